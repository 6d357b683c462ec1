// mHC on the GPU: the pre pass (stream norm, fn projection, sigmoid/softmax/Sinkhorn, the collapse with the
// sub-layer's RMSNorm) in two kernels, and the post-mix. Matches src/model/mhc.cpp, all in fp32.
//
// Batch invariance: every sum a token's outputs go through has an order fixed by S and D alone. The projection
// m = fn·h[t] (with Σh² beside it) is split over S·D in chunks of kChunk; inside a chunk, tile i (kBK wide) gives
// warp w the columns [i·kBK + 8w, i·kBK + 8w + 8), accumulated in column order by one fma chain per output; the
// warps' chains are summed in warp order and the chunks' partials in chunk order. Both projection kernels (tiled for
// batches, a block per chunk and chain for a few tokens, whose chains the apply kernel sums) follow exactly these
// chains, so a token's bits do not depend on T. The apply kernel's sigmoid, softmax and Sinkhorn are the CPU loops'
// operations in their order (each line sum left to right, IEEE division), as mhc_backward.cu's recomputation is.
#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunk = 1024;  // S·D columns per split (a fixed split count for a given S·D: 16 at S·D = 16384)
constexpr int kBK = 64;           // columns per pipeline tile: 8 per warp
constexpr int kStages = 3;
constexpr int64_t kRowsMaxT = 16;  // up to this many tokens, the per-token projection kernel (decode)
static_assert(kBK == 8 * kWarps && kChunk % kBK == 0, "a tile gives each warp 8 columns");

int64_t num_splits(int64_t SD) { return ceil_div(SD, kChunk); }

// The tiled projection of S streams: BM tokens a block, all M = (2+S)·S outputs and Σh² (N = M + 1 in all). Lane
// pair g = lane / 2 holds tokens g, g + 16, … (TQ of them); lane parity picks one half of the outputs (MH each; fn's
// rows are padded to 2·MH with zeros). Pairs of lanes then read the same h address and lanes two apart the same fn
// address, which the shared-memory return path packs (2 wavefronts a 16-byte read): per 4 columns of 4 tokens × 12
// outputs a warp makes 4 h and 12 fn reads (about 32 wavefronts) for 192 FMAs (48 cycles of the SM's FMA pipes).
template <int S>
struct ProjTile {
  static constexpr int M = (2 + S) * S;
  static constexpr int N = M + 1;
  static constexpr int MH = (M + 1) / 2;
  static constexpr int TQ = S <= 4 ? 4 : 2;  // 4·12 accumulators at S = 4
  static constexpr int BM = 16 * TQ;
  static constexpr int LDH = kBK + 4;  // padded rows: 8 rows' 16-byte reads at one column hit distinct banks
  static constexpr int LDF = kBK + 4;  // and fn rows m and MH + m too (at S = 4)
  static constexpr int stage_floats = BM * LDH + 2 * MH * LDF;
  static constexpr int red_floats = kWarps * BM * N;
  static constexpr size_t smem_bytes =
      sizeof(float) * static_cast<size_t>(kStages * stage_floats > red_floats ? kStages * stage_floats : red_floats);
};

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}

// Issues the copies of tile i of this block's chunk [k0, k1): h rows t0 … t0+BM−1 and all M rows of fn, columns
// k0 + i·kBK …; rows past T and columns past k1 are zero-filled. VEC: 16-byte copies (S·D and the bases a multiple
// of 4 floats), else 4-byte ones.
template <int S, bool VEC>
__device__ __forceinline__ void load_tile(float* hs, float* fs, const float* h, const float* fn, int64_t t0, int64_t T,
                                          int64_t SD, int64_t kb, int64_t k1) {
  using P = ProjTile<S>;
  constexpr int W = VEC ? 4 : 1;
  constexpr int per_row = kBK / W;
  for (int idx = threadIdx.x; idx < P::BM * per_row; idx += kThreads) {
    const int r = idx / per_row, c = (idx % per_row) * W;
    const int64_t t = t0 + r, k = kb + c;
    const bool ok = t < T && k < k1;
    const float* src = ok ? h + t * SD + k : h;
    if constexpr (VEC) {
      cp_async16(hs + r * P::LDH + c, src, ok);
    } else {
      cp_async4(hs + r * P::LDH + c, src, ok);
    }
  }
  for (int idx = threadIdx.x; idx < 2 * P::MH * per_row; idx += kThreads) {
    const int m = idx / per_row, c = (idx % per_row) * W;
    const int64_t k = kb + c;
    const bool ok = m < P::M && k < k1;
    const float* src = ok ? fn + m * SD + k : fn;
    if constexpr (VEC) {
      cp_async16(fs + m * P::LDF + c, src, ok);
    } else {
      cp_async4(fs + m * P::LDF + c, src, ok);
    }
  }
}

// The 8 columns [col, col + 8) of one tile for the thread's first NT tokens: one fma chain per (token, output), in
// column order; acc[j][MH] is Σh² (kept by both lanes of a pair, stored by the even one).
template <int S, int NT, int TQ>
__device__ __forceinline__ void tile_fma_cols(const float* hs, const float* fs, int col,
                                              float (&acc)[TQ][ProjTile<S>::MH + 1]) {
  using P = ProjTile<S>;
  const int lane = threadIdx.x & 31;
  const float* hrow = hs + (lane >> 1) * P::LDH + col;
  const float* frow = fs + (lane & 1) * P::MH * P::LDF + col;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    float4 x[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      x[j] = *reinterpret_cast<const float4*>(hrow + 16 * j * P::LDH + 4 * q);
      float& ss = acc[j][P::MH];
      ss = fmaf(x[j].x, x[j].x, ss);
      ss = fmaf(x[j].y, x[j].y, ss);
      ss = fmaf(x[j].z, x[j].z, ss);
      ss = fmaf(x[j].w, x[j].w, ss);
    }
#pragma unroll
    for (int m = 0; m < P::MH; ++m) {
      const float4 f = *reinterpret_cast<const float4*>(frow + m * P::LDF + 4 * q);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float& a = acc[j][m];
        a = fmaf(x[j].x, f.x, a);
        a = fmaf(x[j].y, f.y, a);
        a = fmaf(x[j].z, f.z, a);
        a = fmaf(x[j].w, f.w, a);
      }
    }
  }
}

// The tiled kernel's: warp w takes the columns [8w, 8w + 8) of every tile.
template <int S, int NT>
__device__ __forceinline__ void tile_fma(const float* hs, const float* fs,
                                         float (&acc)[ProjTile<S>::TQ][ProjTile<S>::MH + 1]) {
  tile_fma_cols<S, NT, ProjTile<S>::TQ>(hs, fs, (threadIdx.x >> 5) * 8, acc);
}

// Grid (token tiles, splits). part [splits, T, N]: chunk sp's fn·h[t] (M values) and Σh² of token t.
template <int S, bool VEC>
__global__ void __launch_bounds__(kThreads, S <= 4 ? 2 : 1)
    mhc_project_tiled_kernel(const float* h, const float* fn, float* part, int64_t T, int64_t SD) {
  using P = ProjTile<S>;
  extern __shared__ __align__(16) float smem[];
  const int64_t t0 = int64_t(blockIdx.x) * P::BM, sp = blockIdx.y;
  const int64_t k0 = sp * kChunk, k1 = min(SD, k0 + kChunk);
  const int nt = static_cast<int>((k1 - k0 + kBK - 1) / kBK);
  // Only the token rows below T (in steps of 16) for small batches: the same chains, fewer of them.
  const int64_t rows16 = (T - t0 + 15) / 16;
  const int nj = rows16 < P::TQ ? static_cast<int>(rows16) : P::TQ;
  float acc[P::TQ][P::MH + 1];
#pragma unroll
  for (int j = 0; j < P::TQ; ++j)
#pragma unroll
    for (int n = 0; n <= P::MH; ++n) acc[j][n] = 0.0f;

  auto hs = [&](int s) { return smem + s * P::stage_floats; };
  auto fs = [&](int s) { return smem + s * P::stage_floats + P::BM * P::LDH; };  // [2·MH, LDF]
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nt) load_tile<S, VEC>(hs(s), fs(s), h, fn, t0, T, SD, k0 + int64_t(s) * kBK, k1);
    cp_async_commit();
  }
  for (int i = 0; i < nt; ++i) {
    cp_async_wait<kStages - 2>();  // tile i has landed (this thread's copies) …
    __syncthreads();               // … everyone's, and every warp is done with the buffer refilled below
    const int nx = i + kStages - 1;
    if (nx < nt) load_tile<S, VEC>(hs(nx % kStages), fs(nx % kStages), h, fn, t0, T, SD, k0 + int64_t(nx) * kBK, k1);
    cp_async_commit();
    const int b = i % kStages;
    if (P::TQ == 4 && nj == 4) {
      tile_fma<S, P::TQ>(hs(b), fs(b), acc);
    } else if (P::TQ == 4 && nj == 3) {
      tile_fma<S, P::TQ == 4 ? 3 : 1>(hs(b), fs(b), acc);
    } else if (nj >= 2) {
      tile_fma<S, 2>(hs(b), fs(b), acc);
    } else {
      tile_fma<S, 1>(hs(b), fs(b), acc);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become red [warps, BM, N]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, half = lane & 1;
  float* red = smem;
#pragma unroll
  for (int j = 0; j < P::TQ; ++j) {
    float* row = red + (warp * P::BM + (lane >> 1) + 16 * j) * P::N;
#pragma unroll
    for (int m = 0; m < P::MH; ++m)
      if (half * P::MH + m < P::M) row[half * P::MH + m] = acc[j][m];
    if (!half) row[P::M] = acc[j][P::MH];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < P::BM * P::N; idx += kThreads) {
    const int r = idx / P::N;
    if (t0 + r >= T) break;  // idx only grows
    float v = red[idx];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v += red[w * P::BM * P::N + idx];
    part[(sp * T + t0) * P::N + idx] = v;
  }
}

// The same chains for a few tokens (decode), spread so that a batch of one still fills the GPU: a block per (chunk,
// warp chain) pair, blockIdx.x = sp·kWarps + w, takes chain w's columns of chunk sp (tile i's [i·kBK + 8w, +8), at
// most kChunk / kWarps = 128 of them) of all M fn rows and of the T tokens' h rows into shared memory with
// asynchronous copies all in flight at once, then one thread a (token, output) runs that chain's fma chain in column
// order (output M: h times itself, Σh²). chains [splits, T, N, kWarps] keeps the chains apart; the apply kernel sums
// them in warp order, then the chunks in chunk order, exactly as the tiled kernel and its apply do.
constexpr int kRowsThreads = 512;                 // T·N chains a block: 400 at T = 16, S = 4
constexpr int kGroupCols = int(kChunk) / kWarps;  // columns of one chain in one chunk
constexpr int kLdG = kGroupCols + 4;              // padded rows: 8 rows' 16-byte reads at one column hit distinct banks

template <int S>
size_t rows_smem_bytes(int64_t T) {
  return sizeof(float) * static_cast<size_t>((ProjTile<S>::M + T) * kLdG);
}

// Columns 4q … 4q+3 of a chain: acc += a·b (a an h row, b an fn row or a itself) in column order.
__device__ __forceinline__ void chain4(const float* a, const float* b, int q, float& acc) {
  const float4 x = *reinterpret_cast<const float4*>(a + 4 * q);
  const float4 f = *reinterpret_cast<const float4*>(b + 4 * q);
  acc = fmaf(x.x, f.x, acc);
  acc = fmaf(x.y, f.y, acc);
  acc = fmaf(x.z, f.z, acc);
  acc = fmaf(x.w, f.w, acc);
}

template <int S, bool VEC>
__global__ void __launch_bounds__(kRowsThreads)
    mhc_project_rows_kernel(const float* h, const float* fn, float* chains, int64_t T, int64_t SD) {
  using P = ProjTile<S>;
  constexpr int kFullTiles = int(kChunk) / kBK;
  extern __shared__ __align__(16) float smem[];  // [M + T, kLdG]: the fn rows, then the h rows
  const int w = static_cast<int>(blockIdx.x % kWarps);
  const int64_t sp = blockIdx.x / kWarps;
  const int64_t k0 = sp * kChunk, k1 = min(SD, k0 + kChunk);
  const int nt = static_cast<int>((k1 - k0 + kBK - 1) / kBK);
  const int rows = P::M + static_cast<int>(T);
  // Column j of the chain (tile j / 8, offset j % 8) is column k0 + (j / 8)·kBK + 8w + j % 8 of S·D; those past the
  // chunk are zero-filled, as the tiled kernel's copies are.
  constexpr int W = VEC ? 4 : 1;
  const int per_row = nt * 8 / W;
  for (int idx = threadIdx.x; idx < rows * per_row; idx += kRowsThreads) {
    const int r = idx / per_row, j = (idx % per_row) * W;
    const int64_t k = k0 + int64_t(j >> 3) * kBK + 8 * w + (j & 7);
    const bool ok = k < k1;  // VEC: k and k1 are multiples of 4, so the whole float4 is in or out
    const float* row = r < P::M ? fn + r * SD : h + (r - P::M) * SD;
    float* dst = smem + r * kLdG + j;
    if constexpr (VEC) {
      cp_async16(dst, ok ? row + k : row, ok);
    } else {
      cp_async4(dst, ok ? row + k : row, ok);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int idx = threadIdx.x; idx < static_cast<int>(T) * P::N; idx += kRowsThreads) {
    const int t = idx / P::N, n = idx % P::N;
    const float* a = smem + (P::M + t) * kLdG;
    const float* b = n < P::M ? smem + n * kLdG : a;
    float acc = 0.0f;
    if (nt == kFullTiles) {
#pragma unroll
      for (int q = 0; q < 2 * kFullTiles; ++q) chain4(a, b, q, acc);
    } else {
#pragma unroll 4
      for (int q = 0; q < 2 * nt; ++q) chain4(a, b, q, acc);
    }
    chains[((sp * T + t) * P::N + n) * kWarps + w] = acc;
  }
}

// The apply kernel's blocks: the first nsk take skt tokens each, a warp a token, for the mix (post, comb: sigmoid,
// softmax, Sinkhorn); the T after them a token each for the collapse a = RMSNorm(Σ_s pre[s]·h[t, s]; norm_w). pre
// does not depend on comb, so the Sinkhorn's serial steps run beside the collapse. Up to kSkOneMaxT tokens (all of
// them fit one wave of blocks) a Sinkhorn block takes one token, so that its chains are loaded in one round and all
// run at once; beyond, kWarps tokens, for fewer blocks. The grouping changes no token's arithmetic.
constexpr int kSumSplits = 16;  // chunk partials staged in shared memory at a time
constexpr int64_t kSkOneMaxT = 128;
int sk_tokens(int64_t T) { return T <= kSkOneMaxT ? 1 : kWarps; }

template <int S>
struct ApplyDims {
  static constexpr int M = (2 + S) * S, N = M + 1;
  static constexpr int NS = N - S;  // the Sinkhorn blocks' outputs S … M: post and comb logits, Σh²
  static constexpr int NC = S + 1;  // the collapse blocks' outputs 0 … S−1 and M: pre logits, Σh²
  // The Sinkhorn's S×S matrix over the lanes: entry (r, c) in slot r / RP of lane (r % RP)·S + c.
  static constexpr int RP = 32 / S;
  static constexpr int E = (S + RP - 1) / RP;
  // Collapse columns (VEC: float4s) a thread loads before using them: after the rows kernel all of D = 4096 at S = 4
  // at once (a few blocks, latency bound); after the tiled one few, for the registers of many blocks an SM.
  static constexpr int collapse_batch(int W) { return W == 1 ? 1 : S <= 4 ? 4 : 2; }
  static constexpr size_t static_bytes = sizeof(float) * (kWarps * NS + S + 32);
  static size_t dyn_bytes(int64_t D) {
    const int64_t sk = int64_t(kWarps) * kSumSplits * NS, col = int64_t(kSumSplits) * NC;
    return sizeof(float) * static_cast<size_t>(std::max({2 * D, sk, col}));
  }
};

// A thread's collapse columns: one float (VEC false) or four consecutive ones.
template <bool VEC>
struct Cols {
  using T = float;
  static constexpr int W = 1;
  static __device__ __forceinline__ T load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, T v) { *p = v; }
  static __device__ __forceinline__ T zero() { return 0.0f; }
  static __device__ __forceinline__ T fma(float a, T x, T v) { return fmaf(a, x, v); }
  static __device__ __forceinline__ float sum_sq(T v, float ss) { return fmaf(v, v, ss); }
};
template <>
struct Cols<true> {
  using T = float4;
  static constexpr int W = 4;
  static __device__ __forceinline__ T load(const float* p) { return *reinterpret_cast<const float4*>(p); }
  static __device__ __forceinline__ void store(float* p, T v) { *reinterpret_cast<float4*>(p) = v; }
  static __device__ __forceinline__ T zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  static __device__ __forceinline__ T fma(float a, T x, T v) {
    return make_float4(fmaf(a, x.x, v.x), fmaf(a, x.y, v.y), fmaf(a, x.z, v.z), fmaf(a, x.w, v.w));
  }
  static __device__ __forceinline__ float sum_sq(T v, float ss) {
    ss = fmaf(v.x, v.x, ss);
    ss = fmaf(v.y, v.y, ss);
    ss = fmaf(v.z, v.z, ss);
    return fmaf(v.w, v.w, ss);
  }
};

// mix[k, j] = output nmap(j) of token t0 + k summed over chunks in chunk order, each chunk's partial being its W
// chains summed in warp order (W = 1: part [splits, T, N] holds the partials). The chains of kSumSplits chunks are
// loaded at a time (Q·W loads a thread in flight) and summed into psum [ntok, ≤ kSumSplits, NO]. Ends synced.
template <int N, int W, int NO, typename Map>
__device__ __forceinline__ void sum_partials(const float* part, int64_t T, int64_t splits, int64_t t0, int ntok,
                                             Map nmap, float* psum, float* mix) {
  constexpr int Q = W == 1 ? 8 : 2;
  for (int64_t g0 = 0; g0 < splits; g0 += kSumSplits) {
    const int ng = static_cast<int>(min(int64_t(kSumSplits), splits - g0));
    const int count = ntok * ng * NO;
    for (int b = threadIdx.x; b < count; b += Q * kThreads) {
      float v[Q][W] = {};
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const int idx = b + q * kThreads;
        if (idx < count) {
          const int j = idx % NO, sp = (idx / NO) % ng, k = idx / (NO * ng);
          const float* src = part + (((g0 + sp) * T + t0 + k) * N + nmap(j)) * W;
#pragma unroll
          for (int w = 0; w < W; ++w) v[q][w] = src[w];
        }
      }
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const int idx = b + q * kThreads;
        if (idx < count) {
          float s = v[q][0];
#pragma unroll
          for (int w = 1; w < W; ++w) s += v[q][w];
          psum[idx] = s;
        }
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ntok * NO; idx += kThreads) {
      const int k = idx / NO, j = idx % NO;
      const float* ps = psum + k * ng * NO + j;
      float s = g0 == 0 ? ps[0] : mix[idx] + ps[0];
      for (int sp = 1; sp < ng; ++sp) s += ps[sp * NO];
      mix[idx] = s;
    }
    __syncthreads();
  }
}

// One Sinkhorn normalisation of the columns: every lane gathers its column's S entries by shuffles and sums them in
// row order, as the CPU loop does; C /= (sum + eps).
template <int S>
__device__ __forceinline__ void sinkhorn_cols(float (&C)[ApplyDims<S>::E], int lane, float eps) {
  using A = ApplyDims<S>;
  const int cc = lane % S;
  float sum = 0.0f;
#pragma unroll
  for (int r = 0; r < S; ++r) sum += __shfl_sync(0xffffffffu, C[r / A::RP], (r % A::RP) * S + cc);
#pragma unroll
  for (int e = 0; e < A::E; ++e) C[e] /= sum + eps;
}

// The same for the rows (summed in column order).
template <int S>
__device__ __forceinline__ void sinkhorn_rows(float (&C)[ApplyDims<S>::E], int lane, float eps) {
  using A = ApplyDims<S>;
  const int rb = (lane / S) * S;
#pragma unroll
  for (int e = 0; e < A::E; ++e) {
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < S; ++c) sum += __shfl_sync(0xffffffffu, C[e], rb + c);
    C[e] /= sum + eps;
  }
}

// A warp: token t's post and comb from mx = its mix outputs S … M. Lanes past the matrix (and slots past row S)
// carry benign values through the shuffles and are never read by a matrix entry nor written.
template <int S>
__device__ __forceinline__ void mix_token(const MhcParams& p, const float* mx, int64_t t, float* post, float* comb,
                                          int lane) {
  using A = ApplyDims<S>;
  const float r = rsqrtf(mx[A::NS - 1] / static_cast<float>(S * p.D) + p.rms_eps);  // fn·(f·r) = r·(fn·f)
  const float* base = p.base;
  const float* sc = p.scale;
  const float eps = p.hc_eps;
  if (lane < S) post[t * S + lane] = 2.0f / (1.0f + expf(-((mx[lane] * r) * sc[1] + base[S + lane])));
  const int rl = lane / S, cc = lane % S, rb = rl * S;
  float C[A::E];
  bool valid[A::E];
#pragma unroll
  for (int e = 0; e < A::E; ++e) {  // softmax of row rr
    const int rr = e * A::RP + rl;
    valid[e] = rl < A::RP && rr < S;
    const float z = valid[e] ? (mx[S + rr * S + cc] * r) * sc[2] + base[2 * S + rr * S + cc] : 0.0f;
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < S; ++c) m = fmaxf(m, __shfl_sync(0xffffffffu, z, rb + c));
    const float ex = expf(z - m);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < S; ++c) sum += __shfl_sync(0xffffffffu, ex, rb + c);
    C[e] = (valid[e] ? ex : 1.0f) / (valid[e] ? sum : 1.0f) + eps;
  }
  sinkhorn_cols<S>(C, lane, eps);
  for (int it = 0; it + 1 < p.iters; ++it) {
    sinkhorn_rows<S>(C, lane, eps);
    sinkhorn_cols<S>(C, lane, eps);
  }
#pragma unroll
  for (int e = 0; e < A::E; ++e)
    if (valid[e]) comb[t * S * S + (e * A::RP + rl) * S + cc] = C[e];
}

// part: the projection's chains [splits, T, N, W] (W = kWarps, the rows kernel) or partials [splits, T, N] (W = 1,
// the tiled one). VEC: D and the bases a multiple of 4 floats (the collapse's loads and its Σx² order).
// mixo (optional) [T, N]: the summed mix each token's coefficients came from (fn·h [M], Σh²), written by the blocks
// that summed it (the Sinkhorn blocks S … M, the collapse blocks 0 … S−1), for the backward to reuse.
template <int S, bool VEC, int W>
__global__ void __launch_bounds__(kThreads)
    mhc_apply_kernel(MhcParams p, const float* h, const float* part, int64_t splits, int skt, int64_t nsk, float* post,
                     float* comb, bf16* a, float* mixo) {
  using A = ApplyDims<S>;
  extern __shared__ __align__(16) float smem[];  // psum, then (collapse) x [D] and norm_w [D]
  __shared__ float mix[kWarps * A::NS];  // skt·NS, or NC
  __shared__ float pre[S];
  __shared__ float scratch[32];
  const int64_t T = p.T, D = p.D, SD = S * D;
  if (int64_t(blockIdx.x) < nsk) {
    const int64_t t0 = int64_t(blockIdx.x) * skt;
    const int ntok = static_cast<int>(min(int64_t(skt), T - t0));
    sum_partials<A::N, W, A::NS>(part, T, splits, t0, ntok, [](int j) { return S + j; }, smem, mix);
    if (mixo)
      for (int idx = threadIdx.x; idx < ntok * A::NS; idx += kThreads)
        mixo[(t0 + idx / A::NS) * A::N + S + idx % A::NS] = mix[idx];
    const int warp = threadIdx.x >> 5;
    if (warp < ntok) mix_token<S>(p, mix + warp * A::NS, t0 + warp, post, comb, threadIdx.x & 31);
    return;
  }

  const int64_t t = int64_t(blockIdx.x) - nsk;
  // x = Σ_s pre[s]·h[t, s] into xs and norm_w into ws, U columns (VEC: float4s) a thread loaded before any is used,
  // the first U before the mix is summed (they do not depend on it); each thread's Σx² in its column order.
  using V = Cols<VEC>;
  constexpr int U = A::collapse_batch(W);
  const int64_t first = V::W * int64_t(threadIdx.x), stride = V::W * int64_t(kThreads);
  const float* ht = h + t * SD;
  typename V::T x[U][S], wv[U];
  auto load = [&](int64_t d0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t d = d0 + stride * u;
      if (d < D) {
#pragma unroll
        for (int s = 0; s < S; ++s) x[u][s] = V::load(ht + s * D + d);
        wv[u] = V::load(p.norm_w + d);
      }
    }
  };
  load(first);
  sum_partials<A::N, W, A::NC>(part, T, splits, t, 1, [](int j) { return j < S ? j : A::M; }, smem, mix);
  if (threadIdx.x < S) {
    const int s = threadIdx.x;
    if (mixo) mixo[t * A::N + s] = mix[s];
    const float r = rsqrtf(mix[S] / static_cast<float>(SD) + p.rms_eps);
    pre[s] = 1.0f / (1.0f + expf(-((mix[s] * r) * p.scale[0] + p.base[s]))) + p.hc_eps;
  }
  __syncthreads();  // pre is set; the partials in smem are no longer needed
  float pr[S];
#pragma unroll
  for (int s = 0; s < S; ++s) pr[s] = pre[s];
  float* xs = smem;
  float* ws = smem + D;
  float ss = 0.0f;
  for (int64_t d0 = first; d0 < D; d0 += stride * U) {
    if (d0 != first) load(d0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t d = d0 + stride * u;
      if (d < D) {
        typename V::T v = V::zero();
#pragma unroll
        for (int s = 0; s < S; ++s) v = V::fma(pr[s], x[u][s], v);
        V::store(xs + d, v);
        V::store(ws + d, wv[u]);
        ss = V::sum_sq(v, ss);
      }
    }
  }
  // Each thread reads back only the columns it wrote.
  const float r2 = rsqrtf(block_sum(ss, scratch) / static_cast<float>(D) + p.rms_eps);
  bf16* at = a + t * D;
  if constexpr (VEC) {
    for (int64_t d = first; d < D; d += stride) {
      const float4 v = *reinterpret_cast<const float4*>(xs + d);
      const float4 w = *reinterpret_cast<const float4*>(ws + d);
      __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(at + d);
      out[0] = __floats2bfloat162_rn(w.x * (v.x * r2), w.y * (v.y * r2));
      out[1] = __floats2bfloat162_rn(w.z * (v.z * r2), w.w * (v.w * r2));
    }
  } else {
    for (int64_t d = first; d < D; d += stride) at[d] = __float2bfloat16(ws[d] * (xs[d] * r2));
  }
}

// Stream s's new values at four consecutive columns of a token: ps·y + Σ_r ct[r·S + s]·old[r], r in order (the
// vectorised post-mix kernel's arithmetic, which the fused post-mix + projection shares, for the same bits).
template <int S>
__device__ __forceinline__ float4 post_mix4(const float4 (&old)[S], float4 yt, float ps, const float* ct, int s) {
  float4 v = make_float4(ps * yt.x, ps * yt.y, ps * yt.z, ps * yt.w);
#pragma unroll
  for (int r = 0; r < S; ++r) {
    const float c = ct[r * S + s];
    v.x += c * old[r].x, v.y += c * old[r].y, v.z += c * old[r].z, v.w += c * old[r].w;
  }
  return v;
}

// One thread per (t, d) (VEC: 4 consecutive d): reads the S old values from h, writes the S new ones to out (which
// may be h: a thread writes only what it has read).
template <int S, bool VEC>
__global__ void mhc_post_kernel(const float* h, float* out, const float* y, const float* post, const float* comb,
                                int64_t D) {
  constexpr int W = VEC ? 4 : 1;
  const int64_t t = blockIdx.y;
  const int64_t d = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * W;
  if (d >= D) return;
  const float* ht = h + t * S * D;
  float* ot = out + t * S * D;
  const float* ct = comb + t * S * S;
  if constexpr (VEC) {
    float4 old[S];
#pragma unroll
    for (int r = 0; r < S; ++r) old[r] = *reinterpret_cast<const float4*>(ht + r * D + d);
    const float4 yt = *reinterpret_cast<const float4*>(y + t * D + d);
#pragma unroll
    for (int s = 0; s < S; ++s)
      *reinterpret_cast<float4*>(ot + s * D + d) = post_mix4<S>(old, yt, post[t * S + s], ct, s);
  } else {
    float old[S];
#pragma unroll
    for (int r = 0; r < S; ++r) old[r] = ht[r * D + d];
    const float yt = y[t * D + d];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      float v = post[t * S + s] * yt;
#pragma unroll
      for (int r = 0; r < S; ++r) v += ct[r * S + s] * old[r];
      ot[s * D + d] = v;
    }
  }
}

// The post-mix fused with the next site's projection (where a site's new streams are the next site's mHC input:
// training's forward and the prefill), so that the new streams are not read back: a block takes BM tokens and one
// group g of kChunk columns of every stream. Per 64-column tile it forms the new values of all S streams from the
// old ones (post_mix4, in shared memory over the old values and into out), then runs the projection of the S
// chunks s·(D / kChunk) + g on them with exactly the tiled kernel's chains: each warp takes R of the tiled kernel's
// warps' column sets of one chunk, TQ tokens a lane pair (a token's chains do not depend on how many tokens a
// thread holds), and the chains are summed in warp order into the same partials [splits, T, N]: the same bits as
// mhc_post then mhc_project_tiled_kernel. D a multiple of kChunk (no chunk spans two streams), S <= 4 (the
// accumulators of R·TQ chains fit), T past kRowsMaxT (the tiled projection's range). 1 block an SM (16 warps at
// S = 4) with three stages of copies in flight.
template <int S>
struct PostProj {
  using P = ProjTile<S>;
  static constexpr int BM = 32, TQ = 2, R = 2;
  static constexpr int warps = S * kWarps / R, threads = 32 * warps;
  static constexpr int h_floats = S * BM * P::LDH;  // [S, BM, LDH]: old values, then new ones
  static constexpr int y_floats = BM * kBK;         // [BM, kBK]
  static constexpr int f_floats = S * 2 * P::MH * P::LDF;  // [S, 2·MH, LDF]: each chunk's fn rows
  static constexpr int stage_floats = h_floats + y_floats + f_floats;
  static constexpr int red_floats = S * kWarps * BM * P::N;  // [S, kWarps, BM, N]
  static constexpr int pipe_floats = kStages * stage_floats > red_floats ? kStages * stage_floats : red_floats;
  static constexpr int mix_floats = BM * (S + S * S);  // post [BM, S], then comb [BM, S, S]
  static constexpr size_t smem_bytes = sizeof(float) * static_cast<size_t>(pipe_floats + mix_floats);
  static_assert(kWarps % R == 0 && BM == 16 * TQ, "warps take whole sets of column groups; lane pairs all rows");
};

// The copies of one tile (columns d0 … d0 + kBK − 1 of each stream): the old values of the block's tokens, their y
// and each chunk's fn rows; token rows past T and fn rows past M are zero-filled. (The copy loops are not unrolled:
// their addresses, held across the tile, made the kernel spill at its 128 registers.)
template <int S>
__device__ __forceinline__ void load_post_tile(float* hs, float* ys, float* fs, const float* h, const float* y,
                                               const float* fn, int64_t t0, int64_t T, int64_t D, int64_t d0) {
  using F = PostProj<S>;
  using P = ProjTile<S>;
  constexpr int per_row = kBK / 4;
  const int64_t SD = S * D;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < S * F::BM * per_row; idx += F::threads) {
    const int row = idx / per_row, c = (idx % per_row) * 4;  // row = r·BM + t
    const int64_t t = t0 + row % F::BM;
    const bool ok = t < T;
    cp_async16(hs + row * P::LDH + c, ok ? h + t * SD + (row / F::BM) * D + d0 + c : h, ok);
  }
#pragma unroll 1
  for (int idx = threadIdx.x; idx < F::BM * per_row; idx += F::threads) {
    const int row = idx / per_row, c = (idx % per_row) * 4;
    const bool ok = t0 + row < T;
    cp_async16(ys + row * kBK + c, ok ? y + (t0 + row) * D + d0 + c : y, ok);
  }
#pragma unroll 1
  for (int idx = threadIdx.x; idx < S * 2 * P::MH * per_row; idx += F::threads) {
    const int row = idx / per_row, c = (idx % per_row) * 4;  // row = s·2MH + m
    const int m = row % (2 * P::MH);
    const bool ok = m < P::M;
    cp_async16(fs + row * P::LDF + c, ok ? fn + m * SD + (row / (2 * P::MH)) * D + d0 + c : fn, ok);
  }
}

// Grid (token tiles of BM, D / kChunk column groups). out may be h (a block writes only the columns it has read).
template <int S>
__global__ void __launch_bounds__(PostProj<S>::threads, 1)
    mhc_post_project_kernel(const float* h, float* out, const float* y, const float* post, const float* comb,
                            const float* fn, float* part, int64_t T, int64_t D) {
  using F = PostProj<S>;
  using P = ProjTile<S>;
  extern __shared__ __align__(16) float smem[];
  float* mixs = smem + F::pipe_floats;
  const int64_t t0 = int64_t(blockIdx.x) * F::BM, g = blockIdx.y, SD = S * D, groups = D / kChunk;
  constexpr int nt = static_cast<int>(kChunk / kBK);
  for (int idx = threadIdx.x; idx < F::mix_floats; idx += F::threads) {
    float v = 0.0f;
    if (idx < F::BM * S) {
      if (t0 + idx / S < T) v = post[t0 * S + idx];
    } else {
      const int j = idx - F::BM * S;
      if (t0 + j / (S * S) < T) v = comb[t0 * S * S + j];
    }
    mixs[idx] = v;
  }
  auto hs = [&](int b) { return smem + b * F::stage_floats; };
  auto ys = [&](int b) { return smem + b * F::stage_floats + F::h_floats; };
  auto fs = [&](int b) { return smem + b * F::stage_floats + F::h_floats + F::y_floats; };
  const int64_t c0 = g * kChunk;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    load_post_tile<S>(hs(s), ys(s), fs(s), h, y, fn, t0, T, D, c0 + int64_t(s) * kBK);
    cp_async_commit();
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cs = warp / (kWarps / F::R);  // this warp's chunk: stream cs
  const int rp = warp % (kWarps / F::R);  // its column sets: the tiled kernel's warps R·rp … R·rp + R − 1
  float acc[F::R][F::TQ][P::MH + 1];
#pragma unroll
  for (int q = 0; q < F::R; ++q)
#pragma unroll
    for (int j = 0; j < F::TQ; ++j)
#pragma unroll
      for (int n = 0; n <= P::MH; ++n) acc[q][j][n] = 0.0f;

  for (int i = 0; i < nt; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int nx = i + kStages - 1;
    if (nx < nt)
      load_post_tile<S>(hs(nx % kStages), ys(nx % kStages), fs(nx % kStages), h, y, fn, t0, T, D,
                        c0 + int64_t(nx) * kBK);
    cp_async_commit();
    const int b = i % kStages;
    const int64_t d0 = c0 + int64_t(i) * kBK;
    // The post-mix: a thread takes four columns of a token in every stream.
    for (int idx = threadIdx.x; idx < F::BM * (kBK / 4); idx += F::threads) {
      const int t = idx / (kBK / 4), c = (idx % (kBK / 4)) * 4;
      float4 old[S];
#pragma unroll
      for (int r = 0; r < S; ++r) old[r] = *reinterpret_cast<const float4*>(hs(b) + (r * F::BM + t) * P::LDH + c);
      const float4 yt = *reinterpret_cast<const float4*>(ys(b) + t * kBK + c);
      const float* ct = mixs + F::BM * S + t * S * S;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const float4 v = post_mix4<S>(old, yt, mixs[t * S + s], ct, s);
        *reinterpret_cast<float4*>(hs(b) + (s * F::BM + t) * P::LDH + c) = v;
        if (t0 + t < T) *reinterpret_cast<float4*>(out + (t0 + t) * SD + s * D + d0 + c) = v;
      }
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < F::R; ++q)
      tile_fma_cols<S, F::TQ, F::TQ>(hs(b) + cs * F::BM * P::LDH, fs(b) + cs * 2 * P::MH * P::LDF,
                                     8 * (F::R * rp + q), acc[q]);
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become red [S, kWarps, BM, N]

  float* red = smem;
  const int half = lane & 1;
#pragma unroll
  for (int q = 0; q < F::R; ++q)
#pragma unroll
    for (int j = 0; j < F::TQ; ++j) {
      float* row = red + ((cs * kWarps + F::R * rp + q) * F::BM + (lane >> 1) + 16 * j) * P::N;
#pragma unroll
      for (int m = 0; m < P::MH; ++m)
        if (half * P::MH + m < P::M) row[half * P::MH + m] = acc[q][j][m];
      if (!half) row[P::M] = acc[q][j][P::MH];
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < S * F::BM * P::N; idx += F::threads) {
    const int s = idx / (F::BM * P::N), rem = idx % (F::BM * P::N);
    if (t0 + rem / P::N >= T) continue;
    const float* src = red + s * kWarps * F::BM * P::N + rem;
    float v = src[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v += src[w * F::BM * P::N];
    part[((s * groups + g) * T + t0) * P::N + rem] = v;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Opts a kernel in to more than the default 48 KB of shared memory when it needs it (static + dyn bytes).
template <typename K>
void allow_smem(K kernel, size_t static_bytes, size_t dyn) {
  if (static_bytes + dyn > 48 * 1024)
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)));
}

// The projection's partials of h into work.
template <int S>
void launch_project(const MhcParams& p, const float* h, float* work, cudaStream_t st) {
  using P = ProjTile<S>;
  const int64_t SD = S * p.D, splits = num_splits(SD);
  const bool rows = p.T <= kRowsMaxT;
  const bool proj_vec = SD % 4 == 0 && aligned16(h) && aligned16(p.fn);
  if (rows) {
    auto kernel = proj_vec ? mhc_project_rows_kernel<S, true> : mhc_project_rows_kernel<S, false>;
    const size_t smem = rows_smem_bytes<S>(p.T);
    allow_smem(kernel, 0, smem);
    kernel<<<static_cast<unsigned>(splits * kWarps), kRowsThreads, smem, st>>>(h, p.fn, work, p.T, SD);
  } else {
    const dim3 grid(static_cast<unsigned>(ceil_div(p.T, P::BM)), static_cast<unsigned>(splits));
    auto kernel = proj_vec ? mhc_project_tiled_kernel<S, true> : mhc_project_tiled_kernel<S, false>;
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(P::smem_bytes)));
    kernel<<<grid, kThreads, P::smem_bytes, st>>>(h, p.fn, work, p.T, SD);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

// The coefficients and the normed collapse from the partials launch_project left in work.
template <int S>
void launch_apply(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, const float* work,
                  float* mix, cudaStream_t st) {
  using A = ApplyDims<S>;
  const int64_t splits = num_splits(S * p.D);
  const bool rows = p.T <= kRowsMaxT;
  const bool vec = p.D % 4 == 0 && aligned16(h) && aligned16(p.norm_w) && reinterpret_cast<uintptr_t>(a) % 8 == 0;
  auto kernel = rows ? (vec ? mhc_apply_kernel<S, true, kWarps> : mhc_apply_kernel<S, false, kWarps>)
                     : (vec ? mhc_apply_kernel<S, true, 1> : mhc_apply_kernel<S, false, 1>);
  const size_t smem = A::dyn_bytes(p.D);
  allow_smem(kernel, A::static_bytes, smem);
  const int skt = sk_tokens(p.T);
  const int64_t nsk = ceil_div(p.T, skt);
  kernel<<<static_cast<unsigned>(nsk + p.T), kThreads, smem, st>>>(p, h, work, splits, skt, nsk, post, comb, a,
                                                                      mix);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <int S>
void launch_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, float* work, float* mix,
                cudaStream_t st) {
  launch_project<S>(p, h, work, st);
  launch_apply<S>(p, h, post, comb, a, work, mix, st);
}

template <int S>
void launch_post(const float* h, float* out, const float* y, const float* post, const float* comb, int64_t T,
                 int64_t D, cudaStream_t st) {
  const bool vec = D % 4 == 0 && aligned16(h) && aligned16(out) && aligned16(y);
  const int64_t per_thread = vec ? 4 : 1;
  const dim3 grid(static_cast<unsigned>(ceil_div(D, 256 * per_thread)), static_cast<unsigned>(T));
  if (vec) {
    mhc_post_kernel<S, true><<<grid, 256, 0, st>>>(h, out, y, post, comb, D);
  } else {
    mhc_post_kernel<S, false><<<grid, 256, 0, st>>>(h, out, y, post, comb, D);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

// The fused post-mix + projection where it applies (PostProj); false (nothing launched) elsewhere.
template <int S>
bool launch_post_project(const float* h, float* out, const float* y, const float* post, const float* comb,
                         const MhcParams& next, float* work, cudaStream_t st) {
  if constexpr (S > 4) {
    return false;
  } else {
    using F = PostProj<S>;
    const int64_t T = next.T, D = next.D;
    if (!mhc_post_project_fuses(T, S, D) || !aligned16(h) || !aligned16(out) || !aligned16(y) || !aligned16(next.fn))
      return false;
    auto kernel = mhc_post_project_kernel<S>;
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(F::smem_bytes)));
    const dim3 grid(static_cast<unsigned>(ceil_div(T, F::BM)), static_cast<unsigned>(D / kChunk));
    kernel<<<grid, F::threads, F::smem_bytes, st>>>(h, out, y, post, comb, next.fn, work, T, D);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    return true;
  }
}

}  // namespace

// The stream count is a template parameter so that the per-thread projection accumulators stay in registers.
#define NEXTLM_MHC_DISPATCH(S_, CALL)                     \
  switch (S_) {                                           \
    case 1: CALL(1); break;                               \
    case 2: CALL(2); break;                               \
    case 3: CALL(3); break;                               \
    case 4: CALL(4); break;                               \
    case 6: CALL(6); break;                               \
    case 8: CALL(8); break;                               \
    default: fail("CUDA mHC: hc_mult ", S_, " is not instantiated (1, 2, 3, 4, 6, 8)"); \
  }

// Up to kRowsMaxT tokens the chains [splits, T, N, kWarps], else the partials [splits, T, N]; past kRowsMaxT at least
// the chains of kRowsMaxT tokens, so that the size never shrinks as T grows (a buffer sized for a batch holds any
// smaller one).
int64_t mhc_pre_workspace_floats(int64_t T, int64_t S, int64_t D) {
  return num_splits(S * D) * ((2 + S) * S + 1) * std::max(T, std::min(T, kRowsMaxT) * kWarps);
}

void mhc_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, float* work, cudaStream_t st,
             float* mix) {
  if (!p.T) return;
#define CALL(S) launch_pre<S>(p, h, post, comb, a, work, mix, st)
  NEXTLM_MHC_DISPATCH(p.S, CALL)
#undef CALL
}

void mhc_pre_apply(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, const float* work,
                   cudaStream_t st, float* mix) {
  if (!p.T) return;
#define CALL(S) launch_apply<S>(p, h, post, comb, a, work, mix, st)
  NEXTLM_MHC_DISPATCH(p.S, CALL)
#undef CALL
}

bool mhc_post_project_fuses(int64_t T, int64_t S, int64_t D) {
  return T > kRowsMaxT && S >= 1 && S <= 4 && D % kChunk == 0;
}

bool mhc_post_project(const float* h, float* out, const float* y, const float* post, const float* comb,
                      const MhcParams& next, float* work, cudaStream_t st, bool fuse) {
  if (!next.T) return false;
  bool fused = false;
  if (fuse) {
#define CALL(S) fused = launch_post_project<S>(h, out, y, post, comb, next, work, st)
    NEXTLM_MHC_DISPATCH(next.S, CALL)
#undef CALL
  }
  if (fused) return true;
  mhc_post(h, out, y, post, comb, next.T, next.S, next.D, st);
#define CALL(S) launch_project<S>(next, out, work, st)
  NEXTLM_MHC_DISPATCH(next.S, CALL)
#undef CALL
  return false;
}

void mhc_post(float* h, const float* y, const float* post, const float* comb, int64_t T, int64_t S, int64_t D,
              cudaStream_t st) {
  mhc_post(h, h, y, post, comb, T, S, D, st);
}

void mhc_post(const float* h, float* out, const float* y, const float* post, const float* comb, int64_t T, int64_t S,
              int64_t D, cudaStream_t st) {
  if (!T) return;
#define CALL(S) launch_post<S>(h, out, y, post, comb, T, D, st)
  NEXTLM_MHC_DISPATCH(S, CALL)
#undef CALL
}

}  // namespace nextlm::cuda
