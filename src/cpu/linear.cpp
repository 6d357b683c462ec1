// OpenBLAS-backed fp32 GEMMs for the CPU reference path.
#include "cpu/linear.h"

#include <cblas.h>
#include <omp.h>

#include "core/error.h"

namespace nextlm::cpu {

void gemm_nt(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
             int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return;
  if (Kd == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = 0.0f;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(Kd), 1.0f, A, static_cast<int>(lda), B, static_cast<int>(ldb),
              accumulate ? 1.0f : 0.0f, C, static_cast<int>(ldc));
}

void linear(const float* x, int64_t T, int64_t in, const Tensor& W, float* y, bool accumulate) {
  check(W.shape.size() == 2 && W.shape[1] == in, "linear: weight shape ", shape_str(W.shape), " does not take ", in,
        " inputs");
  gemm_nt(T, W.shape[0], in, x, in, W.ptr(), in, y, W.shape[0], accumulate);
}

void set_num_threads(int n) {
  if (n <= 0) return;
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

}  // namespace nextlm::cpu
