// The KDA's causal conv over a warp's run of consecutive tokens, shared by the forward conv + SiLU + L2 norm
// (kda.cu) and the backward's dpre pass (kda_layer_backward.cu): lane l holds channels l + 32i (i < PER) of one
// (head, q/k/v) block of raw [T, 3·H·K], their W taps and the last W rows of raw, so each token reads one new row of
// raw and no weights. The conv of a channel at token t is Σ_w taps[w]·raw[t + w − (W−1)] over the taps inside t's
// sequence, in w order, as the one-token-a-warp kernels compute it. The new rows come kGroup tokens at a time, all
// their loads issued before the first is used (Group): one token's loads alone leave too few bytes in flight for
// these memory-bound kernels. nvcc only; internal to those two files.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace nextlm::cuda::kda_conv {

constexpr int kRunTokens = 16;  // tokens a warp runs (the default R below)
constexpr int kGroup = 4;       // tokens whose loads are issued together (divides every R)
static_assert(kRunTokens % kGroup == 0);

// Warp `wid`'s run of R tokens: the block (q, k or v) and head, and tokens [t0, t1); runs(T, H) of them.
struct Run {
  int64_t which, h, t0, t1;
};
template <int R = kRunTokens>
__device__ __forceinline__ int64_t runs(int64_t T, int64_t H) { return (T + R - 1) / R * H * 3; }
template <int R = kRunTokens>
__device__ __forceinline__ Run run_of(int64_t wid, int64_t T, int64_t H) {
  static_assert(R % kGroup == 0, "whole load groups a run");
  Run r;
  r.which = wid % 3, r.h = (wid / 3) % H, r.t0 = wid / (3 * H) * R;
  r.t1 = r.t0 + R < T ? r.t0 + R : T;
  return r;
}

// Per-lane values of kGroup consecutive tokens from t0, PER channels each (zero for tokens ≥ t1 or channels ≥ K), all
// loads issued before any is used. at(t, i): the value of token t for the lane's channel i.
template <int PER>
struct Group {
  float x[kGroup][PER];
  template <class At>
  __device__ __forceinline__ void load(int64_t t0, int64_t t1, int64_t K, At at) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < kGroup; ++u)
#pragma unroll
      for (int i = 0; i < PER; ++i) x[u][i] = t0 + u < t1 && lane + 32 * i < K ? at(t0 + u, i) : 0.0f;
  }
};

// The sequence starts of those tokens (0 past t1).
struct GroupStarts {
  int64_t s0[kGroup];
  __device__ __forceinline__ void load(const int32_t* seq_start, int64_t t0, int64_t t1) {
#pragma unroll
    for (int u = 0; u < kGroup; ++u) s0[u] = t0 + u < t1 ? seq_start[t0 + u] : 0;
  }
};

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
  // The rows of raw of the lane's channels for kGroup tokens from t0 (those before t1).
  __device__ __forceinline__ void fetch(Group<PER>& g, const float* raw, int64_t C3, int64_t K, int64_t t0,
                                        int64_t t1) const {
    g.load(t0, t1, K, [&](int64_t t, int i) { return raw[t * C3 + col + 32 * i]; });
  }
  // Channel i's conv at token t, whose sequence starts at s0, given x = raw[t] of the channel (then in the window;
  // channel < K).
  __device__ __forceinline__ float conv_at(float x, int64_t t, int64_t s0, int i) {
    // Every tap inside the sequence (warp-uniform): the same sum without the tests.
    if (t - (W - 1) >= s0) return conv_inside(x, i);
    rows[i][W - 1] = x;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w)
      if (t + w - (W - 1) >= s0) acc += taps[i][w] * rows[i][w];
    return acc;
  }
  // conv_at when the caller knows every tap of the token inside its sequence.
  __device__ __forceinline__ float conv_inside(float x, int i) {
    rows[i][W - 1] = x;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) acc += taps[i][w] * rows[i][w];
    return acc;
  }
  // On to the next token.
  __device__ __forceinline__ void shift() {
#pragma unroll
    for (int i = 0; i < PER; ++i)
#pragma unroll
      for (int w = 0; w + 1 < W; ++w) rows[i][w] = rows[i][w + 1];
  }
  // Walks the run's tokens kGroup at a time: their rows of raw and sequence starts are loaded together, with what
  // load(t0) adds, then body(u, t, pre) runs for each token t = t0 + u in order, pre[i] the conv of the lane's
  // channel i (0 for channels ≥ K).
  template <class Load, class Body>
  __device__ __forceinline__ void walk(const float* raw, const int32_t* seq_start, int64_t C3, int64_t K,
                                       const Run& r, Load load, Body body) {
    const int lane = threadIdx.x & 31;
    for (int64_t t0 = r.t0; t0 < r.t1; t0 += kGroup) {
      Group<PER> x;
      GroupStarts starts;
      fetch(x, raw, C3, K, t0, r.t1);
      starts.load(seq_start, t0, r.t1);
      load(t0);
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        const int64_t t = t0 + u;
        if (t >= r.t1) break;
        float pre[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) pre[i] = lane + 32 * i < K ? conv_at(x.x[u][i], t, starts.s0[u], i) : 0.0f;
        body(u, t, pre);
        shift();
      }
    }
  }
};

}  // namespace nextlm::cuda::kda_conv
