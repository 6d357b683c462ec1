// Backward of the mHC sites, of RMSNorm and of the final stream mean + norm on the GPU, fp32; matches
// src/model/mhc_backward.cpp, norm_backward.cpp and head_backward.cpp (and the forwards of src/cuda/mhc.cu, misc.cu).
//
// mhc_pre_backward reads h twice and updates dh once, in four kernels:
//  1. statistics (grid: token tiles × d-chunks): per token, the projection fn·h, the Gram matrix G[s, s'] =
//     Σ_d h_s·h_s' and A[s] = Σ_d norm_w·da·h_s, from one pass over h and da (cp.async pipeline, register tiles).
//     The collapse x = Σ_s pre_s·h_s is linear in h, so its norm's sums follow from G and A once pre is known:
//     Σx² = preᵀ·G·pre, Σ w·da·x = pre·A, Σ_d x·h_s = (G·pre)_s; and Σh² = trace G. Given the forward's mix
//     (training keeps it: fn·h and Σh² as mhc_pre summed them), G and A alone (mhc_bwd_gram_kernel, a warp a
//     token, streaming), and the coefficients are the forward's bit for bit.
//  2. coefficients (a thread per token): the chunk partials summed in chunk order, the coefficients recomputed with
//     the forward's operations (mhc_apply_kernel: sigmoid, softmax, Sinkhorn), the Sinkhorn and softmax backward,
//     the sub-layer norm's r2, c2 and dpre, then dm = dL/dm, r1 and c1 of the input norm, per token; and the
//     32-token partials of dbase and dscale.
//  3. apply (grid: 32-wide d tiles × token blocks; warp s owns stream s of the tile): a pass over h, da and dh that
//     holds fn's columns in registers: dh += pre_s·dx (sub-layer norm and collapse) + r1·Σ_j dm_j·fn_j − c1·h
//     (input norm), and the dfn and dnorm_w partials of the block's tokens, in token order.
//  4. parameters: dfn, dnorm_w, dbase and dscale summed from the partials in block order.
// Without the parameter gradients (a LoRA step), 3 is mhc_bwd_dh_kernel at S ≤ 4 (a thread a column of all streams:
// dh alone, the same bits) and 4 does not run.
// Every parameter gradient is summed in an order fixed by T, S and D (no atomics), so it is reproducible run to run.
// Without the forward's mix, the mix (fn·h, Σh²) is summed in another order than the forward's projection, so it
// differs from the forward's by rounding; the coefficients are then computed from it with the forward's operations
// in the forward's order.
//
// mhc_post_backward: a block a token, float4 streams through dout, h, y and dy, dh (read-modify-write).
#include <algorithm>

#include "cuda/backward_kernels.h"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Sums NV per-thread values over the block (blockDim.x == NT); out[i] (shared) holds the sums afterwards, for every
// thread. red: (NT / 32)·NV shared floats. Warps are summed in warp order.
template <int NV, int NT = kThreads>
__device__ __forceinline__ void block_sum_to(const float (&v)[NV], float* red, float* out) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const float s = warp_sum(v[i]);
    if (lane == 0) red[warp * NV + i] = s;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NV; i += NT) {
    float s = red[i];
    for (int w = 1; w < NW; ++w) s += red[w * NV + i];
    out[i] = s;
  }
  __syncthreads();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 4-byte asynchronous copy global → shared; valid false zero-fills.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
// VEC: 16 bytes (4 floats), else 4.
template <bool VEC>
__device__ __forceinline__ void cp_async_f(float* dst, const float* src, bool valid) {
  if constexpr (VEC) {
    cp_async16(dst, src, valid);
  } else {
    cp_async4(dst, src, valid);
  }
}

// Component c of v (c a compile-time constant after unrolling, so no local memory).
__device__ __forceinline__ float comp(const float4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// ---- RMSNorm ----

// One block a row: r = rsqrt(mean(x²) + eps), c = r³·Σ(w⊙dy⊙x)/n, and v = r·w·dy − c·x added (times scale) into
// the rep rows dx[row·rep + s] (rep = S and scale = 1/S spread the gradient of a stream mean over its streams), or
// without acc written there. rs[row] = r when rs is not null (for dw).
__global__ void __launch_bounds__(kThreads)
    rmsnorm_bwd_rows_kernel(const float* x, int64_t ldx, const float* w, const float* dy, float* dx, int64_t rep,
                            float scale, float* rs, int64_t n, float eps, bool acc) {
  __shared__ float red[kWarps * 2];
  __shared__ float sums[2];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * ldx;
  const float* gr = dy + row * n;
  float v[2] = {0.0f, 0.0f};
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float xi = xr[i];
    v[0] = fmaf(xi, xi, v[0]);
    v[1] = fmaf((w ? w[i] : 1.0f) * gr[i], xi, v[1]);
  }
  block_sum_to<2>(v, red, sums);
  const float r = rsqrtf(sums[0] / static_cast<float>(n) + eps);
  const float c = (sums[1] / static_cast<float>(n)) * r * r * r;
  if (rs && threadIdx.x == 0) rs[row] = r;
  if (!dx) return;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float g = r * (w ? w[i] : 1.0f) * gr[i] - c * xr[i];
    for (int64_t s = 0; s < rep; ++s) {
      float& o = dx[(row * rep + s) * n + i];
      o = acc ? o + g * scale : g * scale;
    }
  }
}

constexpr int64_t kNormRowsPerBlock = 256;  // rows summed by one block of the dw partials

int64_t norm_row_blocks(int64_t rows) { return ceil_div(rows, kNormRowsPerBlock); }

// Grid (column blocks, row blocks): part[b, i] = Σ_{rows of block b} dy·x·r, rows in order.
__global__ void rmsnorm_dw_part_kernel(const float* x, int64_t ldx, const float* dy, const float* rs, float* part,
                                       int64_t rows, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, b = blockIdx.y;
  if (i >= n) return;
  const int64_t r0 = b * kNormRowsPerBlock, r1 = min(rows, r0 + kNormRowsPerBlock);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += dy[r * n + i] * x[r * ldx + i] * rs[r];
  part[b * n + i] = acc;
}

// out[i] += Σ_b part[b, i] in block order.
__global__ void sum_parts_kernel(const float* part, float* out, int64_t nb, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float acc = part[i];
    for (int64_t b = 1; b < nb; ++b) acc += part[b * n + i];
    out[i] += acc;
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 65535)); }

void rmsnorm_backward_impl(const float* x, int64_t ldx, const float* w, const float* dy, float* dx, int64_t rep,
                           float scale, float* dw, int64_t rows, int64_t n, float eps, float* work, cudaStream_t st,
                           bool accumulate = true) {
  if (!rows || !n) return;
  float* rs = w && dw ? work : nullptr;
  rmsnorm_bwd_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, st>>>(x, ldx, w, dy, dx, rep, scale, rs, n,
                                                                            eps, accumulate);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (!rs) return;
  const int64_t nb = norm_row_blocks(rows);
  float* part = work + rows;
  rmsnorm_dw_part_kernel<<<dim3(static_cast<unsigned>(ceil_div(n, 256)), static_cast<unsigned>(nb)), 256, 0, st>>>(
      x, ldx, dy, rs, part, rows, n);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  sum_parts_kernel<<<grid_for(n), 256, 0, st>>>(part, dw, nb, n);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

// out[t, d] = mean_s h[t, s, d], summed in stream order as the forward.
__global__ void stream_mean_kernel(const float* h, float* out, int64_t T, int64_t S, int64_t D) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * D; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, d = i % D;
    float acc = 0.0f;
    for (int64_t s = 0; s < S; ++s) acc += h[(t * S + s) * D + d];
    out[i] = acc / static_cast<float>(S);
  }
}

// ---- mHC post ----

constexpr int kPostThreads = 128;

// One block a token: dy += Σ_s post_s·g_s, dh_r += Σ_s comb[r, s]·g_s, and the sums over d of g_s·y (dpost) and
// g_s·h_r (dcomb). VEC: 4 consecutive d a thread (D and the bases a multiple of 4 floats). ACC: add into dh, dy,
// dpost and dcomb; else write them (every element of the token's rows has one writer), without reading them first.
// SUMS false: dpost and dcomb are not wanted (null), and h and y are not read. dout, h and y must not overlap dh or
// dy.
template <int S, bool VEC, bool ACC, bool SUMS = true>
__global__ void __launch_bounds__(kPostThreads)
    mhc_post_bwd_kernel(const float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ post,
                        const float* __restrict__ comb, const float* __restrict__ dout, float* __restrict__ dh,
                        float* __restrict__ dy, bf16* __restrict__ dy16, float* __restrict__ dpost,
                        float* __restrict__ dcomb, int64_t D) {
  constexpr int NV = S + S * S;
  __shared__ float red[(kPostThreads / 32) * NV];
  __shared__ float sums[NV];
  const int64_t t = blockIdx.x;
  float P[S], C[S * S];
#pragma unroll
  for (int s = 0; s < S; ++s) P[s] = post[t * S + s];
#pragma unroll
  for (int i = 0; i < S * S; ++i) C[i] = comb[t * S * S + i];
  float acc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
  const float* gt = dout + t * S * D;
  const float* ht = h + t * S * D;
  if constexpr (VEC) {
    const int64_t D4 = D / 4;
#pragma unroll 2
    for (int64_t i = threadIdx.x; i < D4; i += kPostThreads) {
      const int64_t d = 4 * i;
      float4 g[S], hr[S];
#pragma unroll
      for (int s = 0; s < S; ++s) {
        g[s] = *reinterpret_cast<const float4*>(gt + s * D + d);
        if constexpr (SUMS) hr[s] = *reinterpret_cast<const float4*>(ht + s * D + d);
      }
      const float4 yv = SUMS ? *reinterpret_cast<const float4*>(y + t * D + d) : float4{};
      if (dy || dy16) {
        float4* p = reinterpret_cast<float4*>(dy + t * D + d);
        float4 o = ACC ? *p : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float v = 0.0f;
#pragma unroll
          for (int s = 0; s < S; ++s) v = fmaf(P[s], comp(g[s], c), v);
          (c == 0 ? o.x : c == 1 ? o.y : c == 2 ? o.z : o.w) += v;
        }
        if (dy) *p = o;
        if (dy16) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x, o.y), hi = __floats2bfloat162_rn(o.z, o.w);
          *reinterpret_cast<uint2*>(dy16 + t * D + d) =
              make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
        }
      }
      if (dh) {
#pragma unroll
        for (int r = 0; r < S; ++r) {
          float4* p = reinterpret_cast<float4*>(dh + (t * S + r) * D + d);
          float4 o = ACC ? *p : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float v = 0.0f;
#pragma unroll
            for (int s = 0; s < S; ++s) v = fmaf(C[r * S + s], comp(g[s], c), v);
            (c == 0 ? o.x : c == 1 ? o.y : c == 2 ? o.z : o.w) += v;
          }
          *p = o;
        }
      }
      if constexpr (SUMS)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int s = 0; s < S; ++s) {
            acc[s] = fmaf(comp(g[s], c), comp(yv, c), acc[s]);
#pragma unroll
            for (int r = 0; r < S; ++r)
              acc[S + r * S + s] = fmaf(comp(g[s], c), comp(hr[r], c), acc[S + r * S + s]);
          }
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kPostThreads) {
      float g[S], hr[S];
#pragma unroll
      for (int s = 0; s < S; ++s) g[s] = gt[s * D + d], hr[s] = SUMS ? ht[s * D + d] : 0.0f;
      const float yv = SUMS ? y[t * D + d] : 0.0f;
      if (dy || dy16) {
        float v = 0.0f;
#pragma unroll
        for (int s = 0; s < S; ++s) v = fmaf(P[s], g[s], v);
        if (ACC) v += dy[t * D + d];
        if (dy) dy[t * D + d] = v;
        if (dy16) dy16[t * D + d] = __float2bfloat16_rn(v);
      }
      if (dh) {
#pragma unroll
        for (int r = 0; r < S; ++r) {
          float v = 0.0f;
#pragma unroll
          for (int s = 0; s < S; ++s) v = fmaf(C[r * S + s], g[s], v);
          dh[(t * S + r) * D + d] = ACC ? dh[(t * S + r) * D + d] + v : v;
        }
      }
      if constexpr (SUMS)
#pragma unroll
        for (int s = 0; s < S; ++s) {
          acc[s] = fmaf(g[s], yv, acc[s]);
#pragma unroll
          for (int r = 0; r < S; ++r) acc[S + r * S + s] = fmaf(g[s], hr[r], acc[S + r * S + s]);
        }
    }
  }
  if constexpr (!SUMS) return;
  block_sum_to<NV, kPostThreads>(acc, red, sums);
  if (dpost && threadIdx.x < S)
    dpost[t * S + threadIdx.x] = (ACC ? dpost[t * S + threadIdx.x] : 0.0f) + sums[threadIdx.x];
  if (dcomb && threadIdx.x < S * S)
    dcomb[t * S * S + threadIdx.x] = (ACC ? dcomb[t * S * S + threadIdx.x] : 0.0f) + sums[S + threadIdx.x];
}

// ---- mHC pre, kernel 1: the token statistics ----

constexpr int kStatThreads = 128;
constexpr int kStatWarps = kStatThreads / 32;
constexpr int kStatDK = 4 * kStatWarps;  // d's of a tile: warp w takes d 4w … 4w+3 (one float4) of every stream
constexpr int kStatStages = 3;
constexpr int64_t kStatBlocks = 256;  // token tiles × d-chunks aimed at: 2 blocks an SM, one wave on an H200

__host__ __device__ constexpr int gram_count(int S) { return S * (S + 1) / 2; }
// Index of G[a, b] (a ≤ b) among the upper-triangle entries, row by row.
__host__ __device__ constexpr int gram_index(int S, int a, int b) { return a * S - a * (a - 1) / 2 + (b - a); }
// Values a token gets from the statistics kernel: fn·h [M] (proj: unless the forward's mix is given), G [S(S+1)/2],
// A [S].
__host__ __device__ constexpr int stat_values(int S, bool proj = true) {
  return (proj ? (2 + S) * S : 0) + gram_count(S) + S;
}
// Tokens a lane holds: 2 (48 projection accumulators) up to S = 4, else 1.
__host__ __device__ constexpr int stat_tq(int S) { return S <= 4 ? 2 : 1; }

// Shared-memory tiles of the statistics kernel: BT tokens (lane l holds tokens l, l + 32, …), kStatDK d's of each
// stream. h rows are [S][kStatDK] plus 4 floats of padding: LDH/4 is odd, so the 16-byte reads of 8 consecutive
// lanes (8 rows) hit distinct banks; so do da's rows (LDA).
template <int S>
struct StatTile {
  static constexpr int M = (2 + S) * S;
  static constexpr int NG = gram_count(S);
  static constexpr int NP = stat_values(S);
  static constexpr int TQ = stat_tq(S);
  static constexpr int BT = 32 * TQ;
  static constexpr int LDH = S * kStatDK + 4;
  static constexpr int LDA = kStatDK + 4;
  static constexpr int h_floats = BT * LDH;
  static constexpr int f_floats = M * S * kStatDK;  // fn rows (j, s): [M·S][kStatDK]
  static constexpr int a_floats = BT * LDA;
  static constexpr int stage_floats = h_floats + f_floats + a_floats + kStatDK;  // + norm_w [kStatDK]
  static constexpr int red_floats = kStatWarps * BT * NP;
  static constexpr size_t smem_bytes =
      sizeof(float) * static_cast<size_t>(kStatStages * stage_floats > red_floats ? kStatStages * stage_floats
                                                                                  : red_floats);
  static_assert(LDH % 8 == 4 && LDA % 8 == 4, "odd multiples of 4 floats");
};

// Token tiles and d-chunks of the statistics kernel (chunk: d's a block sums, a multiple of kStatDK).
struct StatPlan {
  int64_t tiles, splits, chunk;
};
StatPlan stat_plan(int64_t T, int64_t S, int64_t D) {
  const int64_t tiles = ceil_div(T, 32 * stat_tq(static_cast<int>(S))), dtiles = ceil_div(D, kStatDK);
  const int64_t want = std::clamp<int64_t>(ceil_div(kStatBlocks, std::max<int64_t>(tiles, 1)), 1, dtiles);
  const int64_t chunk = ceil_div(dtiles, want) * kStatDK;
  return {tiles, ceil_div(D, chunk), chunk};
}

// Grid (token tiles, d-chunks). part [splits, NP, T]: over chunk sp's d's (all S streams), token t's fn·h [M]
// (fn·h over those columns), G [NG] and A [S] (zero without da). Each value is one fma chain per warp over its d's
// (tiles in order, streams, then d), the warps' chains summed in warp order. VEC: 16-byte copies (D and the bases
// a multiple of 4 floats).
template <int S, bool VEC>
__global__ void __launch_bounds__(kStatThreads)
    mhc_bwd_stats_kernel(const float* __restrict__ h, const float* __restrict__ fn, const float* __restrict__ norm_w,
                         const float* __restrict__ da, float* __restrict__ part, int64_t T, int64_t D,
                         int64_t chunk) {
  using P = StatTile<S>;
  constexpr int M = P::M, NG = P::NG, NP = P::NP, TQ = P::TQ, BT = P::BT, DK = kStatDK;
  extern __shared__ __align__(16) float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t0 = int64_t(blockIdx.x) * BT, sp = blockIdx.y, SD = S * D;
  const int64_t c0 = sp * chunk, c1 = min(D, c0 + chunk);
  const int nt = static_cast<int>((c1 - c0 + DK - 1) / DK);
  auto hs = [&](int b) { return smem + b * P::stage_floats; };
  auto fs = [&](int b) { return hs(b) + P::h_floats; };
  auto as = [&](int b) { return fs(b) + P::f_floats; };
  auto ws = [&](int b) { return as(b) + P::a_floats; };

  // Tile i of the chunk into buffer b; rows past T and d's past the chunk are zero-filled (adding nothing).
  auto load = [&](int b, int i) {
    constexpr int W = VEC ? 4 : 1, PR = DK / W;  // copies per row segment
    const int64_t dd = c0 + int64_t(i) * DK;
    float* hb = hs(b);
    for (int idx = threadIdx.x; idx < BT * S * PR; idx += kStatThreads) {
      const int r = idx / (S * PR), s = (idx / PR) % S, c = (idx % PR) * W;
      const int64_t t = t0 + r, d = dd + c;
      const bool ok = t < T && d < c1;
      cp_async_f<VEC>(hb + r * P::LDH + s * DK + c, ok ? h + (t * S + s) * D + d : h, ok);
    }
    float* fb = fs(b);
    for (int idx = threadIdx.x; idx < M * S * PR; idx += kStatThreads) {
      const int row = idx / PR, c = (idx % PR) * W;  // row = j·S + s
      const int64_t d = dd + c;
      const bool ok = d < c1;
      cp_async_f<VEC>(fb + row * DK + c, ok ? fn + (row / S) * SD + (row % S) * D + d : h, ok);
    }
    float* ab = as(b);
    for (int idx = threadIdx.x; idx < BT * PR; idx += kStatThreads) {
      const int r = idx / PR, c = (idx % PR) * W;
      const int64_t t = t0 + r, d = dd + c;
      const bool ok = da && t < T && d < c1;
      cp_async_f<VEC>(ab + r * P::LDA + c, ok ? da + t * D + d : h, ok);
    }
    if (threadIdx.x < PR) {
      const int c = threadIdx.x * W;
      const int64_t d = dd + c;
      const bool ok = da && d < c1;
      cp_async_f<VEC>(ws(b) + c, ok ? norm_w + d : h, ok);
    }
  };

  float acc[TQ][M], gram[TQ][NG], aa[TQ][S];
#pragma unroll
  for (int q = 0; q < TQ; ++q) {
#pragma unroll
    for (int j = 0; j < M; ++j) acc[q][j] = 0.0f;
#pragma unroll
    for (int g = 0; g < NG; ++g) gram[q][g] = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) aa[q][s] = 0.0f;
  }

#pragma unroll
  for (int s = 0; s < kStatStages - 1; ++s) {
    if (s < nt) load(s, s);
    cp_async_commit();
  }
  for (int i = 0; i < nt; ++i) {
    cp_async_wait<kStatStages - 2>();  // tile i has landed (this thread's copies) …
    __syncthreads();                   // … everyone's, and every warp is done with the buffer refilled below
    const int nx = i + kStatStages - 1;
    if (nx < nt) load(nx % kStatStages, nx);
    cp_async_commit();
    const int b = i % kStatStages;

    float4 hv[TQ][S];
#pragma unroll
    for (int q = 0; q < TQ; ++q)
#pragma unroll
      for (int s = 0; s < S; ++s)
        hv[q][s] = *reinterpret_cast<const float4*>(hs(b) + (q * 32 + lane) * P::LDH + s * DK + 4 * warp);
    const float* fb = fs(b) + 4 * warp;
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int j = 0; j < M; ++j) {
        const float4 f = *reinterpret_cast<const float4*>(fb + (j * S + s) * DK);  // the same for the whole warp
#pragma unroll
        for (int q = 0; q < TQ; ++q) {
          float& a = acc[q][j];
          a = fmaf(hv[q][s].x, f.x, a);
          a = fmaf(hv[q][s].y, f.y, a);
          a = fmaf(hv[q][s].z, f.z, a);
          a = fmaf(hv[q][s].w, f.w, a);
        }
      }
    const float4 w4 = *reinterpret_cast<const float4*>(ws(b) + 4 * warp);
#pragma unroll
    for (int q = 0; q < TQ; ++q) {
      const float4 a4 = *reinterpret_cast<const float4*>(as(b) + (q * 32 + lane) * P::LDA + 4 * warp);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float wg = comp(w4, c) * comp(a4, c);
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const float hsc = comp(hv[q][s], c);
          aa[q][s] = fmaf(wg, hsc, aa[q][s]);
#pragma unroll
          for (int s2 = s; s2 < S; ++s2) {
            float& g = gram[q][gram_index(S, s, s2)];
            g = fmaf(hsc, comp(hv[q][s2], c), g);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become red [warps, BT, NP]

  float* red = smem;
#pragma unroll
  for (int q = 0; q < TQ; ++q) {
    float* o = red + (warp * BT + q * 32 + lane) * NP;
#pragma unroll
    for (int j = 0; j < M; ++j) o[j] = acc[q][j];
#pragma unroll
    for (int g = 0; g < NG; ++g) o[M + g] = gram[q][g];
#pragma unroll
    for (int s = 0; s < S; ++s) o[M + NG + s] = aa[q][s];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < NP * BT; idx += kStatThreads) {
    const int n = idx / BT, r = idx % BT;
    const int64_t t = t0 + r;
    if (t >= T) continue;
    float v = red[r * NP + n];
#pragma unroll
    for (int w = 1; w < kStatWarps; ++w) v += red[(w * BT + r) * NP + n];
    part[(sp * NP + n) * T + t] = v;
  }
}

// The statistics without the projection (the forward's mix given): a warp a token (kGramWarps tokens a block), each
// lane the float4s q = lane, lane + 32, … of every stream, h and da read once straight from memory. part [NP, T]
// (NP = stat_values(S, false): G, then A, zero without da); each value is a lane's fma chain over its columns in
// order, then summed over the lanes by a butterfly (every lane ends with the same bits). D a multiple of 4, the
// bases 16-byte aligned.
constexpr int kGramWarps = 8;
template <int S>
__global__ void __launch_bounds__(32 * kGramWarps)
    mhc_bwd_gram_kernel(const float* __restrict__ h, const float* __restrict__ norm_w, const float* __restrict__ da,
                        float* __restrict__ part, int64_t T, int64_t D) {
  constexpr int NG = gram_count(S), NP = stat_values(S, false);
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kGramWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const float4* h4 = reinterpret_cast<const float4*>(h + t * S * D);
  const float4* a4 = da ? reinterpret_cast<const float4*>(da + t * D) : nullptr;
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  const int64_t Q = D / 4;
  float g[NG] = {}, aa[S] = {};
#pragma unroll 4
  for (int64_t q = lane; q < Q; q += 32) {
    float4 hv[S];
#pragma unroll
    for (int s = 0; s < S; ++s) hv[s] = h4[s * Q + q];
    float4 wa = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (a4) {
      const float4 a = a4[q], w = w4[q];
      wa = make_float4(w.x * a.x, w.y * a.y, w.z * a.z, w.w * a.w);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float wg = comp(wa, c);
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const float hs = comp(hv[s], c);
        aa[s] = fmaf(wg, hs, aa[s]);
#pragma unroll
        for (int s2 = s; s2 < S; ++s2) g[gram_index(S, s, s2)] = fmaf(hs, comp(hv[s2], c), g[gram_index(S, s, s2)]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NP; ++i) {
    const float v = warp_sum(i < NG ? g[i] : aa[i - NG]);
    if (lane == i % 32) part[int64_t(i) * T + t] = v;
  }
}

// ---- mHC pre, kernel 2: the coefficients and their backward, a thread per token ----

constexpr int kCoefThreads = 32;  // tokens a block (one warp)

__host__ __device__ constexpr int round4(int n) { return (n + 3) / 4 * 4; }
// A token's row for the apply kernel: r1, c1, r2, c2, pre [S] (padded to 4), dm [M] (padded to 4); 16-byte aligned.
__host__ __device__ constexpr int row_dm(int S) { return 4 + round4(S); }
__host__ __device__ constexpr int row_width(int S) { return row_dm(S) + round4((2 + S) * S); }

__host__ __device__ int sinkhorn_steps(int iters) { return iters > 1 ? 2 * iters - 1 : 1; }

// Shared floats of the coefficient kernel: the mix [NP][32], dz and dz·m [2M][33] (padded: the partial sums read
// along a row), the Sinkhorn divisors [steps][S][32].
int64_t coef_smem_floats(int64_t S, int iters) {
  const int64_t M = (2 + S) * S;
  return stat_values(static_cast<int>(S)) * kCoefThreads + 2 * M * (kCoefThreads + 1) +
         sinkhorn_steps(iters) * S * kCoefThreads;
}

// Row rr of the softmax of the comb logits, with the forward's operations (mhc_apply_kernel): out = exp(z − max) /
// Σ exp, the sum in column order.
template <int S>
__device__ __forceinline__ void softmax_row(const float* mx, int rr, float r, float sc2, const float* base,
                                            float (&out)[S]) {
  float m = -INFINITY;
#pragma unroll
  for (int c = 0; c < S; ++c) {
    out[c] = (mx[(2 * S + rr * S + c) * kCoefThreads] * r) * sc2 + base[2 * S + rr * S + c];
    m = fmaxf(m, out[c]);
  }
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < S; ++c) sum += (out[c] = expf(out[c] - m));
#pragma unroll
  for (int c = 0; c < S; ++c) out[c] = out[c] / sum;
}

// Thread = token t (lanes past T compute on token T − 1 and add nothing). part [splits, NP, T] from the statistics
// kernel; FMIX: its values without fn·h (stat_values(S, false), from mhc_bwd_gram_kernel), which comes with Σh²
// from the forward's mix fmix [T, M + 1] (mhc_pre's), so that the coefficients are the forward's bit for bit. Writes
// rows[t] (row_width floats: r1, c1, r2, c2, pre, dm) and tokp[block] = (Σ dz [M], Σ dz·m [M]) over
// the block's tokens in token order. Without dcomb the comb part of dz is zero; without da the pre part (and r2,
// c2); without dpost the post part.
template <int S, bool FMIX>
__global__ void __launch_bounds__(kCoefThreads)
    mhc_bwd_coef_kernel(MhcParams p, const float* __restrict__ part, int64_t splits, const float* __restrict__ fmix,
                        const float* __restrict__ dpost, const float* __restrict__ dcomb, bool has_da,
                        float* __restrict__ rows, float* __restrict__ tokp) {
  constexpr int M = (2 + S) * S, SS = S * S, NG = gram_count(S), NP = stat_values(S), W = row_width(S),
                P0 = row_dm(S), L = kCoefThreads;
  // The values in part (the first of them is value N0 of the token's mix).
  constexpr int NPP = stat_values(S, !FMIX), N0 = NP - NPP;
  extern __shared__ __align__(16) float smem[];
  const int lane = threadIdx.x;
  const int64_t T = p.T, D = p.D, SD = S * D;
  const int64_t t = int64_t(blockIdx.x) * L + lane, tc = t < T ? t : T - 1;
  const bool valid = t < T;
  const int steps = sinkhorn_steps(p.iters);
  const float eps = p.rms_eps, hc_eps = p.hc_eps;
  const float* base = p.base;
  const float* sc = p.scale;
  float* mix = smem + lane;                  // mix[n·L]
  float* dz = smem + NP * L + lane;          // dz[j·(L+1)], dz·m at [(M + j)·(L+1)]
  float* div = smem + NP * L + 2 * M * (L + 1) + lane;  // div[(i·S + a)·L]

  // The chunk partials in chunk order, up to 64 values a pass (their loads in flight together).
  constexpr int K = NPP < 64 ? NPP : 64;
#pragma unroll
  for (int n0 = 0; n0 < NPP; n0 += K) {
    float v[K];
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (n0 + k < NPP) v[k] = part[(n0 + k) * T + tc];
#pragma unroll 2
    for (int64_t s = 1; s < splits; ++s)
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (n0 + k < NPP) v[k] += part[(s * NPP + n0 + k) * T + tc];
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (n0 + k < NPP) mix[(N0 + n0 + k) * L] = v[k];
  }
  if constexpr (FMIX)
#pragma unroll
    for (int j = 0; j < M; ++j) mix[j * L] = fmix[tc * (M + 1) + j];
  const float* Gm = mix + M * L;       // G[gram_index(a, b)·L]
  const float* Am = mix + (M + NG) * L;

  float ssq = 0.0f;  // Σh²: the forward's, or trace G
  if constexpr (FMIX) {
    ssq = fmix[tc * (M + 1) + M];
  } else {
#pragma unroll
    for (int s = 0; s < S; ++s) ssq += Gm[gram_index(S, s, s) * L];
  }
  const float r = rsqrtf(ssq / static_cast<float>(SD) + eps);  // fn·(h·r) = r·(fn·h)

  float e[S], pre[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    e[s] = 1.0f / (1.0f + expf(-((mix[s * L] * r) * sc[0] + base[s])));
    pre[s] = e[s] + hc_eps;
    const float sp = 1.0f / (1.0f + expf(-((mix[(S + s) * L] * r) * sc[1] + base[S + s])));
    dz[(S + s) * (L + 1)] = dpost ? dpost[tc * S + s] * 2.0f * sp * (1.0f - sp) : 0.0f;
  }

  // comb = Sinkhorn(softmax_rows(z) + hc_eps): the forward's steps (columns, then rows and columns; its divisions),
  // each divisor kept; then the steps' backward, din = (dout − Σ_line dout⊙out)/divisor (through the divisor's
  // reciprocal), with C taken back from out to in (C·div).
  if (dcomb) {
    float C[SS], G[SS];
#pragma unroll
    for (int rr = 0; rr < S; ++rr) {
      float pr[S];
      softmax_row<S>(mix, rr, r, sc[2], base, pr);
#pragma unroll
      for (int c = 0; c < S; ++c) C[rr * S + c] = pr[c] + hc_eps;
    }
    for (int i = 0; i < steps; ++i) {
      float* dv = div + i * S * L;
      if (i % 2 == 0) {
#pragma unroll
        for (int a = 0; a < S; ++a) {
          float sum = 0.0f;
#pragma unroll
          for (int b = 0; b < S; ++b) sum += C[b * S + a];
          const float q = sum + hc_eps;
          dv[a * L] = q;
#pragma unroll
          for (int b = 0; b < S; ++b) C[b * S + a] = C[b * S + a] / q;
        }
      } else {
#pragma unroll
        for (int a = 0; a < S; ++a) {
          float sum = 0.0f;
#pragma unroll
          for (int b = 0; b < S; ++b) sum += C[a * S + b];
          const float q = sum + hc_eps;
          dv[a * L] = q;
#pragma unroll
          for (int b = 0; b < S; ++b) C[a * S + b] = C[a * S + b] / q;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < SS; ++i) G[i] = dcomb[tc * SS + i];
    for (int i = steps - 1; i >= 0; --i) {
      const float* dv = div + i * S * L;
      if (i % 2 == 0) {
#pragma unroll
        for (int a = 0; a < S; ++a) {
          float dot = 0.0f;
#pragma unroll
          for (int b = 0; b < S; ++b) dot += G[b * S + a] * C[b * S + a];
          const float q = dv[a * L], rq = 1.0f / q;
#pragma unroll
          for (int b = 0; b < S; ++b) {
            G[b * S + a] = (G[b * S + a] - dot) * rq;
            C[b * S + a] = C[b * S + a] * q;
          }
        }
      } else {
#pragma unroll
        for (int a = 0; a < S; ++a) {
          float dot = 0.0f;
#pragma unroll
          for (int b = 0; b < S; ++b) dot += G[a * S + b] * C[a * S + b];
          const float q = dv[a * L], rq = 1.0f / q;
#pragma unroll
          for (int b = 0; b < S; ++b) {
            G[a * S + b] = (G[a * S + b] - dot) * rq;
            C[a * S + b] = C[a * S + b] * q;
          }
        }
      }
    }
    // The softmax backward, row by row (P recomputed: the same operations give the same values).
#pragma unroll
    for (int rr = 0; rr < S; ++rr) {
      float pr[S];
      softmax_row<S>(mix, rr, r, sc[2], base, pr);
      float dot = 0.0f;
#pragma unroll
      for (int c = 0; c < S; ++c) dot += pr[c] * G[rr * S + c];
#pragma unroll
      for (int c = 0; c < S; ++c) dz[(2 * S + rr * S + c) * (L + 1)] = pr[c] * (G[rr * S + c] - dot);
    }
  } else {
#pragma unroll
    for (int i = 0; i < SS; ++i) dz[(2 * S + i) * (L + 1)] = 0.0f;
  }

  // The sub-layer norm of x = Σ_s pre_s·h_s from G and A: Σx² = Σ_s pre_s·(G·pre)_s, Σ w·da·x = Σ_s pre_s·A_s,
  // dpre_s = Σ_d dx·h_s = r2·A_s − c2·(G·pre)_s.
  float r2 = 0.0f, c2 = 0.0f;
  if (has_da) {
    float gp[S];
#pragma unroll
    for (int a = 0; a < S; ++a) {
      float v = 0.0f;
#pragma unroll
      for (int b = 0; b < S; ++b) v = fmaf(Gm[gram_index(S, a < b ? a : b, a < b ? b : a) * L], pre[b], v);
      gp[a] = v;
    }
    float xx = 0.0f, wx = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      xx = fmaf(pre[s], gp[s], xx);
      wx = fmaf(pre[s], Am[s * L], wx);
    }
    r2 = rsqrtf(xx / static_cast<float>(D) + eps);
    c2 = (wx / static_cast<float>(D)) * r2 * r2 * r2;
#pragma unroll
    for (int s = 0; s < S; ++s) dz[s * (L + 1)] = (r2 * Am[s * L] - c2 * gp[s]) * e[s] * (1.0f - e[s]);
  } else {
#pragma unroll
    for (int s = 0; s < S; ++s) dz[s * (L + 1)] = 0.0f;
  }

  // dm = dz·scale[part]; c1 = r1³·(dm·(fn·h))/SD for the input norm (dflat·h = dm·(fn·h)); dz·m for dscale.
  float* row = rows + tc * W;
  float v = 0.0f;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const int pt = j < S ? 0 : j < 2 * S ? 1 : 2;
    const float z = dz[j * (L + 1)], mj = mix[j * L];
    const float dm = z * sc[pt];
    v = fmaf(dm, mj, v);
    if (valid) row[P0 + j] = dm;
    dz[(M + j) * (L + 1)] = valid ? z * (mj * r) : 0.0f;
    if (!valid) dz[j * (L + 1)] = 0.0f;
  }
  if (valid) {
    row[0] = r;
    row[1] = (v / static_cast<float>(SD)) * r * r * r;
    row[2] = r2;
    row[3] = c2;
#pragma unroll
    for (int s = 0; s < S; ++s) row[4 + s] = pre[s];
#pragma unroll
    for (int i = 4 + S; i < P0; ++i) row[i] = 0.0f;
#pragma unroll
    for (int i = P0 + M; i < W; ++i) row[i] = 0.0f;
  }
  __syncthreads();
  // The block's sums in token order.
  const float* dzb = smem + NP * L;
  for (int o = lane; o < 2 * M; o += L) {
    float acc = 0.0f;
    for (int k = 0; k < L; ++k) acc += dzb[o * (L + 1) + k];
    tokp[blockIdx.x * int64_t(2 * M) + o] = acc;
  }
}

// ---- mHC pre, kernel 3: the per-column pass over h, da and dh ----

// The arithmetic of one element of dh, shared by both per-column kernels below so that they give the same bits: the
// sub-layer norm's input gradient dx = r2·w·da − c2·x of a column (x = Σ_s pre_s·h_s, the collapse), and the update
// dh_s += pre_s·dx (with da) + (r1·df − c1·h_s), df = Σ_j dm_j·fn[j, s·D + d] (the input norm of the projection).
// Explicit roundings: no contraction left to the compiler.
template <int S>
__device__ __forceinline__ float collapse_of(const float (&pre)[S], const float (&hs)[S]) {
  float x = 0.0f;
#pragma unroll
  for (int s = 0; s < S; ++s) x = __fmaf_rn(pre[s], hs[s], x);
  return x;
}
__device__ __forceinline__ float norm_dx(float r2, float w, float g, float c2, float x) {
  return __fmaf_rn(__fmul_rn(r2, w), g, -__fmul_rn(c2, x));
}
__device__ __forceinline__ float dh_update(float dhv, bool has_da, float pre_s, float dx, float r1, float c1,
                                           float df, float hv) {
  if (has_da) dhv = __fmaf_rn(pre_s, dx, dhv);
  return __fadd_rn(dhv, __fmaf_rn(r1, df, -__fmul_rn(hv, c1)));
}

constexpr int kApplyTT = 8;              // tokens a pipeline stage
constexpr int kApplyStages = 4;
constexpr int64_t kApplyBlocks = 1280;   // blocks aimed at: about two waves on an H200 at S = 4

// A pipeline stage of the per-column passes below: TT tokens' h and dh [TT][S][COLS] and da [TT][COLS] on the block's
// columns d0 … d0+COLS−1, and their coefficient rows [TT][W] (from the coefficient kernel); with MIX also their
// post-mix matrices comb [TT][S·S] (and dh holds the post-mix's output gradient dout instead).
template <int S, int COLS, int TT, bool MIX = false>
struct ColumnStage {
  static constexpr int W = row_width(S);
  static constexpr int h_floats = TT * S * COLS;
  static constexpr int floats = 2 * h_floats + TT * COLS + TT * W + (MIX ? TT * S * S : 0);
  float* base;  // the stage's buffer in shared memory
  __device__ float* h() const { return base; }
  __device__ float* dh() const { return base + h_floats; }
  __device__ float* da() const { return base + 2 * h_floats; }
  __device__ float* rows() const { return base + 2 * h_floats + TT * COLS; }
  __device__ float* comb() const { return base + 2 * h_floats + TT * COLS + TT * W; }

  // The copies of the tokens tt0 …, left of them inside the block's range, by NT threads (VEC: 16-byte copies); a
  // missing dh or da and everything out of range is zero-filled. Trip counts are fixed at compile time, offsets
  // inside the stage in 32 bits (a stage spans TT·S rows of D floats) from 64-bit stage bases. comb: [T, S, S], read
  // with MIX only (4-byte copies: S·S need not be a multiple of 4).
  template <bool VEC, int NT>
  __device__ __forceinline__ void load(const float* h, const float* dh, const float* da, const float* rows,
                                       const float* comb, int64_t tt0, int left, int64_t d0, int64_t D) const {
    constexpr int V = VEC ? 4 : 1, PR = COLS / V;
    constexpr int NHV = TT * S * PR, NA = TT * PR, NR = TT * (W / V);
    if constexpr (MIX) {
      constexpr int NC = TT * S * S;
#pragma unroll
      for (int q = 0; q < (NC + NT - 1) / NT; ++q) {
        const int idx = threadIdx.x + q * NT;
        if (NC % NT && idx >= NC) break;
        const bool in = idx / (S * S) < left;
        cp_async_f<false>(this->comb() + idx, in ? comb + tt0 * (S * S) + idx : h, in);
      }
    }
    const int64_t SD = S * D;
    const float* h_st = h + tt0 * SD + d0;
    const float* dh_st = dh ? dh + tt0 * SD + d0 : h;
    const float* da_st = da ? da + tt0 * D + d0 : h;
    const float* rw_st = rows + tt0 * W;
#pragma unroll
    for (int q = 0; q < (NHV + NT - 1) / NT; ++q) {
      const int idx = threadIdx.x + q * NT;
      if (NHV % NT && idx >= NHV) break;  // (a copy out of range would still zero-fill shared memory)
      const int r = idx / PR, c = (idx % PR) * V;  // r = token·S + stream
      const bool in = r / S < left && d0 + c < D;
      const int off = r * static_cast<int>(D) + c;
      cp_async_f<VEC>(this->h() + r * COLS + c, in ? h_st + off : h, in);
      cp_async_f<VEC>(this->dh() + r * COLS + c, in && dh ? dh_st + off : h, in && dh);
    }
#pragma unroll
    for (int q = 0; q < (NA + NT - 1) / NT; ++q) {
      const int idx = threadIdx.x + q * NT;
      if (NA % NT && idx >= NA) break;
      const int r = idx / PR, c = (idx % PR) * V;
      const bool in = da && r < left && d0 + c < D;
      cp_async_f<VEC>(this->da() + r * COLS + c, in ? da_st + r * static_cast<int>(D) + c : h, in);
    }
#pragma unroll
    for (int q = 0; q < (NR + NT - 1) / NT; ++q) {
      const int idx = threadIdx.x + q * NT;
      if (NR % NT && idx >= NR) break;
      const int r = idx / (W / V), c = (idx % (W / V)) * V;
      const bool in = r < left;
      cp_async_f<VEC>(this->rows() + r * W + c, in ? rw_st + r * W + c : h, in);
    }
  }
};

// The stages of a per-column pass over the tokens t0 … t1−1 of its block, TT a stage, in a cp.async pipeline of
// STAGES buffers (smem: STAGES·Stage::floats floats): each stage's copies are issued STAGES − 1 stages ahead of
// use(stage, first token, count of tokens).
template <int STAGES, class Stage, bool VEC, int NT, int TT, class Use>
__device__ __forceinline__ void column_stages(float* smem, const float* h, const float* dh, const float* da,
                                              const float* rows, const float* comb, int64_t t0, int64_t t1,
                                              int64_t d0, int64_t D, Use&& use) {
  const int nst = t1 > t0 ? static_cast<int>((t1 - t0 + TT - 1) / TT) : 0;
  auto stage = [&](int i) { return Stage{smem + (i % STAGES) * Stage::floats}; };
  auto load = [&](int i) {
    const int64_t tt0 = t0 + int64_t(i) * TT;
    stage(i).template load<VEC, NT>(h, dh, da, rows, comb, tt0, static_cast<int>(min(int64_t(TT), t1 - tt0)), d0,
                                    D);
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < nst) load(i);
    cp_async_commit();
  }
  for (int i = 0; i < nst; ++i) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (i + STAGES - 1 < nst) load(i + STAGES - 1);
    cp_async_commit();
    const int64_t tt0 = t0 + int64_t(i) * TT;
    use(stage(i), tt0, static_cast<int>(min(int64_t(TT), t1 - tt0)));
  }
  cp_async_wait<0>();
}

template <int S>
using ApplyStage = ColumnStage<S, 32, kApplyTT>;

// Token blocks of the apply kernel (each ≥ 64 tokens), tpb tokens each.
struct ApplyPlan {
  int64_t dtiles, blocks, tpb;
};
ApplyPlan apply_plan(int64_t T, int64_t D) {
  const int64_t dtiles = ceil_div(D, 32);
  const int64_t want = std::clamp<int64_t>(ceil_div(kApplyBlocks, dtiles), 1, std::max<int64_t>(1, ceil_div(T, 64)));
  const int64_t tpb = ceil_div(std::max<int64_t>(T, 1), want);
  return {dtiles, ceil_div(std::max<int64_t>(T, 1), tpb), tpb};
}

// Grid (d tiles of 32, token blocks of tpb); warp s, lane l own column k = s·D + d (d = 32·tile + l) and hold
// fn[:, k] in registers. Per token (rows[t] from the coefficient kernel):
//   x = Σ_s pre_s·h_s, dx = r2·w·da − c2·x (the sub-layer norm), dh_s += pre_s·dx;
//   dh_s += r1·Σ_j dm_j·fn[j, k] − c1·h_s (the input norm of the projection);
// and the partials part[b] = (dfn [M, S·D]: Σ_t dm[t, j]·h[t, k]·r1[t]; dnorm_w [D]: Σ_t da·x·r2), tokens in order.
// h, da, dh and the rows come through a cp.async pipeline of kApplyTT tokens a stage. VEC: 16-byte copies.
// At S = 4 (the model's hc_mult) five blocks an SM: at most 102 registers (the unrolled token loop would take 128).
// PARAMS false (no parameter gradient wanted: a LoRA step's frozen mHC), at S > 4: dh alone, no partials (part
// unused); at S ≤ 4 mhc_bwd_dh_kernel below does that.
template <int S, bool VEC, bool PARAMS>
__global__ void __launch_bounds__(32 * S, S == 4 ? 5 : 1)
    mhc_bwd_apply_kernel(const float* __restrict__ h, const float* __restrict__ fn, const float* __restrict__ norm_w,
                         const float* __restrict__ da, const float* __restrict__ rows, float* __restrict__ dh,
                         float* __restrict__ part, int64_t T, int64_t D, int64_t tpb) {
  constexpr int M = (2 + S) * S, W = row_width(S), P0 = row_dm(S);
  extern __shared__ __align__(16) float smem[];
  const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
  const int64_t SD = S * D, d0 = int64_t(blockIdx.x) * 32, d = d0 + lane, b = blockIdx.y;
  const int64_t t0 = b * tpb, t1 = min(T, t0 + tpb);
  const bool ok = d < D, has_da = da != nullptr;

  float f[M], acc[M];
#pragma unroll
  for (int j = 0; j < M; ++j) f[j] = ok ? fn[j * SD + s * D + d] : 0.0f, acc[j] = 0.0f;
  const float w = ok && has_da ? norm_w[d] : 0.0f;
  float dnw = 0.0f;

  column_stages<kApplyStages, ApplyStage<S>, VEC, 32 * S, kApplyTT>(
      smem, h, dh, da, rows, nullptr, t0, t1, d0, D, [&](const ApplyStage<S>& st, int64_t tt0, int cnt) {
        const float* hb = st.h();
        const float* dhb = st.dh();
        const float* ab = st.da();
        const float* rb = st.rows();
        float* dh_st = dh ? dh + (tt0 * S + s) * D + d : nullptr;  // this thread's element at the first token
        // Unrolled over the stage's tokens: every shared-memory offset below is then a constant.
#pragma unroll
        for (int tt = 0; tt < kApplyTT; ++tt) {
          if (tt >= cnt) break;
          const float* rw = rb + tt * W;
          const float4 k4 = *reinterpret_cast<const float4*>(rw);  // r1, c1, r2, c2
          const float r1 = k4.x, c1 = k4.y, r2 = k4.z, c2 = k4.w;
          const float hv = hb[(tt * S + s) * 32 + lane];
          float dx = 0.0f;
          if (has_da) {
            float pr[S], hs2[S];
#pragma unroll
            for (int s2 = 0; s2 < S; s2 += 4) {
              const float4 p4 = *reinterpret_cast<const float4*>(rw + 4 + s2);  // pre, padded to 4
#pragma unroll
              for (int u = 0; u < 4; ++u)
                if (s2 + u < S) pr[s2 + u] = comp(p4, u);
            }
#pragma unroll
            for (int s2 = 0; s2 < S; ++s2) hs2[s2] = hb[(tt * S + s2) * 32 + lane];
            const float x = collapse_of<S>(pr, hs2);
            const float g = ab[tt * 32 + lane];
            dx = norm_dx(r2, w, g, c2, x);
            if (PARAMS && s == 0) dnw += g * x * r2;
          }
          const float v = hv * r1;
          float df = 0.0f;
#pragma unroll
          for (int j = 0; j < M; j += 4) {
            const float4 d4 = *reinterpret_cast<const float4*>(rw + P0 + j);  // rows are 16-byte aligned
#pragma unroll
            for (int u = 0; u < 4; ++u)
              if (j + u < M) {
                const float dmj = comp(d4, u);
                df = __fmaf_rn(dmj, f[j + u], df);
                if constexpr (PARAMS) acc[j + u] = fmaf(dmj, v, acc[j + u]);
              }
          }
          const float dhv = dh_update(dhb[(tt * S + s) * 32 + lane], has_da, rw[4 + s], dx, r1, c1, df, hv);
          if (ok && dh) dh_st[tt * SD] = dhv;
        }
      });

  if (!PARAMS || !ok) return;
  float* out = part + b * (M * SD + D);
#pragma unroll
  for (int j = 0; j < M; ++j) out[j * SD + s * D + d] = acc[j];
  if (s == 0) out[M * SD + d] = dnw;
}

// dh alone (no parameter gradient wanted: a LoRA step's frozen mHC), at S ≤ 4: the per-element arithmetic of
// mhc_bwd_apply_kernel (the same dh, bit for bit, as with the parameter gradients), cut the other way round. A
// thread owns one column d of all S streams (a block 128 consecutive columns, a warp 32) and holds fn[:, s·D + d] for
// every s in registers (S·M ≤ 96), so the collapse x is formed once a column instead of once a stream, and each
// token's row of coefficients (r1, c1, r2, c2, pre, dm) is read from shared memory once per S·32 elements instead of
// once per 32: the per-stream kernel was bound by those shared-memory reads (L1 88 % busy on the H200 at T = 4096,
// D = 4096; 0.345 → 0.238 ms a site).
// MIX: the site's post-mix backward left dh alone (mhc_post_backward with a null dh) and this kernel forms its term
// itself, from the post-mix's output gradient dout and comb: dh_r = Σ_s comb[r, s]·dout_s (the post-mix kernel's
// operations: an fma chain over s from 0, then 0 + it, as its vectorised store into a zeroed float4 adds) takes the
// place of the dh it would have written and this kernel read back, and dh is written. The same bits as the two
// kernels in turn, without 2·T·S·D floats of traffic.
constexpr int kDhCols = 128, kDhTT = 4, kDhStages = 3;
constexpr int64_t kDhBlocks = 800;  // blocks aimed at: about two waves of three blocks an SM on an H200

template <int S, bool MIX>
using DhStage = ColumnStage<S, kDhCols, kDhTT, MIX>;

ApplyPlan dh_plan(int64_t T, int64_t D) {
  const int64_t dtiles = ceil_div(D, kDhCols);
  const int64_t want = std::clamp<int64_t>(ceil_div(kDhBlocks, dtiles), 1, std::max<int64_t>(1, ceil_div(T, 32)));
  const int64_t tpb = ceil_div(std::max<int64_t>(T, 1), want);
  return {dtiles, ceil_div(std::max<int64_t>(T, 1), tpb), tpb};
}

template <int S, bool VEC, bool MIX>
__global__ void __launch_bounds__(kDhCols, 3)
    mhc_bwd_dh_kernel(const float* __restrict__ h, const float* __restrict__ fn, const float* __restrict__ norm_w,
                      const float* __restrict__ da, const float* __restrict__ rows, const float* __restrict__ dout,
                      const float* __restrict__ comb, float* __restrict__ dh, int64_t T, int64_t D, int64_t tpb) {
  static_assert(S <= 4, "fn's columns of every stream in registers");
  constexpr int M = (2 + S) * S, W = row_width(S), P0 = row_dm(S);
  extern __shared__ __align__(16) float smem[];
  const int c = threadIdx.x;
  const int64_t SD = S * D, d0 = int64_t(blockIdx.x) * kDhCols, d = d0 + c, b = blockIdx.y;
  const int64_t t0 = b * tpb, t1 = min(T, t0 + tpb);
  const bool ok = d < D, has_da = da != nullptr;

  float f[S][M];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int j = 0; j < M; ++j) f[s][j] = ok ? fn[j * SD + s * D + d] : 0.0f;
  const float w = ok && has_da ? norm_w[d] : 0.0f;

  column_stages<kDhStages, DhStage<S, MIX>, VEC, kDhCols, kDhTT>(
      smem, h, MIX ? dout : dh, da, rows, comb, t0, t1, d0, D, [&](const DhStage<S, MIX>& st, int64_t tt0, int cnt) {
        const float* hb = st.h();
        const float* dhb = st.dh();  // with MIX, dout
        const float* ab = st.da();
        const float* rb = st.rows();
        float* dh_st = dh + tt0 * SD + d;  // this thread's element of stream 0 at the stage's first token
#pragma unroll
        for (int tt = 0; tt < kDhTT; ++tt) {
          if (tt >= cnt) break;
          const float* rw = rb + tt * W;
          const float4 k4 = *reinterpret_cast<const float4*>(rw);  // r1, c1, r2, c2
          const float r1 = k4.x, c1 = k4.y, r2 = k4.z, c2 = k4.w;
          float pr[S], hv[S];
          const float4 p4 = *reinterpret_cast<const float4*>(rw + 4);  // pre, padded to 4
#pragma unroll
          for (int s = 0; s < S; ++s) pr[s] = comp(p4, s), hv[s] = hb[(tt * S + s) * kDhCols + c];
          float dx = 0.0f;
          if (has_da) dx = norm_dx(r2, w, ab[tt * kDhCols + c], c2, collapse_of<S>(pr, hv));
          float df[S];
#pragma unroll
          for (int s = 0; s < S; ++s) df[s] = 0.0f;
#pragma unroll
          for (int j = 0; j < M; j += 4) {
            const float4 d4 = *reinterpret_cast<const float4*>(rw + P0 + j);  // rows are 16-byte aligned
#pragma unroll
            for (int u = 0; u < 4; ++u)
              if (j + u < M)
#pragma unroll
                for (int s = 0; s < S; ++s) df[s] = __fmaf_rn(comp(d4, u), f[s][j + u], df[s]);
          }
          if (ok) {
            if constexpr (MIX) {
              const float* cm = st.comb() + tt * S * S;
              float g[S], cv[S * S];
#pragma unroll
              for (int s = 0; s < S; ++s) g[s] = dhb[(tt * S + s) * kDhCols + c];
              if constexpr (S * S % 4 == 0) {  // 16-byte rows (the stage's comb is 16-byte aligned): fewer reads
#pragma unroll
                for (int q = 0; q < S * S / 4; ++q) {
                  const float4 c4 = reinterpret_cast<const float4*>(cm)[q];
                  cv[4 * q] = c4.x, cv[4 * q + 1] = c4.y, cv[4 * q + 2] = c4.z, cv[4 * q + 3] = c4.w;
                }
              } else {
#pragma unroll
                for (int i = 0; i < S * S; ++i) cv[i] = cm[i];
              }
#pragma unroll
              for (int r = 0; r < S; ++r) {
                float v = 0.0f;
#pragma unroll
                for (int s = 0; s < S; ++s) v = fmaf(cv[r * S + s], g[s], v);
                dh_st[tt * SD + r * D] = dh_update(__fadd_rn(0.0f, v), has_da, pr[r], dx, r1, c1, df[r], hv[r]);
              }
            } else {
#pragma unroll
              for (int s = 0; s < S; ++s)
                dh_st[tt * SD + s * D] =
                    dh_update(dhb[(tt * S + s) * kDhCols + c], has_da, pr[s], dx, r1, c1, df[s], hv[s]);
            }
          }
        }
      });
}

// ---- mHC pre, kernel 4: the parameter gradients ----

// Blocks 0 … M+2: dbase[j] += Σ_b tokp[b, j] (block o = j), dscale[pt] += Σ_b Σ_{j ∈ part pt} tokp[b, M + j]
// (block o = M + pt); each thread sums a fixed stride of the terms, then the block in warp order. The other
// blocks: Σ_b part[b, i] in block order (part rows of pw floats) added to dfn[i] for i < msd = M·S·D, else to
// dnorm_w[i − msd], for i < nsum (msd without da).
__global__ void __launch_bounds__(kThreads)
    mhc_bwd_params_kernel(const float* tokp, int64_t nbt, const float* part, int64_t nbp, int64_t pw, int64_t msd,
                          int64_t nsum, int S, float* dfn, float* dnorm_w, float* dbase, float* dscale) {
  const int M = (2 + S) * S;
  const unsigned ncoef = static_cast<unsigned>(M + 3);
  if (blockIdx.x < ncoef) {
    __shared__ float red[kWarps];
    __shared__ float sums[1];
    const int o = blockIdx.x;
    int64_t j0 = o, np = 1;
    if (o >= M) {
      const int pt = o - M;
      j0 = M + (pt == 0 ? 0 : pt == 1 ? S : 2 * S);
      np = pt == 2 ? S * S : S;
    }
    float acc[1] = {0.0f};
    for (int64_t q = threadIdx.x; q < nbt * np; q += kThreads) acc[0] += tokp[(q / np) * (2 * M) + j0 + q % np];
    block_sum_to<1>(acc, red, sums);
    if (threadIdx.x == 0) {
      if (o < M) {
        dbase[o] += sums[0];
      } else {
        dscale[o - M] += sums[0];
      }
    }
    return;
  }
  const int64_t stride = int64_t(gridDim.x - ncoef) * kThreads;
  for (int64_t i = int64_t(blockIdx.x - ncoef) * kThreads + threadIdx.x; i < nsum; i += stride) {
    float acc = part[i];
    for (int64_t b = 1; b < nbp; ++b) acc += part[b * pw + i];
    if (i < msd) {
      dfn[i] += acc;
    } else {
      dnorm_w[i - msd] += acc;
    }
  }
}

// Workspace layout of mhc_pre_backward (floats, in this order; each part 16-byte aligned).
struct PreWork {
  StatPlan stats;   // the statistics kernel's grid
  ApplyPlan apply;  // the apply kernel's grid
  int64_t coef_blocks, pw;
  int64_t stat, rows, tokp, part, total;
  PreWork(int64_t T, int64_t S, int64_t D) : stats(stat_plan(T, S, D)), apply(apply_plan(T, D)) {
    const int64_t M = (2 + S) * S;
    auto align = [](int64_t n) { return ceil_div(n, 64) * 64; };
    coef_blocks = ceil_div(T, kCoefThreads);
    pw = M * S * D + D;
    stat = 0;                                                                     // [splits, NP, T]
    rows = align(stat + stats.splits * stat_values(static_cast<int>(S)) * T);    // [T, row_width]
    tokp = align(rows + T * row_width(static_cast<int>(S)));                     // [coef blocks, 2M]
    part = align(tokp + coef_blocks * 2 * M);                                    // [apply blocks, pw]
    total = part + apply.blocks * pw;
  }
};

template <class K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
}

template <int S>
void launch_pre_backward(const MhcParams& p, const float* h, const float* dpost, const float* dcomb, const float* da,
                         float* dh, float* dfn, float* dbase, float* dscale, float* dnorm_w, float* work,
                         const float* mix, const float* dout, const float* comb, cudaStream_t st) {
  constexpr int M = (2 + S) * S;
  const int64_t T = p.T, D = p.D;
  const PreWork wk(T, S, D);
  float* stat = work + wk.stat;
  float* rows = work + wk.rows;
  float* tokp = work + wk.tokp;
  float* part = work + wk.part;
  // The parameters' gradients all wanted, or none (a LoRA step's frozen mHC and norm: dh alone).
  const bool params = dfn != nullptr;
  check(params == (dbase != nullptr) && params == (dscale != nullptr) && (params || !dnorm_w),
        "CUDA mHC backward: dfn, dbase, dscale (and dnorm_w) are all given or all null");
  const bool fold = dout != nullptr;
  check(fold == (comb != nullptr), "CUDA mHC backward: dout and comb are given together or not at all");
  check(!fold || (mhc_pre_backward_forms_mix(S, params) && dh), "CUDA mHC backward: the post-mix's dh term is formed "
        "here only without parameter gradients, at hc_mult <= 4, into a given dh");

  // With the forward's mix (and 16-byte rows), the statistics without the projection, in one split.
  const bool gram = mix && D % 4 == 0 && aligned16(h) && aligned16(p.norm_w) && aligned16(da);
  if (gram) {
    mhc_bwd_gram_kernel<S><<<static_cast<unsigned>(ceil_div(T, kGramWarps)), 32 * kGramWarps, 0, st>>>(h, p.norm_w,
                                                                                                      da, stat, T, D);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  } else {
    const StatPlan& sp = wk.stats;
    const bool vec = D % 4 == 0 && aligned16(h) && aligned16(p.fn) && aligned16(p.norm_w) && aligned16(da);
    auto kernel = vec ? mhc_bwd_stats_kernel<S, true> : mhc_bwd_stats_kernel<S, false>;
    const size_t smem = StatTile<S>::smem_bytes;
    allow_smem(kernel, smem);
    kernel<<<dim3(static_cast<unsigned>(sp.tiles), static_cast<unsigned>(sp.splits)), kStatThreads, smem, st>>>(
        h, p.fn, p.norm_w, da, stat, T, D, sp.chunk);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  {
    const size_t smem = sizeof(float) * static_cast<size_t>(coef_smem_floats(S, p.iters));
    check(smem <= 227 * 1024, "CUDA mHC backward: hc_sinkhorn_iters ", p.iters, " needs ", smem,
          " bytes of shared memory (at most 227 KiB)");
    auto kernel = gram ? mhc_bwd_coef_kernel<S, true> : mhc_bwd_coef_kernel<S, false>;
    allow_smem(kernel, smem);
    kernel<<<static_cast<unsigned>(wk.coef_blocks), kCoefThreads, smem, st>>>(
        p, stat, gram ? 1 : wk.stats.splits, mix, dpost, dcomb, da != nullptr, rows, tokp);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  if constexpr (S <= 4) {
    if (!params) {  // dh alone: the all-streams kernel
      if (!dh) return;
      const ApplyPlan dp = dh_plan(T, D);
      const bool vec =
          D % 4 == 0 && aligned16(h) && aligned16(dh) && aligned16(da) && aligned16(rows) && aligned16(dout);
      auto kernel = fold ? (vec ? mhc_bwd_dh_kernel<S, true, true> : mhc_bwd_dh_kernel<S, false, true>)
                         : (vec ? mhc_bwd_dh_kernel<S, true, false> : mhc_bwd_dh_kernel<S, false, false>);
      const size_t smem = sizeof(float) * kDhStages * (fold ? DhStage<S, true>::floats : DhStage<S, false>::floats);
      allow_smem(kernel, smem);
      kernel<<<dim3(static_cast<unsigned>(dp.dtiles), static_cast<unsigned>(dp.blocks)), kDhCols, smem, st>>>(
          h, p.fn, p.norm_w, da, rows, dout, comb, dh, T, D, dp.tpb);
      NEXTLM_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  {
    const ApplyPlan& ap = wk.apply;
    const bool vec = D % 4 == 0 && aligned16(h) && aligned16(dh) && aligned16(da) && aligned16(rows);
    auto kernel = [&] {  // dh alone runs here only at S > 4 (above otherwise)
      if constexpr (S <= 4) return vec ? mhc_bwd_apply_kernel<S, true, true> : mhc_bwd_apply_kernel<S, false, true>;
      else
        return params ? (vec ? mhc_bwd_apply_kernel<S, true, true> : mhc_bwd_apply_kernel<S, false, true>)
                      : (vec ? mhc_bwd_apply_kernel<S, true, false> : mhc_bwd_apply_kernel<S, false, false>);
    }();
    const size_t smem = sizeof(float) * kApplyStages * ApplyStage<S>::floats;
    allow_smem(kernel, smem);
    kernel<<<dim3(static_cast<unsigned>(ap.dtiles), static_cast<unsigned>(ap.blocks)), 32 * S, smem, st>>>(
        h, p.fn, p.norm_w, da, rows, dh, part, T, D, ap.tpb);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  if (!params) return;
  const int64_t msd = int64_t(M) * S * D, nsum = da ? msd + D : msd;
  const unsigned sum_blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(nsum, kThreads), 4096));
  mhc_bwd_params_kernel<<<M + 3 + sum_blocks, kThreads, 0, st>>>(tokp, wk.coef_blocks, part, wk.apply.blocks,
                                                                  wk.pw, msd, nsum, S, dfn, dnorm_w, dbase, dscale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <int S>
void launch_post_backward(const float* h, const float* y, const float* post, const float* comb, const float* dout,
                          float* dh, float* dy, bf16* dy16, float* dpost, float* dcomb, int64_t T, int64_t D,
                          bool accumulate, cudaStream_t st) {
  const bool vec = D % 4 == 0 && aligned16(h) && aligned16(y) && aligned16(dout) && aligned16(dh) && aligned16(dy) &&
                   (reinterpret_cast<uintptr_t>(dy16) & 7) == 0;
  // Without dpost and dcomb (nobody reads them: the first site's, where its input gradient is not formed), h and y
  // are not read.
  const bool sums = dpost || dcomb;
  auto kernel = vec ? mhc_post_bwd_kernel<S, true, false> : mhc_post_bwd_kernel<S, false, false>;
  if (accumulate)
    kernel = vec ? mhc_post_bwd_kernel<S, true, true> : mhc_post_bwd_kernel<S, false, true>;
  else if (!sums)
    kernel = vec ? mhc_post_bwd_kernel<S, true, false, false> : mhc_post_bwd_kernel<S, false, false, false>;
  kernel<<<static_cast<unsigned>(T), kPostThreads, 0, st>>>(h, y, post, comb, dout, dh, dy, dy16, dpost, dcomb, D);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

// The stream count is a template parameter so that the per-thread accumulators stay in registers.
#define NEXTLM_MHC_BWD_DISPATCH(S_, CALL)                                                      \
  switch (S_) {                                                                                \
    case 1: CALL(1); break;                                                                    \
    case 2: CALL(2); break;                                                                    \
    case 3: CALL(3); break;                                                                    \
    case 4: CALL(4); break;                                                                    \
    case 6: CALL(6); break;                                                                    \
    case 8: CALL(8); break;                                                                    \
    default: fail("CUDA mHC backward: hc_mult ", S_, " is not instantiated (1, 2, 3, 4, 6, 8)"); \
  }

int64_t rmsnorm_backward_workspace_floats(int64_t rows, int64_t n) { return rows + norm_row_blocks(rows) * n; }

void rmsnorm_backward(const float* x, int64_t ldx, const float* w, const float* dy, float* dx, float* dw, int64_t rows,
                      int64_t n, float eps, float* work, cudaStream_t st) {
  rmsnorm_backward_impl(x, ldx, w, dy, dx, 1, 1.0f, dw, rows, n, eps, work, st);
}

int64_t mhc_pre_backward_workspace_floats(int64_t T, int64_t S, int64_t D) { return PreWork(T, S, D).total; }

bool mhc_pre_backward_forms_mix(int64_t S, bool params) { return !params && S >= 1 && S <= 4; }

void mhc_pre_backward(const MhcParams& p, const float* h, const float* dpost, const float* dcomb, const float* da,
                      float* dh, float* dfn, float* dbase, float* dscale, float* dnorm_w, float* work,
                      cudaStream_t st, const float* mix, const float* dout, const float* comb) {
  if (!p.T) return;
#define CALL(S) \
  launch_pre_backward<S>(p, h, dpost, dcomb, da, dh, dfn, dbase, dscale, dnorm_w, work, mix, dout, comb, st)
  NEXTLM_MHC_BWD_DISPATCH(p.S, CALL)
#undef CALL
}

void mhc_post_backward(const float* h, const float* y, const float* post, const float* comb, const float* dout,
                       float* dh, float* dy, float* dpost, float* dcomb, int64_t T, int64_t S, int64_t D,
                       cudaStream_t st, bool accumulate, bf16* dy16) {
  if (!T) return;
  check(!(accumulate && dy16 && !dy), "mhc_post_backward: a bf16 dy alone cannot be accumulated into");
#define CALL(S) launch_post_backward<S>(h, y, post, comb, dout, dh, dy, dy16, dpost, dcomb, T, D, accumulate, st)
  NEXTLM_MHC_BWD_DISPATCH(S, CALL)
#undef CALL
}

void stream_mean_norm_backward(const float* h, const float* w, const float* dout, float* dh, float* dw, int64_t T,
                               int64_t S, int64_t D, float eps, float* work, cudaStream_t st, bool accumulate,
                               const float* mean) {
  if (!T) return;
  const float* hm = mean;  // [T, D] the stream mean
  if (!hm) {
    float* m = work + rmsnorm_backward_workspace_floats(T, D);
    stream_mean_kernel<<<grid_for(T * D), 256, 0, st>>>(h, m, T, S, D);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    hm = m;
  }
  rmsnorm_backward_impl(hm, D, w, dout, dh, S, 1.0f / static_cast<float>(S), dw, T, D, eps, work, st, accumulate);
}

}  // namespace nextlm::cuda
