// Host-side entry points to the KDA recurrence backward kernels (src/cuda/kda_backward.cu, the recurrent form;
// src/cuda/kda_chunked_backward.cu, the chunked form), for their tests.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

struct KdaBackwardGrads {
  std::vector<float> dq, dk, dv, dg;  // [T, H, K]
  std::vector<float> dbeta;           // [T, H]
};

// cuda::kda_recurrent_backward on packed sequences: q, k, v, g, do_ [T, H, K], beta [T, H], cu_seqlens [N+1]. The
// gradients are added into `init` (uploaded as the output buffers; empty vectors mean zeros). The workspace is
// poisoned with NaN first (every checkpoint read must have been written). Timed at the model's shape by
// nextlm_bench's kda_bwd_T4096_H64 (bench/backward.cu).
KdaBackwardGrads kda_recurrent_backward(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, const std::vector<float>& g,
                                        const std::vector<float>& beta, const std::vector<float>& do_,
                                        const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                        const KdaBackwardGrads& init = {});

// cuda::kda_chunked_backward on the same inputs, with the chunks of 64 built from cu_seqlens as the forward's plan
// builds them; the workspace is poisoned with NaN first (every factor read must have been written). Same init
// convention as above; with written, the gradient buffers start as NaN instead and the kernel writes them
// (accumulate false), so an element it misses shows. bf16_products: cuda::KdaBackwardProducts::Bf16 (else split).
// bf16_inputs: q, k and v rounded to bf16 and passed as such (the overload a training step calls).
KdaBackwardGrads kda_chunked_backward(const std::vector<float>& q, const std::vector<float>& k,
                                      const std::vector<float>& v, const std::vector<float>& g,
                                      const std::vector<float>& beta, const std::vector<float>& do_,
                                      const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                      const KdaBackwardGrads& init = {}, bool written = false,
                                      bool bf16_products = false, bool bf16_inputs = false);

// The same from the gate's inputs: f [T, H, K] (the f_b output), dt_bias [H·K], A_log [H] (has_bound: the safe
// gate with lower bound `bound`, else softplus). from_f: the kernel forms g itself (cuda::KdaGateInputs); else g =
// cuda::kda_gate of them is formed on the device first and passed, as the fp32 path keeps it. Gradients written.
KdaBackwardGrads kda_chunked_backward_gated(const std::vector<float>& q, const std::vector<float>& k,
                                            const std::vector<float>& v, const std::vector<float>& f,
                                            const std::vector<float>& dt_bias, const std::vector<float>& A_log,
                                            bool has_bound, float bound, const std::vector<float>& beta,
                                            const std::vector<float>& do_, const std::vector<int64_t>& cu_seqlens,
                                            int64_t H, int64_t K, bool from_f, bool bf16_products);

// The training step's form with the forward's kept states: cuda::kda_chunked_tc (q, k and v rounded to bf16, the
// safe gate from f, dt_bias, A_log and bound) keeps every chunk's state and v_new, and the chunked backward takes
// them, the gate from f and bf16 products, dO as the bf16 rounding of do_, gradients written. bf16_operands: dO and
// v_new in bf16 (cuda::KdaBf16Operands, KdaTcStates::chunk_u16); else both in fp32 holding the same values.
KdaBackwardGrads kda_chunked_backward_kept(const std::vector<float>& q, const std::vector<float>& k,
                                           const std::vector<float>& v, const std::vector<float>& f,
                                           const std::vector<float>& dt_bias, const std::vector<float>& A_log,
                                           float bound, const std::vector<float>& beta, const std::vector<float>& do_,
                                           const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                           bool bf16_operands);

// cuda::set_kda_backward_compact_prep / kda_backward_compact_prep (process-wide).
void set_kda_backward_compact_prep(bool on);
bool kda_backward_compact_prep();

}  // namespace nextlm::cuda_testing
