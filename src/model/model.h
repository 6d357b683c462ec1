// The glm5_next text model on the CPU in fp32: the executable specification every other path is checked against.
// forward: embed into S streams → per layer (mHC → RMSNorm → KDA or DSA → mHC mix; mHC → RMSNorm → MLP or MoE →
// mHC mix) → mean over streams → RMSNorm → lm_head (../shared/docs/glm5_next.md §3).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/dsa.h"
#include "model/kda.h"
#include "model/weights.h"

namespace nextlm {

// A packed batch: the tokens of N sequences back to back, and cu_seqlens [N+1] (0, end of seq 0, …, T).
struct PackedBatch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> cu_seqlens;
  // Optional per-token loss weights [T] for training (empty: every prediction counts 1). target_weight[t] weighs
  // the prediction of tokens[t] from the tokens before it, so a prompt token gets 0; a sequence's first token is
  // never predicted and its entry is ignored. Only the loss (model_forward_backward) reads it.
  std::vector<float> target_weight;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  void add(const std::vector<int32_t>& seq);  // appends one sequence
};

struct ForwardOptions {
  KdaForm kda_form = KdaForm::Chunked;  // prefill uses the chunked form; the recurrent one is its definition
  // Queries that select no key (kpool > 1 without the tail): AllKeys as transformers, SeenKeys as decoding does.
  EmptySelection empty_selection = EmptySelection::AllKeys;
};

class Model {
 public:
  Model(ModelConfig config, ModelWeights weights);
  // Reads DIR/config.json and the safetensors checkpoint in DIR.
  static Model load(const std::string& dir, LoadReport* report = nullptr);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  ModelWeights& mutable_weights() { return weights_; }  // for the optimizer, which updates the weights in place

  // Final normed hidden states [T, D] of a packed batch. Throws Error on an empty sequence, inconsistent offsets
  // or a token id outside [0, vocab_size).
  Tensor forward_hidden(const PackedBatch& batch, const ForwardOptions& opt = {}) const;
  // Logits [rows, V] of hidden rows [begin, end).
  Tensor logits(const Tensor& hidden, int64_t begin, int64_t end) const;
  // Convenience: all logits [T, V].
  Tensor forward(const PackedBatch& batch, const ForwardOptions& opt = {}) const;

  // log p(x[t+1] | x[..t]) for every sequence of the batch: result[n] has T_n − 1 values. Processes the lm_head in
  // row blocks so that [T, V] logits are never held at once.
  std::vector<std::vector<double>> next_token_logprobs(const PackedBatch& batch, const ForwardOptions& opt = {}) const;
  // The same from hidden states that forward_hidden(batch) returned.
  std::vector<std::vector<double>> next_token_logprobs(const Tensor& hidden, const PackedBatch& batch) const;

  // Parameter counts of the text model: every tensor, and those one token uses (top-k routed + shared experts).
  int64_t num_parameters() const;
  int64_t num_active_parameters() const;

 private:
  ModelConfig config_;
  ModelWeights weights_;
};

void validate_batch(const PackedBatch& batch, int64_t vocab_size);

// Model::num_parameters() of a model of config c, from the config alone (the shapes load_weights checks): for a
// base that is never loaded (a LoRA trainer's on disk).
int64_t parameter_count(const ModelConfig& c);

}  // namespace nextlm
