// Loads the text model's parameters from a hub checkpoint, checking every name and shape (spec §2).
#include "model/weights.h"

#include <set>

#include "core/error.h"

namespace nextlm {
namespace {

class Loader {
 public:
  Loader(const Checkpoint& ckpt, std::string prefix) : ckpt_(ckpt), prefix_(std::move(prefix)) {}

  // Reads `name` (relative to the text-model prefix unless absolute) and checks its shape.
  Tensor get(const std::string& name, const std::vector<int64_t>& shape, bool absolute = false) {
    const std::string full = absolute ? name : prefix_ + name;
    const TensorView* t = ckpt_.find(full);
    check(t != nullptr, "checkpoint ", ckpt_.dir(), " is missing tensor ", full);
    check(t->shape == shape, "tensor ", full, " in ", t->file, " has shape ", shape_str(t->shape), ", expected ",
          shape_str(shape));
    used_.insert(full);
    Tensor out;
    out.shape = shape;
    out.data = to_f32(*t);
    return out;
  }
  // Conv weights are stored [C, 1, W]; the forward wants [C, W].
  Tensor get_conv(const std::string& name, int64_t C, int64_t W) {
    Tensor t = get(name, {C, 1, W});
    t.shape = {C, W};
    return t;
  }
  bool has(const std::string& name) const { return ckpt_.find(prefix_ + name) != nullptr; }
  const std::set<std::string>& used() const { return used_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const Checkpoint& ckpt_;
  std::string prefix_;
  std::set<std::string> used_;
};

HcWeights load_hc(Loader& ld, const std::string& p, const ModelConfig& c) {
  const int64_t S = c.hc_mult, D = c.hidden_size, M = (2 + S) * S;
  return HcWeights{ld.get(p + "_fn", {M, S * D}), ld.get(p + "_base", {M}), ld.get(p + "_scale", {3})};
}

MlpWeights load_mlp(Loader& ld, const std::string& p, int64_t D, int64_t I) {
  return MlpWeights{ld.get(p + "gate_proj.weight", {I, D}), ld.get(p + "up_proj.weight", {I, D}),
                    ld.get(p + "down_proj.weight", {D, I})};
}

KdaWeights load_kda(Loader& ld, const std::string& p, const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, W = c.linear_conv_kernel_dim;
  KdaWeights w;
  w.q_proj = ld.get(p + "q_proj.weight", {H * K, D});
  w.k_proj = ld.get(p + "k_proj.weight", {H * K, D});
  w.v_proj = ld.get(p + "v_proj.weight", {H * K, D});
  w.q_conv = ld.get_conv(p + "q_conv1d.weight", H * K, W);
  w.k_conv = ld.get_conv(p + "k_conv1d.weight", H * K, W);
  w.v_conv = ld.get_conv(p + "v_conv1d.weight", H * K, W);
  w.f_a = ld.get(p + "f_a_proj.weight", {K, D});
  w.f_b = ld.get(p + "f_b_proj.weight", {H * K, K});
  w.dt_bias = ld.get(p + "dt_bias", {H * K});
  w.A_log = ld.get(p + "A_log", {H});
  w.b_proj = ld.get(p + "b_proj.weight", {H, D});
  w.g_a = ld.get(p + "g_a_proj.weight", {K, D});
  w.g_b = ld.get(p + "g_b_proj.weight", {H * K, K});
  w.o_norm = ld.get(p + "o_norm.weight", {K});
  w.o_proj = ld.get(p + "o_proj.weight", {D, H * K});
  return w;
}

DsaWeights load_dsa(Loader& ld, const std::string& p, const ModelConfig& c, bool full_indexer) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank;
  DsaWeights w;
  w.q_a = ld.get(p + "q_a_proj.weight", {QL, D});
  w.q_a_norm = ld.get(p + "q_a_layernorm.weight", {QL});
  w.q_b = ld.get(p + "q_b_proj.weight", {NH * dqk, QL});
  w.kv_a = ld.get(p + "kv_a_proj_with_mqa.weight", {KL, D});
  w.kv_a_norm = ld.get(p + "kv_a_layernorm.weight", {KL});
  w.kv_b = ld.get(p + "kv_b_proj.weight", {NH * (dqk + dv), KL});
  w.o_proj = ld.get(p + "o_proj.weight", {D, NH * dv});
  if (full_indexer) w.indexer = load_indexer(ld, p + "indexer.", c);
  return w;
}

MoeWeights load_moe(Loader& ld, const std::string& p, const ModelConfig& c) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size;
  MoeWeights w;
  w.router = ld.get(p + "gate.weight", {E, D});
  w.correction_bias = ld.get(p + "gate.e_score_correction_bias", {E});
  w.experts.reserve(E);
  for (int64_t e = 0; e < E; ++e) w.experts.push_back(load_mlp(ld, p + "experts." + std::to_string(e) + ".", D, I));
  if (c.n_shared_experts > 0) w.shared = load_mlp(ld, p + "shared_experts.", D, I * c.n_shared_experts);
  return w;
}

// The index of the layer a name belongs to, when it is "<prefix>layers.<i>.…"; else -1.
int64_t layer_of(const std::string& name, const std::string& prefix) {
  const std::string lp = prefix + "layers.";
  if (name.rfind(lp, 0) != 0) return -1;
  size_t i = lp.size(), j = i;
  while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
  if (j == i || j >= name.size() || name[j] != '.') return -1;
  return std::stoll(name.substr(i, j - i));
}

}  // namespace

ModelWeights load_weights(const Checkpoint& ckpt, const ModelConfig& c, LoadReport* report) {
  // Multimodal checkpoints hold the text model under model.language_model.; text-only ones under model.
  std::string prefix = "model.language_model.";
  if (!ckpt.find(prefix + "embed_tokens.weight") && ckpt.find("model.embed_tokens.weight")) prefix = "model.";
  Loader ld(ckpt, prefix);
  const int64_t V = c.vocab_size, D = c.hidden_size;

  ModelWeights w;
  w.embed = ld.get("embed_tokens.weight", {V, D});
  w.final_norm = ld.get("norm.weight", {D});
  if (c.tie_word_embeddings && !ckpt.find("lm_head.weight")) {
    w.lm_head = w.embed;
  } else {
    w.lm_head = ld.get("lm_head.weight", {V, D}, /*absolute=*/true);
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights lw;
    lw.hc_attn = load_hc(ld, p + "hc_attn", c);
    lw.hc_ffn = load_hc(ld, p + "hc_ffn", c);
    lw.input_norm = ld.get(p + "input_layernorm.weight", {D});
    lw.post_attention_norm = ld.get(p + "post_attention_layernorm.weight", {D});
    if (c.layer_types[i] == LayerType::LinearAttention) {
      lw.kda = load_kda(ld, p + "self_attn.", c);
    } else {
      lw.dsa = load_dsa(ld, p + "self_attn.", c, c.indexer_types[i] == IndexerType::Full);
    }
    if (c.mlp_layer_types[i] == MlpType::Dense) {
      lw.mlp = load_mlp(ld, p + "mlp.", D, c.intermediate_size);
    } else {
      lw.moe = load_moe(ld, p + "mlp.", c);
    }
    w.layers.push_back(std::move(lw));
  }

  if (report) {
    *report = LoadReport{};
    report->loaded_tensors = static_cast<int64_t>(ld.used().size());
    for (const std::string& name : ckpt.names()) {
      if (ld.used().count(name)) continue;
      if (name.rfind("model.visual.", 0) == 0) {
        ++report->vision_tensors;
      } else if (name.find("shared_head.") != std::string::npos) {
        ++report->shared_head_tensors;
      } else if (layer_of(name, prefix) >= c.num_hidden_layers) {
        ++report->mtp_tensors;
      } else {
        report->unexpected.push_back(name);
      }
    }
  }
  return w;
}

}  // namespace nextlm
