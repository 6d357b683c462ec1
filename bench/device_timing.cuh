// Timing and checking helpers of the nvcc-compiled benchmarks (bench/*.cu): the median of CUDA-event timings of
// work enqueued on a stream, and the relative error of two device arrays.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/common.cuh"

namespace nextlm::bench {

// Median milliseconds of f() (enqueued on st) over `iters` timed runs after `warm` untimed ones.
template <class F>
double median_ms(F&& f, cudaStream_t st, int warm, int iters) {
  for (int i = 0; i < warm; ++i) f();
  cudaEvent_t a, b;
  NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
  NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    NEXTLM_CUDA_CHECK(cudaEventRecord(a, st));
    f();
    NEXTLM_CUDA_CHECK(cudaEventRecord(b, st));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Two forms of the same work timed alternately, `rounds` times each (median_ms of each, a then b): the medians of each
// form's runs, sorted (the middle one is the figure to report).
template <class A, class B>
void alternate_medians(A&& a, B&& b, cudaStream_t st, int warm, int iters, int rounds, std::vector<double>& ma,
                       std::vector<double>& mb) {
  ma.clear(), mb.clear();
  for (int r = 0; r < rounds; ++r) {
    ma.push_back(median_ms(a, st, warm, iters));
    mb.push_back(median_ms(b, st, warm, iters));
  }
  std::sort(ma.begin(), ma.end());
  std::sort(mb.begin(), mb.end());
}

// ‖a − b‖ / ‖b‖ over n elements of two device arrays (bf16 or fp32) copied to the host; a non-finite element gives
// +inf.
template <class T>
double device_rel_err(const T* a, const T* b, int64_t n) {
  std::vector<T> ha(n), hb(n);
  NEXTLM_CUDA_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(T), cudaMemcpyDeviceToHost));
  NEXTLM_CUDA_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(T), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    double x, y;
    if constexpr (sizeof(T) == 2) {
      x = __bfloat162float(ha[i]);
      y = __bfloat162float(hb[i]);
    } else {
      x = ha[i];
      y = hb[i];
    }
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace nextlm::bench
