// Decoding kernels: one new token per cache slot (batch-invariant GEMV, the KDA recurrent step with the conv history,
// the indexer's incremental pool cache and selection, absorbed MLA over cached bf16 latents). Matches
// src/model/kda.cpp (kda_layer_forward_cached, recurrent form) and src/model/dsa.cpp (indexer_forward_cached,
// dsa_layer_forward_cached), with the numerics of the bf16 forward (src/cuda/kda.cu, dsa.cu).
#include "cuda/decode_kernels.h"

#include <algorithm>

#include "cuda/gemv.cuh"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

// ---- GEMV ----

// decode_linear on the tensor-core GEMV of gemv.cuh (its summation order). Work item (row group rg, x tile mt):
// Split::tiles tiles of 16 outputs against up to 32 rows of x; mt runs fastest, so that the x tiles of one weight slab
// run side by side and all but the first read it from L2. A persistent grid walks the items.
template <bool kVec>
__global__ void __launch_bounds__(gemv::kThreads, gemv::kBlocksPerSm)
    linear_kernel(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, float* y, int64_t ldy, int64_t M,
                  bool accumulate) {
  __shared__ float red[gemv::kWarps][gemv::kTileRows][gemv::kRedLd];
  const gemv::Split sp = gemv::split_of(in);
  const int64_t ntiles = (out + gemv::kTileRows - 1) / gemv::kTileRows, groups = (ntiles + sp.tiles - 1) / sp.tiles;
  const int64_t mtiles = (M + gemv::kPassRows - 1) / gemv::kPassRows;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int tb = warp / sp.nchain, chain = warp % sp.nchain;
  for (int64_t item = blockIdx.x; item < groups * mtiles; item += gridDim.x) {
    const int64_t rg = item / mtiles, m0 = item % mtiles * gemv::kPassRows;
    const int rows = static_cast<int>(M - m0 < gemv::kPassRows ? M - m0 : gemv::kPassRows);
    const int64_t tile = rg * sp.tiles + tb;
    if (tb < sp.tiles && tile < ntiles) {
      // Rows past `out` read as zeros (their pointers clamped to the last row, never dereferenced).
      const int64_t n_lo = tile * gemv::kTileRows + g, n_hi = n_lo + 8;
      gemv::warp_pass<kVec>(W + min(n_lo, out - 1) * in, n_lo < out, W + min(n_hi, out - 1) * in, n_hi < out,
                            x + m0 * ldx, ldx, rows, static_cast<int>(in), sp, chain, red[warp]);
    }
    __syncthreads();
    // Outputs fastest: 16 consecutive y elements of a row per tile.
    for (int idx = threadIdx.x; idx < sp.tiles * gemv::kTileRows * rows; idx += blockDim.x) {
      const int r = idx % gemv::kTileRows, m = idx / gemv::kTileRows % rows, t = idx / gemv::kTileRows / rows;
      const int64_t n = (rg * sp.tiles + t) * gemv::kTileRows + r;
      if (n < out) {
        const float s = gemv::chain_sum(red, sp, t, r, m);
        float* dst = y + (m0 + m) * ldy + n;
        *dst = accumulate ? *dst + s : s;
      }
    }
    __syncthreads();  // red is rewritten by the next item
  }
}

// Eight bf16 (one 16-byte load) to fp32.
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- KDA ----

constexpr int kKdaMaxK = 128;
constexpr int kKdaChunk = 64;  // the tensor-core KDA's chunk length

// One delta-rule token on thread (j, r)'s slice s of column j (rows 32r … 32r+31) of a head's state, from q, k, v
// and the decay factors e^g in shared memory: S ← diag(e^g)·S; u = β(v − Sᵀk); S += k uᵀ; returns (Sᵀq)_j to the
// threads of group 0. Sums over rows run per group in row order, then over the R groups in order. Every thread of
// the block calls it.
__device__ __forceinline__ float delta_token(float (&s)[32], int j, int r, int R, bool active, int64_t K,
                                            const float* q, const float* k, const float* v, const float* eg,
                                            float beta, float (*red)[kKdaMaxK]) {
  float part = 0.0f;
#pragma unroll
  for (int ii = 0; ii < 32; ++ii) {
    const int i = 32 * r + ii;
    if (active && i < K) {
      s[ii] *= eg[i];
      part = fmaf(s[ii], k[i], part);
    }
  }
  red[r][j] = part;
  __syncthreads();
  float mem = 0.0f;
  for (int rr = 0; rr < R; ++rr) mem += red[rr][j];
  const float u = active ? beta * (v[j] - mem) : 0.0f;
  __syncthreads();
  float po = 0.0f;
#pragma unroll
  for (int ii = 0; ii < 32; ++ii) {
    const int i = 32 * r + ii;
    if (active && i < K) {
      s[ii] = fmaf(k[i], u, s[ii]);
      po = fmaf(s[ii], q[i], po);
    }
  }
  red[r][j] = po;
  __syncthreads();
  float o = 0.0f;
  if (r == 0)
    for (int rr = 0; rr < R; ++rr) o += red[rr][j];
  __syncthreads();  // red may be reused by the next call
  return o;
}

// The new token of row b, head h, in cache slot `slot`: the causal conv over [the slot's last W−1 pre-conv
// projections; raw] (the history shifted by one), SiLU and the L2 norms of q and k (q also × K^-1/2) in the lane
// order of kda_conv_norm, into qkv[3][K] in shared memory, rounded to bf16 when `round` (as the tensor-core forward
// stores them): what kda_conv_norm gives the forward for this token. Every thread of the block calls it; it ends
// with a barrier.
__device__ __forceinline__ void conv_norm_token(const float* raw, const float* conv, float* conv_hist, int64_t b,
                                                int64_t h, int64_t slot, int64_t H, int64_t K, int64_t W, bool round,
                                                float (*qkv)[kKdaMaxK], float* scale) {
  const int64_t HK = H * K, W1 = W - 1;
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t c = tid; c < 3 * K; c += nt) {
    const int64_t which = c / K, d = c % K, ch = which * HK + h * K + d;
    float* hist = conv_hist + (slot * 3 + which) * W1 * HK + h * K + d;
    const float* w = conv + ch * W;
    const float xn = raw[b * 3 * HK + ch];
    float acc = 0.0f;
    for (int64_t i = 0; i < W1; ++i) acc += w[i] * hist[i * HK];
    acc += w[W1] * xn;
    for (int64_t i = 0; i + 1 < W1; ++i) hist[i * HK] = hist[(i + 1) * HK];
    if (W1 > 0) hist[(W1 - 1) * HK] = xn;
    qkv[which][d] = silu(acc);
  }
  __syncthreads();
  if (tid < 32) {
    for (int which = 0; which < 2; ++which) {
      float ss = 0.0f;
      for (int64_t d = tid; d < K; d += 32) ss += qkv[which][d] * qkv[which][d];
      ss = warp_sum(ss);
      if (tid == 0) scale[which] = rsqrtf(ss + 1e-6f) * (which == 0 ? rsqrtf(static_cast<float>(K)) : 1.0f);
    }
  }
  __syncthreads();
  for (int64_t c = tid; c < 3 * K; c += nt) {
    const int64_t which = c / K, d = c % K;
    float v = qkv[which][d] * (which < 2 ? scale[which] : 1.0f);
    if (round) v = __bfloat162float(__float2bfloat16(v));
    qkv[which][d] = v;
  }
  __syncthreads();
}

// One block per (row, head): Kp·R threads (Kp = K rounded up to 32, R = ⌈K/32⌉ groups of 32 state rows). Thread
// (j, r) owns column j of rows 32r … 32r+31 of the head's state; sums over rows are taken per group in row order,
// then over groups in order.
__global__ void __launch_bounds__(512) kda_step_kernel(KdaDecodeParams p) {
  __shared__ float qkv[3][kKdaMaxK];
  __shared__ float eg[kKdaMaxK];
  __shared__ float red[4][kKdaMaxK];
  __shared__ float scale[2];
  const int64_t b = blockIdx.x, h = blockIdx.y, K = p.K, H = p.H, HK = H * K;
  const int64_t slot = p.slot[b];
  const int tid = threadIdx.x, nt = blockDim.x;
  // Decay gate (as kda_gate), kept as the factor e^g.
  for (int64_t d = tid; d < K; d += nt) {
    const int64_t c = h * K + d;
    const float rate = expf(p.A_log[h]);
    const float f = p.graw[b * HK + c] + p.dt_bias[c];
    const float g = p.has_bound ? p.bound * (1.0f / (1.0f + expf(-rate * f)))
                                : -rate * (f > 20.0f ? f : logf(1.0f + expf(f)));
    eg[d] = expf(g);
  }
  conv_norm_token(p.raw, p.conv, p.conv_hist, b, h, slot, H, K, p.W, false, qkv, scale);
  // S ← diag(e^g)·S; u = β(v − Sᵀk); S += k uᵀ; o = Sᵀq.
  const int Kp = static_cast<int>((K + 31) / 32 * 32), R = nt / Kp;
  const int j = tid % Kp, r = tid / Kp;
  const bool active = j < K;
  float* S = p.state + (slot * H + h) * K * K;
  float s[32];
#pragma unroll
  for (int ii = 0; ii < 32; ++ii) {
    const int i = 32 * r + ii;
    s[ii] = active && i < K ? S[i * K + j] : 0.0f;
  }
  const float o = delta_token(s, j, r, R, active, K, qkv[0], qkv[1], qkv[2], eg, p.beta[b * H + h], red);
#pragma unroll
  for (int ii = 0; ii < 32; ++ii) {
    const int i = 32 * r + ii;
    if (active && i < K) S[i * K + j] = s[ii];
  }
  if (r == 0 && active) p.o[(b * H + h) * K + j] = o;
}

// The delta rule over each prefilled sequence from a zero state, one token at a time in the arithmetic of
// kda_step_kernel (the state column slices stay in registers); one block per (sequence, head).
__global__ void __launch_bounds__(512) kda_final_state_kernel(const float* q, const float* k, const float* v,
                                                              const float* g, const float* beta, PrefillSeqs ps,
                                                              float* state, int64_t H, int64_t K) {
  __shared__ float qkv[3][kKdaMaxK];
  __shared__ float eg[kKdaMaxK];
  __shared__ float red[4][kKdaMaxK];
  const int64_t n = blockIdx.x, h = blockIdx.y, s0 = ps.seq_start[n], L = ps.seq_len[n], slot = ps.slot[n];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int Kp = static_cast<int>((K + 31) / 32 * 32), R = nt / Kp;
  const int j = tid % Kp, r = tid / Kp;
  const bool active = j < K;
  float s[32];
#pragma unroll
  for (int ii = 0; ii < 32; ++ii) s[ii] = 0.0f;
  for (int64_t t = s0; t < s0 + L; ++t) {
    __syncthreads();  // the previous token is done with the shared inputs
    for (int64_t d = tid; d < K; d += nt) {
      const int64_t off = (t * H + h) * K + d;
      qkv[0][d] = q[off];
      qkv[1][d] = k[off];
      qkv[2][d] = v[off];
      eg[d] = expf(g[off]);
    }
    __syncthreads();
    delta_token(s, j, r, R, active, K, qkv[0], qkv[1], qkv[2], eg, beta[t * H + h], red);
  }
  float* S = state + (slot * H + h) * K * K;
#pragma unroll
  for (int ii = 0; ii < 32; ++ii) {
    const int i = 32 * r + ii;
    if (active && i < K) S[i * K + j] = s[ii];
  }
}

// One block per (row, head): the new token's q, k, v (conv_norm_token, rounded to bf16), raw gate and β into row
// pos mod 64 of its slot's chunk buffers.
__global__ void __launch_bounds__(256) kda_chunk_append_kernel(KdaChunkAppendParams p) {
  __shared__ float qkv[3][kKdaMaxK];
  __shared__ float scale[2];
  const int64_t b = blockIdx.x, h = blockIdx.y, K = p.K, H = p.H, HK = H * K;
  const int64_t slot = p.slot[b], row = slot * kKdaChunk + p.pos[b] % kKdaChunk;
  conv_norm_token(p.raw, p.conv, p.conv_hist, b, h, slot, H, K, p.W, true, qkv, scale);
  for (int64_t d = threadIdx.x; d < K; d += blockDim.x) {
    const int64_t c = row * HK + h * K + d;
    p.q[c] = __float2bfloat16(qkv[0][d]);
    p.k[c] = __float2bfloat16(qkv[1][d]);
    p.v[c] = __float2bfloat16(qkv[2][d]);
    p.g[c] = p.graw[b * HK + h * K + d];
  }
  if (threadIdx.x == 0) p.beta_out[row * H + h] = p.beta[b * H + h];
}

// Block (sequence n, row r): row r of the sequence's last, incomplete chunk (if it has row r) into its slot's chunk
// buffers.
__global__ void store_chunk_rows_kernel(const bf16* q, const bf16* k, const bf16* v, const float* g,
                                        const float* beta, PrefillSeqs ps, bf16* cq, bf16* ck, bf16* cv, float* cg,
                                        float* cb, int64_t H, int64_t HK) {
  const int64_t n = blockIdx.x, r = blockIdx.y, L = ps.seq_len[n];
  if (r >= L % kKdaChunk) return;
  const int64_t src = ps.seq_start[n] + L / kKdaChunk * kKdaChunk + r, dst = ps.slot[n] * kKdaChunk + r;
  for (int64_t c = threadIdx.x; c < HK; c += blockDim.x) {
    cq[dst * HK + c] = q[src * HK + c];
    ck[dst * HK + c] = k[src * HK + c];
    cv[dst * HK + c] = v[src * HK + c];
    cg[dst * HK + c] = g[src * HK + c];
  }
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) cb[dst * H + c] = beta[src * H + c];
}

// One block per sequence: the last W−1 pre-conv projections (zeros before the sequence's start).
__global__ void store_conv_hist_kernel(const float* raw, PrefillSeqs ps, float* hist, int64_t HK, int64_t W) {
  const int64_t n = blockIdx.x, s0 = ps.seq_start[n], L = ps.seq_len[n], slot = ps.slot[n], W1 = W - 1;
  for (int64_t idx = threadIdx.x; idx < 3 * W1 * HK; idx += blockDim.x) {
    const int64_t which = idx / (W1 * HK), i = (idx / HK) % W1, c = idx % HK;
    const int64_t t = L - W1 + i;  // sequence-relative token of history row i
    hist[(slot * 3 + which) * W1 * HK + i * HK + c] = t >= 0 ? raw[(s0 + t) * 3 * HK + which * HK + c] : 0.0f;
  }
}

// One block per sequence: complete pools' keys and the incomplete pool's pending rows.
__global__ void indexer_store_prefill_kernel(const float* ki, const float* gs, const float* pk,
                                             const int32_t* pool_base, PrefillSeqs ps, float* pending_key,
                                             float* pending_gate, float* pool_key, int64_t P, int64_t ID,
                                             int64_t max_pools) {
  const int64_t n = blockIdx.x, s0 = ps.seq_start[n], L = ps.seq_len[n], slot = ps.slot[n], npool = L / P;
  for (int64_t idx = threadIdx.x; idx < npool * ID; idx += blockDim.x)
    pool_key[slot * max_pools * ID + idx] = pk[static_cast<int64_t>(pool_base[n]) * ID + idx];
  for (int64_t idx = threadIdx.x; idx < (L - npool * P) * ID; idx += blockDim.x) {
    pending_key[slot * P * ID + idx] = ki[(s0 + npool * P) * ID + idx];
    pending_gate[slot * P * ID + idx] = gs[(s0 + npool * P) * ID + idx];
  }
}

// ---- Indexer ----

// One block per row: the new key and gate score go to the slot's pending row pos % P; the token that completes its
// pool makes the pool's compressed key (the arithmetic of pool_keys_kernel).
__global__ void indexer_append_kernel(IndexerDecodeParams p) {
  const int64_t b = blockIdx.x, slot = p.slot[b], pos = p.pos[b], P = p.P, ID = p.ID, r = pos % P;
  float* pk = p.pending_key + slot * P * ID;
  float* pg = p.pending_gate + slot * P * ID;
  for (int64_t c = threadIdx.x; c < ID; c += blockDim.x) {
    pk[r * ID + c] = p.ki[b * ID + c];
    pg[r * ID + c] = p.gs[b * ID + c];
    if (r == P - 1) {
      float mx = -INFINITY;
      for (int64_t i = 0; i < P; ++i) mx = fmaxf(mx, pg[i * ID + c] + p.ape[i * ID + c]);
      float den = 0.0f, num = 0.0f;
      for (int64_t i = 0; i < P; ++i) {
        const float e = expf(pg[i * ID + c] + p.ape[i * ID + c] - mx);
        den += e;
        num += e * pk[i * ID + c];
      }
      p.pool_key[(slot * p.max_pools + pos / P) * ID + c] = num / den;
    }
  }
}

constexpr int kPoolsPerBlock = 32;

// Blocks of 32 pools per row, one warp per pool: Σ_h w_h·IH^-1/2·ReLU(ID^-1/2·q_h·pk_j), in the order of the
// forward's select_kernel (so equal inputs give equal scores). Rows whose selectable pools all fit skip this.
__global__ void indexer_scores_kernel(IndexerDecodeParams p) {
  extern __shared__ float q[];  // [IH·ID]
  const int64_t b = blockIdx.y, slot = p.slot[b], selectable = (p.pos[b] + 1) / p.P;
  const int64_t j0 = blockIdx.x * int64_t(kPoolsPerBlock);
  if (selectable <= p.topk / p.P || j0 >= selectable) return;
  for (int64_t i = threadIdx.x; i < p.IH * p.ID; i += blockDim.x) q[i] = p.qi[b * p.IH * p.ID + i];
  __syncthreads();
  const float sscale = rsqrtf(static_cast<float>(p.ID)), wscale = rsqrtf(static_cast<float>(p.IH));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const float* pkb = p.pool_key + slot * p.max_pools * p.ID;
  const int64_t j1 = min(j0 + kPoolsPerBlock, selectable);
  for (int64_t j = j0 + warp; j < j1; j += nw) {
    float acc = 0.0f;
    for (int64_t h = 0; h < p.IH; ++h) {
      float dot = 0.0f;
      for (int64_t c = lane; c < p.ID; c += 32) dot += q[h * p.ID + c] * pkb[j * p.ID + c];
      dot = warp_sum(dot);
      acc += p.wts[b * p.IH + h] * wscale * fmaxf(dot * sscale, 0.0f);
    }
    if (lane == 0) p.scores[b * p.max_pools + j] = acc;
  }
}

// Floats ordered as unsigned integers (larger float ⇔ larger key), as in dsa.cu.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row: the budget-th largest score by a bitwise radix search, then the chosen pools in ascending
// order (ties to the lower pool) and the tail.
__global__ void indexer_select_kernel(IndexerDecodeParams p, int32_t* sel, int32_t* count, int64_t max_sel) {
  const int64_t b = blockIdx.x, rel = p.pos[b], selectable = (rel + 1) / p.P, budget = p.topk / p.P;
  const bool choose = selectable > budget;
  const float* sc = p.scores + b * p.max_pools;
  __shared__ uint32_t kth;
  __shared__ int cnt_gt;
  if (choose) {
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1u << bit);
      int local = 0;
      for (int64_t j = threadIdx.x; j < selectable; j += blockDim.x) local += order_key(sc[j]) >= cand;
      if (block_sum_int(local) >= budget) prefix = cand;
    }
    if (threadIdx.x == 0) kth = prefix;
    __syncthreads();
    int local = 0;
    for (int64_t j = threadIdx.x; j < selectable; j += blockDim.x) local += order_key(sc[j]) > kth;
    const int gt = block_sum_int(local);
    if (threadIdx.x == 0) cnt_gt = gt;
    __syncthreads();
  }
  // Warp 0 walks the pools 32 at a time in ascending order: a pool is taken when its key is above the k-th, or equal
  // to it and among the first (budget − #above) equal ones (ties to the lower pool).
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const uint32_t below = (1u << lane) - 1u;
    int32_t* out = sel + b * max_sel;
    int64_t n = 0, eq_left = choose ? budget - cnt_gt : 0;
    for (int64_t j0 = 0; j0 < selectable; j0 += 32) {
      const int64_t j = j0 + lane;
      bool take = false, eq = false;
      if (j < selectable) {
        if (choose) {
          const uint32_t key = order_key(sc[j]);
          eq = key == kth;
          take = key > kth;
        } else {
          take = true;
        }
      }
      const uint32_t eq_mask = __ballot_sync(0xffffffffu, eq);
      take = take || (eq && __popc(eq_mask & below) < eq_left);
      const uint32_t take_mask = __ballot_sync(0xffffffffu, take);
      if (take) {
        const int64_t at = n + static_cast<int64_t>(__popc(take_mask & below)) * p.P;
        for (int64_t i = 0; i < p.P; ++i) out[at + i] = static_cast<int32_t>(j * p.P + i);
      }
      n += static_cast<int64_t>(__popc(take_mask)) * p.P;
      eq_left -= eq_left < __popc(eq_mask) ? eq_left : __popc(eq_mask);
    }
    if (p.tail)
      for (int64_t i = selectable * p.P + lane; i <= rel; i += 32)
        out[n + i - selectable * p.P] = static_cast<int32_t>(i);
    if (lane == 0) count[b] = static_cast<int32_t>(n + (p.tail ? rel + 1 - selectable * p.P : 0));
  }
}

// ---- MLA ----

__global__ void mla_append_kernel(const bf16* lat, const int32_t* slot, const int32_t* pos, bf16* cache, int64_t KL,
                                  int64_t max_len) {
  const int64_t b = blockIdx.x;
  bf16* dst = cache + (static_cast<int64_t>(slot[b]) * max_len + pos[b]) * KL;
  for (int64_t l = threadIdx.x; l < KL; l += blockDim.x) dst[l] = lat[b * KL + l];
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(r);
}

// Absorbed MLA decoding in three kernels, so that a step has B·NH·kMlaSplits blocks at work on the keys rather
// than B·NH: (1) qa = W_kᵀ q per (row, head); (2) per (row, head, split) of the row's keys, the scores, their local
// max m, Σ e^(score−m) and the e^(score−m)-weighted latent sum; (3) per (row, head), the splits merged in split
// order, normalised, and the value part of kv_b applied. The split count is fixed and every sum runs in an order set
// by the shapes and the row's own key count, so a row's result never depends on the batch.
// With kVec (KL a multiple of 8, at most 8·blockDim) latent and weight rows are read in 16-byte pieces: thread
// (g, c) of G = blockDim / (KL/8) groups takes piece c of rows g, g+G, …, and the groups' partial sums are added in
// group order.
constexpr int kMlaThreads = 256, kMlaSplits = 8;

struct MlaWork {
  float* qa;   // [B, NH, KL]
  float* ml;   // [B, NH, splits, 2]: local max and sum
  float* acc;  // [B, NH, splits, KL]
};
__device__ __forceinline__ MlaWork mla_work(const MlaDecodeParams& p) {
  return MlaWork{p.work, p.work + p.B * p.NH * p.KL, p.work + p.B * p.NH * (p.KL + 2 * kMlaSplits)};
}

// Sums the blockDim·8 group partials `part` of piece-sliced rows into dst[KL] (one barrier before and after).
__device__ __forceinline__ void reduce_groups(const float* part, float* dst, int64_t KL, int64_t G) {
  __syncthreads();
  const int64_t C = KL / 8;
  for (int64_t l = threadIdx.x; l < KL; l += blockDim.x) {
    float acc = 0.0f;
    for (int64_t gg = 0; gg < G; ++gg) acc += part[(gg * C + l / 8) * 8 + l % 8];
    dst[l] = acc;
  }
  __syncthreads();
}

// dst[KL] = Σ_r coef(r)·row(r) over rows r < R (bf16 rows of KL, a multiple of 8, 16-byte aligned), piece-sliced
// over the block's groups as described above. Every thread of the block calls it.
template <class RowFn, class CoefFn>
__device__ __forceinline__ void weighted_rows(RowFn row, CoefFn coef, int64_t R, int64_t KL, float* part,
                                              float* dst) {
  const int64_t C = KL / 8, G = blockDim.x / C, g = threadIdx.x / C, pc = threadIdx.x % C;
  if (g < G) {
    float acc[8] = {};
    for (int64_t r = g; r < R; r += G) {
      float xf[8];
      unpack8(__ldg(reinterpret_cast<const uint4*>(row(r)) + pc), xf);
      const float c = coef(r);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(c, xf[j], acc[j]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) part[(g * C + pc) * 8 + j] = acc[j];
  }
  reduce_groups(part, dst, KL, G);
}

template <bool kVec>
__global__ void __launch_bounds__(kMlaThreads) mla_qa_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];
  const int64_t b = blockIdx.x, h = blockIdx.y, KL = p.KL, dqk = p.dqk, dv = p.dv;
  float* qs = sm;           // [dqk]
  float* part = qs + dqk;   // kVec: [blockDim·8]
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t d = tid; d < dqk; d += nt) qs[d] = p.q[(b * p.NH + h) * dqk + d];
  __syncthreads();
  const bf16* Wk = p.kv_b + h * (dqk + dv) * KL;
  float* out = mla_work(p).qa + (b * p.NH + h) * KL;
  if constexpr (kVec) {
    weighted_rows([&](int64_t d) { return Wk + d * KL; }, [&](int64_t d) { return qs[d]; }, dqk, KL, part, out);
  } else {
    for (int64_t l = tid; l < KL; l += nt) {
      float acc = 0.0f;
      for (int64_t d = 0; d < dqk; ++d) acc = fmaf(qs[d], __bfloat162float(Wk[d * KL + l]), acc);
      out[l] = acc;
    }
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kMlaThreads) mla_split_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];
  __shared__ float scratch[32];
  const int64_t b = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, KL = p.KL;
  const int64_t slot = p.row_start ? 0 : p.slot[b], pos = p.pos[b];
  int64_t n = p.count[b];
  const bool uniform = n == 0;
  if (uniform) n = pos + 1;
  const int64_t i0 = n * sp / kMlaSplits, i1 = n * (sp + 1) / kMlaSplits, m = i1 - i0;
  float* qa = sm;                 // [KL]
  float* pr = qa + KL;            // [max_sel / kMlaSplits + 1]
  float* part = pr + p.max_sel / kMlaSplits + 1;  // kVec: [blockDim·8]; else unused
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  const MlaWork w = mla_work(p);
  const int64_t row = (b * p.NH + h) * kMlaSplits + sp;
  for (int64_t l = tid; l < KL; l += nt) qa[l] = w.qa[(b * p.NH + h) * KL + l];
  __syncthreads();
  auto key = [&](int64_t i) -> int64_t { return uniform ? i : p.sel[b * p.max_sel + i]; };
  const bf16* lat = p.latent + (p.row_start ? static_cast<int64_t>(p.row_start[b]) : slot * p.max_len) * KL;
  const float scale = rsqrtf(static_cast<float>(p.dqk));
  for (int64_t i = warp; i < m; i += nw) {
    const bf16* c = lat + key(i0 + i) * KL;
    float dot = 0.0f;
    if constexpr (kVec) {
      for (int64_t q8 = lane; q8 < KL / 8; q8 += 32) {
        float cf[8];
        unpack8(*(reinterpret_cast<const uint4*>(c) + q8), cf);
#pragma unroll
        for (int j = 0; j < 8; ++j) dot = fmaf(qa[8 * q8 + j], cf[j], dot);
      }
    } else {
      for (int64_t l = lane; l < KL; l += 32) dot += qa[l] * __bfloat162float(c[l]);
    }
    dot = warp_sum(dot);
    if (lane == 0) pr[i] = uniform ? 0.0f : dot * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t i = tid; i < m; i += nt) mx = fmaxf(mx, pr[i]);
  mx = block_max(mx, scratch);
  __syncthreads();
  float s = 0.0f;
  for (int64_t i = tid; i < m; i += nt) s += (pr[i] = expf(pr[i] - mx));
  const float den = block_sum(s, scratch);
  __syncthreads();
  float* acc_out = w.acc + row * KL;
  if constexpr (kVec) {
    weighted_rows([&](int64_t i) { return lat + key(i0 + i) * KL; }, [&](int64_t i) { return pr[i]; }, m, KL, part,
                  acc_out);
  } else {
    for (int64_t l = tid; l < KL; l += nt) {
      float acc = 0.0f;
      for (int64_t i = 0; i < m; ++i) acc = fmaf(pr[i], __bfloat162float(lat[key(i0 + i) * KL + l]), acc);
      acc_out[l] = acc;
    }
  }
  if (tid == 0) {
    w.ml[2 * row] = mx;  // −∞ for an empty split
    w.ml[2 * row + 1] = den;
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kMlaThreads) mla_combine_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];
  const int64_t b = blockIdx.x, h = blockIdx.y, KL = p.KL, dqk = p.dqk, dv = p.dv;
  float* cs = sm;  // [KL]
  __shared__ float f[kMlaSplits];
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  const MlaWork w = mla_work(p);
  const int64_t row0 = (b * p.NH + h) * kMlaSplits;
  if (tid == 0) {
    float M = -INFINITY;
    for (int sp = 0; sp < kMlaSplits; ++sp) M = fmaxf(M, w.ml[2 * (row0 + sp)]);
    float L = 0.0f;
    for (int sp = 0; sp < kMlaSplits; ++sp) {
      const float ms = w.ml[2 * (row0 + sp)];
      f[sp] = ms == -INFINITY ? 0.0f : expf(ms - M);
      L += f[sp] * w.ml[2 * (row0 + sp) + 1];
    }
    for (int sp = 0; sp < kMlaSplits; ++sp) f[sp] /= L;
  }
  __syncthreads();
  for (int64_t l = tid; l < KL; l += nt) {
    float acc = 0.0f;
    for (int sp = 0; sp < kMlaSplits; ++sp)
      if (f[sp] != 0.0f) acc = fmaf(f[sp], w.acc[(row0 + sp) * KL + l], acc);
    cs[l] = acc;
  }
  __syncthreads();
  const bf16* Wv = p.kv_b + h * (dqk + dv) * KL + dqk * KL;
  for (int64_t e = warp; e < dv; e += nw) {
    float acc = 0.0f;
    if constexpr (kVec) {
      for (int64_t q8 = lane; q8 < KL / 8; q8 += 32) {
        float wf[8];
        unpack8(__ldg(reinterpret_cast<const uint4*>(Wv + e * KL) + q8), wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(wf[j], cs[8 * q8 + j], acc);
      }
    } else {
      for (int64_t l = lane; l < KL; l += 32) acc += __bfloat162float(Wv[e * KL + l]) * cs[l];
    }
    acc = warp_sum(acc);
    if (lane == 0) p.o[(b * p.NH + h) * dv + e] = __float2bfloat16(acc);
  }
}

// The split kernel on tensor cores (mla_decode_tc): one block per (row, split) for all the row's heads. The row's
// qa (heads padded to 16·HG) against 64-key tiles of the split's latents: scores on tensor cores, an online softmax
// in the log2 domain, and the P-weighted latent sum on tensor cores. qa and P go in as bf16 pairs hi + lo (about 16
// bits each; the latents are bf16 already), so the products lose next to nothing to the tensor cores: with plain
// bf16 qa and P, decoding's log-probs sat several times further from the forward's on the goldens. Warp w takes heads
// 16(w mod 4) … +15 and latent columns (w / 4)·KL/2 … +KL/2 − 1 of the sum; the two warps of a head group compute its
// scores alike (the same instructions on the same data). Every sum runs in an order set by KL and the row's own
// keys, so a row's result never depends on the batch, and the forward's attention in batch-invariant mode runs this
// same kernel.
constexpr int kMlaTcThreads = 256, kMlaTcKeys = 64;

template <int KL>
struct MlaTcLayout {
  static constexpr int LS = KL + 8;                          // padded row (bf16 elements)
  static constexpr int bytes = 3 * 64 * LS * 2 + kMlaTcKeys * 4;  // Q hi, Q lo, the key tile, its key positions
};

template <int KL>
__global__ void __launch_bounds__(kMlaTcThreads) mla_split_tc_kernel(MlaDecodeParams p, float scale_log2) {
  using L = MlaTcLayout<KL>;
  constexpr int LS = L::LS, HALF = KL / 2, NT = HALF / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [64 heads][LS] qa's bf16 value
  bf16* Ql = Qs + 64 * LS;                   // [64 heads][LS] the bf16 of what is left
  bf16* Cs = Ql + 64 * LS;                   // [64 keys][LS]
  int32_t* keys = reinterpret_cast<int32_t*>(Cs + 64 * LS);
  const int64_t b = blockIdx.x, sp = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int NH = static_cast<int>(p.NH), HG = (NH + 15) / 16, hg = warp & 3, dh = warp >> 2;
  const bool active = hg < HG;
  const int64_t pos = p.pos[b];
  int64_t n = p.count[b];
  const bool uniform = n == 0;
  if (uniform) n = pos + 1;
  const int64_t i0 = n * sp / kMlaSplits, m = n * (sp + 1) / kMlaSplits - i0;
  const MlaWork w = mla_work(p);
  const bf16* lat = p.latent + (p.row_start ? static_cast<int64_t>(p.row_start[b]) : p.slot[b] * p.max_len) * KL;
  for (int i = tid; i < 16 * HG * (KL / 2); i += kMlaTcThreads) {
    const int h = i / (KL / 2), c = 2 * (i % (KL / 2));
    const float2 v = h < NH ? *reinterpret_cast<const float2*>(w.qa + (b * NH + h) * KL + c) : make_float2(0.f, 0.f);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(Qs + h * LS + c) = hi;
    *reinterpret_cast<__nv_bfloat162*>(Ql + h * LS + c) =
        __floats2bfloat162_rn(v.x - __low2float(hi), v.y - __high2float(hi));
  }
  float oc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) oc[nt][0] = oc[nt][1] = oc[nt][2] = oc[nt][3] = 0.0f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  for (int64_t k0 = 0; k0 < m; k0 += kMlaTcKeys) {
    __syncthreads();  // the last tile's reads are done (and Q is in place)
    if (tid < kMlaTcKeys) {
      const int64_t i = i0 + k0 + tid;
      keys[tid] = k0 + tid < m ? (uniform ? static_cast<int32_t>(i) : p.sel[b * p.max_sel + i]) : 0;
    }
    __syncthreads();
    for (int i = tid; i < kMlaTcKeys * (KL / 8); i += kMlaTcThreads) {
      const int r = i / (KL / 8), c = i % (KL / 8);
      cp_async16(Cs + r * LS + 8 * c, lat + static_cast<int64_t>(keys[r]) * KL + 8 * c, k0 + r < m);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (!active) continue;
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    if (!uniform) {
#pragma unroll 4
      for (int kk = 0; kk < KL / 16; ++kk) {
        uint32_t a[4], al[4];
        load_a(a, Qs + 16 * hg * LS + 16 * kk, LS);
        load_a(al, Ql + 16 * hg * LS + 16 * kk, LS);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bb[4];
          load_b_nk(bb, Cs + 16 * np * LS + 16 * kk, LS);
          mma_bf16(s[2 * np], a, bb[0], bb[1]);
          mma_bf16(s[2 * np + 1], a, bb[2], bb[3]);
          mma_bf16(s[2 * np], al, bb[0], bb[1]);
          mma_bf16(s[2 * np + 1], al, bb[2], bb[3]);
        }
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * hf + e];
          x = k0 + 8 * nt + 2 * tq + e < m ? (uniform ? 0.0f : x * scale_log2) : -INFINITY;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(mrow[hf], mx);  // finite: key k0 is in every tile
      const float alpha = exp2f(mrow[hf] - mnew);
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * hf + e];
          x = x == -INFINITY ? 0.0f : exp2f(x - mnew);
          sum += x;
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      lrow[hf] = lrow[hf] * alpha + sum;
      mrow[hf] = mnew;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) oc[nt][2 * hf] *= alpha, oc[nt][2 * hf + 1] *= alpha;
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      // P as a bf16 pair too: hi + lo.
      uint32_t a[4], al[4];
      const float* x[4] = {&s[2 * kk][0], &s[2 * kk][2], &s[2 * kk + 1][0], &s[2 * kk + 1][2]};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const __nv_bfloat162 hi = __floats2bfloat162_rn(x[r][0], x[r][1]);
        a[r] = *reinterpret_cast<const uint32_t*>(&hi);
        al[r] = pack_bf16(x[r][0] - __low2float(hi), x[r][1] - __high2float(hi));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bb[4];
        load_b_kn(bb, Cs + 16 * kk * LS + dh * HALF + 16 * np, LS);
        mma_bf16(oc[2 * np], a, bb[0], bb[1]);
        mma_bf16(oc[2 * np + 1], a, bb[2], bb[3]);
        mma_bf16(oc[2 * np], al, bb[0], bb[1]);
        mma_bf16(oc[2 * np + 1], al, bb[2], bb[3]);
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int h = 16 * hg + gq + 8 * hf;
    if (h >= NH) continue;
    const int64_t row = (b * NH + h) * kMlaSplits + sp;
    float* acc = w.acc + row * KL + dh * HALF;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float2*>(acc + 8 * nt + 2 * tq) = make_float2(oc[nt][2 * hf], oc[nt][2 * hf + 1]);
    if (dh == 0 && tq == 0) {
      w.ml[2 * row] = mrow[hf] * 0.6931471805599453f;  // natural-log units, −∞ for an empty split
      w.ml[2 * row + 1] = lrow[hf];
    }
  }
}

void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
}

}  // namespace

void decode_linear(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, float* y, int64_t ldy,
                   int64_t M, bool accumulate, cudaStream_t st) {
  check(M >= 0 && out >= 0 && in >= 0 && in < (int64_t{1} << 31), "decode_linear: bad shape ", M, "x", in, " -> ",
        out);
  if (!M || !out) return;
  const gemv::Split sp = gemv::split_of(in);
  const int64_t items = ceil_div(ceil_div(out, gemv::kTileRows), sp.tiles) * ceil_div(M, gemv::kPassRows);
  const unsigned grid = static_cast<unsigned>(gemv::grid_for(items));
  // 16-byte loads or element loads: the same values into the same MMAs, so the choice changes no bit.
  if (in % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(W)) {
    linear_kernel<true><<<grid, gemv::kThreads, 0, st>>>(x, ldx, W, out, in, y, ldy, M, accumulate);
  } else {
    linear_kernel<false><<<grid, gemv::kThreads, 0, st>>>(x, ldx, W, out, in, y, ldy, M, accumulate);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void kda_decode_step(const KdaDecodeParams& p, cudaStream_t st) {
  check(p.K >= 1 && p.K <= kKdaMaxK, "CUDA KDA decoding: linear_head_dim must be at most ", kKdaMaxK, ", got ", p.K);
  check(p.W >= 1, "CUDA KDA decoding: conv kernel size must be positive");
  if (!p.B) return;
  const int64_t Kp = (p.K + 31) / 32 * 32, R = (p.K + 31) / 32;
  kda_step_kernel<<<dim3(static_cast<unsigned>(p.B), static_cast<unsigned>(p.H)), static_cast<unsigned>(Kp * R), 0,
                    st>>>(p);
}

void indexer_decode_append(const IndexerDecodeParams& p, cudaStream_t st) {
  if (p.B) indexer_append_kernel<<<p.B, 128, 0, st>>>(p);
}

void indexer_decode_select(const IndexerDecodeParams& p, int32_t* sel, int32_t* count, int64_t max_sel,
                           cudaStream_t st) {
  if (!p.B) return;
  check(p.max_selectable <= p.max_pools, "indexer decoding: ", p.max_selectable, " pools exceed the capacity ",
        p.max_pools);
  if (p.max_selectable > p.topk / p.P) {
    const size_t smem = p.IH * p.ID * sizeof(float);
    set_smem(reinterpret_cast<const void*>(indexer_scores_kernel), smem);
    const dim3 grid(static_cast<unsigned>(ceil_div(p.max_selectable, kPoolsPerBlock)), static_cast<unsigned>(p.B));
    indexer_scores_kernel<<<grid, 256, smem, st>>>(p);
  }
  indexer_select_kernel<<<p.B, 256, 0, st>>>(p, sel, count, max_sel);
}

void mla_decode_append(const bf16* lat, const int32_t* slot, const int32_t* pos, bf16* cache, int64_t B, int64_t KL,
                       int64_t max_len, cudaStream_t st) {
  if (B) mla_append_kernel<<<B, 128, 0, st>>>(lat, slot, pos, cache, KL, max_len);
}

int64_t mla_decode_workspace_floats(int64_t B, int64_t NH, int64_t KL) {
  return B * NH * (KL + 2 * kMlaSplits + kMlaSplits * KL);
}

bool mla_decode_tc(int64_t NH, int64_t KL) {
  return NH >= 1 && NH <= 64 && (KL == 32 || KL == 64 || KL == 128 || KL == 256 || KL == 512);
}

namespace {

template <int KL>
void launch_split_tc(const MlaDecodeParams& p, cudaStream_t st) {
  const int bytes = MlaTcLayout<KL>::bytes;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(mla_split_tc_kernel<KL>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const float scale_log2 = 1.4426950408889634f * rsqrtf(static_cast<float>(p.dqk));
  mla_split_tc_kernel<KL><<<dim3(static_cast<unsigned>(p.B), kMlaSplits), kMlaTcThreads, bytes, st>>>(p, scale_log2);
}

}  // namespace

void mla_decode_attention(const MlaDecodeParams& p, cudaStream_t st) {
  if (!p.B) return;
  // The vector path depends on the shapes and the buffers' alignment only, never on B.
  const bool vec = p.KL % 8 == 0 && p.KL / 8 <= kMlaThreads && aligned16(p.kv_b) && aligned16(p.latent);
  const size_t part = vec ? 8 * kMlaThreads : 0;
  const size_t qa_smem = (p.dqk + part) * sizeof(float);
  const size_t split_smem = (p.KL + p.max_sel / kMlaSplits + 1 + part) * sizeof(float);
  const size_t combine_smem = p.KL * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.NH));
  const dim3 split_grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.NH), kMlaSplits);
  const bool tc = mla_decode_tc(p.NH, p.KL) && aligned16(p.latent);
  auto run = [&](auto qa_k, auto split_k, auto combine_k) {
    set_smem(reinterpret_cast<const void*>(qa_k), qa_smem);
    set_smem(reinterpret_cast<const void*>(combine_k), combine_smem);
    qa_k<<<grid, kMlaThreads, qa_smem, st>>>(p);
    if (tc) {
      switch (p.KL) {
        case 32: launch_split_tc<32>(p, st); break;
        case 64: launch_split_tc<64>(p, st); break;
        case 128: launch_split_tc<128>(p, st); break;
        case 256: launch_split_tc<256>(p, st); break;
        default: launch_split_tc<512>(p, st); break;
      }
    } else {
      set_smem(reinterpret_cast<const void*>(split_k), split_smem);
      split_k<<<split_grid, kMlaThreads, split_smem, st>>>(p);
    }
    combine_k<<<grid, kMlaThreads, combine_smem, st>>>(p);
  };
  if (vec) {
    run(mla_qa_kernel<true>, mla_split_kernel<true>, mla_combine_kernel<true>);
  } else {
    run(mla_qa_kernel<false>, mla_split_kernel<false>, mla_combine_kernel<false>);
  }
}

void kda_chunk_append(const KdaChunkAppendParams& p, cudaStream_t st) {
  check(p.K >= 1 && p.K <= kKdaMaxK, "CUDA KDA decoding: linear_head_dim must be at most ", kKdaMaxK, ", got ", p.K);
  check(p.W >= 1, "CUDA KDA decoding: conv kernel size must be positive");
  if (p.B) kda_chunk_append_kernel<<<dim3(static_cast<unsigned>(p.B), static_cast<unsigned>(p.H)), 256, 0, st>>>(p);
}

void kda_store_chunk_rows(const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
                          const PrefillSeqs& s, bf16* chunk_q, bf16* chunk_k, bf16* chunk_v, float* chunk_g,
                          float* chunk_beta, int64_t H, int64_t K, cudaStream_t st) {
  if (s.N)
    store_chunk_rows_kernel<<<dim3(static_cast<unsigned>(s.N), kKdaChunk), 256, 0, st>>>(
        q, k, v, g, beta, s, chunk_q, chunk_k, chunk_v, chunk_g, chunk_beta, H, H * K);
}

void kda_store_conv_hist(const float* raw, const PrefillSeqs& s, float* conv_hist, int64_t HK, int64_t W,
                         cudaStream_t st) {
  if (s.N && W > 1) store_conv_hist_kernel<<<s.N, 256, 0, st>>>(raw, s, conv_hist, HK, W);
}

void kda_final_state(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const PrefillSeqs& s, float* state, int64_t H, int64_t K, cudaStream_t st) {
  check(K >= 1 && K <= kKdaMaxK, "CUDA KDA decoding: linear_head_dim must be at most ", kKdaMaxK, ", got ", K);
  if (!s.N) return;
  const int64_t Kp = (K + 31) / 32 * 32, R = (K + 31) / 32;
  kda_final_state_kernel<<<dim3(static_cast<unsigned>(s.N), static_cast<unsigned>(H)), static_cast<unsigned>(Kp * R),
                           0, st>>>(q, k, v, g, beta, s, state, H, K);
}

void indexer_store_prefill(const float* ki, const float* gs, const float* pk, const int32_t* pool_base,
                           const PrefillSeqs& s, float* pending_key, float* pending_gate, float* pool_key, int64_t P,
                           int64_t ID, int64_t max_pools, cudaStream_t st) {
  if (s.N)
    indexer_store_prefill_kernel<<<s.N, 256, 0, st>>>(ki, gs, pk, pool_base, s, pending_key, pending_gate, pool_key,
                                                      P, ID, max_pools);
}

}  // namespace nextlm::cuda
