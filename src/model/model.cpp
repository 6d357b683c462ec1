// Whole-model CPU forward (Glm5NextForConditionalGeneration text path, transformers 5.17.0).
#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "cpu/linear.h"
#include "io/safetensors.h"
#include "model/block.h"
#include "model/dsa.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "model/norm.h"

namespace nextlm {

void PackedBatch::add(const std::vector<int32_t>& seq) {
  if (cu_seqlens.empty()) cu_seqlens.push_back(0);
  tokens.insert(tokens.end(), seq.begin(), seq.end());
  cu_seqlens.push_back(static_cast<int64_t>(tokens.size()));
}

void validate_batch(const PackedBatch& b, int64_t V) {
  check(b.cu_seqlens.size() >= 2 && b.cu_seqlens.front() == 0 && b.cu_seqlens.back() == b.num_tokens(),
        "batch: cu_seqlens must start at 0 and end at the token count");
  for (size_t n = 0; n + 1 < b.cu_seqlens.size(); ++n)
    check(b.cu_seqlens[n + 1] > b.cu_seqlens[n], "batch: sequence ", n, " is empty");
  for (int64_t t = 0; t < b.num_tokens(); ++t)
    check(b.tokens[t] >= 0 && b.tokens[t] < V, "token id ", b.tokens[t], " at position ", t,
          " is outside the vocabulary [0, ", V, ")");
}

Model::Model(ModelConfig config, ModelWeights weights) : config_(std::move(config)), weights_(std::move(weights)) {}

Model Model::load(const std::string& dir, LoadReport* report) {
  const std::filesystem::path cfg = std::filesystem::path(dir) / "config.json";
  check(std::filesystem::is_directory(dir), "model directory ", dir, " does not exist");
  check(std::filesystem::exists(cfg), "no config.json in ", dir);
  ModelConfig c = load_config(cfg.string());
  Checkpoint ckpt(dir);
  ModelWeights w = load_weights(ckpt, c, report);
  return Model(std::move(c), std::move(w));
}

Tensor Model::forward_hidden(const PackedBatch& batch, const ForwardOptions& opt) const {
  const ModelConfig& c = config_;
  validate_batch(batch, c.vocab_size);
  const int64_t T = batch.num_tokens();
  return decoder_forward(weights_, c, batch.tokens, [&](int64_t i, const float* a, float* y, Selection& sel) {
    const LayerWeights& lw = weights_.layers[i];
    if (lw.kda) {
      kda_layer_forward(*lw.kda, c, a, T, batch.cu_seqlens, y, opt.kda_form);
    } else {
      dsa_layer_forward(*lw.dsa, c, a, T, batch.cu_seqlens, sel, y, opt.empty_selection);
    }
  });
}

Tensor Model::logits(const Tensor& hidden, int64_t begin, int64_t end) const {
  const int64_t D = config_.hidden_size, V = config_.vocab_size;
  Tensor out({end - begin, V});
  cpu::linear(hidden.ptr() + begin * D, end - begin, D, weights_.lm_head, out.ptr());
  return out;
}

Tensor Model::forward(const PackedBatch& batch, const ForwardOptions& opt) const {
  Tensor h = forward_hidden(batch, opt);
  return logits(h, 0, batch.num_tokens());
}

std::vector<std::vector<double>> Model::next_token_logprobs(const PackedBatch& batch, const ForwardOptions& opt) const {
  return next_token_logprobs(forward_hidden(batch, opt), batch);
}

std::vector<std::vector<double>> Model::next_token_logprobs(const Tensor& h, const PackedBatch& batch) const {
  const int64_t V = config_.vocab_size, T = batch.num_tokens();
  std::vector<std::vector<double>> out(batch.num_seqs());
  std::vector<int64_t> seq_of(T);
  for (int64_t n = 0; n < batch.num_seqs(); ++n)
    for (int64_t t = batch.cu_seqlens[n]; t < batch.cu_seqlens[n + 1]; ++t) seq_of[t] = n;
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 24) / V);  // ~64 MB of logits at a time
  for (int64_t b0 = 0; b0 < T; b0 += block) {
    const int64_t b1 = std::min(T, b0 + block);
    const Tensor lg = logits(h, b0, b1);
    for (int64_t t = b0; t < b1; ++t) {
      const int64_t n = seq_of[t];
      if (t + 1 >= batch.cu_seqlens[n + 1]) continue;  // the last token of a sequence predicts nothing scored
      const float* row = lg.ptr() + (t - b0) * V;
      const float mx = *std::max_element(row, row + V);
      double sum = 0.0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
      out[n].push_back(static_cast<double>(row[batch.tokens[t + 1]]) - mx - std::log(sum));
    }
  }
  return out;
}

namespace {
int64_t count(const Tensor& t) { return t.numel(); }
int64_t count(const MlpWeights& m) { return count(m.gate) + count(m.up) + count(m.down); }
int64_t count(const HcWeights& h) { return count(h.fn) + count(h.base) + count(h.scale); }
int64_t count(const KdaWeights& w) {
  return count(w.q_proj) + count(w.k_proj) + count(w.v_proj) + count(w.q_conv) + count(w.k_conv) + count(w.v_conv) +
         count(w.f_a) + count(w.f_b) + count(w.dt_bias) + count(w.A_log) + count(w.b_proj) + count(w.g_a) +
         count(w.g_b) + count(w.o_norm) + count(w.o_proj);
}
int64_t count(const DsaWeights& w) {
  int64_t n = count(w.q_a) + count(w.q_a_norm) + count(w.q_b) + count(w.kv_a) + count(w.kv_a_norm) + count(w.kv_b) +
              count(w.o_proj);
  if (w.indexer) {
    const IndexerWeights& i = *w.indexer;
    n += count(i.wq_b) + count(i.wk) + count(i.k_norm_w) + count(i.k_norm_b) + count(i.weights_proj) +
         count(i.ape) + count(i.gate);
  }
  return n;
}
// Parameters of one layer, with `experts` routed experts counted.
int64_t count_layer(const LayerWeights& l, int64_t experts) {
  int64_t n = count(l.hc_attn) + count(l.hc_ffn) + count(l.input_norm) + count(l.post_attention_norm);
  n += l.kda ? count(*l.kda) : count(*l.dsa);
  if (l.mlp) n += count(*l.mlp);
  if (l.moe) {
    n += count(l.moe->router) + count(l.moe->correction_bias);
    if (l.moe->shared) n += count(*l.moe->shared);
    if (!l.moe->experts.empty()) n += experts * count(l.moe->experts[0]);
  }
  return n;
}
}  // namespace

int64_t Model::num_parameters() const {
  int64_t n = count(weights_.embed) + count(weights_.final_norm) + (config_.tie_word_embeddings ? 0 : count(weights_.lm_head));
  for (const LayerWeights& l : weights_.layers) n += count_layer(l, config_.n_routed_experts);
  return n;
}

int64_t parameter_count(const ModelConfig& c) {
  const int64_t V = c.vocab_size, D = c.hidden_size, S = c.hc_mult, M = (2 + S) * S;
  const int64_t H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K, W = c.linear_conv_kernel_dim;
  const int64_t NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank, IH = c.index_n_heads, ID = c.index_head_dim;
  const int64_t E = c.n_routed_experts, Im = c.moe_intermediate_size;
  const int64_t kda = 3 * HK * D + 3 * HK * W + K * D + HK * K + HK + H + H * D + K * D + HK * K + K + D * HK;
  const int64_t dsa = QL * D + QL + NH * dqk * QL + KL * D + KL + NH * (dqk + dv) * KL + D * NH * dv;
  const int64_t indexer = IH * ID * QL + ID * D + 2 * ID + IH * D + c.index_kpool * ID + ID * D;
  const int64_t moe = E * D + E + E * 3 * Im * D + (c.n_shared_experts > 0 ? 3 * Im * c.n_shared_experts * D : 0);
  int64_t n = V * D + D + (c.tie_word_embeddings ? 0 : V * D);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    n += 2 * (M * S * D + M + 3) + 2 * D;  // mHC of both sites, the two norms
    if (c.layer_types[i] == LayerType::LinearAttention) {
      n += kda;
    } else {
      n += dsa + (c.indexer_types[i] == IndexerType::Full ? indexer : 0);
    }
    n += c.mlp_layer_types[i] == MlpType::Dense ? 3 * c.intermediate_size * D : moe;
  }
  return n;
}

int64_t Model::num_active_parameters() const {
  // A token runs num_experts_per_tok of the routed experts of each MoE layer; everything else counts whole.
  int64_t n = num_parameters();
  for (const LayerWeights& l : weights_.layers)
    if (l.moe && !l.moe->experts.empty())
      n -= (config_.n_routed_experts - config_.num_experts_per_tok) * count(l.moe->experts[0]);
  return n;
}

}  // namespace nextlm
