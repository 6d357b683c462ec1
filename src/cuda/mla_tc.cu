// MLA attention over the indexer's selection on tensor cores (mma.sync bf16 → fp32), flash-attention style: each
// block takes 64 consecutive packed tokens and one head, walks the keys in blocks of 64 with an online softmax, and
// masks every (query, key) pair by the query's selection, kept as a bitmask over its sequence's positions. Key
// blocks that no query of the block selects are skipped. A query whose selection is empty attends with equal weights
// to every key of its sequence (transformers' eager softmax of an all-masked row), as attention_kernel in dsa.cu.
// Head dims whose key width is a multiple of 64 and value width 128 or 256 (the model's 256/256 among them) run on
// Hopper's warpgroup MMAs (mla_wgmma_kernel); 64/64 on mma.sync (mla_tc_kernel).
#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/mla_mask.cuh"
#include "cuda/mma.cuh"
#include "cuda/tensor_map.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kRows = 64, kKeys = 64, kThreads = 128;

__global__ void selection_mask_kernel(const int32_t* sel, const int32_t* count, uint32_t* mask, int64_t T,
                                      int64_t max_sel, int64_t words) {
  const int64_t t = blockIdx.x;
  const int64_t n = count[t];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t j = sel[t * max_sel + i];
    atomicOr(mask + t * words + (j >> 5), 1u << (j & 31));
  }
}

template <int DQK, int DV>
struct MlaLayout {
  static constexpr int QS = DQK + 8, VS = DV + 8;
  static constexpr int bytes = (kRows * QS + kKeys * QS + kKeys * VS) * 2;
};

// One thread's two query rows (g and g + 8 of its warp's 16; the first is `first`), as both kernels hold them.
struct MlaRows {
  int64_t row[2];
  int32_t s0[2], len[2];  // as seq_start and seq_len hold them
  bool valid[2], uniform[2];  // uniform: an empty selection (equal weights over the sequence)

  __device__ void load(int64_t first, int64_t T, const int32_t* count, const int32_t* seq_start,
                       const int32_t* seq_len) {
    for (int hf = 0; hf < 2; ++hf) {
      row[hf] = first + 8 * hf;
      valid[hf] = row[hf] < T;
      const int64_t t = valid[hf] ? row[hf] : 0;
      s0[hf] = seq_start[t];
      len[hf] = seq_len[t];
      uniform[hf] = valid[hf] && count[t] == 0;
    }
  }
  // Widens the block's key range [*lo, *hi) to these rows' keys (a selection is causal: keys up to the row).
  __device__ void widen(int64_t* lo, int64_t* hi) const {
    for (int hf = 0; hf < 2; ++hf)
      if (valid[hf]) {
        atomicMin(reinterpret_cast<unsigned long long*>(lo), static_cast<unsigned long long>(s0[hf]));
        const int64_t end = uniform[hf] ? int64_t(s0[hf]) + len[hf] : row[hf] + 1;
        atomicMax(reinterpret_cast<unsigned long long*>(hi), static_cast<unsigned long long>(end));
      }
  }
  // Issues the reads of the mask words the rows' bits for keys j0 … j0 + 63 come from (bits_from combines them).
  __device__ void prefetch(int64_t j0, const uint32_t* mask, int64_t words, MaskWindow mw[2]) const {
    for (int hf = 0; hf < 2; ++hf)
      if (valid[hf] && !uniform[hf]) mw[hf].load(mask + row[hf] * words, words, j0 - s0[hf]);
  }
  // The rows' selected keys among j0 … j0 + 63, from the words prefetch(j0, …) read.
  __device__ void bits_from(int64_t j0, const MaskWindow mw[2], uint64_t out[2]) const {
    for (int hf = 0; hf < 2; ++hf)
      out[hf] = !valid[hf] ? 0 : uniform[hf] ? range64(j0 - s0[hf], len[hf]) : mw[hf].bits();
  }
  // Both at once.
  __device__ void bits(int64_t j0, const uint32_t* mask, int64_t words, uint64_t out[2]) const {
    MaskWindow mw[2];
    prefetch(j0, mask, words, mw);
    bits_from(j0, mw, out);
  }
  // o = oc / l in bf16 and, when lse2 is given, the log2-domain log-sum-exp (0 for a row without keys, as the
  // backward's stats pass forms it). oc[4nt + 2hf + e] = (row hf, value column 8nt + 2tq + e).
  template <int DV>
  __device__ void store(const float* oc, const float m[2], const float l[2], bf16* o, float* lse2, int NH, int h,
                        int tq) const {
    for (int hf = 0; hf < 2; ++hf) {
      if (!valid[hf]) continue;
      if (lse2 && tq == 0) lse2[row[hf] * NH + h] = m[hf] == -INFINITY ? 0.0f : m[hf] + log2f(l[hf]);
      const float inv = l[hf] > 0.0f ? 1.0f / l[hf] : 0.0f;
      bf16* out = o + (row[hf] * NH + h) * DV;
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt)
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * nt + 2 * tq) =
            __floats2bfloat162_rn(oc[4 * nt + 2 * hf] * inv, oc[4 * nt + 2 * hf + 1] * inv);
    }
  }
};

// One key block's step of the online softmax for row hf of a thread's two, but for the output: s[4nt + 2hf + e]
// holds the scores of (row hf, key 8nt + 2tq + e) and leaves as probabilities (masked by bits, scaled to the log2
// domain; 0 for every key of an empty selection: equal weights); m and l are the running max and sum. Returns the
// factor that takes the row's output accumulators to the new max.
__device__ __forceinline__ float softmax_row(float* s, int hf, uint64_t bits, bool uniform, float& m, float& l,
                                             float scale_log2, int tq) {
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[4 * nt + 2 * hf + e];
      x = (bits >> (8 * nt + 2 * tq + e)) & 1 ? (uniform ? 0.0f : x * scale_log2) : -INFINITY;
      mx = fmaxf(mx, x);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mnew = fmaxf(m, mx);
  const float alpha = mnew == -INFINITY ? 1.0f : exp2_ftz(m - mnew);  // m = −inf → 0
  const float ms = mnew == -INFINITY ? 0.0f : mnew;  // no key yet: every x is −inf, and 2^−inf = 0
  float sum = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[4 * nt + 2 * hf + e];
      x = exp2_ftz(x - ms);  // −inf → 0
      sum += x;
    }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  l = l * alpha + sum;
  m = mnew;
  return alpha;
}

// Row hf of the output accumulators oc (the layout of s, DV/8 n-tiles) times alpha.
template <int DV>
__device__ __forceinline__ void rescale_row(float* oc, int hf, float alpha) {
#pragma unroll
  for (int nt = 0; nt < DV / 8; ++nt) oc[4 * nt + 2 * hf] *= alpha, oc[4 * nt + 2 * hf + 1] *= alpha;
}

// The whole step of the online softmax for both rows but for adding P·V: the output rescaled at once.
template <int DV>
__device__ __forceinline__ void softmax_block(float* s, float* oc, const uint64_t bits[2], const bool uniform[2],
                                              float m[2], float l[2], float scale_log2, int tq) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) rescale_row<DV>(oc, hf, softmax_row(s, hf, bits[hf], uniform[hf], m[hf], l[hf],
                                                                     scale_log2, tq));
}

template <int DQK, int DV>
__global__ void __launch_bounds__(kThreads)
    mla_tc_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kv, const uint32_t* __restrict__ mask,
                  int64_t words, const int32_t* __restrict__ count, const int32_t* __restrict__ seq_start,
                  const int32_t* __restrict__ seq_len, bf16* __restrict__ o, float* __restrict__ lse2, int64_t T,
                  int NH, float scale_log2) {
  using L = MlaLayout<DQK, DV>;
  constexpr int QS = L::QS, VS = L::VS, DKV = DQK + DV;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + kRows * QS;
  bf16* Vs = Ks + kKeys * QS;
  __shared__ int64_t key_lo, key_hi;

  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  if (tid == 0) key_lo = INT64_MAX, key_hi = 0;

  for (int i = tid; i < kRows * (DQK / 8); i += kThreads) {
    const int r = i / (DQK / 8), p = i % (DQK / 8);
    const bool in = r0 + r < T;
    cp_async16(Qs + r * QS + p * 8, q + ((in ? r0 + r : 0) * NH + h) * DQK + p * 8, in);
  }
  cp_async_commit();

  MlaRows rw;
  rw.load(r0 + 16 * warp + gq, T, count, seq_start, seq_len);
  __syncthreads();  // key_lo / key_hi initialised
  rw.widen(&key_lo, &key_hi);
  cp_async_wait<0>();
  __syncthreads();
  const int64_t klo = key_lo, khi = key_hi;

  float oc[DV / 8][4];
#pragma unroll
  for (int nt = 0; nt < DV / 8; ++nt) oc[nt][0] = oc[nt][1] = oc[nt][2] = oc[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int64_t j0 = klo; j0 < khi; j0 += kKeys) {
    uint64_t bits[2];
    rw.bits(j0, mask, words, bits);
    // A barrier (the last block's K/V reads are done) that also tells whether any query selects a key here.
    if (!__syncthreads_or((bits[0] | bits[1]) != 0)) continue;
    for (int i = tid; i < kKeys * (DQK / 8); i += kThreads) {
      const int r = i / (DQK / 8), p = i % (DQK / 8);
      const bool in = j0 + r < T;
      cp_async16(Ks + r * QS + p * 8, kv + ((in ? j0 + r : 0) * NH + h) * DKV + p * 8, in);
    }
    for (int i = tid; i < kKeys * (DV / 8); i += kThreads) {
      const int r = i / (DV / 8), p = i % (DV / 8);
      const bool in = j0 + r < T;
      cp_async16(Vs + r * VS + p * 8, kv + ((in ? j0 + r : 0) * NH + h) * DKV + DQK + p * 8, in);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // Scores of this warp's 16 rows against the 64 keys.
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      uint32_t a[4];
      load_a(a, Qs + 16 * warp * QS + 16 * kk, QS);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        load_b_nk(b, Ks + 16 * np * QS + 16 * kk, QS);
        mma_bf16(s[2 * np], a, b[0], b[1]);
        mma_bf16(s[2 * np + 1], a, b[2], b[3]);
      }
    }
    softmax_block<DV>(&s[0][0], &oc[0][0], bits, rw.uniform, m, l, scale_log2, tq);
    // o += P·V, P straight from the score fragments.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < DV / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, Vs + 16 * kk * VS + 16 * np, VS);
        mma_bf16(oc[2 * np], a, b[0], b[1]);
        mma_bf16(oc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
  rw.store<DV>(&oc[0][0], m, l, o, lse2, NH, h, tq);
}

// ---- Hopper (sm_90a): the same attention on warpgroup MMAs ----
// Each block takes 128 consecutive packed tokens (two warpgroups of 64 rows) and one head. Q stays in shared memory
// for the whole walk; K and V of the selected key blocks (64 keys) go through two buffers each, filled by TMA.
// S = Q·Kᵀ is wgmma m64n64k16 from shared memory (Q and K both K-major); P, rounded to bf16, goes from the score
// accumulators into the A registers of O += P·V (m64n{DV}k16, V read N-major). Masking, the online softmax and the
// outputs are those of mla_tc_kernel, row for row.
// Software pipelined (flash-attention 3's intra-warpgroup overlap): while the tensor cores run P·V of block i, the
// warpgroup runs the softmax of block i + 1, whose scores were issued just before; the output is rescaled to block
// i + 1's max once P·V of block i is done, so the sums are those of the plain order (score, softmax and rescale, P·V
// per block), bit for bit. Iteration i reads K of block i + 1 and V of block i, and refills the buffers iteration
// i − 1 finished: K of block i + 2 where block i's K was, V of block i + 1 where block i − 1's V was, so each copy has
// a whole iteration to land. The mask words of the next candidate block are read an iteration ahead too.
// Shared memory, every matrix in the 128-byte-swizzle layout of cuda/wgmma.cuh: Q as DQK/64 slabs of [128 rows][64],
// then two K buffers (DQK/64 slabs of [64 keys][64]) and two V buffers (DV/64 blocks of [64 keys][64 value columns]).
constexpr int kWgRows = 128, kWgThreads = 256;

template <int DQK, int DV>
struct WgLayout {
  static constexpr int q_bytes = kWgRows * DQK * 2, k_bytes = kKeys * DQK * 2, v_bytes = kKeys * DV * 2;
  static constexpr int k_off(int b) { return q_bytes + b * k_bytes; }
  static constexpr int v_off(int b) { return q_bytes + 2 * k_bytes + b * v_bytes; }
  static constexpr int bytes = q_bytes + 2 * (k_bytes + v_bytes) + 1024;  // + slack to align the tiles to 1024 bytes
  static_assert(DQK % 64 == 0 && (DV == 128 || DV == 256) && k_bytes % 1024 == 0 && v_bytes % 1024 == 0);
};

// s = Q·Kᵀ for the warpgroup's 64 rows of Q at qs (a tile of kWgRows rows) and the 64 keys at ks, issued and
// committed.
template <int DQK>
__device__ __forceinline__ void issue_scores(float* s, uint32_t qs, uint32_t ks) {
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.0f;
  fence_regs<32>(s);
  wgmma_fence();
  wgmma_scores<DQK>(s, qs, kWgRows, ks, kKeys);
  wgmma_commit();
}

template <int DQK, int DV>
__global__ void __launch_bounds__(kWgThreads, 1)
    mla_wgmma_kernel(const __grid_constant__ CUtensorMap map_kv, const bf16* __restrict__ q,
                     const uint32_t* __restrict__ mask, int64_t words, const int32_t* __restrict__ count,
                     const int32_t* __restrict__ seq_start, const int32_t* __restrict__ seq_len,
                     bf16* __restrict__ o, float* __restrict__ lse2, int64_t T, int NH, float scale_log2) {
  using L = WgLayout<DQK, DV>;
  constexpr int NO = DV / 2;  // output accumulators per thread
  extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
  const uint32_t raw_s = smem_addr(wg_smem_raw), pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = wg_smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  __shared__ int64_t key_lo, key_hi;
  __shared__ __align__(8) uint64_t bars[4];  // K buffers 0 and 1, V buffers 0 and 1: their copies have landed

  const int64_t r0 = int64_t(blockIdx.x) * kWgRows;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const uint32_t bar_s = smem_addr(bars);
  if (tid == 0) {
    key_lo = INT64_MAX, key_hi = 0;
    tma_prefetch_map(&map_kv);
    for (int i = 0; i < 4; ++i) mbar_init(bar_s + 8 * i, 1);
    mbar_init_fence();
  }

  sw128_load_rows<kWgRows, DQK, kWgThreads>(smem, q, DQK, 0, r0, T, NH, h);
  // Block n's K and V go to buffers n & 1, by TMA from one thread (keys past T zero-filled); its K's copies complete
  // K barrier n & 1's phase n >> 1, its V's likewise. (Against 16 cp.async a thread an iteration: 1.80 → 1.76 ms in
  // the LoRA step's kernel traces on the H200.)
  auto load = [&](int64_t j0, int b, int first, int n, int which) {
    if (tid != 0) return;
    const uint32_t bar = bar_s + 8 * (2 * which + b), dst = smem_s + (which ? L::v_off(b) : L::k_off(b));
    mbar_arrive_expect_tx(bar, n * kKeys * 128);
    for (int j = 0; j < n; ++j)
      tma_load_3d(dst + j * kKeys * 128, &map_kv, bar, first + 64 * j, h, static_cast<int>(j0));
  };
  auto load_k = [&](int64_t j0, int b) { load(j0, b, 0, DQK / 64, 0); };
  auto load_v = [&](int64_t j0, int b) { load(j0, b, DQK, DV / 64, 1); };
  auto wait_k = [&](int64_t n) { mbar_wait(bar_s + 8 * (n & 1), (n >> 1) & 1); };
  auto wait_v = [&](int64_t n) { mbar_wait(bar_s + 8 * (2 + (n & 1)), (n >> 1) & 1); };

  MlaRows rw;
  rw.load(r0 + 64 * wg + 16 * wq + gq, T, count, seq_start, seq_len);
  __syncthreads();  // key_lo / key_hi initialised
  rw.widen(&key_lo, &key_hi);
  __syncthreads();
  const int64_t klo = key_lo, khi = key_hi;

  // The candidate block pj (block-uniform) and this thread's mask words for it, read ahead of their use.
  MaskWindow pw[2];
  int64_t pj = klo;
  auto prefetch = [&](int64_t j0) {
    pj = j0;
    if (j0 < khi) rw.prefetch(j0, mask, words, pw);
  };
  // The first block from the candidate on that some row of the block selects (khi if none), with this thread's rows'
  // bits for it. Block-wide: a barrier per block looked at, at least one.
  auto resolve = [&](uint64_t out[2]) {
    for (;;) {
      bool any = false;
      if (pj < khi) {
        rw.bits_from(pj, pw, out);
        any = (out[0] | out[1]) != 0;
      }
      if (__syncthreads_or(any) || pj >= khi) return pj < khi ? pj : khi;
      prefetch(pj + kKeys);
    }
  };

  float oc[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) oc[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float s[32];                     // scores, then probabilities: s[4nt + 2hf + e] = (row hf, key 8nt + 2tq + e)
  uint32_t p[4][4];                // the probabilities of the block whose P·V is next, as wgmma A registers
  uint64_t b0[2], b1[2], b2[2];    // this thread's rows' bits for blocks 0 (then i), i + 1 and i + 2
  const uint32_t qs = smem_s + wg * 64 * 128;

  prefetch(klo);
  int64_t j0 = resolve(b0);
  if (j0 < khi) load_k(j0, 0), load_v(j0, 0);
  prefetch(j0 + kKeys);
  int64_t j1 = resolve(b1);
  if (j1 < khi) load_k(j1, 1);
  cp_async_commit();  // with the Q tile
  prefetch(j1 + kKeys);
  if (j0 < khi) {  // block 0's scores and probabilities (the output is still zero: no rescale)
    cp_async_wait<0>();
    fence_proxy_async();  // Q, by cp.async
    wait_k(0);
    __syncthreads();
    issue_scores<DQK>(s, qs, smem_s + L::k_off(0));
    wgmma_wait<0>();
    fence_regs<32>(s);
    for (int hf = 0; hf < 2; ++hf) softmax_row(s, hf, b0[hf], rw.uniform[hf], m[hf], l[hf], scale_log2, tq);
    pack_tile(p, s);
  }
  for (int i = 0; j0 < khi; ++i) {
    if (j1 < khi) wait_k(i + 1);  // K of block i + 1 and V of block i, issued an iteration ago
    wait_v(i);
    // resolve's barrier finds every warpgroup done with iteration i − 1.
    const int64_t j2 = resolve(b2);
    if (j2 < khi) load_k(j2, i & 1);
    if (j1 < khi) load_v(j1, (i + 1) & 1);
    prefetch(j2 + kKeys);
    // Block i + 1's scores, also past the last block (on a stale K buffer, unused): ptxas serialises wgmma under a
    // branch it cannot prove warpgroup-uniform.
    const bool next = j1 < khi;
    issue_scores<DQK>(s, qs, smem_s + L::k_off((i + 1) & 1));
    wgmma_tile_issue<DV>(oc, p, smem_s + L::v_off(i & 1));  // o += P·V of block i
    wgmma_wait<1>();
    fence_regs<32>(s);
    float alpha[2] = {1.0f, 1.0f};
    if (next)  // while P·V runs
      for (int hf = 0; hf < 2; ++hf)
        alpha[hf] = softmax_row(s, hf, b1[hf], rw.uniform[hf], m[hf], l[hf], scale_log2, tq);
    wgmma_wait<0>();
    fence_regs<NO>(oc);
    fence_regs<16>(&p[0][0]);
    if (next) {
      for (int hf = 0; hf < 2; ++hf) rescale_row<DV>(oc, hf, alpha[hf]);
      pack_tile(p, s);
    }
    j0 = j1, j1 = j2;
    b1[0] = b2[0], b1[1] = b2[1];
  }
  cp_async_wait<0>();  // no block: Q's copies still in flight
  rw.store<DV>(oc, m, l, o, lse2, NH, h, tq);
}

template <int DQK, int DV>
void launch_wgmma(const bf16* q, const bf16* kv, const uint32_t* mask, int64_t words, const int32_t* count,
                  const int32_t* seq_start, const int32_t* seq_len, bf16* o, float* lse2, int64_t T, int64_t NH,
                  cudaStream_t st) {
  const int bytes = WgLayout<DQK, DV>::bytes;
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(mla_wgmma_kernel<DQK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const float scale_log2 = 1.4426950408889634f / sqrtf(static_cast<float>(DQK));
  check(T < (int64_t{1} << 31), "MLA attention on tensor cores: ", T, " tokens (TMA coordinates are 32-bit)");
  // kv [T, NH, DQK + DV] as (DQK + DV, NH, T), boxes of 64 columns × one head × 64 keys.
  const cuuint64_t dims[3] = {DQK + DV, static_cast<cuuint64_t>(NH), static_cast<cuuint64_t>(T)},
                   strides[2] = {(DQK + DV) * 2, static_cast<cuuint64_t>(NH) * (DQK + DV) * 2};
  const cuuint32_t box[3] = {64, 1, kKeys};
  const CUtensorMap map_kv = bf16_tensor_map(kv, 3, dims, strides, box, "MLA attention");
  mla_wgmma_kernel<DQK, DV><<<dim3(static_cast<unsigned>(ceil_div(T, kWgRows)), static_cast<unsigned>(NH)),
                              kWgThreads, bytes, st>>>(map_kv, q, mask, words, count, seq_start, seq_len, o, lse2, T,
                                                       static_cast<int>(NH), scale_log2);
}

template <int DQK, int DV>
void launch(const bf16* q, const bf16* kv, const uint32_t* mask, int64_t words, const int32_t* count,
            const int32_t* seq_start, const int32_t* seq_len, bf16* o, float* lse2, int64_t T, int64_t NH,
            cudaStream_t st) {
  const int bytes = MlaLayout<DQK, DV>::bytes;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(mla_tc_kernel<DQK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const float scale_log2 = 1.4426950408889634f / sqrtf(static_cast<float>(DQK));
  mla_tc_kernel<DQK, DV><<<dim3(static_cast<unsigned>(ceil_div(T, kRows)), static_cast<unsigned>(NH)), kThreads,
                           bytes, st>>>(q, kv, mask, words, count, seq_start, seq_len, o, lse2, T,
                                        static_cast<int>(NH), scale_log2);
}

}  // namespace

bool mla_tc_supported(int64_t dqk, int64_t dv) {
  return (dqk == 64 && dv == 64) || (dqk == 128 && dv == 128) || (dqk == 192 && dv == 128) ||
         (dqk == 256 && dv == 256);
}

int64_t mla_mask_words(int64_t max_len) { return ceil_div(std::max<int64_t>(max_len, 1), 32); }

void mla_sparse_attention_tc(const bf16* q, const bf16* kv, const int32_t* sel, const int32_t* count,
                             const int32_t* seq_start, const int32_t* seq_len, bf16* o, uint32_t* mask,
                             int64_t words, int64_t T, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                             cudaStream_t st, float* lse2) {
  if (!T) return;
  NEXTLM_CUDA_CHECK(cudaMemsetAsync(mask, 0, static_cast<size_t>(T * words) * sizeof(uint32_t), st));
  selection_mask_kernel<<<static_cast<unsigned>(T), 128, 0, st>>>(sel, count, mask, T, max_sel, words);
  if (dqk == 64 && dv == 64) return launch<64, 64>(q, kv, mask, words, count, seq_start, seq_len, o, lse2, T, NH, st);
  if (dqk == 128 && dv == 128)
    return launch_wgmma<128, 128>(q, kv, mask, words, count, seq_start, seq_len, o, lse2, T, NH, st);
  if (dqk == 192 && dv == 128)
    return launch_wgmma<192, 128>(q, kv, mask, words, count, seq_start, seq_len, o, lse2, T, NH, st);
  if (dqk == 256 && dv == 256)
    return launch_wgmma<256, 256>(q, kv, mask, words, count, seq_start, seq_len, o, lse2, T, NH, st);
  fail("MLA attention on tensor cores: unsupported head dims ", dqk, "/", dv);
}

}  // namespace nextlm::cuda
