// The new token's share of a KDA decoding step, shared by the recurrent step (decode.cu) and the tensor-core step
// (kda_tc_decode.cu): the causal conv over the slot's history, SiLU and the L2 norms, in the forward's order.
// Device code only (nvcc).
#pragma once
#include "cuda/common.cuh"

namespace nextlm::cuda {

constexpr int kKdaMaxK = 128;

// The new token of row b, head h, in cache slot `slot`: the causal conv over [the slot's last W−1 pre-conv
// projections; raw] (the history shifted by one), SiLU and the L2 norms of q and k (q also × K^-1/2) in the lane
// order of kda_conv_norm, into qkv[3][K] in shared memory, rounded to bf16 when `round` (as the tensor-core forward
// stores them): what kda_conv_norm gives the forward for this token. Every thread of the block calls it; it ends
// with a barrier.
__device__ __forceinline__ void conv_norm_token(const float* raw, const float* conv, float* conv_hist, int64_t b,
                                                int64_t h, int64_t slot, int64_t H, int64_t K, int64_t W, bool round,
                                                float (*qkv)[kKdaMaxK], float* scale) {
  const int64_t HK = H * K, W1 = W - 1;
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t c = tid; c < 3 * K; c += nt) {
    const int64_t which = c / K, d = c % K, ch = which * HK + h * K + d;
    float* hist = conv_hist + (slot * 3 + which) * W1 * HK + h * K + d;
    const float* w = conv + ch * W;
    const float xn = raw[b * 3 * HK + ch];
    float acc = 0.0f;
    for (int64_t i = 0; i < W1; ++i) acc += w[i] * hist[i * HK];
    acc += w[W1] * xn;
    for (int64_t i = 0; i + 1 < W1; ++i) hist[i * HK] = hist[(i + 1) * HK];
    if (W1 > 0) hist[(W1 - 1) * HK] = xn;
    qkv[which][d] = silu(acc);
  }
  __syncthreads();
  if (tid < 32) {
    for (int which = 0; which < 2; ++which) {
      float ss = 0.0f;
      for (int64_t d = tid; d < K; d += 32) ss += qkv[which][d] * qkv[which][d];
      ss = warp_sum(ss);
      if (tid == 0) scale[which] = rsqrtf(ss + 1e-6f) * (which == 0 ? rsqrtf(static_cast<float>(K)) : 1.0f);
    }
  }
  __syncthreads();
  for (int64_t c = tid; c < 3 * K; c += nt) {
    const int64_t which = c / K, d = c % K;
    float v = qkv[which][d] * (which < 2 ? scale[which] : 1.0f);
    if (round) v = __bfloat162float(__float2bfloat16(v));
    qkv[which][d] = v;
  }
  __syncthreads();
}

}  // namespace nextlm::cuda
