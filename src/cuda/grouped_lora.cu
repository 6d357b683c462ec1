// Grouped per-expert LoRA (see grouped_lora.h): three mma.sync m16n8k16 bf16 → fp32 kernels over the MoE's
// permuted rows that together do train.cu's per-expert lora_forward / lora_backward for every expert at once.
//   down_kernel  P [n, ldr] = bf16(scale · X·W_eᵀ)    (u from x and A_e; gs from dy and B_e)
//   up_kernel    Y [n, N] += P·W_eᵀ                   (y from u and B_e; dx from gs and A_e)
//   grad_kernel  G_e += X_eᵀ·P_e over e's rows         (dB_e from dy and u; dA_e from x and gs)
// All of them are memory-bound: the rank is small (r ≤ 64), so the MMAs only keep the arithmetic off the critical
// path; what matters is streaming X / Y once with enough bytes in flight (cp.async pipelines, several blocks per SM).
#include "cuda/grouped_lora.h"

#include <algorithm>
#include <mutex>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

// ---- Expert-aligned row tiles (down_kernel, up_kernel) ----
// Expert e owns ceil(rows_e / kBM) tiles of kBM consecutive rows from offsets[e] (its last one shorter), numbered
// expert-major; an empty expert owns none. Tiles never straddle two experts, so a block applies one W_e. Each non-empty
// expert wastes at most one partial tile, so there are at most ceil(offsets[E] / kBM) + E ≤ ceil(n / kBM) + E tiles:
// the host launches that many blocks and those past the last tile return at once.
constexpr int kBM = 64;

// The tile `tile` of the block: its expert, first row and row count, the same in every thread; false when past the
// last tile (then the whole block returns). s_start: E + 1 ints of shared memory, free again once this returns.
// The per-expert tile counts are prefix-summed by a block-wide scan (ITEMS experts per thread and round), then the
// owning expert is the last e with start[e] ≤ tile (empty experts share their successor's start).
template <int THREADS>
__device__ bool find_tile(const int32_t* __restrict__ offsets, int E, int tile, int* s_start, int& e_out,
                          int64_t& row0, int& rows) {
  constexpr int ITEMS = 4;
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage tmp;
  int carry = 0;
  for (int base = 0; base < E; base += THREADS * ITEMS) {
    const int e0 = base + static_cast<int>(threadIdx.x) * ITEMS;
    int off[ITEMS + 1], cnt[ITEMS], ex[ITEMS];
#pragma unroll
    for (int i = 0; i <= ITEMS; ++i) off[i] = e0 + i <= E ? offsets[e0 + i] : 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) cnt[i] = e0 + i < E ? (max(off[i + 1] - off[i], 0) + kBM - 1) / kBM : 0;
    int total;
    Scan(tmp).ExclusiveSum(cnt, ex, total);  // total: every thread gets the round's sum
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
      if (e0 + i < E) s_start[e0 + i] = carry + ex[i];
    carry += total;
    __syncthreads();  // tmp is reused by the next round; s_start is complete after the last
  }
  if (tile >= carry) return false;
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_start[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  const int begin = offsets[lo];
  e_out = lo;
  row0 = begin + int64_t(tile - s_start[lo]) * kBM;
  rows = static_cast<int>(min(int64_t{kBM}, offsets[lo + 1] - row0));
  return true;
}

__device__ __forceinline__ void store_bf16x2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// ---- down_kernel: P [n, ldp] = bf16(scale · X·W_eᵀ) on every expert's rows ----
// X bf16 [n, K] (row stride ldx); W_e(j, k), j < r, stored as
//   kFlatW = false: A_e [r, K] row-major, W_e(j, k) = A_e[j·K + k]   (u = x·A_eᵀ)
//   kFlatW = true:  B_e [K, r] row-major, W_e(j, k) = B_e[k·r + j]   (gs = dy·B_e)
// One block per row tile, four warps of 16 rows each; K streams through a kDownStages-deep cp.async pipeline in
// chunks of kDownBK. A chunk of A_e is r row segments of 16-byte pieces, stored [j][k] (rows j ≥ r zero-filled) and
// read with ldmatrix; a chunk of B_e is the contiguous run B_e[k0·r … (k0 + kDownBK)·r) (16-byte aligned since
// k0·r·2 is a multiple of 128), copied as is and read element by element (r need not be a multiple of 8), masked to
// j < r. Columns past K zero-fill in both X and W, so stale shared memory never meets a product. The r sums of a
// row are complete in the warp that owns the row: scale and bf16 rounding happen once, on the full fp32 sum, as
// train.cu's scaled_bf16 does after the GEMM. PARTS = 2 (A_e factors only): two adapters' A_e on the same X (W and
// W1), their rows side by side in a stage, into P and P1; each column's sum is the chain of MMAs one launch makes.
constexpr int kDownThreads = 128;
constexpr int kDownBK = 64;
constexpr int kDownStages = 3;
constexpr int kDownLd = kDownBK + 8;  // padded row: the 8 rows of an ldmatrix phase fall in distinct bank groups

template <int RP>
constexpr int down_stage_elems() {
  return (kBM + RP) * kDownLd;
}

template <int RP, bool kFlatW, int PARTS = 1>
__global__ void __launch_bounds__(kDownThreads)
    down_kernel(const bf16* __restrict__ X, int64_t ldx, const int32_t* __restrict__ xrows,
                const int32_t* __restrict__ offsets, int E, const bf16* const* __restrict__ W, int r, int K,
                float scale, bf16* __restrict__ P, int ldp, const bf16* const* __restrict__ W1 = nullptr,
                bf16* __restrict__ P1 = nullptr) {
  static_assert(PARTS == 1 || (PARTS == 2 && !kFlatW), "two parts: A_e factors only");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  constexpr int NT = PARTS * RP / 8, STAGE = down_stage_elems<PARTS * RP>();
  int e, rows;
  int64_t row0;
  if (!find_tile<kDownThreads>(offsets, E, blockIdx.x, reinterpret_cast<int*>(smem_raw), e, row0, rows)) return;
  __syncthreads();  // s_start (the same shared memory as the stages) has been read by every thread
  const bf16* We = W[e];
  const bf16* We1 = PARTS == 2 ? W1[e] : nullptr;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int KT = (K + kDownBK - 1) / kDownBK;
  // The X rows this thread copies, the same in every stage: row0 + row, or xrows[row0 + row] (null past the tile).
  constexpr int kXCopies = kBM * (kDownBK / 8) / kDownThreads;
  const bf16* xsrc[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int row = (tid + i * kDownThreads) / (kDownBK / 8);
    xsrc[i] = row < rows ? X + (xrows ? int64_t(xrows[row0 + row]) : row0 + row) * ldx : nullptr;
  }

  auto load_stage = [&](int kt) {
    bf16* xs = smem + (kt % kDownStages) * STAGE;
    bf16* ws = xs + kBM * kDownLd;
    const int k0 = kt * kDownBK;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int p = tid + i * kDownThreads, row = p / (kDownBK / 8), c = p % (kDownBK / 8) * 8;
      const bool v = xsrc[i] && k0 + c < K;
      cp_async16(xs + row * kDownLd + c, v ? xsrc[i] + k0 + c : X, v);
    }
    if constexpr (kFlatW) {
      const int valid = min(kDownBK, K - k0) * r;  // a multiple of 8: K − k0 is
      for (int p = tid; p < kDownBK * r / 8; p += kDownThreads) {
        const bool v = p * 8 < valid;
        cp_async16(ws + p * 8, v ? We + int64_t(k0) * r + p * 8 : We, v);
      }
    } else {  // part q's rows at q·RP (rows j ≥ r of each zero-filled)
      for (int p = tid; p < PARTS * RP * (kDownBK / 8); p += kDownThreads) {
        const int j = p / (kDownBK / 8), c = p % (kDownBK / 8) * 8, q = j / RP, jj = j % RP;
        const bf16* Wq = q ? We1 : We;
        const bool v = jj < r && k0 + c < K;
        cp_async16(ws + j * kDownLd + c, v ? Wq + int64_t(jj) * K + k0 + c : We, v);
      }
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  const bool active = warp * 16 < rows;  // a short tile's empty warps skip the MMAs (not the loads and barriers)

#pragma unroll
  for (int s = 0; s < kDownStages - 1; ++s) {
    if (s < KT) load_stage(s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kDownStages - 2>();
    __syncthreads();  // chunk kt is in for every thread; every warp is done with chunk kt − 1, whose stage refills
    if (kt + kDownStages - 1 < KT) load_stage(kt + kDownStages - 1);
    cp_async_commit();
    if (!active) continue;
    const bf16* xs = smem + (kt % kDownStages) * STAGE;
    const bf16* ws = xs + kBM * kDownLd;
#pragma unroll
    for (int kk = 0; kk < kDownBK; kk += 16) {
      uint32_t a[4];
      load_a(a, xs + warp * 16 * kDownLd + kk, kDownLd);
      if constexpr (kFlatW) {
        const uint16_t* w16 = reinterpret_cast<const uint16_t*>(ws);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int j = nt * 8 + g;
          uint32_t b0 = 0, b1 = 0;
          if (j < r) {
            const uint16_t* q = w16 + (kk + 2 * t4) * r + j;  // (k, j) at k·r + j; k = kk + 2t, +1, +8, +9
            b0 = uint32_t(q[0]) | uint32_t(q[r]) << 16;
            b1 = uint32_t(q[8 * r]) | uint32_t(q[9 * r]) << 16;
          }
          mma_bf16(acc[nt], a, b0, b1);
        }
      } else {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          load_b_nk(b, ws + np * 16 * kDownLd + kk, kDownLd);
          mma_bf16(acc[2 * np], a, b[0], b[1]);
          mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
      }
    }
  }
  if (!active) return;
  // Columns r … ldp − 1 of P are written as zeros (ldp ≤ RP); part q's columns go to its own P.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + g + 8 * h;
    if (row >= rows) continue;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int q = nt * 8 / RP, col = nt * 8 % RP + 2 * t4;
      if (col >= ldp) continue;
      bf16* out = (q ? P1 : P) + (row0 + row) * ldp;
      store_bf16x2(out + col, col < r ? scale * acc[nt][2 * h] : 0.0f,
                   col + 1 < r ? scale * acc[nt][2 * h + 1] : 0.0f);
    }
  }
}

// ---- up_kernel: Y [n, N] += P·W_eᵀ on every expert's rows ----
// P bf16 [n, ldp] (columns past r ignored), Y fp32 (row stride ldy); W_e(c, j), c < N, j < r, stored as
//   kFlatW = true:  B_e [N, r] row-major, W_e(c, j) = B_e[c·r + j]   (y += u·B_eᵀ)
//   kFlatW = false: A_e [r, N] row-major, W_e(c, j) = A_e[j·N + c]   (dx += gs·A_e)
// One block per (row tile, slice of kUpCols columns), eight warps: four along the rows (16 each) × two along the
// columns (64 each). The P tile (64 × RP, zero-padded past ldp) is loaded once and held as A fragments; the slice's
// columns go kUpBN at a time through a double-buffered W chunk: B_e's is the contiguous run B_e[c0·r … (c0 + kUpBN)·r)
// read element by element (masked to j < r), A_e's is r row segments stored [j][c] (rows j ≥ r zero-filled) and read
// with ldmatrix.trans. Each thread loads its Y elements before waiting for the chunk, adds the fp32 product once
// (Y + Σ_j, as a GEMM with beta = 1) and writes them back: every Y element has one owner, so there are no races.
constexpr int kUpThreads = 256;
constexpr int kUpBN = 128;
constexpr int kUpCols = 512;
constexpr int kUpLdW = kUpBN + 8;

template <int RP>
constexpr int up_smem_bytes() {
  return (kBM * (RP + 8) + 2 * RP * kUpLdW) * 2;
}

template <int RP, bool kFlatW>
__global__ void __launch_bounds__(kUpThreads, 2)
    up_kernel(const bf16* __restrict__ P, int ldp, const int32_t* __restrict__ offsets, int E,
              const bf16* const* __restrict__ W, int r, int N, float* __restrict__ Y, int64_t ldy) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int LDP = RP + 8, KS = RP / 16, WBUF = RP * kUpLdW;
  bf16* ps = reinterpret_cast<bf16*>(smem_raw);
  bf16* wbuf = ps + kBM * LDP;
  int e, rows;
  int64_t row0;
  if (!find_tile<kUpThreads>(offsets, E, blockIdx.x, reinterpret_cast<int*>(smem_raw), e, row0, rows)) return;
  __syncthreads();  // s_start (the same shared memory as ps and wbuf) has been read by every thread
  const bf16* We = W[e];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;
  const int c_begin = blockIdx.y * kUpCols;
  const int nchunks = (min(kUpCols, N - c_begin) + kUpBN - 1) / kUpBN;

  for (int p = tid; p < kBM * (RP / 8); p += kUpThreads) {
    const int row = p / (RP / 8), c = p % (RP / 8) * 8;
    const bool v = row < rows && c < ldp;
    cp_async16(ps + row * LDP + c, v ? P + (row0 + row) * ldp + c : P, v);
  }
  auto load_w = [&](int i) {
    bf16* ws = wbuf + (i & 1) * WBUF;
    const int c0 = c_begin + i * kUpBN;
    if constexpr (kFlatW) {
      const int valid = min(kUpBN, N - c0) * r;  // a multiple of 8: N − c0 is
      for (int p = tid; p < kUpBN * r / 8; p += kUpThreads) {
        const bool v = p * 8 < valid;
        cp_async16(ws + p * 8, v ? We + int64_t(c0) * r + p * 8 : We, v);
      }
    } else {
      for (int p = tid; p < RP * (kUpBN / 8); p += kUpThreads) {
        const int j = p / (kUpBN / 8), c = p % (kUpBN / 8) * 8;
        const bool v = j < r && c0 + c < N;
        cp_async16(ws + j * kUpLdW + c, v ? We + int64_t(j) * N + c0 + c : We, v);
      }
    }
  };
  load_w(0);
  cp_async_commit();  // the first group also holds the P tile

  const bool active = wm * 16 < rows;
  uint32_t a[KS][4];
#pragma unroll 1
  for (int i = 0; i < nchunks; ++i) {
    if (i + 1 < nchunks) load_w(i + 1);
    cp_async_commit();
    const int cw = c_begin + i * kUpBN + wn * 64;  // this warp's first column
    float yv[8][4];
    if (active) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wm * 16 + g + 8 * h;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int col = cw + nt * 8 + 2 * t4;
          float2 v = make_float2(0.0f, 0.0f);
          if (row < rows && col < N) v = *reinterpret_cast<const float2*>(Y + (row0 + row) * ldy + col);
          yv[nt][2 * h] = v.x;
          yv[nt][2 * h + 1] = v.y;
        }
      }
    }
    cp_async_wait<1>();
    __syncthreads();  // chunk i (and, at i = 0, the P tile) is in for every thread
    if (active) {
      if (i == 0) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) load_a(a[ks], ps + wm * 16 * LDP + ks * 16, LDP);
      }
      float acc[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
      const bf16* ws = wbuf + (i & 1) * WBUF;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        if constexpr (kFlatW) {
          const uint16_t* w16 = reinterpret_cast<const uint16_t*>(ws);
          const int j = ks * 16 + 2 * t4;  // b0: j, j + 1; b1: j + 8, j + 9
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const uint16_t* q = w16 + (wn * 64 + nt * 8 + g) * r;  // (c, j) at c·r + j
            const uint32_t b0 = (j < r ? uint32_t(q[j]) : 0u) | (j + 1 < r ? uint32_t(q[j + 1]) << 16 : 0u);
            const uint32_t b1 = (j + 8 < r ? uint32_t(q[j + 8]) : 0u) | (j + 9 < r ? uint32_t(q[j + 9]) << 16 : 0u);
            mma_bf16(acc[nt], a[ks], b0, b1);
          }
        } else {
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            load_b_kn(b, ws + ks * 16 * kUpLdW + wn * 64 + np * 16, kUpLdW);
            mma_bf16(acc[2 * np], a[ks], b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a[ks], b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wm * 16 + g + 8 * h;
        if (row >= rows) continue;
        float* out = Y + (row0 + row) * ldy;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int col = cw + nt * 8 + 2 * t4;
          if (col < N)
            *reinterpret_cast<float2*>(out + col) =
                make_float2(yv[nt][2 * h] + acc[nt][2 * h], yv[nt][2 * h + 1] + acc[nt][2 * h + 1]);
        }
      }
    }
    __syncthreads();  // every warp is done with chunk i's buffer before chunk i + 2 is copied into it
  }
}

// ---- grad_kernel: G_e(q, j) += Σ over e's rows of X[row, q]·P[row, j] ----
// X bf16 (row stride ldx), q < Q; P bf16 [n, ldp], j < r; G_e fp32 stored as
//   kJMajor = false: [Q, r], G_e(q, j) at q·r + j   (dB_e from dy and u)
//   kJMajor = true:  [r, Q], G_e(q, j) at j·Q + q   (dA_e from x and gs)
// One block per (column tile of kGradBQ, expert): M = q (four warps × 32), N = j, K = the expert's rows, walked in
// order from offsets[e] in chunks of kGradBK through a cp.async pipeline (X chunks read with ldmatrix.trans as the
// transposed A operand, P chunks [row][j] with ldmatrix.trans as B). Rows past the expert and columns past Q or ldp
// zero-fill. The block is the only writer of its G_e elements (one read-add-write each, after the sum, or with
// `overwrite` one store of the sum: zeros for an expert without rows), and its sum runs over the chunks in order with
// a fixed MMA order inside: the bits depend on the expert's rows alone.
constexpr int kGradThreads = 128;
constexpr int kGradBQ = 128;
constexpr int kGradBK = 32;
constexpr int kGradStages = 4;
constexpr int kGradLdX = kGradBQ + 8;

template <int RP>
constexpr int grad_smem_bytes() {
  return kGradStages * kGradBK * (kGradLdX + RP + 8) * 2;
}

// PARTS = 2: two gradients over the same X, G_e from P and G1_e from P1 (both [n, ldp]), as two launches would form
// them (each column j's sum is the same chain of MMAs), from one pass over X.
template <int RP, bool kJMajor, int PARTS = 1>
__global__ void __launch_bounds__(kGradThreads)
    grad_kernel(const bf16* __restrict__ X, int64_t ldx, const int32_t* __restrict__ xrows,
                const bf16* __restrict__ P, int ldp, const int32_t* __restrict__ offsets, float* const* __restrict__ G,
                int r, int Q, bool overwrite, const bf16* __restrict__ P1 = nullptr,
                float* const* __restrict__ G1 = nullptr) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  constexpr int LDP = PARTS * RP + 8, NT = PARTS * RP / 8, STAGE = kGradBK * (kGradLdX + LDP);
  const int e = blockIdx.y;
  const int r0 = offsets[e], rows = max(offsets[e + 1] - r0, 0);
  if (rows == 0 && !overwrite) return;  // (overwriting: an expert without rows gets zeros)
  const int q0 = blockIdx.x * kGradBQ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int KT = (rows + kGradBK - 1) / kGradBK;
  // With xrows, the X rows of a chunk's copies are read a chunk ahead of them (their loads then wait on nothing):
  // xr holds those of the next chunk to be loaded.
  constexpr int kXCopies = kGradBK * (kGradBQ / 8) / kGradThreads;
  int xr[kXCopies];
  auto fetch_rows = [&](int kt) {
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int row = kt * kGradBK + (tid + i * kGradThreads) / (kGradBQ / 8);
      xr[i] = row < rows ? (xrows ? xrows[r0 + row] : r0 + row) : -1;
    }
  };
  fetch_rows(0);

  auto load_stage = [&](int kt) {
    bf16* xs = smem + (kt % kGradStages) * STAGE;
    bf16* ps = xs + kGradBK * kGradLdX;
    const int rr = kt * kGradBK;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int p = tid + i * kGradThreads, row = p / (kGradBQ / 8), c = p % (kGradBQ / 8) * 8;
      const bool v = xr[i] >= 0 && q0 + c < Q;
      cp_async16(xs + row * kGradLdX + c, v ? X + int64_t(xr[i]) * ldx + q0 + c : X, v);
    }
    fetch_rows(kt + 1);
    for (int p = tid; p < kGradBK * (PARTS * RP / 8); p += kGradThreads) {  // part q's columns at q·RP
      const int row = p / (PARTS * RP / 8), c = p % (PARTS * RP / 8) * 8, q = c / RP, cc = c % RP;
      const bool v = rr + row < rows && cc < ldp;
      cp_async16(ps + row * LDP + c, v ? (q ? P1 : P) + int64_t(r0 + rr + row) * ldp + cc : P, v);
    }
  };

  float acc[2][NT][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mi][nt][0] = acc[mi][nt][1] = acc[mi][nt][2] = acc[mi][nt][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < kGradStages - 1; ++s) {
    if (s < KT) load_stage(s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kGradStages - 2>();
    __syncthreads();  // chunk kt is in; every warp is done with chunk kt − 1, whose stage refills
    if (kt + kGradStages - 1 < KT) load_stage(kt + kGradStages - 1);
    cp_async_commit();
    const bf16* xs = smem + (kt % kGradStages) * STAGE;
    const bf16* ps = xs + kGradBK * kGradLdX;
#pragma unroll
    for (int ks = 0; ks < kGradBK / 16; ++ks) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) load_a_t(a[mi], xs + ks * 16 * kGradLdX + warp * 32 + mi * 16, kGradLdX);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, ps + ks * 16 * LDP + np * 16, LDP);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma_bf16(acc[mi][2 * np], a[mi], b[0], b[1]);
          mma_bf16(acc[mi][2 * np + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
  float* Ge = G[e];
  float* Ge1 = PARTS == 2 ? G1[e] : nullptr;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = q0 + warp * 32 + mi * 16 + g + 8 * h;
      if (q >= Q) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int part = nt * 8 / RP, j = nt * 8 % RP + 2 * t4 + c;
          if (j >= r) continue;
          float* p = (part ? Ge1 : Ge) + (kJMajor ? int64_t(j) * Q + q : int64_t(q) * r + j);
          *p = overwrite ? acc[mi][nt][2 * h + c] : *p + acc[mi][nt][2 * h + c];
        }
    }
}

// ---- Host side ----
constexpr int kMaxDevices = 64;
// Dynamic shared memory a launch may use without opting in: the default 48 KiB less room for the kernels' static
// shared memory (find_tile's scan storage, at most 1184 bytes).
constexpr int kDefaultSmem = 46 * 1024;

// Raises a kernel's dynamic shared memory limit on the current device to `need` bytes when above the default,
// remembering per device how far it was raised (so that repeated launches and graph captures make no attribute
// call).
struct SmemOptIn {
  std::mutex mu;
  int bytes[kMaxDevices] = {};
  void ensure(const void* kernel, int need) {
    if (need <= kDefaultSmem) return;
    int dev = 0;
    NEXTLM_CUDA_CHECK(cudaGetDevice(&dev));
    check(dev >= 0 && dev < kMaxDevices, "grouped_lora: device ordinal ", dev, " out of range");
    std::lock_guard<std::mutex> lock(mu);
    if (bytes[dev] >= need) return;
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, need));
    bytes[dev] = need;
  }
};

// Blocks for the row tiles of n rows over E experts (see kBM).
unsigned row_tile_blocks(int64_t n, int E) { return static_cast<unsigned>(ceil_div(n, kBM) + E); }

template <int RP, bool kFlatW, int PARTS = 1>
void launch_down(const bf16* X, int64_t ldx, const int32_t* xrows, const int32_t* offsets, int E,
                 const bf16* const* W, int r, int K, float scale, bf16* P, int64_t n, cudaStream_t st,
                 const bf16* const* W1 = nullptr, bf16* P1 = nullptr) {
  static SmemOptIn opt;
  // The tile scan's start array shares the stages' memory.
  const int smem = std::max<int>(kDownStages * down_stage_elems<PARTS * RP>() * 2, (E + 1) * 4);
  const auto kernel = down_kernel<RP, kFlatW, PARTS>;
  opt.ensure(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<row_tile_blocks(n, E), kDownThreads, smem, st>>>(X, ldx, xrows, offsets, E, W, r, K, scale, P,
                                                            grouped_lora_ld(r), W1, P1);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <int RP, bool kFlatW>
void launch_up(const bf16* P, const int32_t* offsets, int E, const bf16* const* W, int r, int N, float* Y,
               int64_t ldy, int64_t n, cudaStream_t st) {
  static SmemOptIn opt;
  const int smem = std::max<int>(up_smem_bytes<RP>(), (E + 1) * 4);
  const auto kernel = up_kernel<RP, kFlatW>;
  opt.ensure(reinterpret_cast<const void*>(kernel), smem);
  const dim3 grid(row_tile_blocks(n, E), static_cast<unsigned>(ceil_div(N, kUpCols)));
  kernel<<<grid, kUpThreads, smem, st>>>(P, grouped_lora_ld(r), offsets, E, W, r, N, Y, ldy);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <int RP, bool kJMajor, int PARTS = 1>
void launch_grad(const bf16* X, int64_t ldx, const int32_t* xrows, const bf16* P, const int32_t* offsets, int E,
                 float* const* G, int r, int Q, bool overwrite, cudaStream_t st, const bf16* P1 = nullptr,
                 float* const* G1 = nullptr) {
  static SmemOptIn opt;
  const int smem = grad_smem_bytes<PARTS * RP>();
  const auto kernel = grad_kernel<RP, kJMajor, PARTS>;
  opt.ensure(reinterpret_cast<const void*>(kernel), smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(Q, kGradBQ)), static_cast<unsigned>(E));
  kernel<<<grid, kGradThreads, smem, st>>>(X, ldx, xrows, P, grouped_lora_ld(r), offsets, G, r, Q, overwrite, P1,
                                           G1);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void check_common(const GroupedLora& g, int64_t n, int64_t col0) {
  check(g.E >= 0 && g.E <= 65535, "grouped_lora: E = ", g.E, " experts, at most 65535");
  check(g.r >= 1 && g.r <= 64, "grouped_lora: rank ", g.r, " out of 1 … 64");
  check(g.in > 0 && g.in % 8 == 0 && g.out > 0 && g.out % 8 == 0, "grouped_lora: in ", g.in, " and out ", g.out,
        " must be positive multiples of 8");
  check(n >= 0 && n <= INT32_MAX, "grouped_lora: bad row count ", n);
  check(col0 >= 0 && col0 % 8 == 0, "grouped_lora: col0 ", col0, " must be a non-negative multiple of 8");
  // The start array of the tile scan must fit in a block's shared memory.
  check((int64_t(g.E) + 1) * 4 <= 160 * 1024, "grouped_lora: too many experts for the tile scan: ", g.E);
}

// The padded rank RP (a multiple of 16) picks the instantiation; f(std::integral_constant<int, RP>).
template <class F>
void with_rank(int r, F&& f) {
  if (r <= 16) f(std::integral_constant<int, 16>{});
  else if (r <= 32) f(std::integral_constant<int, 32>{});
  else if (r <= 48) f(std::integral_constant<int, 48>{});
  else f(std::integral_constant<int, 64>{});
}

}  // namespace

void grouped_lora_forward(const GroupedLora& g, const bf16* x, int64_t ldx, int64_t n, bf16* u, float* y,
                          int64_t ldy, int64_t col0, cudaStream_t stream) {
  check_common(g, n, col0);
  check(ldx >= g.in && ldx % 8 == 0 && aligned(x, 16), "grouped_lora_forward: x needs 16-byte aligned rows (ldx ",
        ldx, ", in ", g.in, ")");
  check(ldy >= col0 + g.out && ldy % 2 == 0 && aligned(y, 8), "grouped_lora_forward: y needs 8-byte aligned rows "
        "holding columns col0 … col0 + out (ldy ", ldy, ", col0 ", col0, ", out ", g.out, ")");
  check(aligned(u, 16), "grouped_lora_forward: u must be 16-byte aligned");
  if (n == 0 || g.E == 0) return;
  with_rank(g.r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    launch_down<RP, false>(x, ldx, g.x_rows, g.offsets, g.E, g.A, g.r, g.in, g.scale, u, n, stream);
    launch_up<RP, true>(u, g.offsets, g.E, g.B, g.r, g.out, y + col0, ldy, n, stream);
  });
}

void grouped_lora_factor(const GroupedLora& g, const bf16* x, int64_t ldx, int64_t n, bf16* u, cudaStream_t stream) {
  check_common(g, n, 0);
  check(ldx >= g.in && ldx % 8 == 0 && aligned(x, 16), "grouped_lora_factor: x needs 16-byte aligned rows (ldx ", ldx,
        ", in ", g.in, ")");
  check(aligned(u, 16), "grouped_lora_factor: u must be 16-byte aligned");
  if (n == 0 || g.E == 0) return;
  with_rank(g.r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    launch_down<RP, false>(x, ldx, g.x_rows, g.offsets, g.E, g.A, g.r, g.in, g.scale, u, n, stream);
  });
}

void grouped_lora_backward(const GroupedLora& g, float* const* dA, float* const* dB, const bf16* x, int64_t ldx,
                           const bf16* u, const bf16* dy, int64_t lddy, int64_t n, bf16* gs, float* dx,
                           int64_t lddx, int64_t col0, cudaStream_t stream, bool overwrite) {
  check_common(g, n, col0);
  check(ldx >= g.in && ldx % 8 == 0 && aligned(x, 16), "grouped_lora_backward: x needs 16-byte aligned rows (ldx ",
        ldx, ", in ", g.in, ")");
  check(lddy >= col0 + g.out && lddy % 8 == 0 && aligned(dy, 16), "grouped_lora_backward: dy needs 16-byte aligned "
        "rows holding columns col0 … col0 + out (lddy ", lddy, ", col0 ", col0, ", out ", g.out, ")");
  check(!dx || (lddx >= g.in && lddx % 2 == 0 && aligned(dx, 8)), "grouped_lora_backward: dx needs 8-byte aligned "
        "rows (lddx ", lddx, ", in ", g.in, ")");
  check(aligned(u, 16) && aligned(gs, 16), "grouped_lora_backward: u and gs must be 16-byte aligned");
  if (g.E == 0 || (n == 0 && !overwrite)) return;
  const bf16* dyc = dy + col0;
  with_rank(g.r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    launch_grad<RP, false>(dyc, lddy, nullptr, u, g.offsets, g.E, dB, g.r, g.out, overwrite, stream);
    if (n == 0) {  // overwriting: the zeros of dA and dB alone
      launch_grad<RP, true>(x, ldx, g.x_rows, gs, g.offsets, g.E, dA, g.r, g.in, overwrite, stream);
      return;
    }
    launch_down<RP, true>(dyc, lddy, nullptr, g.offsets, g.E, g.B, g.r, g.out, g.scale, gs, n, stream);
    launch_grad<RP, true>(x, ldx, g.x_rows, gs, g.offsets, g.E, dA, g.r, g.in, overwrite, stream);
    if (dx) launch_up<RP, false>(gs, g.offsets, g.E, g.A, g.r, g.in, dx, lddx, n, stream);
  });
}

bool grouped_lora_pairable(const GroupedLora& g0, const GroupedLora& g1) {
  return g0.offsets == g1.offsets && g0.x_rows == g1.x_rows && g0.E == g1.E && g0.r == g1.r && g0.r <= 32 &&
         g0.in == g1.in && g0.scale == g1.scale;
}

void grouped_lora_factor2(const GroupedLora& g0, const GroupedLora& g1, const bf16* x, int64_t ldx, int64_t n,
                          bf16* u0, bf16* u1, cudaStream_t stream) {
  check(grouped_lora_pairable(g0, g1), "grouped_lora_factor2: the adapters differ in rows, rank (≤ 32), input or "
        "scale");
  check_common(g0, n, 0);
  check(ldx >= g0.in && ldx % 8 == 0 && aligned(x, 16), "grouped_lora_factor2: x needs 16-byte aligned rows (ldx ",
        ldx, ", in ", g0.in, ")");
  check(aligned(u0, 16) && aligned(u1, 16), "grouped_lora_factor2: u0 and u1 must be 16-byte aligned");
  if (n == 0 || g0.E == 0) return;
  with_rank(g0.r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    if constexpr (RP <= 32)
      launch_down<RP, false, 2>(x, ldx, g0.x_rows, g0.offsets, g0.E, g0.A, g0.r, g0.in, g0.scale, u0, n, stream,
                                g1.A, u1);
  });
}

void grouped_lora_backward2(const GroupedLora& g0, const GroupedLora& g1, float* const* dA0, float* const* dB0,
                            float* const* dA1, float* const* dB1, const bf16* x, int64_t ldx, const bf16* u0,
                            const bf16* u1, const bf16* dy, int64_t lddy, int64_t n, bf16* gs0, bf16* gs1, float* dx,
                            int64_t lddx, int64_t col0_0, int64_t col0_1, cudaStream_t stream, bool overwrite) {
  check(grouped_lora_pairable(g0, g1), "grouped_lora_backward2: the adapters differ in rows, rank (≤ 32), input or "
        "scale");
  check_common(g0, n, col0_0);
  check_common(g1, n, col0_1);
  check(ldx >= g0.in && ldx % 8 == 0 && aligned(x, 16), "grouped_lora_backward2: x needs 16-byte aligned rows (ldx ",
        ldx, ", in ", g0.in, ")");
  check(lddy >= col0_0 + g0.out && lddy >= col0_1 + g1.out && lddy % 8 == 0 && aligned(dy, 16),
        "grouped_lora_backward2: dy needs 16-byte aligned rows holding both adapters' columns (lddy ", lddy, ")");
  check(!dx || (lddx >= g0.in && lddx % 2 == 0 && aligned(dx, 8)), "grouped_lora_backward2: dx needs 8-byte aligned "
        "rows (lddx ", lddx, ", in ", g0.in, ")");
  check(aligned(u0, 16) && aligned(u1, 16) && aligned(gs0, 16) && aligned(gs1, 16),
        "grouped_lora_backward2: u0, u1, gs0 and gs1 must be 16-byte aligned");
  if (g0.E == 0 || (n == 0 && !overwrite)) return;
  const bf16 *dy0 = dy + col0_0, *dy1 = dy + col0_1;
  with_rank(g0.r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    if constexpr (RP <= 32) {
      launch_grad<RP, false>(dy0, lddy, nullptr, u0, g0.offsets, g0.E, dB0, g0.r, g0.out, overwrite, stream);
      launch_grad<RP, false>(dy1, lddy, nullptr, u1, g1.offsets, g1.E, dB1, g1.r, g1.out, overwrite, stream);
      if (n > 0) {
        launch_down<RP, true>(dy0, lddy, nullptr, g0.offsets, g0.E, g0.B, g0.r, g0.out, g0.scale, gs0, n,
                              stream);
        launch_down<RP, true>(dy1, lddy, nullptr, g1.offsets, g1.E, g1.B, g1.r, g1.out, g1.scale, gs1, n,
                              stream);
      }
      launch_grad<RP, true, 2>(x, ldx, g0.x_rows, gs0, g0.offsets, g0.E, dA0, g0.r, g0.in, overwrite, stream, gs1,
                               dA1);
      if (n == 0) return;
      if (dx) {
        launch_up<RP, false>(gs0, g0.offsets, g0.E, g0.A, g0.r, g0.in, dx, lddx, n, stream);
        launch_up<RP, false>(gs1, g1.offsets, g1.E, g1.A, g1.r, g1.in, dx, lddx, n, stream);
      }
    }
  });
}

}  // namespace nextlm::cuda
