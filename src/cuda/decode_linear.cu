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

template <bool kVec>
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
      gemv::warp_pass<kVec>(s.W + min(n_lo, s.out - 1) * s.in, n_lo < s.out, s.W + min(n_hi, s.out - 1) * s.in,
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
  if (vec) {
    linear_multi_kernel<true><<<grid, gemv::kThreads, 0, st>>>(p);
  } else {
    linear_multi_kernel<false><<<grid, gemv::kThreads, 0, st>>>(p);
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
