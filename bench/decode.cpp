// Decoding benchmarks on the 4-layer full-width slice (bench/slice4/config.json, random device weights):
// `slice4_decode_b1`, `_b16`, `_b64`: milliseconds per decoding step after a 4096-token prompt in each of B slots
// (CudaDecoder: prefill through the forward, then batched one-token steps, logits left on the device).
#include "decode.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda/device_model.h"
#include "model/config.h"
#include "slice4.h"

namespace nextlm::bench {

namespace {

constexpr double kBytesPerMs = 4.14e12 / 1e3;
constexpr int64_t kPrompt = 4096;
constexpr int kWarmup = 3, kSteps = 64;  // the steps cover every row of a KDA chunk once

// Bytes one decoding step must read at least: every weight it touches once in bf16 (the B tokens' distinct experts
// counted as min(E, B·k)), the mHC matrices in fp32, each slot's KDA states (read and written, fp32) and its
// selected latents (bf16).
double step_floor_ms(const ModelConfig& c, int64_t B, int64_t len) {
  const double D = c.hidden_size, S = c.hc_mult, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
  const double QL = c.q_lora_rank, KL = c.kv_lora_rank, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim,
               dv = c.v_head_dim, IH = c.index_n_heads, ID = c.index_head_dim, Im = c.moe_intermediate_size;
  double w = 2.0 * c.vocab_size * D;  // lm_head
  double act = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    w += 2 * 4.0 * (2 + S) * S * S * D;  // two mHC sites, fp32
    if (c.layer_types[i] == LayerType::LinearAttention) {
      w += 2.0 * (3 * HK * D + 2 * K * D + 2 * HK * K + H * D + D * HK);
      act += B * 2.0 * H * K * K * 4;
    } else {
      w += 2.0 * (QL * D + NH * dqk * QL + KL * D + NH * (dqk + dv) * KL + D * NH * dv);
      if (c.indexer_types[i] == IndexerType::Full) w += 2.0 * (IH * ID * QL + 2 * ID * D + IH * D);
      act += B * 2.0 * KL * std::min<double>(len, c.index_topk + c.index_kpool);
    }
    if (c.mlp_layer_types[i] == MlpType::Sparse) {
      const double experts = std::min<double>(c.n_routed_experts, double(B) * c.num_experts_per_tok);
      w += 2.0 * (c.n_routed_experts * D + (experts + c.n_shared_experts) * 3 * Im * D);
    } else {
      w += 2.0 * 3 * c.intermediate_size * D;
    }
  }
  return (w + act) / kBytesPerMs;
}

}  // namespace

void slice4_decode_case(const std::string& name, int64_t B) {
  const std::string path = slice4_config_path();
  const ModelConfig cfg = load_config(path);
  auto model = CudaModel::random(cfg, 1);
  CudaDecoder dec(*model, B, kPrompt + kWarmup + kSteps + 2);
  std::mt19937 gen(11);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  // Prompts go in four at a time (a prefill's activations grow with its tokens).
  double prefill_ms = 0;
  for (int64_t s0 = 0; s0 < B; s0 += 4) {
    std::vector<int64_t> slots;
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t s = s0; s < std::min<int64_t>(B, s0 + 4); ++s) {
      slots.push_back(s);
      prompts.emplace_back(kPrompt);
      for (int32_t& x : prompts.back()) x = tok(gen);
    }
    const auto first = dec.prefill(slots, prompts);
    prefill_ms += dec.last_ms();
    for (const auto& row : first)
      for (float x : row)
        if (!std::isfinite(x)) {
          std::fprintf(stderr, "%s: non-finite logit after the prefill\n", name.c_str());
          std::exit(1);
        }
  }
  std::vector<int64_t> slots(B);
  for (int64_t s = 0; s < B; ++s) slots[s] = s;
  std::vector<int32_t> next(B);
  std::vector<double> ms, wall;
  for (int i = 0; i < kWarmup + kSteps; ++i) {
    for (int32_t& x : next) x = tok(gen);
    const auto w0 = std::chrono::steady_clock::now();
    dec.step_no_copy(slots, next);
    const double w = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count();
    if (i >= kWarmup) ms.push_back(dec.last_ms()), wall.push_back(w);
  }
  std::sort(ms.begin(), ms.end());
  std::sort(wall.begin(), wall.end());
  const double med = ms[ms.size() / 2];
  char note[400];
  std::snprintf(note, sizeof note,
                "4-layer slice, random device weights, %lld slot(s) after a %lld-token prompt each (prefill %.1f ms); "
                "median of %d steps (device %.3f ms, wall %.3f ms incl. host); the floor reads the touched weights "
                "once",
                static_cast<long long>(B), static_cast<long long>(kPrompt), prefill_ms, kSteps, med,
                wall[wall.size() / 2]);
  nlohmann::json line{{"case", name},
                      {"ours_ms", std::round(med * 1e4) / 1e4},
                      {"floor_ms", std::round(step_floor_ms(cfg, B, kPrompt) * 1e4) / 1e4},
                      {"ms_per_token", std::round(med / B * 1e4) / 1e4},
                      {"note", note}};
  std::printf("%s\n", line.dump().c_str());
  // One more step with CUDA events around each part (each synchronises, so the parts add up to more than a step).
  model->set_profiling(true);
  for (int32_t& x : next) x = tok(gen);
  dec.step_no_copy(slots, next);
  model->set_profiling(false);
  nlohmann::json parts = nlohmann::json::object();
  for (const auto& [part, part_ms] : model->profile()) parts[part] = std::round(part_ms * 1e4) / 1e4;
  const nlohmann::json breakdown{
      {"case", name + "/breakdown"}, {"profiled_step_ms", std::round(dec.last_ms() * 1e4) / 1e4}, {"parts_ms", parts}};
  std::printf("%s\n", breakdown.dump().c_str());
  std::fflush(stdout);
}

// Train–inference agreement at full width (issue 5): the log-probs a decoding session reports for 64 tokens after a
// 4096-token prompt (the prefill's last position, then each step) against the packed forward's score of the whole
// sequence, as `nextlm score --device cuda` computes it.
// Run with the tensor-core KDA in the forward (the default) and with the fp32 KDA kernels.
void slice4_train_inference_case(const std::string& name) {
  const ModelConfig cfg = load_config(slice4_config_path());
  auto model = CudaModel::random(cfg, 1);
  model->set_empty_selection(EmptySelection::SeenKeys);  // as the decoder (with the tail on, no selection is empty)
  // The default (tensor-core KDA), the fp32 KDA kernels, and batch-invariant mode (one arithmetic for both).
  struct Mode {
    const char* suffix;
    bool tc, invariant;
  };
  for (const Mode mode : {Mode{"", true, false}, Mode{"_fp32_kda", false, false}, Mode{"_batch_invariant", true, true}}) {
    model->set_kda_tensor_cores(mode.tc);
    model->set_batch_invariant(mode.invariant);
    constexpr int64_t kNew = 64;
    std::mt19937 gen(13);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
    std::vector<int32_t> seq(kPrompt + kNew);
    for (int32_t& x : seq) x = tok(gen);
    auto logprob = [](const std::vector<float>& logits, int32_t target) {
      double mx = -INFINITY, sum = 0;
      for (float x : logits) mx = std::max<double>(mx, x);
      for (float x : logits) sum += std::exp(double(x) - mx);
      return double(logits[target]) - mx - std::log(sum);
    };
    std::vector<double> decoded;
    double step_ms = 0;
    {
      CudaDecoder dec(*model, 1, kPrompt + kNew);
      const std::vector<int32_t> prompt(seq.begin(), seq.begin() + kPrompt);
      decoded.push_back(logprob(dec.prefill({0}, {prompt})[0], seq[kPrompt]));
      for (int64_t t = kPrompt; t + 1 < kPrompt + kNew; ++t) {
        decoded.push_back(logprob(dec.step({0}, {seq[t]})[0], seq[t + 1]));
        step_ms += dec.last_ms();
      }
    }
    PackedBatch b;
    b.add(seq);
    std::vector<double> scored;
    for (int rep = 0; rep < 2; ++rep) scored = model->next_token_logprobs(b)[0];  // the second one timed
    const double score_ms = model->last_forward_ms();
    double sum = 0, worst = 0;
    for (size_t i = 0; i < decoded.size(); ++i) {
      const double d = std::fabs(decoded[i] - scored[kPrompt - 1 + i]);
      sum += d, worst = std::max(worst, d);
    }
    const double mean = sum / static_cast<double>(decoded.size());
    char note[400];
    std::snprintf(note, sizeof note,
                  "4-layer slice, random device weights: log-probs of %zu decoded tokens after a %lld-token prompt vs "
                  "the packed forward's score of the sequence; target mean |dlogprob| <= 1e-3 (Megatron vs vLLM "
                  "~0.055); score_ms: the scoring forward of the %lld tokens, decode_step_ms: mean b1 step",
                  decoded.size(), static_cast<long long>(kPrompt), static_cast<long long>(kPrompt + kNew));
    const nlohmann::json line{{"case", name + mode.suffix},
                              {"mean_abs_dlogprob", mean},
                              {"max_abs_dlogprob", worst},
                              {"score_ms", score_ms},
                              {"decode_step_ms", step_ms / static_cast<double>(kNew - 1)},
                              {"note", note}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  model->set_kda_tensor_cores(true);
  model->set_batch_invariant(false);
}

}  // namespace nextlm::bench
