// The DSA selection as the MLA attention kernels read it (mla_tc.cu, mla_tc_backward.cu, dsa_backward.cu): a bitmask
// per query over its sequence's positions, read 64 keys at a time, and the backward kernels' maps of which query and
// key tiles meet (selection_tiles_kernel).
#pragma once
#include <cstdint>

#include "cuda/common.cuh"  // exp2_ftz, which the attention kernels' softmax takes with these masks

namespace nextlm::cuda {

// Bits for positions p … p+63 that fall in [0, len).
__device__ __forceinline__ uint64_t range64(int64_t p, int64_t len) {
  const int64_t a = p < 0 ? -p : 0, b = len - p;  // in-window bit range [a, min(b, 64))
  if (b <= a || a >= 64) return 0;
  const uint64_t hi = b >= 64 ? ~0ull : ((1ull << b) - 1);
  return hi & ~((1ull << a) - 1);
}

// The mask words holding bits p … p+63 of a row of `words` 32-bit words (0 outside the row; p may be negative):
// load() issues the reads, bits() combines them, so that their latency can pass while the warp computes.
struct MaskWindow {
  uint32_t w[3];
  int r;
  __device__ __forceinline__ void load(const uint32_t* row, int64_t words, int64_t p) {
    const int64_t q = p >> 5;  // floor division, also for negative p
    r = static_cast<int>(p & 31);
#pragma unroll
    for (int i = 0; i < 3; ++i) w[i] = q + i >= 0 && q + i < words ? row[q + i] : 0u;
  }
  __device__ __forceinline__ uint64_t bits() const {
    const uint64_t lo = w[0] | (uint64_t(w[1]) << 32);
    return r ? (lo >> r) | (uint64_t(w[2]) << (64 - r)) : lo;
  }
};

// One block per query tile of TQ tokens: the bitmask rows of its tokens (mask, `words` words a row, zeroed before),
// the row of key tiles (TK keys each, absolute positions) it touches (tmap, wk words a row) and its bit in those key
// tiles' rows of query tiles (tmapT, wq words a row, zeroed before). A token with an empty selection (count 0)
// attends uniformly over its whole sequence: its key tiles are those of s0 … s0+len−1 and it sets no mask bits.
// wk ≤ MAXW (the shared key-tile row).
template <int TQ, int TK, int MAXW>
__global__ void selection_tiles_kernel(const int32_t* sel, const int32_t* count, const int32_t* seq_start,
                                       const int32_t* seq_len, uint32_t* mask, int64_t words, uint32_t* tmap,
                                       int64_t wk, uint32_t* tmapT, int64_t wq, int64_t T, int64_t max_sel) {
  __shared__ uint32_t tiles[MAXW];
  const int64_t qt = blockIdx.x;
  for (int64_t w = threadIdx.x; w < wk; w += blockDim.x) tiles[w] = 0;
  __syncthreads();
  for (int64_t t = qt * TQ; t < min(T, (qt + 1) * TQ); ++t) {
    const int64_t n = count[t], s0 = seq_start[t];
    if (n == 0) {
      const int64_t len = seq_len[t];
      if (len <= 0) continue;
      for (int64_t kt = s0 / TK + threadIdx.x; kt <= (s0 + len - 1) / TK; kt += blockDim.x)
        atomicOr(tiles + (kt >> 5), 1u << (kt & 31));
    } else {
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int32_t j = sel[t * max_sel + i];
        atomicOr(mask + t * words + (j >> 5), 1u << (j & 31));
        const int64_t kt = (s0 + j) / TK;
        atomicOr(tiles + (kt >> 5), 1u << (kt & 31));
      }
    }
  }
  __syncthreads();
  for (int64_t w = threadIdx.x; w < wk; w += blockDim.x) {
    uint32_t word = tiles[w];
    tmap[qt * wk + w] = word;
    for (; word; word &= word - 1) {
      const int64_t kt = w * 32 + __ffs(word) - 1;
      atomicOr(tmapT + kt * wq + (qt >> 5), 1u << (qt & 31));
    }
  }
}

}  // namespace nextlm::cuda
