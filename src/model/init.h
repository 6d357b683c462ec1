// Random initialisation of a glm5_next model from its config, as transformers' Glm5NextPreTrainedModel._init_weights
// does it (5.17.0), and saving a model in the hub layout that Model::load reads.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/weights.h"

namespace nextlm {

// A deterministic random source (std::mt19937_64, whose sequence the C++ standard fixes, so the same seed gives the
// same model on every platform; normals by Box–Muller rather than std::normal_distribution, which is not portable).
class Rng {
 public:
  explicit Rng(uint64_t seed);
  double uniform();                      // [0, 1)
  double uniform(double a, double b);    // [a, b)
  double normal(double mean, double std);
  uint64_t next();                       // raw 64 bits

 private:
  uint64_t s_[4];
};

// Fresh weights for config c, the same distributions as transformers' _init_weights:
//  * every linear, the embedding, the experts and the router: normal(0, initializer_range); the embedding's
//    pad_token_id row is zero (nn.Embedding's padding_idx);
//  * every norm weight 1 (RMSNorm, gated o_norm, q_a/kv_a layernorms), the indexer's LayerNorm k_norm weight 1 and
//    bias 0;
//  * KDA gate: A_log = 0 for the safe gate (linear_lower_bound set), log(U(1, 16)) for the softplus gate; dt_bias the
//    inverse softplus of dt = max(exp(U(log 1e-3, log 1e-1)), 1e-4);
//  * conv weights (nn.Conv1d's own init, which _init_weights leaves alone): kaiming-uniform, U(−1/√W, 1/√W) for a
//    depthwise conv of width W;
//  * mHC: fn normal(0, 0.02), base 0, scale 1;
//  * MoE e_score_correction_bias 0; indexer index_kpool_compress_ape 0 and index_kpool_compress_gate 1.
// With tie_word_embeddings lm_head is a copy of the embedding.
ModelWeights init_weights(const ModelConfig& c, uint64_t seed);

// The config as a hub config.json object (nested: glm5_next with a text_config), every field written explicitly,
// the derived layer lists included, so that parse_config gives back an equal ModelConfig.
nlohmann::json config_to_json(const ModelConfig& c);

// Every tensor of the model (trainable and frozen) under its checkpoint name, f32, hub shapes: the text model under
// "model.language_model.", lm_head.weight at the top (absent when tied). Pointers into w.
std::vector<TensorToWrite> hub_tensors(const ModelConfig& c, const ModelWeights& w);

// Writes DIR/config.json and DIR/model.safetensors (f32), each atomically; DIR must exist. Model::load(DIR) gives
// back the same config and bit-identical weights.
void save_model(const std::string& dir, const ModelConfig& c, const ModelWeights& w);

}  // namespace nextlm
