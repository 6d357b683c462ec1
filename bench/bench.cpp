// nextlm GPU benchmarks: each registered case prints one JSON line {"case", "ours_ms", "floor_ms", "note"} (with
// "peer" and "peer_ms" where a peer is timed in the same process) and the floor from the measured ceilings of
// ../shared/docs/performance.md (4.14 TB/s copy, 729 TFLOP/s bf16 GEMM).
// Peers run in the same call from bench/run_h200.sh.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda/device_model.h"
#include "backward.h"
#include "cuda/testing.h"
#include "decode.h"
#include "decode_gemv.h"
#include "mhc_backward.h"
#include "moe_gemm.h"
#include "slice4.h"
#include "xent.h"

namespace {

constexpr double kBytesPerMs = 4.14e12 / 1e3;
constexpr double kFlopsPerMs = 729e12 / 1e3;

// KDA forward bytes (q, k, v, g read, o written, bf16) and FLOPs (chunked form, per the performance doc's count).
double kda_floor_ms(int64_t T, int64_t H, int64_t K) {
  const double bytes = 5.0 * T * H * K * 2;
  const double flops = 0.1e12 * (static_cast<double>(T) * H * K * K) / (8192.0 * 64 * 128 * 128);
  return std::max(bytes / kBytesPerMs, flops / kFlopsPerMs);
}

void emit(const std::string& name, double ms, double floor, const std::string& note) {
  std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n", name.c_str(), ms, floor,
              note.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  const std::string dev = nextlm::cuda_device_name();
  if (dev.empty()) {
    std::fprintf(stderr, "error: no CUDA device\n");
    return 1;
  }
  std::fprintf(stderr, "device: %s\n", dev.c_str());
  // NEXTLM_MOE_GEMM: the MoE expert GEMM of every device model in this process (see set_moe_expert_gemm).
  if (const char* m = std::getenv("NEXTLM_MOE_GEMM")) nextlm::set_moe_expert_gemm(std::atoi(m));
  // NEXTLM_MOE_GEMM_DX: the variant of training's input-gradient expert GEMMs (see set_moe_expert_gemm_dx).
  if (const char* m = std::getenv("NEXTLM_MOE_GEMM_DX")) nextlm::set_moe_expert_gemm_dx(std::atoi(m));
  // NEXTLM_LORA_FOLD: where the routed experts' LoRA adapters run in training (see set_expert_lora_fold).
  if (const char* m = std::getenv("NEXTLM_LORA_FOLD")) nextlm::set_expert_lora_fold(std::atoi(m));
  // NEXTLM_HEAD_BLOCK_BYTES: the cap on one lm_head row block's fp32 logits in training (see set_head_block_bytes).
  if (const char* b = std::getenv("NEXTLM_HEAD_BLOCK_BYTES"))
    nextlm::set_head_block_bytes(std::strtoull(b, nullptr, 10));
  if (only == "parity") return nextlm::bench::slice4_parity(argc - 2, argv + 2);
  struct Case {
    std::string name;
    std::function<void(const std::string&)> run;
  };
  const int64_t H = 64, K = 128;
  const std::vector<int64_t> varlen{1300, 547, 2048, 963, 271, 3063};
  std::vector<Case> cases{
      {"kda_fwd_T8192_H64",
       [&](const std::string& n) {
         const auto t = nextlm::cuda_testing::time_kda_forward_tc({8192}, H, K, 20);
         char note[200];
         std::snprintf(note, sizeof note, "tensor cores: prepare kernel %.3f ms + state kernel %.3f ms", t.prepare_ms,
                       t.state_ms);
         emit(n, t.total_ms, kda_floor_ms(8192, H, K), note);
       }},
      {"kda_fwd_varlen",
       [&](const std::string& n) {
         const auto t = nextlm::cuda_testing::time_kda_forward_tc(varlen, H, K, 20);
         char note[200];
         std::snprintf(note, sizeof note, "[1300,547,2048,963,271,3063]; prepare %.3f ms + state %.3f ms",
                       t.prepare_ms, t.state_ms);
         emit(n, t.total_ms, kda_floor_ms(8192, H, K), note);
       }},
      {"kda_fwd_T32768_H64",
       [&](const std::string& n) {
         const auto t = nextlm::cuda_testing::time_kda_forward_tc({32768}, H, K, 10);
         char note[200];
         std::snprintf(note, sizeof note, "prepare %.3f ms + state %.3f ms", t.prepare_ms, t.state_ms);
         emit(n, t.total_ms, kda_floor_ms(32768, H, K), note);
       }},
      {"kda_fwd_T8192_H64_fp32",
       [&](const std::string& n) {
         emit(n, nextlm::cuda_testing::time_kda_forward({8192}, H, K, 5), kda_floor_ms(8192, H, K),
              "the fp32 CUDA-core kernels (softplus-gate fallback)");
       }},
      // The training backward's recurrence and attention kernels against their peers (bench/backward.cu).
      {"kda_bwd_T4096_H64", nextlm::bench::kda_backward_case},
      {"kda_bwd_T4096_H64_bf16", nextlm::bench::kda_backward_case},
      {"kda_bwd_T4096_H64_train", nextlm::bench::kda_backward_train_case},
      {"mla_bwd_T4096_NH64", nextlm::bench::mla_backward_case},
      // One mHC site's backward (post + pre) at the slice's width (bench/mhc_backward.cu).
      {"mhc_bwd_T4096", nextlm::bench::mhc_backward_case},
      {"mhc_bwd_T4096_forward_mix", nextlm::bench::mhc_backward_case},
      {"mhc_bwd_frozen_T4096", nextlm::bench::mhc_backward_case},
      {"mhc_post_project_T4096", nextlm::bench::mhc_post_project_case},
      // The training head's cross-entropy at the slice's vocabulary, both kernels (bench/xent.cu).
      {"xent_R2048_V154880", nextlm::bench::xent_case},
      // The 4-layer full-width slice (bench/slice4.cpp); both cases share one run of the slice.
      {"slice4_prefill_T4096", nextlm::bench::slice4_prefill_case},
      // The same in batch-invariant mode (what `score --batch-invariant` costs), and with only the forward's MLA
      // attention on the absorbed kernels of decoding.
      {"slice4_prefill_T4096_batch_invariant", nextlm::bench::slice4_prefill_case},
      {"slice4_prefill_T4096_absorbed_mla", nextlm::bench::slice4_prefill_case},
      // Decoding steps on the slice after 4096-token prompts (bench/decode.cpp).
      {"slice4_decode_b1", [](const std::string& n) { nextlm::bench::slice4_decode_case(n, 1); }},
      {"slice4_decode_b16", [](const std::string& n) { nextlm::bench::slice4_decode_case(n, 16); }},
      {"slice4_decode_b64", [](const std::string& n) { nextlm::bench::slice4_decode_case(n, 64); }},
      // decode_linear against its byte floors and cuBLASLt (bench/decode_gemv.cu).
      {"decode_gemv", nextlm::bench::decode_gemv_case},
      {"slice4_train_inference_b1", nextlm::bench::slice4_train_inference_case},
      {"slice4_train_step_T4096", nextlm::bench::slice4_train_step_case},
      {"small8_full_train_step_T4096", nextlm::bench::slice4_train_step_case},
      // The same keeping every sub-layer's activations from the forward instead of recomputing them.
      {"slice4_train_step_T4096_keep", nextlm::bench::slice4_train_step_case},
      {"small8_full_train_step_T4096_keep", nextlm::bench::slice4_train_step_case},
      {"slice4_lora_step_T4096", nextlm::bench::slice4_lora_step_case},
      {"slice4_lora_step_T4096_shared_experts", nextlm::bench::slice4_lora_step_case},
      {"slice4_lora_step_T4096_keep", nextlm::bench::slice4_lora_step_case},
      {"slice4_lora_step_T4096_shared_experts_keep", nextlm::bench::slice4_lora_step_case},
      // And recomputing everything, the routed experts' gate|up too (--recompute all: the least memory).
      {"slice4_train_step_T4096_all", nextlm::bench::slice4_train_step_case},
      {"slice4_lora_step_T4096_all", nextlm::bench::slice4_lora_step_case},
      // And under the fixed middle policy (--recompute kda,mla,moe,mhc: auto's fallback, the default until auto).
      {"slice4_train_step_T4096_recompute", nextlm::bench::slice4_train_step_case},
      {"slice4_lora_step_T4096_recompute", nextlm::bench::slice4_lora_step_case},
#ifdef NEXTLM_HAVE_NCCL
      {"slice4_prefill_T4096_tp2", nextlm::bench::slice4_parallel_prefill_case},
      {"slice4_prefill_T4096_ep2", nextlm::bench::slice4_parallel_prefill_case},
      {"slice4_prefill_T4096_tp2_ep2", nextlm::bench::slice4_parallel_prefill_case},
      {"slice4_train_step_T4096_tp2", nextlm::bench::slice4_train_step_case},
      {"slice4_train_step_T4096_ep2", nextlm::bench::slice4_train_step_case},
      {"slice4_train_step_T4096_tp2_ep2", nextlm::bench::slice4_train_step_case},
      {"slice4_lora_step_T4096_shared_experts_tp2", nextlm::bench::slice4_lora_step_case},
      {"slice4_lora_step_T4096_shared_experts_ep2", nextlm::bench::slice4_lora_step_case},
      {"slice4_lora_step_T4096_shared_experts_tp2_ep2", nextlm::bench::slice4_lora_step_case},
#endif
      {"mhc", nextlm::bench::mhc_share_case},
      {"moe_grouped_gemm", nextlm::bench::moe_grouped_gemm_case},  // bench/moe_gemm.cu
      {"moe_grouped_gemm_dx", nextlm::bench::moe_grouped_gemm_dx_case},  // the backward's dx pair (w_kn)
      {"moe_grouped_gemm_skewed", nextlm::bench::moe_grouped_gemm_case},        // log-normally skewed routing
      {"moe_grouped_gemm_dx_skewed", nextlm::bench::moe_grouped_gemm_dx_case},
      // The routed experts' grouped LoRA kernels of one MoE layer of the LoRA step (bench/moe_gemm.cu).
      {"grouped_lora_T4096", nextlm::bench::grouped_lora_case},
  };
  // `only` may name several cases, comma-separated.
  for (const Case& c : cases)
    if (only.empty() || ("," + only + ",").find("," + c.name + ",") != std::string::npos) c.run(c.name);
  return 0;
}
