// OpenBLAS-backed gradient GEMMs for the CPU reference backward (see linear_backward.h).
#include "cpu/linear_backward.h"

#include <cblas.h>

#include "core/error.h"

namespace nextlm::cpu {

void gemm_nn_acc(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc) {
  if (M == 0 || N == 0 || Kd == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(Kd), 1.0f, A, static_cast<int>(lda), B, static_cast<int>(ldb), 1.0f, C,
              static_cast<int>(ldc));
}

void gemm_tn_acc(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc) {
  if (M == 0 || N == 0 || Kd == 0) return;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(Kd), 1.0f, A, static_cast<int>(lda), B, static_cast<int>(ldb), 1.0f, C,
              static_cast<int>(ldc));
}

void linear_backward(const float* x, int64_t T, int64_t in, const Tensor& W, const float* dy, float* dx, Tensor* dW) {
  check(W.shape.size() == 2 && W.shape[1] == in, "linear_backward: weight shape ", shape_str(W.shape),
        " does not take ", in, " inputs");
  const int64_t out = W.shape[0];
  if (dx) gemm_nn_acc(T, in, out, dy, out, W.ptr(), in, dx, in);
  if (dW) {
    check(dW->shape == W.shape, "linear_backward: gradient shape ", shape_str(dW->shape), " is not ",
          shape_str(W.shape));
    gemm_tn_acc(out, in, T, dy, out, x, in, dW->ptr(), in);
  }
}

}  // namespace nextlm::cpu
