// The grouped GEMV of a decoding step's MoE (see moe_decode.h): gemv.cuh's tensor-core GEMV per expert, with the
// epilogues of grouped_gemm.cu (fp32, fp32 added, bf16, and the fused clamped SwiGLU of its swiglu()).
// The CPU reference is nn.Linear per expert followed by moe.cu's swiglu: act = silu(min(g, L)) · clamp(u, −L, L).
#include "cuda/moe_decode.h"

#include <algorithm>

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/gemv.cuh"

namespace nextlm::cuda {

namespace {

// As grouped_gemm.cu's swiglu() (same clamps, __expf, one bf16 rounding by the caller).
__device__ __forceinline__ float swiglu(float g, float u, float L) {
  g = fminf(g, L);
  u = fminf(fmaxf(u, -L), L);
  return g / (1.0f + __expf(-g)) * u;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Persistent blocks. Each first lists the chosen (non-empty) experts in expert order: their rows and weights, in
// shared memory. Work item (k, rg): row group rg (Split::tiles tiles of 16 weight rows, or with SwiGLU of 8 act
// columns: their 8 gate and 8 up rows) of the k-th chosen expert, against all of its rows, 32 at a time; items run
// rg fastest, so that the blocks side by side share the expert's rows of A in L2.
template <bool kVec>
__global__ void __launch_bounds__(gemv::kThreads, gemv::kBlocksPerSm)
    moe_gemv_kernel(const bf16* __restrict__ A, const int32_t* __restrict__ offsets, const bf16* const* W, void* C,
                    int E, int N, int K, int epi, float L) {
  using Scan = cub::BlockScan<int, gemv::kThreads>;
  __shared__ float red[gemv::kWarps][gemv::kTileRows][gemv::kRedLd];
  __shared__ int32_t row0[kMoeDecodeMaxExperts], row1[kMoeDecodeMaxExperts];
  __shared__ const bf16* wts[kMoeDecodeMaxExperts];
  __shared__ typename Scan::TempStorage scan;
  __shared__ int chosen;

  // The chosen experts: thread i looks at experts i·per … i·per + per − 1, a block scan gives each its slots.
  const int per = (E + gemv::kThreads - 1) / gemv::kThreads, e0 = threadIdx.x * per;
  int cnt = 0;
  for (int i = 0; i < per; ++i) {
    const int e = e0 + i;
    cnt += e < E && offsets[e + 1] > offsets[e];
  }
  int slot, total;
  Scan(scan).ExclusiveSum(cnt, slot, total);
  for (int i = 0; i < per; ++i) {
    const int e = e0 + i;
    if (e < E && offsets[e + 1] > offsets[e]) {
      row0[slot] = offsets[e];
      row1[slot] = offsets[e + 1];
      wts[slot] = W[e];
      ++slot;
    }
  }
  if (threadIdx.x == 0) chosen = total;
  __syncthreads();

  const bool glu = epi == static_cast<int>(GroupedEpilogue::kSwiGLU);
  const int I = N / 2;
  const gemv::Split sp = gemv::split_of(K);
  // Tiles of 16 weight rows; with SwiGLU tile j holds gate rows 8j … 8j+7 then up rows I+8j … I+8j+7.
  const int ntiles = glu ? (I + 7) / 8 : (N + gemv::kTileRows - 1) / gemv::kTileRows;
  const int groups = (ntiles + sp.tiles - 1) / sp.tiles;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int tb = warp / sp.nchain, chain = warp % sp.nchain;
  const int64_t items = int64_t(chosen) * groups;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int k = static_cast<int>(item / groups), rg = static_cast<int>(item % groups);
    const int64_t r0 = row0[k], r1 = row1[k];
    const bf16* We = wts[k];
    const int tile = rg * sp.tiles + tb;
    const bool busy = tb < sp.tiles && tile < ntiles;
    // This lane's weight rows (tile rows g and g+8); past the end they read as zeros (pointers clamped, not read).
    const bf16 *w_lo, *w_hi;
    bool lo_ok, hi_ok;
    if (glu) {
      const int col = tile * 8 + g, cc = min(col, I - 1);
      lo_ok = hi_ok = col < I;
      w_lo = We + int64_t(cc) * K;
      w_hi = We + int64_t(I + cc) * K;
    } else {
      const int n_lo = tile * gemv::kTileRows + g, n_hi = n_lo + 8;
      lo_ok = n_lo < N;
      hi_ok = n_hi < N;
      w_lo = We + int64_t(min(n_lo, N - 1)) * K;
      w_hi = We + int64_t(min(n_hi, N - 1)) * K;
    }
    for (int64_t m0 = r0; m0 < r1; m0 += gemv::kPassRows) {
      const int rows = static_cast<int>(r1 - m0 < gemv::kPassRows ? r1 - m0 : gemv::kPassRows);
      if (busy) gemv::warp_pass<kVec>(w_lo, lo_ok, w_hi, hi_ok, A + m0 * K, K, rows, K, sp, chain, red[warp]);
      __syncthreads();
      if (glu) {
        bf16* act = static_cast<bf16*>(C);
        for (int idx = threadIdx.x; idx < sp.tiles * 8 * rows; idx += blockDim.x) {
          const int r = idx % 8, m = idx / 8 % rows, t = idx / 8 / rows;
          const int col = (rg * sp.tiles + t) * 8 + r;
          if (col < I) {
            const float gate = gemv::chain_sum(red, sp, t, r, m), up = gemv::chain_sum(red, sp, t, r + 8, m);
            act[(m0 + m) * I + col] = __float2bfloat16(swiglu(gate, up, L));
          }
        }
      } else {
        for (int idx = threadIdx.x; idx < sp.tiles * gemv::kTileRows * rows; idx += blockDim.x) {
          const int r = idx % gemv::kTileRows, m = idx / gemv::kTileRows % rows, t = idx / gemv::kTileRows / rows;
          const int n = (rg * sp.tiles + t) * gemv::kTileRows + r;
          if (n < N) {
            const float s = gemv::chain_sum(red, sp, t, r, m);
            const int64_t at = (m0 + m) * N + n;
            if (epi == static_cast<int>(GroupedEpilogue::kF32)) static_cast<float*>(C)[at] = s;
            else if (epi == static_cast<int>(GroupedEpilogue::kF32Add)) static_cast<float*>(C)[at] += s;
            else static_cast<bf16*>(C)[at] = __float2bfloat16(s);
          }
        }
      }
      __syncthreads();  // red is rewritten by the next pass
    }
  }
}

}  // namespace

void moe_decode_gemv(const GroupedGemm& g, cudaStream_t stream) {
  const bool glu = g.epilogue == GroupedEpilogue::kSwiGLU;
  check(!g.w_kn, "moe_decode_gemv: W must be [N, K] (w_kn = false)");
  check(g.N > 0 && (!glu || g.N % 2 == 0), "moe_decode_gemv: N must be positive (and even with SwiGLU), got ", g.N);
  check(g.K >= 0, "moe_decode_gemv: bad K ", g.K);
  check(g.E >= 1 && g.E <= kMoeDecodeMaxExperts, "moe_decode_gemv: E must be 1 … ", kMoeDecodeMaxExperts, ", got ",
        g.E);
  check(g.n >= 0 && g.n < (int64_t{1} << 31), "moe_decode_gemv: bad row count ", g.n);
  if (g.n == 0) return;
  const gemv::Split sp = gemv::split_of(g.K);
  const int64_t ntiles = glu ? ceil_div(g.N / 2, 8) : ceil_div(g.N, gemv::kTileRows);
  // At most min(n, E) experts are chosen; the blocks find out how many on the device.
  const int64_t items = std::min<int64_t>(g.n, g.E) * ceil_div(ntiles, sp.tiles);
  const unsigned grid = static_cast<unsigned>(gemv::grid_for(items));
  const int epi = static_cast<int>(g.epilogue);
  if (g.K % 8 == 0 && aligned16(g.A)) {
    moe_gemv_kernel<true><<<grid, gemv::kThreads, 0, stream>>>(g.A, g.offsets, g.W, g.C, g.E, g.N, g.K, epi, g.limit);
  } else {
    moe_gemv_kernel<false><<<grid, gemv::kThreads, 0, stream>>>(g.A, g.offsets, g.W, g.C, g.E, g.N, g.K, epi, g.limit);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nextlm::cuda
