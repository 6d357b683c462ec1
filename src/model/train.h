// CPU fp32 training pieces: the loss L of a packed batch with the gradient of every trainable parameter, and the
// gradients' names and shapes in the checkpoint's hub layout (what `nextlm grad` writes).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/backward.h"
#include "model/model.h"
#include "model/moe.h"
#include "model/recompute.h"

namespace nextlm {

// L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) over the batch (each sequence independent, as run alone; each term
// weighted by batch.target_weight[t+1] when that is given), and
// grads += dL/dθ for every trainable tensor (the convention of backward.h). grads comes from
// zeros_like(model.weights()), or holds earlier accumulations. With tie_word_embeddings the lm_head's gradient is
// added to grads.embed (grads.lm_head is left alone).
// The forward runs once, with the functions the backward recomputes with (kda_layer_forward_train with the chunked
// core, dsa_layer_forward_train, mlp_forward, moe_forward_routed: the bits of the Model's forward), and keeps the
// residual streams entering each mHC site, the DSA selections, the MoE choices and what `policy` keeps; the
// backward then walks back one layer at a time, recomputing first what the policy did not keep. Under the default
// policy (recompute all) the activation memory is one layer's plus 2·layers·T·S·D floats of streams.
double model_forward_backward(const Model& model, const PackedBatch& batch, ModelWeights& grads,
                              const RecomputePolicy& policy = {});

// What differs between the whole model and one rank's slices of it (src/dist) around the shared training skeleton
// (the mHC sites, the RMSNorms, the layer loop, the sub-layers and the recompute policy).
struct TrainParts {
  // The config the attention layers run with: the model's, or a rank's share of the heads.
  const ModelConfig* attention_config = nullptr;
  // Sums x [n] over the tensor-parallel ranks: the outputs of the attention and dense-MLP slices and their input
  // gradients are partial sums. Empty: one process, nothing to sum.
  std::function<void(float* x, size_t n)> tp_sum;
  std::function<void(const std::vector<int32_t>& tokens, float* e)> embed;  // e [T, D]
  // The MoE of layer i with the experts chosen (`route`, from route_forward): its full output y [T, D], and its
  // backward, which adds the full input gradient into da [T, D] (collectives inside).
  std::function<void(int64_t i, const float* a, const Routing& route, float* y)> moe_forward;
  std::function<void(int64_t i, const float* a, const Routing& route, const float* dy, float* da)> moe_backward;
  // The loss from the final streams h [T, S, D]: adds dL/dh into dh and the head's gradients into the gradients
  // (the skeleton moves the lm_head's into the embedding's when they are tied).
  std::function<double(const float* h, float* dh)> head;
  std::function<void(const std::vector<int32_t>& tokens, const float* dh)> embed_backward;  // dh [T, S, D]
};
// The skeleton: c and w give the model's weights (a rank's slices of them), grads receives their gradients.
double forward_backward(const ModelConfig& c, const ModelWeights& w, const PackedBatch& batch, ModelWeights& grads,
                        const TrainParts& parts, const RecomputePolicy& policy = {});

// The text-model prefix of a checkpoint's tensor names ("model.language_model." or "model."), chosen as the loader
// chooses it.
std::string text_prefix(const Checkpoint& ckpt);

// One gradient under its checkpoint name, with the checkpoint's shape; data points into the ModelWeights it came from.
struct GradTensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// Every trainable tensor's gradient under the checkpoint's own names (prefix from text_prefix; per-expert tensors
// as in the hub layout; conv weights [C, 1, W]). Absent: the frozen tensors (indexer, e_score_correction_bias), and
// lm_head.weight when the embeddings are tied.
std::vector<GradTensor> hub_gradients(const ModelConfig& c, const ModelWeights& grads, const std::string& prefix);
// Sets every tensor hub_gradients lists to zero, in place (the buffers keep their addresses).
void zero_gradients(const ModelConfig& c, ModelWeights& grads);

}  // namespace nextlm
