// Incremental decoding on the CPU: a per-sequence state holding each layer's cache, prefill of a prompt, one-token
// decode steps, and a generation loop with sampling. Each step's logits equal the full forward's logits of the same
// prefix (tests/test_decode.cpp), with one documented exception below.
//
// Queries that select no key. With index_kpool_always_select_tail false and index_kpool > 1, the first kpool−1
// positions of a sequence select nothing. The batch forward (like transformers' eager attention) then spreads them
// uniformly over every key of the sequence, later ones included; no causal decoder can reproduce that, and the
// result would depend on how the sequence was split between prefill and decode. Decoding instead attends uniformly
// to the keys seen so far (EmptySelection::SeenKeys; transformers' own cached one-token steps do the same), in
// prefill and decode alike, so the state never depends on the split. It equals the forward run with
// ForwardOptions::empty_selection = SeenKeys. The real GLM-5.3-Flash has the tail on, where the two never differ.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "model/dsa.h"
#include "model/kda.h"
#include "model/model.h"
#include "model/sampling.h"

namespace nextlm {

// Everything one sequence's next token needs from its past. Refers to its model, which must outlive it.
struct DecodeState {
  explicit DecodeState(const Model& model);  // the empty sequence

  const Model* model;
  int64_t length = 0;                       // tokens consumed
  std::vector<std::optional<KdaCache>> kda;  // [layers]: set on KDA layers (conv history, recurrent state)
  std::vector<std::optional<DsaCache>> dsa;  // [layers]: set on DSA layers (MLA latents, indexer pools)
};

// Appends tokens (at least one) to the sequence, in one pass per layer (chunked KDA), and returns the logits [V] of
// the last one: the distribution of the next token. May be called again to extend the sequence.
std::vector<float> prefill(DecodeState& state, const std::vector<int32_t>& tokens);

// Appends one token (recurrent KDA) and returns its logits [V].
std::vector<float> decode_step(DecodeState& state, int32_t token);

struct GenerateOptions {
  int64_t max_new_tokens = 16;
  SamplingOptions sampling;
  std::vector<int32_t> stop_tokens;  // generation ends after producing one of these (it is part of the result)
  // The model's end-of-sequence ids (load_eos_token_ids in model/config.h; the CLI leaves them out with --ignore-eos):
  // generation ends after producing one. It was sampled, so it is part of tokens and logprobs, but callers leave it
  // out of the text (Generation::eos), as transformers' decode(skip_special_tokens) and vLLM do.
  std::vector<int32_t> eos_tokens;
};

struct Generation {
  std::vector<int32_t> tokens;   // the new tokens only
  std::vector<double> logprobs;  // log p(token | everything before it), unmodified model distribution (sampling.h)
  std::vector<std::vector<TokenLogprob>> top;  // per new token, the sampling.top_logprobs alternatives
  bool stopped = false;          // ended on a stop or eos token rather than on max_new_tokens
  bool eos = false;              // ended on an eos token (the last of `tokens`): not part of the text
};

// Prefills the prompt (non-empty), then samples up to max_new_tokens tokens.
Generation generate(const Model& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt);

// The same loop over any decoder (the CUDA one, the tensor/expert-parallel one): `prefill` gives the logits [V] of
// the next token after the prompt, `step` after one more token; `agree`, when given, may replace each sample (the
// parallel decoder makes every rank take rank 0's). Checks the prompt and the options against the vocabulary V.
using PrefillFn = std::function<std::vector<float>(const std::vector<int32_t>& prompt)>;
using StepFn = std::function<std::vector<float>(int32_t token)>;
Generation generate_with(int64_t V, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                         const PrefillFn& prefill, const StepFn& step,
                         const std::function<void(Sample&)>& agree = nullptr);

}  // namespace nextlm
