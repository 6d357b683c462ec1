// AdamW, gradient clipping and the learning-rate schedule of the CPU training path (torch.optim.AdamW semantics).
#include "model/optim.h"

#include <cmath>

#include "core/error.h"
#include "model/train.h"

namespace nextlm {

bool decays(const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (name.find("norm") != std::string::npos) return false;  // *norm.weight, *_layernorm.weight, k_norm.bias
  if (ends_with("bias") || ends_with("A_log")) return false;  // dt_bias, any bias
  if (name.find(".hc_") != std::string::npos && (ends_with("_base") || ends_with("_scale"))) return false;
  return true;
}

std::vector<ParamRef> trainable_params(const ModelConfig& c, ModelWeights& weights, ModelWeights& grads,
                                       const std::string& prefix) {
  // hub_gradients lists the trainable tensors of any ModelWeights; the weights and their gradients share one
  // structure, so both lists come out in the same order. It hands out const pointers because it serves `grad`'s
  // writer; the tensors themselves are ours to modify.
  const std::vector<GradTensor> ws = hub_gradients(c, weights, prefix), gs = hub_gradients(c, grads, prefix);
  check(ws.size() == gs.size(), "gradients do not match the model's tensors");
  std::vector<ParamRef> out;
  for (size_t i = 0; i < ws.size(); ++i) {
    check(ws[i].name == gs[i].name && ws[i].shape == gs[i].shape, "gradient ", gs[i].name, " does not match ",
          ws[i].name);
    ParamRef p;
    p.name = ws[i].name;
    p.shape = ws[i].shape;
    p.w = const_cast<float*>(ws[i].data);
    p.g = const_cast<float*>(gs[i].data);
    p.n = 1;
    for (int64_t d : p.shape) p.n *= d;
    p.decay = decays(p.name);
    out.push_back(std::move(p));
  }
  return out;
}

double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const int64_t decay_steps = total - warmup - 1;  // the cosine reaches its floor exactly at the last step
  if (decay_steps <= 0) return lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
  const double floor = lr * min_ratio;
  return floor + 0.5 * (lr - floor) * (1.0 + std::cos(M_PI * progress));
}

double clip_grad_norm(std::vector<ParamRef>& params, double max_norm) {
  double sq = 0.0;
  for (const ParamRef& p : params)
    for (int64_t i = 0; i < p.n; ++i) sq += static_cast<double>(p.g[i]) * p.g[i];
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && norm > max_norm) {
    const float scale = static_cast<float>(max_norm / (norm + 1e-6));
    for (ParamRef& p : params)
      for (int64_t i = 0; i < p.n; ++i) p.g[i] *= scale;
  }
  return norm;
}

AdamW::AdamW(const std::vector<ParamRef>& params, AdamWOptions opt) : opt_(opt) {
  for (const ParamRef& p : params) {
    m_.emplace_back(p.n, 0.0f);
    v_.emplace_back(p.n, 0.0f);
  }
}

void AdamW::step(std::vector<ParamRef>& params, double lr) {
  check(params.size() == m_.size(), "AdamW: ", params.size(), " parameters, state for ", m_.size());
  ++t_;
  const double bc1 = 1.0 - std::pow(opt_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(opt_.beta2, static_cast<double>(t_));
  const float b1 = static_cast<float>(opt_.beta1), b2 = static_cast<float>(opt_.beta2);
  const float step_size = static_cast<float>(lr / bc1), sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(opt_.eps);
  for (size_t k = 0; k < params.size(); ++k) {
    ParamRef& p = params[k];
    const float decay = p.decay ? static_cast<float>(1.0 - lr * opt_.weight_decay) : 1.0f;
    float* m = m_[k].data();
    float* v = v_[k].data();
    for (int64_t i = 0; i < p.n; ++i) {
      const float g = p.g[i];
      p.w[i] *= decay;
      m[i] = b1 * m[i] + (1.0f - b1) * g;
      v[i] = b2 * v[i] + (1.0f - b2) * g * g;
      p.w[i] -= step_size * m[i] / (std::sqrt(v[i]) / sqrt_bc2 + eps);
    }
  }
}

}  // namespace nextlm
