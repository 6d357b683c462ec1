// Tokenizer (src/io/tokenizer.h) and GLM chat format (src/io/chat_template.h) tests.
// TokenizerHand.*: encodings derived by hand on tests/golden/tokenizer/hand/tokenizer.json (256 byte tokens with id =
//   byte value, 8 merges, 3 special tokens), the regex matcher's features, decode, round trips, malformed files.
// TokenizerCli.*, TokenizerServe.*: `nextlm generate` and `nextlm serve` on a model directory with a tokenizer.json
//   (text prompts, chat, decoded output, stop strings across and inside tokens).
// TokenizerGolden.*, TokenizerGoldenFiles.*: bit-exact agreement with HF `tokenizers` / transformers on the goldens
//   that tests/golden/make_tokenizer_goldens.py writes to tests/golden/tokenizer/ (per variant: pre-tokenized pieces,
//   ids, decode with and without special tokens, decode of random ids, chat rendering; regex.json: Split
//   pre-tokenizers against Oniguruma). They FAIL when those files are missing.
#include <signal.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/chat_template.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "serve/scheduler.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const std::string kDir = std::string(NEXTLM_TEST_DATA) + "/golden/tokenizer";

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

const Tokenizer& hand() {
  static const Tokenizer t = Tokenizer::load(kDir + "/hand/tokenizer.json");
  return t;
}

std::vector<int32_t> bytes_of(const std::string& s) {
  std::vector<int32_t> v;
  for (unsigned char c : s) v.push_back(c);
  return v;
}

// ------------------------------------------------------------------------------------------------ hand-derived

TEST(TokenizerHand, MergesByRank) {
  // h e l l o: (h,e) rank 0, then (l,l) rank 1, then (he,ll) rank 2, then (hell,o) rank 3 → "hello" (259).
  EXPECT_EQ(hand().encode("hello"), (std::vector<int32_t>{259}));
  // " world" is one piece "Ġworld": (Ġ,w) rank 4, (o,r) rank 5, (Ġw,or) rank 6, (Ġwor,l) rank 7, then d alone.
  EXPECT_EQ(hand().encode("hello world"), (std::vector<int32_t>{259, 263, 'd'}));
  // No merge applies inside "help" after "he": h e l p → (h,e) → he, l, p.
  EXPECT_EQ(hand().encode("help"), (std::vector<int32_t>{256, 'l', 'p'}));
  // Merges never cross pieces: "hel lo" is "hel" + " lo".
  EXPECT_EQ(hand().encode("hel lo"), (std::vector<int32_t>{256, 'l', ' ', 'l', 'o'}));
}

TEST(TokenizerHand, PreTokenizerPieces) {
  using V = std::vector<std::string>;
  // Contractions are their own pieces (case-insensitive), letters take one leading non-letter.
  EXPECT_EQ(hand().pre_tokenize("it's"), (V{"it", "'s"}));
  EXPECT_EQ(hand().pre_tokenize("IT'S"), (V{"IT", "'S"}));
  EXPECT_EQ(hand().pre_tokenize("we'Ll"), (V{"we", "'Ll"}));
  // \s+(?!\S) backtracks so that the last space joins the word.
  EXPECT_EQ(hand().pre_tokenize("  x"), (V{"Ġ", "Ġx"}));
  EXPECT_EQ(hand().pre_tokenize("a   b"), (V{"a", "ĠĠ", "Ġb"}));
  // Trailing spaces: \s+(?!\S) takes them all at the end of the text.
  EXPECT_EQ(hand().pre_tokenize("a  "), (V{"a", "ĠĠ"}));
  // Numbers in runs of at most three digits.
  EXPECT_EQ(hand().pre_tokenize("12345"), (V{"123", "45"}));
  // Newlines: \s*[\r\n]+ (the byte map writes \n as Ċ, \r as č).
  EXPECT_EQ(hand().pre_tokenize("a\n\nb"), (V{"a", "ĊĊ", "b"}));
  EXPECT_EQ(hand().pre_tokenize("a \r\nb"), (V{"a", "ĠčĊ", "b"}));
  // Punctuation with one optional space, then newlines.
  EXPECT_EQ(hand().pre_tokenize("x ...\n"), (V{"x", "Ġ...Ċ"}));
  // Non-ASCII letters are \p{L}: "é" (C3 A9) is one piece of two byte characters.
  EXPECT_EQ(hand().pre_tokenize("café"), (V{"cafÃ©"}));
}

TEST(TokenizerHand, BytesAndSpecialTokens) {
  EXPECT_EQ(hand().encode("é"), (std::vector<int32_t>{0xC3, 0xA9}));
  EXPECT_EQ(hand().encode("  x"), (std::vector<int32_t>{' ', ' ', 'x'}));
  EXPECT_EQ(hand().encode("it's"), bytes_of("it's"));
  // Special tokens are matched before pre-tokenization, anywhere in the text.
  EXPECT_EQ(hand().encode("[gMASK]<sop><|user|>hello"), (std::vector<int32_t>{265, 266, 264, 259}));
  EXPECT_EQ(hand().encode("x<|user|>y"), (std::vector<int32_t>{'x', 264, 'y'}));
  // A near miss is plain text.
  EXPECT_EQ(hand().encode("<|user|"), bytes_of("<|user|"));
  EXPECT_EQ(hand().encode(""), std::vector<int32_t>{});
  EXPECT_EQ(hand().vocab_size(), 267);
  EXPECT_EQ(hand().token_to_id("hello"), 259);
  EXPECT_EQ(hand().token_to_id("<sop>"), 266);
  EXPECT_TRUE(hand().is_special(264));
  EXPECT_FALSE(hand().is_special(259));
}

TEST(TokenizerHand, Decode) {
  EXPECT_EQ(hand().decode({259, 263, 'd'}), "hello world");
  EXPECT_EQ(hand().decode({264, 259}), "<|user|>hello");
  EXPECT_EQ(hand().decode({264, 259}, true), "hello");
  EXPECT_EQ(hand().decode({0xC3, 0xA9}), "é");
  EXPECT_EQ(hand().token_bytes(0xC3), "\xC3");
  // Ill-formed UTF-8: one U+FFFD per maximal subpart (Rust's from_utf8_lossy); unknown ids are dropped.
  EXPECT_EQ(hand().decode({0xC3}), "\xEF\xBF\xBD");
  EXPECT_EQ(hand().decode({0xE4, 0xBD, 'a'}), "\xEF\xBF\xBD" "a");   // truncated 3-byte sequence: one U+FFFD
  EXPECT_EQ(hand().decode({0xFF, 0xC0, 'b'}), "\xEF\xBF\xBD\xEF\xBF\xBD" "b");
  EXPECT_EQ(hand().decode({0xED, 0xA0, 0x80}), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
  EXPECT_EQ(hand().decode({'a', 99999, 'b'}), "ab");
  // Encode then decode gives the text back.
  for (const std::string s : {"hello world", "  tabs\tand\nnewlines\r\n", "日本語 😀 café", "<|user|>x[gMASK]"})
    EXPECT_EQ(hand().decode(hand().encode(s)), s);
}

// Byte-level BPE loses nothing: decode(encode(s)) == s for any valid UTF-8, here random code points from every plane
// mixed with spaces, newlines, apostrophes and the special tokens.
TEST(TokenizerHand, RandomTextRoundTrips) {
  std::mt19937 rng(1);
  const std::vector<std::string> extras = {" ", "\n", "\r\n", "\t", "'s", "'S", "<|user|>", "[gMASK]", "12345"};
  for (int it = 0; it < 2000; ++it) {
    std::string s;
    const int len = static_cast<int>(rng() % 24);
    for (int i = 0; i < len; ++i) {
      if (rng() % 4 == 0) {
        s += extras[rng() % extras.size()];
        continue;
      }
      const uint32_t limit[] = {0x80, 0x800, 0x10000, 0x110000};
      uint32_t c = static_cast<uint32_t>(rng() % limit[rng() % 4]);
      if (c >= 0xD800 && c <= 0xDFFF) c = 'x';  // surrogates are not text
      if (c < 0x80) {
        s += static_cast<char>(c);
      } else if (c < 0x800) {
        s += {static_cast<char>(0xC0 | (c >> 6)), static_cast<char>(0x80 | (c & 63))};
      } else if (c < 0x10000) {
        s += {static_cast<char>(0xE0 | (c >> 12)), static_cast<char>(0x80 | ((c >> 6) & 63)),
              static_cast<char>(0x80 | (c & 63))};
      } else {
        s += {static_cast<char>(0xF0 | (c >> 18)), static_cast<char>(0x80 | ((c >> 12) & 63)),
              static_cast<char>(0x80 | ((c >> 6) & 63)), static_cast<char>(0x80 | (c & 63))};
      }
    }
    ASSERT_EQ(hand().decode(hand().encode(s)), s) << json(s).dump();
  }
}

TEST(TokenizerHand, InvalidUtf8InputIsAnError) {
  try {
    hand().encode("ab\xC3");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
  }
}

// A tokenizer.json with the hand file's model and another pre-tokenizer, to test the regex matcher.
Tokenizer with_pre_tokenizer(const json& pre) {
  json j = json::parse(read(kDir + "/hand/tokenizer.json"));
  j["pre_tokenizer"] = pre;
  return Tokenizer::parse(j.dump(), "test tokenizer");
}

json split(const std::string& regex, const std::string& behavior = "Isolated", bool invert = false) {
  return {{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", behavior}, {"invert", invert}};
}

TEST(TokenizerHand, RegexFeatures) {
  using V = std::vector<std::string>;
  // Lazy, possessive and bounded repeats; alternation order (first alternative that leads to a match wins).
  EXPECT_EQ(with_pre_tokenizer(split("a+?")).pre_tokenize("aaa"), (V{"a", "a", "a"}));
  EXPECT_EQ(with_pre_tokenizer(split("a{2}")).pre_tokenize("aaaaa"), (V{"aa", "aa", "a"}));
  EXPECT_EQ(with_pre_tokenizer(split("a|ab")).pre_tokenize("ab"), (V{"a", "b"}));
  EXPECT_EQ(with_pre_tokenizer(split("ab|a")).pre_tokenize("ab"), (V{"ab"}));
  EXPECT_EQ(with_pre_tokenizer(split("a++a")).pre_tokenize("aaa"), (V{"aaa"}));  // possessive: no match
  EXPECT_EQ(with_pre_tokenizer(split("(?:ab)+c")).pre_tokenize("xababcx"), (V{"x", "ababc", "x"}));
  EXPECT_EQ(with_pre_tokenizer(split("[a-c]+(?=d)")).pre_tokenize("abcdabc"), (V{"abc", "dabc"}));
  EXPECT_EQ(with_pre_tokenizer(split(R"(\p{Lu}\p{Ll}*)")).pre_tokenize("HelloWorld"), (V{"Hello", "World"}));
  EXPECT_EQ(with_pre_tokenizer(split(R"(\d+)")).pre_tokenize("a12b"), (V{"a", "12", "b"}));
  EXPECT_EQ(with_pre_tokenizer(split(R"(\h+)")).pre_tokenize("xx0aFz"), (V{"xx", "0aF", "z"}));  // Oniguruma: hex
  EXPECT_EQ(with_pre_tokenizer(split("^a|b$")).pre_tokenize("ab\nab"), (V{"a", "b", "\n", "a", "b"}));  // line anchors
  EXPECT_EQ(with_pre_tokenizer(split(R"(\Aa|b\z)")).pre_tokenize("ab\nab"), (V{"a", "b\na", "b"}));
  // Split behaviours on "a-b-" with the pattern "-".
  EXPECT_EQ(with_pre_tokenizer(split("-", "Removed")).pre_tokenize("a-b-"), (V{"a", "b"}));
  EXPECT_EQ(with_pre_tokenizer(split("-", "MergedWithPrevious")).pre_tokenize("a-b-"), (V{"a-", "b-"}));
  EXPECT_EQ(with_pre_tokenizer(split("-", "MergedWithNext")).pre_tokenize("a-b-"), (V{"a", "-b", "-"}));
  EXPECT_EQ(with_pre_tokenizer(split("-", "Contiguous")).pre_tokenize("a--b"), (V{"a", "--", "b"}));
  EXPECT_EQ(with_pre_tokenizer(split("-", "Removed", true)).pre_tokenize("a-b-"), (V{"-", "-"}));
  // ByteLevel with its own GPT-2 regex and a prefix space.
  const json bl = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  EXPECT_EQ(with_pre_tokenizer(bl).pre_tokenize("Hi  there"), (V{"ĠHi", "Ġ", "Ġthere"}));
}

void expect_load_error(const std::string& text, const std::string& mention) {
  try {
    Tokenizer::parse(text, "bad/tokenizer.json");
    ADD_FAILURE() << "no error for " << text.substr(0, 200);
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(mention), std::string::npos) << m;
    EXPECT_NE(m.find("bad/tokenizer.json"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << "not one line: " << m;
  }
}

TEST(TokenizerHand, MalformedFilesGiveOneLineErrors) {
  const json good = json::parse(read(kDir + "/hand/tokenizer.json"));
  expect_load_error("{not json", "not valid JSON");
  expect_load_error("[]", "must be an object");
  json j = good;
  j.erase("model");
  expect_load_error(j.dump(), "model is missing");
  j = good;
  j["model"]["merges"].push_back("h zz");
  expect_load_error(j.dump(), "\"zz\" is not in the vocabulary");
  j = good;
  j["model"]["merges"].push_back("hello");
  expect_load_error(j.dump(), "merges[8]");
  j = good;
  j["model"]["vocab"]["x"] = "one";
  expect_load_error(j.dump(), "vocab[\"x\"]");
  j = good;
  j["normalizer"] = {{"type", "NFC"}};
  expect_load_error(j.dump(), "normalizer \"NFC\" is not supported");
  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(?<=a)b";
  expect_load_error(j.dump(), "regex");
  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{Foo}";
  expect_load_error(j.dump(), "unknown property");
  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  expect_load_error(j.dump(), "behavior");
  j = good;
  j["decoder"] = {{"type", "WordPiece"}};
  expect_load_error(j.dump(), "decoder type \"WordPiece\"");
  j = good;
  j["added_tokens"][0].erase("content");
  expect_load_error(j.dump(), "added_tokens[0].content is missing");
  try {
    Tokenizer::load(kDir + "/no_such/tokenizer.json");
    ADD_FAILURE() << "no error for a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplateHand, Rendering) {
  EXPECT_EQ(render_glm_chat({{"system", "Be brief."}, {"user", "Hi"}}),
            "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>");
  EXPECT_EQ(render_glm_chat({{"user", "a"}, {"assistant", "  b  "}, {"user", "c"}}, {false, std::nullopt}),
            "[gMASK]<sop><|user|>\na<|assistant|>\n<think></think>\nb<|user|>\nc");
  EXPECT_EQ(render_glm_chat({{"user", "q"}, {"assistant", "<think>\nr \n</think>\n\nans"}}, {false, std::nullopt}),
            "[gMASK]<sop><|user|>\nq<|assistant|>\n<think>r</think>\nans");
  EXPECT_EQ(render_glm_chat({{"user", "q"}}, {true, false}),
            "[gMASK]<sop><|user|>\nq/nothink<|assistant|>\n<think></think>");
  EXPECT_THROW(render_glm_chat({{"wizard", "x"}}), Error);
}

// ------------------------------------------------------------------------------------------------ nextlm generate

// A golden model widened to a 300-token vocabulary (extra embedding and lm_head rows), with the hand tokenizer.json
// (ids < 267) beside it.
std::string make_model_with_tokenizer(const TempDir& tmp) {
  write_wide_vocab_model(tmp.str());
  std::ofstream(tmp.str("tokenizer.json")) << read(kDir + "/hand/tokenizer.json");
  return tmp.str();
}

std::string ids_arg(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

TEST(TokenizerCli, GenerateEncodesPromptAndDecodesOutput) {
  TempDir tmp;
  const std::string model = make_model_with_tokenizer(tmp);
  const std::string common = " --max-new-tokens 5 --temperature 0 --threads 1 --format json";
  const CliResult text = run_nextlm("generate --model " + shell_quote(model) + " --prompt 'hello world'" + common);
  ASSERT_EQ(text.rc, 0) << text.err;
  const CliResult ids = run_nextlm("generate --model " + shell_quote(model) + " --prompt-tokens 259,263,100" + common);
  ASSERT_EQ(ids.rc, 0) << ids.err;
  const json a = json::parse(text.out), b = json::parse(ids.out);
  EXPECT_EQ(a.at("tokens"), b.at("tokens"));  // --prompt 'hello world' is the ids 259,263,100
  const auto tokens = a.at("tokens").get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 5u);
  EXPECT_EQ(a.at("text").get<std::string>(), hand().decode(tokens));
  // Text format prints the decoded text.
  const CliResult plain = run_nextlm("generate --model " + shell_quote(model) +
                                     " --prompt 'hello world' --max-new-tokens 5 --temperature 0 --threads 1");
  ASSERT_EQ(plain.rc, 0) << plain.err;
  EXPECT_EQ(plain.out, hand().decode(tokens) + "\n");
  // --chat renders one user message in GLM's format, then encodes it.
  const std::vector<int32_t> chat = hand().encode(render_glm_chat({{"user", "hi"}}));
  const CliResult c1 = run_nextlm("generate --model " + shell_quote(model) + " --chat --prompt hi" + common);
  const CliResult c2 =
      run_nextlm("generate --model " + shell_quote(model) + " --prompt-tokens " + ids_arg(chat) + common);
  ASSERT_EQ(c1.rc, 0) << c1.err;
  ASSERT_EQ(c2.rc, 0) << c2.err;
  EXPECT_EQ(json::parse(c1.out).at("tokens"), json::parse(c2.out).at("tokens"));
  EXPECT_NE(c1.err.find("after a " + std::to_string(chat.size()) + "-token prompt"), std::string::npos) << c1.err;
}

TEST(TokenizerCli, MalformedTokenizerJsonIsAOneLineError) {
  TempDir tmp;
  const std::string model = make_model_with_tokenizer(tmp);
  std::ofstream(tmp.str("tokenizer.json")) << R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})";
  const CliResult r = run_nextlm("generate --model " + shell_quote(model) + " --prompt hi --max-new-tokens 1");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_EQ(r.err.rfind("error:", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("tokenizer.json"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\"b\" is not in the vocabulary"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(TokenizerCli, ChatNeedsATokenizer) {
  // The bundled byte-level example has no tokenizer.json: --prompt stays bytes, --chat is refused.
  const std::string tiny = std::string(NEXTLM_SOURCE_DIR) + "/examples/tiny-glm5-next";
  const CliResult r = run_nextlm("generate --model " + shell_quote(tiny) + " --chat --prompt hi --max-new-tokens 1");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("--chat needs the model's tokenizer.json"), std::string::npos) << r.err;
}

// `nextlm serve --port 0` on `model` as a child process.
class Server : public ServeProcess {
 public:
  explicit Server(const std::string& model) : ServeProcess(NEXTLM_BINARY, {"--model", model, "--threads", "1"}) {}
};

// `nextlm serve` on the model with a tokenizer: text prompts and chat are encoded as `generate` encodes them, and
// the answers' text is the decoded tokens (streamed chunks add up to it).
TEST(TokenizerServe, TextPromptsChatAndOutputUseTheTokenizer) {
  TempDir tmp;
  const std::string model = make_model_with_tokenizer(tmp);
  Server server(model);
  httplib::Client cli("127.0.0.1", server.port());
  cli.set_read_timeout(60);
  auto post = [&](const char* path, const json& body) {
    auto res = cli.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(res);
    return res ? res->body : std::string();
  };
  auto generated = [&](const std::string& args) {
    const CliResult r = run_nextlm("generate --model " + shell_quote(model) + " --max-new-tokens 6 --temperature 0 " +
                                   "--threads 1 --format json " + args);
    EXPECT_EQ(r.rc, 0) << r.err;
    return json::parse(r.out).at("tokens").get<std::vector<int32_t>>();
  };
  auto text_of = [&](const std::vector<int32_t>& ids) {
    std::string b;
    for (int32_t id : ids) b += hand().token_bytes(id);
    return serve::utf8_text(b, true);
  };

  const json c =
      json::parse(post("/v1/completions", {{"prompt", "hello world"}, {"max_tokens", 6}, {"temperature", 0}}));
  const auto tokens = c.at("choices")[0].at("tokens").get<std::vector<int32_t>>();
  EXPECT_EQ(tokens, generated("--prompt 'hello world'"));
  EXPECT_EQ(c.at("usage").at("prompt_tokens"), 3);
  EXPECT_EQ(c.at("choices")[0].at("text").get<std::string>(), text_of(tokens));

  const json messages =
      json::array({{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "hi"}}});
  const json chat = json::parse(post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 6},
                                                              {"temperature", 0}, {"logprobs", true}}));
  const auto chat_tokens = chat.at("choices")[0].at("tokens").get<std::vector<int32_t>>();
  const std::vector<int32_t> prompt = hand().encode(render_glm_chat({{"system", "Be brief."}, {"user", "hi"}}));
  EXPECT_EQ(chat.at("usage").at("prompt_tokens"), prompt.size());
  EXPECT_EQ(chat_tokens, generated("--prompt-tokens " + ids_arg(prompt)));
  const std::string content = chat.at("choices")[0].at("message").at("content").get<std::string>();
  EXPECT_EQ(content, text_of(chat_tokens));
  const json& lp = chat.at("choices")[0].at("logprobs").at("content");
  ASSERT_EQ(lp.size(), chat_tokens.size());
  for (size_t i = 0; i < lp.size(); ++i) {
    std::string b;
    for (const json& x : lp[i].at("bytes")) b.push_back(static_cast<char>(x.get<int>()));
    EXPECT_EQ(b, hand().token_bytes(chat_tokens[i]));
  }

  // Streamed: the deltas add up to the whole message, the chunks' ids to its tokens.
  const std::string sse = post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 6}, {"temperature", 0},
                                                        {"stream", true}});
  std::string streamed;
  std::vector<int32_t> streamed_ids;
  std::istringstream in(sse);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("data: {", 0) != 0) continue;
    const json chunk = json::parse(l.substr(6));
    const json& ch = chunk.at("choices")[0];
    if (ch.at("delta").contains("content")) streamed += ch.at("delta").at("content").get<std::string>();
    if (ch.contains("tokens"))
      for (const json& t : ch.at("tokens")) streamed_ids.push_back(t.get<int32_t>());
  }
  EXPECT_EQ(streamed, content);
  EXPECT_EQ(streamed_ids, chat_tokens);
}

// Where a candidate stop string's first occurrence lies in a generated output: tokens `ids` with byte ends `ends`.
struct Occurrence {
  size_t at = std::string::npos;  // first byte in the output
  size_t first = 0, last = 0;     // tokens holding its first and last byte
};
Occurrence locate(const std::string& bytes, const std::vector<size_t>& ends, const std::string& stop) {
  Occurrence o;
  o.at = bytes.find(stop);
  if (o.at == std::string::npos) return o;
  while (ends[o.first] <= o.at) ++o.first;
  o.last = o.first;
  while (ends[o.last] < o.at + stop.size()) ++o.last;
  return o;
}

// Stop strings on a model with a byte-level BPE tokenizer, taken from an unconstrained sampled run of the same
// request so that they surely occur: one that spans two tokens and one that starts inside a multi-byte token. The
// text ends before the first occurrence, the tokens (and logprobs) are those with a byte before it (the one it
// starts inside stays), usage counts every token up to the one that completed it, and a stream never shows text
// that is not a prefix of the final text.
TEST(TokenizerServe, StopStringsCutTextAndTokens) {
  TempDir tmp;
  const std::string model = make_model_with_tokenizer(tmp);
  Server server(model);
  httplib::Client cli("127.0.0.1", server.port());
  cli.set_read_timeout(60);
  auto complete = [&](const json& body) {
    auto res = cli.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res && res->status == 200) << (res ? res->body : std::string("no response"));
    return res && res->status == 200 ? json::parse(res->body) : json::object();
  };
  const std::string never = "\x01\x02 never";

  // The first seed whose output has both kinds of stop string, made of ASCII bytes (valid UTF-8, as JSON needs).
  json req;
  std::vector<int32_t> ids;
  std::string bytes;
  std::vector<size_t> ends;
  std::string across, inside;
  int seed = 0;
  while (++seed <= 40 && (across.empty() || inside.empty())) {
    req = {{"prompt", "hello world"}, {"max_tokens", 60}, {"temperature", 1.0}, {"seed", seed}, {"logprobs", 0}};
    ids = complete(req).at("choices")[0].at("tokens").get<std::vector<int32_t>>();
    bytes.clear(), ends.clear();
    for (int32_t id : ids) ends.push_back((bytes += hand().token_bytes(id)).size());
    across.clear(), inside.clear();
    for (size_t at = 1; at < bytes.size(); ++at) {
      for (size_t len = 1; len <= 4 && at + len <= bytes.size(); ++len) {
        const std::string cand = bytes.substr(at, len);
        if (std::any_of(cand.begin(), cand.end(), [](char c) { return c <= 0; }) || cand == never) break;
        const Occurrence o = locate(bytes, ends, cand);
        if (o.at != at || o.last + 1 >= ids.size()) continue;  // not its first occurrence, or not mid-generation
        const bool starts_inside = (o.first == 0 ? 0 : ends[o.first - 1]) < at;
        if (across.empty() && !starts_inside && o.last > o.first) across = cand;
        if (inside.empty() && starts_inside) inside = cand;
      }
    }
  }
  ASSERT_FALSE(across.empty() || inside.empty()) << "no seed gave both kinds of stop string";
  std::printf("[stop strings] seed %d: across tokens %s, inside a token %s\n", seed - 1, json(across).dump().c_str(),
              json(inside).dump().c_str());
  ASSERT_EQ(bytes.find(never), std::string::npos);

  for (const std::string& stop : {across, inside}) {
    SCOPED_TRACE("stop \"" + stop + "\"");
    const Occurrence o = locate(bytes, ends, stop);
    size_t kept = 0;  // the tokens with a byte before the cut (or none after it)
    while (kept < ids.size() && ((kept == 0 ? 0 : ends[kept - 1]) < o.at || ends[kept] <= o.at)) ++kept;
    EXPECT_EQ(kept, stop == inside ? o.first + 1 : o.first);
    json r = req;
    r["stop"] = {never, stop};
    const json c = complete(r);
    const json& ch = c.at("choices")[0];
    EXPECT_EQ(ch.at("finish_reason"), "stop");
    EXPECT_EQ(ch.at("text").get<std::string>(), serve::utf8_text(bytes.substr(0, o.at), true));
    EXPECT_EQ(ch.at("tokens").get<std::vector<int32_t>>(), std::vector<int32_t>(ids.begin(), ids.begin() + kept));
    EXPECT_EQ(ch.at("logprobs").at("token_logprobs").size(), kept);
    EXPECT_EQ(c.at("usage").at("completion_tokens"), o.last + 1);

    r["stream"] = true;
    auto res = cli.Post("/v1/completions", r.dump(), "application/json");
    ASSERT_TRUE(res && res->status == 200);
    const std::string final_text = ch.at("text").get<std::string>();
    std::string streamed, finish;
    std::vector<int32_t> streamed_ids;
    std::istringstream in(res->body);
    for (std::string l; std::getline(in, l);) {
      if (l.rfind("data: {", 0) != 0) continue;
      const json event = json::parse(l.substr(6));
      const json& chunk = event.at("choices")[0];
      streamed += chunk.at("text").get<std::string>();
      EXPECT_EQ(final_text.compare(0, streamed.size(), streamed), 0) << "the stream showed \"" << streamed << "\"";
      for (const json& t : chunk.at("tokens")) streamed_ids.push_back(t.get<int32_t>());
      if (!chunk.at("finish_reason").is_null()) finish = chunk.at("finish_reason");
    }
    EXPECT_EQ(streamed, final_text);
    EXPECT_EQ(streamed_ids, ch.at("tokens").get<std::vector<int32_t>>());
    EXPECT_EQ(finish, "stop");
  }

  // A model with neither a tokenizer nor a byte vocabulary has no text: stop strings are refused, token ids are not.
  TempDir bare;
  make_model_with_tokenizer(bare);
  fs::remove(bare.str("tokenizer.json"));
  Server ids_only(bare.str());
  httplib::Client cli2("127.0.0.1", ids_only.port());
  auto refused = cli2.Post("/v1/completions", json{{"prompt", {1, 2}}, {"stop", "x"}}.dump(), "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400);
  EXPECT_EQ(json::parse(refused->body).at("error").at("code"), "tokenizer_unavailable") << refused->body;
  auto ok = cli2.Post("/v1/completions", json{{"prompt", {1, 2}}, {"stop_token_ids", {3}}, {"max_tokens", 2}}.dump(),
                      "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// ------------------------------------------------------------------------------------------------ goldens

// The golden variants; a missing golden directory is a failure, not a skip.
const std::vector<std::string> kVariants = {"hand", "glm", "o200k"};

json load_json(const std::string& path) {
  if (!fs::exists(path)) {
    ADD_FAILURE() << path << " is missing: run python3 tests/golden/make_tokenizer_goldens.py tests/golden/tokenizer "
                  << "where HF tokenizers and transformers are installed";
    return json();
  }
  return json::parse(read(path));
}

class TokenizerGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerGolden, EncodeMatchesHF) {
  const std::string dir = kDir + "/" + GetParam();
  const json cases = load_json(dir + "/cases.json");
  if (cases.is_null()) return;
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  ASSERT_GT(cases.at("encode").size(), 100u);
  size_t bad = 0;
  for (const json& c : cases.at("encode")) {
    const std::string text = c.at("text").get<std::string>();
    const auto pieces = tok.pre_tokenize(text);
    EXPECT_EQ(pieces, c.at("pieces").get<std::vector<std::string>>()) << "pieces of " << json(text).dump();
    const auto ids = tok.encode(text);
    const bool ok = ids == c.at("ids").get<std::vector<int32_t>>();
    EXPECT_TRUE(ok) << "ids of " << json(text).dump() << "\n  got  " << json(ids).dump() << "\n  want "
                    << c.at("ids").dump();
    bad += !ok;
    EXPECT_EQ(tok.decode(ids), c.at("decoded").get<std::string>()) << json(text).dump();
    EXPECT_EQ(tok.decode(ids, true), c.at("decoded_skip_special").get<std::string>()) << json(text).dump();
  }
  EXPECT_EQ(bad, 0u) << "texts encoded differently";
}

TEST_P(TokenizerGolden, DecodeMatchesHF) {
  const std::string dir = kDir + "/" + GetParam();
  const json cases = load_json(dir + "/cases.json");
  if (cases.is_null()) return;
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  ASSERT_FALSE(cases.at("decode").empty());
  for (const json& c : cases.at("decode")) {
    const auto ids = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok.decode(ids), c.at("decoded").get<std::string>()) << c.at("ids").dump();
    EXPECT_EQ(tok.decode(ids, true), c.at("decoded_skip_special").get<std::string>()) << c.at("ids").dump();
  }
}

TEST_P(TokenizerGolden, ChatTemplateMatchesTransformers) {
  const std::string dir = kDir + "/" + GetParam();
  const json chats = load_json(dir + "/chat.json");
  if (chats.is_null()) return;
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  ASSERT_FALSE(chats.empty());
  for (const json& c : chats) {
    std::vector<ChatMessage> messages;
    for (const json& m : c.at("messages")) messages.push_back({m.at("role"), m.at("content")});
    ChatOptions opt;
    opt.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
    if (!c.at("enable_thinking").is_null()) opt.enable_thinking = c.at("enable_thinking").get<bool>();
    const std::string text = render_glm_chat(messages, opt);
    EXPECT_EQ(text, c.at("text").get<std::string>()) << c.at("messages").dump();
    EXPECT_EQ(tok.encode(text), c.at("ids").get<std::vector<int32_t>>()) << c.at("messages").dump();
    EXPECT_EQ(c.at("ids"), c.at("hf_ids"));  // transformers' tokenizer agrees with tokenizers' on the text
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, TokenizerGolden, ::testing::ValuesIn(kVariants),
                         [](const auto& info) { return info.param; });

// Split pre-tokenizers with other patterns and behaviours, against Oniguruma (HF's SysRegex).
TEST(TokenizerGoldenFiles, RegexMatchesOniguruma) {
  const json g = load_json(kDir + "/regex.json");
  if (g.is_null()) return;
  const auto texts = g.at("texts").get<std::vector<std::string>>();
  ASSERT_GT(g.at("splits").size(), 20u);
  static const std::map<std::string, std::string> behaviors = {
      {"isolated", "Isolated"}, {"removed", "Removed"}, {"merged_with_previous", "MergedWithPrevious"},
      {"merged_with_next", "MergedWithNext"}, {"contiguous", "Contiguous"}};
  for (const json& c : g.at("splits")) {
    const std::string pattern = c.at("pattern").get<std::string>();
    const Tokenizer t = with_pre_tokenizer(split(pattern, behaviors.at(c.at("behavior")), c.at("invert")));
    for (size_t i = 0; i < texts.size(); ++i)
      EXPECT_EQ(t.pre_tokenize(texts[i]), c.at("pieces")[i].get<std::vector<std::string>>())
          << "pattern " << json(pattern).dump() << " " << c.at("behavior") << (c.at("invert") ? " inverted" : "")
          << " on " << json(texts[i]).dump();
  }
}

TEST(TokenizerGoldenFiles, VersionsRecorded) {
  const std::string v = read(kDir + "/VERSIONS");
  EXPECT_NE(v.find("tokenizers "), std::string::npos) << kDir << "/VERSIONS is missing or incomplete";
  EXPECT_NE(v.find("transformers "), std::string::npos);
}

}  // namespace
}  // namespace nextlm::test
