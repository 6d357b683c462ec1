// Host-side entry points to the decoding GEMV (decode_linear and decode_linear_multi, src/cuda/decode_linear.cu), for
// tests/test_cuda_decode_gemv.cpp: host vectors in and out, inputs rounded to bf16 on the way in. The output is
// poisoned with NaN first (unless accumulated into) and framed by sentinels that must survive (an Error otherwise),
// so an unwritten element or a write out of bounds shows.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// decode_linear on x [M, in] and W [out, in]: y [M, out]. With y0 non-empty y starts as y0 and the product is added
// (accumulate). misalign: x and W start one bf16 past a 16-byte boundary, which takes the element-load path.
std::vector<float> decode_linear_gemv(const std::vector<float>& x, const std::vector<float>& W, int64_t M,
                                      int64_t out, int64_t in, const std::vector<float>& y0 = {},
                                      bool misalign = false);

// decode_linear_multi over segments i = 0 … n−1, each x_i [M, in_i] against W_i [out_i, in_i] (x_i misaligned by one
// bf16 when misalign[i], which sends the whole launch down the element-load path): the y_i [M, out_i], each framed
// by sentinels and poisoned with NaN as above.
struct GemvSegment {
  std::vector<float> x, W;
  int64_t out, in;
  bool misalign = false;
};
std::vector<std::vector<float>> decode_linear_multi_gemv(const std::vector<GemvSegment>& segs, int64_t M);

}  // namespace nextlm::cuda_testing
