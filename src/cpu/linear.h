// CPU GEMM entry points (OpenBLAS sgemm): the one matrix product every CPU layer goes through.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace nextlm::cpu {

// y[T, out] = x[T, in] · W[out, in]ᵀ, or y += … when accumulate.
void linear(const float* x, int64_t T, int64_t in, const Tensor& W, float* y, bool accumulate = false);

// C[M, N] = A[M, Kd] · B[N, Kd]ᵀ with explicit leading dimensions (row-major).
void gemm_nt(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
             int64_t ldc, bool accumulate = false);

// Threads used by OpenMP loops and by OpenBLAS.
void set_num_threads(int n);

}  // namespace nextlm::cpu
