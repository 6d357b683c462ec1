// Reads glm5_next config.json exactly as transformers 5.17.0 Glm5NextConfig / Glm5NextTextConfig do: nested
// "text_config" or flat fields, library defaults, the derived layer lists and the validation rules.
#include "model/config.h"

#include <cmath>
#include <climits>
#include <fstream>

#include "core/error.h"

namespace nextlm {
namespace {

using json = nlohmann::json;

bool present(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

int64_t get_int(const json& j, const char* key, int64_t def) {
  if (!present(j, key)) return def;
  const json& v = j.at(key);
  // Integers beyond int64 (or an integral float beyond it) are out of any sensible range and would wrap or be UB.
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    fail("config: ", key, " is out of range: ", v.dump());
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    check(d >= -0x1p62 && d <= 0x1p62 && d == std::floor(d), "config: ", key, " must be an integer, got ", v.dump());
    return static_cast<int64_t>(d);
  }
  fail("config: ", key, " must be an integer, got ", v.dump());
}

double get_num(const json& j, const char* key, double def) {
  if (!present(j, key)) return def;
  const json& v = j.at(key);
  check(v.is_number(), "config: ", key, " must be a number, got ", v.dump());
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, bool def) {
  if (!present(j, key)) return def;
  const json& v = j.at(key);
  check(v.is_boolean(), "config: ", key, " must be true or false, got ", v.dump());
  return v.get<bool>();
}

std::vector<std::string> get_strings(const json& j, const char* key) {
  const json& v = j.at(key);
  check(v.is_array(), "config: ", key, " must be a list of strings, got ", v.dump());
  std::vector<std::string> out;
  for (const json& e : v) {
    check(e.is_string(), "config: ", key, " must be a list of strings, got an entry ", e.dump());
    out.push_back(e.get<std::string>());
  }
  return out;
}

LayerType parse_layer_type(const std::string& s) {
  if (s == "linear_attention") return LayerType::LinearAttention;
  if (s == "deepseek_sparse_attention" || s == "full_attention") return LayerType::SparseAttention;
  fail("config: unknown layer type \"", s, "\" (expected linear_attention, deepseek_sparse_attention or full_attention)");
}

MlpType parse_mlp_type(const std::string& s) {
  if (s == "dense") return MlpType::Dense;
  if (s == "sparse") return MlpType::Sparse;
  fail("config: unknown mlp layer type \"", s, "\" (expected dense or sparse)");
}

IndexerType parse_indexer_type(const std::string& s) {
  if (s == "full") return IndexerType::Full;
  if (s == "shared") return IndexerType::Shared;
  fail("config: unknown indexer type \"", s, "\" (expected full or shared)");
}

template <class T, class F>
std::vector<T> parse_list(const json& j, const char* key, int64_t layers, F parse) {
  std::vector<T> out;
  for (const std::string& s : get_strings(j, key)) out.push_back(parse(s));
  // transformers indexes these lists by layer and ignores any extra entries (e.g. one for the MTP layer).
  check(static_cast<int64_t>(out.size()) >= layers, "config: ", key, " has ", out.size(),
        " entries but num_hidden_layers is ", layers);
  out.resize(layers);
  return out;
}

// Glm5NextTextConfig fields and __post_init__.
ModelConfig parse_text(const json& t, const json& top, bool nested) {
  ModelConfig c;
  c.nested = nested;
  c.vocab_size = get_int(t, "vocab_size", c.vocab_size);
  c.hidden_size = get_int(t, "hidden_size", c.hidden_size);
  c.intermediate_size = get_int(t, "intermediate_size", c.intermediate_size);
  c.moe_intermediate_size = get_int(t, "moe_intermediate_size", c.moe_intermediate_size);
  c.num_hidden_layers = get_int(t, "num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = get_int(t, "num_attention_heads", c.num_attention_heads);
  // An explicit null copies num_attention_heads (__post_init__); an absent key keeps the dataclass default 64.
  c.num_key_value_heads = t.contains("num_key_value_heads") && t.at("num_key_value_heads").is_null()
                              ? c.num_attention_heads
                              : get_int(t, "num_key_value_heads", c.num_key_value_heads);
  check(!(t.contains("q_lora_rank") && t.at("q_lora_rank").is_null()),
        "config: q_lora_rank is required for the DSA attention layers (got null)");
  c.q_lora_rank = get_int(t, "q_lora_rank", c.q_lora_rank);
  c.kv_lora_rank = get_int(t, "kv_lora_rank", c.kv_lora_rank);
  c.qk_nope_head_dim = get_int(t, "qk_nope_head_dim", c.qk_nope_head_dim);
  c.v_head_dim = get_int(t, "v_head_dim", c.v_head_dim);
  c.qk_rope_head_dim = get_int(t, "qk_rope_head_dim", c.qk_rope_head_dim);
  c.n_routed_experts = get_int(t, "n_routed_experts", c.n_routed_experts);
  c.num_experts_per_tok = get_int(t, "num_experts_per_tok", c.num_experts_per_tok);
  c.n_shared_experts = get_int(t, "n_shared_experts", c.n_shared_experts);
  c.n_group = get_int(t, "n_group", c.n_group);
  c.topk_group = get_int(t, "topk_group", c.topk_group);
  c.norm_topk_prob = get_bool(t, "norm_topk_prob", c.norm_topk_prob);
  c.routed_scaling_factor = get_num(t, "routed_scaling_factor", c.routed_scaling_factor);
  c.swiglu_limit = get_num(t, "swiglu_limit", c.swiglu_limit);
  c.rms_norm_eps = get_num(t, "rms_norm_eps", c.rms_norm_eps);
  c.linear_num_heads = get_int(t, "linear_num_heads", c.linear_num_heads);
  c.linear_head_dim = get_int(t, "linear_head_dim", c.linear_head_dim);
  c.linear_conv_kernel_dim = get_int(t, "linear_conv_kernel_dim", c.linear_conv_kernel_dim);
  if (t.contains("linear_lower_bound"))
    c.linear_lower_bound = t.at("linear_lower_bound").is_null()
                               ? std::nullopt
                               : std::optional<double>(get_num(t, "linear_lower_bound", 0.0));
  c.hc_mult = get_int(t, "hc_mult", c.hc_mult);
  c.hc_eps = get_num(t, "hc_eps", c.hc_eps);
  c.hc_sinkhorn_iters = get_int(t, "hc_sinkhorn_iters", c.hc_sinkhorn_iters);
  c.initializer_range = get_num(t, "initializer_range", c.initializer_range);
  c.index_n_heads = get_int(t, "index_n_heads", c.index_n_heads);
  c.index_head_dim = get_int(t, "index_head_dim", c.index_head_dim);
  c.index_topk = get_int(t, "index_topk", c.index_topk);
  c.index_kpool = get_int(t, "index_kpool", c.index_kpool);
  c.index_kpool_always_select_tail = get_bool(t, "index_kpool_always_select_tail", c.index_kpool_always_select_tail);
  if (present(t, "hidden_act")) {
    check(t.at("hidden_act").is_string(), "config: hidden_act must be a string");
    c.hidden_act = t.at("hidden_act").get<std::string>();
  }
  check(c.hidden_act == "silu", "config: hidden_act \"", c.hidden_act, "\" is not supported (glm5_next uses silu)");
  // The lm_head tie is the outer model's attribute when the config is nested.
  c.tie_word_embeddings = get_bool(t, "tie_word_embeddings", false);
  if (nested) c.tie_word_embeddings = get_bool(top, "tie_word_embeddings", false);
  if (present(t, "pad_token_id")) c.pad_token_id = get_int(t, "pad_token_id", 0);
  if (present(t, "eos_token_id")) {
    const json& e = t.at("eos_token_id");
    if (e.is_array()) {
      for (const json& x : e) {
        check(x.is_number_integer(), "config: eos_token_id entries must be integers");
        c.eos_token_ids.push_back(x.get<int64_t>());
      }
    } else {
      c.eos_token_ids.push_back(get_int(t, "eos_token_id", 0));
    }
  }

  // The per-layer lists are built before anything else is checked: an absurd layer count would otherwise allocate
  // gigabytes here (the config fuzzer found a layer count that made one 2 GB allocation). GLM-5.3-Flash has 45.
  constexpr int64_t kMaxLayers = 65536;
  const int64_t L = c.num_hidden_layers;
  check(L >= 1 && L <= kMaxLayers, "config: num_hidden_layers must be between 1 and ", kMaxLayers, ", got ", L);
  if (present(t, "mlp_layer_types")) {
    c.mlp_layer_types = parse_list<MlpType>(t, "mlp_layer_types", L, parse_mlp_type);
  } else {
    for (int64_t i = 0; i < L; ++i) c.mlp_layer_types.push_back(i < 3 ? MlpType::Dense : MlpType::Sparse);
  }
  if (present(t, "layer_types")) {
    c.layer_types = parse_list<LayerType>(t, "layer_types", L, parse_layer_type);
  } else {
    for (int64_t i = 0; i < L; ++i)
      c.layer_types.push_back(i % 4 != 3 ? LayerType::LinearAttention : LayerType::SparseAttention);
  }
  if (present(t, "indexer_types")) {
    c.indexer_types = parse_list<IndexerType>(t, "indexer_types", L, parse_indexer_type);
  } else if (present(t, "index_topk_pattern")) {
    const json& p = t.at("index_topk_pattern");
    if (p.is_string()) {
      std::vector<IndexerType> v;
      for (char ch : p.get<std::string>()) {
        check(ch == 'F' || ch == 'S', "config: index_topk_pattern may hold only F and S, got '", ch, "'");
        v.push_back(ch == 'F' ? IndexerType::Full : IndexerType::Shared);
      }
      check(static_cast<int64_t>(v.size()) >= L, "config: index_topk_pattern has ", v.size(),
            " entries but num_hidden_layers is ", L);
      v.resize(L);
      c.indexer_types = v;
    } else {
      c.indexer_types = parse_list<IndexerType>(t, "index_topk_pattern", L, parse_indexer_type);
    }
  } else {
    const int64_t freq = std::max<int64_t>(get_int(t, "index_topk_freq", 1), 1);
    const int64_t offset = get_int(t, "index_skip_topk_offset", 2);
    for (int64_t i = 0; i < L; ++i)
      c.indexer_types.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? IndexerType::Full
                                                                                : IndexerType::Shared);
  }
  if (present(t, "linear_attn_config")) {
    const json& d = t.at("linear_attn_config");
    check(d.is_object(), "config: linear_attn_config must be an object");
    c.linear_head_dim = get_int(d, "head_dim", c.linear_head_dim);
    c.linear_num_heads = get_int(d, "num_heads", c.linear_num_heads);
    c.linear_conv_kernel_dim = get_int(d, "short_conv_kernel_size", c.linear_conv_kernel_dim);
    if (d.contains("gate_lower_bound"))  // an explicit null selects the softplus gate, as dict.get() does
      c.linear_lower_bound = d.at("gate_lower_bound").is_null()
                                 ? std::nullopt
                                 : std::optional<double>(get_num(d, "gate_lower_bound", 0.0));
    // dict.get("safe_gate", True) gives None for an explicit null, which is falsy.
    const bool safe_gate = !(d.contains("safe_gate") && d.at("safe_gate").is_null()) && get_bool(d, "safe_gate", true);
    if (safe_gate && !c.linear_lower_bound) c.linear_lower_bound = -5.0;
  }
  validate(c);
  return c;
}

}  // namespace

const char* to_string(LayerType t) {
  return t == LayerType::LinearAttention ? "linear_attention" : "deepseek_sparse_attention";
}
const char* to_string(MlpType t) { return t == MlpType::Dense ? "dense" : "sparse"; }
const char* to_string(IndexerType t) { return t == IndexerType::Full ? "full" : "shared"; }

int64_t ModelConfig::num_kda_layers() const {
  int64_t n = 0;
  for (LayerType t : layer_types) n += t == LayerType::LinearAttention;
  return n;
}
int64_t ModelConfig::num_dsa_layers() const { return static_cast<int64_t>(layer_types.size()) - num_kda_layers(); }

void validate(const ModelConfig& c) {
  auto positive = [](int64_t v, const char* name) { check(v > 0, "config: ", name, " must be positive, got ", v); };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.q_lora_rank, "q_lora_rank");
  positive(c.kv_lora_rank, "kv_lora_rank");
  positive(c.qk_nope_head_dim, "qk_nope_head_dim");
  positive(c.v_head_dim, "v_head_dim");
  positive(c.linear_num_heads, "linear_num_heads");
  positive(c.linear_head_dim, "linear_head_dim");
  positive(c.linear_conv_kernel_dim, "linear_conv_kernel_dim");
  positive(c.hc_mult, "hc_mult");
  positive(c.index_n_heads, "index_n_heads");
  positive(c.index_head_dim, "index_head_dim");
  positive(c.index_topk, "index_topk");
  check(c.hc_sinkhorn_iters >= 0, "config: hc_sinkhorn_iters must not be negative, got ", c.hc_sinkhorn_iters);
  check(c.rms_norm_eps >= 0 && c.hc_eps >= 0, "config: rms_norm_eps and hc_eps must not be negative");
  check(c.num_attention_heads == c.num_key_value_heads, "config: num_attention_heads (", c.num_attention_heads,
        ") must be the same as num_key_value_heads (", c.num_key_value_heads, ")");
  check(c.index_kpool >= 1, "config: index_kpool must be positive, got ", c.index_kpool);
  check(c.index_topk % c.index_kpool == 0, "config: index_topk (", c.index_topk,
        ") must be divisible by index_kpool (", c.index_kpool, ")");
  check(c.qk_rope_head_dim == 0, "config: qk_rope_head_dim must be 0 (the DSA layers are NoPE), got ",
        c.qk_rope_head_dim);
  const int64_t L = c.num_hidden_layers;
  check(static_cast<int64_t>(c.layer_types.size()) == L && static_cast<int64_t>(c.mlp_layer_types.size()) == L &&
            static_cast<int64_t>(c.indexer_types.size()) == L,
        "config: the layer lists must have num_hidden_layers entries");
  bool any_sparse = false;
  for (MlpType t : c.mlp_layer_types) any_sparse |= t == MlpType::Sparse;
  bool any_dense = false;
  for (MlpType t : c.mlp_layer_types) any_dense |= t == MlpType::Dense;
  if (any_dense) positive(c.intermediate_size, "intermediate_size");
  if (any_sparse) {
    positive(c.n_routed_experts, "n_routed_experts");
    positive(c.moe_intermediate_size, "moe_intermediate_size");
    positive(c.num_experts_per_tok, "num_experts_per_tok");
    positive(c.n_group, "n_group");
    positive(c.topk_group, "topk_group");
    check(c.n_shared_experts >= 0, "config: n_shared_experts must not be negative");
    check(c.n_routed_experts % c.n_group == 0, "config: n_routed_experts (", c.n_routed_experts,
          ") must be divisible by n_group (", c.n_group, ")");
    check(c.n_routed_experts / c.n_group >= 2, "config: each expert group needs at least 2 experts (n_routed_experts ",
          c.n_routed_experts, ", n_group ", c.n_group, ")");
    check(c.topk_group <= c.n_group, "config: topk_group (", c.topk_group, ") exceeds n_group (", c.n_group, ")");
    check(c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts / c.n_group), "config: num_experts_per_tok (",
          c.num_experts_per_tok, ") exceeds the experts of the kept groups");
  }
  // A shared-indexer layer takes the selection handed on by the layer directly before it, which transformers only
  // hands on from a full DSA layer.
  for (int64_t i = 0; i < L; ++i) {
    if (c.layer_types[i] != LayerType::SparseAttention || c.indexer_types[i] != IndexerType::Shared) continue;
    check(i > 0 && c.layer_types[i - 1] == LayerType::SparseAttention && c.indexer_types[i - 1] == IndexerType::Full,
          "config: indexer_types: layer ", i,
          " is a shared-indexer DSA layer without a full-indexer DSA layer directly before it to hand on a selection");
  }
}

ModelConfig parse_config(const nlohmann::json& j) {
  check(j.is_object(), "config: expected a JSON object");
  check(j.contains("model_type") && j.at("model_type").is_string(), "config: model_type is missing");
  const std::string mt = j.at("model_type").get<std::string>();
  check(mt == "glm5_next" || mt == "glm5_next_text", "config: unknown model_type \"", mt,
        "\" (nextlm runs glm5_next)");
  try {
    if (mt == "glm5_next" && present(j, "text_config")) {
      const json& t = j.at("text_config");
      check(t.is_object(), "config: text_config must be an object");
      return parse_text(t, j, true);
    }
    return parse_text(j, j, false);
  } catch (const json::exception& e) {
    fail("config: ", e.what());
  }
}

ModelConfig load_config(const std::string& path) {
  std::ifstream in(path);
  check(in.good(), "cannot read ", path);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  check(!j.is_discarded(), path, ": not valid JSON");
  try {
    return parse_config(j);
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
}

std::vector<int32_t> load_eos_token_ids(const std::string& model_dir, const ModelConfig& c) {
  std::vector<int64_t> ids = c.eos_token_ids;
  std::string from = model_dir + "/config.json";
  const std::string gc = model_dir + "/generation_config.json";
  if (std::ifstream in(gc); in.good()) {
    const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    check(!j.is_discarded() && j.is_object(), gc, ": not a JSON object");
    if (present(j, "eos_token_id")) {
      const json& e = j.at("eos_token_id");
      ids.clear();
      for (const json& x : e.is_array() ? e : json::array({e})) {
        check(x.is_number_integer(), gc, ": eos_token_id must be an integer or a list of integers, got ", e.dump());
        ids.push_back(x.is_number_unsigned() && x.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                          ? INT64_MAX
                          : x.get<int64_t>());
      }
      from = gc;
    }
  }
  std::vector<int32_t> out;
  for (int64_t id : ids) {
    check(id >= 0 && id < c.vocab_size, from, ": eos_token_id ", id, " is outside the vocabulary [0, ", c.vocab_size,
          ")");
    out.push_back(static_cast<int32_t>(id));
  }
  return out;
}

}  // namespace nextlm
