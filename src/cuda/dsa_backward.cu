// Backward of the MLA attention over the DSA selection (mla_sparse_attention of dsa.cu) in fp32, flash-attention-2
// style with the selection as a mask: the softmax is recomputed from q and kv on tiles of 64 queries × 32 keys of one
// head, and every (query, key) pair of a tile is masked by the query's selection, kept as a bitmask over its
// sequence's positions (as mla_tc.cu). Matches the attention part of dsa_layer_backward (src/model/dsa_backward.cpp).
//
// With s = scale·q·k (0 for every key of an empty selection: uniform weights over keys s0 … s0+len−1, as the forward
// and the CPU), p = exp(s − lse), dp = do·v, D = Σ_j p_j·dp_j, ds = p·(dp − D)·scale:
//   1. build: the bitmask, and which (query tile, key tile) pairs hold any selected pair, both ways round;
//   2. stats (query-major): lse and D per (query, head), by an online softmax over the query tile's key tiles;
//   3. dq (query-major): dq_i += Σ_j ds_ij·k_j, summed in registers over the key tiles in order;
//   4. dkv (key-major): dk_j += Σ_i ds_ij·q_i, dv_j += Σ_i p_ij·do_i, summed in registers over the query tiles.
// Every output element is added once, by one thread, after sums in a fixed order: the result is reproducible.
// The cost follows the (query tile, key tile) pairs that hold any selected pair: for selections spread over the
// whole past (random top-k) that is every causal tile pair, i.e. the dense causal cost at long T.
// Keys are assumed to lie inside their query's packed sequence, and a selection to hold no key twice.
#include <algorithm>

#include "cuda/backward_kernels.h"
#include "cuda/mla_mask.cuh"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kQ = 64, kK = 32, kThreads = 256;
constexpr int kMaxW4 = 512, kMaxDqk4 = 256;  // register tiles: 8 column slots of 64 (dkv), 4 (dq)
constexpr int kMaxTileWords = 1024;          // key-tile bitmap of a query tile in shared memory: T ≤ 2^20

// Head dims, each padded to a multiple of 4 in shared memory (zeros), and the row stride of the staged tiles: an odd
// number of 16-byte units, so eight rows read by float4 fall in distinct banks. vec: every row of q, kv, do starts
// on 16 bytes (no padding), so tiles are staged by 16-byte asynchronous copies.
struct Dims {
  int dqk, dv, dqk4, dv4, w4, stride;
  bool vec;
};

// Rows r0 … r0+n−1 of two row-major arrays a [·, na] | b [·, nb] (row index ·NH + h) into tile rows [a pad | b pad].
// Complete (for this thread) on return; the caller's barrier makes the tile visible.
__device__ __forceinline__ void stage(float* tile, int n, const float* a, int64_t lda, const float* b, int64_t ldb,
                                      int64_t r0, int64_t T, int64_t NH, int64_t h, const Dims& d) {
  if (d.vec) {
    // All copies in flight at once: the tile's load costs one memory latency, not one per row.
    const int n4 = d.w4 / 4;
    for (int idx = threadIdx.x; idx < n * n4; idx += kThreads) {
      const int r = idx / n4, c = 4 * (idx - r * n4);
      const int64_t t = r0 + r, row = t * NH + h;
      const bool in = t < T;
      const float* src = !in ? a : c < d.dqk ? a + row * lda + c : b + row * ldb + (c - d.dqk);
      cp_async16(tile + r * d.stride + c, src, in);
    }
    cp_async_commit();
    cp_async_wait<0>();
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < n; r += kThreads / 32) {
    const int64_t t = r0 + r;
    const int64_t row = (t * NH + h);
    for (int c = lane; c < d.w4; c += 32) {
      float v = 0.0f;
      if (t < T) {
        if (c < d.dqk4) {
          if (c < d.dqk) v = a[row * lda + c];
        } else if (c - d.dqk4 < d.dv) {
          v = b[row * ldb + (c - d.dqk4)];
        }
      }
      tile[r * d.stride + c] = v;
    }
  }
}

// Bits p … p+31 of a row of `words` 32-bit words (0 outside the row); p may be negative.
__device__ __forceinline__ uint32_t window32(const uint32_t* row, int64_t words, int64_t p) {
  const int64_t q = p >> 5;  // floor division, also for negative p
  const int r = static_cast<int>(p & 31);
  auto get = [&](int64_t i) -> uint64_t { return i >= 0 && i < words ? row[i] : 0u; };
  return static_cast<uint32_t>((get(q) | (get(q + 1) << 32)) >> r);
}

// Bits for positions p … p+31 that fall in [0, len).
__device__ __forceinline__ uint32_t range32(int64_t p, int64_t len) {
  const int64_t a = p < 0 ? -p : 0, b = len - p;  // in-window bit range [a, min(b, 32))
  if (b <= a || a >= 32) return 0;
  const uint64_t hi = b >= 32 ? 0xffffffffull : ((1ull << b) - 1);
  return static_cast<uint32_t>(hi & ~((1ull << a) - 1));
}

// One query's keys among j0 … j0+31.
struct QueryInfo {
  int64_t t, s0, len;
  bool valid, uniform;
  __device__ void load(int64_t t_, int64_t T, const int32_t* count, const int32_t* seq_start, const int32_t* seq_len) {
    t = t_;
    valid = t < T;
    s0 = valid ? seq_start[t] : 0;
    len = valid ? seq_len[t] : 0;
    uniform = valid && count[t] == 0;
  }
  __device__ uint32_t bits(int64_t j0, int64_t T, const uint32_t* mask, int64_t words) const {
    if (!valid) return 0;
    const uint32_t b = uniform ? range32(j0 - s0, len) : window32(mask + t * words, words, j0 - s0);
    return T - j0 >= 32 ? b : b & ((1u << (T - j0)) - 1);
  }
};

// Scores and dp of this thread's 4 queries × 2 keys of the tile: queries 4·(tid/16) + a, keys tid%16 + 16·b.
__device__ __forceinline__ void scores(const float* X, const float* Y, const Dims& d, float s[4][2], float g[4][2]) {
  const int tq = threadIdx.x >> 4, tk = threadIdx.x & 15;
  const float* x = X + 4 * tq * d.stride;
  const float* y = Y + tk * d.stride;
#pragma unroll
  for (int a = 0; a < 4; ++a) s[a][0] = s[a][1] = g[a][0] = g[a][1] = 0.0f;
  for (int c = 0; c < d.dqk4; c += 4) {
    float4 xa[4], yb[2];
#pragma unroll
    for (int a = 0; a < 4; ++a) xa[a] = *reinterpret_cast<const float4*>(x + a * d.stride + c);
#pragma unroll
    for (int b = 0; b < 2; ++b) yb[b] = *reinterpret_cast<const float4*>(y + 16 * b * d.stride + c);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
        s[a][b] = fmaf(xa[a].x, yb[b].x,
                       fmaf(xa[a].y, yb[b].y, fmaf(xa[a].z, yb[b].z, fmaf(xa[a].w, yb[b].w, s[a][b]))));
  }
  for (int c = d.dqk4; c < d.w4; c += 4) {
    float4 xa[4], yb[2];
#pragma unroll
    for (int a = 0; a < 4; ++a) xa[a] = *reinterpret_cast<const float4*>(x + a * d.stride + c);
#pragma unroll
    for (int b = 0; b < 2; ++b) yb[b] = *reinterpret_cast<const float4*>(y + 16 * b * d.stride + c);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
        g[a][b] = fmaf(xa[a].x, yb[b].x,
                       fmaf(xa[a].y, yb[b].y, fmaf(xa[a].z, yb[b].z, fmaf(xa[a].w, yb[b].w, g[a][b]))));
  }
}

// The logit of a selected pair: scale·q·k, or 0 in a uniform row (its weights ignore the scores).
__device__ __forceinline__ float logit(float s, bool uniform, float scale) { return uniform ? 0.0f : s * scale; }

// Shared memory of the three tile kernels: the query tile X [kQ][stride] (q | do), the key tile Y [kK][stride]
// (k | v), two kQ × kK float tiles (p and ds), and per query of the tile lse, D, its key bits and uniform flag.
struct Smem {
  float *X, *Y, *P, *S, *lse, *D;
  uint32_t* bits;
  int* uni;
  __device__ explicit Smem(float* sm, const Dims& d) {
    X = sm;
    Y = X + kQ * d.stride;
    P = Y + kK * d.stride;
    S = P + kQ * kK;
    lse = S + kQ * kK;
    D = lse + kQ;
    bits = reinterpret_cast<uint32_t*>(D + kQ);
    uni = reinterpret_cast<int*>(bits + kQ);
  }
  static size_t bytes(const Dims& d) { return ((kQ + kK) * d.stride + 2 * kQ * kK + 4 * kQ) * sizeof(float); }
};

// Query-major pass over the key tiles of one query tile and head. kStats: writes lse and D (online softmax); else
// adds dq.
template <bool kStats>
__global__ void __launch_bounds__(kThreads, 1)
    query_kernel(const float* q, const float* kv, const float* do_, const int32_t* count, const int32_t* seq_start,
                 const int32_t* seq_len, const uint32_t* mask, int64_t words, const uint32_t* tmap, int64_t wk,
                 float* lse_g, float* D_g, float* dq, int64_t T, int64_t NH, Dims d, float scale) {
  extern __shared__ __align__(16) float sm[];
  const Smem m(sm, d);
  const int tid = threadIdx.x, tq = tid >> 4, tk = tid & 15;
  const int64_t r0 = int64_t(blockIdx.x) * kQ, h = blockIdx.y, W = d.dqk + d.dv;
  QueryInfo qi{};
  if (tid < kQ) {
    qi.load(r0 + tid, T, count, seq_start, seq_len);
    m.uni[tid] = qi.uniform;
    if (!kStats) {
      m.lse[tid] = qi.valid ? lse_g[qi.t * NH + h] : 0.0f;
      m.D[tid] = qi.valid ? D_g[qi.t * NH + h] : 0.0f;
    }
  }
  stage(m.X, kQ, q, d.dqk, do_, d.dv, r0, T, NH, h, d);

  // kStats: per query a of this thread the running max, sum of exp and sum of exp·dp (the same in the 16 threads of
  // a query group). Else dq of queries 16·(tid/64) + i, columns tid%64 + 64·c.
  float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4] = {}, dn[4] = {};
  float acc[4][16];
  if (!kStats)
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[c][i] = 0.0f;
  const int qg = tid >> 6, cl = tid & 63;

  const uint32_t* row = tmap + int64_t(blockIdx.x) * wk;
  for (int64_t w = 0; w < wk; ++w)
    for (uint32_t word = row[w]; word; word &= word - 1) {
      const int64_t j0 = (w * 32 + __ffs(word) - 1) * kK;
      __syncthreads();  // the previous tile's readers are done
      if (tid < kQ) m.bits[tid] = qi.bits(j0, T, mask, words);
      stage(m.Y, kK, kv, W, kv + d.dqk, W, j0, T, NH, h, d);
      __syncthreads();
      float s[4][2], g[4][2];
      scores(m.X, m.Y, d, s, g);
      if (kStats) {
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const int i = 4 * tq + a;
          const uint32_t bi = m.bits[i];
          const bool uni = m.uni[i];
          float x[2];
#pragma unroll
          for (int b = 0; b < 2; ++b) x[b] = (bi >> (tk + 16 * b)) & 1 ? logit(s[a][b], uni, scale) : -INFINITY;
          float tmax = fmaxf(x[0], x[1]);
#pragma unroll
          for (int o = 1; o < 16; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
          // No key of this query yet: mnew = −inf, alpha = 1 and nothing is added (no early exit: the shuffles
          // below need every lane).
          const float mnew = fmaxf(mx[a], tmax);
          const float alpha = mnew == -INFINITY ? 1.0f : expf(mx[a] - mnew);
          float se = 0.0f, sed = 0.0f;
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const float e = x[b] == -INFINITY ? 0.0f : expf(x[b] - mnew);
            se += e;
            sed = fmaf(e, g[a][b], sed);
          }
#pragma unroll
          for (int o = 1; o < 16; o <<= 1) {
            se += __shfl_xor_sync(0xffffffffu, se, o);
            sed += __shfl_xor_sync(0xffffffffu, sed, o);
          }
          l[a] = fmaf(l[a], alpha, se);
          dn[a] = fmaf(dn[a], alpha, sed);
          mx[a] = mnew;
        }
      } else {
        // ds, stored transposed (S [key][query]) for the dq product.
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const int i = 4 * tq + a;
          const uint32_t bi = m.bits[i];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int k = tk + 16 * b;
            float ds = 0.0f;
            if ((bi >> k) & 1) {
              const float p = expf(logit(s[a][b], m.uni[i], scale) - m.lse[i]);
              ds = p * (g[a][b] - m.D[i]) * scale;
            }
            m.S[k * kQ + i] = ds;
          }
        }
        __syncthreads();
        for (int k = 0; k < kK; ++k) {
          float ds[16];
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const float4 f = *reinterpret_cast<const float4*>(m.S + k * kQ + 16 * qg + 4 * v);
            ds[4 * v] = f.x, ds[4 * v + 1] = f.y, ds[4 * v + 2] = f.z, ds[4 * v + 3] = f.w;
          }
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int col = cl + 64 * c;
            if (col < d.dqk4) {
              const float y = m.Y[k * d.stride + col];
#pragma unroll
              for (int i = 0; i < 16; ++i) acc[c][i] = fmaf(ds[i], y, acc[c][i]);
            }
          }
        }
      }
    }

  if (kStats) {
    if (tk == 0)
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int64_t t = r0 + 4 * tq + a;
        if (t >= T) continue;
        lse_g[t * NH + h] = l[a] > 0.0f ? mx[a] + logf(l[a]) : 0.0f;
        D_g[t * NH + h] = l[a] > 0.0f ? dn[a] / l[a] : 0.0f;
      }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t t = r0 + 16 * qg + i;
      if (t >= T) continue;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = cl + 64 * c;
        if (col < d.dqk) dq[(t * NH + h) * d.dqk + col] += acc[c][i];
      }
    }
  }
}

// Key-major pass over the query tiles that select any key of one key tile (32 keys) and head: dk | dv of the tile's
// keys, in registers (keys 8·(tid/64) + k, padded columns tid%64 + 64·c), added to dkv at the end.
__global__ void __launch_bounds__(kThreads, 1)
    key_kernel(const float* q, const float* kv, const float* do_, const int32_t* count, const int32_t* seq_start,
               const int32_t* seq_len, const uint32_t* mask, int64_t words, const uint32_t* tmapT, int64_t wq,
               const float* lse_g, const float* D_g, float* dkv, int64_t T, int64_t NH, Dims d, float scale) {
  extern __shared__ __align__(16) float sm[];
  const Smem m(sm, d);
  const int tid = threadIdx.x, tq = tid >> 4, tk = tid & 15, kg = tid >> 6, cl = tid & 63;
  const int64_t j0 = int64_t(blockIdx.x) * kK, h = blockIdx.y, W = d.dqk + d.dv;
  stage(m.Y, kK, kv, W, kv + d.dqk, W, j0, T, NH, h, d);
  float acc[8][8];
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[c][k] = 0.0f;

  const uint32_t* row = tmapT + int64_t(blockIdx.x) * wq;
  for (int64_t w = 0; w < wq; ++w)
    for (uint32_t word = row[w]; word; word &= word - 1) {
      const int64_t r0 = (w * 32 + __ffs(word) - 1) * kQ;
      __syncthreads();  // the previous tile's readers are done
      if (tid < kQ) {
        QueryInfo qi;
        qi.load(r0 + tid, T, count, seq_start, seq_len);
        m.bits[tid] = qi.bits(j0, T, mask, words);
        m.uni[tid] = qi.uniform;
        m.lse[tid] = qi.valid ? lse_g[qi.t * NH + h] : 0.0f;
        m.D[tid] = qi.valid ? D_g[qi.t * NH + h] : 0.0f;
      }
      stage(m.X, kQ, q, d.dqk, do_, d.dv, r0, T, NH, h, d);
      __syncthreads();
      float s[4][2], g[4][2];
      scores(m.X, m.Y, d, s, g);
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int i = 4 * tq + a;
        const uint32_t bi = m.bits[i];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int k = tk + 16 * b;
          float p = 0.0f, ds = 0.0f;
          if ((bi >> k) & 1) {
            p = expf(logit(s[a][b], m.uni[i], scale) - m.lse[i]);
            ds = p * (g[a][b] - m.D[i]) * scale;
          }
          m.P[i * kK + k] = p;
          m.S[i * kK + k] = ds;
        }
      }
      __syncthreads();
      for (int i = 0; i < kQ; ++i) {
        if (!m.bits[i]) continue;
        float p[8], ds[8];
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const float4 f = *reinterpret_cast<const float4*>(m.P + i * kK + 8 * kg + 4 * v);
          const float4 e = *reinterpret_cast<const float4*>(m.S + i * kK + 8 * kg + 4 * v);
          p[4 * v] = f.x, p[4 * v + 1] = f.y, p[4 * v + 2] = f.z, p[4 * v + 3] = f.w;
          ds[4 * v] = e.x, ds[4 * v + 1] = e.y, ds[4 * v + 2] = e.z, ds[4 * v + 3] = e.w;
        }
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const int col = cl + 64 * c;
          if (col < d.dqk4) {
            const float x = m.X[i * d.stride + col];
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[c][k] = fmaf(ds[k], x, acc[c][k]);
          } else if (col < d.w4) {
            const float x = m.X[i * d.stride + col];
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[c][k] = fmaf(p[k], x, acc[c][k]);
          }
        }
      }
    }

#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int64_t j = j0 + 8 * kg + k;
    if (j >= T) continue;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int col = cl + 64 * c;
      const int out = col < d.dqk4 ? (col < d.dqk ? col : -1) : (col - d.dqk4 < d.dv ? d.dqk + col - d.dqk4 : -1);
      if (col < d.w4 && out >= 0) dkv[(j * NH + h) * W + out] += acc[c][k];
    }
  }
}

struct Layout {
  int64_t words, nqt, nkt, wk, wq;
  size_t lse, D, mask, tmapT, tmap, end;  // byte offsets; mask … tmapT are zeroed before the build
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

Layout layout(int64_t T, int64_t NH, int64_t max_len) {
  Layout L;
  L.words = ceil_div(std::max<int64_t>(max_len, 1), 32);
  L.nqt = ceil_div(T, kQ);
  L.nkt = ceil_div(T, kK);
  L.wk = ceil_div(std::max<int64_t>(L.nkt, 1), 32);
  L.wq = ceil_div(std::max<int64_t>(L.nqt, 1), 32);
  const size_t f = sizeof(float), u = sizeof(uint32_t);
  L.lse = 0;
  L.D = align256(L.lse + T * NH * f);
  L.mask = align256(L.D + T * NH * f);
  L.tmapT = L.mask + T * L.words * u;
  L.tmap = align256(L.tmapT + L.nkt * L.wq * u);
  L.end = L.tmap + L.nqt * L.wk * u;
  return L;
}

}  // namespace

size_t mla_sparse_attention_backward_workspace_bytes(int64_t T, int64_t NH, int64_t max_len) {
  return std::max<size_t>(layout(T, NH, max_len).end, 1);
}

void mla_sparse_attention_backward(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                                   const int32_t* seq_start, const int32_t* seq_len, const float* do_, float* dq,
                                   float* dkv, int64_t T, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                                   int64_t max_len, void* work, cudaStream_t st) {
  if (T == 0 || NH == 0) return;
  Dims d;
  d.dqk = static_cast<int>(dqk);
  d.dv = static_cast<int>(dv);
  d.dqk4 = static_cast<int>(ceil_div(dqk, 4) * 4);
  d.dv4 = static_cast<int>(ceil_div(dv, 4) * 4);
  d.w4 = d.dqk4 + d.dv4;
  d.stride = 4 * ((d.w4 / 4) | 1);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  d.vec = dqk % 4 == 0 && dv % 4 == 0 && aligned(q) && aligned(kv) && aligned(do_);
  const Layout L = layout(T, NH, max_len);
  check(NH <= 65535 && dqk >= 1 && dv >= 1 && max_sel >= 0 &&
            max_len >= 1 && d.dqk4 <= kMaxDqk4 && d.w4 <= kMaxW4 && L.wk <= kMaxTileWords,
        "CUDA MLA attention backward: bad shape T ", T, ", NH ", NH, ", dqk ", dqk, ", dv ", dv, ", max_sel ", max_sel,
        ", max_len ", max_len);
  const size_t smem = Smem::bytes(d);
  auto* base = static_cast<unsigned char*>(work);
  float* lse = reinterpret_cast<float*>(base + L.lse);
  float* D = reinterpret_cast<float*>(base + L.D);
  uint32_t* mask = reinterpret_cast<uint32_t*>(base + L.mask);
  uint32_t* tmapT = reinterpret_cast<uint32_t*>(base + L.tmapT);
  uint32_t* tmap = reinterpret_cast<uint32_t*>(base + L.tmap);
  const float scale = 1.0f / sqrtf(static_cast<float>(dqk));

  NEXTLM_CUDA_CHECK(cudaMemsetAsync(mask, 0, L.tmap - L.mask, st));
  selection_tiles_kernel<kQ, kK, kMaxTileWords><<<static_cast<unsigned>(L.nqt), kThreads, 0, st>>>(
      sel, count, seq_start, seq_len, mask, L.words, tmap, L.wk, tmapT, L.wq, T, max_sel);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(query_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(query_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(key_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 qgrid(static_cast<unsigned>(L.nqt), static_cast<unsigned>(NH));
  query_kernel<true><<<qgrid, kThreads, smem, st>>>(q, kv, do_, count, seq_start, seq_len, mask, L.words, tmap, L.wk,
                                                    lse, D, dq, T, NH, d, scale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  query_kernel<false><<<qgrid, kThreads, smem, st>>>(q, kv, do_, count, seq_start, seq_len, mask, L.words, tmap,
                                                     L.wk, lse, D, dq, T, NH, d, scale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  key_kernel<<<dim3(static_cast<unsigned>(L.nkt), static_cast<unsigned>(NH)), kThreads, smem, st>>>(
      q, kv, do_, count, seq_start, seq_len, mask, L.words, tmapT, L.wq, lse, D, dkv, T, NH, d, scale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nextlm::cuda
