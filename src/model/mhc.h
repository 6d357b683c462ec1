// Manifold-Constrained Hyper-Connections (transformers' Glm5NextTextHyperConnection): S residual streams are
// collapsed into the sub-layer input, and the sub-layer output is placed back with a Sinkhorn-normalised mixer.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace nextlm {

// Per-token mixing coefficients of one mHC site.
struct HcMix {
  std::vector<float> post;  // [T, S]     weight of the sub-layer output in each stream, in [0, 2]
  std::vector<float> comb;  // [T, S, S]  comb[t, r, s]: weight of old stream r in new stream s (doubly stochastic)
  std::vector<float> pre;   // [T, S]     collapse weights
};

// From the streams h [T, S, D]: the mixing coefficients, and the collapsed sub-layer input a [T, D].
void mhc_pre_forward(const HcWeights& w, const ModelConfig& c, const float* h, int64_t T, HcMix& mix, float* a);

// h_out[t, s] = post[t, s]·y[t] + Σ_r comb[t, r, s]·h[t, r]. h_out [T, S, D] may not alias h.
void mhc_post_forward(const HcMix& mix, const float* h, const float* y, int64_t T, int64_t S, int64_t D,
                      float* h_out);

// In place on one S×S matrix of softmax rows (+eps): column-normalise, then (iters−1) times row then column.
void sinkhorn_forward(float* C, int64_t S, int64_t iters, float eps);

}  // namespace nextlm
