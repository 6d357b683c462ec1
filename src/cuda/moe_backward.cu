// The element-wise and routing pieces of the training backward on the GPU: the cross-entropy head (head_block of
// src/model/head_backward.cpp), the embedding (embedding_backward), the clamped SwiGLU, the MoE combine / gather
// and the router weights (src/model/moe_backward.cpp). The GEMMs between them are the caller's.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include <cooperative_groups.h>

#include "core/env.h"
#include "cuda/backward_kernels.h"
#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/tma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kXentThreads = 512;  // softmax_xent_kernel: a row's block (fewer, larger blocks: better-filled waves)
constexpr int kXentCluster = 8;                 // softmax_xent_stream_kernel: CTAs a row
constexpr int kXentStreamThreads = 512;         // and threads a CTA (two CTAs an SM)
constexpr int kXentStreamMaxNV = 10;            // float4 of a row a thread holds at most (V up to 163840)
constexpr int64_t kXentStreamMinV = 16384;      // narrower rows take softmax_xent_kernel
constexpr size_t kXentStreamSmem = 80 * 1024;   // a CTA's segment buffer at most (kXentStreamMaxNV float4 a thread)
static_assert(kXentStreamSmem >= size_t{16} * kXentStreamMaxNV * kXentStreamThreads, "the widest segment fits");
EnvSwitch g_xent_stream("NEXTLM_XENT_STREAM");

// Blocks for a grid-stride loop over n items (every kernel below loops, so the grid only has to be big enough).
int grid_for(int64_t n, int per_block = kThreads) {
  return static_cast<int>(std::min<int64_t>(ceil_div(n, per_block), 65535));
}

// ---- Cross-entropy ----

// Merge of two online-softmax states (max m, Σ exp(x − m)); an empty state has m = −inf, s = 0.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;  // both empty
  s = (m == -INFINITY ? 0.0f : s * expf(m - nm)) + (om == -INFINITY ? 0.0f : os * expf(om - nm));
  m = nm;
}

// One online-softmax step: the state (m, s) takes x.
__device__ __forceinline__ void softmax_take(float& m, float& s, float x) {
  if (x > m) {
    s = (m == -INFINITY ? 0.0f : s * expf(m - x)) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

// p = exp(x − m)·inv as the gradient of the row's term, wt·(p − onehot(target)), in bf16.
__device__ __forceinline__ bf16 xent_grad(float x, int64_t v, int32_t tg, float m, float inv, float w) {
  const float p = expf(x - m) * inv;
  return __float2bfloat16(w * (v == tg ? p - 1.0f : p));
}

// One block per row (grid-stride over rows): an online max / sum pass over V, then p = exp(x − max)/sum written as
// wt·(p − onehot) in bf16. The log-sum-exp and the loss are formed in double, as the CPU's. The rows are far larger
// than the caches, so both passes stream from memory: with V a multiple of 4 (16-byte aligned rows) a thread reads
// four logits at once and keeps four online states (element v mod 4 → state v mod 4), merged in state order, and
// writes four gradients at once; otherwise one logit at a time into state 0.
__global__ void __launch_bounds__(kXentThreads) softmax_xent_kernel(const float* logits, const int32_t* target,
                                                                    const float* wt, double* loss, bf16* dlogits,
                                                                    int64_t n, int64_t V) {
  __shared__ float sm[32], ss[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const bool vec = V % 4 == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(dlogits) & 7) == 0;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* row = logits + r * V;
    bf16* drow = dlogits + r * V;
    const int32_t tg = target[r];
    const float w = tg >= 0 && wt ? wt[r] : 1.0f;
    if (tg < 0 || w == 0.0f) {  // no term (the CPU skips rows of weight 0 too)
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) drow[v] = __float2bfloat16(0.0f);
      if (threadIdx.x == 0) loss[r] = 0.0;
      continue;
    }
    float m4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (vec) {
      const float4* row4 = reinterpret_cast<const float4*>(row);
      for (int64_t v = threadIdx.x; v < V / 4; v += blockDim.x) {
        const float4 x = row4[v];
        softmax_take(m4[0], s4[0], x.x), softmax_take(m4[1], s4[1], x.y);
        softmax_take(m4[2], s4[2], x.z), softmax_take(m4[3], s4[3], x.w);
      }
    } else {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) softmax_take(m4[0], s4[0], row[v]);
    }
    float m = m4[0], s = s4[0];
#pragma unroll
    for (int i = 1; i < 4; ++i) softmax_merge(m, s, m4[i], s4[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
      softmax_merge(m, s, om, os);
    }
    __syncthreads();  // the previous row's readers of sm / ss are done
    if (lane == 0) sm[warp] = m, ss[warp] = s;
    __syncthreads();
    m = -INFINITY, s = 0.0f;
    for (int i = 0; i < nwarps; ++i) softmax_merge(m, s, sm[i], ss[i]);  // same order in every thread
    const float inv = 1.0f / s;
    if (vec) {
      const float4* row4 = reinterpret_cast<const float4*>(row);
      for (int64_t v = threadIdx.x; v < V / 4; v += blockDim.x) {
        const float4 x = row4[v];
        const int64_t c = 4 * v;
        __align__(8) bf16 g[4] = {xent_grad(x.x, c, tg, m, inv, w), xent_grad(x.y, c + 1, tg, m, inv, w),
                                  xent_grad(x.z, c + 2, tg, m, inv, w), xent_grad(x.w, c + 3, tg, m, inv, w)};
        *reinterpret_cast<uint2*>(drow + c) = *reinterpret_cast<const uint2*>(g);
      }
    } else {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) drow[v] = xent_grad(row[v], v, tg, m, inv, w);
    }
    if (threadIdx.x == 0) {
      const double lse = static_cast<double>(m) + log(static_cast<double>(s));
      loss[r] = static_cast<double>(w) * (lse - static_cast<double>(row[tg]));
    }
  }
}

constexpr float kLog2e = 1.4426950408889634f;  // exp(x − m) = exp2_ftz(x·log2 e − m·log2 e)

// The online-softmax states (max m, Σ exp(x − m)) of a warp's lanes merged by butterflies: the max first, then each
// lane's sum brought to it and added. Every lane ends with the same bits, and every warp that merges the same states
// does so in the same order.
__device__ __forceinline__ void warp_state_merge(float& m, float& s) {
  const float mx = warp_max(m);
  s = warp_sum(m == -INFINITY ? 0.0f : s * exp2_ftz((m - mx) * kLog2e));  // an empty state adds nothing
  m = mx;
}

// The same terms with each row cut into kXentCluster segments of seg floats (a multiple of 4), one for each CTA of
// a thread-block cluster, so that every logit is read from memory once (softmax_xent_kernel reads each row twice:
// the rows are far larger than the caches) and takes one exponential. The grid is persistent: cluster c takes rows
// c, c + clusters, …, and each CTA streams its segments of them into a shared-memory buffer by bulk copies
// (cp.async.bulk, L2 evict_first). A thread takes its NV float4 of the segment into registers at once, and the
// buffer then takes the next row's segment while this one is reduced, merged and written; two CTAs an SM keep each
// other's copies in flight meanwhile (on an H100 against two buffers at one CTA of 1024 threads an SM: 0.70 against
// 0.82 ms for 2048 rows of 154880). A thread forms its elements' max m_t and e = exp(x − m_t) in place (ex2.approx),
// and the states (max, Σe) are merged by butterflies: the warp's lanes, the CTA's warps (every warp alike, from
// shared memory), the cluster's CTAs (every warp alike, through distributed shared memory), so that every thread of
// the cluster holds the same M and S; the gradient is e·exp(m_t − M)/S. Rows without a term are loaded too (the
// CTAs decide alike and skip the merge). Needs V a multiple of 4, 16-byte aligned logits, 8-byte aligned dlogits
// and seg ≤ 4·NV·kXentStreamThreads (softmax_xent_backward checks); a CTA whose segment lies past V, and a thread
// past its segment, hold an empty state.
template <int NV>
__global__ void __cluster_dims__(kXentCluster, 1, 1) __launch_bounds__(kXentStreamThreads, 2)
    softmax_xent_stream_kernel(const float* logits, const int32_t* target, const float* wt, double* loss,
                               bf16* dlogits, int64_t n, int64_t V, int64_t seg) {
  constexpr int NT = kXentStreamThreads, NW = NT / 32;
  static_assert(NW <= 32 && kXentCluster <= 32, "a warp's lanes merge the CTA's warps and the cluster's CTAs");
  extern __shared__ __align__(128) float4 xbuf[];  // [seg / 4]: this CTA's segment of the next row
  __shared__ __align__(8) uint64_t full;           // the buffer's copy has landed
  __shared__ float2 wstate[2][NW];                 // the warps' states of a row (alternate rows, alternate slots)
  __shared__ float2 part[2];  // the CTA's state of a row, read by the whole cluster (alternate merges, alternate slots)
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t start = static_cast<int64_t>(cluster.block_rank()) * seg;
  const int64_t c0 = start < V ? start : V, c1 = c0 + seg < V ? c0 + seg : V;  // this CTA's columns
  const int nv4 = static_cast<int>((c1 - c0) / 4);
  const uint32_t bytes = 16u * static_cast<uint32_t>(nv4);
  const bool lead = cluster.block_rank() == 0 && threadIdx.x == 0;  // writes the loss
  const int64_t cid = blockIdx.x / kXentCluster, clusters = gridDim.x / kXentCluster;
  const uint32_t full_s = smem_addr(&full), buf_s = smem_addr(xbuf);
  if (threadIdx.x == 0) {
    mbar_init(full_s, 1);
    mbar_init_fence();
  }
  __syncthreads();
  // Row r's segment into the buffer (thread 0).
  const auto issue = [&](int64_t r) {
    mbar_arrive_expect_tx(full_s, bytes);
    if (bytes) bulk_load(buf_s, logits + r * V + c0, bytes, full_s, l2_policy_evict_first());
  };
  if (threadIdx.x == 0 && cid < n) issue(cid);
  int slot = 0;  // flips on every row the cluster merges (the skipped rows have no merge)
  int i = 0;     // this cluster's rows so far: row i is the buffer's i-th copy
  for (int64_t r = cid; r < n; r += clusters, ++i) {
    mbar_wait(full_s, i & 1);
    float4 x[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int v = static_cast<int>(threadIdx.x) + j * NT;
      x[j] = v < nv4 ? xbuf[v] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    }
    __syncthreads();  // every thread holds its part: the buffer takes the next row
    if (threadIdx.x == 0 && r + clusters < n) issue(r + clusters);
    bf16* drow = dlogits + r * V + c0;
    const int32_t tg = target[r];
    const float w = tg >= 0 && wt ? wt[r] : 1.0f;
    if (tg < 0 || w == 0.0f) {  // no term; the same decision in every CTA of the cluster
      for (int v = threadIdx.x; v < nv4; v += NT) *reinterpret_cast<uint2*>(drow + 4 * v) = make_uint2(0u, 0u);
      if (lead) loss[r] = 0.0;
      continue;
    }
    float mt = -INFINITY;
#pragma unroll
    for (int j = 0; j < NV; ++j) mt = fmaxf(mt, fmaxf(fmaxf(x[j].x, x[j].y), fmaxf(x[j].z, x[j].w)));
    float st = 0.0f;
    const float base = mt == -INFINITY ? 0.0f : mt * kLog2e;  // an empty state's e are exp2_ftz(−inf) = 0
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      x[j].x = exp2_ftz(fmaf(x[j].x, kLog2e, -base)), x[j].y = exp2_ftz(fmaf(x[j].y, kLog2e, -base));
      x[j].z = exp2_ftz(fmaf(x[j].z, kLog2e, -base)), x[j].w = exp2_ftz(fmaf(x[j].w, kLog2e, -base));
      st += (x[j].x + x[j].y) + (x[j].z + x[j].w);
    }
    float m = mt, s = st;
    warp_state_merge(m, s);
    if (lane == 0) wstate[slot][warp] = make_float2(m, s);
    __syncthreads();
    // Every warp merges the CTA's warps alike; warp 0 publishes the CTA's state. A slot of wstate and part is written
    // again two merges later, after the barriers of the merge between, which every thread reaches only once it has
    // read this one.
    {
      const float2 o = lane < NW ? wstate[slot][lane] : make_float2(-INFINITY, 0.0f);
      m = o.x, s = o.y;
      warp_state_merge(m, s);
    }
    if (threadIdx.x == 0) part[slot] = make_float2(m, s);
    cluster.sync();
    {
      float2 o = make_float2(-INFINITY, 0.0f);
      if (lane < kXentCluster) o = *cluster.map_shared_rank(&part[slot], static_cast<unsigned>(lane));
      m = o.x, s = o.y;
      warp_state_merge(m, s);  // the lanes past the cluster's CTAs hold empty states
    }
    slot ^= 1;
    const float f = mt == -INFINITY ? 0.0f : exp2_ftz((mt - m) * kLog2e) / s;  // p = e·f
    const float wf = w * f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int v = static_cast<int>(threadIdx.x) + j * NT;
      if (v >= nv4) break;
      const int64_t c = c0 + 4 * v;
      __nv_bfloat162 g01 = __floats2bfloat162_rn(wf * x[j].x, wf * x[j].y);
      __nv_bfloat162 g23 = __floats2bfloat162_rn(wf * x[j].z, wf * x[j].w);
      if (tg >= c && tg < c + 4) {  // the target's term: w·(p − 1)
        __align__(8) bf16 g[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float p = (k == 0 ? x[j].x : k == 1 ? x[j].y : k == 2 ? x[j].z : x[j].w) * f;
          g[k] = __float2bfloat16(w * (c + k == tg ? p - 1.0f : p));
        }
        g01 = __halves2bfloat162(g[0], g[1]), g23 = __halves2bfloat162(g[2], g[3]);
      }
      *reinterpret_cast<uint2*>(drow + 4 * v) =
          make_uint2(*reinterpret_cast<uint32_t*>(&g01), *reinterpret_cast<uint32_t*>(&g23));
    }
    if (lead) {
      const double lse = static_cast<double>(m) + log(static_cast<double>(s));
      loss[r] = static_cast<double>(w) * (lse - static_cast<double>(logits[r * V + tg]));
    }
  }
  cluster.sync();  // no CTA leaves while another may still read its states
}

// ---- Embedding ----

// Blocks over tokens (grid-stride), threads over D: the S streams are summed here, then added with atomics, since
// a token repeated in the batch adds into the same row from several blocks.
__global__ void embedding_backward_kernel(const int32_t* tok, const float* dh, float* dembed, int64_t T, int64_t S,
                                          int64_t D, int64_t pad_id) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = tok[t];
    if (id == pad_id) continue;  // pad_id < 0 never matches a token
    float* dst = dembed + id * D;
    const float* src = dh + t * S * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc += src[s * D + d];
      atomicAdd(dst + d, acc);
    }
  }
}

// ---- Clamped SwiGLU: act = silu(min(g, L))·clamp(u, −L, L) ----

// dgate and dup of one element. The min / clamp pass the gradient at exactly ±L (torch.clamp's convention), and also
// where g or u is NaN the comparisons fail and give 0, as the CPU's.
__device__ __forceinline__ void swiglu_grad(float g, float u, float da, float L, bf16& dg, bf16& du) {
  const float gc = fminf(g, L), uc = fminf(fmaxf(u, -L), L);
  const float sg = 1.0f / (1.0f + expf(-gc));
  dg = __float2bfloat16(g <= L ? da * uc * (sg * (1.0f + gc * (1.0f - sg))) : 0.0f);
  du = __float2bfloat16((u >= -L && u <= L) ? da * (gc * sg) : 0.0f);
}

// An element, and four consecutive elements at p (16-byte aligned for fp32, 8-byte for bf16), widened to fp32.
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const bf16* p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}

// Blocks over rows (grid-stride), threads over a row's columns; G and A are the element types of gu and dact (fp32
// or bf16, widened on load: the same arithmetic). VEC (I a multiple of 4, gu and dact 16-byte aligned, dgu 8-byte
// aligned): four columns at a time, one load each of gate, up and dact and 8-byte stores.
template <class G, class A, bool VEC>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(const G* gu, const A* dact, bf16* dgu, int64_t n,
                                                                   int64_t I, float L, const int32_t* rows_held) {
  const int64_t held = rows_held ? *rows_held : n;
  constexpr int W = VEC ? 4 : 1;
  const int cols = static_cast<int>(I / W);
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const G* g_row = gu + r * 2 * I;
    const A* da_row = dact + r * I;
    bf16* dg_row = dgu + r * 2 * I;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      if constexpr (VEC) {
        __align__(8) bf16 dg[4], du[4];
        if (r >= held) {  // another rank's row: its gu was never computed here
          for (int j = 0; j < 4; ++j) dg[j] = du[j] = __float2bfloat16(0.0f);
        } else {
          const float4 g = load4(g_row + 4 * c), u = load4(g_row + I + 4 * c), da = load4(da_row + 4 * c);
          swiglu_grad(g.x, u.x, da.x, L, dg[0], du[0]);
          swiglu_grad(g.y, u.y, da.y, L, dg[1], du[1]);
          swiglu_grad(g.z, u.z, da.z, L, dg[2], du[2]);
          swiglu_grad(g.w, u.w, da.w, L, dg[3], du[3]);
        }
        reinterpret_cast<uint2*>(dg_row)[c] = *reinterpret_cast<const uint2*>(dg);
        reinterpret_cast<uint2*>(dg_row + I)[c] = *reinterpret_cast<const uint2*>(du);
      } else {
        bf16 dg = __float2bfloat16(0.0f), du = dg;
        if (r < held) swiglu_grad(widen(g_row[c]), widen(g_row[I + c]), widen(da_row[c]), L, dg, du);
        dg_row[c] = dg;
        dg_row[I + c] = du;
      }
    }
  }
}

// ---- MoE combine / gather ----

// One warp per (token, choice): the scaled gradient of its permuted output row. VEC (D a multiple of 4, dy 16-byte
// aligned, dout 8-byte aligned): each lane takes four consecutive elements at a time.
template <bool VEC>
__global__ void moe_combine_backward_kernel(const float* dy, const int32_t* slot_of, const float* weights, bf16* dout,
                                            int64_t T, int64_t k, int64_t D) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t j = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; j < T * k; j += warps) {
    const int64_t t = j / k, p = slot_of[j];
    const float w = weights[j];
    const float* g = dy + t * D;
    bf16* dst = dout + p * D;
    if constexpr (VEC) {
      for (int64_t d = 4 * lane; d < D; d += 128) {
        const float4 g4 = *reinterpret_cast<const float4*>(g + d);
        const __nv_bfloat162 a = __floats2bfloat162_rn(w * g4.x, w * g4.y);
        const __nv_bfloat162 b = __floats2bfloat162_rn(w * g4.z, w * g4.w);
        uint2 u;
        u.x = *reinterpret_cast<const uint32_t*>(&a);
        u.y = *reinterpret_cast<const uint32_t*>(&b);
        *reinterpret_cast<uint2*>(dst + d) = u;
      }
    } else {
      for (int64_t d = lane; d < D; d += 32) dst[d] = __float2bfloat16(w * g[d]);
    }
  }
}

// One warp per (token, choice) j, slot p = slot_of[j]: dweights[j] = act[p]·dact[p] / w[j], in a fixed order (zero
// where w[j] is zero, or where p is another rank's row: p ≥ *rows_held). VEC (I a multiple of 8, act 16-byte and
// dact 32-byte aligned rows): eight elements a lane at a time.
template <class A, bool VEC>
__global__ void moe_weights_backward_kernel(const bf16* act, const A* dact, const int32_t* slot_of,
                                            const float* weights, float* dweights, int64_t T, int64_t k, int64_t I,
                                            const int32_t* rows_held) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  const int64_t held = rows_held ? *rows_held : T * k;
  for (int64_t j = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; j < T * k; j += warps) {
    const int64_t p = slot_of[j];
    const float w = weights[j];
    if (p >= held || w == 0.0f) {
      if (lane == 0) dweights[j] = 0.0f;
      continue;
    }
    const bf16* a = act + p * I;
    const A* g = dact + p * I;
    float acc = 0.0f;
    if constexpr (VEC) {
      for (int64_t c = 8 * lane; c < I; c += 256) {
        const uint4 a8 = *reinterpret_cast<const uint4*>(a + c);
        const float4 g0 = load4(g + c), g1 = load4(g + c + 4);
        const uint32_t w4[4] = {a8.x, a8.y, a8.z, a8.w};
        const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc = fmaf(__uint_as_float(w4[q] << 16), gv[2 * q], acc);
          acc = fmaf(__uint_as_float(w4[q] & 0xffff0000u), gv[2 * q + 1], acc);
        }
      }
    } else {
      for (int64_t c = lane; c < I; c += 32) acc = fmaf(__bfloat162float(a[c]), widen(g[c]), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) dweights[j] = acc / w;
  }
}

// A block a token (grid-stride), threads over its columns, each sum in choice order. VEC (D a multiple of 4, dxp and
// dx 16-byte aligned for fp32 dxp, 8-byte for bf16): four columns a thread at a time.
template <class P, bool VEC>
__global__ void moe_gather_backward_kernel(const P* dxp, const int32_t* slot_of, float* dx, int64_t T, int64_t k,
                                           int64_t D) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    if constexpr (VEC) {
      for (int64_t d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int64_t i = 0; i < k; ++i) {
          const float4 v = load4(dxp + static_cast<int64_t>(slot_of[t * k + i]) * D + d);
          acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
        }
        float4& o = *reinterpret_cast<float4*>(dx + t * D + d);
        o.x += acc.x, o.y += acc.y, o.z += acc.z, o.w += acc.w;
      }
    } else {
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int64_t i = 0; i < k; ++i) acc += widen(dxp[static_cast<int64_t>(slot_of[t * k + i]) * D + d]);
        dx[t * D + d] += acc;
      }
    }
  }
}

// ---- Router weights ----

// One warp per token. Every lane forms Σ s and Σ dweights·s over the k choices in choice order (the CPU's
// router_backward), then writes the columns e ≡ lane (mod 32) of the dlogits row: the sum over the choices equal to
// e (zero when none), so a full row is written without a separate zeroing pass.
__global__ void moe_route_backward_kernel(const float* logits, const int32_t* experts, const float* dweights,
                                          float* dlogits, int64_t T, int64_t E, int64_t k, bool norm, float scale) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; t < T; t += warps) {
    const float* lg = logits + t * E;
    const int32_t* ex = experts + t * k;
    const float* dw = dweights + t * k;
    float sum = 0.0f, wdot = 0.0f;
    for (int64_t i = 0; i < k; ++i) {
      const float se = 1.0f / (1.0f + expf(-lg[ex[i]]));
      sum += se;
      wdot += dw[i] * se;
    }
    const float Z = sum + 1e-20f;  // as route_forward's normalisation
    for (int64_t e = lane; e < E; e += 32) {
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) {
        if (ex[i] != e) continue;
        const float se = 1.0f / (1.0f + expf(-lg[e]));
        const float ds = norm ? scale * (dw[i] / Z - wdot / (Z * Z)) : scale * dw[i];
        acc += ds * se * (1.0f - se);
      }
      dlogits[t * E + e] = acc;
    }
  }
}

}  // namespace

namespace {

// softmax_xent_stream_kernel<NV> on a persistent grid of the clusters that fit at once (found per device and NV).
template <int NV>
void launch_xent_stream(const float* logits, const int32_t* target, const float* wt, double* loss, bf16* dlogits,
                        int64_t n, int64_t V, int64_t seg, cudaStream_t st) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> resident[kMaxDevices];
  int dev = 0;
  NEXTLM_CUDA_CHECK(cudaGetDevice(&dev));
  check(dev >= 0 && dev < kMaxDevices, "softmax_xent_backward: device ordinal ", dev, " out of range");
  const auto kernel = softmax_xent_stream_kernel<NV>;
  const size_t smem = static_cast<size_t>(seg) * sizeof(float);
  // The attribute covers the largest buffer any call takes, so that it is set once (graph captures make no calls).
  int clusters = resident[dev].load(std::memory_order_relaxed);
  if (!clusters) {
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kXentStreamSmem)));
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(kXentCluster * std::max(1, sm_count() / kXentCluster)));
    cfg.blockDim = dim3(kXentStreamThreads);
    cfg.dynamicSmemBytes = kXentStreamSmem;
    NEXTLM_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    check(clusters >= 1, "softmax_xent_backward: clusters of ", kXentCluster, " CTAs do not fit on this device");
    resident[dev].store(clusters, std::memory_order_relaxed);
  }
  const int64_t grid = kXentCluster * std::min<int64_t>(n, clusters);
  kernel<<<static_cast<unsigned>(grid), kXentStreamThreads, smem, st>>>(logits, target, wt, loss, dlogits, n, V, seg);
}

}  // namespace

void set_xent_stream(bool on) { g_xent_stream.set(on); }
bool xent_stream() { return g_xent_stream.on(); }

void softmax_xent_backward(const float* logits, const int32_t* target, const float* wt, double* loss, bf16* dlogits,
                           int64_t n, int64_t V, cudaStream_t st) {
  if (n <= 0) return;
  check(V > 0, "softmax_xent_backward: V must be positive");
  // Wide rows (a vocabulary) of up to kXentStreamMaxNV float4 a thread: one read of each logit.
  const int64_t seg = 4 * ceil_div(ceil_div(V, kXentCluster), 4);
  const int64_t per_thread = ceil_div(seg / 4, kXentStreamThreads);  // float4 a thread
  if (xent_stream() && V >= kXentStreamMinV && V % 4 == 0 && is_aligned16(logits) &&
      reinterpret_cast<uintptr_t>(dlogits) % 8 == 0 && per_thread <= kXentStreamMaxNV) {
    if (per_thread <= 4) launch_xent_stream<4>(logits, target, wt, loss, dlogits, n, V, seg, st);
    else launch_xent_stream<kXentStreamMaxNV>(logits, target, wt, loss, dlogits, n, V, seg, st);  // V 154880
  } else {
    softmax_xent_kernel<<<static_cast<int>(std::min<int64_t>(n, 65535)), kXentThreads, 0, st>>>(logits, target, wt,
                                                                                                loss, dlogits, n, V);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void embedding_backward(const int32_t* tok, const float* dh, float* dembed, int64_t T, int64_t S, int64_t D,
                        int64_t pad_id, cudaStream_t st) {
  if (T <= 0 || D <= 0) return;
  embedding_backward_kernel<<<static_cast<int>(std::min<int64_t>(T, 65535)), kThreads, 0, st>>>(tok, dh, dembed, T, S,
                                                                                                D, pad_id);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <class G, class A>
void swiglu_backward(const G* gu, const A* dact, bf16* dgu, int64_t n, int64_t I, float limit, cudaStream_t st,
                     const int32_t* rows_held) {
  if (n * I <= 0) return;
  const bool vec = I % 4 == 0 && reinterpret_cast<uintptr_t>(gu) % (4 * sizeof(G)) == 0 &&
                   reinterpret_cast<uintptr_t>(dact) % (4 * sizeof(A)) == 0 &&
                   reinterpret_cast<uintptr_t>(dgu) % 8 == 0;
  const int grid = static_cast<int>(std::min<int64_t>(n, 65535));
  if (vec) swiglu_backward_kernel<G, A, true><<<grid, kThreads, 0, st>>>(gu, dact, dgu, n, I, limit, rows_held);
  else swiglu_backward_kernel<G, A, false><<<grid, kThreads, 0, st>>>(gu, dact, dgu, n, I, limit, rows_held);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}
template void swiglu_backward(const float*, const float*, bf16*, int64_t, int64_t, float, cudaStream_t,
                              const int32_t*);
template void swiglu_backward(const bf16*, const float*, bf16*, int64_t, int64_t, float, cudaStream_t,
                              const int32_t*);
template void swiglu_backward(const float*, const bf16*, bf16*, int64_t, int64_t, float, cudaStream_t,
                              const int32_t*);
template void swiglu_backward(const bf16*, const bf16*, bf16*, int64_t, int64_t, float, cudaStream_t,
                              const int32_t*);

void moe_combine_backward(const float* dy, const int32_t* slot_of, const float* weights, bf16* dout, int64_t T,
                          int64_t k, int64_t D, cudaStream_t st) {
  if (T * k <= 0) return;
  const bool vec =
      D % 4 == 0 && reinterpret_cast<uintptr_t>(dy) % 16 == 0 && reinterpret_cast<uintptr_t>(dout) % 8 == 0;
  const int grid = grid_for(T * k, kThreads / 32);
  if (vec)
    moe_combine_backward_kernel<true><<<grid, kThreads, 0, st>>>(dy, slot_of, weights, dout, T, k, D);
  else
    moe_combine_backward_kernel<false><<<grid, kThreads, 0, st>>>(dy, slot_of, weights, dout, T, k, D);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <class A>
void moe_weights_backward(const bf16* act, const A* dact, const int32_t* slot_of, const float* weights,
                          float* dweights, int64_t T, int64_t k, int64_t I, cudaStream_t st,
                          const int32_t* rows_held) {
  if (T * k <= 0) return;
  const bool vec = I % 8 == 0 && reinterpret_cast<uintptr_t>(act) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dact) % (8 * sizeof(A)) == 0;
  const int grid = grid_for(T * k, kThreads / 32);
  if (vec)
    moe_weights_backward_kernel<A, true><<<grid, kThreads, 0, st>>>(act, dact, slot_of, weights, dweights, T, k, I,
                                                                    rows_held);
  else
    moe_weights_backward_kernel<A, false><<<grid, kThreads, 0, st>>>(act, dact, slot_of, weights, dweights, T, k, I,
                                                                     rows_held);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}
template void moe_weights_backward(const bf16*, const float*, const int32_t*, const float*, float*, int64_t, int64_t,
                                   int64_t, cudaStream_t, const int32_t*);
template void moe_weights_backward(const bf16*, const bf16*, const int32_t*, const float*, float*, int64_t, int64_t,
                                   int64_t, cudaStream_t, const int32_t*);

template <class P>
void moe_gather_backward(const P* dxp, const int32_t* slot_of, float* dx, int64_t T, int64_t k, int64_t D,
                         cudaStream_t st) {
  if (T <= 0 || D <= 0) return;
  const bool vec = D % 4 == 0 && reinterpret_cast<uintptr_t>(dxp) % (4 * sizeof(P)) == 0 &&
                   reinterpret_cast<uintptr_t>(dx) % 16 == 0;
  const int grid = static_cast<int>(std::min<int64_t>(T, 65535));
  if (vec) moe_gather_backward_kernel<P, true><<<grid, kThreads, 0, st>>>(dxp, slot_of, dx, T, k, D);
  else moe_gather_backward_kernel<P, false><<<grid, kThreads, 0, st>>>(dxp, slot_of, dx, T, k, D);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}
template void moe_gather_backward(const float*, const int32_t*, float*, int64_t, int64_t, int64_t, cudaStream_t);
template void moe_gather_backward(const bf16*, const int32_t*, float*, int64_t, int64_t, int64_t, cudaStream_t);

void moe_route_backward(const float* logits, const int32_t* experts, const float* dweights, float* dlogits,
                        int64_t T, int64_t E, int64_t k, bool norm, float scale, cudaStream_t st) {
  if (T <= 0 || E <= 0) return;
  moe_route_backward_kernel<<<grid_for(T, kThreads / 32), kThreads, 0, st>>>(logits, experts, dweights, dlogits, T, E,
                                                                             k, norm, scale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}



}  // namespace nextlm::cuda
