// The tensor-core GEMV of decoding, the kernel body of decode_linear (decode_linear.cu): a few rows of x [rows, in]
// against a bf16 weight W [out, in] that is streamed from HBM once, fp32 accumulation on m16n8k16 MMAs (W rows as the
// MMA's M side, x rows as its N side, so one row of x costs an n8 tile, not an m16 one).
//
// The summation order of output n of a row (batch invariance: it depends on `in` alone):
//   - `in` is cut into segments of 64·SB inputs, SB = clamp(⌈in / 512⌉, 1, 4); nseg = max(1, ⌈in / (64·SB)⌉);
//     inputs past `in` (the last segment's tail) enter as zeros;
//   - chain c, for c < nchain = min(8, nseg), is one fp32 MMA accumulator starting from 0 that takes the segments
//     c, c + nchain, c + 2·nchain, … in order; a segment its SB blocks of 64 inputs in order; the block at input c0
//     four MMAs in order, MMA q (0 … 3) taking the inputs c0 + 32·⌊q/2⌋ + 4·(q mod 2) + 8·t + u (t, u = 0 … 3) into
//     its k slots 2t + u (u < 2) and 2t + 6 + u (u ≥ 2);
//   - the output is (((chain 0 + chain 1) + chain 2) + …) in fp32, then y + that when accumulating.
// Nothing else enters: which block, warp or MMA row/column holds a chain, how many x rows share an MMA (8, 16 or 32
// per pass) and whether the loads are 16-byte vectors or single elements change no bit, given (as the grouped GEMM
// assumes too) that an MMA's output element depends on its own row of A and column of B only.
//
// Work split: a block of 8 warps takes `tiles` = 8 / nchain tiles of 16 W rows at once, warp w running chain
// w mod nchain of tile ⌊w / nchain⌋ over one pass of up to 32 x rows; the chains meet in shared memory. The weights
// bypass L1 (each byte is used once) and leave it to x. Two ways to load them:
//   - 16-byte aligned inputs (every decoding projection): a warp's weights stream through a ring of kStages units
//     in shared memory (cp.async), kStages units ahead of its MMAs and across work items, so that the stream never
//     drains (the streaming path below; 87 → 98 % of 4.14 TB/s on lm_head at one row);
//   - otherwise element by element into registers, a segment at a time (chain_tile).
// nvcc only (device code); internal to the kernels that include it.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace nextlm::cuda::gemv {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 16;   // W rows of an MMA tile
constexpr int kPassRows = 32;   // x rows of one pass (four n8 tiles)
constexpr int kRedLd = kPassRows + 1;  // shared partials' row stride (odd: the reduction's reads spread over banks)
constexpr int kBlocksPerSm = 2;  // __launch_bounds__ minimum; the persistent grids are sized to it

// The split of `in` (see above); every field depends on `in` alone.
struct Split {
  int sb;      // 64-input blocks per segment, 1 … 4
  int nseg;    // segments, ≥ 1
  int nchain;  // chains (one accumulator each), min(8, nseg)
  int tiles;   // 16-row tiles a block works on at once, 8 / nchain
};

__host__ __device__ inline Split split_of(int64_t in) {
  Split s;
  const int64_t sb = (in + 511) / 512;
  s.sb = sb < 1 ? 1 : sb > 4 ? 4 : static_cast<int>(sb);
  const int64_t nseg = (in + 64 * s.sb - 1) / (64 * s.sb);
  s.nseg = nseg < 1 ? 1 : static_cast<int>(nseg);
  s.nchain = s.nseg < kWarps ? s.nseg : kWarps;
  s.tiles = kWarps / s.nchain;
  return s;
}

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// p[0 … 7] as four bf16 pairs, element by element, of which the first `left` (≥ 1) exist and the rest read as zeros.
__device__ __forceinline__ uint4 load8(const bf16* p, int left) {
  const unsigned short* u = reinterpret_cast<const unsigned short*>(p);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = 2 * i < left ? __ldg(u + 2 * i) : 0u, hi = 2 * i + 1 < left ? __ldg(u + 2 * i + 1) : 0u;
    w[i] = lo | hi << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Chain `chain` of one 16-row tile against x rows 0 … xrows−1 (xrows ≤ 8·NT), into acc (zeroed by the caller):
// acc[j] is the m16n8 C fragment of x rows 8j … 8j+7 (c0, c1: tile row g, x rows 8j+2t, +1; c2, c3: tile row g+8).
// w_lo / w_hi: this lane's W rows (tile rows g and g+8), read only where lo_ok / hi_ok (else zeros). in < 2^31.
template <int NT>
__device__ __forceinline__ void chain_tile(const bf16* w_lo, bool lo_ok, const bf16* w_hi, bool hi_ok, const bf16* x,
                                           int64_t ldx, int xrows, int in, const Split& sp, int chain,
                                           float (&acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int seg = 64 * sp.sb;
  const bf16* xg = x + g * ldx;  // the lane's x row in n8 tile 0; tile j's is 8j·ldx further
  // The weights of kPhase blocks are loaded before their MMAs: the whole segment (up to 16 loads of 16 bytes a lane)
  // for one n8 tile, half of it for two or four, whose accumulators and x leave fewer registers.
  constexpr int kPhase = NT > 1 ? 2 : 4;
  for (int s = chain; s < sp.nseg; s += sp.nchain) {
    // The lane's first input of the segment: block b's inputs are c + 64b + {0 … 7} (lo) and c + 64b + 32 + {0 … 7}
    // (hi), so every load below is a fixed offset from one pointer per row.
    const int c = s * seg + 8 * t, rem = in - c;  // rem: inputs from c on (≤ 0 past the end)
    const bf16* pl = w_lo + c;
    const bf16* ph = w_hi + c;
#pragma unroll
    for (int b0 = 0; b0 < 4; b0 += kPhase) {
      if (b0 >= sp.sb) break;
      uint4 wv[kPhase][4];  // [block][row g lo, row g hi, row g+8 lo, row g+8 hi]
#pragma unroll
      for (int i = 0; i < kPhase; ++i) {
        const int o = 64 * (b0 + i);
        const bool on = b0 + i < sp.sb, lo_in = on && o < rem, hi_in = on && o + 32 < rem;
        wv[i][0] = lo_ok && lo_in ? load8(pl + o, rem - o) : zero4();
        wv[i][1] = lo_ok && hi_in ? load8(pl + o + 32, rem - o - 32) : zero4();
        wv[i][2] = hi_ok && lo_in ? load8(ph + o, rem - o) : zero4();
        wv[i][3] = hi_ok && hi_in ? load8(ph + o + 32, rem - o - 32) : zero4();
      }
#pragma unroll
      for (int i = 0; i < kPhase; ++i) {
        if (b0 + i >= sp.sb) break;
        const int o = 64 * (b0 + i);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          uint4 xl = zero4(), xh = zero4();
          if (8 * j + g < xrows) {
            const bf16* xr = xg + 8 * j * ldx + c + o;
            if (o < rem) xl = load8(xr, rem - o);
            if (o + 32 < rem) xh = load8(xr + 32, rem - o - 32);
          }
          // MMA q: words 2(q mod 2) and 2(q mod 2)+1 of the lo (q < 2) or hi (q ≥ 2) vectors, i.e. the inputs
          // c0 + 32⌊q/2⌋ + 8t + 4(q mod 2) + {0, 1} in k slots 2t, 2t+1 and + {2, 3} in k slots 2t+8, 2t+9 (c0 the
          // block's first input), for the W rows (A fragment a0…a3: row g, row g+8, row g, row g+8) and the x row g
          // (B fragment b0, b1) alike.
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint4& wg = q < 2 ? wv[i][0] : wv[i][1];
            const uint4& wu = q < 2 ? wv[i][2] : wv[i][3];
            const uint4& xs = q < 2 ? xl : xh;
            const int r = 2 * (q & 1);
            const uint32_t a[4] = {word(wg, r), word(wu, r), word(wg, r + 1), word(wu, r + 1)};
            mma_bf16(acc[j], a, word(xs, r), word(xs, r + 1));
          }
        }
      }
    }
  }
}

template <int NT>
__device__ __forceinline__ void store_partial(float (*red)[kRedLd], const float (&acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    red[g][8 * j + 2 * t] = acc[j][0];
    red[g][8 * j + 2 * t + 1] = acc[j][1];
    red[g + 8][8 * j + 2 * t] = acc[j][2];
    red[g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
}

// chain_tile for a pass of xrows ≤ 32 x rows with as few n8 tiles as cover them, its partials to red [16][kRedLd]
// (tile row, x row) of this warp.
__device__ __forceinline__ void warp_pass(const bf16* w_lo, bool lo_ok, const bf16* w_hi, bool hi_ok, const bf16* x,
                                          int64_t ldx, int xrows, int in, const Split& sp, int chain,
                                          float (*red)[kRedLd]) {
  if (xrows <= 8) {
    float acc[1][4] = {};
    chain_tile<1>(w_lo, lo_ok, w_hi, hi_ok, x, ldx, xrows, in, sp, chain, acc);
    store_partial<1>(red, acc);
  } else if (xrows <= 16) {
    float acc[2][4] = {};
    chain_tile<2>(w_lo, lo_ok, w_hi, hi_ok, x, ldx, xrows, in, sp, chain, acc);
    store_partial<2>(red, acc);
  } else {
    float acc[4][4] = {};
    chain_tile<4>(w_lo, lo_ok, w_hi, hi_ok, x, ldx, xrows, in, sp, chain, acc);
    store_partial<4>(red, acc);
  }
}

// ---- The streaming path (16-byte aligned inputs): weights through a shared-memory ring ----
//
// The same chains as chain_tile, cut into units of one 64-input block of the warp's 16 W rows (per lane the four
// 16-byte pieces chain_tile loads for a block: rows g and g+8, inputs c0 + 8t + {0 … 7} and c0 + 32 + 8t + …). A
// warp copies units into its ring of kStages slots with cp.async and consumes them in order, kStages ahead, across
// the work items of the persistent grid: the weight stream does not drain at a segment's end, nor while the block
// sums and stores an item. The MMAs, their operands and their order are chain_tile's, so the two paths agree
// bitwise.
constexpr int kStages = 3;  // units in flight a warp: 48 KB a block; 3 measured faster than 2, 4 or 5 (README)

struct alignas(16) Ring {
  uint4 v[kStages][4][32];  // [slot][piece][lane]: a lane reads back only what it copied itself
};
constexpr size_t kRingBytes = sizeof(Ring) * kWarps;

// 16 bytes of a weight row into shared memory, read once (L2 only, with a 256-byte L2 prefetch); zeros when !valid.
__device__ __forceinline__ void cp_stream16(uint4* dst, const bf16* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until the oldest of the kStages groups in flight has landed (the memory clobber keeps the slot's reads
// below it).
__device__ __forceinline__ void cp_wait_oldest() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1) : "memory");
}

// The lane's first input of unit u of chain `chain` (segments chain, chain + nchain, …, each sb blocks).
__device__ __forceinline__ int unit_input(const Split& sp, int chain, int u) {
  const int t = threadIdx.x & 3;
  return (chain + u / sp.sb * sp.nchain) * 64 * sp.sb + 64 * (u % sp.sb) + 8 * t;
}

// Copies unit u of rows w_lo / w_hi (in inputs a row) into a slot.
__device__ __forceinline__ void copy_unit(uint4 (*slot)[32], const bf16* w_lo, bool lo_ok, const bf16* w_hi,
                                          bool hi_ok, int in, const Split& sp, int chain, int u) {
  const int lane = threadIdx.x & 31, c = unit_input(sp, chain, u);
  const bool lo_in = c < in, hi_in = c + 32 < in;  // in and c are multiples of 8 on this path
  cp_stream16(&slot[0][lane], w_lo + c, lo_ok && lo_in);
  cp_stream16(&slot[1][lane], w_lo + c + 32, lo_ok && hi_in);
  cp_stream16(&slot[2][lane], w_hi + c, hi_ok && lo_in);
  cp_stream16(&slot[3][lane], w_hi + c + 32, hi_ok && hi_in);
}

// The MMAs of unit u (its weights in a slot, the oldest copy in flight) against x rows 0 … xrows−1, into acc as
// chain_tile's. x's loads go out before the wait for the slot.
template <int NT>
__device__ __forceinline__ void consume_unit(const uint4 (*slot)[32], const bf16* x, int64_t ldx, int xrows, int in,
                                             const Split& sp, int chain, int u, float (&acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const int c = unit_input(sp, chain, u);
  uint4 xl[NT], xh[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xl[j] = zero4(), xh[j] = zero4();
    if (8 * j + g < xrows) {
      const bf16* xr = x + (8 * j + g) * ldx + c;
      if (c < in) xl[j] = __ldg(reinterpret_cast<const uint4*>(xr));
      if (c + 32 < in) xh[j] = __ldg(reinterpret_cast<const uint4*>(xr + 32));
    }
  }
  cp_wait_oldest();
  const uint4 w0 = slot[0][lane], w1 = slot[1][lane], w2 = slot[2][lane], w3 = slot[3][lane];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4& wg = q < 2 ? w0 : w1;
      const uint4& wu = q < 2 ? w2 : w3;
      const uint4& xs = q < 2 ? xl[j] : xh[j];
      const int r = 2 * (q & 1);
      const uint32_t a[4] = {word(wg, r), word(wu, r), word(wg, r + 1), word(wu, r + 1)};
      mma_bf16(acc[j], a, word(xs, r), word(xs, r + 1));
    }
}

// The fixed-order sum of the chains of tile tb (of a block's `tiles`) for tile row r and x row m.
__device__ __forceinline__ float chain_sum(const float (*red)[kTileRows][kRedLd], const Split& sp, int tb, int r,
                                           int m) {
  const int w0 = tb * sp.nchain;
  float s = red[w0][r][m];
  for (int c = 1; c < sp.nchain; ++c) s += red[w0 + c][r][m];
  return s;
}

// Blocks of a persistent grid over `items` work items: kBlocksPerSm per SM.
inline int64_t grid_for(int64_t items) {
  const int64_t full = int64_t(sm_count()) * kBlocksPerSm;
  return items < full ? items : full;
}

}  // namespace nextlm::cuda::gemv
