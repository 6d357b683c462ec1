// Decoder-layer stack (see block.h), fp32; matches Glm5NextTextModel.forward of transformers 5.17.0.
#include "model/block.h"

#include <algorithm>

#include "model/mhc.h"
#include "model/moe.h"
#include "model/norm.h"

namespace nextlm {

Tensor decoder_forward(const ModelWeights& w, const ModelConfig& c, const std::vector<int32_t>& tokens,
                       const AttentionFn& attention) {
  const int64_t T = static_cast<int64_t>(tokens.size()), D = c.hidden_size;
  std::vector<float> e(T * D);
  for (int64_t t = 0; t < T; ++t) std::copy_n(w.embed.ptr() + static_cast<int64_t>(tokens[t]) * D, D, e.data() + t * D);
  const float limit = static_cast<float>(c.swiglu_limit);
  return decoder_forward(w, c, e.data(), T, attention, [&](int64_t i, const float* a, float* y) {
    const LayerWeights& lw = w.layers[i];
    if (lw.mlp) {
      mlp_forward(*lw.mlp, limit, a, T, D, y);
    } else {
      moe_forward(*lw.moe, c, a, T, y);
    }
  });
}

Tensor decoder_forward(const ModelWeights& w, const ModelConfig& c, const float* e, int64_t T,
                       const AttentionFn& attention, const FfnFn& ffn) {
  const int64_t S = c.hc_mult, D = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // Streams h [T, S, D], each a copy of the embedding.
  std::vector<float> h(T * S * D), h2(T * S * D), a(T * D), y(T * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) std::copy_n(e + t * D, D, h.data() + (t * S + s) * D);

  Selection sel;
  HcMix mix;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& lw = w.layers[i];
    mhc_pre_forward(lw.hc_attn, c, h.data(), T, mix, a.data());
    rmsnorm_forward(a.data(), lw.input_norm.ptr(), a.data(), T, D, eps);
    attention(i, a.data(), y.data(), sel);
    mhc_post_forward(mix, h.data(), y.data(), T, S, D, h2.data());
    std::swap(h, h2);

    mhc_pre_forward(lw.hc_ffn, c, h.data(), T, mix, a.data());
    rmsnorm_forward(a.data(), lw.post_attention_norm.ptr(), a.data(), T, D, eps);
    ffn(i, a.data(), y.data());
    mhc_post_forward(mix, h.data(), y.data(), T, S, D, h2.data());
    std::swap(h, h2);
    // transformers hands a selection only to the layer directly after the one that made it.
    if (!(lw.dsa && lw.dsa->indexer)) sel.clear();
  }

  Tensor out({T, D});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc += h[(t * S + s) * D + d];
      out.data[t * D + d] = acc / static_cast<float>(S);
    }
  rmsnorm_forward(out.ptr(), w.final_norm.ptr(), out.ptr(), T, D, eps);
  return out;
}

}  // namespace nextlm
