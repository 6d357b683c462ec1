// The serve scheduler: a job queue, one thread that advances every running job by one token through a decoder
// backend, and the text helpers that streaming relies on (UTF-8 cut points, stop-string hold-back).
#include "serve/scheduler.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>

#include "core/error.h"

namespace nextlm::serve {

namespace {

bool contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

// The checks' order: an eos token ends the text before it (its bytes are not text, so no stop string is looked for
// in them); then a stop string, which cuts the text even when the token completing it is also a stop token, so that
// a stop string never shows; then a stop token, which stays in the text; then max_tokens.
bool Job::append(Sample s) {
  std::lock_guard<std::mutex> lk(mu_);
  const int32_t token = s.token;
  samples_.push_back(std::move(s));
  const size_t before = bytes_.size();
  if (request.tokenizer) bytes_ += request.tokenizer->token_bytes(token);
  else if (request.byte_level) bytes_.push_back(static_cast<char>(token));
  ends_.push_back(bytes_.size());
  if (contains(request.eos_tokens, token)) {
    finish_locked("stop", samples_.size(), before);
  } else if (const size_t cut = find_stop(bytes_, before, request.stop_strings); cut != std::string::npos) {
    finish_locked("stop", tokens_for_text(ends_, cut), cut);
  } else if (contains(request.stop_tokens, token)) {
    finish_locked("stop", samples_.size(), bytes_.size());
  } else if (static_cast<int64_t>(samples_.size()) >= request.max_tokens) {
    finish_locked("length", samples_.size(), bytes_.size());
  }
  cv_.notify_all();
  return finished_;
}

void Job::finish_locked(const std::string& reason, size_t kept, size_t text) {
  finished_ = true, reason_ = reason, kept_ = kept, text_ = text;
}

void Job::finish(const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  if (finished_) return;
  finish_locked(reason, samples_.size(), bytes_.size());
  cv_.notify_all();
}

void Job::fail(const std::string& message) {
  std::lock_guard<std::mutex> lk(mu_);
  error_ = message;
  finish_locked("error", samples_.size(), bytes_.size());
  cv_.notify_all();
}

void Job::cancel() {
  cancelled_ = true;
  std::lock_guard<std::mutex> lk(mu_);
  cv_.notify_all();
}

Job::Snapshot Job::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  Snapshot s;
  s.samples = samples_;
  s.bytes = bytes_;
  s.ends = ends_;
  s.finished = finished_;
  s.finish_reason = reason_;
  s.error = error_;
  if (finished_) {
    s.text = text_, s.shown = kept_;
  } else {
    s.text = bytes_.size() - stop_holdback(bytes_, request.stop_strings);
    s.shown = tokens_for_text(ends_, s.text);
  }
  return s;
}

void Job::wait(size_t seen, int timeout_ms) const {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms),
               [&] { return finished_ || samples_.size() > seen || cancelled_.load(); });
}

namespace {

// Length of the well-formed UTF-8 sequence starting at bytes[i]: n > 0 when complete, 0 when the byte cannot start
// or continue one (it is replaced), −1 when it is well-formed up to the end of the input but incomplete.
int utf8_sequence(const std::string& bytes, size_t i) {
  const unsigned char b = bytes[i];
  int n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte (Unicode table 3-7)
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) n = 2;
  else if (b == 0xE0) n = 3, lo = 0xA0;
  else if (b >= 0xE1 && b <= 0xEC) n = 3;
  else if (b == 0xED) n = 3, hi = 0x9F;
  else if (b >= 0xEE && b <= 0xEF) n = 3;
  else if (b == 0xF0) n = 4, lo = 0x90;
  else if (b >= 0xF1 && b <= 0xF3) n = 4;
  else if (b == 0xF4) n = 4, hi = 0x8F;
  else return 0;
  for (int j = 1; j < n; ++j) {
    if (i + j >= bytes.size()) return -1;
    const unsigned char c = bytes[i + j];
    if (c < (j == 1 ? lo : 0x80) || c > (j == 1 ? hi : 0xBF)) return 0;
  }
  return n;
}

}  // namespace

std::string utf8_text(const std::string& bytes, bool final, size_t* consumed) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const int n = utf8_sequence(bytes, i);
    if (n < 0 && !final) break;
    if (n > 0) {
      out.append(bytes, i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      i += 1;
    }
  }
  if (consumed) *consumed = i;
  return out;
}

size_t stop_holdback(const std::string& bytes, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const std::string& stop : stops)
    for (size_t k = std::min(stop.size() - 1, bytes.size()); k > best; --k)
      if (bytes.compare(bytes.size() - k, k, stop, 0, k) == 0) {
        best = k;
        break;
      }
  return best;
}

size_t find_stop(const std::string& bytes, size_t from, const std::vector<std::string>& stops) {
  size_t cut = std::string::npos;
  for (const std::string& stop : stops) {
    if (stop.empty()) continue;
    const size_t at = bytes.find(stop, from + 1 > stop.size() ? from + 1 - stop.size() : 0);
    cut = std::min(cut, at);
  }
  return cut;
}

size_t tokens_for_text(const std::vector<size_t>& ends, size_t text) {
  size_t n = 0;
  while (n < ends.size() && ((n == 0 ? 0 : ends[n - 1]) < text || ends[n] <= text)) ++n;
  return n;
}

struct Scheduler::Running {
  Running(std::shared_ptr<Job> j, int64_t slot) : job(std::move(j)), sampler(job->request.sampling), slot(slot) {}
  std::shared_ptr<Job> job;
  Sampler sampler;
  const int64_t slot;   // the job's decoder slot
  bool used = false;    // the slot went to the decoder: it must be cleared when the job leaves
  bool prefilled = false;
  int32_t last = 0;     // the last sampled token, fed to the next decode step
  bool done = false;    // finished or cancelled: leaves the running set after this iteration
};

Scheduler::Scheduler(std::unique_ptr<DecodeBackend> backend) : backend_(std::move(backend)) {
  check(backend_ && backend_->slots() >= 1, "the scheduler needs a decoder with at least one slot");
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Scheduler::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

int64_t Scheduler::active() const {
  std::lock_guard<std::mutex> lk(mu_);
  return active_count_;
}

int64_t Scheduler::queued() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(queue_.size());
}

// The same calls in the same order as generate_with() (model/decode.h), per job: prefill, sample, then (while not
// finished) step, sample. The sampler reads only the job's own logits, so batching changes nothing it sees.
void Scheduler::advance(const std::vector<Running*>& batch, bool prefill) {
  if (batch.empty()) return;
  std::vector<int64_t> slots;
  for (const Running* r : batch) slots.push_back(r->slot);
  std::vector<std::vector<float>> logits;
  try {
    if (prefill) {
      std::vector<std::vector<int32_t>> prompts;
      for (Running* r : batch) {
        prompts.push_back(r->job->request.prompt);
        r->used = true;
      }
      logits = backend_->prefill(slots, prompts);
    } else {
      std::vector<int32_t> tokens;
      for (const Running* r : batch) tokens.push_back(r->last);
      logits = backend_->step(slots, tokens);
    }
    check(logits.size() == batch.size(), "the decoder returned ", logits.size(), " rows of logits for ", batch.size(),
          " sequences");
  } catch (const std::exception& e) {
    for (Running* r : batch) {
      r->job->fail(e.what());
      r->done = true;
    }
    return;
  }
  for (size_t i = 0; i < batch.size(); ++i) sample(*batch[i], logits[i]);
}

void Scheduler::sample(Running& r, const std::vector<float>& logits) {
  try {
    const int64_t V = backend_->vocab_size();
    check(static_cast<int64_t>(logits.size()) == V, "the decoder returned ", logits.size(), " logits, not ", V);
    Sample s = r.sampler.sample(logits.data(), V);
    r.prefilled = true;
    r.last = s.token;
    r.done = r.job->append(std::move(s));
  } catch (const std::exception& e) {
    r.job->fail(e.what());
    r.done = true;
  }
}

void Scheduler::run() {
  backend_->start();
  const int64_t max_len = backend_->max_len();
  std::vector<int64_t> free_slots;  // the lowest last, so that it is taken first
  for (int64_t s = backend_->slots() - 1; s >= 0; --s) free_slots.push_back(s);
  std::vector<std::unique_ptr<Running>> running;
  while (true) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !running.empty(); });
      if (stop_ && queue_.empty() && running.empty()) return;
      // Newcomers take the free slots between iterations; the rest wait in arrival order.
      while (!free_slots.empty() && !queue_.empty()) {
        std::shared_ptr<Job> job = std::move(queue_.front());
        queue_.pop_front();
        const JobRequest& q = job->request;
        const int64_t len = static_cast<int64_t>(q.prompt.size()) + q.max_tokens;
        if (max_len > 0 && len > max_len) {  // the HTTP layer refuses these first
          job->fail("the prompt (" + std::to_string(q.prompt.size()) + " tokens) plus max_tokens (" +
                    std::to_string(q.max_tokens) + ") is more than the decoder's " + std::to_string(max_len) +
                    " tokens per sequence");
          continue;
        }
        try {
          running.push_back(std::make_unique<Running>(job, free_slots.back()));
          free_slots.pop_back();
        } catch (const std::exception& e) {  // bad sampling options (the HTTP layer checks them first)
          job->fail(e.what());
        }
      }
      active_count_ = static_cast<int64_t>(running.size());
    }
    std::vector<Running*> stepping, newcomers;
    for (auto& r : running) {
      if (r->job->cancelled()) {
        r->job->finish("cancelled");
        r->done = true;
      } else if (!r->prefilled && r->job->request.max_tokens == 0) {  // as generate(): no tokens, no prefill
        r->job->finish("length");
        r->done = true;
      } else {
        (r->prefilled ? stepping : newcomers).push_back(r.get());
      }
    }
    // The running jobs first, so that their tokens are not held up behind the newcomers' prefill.
    advance(stepping, false);
    advance(newcomers, true);
    for (auto& r : running) {
      if (!r->done) continue;
      // A slot whose clearing failed is handed out all the same: the decoder refuses to prefill a slot that is not
      // empty, which fails that job with a message rather than leaving the queue waiting for a slot forever.
      if (r->used) {
        try {
          backend_->clear(r->slot);
        } catch (const std::exception& e) {
          std::cerr << "serve: cannot clear decoder slot " << r->slot << ": " << e.what() << "\n" << std::flush;
        }
      }
      free_slots.push_back(r->slot);
    }
    std::erase_if(running, [](const std::unique_ptr<Running>& r) { return r->done; });
    std::sort(free_slots.begin(), free_slots.end(), std::greater<int64_t>());
    std::lock_guard<std::mutex> lk(mu_);
    active_count_ = static_cast<int64_t>(running.size());
  }
}

}  // namespace nextlm::serve
