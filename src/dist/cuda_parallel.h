// Tensor- and expert-parallel device models over NCCL: one GPU per rank, the ranks either processes under mpirun or
// threads of one process (one per GPU of the machine). The model's layout is src/dist/parallel_model.h's: TP groups
// are the runs of tp consecutive ranks, EP groups the runs of ep; the world is one replica, lcm(tp, ep) ranks, each
// holding every slice once. Built with CUDA, MPI and NCCL (target nextlm_nccl).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/device_model.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "dist/rank_pool.h"
#include "model/lora.h"

namespace nextlm::dist {

// One rank's model and its groups (the model refers to the groups: destroy it first, as the member order does).
struct CudaRank {
  std::unique_ptr<NcclComm> tp, ep;    // null when the group has one rank; with tp == ep only `tp` exists
  std::unique_ptr<CudaModel> model;    // collectives set (CudaModel::set_collectives)
  NcclComm* ep_group() const { return ep ? ep.get() : tp.get(); }
};

// This rank's shard of a world of lcm(tp, ep) ranks (an error naming the flag when the world has another size).
// With `replicas` the world may be any multiple of lcm(tp, ep): its runs of lcm(tp, ep) consecutive ranks are
// data-parallel replicas, each holding every slice once (LoRA training, LoraGpuRanks).
CudaShard cuda_shard(int world_rank, int world_size, int tp, int ep, bool replicas = false);

// Collective over `world` (MPI or threads): loads this rank's slices on GPU `device` with `load` (given the shard
// and the device), then joins its TP and EP groups' NCCL cliques on the model's stream (non-blocking: the
// collectives run in stream order with the model's kernels). `replicas` as for cuda_shard.
CudaRank make_cuda_rank(Comm& world, int tp, int ep, int device,
                        const std::function<std::unique_ptr<CudaModel>(const CudaShard&, int device)>& load,
                        bool replicas = false);

// Runs fn(world, device) on lcm(tp, ep) threads, rank r on GPU r (an error when the machine has fewer GPUs), and
// rethrows the first exception any of them threw. fn must fail on every rank alike (a rank that throws while the
// others wait in a collective leaves them waiting).
void run_gpu_ranks(int tp, int ep, const std::function<void(Comm& world, int device)>& fn);

// The GPUs this process sees.
int cuda_device_count();

// One micro-batch of LoRA training on a sharded device model, collective over `world` (one replica of the model, or
// several: runs of lcm(tp, ep) consecutive ranks, the model's shard telling tp and ep). Uploads the adapters'
// current A and B when `refresh` (set_lora of the trainer's adapter; the first call must refresh); each replica
// runs forward_backward from zeroed gradients on its share of the batch's sequences (replica_share, as the CPU's
// ParallelTrainer splits them; a replica without one computes nothing); and the ranks' shares of dA and dB
// (lora_gradients) are summed over the world (all_reduce_gradients: in rank order), so that every rank's `grads`
// ends with the whole micro-batch's dA and dB (grads: an adapter of the same layout as `lora`; its dA and dB are
// overwritten, its A and B unused). Returns the whole micro-batch's loss (the replicas' summed) on every rank.
double sharded_lora_micro_batch(Comm& world, CudaModel& model, const LoraAdapter& lora, bool refresh,
                                const PackedBatch& batch, LoraAdapter& grads);

// The GPU ranks of `nextlm train --device cuda --tp T --ep E --lora-rank R`: one GPU a rank, every rank holding its
// slices of the frozen base read from its checkpoint and the adapters' bf16 copies, while the trainer
// (model/trainer.h, its AdamW on the host) holds the adapters and their optimizer state. Without an MPI launcher
// the world is one replica, lcm(T, E) threads of this process on GPUs 0 … lcm − 1 (a RankPool, so that each keeps
// its GPU and NCCL groups for the whole run). Under `mpirun -np N` this process is one rank (GPU = world rank modulo
// the GPUs it sees), N a multiple of lcm(T, E): N / lcm(T, E) data-parallel replicas split each micro-batch's
// sequences, and every process runs the same trainer on the same data, so that all hold the same adapters.
class LoraGpuRanks {
 public:
  // `prepare` runs on each rank's model once it is loaded (set_recompute and the like). A fixed recompute policy
  // belongs there: an adaptive one cannot fall back on one rank alone (recompute.h).
  LoraGpuRanks(const std::string& base_dir, int tp, int ep, const std::function<void(CudaModel&)>& prepare);
  // One rank of a world whose other ranks run their own LoraGpuRanks and trainer (as under mpirun): `model` is this
  // rank's shard with its collectives set; world and model must outlive this object.
  LoraGpuRanks(Comm& world, CudaModel& model);
  ~LoraGpuRanks();
  LoraGpuRanks(const LoraGpuRanks&) = delete;  // the pool's ranks refer to this object
  LoraGpuRanks& operator=(const LoraGpuRanks&) = delete;
  // Trainer::GradientFn's LoRA case: the micro-batch's loss, with its dA and dB added into lora's modules. The
  // adapters are uploaded again when version changes (the trainer's optimizer steps taken).
  double micro_batch(LoraAdapter& lora, int64_t version, const PackedBatch& batch);
  // Rank 0's model (under mpirun: this process's), for what every rank has alike (its recompute policy).
  const CudaModel& model() const;
  // The world's size (all ranks, with every replica's).
  int world_size() const { return size_; }

 private:
  struct Rank {
    CudaRank gpu;                        // the model and groups, when this object made them
    CudaModel* model = nullptr;
    std::unique_ptr<LoraAdapter> grads;  // this rank's gradients of the last micro-batch (lora's layout)
    std::optional<int64_t> version;      // the adapters' version on the device (none before the first upload)
  };
  double step_rank(Comm& world, Rank& r, const LoraAdapter& lora, int64_t version, const PackedBatch& batch);
  int size_ = 1;
  std::vector<Rank> ranks_;         // threads: one per rank; else this process's
  Comm* world_ = nullptr;           // the world of this process's rank (not threads)
  std::unique_ptr<RankPool> pool_;  // threads only
};

}  // namespace nextlm::dist
