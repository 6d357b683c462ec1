// The decoding GEMV (src/cuda/decode_linear.cu), alone or several in one launch: the projections of a decoding step
// that read the same input (a KDA layer's q|k|v, f_a, b and g_a; a DSA layer's q_a, kv_a and the indexer's) or that
// are independent of each other run as the work items of one persistent grid, so that a batch-1 step pays one launch
// and one ramp for them instead of one per projection. Each output is computed exactly as decode_linear computes it
// (the summation order of src/cuda/gemv.cuh, fixed by the segment's `in` alone): grouping changes no bit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "cuda/common.cuh"

namespace nextlm::cuda {

// y[m] = W·x[m] (+ y[m] when accumulate) for M rows: x bf16 [M, in] (row stride ldx), W bf16 [out, in], y fp32
// [M, out] (row stride ldy), fp32 accumulation: the batch-invariant replacement of Gemm::run for decoding. A
// tensor-core GEMV that streams W once per 32 rows of x (src/cuda/gemv.cuh), every output summed in an order fixed
// by `in` alone (documented there), whatever M, the row's position or the buffers' alignment. in < 2^31.
void decode_linear(const bf16* x, int64_t ldx, const bf16* W, int64_t out, int64_t in, float* y, int64_t ldy,
                   int64_t M, bool accumulate, cudaStream_t st);

// One segment of decode_linear_multi: y[m] = W·x[m] for rows m < M, shapes as decode_linear's.
struct LinearSeg {
  const bf16* x;
  int64_t ldx;
  const bf16* W;
  int64_t out, in;
  float* y;
  int64_t ldy;
};
constexpr int kMaxLinearSegs = 6;

// Every segment for the same M rows, in one launch (at most kMaxLinearSegs segments; empty ones are skipped).
void decode_linear_multi(const LinearSeg* segs, size_t n, int64_t M, cudaStream_t st);
inline void decode_linear_multi(std::initializer_list<LinearSeg> segs, int64_t M, cudaStream_t st) {
  decode_linear_multi(segs.begin(), segs.size(), M, st);
}

}  // namespace nextlm::cuda
