// AdamW with fp32 master weights and moments (torch.optim.AdamW's update, decoupled weight decay), global
// gradient-norm clipping (torch.nn.utils.clip_grad_norm_) and a linear-warmup + cosine-decay learning rate.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace nextlm {

// One trainable tensor: the fp32 master weight, its gradient (same length) and whether weight decay applies.
struct ParamRef {
  std::string name;  // the checkpoint name (hub layout), e.g. model.language_model.layers.0.self_attn.A_log
  std::vector<int64_t> shape;
  float* w = nullptr;
  float* g = nullptr;
  int64_t n = 0;
  bool decay = true;
};

// True for tensors that get weight decay. Excluded, as is usual for LLM training: every norm weight (RMSNorm,
// gated norm, layernorms) and bias (k_norm.bias, dt_bias), the KDA A_log, and the mHC base and scale, which are
// offsets and gains whose natural value is not 0. Decided by name so it is visible in one place.
bool decays(const std::string& name);

// The trainable tensors of `weights` paired with the same tensors of `grads` (made by zeros_like(weights)), named as
// in the checkpoint (hub_gradients' names and order). Frozen tensors are absent: the DSA indexer and the MoE
// e_score_correction_bias get no gradient (transformers runs the indexer under no_grad and the bias is a buffer),
// so they keep their initial values. With tie_word_embeddings only the embedding appears; the caller copies it to
// lm_head after each step.
std::vector<ParamRef> trainable_params(const ModelConfig& c, ModelWeights& weights, ModelWeights& grads,
                                       const std::string& prefix);

struct AdamWOptions {
  double lr = 1e-3;            // peak learning rate
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;   // decoupled: w -= lr · wd · w, only on tensors where decays() holds
};

// Learning rate at optimizer step `step` (0-based: the first update is step 0) of `total`: linear warmup from
// lr/warmup to lr over the first `warmup` steps, then a cosine from lr down to min_ratio·lr at the last step.
double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio = 0.1);

// ‖g‖₂ over every gradient (accumulated in double). When max_norm > 0 and the norm exceeds it, scales every
// gradient by max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_ does. Returns the norm before clipping.
double clip_grad_norm(std::vector<ParamRef>& params, double max_norm);

// AdamW state: one fp32 first and second moment per parameter element and the step count.
class AdamW {
 public:
  AdamW(const std::vector<ParamRef>& params, AdamWOptions opt);

  // One update of every parameter with learning rate lr (the schedule's value for this step):
  //   w ← w − lr·wd·w (decaying tensors); m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²;
  //   w ← w − lr/(1−β1^t) · m / (√v/√(1−β2^t) + ε), with t the step count after this call (torch's form).
  void step(std::vector<ParamRef>& params, double lr);

  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  std::vector<std::vector<float>>& m() { return m_; }
  std::vector<std::vector<float>>& v() { return v_; }
  const std::vector<std::vector<float>>& m() const { return m_; }
  const std::vector<std::vector<float>>& v() const { return v_; }
  const AdamWOptions& options() const { return opt_; }

 private:
  AdamWOptions opt_;
  int64_t t_ = 0;
  std::vector<std::vector<float>> m_, v_;  // parallel to the params list
};

}  // namespace nextlm
