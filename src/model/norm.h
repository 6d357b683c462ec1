// Normalisations and pointwise functions of the glm5_next forward, in fp32 (transformers' Glm5NextTextRMSNorm,
// the unweighted mHC input norm, the gated KDA output norm and the indexer's LayerNorm).
#pragma once
#include <cmath>
#include <cstdint>

namespace nextlm {

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float siluf(float x) { return x / (1.0f + std::exp(-x)); }

// y[t] = w ⊙ x[t]·rsqrt(mean(x[t]²) + eps) over rows of width D; w may be null (unweighted). y may alias x.
void rmsnorm_forward(const float* x, const float* w, float* y, int64_t T, int64_t D, float eps);

// y[t] = (x[t] − mean)·rsqrt(var + eps)·w + b (biased variance, as torch.nn.LayerNorm). y may alias x.
void layernorm_forward(const float* x, const float* w, const float* b, float* y, int64_t T, int64_t D, float eps);

}  // namespace nextlm
