// Per-expert LoRA adapters on the MoE's permuted rows, all experts in one launch each and no host synchronisation:
// the grouped counterpart of train.cu's per-expert loop of lora_forward / lora_backward (cuBLASLt GEMMs on each
// expert's rows, then a scale-and-round kernel), with the same roundings: u and gs are fp32 sums scaled by `scale`
// and then rounded to bf16 once, every other product accumulates in fp32 on bf16 inputs.
//
// For expert e (rows offsets[e] … offsets[e+1] − 1 of the permuted order), A_e bf16 [r, in], B_e bf16 [out, r]:
//   forward   u  = bf16(scale · x·A_eᵀ)              [n, ldr]  (kept for the backward)
//             y[:, col0 : col0 + out] += u·B_eᵀ     fp32
//   backward  dB_e += dyᵀ·u                         [out, r]  fp32, a sum over the expert's rows
//             gs = bf16(scale · dy·B_e)             [n, ldr]  (workspace)
//             dA_e += gsᵀ·x                         [r, in]   fp32, a sum over the expert's rows
//             dx += gs·A_e                          fp32 (when dx is given)
// where dy is the gradient of y's adapted columns (bf16, from column col0). Rows from offsets[E] on (the other EP
// ranks' rows) and empty experts are left alone. u and gs have the row stride ldr = grouped_lora_ld(r), r rounded
// up to 8, so that every row is 16 bytes aligned; their columns r … ldr − 1 are written as zeros.
//
// The work split (grouped_lora.cu has the details):
//   u, gs   ("down", x [n, K] → [n, r]): one block per expert-aligned tile of 64 rows (expert e owns
//           ceil(rows_e / 64) of them, numbered expert-major; each block finds its own with a block-wide scan of the
//           offsets), streaming K through a cp.async pipeline into m16n8k16 MMAs; each row's r outputs are complete
//           in one block, so scaling and rounding happen once, after the full fp32 sum.
//   y, dx   ("up", [n, r] → Y [n, N] +=): the same row tiles × 512-column slices; every Y element is read, added
//           to and written by exactly one thread.
//   dA, dB  ("grad", a sum over an expert's rows): one block per (128-column tile, expert) walking the expert's
//           rows in order, 32 at a time; one block owns each gradient element, so there are no atomics and the
//           summation order depends on the expert's rows only (not on the launch or on other experts' sizes).
// Deterministic: every launch computes the same bits for the same inputs.
//
// Calling it from train.cu's expert_adapters_forward / expert_adapters_backward (the per-expert branch), for each
// kind k of {ExpertGate, ExpertUp} or {ExpertDown} of layer i that has per-expert adapters:
//
//   // at set_lora, for each such (layer, kind): device arrays of the El experts' pointers (cudaMemcpy of host
//   // vectors of the DAdapter fields A, B, dA, dB, in expert order) and the shared shape (every expert's r, in, out,
//   // col0 and scale must agree; otherwise keep the per-expert loop):
//   //   const bf16* const* A;  const bf16* const* B;  float* const* dA;  float* const* dB;
//   GroupedLora g{x.offsets, int(El), int(ad.r), int(ad.in), int(ad.out), A, B, ad.scale};
//   // forward: in = x.xp (ld D) or x.act (ld I), out = x.gu (ld 2I) or x.out (ld D), n = T·k
//   bf16* u = arena.alloc<bf16>(n * grouped_lora_ld(ad.r));  // kept for the backward
//   grouped_lora_forward(g, in, ld_in, n, u, out, ld_out, ad.col0, stream);
//   // backward: dy = dgu or dout (ld ld_out), dx = dxp or dact (ld ld_in)
//   bf16* gs = arena.alloc<bf16>(n * grouped_lora_ld(ad.r));
//   grouped_lora_backward(g, dA, dB, in, ld_in, u, dy, ld_out, n, gs, dx, ld_in, ad.col0, stream);
//
// The header includes only host-compilable CUDA headers (no common.cuh), so plain C++ tests can use it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace nextlm::cuda {

using bf16 = __nv_bfloat16;

// One adapter per expert on the rows of a grouped projection; all experts share r, in, out and scale.
struct GroupedLora {
  const int32_t* offsets;  // [E+1] device: rows of expert e are offsets[e] … offsets[e+1] − 1; offsets[E] ≤ n
  int E;                   // experts
  int r;                   // rank, 1 … 64
  int in, out;             // adapter input and output widths, positive multiples of 8
  const bf16* const* A;    // [E] device array of device pointers, each bf16 [r, in], 16-byte aligned
  const bf16* const* B;    // [E] each bf16 [out, r], 16-byte aligned
  float scale;             // alpha / r
  // x's row of each permuted row: the sums over x (u's and dA's) read x's row x_rows[i] for row i, so that the
  // adapters of an MoE's gate and up read the layer's input (T rows, held in L2) through the routing's token of each
  // row instead of its gathered copy (k times the bytes); null: x's rows are the permuted rows. [n] device.
  const int32_t* x_rows = nullptr;
};

// Row stride of u and gs: r rounded up to a multiple of 8.
inline int grouped_lora_ld(int r) { return (r + 7) / 8 * 8; }

// Forward on the n permuted rows: u [n, ldr] = bf16(scale · x·A_eᵀ) (bf16, written), y[:, col0 : col0 + out] +=
// u·B_eᵀ (fp32, row stride ldy). x bf16 with row stride ldx (a multiple of 8), 16-byte aligned; u 16-byte aligned;
// y 8-byte aligned, ldy even, col0 a multiple of 8. n = 0 (or E = 0) is a no-op.
// The forward's factor alone, u [n, ldr] = bf16(scale · x·A_eᵀ) (as grouped_lora_forward writes it), for a grouped
// GEMM that adds u·B_eᵀ in its own accumulators (GroupedGemm::low_rank).
void grouped_lora_factor(const GroupedLora& g, const bf16* x, int64_t ldx, int64_t n, bf16* u, cudaStream_t stream);

void grouped_lora_forward(const GroupedLora& g, const bf16* x, int64_t ldx, int64_t n, bf16* u, float* y,
                          int64_t ldy, int64_t col0, cudaStream_t stream);

// Backward given dy (bf16, row stride lddy (a multiple of 8), the adapted columns from col0) and the forward's u:
// dB_e += dyᵀ·u_e, gs [n, ldr] = bf16(scale · dy·B_e) (written; workspace), dA_e += gs_eᵀ·x_e, and dx (fp32, row
// stride lddx, even) += gs·A_e when dx is not null. dA and dB are [E] device arrays of device pointers to each
// expert's fp32 [r, in] and [out, r] gradients. Alignment as the forward's (dy, gs 16 bytes; dx 8 bytes).
// overwrite: dA_e and dB_e are set to the sums instead of added to (zeros for an expert without rows; for a first
// backward onto gradients not cleared).
void grouped_lora_backward(const GroupedLora& g, float* const* dA, float* const* dB, const bf16* x, int64_t ldx,
                           const bf16* u, const bf16* dy, int64_t lddy, int64_t n, bf16* gs, float* dx,
                           int64_t lddx, int64_t col0, cudaStream_t stream, bool overwrite = false);

// Two adapters on the same rows and input x (an MoE layer's gate and up projections): g0 and g1 agree in offsets,
// E, r, in and scale (grouped_lora_pairable). The forms below give exactly the bits of the calls above on each, the
// sums over x's rows (u's and dA's) made in one pass over x instead of two.
bool grouped_lora_pairable(const GroupedLora& g0, const GroupedLora& g1);
// grouped_lora_factor of both: u0 and u1 [n, ldr].
void grouped_lora_factor2(const GroupedLora& g0, const GroupedLora& g1, const bf16* x, int64_t ldx, int64_t n,
                          bf16* u0, bf16* u1, cudaStream_t stream);
// grouped_lora_backward of g0 (its output's gradient at dy's columns col0_0 …) and then of g1 (at col0_1 …).
void grouped_lora_backward2(const GroupedLora& g0, const GroupedLora& g1, float* const* dA0, float* const* dB0,
                            float* const* dA1, float* const* dB1, const bf16* x, int64_t ldx, const bf16* u0,
                            const bf16* u1, const bf16* dy, int64_t lddy, int64_t n, bf16* gs0, bf16* gs1, float* dx,
                            int64_t lddx, int64_t col0_0, int64_t col0_1, cudaStream_t stream,
                            bool overwrite = false);

}  // namespace nextlm::cuda
