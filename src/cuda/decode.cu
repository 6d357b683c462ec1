// Decoding kernels: one new token per cache slot (the KDA recurrent step with the conv history,
// the indexer's incremental pool cache and selection, absorbed MLA over cached bf16 latents). Matches
// src/model/kda.cpp (kda_layer_forward_cached, recurrent form) and src/model/dsa.cpp (indexer_forward_cached,
// dsa_layer_forward_cached), with the numerics of the bf16 forward (src/cuda/kda.cu, dsa.cu).
#include "cuda/decode_kernels.h"

#include <algorithm>

#include "cuda/kda_decode_token.cuh"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

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
    eg[d] = expf(kda_gate_value(f, rate, p.has_bound, p.bound));
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
// pool makes the pool's compressed key (the arithmetic of pool_keys_kernel) from the pending rows before it and its
// own, all read before anything is stored (so the loads need not wait for the stores).
__global__ void indexer_append_kernel(IndexerDecodeParams p) {
  const int64_t b = blockIdx.x, slot = p.slot[b], pos = p.pos[b], P = p.P, ID = p.ID, r = pos % P;
  float* pk = p.pending_key + slot * P * ID;
  float* pg = p.pending_gate + slot * P * ID;
  for (int64_t c = threadIdx.x; c < ID; c += blockDim.x) {
    const float kn = p.ki[b * ID + c], gn = p.gs[b * ID + c];
    if (r == P - 1) {
      float mx = -INFINITY;
#pragma unroll 4
      for (int64_t i = 0; i < P; ++i) mx = fmaxf(mx, (i == r ? gn : pg[i * ID + c]) + p.ape[i * ID + c]);
      float den = 0.0f, num = 0.0f;
#pragma unroll 4
      for (int64_t i = 0; i < P; ++i) {
        const float e = expf((i == r ? gn : pg[i * ID + c]) + p.ape[i * ID + c] - mx);
        den += e;
        num += e * (i == r ? kn : pk[i * ID + c]);
      }
      p.pool_key[(slot * p.max_pools + pos / P) * ID + c] = num / den;
    }
    pk[r * ID + c] = kn;
    pg[r * ID + c] = gn;
  }
}

// Pool scores Σ_h (w_h·IH^-1/2)·ReLU(ID^-1/2·q_h·pk_j) in the order of the forward's score_kernel (dsa.cu), so that
// equal inputs give equal bits: lane l holds channels l, l+32, l+64, l+96 of a dot product (zero past ID) and adds
// them in order with fma from 0, the 32 lane sums meet along warp_sum's butterfly (offsets 16, 8, 4, 2, 1), and the
// heads add in order. One warp per pool takes 32 heads at a time: their 32 butterflies run as one reduce-scatter
// (each step adds exactly the pairs the butterfly adds, on the lane that keeps the pair), which leaves head h0 + l's
// dot product on lane l after 31 shuffles rather than 160. The row's queries sit in shared memory lane-major, one
// 16-byte load per head and lane. Grid (pool blocks, rows); rows whose selectable pools all fit skip this.
constexpr int kScoreWarps = 8;

// One step of the reduce-scatter: lanes with bit O set keep the upper O of their 2·O live slots, the others the lower
// O; each adds its partner's (lane ^ O) value of the kept slots, as the butterfly's `v += shfl_xor(v, O)` does.
template <int O>
__device__ __forceinline__ void scatter_step(float (&d)[32], int lane) {
  const bool up = (lane & O) != 0;
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = up ? d[i] : d[i + O], keep = up ? d[i + O] : d[i];
    d[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}

__global__ void __launch_bounds__(kScoreWarps * 32) indexer_scores_kernel(IndexerDecodeParams p, int pools_per_block) {
  extern __shared__ float4 qv[];  // [IH][32]: lane l's channels l, l+32, l+64, l+96 of each head's query
  const int64_t b = blockIdx.y, slot = p.slot[b], selectable = (p.pos[b] + 1) / p.P;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * pools_per_block;
  if (selectable <= p.topk / p.P || j0 >= selectable) return;
  const int IH = static_cast<int>(p.IH), ID = static_cast<int>(p.ID);
  float* ws = reinterpret_cast<float*>(qv + IH * 32);  // [IH] head weights times IH^-1/2
  const float sscale = rsqrtf(static_cast<float>(ID)), wscale = rsqrtf(static_cast<float>(IH));
  const float* qb = p.qi + b * IH * ID;
  for (int i = threadIdx.x; i < IH * 32; i += blockDim.x) {
    const int h = i / 32, l = i % 32;
    float v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = l + 32 * c < ID ? qb[h * ID + l + 32 * c] : 0.0f;
    qv[i] = make_float4(v[0], v[1], v[2], v[3]);
  }
  for (int h = threadIdx.x; h < IH; h += blockDim.x) ws[h] = p.wts[b * IH + h] * wscale;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j1 = min(j0 + pools_per_block, selectable);
  for (int64_t j = j0 + warp; j < j1; j += kScoreWarps) {
    const float* pk = p.pool_key + (slot * p.max_pools + j) * ID;
    float k[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) k[c] = lane + 32 * c < ID ? pk[lane + 32 * c] : 0.0f;
    float acc = 0.0f;
    for (int h0 = 0; h0 < IH; h0 += 32) {
      float d[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const float4 q = h0 + i < IH ? qv[(h0 + i) * 32 + lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        d[i] = fmaf(q.w, k[3], fmaf(q.z, k[2], fmaf(q.y, k[1], fmaf(q.x, k[0], 0.0f))));
      }
      scatter_step<16>(d, lane);
      scatter_step<8>(d, lane);
      scatter_step<4>(d, lane);
      scatter_step<2>(d, lane);
      scatter_step<1>(d, lane);
      const float relu = fmaxf(d[0] * sscale, 0.0f);  // head h0 + lane
      const int nh = min(32, IH - h0);
      for (int i = 0; i < nh; ++i) acc = fmaf(ws[h0 + i], __shfl_sync(0xffffffffu, relu, i), acc);
    }
    if (lane == 0) p.scores[b * p.max_pools + j] = acc;
  }
}

// Floats ordered as unsigned integers (larger float ⇔ larger key), as in dsa.cu.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row: every selectable pool when they fit the budget; else the budget-th largest score κ by a radix
// select on 8-bit digits (warp-aggregated shared-memory histograms, one warp scanning the 256 bins), then the pools
// above κ and the lowest-indexed ones equal to κ (ties to the lower pool), written in ascending order through one
// block-wide count per round of kSelectThreads pools; then the tail.
constexpr int kSelectThreads = 512, kSelectWarps = kSelectThreads / 32;

__global__ void __launch_bounds__(kSelectThreads)
    indexer_select_kernel(IndexerDecodeParams p, int32_t* sel, int32_t* count, int64_t max_sel) {
  __shared__ int hist[2][256], part[2][kSelectWarps];
  __shared__ int found_digit, found_above;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t b = blockIdx.x, rel = p.pos[b], P = p.P, selectable = (rel + 1) / P, budget = p.topk / P;
  const int64_t tail = p.tail ? rel + 1 - selectable * P : 0;
  int32_t* out = sel + b * max_sel;
  if (selectable <= budget) {  // every selectable pool, then the tail: positions 0 … n−1
    const int64_t n = selectable * P + tail;
    for (int64_t i = tid; i < n; i += kSelectThreads) out[i] = static_cast<int32_t>(i);
    if (tid == 0) count[b] = static_cast<int32_t>(n);
    return;
  }
  const float* sc = p.scores + b * p.max_pools;
  // κ = the largest key with #(key ≥ κ) ≥ budget, a digit at a time from the top; `need` counts the keys equal to
  // the prefix so far still to be taken.
  uint32_t prefix = 0, mask = 0;
  int64_t need = budget;
  if (budget > 0) {
    if (tid < 256) hist[0][tid] = 0;
    __syncthreads();
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      int* h = hist[pass & 1];
      for (int64_t j0 = 0; j0 < selectable; j0 += kSelectThreads) {
        const int64_t j = j0 + tid;
        const uint32_t key = j < selectable ? order_key(__ldg(sc + j)) : 0u;
        const bool match = j < selectable && (key & mask) == prefix;
        const uint32_t digit = match ? (key >> shift) & 255u : 256u;
        const uint32_t peers = __match_any_sync(0xffffffffu, digit);
        if (match && lane == __ffs(peers) - 1) atomicAdd(&h[digit], __popc(peers));
      }
      if (tid < 256) hist[(pass + 1) & 1][tid] = 0;  // the next pass's histogram (scanned in the last pass)
      __syncthreads();
      if (warp == 0) {
        // Lane l holds digits 255 − 8l … 248 − 8l: `at_least` counts the matching keys with a digit ≥ the one.
        int run[8], total = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) run[i] = total += h[255 - 8 * lane - i];
        int before = total;
        for (int o = 1; o < 32; o <<= 1) {
          const int u = __shfl_up_sync(0xffffffffu, before, o);
          if (lane >= o) before += u;
        }
        before -= total;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int here = h[255 - 8 * lane - i], at_least = before + run[i];
          if (at_least >= need && at_least - here < need) {
            found_digit = 255 - 8 * lane - i;
            found_above = at_least - here;
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<uint32_t>(found_digit) << shift;
      mask |= 255u << shift;
      need -= found_above;
    }
  } else {
    prefix = 0xffffffffu, need = 0;  // nothing is above the largest key, and no equal one is taken
  }
  // Round r takes pools r·kSelectThreads + tid: per warp the counts above and equal (packed), then each thread's
  // place from the warps before it.
  const uint32_t below = (1u << lane) - 1u;
  int64_t taken = 0, equal = 0;  // before this round
  for (int64_t j0 = 0, r = 0; j0 < selectable; j0 += kSelectThreads, ++r) {
    const int64_t j = j0 + tid;
    const uint32_t key = j < selectable ? order_key(__ldg(sc + j)) : 0u;
    const bool above = j < selectable && key > prefix, eq = j < selectable && key == prefix;
    const uint32_t ba = __ballot_sync(0xffffffffu, above), be = __ballot_sync(0xffffffffu, eq);
    int* pt = part[r & 1];
    if (lane == 0) pt[warp] = __popc(ba) | (__popc(be) << 16);
    __syncthreads();  // part[r & 1] is rewritten two rounds on, after the next round's barrier
    int64_t a_before = __popc(ba & below), e_before = __popc(be & below), a_total = 0, e_total = 0;
    for (int w = 0; w < kSelectWarps; ++w) {
      const int v = pt[w];
      if (w < warp) a_before += v & 0xffff, e_before += v >> 16;
      a_total += v & 0xffff, e_total += v >> 16;
    }
    const int64_t room = max(need - equal, int64_t{0});  // equal keys still to take
    if (above || (eq && e_before < room)) {
      const int64_t at = taken + a_before + min(e_before, room);
      for (int64_t i = 0; i < P; ++i) out[at * P + i] = static_cast<int32_t>(j * P + i);
    }
    taken += a_total + min(e_total, room);
    equal += e_total;
  }
  for (int64_t i = tid; i < tail; i += kSelectThreads) out[budget * P + i] = static_cast<int32_t>(selectable * P + i);
  if (tid == 0) count[b] = static_cast<int32_t>(budget * P + tail);
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

// Absorbed MLA decoding in three kernels: (1) qa = W_kᵀ q per (row, head); (2) per (row, head, split) of the row's
// keys, the scores, their local max m, Σ e^(score−m) and the e^(score−m)-weighted latent sum; (3) per (row, head),
// the splits merged in split order, normalised, and the value part of kv_b applied. The split count is fixed and
// every sum runs in an order set by the shapes and the row's own key count, so a row's result never depends on the
// batch; how the work is spread over blocks (and how many rows share a block) may depend on B, never the sums.
// With 16-byte pieces (KL a multiple of 8, at most 8·kMlaThreads, aligned buffers) a sum over rows of bf16 [·, KL]
// runs as in weighted_rows: G = kMlaThreads / (KL/8) groups, group g takes rows g, g+G, … of 8-column piece c with
// fma in row order, and the groups' partial sums add in group order from 0.
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
// over the block's groups as described above (blockDim = kMlaThreads). Every thread of the block calls it.
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

// qa with 16-byte pieces, spread over blocks: grid (row groups of RB, heads, column slices). A block runs the
// chains (group g, piece c) of `pieces` consecutive pieces for all G groups, each weight piece loaded once for the
// RB rows of the block (U loads in flight per thread), then adds each column's group partials in group order.
struct QaTiling {
  int C, G, pieces, slices, threads;
};
__host__ __device__ inline QaTiling qa_tiling(int64_t KL) {
  QaTiling t;
  t.C = static_cast<int>(KL / 8);
  t.G = kMlaThreads / t.C;
  const int want = 64 / t.G > 1 ? 64 / t.G : 1;  // about 64 chains a block
  t.pieces = want < t.C ? want : t.C;
  t.slices = (t.C + t.pieces - 1) / t.pieces;
  t.threads = (t.G * t.pieces + 31) / 32 * 32;
  return t;
}

template <int RB, int U>
__global__ void __launch_bounds__(kMlaThreads) mla_qa_vec_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];
  const QaTiling t = qa_tiling(p.KL);
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * RB, h = blockIdx.y, NH = p.NH, KL = p.KL, dqk = p.dqk;
  const int rows = static_cast<int>(min(static_cast<int64_t>(RB), p.B - b0));
  const int W8 = 8 * t.pieces;                   // columns of the block
  float* qs = sm;                                // [RB][dqk]
  float* part = qs + RB * dqk;                   // [RB][G][W8]
  const int tid = threadIdx.x, g = tid / t.pieces, pc = tid % t.pieces;
  const int64_t piece = static_cast<int64_t>(blockIdx.z) * t.pieces + pc;
  for (int64_t i = tid; i < RB * dqk; i += blockDim.x) {
    const int64_t r = i / dqk;
    qs[i] = r < rows ? p.q[((b0 + r) * NH + h) * dqk + i % dqk] : 0.0f;
  }
  __syncthreads();
  if (g < t.G && piece < t.C) {
    // Row d of W_k at W + d·C.
    const uint4* W = reinterpret_cast<const uint4*>(p.kv_b + h * (dqk + p.dv) * KL) + piece;
    float acc[RB][8] = {};
    for (int64_t d0 = g; d0 < dqk; d0 += static_cast<int64_t>(U) * t.G) {
      uint4 wv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t d = d0 + static_cast<int64_t>(u) * t.G;
        wv[u] = d < dqk ? __ldg(W + d * t.C) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t d = d0 + static_cast<int64_t>(u) * t.G;
        if (d < dqk) {
          float wf[8];
          unpack8(wv[u], wf);
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            const float c = qs[r * dqk + d];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(c, wf[j], acc[r][j]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int j = 0; j < 8; ++j) part[(r * t.G + g) * W8 + pc * 8 + j] = acc[r][j];
  }
  __syncthreads();
  float* qa = mla_work(p).qa;
  for (int i = tid; i < rows * W8; i += blockDim.x) {
    const int r = i / W8, l = i % W8;
    const int64_t col = static_cast<int64_t>(blockIdx.z) * W8 + l;
    if (col >= KL) continue;
    float s = 0.0f;
    for (int gg = 0; gg < t.G; ++gg) s += part[(r * t.G + gg) * W8 + l];
    qa[((b0 + r) * NH + h) * KL + col] = s;
  }
}

// qa on CUDA cores in fp32 (KL not a multiple of 8, or unaligned buffers): one thread per output, rows in order.
__global__ void __launch_bounds__(kMlaThreads) mla_qa_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];
  const int64_t b = blockIdx.x, h = blockIdx.y, KL = p.KL, dqk = p.dqk, dv = p.dv;
  float* qs = sm;  // [dqk]
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t d = tid; d < dqk; d += nt) qs[d] = p.q[(b * p.NH + h) * dqk + d];
  __syncthreads();
  const bf16* Wk = p.kv_b + h * (dqk + dv) * KL;
  float* out = mla_work(p).qa + (b * p.NH + h) * KL;
  for (int64_t l = tid; l < KL; l += nt) {
    float acc = 0.0f;
    for (int64_t d = 0; d < dqk; ++d) acc = fmaf(qs[d], __bfloat162float(Wk[d * KL + l]), acc);
    out[l] = acc;
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

// The merge factors of row b's splits (one thread): f[sp] = e^(m_sp − M) / Σ_s e^(m_s − M)·l_s, 0 for an empty one.
__device__ __forceinline__ void merge_factors(const MlaWork& w, int64_t row0, float* f) {
  float M = -INFINITY;
  for (int sp = 0; sp < kMlaSplits; ++sp) M = fmaxf(M, w.ml[2 * (row0 + sp)]);
  float L = 0.0f;
  for (int sp = 0; sp < kMlaSplits; ++sp) {
    const float ms = w.ml[2 * (row0 + sp)];
    f[sp] = ms == -INFINITY ? 0.0f : expf(ms - M);
    L = fmaf(f[sp], w.ml[2 * (row0 + sp) + 1], L);
  }
  for (int sp = 0; sp < kMlaSplits; ++sp) f[sp] /= L;
}

// The merged latent sum cs[l] = Σ_sp f[sp]·acc_sp[l] in split order (empty splits skipped).
__device__ __forceinline__ float merged(const MlaWork& w, int64_t row0, const float* f, int64_t KL, int64_t l) {
  float acc = 0.0f;
  for (int sp = 0; sp < kMlaSplits; ++sp)
    if (f[sp] != 0.0f) acc = fmaf(f[sp], w.acc[(row0 + sp) * KL + l], acc);
  return acc;
}

// The combine with 16-byte pieces, spread over blocks: grid (row groups of RB, heads, slices of kCombineOuts value
// outputs). Each block merges its rows' splits (recomputed per slice: 8·KL floats from L2) while its weight pieces
// are in flight; output e is a warp's: lane l adds pieces l, l+32, … of W_v[e]·cs in order with fma, then warp_sum.
// A warp holds the first two pieces of its kCombinePerWarp outputs in registers and reuses them for every row.
constexpr int kCombinePerWarp = 8, kCombineOuts = kCombinePerWarp * (kMlaThreads / 32);

template <int RB>
__global__ void __launch_bounds__(kMlaThreads, 2) mla_combine_vec_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];  // cs [RB][KL]
  __shared__ float f[RB][kMlaSplits];
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * RB, h = blockIdx.y, NH = p.NH, KL = p.KL, C = KL / 8,
                dv = p.dv;
  const int rows = static_cast<int>(min(static_cast<int64_t>(RB), p.B - b0));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t e0 = static_cast<int64_t>(blockIdx.z) * kCombineOuts + warp;  // the warp's outputs e0 + 8i
  const uint4* Wv = reinterpret_cast<const uint4*>(p.kv_b + (h * (p.dqk + dv) + p.dqk) * KL);  // row e at Wv + e·C
  uint4 wv[kCombinePerWarp][2];
#pragma unroll
  for (int i = 0; i < kCombinePerWarp; ++i)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int64_t e = e0 + 8 * i, q8 = lane + 32 * q;
      wv[i][q] = e < dv && q8 < C ? __ldg(Wv + e * C + q8) : make_uint4(0u, 0u, 0u, 0u);
    }
  const MlaWork w = mla_work(p);
  if (tid < rows) merge_factors(w, ((b0 + tid) * NH + h) * kMlaSplits, f[tid]);
  __syncthreads();
  for (int64_t i = tid; i < rows * KL; i += blockDim.x) {
    const int64_t r = i / KL;
    sm[i] = merged(w, ((b0 + r) * NH + h) * kMlaSplits, f[r], KL, i % KL);
  }
  __syncthreads();
  for (int r = 0; r < rows; ++r) {
    const float* cs = sm + r * KL;
    // Pieces lane and lane + 32 of all the warp's outputs (those past dv have zero weights), then the rest.
    float acc[kCombinePerWarp] = {};
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int64_t q8 = lane + 32 * q;
      if (q8 >= C) break;
      float cf[8];
      const float4 lo = *reinterpret_cast<const float4*>(cs + 8 * q8);
      const float4 hi = *reinterpret_cast<const float4*>(cs + 8 * q8 + 4);
      cf[0] = lo.x, cf[1] = lo.y, cf[2] = lo.z, cf[3] = lo.w, cf[4] = hi.x, cf[5] = hi.y, cf[6] = hi.z, cf[7] = hi.w;
#pragma unroll
      for (int i = 0; i < kCombinePerWarp; ++i) {
        // Unpacked afresh for each row: hoisting the unpacked pieces out of the row loop would take 128 registers.
        uint4 v = wv[i][q];
        asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
        float wf[8];
        unpack8(v, wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i] = fmaf(wf[j], cf[j], acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kCombinePerWarp; ++i) {
      const int64_t e = e0 + 8 * i;
      if (e >= dv) break;  // the same for the whole warp
      for (int64_t q8 = lane + 64; q8 < C; q8 += 32) {
        float wf[8];
        unpack8(__ldg(Wv + e * C + q8), wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i] = fmaf(wf[j], cs[8 * q8 + j], acc[i]);
      }
      const float sum = warp_sum(acc[i]);
      if (lane == 0) p.o[((b0 + r) * NH + h) * dv + e] = __float2bfloat16(sum);
    }
  }
}

// The combine on CUDA cores in fp32 (KL not a multiple of 8, or unaligned buffers): one block per (row, head).
__global__ void __launch_bounds__(kMlaThreads) mla_combine_kernel(MlaDecodeParams p) {
  extern __shared__ float sm[];
  const int64_t b = blockIdx.x, h = blockIdx.y, KL = p.KL, dqk = p.dqk, dv = p.dv;
  float* cs = sm;  // [KL]
  __shared__ float f[kMlaSplits];
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  const MlaWork w = mla_work(p);
  const int64_t row0 = (b * p.NH + h) * kMlaSplits;
  if (tid == 0) merge_factors(w, row0, f);
  __syncthreads();
  for (int64_t l = tid; l < KL; l += nt) cs[l] = merged(w, row0, f, KL, l);
  __syncthreads();
  const bf16* Wv = p.kv_b + h * (dqk + dv) * KL + dqk * KL;
  for (int64_t e = warp; e < dv; e += nw) {
    float acc = 0.0f;
    for (int64_t l = lane; l < KL; l += 32) acc += __bfloat162float(Wv[e * KL + l]) * cs[l];
    acc = warp_sum(acc);
    if (lane == 0) p.o[(b * p.NH + h) * dv + e] = __float2bfloat16(acc);
  }
}

// The split kernel on tensor cores (mla_decode_tc): one block per (row, split, group of 16 heads). The group's qa
// against 64-key tiles of the split's latents: scores on tensor cores, an online softmax in the log2 domain, and the
// P-weighted latent sum on tensor cores. qa and P go in as bf16 pairs hi + lo (about 16 bits each; the latents are
// bf16 already), so the products lose next to nothing to the tensor cores: with plain bf16 qa and P, decoding's
// log-probs sat several times further from the forward's on the goldens. Warps 0–3 score 16 keys each (every score
// one chain of hi, lo MMAs over the KL/16 slices) into shared memory; then every warp runs the same softmax on the
// whole tile (so all hold the same P, max and sum) and sums its own KL/8 latent columns. Every sum runs in an order
// set by KL and the row's own keys, so a row's result never depends on the batch, and the forward's attention in
// batch-invariant mode runs this same kernel. kStages = 2 double-buffers the latent tiles (one block per SM, for a
// grid of at most one wave); kStages = 1 leaves room for two blocks per SM. Both compute the same bits.
constexpr int kMlaTcThreads = 256, kMlaTcKeys = 64, kMlaTcSs = kMlaTcKeys + 8;

template <int KL, int kStages>
struct MlaTcLayout {
  static constexpr int LS = KL + 8;  // padded row (bf16 elements)
  // Q hi, Q lo [16][LS]; the key tiles [kStages][64][LS]; the scores fp32 [16][kMlaTcSs].
  static constexpr int bytes = (2 * 16 + kStages * kMlaTcKeys) * LS * 2 + 16 * kMlaTcSs * 4;
};

template <int KL, int kStages>
__global__ void __launch_bounds__(kMlaTcThreads) mla_split_tc_kernel(MlaDecodeParams p, float scale_log2) {
  using L = MlaTcLayout<KL, kStages>;
  // The P·C product in units of 16 latent columns (one ldmatrix.x4.trans), UPW of them per warp.
  constexpr int LS = L::LS, UNITS = KL / 16, UPW = UNITS >= 8 ? UNITS / 8 : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [16 heads][LS] qa's bf16 value
  bf16* Ql = Qs + 16 * LS;                   // [16 heads][LS] the bf16 of what is left
  bf16* Cs = Ql + 16 * LS;                   // [kStages][64 keys][LS]
  float* S = reinterpret_cast<float*>(Cs + kStages * kMlaTcKeys * LS);  // [16 heads][kMlaTcSs] the tile's scores
  const int64_t b = blockIdx.x, sp = blockIdx.y, hg = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int NH = static_cast<int>(p.NH);
  const int64_t pos = p.pos[b];
  int64_t n = p.count[b];
  const bool uniform = n == 0;
  if (uniform) n = pos + 1;
  const int64_t i0 = n * sp / kMlaSplits, m = n * (sp + 1) / kMlaSplits - i0;
  const MlaWork w = mla_work(p);
  const bf16* lat = p.latent + (p.row_start ? static_cast<int64_t>(p.row_start[b]) : p.slot[b] * p.max_len) * KL;
  for (int i = tid; i < 16 * (KL / 2); i += kMlaTcThreads) {
    const int hl = i / (KL / 2), c = 2 * (i % (KL / 2));
    const int64_t h = 16 * hg + hl;
    const float2 v = h < NH ? *reinterpret_cast<const float2*>(w.qa + (b * NH + h) * KL + c) : make_float2(0.f, 0.f);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(Qs + hl * LS + c) = hi;
    *reinterpret_cast<__nv_bfloat162*>(Ql + hl * LS + c) =
        __floats2bfloat162_rn(v.x - __low2float(hi), v.y - __high2float(hi));
  }
  // Keys k0 … k0+63 of the split (rows past m zero-filled) into dst, one commit group.
  auto load_tile = [&](int64_t k0, bf16* dst) {
    for (int i = tid; i < kMlaTcKeys * (KL / 8); i += kMlaTcThreads) {
      const int r = i / (KL / 8), c = i % (KL / 8);
      const bool valid = k0 + r < m;
      const int64_t key = valid ? (uniform ? i0 + k0 + r : p.sel[b * p.max_sel + i0 + k0 + r]) : 0;
      cp_async16(dst + r * LS + 8 * c, lat + key * KL + 8 * c, valid);
    }
    cp_async_commit();
  };
  const bool pv = warp * UPW < UNITS;  // whether the warp has columns of the P·C product
  const int col0 = warp * UPW * 16;
  float oc[2 * UPW][4];
#pragma unroll
  for (int nt = 0; nt < 2 * UPW; ++nt) oc[nt][0] = oc[nt][1] = oc[nt][2] = oc[nt][3] = 0.0f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  if (m > 0) load_tile(0, Cs);
  for (int64_t k0 = 0, t = 0; k0 < m; k0 += kMlaTcKeys, ++t) {
    bf16* Ct = Cs + (kStages == 2 ? (t & 1) : 0) * kMlaTcKeys * LS;
    if (kStages == 1 && t > 0) {
      __syncthreads();  // every warp is done with the last tile
      load_tile(k0, Ct);
    }
    cp_async_wait<0>();
    __syncthreads();  // the tile (and Q) in place; every warp done with the last tile's buffer and scores
    if (kStages == 2 && k0 + kMlaTcKeys < m) load_tile(k0 + kMlaTcKeys, Cs + ((t + 1) & 1) * kMlaTcKeys * LS);
    if (!uniform) {
      if (warp < 4) {
        float s2[2][4] = {};
#pragma unroll 4
        for (int kk = 0; kk < KL / 16; ++kk) {
          uint32_t a[4], al[4], bb[4];
          load_a(a, Qs + 16 * kk, LS);
          load_a(al, Ql + 16 * kk, LS);
          load_b_nk(bb, Ct + 16 * warp * LS + 16 * kk, LS);
          mma_bf16(s2[0], a, bb[0], bb[1]);
          mma_bf16(s2[1], a, bb[2], bb[3]);
          mma_bf16(s2[0], al, bb[0], bb[1]);
          mma_bf16(s2[1], al, bb[2], bb[3]);
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int key = 8 * (2 * warp + hf) + 2 * tq;
          *reinterpret_cast<float2*>(S + gq * kMlaTcSs + key) = make_float2(s2[hf][0], s2[hf][1]);
          *reinterpret_cast<float2*>(S + (gq + 8) * kMlaTcSs + key) = make_float2(s2[hf][2], s2[hf][3]);
        }
      }
      __syncthreads();
    }
    // The tile's scores in the accumulator layout: s[nt] holds keys 8nt + 2tq, +1 of heads gq and gq + 8.
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (uniform) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      } else {
        const float2 lo = *reinterpret_cast<const float2*>(S + gq * kMlaTcSs + 8 * nt + 2 * tq);
        const float2 hi = *reinterpret_cast<const float2*>(S + (gq + 8) * kMlaTcSs + 8 * nt + 2 * tq);
        s[nt][0] = lo.x, s[nt][1] = lo.y, s[nt][2] = hi.x, s[nt][3] = hi.y;
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
      lrow[hf] = fmaf(lrow[hf], alpha, sum);
      mrow[hf] = mnew;
#pragma unroll
      for (int nt = 0; nt < 2 * UPW; ++nt) oc[nt][2 * hf] *= alpha, oc[nt][2 * hf + 1] *= alpha;
    }
    if (pv) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // P as a bf16 pair too: hi + lo.
        uint32_t a[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          // Fragment register r: keys 16kk + 8(r/2) + 2tq, +1 of head gq + 8(r%2).
          const float x0 = s[2 * kk + r / 2][2 * (r % 2)], x1 = s[2 * kk + r / 2][2 * (r % 2) + 1];
          const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
          a[r] = *reinterpret_cast<const uint32_t*>(&hi);
          al[r] = pack_bf16(x0 - __low2float(hi), x1 - __high2float(hi));
        }
#pragma unroll
        for (int u = 0; u < UPW; ++u) {
          uint32_t bb[4];
          load_b_kn(bb, Ct + 16 * kk * LS + col0 + 16 * u, LS);
          mma_bf16(oc[2 * u], a, bb[0], bb[1]);
          mma_bf16(oc[2 * u + 1], a, bb[2], bb[3]);
          mma_bf16(oc[2 * u], al, bb[0], bb[1]);
          mma_bf16(oc[2 * u + 1], al, bb[2], bb[3]);
        }
      }
    }
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int64_t h = 16 * hg + gq + 8 * hf;
    if (h >= NH) continue;
    const int64_t row = (b * NH + h) * kMlaSplits + sp;
    if (pv) {
      float* acc = w.acc + row * KL + col0;
#pragma unroll
      for (int nt = 0; nt < 2 * UPW; ++nt)
        *reinterpret_cast<float2*>(acc + 8 * nt + 2 * tq) = make_float2(oc[nt][2 * hf], oc[nt][2 * hf + 1]);
    }
    if (warp == 0 && tq == 0) {
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

void kda_decode_step(const KdaDecodeParams& p, cudaStream_t st) {
  check(p.K >= 1 && p.K <= kKdaMaxK, "CUDA KDA decoding: linear_head_dim must be at most ", kKdaMaxK, ", got ", p.K);
  check(p.W >= 1, "CUDA KDA decoding: conv kernel size must be positive");
  if (!p.B) return;
  const int64_t Kp = (p.K + 31) / 32 * 32, R = (p.K + 31) / 32;
  kda_step_kernel<<<dim3(static_cast<unsigned>(p.B), static_cast<unsigned>(p.H)), static_cast<unsigned>(Kp * R), 0,
                    st>>>(p);
}

void indexer_decode_append(const IndexerDecodeParams& p, cudaStream_t st) {
  if (!p.B) return;
  indexer_append_kernel<<<static_cast<unsigned>(p.B), 128, 0, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void indexer_decode_select(const IndexerDecodeParams& p, int32_t* sel, int32_t* count, int64_t max_sel,
                           cudaStream_t st) {
  if (!p.B) return;
  check(p.ID >= 1 && p.ID <= 128, "CUDA indexer decoding: index_head_dim must be at most 128, got ", p.ID);
  check(p.IH >= 1 && p.P >= 1, "CUDA indexer decoding: bad head count or pool size");
  check(p.max_selectable <= p.max_pools, "indexer decoding: ", p.max_selectable, " pools exceed the capacity ",
        p.max_pools);
  if (p.max_selectable > p.topk / p.P) {
    // 16 pools a block (two per warp) at small batches; fewer, larger blocks when there are many rows, as each block
    // stages the row's queries. The split changes no sum.
    int pools_per_block = 16;
    while (pools_per_block < 128 && p.B * ceil_div(p.max_selectable, pools_per_block) > 2048) pools_per_block *= 2;
    const size_t smem = p.IH * 32 * sizeof(float4) + p.IH * sizeof(float);
    set_smem(reinterpret_cast<const void*>(indexer_scores_kernel), smem);
    const dim3 grid(static_cast<unsigned>(ceil_div(p.max_selectable, pools_per_block)), static_cast<unsigned>(p.B));
    indexer_scores_kernel<<<grid, kScoreWarps * 32, smem, st>>>(p, pools_per_block);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  indexer_select_kernel<<<static_cast<unsigned>(p.B), kSelectThreads, 0, st>>>(p, sel, count, max_sel);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void mla_decode_append(const bf16* lat, const int32_t* slot, const int32_t* pos, bf16* cache, int64_t B, int64_t KL,
                       int64_t max_len, cudaStream_t st) {
  if (!B) return;
  mla_append_kernel<<<static_cast<unsigned>(B), 128, 0, st>>>(lat, slot, pos, cache, KL, max_len);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

int64_t mla_decode_workspace_floats(int64_t B, int64_t NH, int64_t KL) {
  return B * NH * (KL + 2 * kMlaSplits + kMlaSplits * KL);
}

bool mla_decode_tc(int64_t NH, int64_t KL) {
  return NH >= 1 && NH <= 64 && (KL == 32 || KL == 64 || KL == 128 || KL == 256 || KL == 512);
}

namespace {

template <int KL, int kStages>
void launch_split_tc_stages(const MlaDecodeParams& p, const dim3& grid, cudaStream_t st) {
  const int bytes = MlaTcLayout<KL, kStages>::bytes;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(mla_split_tc_kernel<KL, kStages>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const float scale_log2 = 1.4426950408889634f * rsqrtf(static_cast<float>(p.dqk));
  mla_split_tc_kernel<KL, kStages><<<grid, kMlaTcThreads, bytes, st>>>(p, scale_log2);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

// Double-buffered latent tiles while the grid fits one wave (one block per SM); else single-buffered, two blocks
// per SM hiding each other's loads. Both compute the same bits.
template <int KL>
void launch_split_tc(const MlaDecodeParams& p, cudaStream_t st) {
  const int64_t groups = (p.NH + 15) / 16;
  const dim3 grid(static_cast<unsigned>(p.B), kMlaSplits, static_cast<unsigned>(groups));
  if (p.B * kMlaSplits * groups <= sm_count()) {
    launch_split_tc_stages<KL, 2>(p, grid, st);
  } else {
    launch_split_tc_stages<KL, 1>(p, grid, st);
  }
}

template <int RB>
void launch_qa_vec(const MlaDecodeParams& p, cudaStream_t st) {
  const QaTiling t = qa_tiling(p.KL);
  const size_t smem = (RB * p.dqk + static_cast<int64_t>(RB) * t.G * 8 * t.pieces) * sizeof(float);
  constexpr int U = RB == 1 ? 16 : 4;  // weight loads in flight per thread
  set_smem(reinterpret_cast<const void*>(mla_qa_vec_kernel<RB, U>), smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.B, RB)), static_cast<unsigned>(p.NH),
                  static_cast<unsigned>(t.slices));
  mla_qa_vec_kernel<RB, U><<<grid, t.threads, smem, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <int RB>
void launch_combine_vec(const MlaDecodeParams& p, cudaStream_t st) {
  const size_t smem = RB * p.KL * sizeof(float);
  set_smem(reinterpret_cast<const void*>(mla_combine_vec_kernel<RB>), smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.B, RB)), static_cast<unsigned>(p.NH),
                  static_cast<unsigned>(ceil_div(p.dv, kCombineOuts)));
  mla_combine_vec_kernel<RB><<<grid, kMlaThreads, smem, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

namespace {

// The vector path depends on the shapes and the buffers' alignment only, never on B. Rows share the weight loads of
// qa and the combine in groups of 8 from B = 4 on (each row's sums unchanged).
bool mla_vec(const MlaDecodeParams& p) {
  return p.KL > 0 && p.KL % 8 == 0 && p.KL / 8 <= kMlaThreads && aligned16(p.kv_b) && aligned16(p.latent);
}

}  // namespace

void mla_decode_absorb(const MlaDecodeParams& p, cudaStream_t st) {
  if (!p.B || !p.NH || !p.dv) return;
  if (mla_vec(p)) {
    if (p.B >= 4) {
      launch_qa_vec<8>(p, st);
    } else {
      launch_qa_vec<1>(p, st);
    }
  } else {
    const size_t smem = p.dqk * sizeof(float);
    set_smem(reinterpret_cast<const void*>(mla_qa_kernel), smem);
    mla_qa_kernel<<<dim3(static_cast<unsigned>(p.B), static_cast<unsigned>(p.NH)), kMlaThreads, smem, st>>>(p);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
}

void mla_decode_attention(const MlaDecodeParams& p, cudaStream_t st) {
  mla_decode_absorb(p, st);
  mla_decode_attend(p, st);
}

void mla_decode_attend(const MlaDecodeParams& p, cudaStream_t st) {
  if (!p.B || !p.NH || !p.dv) return;
  const bool vec = mla_vec(p);
  const bool grouped = p.B >= 4;
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.NH));
  if (mla_decode_tc(p.NH, p.KL) && aligned16(p.latent)) {
    switch (p.KL) {
      case 32: launch_split_tc<32>(p, st); break;
      case 64: launch_split_tc<64>(p, st); break;
      case 128: launch_split_tc<128>(p, st); break;
      case 256: launch_split_tc<256>(p, st); break;
      default: launch_split_tc<512>(p, st); break;
    }
  } else {
    const size_t part = vec ? 8 * kMlaThreads : 0;
    const size_t smem = (p.KL + p.max_sel / kMlaSplits + 1 + part) * sizeof(float);
    const dim3 split_grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.NH), kMlaSplits);
    auto split_k = vec ? mla_split_kernel<true> : mla_split_kernel<false>;
    set_smem(reinterpret_cast<const void*>(split_k), smem);
    split_k<<<split_grid, kMlaThreads, smem, st>>>(p);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  if (vec) {
    if (grouped) {
      launch_combine_vec<8>(p, st);
    } else {
      launch_combine_vec<1>(p, st);
    }
  } else {
    const size_t smem = p.KL * sizeof(float);
    set_smem(reinterpret_cast<const void*>(mla_combine_kernel), smem);
    mla_combine_kernel<<<grid, kMlaThreads, smem, st>>>(p);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
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
