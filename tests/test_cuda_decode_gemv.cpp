// The decoding GEMVs (src/cuda/gemv.cuh: decode_linear, moe_decode_gemv) against a host reference on the same
// bf16-rounded inputs (fp64 sums), and their batch invariance: a row's output is bitwise the same alone, among other
// rows, at another position, with other experts' rows around it, and through the element-load path. Outputs are
// poisoned with NaN and framed by sentinels (cuda/testing_decode_gemv.h). Runs on a GPU machine (part of test_cuda,
// CTest label "gpu").
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

using cuda_testing::MoeGemvEpilogue;

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

// ---- moe_decode_gemv ----

// A routed problem: experts' row counts, A [n, K] and W [E, N, K] (bf16-rounded).
struct MoeProblem {
  std::vector<int32_t> offsets;
  std::vector<float> A, W;
  int N = 0, K = 0;
  int E() const { return static_cast<int>(offsets.size()) - 1; }
  int64_t n() const { return offsets.back(); }
};

MoeProblem make_moe(const std::vector<int>& rows, int N, int K, float w_scale, unsigned seed) {
  MoeProblem p;
  p.N = N, p.K = K;
  p.offsets.push_back(0);
  for (int r : rows) p.offsets.push_back(p.offsets.back() + r);
  p.A = rounded(test::randn(p.n() * K, seed));
  p.W = rounded(test::randn(size_t(rows.size()) * N * K, seed + 1, w_scale / std::sqrt(float(K))));
  return p;
}

// C [n, N]: each row through its expert's weights, fp64 sums.
std::vector<float> moe_reference(const MoeProblem& p) {
  std::vector<float> c(p.n() * p.N);
  for (int e = 0; e < p.E(); ++e) {
    const int64_t r0 = p.offsets[e], r1 = p.offsets[e + 1];
    const std::vector<float> W(p.W.begin() + int64_t(e) * p.N * p.K, p.W.begin() + int64_t(e + 1) * p.N * p.K);
    const std::vector<float> y = reference(rows_of(p.A, p.K, r0, r1), W, r1 - r0, p.N, p.K);
    std::copy(y.begin(), y.end(), c.begin() + r0 * p.N);
  }
  return c;
}

// act [n, I] = bf16(silu(min(gate, L)) · clamp(up, −L, L)) from the fp32 products C [n, 2I] (moe.cu's swiglu).
std::vector<float> swiglu_reference(const std::vector<float>& c, int64_t n, int64_t I, float L) {
  std::vector<float> act(n * I);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < I; ++j) {
      const float g = std::min(c[r * 2 * I + j], L), u = std::min(std::max(c[r * 2 * I + I + j], -L), L);
      act[r * I + j] = bf16r(g / (1.0f + std::exp(-g)) * u);
    }
  return act;
}

// Experts: empty ones (first, in the middle, last), one row, 5, 40 (a full pass of 32 and 8 more), 33 (32 and 1).
const std::vector<int> kRows{0, 1, 5, 40, 0, 3, 0, 17, 2, 33, 0};
// The same experts 3 and 7 (rows and weights) among other experts' rows.
const std::vector<int> kOtherRows{4, 0, 9, 40, 1, 0, 2, 17, 0, 6, 3};

// The rows of experts 3 and 7 of a kRows problem inside a kOtherRows one (A rows copied over, same weights).
MoeProblem regrouped(const MoeProblem& p, unsigned seed) {
  MoeProblem q = make_moe(kOtherRows, p.N, p.K, 1.0f, seed);
  q.W = p.W;
  for (int e : {3, 7})
    std::copy(p.A.begin() + int64_t(p.offsets[e]) * p.K, p.A.begin() + int64_t(p.offsets[e + 1]) * p.K,
              q.A.begin() + int64_t(q.offsets[e]) * q.K);
  return q;
}

// The output rows of experts 3 and 7 agree bitwise between a problem and its regrouped copy.
void expect_same_rows(const MoeProblem& p, const std::vector<float>& cp, const MoeProblem& q,
                      const std::vector<float>& cq, int64_t cols, const char* what) {
  for (int e : {3, 7}) {
    const int64_t rows = p.offsets[e + 1] - p.offsets[e];
    EXPECT_TRUE(bitwise_equal(cp.data() + p.offsets[e] * cols, cq.data() + q.offsets[e] * cols, rows * cols))
        << what << ": expert " << e << "'s rows changed with the other experts' rows";
  }
}

// N = 1000 (not a multiple of the 16-row tile), K = 1032 (three 64-input blocks a segment, six chains, the last
// segment short); then K = 203 (element loads). fp32 sums of exact products: ~1e-6 relative in norm.
TEST(CudaMoeDecodeGemv, F32MatchesHostReferenceAndDecodeLinear) {
  for (int K : {1032, 203}) {
    const MoeProblem p = make_moe(kRows, 1000, K, 1.0f, 31);
    const std::vector<float> want = moe_reference(p);
    const std::vector<float> got = cuda_testing::moe_decode_gemv(p.A, p.offsets, p.W, p.N, p.K, MoeGemvEpilogue::kF32);
    const double err = test::norm_rel_error(got.data(), want.data(), want.size());
    std::printf("[moe decode gemv] fp32 K=%d: norm rel err %.2e, max rel err %.2e\n", K, err,
                test::max_rel_error(got.data(), want.data(), want.size()));
    EXPECT_LE(err, 1e-5);
    EXPECT_LE(test::max_rel_error(got.data(), want.data(), want.size()), 1e-4);
    // Each expert's rows are decode_linear's result on them, bit for bit (the same summation order).
    for (int e = 0; e < p.E(); ++e) {
      const int64_t r0 = p.offsets[e], r1 = p.offsets[e + 1];
      if (r0 == r1) continue;
      const std::vector<float> W(p.W.begin() + int64_t(e) * p.N * K, p.W.begin() + int64_t(e + 1) * p.N * K);
      const std::vector<float> lin = cuda_testing::decode_linear_gemv(rows_of(p.A, K, r0, r1), W, r1 - r0, p.N, K);
      EXPECT_TRUE(bitwise_equal(lin.data(), got.data() + r0 * p.N, lin.size()))
          << "K=" << K << ": expert " << e << " differs from decode_linear";
    }
    // Other experts' rows change nothing.
    const MoeProblem q = regrouped(p, 41);
    const std::vector<float> gq = cuda_testing::moe_decode_gemv(q.A, q.offsets, q.W, q.N, q.K, MoeGemvEpilogue::kF32);
    expect_same_rows(p, got, q, gq, p.N, "fp32");
    // kF32Add adds to C.
    const std::vector<float> c0 = test::randn(p.n() * p.N, 32);
    const std::vector<float> ga =
        cuda_testing::moe_decode_gemv(p.A, p.offsets, p.W, p.N, p.K, MoeGemvEpilogue::kF32Add, 0.0f, c0);
    std::vector<float> wa(want.size());
    for (size_t i = 0; i < wa.size(); ++i) wa[i] = c0[i] + want[i];
    EXPECT_LE(test::norm_rel_error(ga.data(), wa.data(), wa.size()), 1e-5) << "fp32 add, K=" << K;
  }
}

// bf16 store: one rounding of a sum within ~1e-6 of the reference's, so at most one bf16 ulp on a few elements.
TEST(CudaMoeDecodeGemv, Bf16MatchesHostReference) {
  const MoeProblem p = make_moe(kRows, 136, 520, 1.0f, 51);
  const std::vector<float> want = rounded(moe_reference(p));
  const std::vector<float> got = cuda_testing::moe_decode_gemv(p.A, p.offsets, p.W, p.N, p.K, MoeGemvEpilogue::kBf16);
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[moe decode gemv] bf16: norm rel err %.2e\n", err);
  EXPECT_LE(err, 1e-3);
}

// Fused SwiGLU: I = 500 act columns (N = 1000, gate rows then up rows), K = 2056 (eight chains, chain 0 with the
// 8-input tail as a second segment). Weights scaled so that gate and up are ~N(0, 9) and the clamp L = 4 bites on
// both (checked); act is rounded to bf16 on both sides, so besides the rare one-ulp flip only __expf differs.
TEST(CudaMoeDecodeGemv, SwiGluMatchesHostReference) {
  const int I = 500, K = 2056;
  const float L = 4.0f;
  const MoeProblem p = make_moe(kRows, 2 * I, K, 3.0f, 61);
  const std::vector<float> c = moe_reference(p);
  const std::vector<float> want = swiglu_reference(c, p.n(), I, L);
  int64_t clamped_gate = 0, clamped_up = 0;
  for (int64_t r = 0; r < p.n(); ++r)
    for (int64_t j = 0; j < I; ++j) {
      clamped_gate += c[r * 2 * I + j] > L;
      clamped_up += std::fabs(c[r * 2 * I + I + j]) > L;
    }
  const std::vector<float> got =
      cuda_testing::moe_decode_gemv(p.A, p.offsets, p.W, p.N, p.K, MoeGemvEpilogue::kSwiGLU, L);
  ASSERT_EQ(got.size(), want.size());
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[moe decode gemv] swiglu: norm rel err %.2e, max rel err %.2e (gate clamped %.1f%%, up %.1f%%)\n", err,
              test::max_rel_error(got.data(), want.data(), want.size()), 100.0 * clamped_gate / (p.n() * I),
              100.0 * clamped_up / (p.n() * I));
  EXPECT_GT(clamped_gate, 0);
  EXPECT_GT(clamped_up, 0);
  EXPECT_LE(err, 1e-3);
  EXPECT_LE(test::max_rel_error(got.data(), want.data(), want.size()), 1e-2);
  const MoeProblem q = regrouped(p, 71);
  const std::vector<float> gq =
      cuda_testing::moe_decode_gemv(q.A, q.offsets, q.W, q.N, q.K, MoeGemvEpilogue::kSwiGLU, L);
  expect_same_rows(p, got, q, gq, I, "swiglu");
}

// No rows at all, and rows only in the last expert.
TEST(CudaMoeDecodeGemv, EmptyAndSingleExpert) {
  const MoeProblem none = make_moe({0, 0, 0}, 64, 128, 1.0f, 81);
  EXPECT_TRUE(
      cuda_testing::moe_decode_gemv(none.A, none.offsets, none.W, none.N, none.K, MoeGemvEpilogue::kF32).empty());
  const MoeProblem last = make_moe({0, 0, 3}, 64, 128, 1.0f, 82);
  const std::vector<float> want = moe_reference(last);
  const std::vector<float> got =
      cuda_testing::moe_decode_gemv(last.A, last.offsets, last.W, last.N, last.K, MoeGemvEpilogue::kF32);
  EXPECT_LE(test::norm_rel_error(got.data(), want.data(), want.size()), 1e-5);
}

}  // namespace
}  // namespace nextlm
