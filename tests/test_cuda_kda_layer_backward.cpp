// The CUDA KDA layer backward outside the recurrence (src/cuda/kda_layer_backward.cu) against the CPU: each kernel
// against plain loops that restate the CPU's gradient (the CPU helpers of kda_backward.cpp are file-local) or the
// exposed rmsnorm_backward, on packed sequences of uneven lengths, accumulating into non-zero buffers; then the
// composition against kda_layer_backward's parameter gradients.
//
// Tolerance: fp32 against fp32, differing only in summation order and in the float/double width of the row sums, so
// ‖gpu − cpu‖/‖cpu‖ ≤ 1e-4 per output; a wrong term, index or sequence boundary gives O(0.1) or more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "cuda/testing_kda_layer_backward.h"
#include "io/safetensors.h"
#include "model/backward.h"
#include "model/kda.h"
#include "model/norm.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr double kTol = 1e-4;

std::vector<int64_t> cu_of(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

#define EXPECT_CLOSE(got, want)                                                                     \
  do {                                                                                              \
    ASSERT_EQ((got).size(), (want).size()) << #got;                                                 \
    EXPECT_TRUE(all_finite(got)) << #got;                                                           \
    EXPECT_LE(test::norm_rel_error((got).data(), (want).data(), (want).size()), kTol) << #got;      \
  } while (0)

double silu_grad(double x) {
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s * (1.0 + x * (1.0 - s));
}

// ---- conv + SiLU + L2 norm --------------------------------------------------------------------------------------

// The CPU gradient of kda_conv_norm in its layouts (raw [T, 3·HK], conv [3·HK, W]): the steps of kda_layer_backward's
// branch (l2norm_backward with scale K^-1/2 for q and 1 for k, none for v; silu_grad; causal_conv_backward).
void conv_norm_backward_ref(const std::vector<float>& raw, const std::vector<float>& conv,
                            const std::vector<int64_t>& cu, const std::vector<float>& dq, const std::vector<float>& dk,
                            const std::vector<float>& dv, std::vector<float>& draw, std::vector<float>& dconv,
                            int64_t H, int64_t K, int64_t W) {
  const int64_t T = cu.back(), HK = H * K, C3 = 3 * HK;
  std::vector<double> pre(T * C3, 0.0), dpre(T * C3, 0.0);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
      for (int64_t ch = 0; ch < C3; ++ch)
        for (int64_t i = 0; i < W; ++i) {
          const int64_t src = t + i - (W - 1);
          if (src >= cu[n]) pre[t * C3 + ch] += double(conv[ch * W + i]) * raw[src * C3 + ch];
        }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t which = 0; which < 3; ++which)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t c0 = t * C3 + which * HK + h * K;
        const float* dy = (which == 0 ? dq : which == 1 ? dk : dv).data() + (t * H + h) * K;
        std::vector<double> act(K);
        double ss = 0.0, dot = 0.0;
        for (int64_t d = 0; d < K; ++d) {
          act[d] = pre[c0 + d] / (1.0 + std::exp(-pre[c0 + d]));
          ss += act[d] * act[d];
          dot += dy[d] * act[d];
        }
        const double n = std::sqrt(ss + 1e-6), scale = which == 0 ? 1.0 / std::sqrt(double(K)) : 1.0;
        for (int64_t d = 0; d < K; ++d) {
          const double dact = which < 2 ? scale * (dy[d] / n - act[d] * dot / (n * n * n)) : dy[d];
          dpre[c0 + d] = dact * silu_grad(pre[c0 + d]);
        }
      }
  std::vector<double> dx(draw.begin(), draw.end()), dw(dconv.begin(), dconv.end());
  for (int64_t ch = 0; ch < C3; ++ch)
    for (size_t n = 0; n + 1 < cu.size(); ++n)
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
        for (int64_t i = 0; i < W; ++i) {
          const int64_t src = t + i - (W - 1);
          if (src < cu[n]) continue;
          dw[ch * W + i] += dpre[t * C3 + ch] * raw[src * C3 + ch];
          dx[src * C3 + ch] += dpre[t * C3 + ch] * conv[ch * W + i];
        }
  draw.assign(dx.begin(), dx.end());
  dconv.assign(dw.begin(), dw.end());
}

struct ConvCase {
  std::vector<int64_t> lens;
  int64_t K;
  int64_t W = 4;  // conv taps (the kernel is compiled per tap count)
};
class CudaBackwardKdaLayerConv : public ::testing::TestWithParam<ConvCase> {};

TEST_P(CudaBackwardKdaLayerConv, ConvNormMatchesCpu) {
  const int64_t H = 3, K = GetParam().K, W = GetParam().W, HK = H * K, C3 = 3 * HK;
  const std::vector<int64_t> cu = cu_of(GetParam().lens);
  const int64_t T = cu.back();
  const std::vector<float> raw = test::randn(T * C3, 1), conv = test::randn(C3 * W, 2, 0.5f);
  const std::vector<float> dq = test::randn(T * HK, 3), dk = test::randn(T * HK, 4), dv = test::randn(T * HK, 5);
  std::vector<float> draw = test::randn(T * C3, 6), dconv = test::randn(C3 * W, 7);
  std::vector<float> draw_ref = draw, dconv_ref = dconv;
  cuda_testing::kda_conv_norm_backward(raw, conv, cu, dq, dk, dv, draw, dconv, H, K, W);
  conv_norm_backward_ref(raw, conv, cu, dq, dk, dv, draw_ref, dconv_ref, H, K, W);
  EXPECT_CLOSE(draw, draw_ref);
  EXPECT_CLOSE(dconv, dconv_ref);
  // The accumulation alone would hide a small gradient: compare the increments too.
  const std::vector<float> draw0 = test::randn(T * C3, 6), dconv0 = test::randn(C3 * W, 7);
  std::vector<float> inc(draw.size()), inc_ref(draw.size());
  for (size_t i = 0; i < inc.size(); ++i) inc[i] = draw[i] - draw0[i], inc_ref[i] = draw_ref[i] - draw0[i];
  EXPECT_LE(test::norm_rel_error(inc.data(), inc_ref.data(), inc.size()), kTol);
  std::vector<float> winc(dconv.size()), winc_ref(dconv.size());
  for (size_t i = 0; i < winc.size(); ++i) winc[i] = dconv[i] - dconv0[i], winc_ref[i] = dconv_ref[i] - dconv0[i];
  EXPECT_LE(test::norm_rel_error(winc.data(), winc_ref.data(), winc.size()), kTol);
  // draw written in bf16 (as training runs it): the fp32 form's gradient from zero, rounded; dconv as before.
  std::vector<float> from0(T * C3, 0.0f), dconv_a = dconv0, dconv_b = dconv0;
  cuda_testing::kda_conv_norm_backward(raw, conv, cu, dq, dk, dv, from0, dconv_a, H, K, W);
  const std::vector<uint16_t> d16 = cuda_testing::kda_conv_norm_backward_bf16(raw, conv, cu, dq, dk, dv, dconv_b, H,
                                                                              K, W);
  ASSERT_EQ(d16.size(), from0.size());
  int64_t differ = 0;
  for (size_t i = 0; i < d16.size(); ++i) differ += bf16_to_f32(d16[i]) != bf16_to_f32(f32_to_bf16(from0[i]));
  EXPECT_EQ(differ, 0) << "bf16 draw elements that are not the rounded fp32 gradient";
  EXPECT_EQ(dconv_a, dconv_b);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackwardKdaLayerConv,
                         // At 4 taps, K 16, 64, 128 and 256: the dpre kernel's four register widths.
                         ::testing::Values(ConvCase{{1, 3, 17, 100}, 16}, ConvCase{{1, 3, 17, 100}, 128},
                                           ConvCase{{5, 2000, 1, 63}, 128}, ConvCase{{70, 1, 60}, 64},
                                           ConvCase{{1, 3, 17, 100}, 256}, ConvCase{{1, 3, 17, 100}, 16, 1},
                                           ConvCase{{1, 3, 17, 100}, 16, 2}, ConvCase{{2, 3, 170, 1}, 32, 3},
                                           ConvCase{{1, 3, 17, 100}, 16, 8}),
                         [](const auto& info) {
                           return "K" + std::to_string(info.param.K) + "_T" +
                                  std::to_string(cu_of(info.param.lens).back()) + "_W" +
                                  std::to_string(info.param.W);
                         });

// At 4 taps one kernel forms dpre in registers; it must give the two-kernel path's bits exactly (draw added to in
// fp32 or written in bf16, dconv), and the same draw without dconv (a frozen conv). The shapes cover every register
// width, sequence starts inside and at the edges of the per-channel token ranges, and T = 8193, whose last range is
// empty (num_parts caps the ranges at 128 of 65 tokens).
TEST(CudaBackwardKdaLayer, ConvNormFusedGivesTheTwoPassBits) {
  const struct {
    std::vector<int64_t> lens;
    int64_t H, K;
  } cases[] = {{{1, 3, 17, 100}, 3, 16}, {{70, 1, 60}, 2, 64}, {{5, 130, 1, 63}, 3, 128},
               {{64, 64, 3, 1}, 2, 256}, {{8000, 193}, 1, 16}};
  constexpr int64_t W = 4;
  for (const auto& c : cases) {
    SCOPED_TRACE("K " + std::to_string(c.K) + " T " + std::to_string(cu_of(c.lens).back()));
    const std::vector<int64_t> cu = cu_of(c.lens);
    const int64_t T = cu.back(), HK = c.H * c.K, C3 = 3 * HK;
    const std::vector<float> raw = test::randn(T * C3, 11), conv = test::randn(C3 * W, 12, 0.5f);
    const std::vector<float> dq = test::randn(T * HK, 13), dk = test::randn(T * HK, 14), dv = test::randn(T * HK, 15);
    std::vector<float> draw_f = test::randn(T * C3, 16), draw_t = draw_f;
    std::vector<float> dconv_f = test::randn(C3 * W, 17), dconv_t = dconv_f;
    cuda_testing::kda_conv_norm_backward(raw, conv, cu, dq, dk, dv, draw_f, dconv_f, c.H, c.K, W);
    cuda_testing::kda_conv_norm_backward(raw, conv, cu, dq, dk, dv, draw_t, dconv_t, c.H, c.K, W, true);
    ASSERT_TRUE(all_finite(draw_f) && all_finite(dconv_f));
    EXPECT_EQ(draw_f, draw_t);
    EXPECT_EQ(dconv_f, dconv_t);
    std::vector<float> dconv16_f = dconv_f, dconv16_t = dconv_f, frozen;
    const std::vector<uint16_t> d16_f =
        cuda_testing::kda_conv_norm_backward_bf16(raw, conv, cu, dq, dk, dv, dconv16_f, c.H, c.K, W);
    const std::vector<uint16_t> d16_t =
        cuda_testing::kda_conv_norm_backward_bf16(raw, conv, cu, dq, dk, dv, dconv16_t, c.H, c.K, W, true);
    const std::vector<uint16_t> d16_frozen =
        cuda_testing::kda_conv_norm_backward_bf16(raw, conv, cu, dq, dk, dv, frozen, c.H, c.K, W);
    EXPECT_EQ(d16_f, d16_t);
    EXPECT_EQ(d16_f, d16_frozen);
    EXPECT_EQ(dconv16_f, dconv16_t);
    EXPECT_TRUE(frozen.empty());
  }
}

TEST(CudaBackwardKdaLayer, ConvNormEmptyIsNoOp) {
  std::vector<float> draw, dconv = test::randn(3 * 2 * 16 * 4, 8);
  const std::vector<float> dconv0 = dconv;
  cuda_testing::kda_conv_norm_backward({}, test::randn(3 * 2 * 16 * 4, 9), {0}, {}, {}, {}, draw, dconv, 2, 16, 4);
  EXPECT_TRUE(draw.empty());
  EXPECT_EQ(dconv, dconv0);
}

// ---- the decay gate ---------------------------------------------------------------------------------------------

struct GateCase {
  int64_t T, K;
  bool has_bound;
};
class CudaBackwardKdaLayerGate : public ::testing::TestWithParam<GateCase> {};

TEST_P(CudaBackwardKdaLayerGate, MatchesCpu) {
  const int64_t T = GetParam().T, H = 3, K = GetParam().K, HK = H * K;
  const bool has_bound = GetParam().has_bound;
  const float bound = -5.0f;
  std::vector<float> f = test::randn(T * HK, 11, 2.0f);
  // Past the softplus cutoff (f + dt_bias > 20) on some columns of some tokens, a few past where exp(f) overflows
  // (f > 88), so that a missing cutoff gives inf.
  for (int64_t i = 0; i < T * HK; i += 7) f[i] = 25.0f + f[i];
  for (int64_t i = 3; i < T * HK; i += 11) f[i] = 100.0f + f[i];
  const std::vector<float> dt_bias = test::randn(HK, 12, 0.5f), A_log = test::randn(H, 13, 0.5f),
                           dg = test::randn(T * HK, 14);
  std::vector<float> ddt = test::randn(HK, 15), dA = test::randn(H, 16);
  std::vector<double> ddt_ref(ddt.begin(), ddt.end()), dA_ref(dA.begin(), dA.end());
  std::vector<float> df_ref(T * HK);
  // kda_layer_backward's loop, with x.f = f + dt_bias and x.g recomputed as kda_layer_forward_train makes it.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float rate = std::exp(A_log[h]);
      for (int64_t d = 0; d < K; ++d) {
        const int64_t i = t * HK + h * K + d;
        const float x = f[i] + dt_bias[h * K + d];
        if (has_bound) {
          const float sg = sigmoidf(rate * x);
          const float dz = dg[i] * bound * sg * (1.0f - sg);
          df_ref[i] = dz * rate;
          dA_ref[h] += double(dz) * rate * x;
        } else {
          const float g = -rate * (x > 20.0f ? x : std::log(1.0f + std::exp(x)));
          df_ref[i] = -dg[i] * rate * (x > 20.0f ? 1.0f : sigmoidf(x));
          dA_ref[h] += double(dg[i]) * g;
        }
        ddt_ref[h * K + d] += df_ref[i];
      }
    }
  const std::vector<float> ddt0 = ddt, dA0 = dA;
  const std::vector<float> df = cuda_testing::kda_gate_backward(f, dt_bias, A_log, dg, ddt, dA, T, H, K, has_bound,
                                                                bound);
  EXPECT_CLOSE(df, df_ref);
  EXPECT_CLOSE(ddt, std::vector<float>(ddt_ref.begin(), ddt_ref.end()));
  EXPECT_CLOSE(dA, std::vector<float>(dA_ref.begin(), dA_ref.end()));
  // df in bf16 instead (training's form, the f_b GEMMs' operand): the fp32 df's bits rounded to nearest even, and
  // the same reductions.
  std::vector<float> ddt16 = ddt0, dA16 = dA0;
  std::vector<uint16_t> df16;
  cuda_testing::kda_gate_backward(f, dt_bias, A_log, dg, ddt16, dA16, T, H, K, has_bound, bound, &df16);
  ASSERT_EQ(df16.size(), df.size());
  size_t differ = 0;
  for (size_t i = 0; i < df.size(); ++i) differ += df16[i] != f32_to_bf16(df[i]);
  EXPECT_EQ(differ, 0u);
  EXPECT_EQ(ddt16, ddt);
  EXPECT_EQ(dA16, dA);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackwardKdaLayerGate,
                         ::testing::Values(GateCase{121, 16, true}, GateCase{121, 16, false},
                                           GateCase{121, 128, true}, GateCase{121, 128, false},
                                           GateCase{9001, 128, true}, GateCase{9001, 128, false},
                                           GateCase{1, 16, false}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_K" + std::to_string(info.param.K) +
                                  (info.param.has_bound ? "_bound" : "_softplus");
                         });

// ---- sigmoid ----------------------------------------------------------------------------------------------------

TEST(CudaBackwardKdaLayer, SigmoidBackwardMatchesCpu) {
  const int64_t n = 70001;
  std::vector<float> y = test::randn(n, 21, 2.0f);
  for (float& v : y) v = sigmoidf(v);
  const std::vector<float> d = test::randn(n, 22);
  std::vector<float> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = d[i] * y[i] * (1.0f - y[i]);
  const std::vector<float> got = cuda_testing::sigmoid_backward(y, d);
  EXPECT_CLOSE(got, ref);
}

// ---- the gated output norm --------------------------------------------------------------------------------------

struct OutNormCase {
  int64_t T, K;
};
class CudaBackwardKdaLayerOutNorm : public ::testing::TestWithParam<OutNormCase> {};

TEST_P(CudaBackwardKdaLayerOutNorm, MatchesCpu) {
  const int64_t T = GetParam().T, H = 3, K = GetParam().K, n = T * H * K;
  const float eps = 1e-6f;
  const std::vector<float> o = test::randn(n, 31), gate = test::randn(n, 32, 2.0f), don = test::randn(n, 34);
  std::vector<float> w = test::randn(K, 33, 0.2f);
  for (float& v : w) v += 1.0f;
  std::vector<float> do_ = test::randn(n, 35), dw = test::randn(K, 36);
  std::vector<float> do_ref = do_, dw_ref = dw;
  // kda_layer_backward's steps.
  std::vector<float> normed(n), dnormed(n), dgate_ref(n);
  rmsnorm_forward(o.data(), w.data(), normed.data(), T * H, K, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float sg = sigmoidf(gate[i]);
    dnormed[i] = don[i] * sg;
    dgate_ref[i] = don[i] * normed[i] * sg * (1.0f - sg);
  }
  rmsnorm_backward(o.data(), w.data(), dnormed.data(), T * H, K, eps, do_ref.data(), dw_ref.data());
  const std::vector<float> do0 = do_;
  const std::vector<float> dgate = cuda_testing::kda_out_norm_backward(o, gate, w, don, do_, dw, T, H, K, eps);
  EXPECT_CLOSE(dgate, dgate_ref);
  EXPECT_CLOSE(do_, do_ref);
  EXPECT_CLOSE(dw, dw_ref);
  // Written instead of added to (training's form): every element, and the sum the added form put on top of do0.
  std::vector<float> written(n), dw2 = dw;
  cuda_testing::kda_out_norm_backward(o, gate, w, don, written, dw2, T, H, K, eps, true);
  std::vector<float> added(n);
  for (int64_t i = 0; i < n; ++i) added[i] = do_[i] - do0[i];
  EXPECT_CLOSE(written, added);
  // o in bf16 (the tensor-core recurrence's output, as training passes it): the fp32 form's bits on the widened
  // values.
  std::vector<float> o_r(n);
  for (int64_t i = 0; i < n; ++i) o_r[i] = bf16_to_f32(f32_to_bf16(o[i]));
  std::vector<float> do_a = do0, dw_a = dw, do_b = do0, dw_b = dw;
  const std::vector<float> dgate_a = cuda_testing::kda_out_norm_backward(o_r, gate, w, don, do_a, dw_a, T, H, K, eps),
                           dgate_b = cuda_testing::kda_out_norm_backward(o, gate, w, don, do_b, dw_b, T, H, K, eps,
                                                                         false, true);
  EXPECT_EQ(std::memcmp(dgate_a.data(), dgate_b.data(), n * sizeof(float)), 0) << "dgate";
  EXPECT_EQ(std::memcmp(do_a.data(), do_b.data(), n * sizeof(float)), 0) << "do";
  EXPECT_EQ(std::memcmp(dw_a.data(), dw_b.data(), K * sizeof(float)), 0) << "dw";
  // dgate in bf16 instead (training's form, the g_b GEMMs' operand): the fp32 dgate's bits rounded to nearest even,
  // do and dw the same bits.
  std::vector<float> do_c = do0, dw_c = dw;
  std::vector<uint16_t> dgate16;
  cuda_testing::kda_out_norm_backward(o, gate, w, don, do_c, dw_c, T, H, K, eps, false, true, &dgate16);
  ASSERT_EQ(dgate16.size(), dgate_b.size());
  size_t differ = 0;
  for (size_t i = 0; i < dgate_b.size(); ++i) differ += dgate16[i] != f32_to_bf16(dgate_b[i]);
  EXPECT_EQ(differ, 0u);
  EXPECT_EQ(std::memcmp(do_c.data(), do_b.data(), n * sizeof(float)), 0) << "do with bf16 dgate";
  EXPECT_EQ(std::memcmp(dw_c.data(), dw_b.data(), K * sizeof(float)), 0) << "dw with bf16 dgate";
  // dO in bf16 too, written (training's form with the KDA backward's bf16 products, which read only its roundings):
  // the written fp32 dO's bits rounded to nearest even.
  std::vector<float> written_b(n), unused(n), dw_d = dw, dw_e = dw;
  std::vector<uint16_t> dgate16_e, do16;
  cuda_testing::kda_out_norm_backward(o, gate, w, don, written_b, dw_d, T, H, K, eps, true, true);
  cuda_testing::kda_out_norm_backward(o, gate, w, don, unused, dw_e, T, H, K, eps, true, true, &dgate16_e, &do16);
  ASSERT_EQ(do16.size(), written_b.size());
  differ = 0;
  for (size_t i = 0; i < written_b.size(); ++i) differ += do16[i] != f32_to_bf16(written_b[i]);
  EXPECT_EQ(differ, 0u) << "bf16 dO";
  EXPECT_EQ(dgate16_e, dgate16) << "dgate with bf16 dO";
  EXPECT_EQ(std::memcmp(dw_e.data(), dw_d.data(), K * sizeof(float)), 0) << "dw with bf16 dO";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackwardKdaLayerOutNorm,
                         ::testing::Values(OutNormCase{1, 16}, OutNormCase{121, 16}, OutNormCase{121, 128},
                                           OutNormCase{3001, 128}, OutNormCase{77, 48}, OutNormCase{77, 200}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_K" + std::to_string(info.param.K);
                         });

// ---- the composition against kda_layer_backward -----------------------------------------------------------------

Tensor rand_tensor(std::vector<int64_t> shape, unsigned seed, float scale, float offset = 0.0f) {
  Tensor t(std::move(shape));
  t.data = test::randn(t.data.size(), seed, scale);
  for (float& x : t.data) x += offset;
  return t;
}

class CudaBackwardKdaLayerComposition : public ::testing::TestWithParam<bool> {};

// The GPU kernels chained with the CPU's linears and recurrence backward give kda_layer_backward's parameter
// gradients: o_norm, g_b (through dgate), A_log, dt_bias, f_b (through df), b_proj (through the β sigmoid), the
// three convs, and the q/k/v projections (through draw).
TEST_P(CudaBackwardKdaLayerComposition, MatchesKdaLayerBackward) {
  ModelConfig c;
  c.hidden_size = 24;
  c.linear_num_heads = 3;
  c.linear_head_dim = 16;
  c.linear_conv_kernel_dim = 4;
  if (!GetParam()) c.linear_lower_bound.reset();
  const int64_t D = c.hidden_size, H = 3, K = 16, HK = H * K, W = 4, C3 = 3 * HK;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const std::vector<int64_t> cu = cu_of({1, 3, 17, 100});
  const int64_t T = cu.back(), n = T * HK;
  KdaWeights w;
  const float ws = 1.0f / std::sqrt(static_cast<float>(D)), ks = 1.0f / std::sqrt(static_cast<float>(K));
  w.q_proj = rand_tensor({HK, D}, 40, ws);
  w.k_proj = rand_tensor({HK, D}, 41, ws);
  w.v_proj = rand_tensor({HK, D}, 42, ws);
  w.q_conv = rand_tensor({HK, W}, 43, 0.5f);
  w.k_conv = rand_tensor({HK, W}, 44, 0.5f);
  w.v_conv = rand_tensor({HK, W}, 45, 0.5f);
  w.f_a = rand_tensor({K, D}, 46, ws);
  w.f_b = rand_tensor({HK, K}, 47, ks);
  w.dt_bias = rand_tensor({HK}, 48, 0.5f);
  w.A_log = rand_tensor({H}, 49, 0.5f);
  w.b_proj = rand_tensor({H, D}, 50, ws);
  w.g_a = rand_tensor({K, D}, 51, ws);
  w.g_b = rand_tensor({HK, K}, 52, ks);
  w.o_norm = rand_tensor({K}, 53, 0.2f, 1.0f);
  w.o_proj = rand_tensor({D, HK}, 54, 1.0f / std::sqrt(static_cast<float>(HK)));
  const Tensor a = rand_tensor({T, D}, 55, 1.0f);
  const std::vector<float> dy = test::randn(T * D, 56);

  KdaActs x;
  std::vector<float> y(T * D), da(T * D, 0.0f);
  kda_layer_forward_train(w, c, a.ptr(), T, cu, x, y.data());
  KdaWeights ref = zeros_like(w), got = zeros_like(w);
  kda_layer_backward(w, c, a.ptr(), T, cu, x, dy.data(), da.data(), ref);

  // on → o, gate
  std::vector<float> don(n, 0.0f), dO(n, 0.0f);
  cpu::linear_backward(x.on.data(), T, HK, w.o_proj, dy.data(), don.data(), nullptr);
  const std::vector<float> dgate =
      cuda_testing::kda_out_norm_backward(x.o, x.gate, w.o_norm.data, don, dO, got.o_norm.data, T, H, K, eps);
  cpu::linear_backward(x.ga.data(), T, K, w.g_b, dgate.data(), nullptr, &got.g_b);

  // The recurrence on the CPU, from the GPU's dO.
  std::vector<float> dq(n, 0.0f), dk(n, 0.0f), dv(n, 0.0f), dg(n, 0.0f), dbeta(T * H, 0.0f);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t t0 = cu[s], off = t0 * HK + h * K;
      KdaSeq seq{x.q.data() + off, x.k.data() + off, x.v.data() + off, x.g.data() + off,
                 x.beta.data() + t0 * H + h, cu[s + 1] - t0, K, HK, H, nullptr};
      kda_recurrent_backward(seq, dO.data() + off, dq.data() + off, dk.data() + off, dv.data() + off,
                             dg.data() + off, dbeta.data() + t0 * H + h);
    }

  // β = sigmoid(b_proj·a)
  dbeta = cuda_testing::sigmoid_backward(x.beta, dbeta);
  cpu::linear_backward(a.ptr(), T, D, w.b_proj, dbeta.data(), nullptr, &got.b_proj);

  // The gate from the f_b output (before dt_bias).
  std::vector<float> fb(n);
  cpu::linear(x.fa.data(), T, K, w.f_b, fb.data());
  const bool has_bound = c.linear_lower_bound.has_value();
  const float bound = static_cast<float>(c.linear_lower_bound.value_or(0.0));
  const std::vector<float> df = cuda_testing::kda_gate_backward(fb, w.dt_bias.data, w.A_log.data, dg, got.dt_bias.data,
                                                                got.A_log.data, T, H, K, has_bound, bound);
  cpu::linear_backward(x.fa.data(), T, K, w.f_b, df.data(), nullptr, &got.f_b);

  // The convs, in kda_conv_norm's layouts.
  std::vector<float> raw(T * C3), conv(C3 * W), draw(T * C3, 0.0f), dconv(C3 * W, 0.0f);
  const std::vector<float>* raws[3] = {&x.q_raw, &x.k_raw, &x.v_raw};
  const Tensor* convs[3] = {&w.q_conv, &w.k_conv, &w.v_conv};
  for (int j = 0; j < 3; ++j) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t ch = 0; ch < HK; ++ch) raw[t * C3 + j * HK + ch] = (*raws[j])[t * HK + ch];
    for (int64_t i = 0; i < HK * W; ++i) conv[j * HK * W + i] = convs[j]->data[i];
  }
  cuda_testing::kda_conv_norm_backward(raw, conv, cu, dq, dk, dv, draw, dconv, H, K, W);
  Tensor* dconvs[3] = {&got.q_conv, &got.k_conv, &got.v_conv};
  Tensor* dprojs[3] = {&got.q_proj, &got.k_proj, &got.v_proj};
  const Tensor* projs[3] = {&w.q_proj, &w.k_proj, &w.v_proj};
  for (int j = 0; j < 3; ++j) {
    std::vector<float> dr(n);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t ch = 0; ch < HK; ++ch) dr[t * HK + ch] = draw[t * C3 + j * HK + ch];
    for (int64_t i = 0; i < HK * W; ++i) dconvs[j]->data[i] = dconv[j * HK * W + i];
    cpu::linear_backward(a.ptr(), T, D, *projs[j], dr.data(), nullptr, dprojs[j]);
  }

  EXPECT_CLOSE(got.o_norm.data, ref.o_norm.data);
  EXPECT_CLOSE(got.g_b.data, ref.g_b.data);
  EXPECT_CLOSE(got.b_proj.data, ref.b_proj.data);
  EXPECT_CLOSE(got.A_log.data, ref.A_log.data);
  EXPECT_CLOSE(got.dt_bias.data, ref.dt_bias.data);
  EXPECT_CLOSE(got.f_b.data, ref.f_b.data);
  EXPECT_CLOSE(got.q_conv.data, ref.q_conv.data);
  EXPECT_CLOSE(got.k_conv.data, ref.k_conv.data);
  EXPECT_CLOSE(got.v_conv.data, ref.v_conv.data);
  EXPECT_CLOSE(got.q_proj.data, ref.q_proj.data);
  EXPECT_CLOSE(got.k_proj.data, ref.k_proj.data);
  EXPECT_CLOSE(got.v_proj.data, ref.v_proj.data);
}

INSTANTIATE_TEST_SUITE_P(Gates, CudaBackwardKdaLayerComposition, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? std::string("bound") : std::string("softplus"); });

}  // namespace
}  // namespace nextlm
