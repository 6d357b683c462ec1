// Incremental decoding: the decoder stack (block.h) over the next T tokens of one sequence, with the
// stateful KDA and DSA layers (kda_layer_forward_cached, dsa_layer_forward_cached) in place of the batch ones;
// matches transformers' cached generation path (DynamicCache with conv / recurrent / indexer states).
#include "model/decode.h"

#include <algorithm>

#include "core/error.h"
#include "model/block.h"

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
  const int64_t T = static_cast<int64_t>(tokens.size());
  check(T > 0, "no tokens to add to the sequence");
  check_tokens(tokens, st.length, c.vocab_size);
  const Tensor hidden = decoder_forward(w, c, tokens, [&](int64_t i, const float* a, float* y, Selection& sel) {
    const LayerWeights& lw = w.layers[i];
    if (lw.kda) {
      kda_layer_forward_cached(*lw.kda, c, a, T, *st.kda[i], y, form);
    } else {
      dsa_layer_forward_cached(*lw.dsa, c, a, T, *st.dsa[i], sel, y);
    }
  });
  st.length += T;
  return m.logits(hidden, T - 1, T).data;
}

}  // namespace

std::vector<float> prefill(DecodeState& state, const std::vector<int32_t>& tokens) {
  return extend(state, tokens, KdaForm::Chunked);
}

std::vector<float> decode_step(DecodeState& state, int32_t token) {
  return extend(state, {token}, KdaForm::Recurrent);
}

Generation generate_with(int64_t V, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                         const PrefillFn& prefill, const StepFn& step, const std::function<void(Sample&)>& agree) {
  check(opt.max_new_tokens >= 0, "max-new-tokens must be >= 0, got ", opt.max_new_tokens);
  check(!prompt.empty(), "the prompt is empty");
  check_tokens(prompt, 0, V);
  for (int32_t s : opt.stop_tokens)
    check(s >= 0 && s < V, "stop token ", s, " is outside the vocabulary [0, ", V, ")");
  for (int32_t s : opt.eos_tokens)
    check(s >= 0 && s < V, "eos token ", s, " is outside the vocabulary [0, ", V, ")");
  Sampler sampler(opt.sampling);
  Generation g;
  if (opt.max_new_tokens == 0) return g;

  std::vector<float> logits = prefill(prompt);
  for (int64_t n = 0; n < opt.max_new_tokens; ++n) {
    Sample s = sampler.sample(logits.data(), V);
    if (agree) agree(s);
    g.tokens.push_back(s.token);
    g.logprobs.push_back(s.logprob);
    g.top.push_back(std::move(s.top));
    g.eos = std::find(opt.eos_tokens.begin(), opt.eos_tokens.end(), g.tokens.back()) != opt.eos_tokens.end();
    if (g.eos || std::find(opt.stop_tokens.begin(), opt.stop_tokens.end(), g.tokens.back()) != opt.stop_tokens.end()) {
      g.stopped = true;
      break;
    }
    if (n + 1 < opt.max_new_tokens) logits = step(s.token);
  }
  return g;
}

Generation generate(const Model& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  std::optional<DecodeState> state;
  return generate_with(
      model.config().vocab_size, prompt, opt,
      [&](const std::vector<int32_t>& p) {
        state.emplace(model);
        return prefill(*state, p);
      },
      [&](int32_t token) { return decode_step(*state, token); });
}

}  // namespace nextlm
