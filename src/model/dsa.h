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

// The attention sub-layer. `sel` is read when this is a shared-indexer layer and written by a full one.
// A query whose selection is empty (index_kpool > 1 without the tail: the first kpool−1 queries of a sequence)
// attends uniformly to every key of its sequence, as transformers' eager attention does with an all-masked row.
void dsa_layer_forward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu_seqlens, Selection& sel, float* y);

}  // namespace nextlm
