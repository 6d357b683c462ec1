// NoPE MLA attention with the DeepSeek-Sparse-Attention indexer over k-pooled keys (transformers'
// Glm5NextTextAttention and Glm5NextTextIndexer).
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace nextlm {

// For every token of a packed batch, the key positions it attends to, as offsets from its sequence's first token,
// sorted ascending without repeats. A full-indexer layer makes it; the shared layer after it reuses it.
using Selection = std::vector<std::vector<int32_t>>;  // [T][≤ index_topk + kpool − 1]

// The indexer of one full DSA layer. a [T, D] sub-layer input, qr [T, q_lora] the normed q latent.
// Pool j of a sequence holds its tokens jP … jP+P−1 (complete pools only); query t may pick pools whose last token
// is ≤ t: the top min(index_topk/P, #selectable) by Σ_h w_h·ReLU(ID^-1/2·q_h·pk_j), expanded to tokens, plus, with
// always_select_tail, its incomplete pool ⌊(t+1)/P⌋P … t.
Selection indexer_forward(const IndexerWeights& w, const ModelConfig& c, const float* a, const float* qr, int64_t T,
                          const std::vector<int64_t>& cu_seqlens);

// Softmax weights p [keys] of query head h (qh [dqk]) over the given sequence-relative keys of kv [T, NH, dqk+dv]
// (t0 = the sequence's first token), with scale dqk^-1/2; equal weights when `uniform` (an all-masked row).
void attention_weights(const float* qh, const float* kv, int64_t NH, int64_t h, int64_t dqk, int64_t dkv, int64_t t0,
                       const std::vector<int32_t>& keys, bool uniform, float scale, std::vector<float>& p);

// The attention sub-layer. `sel` is read when this is a shared-indexer layer and written by a full one.
// A query whose selection is empty (index_kpool > 1 without the tail: the first kpool−1 queries of a sequence)
// attends uniformly to every key of its sequence, as transformers' eager attention does with an all-masked row.
void dsa_layer_forward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu_seqlens, Selection& sel, float* y);

// What a query whose selection is empty attends to. Only index_kpool > 1 without the tail has such queries (the
// first kpool−1 of a sequence), and the real GLM-5.3-Flash has the tail on.
enum class EmptySelection {
  AllKeys,   // every key of the sequence, later ones included: transformers' batch forward (not causal)
  SeenKeys,  // keys 0 … t: causal, and what decoding does (as do transformers' cached one-token decode steps)
};
// dsa_layer_forward with a choice for empty selections (the overload above uses AllKeys).
void dsa_layer_forward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu_seqlens, Selection& sel, float* y, EmptySelection empty);

// What one sequence's next token needs from its past in one DSA layer (the decode state). Letters: KL kv_lora_rank,
// ID index_head_dim, P index_kpool, n the tokens seen so far.
struct DsaCache {
  int64_t length = 0;         // n
  std::vector<float> latent;  // [n, KL] the normed kv latent c of every token (the MLA cache; k, v never expanded)
  // Full-indexer layers only. A token's indexer key and gate score are needed until its pool completes; then the
  // pool's compressed key is computed once and they are dropped.
  std::vector<float> pool_key;      // [n / P, ID] compressed key of every complete pool
  std::vector<float> pending_key;   // [n % P, ID] LayerNormed indexer keys of the incomplete pool's tokens
  std::vector<float> pending_gate;  // [n % P, ID] their compress-gate scores
};

// indexer_forward for the next T tokens of one sequence, continuing from `cache` (whose pending keys and pool keys it
// updates; `length` and the latents are the caller's). Positions in the result count from the sequence start.
Selection indexer_forward_cached(const IndexerWeights& w, const ModelConfig& c, const float* a, const float* qr,
                                 int64_t T, DsaCache& cache);

// dsa_layer_forward for the next T tokens of one sequence, continuing from `cache` and appending to it, with empty
// selections attending to the keys seen so far (EmptySelection::SeenKeys). Attention runs in the absorbed MLA form
// on the cached latents: per head, the key part of kv_b is folded into the query (q·(W_k c) = (W_kᵀq)·c) and the
// value part is applied after the weighted latent sum (Σ p·W_v c = W_v Σ p·c), equal to expanding k and v.
void dsa_layer_forward_cached(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T, DsaCache& cache,
                              Selection& sel, float* y);

}  // namespace nextlm
