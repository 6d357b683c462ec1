// Ranks as threads that outlive a call (see rank_pool.h).
#include "dist/rank_pool.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "dist/thread_comm.h"

namespace nextlm::dist {

struct RankPool::State {
  std::mutex mu;
  std::condition_variable wake, done_cv;
  const Fn* job = nullptr;    // the job of generation `generation` (the setup is generation 0)
  unsigned long generation = 0;
  int done = 0;               // ranks done with the current generation
  bool stopping = false;
  std::vector<std::exception_ptr> errors;  // of the current generation, by rank
  Fn teardown;

  void finish(int rank, std::exception_ptr e, int n) {
    std::lock_guard<std::mutex> lk(mu);
    errors[static_cast<size_t>(rank)] = e;
    if (++done == n) done_cv.notify_all();
  }
  // Waits until every rank finished the current generation, then rethrows its first error.
  void wait_all(int n) {
    std::unique_lock<std::mutex> lk(mu);
    done_cv.wait(lk, [&] { return done == n; });
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
  }
};

RankPool::RankPool(int n, const Fn& setup, Fn teardown) : n_(n), s_(std::make_unique<State>()) {
  check(n >= 1, "a rank pool needs at least one rank");
  State& s = *s_;
  s.errors.resize(static_cast<size_t>(n));
  s.teardown = std::move(teardown);
  s.job = &setup;
  driver_ = std::thread([&s, n] {
    run_ranks(n, [&s, n](Comm& world) {
      unsigned long seen = 0;
      const Fn* job = s.job;
      for (;;) {
        std::exception_ptr error;
        try {
          (*job)(world);
        } catch (...) {
          error = std::current_exception();
        }
        s.finish(world.rank(), error, n);
        std::unique_lock<std::mutex> lk(s.mu);
        s.wake.wait(lk, [&] { return s.stopping || s.generation != seen; });
        if (s.stopping) break;
        seen = s.generation;
        job = s.job;
      }
      if (s.teardown) {
        try {
          s.teardown(world);
        } catch (...) {  // a destructor's path: nothing to report to
        }
      }
    });
  });
  try {
    s.wait_all(n);
  } catch (...) {
    stop();
    throw;
  }
}

RankPool::~RankPool() { stop(); }

void RankPool::stop() {
  if (!driver_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->stopping = true;
  }
  s_->wake.notify_all();
  driver_.join();
}

void RankPool::run(const Fn& job) {
  State& s = *s_;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    check(!s.stopping, "the rank pool has stopped");
    s.job = &job;
    s.done = 0;
    std::fill(s.errors.begin(), s.errors.end(), nullptr);
    ++s.generation;
  }
  s.wake.notify_all();
  s.wait_all(n_);
}

}  // namespace nextlm::dist
