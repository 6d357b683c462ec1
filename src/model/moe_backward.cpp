// MLP / MoE backward in fp32: the clamped SwiGLU (zero gradient where a clamp is active), the routed experts on
// their tokens, the shared expert, and the router through the chosen experts' weights (sigmoid, optional top-k
// normalisation, scaling; the choice itself and e_score_correction_bias are constants). Gradients of
// Glm5NextTextMLP / Glm5NextTextExperts / Glm5NextTextTopkRouter / Glm5NextTextMoE (transformers 5.17.0).
#include <algorithm>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "model/backward.h"
#include "model/norm.h"

namespace nextlm {

namespace {

float silu_grad(float x) {
  const float s = sigmoidf(x);
  return s * (1.0f + x * (1.0f - s));
}

// The clamped SwiGLU's pre-activations g = gate·x, u = up·x [T, I] and act = silu(min(g, L))·clamp(u, ±L), in the
// arithmetic of mlp_forward.
struct SwigluActs {
  std::vector<float> g, u, act;
};
SwigluActs swiglu_acts(const MlpWeights& w, float L, const float* x, int64_t T, int64_t D) {
  const int64_t I = w.gate.dim(0);
  SwigluActs a{std::vector<float>(T * I), std::vector<float>(T * I), std::vector<float>(T * I)};
  cpu::linear(x, T, D, w.gate, a.g.data());
  cpu::linear(x, T, D, w.up, a.u.data());
  for (int64_t i = 0; i < T * I; ++i) a.act[i] = siluf(std::min(a.g[i], L)) * std::clamp(a.u[i], -L, L);
  return a;
}

// mlp_backward from the activations of its input x.
void swiglu_backward(const MlpWeights& w, float L, const float* x, int64_t T, int64_t D, const SwigluActs& a,
                     const float* dy, float* dx, MlpWeights& dw) {
  const int64_t I = w.gate.dim(0);
  std::vector<float> dact(T * I, 0.0f), dg(T * I), du(T * I);
  cpu::linear_backward(a.act.data(), T, I, w.down, dy, dact.data(), &dw.down);
  for (int64_t i = 0; i < T * I; ++i) {
    const float g = a.g[i], u = a.u[i], gc = std::min(g, L), uc = std::clamp(u, -L, L);
    dg[i] = g <= L ? dact[i] * uc * silu_grad(gc) : 0.0f;
    du[i] = (u >= -L && u <= L) ? dact[i] * siluf(gc) : 0.0f;
  }
  cpu::linear_backward(x, T, D, w.gate, dg.data(), dx, &dw.gate);
  cpu::linear_backward(x, T, D, w.up, du.data(), dx, &dw.up);
}

}  // namespace

void routed_weights(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& r,
                    std::vector<float>& s, std::vector<float>& weights) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  s.assign(T * E, 0.0f);
  cpu::linear(x, T, D, w.router, s.data());
  for (float& v : s) v = sigmoidf(v);
  weights.assign(T * k, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) sum += s[t * E + r.experts[t * k + i]];
    for (int64_t i = 0; i < k; ++i) {
      float wt = s[t * E + r.experts[t * k + i]];
      if (c.norm_topk_prob) wt /= sum + 1e-20f;  // normalised over the k chosen, +1e-20 as route_forward
      weights[t * k + i] = wt * static_cast<float>(c.routed_scaling_factor);
    }
  }
}

std::vector<ExpertTokens> expert_assignments(const Routing& r, int64_t T, int64_t E, int64_t k) {
  std::vector<ExpertTokens> out(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) out[r.experts[t * k + i]].emplace_back(t, i);
  return out;
}

void expert_backward(const MlpWeights& ew, float L, const float* x, const ExpertTokens& list, int64_t D, int64_t k,
                     const std::vector<float>& weights, const float* dy, float* dx, float* dweights, MlpWeights& dew) {
  if (list.empty()) return;
  const int64_t n = static_cast<int64_t>(list.size());
  std::vector<float> xin(n * D), out(n * D), dout(n * D), dxin(n * D, 0.0f);
  for (int64_t i = 0; i < n; ++i) std::copy_n(x + list[i].first * D, D, xin.data() + i * D);
  // The expert's output (for the gradient of its routing weight) and its backward share one set of activations.
  const SwigluActs acts = swiglu_acts(ew, L, xin.data(), n, D);
  cpu::linear(acts.act.data(), n, ew.gate.dim(0), ew.down, out.data());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = list[i].first, slot = t * k + list[i].second;
    float acc = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      acc += dy[t * D + d] * out[i * D + d];
      dout[i * D + d] = weights[slot] * dy[t * D + d];
    }
    dweights[slot] = acc;
  }
  swiglu_backward(ew, L, xin.data(), n, D, acts, dout.data(), dxin.data(), dew);
  if (dx)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) dx[list[i].first * D + d] += dxin[i * D + d];
}

void router_backward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& r,
                     const std::vector<float>& s, const float* dweights, float* dx, MoeWeights& dw) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const float rsf = static_cast<float>(c.routed_scaling_factor);
  // Weights from the sigmoid scores of the chosen experts: dlogits [T, E] is zero off the chosen ones.
  std::vector<float> dlogits(T * E, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0.0f, wdot = 0.0f;
    for (int64_t i = 0; i < k; ++i) {
      const float se = s[t * E + r.experts[t * k + i]];
      sum += se;
      wdot += dweights[t * k + i] * se;
    }
    const float Z = sum + 1e-20f;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = r.experts[t * k + i];
      const float ds = c.norm_topk_prob ? rsf * (dweights[t * k + i] / Z - wdot / (Z * Z)) : rsf * dweights[t * k + i];
      dlogits[t * E + e] += ds * s[t * E + e] * (1.0f - s[t * E + e]);
    }
  }
  cpu::linear_backward(x, T, D, w.router, dlogits.data(), dx, &dw.router);
}

void mlp_backward(const MlpWeights& w, float L, const float* x, int64_t T, int64_t D, const float* dy, float* dx,
                  MlpWeights& dw) {
  swiglu_backward(w, L, x, T, D, swiglu_acts(w, L, x, T, D), dy, dx, dw);
}

void moe_forward_routed(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& r,
                        float* y) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const float L = static_cast<float>(c.swiglu_limit);
  std::vector<float> s, weights;
  routed_weights(w, c, x, T, r, s, weights);
  if (w.shared) {
    mlp_forward(*w.shared, L, x, T, D, y);
  } else {
    std::fill(y, y + T * D, 0.0f);
  }
  const auto assigned = expert_assignments(r, T, E, k);
  for (int64_t e = 0; e < E; ++e) {
    const auto& list = assigned[e];
    if (list.empty()) continue;
    const int64_t n = static_cast<int64_t>(list.size());
    std::vector<float> xin(n * D), out(n * D);
    for (int64_t i = 0; i < n; ++i) std::copy_n(x + list[i].first * D, D, xin.data() + i * D);
    mlp_forward(w.experts[e], L, xin.data(), n, D, out.data());
    for (int64_t i = 0; i < n; ++i) {
      const float wt = weights[list[i].first * k + list[i].second];
      for (int64_t d = 0; d < D; ++d) y[list[i].first * D + d] += wt * out[i * D + d];
    }
  }
}

void moe_backward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& r,
                  const float* dy, float* dx, MoeWeights& dw) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const float L = static_cast<float>(c.swiglu_limit);
  std::vector<float> s, weights;
  routed_weights(w, c, x, T, r, s, weights);
  if (w.shared) mlp_backward(*w.shared, L, x, T, D, dy, dx, *dw.shared);
  // Experts on their gathered tokens: y[t] += w[t, i]·expert(x[t]).
  std::vector<float> dweights(T * k, 0.0f);
  const auto assigned = expert_assignments(r, T, E, k);
  for (int64_t e = 0; e < E; ++e)
    expert_backward(w.experts[e], L, x, assigned[e], D, k, weights, dy, dx, dweights.data(), dw.experts[e]);
  router_backward(w, c, x, T, r, s, dweights.data(), dx, dw);
}

}  // namespace nextlm
