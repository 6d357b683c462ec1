// The MoE expert GEMMs at the slice's shapes: the grouped GEMM (src/cuda/grouped_gemm.h) against cuBLASLt.
#pragma once
#include <string>

namespace nextlm::bench {

// `moe_grouped_gemm`: 4096 tokens × top-8 over 288 experts (random, roughly balanced routing), gate_up (D = 4096 →
// 2·2048, fused SwiGLU, bf16 act) then down (2048 → 4096, fp32 out), median of CUDA-event timings after warm-up.
// Beside it, in the same run: a dense cuBLASLt GEMM of the same FLOPs (one weight) and the current per-expert
// cuBLASLt loop with the separate SwiGLU kernel. One JSON line per kernel variant; the default variant's line is
// `name`, the others `name_<variant>`.
//
// At these shapes each expert sees ~114 rows, so each weight element takes part in only ~114 multiply-adds: the pair
// must read 14.5 GB of weights (3.5 ms at 4.14 TB/s; 3.7 ms with the activations) against 1.65 TFLOP (2.26 ms at
// 729 TFLOP/s). A dense GEMM of the same FLOPs reads one weight, so "ours / cuBLAS dense" is bounded by about
// 2.3 / 3.7 ≈ 60–65% here, whatever the kernel; the note prints the byte floor next to the FLOP floor.
// `moe_grouped_gemm_skewed` (and `moe_grouped_gemm_dx_skewed`): the same with log-normally skewed routing, the
// spread of rows per expert that the randomly initialised slice routes with (many experts far below a 128-row tile,
// a few with several).
void moe_grouped_gemm_case(const std::string& name);

// `moe_grouped_gemm_dx`: the backward's input gradients of the same experts at the same shapes and routing, in the
// grouped GEMM's w_kn form (W_e as stored, [K, N]): dact [n, I] = dout [n, D] · W_down_e [D, I] and dxp [n, D] =
// dgu [n, 2I] · W_gu_e [2I, D], both fp32. Beside it, in the same run: the per-expert cuBLASLt loop of
// Gemm::run_dx that Step::moe_backward runs today (host offsets; the sync is not timed), which is also the reference
// of the check (rel err ≤ 1e-2, "CHECK FAILED" in the note otherwise), and the dense cuBLASLt dx GEMMs of the same
// FLOPs. One JSON line per kernel variant, named as in moe_grouped_gemm. The byte floor is that of the forward pair.
void moe_grouped_gemm_dx_case(const std::string& name);

// `grouped_lora_T4096`: the routed experts' grouped LoRA kernels (src/cuda/grouped_lora.h) of one MoE layer of the
// LoRA step at 4096 tokens (top-8 over 288 experts, the skewed routing of `_skewed`, rank 16): the forward's factors
// (u of gate and up in one pass over x [n, 4096], u of down from act [n, 2048]) and the backward's (the down
// adapter's dB, gs and dA from dout [n, 4096] and act; the gate and up adapters' from dgu [n, 4096] and x), as the
// step calls them (no dx: the step folds gs·A_e into the experts' input-gradient GEMM). Memory-bound: the floor is
// their bytes (the activations each call reads, the fp32 gradients and bf16 factors it writes) at 4.14 TB/s; no peer.
// The note gives the forward's and the backward's parts and whether every output is finite.
void grouped_lora_case(const std::string& name);

}  // namespace nextlm::bench
