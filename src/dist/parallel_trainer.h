// Data-, tensor- and expert-parallel CPU training (`mpirun -np N nextlm train --tp T --ep E`): the counterpart of
// model/trainer.h's Trainer over a Mesh, giving the same steps as one process on the same data up to the order of
// floating-point sums.
//   - Replicas: the N/R runs of R = lcm(T, E) consecutive ranks (parallel_model.h); each holds every slice once.
//     Every rank draws the same micro-batches as the single-process Trainer (same data stream, same packing); replica
//     d of the DP replicas takes a contiguous share of each micro-batch's sequences (replica_share), computes its
//     loss and gradients with parallel_forward_backward, and the gradients and losses are summed over the DP group
//     (the ranks that hold the same slices). The step then divides by the weighted prediction count of the whole
//     step (all micro-batches, all replicas), as Trainer::step does, so the update does not depend on the split.
//   - Optimizer: AdamW over this rank's slices (each rank keeps the moments of what it holds; replicated tensors are
//     updated identically on every rank that holds them, from identical gradients). The clipping norm is the global
//     one: each tensor counted once over the replica.
//   - Checkpoints: the slices gathered into one hub-layout training checkpoint (Trainer::save's layout, written by
//     world rank 0), which a single-process run resumes from; resuming under mpirun reads each rank's slices of the
//     weights and the moments from such a checkpoint, whatever layout wrote it.
//   - LoRA (TrainOptions::lora): the model given is the frozen base, sliced as always; every rank holds the whole
//     adapter with its optimizer state (the same values everywhere), merges it into its slices (ShardLora,
//     parallel_lora.h), and takes the adapter's gradients from its slices' weight gradients, summed over the world.
//     Checkpoints are Trainer::save's LoRA ones (the PEFT adapter files, written by world rank 0), so a single-process
//     run resumes them and the reverse.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dist/parallel_lora.h"
#include "dist/parallel_model.h"
#include "model/optim.h"
#include "model/trainer.h"

namespace nextlm::dist {

// Where a trainable tensor lives over the ranks of one replica, from its checkpoint name: the same on every rank
// (norms, mHC, router, the replicated attention projections), sliced over TP (heads, MLP width, vocabulary) or
// whole experts over EP.
enum class Placement { Replicated, TpSliced, Expert };
Placement placement_of(const std::string& name);

// The sequences [begin, end) of micro-batch b that replica d of n takes: sequence s goes to the replica whose equal
// share of the batch's T tokens, [d·T/n, (d+1)·T/n), holds the middle of s (its token range's midpoint). The shares
// are contiguous, in order and disjoint, balanced by tokens; a replica gets none when the batch has fewer sequences
// than replicas.
Range replica_share(const PackedBatch& b, int n, int d);
// The sequences [seqs.begin, seqs.end) of b as a batch of their own (with their target weights).
PackedBatch sub_batch(const PackedBatch& b, Range seqs);

// Sums the gradients (g[n]) of params over comm, each element in rank order: the small ones staged back to back
// into all-reduces of at most `chunk` floats (thousands of per-expert tensors in a few calls, through a bounded
// buffer), a larger one in place, `chunk` floats at a time (an MPI message stays under its 2 GiB limit). The sums
// do not depend on the chunk.
void all_reduce_gradients(Comm& comm, const std::vector<ParamRef>& params, size_t chunk = size_t{1} << 22);

// This rank's slices of full in-memory weights (a random init): load_sharded over the tensors save_model would write.
ShardedModel shard_weights(const ModelConfig& c, const ModelWeights& full, const Mesh& mesh);

class ParallelTrainer {
 public:
  // Starts from this rank's slices with fresh optimizer state (with opt.lora: fresh adapters on these slices of the
  // frozen base, the same on every rank as Trainer makes them). Every rank of mesh.world must pass the same data and
  // options. The mesh must outlive the trainer.
  ParallelTrainer(ShardedModel model, const Mesh& mesh, std::vector<TrainExample> data, TrainOptions opt);
  // params_ points into model_ and grads_ (see Trainer).
  ParallelTrainer(const ParallelTrainer&) = delete;
  ParallelTrainer& operator=(const ParallelTrainer&) = delete;
  ParallelTrainer(ParallelTrainer&&) = default;

  // A trainer in the state a training checkpoint recorded (Trainer::save or save below); `opt` replaces the stored
  // options. A LoRA checkpoint's base is read again from opt.base_model. Collective over the world.
  static ParallelTrainer resume(const std::string& dir, const Mesh& mesh, std::vector<TrainExample> data,
                                TrainOptions opt);

  // One optimizer step (collective over the world); the same statistics on every rank.
  StepStats step();
  // Gathers the slices and writes DIR as Trainer::save does (world rank 0 writes; collective; an error writing it is
  // thrown on every rank). Checks first that the replicas agree on the weights (check_replicas_agree).
  void save(const std::string& dir) const;
  // Fails (on every rank) unless the ranks of each DP group hold bit-identical slices and the ranks of each replica
  // the same replicated tensors: data parallelism must keep the copies in step.
  void check_replicas_agree() const;

  // This rank's slices (with LoRA: base + adapter merged) and the adapter (null without LoRA).
  const ShardedModel& model() const { return model_; }
  const LoraAdapter* lora() const { return lora_ ? &*lora_ : nullptr; }
  const TrainOptions& options() const { return opt_; }
  int64_t steps_done() const { return adam_.steps(); }
  DataPosition data_position() const { return pos_; }
  // The trainable parameters of the whole model (each counted once; collective over the replica).
  int64_t num_trainable() const;

 private:
  ModelWeights moments_as_weights(const std::vector<std::vector<float>>& moments) const;
  // Whether params_[k] is counted on this rank in sums over the replica (the clipping norm): each tensor once.
  bool counted_here(size_t k) const;

  ShardedModel model_;
  const Mesh* mesh_;
  std::vector<TrainExample> data_;
  TrainOptions opt_;
  ModelWeights grads_;
  std::vector<ParamRef> params_;       // the adapter's A and B with LoRA
  std::vector<Placement> placement_;  // parallel to params_ (without LoRA)
  std::optional<LoraAdapter> lora_;
  ShardLora shard_lora_;
  AdamW adam_;
  DataPosition pos_;
  std::vector<int64_t> order_;
};

}  // namespace nextlm::dist
