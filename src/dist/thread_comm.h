// An in-process communicator: N ranks as N threads of one process sharing memory. It lets the tests run the
// tensor/expert-parallel code at several ranks without MPI (in the sanitizer build too), and is a reference for the
// semantics of every collective.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "dist/comm.h"

namespace nextlm::dist {

// The n communicators of one group; comms[r] is to be used by the thread playing rank r only.
std::vector<std::unique_ptr<Comm>> make_thread_comms(int n);

// Runs fn(comm) on n threads, one per rank, and rethrows the first exception any of them threw (after all joined).
// A rank that throws while others wait in a collective would hang them, so fn must fail on every rank alike.
void run_ranks(int n, const std::function<void(Comm&)>& fn);

}  // namespace nextlm::dist
