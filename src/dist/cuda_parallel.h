// Tensor- and expert-parallel device models over NCCL: one GPU per rank, the ranks either processes under mpirun or
// threads of one process (one per GPU of the machine). The model's layout is src/dist/parallel_model.h's: TP groups
// are the runs of tp consecutive ranks, EP groups the runs of ep; the world is one replica, lcm(tp, ep) ranks, each
// holding every slice once. Built with CUDA, MPI and NCCL (target nextlm_nccl).
#pragma once
#include <functional>
#include <memory>

#include "cuda/device_model.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"

namespace nextlm::dist {

// One rank's model and its groups (the model refers to the groups: destroy it first, as the member order does).
struct CudaRank {
  std::unique_ptr<NcclComm> tp, ep;    // null when the group has one rank; with tp == ep only `tp` exists
  std::unique_ptr<CudaModel> model;    // collectives set (CudaModel::set_collectives)
  NcclComm* ep_group() const { return ep ? ep.get() : tp.get(); }
};

// This rank's shard of a world of lcm(tp, ep) ranks (an error naming the flag when the world has another size).
CudaShard cuda_shard(int world_rank, int world_size, int tp, int ep);

// Collective over `world` (MPI or threads): loads this rank's slices on GPU `device` with `load` (given the shard
// and the device), then joins its TP and EP groups' NCCL cliques on the model's stream (non-blocking: the
// collectives run in stream order with the model's kernels).
CudaRank make_cuda_rank(Comm& world, int tp, int ep, int device,
                        const std::function<std::unique_ptr<CudaModel>(const CudaShard&, int device)>& load);

// Runs fn(world, device) on lcm(tp, ep) threads, rank r on GPU r (an error when the machine has fewer GPUs), and
// rethrows the first exception any of them threw. fn must fail on every rank alike (a rank that throws while the
// others wait in a collective leaves them waiting).
void run_gpu_ranks(int tp, int ep, const std::function<void(Comm& world, int device)>& fn);

// The GPUs this process sees.
int cuda_device_count();

}  // namespace nextlm::dist
