// The text model's parameters in fp32, mapped from the hub checkpoint layout (docs: ../shared/docs/glm5_next.md §2).
// Shapes use the letters D hidden, S streams, H linear heads, K linear head dim, W conv width, E experts,
// NH attention heads, IH/ID indexer heads/dim, P kpool, V vocab.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/config.h"

namespace nextlm {

struct HcWeights {
  Tensor fn;     // [(2+S)S, S·D]
  Tensor base;   // [(2+S)S]
  Tensor scale;  // [3]
};

struct KdaWeights {
  Tensor q_proj, k_proj, v_proj;     // [H·K, D]
  Tensor q_conv, k_conv, v_conv;     // [H·K, W] (hub shape [H·K, 1, W])
  Tensor f_a, f_b;                   // [K, D], [H·K, K]
  Tensor dt_bias;                    // [H·K]
  Tensor A_log;                      // [H]
  Tensor b_proj;                     // [H, D]
  Tensor g_a, g_b;                   // [K, D], [H·K, K]
  Tensor o_norm;                     // [K]
  Tensor o_proj;                     // [D, H·K]
};

struct IndexerWeights {
  Tensor wq_b;          // [IH·ID, q_lora]
  Tensor wk;            // [ID, D]
  Tensor k_norm_w;      // [ID]
  Tensor k_norm_b;      // [ID]
  Tensor weights_proj;  // [IH, D]
  Tensor ape;           // [P, ID]
  Tensor gate;          // [ID, D]
};

// The indexer's tensors, named `q` + their checkpoint names (q = "….self_attn.indexer."), through a loader with
// get(name, shape): the whole model's (weights.cpp) or a rank's shard's (dist/parallel_model.cpp, where the indexer
// is replicated: every rank makes the same selection).
template <class Loader>
IndexerWeights load_indexer(Loader& ld, const std::string& q, const ModelConfig& c) {
  const int64_t IH = c.index_n_heads, ID = c.index_head_dim, P = c.index_kpool, QL = c.q_lora_rank,
                D = c.hidden_size;
  return IndexerWeights{ld.get(q + "wq_b.weight", {IH * ID, QL}),
                        ld.get(q + "wk.weight", {ID, D}),
                        ld.get(q + "k_norm.weight", {ID}),
                        ld.get(q + "k_norm.bias", {ID}),
                        ld.get(q + "weights_proj.weight", {IH, D}),
                        ld.get(q + "index_kpool_compress_ape", {P, ID}),
                        ld.get(q + "index_kpool_compress_gate", {ID, D})};
}

struct DsaWeights {
  Tensor q_a;       // [q_lora, D]
  Tensor q_a_norm;  // [q_lora]
  Tensor q_b;       // [NH·dqk, q_lora]
  Tensor kv_a;      // [kv_lora, D]
  Tensor kv_a_norm; // [kv_lora]
  Tensor kv_b;      // [NH·(dqk+dv), kv_lora], per head dqk rows of k then dv rows of v
  Tensor o_proj;    // [D, NH·dv]
  std::optional<IndexerWeights> indexer;  // present on full-indexer layers
};

struct MlpWeights {
  Tensor gate, up;  // [I, D]
  Tensor down;      // [D, I]
};

struct MoeWeights {
  Tensor router;                  // [E, D]
  Tensor correction_bias;         // [E]
  std::vector<MlpWeights> experts;  // E of width moe_intermediate_size
  std::optional<MlpWeights> shared; // width moe_intermediate_size · n_shared_experts; absent when that is 0
};

struct LayerWeights {
  HcWeights hc_attn, hc_ffn;
  Tensor input_norm, post_attention_norm;  // [D]
  std::optional<KdaWeights> kda;           // exactly one of kda / dsa
  std::optional<DsaWeights> dsa;
  std::optional<MlpWeights> mlp;           // exactly one of mlp / moe
  std::optional<MoeWeights> moe;
};

struct ModelWeights {
  Tensor embed;       // [V, D]
  Tensor final_norm;  // [D]
  Tensor lm_head;     // [V, D]; a copy of embed when tie_word_embeddings
  std::vector<LayerWeights> layers;
};

// What the loader found beside the text model.
struct LoadReport {
  int64_t vision_tensors = 0;       // model.visual.*
  int64_t mtp_tensors = 0;          // layers >= num_hidden_layers (the MTP layer)
  int64_t shared_head_tensors = 0;  // *.shared_head.*
  std::vector<std::string> unexpected;  // anything else the text model does not use
  int64_t loaded_tensors = 0;
};

// Maps every text-model tensor. A missing tensor or a wrong shape is an Error naming it.
ModelWeights load_weights(const Checkpoint& ckpt, const ModelConfig& cfg, LoadReport* report = nullptr);

}  // namespace nextlm
