// Random init (transformers' _init_weights distributions) and hub-layout saving of a glm5_next model.
#include "model/init.h"

#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "io/atomic_file.h"
#include "model/train.h"

namespace nextlm {

namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

}  // namespace

// xoshiro256** seeded by splitmix64: a small, fully specified generator whose state is four words (easy to
// checkpoint), so the same seed gives the same numbers everywhere.
Rng::Rng(uint64_t seed) {
  for (uint64_t& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
double Rng::uniform(double a, double b) { return a + (b - a) * uniform(); }

double Rng::normal(double mean, double std) {
  const double u1 = 1.0 - uniform(), u2 = uniform();  // u1 in (0, 1]: log is finite
  return mean + std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

namespace {

struct Init {
  const ModelConfig& c;
  Rng rng;

  Tensor normal(std::vector<int64_t> shape, double std) {
    Tensor t(std::move(shape));
    for (float& x : t.data) x = static_cast<float>(rng.normal(0.0, std));
    return t;
  }
  Tensor linear(int64_t out, int64_t in) { return normal({out, in}, c.initializer_range); }
  Tensor uniform(std::vector<int64_t> shape, double a, double b) {
    Tensor t(std::move(shape));
    for (float& x : t.data) x = static_cast<float>(rng.uniform(a, b));
    return t;
  }
  static Tensor fill(std::vector<int64_t> shape, float v) { return Tensor(std::move(shape), v); }

  MlpWeights mlp(int64_t I) {
    const int64_t D = c.hidden_size;
    MlpWeights m;
    m.gate = linear(I, D);
    m.up = linear(I, D);
    m.down = linear(D, I);
    return m;
  }

  HcWeights hc() {
    const int64_t S = c.hc_mult, M = (2 + S) * S;
    return HcWeights{normal({M, S * c.hidden_size}, 0.02), fill({M}, 0.0f), fill({3}, 1.0f)};
  }

  KdaWeights kda() {
    const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, W = c.linear_conv_kernel_dim;
    const double bound = 1.0 / std::sqrt(static_cast<double>(W));  // kaiming-uniform, fan_in = W (depthwise)
    KdaWeights w;
    w.q_proj = linear(H * K, D);
    w.k_proj = linear(H * K, D);
    w.v_proj = linear(H * K, D);
    w.q_conv = uniform({H * K, W}, -bound, bound);
    w.k_conv = uniform({H * K, W}, -bound, bound);
    w.v_conv = uniform({H * K, W}, -bound, bound);
    w.f_a = linear(K, D);
    w.f_b = linear(H * K, K);
    // FLA's gate init: dt log-uniform in [1e-3, 1e-1], stored as its inverse softplus.
    w.dt_bias = Tensor({H * K});
    for (float& x : w.dt_bias.data) {
      const double dt = std::max(std::exp(rng.uniform(std::log(1e-3), std::log(1e-1))), 1e-4);
      x = static_cast<float>(dt + std::log(-std::expm1(-dt)));
    }
    w.A_log = Tensor({H});
    for (float& x : w.A_log.data) x = c.linear_lower_bound ? 0.0f : static_cast<float>(std::log(rng.uniform(1.0, 16.0)));
    w.b_proj = linear(H, D);
    w.g_a = linear(K, D);
    w.g_b = linear(H * K, K);
    w.o_norm = fill({K}, 1.0f);
    w.o_proj = linear(D, H * K);
    return w;
  }

  DsaWeights dsa(bool full_indexer) {
    const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
    const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank;
    DsaWeights w;
    w.q_a = linear(QL, D);
    w.q_a_norm = fill({QL}, 1.0f);
    w.q_b = linear(NH * dqk, QL);
    w.kv_a = linear(KL, D);
    w.kv_a_norm = fill({KL}, 1.0f);
    w.kv_b = linear(NH * (dqk + dv), KL);
    w.o_proj = linear(D, NH * dv);
    if (full_indexer) {
      const int64_t IH = c.index_n_heads, ID = c.index_head_dim;
      IndexerWeights ix;
      ix.wq_b = linear(IH * ID, QL);
      ix.wk = linear(ID, D);
      ix.k_norm_w = fill({ID}, 1.0f);
      ix.k_norm_b = fill({ID}, 0.0f);
      ix.weights_proj = linear(IH, D);
      ix.ape = fill({c.index_kpool, ID}, 0.0f);
      ix.gate = fill({ID, D}, 1.0f);
      w.indexer = std::move(ix);
    }
    return w;
  }

  MoeWeights moe() {
    MoeWeights w;
    w.router = linear(c.n_routed_experts, c.hidden_size);
    w.correction_bias = fill({c.n_routed_experts}, 0.0f);
    for (int64_t e = 0; e < c.n_routed_experts; ++e) w.experts.push_back(mlp(c.moe_intermediate_size));
    if (c.n_shared_experts > 0) w.shared = mlp(c.moe_intermediate_size * c.n_shared_experts);
    return w;
  }
};

}  // namespace

ModelWeights init_weights(const ModelConfig& c, uint64_t seed) {
  validate(c);
  Init in{c, Rng(seed)};
  const int64_t V = c.vocab_size, D = c.hidden_size;
  ModelWeights w;
  w.embed = in.linear(V, D);
  if (c.pad_token_id && *c.pad_token_id >= 0 && *c.pad_token_id < V)
    std::fill_n(w.embed.ptr() + *c.pad_token_id * D, D, 0.0f);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights l;
    l.hc_attn = in.hc();
    l.hc_ffn = in.hc();
    l.input_norm = Init::fill({D}, 1.0f);
    l.post_attention_norm = Init::fill({D}, 1.0f);
    if (c.layer_types[i] == LayerType::LinearAttention) {
      l.kda = in.kda();
    } else {
      l.dsa = in.dsa(c.indexer_types[i] == IndexerType::Full);
    }
    if (c.mlp_layer_types[i] == MlpType::Dense) {
      l.mlp = in.mlp(c.intermediate_size);
    } else {
      l.moe = in.moe();
    }
    w.layers.push_back(std::move(l));
  }
  w.final_norm = Init::fill({D}, 1.0f);
  w.lm_head = c.tie_word_embeddings ? w.embed : in.linear(V, D);
  return w;
}

nlohmann::json config_to_json(const ModelConfig& c) {
  nlohmann::json t;
  t["model_type"] = "glm5_next_text";
  t["vocab_size"] = c.vocab_size;
  t["hidden_size"] = c.hidden_size;
  t["intermediate_size"] = c.intermediate_size;
  t["moe_intermediate_size"] = c.moe_intermediate_size;
  t["num_hidden_layers"] = c.num_hidden_layers;
  t["num_attention_heads"] = c.num_attention_heads;
  t["num_key_value_heads"] = c.num_key_value_heads;
  t["q_lora_rank"] = c.q_lora_rank;
  t["kv_lora_rank"] = c.kv_lora_rank;
  t["qk_nope_head_dim"] = c.qk_nope_head_dim;
  t["v_head_dim"] = c.v_head_dim;
  t["qk_rope_head_dim"] = c.qk_rope_head_dim;
  t["n_routed_experts"] = c.n_routed_experts;
  t["num_experts_per_tok"] = c.num_experts_per_tok;
  t["n_shared_experts"] = c.n_shared_experts;
  t["n_group"] = c.n_group;
  t["topk_group"] = c.topk_group;
  t["norm_topk_prob"] = c.norm_topk_prob;
  t["routed_scaling_factor"] = c.routed_scaling_factor;
  t["swiglu_limit"] = c.swiglu_limit;
  t["rms_norm_eps"] = c.rms_norm_eps;
  t["linear_num_heads"] = c.linear_num_heads;
  t["linear_head_dim"] = c.linear_head_dim;
  t["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  t["linear_lower_bound"] = c.linear_lower_bound ? nlohmann::json(*c.linear_lower_bound) : nlohmann::json(nullptr);
  t["hc_mult"] = c.hc_mult;
  t["hc_eps"] = c.hc_eps;
  t["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  t["index_n_heads"] = c.index_n_heads;
  t["index_head_dim"] = c.index_head_dim;
  t["index_topk"] = c.index_topk;
  t["index_kpool"] = c.index_kpool;
  t["index_kpool_always_select_tail"] = c.index_kpool_always_select_tail;
  t["hidden_act"] = c.hidden_act;
  t["initializer_range"] = c.initializer_range;
  t["pad_token_id"] = c.pad_token_id ? nlohmann::json(*c.pad_token_id) : nlohmann::json(nullptr);
  t["eos_token_id"] = c.eos_token_ids;
  nlohmann::json lt = nlohmann::json::array(), mt = nlohmann::json::array(), it = nlohmann::json::array();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    lt.push_back(to_string(c.layer_types[i]));
    mt.push_back(to_string(c.mlp_layer_types[i]));
    it.push_back(to_string(c.indexer_types[i]));
  }
  t["layer_types"] = lt;
  t["mlp_layer_types"] = mt;
  t["indexer_types"] = it;
  t["tie_word_embeddings"] = c.tie_word_embeddings;
  nlohmann::json j;
  j["architectures"] = {"Glm5NextForConditionalGeneration"};
  j["model_type"] = "glm5_next";
  j["tie_word_embeddings"] = c.tie_word_embeddings;  // the nested form reads the tie from the outer config
  j["text_config"] = t;
  j["producer"] = "nextlm";
  return j;
}

std::vector<TensorToWrite> hub_tensors(const ModelConfig& c, const ModelWeights& w) {
  const std::string prefix = "model.language_model.";
  std::vector<TensorToWrite> out;
  for (const GradTensor& g : hub_gradients(c, w, prefix)) out.push_back({g.name, DType::F32, g.shape, g.data});
  // The frozen tensors, which hub_gradients leaves out.
  auto add = [&](const std::string& name, const Tensor& t) {
    out.push_back({prefix + name, DType::F32, t.shape, t.ptr()});
  };
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    if (l.dsa && l.dsa->indexer) {
      const IndexerWeights& ix = *l.dsa->indexer;
      const std::string q = p + "self_attn.indexer.";
      add(q + "wq_b.weight", ix.wq_b);
      add(q + "wk.weight", ix.wk);
      add(q + "k_norm.weight", ix.k_norm_w);
      add(q + "k_norm.bias", ix.k_norm_b);
      add(q + "weights_proj.weight", ix.weights_proj);
      add(q + "index_kpool_compress_ape", ix.ape);
      add(q + "index_kpool_compress_gate", ix.gate);
    }
    if (l.moe) add(p + "mlp.gate.e_score_correction_bias", l.moe->correction_bias);
  }
  return out;
}

void save_model(const std::string& dir, const ModelConfig& c, const ModelWeights& w) {
  namespace fs = std::filesystem;
  check(fs::is_directory(dir), "cannot save the model: ", dir, " is not a directory");
  write_safetensors((fs::path(dir) / "model.safetensors").string(), hub_tensors(c, w),
                    {{"format", "pt"}, {"producer", "nextlm"}});
  AtomicFile f((fs::path(dir) / "config.json").string());
  f.write(config_to_json(c).dump(2) + "\n");
  f.commit();
}

}  // namespace nextlm
