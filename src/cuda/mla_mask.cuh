// The DSA selection as the MLA attention kernels read it (mla_tc.cu, mla_tc_backward.cu): a bitmask per query over
// its sequence's positions, read 64 keys at a time.
#pragma once
#include <cstdint>

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

}  // namespace nextlm::cuda
