// The 4-layer full-width slice on the GPU: the prefill benchmark with a per-component breakdown against floors
// (bytes / 4.14 TB/s or FLOPs / 729 TFLOP/s, ../shared/docs/performance.md), the mHC share of layer time, and the
// parity mode that scores nextlm's bf16 distributions against transformers' fp32 ones.
#include "slice4.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cuda/device_model.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/optim.h"
#ifdef NEXTLM_HAVE_NCCL
#include <numeric>

#include "dist/cuda_parallel.h"
#endif

namespace nextlm::bench {

std::string slice4_config_path() {
  if (const char* p = std::getenv("NEXTLM_SLICE4_CONFIG")) return p;
  if (const char* d = std::getenv("NEXTLM_SOURCE_DIR")) return std::string(d) + "/bench/slice4/config.json";
#ifdef NEXTLM_SOURCE_DIR
  if (std::filesystem::exists(NEXTLM_SOURCE_DIR "/bench/slice4/config.json"))
    return NEXTLM_SOURCE_DIR "/bench/slice4/config.json";
#endif
  return "bench/slice4/config.json";
}

namespace {

constexpr double kBytesPerMs = 4.14e12 / 1e3;
constexpr double kFlopsPerMs = 729e12 / 1e3;
constexpr int64_t kT = 4096;
constexpr int kWarmup = 2, kIters = 10;
constexpr uint64_t kSeed = 1;

// A roofline cost: the floor is whichever of the bytes and the FLOPs takes longer at the measured ceilings.
struct Cost {
  double flops = 0, bytes = 0;
  double floor_ms() const { return std::max(bytes / kBytesPerMs, flops / kFlopsPerMs); }
  Cost& operator+=(const Cost& o) {
    flops += o.flops, bytes += o.bytes;
    return *this;
  }
};

// Costs of the parts the device model profiles (summed over the layers that have them), for one sequence of T
// tokens. Weights are read once in bf16; activations cross memory once at the precision an ideal kernel would use.
std::map<std::string, Cost> slice_costs(const ModelConfig& c, int64_t T) {
  const double t = static_cast<double>(T), D = c.hidden_size, S = c.hc_mult, M = (2 + S) * S;
  std::map<std::string, Cost> m;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    // mHC: per site, pre reads the streams (fp32) and writes the sub-layer input (bf16); post reads streams and y,
    // writes streams.
    m["mhc"] += Cost{2 * (2 * t * M * S * D), 2 * (t * S * D * 4 + t * D * 2 + 2 * t * S * D * 4 + t * D * 4)};
    const Cost io{0, t * D * 2 + t * D * 4};  // a sub-layer reads a (bf16) and writes y (fp32)
    if (c.layer_types[i] == LayerType::LinearAttention) {
      const double H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
      const double params = 3 * HK * D + K * D + HK * K + H * D + K * D + HK * K + D * HK;
      // The chunked delta rule: ~0.1 TFLOP at T=8192, H=64, K=128 (performance.md), linear in T·H·K².
      const Cost core{0.1e12 * t * H * K * K / (8192.0 * 64 * 128 * 128), 5 * t * HK * 2};
      m["kda core"] += core;
      Cost layer{2 * t * params, 2 * params};
      layer += core;
      layer += io;
      m["kda layer"] += layer;
    } else {
      const double NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim, QL = c.q_lora_rank,
                   KL = c.kv_lora_rank, P = static_cast<double>(c.index_kpool);
      const double params = QL * D + NH * dqk * QL + KL * D + NH * (dqk + dv) * KL + D * NH * dv;
      // Selected keys and selectable pools of every query (one sequence from position 0).
      double sel = 0, pools = 0;
      for (int64_t q = 0; q < T; ++q) {
        const int64_t complete = (q + 1) / c.index_kpool;
        const int64_t chosen = std::min<int64_t>(c.index_topk / c.index_kpool, complete);
        sel += static_cast<double>(chosen * c.index_kpool +
                                   (c.index_kpool_always_select_tail ? (q + 1) % c.index_kpool : 0));
        pools += static_cast<double>(complete);
      }
      const Cost attn{2 * sel * NH * (dqk + dv), t * NH * (2 * dqk + dv) * 2 + t * NH * dv * 2};
      m["sparse attention"] += attn;
      Cost layer{2 * t * params, 2 * params};
      layer += attn;
      layer += io;
      if (c.indexer_types[i] == IndexerType::Full) {
        const double IH = c.index_n_heads, ID = c.index_head_dim;
        const double ip = IH * ID * QL + ID * D + IH * D + ID * D;
        const Cost idx{2 * t * ip + 2 * pools * IH * ID + t * P * ID * 4, 2 * ip + t * IH * ID * 2 + t * ID * 2};
        m["indexer"] += idx;
        layer += idx;
      }
      m["dsa layer"] += layer;
    }
    if (c.mlp_layer_types[i] == MlpType::Dense) {
      const double params = 3.0 * c.intermediate_size * D;
      Cost mlp{2 * t * params, 2 * params};
      mlp += io;
      m["dense mlp"] += mlp;
    } else {
      const double E = c.n_routed_experts, k = c.num_experts_per_tok, Im = c.moe_intermediate_size;
      const double per_expert = 3 * Im * D;
      // Experts that receive at least one token, for uniform routing: E·(1 − (1 − k/E)^T).
      const double hit = E * (1.0 - std::pow(1.0 - k / E, t));
      const Cost experts{2 * t * k * per_expert, 2 * hit * per_expert + t * k * (D * 2 + D * 4)};
      m["experts"] += experts;
      Cost moe = experts;
      const double shared = c.n_shared_experts * per_expert;
      moe += Cost{2 * t * shared + 2 * t * E * D, 2 * shared + 2 * E * D};
      moe += io;
      m["moe"] += moe;
    }
  }
  m["lm_head"] = Cost{2 * t * c.vocab_size * D, 2.0 * c.vocab_size * D + t * D * 2};
  return m;
}

// A training step's floor with the routed experts' weight traffic in it. floor_ms counts FLOPs alone; at these token
// counts every expert is hit, so each pass of the experts' GEMMs reads all their weights and is bound by those bytes,
// not by its FLOPs: the step reads them once in the forward (gate|up and down), once in the input gradients and,
// when the experts' gate|up is recomputed (--recompute all), those (2/3 of them) once more. Returns that floor:
// floor_ms with the experts' FLOPs (forward and input gradients, `fwd_mult`·forward in all) replaced by the larger of
// those and the weights' bytes.
double floor_with_expert_bytes_ms(const std::map<std::string, Cost>& costs, const ModelConfig& c, double needed,
                                  double fwd_mult, bool recompute_experts) {
  const auto it = costs.find("experts");
  if (it == costs.end()) return needed / kFlopsPerMs;
  // The experts hit (as slice_costs counts them) and their bf16 weights, over the MoE layers.
  const double t = static_cast<double>(kT), E = c.n_routed_experts, k = c.num_experts_per_tok;
  const double hit = E * (1.0 - std::pow(1.0 - k / E, t));
  const double layers = static_cast<double>(std::count(c.mlp_layer_types.begin(), c.mlp_layer_types.end(),
                                                       MlpType::Sparse));
  const double weight_bytes = layers * hit * 3.0 * c.moe_intermediate_size * c.hidden_size * 2;
  const double passes = 2.0 + (recompute_experts ? 2.0 / 3.0 : 0.0);
  const double expert_flops = fwd_mult * it->second.flops;
  return (needed - expert_flops) / kFlopsPerMs +
         std::max(expert_flops / kFlopsPerMs, passes * weight_bytes / kBytesPerMs);
}

// The profiled parts that do not overlap: their sum is the whole forward (up to the embedding and final norm).
const std::vector<std::string> kTopLevel{"mhc", "kda layer", "dsa layer", "dense mlp", "moe", "lm_head"};
const std::map<std::string, std::string> kWithin{
    {"kda core", "kda layer"}, {"indexer", "dsa layer"}, {"sparse attention", "dsa layer"}, {"experts", "moe"}};

// FLOPs a training step needs, from the forward's (slice_costs): a product with a weight once more for its input's
// gradient and, with trained weights, once more for the weight's; a product of two activations (the sparse
// attention's and the KDA core's) twice more, once for each operand's gradient (dq, dk, dv, dp: four products for
// attention's two); the indexer's once, as it runs under no_grad (neither its weights nor its input get a gradient
// from it). Recomputation is not counted. Until 2026-12-03 every part counted as a product with a weight (2 or 3
// forwards): 1.4 % below this count for the slice's LoRA step (34.4 against 34.9 TFLOP), and for a full-parameter
// step the indexer's FLOPs twice too many.
double step_flops(const std::map<std::string, Cost>& costs, bool full) {
  auto flops = [&](const std::string& part) {
    const auto it = costs.find(part);
    return it == costs.end() ? 0.0 : it->second.flops;
  };
  double forward = 0;
  for (const std::string& part : kTopLevel) forward += flops(part);
  const double activations = flops("sparse attention") + flops("kda core"), indexer = flops("indexer");
  return (full ? 3 : 2) * (forward - activations - indexer) + 3 * activations + indexer;
}

struct SliceResult {
  ModelConfig cfg;
  double median_ms = 0, min_ms = 0, wall_median_ms = 0, init_s = 0, mean_logprob = 0;
  bool finite = true;
  std::map<std::string, double> profile;
  std::map<int, double> moe_modes;  // median ms with another MoE expert GEMM (NEXTLM_SLICE4_MOE_MODES)
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One sequence of kT uniformly random tokens (the same for every case: generator seed 7).
PackedBatch random_batch(const ModelConfig& cfg) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  std::vector<int32_t> seq(kT);
  for (int32_t& x : seq) x = tok(gen);
  PackedBatch b;
  b.add(seq);
  return b;
}

// How the slice runs: the defaults, batch-invariant mode, or the absorbed MLA attention with cuBLASLt GEMMs.
enum class Variant { kDefault, kBatchInvariant, kAbsorbedMla };

// Runs the slice once per process and variant (the cases of a variant read it).
const SliceResult& slice_result(Variant variant = Variant::kDefault) {
  static std::map<Variant, SliceResult> cached;
  if (cached.count(variant)) return cached.at(variant);
  SliceResult r;
  const std::string path = slice4_config_path();
  r.cfg = load_config(path);
  std::fprintf(stderr, "slice4: config %s (%lld layers, vocab %lld, %lld experts)\n", path.c_str(),
               static_cast<long long>(r.cfg.num_hidden_layers), static_cast<long long>(r.cfg.vocab_size),
               static_cast<long long>(r.cfg.n_routed_experts));
  const auto t0 = std::chrono::steady_clock::now();
  auto model = CudaModel::random(r.cfg, kSeed);
  model->set_batch_invariant(variant == Variant::kBatchInvariant);
  model->set_mla_absorbed(variant == Variant::kAbsorbedMla);
  r.init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "slice4: random device weights in %.1f s\n", r.init_s);

  const PackedBatch b = random_batch(r.cfg);

  // Warm-up (arena chunks, GEMM algorithm choices), and a sanity check of the output: random tokens under random
  // weights score about −log V each, never NaN.
  for (int i = 0; i < kWarmup; ++i) {
    const auto lp = model->next_token_logprobs(b);
    double s = 0;
    for (double x : lp[0]) s += x, r.finite = r.finite && std::isfinite(x);
    r.mean_logprob = s / static_cast<double>(lp[0].size());
  }
  std::fprintf(stderr, "slice4: mean log-prob %.3f (log 1/V = %.3f), finite: %s\n", r.mean_logprob,
               -std::log(static_cast<double>(r.cfg.vocab_size)), r.finite ? "yes" : "NO");
  std::vector<double> gpu, wall;
  for (int i = 0; i < kIters; ++i) {
    const auto w0 = std::chrono::steady_clock::now();
    model->next_token_logprobs(b);
    wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count());
    gpu.push_back(model->last_forward_ms());
  }
  r.median_ms = median(gpu);
  r.min_ms = *std::min_element(gpu.begin(), gpu.end());
  r.wall_median_ms = median(wall);
  // The same prefill with other MoE expert GEMMs (set_moe_expert_gemm modes, comma-separated, e.g. "-1,1,2"): the
  // cuBLASLt loop and the grouped GEMM's variants side by side.
  if (const char* modes = std::getenv("NEXTLM_SLICE4_MOE_MODES")) {
    const int saved = moe_expert_gemm();
    std::string list = modes;
    for (size_t pos = 0; pos < list.size();) {
      const size_t end = std::min(list.find(',', pos), list.size());
      const int mode = std::atoi(list.substr(pos, end - pos).c_str());
      pos = end + 1;
      set_moe_expert_gemm(mode);
      model->next_token_logprobs(b);
      std::vector<double> t;
      for (int i = 0; i < kIters; ++i) model->next_token_logprobs(b), t.push_back(model->last_forward_ms());
      r.moe_modes[mode] = median(t);
      std::fprintf(stderr, "slice4: MoE expert GEMM mode %d: %.2f ms\n", mode, r.moe_modes[mode]);
    }
    set_moe_expert_gemm(saved);
  }
  model->set_profiling(true);
  model->next_token_logprobs(b);
  model->set_profiling(false);
  for (const auto& [name, ms] : model->profile()) r.profile[name] = ms;
  return cached.emplace(variant, std::move(r)).first->second;
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

}  // namespace

void slice4_prefill_case(const std::string& name) {
  const Variant variant = name.find("batch_invariant") != std::string::npos ? Variant::kBatchInvariant
                          : name.find("absorbed_mla") != std::string::npos  ? Variant::kAbsorbedMla
                                                                            : Variant::kDefault;
  const SliceResult& r = slice_result(variant);
  const auto costs = slice_costs(r.cfg, kT);
  double floor = 0, profiled = 0;
  for (const std::string& part : kTopLevel) {
    floor += costs.at(part).floor_ms();
    if (r.profile.count(part)) profiled += r.profile.at(part);
  }
  nlohmann::json line{{"case", name},
                      {"ours_ms", std::round(r.median_ms * 1e4) / 1e4},
                      {"floor_ms", std::round(floor * 1e4) / 1e4},
                      {"ratio", std::round(r.median_ms / floor * 100) / 100},
                      {"target_ms", 30.0},
                      {"finite", r.finite},
                      {"note", "4-layer slice (bench/slice4/config.json), random device weights, one sequence of " +
                                   std::to_string(kT) + " tokens, lm_head + log-probs; median of " +
                                   std::to_string(kIters) + " CUDA-event timings after " + std::to_string(kWarmup) +
                                   " warm-ups (min " + fmt("%.2f", r.min_ms) + " ms, host wall median " +
                                   fmt("%.2f", r.wall_median_ms) + " ms); peer: bench/peers/hf_slice4.py"}};
  line["moe_expert_gemm"] = moe_expert_gemm();
  for (const auto& [mode, ms] : r.moe_modes) line["ms_with_moe_expert_gemm_" + std::to_string(mode)] = ms;
  std::printf("%s\n", line.dump().c_str());
  // The breakdown comes from one more run with an event pair around every part (each part ends in a
  // synchronisation, so the parts add up to a little more than the plain run).
  for (const auto& [part, cost] : costs) {
    const bool top = std::find(kTopLevel.begin(), kTopLevel.end(), part) != kTopLevel.end();
    const double ms = r.profile.count(part) ? r.profile.at(part) : NAN;
    // A part the profile lacks (no such layer) prints null.
    auto num = [](double x, double scale) {
      return std::isfinite(x) ? nlohmann::json(std::round(x * scale) / scale) : nlohmann::json(nullptr);
    };
    nlohmann::json c{{"case", name + "/" + part},
                     {"ours_ms", num(ms, 1e4)},
                     {"floor_ms", num(cost.floor_ms(), 1e4)},
                     {"ratio", num(ms / cost.floor_ms(), 100)},
                     {"gflop", std::round(cost.flops / 1e9 * 10) / 10},
                     {"gbytes", std::round(cost.bytes / 1e9 * 1000) / 1000},
                     {"bound", cost.bytes / kBytesPerMs > cost.flops / kFlopsPerMs ? "bytes" : "flops"}};
    if (top) {
      c["share_of_profiled"] = num(ms / profiled, 1000);
    } else {
      c["within"] = kWithin.at(part);
    }
    std::printf("%s\n", c.dump().c_str());
  }
  std::fflush(stdout);
}

// The routed experts' layout of a training case with frozen experts, as `nextlm train --lora-rank` holds them
// (frozen_expert_layout); NEXTLM_EXPERT_LAYOUT=L sets layout L instead, to compare the layouts on one card.
// Returns the layout.
int apply_expert_layout(CudaModel& model, bool frozen) {
  const char* v = std::getenv("NEXTLM_EXPERT_LAYOUT");
  const int layout = v ? std::atoi(v) : frozen ? frozen_expert_layout(model.config()) : 0;
  model.set_expert_layout(layout);
  return layout;
}

// A training case's recompute policy: --recompute none for *_keep, all for *_all, kda,mla,moe,mhc for *_recompute,
// the trainer's default (auto) otherwise; NEXTLM_BENCH_RECOMPUTE (in --recompute's syntax) overrides it, to measure
// what recomputing each component costs in time and memory.
RecomputePolicy case_policy(const std::string& name) {
  if (const char* p = std::getenv("NEXTLM_BENCH_RECOMPUTE")) return parse_recompute(p);
  if (name.find("_keep") != std::string::npos) return parse_recompute("none");
  if (name.find("_all") != std::string::npos) return RecomputePolicy{};
  if (name.find("_recompute") != std::string::npos) return default_recompute();
  return auto_recompute();
}

// The policy a case ran under (CudaModel::recompute(): an adaptive one at the rung it ended at) as --recompute
// writes it, with the rung: "auto (none)".
std::string policy_name(const RecomputePolicy& p) {
  RecomputePolicy rung = p;
  rung.adaptive = false;
  return p.adaptive ? "auto (" + recompute_to_string(rung) + ")" : recompute_to_string(p);
}

// How a case's note says that policy.
std::string policy_words(const RecomputePolicy& p) {
  RecomputePolicy q = p;
  q.adaptive = false;
  const std::string how = p.adaptive ? "the default, --recompute auto: the fastest of none, states, " +
                                           recompute_to_string(default_recompute()) + " and all that fits the card, "
                                     : "";
  const std::string but = "every sub-layer recomputed before its backward up to its output projection (the outputs "
                          "kept), but for the KDA recurrence and the MLA attention (their outputs kept)";
  if (q == RecomputePolicy{}) return but + " (" + how + "--recompute all)";
  if (q == default_recompute())
    return but + ", the routed experts' gate|up (their pre-activations and act kept) and the dense MLP (" + how +
           "--recompute " + recompute_to_string(q) + ")";
  if (q == parse_recompute("none"))
    return "every sub-layer's activations kept from the forward (" + how + "--recompute none)";
  return how + "--recompute " + recompute_to_string(q);
}

// Device memory in use now (weights, gradients, optimizer state, the arena), GiB to a tenth.
double device_memory_gib(const std::string& name) {
  size_t free_bytes = 0, total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess, name, ": cudaMemGetInfo failed");
  return std::round((total_bytes - free_bytes) / double(1 << 30) * 10) / 10;
}

void slice4_train_step_case(const std::string& name) {
#ifdef NEXTLM_HAVE_NCCL
  if (name.find("_tp2") != std::string::npos || name.find("_ep2") != std::string::npos)
    return slice4_parallel_case(name, true);
#endif
  // slice4_*: the base of a LoRA step on the slice, every input gradient but no weight gradient for the frozen
  // projections and experts; small8_*: full-parameter training of a smaller model with the real layer pattern.
  const bool full = name.rfind("small8", 0) == 0;
  std::string path = slice4_config_path();
  if (full) {
    const size_t at = path.rfind("slice4/config.json");
    check(at != std::string::npos, "small8: bench/small8/config.json is found beside the slice's config, not ", path);
    path = path.substr(0, at) + "small8/config.json";
  }
  const ModelConfig cfg = load_config(path);
  auto model = CudaModel::random(cfg, kSeed);
  const int layout = apply_expert_layout(*model, !full);
  model->set_train_linears(full);
  // *_keep: every sub-layer keeps its activations from the forward (--recompute none) instead of running again;
  // *_all: every sub-layer runs again, the routed experts' gate|up too (--recompute all).
  const RecomputePolicy policy = case_policy(name);
  model->set_recompute(policy);
  const PackedBatch b = random_batch(cfg);
  const double loss = model->forward_backward(b);  // warm-up: arena, GEMM algorithms
  const double memory_gib = device_memory_gib(name);
  std::vector<double> gpu, wall;
  constexpr int kStepIters = 3;
  for (int i = 0; i < kStepIters; ++i) {
    model->zero_grads();
    const auto w0 = std::chrono::steady_clock::now();
    model->forward_backward(b);
    wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count());
    gpu.push_back(model->last_forward_ms());
  }
  const double ms = median(gpu);
  const RecomputePolicy used = model->recompute();
  const double needed = step_flops(slice_costs(cfg, kT), full);
  const bool recompute_experts = used.recomputes_experts();
  constexpr double kPeakFlopsPerMs = 989.4e12 / 1e3;  // H200 dense bf16, the spec sheet's figure
  nlohmann::json line{
      {"case", name},
      {"ours_ms", std::round(ms * 1e4) / 1e4},
      {"floor_ms", std::round(needed / kFlopsPerMs * 1e4) / 1e4},
      {"floor_with_expert_bytes_ms",
       std::round(floor_with_expert_bytes_ms(slice_costs(cfg, kT), cfg, needed, full ? 3 : 2, recompute_experts) *
                  1e4) /
           1e4},
      {"tokens_per_s", std::round(kT / ms * 1e3)},
      {"mfu", std::round(needed / (ms * kPeakFlopsPerMs) * 1e4) / 1e4},
      {"target_mfu", 0.35},
      {"loss_per_token", std::round(loss / (kT - 1) * 1e4) / 1e4},
      {"finite", std::isfinite(loss)},
      {"recompute", policy_name(used)},
      {"expert_layout", layout},
      {"device_memory_gib", memory_gib},
      {"kda_backward_products", model->kda_backward_bf16() ? "bf16" : "split bf16"},
      {"kda_keep_states", model->kda_keep_states()},
      {"train_overlap", model->train_overlap()},
      {"note", std::string(full ? "full-parameter forward + backward (every weight's fp32 gradient) of "
                                  "bench/small8/config.json (8 layers in the real pattern, hidden 2048, 64 experts "
                                  "top-8; optimizer not included, it runs on the host in `train --device cuda`)"
                                : "forward + backward of the 4-layer slice with frozen linear weights (the base of a "
                                  "LoRA step: adapters and optimizer not included)") +
                   " at " + std::to_string(kT) + " tokens, " + policy_words(used) +
                   "; device_memory_gib: the GPU's memory in use after the step (weights, gradients, arena); KDA "
                   "forward core on tensor cores and chunked (WY) backward on tensor cores (kda_backward_products), "
                   "MLA attention backward on tensor cores, dx of the experts on the grouped GEMM; median of " + std::to_string(kStepIters) +
                   " CUDA-event timings (host wall median " +
                   fmt("%.1f", median(wall)) + " ms); MFU = FLOPs needed (forward, input gradients" +
                   (full ? ", weight gradients" : "") +
                   "; step_flops in bench/slice4.cpp) / time / 989.4 TFLOP/s; floor at 729 TFLOP/s; "
                   "floor_with_expert_bytes_ms: the same with the routed experts' GEMMs bound by reading their weights "
                   "(all of them a pass, 4.14 TB/s)"}};
  std::printf("%s\n", line.dump().c_str());
  // Where the step's time goes: one more step with an event pair around every part (each ends in a sync).
  model->set_profiling(true);
  model->zero_grads();
  model->forward_backward(b);
  model->set_profiling(false);
  for (const auto& [part, part_ms] : model->profile())
    std::printf("%s\n", nlohmann::json{{"case", name + "/" + part}, {"ours_ms", std::round(part_ms * 1e4) / 1e4},
                                       {"share", std::round(part_ms / ms * 1e3) / 1e3}}
                            .dump()
                            .c_str());
  std::fflush(stdout);
}

namespace {

constexpr int kLoraStepIters = 3;

struct LoraSteps {
  double wall_ms = 0, device_ms = 0, loss = 0;
  double memory_gib = 0;  // the device's memory in use after the steps
  // The model's modes (CudaModel) the steps ran under.
  bool kda_backward_bf16 = false, train_overlap = false, kda_keep_states = false, lora_update_beside = false;
  size_t modules = 0;
  int64_t parameters = 0;
  std::vector<LoraModule> layout;  // the adapter's modules (for the FLOP count)
};

// LoRA steps on a model, as `train --device cuda --lora-rank` runs them: on one GPU the whole step on the device
// (forward, backward, clipping and AdamW on the device's fp32 adapters: start_lora_optimizer); on a shard the
// adapters' gradients go to the host, where `sum` adds up the ranks' shares (lora_gradients) and AdamW runs, and
// the new adapters go back; `sync` lines the ranks up before each timed step.
LoraSteps time_lora_steps(CudaModel& model, bool shared, const PackedBatch& b,
                          const std::function<void(std::vector<ParamRef>&)>& sum, const std::function<void()>& sync,
                          bool on_device) {
  model.set_train_linears(false);
  model.set_train_small(false);  // as `nextlm train --lora`: no gradient of the frozen base, small tensors included
  LoraOptions o;
  o.rank = 16;
  o.alpha = 32;
  o.experts = shared ? LoraExperts::Shared : LoraExperts::PerExpert;
  LoraAdapter lora(model.config(), o, kSeed);
  std::vector<ParamRef> params = lora.params("model.language_model.");
  AdamW adam(params, AdamWOptions{});
  LoraSteps r;
  if (on_device) {
    model.set_lora(lora);
    model.start_lora_optimizer(lora);
  }
  auto step = [&] {
    model.zero_grads();
    if (on_device) {
      r.loss = model.forward_backward(b);
      model.lora_adamw_step(AdamWOptions{}, 1e-4, adam.steps() + 1, 1.0 / (kT - 1), 1.0);
      adam.set_steps(adam.steps() + 1);
      return model.last_forward_ms();
    }
    for (ParamRef& p : params) std::fill_n(p.g, p.n, 0.0f);
    model.set_lora(lora);
    r.loss = model.forward_backward(b);
    model.lora_gradients(lora);
    sum(params);
    for (ParamRef& p : params)
      for (int64_t i = 0; i < p.n; ++i) p.g[i] /= static_cast<float>(kT - 1);
    clip_grad_norm(params, 1.0);
    adam.step(params, 1e-4);
    return model.last_forward_ms();
  };
  step();  // warm-up
  std::vector<double> gpu, wall;
  for (int i = 0; i < kLoraStepIters; ++i) {
    sync();
    const auto w0 = std::chrono::steady_clock::now();
    gpu.push_back(step());
    wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count());
  }
  r.wall_ms = median(wall), r.device_ms = median(gpu);
  r.memory_gib = device_memory_gib("lora step");
  r.kda_backward_bf16 = model.kda_backward_bf16(), r.train_overlap = model.train_overlap();
  r.kda_keep_states = model.kda_keep_states(), r.lora_update_beside = model.lora_update_beside();
  r.modules = lora.modules().size(), r.parameters = lora.num_parameters(), r.layout = lora.modules();
  return r;
}

}  // namespace

void slice4_lora_step_case(const std::string& name) {
  const bool shared = name.find("shared_experts") != std::string::npos;
  const int tp = name.find("_tp2") != std::string::npos ? 2 : 1, ep = name.find("_ep2") != std::string::npos ? 2 : 1;
  const RecomputePolicy policy = case_policy(name);  // _keep, _all: one GPU
  const ModelConfig cfg = load_config(slice4_config_path());
  const PackedBatch b = random_batch(cfg);
  LoraSteps one, split;
  RecomputePolicy used = fixed_recompute(policy);  // a shard's
  int layout = 0;  // the experts' (one GPU)
  {
    auto model = CudaModel::random(cfg, kSeed);
    layout = apply_expert_layout(*model, true);
    model->set_recompute(policy);
    one = time_lora_steps(*model, shared, b, [](std::vector<ParamRef>&) {}, [] {}, true);
    if (tp == 1 && ep == 1) used = model->recompute();
  }
  if (tp > 1 || ep > 1) {
#ifdef NEXTLM_HAVE_NCCL
    // The same step split over GPUs: every rank holds its part of the adapters, their gradients' shares are summed
    // over the ranks on the host, and every rank runs the same AdamW.
    dist::run_gpu_ranks(tp, ep, [&](dist::Comm& world, int device) {
      dist::CudaRank r = dist::make_cuda_rank(world, tp, ep, device, [&](const CudaShard& sh, int dev) {
        auto m = CudaModel::random(cfg, kSeed, dev, sh);
        apply_expert_layout(*m, true);
        return m;
      });
      const LoraSteps mine = time_lora_steps(
          *r.model, shared, b,
          [&](std::vector<ParamRef>& params) {
            for (ParamRef& p : params) world.all_reduce_sum(p.g, static_cast<size_t>(p.n));
          },
          [&] { world.barrier(); }, false);
      if (world.rank() == 0) split = mine;
    });
#else
    fail(name, ": needs a build with NCCL");
#endif
  }
  const bool par = tp > 1 || ep > 1;
  const LoraSteps& r = par ? split : one;
  const double ms = r.wall_ms;
  // The adapters' FLOPs: per module and token, x·Aᵀ and u·Bᵀ forward, and four products of the same size backward.
  double adapter_flops = 0;
  for (const LoraModule& m : r.layout) {
    const double tokens = lora_kind_is_expert(m.kind)
                              ? (m.expert == LoraModule::kAllExperts ? kT * cfg.num_experts_per_tok
                                                                      : kT * cfg.num_experts_per_tok /
                                                                            static_cast<double>(cfg.n_routed_experts))
                              : kT;
    adapter_flops += 6 * tokens * m.rank * static_cast<double>(m.A.dim(1) + m.B.dim(0));
  }
  const double needed = step_flops(slice_costs(cfg, kT), false) + adapter_flops;
  const bool recompute_experts = used.recomputes_experts();
  constexpr double kPeakFlopsPerMs = 989.4e12 / 1e3;
  nlohmann::json line{
      {"case", name},
      {"ours_ms", std::round(ms * 1e4) / 1e4},
      {"device_ms", std::round(r.device_ms * 1e4) / 1e4},
      {"floor_ms", std::round(needed / kFlopsPerMs * 1e4) / 1e4},
      {"floor_with_expert_bytes_ms",
       std::round(floor_with_expert_bytes_ms(slice_costs(cfg, kT), cfg, needed, 2, recompute_experts) * 1e4) / 1e4},
      {"tokens_per_s", std::round(kT / ms * 1e3)},
      {"mfu", std::round(needed / (ms * kPeakFlopsPerMs) * 1e4) / 1e4},
      {"target_mfu", 0.35},
      {"recompute", policy_name(used)},
      {"adapters", r.modules},
      {"adapter_parameters", r.parameters},
      {"loss_per_token", std::round(r.loss / (kT - 1) * 1e4) / 1e4},
      {"finite", std::isfinite(r.loss)},
      {"note", std::string("one LoRA step of the 4-layer slice at ") + std::to_string(kT) +
                   " tokens: rank 16 adapters on every projection (" +
                   (shared ? "one adapter per layer shared by the routed experts" : "one adapter per routed expert") +
                   "), forward + backward on the device (base frozen: no weight gradients)" +
                   (par ? ", the adapters' gradients to the host, clipping and AdamW there and the new adapters back"
                        : ", clipping and AdamW on the device's fp32 adapters (nothing goes to the host)") +
                   ", " + policy_words(used) +
                   "; median host wall time of " +
                   std::to_string(kLoraStepIters) + " steps (device_ms: the forward + backward alone); MFU = FLOPs "
                   "needed (forward, input gradients, adapters; step_flops in bench/slice4.cpp) / wall time / "
                   "989.4 TFLOP/s" +
                   (par ? " of all " + std::to_string(std::lcm(tp, ep)) + " GPUs; tp " + std::to_string(tp) +
                              " ep " + std::to_string(ep) + " (threads, NCCL), the adapters' gradients summed over "
                              "the ranks on the host"
                        : std::string()) +
                   "; floor_with_expert_bytes_ms: floor_ms with the routed experts' GEMMs bound by reading their "
                   "weights (all of them a pass, 4.14 TB/s, one GPU)" +
                   (par ? std::string()
                        : "; device_memory_gib: the GPU's memory in use after the steps (weights, adapters and their "
                          "AdamW state, the arena)")}};
  if (!par) line["device_memory_gib"] = r.memory_gib;
  line["kda_backward_products"] = r.kda_backward_bf16 ? "bf16" : "split bf16";
  line["kda_keep_states"] = r.kda_keep_states;
  line["train_overlap"] = r.train_overlap;
  if (!par) line["lora_update_beside"] = r.lora_update_beside;
  line["mhc_mix_fold"] = mhc_mix_fold();
  line["mhc_post_fusion"] = mhc_post_fusion();
  line["moe_expert_gemm"] = moe_expert_gemm(), line["moe_expert_gemm_dx"] = moe_expert_gemm_dx(layout == 2);
  line["expert_layout"] = layout;
  if (par) {
    line["mfu"] = std::round(needed / (ms * kPeakFlopsPerMs * std::lcm(tp, ep)) * 1e4) / 1e4;
    line["peer"] = "nextlm on one GPU, same run";
    line["peer_ms"] = std::round(one.wall_ms * 1e4) / 1e4;
    line["speedup"] = std::round(one.wall_ms / ms * 100) / 100;
    line["loss_rel_diff_vs_one_gpu"] = std::fabs(r.loss - one.loss) / std::fabs(one.loss);
  }
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

void mhc_share_case(const std::string& name) {
  const SliceResult& r = slice_result();
  const auto costs = slice_costs(r.cfg, kT);
  double layers = 0;  // mHC plus every sub-layer: the layer stack without the lm_head
  for (const std::string& part : kTopLevel)
    if (part != "lm_head" && r.profile.count(part)) layers += r.profile.at(part);
  const double mhc = r.profile.count("mhc") ? r.profile.at("mhc") : NAN;
  nlohmann::json line{{"case", name},
                      {"ours_ms", std::round(mhc * 1e4) / 1e4},
                      {"floor_ms", std::round(costs.at("mhc").floor_ms() * 1e4) / 1e4},
                      {"pct_of_layer_time", std::round(mhc / layers * 1000) / 10},
                      {"target_pct", 7.0},
                      {"note", "slice4 T=" + std::to_string(kT) + ", " + std::to_string(r.cfg.num_hidden_layers) +
                                   " layers: mHC pre (norm, fn projection, Sinkhorn, collapse) and post (mix) of both "
                                   "sites, as a share of the profiled layer time " +
                                   fmt("%.2f", layers) + " ms"}};
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

int slice4_parity(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: nextlm_bench parity MODEL_DIR REF.safetensors OUT.json\n");
    return 2;
  }
  const std::string dir = argv[0], ref_path = argv[1], out_path = argv[2];
  try {
    const auto t0 = std::chrono::steady_clock::now();
    auto model = CudaModel::load(dir);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t V = model->config().vocab_size;
    std::fprintf(stderr, "parity: loaded %s to the GPU in %.1f s\n", dir.c_str(), load_s);
    SafetensorsFile ref(ref_path);
    const auto& meta = ref.buffer().metadata();
    check(meta.count("batches"), ref_path, " has no \"batches\" metadata");
    const nlohmann::json batches = nlohmann::json::parse(meta.at("batches"));
    nlohmann::json out{{"model", dir}, {"load_s", load_s}, {"batches", nlohmann::json::array()}};
    double kl_all = 0, agree_all = 0;
    int64_t n_all = 0;
    bool ok = true;
    for (const auto& bj : batches) {
      PackedBatch b;
      std::vector<const float*> rows;
      for (int64_t i : bj.at("seqs").get<std::vector<int64_t>>()) {
        const TensorView* tv = ref.buffer().find("tokens." + std::to_string(i));
        const TensorView* lv = ref.buffer().find("logp." + std::to_string(i));
        check(tv && lv, ref_path, ": sequence ", i, " lacks tokens or logp");
        check(tv->dtype == DType::I64 && tv->shape.size() == 1, "tokens.", i, " must be I64 [T]");
        const int64_t T = tv->shape[0];
        check(lv->dtype == DType::F32 && lv->shape == std::vector<int64_t>{T, V}, "logp.", i, " must be F32 [", T,
              ", ", V, "]");
        std::vector<int64_t> ids(T);
        std::memcpy(ids.data(), tv->data, T * sizeof(int64_t));
        b.add(std::vector<int32_t>(ids.begin(), ids.end()));
        rows.push_back(reinterpret_cast<const float*>(lv->data));
      }
      const auto res = model->compare_with_reference(b, rows);
      double kl = 0, kl_max = 0, agree = 0, dlp = 0;
      int64_t n_lp = 0;
      const int64_t T = b.num_tokens();
      std::vector<double> kl_by_pos;  // mean KL per 512 positions of the packed batch
      for (int64_t n = 0; n < b.num_seqs(); ++n)
        for (int64_t t = b.cu_seqlens[n]; t < b.cu_seqlens[n + 1]; ++t) {
          const TokenComparison& c = res[t];
          ok = ok && std::isfinite(c.kl) && c.kl > -1e-6;
          kl += c.kl, kl_max = std::max(kl_max, c.kl), agree += c.argmax == c.ref_argmax;
          if (t + 1 < b.cu_seqlens[n + 1]) {
            float ref_lp;
            std::memcpy(&ref_lp, rows[n] + (t - b.cu_seqlens[n]) * V + b.tokens[t + 1], sizeof(float));
            dlp += std::fabs(c.logprob - ref_lp), ++n_lp;
          }
          if (t % 512 == 0) kl_by_pos.push_back(0);
          kl_by_pos.back() += c.kl / 512;
        }
      nlohmann::json r{{"name", bj.value("name", "")},
                       {"num_seqs", b.num_seqs()},
                       {"tokens", T},
                       {"kl_mean", kl / T},
                       {"kl_max", kl_max},
                       {"argmax_agree", agree / T},
                       {"mean_abs_dlogprob", n_lp ? dlp / n_lp : 0.0},
                       {"kl_mean_per_512_positions", kl_by_pos},
                       {"forward_ms", model->last_forward_ms()}};
      std::fprintf(stderr, "parity: %s\n", r.dump().c_str());
      out["batches"].push_back(r);
      kl_all += kl, agree_all += agree, n_all += T;
    }
    out["all"] = {{"tokens", n_all}, {"kl_mean", kl_all / n_all}, {"argmax_agree", agree_all / n_all}, {"finite", ok}};
    std::ofstream(out_path) << out.dump(2) << "\n";
    std::printf("%s\n", out["all"].dump().c_str());
    if (!ok) std::fprintf(stderr, "parity: error: a KL value is NaN or negative\n");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace nextlm::bench

#ifdef NEXTLM_HAVE_NCCL
namespace nextlm::bench {

void slice4_parallel_prefill_case(const std::string& name) { slice4_parallel_case(name, false); }

void slice4_parallel_case(const std::string& name, bool train) {
  const int tp = name.find("_tp2") != std::string::npos ? 2 : 1, ep = name.find("_ep2") != std::string::npos ? 2 : 1;
  const ModelConfig cfg = load_config(slice4_config_path());
  const PackedBatch b = random_batch(cfg);
  // One GPU first, the same random weights and batch: its time and log-probs, the reference of the split run.
  // A training step: forward + backward with frozen linear weights (the base of a LoRA step), the loss compared.
  const int iters = train ? 3 : kIters;
  auto step = [&](CudaModel& m) {
    if (!train) return m.next_token_logprobs(b)[0];
    m.zero_grads();
    return std::vector<double>{m.forward_backward(b)};
  };
  std::vector<double> one_lp, one_ms;
  {
    auto model = CudaModel::random(cfg, kSeed);
    model->set_train_linears(false);
    for (int i = 0; i < kWarmup; ++i) one_lp = step(*model);
    for (int i = 0; i < iters; ++i) step(*model), one_ms.push_back(model->last_forward_ms());
  }
  std::vector<double> lp, ms;
  double init_s = 0;
  dist::run_gpu_ranks(tp, ep, [&](dist::Comm& world, int device) {
    const auto t0 = std::chrono::steady_clock::now();
    dist::CudaRank r = dist::make_cuda_rank(world, tp, ep, device, [&](const CudaShard& s, int dev) {
      return CudaModel::random(cfg, kSeed, dev, s);
    });
    world.barrier();
    if (world.rank() == 0) init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.model->set_train_linears(false);
    std::vector<double> mine, t;
    for (int i = 0; i < kWarmup; ++i) mine = step(*r.model);
    for (int i = 0; i < iters; ++i) {
      world.barrier();  // every rank starts together: rank 0's events then time the whole split step
      step(*r.model);
      t.push_back(r.model->last_forward_ms());
    }
    if (world.rank() == 0) lp = std::move(mine), ms = std::move(t);
  });
  double diff = 0, worst = 0;
  for (size_t i = 0; i < lp.size() && i < one_lp.size(); ++i) {
    const double e = std::fabs(lp[i] - one_lp[i]);
    diff += e, worst = std::max(worst, e);
  }
  diff /= std::max<size_t>(lp.size(), 1);
  const double ours = median(ms), one = median(one_ms);
  nlohmann::json line{{"case", name},
                      {"ours_ms", std::round(ours * 1e4) / 1e4},
                      {"peer", "nextlm on one GPU, same run"},
                      {"peer_ms", std::round(one * 1e4) / 1e4},
                      {"tokens_per_s", std::round(kT / ours * 1e3)},
                      {"peer_tokens_per_s", std::round(kT / one * 1e3)},
                      {"speedup", std::round(one / ours * 100) / 100},
                      {train ? "loss_rel_diff_vs_one_gpu" : "mean_abs_dlogprob_vs_one_gpu",
                       train ? diff / std::fabs(one_lp[0]) : diff},
                      {"note", std::string("4-layer slice, random device weights, one sequence of ") +
                                   std::to_string(kT) + " tokens, " +
                                   (train ? "forward + backward with frozen linear weights (the base of a LoRA step)"
                                          : "lm_head + log-probs") +
                                   ", tp " + std::to_string(tp) + " ep " + std::to_string(ep) + " on " +
                                   std::to_string(std::lcm(tp, ep)) + " GPUs (threads, NCCL); rank 0's CUDA-event " +
                                   "median of " + std::to_string(iters) + "; shard init " + fmt("%.1f", init_s) + " s"}};
  if (!train) line["max_abs_dlogprob_vs_one_gpu"] = worst;
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

}  // namespace nextlm::bench
#endif
