// Backward of the MLA attention over the DSA selection on tensor cores (mma.sync bf16 → fp32), flash-attention-2
// style with the selection as a bitmask (the layout of mla_tc.cu): matches mla_sparse_attention_backward
// (dsa_backward.cu) and the attention part of dsa_layer_backward (src/model/dsa_backward.cpp).
//
// With x = scale·q·k·log2(e) (0 for every key of an empty selection: uniform weights over keys s0 … s0+len−1),
// p = 2^(x − lse2), dp = do·v, D = Σ_j p_j·dp_j, ds = p·(dp − D)·scale, on tiles of 64 queries × 64 keys of one head:
//   1. build: the bitmask, and which (query tile, key tile) pairs hold any selected pair, both ways round; do → bf16;
//   2. stats (query-major): lse2 and D per (query, head), by an online softmax over the query tile's key tiles;
//   3. dq (query-major): dq_i += Σ_j ds_ij·k_j, summed in registers over the key tiles in order;
//   4. dkv (key-major): dk_j += Σ_i ds_ij·q_i, dv_j += Σ_i p_ij·do_i, summed in registers over the query tiles.
// Every output element is added once, by one thread, after sums in a fixed order: no atomics, reproducible results.
// Products run in bf16 (q, k, v as given, do, p and ds rounded to bf16), sums in fp32.
//
// Each block has 8 warps. The 64 × 64 score and dp tiles are split 4 (rows) × 2 (32 keys) among them; p and ds go
// through shared memory in bf16, and the output tile (64 rows × head dim) is split 4 (rows) × 2 (column halves).
// The operand tile that changes along the walk (k | v in the query-major passes, q | do in the key-major one) is
// double-buffered: the next tile's copies are in flight while the current one is used. On Hopper the dq pass (dqk
// of 128, 192 or 256: dq_wgmma_kernel) and the key-major pass (dqk = dv = 128 or 256: key_wgmma_kernel) run on
// warpgroup MMAs instead (still fixed-order sums, each output element added once), their walking tiles loaded by
// TMA; the stats pass and 64/64 stay on the mma.sync kernels.
#include <algorithm>
#include <type_traits>

#include "cuda/backward_kernels.h"
#include "cuda/kernels.h"
#include "cuda/mla_mask.cuh"
#include "cuda/mma.cuh"
#include "cuda/tensor_map.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kTile = 64, kThreads = 256;
constexpr int kMaxTileWords = 1024;  // key-tile bitmap of a query tile in the build's shared memory: T ≤ 2^21
constexpr int PS = kTile + 8;        // row stride (elements) of the bf16 p / ds tiles: ldmatrix without conflicts

template <int DQK, int DV>
struct Dims {
  static constexpr int QS = DQK + 8, VS = DV + 8, DKV = DQK + DV;
  static constexpr int tile_q = kTile * QS, tile_v = kTile * VS;  // elements of one staged tile
  // query_kernel: q, do resident, k | v double-buffered, ds (dq pass only).
  static constexpr int query_bytes(bool stats) { return (3 * tile_q + 3 * tile_v + (stats ? 0 : kTile * PS)) * 2; }
  // key_kernel: k, v resident, q | do double-buffered, p and ds.
  static constexpr int key_bytes = (3 * tile_q + 3 * tile_v + 2 * kTile * PS) * 2;
};

// One query token: its sequence, and whether its selection is empty.
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
  // Its keys among j0 … j0+63: start() before, finish() after other work.
  __device__ void start(MaskWindow& mw, int64_t j0, const uint32_t* mask, int64_t words) const {
    if (valid && !uniform) mw.load(mask + t * words, words, j0 - s0);
  }
  __device__ uint64_t finish(const MaskWindow& mw, int64_t j0) const {
    return !valid ? 0 : uniform ? range64(j0 - s0, len) : mw.bits();
  }
};

// 4-byte asynchronous copy global → shared; !valid zero-fills.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}

// The first set bit at index ≥ from of a bitmap of nw words, or −1.
__device__ __forceinline__ int64_t next_tile(const uint32_t* row, int64_t nw, int64_t from) {
  for (int64_t w = from >> 5; w < nw; ++w) {
    uint32_t word = row[w];
    if (w == from >> 5) word &= ~0u << (from & 31);
    if (word) return w * 32 + __ffs(word) - 1;
  }
  return -1;
}

// Rows r0 … r0+63 (row index ·NH + h, row stride ld elements, n columns from src) into a tile of row stride ls;
// rows past T are zero-filled. Asynchronous: the caller commits and waits.
template <int N>
__device__ __forceinline__ void stage(bf16* tile, int ls, const bf16* src, int64_t ld, int64_t r0, int64_t T,
                                      int64_t NH, int64_t h) {
  constexpr int chunks = N / 8;
  for (int i = threadIdx.x; i < kTile * chunks; i += kThreads) {
    const int r = i / chunks, c = i % chunks;
    const bool in = r0 + r < T;
    cp_async16(tile + r * ls + c * 8, src + ((in ? r0 + r : 0) * NH + h) * ld + c * 8, in);
  }
}

// s = X·Yᵀ (over DQK) and dp = O·Zᵀ (over DV) for this warp's 16 rows (rq …) × 32 keys (kc …): X, O the row tiles
// (q | do), Y, Z the key tiles (k | v). Added into s, dp (C fragments; n-tile nt holds keys kc + 8·nt …).
template <int DQK, int DV>
__device__ __forceinline__ void scores(const bf16* X, const bf16* O, const bf16* Y, const bf16* Z, int rq, int kc,
                                       float s[4][4], float dp[4][4]) {
  constexpr int QS = Dims<DQK, DV>::QS, VS = Dims<DQK, DV>::VS;
#pragma unroll
  for (int kk = 0; kk < DQK / 16; ++kk) {
    uint32_t a[4];
    load_a(a, X + rq * QS + 16 * kk, QS);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t b[4];
      load_b_nk(b, Y + (kc + 16 * np) * QS + 16 * kk, QS);
      mma_bf16(s[2 * np], a, b[0], b[1]);
      mma_bf16(s[2 * np + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int kk = 0; kk < DV / 16; ++kk) {
    uint32_t a[4];
    load_a(a, O + rq * VS + 16 * kk, VS);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t b[4];
      load_b_nk(b, Z + (kc + 16 * np) * VS + 16 * kk, VS);
      mma_bf16(dp[2 * np], a, b[0], b[1]);
      mma_bf16(dp[2 * np + 1], a, b[2], b[3]);
    }
  }
}

__device__ __forceinline__ void zero(float (*c)[4], int n) {
  for (int i = 0; i < n; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
}

// p and ds of this warp's 16 × 32 fragments (rows rq + g, rq + g + 8; keys kc + 8·nt + 2t + e), rounded to bf16 and
// stored at P [row][key] (when P) and S [row][key], stride PS. Per row of the 64-row tile: bits its keys in the key
// tile, cnt its selection's size (0: uniform weights, x = 0), lse2 (log2 domain) and D.
__device__ __forceinline__ void p_ds(const uint64_t* bits, const int32_t* cnt, const float* lse2, const float* D,
                                     const float s[4][4], const float dp[4][4], int rq, int kc, float scale_log2,
                                     float scale, bf16* P, bf16* S) {
  const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = rq + gq + 8 * hf;
    const uint32_t bw = static_cast<uint32_t>(bits[r] >> kc);
    const float sl = cnt[r] ? scale_log2 : 0.0f, l2 = lse2[r], Dr = D[r];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float p[2], ds[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 8 * nt + 2 * tq + e;
        p[e] = (bw >> j) & 1 ? exp2_ftz(s[nt][2 * hf + e] * sl - l2) : 0.0f;
        ds[e] = p[e] * (dp[nt][2 * hf + e] - Dr) * scale;
      }
      const int off = r * PS + kc + 8 * nt + 2 * tq;
      if (P) *reinterpret_cast<uint32_t*>(P + off) = pack_bf16(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(S + off) = pack_bf16(ds[0], ds[1]);
    }
  }
}

// Query-major pass over the key tiles of one query tile and head. kStats: writes lse2 and D (online softmax); else
// adds dq.
template <int DQK, int DV, bool kStats>
__global__ void __launch_bounds__(kThreads, 1)
    query_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kv, const bf16* __restrict__ do16,
                 const int32_t* __restrict__ count, const int32_t* __restrict__ seq_start,
                 const int32_t* __restrict__ seq_len, const uint32_t* __restrict__ mask, int64_t words,
                 const uint32_t* __restrict__ tmap, int64_t wk, float* __restrict__ lse_g, float* __restrict__ D_g,
                 float* __restrict__ dq, int64_t T, int64_t NH, float scale_log2, float scale) {
  using L = Dims<DQK, DV>;
  constexpr int QS = L::QS, VS = L::VS, DKV = L::DKV, NQ = DQK / 16;  // NQ: n-tiles of a dq column half
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Xs = reinterpret_cast<bf16*>(smem);       // q
  bf16* Os = Xs + L::tile_q;                      // do
  bf16* const buf0 = Os + L::tile_v;              // two key tile buffers, each k | v
  bf16* Ss = buf0 + 2 * (L::tile_q + L::tile_v);  // ds (dq pass)
  auto Ys = [&](int b) { return buf0 + b * (L::tile_q + L::tile_v); };
  auto Zs = [&](int b) { return buf0 + b * (L::tile_q + L::tile_v) + L::tile_q; };
  __shared__ uint64_t bits[2][kTile];  // per key tile buffer
  __shared__ int32_t cnt[kTile];       // selection sizes (0: uniform, or past T)
  __shared__ float lse2[kTile], Dm[kTile];
  __shared__ float mst[kTile], lst[kTile], dst[kTile];  // the second key half's softmax stats (stats pass)

  // Query tiles in reverse order: in causal batches the late tiles have the most key tiles, so they start first and
  // the grid's tail holds short blocks.
  const int64_t qt = int64_t(gridDim.x) - 1 - blockIdx.x, r0 = qt * kTile, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int rq = 16 * (warp & 3), kc = 32 * (warp >> 2), qc = (DQK / 2) * (warp >> 2);

  stage<DQK>(Xs, QS, q, DQK, r0, T, NH, h);
  stage<DV>(Os, VS, do16, DV, r0, T, NH, h);
  cp_async_commit();
  auto issue = [&](int64_t kt, int b) {
    stage<DQK>(Ys(b), QS, kv, DKV, kt * kTile, T, NH, h);
    stage<DV>(Zs(b), VS, kv + DQK, DKV, kt * kTile, T, NH, h);
    cp_async_commit();
  };
  // This query tile's row of key tiles, after the operand tiles in shared memory: walked without global reads.
  uint32_t* trow = reinterpret_cast<uint32_t*>(smem + L::query_bytes(kStats));
  for (int64_t i = tid; i < wk; i += kThreads) trow[i] = tmap[qt * wk + i];
  __syncthreads();
  int64_t kt = next_tile(trow, wk, 0);
  if (kt >= 0) issue(kt, 0);
  QueryInfo qi{};
  if (tid < kTile) {
    qi.load(r0 + tid, T, count, seq_start, seq_len);
    cnt[tid] = qi.valid ? count[qi.t] : 0;
    lse2[tid] = !kStats && qi.valid ? lse_g[qi.t * NH + h] : 0.0f;
    Dm[tid] = !kStats && qi.valid ? D_g[qi.t * NH + h] : 0.0f;
    if (kt >= 0) {
      MaskWindow mw;
      qi.start(mw, kt * kTile, mask, words);
      bits[0][tid] = qi.finish(mw, kt * kTile);
    }
  }

  // Stats: per row half hf the running max (log2 domain, common to the 4 lanes of a quad) and this lane's partial
  // sums of 2^(x − m) and 2^(x − m)·dp. Dq: this warp's 16 rows × DQK/2 columns.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, dn[2] = {0.0f, 0.0f};
  float acc[kStats ? 1 : NQ][4];
  zero(acc, kStats ? 1 : NQ);

  for (int b = 0; kt >= 0; b ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // tile b and its bits visible; the readers of buffer b ^ 1 are done
    const int64_t nkt = next_tile(trow, wk, kt + 1);
    MaskWindow mw;
    if (nkt >= 0) {
      issue(nkt, b ^ 1);
      if (tid < kTile) qi.start(mw, nkt * kTile, mask, words);  // used at the end of this iteration
    }
    float s[4][4], dp[4][4];
    zero(s, 4);
    zero(dp, 4);
    const bool any = __any_sync(0xffffffffu, ((bits[b][rq + gq] | bits[b][rq + gq + 8]) >> kc & 0xffffffffull) != 0);
    if (any) scores<DQK, DV>(Xs, Os, Ys(b), Zs(b), rq, kc, s, dp);
    if (kStats) {
      if (any)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = rq + gq + 8 * hf;
          const uint32_t bw = static_cast<uint32_t>(bits[b][r] >> kc);
          const float sl = cnt[r] ? scale_log2 : 0.0f;
          float x[4][2], mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              x[nt][e] = (bw >> (8 * nt + 2 * tq + e)) & 1 ? s[nt][2 * hf + e] * sl : -INFINITY;
              mx = fmaxf(mx, x[nt][e]);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mnew = fmaxf(m[hf], mx);
          if (mnew == -INFINITY) continue;  // no key of this row yet (the same in the whole quad)
          const float alpha = exp2_ftz(m[hf] - mnew);  // m = −inf → 0
          float se = 0.0f, sed = 0.0f;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = exp2_ftz(x[nt][e] - mnew);  // −inf → 0
              se += p;
              sed = fmaf(p, dp[nt][2 * hf + e], sed);
            }
          l[hf] = fmaf(l[hf], alpha, se);
          dn[hf] = fmaf(dn[hf], alpha, sed);
          m[hf] = mnew;
        }
    } else {
      // ds of this warp's fragment, then dq += ds·k over the whole key tile.
      p_ds(bits[b], cnt, lse2, Dm, s, dp, rq, kc, scale_log2, scale, nullptr, Ss);
      __syncthreads();  // ds complete
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        uint32_t a[4];
        load_a(a, Ss + rq * PS + 16 * kk, PS);
#pragma unroll
        for (int np = 0; np < NQ / 2; ++np) {
          uint32_t bb[4];
          load_b_kn(bb, Ys(b) + 16 * kk * QS + qc + 16 * np, QS);
          mma_bf16(acc[2 * np], a, bb[0], bb[1]);
          mma_bf16(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
    }
    // The next tile's bits: bits[b ^ 1] was last read in the previous iteration, before this one's first barrier.
    if (nkt >= 0 && tid < kTile) bits[b ^ 1][tid] = qi.finish(mw, nkt * kTile);
    kt = nkt;
  }
  cp_async_wait<0>();  // no tile: q and do copies still in flight

  if (kStats) {
    // Merge the two key halves (warps w and w + 4 hold the same rows).
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 1);
      l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 2);
      dn[hf] += __shfl_xor_sync(0xffffffffu, dn[hf], 1);
      dn[hf] += __shfl_xor_sync(0xffffffffu, dn[hf], 2);
      if (warp >= 4 && tq == 0) {
        const int r = rq + gq + 8 * hf;
        mst[r] = m[hf], lst[r] = l[hf], dst[r] = dn[hf];
      }
    }
    __syncthreads();
    if (warp < 4 && tq == 0)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = rq + gq + 8 * hf;
        const int64_t t = r0 + r;
        if (t >= T) continue;
        const float M = fmaxf(m[hf], mst[r]);
        float ls = 0.0f, D = 0.0f;
        if (M != -INFINITY) {
          const float a0 = exp2_ftz(m[hf] - M), a1 = exp2_ftz(mst[r] - M);
          const float lt = l[hf] * a0 + lst[r] * a1, dt = dn[hf] * a0 + dst[r] * a1;
          ls = M + log2f(lt);
          D = dt / lt;
        }
        lse_g[t * NH + h] = ls;
        D_g[t * NH + h] = D;
      }
  } else {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t t = r0 + rq + gq + 8 * hf;
      if (t >= T) continue;
      float* out = dq + (t * NH + h) * DQK + qc + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt) {
        out[8 * nt] += acc[nt][2 * hf];
        out[8 * nt + 1] += acc[nt][2 * hf + 1];
      }
    }
  }
}

// Per row of a query tile in the key-major pass, copied asynchronously with the tile: selection size (0: uniform,
// or past T), sequence start and length, lse2 and D.
struct KeyPassRows {
  int32_t cnt[kTile], s0[kTile], len[kTile];
  float lse2[kTile], D[kTile];
};

// Key-major pass over the query tiles that select any key of one key tile (64 keys) and head: dk | dv of the tile's
// keys in registers (this warp: keys 16·(w%4) …, column half w/4 of dk and of dv), added to dkv at the end.
template <int DQK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    key_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kv, const bf16* __restrict__ do16,
               const int32_t* __restrict__ count, const int32_t* __restrict__ seq_start,
               const int32_t* __restrict__ seq_len, const uint32_t* __restrict__ mask, int64_t words,
               const uint32_t* __restrict__ tmapT, int64_t wq, const float* __restrict__ lse_g,
               const float* __restrict__ D_g, float* __restrict__ dkv, int64_t T, int64_t NH, float scale_log2,
               float scale) {
  using L = Dims<DQK, DV>;
  constexpr int QS = L::QS, VS = L::VS, DKV = L::DKV, NK = DQK / 16, NV = DV / 16;  // n-tiles of a column half
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ys = reinterpret_cast<bf16*>(smem);       // k
  bf16* Zs = Ys + L::tile_q;                      // v
  bf16* const buf0 = Zs + L::tile_v;              // two query tile buffers, each q | do
  bf16* Ps = buf0 + 2 * (L::tile_q + L::tile_v);  // p [query][key]
  bf16* Ss = Ps + kTile * PS;                     // ds [query][key]
  auto Xs = [&](int b) { return buf0 + b * (L::tile_q + L::tile_v); };
  auto Os = [&](int b) { return buf0 + b * (L::tile_q + L::tile_v) + L::tile_q; };
  __shared__ KeyPassRows rows[2];  // per query tile buffer
  __shared__ uint64_t bits[kTile];

  const int64_t j0 = int64_t(blockIdx.x) * kTile, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int rq = 16 * (warp & 3), kc = 32 * (warp >> 2);  // score fragment: queries rq …, keys kc …
  const int kr = 16 * (warp & 3), ck = (DQK / 2) * (warp >> 2), cv = (DV / 2) * (warp >> 2);  // output fragment

  stage<DQK>(Ys, QS, kv, DKV, j0, T, NH, h);
  stage<DV>(Zs, VS, kv + DQK, DKV, j0, T, NH, h);
  cp_async_commit();
  auto issue = [&](int64_t qt, int b) {
    const int64_t r0 = qt * kTile;
    stage<DQK>(Xs(b), QS, q, DQK, r0, T, NH, h);
    stage<DV>(Os(b), VS, do16, DV, r0, T, NH, h);
    if (tid < kTile) {
      const int64_t t = r0 + tid;
      const bool in = t < T;
      const int64_t i = in ? t : 0, ih = in ? t * NH + h : 0;
      cp_async4(rows[b].cnt + tid, count + i, in);
      cp_async4(rows[b].s0 + tid, seq_start + i, in);
      cp_async4(rows[b].len + tid, seq_len + i, in);
      cp_async4(rows[b].lse2 + tid, lse_g + ih, in);
      cp_async4(rows[b].D + tid, D_g + ih, in);
    }
    cp_async_commit();
  };

  float dk[NK][4], dv[NV][4];
  zero(dk, NK);
  zero(dv, NV);

  // This key tile's row of query tiles, after the operand tiles in shared memory: walked without global reads.
  uint32_t* trow = reinterpret_cast<uint32_t*>(smem + L::key_bytes);
  for (int64_t i = tid; i < wq; i += kThreads) trow[i] = tmapT[int64_t(blockIdx.x) * wq + i];
  __syncthreads();
  int64_t qt = next_tile(trow, wq, 0);
  if (qt >= 0) issue(qt, 0);
  for (int b = 0; qt >= 0; b ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // tile b and its rows visible; the readers of buffer b ^ 1, bits, p and ds are done
    const int64_t nqt = next_tile(trow, wq, qt + 1);
    if (nqt >= 0) issue(nqt, b ^ 1);
    // This tile's key bits: the mask reads are in flight during the scores.
    MaskWindow mw;
    const KeyPassRows& rb = rows[b];
    if (tid < kTile && rb.cnt[tid] > 0) mw.load(mask + (qt * kTile + tid) * words, words, j0 - rb.s0[tid]);
    float s[4][4], dp[4][4];
    zero(s, 4);
    zero(dp, 4);
    scores<DQK, DV>(Xs(b), Os(b), Ys, Zs, rq, kc, s, dp);
    if (tid < kTile) bits[tid] = rb.cnt[tid] > 0 ? mw.bits() : range64(j0 - rb.s0[tid], rb.len[tid]);
    __syncthreads();  // bits complete
    p_ds(bits, rb.cnt, rb.lse2, rb.D, s, dp, rq, kc, scale_log2, scale, Ps, Ss);
    __syncthreads();  // p and ds complete
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      uint32_t a[4];
      // dv += pᵀ·do: A = pᵀ (keys kr …, queries 16·kk …) from P [query][key].
      load_a_t(a, Ps + 16 * kk * PS + kr, PS);
#pragma unroll
      for (int np = 0; np < NV / 2; ++np) {
        uint32_t bb[4];
        load_b_kn(bb, Os(b) + 16 * kk * VS + cv + 16 * np, VS);
        mma_bf16(dv[2 * np], a, bb[0], bb[1]);
        mma_bf16(dv[2 * np + 1], a, bb[2], bb[3]);
      }
      // dk += dsᵀ·q.
      load_a_t(a, Ss + 16 * kk * PS + kr, PS);
#pragma unroll
      for (int np = 0; np < NK / 2; ++np) {
        uint32_t bb[4];
        load_b_kn(bb, Xs(b) + 16 * kk * QS + ck + 16 * np, QS);
        mma_bf16(dk[2 * np], a, bb[0], bb[1]);
        mma_bf16(dk[2 * np + 1], a, bb[2], bb[3]);
      }
    }
    qt = nqt;
  }
  cp_async_wait<0>();  // no tile: k and v copies still in flight

#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int64_t j = j0 + kr + gq + 8 * hf;
    if (j >= T) continue;
    float* out = dkv + (j * NH + h) * DKV;
#pragma unroll
    for (int nt = 0; nt < NK; ++nt) {
      out[ck + 8 * nt + 2 * tq] += dk[nt][2 * hf];
      out[ck + 8 * nt + 2 * tq + 1] += dk[nt][2 * hf + 1];
    }
#pragma unroll
    for (int nt = 0; nt < NV; ++nt) {
      out[DQK + cv + 8 * nt + 2 * tq] += dv[nt][2 * hf];
      out[DQK + cv + 8 * nt + 2 * tq + 1] += dv[nt][2 * hf + 1];
    }
  }
}

// ---- Hopper (sm_90a): the dq pass on warpgroup MMAs ----
// One block per pair of query tiles (128 rows; warpgroup w takes tile 2·pair + w) and head, walking the key tiles
// that either tile touches (the union of their tmap rows) in order. q and do stay in shared memory; k tiles are
// double-buffered (the next one loads during the current one's work) and the v tile is single (the next one loads
// once both warpgroups have their dp). Per key tile and warpgroup: s = q·kᵀ and dp = do·vᵀ (wgmma m64n64k16 from
// shared memory, both K-major), then p and ds in the accumulators as p_ds forms them, then dq += ds·k (ds repacked
// into wgmma's A registers, k read N-major). Every matrix in shared memory is in the 128-byte-swizzle layout of
// cuda/wgmma.cuh. dq is added to once per element after the walk, as query_kernel does.
constexpr int kWgRows = 128;

// The epilogue of the warpgroup kernels: each output tile goes through shared memory (free once the walk is done),
// so that the block writes whole rows with 16-byte accesses instead of the accumulators' 4- or 8-byte pairs on 8 rows
// a warp (the scattered stores were 8 % of the key pass's warp time and 7.5 % of the dq pass's). bf16 outputs are
// stored, fp32 ones added to, each sum rounded once as before.
// A warpgroup's 64 × N product (acc[4nt + 2hf + e] = row 16wr + gq + 8hf, column 8nt + 2tq + e) into the tile at
// column c0 (row stride LD elements).
template <int N, int LD, class E>
__device__ __forceinline__ void acc_to_tile(E* tile, int c0, const float* acc, int wr) {
  const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    E* row = tile + (16 * wr + gq + 8 * hf) * LD + c0 + 2 * tq;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
      const float a = acc[4 * nt + 2 * hf], b = acc[4 * nt + 2 * hf + 1];
      if constexpr (std::is_same_v<E, float>) *reinterpret_cast<float2*>(row + 8 * nt) = make_float2(a, b);
      else *reinterpret_cast<__nv_bfloat162*>(row + 8 * nt) = __floats2bfloat162_rn(a, b);
    }
  }
}
// Rows r < R of the tile (W columns, row stride LD) to out(r) (16-byte aligned; null: skipped) by the block's
// kThreads threads, 16 bytes each: bf16 stored; fp32 added, a batch of loads in flight before its stores.
template <int R, int W, int LD, class E, class Out>
__device__ __forceinline__ void tile_to_rows(const E* tile, Out out) {
  constexpr int per = 16 / static_cast<int>(sizeof(E)), pieces = W / per, n = R * pieces / kThreads;
  static_assert(W % per == 0 && (R * pieces) % kThreads == 0, "whole rounds of 16-byte pieces");
  constexpr int B = std::is_same_v<E, float> ? 8 : 1;
  static_assert(n % B == 0, "whole batches");
#pragma unroll 1
  for (int i0 = 0; i0 < n; i0 += B) {
    E* o[B];
    float4 x[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int i = threadIdx.x + (i0 + b) * kThreads, r = i / pieces, c = (i - r * pieces) * per;
      o[b] = out(r);
      if (o[b]) o[b] += c;
      x[b] = *reinterpret_cast<const float4*>(tile + r * LD + c);
    }
    if constexpr (std::is_same_v<E, float>) {
      float4 y[B];
#pragma unroll
      for (int b = 0; b < B; ++b) y[b] = o[b] ? *reinterpret_cast<const float4*>(o[b]) : x[b];
#pragma unroll
      for (int b = 0; b < B; ++b)
        if (o[b])
          *reinterpret_cast<float4*>(o[b]) = make_float4(y[b].x + x[b].x, y[b].y + x[b].y, y[b].z + x[b].z,
                                                         y[b].w + x[b].w);
    } else {
#pragma unroll
      for (int b = 0; b < B; ++b)
        if (o[b]) *reinterpret_cast<float4*>(o[b]) = x[b];
    }
  }
}
// The epilogue: this warpgroup's 64 × N accumulators into rows row0 … and columns c0 … of an R × W tile at the start
// of shared memory (ROOM bytes free there), then the tile's row r to out + ((first + r)·NH + h)·W where first + r < T.
// The tile's row stride is W + 8 elements (W a multiple of 64): bf16 rows 16 bytes and fp32 rows 32 bytes past a
// multiple of 128, so that the pairs of a warp (of a half-warp for 8-byte ones) fall in distinct banks.
template <int R, int W, int N, int ROOM, class E>
__device__ __forceinline__ void write_staged(unsigned char* smem, int row0, int c0, const float* acc, int wr, E* out,
                                             int64_t first, int64_t T, int64_t NH, int64_t h) {
  constexpr int LD = W + 8;
  static_assert(R * LD * sizeof(E) <= ROOM, "the staged tile fits");
  E* tile = reinterpret_cast<E*>(smem);
  acc_to_tile<N, LD>(tile + row0 * LD, c0, acc, wr);
  __syncthreads();
  tile_to_rows<R, W, LD>(tile, [&](int r) { return first + r < T ? out + ((first + r) * NH + h) * W : nullptr; });
}

template <int DQK, int DV>
struct DqWg {
  static constexpr int q_bytes = kWgRows * DQK * 2, o_bytes = kWgRows * DV * 2, k_bytes = kTile * DQK * 2,
                       v_bytes = kTile * DV * 2;
  static constexpr int k_at = q_bytes + o_bytes, v_at = k_at + 2 * k_bytes;
  static constexpr int bytes = v_at + v_bytes + 1024;  // + slack to align the tiles to 1024 bytes
  static_assert(DV % 64 == 0 && (DQK == 128 || DQK == 192 || DQK == 256));
};

template <int DQK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    dq_wgmma_kernel(const __grid_constant__ CUtensorMap map_kv, const bf16* __restrict__ q,
                    const bf16* __restrict__ do16, const int32_t* __restrict__ count,
                    const int32_t* __restrict__ seq_start, const int32_t* __restrict__ seq_len,
                    const uint32_t* __restrict__ mask, int64_t words,
                    const uint32_t* __restrict__ tmap, int64_t wk, int64_t nqt, bool rows_in_smem,
                    const float* __restrict__ lse_g, const float* __restrict__ D_g, float* __restrict__ dq,
                    bf16* __restrict__ dq16, int64_t T, int64_t NH, float scale_log2, float scale) {
  using L = DqWg<DQK, DV>;
  constexpr int NQ = DQK / 2;  // dq accumulators per thread
  extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
  const uint32_t raw_s = smem_addr(wg_smem_raw), pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = wg_smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;

  // Pairs in reverse order, as query_kernel's tiles: the late ones have the most key tiles.
  const int64_t pair = int64_t(gridDim.x) - 1 - blockIdx.x, r0 = pair * kWgRows, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  __shared__ __align__(8) uint64_t bars[3];  // k buffers 0 and 1, v: their copies have landed
  const uint32_t bar_s = smem_addr(bars);
  if (tid == 0) {
    tma_prefetch_map(&map_kv);
    for (int i = 0; i < 3; ++i) mbar_init(bar_s + 8 * i, 1);
    mbar_init_fence();
  }
  // The pair's two rows of the tile map, in shared memory after the tiles when the launch made room (rows_in_smem).
  const bool second = 2 * pair + 1 < nqt;
  const uint32_t* trow = tmap + 2 * pair * wk;
  if (rows_in_smem) {
    uint32_t* rs = reinterpret_cast<uint32_t*>(smem + L::v_at + L::v_bytes);
    for (int64_t w = tid; w < (second ? 2 : 1) * wk; w += kThreads) rs[w] = trow[w];
    trow = rs;
  }
  auto next = [&](int64_t from) {
    const int64_t a = next_tile(trow, wk, from), b = second ? next_tile(trow + wk, wk, from) : -1;
    return a < 0 ? b : b < 0 ? a : min(a, b);
  };

  sw128_load_rows<kWgRows, DQK, kThreads>(smem, q, DQK, 0, r0, T, NH, h);
  sw128_load_rows<kWgRows, DV, kThreads>(smem + L::q_bytes, do16, DV, 0, r0, T, NH, h);
  // A key tile's k (into buffer b) or v by TMA from one thread (rows past T zero-filled). (Their cp.async, 8 a
  // thread with their addresses, and the tile map's reads from global memory were an eighth of the pass's time.)
  auto load_k = [&](int64_t kt, int b) {
    if (tid != 0) return;
    const uint32_t bar = bar_s + 8 * b, dst = smem_s + L::k_at + b * L::k_bytes;
    mbar_arrive_expect_tx(bar, L::k_bytes);
#pragma unroll
    for (int j = 0; j < DQK / 64; ++j)
      tma_load_3d(dst + j * kTile * 128, &map_kv, bar, 64 * j, static_cast<int>(h), static_cast<int>(kt * kTile));
  };
  auto load_v = [&](int64_t kt) {
    if (tid != 0) return;
    const uint32_t bar = bar_s + 16, dst = smem_s + L::v_at;
    mbar_arrive_expect_tx(bar, L::v_bytes);
#pragma unroll
    for (int j = 0; j < DV / 64; ++j)
      tma_load_3d(dst + j * kTile * 128, &map_kv, bar, DQK + 64 * j, static_cast<int>(h),
                  static_cast<int>(kt * kTile));
  };
  __syncthreads();  // the barriers and the tile map's rows are ready

  // This thread's two rows (g and g + 8 of its warp's 16): the forward's statistics, and the score scale (0 for an
  // empty selection: uniform weights).
  QueryInfo qi[2];
  float lse2[2], Dr[2], sl[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    qi[hf].load(r0 + 64 * wg + 16 * wq + gq + 8 * hf, T, count, seq_start, seq_len);
    const int64_t ih = qi[hf].valid ? qi[hf].t * NH + h : 0;
    lse2[hf] = qi[hf].valid ? lse_g[ih] : 0.0f;
    Dr[hf] = qi[hf].valid ? D_g[ih] : 0.0f;
    sl[hf] = qi[hf].uniform ? 0.0f : scale_log2;
  }

  float acc[NQ];
#pragma unroll
  for (int i = 0; i < NQ; ++i) acc[i] = 0.0f;
  int64_t kt = next(0);
  if (kt >= 0) load_k(kt, 0), load_v(kt);
  cp_async_commit();  // q and do
  for (int n = 0; kt >= 0; ++n) {
    const int b = n & 1;
    MaskWindow mw[2];  // the tile's mask words: in flight during the wait and the products
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) qi[hf].start(mw[hf], kt * kTile, mask, words);
    cp_async_wait<0>();
    fence_proxy_async();  // q and do (the first time), by cp.async
    mbar_wait(bar_s + 8 * b, (n >> 1) & 1);
    mbar_wait(bar_s + 16, n & 1);
    __syncthreads();  // k tile b and the v tile visible; every warpgroup is done with k tile b ^ 1
    const int64_t nkt = next(kt + 1);
    if (nkt >= 0) load_k(nkt, b ^ 1);

    const uint32_t qs = smem_s + wg * 64 * 128, os = smem_s + L::q_bytes + wg * 64 * 128;
    const uint32_t ks = smem_s + L::k_at + b * L::k_bytes, vs = smem_s + L::v_at;
    // s[4nt + 2hf + e], dp[…] = (row hf, key 8nt + 2tq + e) of the tile.
    float s[32], dp[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = dp[i] = 0.0f;
    fence_regs<32>(s);
    fence_regs<32>(dp);
    wgmma_fence();
    wgmma_scores<DQK>(s, qs, kWgRows, ks, kTile);
    wgmma_scores<DV>(dp, os, kWgRows, vs, kTile);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<32>(s);
    fence_regs<32>(dp);
    __syncthreads();  // every warpgroup is done with the v tile
    if (nkt >= 0) load_v(nkt);

    // ds = p·(dp − D)·scale with p = 2^(s·sl − lse2) on the selected keys, in place of s.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint64_t bits = qi[hf].finish(mw[hf], kt * kTile);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 4 * nt + 2 * hf + e;
          const float p = (bits >> (8 * nt + 2 * tq + e)) & 1 ? exp2_ftz(s[i] * sl[hf] - lse2[hf]) : 0.0f;
          s[i] = p * (dp[i] - Dr[hf]) * scale;
        }
    }
    wgmma_tile_product<DQK>(acc, s, ks);  // dq += ds·k
    kt = nkt;
  }
  cp_async_wait<0>();  // no tile: q and do copies still in flight
  __syncthreads();     // every warpgroup is done with the tiles in shared memory

  constexpr int room = L::bytes - 1024;
  if (dq16) write_staged<kWgRows, DQK, DQK, room>(smem, 64 * wg, 0, acc, wq, dq16, r0, T, NH, h);
  else write_staged<kWgRows, DQK, DQK, room>(smem, 64 * wg, 0, acc, wq, dq, r0, T, NH, h);
}

// ---- Hopper (sm_90a): the key-major pass on warpgroup MMAs, for dqk = dv = D (128 or 256) ----
// One block per key tile (64 keys) and head, walking the query tiles that select any of its keys, as key_kernel.
// k and v stay in shared memory; the query tiles (q | do) are double-buffered. The two warpgroups split the work on
// the same 64 keys: warpgroup 0 forms sᵀ = k·qᵀ, hands it (fp32) to warpgroup 1 through shared memory, forms pᵀ and
// adds dv += pᵀ·do; warpgroup 1 forms dpᵀ = v·doᵀ meanwhile, then the same pᵀ from sᵀ and dsᵀ = pᵀ·(dpᵀ − D)·scale
// as p_ds does, and adds dk += dsᵀ·q. The score products are wgmma m64n64k16 with both operands K-major from shared
// memory, the others take pᵀ and dsᵀ repacked into wgmma's A registers and q, do read N-major. dk | dv are added to
// once per element after the walk. Every matrix in shared memory is in the 128-byte-swizzle layout of
// cuda/wgmma.cuh; sᵀ goes through shared memory in the accumulators' own order, element i of thread x at [i][x].
template <int D>
struct KeyWg {
  static constexpr int k_bytes = kTile * D * 2, stage_bytes = 2 * k_bytes;  // k | v; a stage: q | do
  static constexpr int stage_at = 2 * k_bytes, p_at = stage_at + 2 * stage_bytes;
  static constexpr int bytes = p_at + kTile * kTile * 4 + 1024;  // + slack to align the tiles to 1024 bytes
  static_assert(D == 128 || D == 256);
};

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    key_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_do,
                     const bf16* __restrict__ kv, const int32_t* __restrict__ count,
                     const int32_t* __restrict__ seq_start, const int32_t* __restrict__ seq_len,
                     const uint32_t* __restrict__ mask, int64_t words,
                     const uint32_t* __restrict__ tmapT, int64_t wq, const float* __restrict__ lse_g,
                     const float* __restrict__ D_g, float* __restrict__ dkv, bf16* __restrict__ dkv16, int64_t T,
                     int64_t NH, float scale_log2, float scale) {
  using L = KeyWg<D>;
  constexpr int DQK = D, DV = D, DKV = 2 * D, NA = D / 2;  // NA: dv or dk accumulators per thread
  extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
  const uint32_t raw_s = smem_addr(wg_smem_raw), pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = wg_smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  float* Ps = reinterpret_cast<float*>(smem + L::p_at);  // sᵀ, [32][128 threads]
  __shared__ KeyPassRows rows[2];  // per query tile buffer
  __shared__ uint64_t bits[kTile];
  __shared__ uint32_t trow[kMaxTileWords];   // this key tile's row of the transposed tile map
  __shared__ __align__(8) uint64_t full[2];  // per query tile buffer: its q | do copies have landed

  const int64_t j0 = int64_t(blockIdx.x) * kTile, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int wg = warp >> 2, wr = warp & 3, xt = tid & 127;  // warpgroup, warp in it (keys 16·wr …), thread in it
  const uint32_t full_s = smem_addr(full);

  if (tid == 0) {
    tma_prefetch_map(&map_q);
    tma_prefetch_map(&map_do);
    mbar_init(full_s, 1);
    mbar_init(full_s + 8, 1);
    mbar_init_fence();
  }
  for (int64_t w = tid; w < wq; w += kThreads) trow[w] = tmapT[int64_t(blockIdx.x) * wq + w];
  sw128_load_rows<kTile, DQK, kThreads>(smem, kv, DKV, 0, j0, T, NH, h);
  sw128_load_rows<kTile, DV, kThreads>(smem + L::k_bytes, kv, DKV, DQK, j0, T, NH, h);
  cp_async_commit();
  __syncthreads();  // the tile map's row and the barriers are ready
  // A query tile's q | do by TMA (one thread; rows past T zero-filled) onto full[b], its rows' data by cp.async.
  // (Its 16 cp.async a thread, with their addresses, took a fifth of the pass's warp time on the H200.)
  auto issue = [&](int64_t qt, int b) {
    const int64_t r0 = qt * kTile;
    if (tid == 0) {
      const uint32_t st = smem_s + L::stage_at + b * L::stage_bytes, bar = full_s + 8 * b;
      mbar_arrive_expect_tx(bar, L::stage_bytes);
#pragma unroll
      for (int j = 0; j < D / 64; ++j) {
        tma_load_3d(st + j * kTile * 128, &map_q, bar, 64 * j, static_cast<int>(h), static_cast<int>(r0));
        tma_load_3d(st + L::k_bytes + j * kTile * 128, &map_do, bar, 64 * j, static_cast<int>(h),
                    static_cast<int>(r0));
      }
    }
    if (tid < kTile) {
      const int64_t t = r0 + tid;
      const bool in = t < T;
      const int64_t i = in ? t : 0, ih = in ? t * NH + h : 0;
      cp_async4(rows[b].cnt + tid, count + i, in);
      cp_async4(rows[b].s0 + tid, seq_start + i, in);
      cp_async4(rows[b].len + tid, seq_len + i, in);
      cp_async4(rows[b].lse2 + tid, lse_g + ih, in);
      cp_async4(rows[b].D + tid, D_g + ih, in);
    }
    cp_async_commit();
  };

  float acc[NA];  // warpgroup 0: dv [64 keys × D]; warpgroup 1: dk [64 keys × D]
#pragma unroll
  for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
  int64_t qt = next_tile(trow, wq, 0);
  if (qt >= 0) issue(qt, 0);
  for (int n = 0; qt >= 0; ++n) {
    const int b = n & 1;
    cp_async_wait<0>();
    fence_proxy_async();  // k and v (the first time), by cp.async
    mbar_wait(full_s + 8 * b, (n >> 1) & 1);
    __syncthreads();  // tile b and its rows visible; the readers of buffer b ^ 1, of bits and of sᵀ are done
    const int64_t nqt = next_tile(trow, wq, qt + 1);
    if (nqt >= 0) issue(nqt, b ^ 1);
    MaskWindow mw;  // this tile's key bits: the mask reads are in flight during the products
    const KeyPassRows& rb = rows[b];
    if (tid < kTile && rb.cnt[tid] > 0) mw.load(mask + (qt * kTile + tid) * words, words, j0 - rb.s0[tid]);

    const uint32_t ks = smem_s, vs = smem_s + L::k_bytes;
    const uint32_t qs = smem_s + L::stage_at + b * L::stage_bytes, os = qs + L::k_bytes;
    // x[4nt + 2hf + e] = (key 16wr + gq + 8hf, query 8nt + 2tq + e): sᵀ in warpgroup 0, dpᵀ in warpgroup 1.
    float x[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) x[i] = 0.0f;
    fence_regs<32>(x);
    wgmma_fence();
    // The same instructions in both warpgroups, on their own operands (a branch around wgmma would serialise it).
    const uint32_t xa = wg ? vs : ks, xb = wg ? os : qs;
    wgmma_scores<D>(x, xa, kTile, xb, kTile);
    wgmma_commit();
    if (tid < kTile) bits[tid] = rb.cnt[tid] > 0 ? mw.bits() : range64(j0 - rb.s0[tid], rb.len[tid]);
    wgmma_wait<0>();
    fence_regs<32>(x);
    __syncthreads();  // bits complete

    // Warpgroup 0 hands sᵀ over as it is, before its exponentials: warpgroup 1 forms the same pᵀ from it (the same
    // instructions, so the same bits) instead of waiting for them (13 % of the pass's warp time on the H200).
    if (wg == 0) {
#pragma unroll
      for (int i = 0; i < 32; ++i) Ps[i * 128 + xt] = x[i];
      asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // sᵀ is in for warpgroup 1
    } else {
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * nt + 2 * tq + e;
        const uint64_t bc = bits[c];
        const float sl = rb.cnt[c] ? scale_log2 : 0.0f, l2 = rb.lse2[c], Dc = rb.D[c];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 4 * nt + 2 * hf + e;
          const float si = wg ? Ps[i * 128 + xt] : x[i];
          const float pi = (bc >> (16 * wr + gq + 8 * hf)) & 1 ? exp2_ftz(si * sl - l2) : 0.0f;
          x[i] = wg ? pi * (x[i] - Dc) * scale : pi;  // pᵀ (warpgroup 0) or dsᵀ (warpgroup 1)
        }
      }
    wgmma_tile_product<D>(acc, x, wg ? qs : os);  // dv += pᵀ·do or dk += dsᵀ·q, by the same instructions
    qt = nqt;
  }
  cp_async_wait<0>();  // no tile: k and v copies still in flight
  __syncthreads();     // every warpgroup is done with the tiles in shared memory

  // The tile [64 keys][dk | dv]: warpgroup 1's dk, warpgroup 0's dv.
  constexpr int room = L::bytes - 1024, c0 = DQK;
  if (dkv16) write_staged<kTile, DKV, D, room>(smem, 0, wg == 0 ? c0 : 0, acc, wr, dkv16, j0, T, NH, h);
  else write_staged<kTile, DKV, D, room>(smem, 0, wg == 0 ? c0 : 0, acc, wr, dkv, j0, T, NH, h);
}

struct Layout {
  int64_t words, nqt, wk, wq;
  size_t lse, D, do16, mask, tmapT, tmap, end;  // byte offsets; mask … tmapT are zeroed before the build
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

Layout layout(int64_t T, int64_t NH, int64_t max_len, int64_t dv) {
  Layout L;
  L.words = mla_mask_words(max_len);
  L.nqt = ceil_div(T, kTile);
  L.wk = ceil_div(std::max<int64_t>(L.nqt, 1), 32);  // key tiles are query tiles: the same count
  L.wq = L.wk;
  const size_t f = sizeof(float), u = sizeof(uint32_t);
  L.lse = 0;
  L.D = align256(L.lse + T * NH * f);
  L.do16 = align256(L.D + T * NH * f);
  L.mask = align256(L.do16 + T * NH * dv * sizeof(bf16));
  L.tmapT = L.mask + T * L.words * u;
  L.tmap = align256(L.tmapT + L.nqt * L.wq * u);
  L.end = L.tmap + L.nqt * L.wk * u;
  return L;
}

// D[r] = Σ_d do[r, d]·o[r, d] over the rows r = (token, head) of width dv (a multiple of 8; 16-byte aligned rows), a
// warp a row, eight columns a lane at a time, lane sums added in a fixed order.
__global__ void delta_kernel(const bf16* __restrict__ do16, const bf16* __restrict__ o, float* __restrict__ D,
                             int64_t rows, int64_t dv) {
  const int lane = threadIdx.x & 31;
  const int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (r >= rows) return;
  float acc = 0.0f;
  for (int64_t d = 8 * lane; d < dv; d += 256) {
    const uint4 a = *reinterpret_cast<const uint4*>(do16 + r * dv + d);
    const uint4 b = *reinterpret_cast<const uint4*>(o + r * dv + d);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(__uint_as_float(av[i] << 16), __uint_as_float(bv[i] << 16), acc);
      acc = fmaf(__uint_as_float(av[i] & 0xffff0000u), __uint_as_float(bv[i] & 0xffff0000u), acc);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) D[r] = acc;
}

// stats: the stats pass forms lse and D; else the caller has.
template <int DQK, int DV>
void launch(const bf16* q, const bf16* kv, const bf16* do16, const int32_t* count, const int32_t* seq_start,
            const int32_t* seq_len, const uint32_t* mask, const Layout& L, const uint32_t* tmap,
            const uint32_t* tmapT, float* lse, float* D, float* dq, float* dkv, bf16* dq16, bf16* dkv16, int64_t T,
            int64_t NH, bool stats, cudaStream_t st) {
  using Ds = Dims<DQK, DV>;
  const float scale = 1.0f / sqrtf(static_cast<float>(DQK)), scale_log2 = scale * 1.4426950408889634f;
  // The operand tiles, then the block's row of the tile map (wk = wq words).
  const int row_bytes = static_cast<int>(ceil_div(L.wk, 4) * 16);
  const int qs_bytes = Ds::query_bytes(true) + row_bytes, qd_bytes = Ds::query_bytes(false) + row_bytes,
            k_bytes = Ds::key_bytes + row_bytes;
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(query_kernel<DQK, DV, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, qs_bytes));
  const dim3 grid(static_cast<unsigned>(L.nqt), static_cast<unsigned>(NH));
  if (stats) {
    query_kernel<DQK, DV, true><<<grid, kThreads, qs_bytes, st>>>(q, kv, do16, count, seq_start, seq_len, mask,
                                                                  L.words, tmap, L.wk, lse, D, dq, T, NH, scale_log2,
                                                                  scale);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  if constexpr (DQK == 64) {
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(query_kernel<DQK, DV, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, qd_bytes));
    query_kernel<DQK, DV, false><<<grid, kThreads, qd_bytes, st>>>(q, kv, do16, count, seq_start, seq_len, mask,
                                                                   L.words, tmap, L.wk, lse, D, dq, T, NH,
                                                                   scale_log2, scale);
  } else {
    // The pair's two rows of the tile map go after the tiles where they fit (T up to ~500k), else stay in memory.
    const int rows_bytes = static_cast<int>(ceil_div(2 * L.wk * 4, 16) * 16);
    cudaFuncAttributes fa{};
    NEXTLM_CUDA_CHECK(cudaFuncGetAttributes(&fa, dq_wgmma_kernel<DQK, DV>));
    int dev = 0, optin = 0;
    NEXTLM_CUDA_CHECK(cudaGetDevice(&dev));
    NEXTLM_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    const bool rows_in_smem =
        static_cast<int64_t>(fa.sharedSizeBytes) + DqWg<DQK, DV>::bytes + rows_bytes <= optin;
    const int bytes = DqWg<DQK, DV>::bytes + (rows_in_smem ? rows_bytes : 0);
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(dq_wgmma_kernel<DQK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    // kv [T, NH, DQK + DV] as (DQK + DV, NH, T), boxes of 64 columns × one head × 64 rows.
    const cuuint64_t dims[3] = {DQK + DV, static_cast<cuuint64_t>(NH), static_cast<cuuint64_t>(T)},
                     strides[2] = {(DQK + DV) * 2, static_cast<cuuint64_t>(NH) * (DQK + DV) * 2};
    const cuuint32_t box[3] = {64, 1, kTile};
    const CUtensorMap map_kv = bf16_tensor_map(kv, 3, dims, strides, box, "MLA attention backward");
    const dim3 pairs(static_cast<unsigned>(ceil_div(L.nqt, 2)), static_cast<unsigned>(NH));
    dq_wgmma_kernel<DQK, DV><<<pairs, kThreads, bytes, st>>>(map_kv, q, do16, count, seq_start, seq_len, mask,
                                                            L.words, tmap, L.wk, L.nqt, rows_in_smem, lse, D, dq,
                                                            dq16, T, NH, scale_log2, scale);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if constexpr (DQK == DV && (DQK == 128 || DQK == 256)) {
    constexpr int bytes = KeyWg<DQK>::bytes;
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(key_wgmma_kernel<DQK>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    // q and do [T, NH, D] as (D, NH, T), boxes of 64 columns × one head × 64 rows (one 128-byte-swizzled slab).
    const cuuint64_t dims[3] = {DQK, static_cast<cuuint64_t>(NH), static_cast<cuuint64_t>(T)},
                     strides[2] = {DQK * 2, static_cast<cuuint64_t>(NH) * DQK * 2};
    const cuuint32_t box[3] = {64, 1, kTile};
    const CUtensorMap map_q = bf16_tensor_map(q, 3, dims, strides, box, "MLA attention backward");
    const CUtensorMap map_do = bf16_tensor_map(do16, 3, dims, strides, box, "MLA attention backward");
    key_wgmma_kernel<DQK><<<grid, kThreads, bytes, st>>>(map_q, map_do, kv, count, seq_start, seq_len, mask, L.words,
                                                         tmapT, L.wq, lse, D, dkv, dkv16, T, NH, scale_log2, scale);
  } else {
    NEXTLM_CUDA_CHECK(
        cudaFuncSetAttribute(key_kernel<DQK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, k_bytes));
    key_kernel<DQK, DV><<<grid, kThreads, k_bytes, st>>>(q, kv, do16, count, seq_start, seq_len, mask, L.words,
                                                         tmapT, L.wq, lse, D, dkv, T, NH, scale_log2, scale);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool mla_backward_tc_bf16_outputs(int64_t dqk, int64_t dv) { return dqk == dv && (dqk == 128 || dqk == 256); }

bool mla_backward_tc_supported(int64_t dqk, int64_t dv) {
  return (dqk == 64 && dv == 64) || (dqk == 128 && dv == 128) || (dqk == 192 && dv == 128) ||
         (dqk == 256 && dv == 256);
}

size_t mla_sparse_attention_backward_tc_workspace_bytes(int64_t T, int64_t NH, int64_t max_len, int64_t dqk,
                                                         int64_t dv) {
  (void)dqk;
  return std::max<size_t>(layout(T, NH, max_len, dv).end, 1);
}

void mla_sparse_attention_backward_tc(const bf16* q, const bf16* kv, const int32_t* sel, const int32_t* count,
                                      const int32_t* seq_start, const int32_t* seq_len, const float* do_, float* dq,
                                      float* dkv, int64_t T, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                                      int64_t max_len, void* work, cudaStream_t st, const float* lse2,
                                      const bf16* o, bf16* dq16, bf16* dkv16) {
  if (T == 0 || NH == 0) return;
  const Layout L = layout(T, NH, max_len, dv);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  check(mla_backward_tc_supported(dqk, dv), "MLA attention backward on tensor cores: unsupported head dims ", dqk,
        "/", dv);
  check(NH <= 65535 && T < (int64_t{1} << 31) && max_sel >= 0 && max_len >= 1 && L.wk <= kMaxTileWords &&
            aligned(q) && aligned(kv) && aligned(work),
        "MLA attention backward on tensor cores: bad shape or unaligned buffers (T ", T, ", NH ", NH, ", max_sel ",
        max_sel, ", max_len ", max_len, ")");
  check(!lse2 == !o && (!o || aligned(o)),
        "MLA attention backward on tensor cores: the forward's lse2 and o come together (o 16-byte aligned)");
  check(!dq16 == !dkv16 && (!dq16 || (mla_backward_tc_bf16_outputs(dqk, dv) && aligned(dq16) && aligned(dkv16))),
        "MLA attention backward on tensor cores: bf16 dq and dkv come together, 16-byte aligned, for head dims 128 or "
        "256 alike (got ", dqk, "/", dv, ")");
  auto* base = static_cast<unsigned char*>(work);
  // The key passes only read lse (the stats pass, which writes it, does not run when the forward's is given).
  float* lse = lse2 ? const_cast<float*>(lse2) : reinterpret_cast<float*>(base + L.lse);
  float* D = reinterpret_cast<float*>(base + L.D);
  bf16* do16 = reinterpret_cast<bf16*>(base + L.do16);
  uint32_t* mask = reinterpret_cast<uint32_t*>(base + L.mask);
  uint32_t* tmapT = reinterpret_cast<uint32_t*>(base + L.tmapT);
  uint32_t* tmap = reinterpret_cast<uint32_t*>(base + L.tmap);

  NEXTLM_CUDA_CHECK(cudaMemsetAsync(mask, 0, L.tmap - L.mask, st));
  selection_tiles_kernel<kTile, kTile, kMaxTileWords><<<static_cast<unsigned>(L.nqt), kThreads, 0, st>>>(
      sel, count, seq_start, seq_len, mask, L.words, tmap, L.wk, tmapT, L.wq, T, max_sel);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  const int64_t n = T * NH * dv;
  to_bf16(do_, do16, n, st);
  const bool stats = !lse2;
  if (!stats) {
    delta_kernel<<<static_cast<unsigned>(ceil_div(T * NH * 32, kThreads)), kThreads, 0, st>>>(do16, o, D, T * NH, dv);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  auto run = [&](auto kernel) {
    kernel(q, kv, do16, count, seq_start, seq_len, mask, L, tmap, tmapT, lse, D, dq, dkv, dq16, dkv16, T, NH, stats,
           st);
  };
  if (dqk == 64 && dv == 64) return run(launch<64, 64>);
  if (dqk == 128 && dv == 128) return run(launch<128, 128>);
  if (dqk == 192 && dv == 128) return run(launch<192, 128>);
  return run(launch<256, 256>);
}

}  // namespace nextlm::cuda
