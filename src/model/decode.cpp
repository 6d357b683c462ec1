// Incremental decoding: the layer loop of Model::forward_hidden for the next T tokens of one sequence, with the
// stateful KDA and DSA layers (kda_layer_forward_cached, dsa_layer_forward_cached) in place of the batch ones;
// matches transformers' cached generation path (DynamicCache with conv / recurrent / indexer states).
#include "model/decode.h"

#include <algorithm>

#include "core/error.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "model/norm.h"

namespace nextlm {

DecodeState::DecodeState(const Model& m) : model(&m) {
  const size_t L = m.weights().layers.size();
  kda.resize(L);
  dsa.resize(L);
  for (size_t i = 0; i < L; ++i) {
    if (m.weights().layers[i].kda) {
      kda[i].emplace(m.config());
    } else {
      dsa[i].emplace();
    }
  }
}

namespace {

void check_tokens(const std::vector<int32_t>& tokens, int64_t first_position, int64_t V) {
  for (size_t t = 0; t < tokens.size(); ++t)
    check(tokens[t] >= 0 && tokens[t] < V, "token id ", tokens[t], " at position ", first_position + t,
          " is outside the vocabulary [0, ", V, ")");
}

// Runs the next T tokens through every layer, updating the caches, and returns the logits [V] of the last one.
std::vector<float> extend(DecodeState& st, const std::vector<int32_t>& tokens, KdaForm form) {
  const Model& m = *st.model;
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  const int64_t T = static_cast<int64_t>(tokens.size()), S = c.hc_mult, D = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  check(T > 0, "no tokens to add to the sequence");
  check_tokens(tokens, st.length, c.vocab_size);

  // Streams h [T, S, D], each a copy of the embedding.
  std::vector<float> h(T * S * D), h2(T * S * D), a(T * D), y(T * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s)
      std::copy_n(w.embed.ptr() + static_cast<int64_t>(tokens[t]) * D, D, h.data() + (t * S + s) * D);

  Selection sel;  // handed from a full-indexer DSA layer to the shared one after it, for these T tokens
  HcMix mix;
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& lw = w.layers[i];
    mhc_pre_forward(lw.hc_attn, c, h.data(), T, mix, a.data());
    rmsnorm_forward(a.data(), lw.input_norm.ptr(), a.data(), T, D, eps);
    if (lw.kda) {
      kda_layer_forward_cached(*lw.kda, c, a.data(), T, *st.kda[i], y.data(), form);
    } else {
      dsa_layer_forward_cached(*lw.dsa, c, a.data(), T, *st.dsa[i], sel, y.data());
    }
    mhc_post_forward(mix, h.data(), y.data(), T, S, D, h2.data());
    std::swap(h, h2);

    mhc_pre_forward(lw.hc_ffn, c, h.data(), T, mix, a.data());
    rmsnorm_forward(a.data(), lw.post_attention_norm.ptr(), a.data(), T, D, eps);
    if (lw.mlp) {
      mlp_forward(*lw.mlp, static_cast<float>(c.swiglu_limit), a.data(), T, D, y.data());
    } else {
      moe_forward(*lw.moe, c, a.data(), T, y.data());
    }
    mhc_post_forward(mix, h.data(), y.data(), T, S, D, h2.data());
    std::swap(h, h2);
    if (!(lw.dsa && lw.dsa->indexer)) sel.clear();
  }
  st.length += T;

  // Only the last token's logits are needed: mean over its streams, final norm, lm_head.
  Tensor last({1, D});
  for (int64_t d = 0; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t s = 0; s < S; ++s) acc += h[((T - 1) * S + s) * D + d];
    last.data[d] = acc / static_cast<float>(S);
  }
  rmsnorm_forward(last.ptr(), w.final_norm.ptr(), last.ptr(), 1, D, eps);
  return m.logits(last, 0, 1).data;
}

}  // namespace

std::vector<float> prefill(DecodeState& state, const std::vector<int32_t>& tokens) {
  return extend(state, tokens, KdaForm::Chunked);
}

std::vector<float> decode_step(DecodeState& state, int32_t token) {
  return extend(state, {token}, KdaForm::Recurrent);
}

Generation generate(const Model& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  const int64_t V = model.config().vocab_size;
  check(opt.max_new_tokens >= 0, "max-new-tokens must be >= 0, got ", opt.max_new_tokens);
  check(!prompt.empty(), "the prompt is empty");
  check_tokens(prompt, 0, V);
  for (int32_t s : opt.stop_tokens)
    check(s >= 0 && s < V, "stop token ", s, " is outside the vocabulary [0, ", V, ")");
  Sampler sampler(opt.sampling);
  Generation g;
  if (opt.max_new_tokens == 0) return g;

  DecodeState state(model);
  std::vector<float> logits = prefill(state, prompt);
  for (int64_t n = 0; n < opt.max_new_tokens; ++n) {
    Sample s = sampler.sample(logits.data(), V);
    g.tokens.push_back(s.token);
    g.logprobs.push_back(s.logprob);
    g.top.push_back(std::move(s.top));
    if (std::find(opt.stop_tokens.begin(), opt.stop_tokens.end(), s.token) != opt.stop_tokens.end()) {
      g.stopped = true;
      break;
    }
    if (n + 1 < opt.max_new_tokens) logits = decode_step(state, s.token);
  }
  return g;
}

}  // namespace nextlm
