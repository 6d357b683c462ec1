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

// What one sequence's next token needs from its past in one KDA layer (the decode state).
struct KdaCache {
  std::vector<float> conv;   // [3, W−1, H·K] pre-conv q, k, v projections of the last W−1 tokens (0 before start)
  std::vector<float> state;  // [H, K, K] recurrent state (row = key dim), fp32
  KdaCache() = default;
  explicit KdaCache(const ModelConfig& c);  // the empty sequence: all zeros
};

// kda_layer_forward for the next T tokens of one sequence, continuing from `cache` and updating it. Its rows equal
// those of the whole-sequence forward up to rounding. a [T, D] (normed sub-layer input), y [T, D].
void kda_layer_forward_cached(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T, KdaCache& cache,
                              float* y, KdaForm form = KdaForm::Chunked);

}  // namespace nextlm
