// LoRA adapters on the CPU fp32 reference path: W_eff = W + s·B·A on chosen projections (PEFT's LoraLayer, no
// dropout, no bias), their exact gradients from the explicit backward, PEFT-format files, and merging into a hub
// checkpoint.
//
// The gradient. The forward runs with the merged weights W_eff in the model (so every existing forward and backward
// is used unchanged), model_forward_backward gives dW = ∂L/∂W_eff, and since W_eff is linear in A and B:
//   ∂L/∂B = s·dW·Aᵀ   ∂L/∂A = s·Bᵀ·dW
// That is the exact gradient of the adapted model, not an approximation (tests/test_lora.cpp checks it against
// finite differences). It costs a full-model weight-gradient pass, which the CPU reference accepts for simplicity; a
// fast path would compute dA and dB from the layer inputs and output gradients instead.
//
// The files. PEFT's names use the hub checkpoint's module paths (base_model.model.<path>.lora_{A,B}.weight), as the
// merge does. transformers 5.17.0's module tree equals them except for f_a_proj/f_b_proj (it nests them in
// self_attn.forget_gate) and the routed experts (fused 3-D parameters mlp.experts.gate_up_proj / down_proj there),
// so PEFT can attach the other adapters directly; `nextlm merge` serves them all.
//
// Letters: r rank, in/out the projection's input and output widths, E routed experts.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "model/config.h"
#include "model/model.h"
#include "model/optim.h"
#include "model/weights.h"

namespace nextlm {

// The projections an adapter can sit on. The group and leaf names are those of lora_kind_info.
enum class LoraKind {
  KdaQ, KdaK, KdaV, KdaO, KdaFA, KdaFB, KdaGA, KdaGB, KdaB,  // KDA layers, self_attn.*
  MlaQA, MlaQB, MlaKVA, MlaKVB, MlaO,                      // DSA (MLA) layers, self_attn.*
  MlpGate, MlpUp, MlpDown,                                 // dense MLP layers, mlp.*
  SharedGate, SharedUp, SharedDown,                        // MoE layers, mlp.shared_experts.*
  ExpertGate, ExpertUp, ExpertDown,                        // MoE layers, mlp.experts.{e}.*
};
constexpr int kNumLoraKinds = 23;

struct LoraKindInfo {
  const char* group;  // kda, mla, mlp, shared_experts, experts
  const char* leaf;   // the module's own name: q_proj, kv_b_proj, gate_proj, ...
  const char* path;   // below layers.{i}.: "self_attn.q_proj", "mlp.experts.{e}.gate_proj" ({e} = the expert)
};
const LoraKindInfo& lora_kind_info(LoraKind k);
bool lora_kind_is_expert(LoraKind k);

// Parses --lora-targets: a comma-separated list of
//   all                                    every kind
//   kda | mla | mlp | shared_experts | experts    every projection of that group
//   GROUP.LEAF  (kda.o_proj, experts.down_proj)   one kind
//   LEAF        (o_proj, gate_proj)               that projection wherever it occurs (PEFT's suffix rule)
// An unknown word is an Error naming it and listing the valid ones. The result is sorted and unique.
std::vector<LoraKind> parse_lora_targets(const std::string& list);

enum class LoraExperts {
  PerExpert,  // one adapter per routed expert
  Shared,     // one adapter per layer and projection, shared by all routed experts of the layer
};

struct LoraOptions {
  int64_t rank = 8;
  double alpha = 8.0;                   // scale s = alpha / rank of each module (PEFT's lora_alpha / r)
  std::string targets = "all";          // parse_lora_targets' syntax
  LoraExperts experts = LoraExperts::PerExpert;
  bool rank_div_topk = false;           // routed-expert adapters get rank max(1, rank / num_experts_per_tok)
};

nlohmann::json lora_options_json(const LoraOptions& o);
LoraOptions lora_options_from_json(const nlohmann::json& j);  // throws Error on a bad value

// The [out, in] widths of a kind's weight in a model of this config (the hub layout's shapes, weights.h).
std::array<int64_t, 2> lora_kind_shape(const ModelConfig& c, LoraKind k);
// The largest rank an adapter of these options can use to any end: the largest min(out, in) over the projections
// its targets select in this model (0 when they select none). LoraAdapter refuses a larger rank, which would only
// take memory.
int64_t lora_max_rank(const ModelConfig& c, const LoraOptions& o);

// One adapter: A [r, in], B [out, r] and their gradients, on one projection of one layer; for a routed-expert
// kind, on one expert or (expert == kAllExperts) on every expert of the layer with the same A and B.
struct LoraModule {
  static constexpr int64_t kAllExperts = -1;
  LoraKind kind;
  int64_t layer = 0;
  int64_t expert = kAllExperts;  // routed-expert kinds only
  int64_t rank = 0;
  double scale = 1.0;            // s
  Tensor A, B;                   // [r, in], [out, r]
  Tensor dA, dB;                 // same shapes; backward() accumulates into them
};

// The base weight an adapter's kind, layer and expert name; null when the layer has no such projection.
Tensor* lora_base_weight(ModelWeights& w, LoraKind k, int64_t layer, int64_t expert);
const Tensor* lora_base_weight(const ModelWeights& w, LoraKind k, int64_t layer, int64_t expert);

// out = base + s·(B·A) for one [out, in] weight (out may be base). The one place the merge is computed, so the
// in-memory adapted model and a merged checkpoint hold the same fp32 values bit for bit.
void lora_merge(const LoraModule& m, const float* base, float* out);
// The same for the block rows [r0, r0 + rows) × columns [c0, c0 + cols) of the weight (base and out [rows, cols]):
// each element's bits are lora_merge's (a tensor-parallel shard's slice, dist/parallel_lora.h).
void lora_merge_block(const LoraModule& m, int64_t r0, int64_t rows, int64_t c0, int64_t cols, const float* base,
                      float* out);
// dB[r0 + o, k] += s·Σ_j G[o, j]·A[k, c0 + j] and dA[k, c0 + j] += s·Σ_o B[r0 + o, k]·G[o, j] for the gradient G
// [rows, cols] of that block (the whole weight: LoraAdapter::backward's products).
void lora_block_backward(LoraModule& m, int64_t r0, int64_t rows, int64_t c0, int64_t cols, const float* G);

class LoraAdapter {
 public:
  // Adapters on every targeted projection of the model: A kaiming-uniform(a = √5) as PEFT's init_lora_weights=True
  // (U(−1/√in, 1/√in)), B zero, from `seed`. Throws Error when the targets select nothing in this model.
  LoraAdapter(const ModelConfig& c, const LoraOptions& o, uint64_t seed);
  // Reads a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for a model with config c: every
  // lora_A/lora_B pair must name a supported projection of this model (the text prefix is either
  // "model.language_model." or "model.") and have matching shapes. Each module's scale is lora_alpha (or its
  // alpha_pattern entry) over its rank (√rank with use_rslora). Modules are per expert (an adapter exported from
  // shared mode comes back as E equal copies, which computes the same).
  static LoraAdapter load_peft(const std::string& dir, const ModelConfig& c);

  // Writes DIR/adapter_model.safetensors (f32) and DIR/adapter_config.json, each atomically; DIR must exist.
  // Names are base_model.model.<prefix>layers.{i}.<path>.lora_{A,B}.weight. A shared expert adapter is written
  // once per expert (every expert's module gets the same A and B, which is lossless and what PEFT can load).
  void save_peft(const std::string& dir, const std::string& base_model_name, const std::string& prefix) const;
  // Replaces A and B with those of a PEFT directory this adapter's save_peft wrote (same options and model):
  // for resuming. A shared module takes expert 0's copy and checks that the others are equal.
  void load_values(const std::string& dir, const std::string& prefix);

  // Copies of the base weights the adapters sit on, in module order (shared modules: E copies); apply() needs them.
  std::vector<Tensor> capture(const ModelWeights& w) const;
  // capture()'s checks against a base that is never loaded: the weight under every module (each expert a shared
  // module covers) is in `shapes`, a checkpoint's tensor shapes by name (<prefix>layers.{i}.<path>.weight), with the
  // adapter's [out, in] shape. Throws Error naming the first that is missing or mis-shaped.
  void check_base_shapes(const std::map<std::string, std::vector<int64_t>>& shapes, const std::string& prefix) const;
  // W_eff = base + s·B·A into every targeted weight of w; `base` from capture().
  void apply(const std::vector<Tensor>& base, ModelWeights& w) const;
  // The adapters' gradients from the full-model weight gradients dW = ∂L/∂W_eff: dA += s·Bᵀ·dW, dB += s·dW·Aᵀ
  // (a shared module sums over its experts' dW).
  void backward(const ModelWeights& dW);

  // A and B of every module as optimizer parameters (the gradients dA, dB), named as in the PEFT file (a shared
  // module with "experts.*" in place of the expert number). All get weight decay.
  std::vector<ParamRef> params(const std::string& prefix);
  int64_t num_parameters() const;

  const std::vector<LoraModule>& modules() const { return modules_; }
  std::vector<LoraModule>& modules() { return modules_; }
  const ModelConfig& config() const { return config_; }

  // The PEFT module path of module m for expert e (its own expert when not shared), e.g.
  // model.language_model.layers.3.mlp.experts.5.up_proj.
  std::string module_path(const LoraModule& m, int64_t e, const std::string& prefix) const;

 private:
  LoraAdapter() = default;
  ModelConfig config_;
  LoraOptions options_;
  bool from_options_ = false;
  std::vector<LoraModule> modules_;
};

// The model of DIR with the adapter of ADAPTER_DIR merged in memory (fp32), for `score --adapter`. An empty
// adapter_dir gives the plain model.
Model load_model_with_adapter(const std::string& dir, const std::string& adapter_dir);

// Writes a full hub checkpoint of base + adapter into out_dir (which must not exist): the base's shard files with
// the same names, tensors and order, targeted weights replaced by lora_merge's result in the base's dtype (bf16
// rounded to nearest even; f32 kept) or, with all_f32, every floating tensor as f32; the index (its total_size
// updated), config.json and every other file of the base directory copied. Built in out_dir.tmp.<pid> and renamed
// into place, so out_dir appears complete or not at all. Returns the number of merged tensors.
int64_t merge_adapter_checkpoint(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
                                 bool all_f32);

}  // namespace nextlm
