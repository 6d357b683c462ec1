// Clamped SwiGLU MLP and the MoE (routing in fp32 with the correction bias; experts run on their gathered tokens).
#include "model/moe.h"

#include <algorithm>
#include <numeric>

#include "cpu/linear.h"
#include "model/norm.h"

namespace nextlm {

void mlp_forward(const MlpWeights& w, float L, const float* x, int64_t T, int64_t D, float* y, bool accumulate) {
  const int64_t I = w.gate.dim(0);
  std::vector<float> g(T * I), u(T * I);
  cpu::linear(x, T, D, w.gate, g.data());
  cpu::linear(x, T, D, w.up, u.data());
  for (int64_t i = 0; i < T * I; ++i) g[i] = siluf(std::min(g[i], L)) * std::clamp(u[i], -L, L);
  cpu::linear(g.data(), T, I, w.down, y, accumulate);
}

Routing route_forward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, G = c.n_group, EG = E / G, k = c.num_experts_per_tok;
  std::vector<float> logits(T * E);
  cpu::linear(x, T, D, w.router, logits.data());
  Routing r;
  r.experts.resize(T * k);
  r.weights.resize(T * k);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> s(E), choice(E);
    for (int64_t e = 0; e < E; ++e) {
      s[e] = sigmoidf(logits[t * E + e]);
      choice[e] = s[e] + w.correction_bias.data[e];
    }
    // Group score = sum of the group's two best choice scores; keep the best topk_group groups.
    std::vector<float> gscore(G);
    for (int64_t g = 0; g < G; ++g) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int64_t e = g * EG; e < (g + 1) * EG; ++e) {
        if (choice[e] > b1) {
          b2 = b1;
          b1 = choice[e];
        } else if (choice[e] > b2) {
          b2 = choice[e];
        }
      }
      gscore[g] = b1 + b2;
    }
    std::vector<int64_t> groups(G);
    std::iota(groups.begin(), groups.end(), 0);
    std::partial_sort(groups.begin(), groups.begin() + c.topk_group, groups.end(),
                      [&](int64_t a, int64_t b) { return gscore[a] > gscore[b] || (gscore[a] == gscore[b] && a < b); });
    std::vector<int64_t> cand;
    for (int64_t gi = 0; gi < c.topk_group; ++gi)
      for (int64_t e = groups[gi] * EG; e < (groups[gi] + 1) * EG; ++e) cand.push_back(e);
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                      [&](int64_t a, int64_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) sum += s[cand[i]];
    for (int64_t i = 0; i < k; ++i) {
      float wt = s[cand[i]];
      if (c.norm_topk_prob) wt /= sum + 1e-20f;
      r.experts[t * k + i] = static_cast<int32_t>(cand[i]);
      r.weights[t * k + i] = wt * static_cast<float>(c.routed_scaling_factor);
    }
  }
  return r;
}

void moe_forward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, float* y) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const float L = static_cast<float>(c.swiglu_limit);
  const Routing r = route_forward(w, c, x, T);
  if (w.shared) {
    mlp_forward(*w.shared, L, x, T, D, y);
  } else {
    std::fill(y, y + T * D, 0.0f);
  }
  // Per expert: gather its tokens, run it, scatter-add weighted outputs (fixed token order, so deterministic).
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) assigned[r.experts[t * k + i]].emplace_back(t, r.weights[t * k + i]);
  for (int64_t e = 0; e < E; ++e) {
    const auto& list = assigned[e];
    if (list.empty()) continue;
    const int64_t n = static_cast<int64_t>(list.size());
    std::vector<float> xin(n * D), out(n * D);
    for (int64_t i = 0; i < n; ++i) std::copy(x + list[i].first * D, x + (list[i].first + 1) * D, xin.data() + i * D);
    mlp_forward(w.experts[e], L, xin.data(), n, D, out.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) y[list[i].first * D + d] += list[i].second * out[i * D + d];
  }
}

}  // namespace nextlm
