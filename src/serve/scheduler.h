// Continuous batching for `nextlm serve`: one scheduler thread owns a decoder (serve/backend.h: the CPU decode path
// or a CudaDecoder) and advances every running request by one token per iteration: the newcomers in one prefill
// call, the others in one step call. Each request has its own decoder slot and Sampler, and a slot's logits do not
// depend on the other slots, so a request's tokens are exactly what generate() (model/decode.h) or cuda_generate()
// return for the same options and seed.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/tokenizer.h"
#include "model/sampling.h"
#include "serve/backend.h"

namespace nextlm::serve {

// What to generate: already validated by the HTTP layer.
struct JobRequest {
  std::vector<int32_t> prompt;            // non-empty, ids in the vocabulary
  int64_t max_tokens = 16;                // new tokens at most (0: finish at once, as generate())
  SamplingOptions sampling;
  std::vector<int32_t> stop_tokens;       // end after producing one (it is part of the output, as generate())
  std::vector<int32_t> eos_tokens;        // the model's, unless ignore_eos: end after one (in the tokens, not the text)
  std::vector<std::string> stop_strings;  // end when the output's bytes contain one: the text is cut before it
  const Tokenizer* tokenizer = nullptr;   // a token's bytes: the tokenizer's, else (byte_level) the token itself,
  bool byte_level = false;                // else none (a model without text: no stop strings)
};

// One request's progress, shared by the scheduler (producer) and an HTTP worker (consumer).
class Job {
 public:
  explicit Job(JobRequest request) : request(std::move(request)) {}
  const JobRequest request;

  // Scheduler side. append() adds a sampled token and decides whether the job is finished (eos token, stop string,
  // stop token, max_tokens); it returns true when it is.
  bool append(Sample s);
  void finish(const std::string& reason);  // "stop", "length", or "error" (then `message` says why)
  void fail(const std::string& message);

  // Consumer side.
  void cancel();  // the client went away: the scheduler drops the job at its next step
  bool cancelled() const { return cancelled_.load(); }

  // A consistent copy of the progress so far.
  struct Snapshot {
    std::vector<Sample> samples;  // every sampled token
    std::string bytes;            // the bytes of every sampled token, in order
    std::vector<size_t> ends;     // [samples]: where each token's bytes end in `bytes`
    bool finished = false;
    std::string finish_reason;    // once finished: "stop", "length" or "error"
    std::string error;
    // The first `text` bytes may be shown as text: all of them once finished, less a final eos token's and what a
    // stop string cut off; while running, less the longest suffix that may be the start of a stop string.
    size_t text = 0;
    // The first `shown` tokens may be shown (with their logprobs): tokens_for_text(ends, text).
    size_t shown = 0;
  };
  Snapshot snapshot() const;
  // Waits until more than `seen` tokens exist or the job is finished (or `timeout_ms` passes).
  void wait(size_t seen, int timeout_ms) const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  void finish_locked(const std::string& reason, size_t kept, size_t text);  // mu_ held

  std::vector<Sample> samples_;
  std::string bytes_;         // the output so far, to match stop strings
  std::vector<size_t> ends_;  // [samples_]: the end of each token's bytes in bytes_
  size_t kept_ = 0;           // once finished: tokens kept
  size_t text_ = 0;           // once finished: bytes of text
  bool finished_ = false;
  std::string reason_, error_;
  std::atomic<bool> cancelled_{false};
};

// UTF-8 text of byte-level output. Every byte that is not part of a complete well-formed sequence becomes U+FFFD.
// When `final` is false it stops before a trailing sequence that is well-formed so far but incomplete; *consumed
// is the number of bytes used. Decoding a prefix cut at `consumed` and then the rest gives the same text as
// decoding everything at once, which is what makes streamed chunks add up to the whole text.
std::string utf8_text(const std::string& bytes, bool final, size_t* consumed = nullptr);

// The longest proper prefix of a stop string that `bytes` ends with: bytes a stream must hold back.
size_t stop_holdback(const std::string& bytes, const std::vector<std::string>& stops);

// Where the text is cut once bytes[from, end) were added: the earliest start of a stop string occurrence that ends
// in the added bytes (none ends before them, or generation would have stopped), or std::string::npos. Bytes, not
// decoded text, are matched: a stop string is valid UTF-8, so it matches where the decoded text has it, except that
// a U+FFFD in a stop string matches only a U+FFFD in the output, not an ill-formed byte decoded as one.
size_t find_stop(const std::string& bytes, size_t from, const std::vector<std::string>& stops);

// The tokens that go with the first `text` bytes of the output, ends[i] being where token i's bytes end: the longest
// run of tokens from the start each of which puts a byte before `text` or has no byte after it. A token that
// straddles the cut (a stop string starting inside it) is kept with its logprob, though its bytes from the cut on
// are not in the text; the tokens after the cut are dropped from the answer's tokens and logprobs, though
// usage.completion_tokens still counts them (they were generated, as OpenAI and vLLM count the token that completed
// the stop string). So every byte of the text belongs to a returned token and every returned token but empty ones
// shows at least one byte. While running, with `text` less the hold-back, these tokens are final: a stop string
// found later starts at or after `text`.
size_t tokens_for_text(const std::vector<size_t>& ends, size_t text);

// Each iteration: jobs from the queue take the free slots (arrival order); a cancelled job, or one asking for no
// tokens, finishes without the decoder; the running jobs step in one backend.step call and the newcomers are
// prefilled in one backend.prefill call; each job samples its token from its own logits, and a job that finished
// (or was cancelled, or failed) gives its slot back, cleared, for the next iteration. A job longer than the
// backend's max_len (prompt + max_tokens) fails at once; the HTTP layer refuses it first. A failed backend call
// fails the jobs of that call only.
class Scheduler {
 public:
  explicit Scheduler(std::unique_ptr<DecodeBackend> backend);  // backend->slots() jobs run at once
  ~Scheduler();  // finishes every submitted job, then stops
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void submit(std::shared_ptr<Job> job);
  int64_t active() const;
  int64_t queued() const;

 private:
  struct Running;  // a job with its slot and sampler
  void run();
  // One backend call for `batch` (prefill of its prompts, or a step with each one's last token), then the samples.
  void advance(const std::vector<Running*>& batch, bool prefill);
  void sample(Running& r, const std::vector<float>& logits);

  const std::unique_ptr<DecodeBackend> backend_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  int64_t active_count_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace nextlm::serve
