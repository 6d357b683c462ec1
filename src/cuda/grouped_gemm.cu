// Grouped expert GEMM (see grouped_gemm.h): a one-block scheduling kernel (per-expert tile counts → prefix sum) and a
// persistent mma.sync or wgmma bf16 → fp32 kernel over the global tile list, with fp32, bf16 or fused clamped-SwiGLU
// stores; each kernel also comes in a w_kn form (W_e [K, N], C = A·W_e: the input gradient of the same linear).
// The CPU reference is nn.Linear per expert followed by moe.cu's swiglu: act = silu(min(g, L)) · clamp(u, −L, L).
#include "cuda/grouped_gemm.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"
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

// start[e] = Σ_{e' < e} tiles(e'), start[E] = total, with tiles(e) = ceil(rows_e / BM) · n_tiles.
__global__ void __launch_bounds__(kScanThreads) schedule_kernel(const int32_t* __restrict__ offsets, int E, int BM,
                                                                int n_tiles, int32_t* __restrict__ start) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int carry = 0;
  for (int base = 0; base < E; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int rows = e < E ? offsets[e + 1] - offsets[e] : 0;
    const int tiles = (rows + BM - 1) / BM * n_tiles;
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

// Weight row held by row r of a tile's B operand. SwiGLU tiles interleave gate and up in blocks of eight rows (n8
// MMA tiles): block b holds gate rows (b even) or up rows (b odd) of act columns j·BN/2 + (b/2)·8 .. +7, so that one
// thread's accumulators for n8 tiles 2q and 2q+1 are the gate and the up of the same act columns.
template <class C>
__device__ __forceinline__ int b_row(int r, int nt, bool glu, int N, bool* valid) {
  if (!glu) {
    const int w = nt * C::BN + r;
    *valid = w < N;
    return w;
  }
  const int I = N / 2, b = r >> 3;
  const int col = nt * (C::BN / 2) + (b >> 1) * 8 + (r & 7);
  *valid = col < I;
  return (b & 1) * I + col;
}

// One output tile: expert e, N tile nt, first row row0 (global), rows valid rows (≤ BM).
struct Tile {
  int e, nt, rows;
  int64_t row0;
};

// Tiles of an expert are numbered N-tile-major with the M tile innermost, so that the M tiles reading the same weight
// slab are neighbours in the list and run at the same time.
__device__ __forceinline__ Tile locate(int tile, const int32_t* __restrict__ start,
                                       const int32_t* __restrict__ offsets, int E, int BM) {
  // The expert owning this tile: the last e with start[e] ≤ tile (empty experts share their successor's start).
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (start[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
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
        const int w = b_row<C>(r0 + s * C::RSTEP, nt, glu, N, &v);
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
                              GroupedLowRank lr, float* __restrict__ pre) {
  extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
  const uint32_t raw_s = smem_addr(wg_smem_raw), pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = wg_smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK, S = C::STAGES, NACC = C::NACC, P = C::PREFETCH;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup (64-row half) and warp within it (16-row quarter)
  const int g = lane >> 2, t4 = lane & 3;
  const bool glu = !KN && epi == static_cast<int>(GroupedEpilogue::kSwiGLU);
  const int total = start[E];
  const int KT = (K + BK - 1) / BK, KTT = KT + (lr.parts > 0);  // KTT: with the low-rank term's k-tile
  const int slot = lr.parts > 1 ? BK / 2 : BK;                  // its columns per part
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
        const int w = b_row<C>(r0 + s * C::RSTEP, nt, glu, N, &v);
        b_ok |= uint32_t(v) << s;
        b_src[s] = We + int64_t(v ? w : 0) * K + cc * 8;
      }
    }
    // The low-rank term's k-tile: column (A) or k row (KN's B) j of it is column j mod slot of part j / slot, zero
    // past the part's rank; without KN, B row w (an output column) reads part p's V row w − c0_p inside its columns.
    // (Parts are picked with selects, not indexed: a dynamic index would put the kernel parameter on the stack.)
    auto load_low_rank = [&](unsigned char* As, unsigned char* Bs) {
      const int pa = cc * 8 / slot, ja = cc * 8 % slot;
      const int ra = pa ? lr.r[1] : lr.r[0], lda = pa ? lr.ldu[1] : lr.ldu[0];
      const bool a_in = pa < lr.parts && ja < ra;
      const bf16* U = pa ? lr.U[1] : lr.U[0];
#pragma unroll
      for (int s = 0; s < C::CA; ++s) {
        const bool v = a_in && (a_ok >> s & 1);
        cp_async16(As + (r0 + s * C::RSTEP) * 128 + swz, v ? U + (row0 + r0 + s * C::RSTEP) * lda + ja : A, v);
      }
      if constexpr (KN) {
        const int col = nt * BN + cb * 8;
#pragma unroll
        for (int s = 0; s < C::CBK; ++s) {
          const int k = rb + s * C::RSTEPB, p = k / slot, j = k % slot;
          const bool v = col < N && p < lr.parts && j < (p ? lr.r[1] : lr.r[0]);
          cp_async16(Bs + b_pos + s * C::RSTEPB * 128, v ? (p ? lr.V[1] : lr.V[0])[tl.e] + int64_t(j) * N + col : We,
                     v);
        }
      } else {
        const int c0 = pa ? lr.c0[1] : lr.c0[0], c1 = c0 + (pa ? lr.width[1] : lr.width[0]);
        const bf16* Ve = a_in ? (pa ? lr.V[1] : lr.V[0])[tl.e] : We;
#pragma unroll
        for (int s = 0; s < C::CB; ++s) {
          bool v;
          const int w = b_row<C>(r0 + s * C::RSTEP, nt, glu, N, &v);
          v = v && a_in && w >= c0 && w < c1;
          cp_async16(Bs + (r0 + s * C::RSTEP) * 128 + swz, v ? Ve + int64_t(w - c0) * ra + ja : We, v);
        }
      }
    };
    auto load_stage = [&](int kt, int stage) {
      unsigned char* As = smem + stage * C::stage_bytes;
      unsigned char* Bs = As + C::a_bytes;
      if (kt == KT) return load_low_rank(As, Bs);
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

    // Accumulator layout (per warp as mma.sync's C, per n8 block j): acc[4j + 2h + c] = (row 16·wq + g + 8h,
    // column 8j + 2·t4 + c) of the warpgroup's 64 × BN.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wg * 64 + wq * 16 + g + 8 * h;
      if (r >= rows) continue;
      const int64_t row = row0 + r;
      if (glu) {
        const int I = N / 2;
        bf16* out = static_cast<bf16*>(Cout) + row * I;
#pragma unroll
        for (int q = 0; q < BN / 16; ++q) {
          const int col = nt * (BN / 2) + q * 8 + 2 * t4;
          if (col >= I) continue;
          const float g0 = acc[8 * q + 2 * h], g1 = acc[8 * q + 2 * h + 1];
          const float u0 = acc[8 * q + 4 + 2 * h], u1 = acc[8 * q + 4 + 2 * h + 1];
          store_bf16x2(out + col, swiglu(g0, u0, L), swiglu(g1, u1, L));
          if (pre) {
            *reinterpret_cast<float2*>(pre + row * N + col) = make_float2(g0, g1);
            *reinterpret_cast<float2*>(pre + row * N + I + col) = make_float2(u0, u1);
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

template <class C, bool kWgmma, bool KN>
void launch(const GroupedGemm& g, int32_t* start, cudaStream_t st) {
  const int n_tiles = n_tiles_of<C>(g);
  if (!g.schedule_ready) {
    schedule_kernel<<<1, kScanThreads, 0, st>>>(g.offsets, g.E, C::BM, n_tiles, start);
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
                                                  static_cast<int>(g.epilogue), g.limit, g.low_rank, g.pre);
  } else {
    kernel<<<grid, kThreads, C::smem_bytes, st>>>(g.A, g.offsets, g.W, g.C, start, g.E, g.N, g.K,
                                                  static_cast<int>(g.epilogue), g.limit);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <bool KN>
void dispatch(const GroupedGemm& g, int32_t* workspace, cudaStream_t stream) {
  switch (g.kernel) {
    case GroupedGemmKernel::kMma128x128x32: launch<Cfg0, false, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kMma128x128x64: launch<Cfg1, false, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kMma128x256x32: launch<Cfg2, false, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kWgmma128x128: launch<WgCfg0, true, KN>(g, workspace, stream); break;
    case GroupedGemmKernel::kWgmma128x256: launch<WgCfg1, true, KN>(g, workspace, stream); break;
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
  }
  return "?";
}

int64_t grouped_gemm_workspace_ints(int E) { return int64_t(E) + 1; }

namespace {

// (BM, N tiles) of g's schedule.
std::pair<int, int> schedule_shape(const GroupedGemm& g) {
  switch (g.kernel) {
    case GroupedGemmKernel::kMma128x128x32: return {Cfg0::BM, n_tiles_of<Cfg0>(g)};
    case GroupedGemmKernel::kMma128x128x64: return {Cfg1::BM, n_tiles_of<Cfg1>(g)};
    case GroupedGemmKernel::kMma128x256x32: return {Cfg2::BM, n_tiles_of<Cfg2>(g)};
    case GroupedGemmKernel::kWgmma128x128: return {WgCfg0::BM, n_tiles_of<WgCfg0>(g)};
    case GroupedGemmKernel::kWgmma128x256: return {WgCfg1::BM, n_tiles_of<WgCfg1>(g)};
  }
  fail("grouped_gemm: unknown kernel variant ", static_cast<int>(g.kernel));
}

}  // namespace

bool grouped_gemm_same_schedule(const GroupedGemm& a, const GroupedGemm& b) {
  return a.offsets == b.offsets && a.E == b.E && schedule_shape(a) == schedule_shape(b);
}

void grouped_gemm(const GroupedGemm& g, int32_t* workspace, cudaStream_t stream) {
  check(g.K % 8 == 0 && g.K > 0, "grouped_gemm: K must be a positive multiple of 8, got ", g.K);
  check(g.N % (g.epilogue == GroupedEpilogue::kSwiGLU ? 16 : 8) == 0 && g.N > 0,
        "grouped_gemm: N must be a positive multiple of 8 (16 with the SwiGLU epilogue), got ", g.N);
  check(g.E >= 1 && g.n >= 0 && g.n < (int64_t{1} << 31), "grouped_gemm: bad E ", g.E, " or n ", g.n);
  check(!g.w_kn || g.epilogue != GroupedEpilogue::kSwiGLU,
        "grouped_gemm: the SwiGLU epilogue needs W as [N, K] (w_kn = false); with w_kn use kF32, kF32Add or kBf16");
  check(!g.pre || (g.epilogue == GroupedEpilogue::kSwiGLU && grouped_gemm_is_wgmma(g.kernel)),
        "grouped_gemm: the pre-activation output comes with the SwiGLU epilogue of a wgmma kernel");
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
  if (g.n == 0) return;
  if (g.w_kn) dispatch<true>(g, workspace, stream);
  else dispatch<false>(g, workspace, stream);
}

}  // namespace nextlm::cuda
