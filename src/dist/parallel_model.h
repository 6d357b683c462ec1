// Tensor- and expert-parallel CPU fp32 forward of glm5_next over a communicator. It runs the model's own component
// functions (kda_layer_forward, dsa_layer_forward, mlp_forward, route_forward, mhc_*) on sliced weights with a
// per-rank config (fewer heads), and adds the collectives between them:
//   - KDA: q/k/v/f_b/g_b/b rows, convs, A_log and dt_bias split by head; f_a, g_a, o_norm replicated; o_proj columns
//     (row-parallel) followed by an all-reduce of the partial outputs.
//   - MLA: q_b and kv_b rows by head, o_proj columns + all-reduce; q_a, kv_a, their norms and the DSA indexer
//     replicated (every rank computes the same selection).
//   - dense MLP and shared expert: gate/up rows, down columns + all-reduce; mHC and norms replicated.
//   - routed experts split over the EP group; each EP rank routes its own share of the tokens, sends each token row
//     to the rank owning its chosen expert (all-to-all), gets the expert outputs back (all-to-all) and adds them in
//     expert order as the single-process moe_forward does; an all-gather then gives every rank all tokens.
//   - vocab-parallel embedding (each rank holds a row range; all-reduce of the owner's rows) and lm_head with a
//     parallel log-softmax (max, Σexp and the target logit reduced over ranks; [T, V] is never gathered).
// Every reduction sums in rank order, so results are deterministic for a given layout.
//
// Layout over a world of N ranks: TP groups are the N/tp runs of tp consecutive ranks, EP groups the N/ep runs of
// ep consecutive ranks. Both nest in the runs of R = lcm(tp, ep) consecutive ranks, the replicas: a replica holds
// every slice once and all its ranks work on the same batch. score, grad and generate give every replica the whole
// batch (the N/R replicas compute the same values); `train` gives each replica its own share of a step's sequences
// and sums the gradients over the DP group, the N/R ranks that hold the same slices (parallel_trainer.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/comm.h"
#include "model/config.h"
#include "model/block.h"
#include "model/model.h"
#include "model/weights.h"

namespace nextlm::dist {

struct ParallelOptions {
  int tp = 1;  // tensor-parallel ranks (attention heads, MLP width, vocab)
  int ep = 1;  // expert-parallel ranks (routed experts)
};

// The groups of one rank.
struct Mesh {
  Comm* world = nullptr;
  std::unique_ptr<Comm> tp, ep;
  std::unique_ptr<Comm> replica;  // the replica_size ranks of this rank's replica (world ranks in runs)
  std::unique_ptr<Comm> dp;       // the world ranks with this rank's place in their replica, one per replica
  int replica_size = 1;           // lcm(tp, ep)
  ParallelOptions opt;
  Mesh(Comm& world, ParallelOptions opt);  // validates tp and ep against world.size(); collective over world
};

// Checks tp/ep against the world size and the model: Error with a one-line message naming the flag.
void validate_layout(const ParallelOptions& opt, int world_size, const ModelConfig& c);

// One rank's slices of the model.
struct ShardedModel {
  ModelConfig config;  // the full model's config
  ModelConfig local;   // this rank's: linear_num_heads / num_attention_heads divided by tp
  Range vocab;         // rows of embed / lm_head held here
  Range experts;       // routed experts held here (experts[e − experts.begin] in each MoeWeights)
  // Sliced weights: embed and lm_head [vocab.size(), D]; per layer the slices listed above; a MoE's router and
  // correction bias whole, its `experts` only the held range, its shared expert sliced as a dense MLP.
  ModelWeights weights;
};

// The ranges of the TP-sliced weights that TP rank tp_rank of tp holds: load_sharded reads them, and LoRA on a shard
// cuts its adapters by them (parallel_lora.cpp).
struct TpSlices {
  Range vocab;         // rows of embed / lm_head
  Range kda_heads;     // KDA heads: rows of A_log and b_proj
  Range kda_channels;  // their channels of [H·K]: rows of q/k/v/f_b/g_b, the convs and dt_bias; columns of o_proj
  Range mla_heads;     // MLA heads
  Range mla_q;         // their rows of q_b [NH·dqk]
  Range mla_kv;        // their rows of kv_b [NH·(dqk + dv)]
  Range mla_o;         // their columns of o_proj [D, NH·dv]
  Range mlp;           // the dense MLP's width: rows of gate/up, columns of down
  Range shared;        // the shared expert's width, likewise
};
TpSlices tp_slices(const ModelConfig& c, int tp, int tp_rank);

// Reads config.json and only this rank's slices of every tensor from the checkpoint in `dir` (row or column ranges
// of the memory-mapped tensors, widened to fp32). Names and full shapes are checked as Model::load does.
ShardedModel load_sharded(const std::string& dir, const Mesh& mesh);
// The same from an already parsed config and an open checkpoint.
ShardedModel load_sharded(const Checkpoint& ckpt, const ModelConfig& c, const Mesh& mesh);

// Where load_sharded finds the full tensors: by checkpoint name (nullptr when absent), and what to call the source
// in messages. Besides checkpoints: tensors in memory (a random init) and the optimizer moments of a training
// checkpoint, which have the same names behind "exp_avg." / "exp_avg_sq.".
struct TensorSource {
  std::function<const TensorView*(const std::string& name)> find;
  std::string where;  // "checkpoint DIR"
};
// frozen = false skips the tensors that are never trained (the DSA indexer, e_score_correction_bias), which a
// source of optimizer moments does not hold; they stay empty.
ShardedModel load_sharded(const TensorSource& src, const ModelConfig& c, const Mesh& mesh, bool frozen);

// The decoder stack (block.h's decoder_forward) on this rank's slices: `attention` gives this rank's partial
// attention output (its heads through its o_proj columns), which is all-reduced over TP; the MLP/MoE, the
// embedding and the collectives are done here. Final normed hidden states [T, D], the same on every rank.
Tensor parallel_decoder_forward(const ShardedModel& m, const Mesh& mesh, const std::vector<int32_t>& tokens,
                                const AttentionFn& attention);
// Final normed hidden states [T, D] of a packed batch, the same on every rank.
Tensor parallel_forward_hidden(const ShardedModel& m, const Mesh& mesh, const PackedBatch& batch,
                               const ForwardOptions& opt = {});
// The MoE sub-layer of one layer over the EP group (shared expert tensor-parallel, routed experts dispatched to their
// EP ranks by all-to-all and combined back in expert order). x [T, D] and y [T, D], the same on every rank.
void moe_parallel_forward(const MoeWeights& w, const ShardedModel& m, const Mesh& mesh, const float* x, int64_t T,
                          float* y);
// log p(x[t+1] | x[..t]) per sequence (as Model::next_token_logprobs), the same on every rank.
std::vector<std::vector<double>> parallel_next_token_logprobs(const ShardedModel& m, const Mesh& mesh,
                                                              const Tensor& hidden, const PackedBatch& batch);
// Full logits [end − begin, V] of hidden rows [begin, end) on every rank: gathers the vocab slices, for outputs and
// tests only (the log-probabilities never need it).
Tensor parallel_logits(const ShardedModel& m, const Mesh& mesh, const Tensor& hidden, int64_t begin, int64_t end);

}  // namespace nextlm::dist
