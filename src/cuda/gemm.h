// bf16 GEMMs through cuBLASLt with fp32 accumulation: y[T, out] = x[T, in] · W[out, in]ᵀ.
#pragma once
#include <cstdint>
#include <map>
#include <tuple>

#include "cuda/common.cuh"

namespace nextlm::cuda {

class Gemm {
 public:
  explicit Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y (fp32, row stride ldy) = x (bf16, row stride ldx) · Wᵀ (+ y when accumulate). T may be 0.
  void run(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, float* y, int64_t ldy, int64_t T,
           bool accumulate = false);
  // Same with a bf16 result.
  void run_bf16(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, bf16* y, int64_t ldy, int64_t T);

 private:
  void launch(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, void* y, cudaDataType_t ytype,
              int64_t ldy, int64_t T, bool accumulate);
  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 64u << 20;
  // Cached algorithm per (out, in, T, ldx, ldy, type, accumulate).
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, bool>, cublasLtMatmulAlgo_t> algos_;
};

}  // namespace nextlm::cuda
