// Backward of the CPU GEMM entry points (OpenBLAS sgemm): the gradient products of y = x·Wᵀ.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace nextlm::cpu {

// Backward of y[T, out] = x[T, in]·W[out, in]ᵀ. Both results ACCUMULATE:
//   dx[T, in] += dy[T, out]·W      (skipped when dx is null)
//   dW[out, in] += dyᵀ·x           (skipped when dW is null)
void linear_backward(const float* x, int64_t T, int64_t in, const Tensor& W, const float* dy, float* dx, Tensor* dW);

// C[M, N] += A[M, Kd]·B[Kd, N] (row-major, explicit leading dimensions).
void gemm_nn_acc(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc);
// C[M, N] += A[Kd, M]ᵀ·B[Kd, N].
void gemm_tn_acc(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc);

}  // namespace nextlm::cpu
