// cuBLASLt bf16 × bf16 → fp32/bf16 GEMMs (fp32 accumulate) for every dense projection of the CUDA path.
#include "cuda/gemm.h"

namespace nextlm::cuda {

Gemm::Gemm(cudaStream_t stream) : stream_(stream) {
  NEXTLM_CUBLAS_CHECK(cublasLtCreate(&handle_));
  NEXTLM_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Gemm::~Gemm() {
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

void Gemm::run(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, float* y, int64_t ldy, int64_t T,
               bool accumulate) {
  launch(x, ldx, W, out, in, y, CUDA_R_32F, ldy, T, accumulate);
}

void Gemm::run_bf16(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, bf16* y, int64_t ldy,
                    int64_t T) {
  launch(x, ldx, W, out, in, y, CUDA_R_16BF, ldy, T, false);
}

// Row-major y[T,out] = x[T,in]·W[out,in]ᵀ is column-major yᵀ[out,T] = op(W)·xᵀ with W read as a column-major
// [in, out] matrix transposed.
void Gemm::launch(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, void* y, cudaDataType_t ytype,
                  int64_t ldy, int64_t T, bool accumulate) {
  if (T == 0 || out == 0) return;
  cublasLtMatmulDesc_t op;
  NEXTLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  NEXTLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  NEXTLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  cublasLtMatrixLayout_t la, lb, lc;
  NEXTLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, in, out, in));
  NEXTLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, in, T, ldx));
  NEXTLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, ytype, out, T, ldy));
  const auto key = std::make_tuple(out, in, T, ldx, ldy, static_cast<int>(ytype), accumulate);
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    cublasLtMatmulPreference_t pref;
    NEXTLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    NEXTLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                             &workspace_bytes_, sizeof workspace_bytes_));
    cublasLtMatmulHeuristicResult_t res;
    int n = 0;
    NEXTLM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, op, la, lb, lc, lc, pref, 1, &res, &n));
    cublasLtMatmulPreferenceDestroy(pref);
    check(n > 0, "cuBLASLt has no algorithm for a ", out, "x", in, " x T=", T, " GEMM");
    it = algos_.emplace(key, res.algo).first;
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  NEXTLM_CUBLAS_CHECK(cublasLtMatmul(handle_, op, &alpha, W, la, x, lb, &beta, y, lc, y, lc, &it->second, workspace_,
                                     workspace_bytes_, stream_));
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
}

}  // namespace nextlm::cuda
