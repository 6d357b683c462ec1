// Feed-forward sub-layers: the clamped SwiGLU MLP (dense layers, experts, shared expert) and the sigmoid-routed
// MoE with grouped top-k and a correction bias (transformers' Glm5NextTextMLP, Glm5NextTextTopkRouter,
// Glm5NextTextExperts, Glm5NextTextMoE).
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace nextlm {

// y[T, D] = down(silu(min(gate·x, L)) ⊙ clamp(up·x, −L, L)), or y += … when accumulate.
void mlp_forward(const MlpWeights& w, float limit, const float* x, int64_t T, int64_t D, float* y,
                 bool accumulate = false);

// Router choice for every token: expert ids [T, k] and their weights [T, k].
struct Routing {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};
Routing route_forward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T);

// y[T, D] = Σ_k w_k·expert_k(x) + shared(x).
void moe_forward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, float* y);

}  // namespace nextlm
