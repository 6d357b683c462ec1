// Continuous batching for `nextlm serve`: one scheduler thread owns the model and advances every active request by
// one token per step (prefill for a newcomer), each request with its own DecodeState and Sampler, so a request's
// tokens never depend on which others share its steps: they are exactly what generate() (model/decode.h) returns.
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

#include "model/decode.h"
#include "model/model.h"
#include "model/sampling.h"

namespace nextlm::serve {

// What to generate: already validated by the HTTP layer.
struct JobRequest {
  std::vector<int32_t> prompt;            // non-empty, ids in the vocabulary
  int64_t max_tokens = 16;                // new tokens at most (0: finish at once, as generate())
  SamplingOptions sampling;
  std::vector<int32_t> stop_tokens;       // end after producing one (it is part of the output, as generate())
  std::vector<std::string> stop_strings;  // byte-level models: end when the output bytes end with one (cut off)
  bool byte_level = false;                // tokens are bytes (vocab_size 256)
};

// One request's progress, shared by the scheduler (producer) and an HTTP worker (consumer).
class Job {
 public:
  explicit Job(JobRequest request) : request(std::move(request)) {}
  const JobRequest request;

  // Scheduler side. append() adds a sampled token and decides whether the job is finished (stop token, stop
  // string, max_tokens); it returns true when it is.
  bool append(Sample s);
  void finish(const std::string& reason);  // "stop", "length", or "error" (then `message` says why)
  void fail(const std::string& message);

  // Consumer side.
  void cancel();  // the client went away: the scheduler drops the job at its next step
  bool cancelled() const { return cancelled_.load(); }

  // A consistent copy of the progress so far.
  struct Snapshot {
    std::vector<Sample> samples;  // every sampled token
    bool finished = false;
    std::string finish_reason;    // once finished: "stop", "length" or "error"
    std::string error;
    // Tokens that may be shown: all of them once finished (less those cut by a stop string); while running, those
    // that cannot turn out to be the start of a stop string.
    size_t shown = 0;
  };
  Snapshot snapshot() const;
  // Waits until more than `seen` tokens exist or the job is finished (or `timeout_ms` passes).
  void wait(size_t seen, int timeout_ms) const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<Sample> samples_;
  std::string bytes_;  // byte-level: the output so far, to match stop strings
  size_t kept_ = 0;    // tokens kept once finished
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

class Scheduler {
 public:
  // threads: CPU threads for the model (0: all), set on the scheduler's own thread (OpenMP's count is per thread).
  Scheduler(const Model& model, int64_t max_batch, int threads);
  ~Scheduler();  // finishes every submitted job, then stops
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void submit(std::shared_ptr<Job> job);
  int64_t active() const;
  int64_t queued() const;

 private:
  struct Running;  // a job with its decode state and sampler
  void run();
  void step(Running& r);

  const Model& model_;
  const int64_t max_batch_;
  const int threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  int64_t active_count_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace nextlm::serve
