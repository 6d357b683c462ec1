// decode_linear and decode_linear_multi (src/cuda/decode_linear.h): the tensor-core GEMV of gemv.cuh over one or
// several (x, W, y) segments in one persistent grid. Work item (segment, row group rg, x tile mt): Split::tiles tiles
// of 16 outputs of the segment against up to 32 rows of x; mt runs fastest, so that the x tiles of one weight slab run
// side by side and all but the first read it from L2; the segments' items follow each other.
#include "cuda/decode_linear.h"

#include "cuda/gemv.cuh"

namespace nextlm::cuda {

namespace {

struct Segs {
  LinearSeg seg[kMaxLinearSegs];
  int64_t first[kMaxLinearSegs + 1];  // the segments' first work items; first[n] = all items
  int n;
  int64_t M;
  bool accumulate;  // y += W·x
};

int64_t items_of(const LinearSeg& s, int64_t M) {
  const gemv::Split sp = gemv::split_of(s.in);
  return ceil_div(ceil_div(s.out, gemv::kTileRows), sp.tiles) * ceil_div(M, gemv::kPassRows);
}

// The element-load path (inputs off 16-byte alignment): each warp loads and multiplies its units of an item in
// turn (gemv::chain_tile).
__global__ void __launch_bounds__(gemv::kThreads, gemv::kBlocksPerSm) linear_multi_kernel(Segs p) {
  __shared__ float red[gemv::kWarps][gemv::kTileRows][gemv::kRedLd];
  const int64_t mtiles = (p.M + gemv::kPassRows - 1) / gemv::kPassRows;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  for (int64_t item = blockIdx.x; item < p.first[p.n]; item += gridDim.x) {
    // The item's segment, selected with static indices only (a dynamic index into the parameter struct would make
    // the compiler copy it to local memory).
    LinearSeg s = p.seg[0];
    int64_t first = 0;
#pragma unroll
    for (int i = 1; i < kMaxLinearSegs; ++i)
      if (i < p.n && item >= p.first[i]) s = p.seg[i], first = p.first[i];
    const gemv::Split sp = gemv::split_of(s.in);
    const int tb = warp / sp.nchain, chain = warp % sp.nchain;
    const int64_t ntiles = (s.out + gemv::kTileRows - 1) / gemv::kTileRows;
    const int64_t local = item - first, rg = local / mtiles, m0 = local % mtiles * gemv::kPassRows;
    const int rows = static_cast<int>(p.M - m0 < gemv::kPassRows ? p.M - m0 : gemv::kPassRows);
    const int64_t tile = rg * sp.tiles + tb;
    if (tb < sp.tiles && tile < ntiles) {
      // Rows past `out` read as zeros (their pointers clamped to the last row, never dereferenced).
      const int64_t n_lo = tile * gemv::kTileRows + g, n_hi = n_lo + 8;
      gemv::warp_pass(s.W + min(n_lo, s.out - 1) * s.in, n_lo < s.out, s.W + min(n_hi, s.out - 1) * s.in,
                            n_hi < s.out, s.x + m0 * s.ldx, s.ldx, rows, static_cast<int>(s.in), sp, chain, red[warp]);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < sp.tiles * gemv::kTileRows * rows; idx += blockDim.x) {
      const int r = idx % gemv::kTileRows, m = idx / gemv::kTileRows % rows, t = idx / gemv::kTileRows / rows;
      const int64_t n = (rg * sp.tiles + t) * gemv::kTileRows + r;
      if (n < s.out) {
        const float v = gemv::chain_sum(red, sp, t, r, m);
        float* dst = s.y + (m0 + m) * s.ldy + n;
        *dst = p.accumulate ? *dst + v : v;
      }
    }
    __syncthreads();  // red is rewritten by the next item
  }
}

// ---- The streaming path (gemv.cuh's ring): 16-byte aligned inputs ----

// A warp's view of a work item: the item's segment, split and x pass, and the warp's chain, W rows and units in it.
struct Where {
  LinearSeg s;
  gemv::Split sp;
  int tb, chain, rows, units;  // units: this warp's in the item, 0 when it has no tile there
  int64_t rg, m0;
  const bf16 *w_lo, *w_hi;  // the lane's W rows (clamped to the last row: read only where lo_ok / hi_ok)
  bool lo_ok, hi_ok;
};

__device__ __forceinline__ Where locate(const Segs& p, int64_t item, int64_t mtiles, int warp) {
  Where w;
  w.s = p.seg[0];
  int64_t first = 0;
#pragma unroll
  for (int i = 1; i < kMaxLinearSegs; ++i)  // static indices only (see linear_multi_kernel)
    if (i < p.n && item >= p.first[i]) w.s = p.seg[i], first = p.first[i];
  w.sp = gemv::split_of(w.s.in);
  w.tb = warp / w.sp.nchain, w.chain = warp % w.sp.nchain;
  const int64_t local = item - first;
  w.rg = local / mtiles, w.m0 = local % mtiles * gemv::kPassRows;
  w.rows = static_cast<int>(p.M - w.m0 < gemv::kPassRows ? p.M - w.m0 : gemv::kPassRows);
  const int64_t ntiles = (w.s.out + gemv::kTileRows - 1) / gemv::kTileRows, tile = w.rg * w.sp.tiles + w.tb;
  const bool active = w.tb < w.sp.tiles && tile < ntiles;
  w.units = active ? (w.sp.nseg - w.chain + w.sp.nchain - 1) / w.sp.nchain * w.sp.sb : 0;
  const int64_t n_lo = tile * gemv::kTileRows + ((threadIdx.x & 31) >> 2), n_hi = n_lo + 8;
  w.lo_ok = n_lo < w.s.out, w.hi_ok = n_hi < w.s.out;
  w.w_lo = w.s.W + min(n_lo, w.s.out - 1) * w.s.in, w.w_hi = w.s.W + min(n_hi, w.s.out - 1) * w.s.in;
  return w;
}

// Every warp runs two cursors over its units of the grid-stride items: the feed copies units into the ring
// gemv::kStages ahead of the MMAs, crossing items; the MMAs meet in shared memory per item as linear_multi_kernel's.
// NT n8 tiles of x rows a pass (1, 2 or 4 by M: how many rows share an MMA changes no bit).
template <int NT>
__global__ void __launch_bounds__(gemv::kThreads, gemv::kBlocksPerSm) linear_stream_kernel(Segs p) {
  constexpr int D = gemv::kStages;
  __shared__ float red[gemv::kWarps][gemv::kTileRows][gemv::kRedLd];
  extern __shared__ uint4 ring_smem[];  // a gemv::Ring a warp
  const int warp = threadIdx.x >> 5;
  gemv::Ring& ring = reinterpret_cast<gemv::Ring*>(ring_smem)[warp];
  const int64_t mtiles = (p.M + gemv::kPassRows - 1) / gemv::kPassRows, items = p.first[p.n];

  // The feed: its item and the next of the warp's units there.
  int64_t f_item = blockIdx.x;
  Where f = locate(p, f_item, mtiles, warp);
  int f_unit = 0, f_slot = 0;
  auto feed = [&] {
    while (f_unit >= f.units && f_item + gridDim.x < items) {
      f_item += gridDim.x;
      f = locate(p, f_item, mtiles, warp);
      f_unit = 0;
    }
    if (f_unit < f.units) {
      gemv::copy_unit(ring.v[f_slot], f.w_lo, f.lo_ok, f.w_hi, f.hi_ok, static_cast<int>(f.s.in), f.sp, f.chain,
                      f_unit);
      ++f_unit;
      f_slot = f_slot + 1 == D ? 0 : f_slot + 1;
    }
    gemv::cp_commit();  // one group a call, empty past the last unit: the consumer's wait counts on it
  };
#pragma unroll 1
  for (int i = 0; i < D; ++i) feed();

  int slot = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const Where w = locate(p, item, mtiles, warp);
    if (w.units) {
      float acc[NT][4] = {};
      const bf16* x = w.s.x + w.m0 * w.s.ldx;
      for (int u = 0; u < w.units; ++u) {
        gemv::consume_unit<NT>(ring.v[slot], x, w.s.ldx, w.rows, static_cast<int>(w.s.in), w.sp, w.chain, u, acc);
        slot = slot + 1 == D ? 0 : slot + 1;
        feed();  // into the slot just read (its values are in the MMAs' registers)
      }
      gemv::store_partial<NT>(red[warp], acc);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < w.sp.tiles * gemv::kTileRows * w.rows; idx += blockDim.x) {
      const int r = idx % gemv::kTileRows, m = idx / gemv::kTileRows % w.rows, t = idx / gemv::kTileRows / w.rows;
      const int64_t n = (w.rg * w.sp.tiles + t) * gemv::kTileRows + r;
      if (n < w.s.out) {
        const float v = gemv::chain_sum(red, w.sp, t, r, m);
        float* dst = w.s.y + (w.m0 + m) * w.s.ldy + n;
        *dst = p.accumulate ? *dst + v : v;
      }
    }
    __syncthreads();  // red is rewritten by the next item
  }
}

template <int NT>
void launch_stream(const Segs& p, unsigned grid, cudaStream_t st) {
  // The ring is over the 48 KB a launch gets unasked. Set at every launch, as the other kernels here do: the
  // attribute belongs to the current device's context, and a process may drive several GPUs.
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(linear_stream_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(gemv::kRingBytes)));
  linear_stream_kernel<NT><<<grid, gemv::kThreads, gemv::kRingBytes, st>>>(p);
}

void launch(const LinearSeg* segs, size_t nsegs, int64_t M, bool accumulate, cudaStream_t st) {
  check(M >= 0, "decode_linear: negative row count ", M);
  check(nsegs <= static_cast<size_t>(kMaxLinearSegs), "decode_linear_multi: at most ", kMaxLinearSegs,
        " segments, got ", nsegs);
  Segs p{};
  p.M = M;
  p.accumulate = accumulate;
  bool vec = true;
  for (size_t i = 0; i < nsegs; ++i) {
    const LinearSeg& s = segs[i];
    check(s.out >= 0 && s.in >= 0 && s.in < (int64_t{1} << 31), "decode_linear: bad shape ", M, "x", s.in, " -> ",
          s.out);
    if (!s.out) continue;
    p.seg[p.n] = s;
    p.first[p.n + 1] = p.first[p.n] + items_of(s, M);
    vec = vec && s.in % 8 == 0 && s.ldx % 8 == 0 && is_aligned16(s.x) && is_aligned16(s.W);
    ++p.n;
  }
  if (!M || !p.n) return;
  const unsigned grid = static_cast<unsigned>(gemv::grid_for(p.first[p.n]));
  // 16-byte loads or element loads: the same values into the same MMAs, so the choice changes no bit.
  // The ring or element loads: the same values into the same MMAs, so the choice changes no bit.
  if (vec) {
    const int64_t rows = M < gemv::kPassRows ? M : gemv::kPassRows;
    if (rows <= 8) launch_stream<1>(p, grid, st);
    else if (rows <= 16) launch_stream<2>(p, grid, st);
    else launch_stream<4>(p, grid, st);
  } else {
    linear_multi_kernel<<<grid, gemv::kThreads, 0, st>>>(p);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void decode_linear(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, float* y, int64_t ldy,
                   int64_t M, bool accumulate, cudaStream_t st) {
  const LinearSeg seg{x, ldx, W, out, in, y, ldy};
  launch(&seg, 1, M, accumulate, st);
}

void decode_linear_multi(const LinearSeg* segs, size_t n, int64_t M, cudaStream_t st) {
  launch(segs, n, M, false, st);
}

}  // namespace nextlm::cuda
