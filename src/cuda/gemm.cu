// cuBLASLt bf16 × bf16 → fp32/bf16 GEMMs (fp32 accumulate) for every dense projection of the CUDA path.
#include "cuda/gemm.h"

#include <cstdio>
#include <cstdlib>

#include "core/env.h"
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
  lt(true, false, out, T, in, W, in, x, ldx, y, ytype, ldy, accumulate);
}

// Row-major dx[T, in] = dy[T, out]·W[out, in] is column-major dxᵀ[in, T] = W(as [in, out])·dyᵀ[out, T].
void Gemm::run_dx(const bf16* dy, int64_t lddy, const bf16* W, int64_t out, int64_t in, float* dx, int64_t lddx,
                  int64_t T, bool accumulate) {
  if (T == 0 || in == 0) return;
  lt(false, false, in, T, out, W, in, dy, lddy, dx, CUDA_R_32F, lddx, accumulate);
}

// Row-major dW[out, in] (+)= dy[T, out]ᵀ·x[T, in] is column-major dWᵀ[in, out] = xᵀ(as [in, T])·op_T(dyᵀ as
// [out, T]).
void Gemm::run_dw(const bf16* dy, int64_t lddy, const bf16* x, int64_t ldx, int64_t out, int64_t in, int64_t T,
                  float* dW, bool accumulate) {
  if (out == 0 || in == 0) return;
  if (T == 0) {
    if (!accumulate) NEXTLM_CUDA_CHECK(cudaMemsetAsync(dW, 0, out * in * sizeof(float), stream_));
    return;
  }
  lt(false, true, in, out, T, x, ldx, dy, lddy, dW, CUDA_R_32F, in, accumulate);
}

void Gemm::lt(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bf16* A, int64_t lda, const bf16* B,
              int64_t ldb, void* C, cudaDataType_t ctype, int64_t ldc, bool accumulate) {
  cublasLtMatmulDesc_t op;
  NEXTLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  NEXTLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  NEXTLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  cublasLtMatrixLayout_t la, lb, lc;
  // Stored shapes (column-major rows × columns): A is k×m when transposed, else m×k; B is n×k when transposed.
  NEXTLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
  NEXTLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
  NEXTLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, ctype, m, n, ldc));
  const AlgoKey key{ta, tb, m, n, k, lda, ldb, ldc, static_cast<int>(ctype), accumulate};
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    cublasLtMatmulPreference_t pref;
    NEXTLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    NEXTLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                             &workspace_bytes_, sizeof workspace_bytes_));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    NEXTLM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, op, la, lb, lc, lc, pref, 1, &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    check(found > 0, "cuBLASLt has no algorithm for a ", m, "x", n, "x", k, " GEMM");
    it = algos_.emplace(key, res.algo).first;
  }
  // NEXTLM_GEMM_LOG set (and not 0): one line a GEMM on stderr (operands' transposes, m, n, k, output type, beta),
  // for matching a kernel trace's cuBLASLt launches (one each, a split-K one followed by its reduction) to the
  // products.
  static const bool log = std::getenv("NEXTLM_GEMM_LOG") && env_switch_on("NEXTLM_GEMM_LOG");
  if (log)
    std::fprintf(stderr, "gemm %c%c m=%lld n=%lld k=%lld %s beta=%d\n", ta ? 'T' : 'N', tb ? 'T' : 'N',
                 static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                 ctype == CUDA_R_32F ? "f32" : "bf16", accumulate ? 1 : 0);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  NEXTLM_CUBLAS_CHECK(cublasLtMatmul(handle_, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &it->second, workspace_,
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
