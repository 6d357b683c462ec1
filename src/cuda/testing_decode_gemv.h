// Host-side entry points to the decoding GEMVs (decode_linear in src/cuda/decode.cu, moe_decode_gemv in
// src/cuda/moe_decode.cu), for tests/test_cuda_decode_gemv.cpp: host vectors in and out, inputs rounded to bf16 on the
// way in. Outputs are poisoned with NaN first (unless accumulated into) and framed by sentinels that must survive
// (an Error otherwise), so an unwritten element or a write out of bounds shows; bf16 outputs come back widened.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// decode_linear on x [M, in] and W [out, in]: y [M, out]. With y0 non-empty y starts as y0 and the product is added
// (accumulate). misalign: x and W start one bf16 past a 16-byte boundary, which takes the element-load path.
std::vector<float> decode_linear_gemv(const std::vector<float>& x, const std::vector<float>& W, int64_t M,
                                      int64_t out, int64_t in, const std::vector<float>& y0 = {},
                                      bool misalign = false);

// moe_decode_gemv's epilogues (cuda::GroupedEpilogue).
enum class MoeGemvEpilogue { kF32, kF32Add, kBf16, kSwiGLU };

// moe_decode_gemv on A [n, K] (n = offsets[E]) and W [E, N, K] (each expert in its own allocation), offsets [E+1]:
// C [n, N] (kF32, kF32Add from C0, kBf16) or act [n, N/2] (kSwiGLU with clamp `limit`).
std::vector<float> moe_decode_gemv(const std::vector<float>& A, const std::vector<int32_t>& offsets,
                                   const std::vector<float>& W, int N, int K, MoeGemvEpilogue epilogue,
                                   float limit = 0.0f, const std::vector<float>& C0 = {});

}  // namespace nextlm::cuda_testing
