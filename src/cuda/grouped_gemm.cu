// Grouped expert GEMM (see grouped_gemm.h): a one-block scheduling kernel (per-expert tile counts → prefix sum) and a
// persistent mma.sync or wgmma bf16 → fp32 kernel over the global tile list (or, for the TMA kernel with clusters of
// two, over a list of tile pairs), with fp32, bf16 or fused clamped-SwiGLU stores; each kernel also comes in a w_kn
// form (W_e [K, N], C = A·W_e: the input gradient of the same linear).
// The CPU reference is nn.Linear per expert followed by moe.cu's swiglu: act = silu(min(g, L)) · clamp(u, −L, L).
#include "cuda/grouped_gemm.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <utility>

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"
#include "cuda/tensor_map.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;  // eight warps: 2 along M × 4 along N
constexpr int kScanThreads = 1024;

// BM × BN × BK tile, STAGES-deep cp.async pipeline, MINB CTAs per SM. Shared tiles are [rows][BK] with a row stride
// of BK + 8 elements: the eight 16-byte rows one ldmatrix phase reads then fall in distinct bank groups (stride 80 or
// 144 bytes), and every row start stays 16-byte aligned for cp.async.
// With w_kn the B tile is [BK][BN] (k rows, n contiguous) with a row stride of BN + 8 elements (272 or 528 bytes, an
// odd number of 16-byte units): the eight k rows one ldmatrix.trans phase reads fall in distinct bank groups too. It
// is no larger than the [BN][BK] tile for these shapes, so a stage's size is that of the [N, K] form.
template <int BM_, int BN_, int BK_, int STAGES_, int MINB_>
struct Cfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_, MINB = MINB_;
  static constexpr int LDS = BK + 8;
  static constexpr int WM = BM / 2, WN = BN / 4;  // warp tile
  static constexpr int MI = WM / 16, NI = WN / 8;  // m16 and n8 MMA tiles per warp
  static constexpr int CPR = BK / 8;               // 16-byte chunks per tile row
  static constexpr int RSTEP = kThreads / CPR;     // rows between one thread's successive chunks
  static constexpr int CA = BM / RSTEP, CB = BN / RSTEP;
  // w_kn B tile: row stride, 16-byte chunks per k row, k rows between one thread's chunks, chunks per thread.
  static constexpr int LDB = BN + 8, CPRB = BN / 8, RSTEPB = kThreads / CPRB, CBK = BK / RSTEPB;
  static constexpr int b_elems = BN * LDS > BK * LDB ? BN * LDS : BK * LDB;
  static constexpr int stage_elems = BM * LDS + b_elems;
  static constexpr int smem_bytes = STAGES * stage_elems * 2;
  static_assert(BM % RSTEP == 0 && BN % RSTEP == 0 && MI >= 1 && NI % 2 == 0 && BK % 16 == 0);
  static_assert(kThreads % CPRB == 0 && BK % RSTEPB == 0);
};

using Cfg0 = Cfg<128, 128, 32, 4, 2>;
using Cfg1 = Cfg<128, 128, 64, 3, 2>;
using Cfg2 = Cfg<128, 256, 32, 4, 1>;

// Units per expert of the cluster schedules (the TMA kernel below) for m M tiles of n N tiles. Clusters of two:
// ⌊m/2⌋·n weight-sharing pairs, and with m odd ⌈n/2⌉ A-sharing pairs (the second tile of the last one past N when n
// is odd: it stores nothing). Clusters of four: ⌊m/2⌋·⌈n/2⌉ units of 2 × 2 tiles, and with m odd ⌈n/4⌉ units of the
// last M tile with four N tiles (tiles past N store nothing).
__device__ __forceinline__ int paired_units(int m, int n) { return m / 2 * n + (m & 1) * ((n + 1) / 2); }
__device__ __forceinline__ int quad_units(int m, int n) { return m / 2 * ((n + 1) / 2) + (m & 1) * ((n + 3) / 4); }

// start[e] = Σ_{e' < e} tiles(e'), start[E] = total, with tiles(e) = ceil(rows_e / BM) · n_tiles, or with clusters
// of cl = 2 or 4 CTAs (the TMA kernel) the units of paired_units or quad_units (cl = 1: single tiles).
__global__ void __launch_bounds__(kScanThreads) schedule_kernel(const int32_t* __restrict__ offsets, int E, int BM,
                                                                int n_tiles, int cl, int32_t* __restrict__ start) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int carry = 0;
  for (int base = 0; base < E; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int rows = e < E ? offsets[e + 1] - offsets[e] : 0;
    const int m = (rows + BM - 1) / BM;
    const int tiles = cl == 4 ? quad_units(m, n_tiles) : (cl == 2 ? paired_units(m, n_tiles) : m * n_tiles);
    int excl, total;
    Scan(tmp).ExclusiveSum(tiles, excl, total);
    if (e < E) start[e] = carry + excl;
    carry += total;
    __syncthreads();  // tmp is reused by the next chunk
  }
  if (threadIdx.x == 0) start[E] = carry;
}

__device__ __forceinline__ void store_bf16x2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

__device__ __forceinline__ void add_f32x2(float* p, float a, float b) {
  float2* q = reinterpret_cast<float2*>(p);
  const float2 c = *q;
  *q = make_float2(c.x + a, c.y + b);
}

__device__ __forceinline__ float swiglu(float g, float u, float L) {
  g = fminf(g, L);
  u = fminf(fmaxf(u, -L), L);
  return g / (1.0f + __expf(-g)) * u;
}

// Weight row held by row r of a tile's B operand. SwiGLU tiles of the mma.sync kernels interleave gate and up in
// blocks of eight rows (n8 MMA tiles): block b holds gate rows (b even) or up rows (b odd) of act columns
// j·BN/2 + (b/2)·8 .. +7, so that one thread's accumulators for n8 tiles 2q and 2q+1 are the gate and the up of the
// same act columns. The wgmma kernels' (kHalves), whose threads hold every n8 tile of their rows, take the gate rows
// of act columns j·BN/2 … + BN/2 − 1 in the tile's first half and their up rows in the second: n8 tiles q and
// q + BN/16 pair up, and each half is BN/2 consecutive weight rows (one TMA box).
template <int BN, bool kHalves = false>
__device__ __forceinline__ int b_row(int r, int nt, bool glu, int N, bool* valid) {
  if (!glu) {
    const int w = nt * BN + r;
    *valid = w < N;
    return w;
  }
  const int I = N / 2;
  if constexpr (kHalves) {
    const int col = nt * (BN / 2) + r % (BN / 2);
    *valid = col < I;
    return (r >= BN / 2) * I + col;
  }
  const int b = r >> 3;
  const int col = nt * (BN / 2) + (b >> 1) * 8 + (r & 7);
  *valid = col < I;
  return (b & 1) * I + col;
}

// One output tile: expert e, N tile nt, first row row0 (global), rows valid rows (≤ BM).
struct Tile {
  int e, nt, rows;
  int64_t row0;
};

// The expert owning item u (a tile, or a unit of the paired schedule) of the list: the last e with start[e] ≤ u
// (empty experts share their successor's start).
__device__ __forceinline__ int owner_of(int u, const int32_t* __restrict__ start, int E) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (start[mid] <= u) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Tiles of an expert are numbered N-tile-major with the M tile innermost, so that the M tiles reading the same weight
// slab are neighbours in the list and run at the same time.
__device__ __forceinline__ Tile locate(int tile, const int32_t* __restrict__ start,
                                       const int32_t* __restrict__ offsets, int E, int BM) {
  const int lo = owner_of(tile, start, E);
  const int local = tile - start[lo];
  const int row_begin = offsets[lo], rows_e = offsets[lo + 1] - row_begin;
  const int mtiles = (rows_e + BM - 1) / BM;
  const int mt = local % mtiles;
  return Tile{lo, local / mtiles, min(BM, rows_e - mt * BM), row_begin + int64_t(mt) * BM};
}

// KN (w_kn): W_e is [K, N] and C = A·W_e; the B tile is then [BK][BN] (see Cfg) and read with ldmatrix.trans.
template <class C, bool KN>
__global__ void __launch_bounds__(kThreads, C::MINB)
    grouped_gemm_kernel(const bf16* __restrict__ A, const int32_t* __restrict__ offsets, const bf16* const* W,
                        void* Cout, const int32_t* __restrict__ start, int E, int N, int K, int epi, float L) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK, S = C::STAGES, LDS = C::LDS, MI = C::MI, NI = C::NI;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 2, wn = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const bool glu = !KN && epi == static_cast<int>(GroupedEpilogue::kSwiGLU);
  const int total = start[E];
  const int KT = (K + BK - 1) / BK;
  const int cc = tid % C::CPR, r0 = tid / C::CPR;  // this thread's chunk column and first row in a tile
  const int cb = tid % C::CPRB, rb = tid / C::CPRB;  // KN: its chunk column and first k row in a B tile

  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const Tile tl = locate(tile, start, offsets, E, BM);
    const int nt = tl.nt, rows = tl.rows;
    const int64_t row0 = tl.row0;
    const bf16* We = W[tl.e];
    // m16 blocks of this warp holding at least one row: a short last tile of an expert skips the rest's MMAs.
    const int mact = min(MI, max(0, (rows - wm * C::WM + 15) / 16));

    // Source rows of this thread's chunks (invalid ones read nothing and zero-fill; their address stays in bounds).
    // KN: one source column (b_src[0], row 0; b_ok = the column is in N), the k row's offset added per chunk.
    const bf16* a_src[C::CA];
    const bf16* b_src[C::CB];
    uint32_t a_ok = 0, b_ok = 0;
#pragma unroll
    for (int s = 0; s < C::CA; ++s) {
      const int r = r0 + s * C::RSTEP;
      const bool v = r < rows;
      a_ok |= uint32_t(v) << s;
      a_src[s] = A + (row0 + (v ? r : 0)) * K + cc * 8;
    }
    if constexpr (KN) {
      const int col = nt * BN + cb * 8;
      b_ok = col < N;
      b_src[0] = We + (b_ok ? col : 0);
    } else {
#pragma unroll
      for (int s = 0; s < C::CB; ++s) {
        bool v;
        const int w = b_row<C::BN>(r0 + s * C::RSTEP, nt, glu, N, &v);
        b_ok |= uint32_t(v) << s;
        b_src[s] = We + int64_t(v ? w : 0) * K + cc * 8;
      }
    }
    auto load_stage = [&](int kt, int stage) {
      bf16* As = smem + stage * C::stage_elems;
      bf16* Bs = As + BM * LDS;
      const int k0 = kt * BK;
      const bool kin = k0 + cc * 8 < K;
#pragma unroll
      for (int s = 0; s < C::CA; ++s)
        cp_async16(As + (r0 + s * C::RSTEP) * LDS + cc * 8, a_src[s] + (kin ? k0 : 0), kin && (a_ok >> s & 1));
      if constexpr (KN) {
        // Rows past K zero-fill: stale shared memory must not meet A's zero-filled columns (0 · NaN).
#pragma unroll
        for (int s = 0; s < C::CBK; ++s) {
          const int k = k0 + rb + s * C::RSTEPB;
          const bool v = b_ok && k < K;
          cp_async16(Bs + (rb + s * C::RSTEPB) * C::LDB + cb * 8, b_src[0] + (v ? int64_t(k) * N : 0), v);
        }
      } else {
#pragma unroll
        for (int s = 0; s < C::CB; ++s)
          cp_async16(Bs + (r0 + s * C::RSTEP) * LDS + cc * 8, b_src[s] + (kin ? k0 : 0), kin && (b_ok >> s & 1));
      }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < KT) load_stage(s, s);
      cp_async_commit();
    }
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<S - 2>();  // stage kt has landed (for this thread) …
      __syncthreads();         // … for every thread, and stage kt−1 is no longer read by anyone
      if (kt + S - 1 < KT) load_stage(kt + S - 1, (kt + S - 1) % S);
      cp_async_commit();
      const bf16* As = smem + (kt % S) * C::stage_elems;
      const bf16* Bs = As + BM * LDS;
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        uint32_t a[MI][4], b[NI / 2][4];
#pragma unroll
        for (int i = 0; i < MI; ++i)
          if (i < mact) load_a(a[i], As + (wm * C::WM + i * 16) * LDS + ks * 16, LDS);
#pragma unroll
        for (int p = 0; p < NI / 2; ++p) {
          if constexpr (KN) load_b_kn(b[p], Bs + ks * 16 * C::LDB + wn * C::WN + p * 16, C::LDB);
          else load_b_nk(b[p], Bs + (wn * C::WN + p * 16) * LDS + ks * 16, LDS);
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
          if (i < mact)
#pragma unroll
            for (int j = 0; j < NI; ++j)
              mma_bf16(acc[i][j], a[i], b[j / 2][(j & 1) * 2], b[j / 2][(j & 1) * 2 + 1]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages

    // Epilogue straight from the accumulators: c0, c1 at (g, 2t..2t+1), c2, c3 at (g+8, 2t..2t+1).
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * C::WM + i * 16 + g + 8 * h;
        if (r >= rows) continue;
        const int64_t row = row0 + r;
        if (glu) {
          const int I = N / 2;
          bf16* out = static_cast<bf16*>(Cout) + row * I;
#pragma unroll
          for (int q = 0; q < NI / 2; ++q) {
            const int col = nt * (BN / 2) + ((wn * NI) / 2 + q) * 8 + 2 * t4;
            if (col < I)
              store_bf16x2(out + col, swiglu(acc[i][2 * q][2 * h], acc[i][2 * q + 1][2 * h], L),
                           swiglu(acc[i][2 * q][2 * h + 1], acc[i][2 * q + 1][2 * h + 1], L));
          }
        } else {
#pragma unroll
          for (int j = 0; j < NI; ++j) {
            const int col = nt * BN + wn * C::WN + j * 8 + 2 * t4;
            if (col >= N) continue;
            if (epi == static_cast<int>(GroupedEpilogue::kF32))
              *reinterpret_cast<float2*>(static_cast<float*>(Cout) + row * N + col) =
                  make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            else if (epi == static_cast<int>(GroupedEpilogue::kF32Add))
              add_f32x2(static_cast<float*>(Cout) + row * N + col, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            else
              store_bf16x2(static_cast<bf16*>(Cout) + row * N + col, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
          }
        }
      }
  }
}


// ---------------------------------------------------------------------------------------------------------------------
// Hopper (sm_90a): warpgroup MMA. Two warpgroups each own 64 rows of a 128 × BN tile; operands go global → shared by
// the same cp.async pipeline (BK = 64), stored in the canonical K-major 128-byte-swizzle layout that wgmma reads
// through shared-memory descriptors: tile row r is 128 bytes at r·128, its 16-byte chunk c at position c ^ (r mod 8),
// eight rows (1024 bytes, 1024-aligned) per swizzle atom.
// With w_kn the B tile is stored N-major (the canonical MN-major 128-byte-swizzle layout, read with the transpose
// immediate imm-trans-b = 1): BN/64 blocks of 64 n columns, each BK k rows of 128 bytes (BK·128 bytes, block j at
// j·BK·128), k row r's 16-byte chunk c (n columns 8c..8c+7 of the block) at position c ^ (r mod 8) — the same
// address swizzle, with k in the role of the row.

// A warpgroup's accumulators of a 128 × BN output tile (rows valid rows from global row row0, N tile nt) to C (and
// pre): wg is the warpgroup (64-row half), wq the warp in it. Accumulator layout (per warp as mma.sync's C, per n8
// block j): acc[4j + 2h + c] = (row 16·wq + g + 8h, column 8j + 2·t4 + c) of the warpgroup's 64 × BN.
template <int BN>
__device__ __forceinline__ void store_wg_tile(const float* acc, int wg, int wq, int lane, int rows, int64_t row0,
                                              int nt, bool glu, int N, int epi, float L, void* Cout, void* pre,
                                              bool pre16) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * 64 + wq * 16 + g + 8 * h;
    if (r >= rows) continue;
    const int64_t row = row0 + r;
    if (glu) {
      const int I = N / 2;
      bf16* out = static_cast<bf16*>(Cout) + row * I;
#pragma unroll
      for (int q = 0; q < BN / 16; ++q) {  // gate in n8 tile q, up in q + BN/16 (b_row's halves)
        const int col = nt * (BN / 2) + q * 8 + 2 * t4;
        if (col >= I) continue;
        const float g0 = acc[4 * q + 2 * h], g1 = acc[4 * q + 2 * h + 1];
        const float u0 = acc[4 * (q + BN / 16) + 2 * h], u1 = acc[4 * (q + BN / 16) + 2 * h + 1];
        store_bf16x2(out + col, swiglu(g0, u0, L), swiglu(g1, u1, L));
        if (pre && pre16) {
          store_bf16x2(static_cast<bf16*>(pre) + row * N + col, g0, g1);
          store_bf16x2(static_cast<bf16*>(pre) + row * N + I + col, u0, u1);
        } else if (pre) {
          *reinterpret_cast<float2*>(static_cast<float*>(pre) + row * N + col) = make_float2(g0, g1);
          *reinterpret_cast<float2*>(static_cast<float*>(pre) + row * N + I + col) = make_float2(u0, u1);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = nt * BN + j * 8 + 2 * t4;
        if (col >= N) continue;
        if (epi == static_cast<int>(GroupedEpilogue::kF32))
          *reinterpret_cast<float2*>(static_cast<float*>(Cout) + row * N + col) =
              make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        else if (epi == static_cast<int>(GroupedEpilogue::kF32Add))
          add_f32x2(static_cast<float*>(Cout) + row * N + col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        else
          store_bf16x2(static_cast<bf16*>(Cout) + row * N + col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
  }
}

// The low-rank term's k-tile (GroupedLowRank) into a stage's A and B tiles (the 128-byte-swizzled layouts above),
// by NT threads (this one is i of them), cp.async with zero fill (the caller commits and waits): column (A) or k row
// (KN's B) j of the tile is column j mod slot of part j / slot, zero past the part's rank; without KN, B row w (an
// output column) reads part p's V row w − c0_p inside its columns. `zero` is any valid global address (read by no
// zero-filling copy). Parts are picked with selects, not indexed: a dynamic index would put the kernel parameter on
// the stack.
template <int NT, int BM, int BN, bool KN>
__device__ __forceinline__ void load_low_rank_tile(unsigned char* As, unsigned char* Bs, int i,
                                                   const GroupedLowRank& lr, int e, int rows, int64_t row0, int nt,
                                                   bool glu, int N, const bf16* zero) {
  constexpr int BK = 64, RSTEP = NT / 8;
  const int slot = lr.parts > 1 ? BK / 2 : BK;
  const int cc = i % 8, r0 = i / 8;
  const int pa = cc * 8 / slot, ja = cc * 8 % slot;
  const int ra = pa ? lr.r[1] : lr.r[0], lda = pa ? lr.ldu[1] : lr.ldu[0];
  const bool a_in = pa < lr.parts && ja < ra;
  const bf16* U = pa ? lr.U[1] : lr.U[0];
#pragma unroll
  for (int s = 0; s < BM / RSTEP; ++s) {
    const int r = r0 + s * RSTEP;
    const bool v = a_in && r < rows;
    cp_async16(As + r * 128 + ((cc ^ (r & 7)) << 4), v ? U + (row0 + r) * lda + ja : zero, v);
  }
  if constexpr (KN) {
    constexpr int CPRB = BN / 8, RSTEPB = NT / CPRB;
    const int cb = i % CPRB, rb = i / CPRB, col = nt * BN + cb * 8;
#pragma unroll
    for (int s = 0; s < BK / RSTEPB; ++s) {
      const int k = rb + s * RSTEPB, p = k / slot, j = k % slot;
      const bool v = col < N && p < lr.parts && j < (p ? lr.r[1] : lr.r[0]);
      cp_async16(Bs + (cb >> 3) * (BK * 128) + k * 128 + (((cb & 7) ^ (k & 7)) << 4),
                 v ? (p ? lr.V[1] : lr.V[0])[e] + int64_t(j) * N + col : zero, v);
    }
  } else {
    const int c0 = pa ? lr.c0[1] : lr.c0[0], c1 = c0 + (pa ? lr.width[1] : lr.width[0]);
    const bf16* Ve = a_in ? (pa ? lr.V[1] : lr.V[0])[e] : zero;
#pragma unroll
    for (int s = 0; s < BN / RSTEP; ++s) {
      const int r = r0 + s * RSTEP;
      bool v;
      const int w = b_row<BN, true>(r, nt, glu, N, &v);
      v = v && a_in && w >= c0 && w < c1;
      cp_async16(Bs + r * 128 + ((cc ^ (r & 7)) << 4), v ? Ve + int64_t(w - c0) * ra + ja : zero, v);
    }
  }
}

template <int BN, int TB>
__device__ __forceinline__ void wgmma_k16(float* d, uint64_t da, uint64_t db) {
  if constexpr (BN == 128) wgmma_m64n128k16<TB>(d, da, db);
  else wgmma_m64n256k16<TB>(d, da, db);
}

// KEEP: wgmma groups left in flight while the next k-tile is issued (0 or 1); the prefetch distance is then
// STAGES − 1 − KEEP k-tiles, since a stage is refilled only once no warpgroup's MMAs can still be reading it.
template <int BN_, int STAGES_, int MINB_, int KEEP_>
struct WgCfg {
  static constexpr int BM = 128, BN = BN_, BK = 64, STAGES = STAGES_, MINB = MINB_, KEEP = KEEP_;
  static constexpr int PREFETCH = STAGES - 1 - KEEP;
  static constexpr int CPR = 8, RSTEP = kThreads / CPR, CA = BM / RSTEP, CB = BN / RSTEP;
  // w_kn B tile ([BK][BN], N-major, the same BN·128 bytes): 16-byte chunks per k row, k rows between one thread's
  // chunks (a multiple of 8, so every chunk of a thread has the same swizzled position), chunks per thread.
  static constexpr int CPRB = BN / 8, RSTEPB = kThreads / CPRB, CBK = BK / RSTEPB;
  static constexpr int a_bytes = BM * 128, stage_bytes = (BM + BN) * 128;
  static constexpr int smem_bytes = STAGES * stage_bytes + 1024;  // + slack to align the stages to 1024 bytes
  static constexpr int NACC = BN / 2;                             // fp32 accumulators per thread (64 × BN / 128)
  static_assert((BN == 128 || BN == 256) && (KEEP == 0 || KEEP == 1) && PREFETCH >= 1);
  static_assert(kThreads % CPRB == 0 && RSTEPB % 8 == 0 && BK % RSTEPB == 0);
};

using WgCfg0 = WgCfg<128, 3, 2, 0>;
using WgCfg1 = WgCfg<256, 4, 1, 1>;

// KN (w_kn): W_e is [K, N] and C = A·W_e; the B tile is then stored N-major and read with the transpose immediate.
template <class C, bool KN>
__global__ void __launch_bounds__(kThreads, C::MINB)
    grouped_gemm_wgmma_kernel(const bf16* __restrict__ A, const int32_t* __restrict__ offsets, const bf16* const* W,
                              void* Cout, const int32_t* __restrict__ start, int E, int N, int K, int epi, float L,
                              GroupedLowRank lr, void* __restrict__ pre, bool pre16) {
  extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
  const uint32_t raw_s = smem_addr(wg_smem_raw), pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = wg_smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK, S = C::STAGES, NACC = C::NACC, P = C::PREFETCH;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup (64-row half) and warp within it (16-row quarter)
  const bool glu = !KN && epi == static_cast<int>(GroupedEpilogue::kSwiGLU);
  const int total = start[E];
  const int KT = (K + BK - 1) / BK, KTT = KT + (lr.parts > 0);  // KTT: with the low-rank term's k-tile
  const int cc = tid % C::CPR, r0 = tid / C::CPR;
  const int swz = (cc ^ (r0 & 7)) * 16;  // r0 + s·RSTEP ≡ r0 (mod 8): one swizzled chunk position per thread
  // KN: this thread's chunk column cb and first k row rb in the B tile, and the chunk's byte position there (its
  // 64-column block, its k row, its swizzled place in the row; rb + s·RSTEPB ≡ rb (mod 8)).
  const int cb = tid % C::CPRB, rb = tid / C::CPRB;
  const int b_pos = (cb >> 3) * (BK * 128) + rb * 128 + (((cb & 7) ^ (rb & 7)) * 16);

  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const Tile tl = locate(tile, start, offsets, E, BM);
    const int nt = tl.nt, rows = tl.rows;
    const int64_t row0 = tl.row0;
    const bf16* We = W[tl.e];

    const bf16* a_src[C::CA];
    const bf16* b_src[C::CB];
    uint32_t a_ok = 0, b_ok = 0;
#pragma unroll
    for (int s = 0; s < C::CA; ++s) {
      const int r = r0 + s * C::RSTEP;
      const bool v = r < rows;
      a_ok |= uint32_t(v) << s;
      a_src[s] = A + (row0 + (v ? r : 0)) * K + cc * 8;
    }
    if constexpr (KN) {  // one source column (b_src[0], row 0; b_ok = the column is in N), k rows added per chunk
      const int col = nt * BN + cb * 8;
      b_ok = col < N;
      b_src[0] = We + (b_ok ? col : 0);
    } else {
#pragma unroll
      for (int s = 0; s < C::CB; ++s) {
        bool v;
        const int w = b_row<C::BN, true>(r0 + s * C::RSTEP, nt, glu, N, &v);
        b_ok |= uint32_t(v) << s;
        b_src[s] = We + int64_t(v ? w : 0) * K + cc * 8;
      }
    }
    auto load_stage = [&](int kt, int stage) {
      unsigned char* As = smem + stage * C::stage_bytes;
      unsigned char* Bs = As + C::a_bytes;
      if (kt == KT)
        return load_low_rank_tile<kThreads, BM, BN, KN>(As, Bs, tid, lr, tl.e, rows, row0, nt, glu, N, A);
      const int k0 = kt * BK;
      const bool kin = k0 + cc * 8 < K;
#pragma unroll
      for (int s = 0; s < C::CA; ++s)
        cp_async16(As + (r0 + s * C::RSTEP) * 128 + swz, a_src[s] + (kin ? k0 : 0), kin && (a_ok >> s & 1));
      if constexpr (KN) {
        // Rows past K zero-fill: stale shared memory must not meet A's zero-filled columns (0 · NaN).
#pragma unroll
        for (int s = 0; s < C::CBK; ++s) {
          const int k = k0 + rb + s * C::RSTEPB;
          const bool v = b_ok && k < K;
          cp_async16(Bs + b_pos + s * C::RSTEPB * 128, b_src[0] + (v ? int64_t(k) * N : 0), v);
        }
      } else {
#pragma unroll
        for (int s = 0; s < C::CB; ++s)
          cp_async16(Bs + (r0 + s * C::RSTEP) * 128 + swz, b_src[s] + (kin ? k0 : 0), kin && (b_ok >> s & 1));
      }
    };

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;

#pragma unroll
    for (int s = 0; s < P; ++s) {
      if (s < KTT) load_stage(s, s);
      cp_async_commit();
    }
#pragma unroll 1
    for (int kt = 0; kt < KTT; ++kt) {
      cp_async_wait<P - 1>();
      fence_proxy_async();
      __syncthreads();  // stage kt is complete for all; every warpgroup's MMAs on k-tile kt − 1 − KEEP are done
      // No branch around the MMAs (not even to skip a short tile's empty half): ptxas serialises wgmma in code it
      // cannot prove warpgroup-uniform. Tried again at 4fbda13 with the condition broadcast by a shuffle (wg·64 <
      // rows): ptxas injects warpgroup.arrive (C7519) and the skewed forward pair (moe_grouped_gemm_skewed) went from
      // 3.22 + 1.79 to 3.84 + 2.06 ms. The kernel is bound by L2 (ncu: L2 88 %, DRAM 71–76 %, issue slots 19–23 %),
      // not by the MMAs a short tile wastes.
      const uint32_t a_s = smem_s + (kt % S) * C::stage_bytes + wg * 64 * 128;
      const uint32_t b_s = smem_s + (kt % S) * C::stage_bytes + C::a_bytes;
      fence_regs<NACC>(acc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        if constexpr (KN)
          wgmma_k16<BN, 1>(acc, sw128_desc(a_s + ks * 32), sw128_mn_desc(b_s + ks * 2048, BK * 128));
        else
          wgmma_k16<BN, 0>(acc, sw128_desc(a_s + ks * 32), sw128_desc(b_s + ks * 32));
      }
      wgmma_commit();
      // Refill the stage of k-tile kt − 1 − KEEP while the MMAs run.
      if (kt + P < KTT) load_stage(kt + P, (kt + P) % S);
      cp_async_commit();
      wgmma_wait<C::KEEP>();
      fence_regs<NACC>(acc);
    }
    wgmma_wait<0>();
    fence_regs<NACC>(acc);
    cp_async_wait<0>();
    __syncthreads();

    store_wg_tile<BN>(acc, wg, wq, lane, rows, row0, nt, glu, N, epi, L, Cout, pre, pre16);
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Hopper with TMA and clusters of two or four CTAs (kWgmmaTma128x256, kWgmmaTma128x256c4): the 128 × 256 wgmma
// tile of grouped_gemm_wgmma_kernel, its operands loaded by the tensor memory accelerator from a producer warpgroup
// into 4 stages (the same swizzled layouts: TMA's 128-byte swizzle writes them), two consumer warpgroups running the
// MMAs and the epilogue. The CTAs of a cluster work on tiles that share operands, each loading a part of a shared
// tile and multicasting it to the CTAs that read it, so that L2 serves it once. Clusters of two (measured on the
// H200: no faster than each CTA loading its whole tiles, 4.80 against 4.82 ms on moe_grouped_gemm_skewed; what made
// the kernel faster than the cp.async one is the producer/consumer split, with the waits at CTA scope, and the
// skipped MMAs of empty halves):
//   - an expert's M tiles 2i and 2i + 1 with the same N tile share the weight tile (the routed experts get ~T·k/E
//     rows each, often a little over 128, so that the one-CTA kernel reads most weight slabs twice);
//   - an expert's last (or only) M tile with N tiles 2j and 2j + 1 shares the A tile (with an odd number of M tiles
//     above one, its unit comes right after the pairs of those N tiles: it reads their weight slabs from L2).
// Clusters of four (rank r), to halve the A tiles' share of the L2 traffic (a fifth to a third of it in clusters of
// two); on the H200 faster on the w_kn passes and slower on the forward ones (set_moe_expert_gemm_dx in
// cuda/device_model.h has the figures):
//   - M tiles 2i + (r & 1) with N tiles 2j + (r >> 1): each weight tile is shared by two M tiles and each A tile by
//     two N tiles, both halved among their two readers;
//   - the last odd (or only) M tile with N tiles 4j + r: its A tile shared by the four, its halves loaded by ranks 0
//     and 1, each weight tile loaded whole by its CTA.
// In both, a tile of at most 64 rows loads only the first half of its A tile (its second warpgroup runs no MMAs).
// The weights come through a tensor map over all experts at once (GroupedGemm::W_all: the experts back to back, in
// one of the GroupedWeightLayouts); a SwiGLU tile's weight rows are two boxes, the gate rows of its act columns and
// their up rows (b_row's halves). Rows past an expert's end are read (the next expert's, or zeros past n) and not
// stored.
// Barriers per stage: `full` (the producer's arrival with the stage's bytes, completed by the copies landing in this
// CTA, its own and the others' multicasts) and `empty` (one arrival of every consumer warp of the cluster: a copy of
// any CTA may then refill the stage in the CTAs it writes). The low-rank term's k-tile goes through cp.async from
// the producer warpgroup, into its own CTA only.

constexpr int kTmaThreads = 384;  // warpgroup 0: producer; 1 and 2: consumers (64 rows each)

struct TmaCfg {
  static constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
  static constexpr int a_bytes = BM * 128, b_bytes = BN * 128, stage_bytes = a_bytes + b_bytes;
  static constexpr int smem_bytes = STAGES * stage_bytes + 1024 + 2 * STAGES * 8;  // + alignment, the barriers
  static constexpr int NACC = BN / 2;
};

// A CTA's tile of its cluster's unit, and how its operands arrive. A: a_mask 0, this CTA loads its whole A tile;
// else it loads the 64-row half a_half (none: −1) and multicasts it to a_mask. W likewise: w_mask 0, its whole
// weight tile; else the half w_half, multicast to w_mask.
struct ClusterTile {
  int e, nt, rows;
  int64_t row0;
  bool last_b, last_a;  // no later unit reads this CTA's weight tile / A tile
  uint16_t a_mask, w_mask;
  int a_half, w_half;
};

// The expert of unit u of a cluster schedule (start from schedule_kernel), u's index among that expert's units, the
// expert's first row, its rows and its M tiles.
struct UnitExpert {
  int e, local, row_begin, rows, mtiles;
};
__device__ __forceinline__ UnitExpert unit_expert(int u, const int32_t* __restrict__ start,
                                                  const int32_t* __restrict__ offsets, int E) {
  const int e = owner_of(u, start, E), row_begin = offsets[e], rows = offsets[e + 1] - row_begin;
  return UnitExpert{e, u - start[e], row_begin, rows, (rows + TmaCfg::BM - 1) / TmaCfg::BM};
}
// t's expert, and its rows from M tile mt of ue's expert on.
__device__ __forceinline__ void place_tile(ClusterTile& t, const UnitExpert& ue, int mt) {
  t.e = ue.e, t.rows = min(TmaCfg::BM, ue.rows - mt * TmaCfg::BM), t.row0 = ue.row_begin + int64_t(mt) * TmaCfg::BM;
}

// Clusters of two: unit u's tile for CTA `rank`.
__device__ __forceinline__ ClusterTile locate_pair(int u, const int32_t* __restrict__ start,
                                                   const int32_t* __restrict__ offsets, int E, int n_tiles, int rank) {
  const UnitExpert ue = unit_expert(u, start, offsets, E);
  const int local = ue.local, mtiles = ue.mtiles, pairs = mtiles / 2;
  ClusterTile t;
  int mt;
  bool shared_b;
  if (!(mtiles & 1)) {  // N tile major, the M pair inner: the pairs reading one weight slab side by side
    t.nt = local / pairs, mt = 2 * (local % pairs) + rank, shared_b = true;
    t.last_b = local % pairs == pairs - 1, t.last_a = t.nt == n_tiles - 1;
  } else {
    // With a last odd M tile, the units go by N-tile pairs: the M pairs of N tiles 2j and 2j + 1, then the last M
    // tile's unit over both, so that it reads the weight slabs while the pairs have them in L2 (after all the pairs,
    // as before, it read the expert's weights from memory once more).
    const int j = local / (2 * pairs + 1), w = local - j * (2 * pairs + 1);
    const int in_group = 2 * j + 1 < n_tiles ? 2 * pairs : pairs;  // the group's pair units (one N tile at the end)
    if (w < in_group) {
      t.nt = 2 * j + w / pairs, mt = 2 * (w % pairs) + rank, shared_b = true;
      t.last_b = false, t.last_a = t.nt == n_tiles - 1;
    } else {
      t.nt = 2 * j + rank, mt = mtiles - 1, shared_b = false;
      t.last_b = true, t.last_a = 2 * j + 2 >= n_tiles;
    }
  }
  // The pair shares the weight tile (each CTA loads a half) or the A tile.
  t.w_mask = shared_b ? 3 : 0, t.w_half = shared_b ? rank : -1;
  t.a_mask = shared_b ? 0 : 3, t.a_half = shared_b ? -1 : rank;
  place_tile(t, ue, mt);
  return t;
}

// Clusters of four: unit u's tile for CTA `rank`. An expert's units go by groups of four N tiles 4j … 4j + 3: the M
// pairs with N tiles 4j, 4j + 1, then with 4j + 2, 4j + 3, then (m odd) the last M tile's unit over the four, so
// that it reads their weight slabs while they are in L2.
__device__ __forceinline__ ClusterTile locate_quad(int u, const int32_t* __restrict__ start,
                                                   const int32_t* __restrict__ offsets, int E, int n_tiles, int rank) {
  const UnitExpert ue = unit_expert(u, start, offsets, E);
  const int pairs = ue.mtiles / 2, odd = ue.mtiles & 1;
  const int j = ue.local / (2 * pairs + odd), w = ue.local - j * (2 * pairs + odd);  // all groups but the last whole
  const int in_group = (n_tiles - 4 * j > 2 ? 2 : 1) * pairs;                        // the group's 2 × 2 units
  ClusterTile t;
  int mt;
  if (w < in_group) {
    const int np = w / pairs, i = w - np * pairs;
    t.nt = 4 * j + 2 * np + (rank >> 1), mt = 2 * i + (rank & 1);
    t.last_b = i == pairs - 1 && !odd, t.last_a = 4 * j + 2 * np + 2 >= n_tiles;
    t.w_mask = uint16_t(3 << (rank & 2)), t.w_half = rank & 1;
    t.a_mask = uint16_t(5 << (rank & 1)), t.a_half = rank >> 1;
  } else {
    t.nt = 4 * j + rank, mt = ue.mtiles - 1;
    t.last_b = true, t.last_a = 4 * j + 4 >= n_tiles;
    t.w_mask = 0, t.w_half = -1;
    t.a_mask = 15, t.a_half = rank < 2 ? rank : -1;
  }
  place_tile(t, ue, mt);
  return t;
}

template <int CL>
__device__ __forceinline__ ClusterTile locate_unit(int u, const int32_t* __restrict__ start,
                                                   const int32_t* __restrict__ offsets, int E, int n_tiles, int rank) {
  if constexpr (CL == 4) return locate_quad(u, start, offsets, E, n_tiles, rank);
  else return locate_pair(u, start, offsets, E, n_tiles, rank);
}

template <bool KN, int CL, int LAYOUT>
__global__ void __launch_bounds__(kTmaThreads, 1)
    grouped_gemm_tma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                            const bf16* __restrict__ A, const int32_t* __restrict__ offsets, void* Cout,
                            const int32_t* __restrict__ start, int E, int N, int K, int n_tiles, int epi, float L,
                            GroupedLowRank lr, void* __restrict__ pre, bool pre16) {
  using C = TmaCfg;
  constexpr int S = C::STAGES, BN = C::BN, NACC = C::NACC;
  extern __shared__ __align__(1024) unsigned char tma_smem_raw[];
  const uint32_t raw_s = smem_addr(tma_smem_raw), pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = tma_smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  const uint32_t full0 = smem_s + S * C::stage_bytes, empty0 = full0 + 8 * S;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const uint32_t rank = cluster_rank();
  const bool glu = !KN && epi == static_cast<int>(GroupedEpilogue::kSwiGLU);
  const int total = start[E];
  const int KT = (K + C::BK - 1) / C::BK, KTT = KT + (lr.parts > 0);
  const int cid = static_cast<int>(blockIdx.x) / CL, clusters = static_cast<int>(gridDim.x) / CL;
  // A consumer warp's release of a stage: one arrival on that stage's `empty` barrier in every CTA of the cluster.
  const auto release = [](uint32_t empty) {
#pragma unroll
    for (int c = 0; c < CL; ++c) mbar_arrive_cluster(empty, c);
  };

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, CL * 8);  // the consumer warps of the cluster
    }
    mbar_init_fence();
  }
  cluster_sync();  // every CTA's barriers exist before any copy or remote arrival reaches them

  if (wg == 0) {
    if (tid == 0) {
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b);
    }
    // L2 policies, per unit: an operand tile that a later unit reads again (a weight tile by the next M pair or the
    // odd M tile's unit, an A tile by the next N tiles) is loaded evict_last, and by its last reader evict_first,
    // which lowers those lines again, so that they do not hold L2 after the GEMM. Against weights always
    // evict_first and A rows evict_normal (kernel traces of the LoRA step on the H200, 3 runs each): the 6
    // input-gradient launches 14.60 -> 14.16 ms, the 6 forward ones 15.15 -> 14.86 ms, the kernels after them alike
    // within the runs' spread (the KDA backward's prep +0.08 ms). Before that, evict_last on every A load made the
    // input-gradient launches faster too, but the KDA and MLA backward kernels after them ~1.2 ms slower: nothing
    // lowered the lines.
    const uint64_t p_first = l2_policy_evict_first(), p_last = l2_policy_evict_last();
    uint32_t it = 0;
    for (int u = cid; u < total && (tid == 0 || lr.parts > 0); u += clusters) {
      const ClusterTile tl = locate_unit<CL>(u, start, offsets, E, n_tiles, static_cast<int>(rank));
      const uint64_t pol_b = tl.last_b ? p_first : p_last, pol_a = tl.last_a ? p_first : p_last;
      const int row0 = static_cast<int>(tl.row0);
      for (int kt = 0; kt < KTT; ++kt, ++it) {
        const int st = static_cast<int>(it % S);
        const uint32_t full = full0 + 8 * st, a_s = smem_s + st * C::stage_bytes, b_s = a_s + C::a_bytes;
        // Thread 0 alone waits for the stage (the others, which only help with the low-rank tile, could otherwise
        // fall phases behind a barrier's parity) and lets them in by the named barrier below.
        if (tid == 0) mbar_wait(empty0 + 8 * st, ((it / S) & 1) ^ 1);
        if (kt < KT) {
          if (tid != 0) continue;
          const int k0 = kt * C::BK;
          // A tile of at most 64 rows: its second half, whose consumer warpgroup runs no MMAs, is not loaded.
          const bool half_a = tl.rows <= 64;
          // Every CTA reading this A tile skips the half alike (the tile's rows are the same for all of them).
          mbar_arrive_expect_tx(full, C::stage_bytes - (half_a ? 8192 : 0));
          if (!tl.a_mask) {
            tma_load_2d(a_s, &map_a, full, k0, row0, pol_a);
            if (!half_a) tma_load_2d(a_s + 8192, &map_a, full, k0, row0 + 64, pol_a);
          } else if (tl.a_half == 0 || (tl.a_half == 1 && !half_a)) {
            tma_load_2d_mc(a_s + tl.a_half * 8192, &map_a, full, k0, row0 + 64 * tl.a_half, tl.a_mask, pol_a);
          }
          const bool sh_b = tl.w_mask != 0;  // this CTA loads the half w_half of its weight tile for w_mask
          // A weight box at column c and row r of the expert's natural matrix, by layout (GroupedWeightLayout, a
          // template parameter: a layout branch per load made the w_kn passes in clusters of four 3-7 % slower).
          const auto load_w = [&](uint32_t dst, int c, int r) {
            constexpr int kRowsL = static_cast<int>(GroupedWeightLayout::kRows);
            constexpr int kColsL = static_cast<int>(GroupedWeightLayout::kColumnBlocks);
            const int cols = KN ? N : K;
            if constexpr (LAYOUT == kRowsL) {
              if (!sh_b) tma_load_3d(dst, &map_b, full, c, r, tl.e, pol_b);
              else tma_load_3d_mc(dst, &map_b, full, c, r, tl.e, tl.w_mask, pol_b);
            } else if constexpr (LAYOUT == kColsL) {
              const int b = tl.e * (cols / 64) + c / 64;
              if (!sh_b) tma_load_3d(dst, &map_b, full, 0, r, b, pol_b);
              else tma_load_3d_mc(dst, &map_b, full, 0, r, b, tl.w_mask, pol_b);
            } else {
              if (!sh_b) tma_load_5d(dst, &map_b, full, 0, r % 128, c / 64, r / 128, tl.e, pol_b);
              else tma_load_5d_mc(dst, &map_b, full, 0, r % 128, c / 64, r / 128, tl.e, tl.w_mask, pol_b);
            }
          };
          if constexpr (KN) {  // four 64-column blocks of k rows
            for (int j = 0; j < 4; ++j)
              if (!sh_b || j / 2 == tl.w_half) load_w(b_s + j * 8192, tl.nt * BN + 64 * j, k0);
          } else {  // two halves of 128 weight rows (SwiGLU: the gate rows, then the up rows of the act columns)
            for (int h = 0; h < 2; ++h)
              if (!sh_b || h == tl.w_half)
                load_w(b_s + h * 16384, k0, glu ? h * (N / 2) + tl.nt * (BN / 2) : tl.nt * BN + 128 * h);
          }
        } else {  // the low-rank k-tile: this CTA's alone, by the whole warpgroup
          asm volatile("barrier.sync 1, 128;\n" ::: "memory");  // not .aligned: lane 0 comes apart
          unsigned char* As = smem + st * C::stage_bytes;
          load_low_rank_tile<128, C::BM, BN, KN>(As, As + C::a_bytes, tid, lr, tl.e, tl.rows, tl.row0, tl.nt, glu,
                                                 N, A);
          cp_async_commit();
          cp_async_wait<0>();
          fence_proxy_async();
          asm volatile("barrier.sync 1, 128;\n" ::: "memory");  // not .aligned: lane 0 comes apart
          if (tid == 0) mbar_arrive(full);
        }
      }
    }
  } else {
    const int cw = wg - 1, wq = warp & 3;
    uint32_t it = 0;
    for (int u = cid; u < total; u += clusters) {
      const ClusterTile tl = locate_unit<CL>(u, start, offsets, E, n_tiles, static_cast<int>(rank));
      // No rows in this warpgroup's half (a short last M tile): no MMAs, the stages passed on. (The role split
      // already runs the warpgroups apart, so this costs no wgmma serialisation here, unlike in the one-role kernel.)
      if (cw * 64 >= tl.rows) {
        for (int kt = 0; kt < KTT; ++kt, ++it) {
          const int st = static_cast<int>(it % S);
          mbar_wait(full0 + 8 * st, (it / S) & 1);
          if (lane == 0) release(empty0 + 8 * st);
        }
        continue;
      }
      float acc[NACC];
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
      for (int kt = 0; kt < KTT; ++kt, ++it) {
        const int st = static_cast<int>(it % S);
        mbar_wait(full0 + 8 * st, (it / S) & 1);
        const uint32_t a_s = smem_s + st * C::stage_bytes + cw * 64 * 128, b_s = smem_s + st * C::stage_bytes +
                                                                                   C::a_bytes;
        fence_regs<NACC>(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::BK / 16; ++ks) {
          if constexpr (KN)
            wgmma_k16<BN, 1>(acc, sw128_desc(a_s + ks * 32), sw128_mn_desc(b_s + ks * 2048, C::BK * 128));
          else
            wgmma_k16<BN, 0>(acc, sw128_desc(a_s + ks * 32), sw128_desc(b_s + ks * 32));
        }
        wgmma_commit();
        wgmma_wait<1>();  // the MMAs of the previous k-tile are done: its stage is free in every CTA
        fence_regs<NACC>(acc);
        if (kt > 0 && lane == 0) release(empty0 + 8 * ((it - 1) % S));
      }
      wgmma_wait<0>();
      fence_regs<NACC>(acc);
      if (lane == 0) release(empty0 + 8 * ((it - 1) % S));
      store_wg_tile<BN>(acc, cw, wq, lane, tl.rows, tl.row0, tl.nt, glu, N, epi, L, Cout, pre,
                        pre16);
    }
  }
  cluster_sync();  // no CTA leaves while another may still arrive on its barriers
}

// Per-device state set up on the first call, so that later calls (and CUDA graph captures) make no attribute calls.
constexpr int kMaxDevices = 64;

int current_device() {
  int dev = 0;
  NEXTLM_CUDA_CHECK(cudaGetDevice(&dev));
  check(dev >= 0 && dev < kMaxDevices, "grouped_gemm: device ordinal ", dev, " out of range");
  return dev;
}

// The N tiles of a row block (the schedule's other input besides the offsets and C::BM).
template <class C>
int n_tiles_of(const GroupedGemm& g) {
  return g.epilogue == GroupedEpilogue::kSwiGLU ? static_cast<int>(ceil_div(g.N / 2, C::BN / 2))
                                                : static_cast<int>(ceil_div(g.N, C::BN));
}

// The pre-activation output of g, fp32 (pre) or bf16 (pre16), or null.
void* pre_of(const GroupedGemm& g) { return g.pre16 ? static_cast<void*>(g.pre16) : static_cast<void*>(g.pre); }

template <class C, bool kWgmma, bool KN>
void launch(const GroupedGemm& g, int32_t* start, cudaStream_t st) {
  const int n_tiles = n_tiles_of<C>(g);
  if (!g.schedule_ready) {
    schedule_kernel<<<1, kScanThreads, 0, st>>>(g.offsets, g.E, C::BM, n_tiles, 1, start);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  // Each non-empty expert wastes at most one partial M tile, so the tile count is at most this.
  const int64_t bound = n_tiles * (ceil_div(g.n, C::BM) + g.E);
  const int dev = current_device();
  const int grid = static_cast<int>(std::min<int64_t>(bound, int64_t(sm_count()) * C::MINB));
  const auto kernel = [] {
    if constexpr (kWgmma) return grouped_gemm_wgmma_kernel<C, KN>;
    else return grouped_gemm_kernel<C, KN>;
  }();
  // Opt into the dynamic shared memory once per device and kernel (idempotent: a race only repeats the call).
  static std::atomic<uint64_t> smem_set{0};
  if (!(smem_set.load(std::memory_order_acquire) >> dev & 1)) {
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem_bytes));
    smem_set.fetch_or(uint64_t{1} << dev, std::memory_order_release);
  }
  if constexpr (kWgmma) {
    kernel<<<grid, kThreads, C::smem_bytes, st>>>(g.A, g.offsets, g.W, g.C, start, g.E, g.N, g.K,
                                                  static_cast<int>(g.epilogue), g.limit, g.low_rank, pre_of(g),
                                                  g.pre16 != nullptr);
  } else {
    kernel<<<grid, kThreads, C::smem_bytes, st>>>(g.A, g.offsets, g.W, g.C, start, g.E, g.N, g.K,
                                                  static_cast<int>(g.epilogue), g.limit);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

// A tensor map of the GEMM's operands (cuda/tensor_map.h).
CUtensorMap tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                       const cuuint32_t* box) {
  return bf16_tensor_map(base, rank, dims, strides, box, "grouped_gemm");
}

template <bool KN, int CL, int LAYOUT>
void launch_tma(const GroupedGemm& g, int32_t* start, cudaStream_t st) {
  using C = TmaCfg;
  const int n_tiles = n_tiles_of<C>(g);
  if (!g.schedule_ready) {
    schedule_kernel<<<1, kScanThreads, 0, st>>>(g.offsets, g.E, C::BM, n_tiles, CL, start);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  const cuuint64_t K = static_cast<cuuint64_t>(g.K), N = static_cast<cuuint64_t>(g.N), E = static_cast<cuuint64_t>(g.E);
  const cuuint64_t a_dims[2] = {K, static_cast<cuuint64_t>(g.n)}, a_strides[1] = {K * 2};
  const cuuint32_t a_box[2] = {64, 64};
  const CUtensorMap map_a = tensor_map(g.A, 2, a_dims, a_strides, a_box);
  CUtensorMap map_b;
  // The natural matrix of each expert is R × Cn (rows × columns: [N, K], or [K, N] with w_kn).
  const cuuint64_t R = KN ? K : N, Cn = KN ? N : K;
  const cuuint32_t box_rows = KN ? 64 : 128, box_cols = 64;
  if (g.w_layout == GroupedWeightLayout::kColumnBlocks) {  // (64, R, E·Cn/64)
    const cuuint64_t dims[3] = {64, R, E * (Cn / 64)}, strides[2] = {128, R * 128};
    const cuuint32_t box[3] = {64, box_rows, 1};
    map_b = tensor_map(g.W_all, 3, dims, strides, box);
  } else if (g.w_layout == GroupedWeightLayout::kTiles) {  // (64, 128, Cn/64, R/128, E)
    const cuuint64_t dims[5] = {64, 128, Cn / 64, R / 128, E},
                     strides[4] = {128, 128 * 128, (Cn / 64) * 128 * 128, R * Cn * 2};
    const cuuint32_t box[5] = {64, box_rows, 1, 1, 1};
    map_b = tensor_map(g.W_all, 5, dims, strides, box);
  } else {  // (Cn, R, E): boxes of 64 columns × 64 k rows (w_kn) or 64 k × 128 rows
    const cuuint64_t dims[3] = {Cn, R, E}, strides[2] = {Cn * 2, R * Cn * 2};
    const cuuint32_t box[3] = {box_cols, box_rows, 1};
    map_b = tensor_map(g.W_all, 3, dims, strides, box);
  }
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(kTmaThreads);
  cfg.dynamicSmemBytes = C::smem_bytes;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr, cfg.numAttrs = 1;
  // The clusters that fit at once (a GPC whose free SMs are not a multiple of CL leaves the rest idle): a persistent
  // grid of more would run the excess in a second wave, each with a full share of the units.
  const int dev = current_device();
  static std::atomic<uint64_t> set{0};
  static int resident[kMaxDevices];
  if (!(set.load(std::memory_order_acquire) >> dev & 1)) {
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_tma_kernel<KN, CL, LAYOUT>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem_bytes));
    cfg.gridDim = dim3(static_cast<unsigned>(sm_count()));
    int n = 0;
    NEXTLM_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, grouped_gemm_tma_kernel<KN, CL, LAYOUT>, &cfg));
    check(n >= 1, "grouped_gemm: the TMA kernel's clusters of ", CL, " do not fit on this device");
    resident[dev] = n;
    set.fetch_or(uint64_t{1} << dev, std::memory_order_release);
  }
  // Each non-empty expert has at most one odd M tile, so the units are at most this.
  const int64_t bound = n_tiles * (ceil_div(g.n, C::BM) + g.E);
  const int clusters = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(bound, resident[dev])));
  cfg.gridDim = dim3(static_cast<unsigned>(CL * clusters));
  NEXTLM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, grouped_gemm_tma_kernel<KN, CL, LAYOUT>, map_a, map_b, g.A, g.offsets, g.C,
                                       static_cast<const int32_t*>(start), g.E, g.N, g.K, n_tiles,
                                       static_cast<int>(g.epilogue), g.limit, g.low_rank, pre_of(g),
                                       g.pre16 != nullptr));
}

static_assert(static_cast<int>(GroupedWeightLayout::kRows) == 0 &&
              static_cast<int>(GroupedWeightLayout::kColumnBlocks) == 1 &&
              static_cast<int>(GroupedWeightLayout::kTiles) == 2);

template <bool KN, int CL>
void launch_tma_layout(const GroupedGemm& g, int32_t* start, cudaStream_t st) {
  switch (g.w_layout) {
    case GroupedWeightLayout::kRows: return launch_tma<KN, CL, 0>(g, start, st);
    case GroupedWeightLayout::kColumnBlocks: return launch_tma<KN, CL, 1>(g, start, st);
    case GroupedWeightLayout::kTiles: return launch_tma<KN, CL, 2>(g, start, st);
  }
  fail("grouped_gemm: unknown weight layout ", static_cast<int>(g.w_layout));
}

template <bool KN>
void dispatch(const GroupedGemm& g, int32_t* workspace, cudaStream_t stream) {
  switch (g.kernel) {
    case GroupedGemmKernel::kMma128x128x32: launch<Cfg0, false, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kMma128x128x64: launch<Cfg1, false, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kMma128x256x32: launch<Cfg2, false, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kWgmma128x128: launch<WgCfg0, true, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kWgmma128x256: launch<WgCfg1, true, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kWgmmaTma128x256:
      if (g.W_all) launch_tma_layout<KN, 2>(g, workspace, stream);
      else launch<WgCfg1, true, KN>(g, workspace, stream);
      break;
    case GroupedGemmKernel::kWgmmaTma128x256c4:
      if (g.W_all) launch_tma_layout<KN, 4>(g, workspace, stream);
      else launch<WgCfg1, true, KN>(g, workspace, stream);
      break;
    default: fail("grouped_gemm: unknown kernel variant ", static_cast<int>(g.kernel));
  }
}

}  // namespace

const char* grouped_gemm_kernel_name(GroupedGemmKernel k) {
  switch (k) {
    case GroupedGemmKernel::kMma128x128x32: return "mma128x128x32_s4";
    case GroupedGemmKernel::kMma128x128x64: return "mma128x128x64_s3";
    case GroupedGemmKernel::kMma128x256x32: return "mma128x256x32_s4";
    case GroupedGemmKernel::kWgmma128x128: return "wgmma128x128x64_s3";
    case GroupedGemmKernel::kWgmma128x256: return "wgmma128x256x64_s4";
    case GroupedGemmKernel::kWgmmaTma128x256: return "wgmma_tma128x256x64_s4_c2";
    case GroupedGemmKernel::kWgmmaTma128x256c4: return "wgmma_tma128x256x64_s4_c4";
  }
  return "?";
}

int64_t grouped_gemm_workspace_ints(int E) { return int64_t(E) + 1; }

namespace {

// (BM, N tiles, CTAs a unit: 1, or the TMA kernel's clusters) of g's schedule.
std::tuple<int, int, int> schedule_shape(const GroupedGemm& g) {
  switch (g.kernel) {
    case GroupedGemmKernel::kMma128x128x32: return {Cfg0::BM, n_tiles_of<Cfg0>(g), 1};
    case GroupedGemmKernel::kMma128x128x64: return {Cfg1::BM, n_tiles_of<Cfg1>(g), 1};
    case GroupedGemmKernel::kMma128x256x32: return {Cfg2::BM, n_tiles_of<Cfg2>(g), 1};
    case GroupedGemmKernel::kWgmma128x128: return {WgCfg0::BM, n_tiles_of<WgCfg0>(g), 1};
    case GroupedGemmKernel::kWgmma128x256: return {WgCfg1::BM, n_tiles_of<WgCfg1>(g), 1};
    case GroupedGemmKernel::kWgmmaTma128x256: return {TmaCfg::BM, n_tiles_of<TmaCfg>(g), g.W_all ? 2 : 1};
    case GroupedGemmKernel::kWgmmaTma128x256c4: return {TmaCfg::BM, n_tiles_of<TmaCfg>(g), g.W_all ? 4 : 1};
  }
  fail("grouped_gemm: unknown kernel variant ", static_cast<int>(g.kernel));
}

}  // namespace

bool grouped_gemm_same_schedule(const GroupedGemm& a, const GroupedGemm& b) {
  return a.offsets == b.offsets && a.E == b.E && schedule_shape(a) == schedule_shape(b);
}

namespace {

// 16 bytes a thread: row r's columns c … c + 7 of expert e, from the row-major matrix to the layout (or back).
__global__ void block_weights_kernel(const bf16* __restrict__ src, bf16* __restrict__ dst, int64_t E, int64_t rows,
                                     int64_t cols, bool tiles, bool to_layout) {
  const int64_t chunks = cols / 8, n = E * rows * chunks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = (i % chunks) * 8, er = i / chunks, e = er / rows, r = er - e * rows;
    const int64_t b =
        tiles ? (e * rows * cols + ((r / 128) * (cols / 64) + c / 64) * 8192 + (r % 128) * 64 + c % 64) / 8
              : (((e * (cols / 64) + c / 64) * rows + r) * 64 + c % 64) / 8;
    reinterpret_cast<uint4*>(dst)[to_layout ? b : i] = reinterpret_cast<const uint4*>(src)[to_layout ? i : b];
  }
}

}  // namespace

void block_expert_weights(const bf16* src, bf16* dst, int64_t E, int64_t rows, int64_t cols,
                          GroupedWeightLayout layout, cudaStream_t stream, bool to_layout) {
  if (layout == GroupedWeightLayout::kRows) {
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(dst, src, E * rows * cols * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const bool tiles = layout == GroupedWeightLayout::kTiles;
  check(cols % 64 == 0 && cols > 0 && rows > 0 && E > 0 && (!tiles || rows % 128 == 0),
        "block_expert_weights: ", E, " × ", rows, " × ", cols, " weights: the columns must be a multiple of 64",
        tiles ? " and the rows of 128" : "");
  const int64_t n = E * rows * cols / 8;
  block_weights_kernel<<<static_cast<int>(std::min<int64_t>(ceil_div(n, 256), 65536)), 256, 0, stream>>>(
      src, dst, E, rows, cols, tiles, to_layout);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void grouped_gemm(const GroupedGemm& g, int32_t* workspace, cudaStream_t stream) {
  check(g.K % 8 == 0 && g.K > 0, "grouped_gemm: K must be a positive multiple of 8, got ", g.K);
  check(g.N % (g.epilogue == GroupedEpilogue::kSwiGLU ? 16 : 8) == 0 && g.N > 0,
        "grouped_gemm: N must be a positive multiple of 8 (16 with the SwiGLU epilogue), got ", g.N);
  check(g.E >= 1 && g.n >= 0 && g.n < (int64_t{1} << 31), "grouped_gemm: bad E ", g.E, " or n ", g.n);
  check(!g.w_kn || g.epilogue != GroupedEpilogue::kSwiGLU,
        "grouped_gemm: the SwiGLU epilogue needs W as [N, K] (w_kn = false); with w_kn use kF32, kF32Add or kBf16");
  check(!(g.pre || g.pre16) || (g.epilogue == GroupedEpilogue::kSwiGLU && grouped_gemm_is_wgmma(g.kernel)),
        "grouped_gemm: the pre-activation output comes with the SwiGLU epilogue of a wgmma kernel");
  check(!(g.pre && g.pre16), "grouped_gemm: the pre-activations go to pre or to pre16, not both");
  const GroupedLowRank& lr = g.low_rank;
  if (lr.parts) {
    check(lr.parts <= 2 && grouped_gemm_is_wgmma(g.kernel),
          "grouped_gemm: a low-rank term takes 1 or 2 parts and a wgmma kernel (got ", lr.parts, " parts, kernel ",
          grouped_gemm_kernel_name(g.kernel), ")");
    for (int p = 0; p < lr.parts; ++p) {
      check(lr.U[p] && lr.V[p] && reinterpret_cast<uintptr_t>(lr.U[p]) % 16 == 0 && lr.r[p] > 0 &&
                lr.r[p] % 8 == 0 && lr.r[p] <= 64 / lr.parts && lr.ldu[p] >= lr.r[p] && lr.ldu[p] % 8 == 0,
            "grouped_gemm: low-rank part ", p, ": rank ", lr.r[p], " (a multiple of 8, at most ", 64 / lr.parts,
            "), row stride ", lr.ldu[p], " (a multiple of 8 ≥ the rank) and 16-byte aligned factors");
      check(g.w_kn || (lr.c0[p] >= 0 && lr.width[p] > 0 && lr.c0[p] % 8 == 0 && lr.width[p] % 8 == 0 &&
                       lr.c0[p] + lr.width[p] <= g.N),
            "grouped_gemm: low-rank part ", p, " covers columns ", lr.c0[p], " … ", lr.c0[p] + lr.width[p],
            " of ", g.N);
    }
  }
  if (g.w_layout != GroupedWeightLayout::kRows) {
    check(g.W_all && (g.kernel == GroupedGemmKernel::kWgmmaTma128x256 ||
                      g.kernel == GroupedGemmKernel::kWgmmaTma128x256c4),
          "grouped_gemm: weights in blocks need W_all and a TMA kernel variant, got ",
          grouped_gemm_kernel_name(g.kernel));
    const int rows = g.w_kn ? g.K : g.N, cols = g.w_kn ? g.N : g.K;
    const bool tiles = g.w_layout == GroupedWeightLayout::kTiles;
    check(cols % 64 == 0 && (!tiles || (rows % 128 == 0 && (g.epilogue != GroupedEpilogue::kSwiGLU ||
                                                           g.N % 256 == 0))),
          "grouped_gemm: weights in ", tiles ? "tiles" : "column blocks", " need their columns (", cols,
          ") a multiple of 64", tiles ? " and their rows (" + std::to_string(rows) + ") of 128 (256 with SwiGLU)" : "");
  }
  if (g.n == 0) return;
  if (g.w_kn) dispatch<true>(g, workspace, stream);
  else dispatch<false>(g, workspace, stream);
}

}  // namespace nextlm::cuda
