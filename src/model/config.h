// glm5_next model configuration read from a hub config.json, with transformers' defaults and derived lists
// (Glm5NextTextConfig.__post_init__ and validate_architecture in transformers 5.17.0).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace nextlm {

enum class LayerType { LinearAttention, SparseAttention };  // KDA, or NoPE MLA with the DSA indexer
enum class MlpType { Dense, Sparse };
enum class IndexerType { Full, Shared };

const char* to_string(LayerType t);
const char* to_string(MlpType t);
const char* to_string(IndexerType t);

struct ModelConfig {
  // Sizes. Letters used across the code: V vocab, D hidden, S hc_mult streams, H linear heads, K linear head dim.
  int64_t vocab_size = 154880;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 12288;
  int64_t moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 45;
  int64_t num_attention_heads = 64;
  int64_t num_key_value_heads = 64;
  int64_t q_lora_rank = 1536;
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 256;
  int64_t v_head_dim = 256;
  int64_t qk_rope_head_dim = 0;
  // MoE
  int64_t n_routed_experts = 288;
  int64_t num_experts_per_tok = 8;
  int64_t n_shared_experts = 1;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 2.5;
  double swiglu_limit = 10.0;
  double rms_norm_eps = 1e-5;
  // KDA
  int64_t linear_num_heads = 64;
  int64_t linear_head_dim = 128;
  int64_t linear_conv_kernel_dim = 4;
  std::optional<double> linear_lower_bound = -5.0;  // nullopt selects the softplus gate
  // mHC
  int64_t hc_mult = 4;
  double hc_eps = 1e-6;
  int64_t hc_sinkhorn_iters = 20;
  // DSA indexer
  int64_t index_n_heads = 32;
  int64_t index_head_dim = 128;
  int64_t index_topk = 2048;
  int64_t index_kpool = 16;
  bool index_kpool_always_select_tail = true;

  bool tie_word_embeddings = false;
  std::optional<int64_t> pad_token_id;
  std::vector<int64_t> eos_token_ids;
  std::string hidden_act = "silu";
  double initializer_range = 0.02;  // std of the normal init (only random init reads it)

  std::vector<LayerType> layer_types;        // [num_hidden_layers]
  std::vector<MlpType> mlp_layer_types;      // [num_hidden_layers]
  std::vector<IndexerType> indexer_types;    // [num_hidden_layers]

  bool nested = false;  // text fields came from "text_config"

  int64_t num_kda_layers() const;
  int64_t num_dsa_layers() const;
};

// Parses a config.json object. Throws Error on an unknown model_type, a field of the wrong type, an unknown value
// in a layer list, a list of the wrong length, or a violated rule (see validate()).
ModelConfig parse_config(const nlohmann::json& j);
ModelConfig load_config(const std::string& path);  // reads and parses the file; errors name the path

// The token ids that end generation by default (`generate`, `serve`; --ignore-eos / ignore_eos turn them off): the
// eos_token_id (an int or a list) of model_dir/generation_config.json when that file sets one, else c.eos_token_ids
// from config.json, as transformers' generate() reads its GenerationConfig. Empty when neither sets one. Throws
// Error naming the file for a malformed generation_config.json or an id outside [0, c.vocab_size).
std::vector<int32_t> load_eos_token_ids(const std::string& model_dir, const ModelConfig& c);

// The rules transformers checks, plus the ones the forward relies on (positive sizes, divisibility of groups,
// a shared-indexer DSA layer directly after a full one). Throws Error naming the field.
void validate(const ModelConfig& c);

}  // namespace nextlm
