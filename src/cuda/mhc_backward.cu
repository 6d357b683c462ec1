// Backward of the mHC sites, of RMSNorm and of the final stream mean + norm on the GPU, fp32; matches
// src/model/mhc_backward.cpp, norm_backward.cpp and head_backward.cpp (and the forwards of src/cuda/mhc.cu, misc.cu).
//
// mhc_pre_backward runs in five kernels: the projection fn·h[t] with Σh² (register-tiled, per column-chunk
// partials); a token kernel (the coefficients recomputed, the Sinkhorn and softmax backward, the sub-layer RMSNorm
// and collapse backward into dh, dm = dL/dm); an fn kernel over (columns, token blocks) that holds fn's columns in
// registers for the input norm's backward into dh and the dfn partials; and two fixed-order sums of the partials
// (into dfn; into dnorm_w, dbase, dscale). h is read three times and dh updated twice. Every parameter gradient is
// summed in an order fixed by T, S and D, so it is reproducible run to run.
#include "cuda/backward_kernels.h"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Sums NV per-thread values over the block (blockDim.x == kThreads); out[i] (shared) holds the sums afterwards, for
// every thread. red: kWarps·NV shared floats. Warps are summed in warp order.
template <int NV>
__device__ __forceinline__ void block_sum_to(const float (&v)[NV], float* red, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const float s = warp_sum(v[i]);
    if (lane == 0) red[warp * NV + i] = s;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NV; i += kThreads) {
    float s = red[i];
    for (int w = 1; w < kWarps; ++w) s += red[w * NV + i];
    out[i] = s;
  }
  __syncthreads();
}

// ---- RMSNorm ----

// One block a row: r = rsqrt(mean(x²) + eps), c = r³·Σ(w⊙dy⊙x)/n, and v = r·w·dy − c·x added (times scale) into
// the rep rows dx[row·rep + s] (rep = S and scale = 1/S spread the gradient of a stream mean over its streams).
// rs[row] = r when rs is not null (for dw).
__global__ void __launch_bounds__(kThreads)
    rmsnorm_bwd_rows_kernel(const float* x, int64_t ldx, const float* w, const float* dy, float* dx, int64_t rep,
                            float scale, float* rs, int64_t n, float eps) {
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
    for (int64_t s = 0; s < rep; ++s) dx[(row * rep + s) * n + i] += g * scale;
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
                           float scale, float* dw, int64_t rows, int64_t n, float eps, float* work, cudaStream_t st) {
  if (!rows || !n) return;
  float* rs = w && dw ? work : nullptr;
  rmsnorm_bwd_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, st>>>(x, ldx, w, dy, dx, rep, scale, rs, n,
                                                                            eps);
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

// One block a token: dy += Σ_s post_s·g_s, dh_r += Σ_s comb[r, s]·g_s, and the sums over d of g_s·y (dpost) and
// g_s·h_r (dcomb).
template <int S>
__global__ void __launch_bounds__(kThreads)
    mhc_post_bwd_kernel(const float* h, const float* y, const float* post, const float* comb, const float* dout,
                        float* dh, float* dy, float* dpost, float* dcomb, int64_t D) {
  constexpr int NV = S + S * S;
  __shared__ float red[kWarps * NV];
  __shared__ float sums[NV];
  __shared__ float P[S], C[S * S];
  const int64_t t = blockIdx.x;
  if (threadIdx.x < S) P[threadIdx.x] = post[t * S + threadIdx.x];
  if (threadIdx.x < S * S) C[threadIdx.x] = comb[t * S * S + threadIdx.x];
  __syncthreads();
  float acc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
  const float* gt = dout + t * S * D;
  const float* ht = h + t * S * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float g[S], hr[S];
#pragma unroll
    for (int s = 0; s < S; ++s) g[s] = gt[s * D + d], hr[s] = ht[s * D + d];
    const float yv = y[t * D + d];
    if (dy) {
      float v = 0.0f;
#pragma unroll
      for (int s = 0; s < S; ++s) v = fmaf(P[s], g[s], v);
      dy[t * D + d] += v;
    }
    if (dh) {
#pragma unroll
      for (int r = 0; r < S; ++r) {
        float v = 0.0f;
#pragma unroll
        for (int s = 0; s < S; ++s) v = fmaf(C[r * S + s], g[s], v);
        dh[(t * S + r) * D + d] += v;
      }
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      acc[s] = fmaf(g[s], yv, acc[s]);
#pragma unroll
      for (int r = 0; r < S; ++r) acc[S + r * S + s] = fmaf(g[s], hr[r], acc[S + r * S + s]);
    }
  }
  block_sum_to<NV>(acc, red, sums);
  if (dpost && threadIdx.x < S) dpost[t * S + threadIdx.x] += sums[threadIdx.x];
  if (dcomb && threadIdx.x < S * S) dcomb[t * S * S + threadIdx.x] += sums[S + threadIdx.x];
}

// ---- mHC pre ----

constexpr int64_t kProjChunk = 2048;     // S·D columns a projection block sums (its partial is one split)
constexpr int64_t kTokBlocksMax = 1024;  // blocks of the token kernel (each a contiguous token range)
constexpr int kFnThreads = 128;          // columns a block of the fn kernel owns
constexpr int kFnTokTile = 32;           // tokens of (dm, r1, c1) staged at a time in the fn kernel

int64_t proj_splits(int64_t SD) { return ceil_div(SD, kProjChunk); }
int64_t tok_per_block(int64_t T) { return ceil_div(T, std::min<int64_t>(T, kTokBlocksMax)); }
int64_t tok_blocks(int64_t T) { return T ? ceil_div(T, tok_per_block(T)) : 0; }
// Token blocks of the fn kernel: about 2048 blocks in all, each at least 64 tokens; its dfn partials are
// [fn_blocks, M, S·D].
int64_t fn_blocks(int64_t T, int64_t SD) {
  const int64_t ncol = ceil_div(SD, kFnThreads);
  return std::max<int64_t>(1, std::min(ceil_div(T, 64), ceil_div(2048, ncol)));
}
// Row width of dmr (dm [M], r1, c1), padded to 4 floats for 16-byte shared reads.
__host__ __device__ constexpr int dmr_width(int S) { return ((2 + S) * S + 2 + 3) / 4 * 4; }

// Workspace layout of mhc_pre_backward (floats, in this order).
struct PreWork {
  int64_t part, dmr, tok, dfn, total;
  PreWork(int64_t T, int64_t S, int64_t D) {
    const int64_t M = (2 + S) * S, N = M + 1, SD = S * D;
    part = 0;                                  // [splits, T, N] projection partials
    dmr = part + proj_splits(SD) * T * N;      // [T, dmr_width] dm, r1 and c1 of each token
    tok = dmr + T * dmr_width(static_cast<int>(S));  // [tok_blocks, D + 2M] dnorm_w, dbase, dscale·m partials
    dfn = tok + tok_blocks(T) * (D + 2 * M);   // [fn_blocks, M, SD]
    total = dfn + fn_blocks(T, SD) * M * SD;
  }
};

// The projection as a register-tiled product: a block takes kProjT tokens and all M outputs over one chunk of
// columns, staged kProjK columns at a time (h transposed, so a lane reads its 4 tokens as one float4); warp w owns
// outputs [w·OPT, (w+1)·OPT) and lane l tokens 4l … 4l+3, warp 0 also Σh². The next tile's loads are in flight
// while the current one is multiplied. part[sp, t] = (fn·h[t], Σh²) over chunk sp's columns, summed in column
// order.
constexpr int kProjT = 128;
constexpr int kProjK = 32;
static_assert(kProjT == 4 * 32 && kProjChunk % kProjK == 0, "a lane holds 4 tokens; chunks are whole tiles");

template <int S>
__global__ void __launch_bounds__(kThreads)
    mhc_bwd_project_kernel(const float* __restrict__ h, const float* __restrict__ fn, float* __restrict__ part,
                           int64_t T, int64_t SD) {
  constexpr int M = (2 + S) * S, N = M + 1, OPT = (M + kWarps - 1) / kWarps, MP = OPT * kWarps;
  constexpr int HL = kProjT * kProjK / kThreads;                         // h values a thread loads per tile
  constexpr int FL = (MP * kProjK + kThreads - 1) / kThreads;            // fn values a thread loads per tile
  __shared__ __align__(16) float hs[kProjK][kProjT + 4];
  __shared__ float fs[kProjK][MP + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t0 = int64_t(blockIdx.x) * kProjT, sp = blockIdx.y;
  const int64_t k0 = sp * kProjChunk, k1 = min(SD, k0 + kProjChunk);
  static_assert(kThreads == 8 * kProjK, "a warp loads one column tile row: the rows of thread r are warp + 8r");
  // Thread (warp, lane) loads column lane of token rows warp + 8r (h) and fn rows warp + 8r.
  const float* hcol = h + (t0 + warp) * SD + lane;
  const float* fcol = fn + int64_t(warp) * SD + lane;
  float hp[HL], fp[FL];
  auto load = [&](int64_t kb) {
    const bool kin = kb + lane < k1;
#pragma unroll
    for (int r = 0; r < HL; ++r) hp[r] = kin && t0 + warp + 8 * r < T ? hcol[8 * r * SD + kb] : 0.0f;
#pragma unroll
    for (int r = 0; r < FL; ++r) fp[r] = kin && warp + 8 * r < M ? fcol[8 * r * SD + kb] : 0.0f;
  };
  float acc[4][OPT], ss[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    ss[q] = 0.0f;
#pragma unroll
    for (int o = 0; o < OPT; ++o) acc[q][o] = 0.0f;
  }
  load(k0);
  for (int64_t kb = k0; kb < k1; kb += kProjK) {
    __syncthreads();  // everyone is done with the previous tile
#pragma unroll
    for (int r = 0; r < HL; ++r) hs[lane][warp + 8 * r] = hp[r];
#pragma unroll
    for (int r = 0; r < FL; ++r) fs[lane][warp + 8 * r] = fp[r];
    __syncthreads();
    if (kb + kProjK < k1) load(kb + kProjK);
#pragma unroll 8
    for (int kk = 0; kk < kProjK; ++kk) {
      const float4 x = *reinterpret_cast<const float4*>(&hs[kk][4 * lane]);
      const float xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int o = 0; o < OPT; ++o) {
        const float f = fs[kk][warp * OPT + o];
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[q][o] = fmaf(xv[q], f, acc[q][o]);
      }
      if (warp == 0)
#pragma unroll
        for (int q = 0; q < 4; ++q) ss[q] = fmaf(xv[q], xv[q], ss[q]);
    }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t t = t0 + 4 * lane + q;
    if (t >= T) continue;
    float* out = part + (sp * T + t) * N;
#pragma unroll
    for (int o = 0; o < OPT; ++o)
      if (warp * OPT + o < M) out[warp * OPT + o] = acc[q][o];
    if (warp == 0) out[M] = ss[q];
  }
}

// One Sinkhorn normalisation step of a warp's S×S matrix (lane a < S owns line a: column a when cols, else row a):
// C /= (line sum + eps); div[a] keeps the divisor.
template <int S>
__device__ __forceinline__ void sinkhorn_step(float* C, float* div, bool cols, float eps, int lane) {
  if (lane < S) {
    float sum = 0.0f;
    for (int b = 0; b < S; ++b) sum += cols ? C[b * S + lane] : C[lane * S + b];
    const float dv = sum + eps;
    div[lane] = dv;
    for (int b = 0; b < S; ++b) {
      float& e = cols ? C[b * S + lane] : C[lane * S + b];
      e = e / dv;
    }
  }
  __syncwarp();
}

// Its backward: din = (dout − Σ_line dout⊙out)/div on G (in place); C goes back from out to in (C·div), so only
// the divisors are kept per step.
template <int S>
__device__ __forceinline__ void sinkhorn_step_backward(float* C, float* G, const float* div, bool cols, int lane) {
  if (lane < S) {
    float dot = 0.0f;
    for (int b = 0; b < S; ++b) {
      const int i = cols ? b * S + lane : lane * S + b;
      dot += G[i] * C[i];
    }
    const float dv = div[lane];
    for (int b = 0; b < S; ++b) {
      const int i = cols ? b * S + lane : lane * S + b;
      G[i] = (G[i] - dot) / dv;
      C[i] = C[i] * dv;
    }
  }
  __syncwarp();
}

__host__ __device__ int sinkhorn_steps(int iters) { return iters > 1 ? 2 * iters - 1 : 1; }

// Shared floats a warp of the token kernel uses for its Sinkhorn: P, C, G [S, S] and the divisors [steps, S].
__host__ __device__ int64_t sinkhorn_warp_floats(int64_t S, int iters) { return 3 * S * S + sinkhorn_steps(iters) * S; }

// One block a contiguous range of tokens, kWarps tokens at a time (warp g recomputes token g's coefficients and runs
// its Sinkhorn forward and backward). Per token, with the whole block: the sub-layer RMSNorm backward (da → dx,
// dnorm_w) and the collapse backward (dh += pre·dx; dpre_s = Σ_d dx·h_s = r2·Σ w·da·h_s − c2·Σ x·h_s, summed in the
// same pass as the norm's sums, so h is read once). Then dz = dL/d(m·scale + base), dm = dz·scale, and
// c1 = r1³·(dm·(fn·h))/SD for the input norm's backward (dflat·h = dm·(fn·h) comes from the projection), written to
// dmr[t] = (dm, r1, c1) for the fn kernel; and this block's partials of dnorm_w, dbase and dscale·m.
template <int S>
__global__ void __launch_bounds__(kThreads)
    mhc_bwd_token_kernel(MhcParams p, const float* h, const float* part, int64_t splits, const float* dpost,
                         const float* dcomb, const float* da, float* dh, float* dmr, float* tokpart, int64_t tpb) {
  constexpr int M = (2 + S) * S, N = M + 1, SS = S * S, NR = 2 + 2 * S, W = dmr_width(S);
  extern __shared__ __align__(16) float smem[];
  const int64_t T = p.T, D = p.D, SD = S * D;
  const int steps = sinkhorn_steps(p.iters);
  float* xs = smem;          // [D] the collapse x, per token
  float* dnw = smem + D;     // [D] this block's dnorm_w
  float* sk = smem + 2 * D;  // [kWarps, sinkhorn_warp_floats]
  __shared__ float mix[kWarps][N];
  __shared__ float dz[kWarps][M];
  __shared__ float pre[kWarps][S], sg[kWarps][S];
  __shared__ float r1[kWarps];
  __shared__ float red[kWarps * NR];
  __shared__ float sums[NR];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float eps = p.rms_eps, hc_eps = p.hc_eps;
  const float* base = p.base;
  const float* sc = p.scale;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) dnw[d] = 0.0f;
  float acc_base = 0.0f, acc_scale = 0.0f;  // thread j < M: Σ dz[j] and Σ dz[j]·m[j] over the block's tokens

  const int64_t tb0 = blockIdx.x * tpb, tb1 = min(T, tb0 + tpb);
  for (int64_t g0 = tb0; g0 < tb1; g0 += kWarps) {
    const int ng = static_cast<int>(min(int64_t(kWarps), tb1 - g0));
    for (int idx = threadIdx.x; idx < ng * N; idx += kThreads) {
      const int g = idx / N, n = idx % N;
      const int64_t t = g0 + g;
      float v = part[t * N + n];
      for (int64_t s = 1; s < splits; ++s) v += part[(s * T + t) * N + n];
      mix[g][n] = v;
    }
    __syncthreads();

    // Warp g: token g's coefficients, the post and comb parts of dz.
    if (warp < ng) {
      const int g = warp;
      const int64_t t = g0 + g;
      const float r = rsqrtf(mix[g][M] / static_cast<float>(SD) + eps);  // fn·(h·r) = r·(fn·h)
      float* P = sk + g * sinkhorn_warp_floats(S, p.iters);
      float* C = P + SS;
      float* G = C + SS;
      float* div = G + SS;
      if (lane == 0) r1[g] = r;
      if (lane < S) {
        const int s = lane;
        const float e = 1.0f / (1.0f + expf(-((mix[g][s] * r) * sc[0] + base[s])));
        sg[g][s] = e;
        pre[g][s] = e + hc_eps;
        dz[g][s] = 0.0f;  // set from dpre below when da is given
        const float sp = 1.0f / (1.0f + expf(-((mix[g][S + s] * r) * sc[1] + base[S + s])));
        dz[g][S + s] = dpost ? dpost[t * S + s] * 2.0f * sp * (1.0f - sp) : 0.0f;
        // Softmax of row s of the comb logits.
        float mx = -INFINITY;
        for (int c = 0; c < S; ++c) {
          P[s * S + c] = (mix[g][2 * S + s * S + c] * r) * sc[2] + base[2 * S + s * S + c];
          mx = fmaxf(mx, P[s * S + c]);
        }
        float sum = 0.0f;
        for (int c = 0; c < S; ++c) sum += (P[s * S + c] = expf(P[s * S + c] - mx));
        for (int c = 0; c < S; ++c) {
          P[s * S + c] /= sum;
          C[s * S + c] = P[s * S + c] + hc_eps;
          G[s * S + c] = dcomb ? dcomb[t * SS + s * S + c] : 0.0f;
        }
      }
      __syncwarp();
      if (dcomb) {
        for (int i = 0; i < steps; ++i) sinkhorn_step<S>(C, div + i * S, i % 2 == 0, hc_eps, lane);
        for (int i = steps - 1; i >= 0; --i) sinkhorn_step_backward<S>(C, G, div + i * S, i % 2 == 0, lane);
      }
      if (lane < S) {
        const int rr = lane;
        float dot = 0.0f;
        for (int s = 0; s < S; ++s) dot += P[rr * S + s] * G[rr * S + s];
        for (int s = 0; s < S; ++s) dz[g][2 * S + rr * S + s] = P[rr * S + s] * (G[rr * S + s] - dot);
      }
    }
    __syncthreads();

    // The sub-layer RMSNorm and the collapse, one token at a time with the whole block.
    if (da) {
      for (int g = 0; g < ng; ++g) {
        const int64_t t = g0 + g;
        const float* ht = h + t * SD;
        const float* dat = da + t * D;
        float v[NR];  // Σx², Σ w·da·x, Σ w·da·h_s, Σ x·h_s
#pragma unroll
        for (int i = 0; i < NR; ++i) v[i] = 0.0f;
#pragma unroll 4
        for (int64_t d = threadIdx.x; d < D; d += kThreads) {  // unrolled: the loads of 4 columns in flight
          float hv[S];
          float x = 0.0f;
#pragma unroll
          for (int s = 0; s < S; ++s) hv[s] = ht[s * D + d], x = fmaf(pre[g][s], hv[s], x);
          xs[d] = x;
          const float wg = p.norm_w[d] * dat[d];
          v[0] = fmaf(x, x, v[0]);
          v[1] = fmaf(wg, x, v[1]);
#pragma unroll
          for (int s = 0; s < S; ++s) v[2 + s] = fmaf(wg, hv[s], v[2 + s]), v[2 + S + s] = fmaf(x, hv[s], v[2 + S + s]);
        }
        block_sum_to<NR>(v, red, sums);
        const float r2 = rsqrtf(sums[0] / static_cast<float>(D) + eps);
        const float c2 = (sums[1] / static_cast<float>(D)) * r2 * r2 * r2;
        if (threadIdx.x < S) {
          const int s = threadIdx.x;
          const float e = sg[g][s];
          dz[g][s] = (r2 * sums[2 + s] - c2 * sums[2 + S + s]) * e * (1.0f - e);
        }
        float pg[S];
#pragma unroll
        for (int s = 0; s < S; ++s) pg[s] = pre[g][s];
#pragma unroll 4
        for (int64_t d = threadIdx.x; d < D; d += kThreads) {
          const float x = xs[d], g_ = dat[d];
          const float dx = r2 * p.norm_w[d] * g_ - c2 * x;
          dnw[d] += g_ * x * r2;
#pragma unroll
          for (int s = 0; s < S; ++s) dh[t * SD + s * D + d] += pg[s] * dx;
        }
      }
      __syncthreads();
    }

    // dm = dz·scale[part], the parameter sums in token order, and c1 = r1³·(dm·(fn·h))/SD.
    if (threadIdx.x < M) {
      const int j = threadIdx.x, pt = j < S ? 0 : j < 2 * S ? 1 : 2;
      for (int g = 0; g < ng; ++g) {
        const float z = dz[g][j];
        acc_base += z;
        acc_scale += z * (mix[g][j] * r1[g]);
        dmr[(g0 + g) * W + j] = z * sc[pt];
      }
    }
    if (warp < ng) {
      const int g = warp;
      float v = 0.0f;
      for (int j = lane; j < M; j += 32) {
        const int pt = j < S ? 0 : j < 2 * S ? 1 : 2;
        v = fmaf(dz[g][j] * sc[pt], mix[g][j], v);
      }
      v = warp_sum(v);
      if (lane == 0) {
        const float r = r1[g];
        dmr[(g0 + g) * W + M] = r;
        dmr[(g0 + g) * W + M + 1] = (v / static_cast<float>(SD)) * r * r * r;
      }
    }
    __syncthreads();  // mix, dz are refilled by the next group
  }

  float* out = tokpart + blockIdx.x * (D + 2 * M);
  for (int64_t d = threadIdx.x; d < D; d += kThreads) out[d] = dnw[d];
  if (threadIdx.x < M) {
    out[D + threadIdx.x] = acc_base;
    out[D + M + threadIdx.x] = acc_scale;
  }
}

// The fn path of every token, grid (column blocks, token blocks); a thread owns column k of S·D with fn[:, k] in
// registers: the input norm's backward dh[t, k] += r1·dflat − h·c1 with dflat = Σ_j dm[t, j]·fn[j, k], and the dfn
// partial part[b, j, k] = Σ_{t of block b} dm[t, j]·(h[t, k]·r1[t]), tokens in order.
template <int S>
__global__ void __launch_bounds__(kFnThreads)
    mhc_bwd_fn_kernel(const float* __restrict__ h, const float* __restrict__ fn, const float* __restrict__ dmr,
                      float* __restrict__ dh, float* __restrict__ part, int64_t T,
                      int64_t SD, int64_t tpb) {
  constexpr int M = (2 + S) * S, W = dmr_width(S);
  __shared__ __align__(16) float sdm[kFnTokTile * W];
  const int64_t k = blockIdx.x * int64_t(kFnThreads) + threadIdx.x, b = blockIdx.y;
  const int64_t t0 = b * tpb, t1 = min(T, t0 + tpb);
  const bool ok = k < SD;
  float f[M], acc[M];
#pragma unroll
  for (int j = 0; j < M; ++j) f[j] = ok ? fn[j * SD + k] : 0.0f, acc[j] = 0.0f;
  for (int64_t tt = t0; tt < t1; tt += kFnTokTile) {
    const int cnt = static_cast<int>(min(int64_t(kFnTokTile), t1 - tt));
    __syncthreads();
    for (int idx = threadIdx.x; idx < cnt * W; idx += kFnThreads) sdm[idx] = dmr[tt * W + idx];
    __syncthreads();
    if (ok) {
      // Four tokens at a time, their h and dh loads issued together.
      auto token = [&](int i, float hv, float& dhv) {
        const float* row = sdm + i * W;
        const float r = row[M], c = row[M + 1];
        const float v = hv * r;
        float df = 0.0f;
        if constexpr (M % 4 == 0) {  // 16-byte shared reads (rows are 16-byte aligned)
#pragma unroll
          for (int j = 0; j < M; j += 4) {
            const float4 d4 = *reinterpret_cast<const float4*>(row + j);
            const float dmj[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              df = fmaf(dmj[u], f[j + u], df);
              acc[j + u] = fmaf(dmj[u], v, acc[j + u]);
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < M; ++j) {
            const float dmj = row[j];
            df = fmaf(dmj, f[j], df);
            acc[j] = fmaf(dmj, v, acc[j]);
          }
        }
        dhv += r * df - hv * c;
      };
      int i = 0;
      for (; i + 4 <= cnt; i += 4) {
        float hv[4], dhv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) hv[u] = h[(tt + i + u) * SD + k], dhv[u] = dh[(tt + i + u) * SD + k];
#pragma unroll
        for (int u = 0; u < 4; ++u) token(i + u, hv[u], dhv[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) dh[(tt + i + u) * SD + k] = dhv[u];
      }
      for (; i < cnt; ++i) {
        float dhv = dh[(tt + i) * SD + k];
        token(i, h[(tt + i) * SD + k], dhv);
        dh[(tt + i) * SD + k] = dhv;
      }
    }
  }
  if (ok)
#pragma unroll
    for (int j = 0; j < M; ++j) part[(b * M + j) * SD + k] = acc[j];
}

// dnorm_w[d] += Σ_b tok[b, d]; dbase[j] += Σ_b tok[b, D + j]; dscale[part] += Σ_b Σ_{j ∈ part} tok[b, D + M + j].
__global__ void mhc_bwd_params_kernel(const float* tok, int64_t nb, int64_t S, int64_t D, float* dnorm_w,
                                      float* dbase, float* dscale) {
  const int64_t M = (2 + S) * S, W = D + 2 * M;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < D + M + 3;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (i < D + M) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) acc += tok[b * W + i];
      if (i < D) {
        dnorm_w[i] += acc;
      } else {
        dbase[i - D] += acc;
      }
    } else {
      const int pt = static_cast<int>(i - D - M);
      const int64_t j0 = pt == 0 ? 0 : pt == 1 ? S : 2 * S, j1 = pt == 0 ? S : pt == 1 ? 2 * S : M;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = j0; j < j1; ++j) acc += tok[b * W + D + M + j];
      dscale[pt] += acc;
    }
  }
}

template <int S>
void launch_pre_backward(const MhcParams& p, const float* h, const float* dpost, const float* dcomb, const float* da,
                         float* dh, float* dfn, float* dbase, float* dscale, float* dnorm_w, float* work,
                         cudaStream_t st) {
  constexpr int M = (2 + S) * S;
  const int64_t T = p.T, D = p.D, SD = S * D, splits = proj_splits(SD);
  const PreWork wk(T, S, D);
  float* part = work + wk.part;
  float* dmr = work + wk.dmr;
  float* tok = work + wk.tok;
  float* dfp = work + wk.dfn;

  mhc_bwd_project_kernel<S><<<dim3(static_cast<unsigned>(ceil_div(T, kProjT)), static_cast<unsigned>(splits)),
                              kThreads, 0, st>>>(h, p.fn, part, T, SD);
  NEXTLM_CUDA_CHECK(cudaGetLastError());

  const int64_t tpb = tok_per_block(T), nblk = tok_blocks(T);
  const size_t smem = sizeof(float) * static_cast<size_t>(2 * D + kWarps * sinkhorn_warp_floats(S, p.iters));
  if (smem > 48 * 1024)
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(mhc_bwd_token_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  mhc_bwd_token_kernel<S><<<static_cast<unsigned>(nblk), kThreads, smem, st>>>(p, h, part, splits, dpost, dcomb, da,
                                                                               dh, dmr, tok, tpb);
  NEXTLM_CUDA_CHECK(cudaGetLastError());

  const int64_t nb = fn_blocks(T, SD), ftpb = ceil_div(T, nb);
  mhc_bwd_fn_kernel<S><<<dim3(static_cast<unsigned>(ceil_div(SD, kFnThreads)), static_cast<unsigned>(nb)),
                         kFnThreads, 0, st>>>(h, p.fn, dmr, dh, dfp, T, SD, ftpb);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  sum_parts_kernel<<<grid_for(M * SD), 256, 0, st>>>(dfp, dfn, nb, M * SD);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  mhc_bwd_params_kernel<<<grid_for(D + M + 3), 256, 0, st>>>(tok, nblk, S, D, dnorm_w, dbase, dscale);
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

void mhc_pre_backward(const MhcParams& p, const float* h, const float* dpost, const float* dcomb, const float* da,
                      float* dh, float* dfn, float* dbase, float* dscale, float* dnorm_w, float* work,
                      cudaStream_t st) {
  if (!p.T) return;
#define CALL(S) launch_pre_backward<S>(p, h, dpost, dcomb, da, dh, dfn, dbase, dscale, dnorm_w, work, st)
  NEXTLM_MHC_BWD_DISPATCH(p.S, CALL)
#undef CALL
}

void mhc_post_backward(const float* h, const float* y, const float* post, const float* comb, const float* dout,
                       float* dh, float* dy, float* dpost, float* dcomb, int64_t T, int64_t S, int64_t D,
                       cudaStream_t st) {
  if (!T) return;
#define CALL(S)                                                                                                    \
  mhc_post_bwd_kernel<S><<<static_cast<unsigned>(T), kThreads, 0, st>>>(h, y, post, comb, dout, dh, dy, dpost, \
                                                                        dcomb, D)
  NEXTLM_MHC_BWD_DISPATCH(S, CALL)
#undef CALL
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void stream_mean_norm_backward(const float* h, const float* w, const float* dout, float* dh, float* dw, int64_t T,
                               int64_t S, int64_t D, float eps, float* work, cudaStream_t st) {
  if (!T) return;
  float* hm = work + rmsnorm_backward_workspace_floats(T, D);  // [T, D] the stream mean
  stream_mean_kernel<<<grid_for(T * D), 256, 0, st>>>(h, hm, T, S, D);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  rmsnorm_backward_impl(hm, D, w, dout, dh, S, 1.0f / static_cast<float>(S), dw, T, D, eps, work, st);
}

}  // namespace nextlm::cuda
