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

// Final normed hidden states [T, D] of the tokens (one sequence or a packed batch; the attention function knows
// which). Token ids must already be validated.
Tensor decoder_forward(const ModelWeights& w, const ModelConfig& c, const std::vector<int32_t>& tokens,
                       const AttentionFn& attention);

}  // namespace nextlm
