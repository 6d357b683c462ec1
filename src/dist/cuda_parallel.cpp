// Tensor- and expert-parallel device models over NCCL (cuda_parallel.h).
#include "dist/cuda_parallel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/parallel_trainer.h"
#include "dist/thread_comm.h"

namespace nextlm::dist {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

CudaShard cuda_shard(int world_rank, int world_size, int tp, int ep, bool replicas) {
  check(tp >= 1 && ep >= 1, "--tp and --ep must be at least 1");
  const int replica = std::lcm(tp, ep);
  if (replicas)
    check(world_size % replica == 0, "--device cuda with --tp ", tp, " --ep ", ep, " runs on a multiple of ", replica,
          " ranks (one GPU each, data-parallel replicas of ", replica, "), not ", world_size);
  else
    check(world_size == replica, "--device cuda with --tp ", tp, " --ep ", ep, " runs on ", replica,
          " ranks (one GPU each), not ", world_size);
  CudaShard s;
  s.tp = tp, s.tp_rank = world_rank % tp;
  s.ep = ep, s.ep_rank = world_rank % ep;
  return s;
}

CudaRank make_cuda_rank(Comm& world, int tp, int ep, int device,
                        const std::function<std::unique_ptr<CudaModel>(const CudaShard&, int device)>& load,
                        bool replicas) {
  const int r = world.rank();
  const CudaShard shard = cuda_shard(r, world.size(), tp, ep, replicas);
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

namespace {

// An adapter of lora's layout for lora_gradients to add into: its dA and dB (A and B left empty).
std::unique_ptr<LoraAdapter> gradient_holder(const LoraAdapter& lora) {
  auto g = std::make_unique<LoraAdapter>(lora);
  for (LoraModule& m : g->modules()) m.A = Tensor{}, m.B = Tensor{};
  return g;
}

}  // namespace

double sharded_lora_micro_batch(Comm& world, CudaModel& model, const LoraAdapter& lora, bool refresh,
                                const PackedBatch& batch, LoraAdapter& grads) {
  if (refresh) model.set_lora(lora);
  model.zero_grads();
  // This replica's sequences: all of them unless the world holds several replicas.
  const int replica = std::lcm(model.shard().tp, model.shard().ep);
  check(world.size() % replica == 0, "LoRA on GPU shards: a world of ", world.size(), " ranks for replicas of ",
        replica);
  const Range share = replica_share(batch, world.size() / replica, world.rank() / replica);
  double loss = 0.0;
  if (share.size() == batch.num_seqs()) loss = model.forward_backward(batch);
  else if (share.size() > 0) loss = model.forward_backward(sub_batch(batch, share));
  std::vector<LoraModule>& mods = grads.modules();
  for (LoraModule& m : mods) {
    std::fill(m.dA.data.begin(), m.dA.data.end(), 0.0f);
    std::fill(m.dB.data.begin(), m.dB.data.end(), 0.0f);
  }
  model.lora_gradients(grads);
  std::vector<ParamRef> refs;  // the gradients only (the holder's A and B may be empty)
  for (LoraModule& m : mods)
    for (Tensor* g : {&m.dA, &m.dB}) {
      ParamRef r;
      r.g = g->ptr();
      r.n = g->numel();
      refs.push_back(r);
    }
  all_reduce_gradients(world, refs);
  // Each replica's loss once (its first rank's), summed.
  if (world.rank() % replica != 0) loss = 0.0;
  world.all_reduce_sum(&loss, 1);
  return loss;
}

LoraGpuRanks::LoraGpuRanks(const std::string& base_dir, int tp, int ep,
                           const std::function<void(CudaModel&)>& prepare) {
  auto load = [&](Comm& world, int device, Rank& r, bool replicas) {
    r.gpu = make_cuda_rank(
        world, tp, ep, device,
        [&](const CudaShard& shard, int dev) { return CudaModel::load(base_dir, dev, shard); }, replicas);
    r.model = r.gpu.model.get();
    if (prepare) prepare(*r.model);
  };
  if (launched_by_mpi()) {
    world_ = &dist::world();
    const int gpus = cuda_device_count();
    check(gpus > 0, "--device cuda: no CUDA device is available");
    size_ = world_->size();
    ranks_.resize(1);
    load(*world_, world_->rank() % gpus, ranks_[0], /*replicas=*/true);
    return;
  }
  size_ = std::lcm(tp, ep);
  const int gpus = cuda_device_count();
  check(gpus >= size_, "--tp ", tp, " --ep ", ep, " needs ", size_, " GPUs, this machine has ", gpus);
  ranks_.resize(static_cast<size_t>(size_));
  // Each rank's model and groups are made and freed on its own thread (its current device).
  pool_ = std::make_unique<RankPool>(
      size_, [&](Comm& world) { load(world, world.rank(), ranks_[static_cast<size_t>(world.rank())], false); },
      [this](Comm& world) { ranks_[static_cast<size_t>(world.rank())] = Rank{}; });
}

LoraGpuRanks::LoraGpuRanks(Comm& world, CudaModel& model)
    : size_(world.size()), ranks_(1), world_(&world) {
  ranks_[0].model = &model;
}

LoraGpuRanks::~LoraGpuRanks() { pool_.reset(); }

double LoraGpuRanks::step_rank(Comm& world, Rank& r, const LoraAdapter& lora, int64_t version,
                               const PackedBatch& batch) {
  const bool refresh = r.version != version;
  r.version = version;
  return sharded_lora_micro_batch(world, *r.model, lora, refresh, batch, *r.grads);
}

double LoraGpuRanks::micro_batch(LoraAdapter& lora, int64_t version, const PackedBatch& batch) {
  // Made here, one at a time (each is a copy of the adapter's layout, briefly with its A and B).
  for (Rank& r : ranks_)
    if (!r.grads) r.grads = gradient_holder(lora);
  double loss = 0.0;
  if (!pool_) {
    loss = step_rank(*world_, ranks_[0], lora, version, batch);
  } else {
    pool_->run([&](Comm& world) {
      const double l = step_rank(world, ranks_[static_cast<size_t>(world.rank())], lora, version, batch);
      if (world.rank() == 0) loss = l;
    });
  }
  // Every rank's grads hold the sums: rank 0's (or this rank's) go into the trainer's adapter.
  const std::vector<LoraModule>& from = ranks_[0].grads->modules();
  std::vector<LoraModule>& into = lora.modules();
  for (size_t i = 0; i < into.size(); ++i)
    for (auto [src, dst] : {std::pair{&from[i].dA, &into[i].dA}, std::pair{&from[i].dB, &into[i].dB}})
      for (size_t j = 0; j < dst->data.size(); ++j) dst->data[j] += src->data[j];
  return loss;
}

const CudaModel& LoraGpuRanks::model() const { return *ranks_[0].model; }

}  // namespace nextlm::dist
