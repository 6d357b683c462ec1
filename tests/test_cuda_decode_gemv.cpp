// The decoding GEMV (decode_linear on src/cuda/gemv.cuh) against a host reference on the same bf16-rounded inputs
// (fp64 sums), and its batch invariance: a row's output is bitwise the same alone, among other rows, at another
// position, and through the element-load path. Outputs are poisoned with NaN and framed by sentinels
// (cuda/testing_decode_gemv.h). Runs on a GPU machine (part of test_cuda, CTest label "gpu").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/testing_decode_gemv.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace nextlm {
namespace {

float bf16r(float x) { return bf16_to_f32(f32_to_bf16(x)); }

std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = bf16r(x);
  return v;
}

bool bitwise_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// Rows [r0, r1) of a row-major [rows, cols] matrix.
std::vector<float> rows_of(const std::vector<float>& m, int64_t cols, int64_t r0, int64_t r1) {
  return std::vector<float>(m.begin() + r0 * cols, m.begin() + r1 * cols);
}

// y [M, out] = x [M, in] · W [out, in]ᵀ in fp64 (x, W already bf16-rounded: the products are exact in fp32).
std::vector<float> reference(const std::vector<float>& x, const std::vector<float>& W, int64_t M, int64_t out,
                             int64_t in) {
  std::vector<float> y(M * out);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x.data() + m * in;
    for (int64_t n = 0; n < out; ++n) {
      const float* w = W.data() + n * in;
      double s[4] = {0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 4 <= in; i += 4)
        for (int j = 0; j < 4; ++j) s[j] += double(xm[i + j]) * w[i + j];
      for (; i < in; ++i) s[0] += double(xm[i]) * w[i];
      y[m * out + n] = static_cast<float>((s[0] + s[1]) + (s[2] + s[3]));
    }
  }
  return y;
}

// ---- decode_linear ----

struct LinearCase {
  int64_t in, out;
  bool misalign;  // x and W one bf16 off 16-byte alignment: the element-load path
};

void PrintTo(const LinearCase& c, std::ostream* os) {
  *os << c.out << "x" << c.in << (c.misalign ? " misaligned" : "");
}

class CudaDecodeGemv : public ::testing::TestWithParam<LinearCase> {};

// fp32 accumulation of exact bf16 products on both sides, in another order (and tensor-core additions, which
// truncate): ~1e-6 relative in norm at these lengths. A wrong fragment mapping or a lost segment gives O(1).
TEST_P(CudaDecodeGemv, MatchesHostReferenceAndIsBatchInvariant) {
  const LinearCase c = GetParam();
  const int64_t Mmax = 64;
  const std::vector<float> x = rounded(test::randn(Mmax * c.in, 11)),
                           W = rounded(test::randn(c.out * c.in, 12, 1.0f / std::sqrt(float(c.in))));
  const std::vector<float> want = reference(x, W, Mmax, c.out, c.in);
  const std::vector<float> y0 = test::randn(Mmax * c.out, 13);
  for (int64_t M : {1, 3, 8, 17, 64}) {
    const std::vector<float> xm = rows_of(x, c.in, 0, M), wm = rows_of(want, c.out, 0, M);
    const std::vector<float> y = cuda_testing::decode_linear_gemv(xm, W, M, c.out, c.in, {}, c.misalign);
    const double err = test::norm_rel_error(y.data(), wm.data(), wm.size());
    const double max_err = test::max_rel_error(y.data(), wm.data(), wm.size());
    std::printf("[decode gemv] %lldx%lld%s M=%lld: norm rel err %.2e, max rel err %.2e\n",
                static_cast<long long>(c.out), static_cast<long long>(c.in), c.misalign ? " misaligned" : "",
                static_cast<long long>(M), err, max_err);
    EXPECT_LE(err, 1e-5) << "M=" << M;
    EXPECT_LE(max_err, 1e-4) << "M=" << M;
    // accumulate: y = y0 + x·Wᵀ.
    const std::vector<float> y0m = rows_of(y0, c.out, 0, M);
    const std::vector<float> ya = cuda_testing::decode_linear_gemv(xm, W, M, c.out, c.in, y0m, c.misalign);
    std::vector<float> wa(wm.size());
    for (size_t i = 0; i < wa.size(); ++i) wa[i] = y0m[i] + wm[i];
    EXPECT_LE(test::norm_rel_error(ya.data(), wa.data(), wa.size()), 1e-5) << "accumulate, M=" << M;
  }
  // Batch invariance: rows of M = 17, alone, and copied to another position of M = 64.
  const std::vector<float> x17 = rows_of(x, c.in, 0, 17);
  const std::vector<float> y17 = cuda_testing::decode_linear_gemv(x17, W, 17, c.out, c.in, {}, c.misalign);
  for (int64_t m : {0, 9, 16}) {
    const std::vector<float> row = rows_of(x, c.in, m, m + 1);
    const std::vector<float> alone = cuda_testing::decode_linear_gemv(row, W, 1, c.out, c.in, {}, c.misalign);
    EXPECT_TRUE(bitwise_equal(alone.data(), y17.data() + m * c.out, c.out)) << "row " << m << ": alone vs M=17";
    const int64_t at = 45 - m;
    std::vector<float> x64 = x;
    std::copy(row.begin(), row.end(), x64.begin() + at * c.in);
    const std::vector<float> y64 = cuda_testing::decode_linear_gemv(x64, W, 64, c.out, c.in, {}, c.misalign);
    EXPECT_TRUE(bitwise_equal(alone.data(), y64.data() + at * c.out, c.out))
        << "row " << m << ": alone vs row " << at << " of M=64";
  }
  // The load path changes no bit: element loads (misaligned buffers) give the 16-byte loads' result.
  if (c.in % 8 == 0) {
    const std::vector<float> other = cuda_testing::decode_linear_gemv(x17, W, 17, c.out, c.in, {}, !c.misalign);
    EXPECT_TRUE(bitwise_equal(other.data(), y17.data(), y17.size())) << "16-byte vs element loads";
  }
}

// The slice's shapes scaled down in `out`: in = 4096 (hidden), 2048 (expert intermediate), 200 (short, one partial
// segment) and 203 (not a multiple of 8: element loads); out = 1000, 4096, 8191 (partial last tile).
std::vector<LinearCase> linear_cases() {
  std::vector<LinearCase> v;
  for (int64_t in : {4096, 2048, 200})
    for (int64_t out : {1000, 4096, 8191}) v.push_back({in, out, false});
  v.push_back({200, 8191, true});
  v.push_back({203, 1000, false});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeGemv, ::testing::ValuesIn(linear_cases()),
                         [](const ::testing::TestParamInfo<LinearCase>& i) {
                           return std::to_string(i.param.out) + "x" + std::to_string(i.param.in) +
                                  (i.param.misalign ? "_misaligned" : "");
                         });

// The split's corner cases (gemv.cuh): one segment with eight tiles per block (in ≤ 64), two and three chains (two
// warps idle), five chains with a 3-block segment, a chain of two segments with a short tail, and several of
// them; out below one tile; M = 0.
TEST(CudaDecodeGemvSplit, SmallShapesMatchHostReference) {
  for (int64_t in : {8, 64, 72, 136, 200, 520, 1000, 1544, 4104, 8200})
    for (int64_t out : {1, 5, 37}) {
      const int64_t M = 40;
      const std::vector<float> x = rounded(test::randn(M * in, 21)), W = rounded(test::randn(out * in, 22));
      const std::vector<float> want = reference(x, W, M, out, in);
      const std::vector<float> y = cuda_testing::decode_linear_gemv(x, W, M, out, in);
      EXPECT_LE(test::norm_rel_error(y.data(), want.data(), want.size()), 1e-5) << out << "x" << in;
      const std::vector<float> alone = cuda_testing::decode_linear_gemv(rows_of(x, in, 39, 40), W, 1, out, in);
      EXPECT_TRUE(bitwise_equal(alone.data(), y.data() + 39 * out, out)) << out << "x" << in << ": row 39 alone";
    }
  EXPECT_TRUE(cuda_testing::decode_linear_gemv({}, rounded(test::randn(37 * 64, 23)), 0, 37, 64).empty());
}

// decode_linear_multi: segments of different widths (one split each, several chains or one), output counts below,
// at and across tile and row-group boundaries, in one launch, for one row, a few and more than a pass of 32; each
// segment's output is bitwise what decode_linear gives for it alone, and one misaligned input sends the whole launch
// down the element-load path with the same bits. An empty segment is skipped.
TEST(CudaDecodeGemvMulti, SegmentsEqualSeparateLaunchesBitwise) {
  struct Shape {
    int64_t out, in;
  };
  const std::vector<Shape> shapes{{1000, 520}, {37, 1544}, {16, 64}, {0, 72}, {129, 4104}, {5, 136}};
  for (int64_t M : {1, 7, 40})
    for (bool misalign : {false, true}) {
      std::vector<cuda_testing::GemvSegment> segs;
      unsigned seed = 300 + static_cast<unsigned>(M);
      for (const Shape& sh : shapes)
        segs.push_back({rounded(test::randn(M * sh.in, ++seed)), rounded(test::randn(sh.out * sh.in, ++seed)), sh.out,
                        sh.in, misalign && sh.out == 37});
      const std::vector<std::vector<float>> ys = cuda_testing::decode_linear_multi_gemv(segs, M);
      ASSERT_EQ(ys.size(), segs.size());
      for (size_t i = 0; i < segs.size(); ++i) {
        const auto& sg = segs[i];
        const std::string at = "M=" + std::to_string(M) + " segment " + std::to_string(i) + (misalign ? " misaligned" : "");
        const std::vector<float> one = cuda_testing::decode_linear_gemv(sg.x, sg.W, M, sg.out, sg.in);
        ASSERT_EQ(ys[i].size(), one.size()) << at;
        EXPECT_TRUE(bitwise_equal(ys[i].data(), one.data(), one.size())) << at;
        const std::vector<float> want = reference(sg.x, sg.W, M, sg.out, sg.in);
        EXPECT_LE(test::norm_rel_error(ys[i].data(), want.data(), want.size()), 1e-5) << at;
      }
    }
}

}  // namespace
}  // namespace nextlm
