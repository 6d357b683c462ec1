// Host-side entry points to single CUDA kernels, for the kernel tests and the benchmarks (host vectors in and out,
// or device-resident random inputs timed with CUDA events).
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// The chunked KDA kernel on packed sequences: q, k, v, g [T, H, K] (q normalised and scaled, k normalised),
// beta [T, H]. The output buffer is poisoned with NaN first, so an unwritten element shows.
std::vector<float> kda_chunked(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                               const std::vector<float>& g, const std::vector<float>& beta,
                               const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K);

// The tensor-core KDA kernels (safe gate in the kernel) on packed sequences: q, k, v [T, H, K] (rounded to bf16 on
// the way in), graw [T, H·K] the f_b output before dt_bias, beta [T, H], A_log [H], dt_bias [H·K], states
// [N, H, K, K] (s_in empty for zeros). Returns o [T, H, K] (bf16 widened); s_out gets the final states.
std::vector<float> kda_chunked_tc(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                  const std::vector<float>& graw, const std::vector<float>& beta,
                                  const std::vector<float>& A_log, const std::vector<float>& dt_bias, float bound,
                                  const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                  const std::vector<float>& s_in, std::vector<float>* s_out);

// Median milliseconds of the tensor-core KDA forward on bf16 device inputs (q, k, v, the raw gate; fp32 beta), the
// safe gate computed in the kernel, as fla's chunk_kda is timed with use_gate_in_kernel; and of its two kernels
// (timed in separate runs). `prepare` and `tv` pick the kernel variants (see cuda::KdaTcTuning).
struct KdaTiming {
  double total_ms, prepare_ms, state_ms;
};
KdaTiming time_kda_forward_tc(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters, int prepare = 2,
                              int tv = 64);
// Selects the tensor-core KDA kernel variants for what follows in this process.
void set_kda_tc_variant(int prepare, int tv);

// Median milliseconds of the KDA forward as the model runs it: the safe gate from raw f_b outputs (A_log,
// dt_bias), then the chunked delta rule, on random device inputs of the given sequence lengths.
double time_kda_forward(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters);

}  // namespace nextlm::cuda_testing
