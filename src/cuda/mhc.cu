// mHC on the GPU: the pre pass (stream norm, fn projection, sigmoid/softmax/Sinkhorn, the collapse with the
// sub-layer's RMSNorm) in two kernels, and the post-mix. Matches src/model/mhc.cpp, all in fp32.
//
// Batch invariance: every sum a token's outputs go through has an order fixed by S and D alone. The projection
// m = fn·h[t] (with Σh² beside it) is split over S·D in chunks of kChunk; inside a chunk, tile i (kBK wide) gives
// warp w the columns [i·kBK + 8w, i·kBK + 8w + 8), accumulated in column order by one fma chain per output; the
// warps' chains are summed in warp order and the chunks' partials in chunk order. Both projection kernels (tiled for
// batches, per token for a few tokens) follow exactly these chains, so a token's bits do not depend on T.
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

// This warp's 8 columns of one tile for the thread's first NT tokens: one fma chain per (token, output), in column
// order; acc[j][MH] is Σh² (kept by both lanes of a pair, stored by the even one).
template <int S, int NT>
__device__ __forceinline__ void tile_fma(const float* hs, const float* fs,
                                         float (&acc)[ProjTile<S>::TQ][ProjTile<S>::MH + 1]) {
  using P = ProjTile<S>;
  const int lane = threadIdx.x & 31, col = (threadIdx.x >> 5) * 8;
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

// The same chains for one token a block: grid (T, splits); warp w, lane → outputs lane, lane + 32, … (the last is
// Σh²). For a few tokens (decode), where a tile would be mostly empty rows; fn then comes from L2 for every token.
template <int S>
__global__ void __launch_bounds__(kThreads)
    mhc_project_rows_kernel(const float* h, const float* fn, float* part, int64_t T, int64_t SD) {
  using P = ProjTile<S>;
  __shared__ float red[kWarps][P::N];
  const int64_t t = blockIdx.x, sp = blockIdx.y;
  const int64_t k0 = sp * kChunk, k1 = min(SD, k0 + kChunk);
  const int nt = static_cast<int>((k1 - k0 + kBK - 1) / kBK);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* ht = h + t * SD;
  for (int n = lane; n < P::N; n += 32) {
    const float* fr = n < P::M ? fn + n * SD : ht;  // the last output multiplies h by itself
    float acc = 0.0f;
#pragma unroll 4
    for (int i = 0; i < nt; ++i) {
      const int64_t kb = k0 + int64_t(i) * kBK + warp * 8;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int64_t k = kb + c;
        const bool ok = k < k1;  // past the chunk: the tiled kernel's zero fill
        acc = fmaf(ok ? ht[k] : 0.0f, ok ? fr[k] : 0.0f, acc);
      }
    }
    red[warp][n] = acc;
  }
  __syncthreads();
  for (int n = threadIdx.x; n < P::N; n += kThreads) {
    float v = red[0][n];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v += red[w][n];
    part[(sp * T + t) * P::N + n] = v;
  }
}

// One block a token: the partials summed in chunk order, the norm, sigmoid/softmax/Sinkhorn (warp 0, a lane per row
// or column, each sum in the order of the CPU loops), then a = RMSNorm(Σ_s pre[s]·h[t, s]; norm_w) in bf16.
// VEC: D and the bases a multiple of 4 floats.
template <int S, bool VEC>
__global__ void __launch_bounds__(kThreads) mhc_apply_kernel(MhcParams p, const float* h, const float* part,
                                                             int64_t splits, float* post, float* comb, bf16* a) {
  constexpr int M = (2 + S) * S, N = M + 1;
  extern __shared__ __align__(16) float smem[];  // collapsed [D]
  __shared__ float mix[N];
  __shared__ float pre[S];
  __shared__ float C[S * S];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, T = p.T, D = p.D, SD = S * D;
  for (int n = threadIdx.x; n < N; n += kThreads) {
    float v = part[t * N + n];
    for (int64_t sp = 1; sp < splits; ++sp) v += part[(sp * T + t) * N + n];
    mix[n] = v;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float r = rsqrtf(mix[M] / static_cast<float>(SD) + p.rms_eps);  // fn·(f·r) = r·(fn·f)
    const float* base = p.base;
    const float* sc = p.scale;
    const float eps = p.hc_eps;
    if (lane < S) {
      const int s = lane;
      pre[s] = 1.0f / (1.0f + expf(-((mix[s] * r) * sc[0] + base[s]))) + eps;
      post[t * S + s] = 2.0f / (1.0f + expf(-((mix[S + s] * r) * sc[1] + base[S + s])));
      const int rr = lane;  // softmax of row rr
      float mx = -INFINITY;
      for (int c = 0; c < S; ++c) {
        C[rr * S + c] = (mix[2 * S + rr * S + c] * r) * sc[2] + base[2 * S + rr * S + c];
        mx = fmaxf(mx, C[rr * S + c]);
      }
      float sum = 0.0f;
      for (int c = 0; c < S; ++c) sum += (C[rr * S + c] = expf(C[rr * S + c] - mx));
      for (int c = 0; c < S; ++c) C[rr * S + c] = C[rr * S + c] / sum + eps;
    }
    __syncwarp();
    auto cols = [&] {
      if (lane < S) {
        float sum = 0.0f;
        for (int rr = 0; rr < S; ++rr) sum += C[rr * S + lane];
        for (int rr = 0; rr < S; ++rr) C[rr * S + lane] /= sum + eps;
      }
      __syncwarp();
    };
    cols();
    for (int it = 0; it + 1 < p.iters; ++it) {
      if (lane < S) {
        float sum = 0.0f;
        for (int c = 0; c < S; ++c) sum += C[lane * S + c];
        for (int c = 0; c < S; ++c) C[lane * S + c] /= sum + eps;
      }
      __syncwarp();
      cols();
    }
    for (int i = lane; i < S * S; i += 32) comb[t * S * S + i] = C[i];
  }
  __syncthreads();
  const float* ht = h + t * SD;
  float ss = 0.0f;
  if constexpr (VEC) {
    for (int64_t d = 4 * threadIdx.x; d < D; d += 4 * kThreads) {
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const float4 x = *reinterpret_cast<const float4*>(ht + s * D + d);
        v.x = fmaf(pre[s], x.x, v.x), v.y = fmaf(pre[s], x.y, v.y);
        v.z = fmaf(pre[s], x.z, v.z), v.w = fmaf(pre[s], x.w, v.w);
      }
      *reinterpret_cast<float4*>(smem + d) = v;
      ss = fmaf(v.x, v.x, ss), ss = fmaf(v.y, v.y, ss), ss = fmaf(v.z, v.z, ss), ss = fmaf(v.w, v.w, ss);
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      float v = 0.0f;
#pragma unroll
      for (int s = 0; s < S; ++s) v = fmaf(pre[s], ht[s * D + d], v);
      smem[d] = v;
      ss = fmaf(v, v, ss);
    }
  }
  const float r2 = rsqrtf(block_sum(ss, scratch) / static_cast<float>(D) + p.rms_eps);
  bf16* at = a + t * D;
  if constexpr (VEC) {
    for (int64_t d = 4 * threadIdx.x; d < D; d += 4 * kThreads) {
      const float4 v = *reinterpret_cast<const float4*>(smem + d);
      const float4 w = *reinterpret_cast<const float4*>(p.norm_w + d);
      __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(at + d);
      out[0] = __floats2bfloat162_rn(w.x * (v.x * r2), w.y * (v.y * r2));
      out[1] = __floats2bfloat162_rn(w.z * (v.z * r2), w.w * (v.w * r2));
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) at[d] = __float2bfloat16(p.norm_w[d] * (smem[d] * r2));
  }
}

// One thread per (t, d) (VEC: 4 consecutive d): reads the S old values, writes the S new ones.
template <int S, bool VEC>
__global__ void mhc_post_kernel(float* h, const float* y, const float* post, const float* comb, int64_t D) {
  constexpr int W = VEC ? 4 : 1;
  const int64_t t = blockIdx.y;
  const int64_t d = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * W;
  if (d >= D) return;
  float* ht = h + t * S * D;
  const float* ct = comb + t * S * S;
  if constexpr (VEC) {
    float4 old[S];
#pragma unroll
    for (int r = 0; r < S; ++r) old[r] = *reinterpret_cast<const float4*>(ht + r * D + d);
    const float4 yt = *reinterpret_cast<const float4*>(y + t * D + d);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float ps = post[t * S + s];
      float4 v = make_float4(ps * yt.x, ps * yt.y, ps * yt.z, ps * yt.w);
#pragma unroll
      for (int r = 0; r < S; ++r) {
        const float c = ct[r * S + s];
        v.x += c * old[r].x, v.y += c * old[r].y, v.z += c * old[r].z, v.w += c * old[r].w;
      }
      *reinterpret_cast<float4*>(ht + s * D + d) = v;
    }
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
      ht[s * D + d] = v;
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int S>
void launch_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, float* work, cudaStream_t st) {
  using P = ProjTile<S>;
  const int64_t SD = S * p.D, splits = num_splits(SD);
  if (p.T <= kRowsMaxT) {
    mhc_project_rows_kernel<S>
        <<<dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(splits)), kThreads, 0, st>>>(h, p.fn, work, p.T, SD);
  } else {
    const dim3 grid(static_cast<unsigned>(ceil_div(p.T, P::BM)), static_cast<unsigned>(splits));
    const bool vec = SD % 4 == 0 && aligned16(h) && aligned16(p.fn);
    auto kernel = vec ? mhc_project_tiled_kernel<S, true> : mhc_project_tiled_kernel<S, false>;
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(P::smem_bytes)));
    kernel<<<grid, kThreads, P::smem_bytes, st>>>(h, p.fn, work, p.T, SD);
  }
  const size_t smem = p.D * sizeof(float);
  const bool vec = p.D % 4 == 0 && aligned16(h) && aligned16(p.norm_w) && reinterpret_cast<uintptr_t>(a) % 8 == 0;
  auto kernel = vec ? mhc_apply_kernel<S, true> : mhc_apply_kernel<S, false>;
  if (smem > 48 * 1024)
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(p.T), kThreads, smem, st>>>(p, h, work, splits, post, comb, a);
}

template <int S>
void launch_post(float* h, const float* y, const float* post, const float* comb, int64_t T, int64_t D,
                 cudaStream_t st) {
  const bool vec = D % 4 == 0 && aligned16(h) && aligned16(y);
  const int64_t per_thread = vec ? 4 : 1;
  const dim3 grid(static_cast<unsigned>(ceil_div(D, 256 * per_thread)), static_cast<unsigned>(T));
  if (vec) {
    mhc_post_kernel<S, true><<<grid, 256, 0, st>>>(h, y, post, comb, D);
  } else {
    mhc_post_kernel<S, false><<<grid, 256, 0, st>>>(h, y, post, comb, D);
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

int64_t mhc_pre_workspace_floats(int64_t T, int64_t S, int64_t D) { return num_splits(S * D) * T * ((2 + S) * S + 1); }

void mhc_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, float* work, cudaStream_t st) {
  if (!p.T) return;
#define CALL(S) launch_pre<S>(p, h, post, comb, a, work, st)
  NEXTLM_MHC_DISPATCH(p.S, CALL)
#undef CALL
}

void mhc_post(float* h, const float* y, const float* post, const float* comb, int64_t T, int64_t S, int64_t D,
              cudaStream_t st) {
  if (!T) return;
#define CALL(S) launch_post<S>(h, y, post, comb, T, D, st)
  NEXTLM_MHC_DISPATCH(S, CALL)
#undef CALL
}

}  // namespace nextlm::cuda
