// Ranks as threads that outlive a call: n threads of this process, each a rank of one thread communicator
// (thread_comm.h), which run a setup once and then every job the pool is given, until the pool is destroyed. For
// per-rank state that is costly to build and belongs to its thread: a GPU rank's model and NCCL groups
// (`train --device cuda --tp/--ep`, whose ranks compute every micro-batch of the run).
#pragma once
#include <functional>
#include <memory>
#include <thread>

#include "dist/comm.h"

namespace nextlm::dist {

class RankPool {
 public:
  using Fn = std::function<void(Comm& world)>;
  // Starts n ranks and runs setup on each; returns when every rank is done with it. An error of any rank's setup is
  // rethrown (the first by rank) after the pool stopped: every rank has run teardown, which must therefore cope
  // with a setup that did not finish. teardown runs on each rank's thread when the pool stops.
  RankPool(int n, const Fn& setup, Fn teardown = nullptr);
  ~RankPool();  // stops the ranks (teardown on each) and joins them
  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  // Runs job on every rank (one caller at a time); returns when all are done and rethrows the first error, by rank,
  // that any threw. As with run_ranks, a rank that throws while the others wait in a collective would hang them,
  // so a job must fail on every rank alike.
  void run(const Fn& job);
  int size() const { return n_; }

 private:
  struct State;
  void stop();
  int n_;
  std::unique_ptr<State> s_;
  std::thread driver_;  // runs run_ranks(n, ...), whose threads are the ranks
};

}  // namespace nextlm::dist
