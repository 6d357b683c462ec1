// LoRA adapters on a tensor/expert-parallel CPU shard (dist/parallel_model.h): the counterpart of LoraAdapter's
// capture/apply/backward (model/lora.h) for the slices one rank holds, used by ParallelTrainer.
//
// Every rank holds the whole adapter (A, B and their gradients). Each adapted projection's slice on this rank is a
// block of the full weight: rows [r0, r0 + n) of a row-sliced projection (the KDA and MLA heads' q/k/v/b/f_b/g_b,
// q_b, kv_b; the MLP's and shared expert's gate/up), columns [c0, c0 + n) of a column-sliced one (the o_proj, the
// down projections), or all of a replicated one (f_a, g_a, q_a, kv_a) or of a routed expert held here. For a block
// G of the weight's gradient, with s the module's scale,
//   W_block = base_block + s·B[rows]·A[:, cols]    (element by element as lora_merge forms it: the same bits)
//   dB[rows] += s·G·A[:, cols]ᵀ,   dA[:, cols] += s·B[rows]ᵀ·G
// so the blocks of one replica, each counted on one rank (the first TP group holds each TP slice once, the first EP
// group each expert, replica rank 0 the replicated projections), add up to LoraAdapter::backward's dA and dB of the
// replica's gradient, and a sum over the world adds the data-parallel replicas' shares.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "dist/comm.h"
#include "dist/parallel_model.h"
#include "model/lora.h"

namespace nextlm::dist {

class ShardLora {
 public:
  // Captures this rank's base blocks of the projections `adapter` adapts in `model` (before any merge). The adapter
  // and the model are passed to every call instead of being kept, so that the owner may move them.
  ShardLora(const LoraAdapter& adapter, const ShardedModel& model, const Mesh& mesh);
  ShardLora() = default;

  // Writes base + s·B·A into each adapted block of `weights` (this rank's slices), from the adapter's A and B.
  void apply(const LoraAdapter& adapter, ModelWeights& weights) const;
  // Sets the adapter's dA and dB to this rank's share of its replica's gradient, from the shard's weight gradients
  // `grads` (partial TP sums already reduced: reduce_partial_gradients); zero where this rank counts no block. The
  // shares' sum over the world is the gradient of the whole step's data.
  void gradients(LoraAdapter& adapter, const ModelWeights& grads) const;

 private:
  struct Block {
    size_t module = 0;   // index into adapter.modules()
    int64_t local = -1;  // the expert's index in this shard's MoeWeights (-1: not an expert kind)
    int64_t r0 = 0, rows = 0, c0 = 0, cols = 0;  // the block in the full [out, in] weight
    bool counted = false;                        // this rank adds the block's share to the replica's gradient
    Tensor base;                                 // [rows, cols]
  };
  std::vector<Block> blocks_;
};

}  // namespace nextlm::dist
