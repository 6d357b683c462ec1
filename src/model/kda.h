// Kimi Delta Attention layer (transformers' Glm5NextTextLinearAttention): short causal convs, per-channel decay
// gate, delta-rule recurrence with an fp32 K×K state per head, gated RMSNorm output. Two forms of the core:
// the recurrent one (the definition) and the chunked WY form used for prefill, equal up to rounding.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace nextlm {

enum class KdaForm { Chunked, Recurrent };

// One sequence, one head. q, k, v, g: rows of width K with stride `ld` between tokens (so [T, H, K] buffers can be
// passed at a head offset); beta: stride `ldb`. q must already be L2-normalised and scaled by K^-1/2, k normalised.
// state [K, K] (row = key dim) holds the recurrent state on entry and is updated; o gets T rows of width K (stride ld).
struct KdaSeq {
  const float* q;
  const float* k;
  const float* v;
  const float* g;     // log decay per channel, ≤ 0
  const float* beta;  // per token
  int64_t T, K, ld, ldb;
  float* o;
};
void kda_recurrent_forward(const KdaSeq& s, float* state);
void kda_chunked_forward(const KdaSeq& s, float* state, int64_t chunk = 64);

// The whole layer over a packed batch: a [T, D] (normed sub-layer input), cu_seqlens [N+1], y [T, D].
void kda_layer_forward(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu_seqlens, float* y, KdaForm form = KdaForm::Chunked);

}  // namespace nextlm
