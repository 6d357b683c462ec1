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

// Median milliseconds of the KDA forward as the model runs it: the safe gate from raw f_b outputs (A_log,
// dt_bias), then the chunked delta rule, on random device inputs of the given sequence lengths.
double time_kda_forward(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters);

}  // namespace nextlm::cuda_testing
