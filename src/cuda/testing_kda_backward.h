// Host-side entry point to the KDA recurrence backward kernel (src/cuda/kda_backward.cu), for its tests.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

struct KdaBackwardGrads {
  std::vector<float> dq, dk, dv, dg;  // [T, H, K]
  std::vector<float> dbeta;           // [T, H]
};

// cuda::kda_recurrent_backward on packed sequences: q, k, v, g, do_ [T, H, K], beta [T, H], cu_seqlens [N+1]. The
// gradients are added into `init` (uploaded as the output buffers; empty vectors mean zeros). Returns the gradients
// and, in *ms (if given), the kernel's milliseconds (one timed run after an untimed one, which then starts again from
// init).
KdaBackwardGrads kda_recurrent_backward(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, const std::vector<float>& g,
                                        const std::vector<float>& beta, const std::vector<float>& do_,
                                        const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                        const KdaBackwardGrads& init = {}, double* ms = nullptr);

}  // namespace nextlm::cuda_testing
