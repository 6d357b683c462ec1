// Hugging Face tokenizer.json in C++: byte-level BPE as GLM-4 / GLM-5 use it, bit-exact with HF `tokenizers` 0.23
// (checked against the goldens that tests/golden/make_tokenizer_goldens.py makes). The pipeline is HF's:
//   1. added tokens (special or not) are cut out of the raw text first: leftmost-longest, with their
//      single_word / lstrip / rstrip flags; their ids are final;
//   2. each remaining span goes through the pre-tokenizers: Split (a regex run by a small backtracking matcher with
//      Oniguruma's semantics, or a literal string; any split behaviour, invert) and ByteLevel (the GPT-2
//      byte-to-unicode map, optional prefix space, optional GPT-2 regex), alone or in a Sequence;
//   3. each piece is merged by the BPE model exactly as HF's Word::merge_all does (lowest merge rank first, the
//      leftmost on ties), with ignore_merges, unk_token and byte_fallback;
// and decode maps each token back to its bytes (ByteLevel decoder; a token with a character outside the byte map
// stays as its own UTF-8) and replaces ill-formed UTF-8 as Rust's String::from_utf8_lossy does.
//
// Unicode general categories (\p{L}, \p{N}, ... and \s) come from ICU (Debian's libicu-dev, ICU 72 = Unicode 15.0).
// HF's regex engine (Oniguruma 6.9.x) may be one Unicode version apart: only characters assigned in between differ.
// Not supported (load fails with a one-line error naming the field): normalizers, dropout, subword prefix/suffix,
// pre-tokenizers and decoders other than the above.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace nextlm {

class Tokenizer {
 public:
  // Reads a tokenizer.json; throws Error (one line naming the file and the problem) when it is malformed or uses
  // something this implementation does not support.
  static Tokenizer load(const std::string& path);
  // The same from JSON text; `what` names it in error messages.
  static Tokenizer parse(const std::string& json_text, const std::string& what);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (valid UTF-8, else Error), as HF's Tokenizer.encode(text).ids: added and special tokens in
  // the text become their ids; no post-processor template is applied (GLM's chat template writes [gMASK]<sop>).
  std::vector<int32_t> encode(std::string_view text) const;
  // The pre-tokenized pieces of `text` (byte-level mapped), as HF's pre_tokenizer.pre_tokenize_str: for tests.
  std::vector<std::string> pre_tokenize(std::string_view text) const;
  // Text of `ids`, as HF's Tokenizer.decode(ids, skip_special_tokens): ids outside the vocabulary are dropped,
  // ill-formed UTF-8 becomes U+FFFD.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;
  // The bytes one token decodes to (possibly a partial UTF-8 sequence); empty for an unknown id.
  std::string token_bytes(int32_t id) const;

  // One more than the largest id (model vocabulary and added tokens).
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  bool is_special(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Rust's String::from_utf8_lossy: each maximal ill-formed subpart becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

}  // namespace nextlm
