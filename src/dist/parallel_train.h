// Loss and gradients of the tensor/expert-parallel CPU model (the counterpart of model/train.h's
// model_forward_backward), and the gathering of the sharded gradients into the checkpoint's full tensors.
// Each layer's backward is the model's own (kda_layer_backward, dsa_layer_backward, mlp_backward, mhc_*_backward,
// rmsnorm_backward) on this rank's slices, with the collectives that make the sharding exact:
//   - column-parallel inputs: the gradient of a sub-layer's input is a per-rank partial sum, all-reduced over TP;
//     so are the gradients of the replicated tensors that feed only this rank's heads (KDA f_a, g_a, o_norm; MLA q_a,
//     kv_a and their norms): parallel_forward_backward leaves them partial, gather_gradients sums them;
//   - routed experts: every rank holds all tokens, so each EP rank runs the backward of its own experts on all the
//     tokens routed to them; their input gradients and the routing-weight gradients are all-reduced over the EP
//     group, and every rank then takes the router's backward itself (its gradient is replicated);
//   - the head: vocab-parallel cross-entropy (max, Σexp and target logit reduced over TP), the lm_head slice's
//     gradient local, the normed hidden state's gradient all-reduced over TP.
#pragma once
#include <string>
#include <vector>

#include "dist/parallel_model.h"
#include "model/backward.h"
#include "model/train.h"

namespace nextlm::dist {

// L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) (weighted by batch.target_weight as model_forward_backward), the same on
// every rank, and grads += dL/dθ for this rank's slices (grads from zeros_like(m.weights)). `policy` as in
// model_forward_backward (the same results under every policy); it must be the same on every rank.
double parallel_forward_backward(const ShardedModel& m, const Mesh& mesh, const PackedBatch& batch,
                                 ModelWeights& grads, const RecomputePolicy& policy = {});

// The full gradients with the checkpoint's shapes, assembled on every rank from every rank's slices (collective over
// the TP and EP groups). Frozen tensors stay empty, as zeros_like leaves them.
ModelWeights gather_gradients(const ShardedModel& m, const Mesh& mesh, const ModelWeights& grads);

// Sums, in place over TP, the gradients parallel_forward_backward leaves partial (the replicated tensors that feed
// only a rank's heads: KDA f_a, g_a, o_norm; MLA q_a, kv_a and their norms), so that every TP rank holds the full
// gradient of each replicated tensor, as an optimizer over the slices needs.
void reduce_partial_gradients(const Mesh& mesh, ModelWeights& grads);

// The full model (checkpoint shapes, frozen tensors included) from every rank's slices, on every rank: the
// counterpart of load_sharded, for writing a checkpoint. Also gathers any ModelWeights sliced like the model (the
// optimizer's moments).
ModelWeights gather_weights(const ShardedModel& m, const Mesh& mesh, const ModelWeights& w);

}  // namespace nextlm::dist
