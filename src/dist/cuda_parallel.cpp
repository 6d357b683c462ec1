// Tensor- and expert-parallel device models over NCCL (cuda_parallel.h).
#include "dist/cuda_parallel.h"

#include <cuda_runtime.h>

#include <numeric>

#include "core/error.h"
#include "dist/thread_comm.h"

namespace nextlm::dist {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

CudaShard cuda_shard(int world_rank, int world_size, int tp, int ep) {
  check(tp >= 1 && ep >= 1, "--tp and --ep must be at least 1");
  const int replica = std::lcm(tp, ep);
  check(world_size == replica, "--device cuda with --tp ", tp, " --ep ", ep, " runs on ", replica,
        " ranks (one GPU each), not ", world_size);
  CudaShard s;
  s.tp = tp, s.tp_rank = world_rank % tp;
  s.ep = ep, s.ep_rank = world_rank % ep;
  return s;
}

CudaRank make_cuda_rank(Comm& world, int tp, int ep, int device,
                        const std::function<std::unique_ptr<CudaModel>(const CudaShard&, int device)>& load) {
  const int r = world.rank();
  const CudaShard shard = cuda_shard(r, world.size(), tp, ep);
  CudaRank out;
  out.model = load(shard, device);
  auto stream = static_cast<cudaStream_t>(out.model->stream());
  // Every rank makes the same splits in the same order (split is collective over world).
  std::unique_ptr<Comm> tp_host = world.split(r / tp, r), ep_host = world.split(r / ep, r);
  if (tp > 1) {
    out.tp = std::make_unique<NcclComm>(std::move(tp_host), device, stream);
    out.tp->set_blocking(false);
  }
  if (ep > 1 && ep != tp) {
    out.ep = std::make_unique<NcclComm>(std::move(ep_host), device, stream);
    out.ep->set_blocking(false);
  }
  out.model->set_collectives(out.tp.get(), ep > 1 ? out.ep_group() : nullptr);
  return out;
}

void run_gpu_ranks(int tp, int ep, const std::function<void(Comm& world, int device)>& fn) {
  const int ranks = std::lcm(tp, ep), gpus = cuda_device_count();
  check(gpus >= ranks, "--tp ", tp, " --ep ", ep, " needs ", ranks, " GPUs, this machine has ", gpus);
  run_ranks(ranks, [&](Comm& world) { fn(world, world.rank()); });
}

}  // namespace nextlm::dist
