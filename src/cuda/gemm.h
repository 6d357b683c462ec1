// bf16 GEMMs with fp32 accumulation: y[T, out] = x[T, in] · W[out, in]ᵀ, through cuBLASLt, or in batch-invariant
// mode through our own tiled GEMM (grouped_gemm.h with one group), whose reduction order for an output element
// depends on the shapes only: cuBLASLt picks its algorithm (tile shape, split-K) by T, so a row's result there may
// change with the rows that share its batch.
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
  // The backward's GEMMs (always cuBLASLt): dx (fp32, row stride lddx) (+)= dy (bf16 [T, out], row stride lddy) · W
  // [out, in]; and dW (fp32 [out, in]) (+)= dyᵀ · x (bf16 [T, in], row stride ldx), a sum over the T rows.
  void run_dx(const bf16* dy, int64_t lddy, const bf16* W, int64_t out, int64_t in, float* dx, int64_t lddx, int64_t T,
              bool accumulate = true);
  void run_dw(const bf16* dy, int64_t lddy, const bf16* x, int64_t ldx, int64_t out, int64_t in, int64_t T, float* dW,
              bool accumulate = true);
  // Batch-invariant mode from now on (off by default). Shapes our GEMM does not take (in or out not a multiple of
  // 8, strided rows) stay on cuBLASLt with a one-time warning.
  void set_batch_invariant(bool on) { invariant_ = on; }
  bool batch_invariant() const { return invariant_; }

 private:
  void launch(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, void* y, cudaDataType_t ytype,
              int64_t ldy, int64_t T, bool accumulate);
  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 64u << 20;
  // Column-major C[m, n] (row stride ldc) (+)= op(A)·op(B) on cuBLASLt, A and B bf16, fp32 accumulation.
  void lt(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bf16* A, int64_t lda, const bf16* B, int64_t ldb,
          void* C, cudaDataType_t ctype, int64_t ldc, bool accumulate);
  // Cached algorithm per (ops, m, n, k, leading dimensions, output type, accumulate).
  using AlgoKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool>;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos_;
  bool invariant_ = false;
  bool warned_ = false;
  // Batch-invariant mode: the one-group schedule (offsets {0, T}, the weight pointer, the tile prefix sum).
  int32_t* group_ = nullptr;
  bool invariant_launch(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, void* y,
                        cudaDataType_t ytype, int64_t ldy, int64_t T, bool accumulate);
};

}  // namespace nextlm::cuda
