// CUDA helpers shared by the kernels: error checks, bf16 conversions, warp/block reductions.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/error.h"

#define NEXTLM_CUDA_CHECK(expr)                                                                       \
  do {                                                                                                \
    cudaError_t err_ = (expr);                                                                        \
    if (err_ != cudaSuccess) ::nextlm::fail("CUDA error ", cudaGetErrorString(err_), " in ", #expr, \
                                           " at ", __FILE__, ":", __LINE__);                         \
  } while (0)

#define NEXTLM_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                              \
    cublasStatus_t st_ = (expr);                                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS) ::nextlm::fail("cuBLASLt error ", static_cast<int>(st_), " in ", \
                                                     #expr, " at ", __FILE__, ":", __LINE__);       \
  } while (0)

namespace nextlm::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result. `scratch` holds 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : 0.0f;
  r = warp_sum(r);
  return r;
}

// Integer sum over the block; every thread gets the result.
__device__ __forceinline__ int block_sum_int(int v) {
  __shared__ int part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  int r = lane < nwarps ? part[lane] : 0;
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

// 2^x by ex2.approx with results below 2^−126 flushed to zero. exp2f is the same instruction for x ≥ −126 (the same
// bits) and rescales around it below, a range check and two multiplies more per exponential in the softmax loops.
// The values it flushes are below fp32's normal range, far under anything a sum of them can show.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
// The KDA log decay from f = f_b(f_a(a)) + dt_bias and rate = e^A_log of its head: with a lower bound,
// bound·sigmoid(rate·f); else −rate·softplus(f) (f past 20 as itself). One definition for the fp32 forward's gate
// kernel, the decoding step and the chunked backward's prep, so that they form the same bits.
__device__ __forceinline__ float kda_gate_value(float f, float rate, bool has_bound, float bound) {
  return has_bound ? bound * (1.0f / (1.0f + expf(-rate * f))) : -rate * (f > 20.0f ? f : logf(1.0f + expf(f)));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// The current device's SM count, cached per device (so that later launches and graph captures make no attribute
// call).
inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  NEXTLM_CUDA_CHECK(cudaGetDevice(&dev));
  check(dev >= 0 && dev < kMaxDevices, "CUDA: device ordinal ", dev, " out of range");
  int sms = cache[dev].load(std::memory_order_relaxed);
  if (!sms) {
    NEXTLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Whether a pointer allows 16-byte vector accesses.
inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace nextlm::cuda
