// LoRA on the CPU fp32 reference path: targets, PEFT init, W + s·B·A, the adapters' gradients from the full-model
// weight gradients, PEFT files (adapter_model.safetensors + adapter_config.json) and the merged hub checkpoint.
#include "model/lora.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <tuple>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/init.h"

namespace nextlm {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const LoraKindInfo kKinds[kNumLoraKinds] = {
    {"kda", "q_proj", "self_attn.q_proj"},
    {"kda", "k_proj", "self_attn.k_proj"},
    {"kda", "v_proj", "self_attn.v_proj"},
    {"kda", "o_proj", "self_attn.o_proj"},
    {"kda", "f_a_proj", "self_attn.f_a_proj"},
    {"kda", "f_b_proj", "self_attn.f_b_proj"},
    {"kda", "g_a_proj", "self_attn.g_a_proj"},
    {"kda", "g_b_proj", "self_attn.g_b_proj"},
    {"kda", "b_proj", "self_attn.b_proj"},
    {"mla", "q_a_proj", "self_attn.q_a_proj"},
    {"mla", "q_b_proj", "self_attn.q_b_proj"},
    {"mla", "kv_a_proj_with_mqa", "self_attn.kv_a_proj_with_mqa"},
    {"mla", "kv_b_proj", "self_attn.kv_b_proj"},
    {"mla", "o_proj", "self_attn.o_proj"},
    {"mlp", "gate_proj", "mlp.gate_proj"},
    {"mlp", "up_proj", "mlp.up_proj"},
    {"mlp", "down_proj", "mlp.down_proj"},
    {"shared_experts", "gate_proj", "mlp.shared_experts.gate_proj"},
    {"shared_experts", "up_proj", "mlp.shared_experts.up_proj"},
    {"shared_experts", "down_proj", "mlp.shared_experts.down_proj"},
    {"experts", "gate_proj", "mlp.experts.{e}.gate_proj"},
    {"experts", "up_proj", "mlp.experts.{e}.up_proj"},
    {"experts", "down_proj", "mlp.experts.{e}.down_proj"},
};

LoraKind kind_at(int i) { return static_cast<LoraKind>(i); }

// Whether layer `layer` of config c has projection kind k (and expert e for routed-expert kinds).
bool layer_has(const ModelConfig& c, LoraKind k, int64_t layer) {
  const std::string g = lora_kind_info(k).group;
  const bool kda = c.layer_types[layer] == LayerType::LinearAttention;
  const bool dense = c.mlp_layer_types[layer] == MlpType::Dense;
  if (g == "kda") return kda;
  if (g == "mla") return !kda;
  if (g == "mlp") return dense;
  if (g == "shared_experts") return !dense && c.n_shared_experts > 0;
  return !dense;  // experts
}

std::string replace_expert(std::string path, const std::string& e) {
  const size_t p = path.find("{e}");
  if (p != std::string::npos) path.replace(p, 3, e);
  return path;
}

std::string regex_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (std::strchr(".^$|()[]{}*+?\\", ch)) o += '\\';
    o += ch;
  }
  return o;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string o;
  for (size_t i = 0; i < v.size(); ++i) o += (i ? sep : "") + v[i];
  return o;
}

const char* kPeftPrefix = "base_model.model.";

}  // namespace

const LoraKindInfo& lora_kind_info(LoraKind k) { return kKinds[static_cast<int>(k)]; }

bool lora_kind_is_expert(LoraKind k) {
  return k == LoraKind::ExpertGate || k == LoraKind::ExpertUp || k == LoraKind::ExpertDown;
}

std::vector<LoraKind> parse_lora_targets(const std::string& list) {
  std::set<int> out;
  size_t start = 0;
  while (true) {
    const size_t comma = list.find(',', start);
    std::string w = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    while (!w.empty() && w.front() == ' ') w.erase(w.begin());
    while (!w.empty() && w.back() == ' ') w.pop_back();
    bool hit = false;
    for (int i = 0; i < kNumLoraKinds; ++i) {
      const LoraKindInfo& k = kKinds[i];
      if (w == "all" || w == k.group || w == k.leaf || w == std::string(k.group) + "." + k.leaf) {
        out.insert(i);
        hit = true;
      }
    }
    if (!hit)
      fail("LoRA target \"", w, "\" is not known (use all; a group kda, mla, mlp, shared_experts, experts; a ",
           "projection such as q_proj, o_proj, kv_b_proj, gate_proj; or GROUP.PROJECTION such as kda.o_proj)");
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  std::vector<LoraKind> v;
  for (int i : out) v.push_back(kind_at(i));
  return v;
}

json lora_options_json(const LoraOptions& o) {
  return json{{"rank", o.rank},
              {"alpha", o.alpha},
              {"targets", o.targets},
              {"experts", o.experts == LoraExperts::Shared ? "shared" : "per-expert"},
              {"rank_div_topk", o.rank_div_topk}};
}

LoraOptions lora_options_from_json(const json& j) {
  LoraOptions o;
  try {
    o.rank = j.at("rank").get<int64_t>();
    o.alpha = j.at("alpha").get<double>();
    o.targets = j.at("targets").get<std::string>();
    const std::string e = j.at("experts").get<std::string>();
    check(e == "shared" || e == "per-expert", "LoRA experts mode \"", e, "\" is not per-expert or shared");
    o.experts = e == "shared" ? LoraExperts::Shared : LoraExperts::PerExpert;
    o.rank_div_topk = j.at("rank_div_topk").get<bool>();
  } catch (const json::exception& e) {
    fail("LoRA options: ", e.what());
  }
  check(o.rank >= 1 && o.alpha > 0, "LoRA options: rank must be >= 1 and alpha > 0");
  parse_lora_targets(o.targets);
  return o;
}

const Tensor* lora_base_weight(const ModelWeights& w, LoraKind k, int64_t layer, int64_t expert) {
  if (layer < 0 || layer >= static_cast<int64_t>(w.layers.size())) return nullptr;
  const LayerWeights& l = w.layers[layer];
  const KdaWeights* kd = l.kda ? &*l.kda : nullptr;
  const DsaWeights* ds = l.dsa ? &*l.dsa : nullptr;
  const MlpWeights* mlp = l.mlp ? &*l.mlp : nullptr;
  const MlpWeights* sh = l.moe && l.moe->shared ? &*l.moe->shared : nullptr;
  const MlpWeights* ex = l.moe && expert >= 0 && expert < static_cast<int64_t>(l.moe->experts.size())
                             ? &l.moe->experts[expert]
                             : nullptr;
  switch (k) {
    case LoraKind::KdaQ: return kd ? &kd->q_proj : nullptr;
    case LoraKind::KdaK: return kd ? &kd->k_proj : nullptr;
    case LoraKind::KdaV: return kd ? &kd->v_proj : nullptr;
    case LoraKind::KdaO: return kd ? &kd->o_proj : nullptr;
    case LoraKind::KdaFA: return kd ? &kd->f_a : nullptr;
    case LoraKind::KdaFB: return kd ? &kd->f_b : nullptr;
    case LoraKind::KdaGA: return kd ? &kd->g_a : nullptr;
    case LoraKind::KdaGB: return kd ? &kd->g_b : nullptr;
    case LoraKind::KdaB: return kd ? &kd->b_proj : nullptr;
    case LoraKind::MlaQA: return ds ? &ds->q_a : nullptr;
    case LoraKind::MlaQB: return ds ? &ds->q_b : nullptr;
    case LoraKind::MlaKVA: return ds ? &ds->kv_a : nullptr;
    case LoraKind::MlaKVB: return ds ? &ds->kv_b : nullptr;
    case LoraKind::MlaO: return ds ? &ds->o_proj : nullptr;
    case LoraKind::MlpGate: return mlp ? &mlp->gate : nullptr;
    case LoraKind::MlpUp: return mlp ? &mlp->up : nullptr;
    case LoraKind::MlpDown: return mlp ? &mlp->down : nullptr;
    case LoraKind::SharedGate: return sh ? &sh->gate : nullptr;
    case LoraKind::SharedUp: return sh ? &sh->up : nullptr;
    case LoraKind::SharedDown: return sh ? &sh->down : nullptr;
    case LoraKind::ExpertGate: return ex ? &ex->gate : nullptr;
    case LoraKind::ExpertUp: return ex ? &ex->up : nullptr;
    case LoraKind::ExpertDown: return ex ? &ex->down : nullptr;
  }
  return nullptr;
}

Tensor* lora_base_weight(ModelWeights& w, LoraKind k, int64_t layer, int64_t expert) {
  return const_cast<Tensor*>(lora_base_weight(static_cast<const ModelWeights&>(w), k, layer, expert));
}

void lora_merge(const LoraModule& m, const float* base, float* out) {
  lora_merge_block(m, 0, m.B.dim(0), 0, m.A.dim(1), base, out);
}

void lora_merge_block(const LoraModule& m, int64_t r0, int64_t rows, int64_t c0, int64_t cols, const float* base,
                      float* out) {
  const int64_t I = m.A.dim(1), r = m.rank;
  const float s = static_cast<float>(m.scale);
  const float* A = m.A.ptr();
  const float* B = m.B.ptr();
  // Row o of B·A, accumulated over k in order, then scaled and added: PEFT's W + (B @ A)·s.
#pragma omp parallel
  {
    std::vector<float> row(cols);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < rows; ++o) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t k = 0; k < r; ++k) {
        const float b = B[(r0 + o) * r + k];
        const float* a = A + k * I + c0;
        for (int64_t i = 0; i < cols; ++i) row[i] += b * a[i];
      }
      for (int64_t i = 0; i < cols; ++i) out[o * cols + i] = base[o * cols + i] + s * row[i];
    }
  }
}

void lora_block_backward(LoraModule& m, int64_t r0, int64_t rows, int64_t c0, int64_t cols, const float* G) {
  const int64_t I = m.A.dim(1), r = m.rank;
  const float s = static_cast<float>(m.scale);
  const float* A = m.A.ptr();
  const float* B = m.B.ptr();
  float* dA = m.dA.ptr();
  float* dB = m.dB.ptr();
  // dB[r0 + o, k] += s·Σ_i G[o, i]·A[k, c0 + i]
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t k = 0; k < r; ++k) {
      double acc = 0.0;
      for (int64_t i = 0; i < cols; ++i) acc += static_cast<double>(G[o * cols + i]) * A[k * I + c0 + i];
      dB[(r0 + o) * r + k] += s * static_cast<float>(acc);
    }
  // dA[k, c0 + i] += s·Σ_o B[r0 + o, k]·G[o, i]
#pragma omp parallel
  {
    std::vector<double> acc(cols);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < r; ++k) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t o = 0; o < rows; ++o) {
        const double b = B[(r0 + o) * r + k];
        for (int64_t i = 0; i < cols; ++i) acc[i] += b * G[o * cols + i];
      }
      for (int64_t i = 0; i < cols; ++i) dA[k * I + c0 + i] += s * static_cast<float>(acc[i]);
    }
  }
}

std::array<int64_t, 2> lora_kind_shape(const ModelConfig& c, LoraKind k) {
  const int64_t D = c.hidden_size, HK = c.linear_num_heads * c.linear_head_dim, K = c.linear_head_dim;
  const int64_t H = c.linear_num_heads, NH = c.num_attention_heads, QL = c.q_lora_rank, KL = c.kv_lora_rank;
  const int64_t dqk = c.qk_nope_head_dim, dv = c.v_head_dim, I = c.intermediate_size, Im = c.moe_intermediate_size;
  const int64_t Is = Im * c.n_shared_experts;
  switch (k) {
    case LoraKind::KdaQ: case LoraKind::KdaK: case LoraKind::KdaV: return {HK, D};
    case LoraKind::KdaO: return {D, HK};
    case LoraKind::KdaFA: case LoraKind::KdaGA: return {K, D};
    case LoraKind::KdaFB: case LoraKind::KdaGB: return {HK, K};
    case LoraKind::KdaB: return {H, D};
    case LoraKind::MlaQA: return {QL, D};
    case LoraKind::MlaQB: return {NH * dqk, QL};
    case LoraKind::MlaKVA: return {KL, D};
    case LoraKind::MlaKVB: return {NH * (dqk + dv), KL};
    case LoraKind::MlaO: return {D, NH * dv};
    case LoraKind::MlpGate: case LoraKind::MlpUp: return {I, D};
    case LoraKind::MlpDown: return {D, I};
    case LoraKind::SharedGate: case LoraKind::SharedUp: return {Is, D};
    case LoraKind::SharedDown: return {D, Is};
    case LoraKind::ExpertGate: case LoraKind::ExpertUp: return {Im, D};
    case LoraKind::ExpertDown: return {D, Im};
  }
  return {0, 0};
}

int64_t lora_max_rank(const ModelConfig& c, const LoraOptions& o) {
  int64_t most = 0;
  for (LoraKind k : parse_lora_targets(o.targets)) {
    bool present = false;
    for (int64_t l = 0; l < c.num_hidden_layers && !present; ++l) present = layer_has(c, k, l);
    if (!present) continue;
    const auto [out, in] = lora_kind_shape(c, k);
    most = std::max(most, std::min(out, in));
  }
  return most;
}

LoraAdapter::LoraAdapter(const ModelConfig& c, const LoraOptions& o, uint64_t seed)
    : config_(c), options_(o), from_options_(true) {
  check(o.rank >= 1, "LoRA rank must be >= 1, got ", o.rank);
  check(o.alpha > 0 && std::isfinite(o.alpha), "LoRA alpha must be > 0, got ", o.alpha);
  const std::vector<LoraKind> kinds = parse_lora_targets(o.targets);
  const int64_t expert_rank = o.rank_div_topk ? std::max<int64_t>(1, o.rank / c.num_experts_per_tok) : o.rank;
  Rng rng(seed * 0xd1b54a32d192ed03ULL + 0x4c6f5241ULL);  // "LoRA": apart from the init's and the data's streams
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (LoraKind k : kinds) {
      if (!layer_has(c, k, l)) continue;
      const bool ex = lora_kind_is_expert(k);
      const int64_t n = ex && o.experts == LoraExperts::PerExpert ? c.n_routed_experts : 1;
      for (int64_t e = 0; e < n; ++e) {
        LoraModule m;
        m.kind = k;
        m.layer = l;
        m.expert = ex && o.experts == LoraExperts::PerExpert ? e : LoraModule::kAllExperts;
        m.rank = ex ? expert_rank : o.rank;
        m.scale = o.alpha / static_cast<double>(m.rank);
        modules_.push_back(std::move(m));
      }
    }
  }
  check(!modules_.empty(), "LoRA targets \"", o.targets, "\" select no projection of this model");
  // Checked before any adapter is allocated: a mistyped rank would otherwise fill the memory first.
  const int64_t most = lora_max_rank(c, o);
  check(o.rank <= most, "LoRA rank ", o.rank, " is more than the full rank of every projection it would adapt (", most,
        " at the most: the smaller of a projection's widths)");
  for (LoraModule& m : modules_) {
    const auto [out, in] = lora_kind_shape(c, m.kind);
    // PEFT: nn.init.kaiming_uniform_(lora_A, a=√5): gain √(2/(1+5)), bound gain·√(3/fan_in) = 1/√in. B = 0.
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    m.A = Tensor({m.rank, in});
    for (float& x : m.A.data) x = static_cast<float>(rng.uniform(-bound, bound));
    m.B = Tensor({out, m.rank}, 0.0f);
    m.dA = Tensor(m.A.shape, 0.0f);
    m.dB = Tensor(m.B.shape, 0.0f);
  }
}

std::string LoraAdapter::module_path(const LoraModule& m, int64_t e, const std::string& prefix) const {
  const int64_t ex = m.expert == LoraModule::kAllExperts ? e : m.expert;
  return prefix + "layers." + std::to_string(m.layer) + "." +
         replace_expert(lora_kind_info(m.kind).path, ex < 0 ? "*" : std::to_string(ex));
}

namespace {

// The experts a module covers: {expert}, all E of a shared module, or {-1} for a non-expert kind.
std::vector<int64_t> covered(const LoraModule& m, int64_t E) {
  if (!lora_kind_is_expert(m.kind)) return {-1};
  if (m.expert != LoraModule::kAllExperts) return {m.expert};
  std::vector<int64_t> v(E);
  for (int64_t e = 0; e < E; ++e) v[e] = e;
  return v;
}

}  // namespace

std::vector<Tensor> LoraAdapter::capture(const ModelWeights& w) const {
  std::vector<Tensor> out;
  for (const LoraModule& m : modules_)
    for (int64_t e : covered(m, config_.n_routed_experts)) {
      const Tensor* t = lora_base_weight(w, m.kind, m.layer, e);
      check(t != nullptr, "LoRA module ", module_path(m, e, ""), " has no weight in this model");
      check(t->shape == std::vector<int64_t>{m.B.dim(0), m.A.dim(1)}, "LoRA module ", module_path(m, e, ""),
            ": adapter is for a ", shape_str(std::vector<int64_t>{m.B.dim(0), m.A.dim(1)}), " weight, the model's is ",
            shape_str(t->shape));
      out.push_back(*t);
    }
  return out;
}

void LoraAdapter::check_base_shapes(const std::map<std::string, std::vector<int64_t>>& shapes,
                                    const std::string& prefix) const {
  for (const LoraModule& m : modules_)
    for (int64_t e : covered(m, config_.n_routed_experts)) {
      const std::string name = module_path(m, e, prefix) + ".weight";
      const std::vector<int64_t> want{m.B.dim(0), m.A.dim(1)};
      const auto it = shapes.find(name);
      check(it != shapes.end(), "LoRA module ", module_path(m, e, ""), " has no weight ", name, " in the base");
      check(it->second == want, "LoRA module ", module_path(m, e, ""), ": adapter is for a ", shape_str(want),
            " weight, the base's ", name, " is ", shape_str(it->second));
    }
}

void LoraAdapter::apply(const std::vector<Tensor>& base, ModelWeights& w) const {
  size_t j = 0;
  for (const LoraModule& m : modules_)
    for (int64_t e : covered(m, config_.n_routed_experts)) {
      check(j < base.size(), "LoRA: base weights do not match the adapter");
      Tensor* t = lora_base_weight(w, m.kind, m.layer, e);
      check(t != nullptr && t->shape == base[j].shape, "LoRA: base weights do not match the adapter");
      lora_merge(m, base[j].ptr(), t->ptr());
      ++j;
    }
  check(j == base.size(), "LoRA: base weights do not match the adapter");
}

void LoraAdapter::backward(const ModelWeights& dW) {
  for (LoraModule& m : modules_) {
    const int64_t O = m.B.dim(0), I = m.A.dim(1);
    // G = Σ over the covered experts of dW (one term unless shared).
    std::vector<float> sum;
    const float* G = nullptr;
    const std::vector<int64_t> es = covered(m, config_.n_routed_experts);
    for (int64_t e : es) {
      const Tensor* g = lora_base_weight(dW, m.kind, m.layer, e);
      check(g != nullptr && g->numel() == O * I, "LoRA backward: no gradient for ", module_path(m, e, ""));
      if (es.size() == 1) {
        G = g->ptr();
      } else {
        if (sum.empty()) sum.assign(O * I, 0.0f);
        for (int64_t i = 0; i < O * I; ++i) sum[i] += g->data[i];
        G = sum.data();
      }
    }
    lora_block_backward(m, 0, O, 0, I, G);
  }
}

std::vector<ParamRef> LoraAdapter::params(const std::string& prefix) {
  std::vector<ParamRef> out;
  for (LoraModule& m : modules_) {
    const std::string p = kPeftPrefix + module_path(m, -1, prefix);
    for (auto [name, w, g] : {std::tuple{".lora_A.weight", &m.A, &m.dA}, std::tuple{".lora_B.weight", &m.B, &m.dB}}) {
      ParamRef r;
      r.name = p + name;
      r.shape = w->shape;
      r.w = w->ptr();
      r.g = g->ptr();
      r.n = w->numel();
      r.decay = true;
      out.push_back(std::move(r));
    }
  }
  return out;
}

int64_t LoraAdapter::num_parameters() const {
  int64_t n = 0;
  for (const LoraModule& m : modules_) n += m.A.numel() + m.B.numel();
  return n;
}

void LoraAdapter::save_peft(const std::string& dir, const std::string& base_model_name,
                            const std::string& prefix) const {
  const int64_t E = config_.n_routed_experts;
  std::vector<TensorToWrite> ts;
  // target_modules as a regex that PEFT full-matches against module names: one alternative per projection path,
  // with the layers it is on (KDA and MLA layers both have an o_proj, so a plain list of names would over-match).
  std::map<std::string, std::set<int64_t>> layers_of;     // path pattern below layers.{i}. → layers
  std::map<std::pair<int, int64_t>, std::set<int64_t>> experts_of;  // (kind, layer) → experts
  for (const LoraModule& m : modules_) {
    for (int64_t e : covered(m, E)) {
      const std::string p = kPeftPrefix + module_path(m, e, prefix);
      ts.push_back({p + ".lora_A.weight", DType::F32, m.A.shape, m.A.ptr()});
      ts.push_back({p + ".lora_B.weight", DType::F32, m.B.shape, m.B.ptr()});
      if (e >= 0) experts_of[{static_cast<int>(m.kind), m.layer}].insert(e);
    }
    if (!lora_kind_is_expert(m.kind)) layers_of[regex_escape(lora_kind_info(m.kind).path)].insert(m.layer);
  }
  for (const auto& [kl, es] : experts_of) {
    std::vector<std::string> ev;
    for (int64_t e : es) ev.push_back(std::to_string(e));
    const std::string ex = static_cast<int64_t>(es.size()) == E ? "\\d+" : "(?:" + join(ev, "|") + ")";
    std::string pat = regex_escape(lora_kind_info(kind_at(kl.first)).path);
    pat.replace(pat.find("\\{e\\}"), 5, ex);
    layers_of[pat].insert(kl.second);
  }
  std::vector<std::string> alts;
  for (const auto& [pat, ls] : layers_of) {
    std::vector<std::string> lv;
    for (int64_t l : ls) lv.push_back(std::to_string(l));
    alts.push_back("(?:.*\\.)?layers\\.(?:" + join(lv, "|") + ")\\." + pat);
  }
  json rank_pattern = json::object();
  for (const LoraModule& m : modules_)
    if (m.rank != options_.rank && lora_kind_is_expert(m.kind))
      rank_pattern["mlp\\.experts\\.\\d+\\." + std::string(lora_kind_info(m.kind).leaf)] = m.rank;
  const int64_t r = from_options_ ? options_.rank : (modules_.empty() ? 0 : modules_.front().rank);
  const double alpha = from_options_ ? options_.alpha : (modules_.empty() ? 0 : modules_.front().scale * r);
  const json cfg{{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"base_model_name_or_path", base_model_name},
                 {"r", r},
                 {"lora_alpha", alpha},
                 {"target_modules", "(?:" + join(alts, "|") + ")"},
                 {"rank_pattern", rank_pattern},
                 {"alpha_pattern", json::object()},
                 {"lora_dropout", 0.0},
                 {"bias", "none"},
                 {"fan_in_fan_out", false},
                 {"use_rslora", false},
                 {"use_dora", false},
                 {"init_lora_weights", true},
                 {"inference_mode", true},
                 {"modules_to_save", nullptr},
                 {"layers_to_transform", nullptr},
                 {"revision", nullptr}};
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), ts,
                    {{"format", "pt"}, {"producer", "nextlm train (LoRA)"}});
  AtomicFile f((fs::path(dir) / "adapter_config.json").string());
  f.write(cfg.dump(2) + "\n");
  f.commit();
}

namespace {

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  check(in.good(), "cannot read ", path);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  check(!j.is_discarded() && j.is_object(), path, ": not a JSON object");
  return j;
}

// A module path below the text prefix → (kind, layer, expert), for config c. False when it is not a projection
// LoRA supports.
bool parse_module_path(const ModelConfig& c, const std::string& path, LoraKind& kind, int64_t& layer,
                       int64_t& expert) {
  std::string rest;
  for (const char* p : {"model.language_model.layers.", "model.layers."})
    if (path.rfind(p, 0) == 0) rest = path.substr(std::strlen(p));
  if (rest.empty()) return false;
  const size_t dot = rest.find('.');
  if (dot == std::string::npos || dot == 0 || rest.find_first_not_of("0123456789") != dot) return false;
  layer = std::stoll(rest.substr(0, dot));
  if (layer >= c.num_hidden_layers) return false;
  rest = rest.substr(dot + 1);
  for (int i = 0; i < kNumLoraKinds; ++i) {
    const LoraKind k = kind_at(i);
    if (!layer_has(c, k, layer)) continue;
    const std::string p = lora_kind_info(k).path;
    if (!lora_kind_is_expert(k)) {
      if (rest == p) {
        kind = k, expert = -1;
        return true;
      }
      continue;
    }
    const std::string head = p.substr(0, p.find("{e}")), tail = p.substr(p.find("{e}") + 3);
    if (rest.size() > head.size() + tail.size() && rest.rfind(head, 0) == 0 &&
        rest.compare(rest.size() - tail.size(), tail.size(), tail) == 0) {
      const std::string num = rest.substr(head.size(), rest.size() - head.size() - tail.size());
      if (num.find_first_not_of("0123456789") != std::string::npos || num.size() > 9) return false;
      expert = std::stoll(num);
      if (expert >= c.n_routed_experts) return false;
      kind = k;
      return true;
    }
  }
  return false;
}

}  // namespace

LoraAdapter LoraAdapter::load_peft(const std::string& dir, const ModelConfig& c) {
  const std::string cfg_path = (fs::path(dir) / "adapter_config.json").string();
  std::error_code ec;
  check(fs::is_directory(dir, ec), "adapter directory ", dir, " does not exist");
  check(fs::exists(cfg_path, ec), "no adapter_config.json in ", dir, " (not a LoRA adapter)");
  const json j = read_json_file(cfg_path);
  double alpha = 0.0;
  bool rslora = false;
  json alpha_pattern = json::object();
  try {
    check(j.value("peft_type", std::string("LORA")) == "LORA", cfg_path, ": peft_type is ", j.at("peft_type").dump(),
          ", only LORA is supported");
    alpha = j.at("lora_alpha").get<double>();
    rslora = j.contains("use_rslora") && j.at("use_rslora").is_boolean() && j.at("use_rslora").get<bool>();
    check(!(j.contains("use_dora") && j.at("use_dora").is_boolean() && j.at("use_dora").get<bool>()), cfg_path,
          ": DoRA adapters are not supported");
    check(!j.contains("bias") || j.at("bias").is_null() || j.at("bias") == "none", cfg_path,
          ": LoRA biases (bias != \"none\") are not supported");
    if (j.contains("alpha_pattern") && j.at("alpha_pattern").is_object()) alpha_pattern = j.at("alpha_pattern");
  } catch (const json::exception& e) {
    fail(cfg_path, ": ", e.what());
  }
  check(alpha > 0 && std::isfinite(alpha), cfg_path, ": lora_alpha must be > 0");
  const SafetensorsFile f((fs::path(dir) / "adapter_model.safetensors").string());
  struct Pair {
    const TensorView* A = nullptr;
    const TensorView* B = nullptr;
  };
  std::map<std::string, Pair> pairs;
  for (const TensorView& t : f.buffer().tensors()) {
    const std::string& n = t.name;
    const std::string pre = kPeftPrefix;
    bool is_a = false, is_b = false;
    for (const char* suf : {".lora_A.weight", ".lora_B.weight"}) {
      const size_t L = std::strlen(suf);
      if (n.size() > pre.size() + L && n.rfind(pre, 0) == 0 && n.compare(n.size() - L, L, suf) == 0)
        (suf[6] == 'A' ? is_a : is_b) = true;
    }
    check(is_a || is_b, f.path(), ": tensor ", n, " is not base_model.model.<module>.lora_{A,B}.weight");
    const std::string path = n.substr(pre.size(), n.size() - pre.size() - std::strlen(".lora_A.weight"));
    (is_a ? pairs[path].A : pairs[path].B) = &t;
  }
  check(!pairs.empty(), f.path(), ": no LoRA tensors");
  LoraAdapter ad;
  ad.config_ = c;
  for (const auto& [path, p] : pairs) {
    check(p.A && p.B, f.path(), ": module ", path, " has only one of lora_A and lora_B");
    LoraModule m;
    check(parse_module_path(c, path, m.kind, m.layer, m.expert), f.path(), ": module ", path,
          " is not a projection LoRA supports in this model");
    check(p.A->shape.size() == 2 && p.B->shape.size() == 2 && p.A->shape[0] == p.B->shape[1] && p.A->shape[0] >= 1,
          f.path(), ": module ", path, ": lora_A ", shape_str(p.A->shape), " and lora_B ", shape_str(p.B->shape),
          " are not [r, in] and [out, r]");
    m.rank = p.A->shape[0];
    double a = alpha;
    for (const auto& [key, val] : alpha_pattern.items()) {
      // PEFT's get_pattern_key: the key matches a suffix of the module name at a dot.
      if (val.is_number() && std::regex_match(path, std::regex("(?:.*\\.)?(?:" + key + ")"))) {
        a = val.get<double>();
        break;
      }
    }
    m.scale = rslora ? a / std::sqrt(static_cast<double>(m.rank)) : a / static_cast<double>(m.rank);
    m.A = Tensor(p.A->shape);
    m.A.data = to_f32(*p.A);
    m.B = Tensor(p.B->shape);
    m.B.data = to_f32(*p.B);
    m.dA = Tensor(m.A.shape, 0.0f);
    m.dB = Tensor(m.B.shape, 0.0f);
    ad.modules_.push_back(std::move(m));
  }
  std::sort(ad.modules_.begin(), ad.modules_.end(), [](const LoraModule& x, const LoraModule& y) {
    return std::tuple(x.layer, static_cast<int>(x.kind), x.expert) < std::tuple(y.layer, static_cast<int>(y.kind), y.expert);
  });
  return ad;
}

void LoraAdapter::load_values(const std::string& dir, const std::string& prefix) {
  const SafetensorsFile f((fs::path(dir) / "adapter_model.safetensors").string());
  for (LoraModule& m : modules_) {
    const std::vector<int64_t> es = covered(m, config_.n_routed_experts);
    for (auto [suffix, t] : {std::pair{".lora_A.weight", &m.A}, std::pair{".lora_B.weight", &m.B}}) {
      for (size_t i = 0; i < es.size(); ++i) {
        const std::string name = kPeftPrefix + module_path(m, es[i], prefix) + suffix;
        const TensorView* v = f.buffer().find(name);
        check(v && v->shape == t->shape && v->dtype == DType::F32, f.path(), ": missing or mis-shaped ", name);
        std::vector<float> x = to_f32(*v);
        if (i == 0) {
          std::copy(x.begin(), x.end(), t->data.begin());  // in place: optimizer parameters point into it
        } else {
          check(std::memcmp(x.data(), t->data.data(), x.size() * sizeof(float)) == 0, f.path(), ": ", name,
                " differs from expert 0's copy of the shared adapter");
        }
      }
    }
  }
}

Model load_model_with_adapter(const std::string& dir, const std::string& adapter_dir) {
  Model model = Model::load(dir);
  if (adapter_dir.empty()) return model;
  const LoraAdapter ad = LoraAdapter::load_peft(adapter_dir, model.config());
  ad.apply(ad.capture(model.weights()), model.mutable_weights());
  return model;
}

int64_t merge_adapter_checkpoint(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
                                 bool all_f32) {
  std::error_code ec;
  check(fs::is_directory(base_dir, ec), "model directory ", base_dir, " does not exist");
  check(!fs::exists(out_dir, ec), "--out ", out_dir, " already exists (merge writes a new directory)");
  fs::path parent = fs::absolute(out_dir, ec).parent_path();
  check(fs::is_directory(parent, ec), "--out ", out_dir, ": directory ", parent.string(), " does not exist");
  const ModelConfig c = load_config((fs::path(base_dir) / "config.json").string());
  const LoraAdapter ad = LoraAdapter::load_peft(adapter_dir, c);

  // The shard files of the base, and its text prefix.
  const fs::path index_path = fs::path(base_dir) / "model.safetensors.index.json";
  std::vector<std::string> shards;
  json index;
  if (fs::exists(index_path, ec)) {
    index = read_json_file(index_path.string());
    check(index.contains("weight_map") && index.at("weight_map").is_object(), index_path.string(), ": no weight_map");
    std::set<std::string> s;
    for (const auto& [name, file] : index.at("weight_map").items()) s.insert(file.get<std::string>());
    shards.assign(s.begin(), s.end());
  } else {
    shards = {"model.safetensors"};
  }
  std::string prefix = "model.language_model.";
  {
    const Checkpoint ck(base_dir);
    if (!ck.find(prefix + "embed_tokens.weight") && ck.find("model.embed_tokens.weight")) prefix = "model.";
  }
  // Checkpoint name → (module, expert).
  std::map<std::string, const LoraModule*> target;
  for (const LoraModule& m : ad.modules())
    for (int64_t e : covered(m, c.n_routed_experts)) target[ad.module_path(m, e, prefix) + ".weight"] = &m;
  std::set<std::string> done;

  const std::string tmp = out_dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  check(fs::create_directories(tmp, ec) && !ec, "cannot create ", tmp, ": ", ec.message());
  try {
    int64_t total_size = 0;
    for (const std::string& shard : shards) {
      const SafetensorsFile f((fs::path(base_dir) / shard).string());
      std::deque<std::vector<float>> f32s;
      std::deque<std::vector<uint16_t>> bf16s;
      std::vector<TensorToWrite> ts;
      for (const TensorView& t : f.buffer().tensors()) {
        const bool floating = t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16 ||
                              t.dtype == DType::F64;
        const auto it = target.find(t.name);
        if (it != target.end()) {
          const LoraModule& m = *it->second;
          check(t.shape == std::vector<int64_t>{m.B.dim(0), m.A.dim(1)}, "adapter module for ", t.name, " is for a ",
                shape_str(std::vector<int64_t>{m.B.dim(0), m.A.dim(1)}), " weight, the base's is ", shape_str(t.shape));
          check(all_f32 || t.dtype == DType::F32 || t.dtype == DType::BF16, t.name, ": merging into a ",
                dtype_name(t.dtype), " weight is not supported (F32 or BF16; or write f32 with --dtype f32)");
          std::vector<float>& w = f32s.emplace_back(to_f32(t));
          lora_merge(m, w.data(), w.data());
          done.insert(t.name);
          if (t.dtype == DType::BF16 && !all_f32) {
            std::vector<uint16_t>& b = bf16s.emplace_back(w.size());
            for (size_t i = 0; i < w.size(); ++i) b[i] = f32_to_bf16(w[i]);
            ts.push_back({t.name, DType::BF16, t.shape, b.data()});
          } else {
            ts.push_back({t.name, DType::F32, t.shape, w.data()});
          }
        } else if (all_f32 && floating && t.dtype != DType::F32) {
          const std::vector<float>& w = f32s.emplace_back(to_f32(t));
          ts.push_back({t.name, DType::F32, t.shape, w.data()});
        } else {
          ts.push_back({t.name, t.dtype, t.shape, t.data});
        }
        total_size += static_cast<int64_t>(Tensor::count(ts.back().shape) * dtype_size(ts.back().dtype));
      }
      std::map<std::string, std::string> meta = f.buffer().metadata();
      if (!meta.count("format")) meta["format"] = "pt";
      write_safetensors((fs::path(tmp) / shard).string(), ts, meta);
    }
    for (const auto& [name, m] : target)
      check(done.count(name), "adapter module ", name.substr(0, name.size() - 7), " has no weight in ", base_dir);
    if (!index.is_null()) {
      if (!index.contains("metadata") || !index.at("metadata").is_object()) index["metadata"] = json::object();
      index["metadata"]["total_size"] = total_size;
      AtomicFile fi((fs::path(tmp) / "model.safetensors.index.json").string());
      fi.write(index.dump(2) + "\n");
      fi.commit();
    }
    // config.json and every other file of the base (tokenizer, generation config, ...).
    const std::set<std::string> written(shards.begin(), shards.end());
    for (const fs::directory_entry& de : fs::directory_iterator(base_dir)) {
      const std::string name = de.path().filename().string();
      if (!de.is_regular_file() || written.count(name) || name == "model.safetensors.index.json") continue;
      fs::copy_file(de.path(), fs::path(tmp) / name);
    }
    if (std::rename(tmp.c_str(), out_dir.c_str()) != 0) fail("cannot rename ", tmp, " to ", out_dir, ": ", std::strerror(errno));
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return static_cast<int64_t>(done.size());
}

}  // namespace nextlm
