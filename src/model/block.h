// The decoder-layer stack shared by the batch forward and incremental decoding (transformers'
// Glm5NextTextDecoderLayer): embed into S streams; per layer mHC → RMSNorm → attention → mHC mix, then
// mHC → RMSNorm → MLP or MoE → mHC mix; finally the mean over streams and the final RMSNorm.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/dsa.h"
#include "model/weights.h"

namespace nextlm {

// The attention sub-layer of layer i: y [T, D] from its normed input a [T, D]. `sel` carries the indexer selection
// from a full-indexer DSA layer to the shared one directly after it.
using AttentionFn = std::function<void(int64_t layer, const float* a, float* y, Selection& sel)>;

// The feed-forward sub-layer of layer i (dense MLP or MoE): y [T, D] from its normed input a [T, D].
using FfnFn = std::function<void(int64_t layer, const float* a, float* y)>;

// Final normed hidden states [T, D] of the tokens (one sequence or a packed batch; the attention function knows
// which). Token ids must already be validated.
Tensor decoder_forward(const ModelWeights& w, const ModelConfig& c, const std::vector<int32_t>& tokens,
                       const AttentionFn& attention);

// The same stack from the embedded tokens e [T, D] (every stream starts as a copy), with the feed-forward sub-layers
// given too: what the tensor/expert-parallel model (src/dist) runs with its sharded sub-layers.
Tensor decoder_forward(const ModelWeights& w, const ModelConfig& c, const float* e, int64_t T,
                       const AttentionFn& attention, const FfnFn& ffn);

}  // namespace nextlm
