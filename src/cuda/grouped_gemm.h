// Grouped bf16 GEMM for the MoE experts, with no host synchronisation: C[rows of e] = A[rows of e] · W_eᵀ for every
// expert e, fp32 accumulation, with an fp32, bf16 or fused clamped-SwiGLU epilogue (matches moe.cu's swiglu kernel).
// With w_kn it is C[rows of e] = A[rows of e] · W_e instead (W_e read as [K, N]): the input gradient dy·W of the
// same nn.Linear weights, for the backward.
//
// Calling it from CudaModel's moe(...) (device_model.cu) in place of the host sync and the two per-expert loops:
//
//   // once, at upload: device arrays of the E expert weight pointers (cudaMemcpy of a host std::vector<const bf16*>)
//   //   const bf16* const* gate_up_ptrs;  // each w.experts[e].gate_up.w, bf16 [2I, D]
//   //   const bf16* const* down_ptrs;     // each w.experts[e].down.w,    bf16 [D, I]
//   int32_t* ws = arena.alloc<int32_t>(grouped_gemm_workspace_ints(int(E)));
//   GroupedGemm gu{xp, offsets, gate_up_ptrs, act, n, int(E), int(2 * I), int(D), GroupedEpilogue::kSwiGLU,
//                  float(cfg.swiglu_limit)};
//   grouped_gemm(gu, ws, stream);  // act bf16 [n, I]: replaces the gu buffer, the first loop and swiglu()
//   GroupedGemm dn{act, offsets, down_ptrs, out, n, int(E), int(D), int(I), GroupedEpilogue::kF32};
//   grouped_gemm(dn, ws, stream);  // out fp32 [n, D]: replaces the second loop
//
// The backward's input gradients with the same weight pointers (W_down_e [D, I] is [K = D, N = I], W_gu_e [2I, D] is
// [K = 2I, N = D]):
//
//   GroupedGemm da{dout, offsets, down_ptrs, dact, n, int(E), int(I), int(D)};     // dact fp32 [n, I] = dout·W_down_e
//   da.w_kn = true;
//   grouped_gemm(da, ws, stream);
//   GroupedGemm dx{dgu, offsets, gate_up_ptrs, dxp, n, int(E), int(D), int(2 * I)};  // dxp fp32 [n, D] = dgu·W_gu_e
//   dx.w_kn = true;
//   grouped_gemm(dx, ws, stream);
//
// `offsets` is moe_permute's device output, so the cudaMemcpyAsync + cudaStreamSynchronize go away and the whole
// MoE becomes capturable in a CUDA graph. n = T·k is known on the host; only the split between experts is not.
//
// How: a one-block kernel turns offsets into per-expert tile counts and their prefix sum (workspace); a persistent
// grid then walks the global tile list (expert-major, then N tile, then M tile, so that the M tiles sharing a weight
// slab run side by side and read it from L2), finding each tile's expert by binary search. Empty experts own no tile.
//
// The header includes only host-compilable CUDA headers (no common.cuh), so plain C++ tests and benchmarks can use it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace nextlm::cuda {

using bf16 = __nv_bfloat16;

enum class GroupedEpilogue {
  kF32,     // C fp32 [n, N]
  kF32Add,  // C fp32 [n, N] += the product
  kBf16,    // C bf16 [n, N]
  kSwiGLU,  // W = [gate; up] with N = 2I rows; C bf16 act [n, I] = silu(min(gate, L)) · clamp(up, −L, L)
};

// Kernel variants (all mma.sync m16n8k16 bf16 → fp32, cp.async pipeline, ldmatrix from padded shared memory):
//   kMma128x128x32: 8 warps, 4 stages, two CTAs per SM (the default; the tested fallback)
//   kMma128x128x64: 8 warps, 3 stages of BK = 64, two CTAs per SM (fewer barriers, more bytes in flight)
//   kMma128x256x32: 8 warps, 4 stages, one CTA per SM (each A fragment feeds twice the MMAs)
// and Hopper warpgroup MMA (wgmma.mma_async, sm_90a; same cp.async pipeline into 128-byte-swizzled shared memory):
//   kWgmma128x128:  two warpgroups × m64n128k16, BK = 64, 3 stages, two CTAs per SM
//   kWgmma128x256:  two warpgroups × m64n256k16, BK = 64, 4 stages, one CTA per SM, one MMA batch kept in flight
//   kWgmmaTma128x256: the same tile and MMAs, operands loaded by TMA from a producer warpgroup, CTAs in clusters of
//                   two that share an operand tile (two M tiles of an expert the weight tile, two N tiles the A tile)
//                   and multicast it; needs GroupedGemm::W_all (else it runs as kWgmma128x256)
//   kWgmmaTma128x256c4: the same in clusters of four: 2 × 2 tiles (two M tiles share each weight tile, two N tiles
//                   each A tile), or an expert's last odd M tile with four N tiles sharing its A tile
// Every variant takes w_kn: the mma.sync ones read the [BK][BN] weight tile with ldmatrix.trans, the wgmma ones give
// it to the MMA as an N-major (transposed) operand.
enum class GroupedGemmKernel {
  kMma128x128x32 = 0,
  kMma128x128x64 = 1,
  kMma128x256x32 = 2,
  kWgmma128x128 = 3,
  kWgmma128x256 = 4,
  kWgmmaTma128x256 = 5,
  kWgmmaTma128x256c4 = 6,
};
constexpr int kGroupedGemmKernels = 7;
// Whether k is a warpgroup-MMA variant (the ones that take GroupedGemm::low_rank and GroupedGemm::pre).
inline bool grouped_gemm_is_wgmma(GroupedGemmKernel k) {
  return k == GroupedGemmKernel::kWgmma128x128 || k == GroupedGemmKernel::kWgmma128x256 ||
         k == GroupedGemmKernel::kWgmmaTma128x256 || k == GroupedGemmKernel::kWgmmaTma128x256c4;
}
const char* grouped_gemm_kernel_name(GroupedGemmKernel k);

// A low-rank term added in a wgmma kernel's accumulators (the routed experts' LoRA adapters, cuda/grouped_lora.h):
// one more k-tile of 64 after the K loop, split into `parts` slots of 64 / parts columns. For the rows of expert e,
// part p adds
//   w_kn = false: C[:, c0_p … c0_p + width_p) += U_p·V_p,eᵀ   V_p,e bf16 [width_p, r_p] (LoRA's B_e: y += u·B_eᵀ)
//   w_kn = true:  C += U_p·V_p,e                           V_p,e bf16 [r_p, N]       (LoRA's A_e: dx += gs·A_e)
// with U_p bf16 [n, ldu_p] the rank-r_p factor of every permuted row (u or gs, the adapter's scale in it). The sum
// is rounded like the GEMM's own: fp32 accumulation of bf16 products, then the epilogue (SwiGLU included).
struct GroupedLowRank {
  int parts = 0;                     // 0 (none), 1 or 2
  const bf16* U[2] = {};             // [n, ldu[p]] row-major, 16-byte aligned
  int ldu[2] = {};                   // a multiple of 8, ≥ r[p]
  int r[2] = {};                     // a multiple of 8, at most 64 / parts
  const bf16* const* V[2] = {};      // [E] device arrays of device pointers, 16-byte aligned
  int c0[2] = {}, width[2] = {};     // w_kn = false: the output columns part p adds to (multiples of 8, within N)
};

// How the experts' weights lie in memory, each expert's natural matrix being rows × cols (nn.Linear's [N, K], or
// [K, N] with w_kn), the experts back to back. Every layout holds a TMA box of the kernel's weight tile (64 columns
// × 128 rows, or 64 × 64 with w_kn) in fewer, longer runs of memory than the rows.
enum class GroupedWeightLayout {
  kRows,          // row-major
  kColumnBlocks,  // [cols / 64][rows][64]: columns 64 at a time, each block all the rows (cols a multiple of 64)
  kTiles,         // [rows / 128][cols / 64][128][64]: 128 × 64 tiles, a row of tiles after another (rows a multiple
                  // of 128, cols of 64; with SwiGLU the gate's rows a multiple of 128 too)
};

struct GroupedGemm {
  const bf16* A;               // [n, K] row-major: the permuted token rows, rows of expert e contiguous
  const int32_t* offsets;      // [E+1] device: rows of expert e are offsets[e] .. offsets[e+1]-1, offsets[E] = n
  const bf16* const* W;        // [E] device array of device pointers, each bf16 [N, K] row-major (nn.Linear out×in),
                               // or [K, N] row-major with w_kn; 16-byte aligned
  void* C;                     // output, see GroupedEpilogue (row stride N, or N/2 for kSwiGLU)
  int64_t n;                   // total rows (= offsets[E]); the host only needs it to size the grid
  int E;                       // experts
  int N;                       // output features (2I for kSwiGLU); a multiple of 8 (16 for kSwiGLU)
  int K;                       // input features (the contraction length); a multiple of 8 (16-byte rows for cp.async)
  GroupedEpilogue epilogue = GroupedEpilogue::kF32;
  float limit = 0.0f;          // the SwiGLU clamp L (kSwiGLU only)
  GroupedGemmKernel kernel = GroupedGemmKernel::kMma128x128x32;
  bool w_kn = false;  // true: each W[e] is bf16 [K, N] row-major and C = A·W_e (the input gradient dy·W of a linear);
                      // kF32, kF32Add and kBf16 only (not kSwiGLU)
  GroupedLowRank low_rank{};  // parts > 0: the low-rank term above (wgmma variants only)
  // kSwiGLU on a wgmma kernel: also store the pre-activations, fp32 [n, N] (gate columns, then up), as kF32 would —
  // what training's backward keeps — beside the act.
  float* pre = nullptr;
  // The same rounded to bf16 ([n, N] bf16) instead, half the bytes (pre and pre16 are not both set).
  bf16* pre16 = nullptr;
  // true: `workspace` already holds this GEMM's schedule, made by the previous grouped_gemm on it, for which
  // grouped_gemm_same_schedule(previous, this) held (then only the GEMM is enqueued).
  bool schedule_ready = false;
  // The experts' weights back to back when they are (W[e] == W_all + e·N·K for every e), else null: the TMA kernel
  // reads them through one tensor map.
  const bf16* W_all = nullptr;
  // How W_all holds the weights (block_expert_weights); the TMA variants only.
  GroupedWeightLayout w_layout = GroupedWeightLayout::kRows;
};

// dst = src's E matrices [rows, cols] (row-major, back to back) in `layout`; with to_layout false the inverse (src
// in the layout, dst row-major). dst and src do not overlap.
void block_expert_weights(const bf16* src, bf16* dst, int64_t E, int64_t rows, int64_t cols,
                          GroupedWeightLayout layout, cudaStream_t stream, bool to_layout = true);

// Whether b's tile schedule is a's (the same offsets, experts, kernel variant and tiles per row block): b may then
// set schedule_ready and run on a's workspace after a.
bool grouped_gemm_same_schedule(const GroupedGemm& a, const GroupedGemm& b);

// int32 elements of device workspace grouped_gemm needs (the per-expert tile prefix sum); E + 1.
int64_t grouped_gemm_workspace_ints(int E);
// Enqueues the scheduling kernel and the GEMM on `stream`; asynchronous, no host sync. `workspace` holds
// grouped_gemm_workspace_ints(E) int32 and may be reused as soon as the GEMM has run (stream order).
void grouped_gemm(const GroupedGemm& g, int32_t* workspace, cudaStream_t stream);

}  // namespace nextlm::cuda
