// The KDA's causal conv over a warp's run of consecutive tokens, shared by the forward conv + SiLU + L2 norm
// (kda.cu) and the backward's dpre pass (kda_layer_backward.cu): lane l holds channels l + 32i (i < PER) of one
// (head, q/k/v) block of raw [T, 3·H·K], their W taps and the last W rows of raw, so each token reads one new row of
// raw and no weights. The conv of a channel at token t is Σ_w taps[w]·raw[t + w − (W−1)] over the taps inside t's
// sequence, in w order, as the one-token-a-warp kernels compute it. nvcc only; internal to those two files.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace nextlm::cuda::kda_conv {

constexpr int kRunTokens = 16;  // tokens a warp runs

// Warp `wid`'s run: the block (q, k or v) and head, and tokens [t0, t1).
struct Run {
  int64_t which, h, t0, t1;
};
__device__ __forceinline__ int64_t runs(int64_t T, int64_t H) { return (T + kRunTokens - 1) / kRunTokens * H * 3; }
__device__ __forceinline__ Run run_of(int64_t wid, int64_t T, int64_t H) {
  Run r;
  r.which = wid % 3, r.h = (wid / 3) % H, r.t0 = wid / (3 * H) * kRunTokens;
  r.t1 = r.t0 + kRunTokens < T ? r.t0 + kRunTokens : T;
  return r;
}

template <int W, int PER>
struct Window {
  float taps[PER][W];
  float rows[PER][W];  // rows[i][w] = raw[t + w − (W−1)] of channel lane + 32i at token t (0 before token 0)
  int64_t col;         // the lane's first channel's column in raw: which·H·K + h·K + lane

  // The taps, and the W − 1 rows before the run, of the lane's channels below K.
  __device__ __forceinline__ void load(const float* raw, const float* conv, const Run& r, int64_t H, int64_t K) {
    const int lane = threadIdx.x & 31;
    const int64_t C3 = 3 * H * K;
    col = r.which * H * K + r.h * K + lane;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const bool on = lane + 32 * i < K;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const int64_t src = r.t0 + w - (W - 1);
        taps[i][w] = on ? conv[(col + 32 * i) * W + w] : 0.0f;
        rows[i][w] = on && w < W - 1 && src >= 0 ? raw[src * C3 + col + 32 * i] : 0.0f;
      }
    }
  }
  // Channel i's conv at token t, whose sequence starts at s0 (reads raw[t] into the window first; channel < K).
  __device__ __forceinline__ float conv_at(const float* raw, int64_t C3, int64_t t, int64_t s0, int i) {
    rows[i][W - 1] = raw[t * C3 + col + 32 * i];
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w)
      if (t + w - (W - 1) >= s0) acc += taps[i][w] * rows[i][w];
    return acc;
  }
  // On to the next token.
  __device__ __forceinline__ void shift() {
#pragma unroll
    for (int i = 0; i < PER; ++i)
#pragma unroll
      for (int w = 0; w + 1 < W; ++w) rows[i][w] = rows[i][w + 1];
  }
};

}  // namespace nextlm::cuda::kda_conv
