// Parallel incremental decoding (parallel_decode.h): the cached KDA and DSA layers of model/kda.h and model/dsa.h on
// this rank's slices, inside parallel_decoder_forward; the loop of model/decode.cpp's generate.
#include "dist/parallel_decode.h"

#include <algorithm>

#include "core/error.h"

namespace nextlm::dist {

ParallelDecodeState::ParallelDecodeState(const ShardedModel& m, const Mesh& me) : model(&m), mesh(&me) {
  const size_t L = m.weights.layers.size();
  kda.resize(L);
  dsa.resize(L);
  for (size_t i = 0; i < L; ++i) {
    if (m.weights.layers[i].kda) {
      kda[i].emplace(m.local);
    } else {
      dsa[i].emplace();
    }
  }
}

namespace {

std::vector<float> extend(ParallelDecodeState& st, const std::vector<int32_t>& tokens, KdaForm form) {
  const ShardedModel& m = *st.model;
  const int64_t T = static_cast<int64_t>(tokens.size()), V = m.config.vocab_size;
  check(T > 0, "no tokens to add to the sequence");
  for (size_t t = 0; t < tokens.size(); ++t)
    check(tokens[t] >= 0 && tokens[t] < V, "token id ", tokens[t], " at position ", st.length + t,
          " is outside the vocabulary [0, ", V, ")");
  const Tensor hidden =
      parallel_decoder_forward(m, *st.mesh, tokens, [&](int64_t i, const float* a, float* y, Selection& sel) {
        const LayerWeights& lw = m.weights.layers[i];
        if (lw.kda) {
          kda_layer_forward_cached(*lw.kda, m.local, a, T, *st.kda[i], y, form);
        } else {
          dsa_layer_forward_cached(*lw.dsa, m.local, a, T, *st.dsa[i], sel, y);
        }
      });
  st.length += T;
  return parallel_logits(m, *st.mesh, hidden, T - 1, T).data;
}

}  // namespace

std::vector<float> parallel_prefill(ParallelDecodeState& state, const std::vector<int32_t>& tokens) {
  return extend(state, tokens, KdaForm::Chunked);
}

std::vector<float> parallel_decode_step(ParallelDecodeState& state, int32_t token) {
  return extend(state, {token}, KdaForm::Recurrent);
}

Generation parallel_generate(const ShardedModel& m, const Mesh& mesh, const std::vector<int32_t>& prompt,
                             const GenerateOptions& opt) {
  std::optional<ParallelDecodeState> state;
  return generate_with(
      m.config.vocab_size, prompt, opt,
      [&](const std::vector<int32_t>& p) {
        state.emplace(m, mesh);
        return parallel_prefill(*state, p);
      },
      [&](int32_t token) { return parallel_decode_step(*state, token); },
      [&](Sample& s) {
        // Rank 0's choice for everyone (the same already: same logits bits, same sampler state).
        struct {
          int32_t token;
          double logprob;
        } pick{s.token, s.logprob};
        mesh.world->broadcast(&pick, sizeof pick, 0);
        s.token = pick.token;
        s.logprob = pick.logprob;
      });
}

}  // namespace nextlm::dist
