// Host-side entry points to the head, embedding and MoE backward kernels (src/cuda/moe_backward.cu), for
// tests/test_cuda_moe_backward.cpp: host vectors in and out. Written outputs are poisoned with NaN first, so an
// unwritten element shows; bf16 outputs come back widened to fp32.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// softmax_xent_backward on logits [n, V], target [n], wt [n] (empty: no weights): loss [n] and dlogits [n, V].
void softmax_xent_backward(const std::vector<float>& logits, const std::vector<int32_t>& target,
                           const std::vector<float>& wt, int64_t n, int64_t V, std::vector<double>& loss,
                           std::vector<float>& dlogits);
// cuda::set_xent_stream / xent_stream (process-wide): whether wide rows take the streaming kernel.
void set_xent_stream(bool on);
bool xent_stream();

// embedding_backward: dembed [V, D] (uploaded, then accumulated into) from tok [T] and dh [T, S, D].
void embedding_backward(const std::vector<int32_t>& tok, const std::vector<float>& dh, std::vector<float>& dembed,
                        int64_t T, int64_t S, int64_t D, int64_t pad_id);

// swiglu_backward: dgu [n, 2I] from gu [n, 2I] and dact [n, I]; rows_held ≥ 0: only that many rows are this rank's.
// gu16, dact16: that input goes in as bf16 (rounded on the way in), through the kernel's bf16 form.
std::vector<float> swiglu_backward(const std::vector<float>& gu, const std::vector<float>& dact, int64_t n, int64_t I,
                                   float limit, int32_t rows_held = -1, bool gu16 = false, bool dact16 = false);

// moe_combine_backward: dout [T·k, D] from dy [T, D], slot_of [T, k] and weights [T, k].
std::vector<float> moe_combine_backward(const std::vector<float>& dy, const std::vector<int32_t>& slot_of,
                                        const std::vector<float>& weights, int64_t T, int64_t k, int64_t D);
// moe_weights_backward: dweights [T, k] from act [T·k, I] (rounded to bf16 on the way in), dact [T·k, I], slot_of
// and weights [T, k]; rows_held ≥ 0: only that many rows are this rank's; dact16: dact goes in as bf16.
std::vector<float> moe_weights_backward(const std::vector<float>& act, const std::vector<float>& dact,
                                        const std::vector<int32_t>& slot_of, const std::vector<float>& weights,
                                        int64_t T, int64_t k, int64_t I, int32_t rows_held = -1, bool dact16 = false);

// moe_gather_backward: dx [T, D] (uploaded, then accumulated into) from dxp [T·k, D] and slot_of [T, k]; dxp16: dxp
// goes in as bf16.
void moe_gather_backward(const std::vector<float>& dxp, const std::vector<int32_t>& slot_of, std::vector<float>& dx,
                         int64_t T, int64_t k, int64_t D, bool dxp16 = false);

// moe_route_backward: dlogits [T, E] from logits [T, E], experts [T, k] and dweights [T, k].
std::vector<float> moe_route_backward(const std::vector<float>& logits, const std::vector<int32_t>& experts,
                                      const std::vector<float>& dweights, int64_t T, int64_t E, int64_t k, bool norm,
                                      float scale);

// The MoE routing of a decoding step: moe_route, moe_permute and gather_rows in three launches (fused = false) or
// moe_route_permute_small's one (fused = true; it must accept T) on logits [T, E], bias [E] and rows x [T, D]
// (rounded to bf16). Outputs poisoned first; xp widened.
struct MoeRouting {
  std::vector<int32_t> experts, keys, slots, token_of, slot_of, offsets;
  std::vector<float> weights, xp;
};
MoeRouting moe_route_permute(const std::vector<float>& logits, const std::vector<float>& bias,
                             const std::vector<float>& x, int64_t T, int64_t E, int64_t G, int64_t topk_group,
                             int64_t k, int64_t D, bool norm, float scale, bool fused);

}  // namespace nextlm::cuda_testing
