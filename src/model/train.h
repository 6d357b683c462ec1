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

namespace nextlm {

// L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) over the batch (each sequence independent, as run alone; each term
// weighted by batch.target_weight[t+1] when that is given), and
// grads += dL/dθ for every trainable tensor (the convention of backward.h). grads comes from
// zeros_like(model.weights()), or holds earlier accumulations. With tie_word_embeddings the lm_head's gradient is
// added to grads.embed (grads.lm_head is left alone).
// The forward runs once with the reference's own component functions and keeps only the residual streams entering
// each mHC site, the DSA selections and the MoE choices (constants of the backward); the backward then recomputes
// one layer at a time with its *_forward_train and walks back through it, so activation memory is one layer's plus
// 2·layers·T·S·D floats of streams.
double model_forward_backward(const Model& model, const PackedBatch& batch, ModelWeights& grads);

// The pieces of model_forward_backward around its fixed skeleton (the mHC sites, the RMSNorms and the layer loop),
// so that the tensor/expert-parallel trainer (src/dist) runs the same skeleton with its sharded sub-layers. Each
// forward gives the full sub-layer output and each backward adds the full input gradient (collectives inside).
struct TrainParts {
  std::function<void(const std::vector<int32_t>& tokens, float* e)> embed;  // e [T, D]
  // The forward pass of layer i: attention (`sel` as in AttentionFn) and feed-forward (`route`: the MoE's choices).
  std::function<void(int64_t i, const float* a, float* y, Selection& sel)> attention;
  std::function<void(int64_t i, const float* a, float* y, Routing& route)> ffn;
  // The loss from the final streams h [T, S, D]: adds dL/dh into dh and the head's gradients into the gradients.
  std::function<double(const float* h, float* dh)> head;
  // Layer i's sub-layer recomputed with its activations kept, then its backward (called right after it).
  std::function<void(int64_t i, const float* a, const Selection& sel, float* y)> attention_train;
  std::function<void(int64_t i, const float* a, const Selection& sel, const float* dy, float* da)> attention_backward;
  std::function<void(int64_t i, const float* a, const Routing& route, float* y)> ffn_train;
  std::function<void(int64_t i, const float* a, const Routing& route, const float* dy, float* da)> ffn_backward;
  std::function<void(const std::vector<int32_t>& tokens, const float* dh)> embed_backward;  // dh [T, S, D]
};
// The skeleton: c and w give the mHC and norm weights, grads receives theirs.
double forward_backward(const ModelConfig& c, const ModelWeights& w, const PackedBatch& batch, ModelWeights& grads,
                        const TrainParts& parts);

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

}  // namespace nextlm
