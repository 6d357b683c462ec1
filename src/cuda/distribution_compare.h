// Next-token distributions of the lm_head against a reference (the parity check against transformers): per row the
// KL divergence KL(ref ‖ ours), both argmaxes and our log-probability of the target, without leaving the device.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace nextlm::cuda {

// logits fp32 [rows, V] (ours, raw); ref_logp fp32 [rows, V] (a log-softmax); target [rows] (< 0: none, gives 0).
// Writes kl [rows] = Σ_v exp(ref_v)·(ref_v − log_softmax(logits)_v), argmax / ref_argmax [rows] (ties to the lower
// index) and logp [rows] = log_softmax(logits)[target].
void compare_rows(const float* logits, const float* ref_logp, const int32_t* target, int64_t rows, int64_t V,
                  double* kl, int32_t* argmax, int32_t* ref_argmax, double* logp, cudaStream_t st);

}  // namespace nextlm::cuda
