// cuBLASLt bf16 × bf16 → fp32/bf16 GEMMs (fp32 accumulate) for every dense projection of the CUDA path.
#include "cuda/gemm.h"

#include <cstdio>

#include "cuda/decode_kernels.h"
#include "cuda/grouped_gemm.h"

namespace nextlm::cuda {

namespace {

// The single group of a dense GEMM run as a grouped one: offsets {0, T}, the weight pointer, and room for the
// schedule's prefix sum (grouped_gemm_workspace_ints(1) = 2 ints).
struct OneGroup {
  int32_t offsets[2];
  int32_t start[2];
  const bf16* W[1];
};

__global__ void set_group_kernel(OneGroup* g, int32_t T, const bf16* W) {
  g->offsets[0] = 0;
  g->offsets[1] = T;
  g->W[0] = W;
}

}  // namespace

Gemm::Gemm(cudaStream_t stream) : stream_(stream) {
  NEXTLM_CUBLAS_CHECK(cublasLtCreate(&handle_));
  NEXTLM_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  NEXTLM_CUDA_CHECK(cudaMalloc(&group_, sizeof(OneGroup)));
}

Gemm::~Gemm() {
  cudaFree(group_);
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
  if (invariant_ && invariant_launch(x, ldx, W, out, in, y, ytype, ldy, T, accumulate)) return;
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

// The kernel variant depends on the output width only (never on T), so a row's result does not depend on its batch.
bool Gemm::invariant_launch(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, void* y,
                            cudaDataType_t ytype, int64_t ldy, int64_t T, bool accumulate) {
  const bool f32 = ytype == CUDA_R_32F;
  if (in % 8 || out % 8 || ldx != in || ldy != out || T >= (int64_t{1} << 31)) {
    // Narrow or strided projections (e.g. the per-head beta projection): the decoding GEMV, also M-independent.
    if (f32 && T <= 65535 * int64_t{8}) {
      decode_linear(x, ldx, W, out, in, static_cast<float*>(y), ldy, T, accumulate, stream_);
      return true;
    }
    if (!warned_)
      std::fprintf(stderr, "warning: batch-invariant GEMM: a %lldx%lld projection (row strides %lld, %lld) stays on "
                   "cuBLASLt, whose results may depend on the batch\n", static_cast<long long>(out),
                   static_cast<long long>(in), static_cast<long long>(ldx), static_cast<long long>(ldy));
    warned_ = true;
    return false;
  }
  auto* g = reinterpret_cast<OneGroup*>(group_);
  set_group_kernel<<<1, 1, 0, stream_>>>(g, static_cast<int32_t>(T), W);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  GroupedGemm gg{x, g->offsets, g->W, y, T, 1, static_cast<int>(out), static_cast<int>(in),
                 f32 ? (accumulate ? GroupedEpilogue::kF32Add : GroupedEpilogue::kF32) : GroupedEpilogue::kBf16};
  gg.kernel = out >= 2048 ? GroupedGemmKernel::kWgmma128x256 : GroupedGemmKernel::kWgmma128x128;
  grouped_gemm(gg, g->start, stream_);
  return true;
}

}  // namespace nextlm::cuda
