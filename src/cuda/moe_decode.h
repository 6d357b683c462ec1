// The MoE experts of a decoding step as a grouped GEMV (src/cuda/moe_decode.cu): the problem of grouped_gemm
// (grouped_gemm.h: the permuted rows A, the device offsets, the device array of expert weights, and the same
// epilogues, the fused clamped SwiGLU included), for a few rows per expert. The grouped GEMM runs 128-row tiles: with
// ~B·8 rows over 288 experts (mostly 0 to 2 rows each) it does 64 to 128 times the needed MMA work. This kernel is
// the decoding GEMV of decode_linear (cuda/gemv.cuh) run per expert: each chosen expert's weights are streamed once
// for all of its rows (once per 32 rows), an empty expert costs nothing, and the offsets are read on the device (no
// host sync, capturable in a CUDA graph, no workspace).
//
// Batch invariance: a row's sums run in gemv.cuh's order, fixed by K alone; a row's output does not depend on the
// other rows of its expert, on the other experts or on n. It is also bit for bit decode_linear of that row on W_e
// (with the fp32 epilogue). It is not the grouped GEMM's order: a batch-invariant model whose forward runs the grouped
// GEMM keeps the grouped GEMM in its decoding steps, so that a step computes the forward's bits.
//
// Use: the same GroupedGemm as for grouped_gemm (g.kernel is ignored, no workspace):
//
//   GroupedGemm gu{xp, offsets, w.gate_up_ptrs, act, n, int(El), int(2 * I), int(D), GroupedEpilogue::kSwiGLU,
//                  float(cfg.swiglu_limit)};
//   moe_decode_gemv(gu, stream);  // act bf16 [n, I]
//   GroupedGemm dn{act, offsets, w.down_ptrs, out, n, int(El), int(D), int(I), GroupedEpilogue::kF32};
//   moe_decode_gemv(dn, stream);  // out fp32 [n, D]
//
// When to use it: for every decoding step, whatever its batch (outside batch-invariant mode). A step's rows must not
// change kernels with B, or a sequence's bits would depend on its batch; and a step of up to 64 sequences puts 1 to 2
// rows on an average chosen expert. Up to 32 rows an expert's weights are read once and the MMAs (n8 tiles of 8
// rows, not 128-row tiles) stay far below the tensor cores' rate; past that every 32 more rows read them again
// (from L2 while they are still there) and the re-reads of x by every 16-row weight tile grow with the rows, while
// the grouped GEMM only gets better. For a forward, which may pick its kernel by size, moe_decode_gemv_preferred
// says whether the GEMV is expected to win: an average of at most 4 rows per expert (n ≤ 4·E; a 144-token prompt at
// 288 experts and top-8), a conservative estimate, not a measurement: the `decode_gemv` bench case
// (bench/decode_gemv.cu) times both at 1 to 32 rows per expert.
//
// The header includes only host-compilable CUDA headers, as grouped_gemm.h.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/grouped_gemm.h"

namespace nextlm::cuda {

// The most experts (g.E) moe_decode_gemv takes (its list of the chosen ones lives in shared memory).
constexpr int kMoeDecodeMaxExperts = 1024;

// C[rows of e] = A[rows of e] · W_eᵀ for every expert e < g.E, with g.epilogue (kF32, kF32Add, kBf16, or kSwiGLU:
// act bf16 [n, N/2] = silu(min(gate, L)) · clamp(up, −L, L) rounded to bf16, as grouped_gemm). Needs g.w_kn = false,
// N > 0 (even for kSwiGLU) and K ≥ 0, of any other form: a multiple of 8 with a 16-byte aligned A takes 16-byte
// loads, and then every W_e must be 16-byte aligned, as grouped_gemm requires; otherwise element loads, same bits.
// Rows from offsets[E] on are left alone. Enqueues one kernel on `stream`; asynchronous.
void moe_decode_gemv(const GroupedGemm& g, cudaStream_t stream);

// Whether moe_decode_gemv is expected to beat grouped_gemm on n rows over E experts in a forward (see above; not for
// decoding steps, which use it whatever n).
inline bool moe_decode_gemv_preferred(int64_t n, int E) { return n <= 4 * int64_t(E); }

}  // namespace nextlm::cuda
