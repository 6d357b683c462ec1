// The mHC, RMSNorm and stream-mean-norm backward kernels (src/cuda/mhc_backward.cu) against the CPU backward
// (src/model/mhc_backward.cpp, norm_backward.cpp, head_backward.cpp's final norm), all fp32.
//
// Every gradient buffer starts non-zero (the kernels add), and the error is measured on what was added:
// ‖gpu − cpu‖ / ‖cpu − initial‖. Both sides are fp32 with different summation orders (the CPU's row sums of the
// norms run in double, its fn projection through BLAS): measured on an H200 at most 2.3e-6, except dscale (three
// sums over all tokens with cancellation) at up to 1e-5; 1e-4 leaves that room, also for the Sinkhorn backward's 39
// steps, without hiding a wrong term (a missing term or a wrong index is an O(1) error).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/testing_mhc_backward.h"
#include "io/safetensors.h"
#include "model/backward.h"
#include "model/mhc.h"
#include "model/norm.h"
#include "test_util.h"

namespace nextlm {
namespace {

// ‖gpu − cpu‖ / ‖cpu − init‖ (+inf on any non-finite value of gpu).
double added_rel_error(const std::vector<float>& gpu, const std::vector<float>& cpu, const std::vector<float>& init) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) return INFINITY;
    const double e = static_cast<double>(gpu[i]) - cpu[i], a = static_cast<double>(cpu[i]) - init[i];
    num += e * e, den += a * a;
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

constexpr double kTol = 1e-4;

struct PreCase {
  int64_t T, S, D;
  bool init_weights;  // base = 0, scale = 1 as random_init; else random base and scale
  bool with_dpost = true, with_dcomb = true, with_da = true;  // an absent output gradient passes null
};

void check_pre(const PreCase& pc, unsigned seed) {
  const int64_t T = pc.T, S = pc.S, D = pc.D, M = (2 + S) * S, SD = S * D;
  ModelConfig c;
  c.hc_mult = S;
  c.hidden_size = D;
  const float eps = static_cast<float>(c.rms_norm_eps), hc_eps = static_cast<float>(c.hc_eps);
  const int iters = static_cast<int>(c.hc_sinkhorn_iters);
  HcWeights w{Tensor({M, SD}), Tensor({M}), Tensor({3})};
  w.fn.data = test::randn(M * SD, ++seed, 0.02f);
  if (pc.init_weights) {
    w.base.data.assign(M, 0.0f);
    w.scale.data = {1.0f, 1.0f, 1.0f};
  } else {
    w.base.data = test::randn(M, ++seed, 0.5f);
    w.scale.data = {0.8f, 1.2f, 0.9f};
  }
  std::vector<float> norm_w = test::randn(D, ++seed, 0.2f);
  for (float& x : norm_w) x += 1.0f;
  const std::vector<float> h = test::randn(T * SD, ++seed);
  std::vector<float> dpost = test::randn(T * S, ++seed), dcomb = test::randn(T * S * S, ++seed);
  std::vector<float> da = test::randn(T * D, ++seed);
  if (!pc.with_dpost) dpost.clear();
  if (!pc.with_dcomb) dcomb.clear();
  if (!pc.with_da) da.clear();
  auto or_null = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };

  // CPU: the collapse a0 (before the sub-layer norm), the norm's backward into da0, then mhc_pre_backward.
  const std::vector<float> dh0 = test::randn(T * SD, ++seed, 0.5f), dfn0 = test::randn(M * SD, ++seed, 0.5f);
  const std::vector<float> dbase0 = test::randn(M, ++seed, 0.5f), dscale0 = test::randn(3, ++seed, 0.5f);
  const std::vector<float> dnw0 = test::randn(D, ++seed, 0.5f);
  HcMix mix;
  std::vector<float> a0(T * D), da0(T * D, 0.0f);
  mhc_pre_forward(w, c, h.data(), T, mix, a0.data());
  std::vector<float> dnw_cpu = dnw0, dh_cpu = dh0;
  if (pc.with_da) rmsnorm_backward(a0.data(), norm_w.data(), da.data(), T, D, eps, da0.data(), dnw_cpu.data());
  HcWeights dw{Tensor({M, SD}), Tensor({M}), Tensor({3})};
  dw.fn.data = dfn0, dw.base.data = dbase0, dw.scale.data = dscale0;
  mhc_pre_backward(w, c, h.data(), T, or_null(dpost), or_null(dcomb), pc.with_da ? da0.data() : nullptr,
                   dh_cpu.data(), dw);

  std::vector<float> dh = dh0, dfn = dfn0, dbase = dbase0, dscale = dscale0, dnw = dnw0;
  cuda_testing::mhc_pre_backward(h, w.fn.data, w.base.data, w.scale.data, norm_w, dpost, dcomb, da, T, S, D, eps,
                                 hc_eps, iters, dh, dfn, dbase, dscale, dnw);
  const std::string at = "T=" + std::to_string(T) + " S=" + std::to_string(S) + " D=" + std::to_string(D);
  // What a run added against what the CPU added (dnorm_w left alone without da).
  auto expect_cpu = [&](const std::vector<float>& gh, const std::vector<float>& gfn, const std::vector<float>& gbase,
                        const std::vector<float>& gscale, const std::vector<float>& gnw, const std::string& how) {
    EXPECT_LE(added_rel_error(gh, dh_cpu, dh0), kTol) << "dh" << how << " " << at;
    EXPECT_LE(added_rel_error(gfn, dw.fn.data, dfn0), kTol) << "dfn" << how << " " << at;
    EXPECT_LE(added_rel_error(gbase, dw.base.data, dbase0), kTol) << "dbase" << how << " " << at;
    EXPECT_LE(added_rel_error(gscale, dw.scale.data, dscale0), kTol) << "dscale" << how << " " << at;
    if (pc.with_da) {
      EXPECT_LE(added_rel_error(gnw, dnw_cpu, dnw0), kTol) << "dnorm_w" << how << " " << at;
    } else {
      EXPECT_EQ(gnw, dnw0) << "dnorm_w without da" << how << " " << at;
    }
  };
  expect_cpu(dh, dfn, dbase, dscale, dnw, "");

  // Every gradient is summed in a fixed order (no atomics): a second run adds the same bits.
  std::vector<float> dh2 = dh0, dfn2 = dfn0, dbase2 = dbase0, dscale2 = dscale0, dnw2 = dnw0;
  cuda_testing::mhc_pre_backward(h, w.fn.data, w.base.data, w.scale.data, norm_w, dpost, dcomb, da, T, S, D, eps,
                                 hc_eps, iters, dh2, dfn2, dbase2, dscale2, dnw2);
  EXPECT_EQ(dh2, dh) << "dh rerun " << at;
  EXPECT_EQ(dfn2, dfn) << "dfn rerun " << at;
  EXPECT_EQ(dbase2, dbase) << "dbase rerun " << at;
  EXPECT_EQ(dscale2, dscale) << "dscale rerun " << at;
  EXPECT_EQ(dnw2, dnw) << "dnorm_w rerun " << at;

  // Without the parameters' gradients (all four null: a LoRA step's frozen mHC and norm): the same dh, bit for bit
  // (at S ≤ 4 from another kernel, mhc_bwd_dh_kernel, with the same per-element arithmetic).
  std::vector<float> dh3 = dh0, no_fn, no_base, no_scale, no_nw;
  cuda_testing::mhc_pre_backward(h, w.fn.data, w.base.data, w.scale.data, norm_w, dpost, dcomb, da, T, S, D, eps,
                                 hc_eps, iters, dh3, no_fn, no_base, no_scale, no_nw);
  EXPECT_EQ(dh3, dh) << "dh without parameter gradients " << at;

  // With the forward's mix (mhc_pre's, as training passes it): the statistics pass without the projection, the
  // coefficients from the forward's fn·h and Σh²; against the CPU alike, and without the parameters' gradients the
  // same dh bit for bit.
  std::vector<float> dh4 = dh0, dfn4 = dfn0, dbase4 = dbase0, dscale4 = dscale0, dnw4 = dnw0;
  cuda_testing::mhc_pre_backward(h, w.fn.data, w.base.data, w.scale.data, norm_w, dpost, dcomb, da, T, S, D, eps,
                                 hc_eps, iters, dh4, dfn4, dbase4, dscale4, dnw4, true);
  expect_cpu(dh4, dfn4, dbase4, dscale4, dnw4, " (forward mix)");
  std::vector<float> dh5 = dh0;
  cuda_testing::mhc_pre_backward(h, w.fn.data, w.base.data, w.scale.data, norm_w, dpost, dcomb, da, T, S, D, eps,
                                 hc_eps, iters, dh5, no_fn, no_base, no_scale, no_nw, true);
  EXPECT_EQ(dh5, dh4) << "dh without parameter gradients (forward mix) " << at;
}

// T = 1, 7, 65 and 300 (a 32-token coefficient block holding one token, partial 64-token statistics tiles, many
// blocks), D = 64, 100, 200 and 320 (d tiles of 16 and 32 cut short; D = 70 at S = 8 is not a multiple of 4 and
// takes the 4-byte copies), D = 4096 at S = 4 (the model's width: 86 d-chunks for 3 token tiles), T = 1000 (several
// token blocks of the per-column pass, 32 coefficient blocks); S = 1, 2, 3, 6 and 8 exercise the other
// instantiations (M = 3 and 15 are not multiples of 4); D = 66 at S = 4 takes the 4-byte copies of the all-streams
// dh kernel (no parameter gradients, checked against the per-stream kernel's dh in check_pre).
TEST(CudaBackwardMhc, PreMatchesCpu) {
  unsigned seed = 7000;
  for (const PreCase pc : {PreCase{1, 4, 64, true}, PreCase{7, 4, 64, true}, PreCase{300, 4, 64, true},
                           PreCase{1, 4, 320, false}, PreCase{7, 4, 320, true}, PreCase{300, 4, 320, false},
                           PreCase{37, 4, 1100, false}, PreCase{130, 4, 4096, false}, PreCase{1000, 4, 256, false},
                           PreCase{65, 2, 200, false}, PreCase{40, 1, 100, false}, PreCase{45, 3, 100, false},
                           PreCase{33, 6, 48, false}, PreCase{29, 8, 70, false}, PreCase{50, 4, 66, false}})
    check_pre(pc, seed += 100);
}

// Absent output gradients (null dpost, dcomb or da) contribute nothing; without da dnorm_w is left alone.
TEST(CudaBackwardMhc, PreWithoutSomeGradients) {
  unsigned seed = 7700;
  PreCase no_da{70, 4, 96, false};
  no_da.with_da = false;
  PreCase no_comb{70, 4, 96, false};
  no_comb.with_dcomb = false;
  PreCase no_post{70, 4, 96, false};
  no_post.with_dpost = false;
  for (const PreCase& pc : {no_da, no_comb, no_post}) check_pre(pc, seed += 100);
}

// T = 0 enqueues nothing and leaves the gradients alone.
TEST(CudaBackwardMhc, PreEmptyIsNoOp) {
  const int64_t S = 4, D = 64, M = (2 + S) * S;
  std::vector<float> dh, dfn = test::randn(M * S * D, 1), dbase = test::randn(M, 2), dscale = test::randn(3, 3);
  std::vector<float> dnw = test::randn(D, 4);
  const std::vector<float> fn0 = dfn, base0 = dbase, scale0 = dscale, nw0 = dnw;
  cuda_testing::mhc_pre_backward({}, test::randn(M * S * D, 5), std::vector<float>(M, 0.0f), {1, 1, 1},
                                 std::vector<float>(D, 1.0f), {}, {}, {}, 0, S, D, 1e-5f, 1e-6f, 20, dh, dfn, dbase,
                                 dscale, dnw);
  EXPECT_EQ(dfn, fn0);
  EXPECT_EQ(dbase, base0);
  EXPECT_EQ(dscale, scale0);
  EXPECT_EQ(dnw, nw0);
}

// A post-mix case: post [T, S], comb [T, S, S] (halved), the streams h [T, S, D] and the sub-layer's output y [T, D],
// random from the seeds after `seed` (advanced past them).
struct PostCase {
  HcMix mix;
  std::vector<float> h, y;
};
PostCase post_case(int64_t T, int64_t S, int64_t D, unsigned& seed) {
  PostCase c;
  c.mix.post = test::randn(T * S, ++seed);
  c.mix.comb = test::randn(T * S * S, ++seed, 0.5f);
  c.h = test::randn(T * S * D, ++seed);
  c.y = test::randn(T * D, ++seed);
  return c;
}

TEST(CudaBackwardMhc, PostMatchesCpu) {
  unsigned seed = 8000;
  for (const auto& [T, S, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 64}, {7, 4, 320}, {300, 4, 333},
                                {3, 4, 4096}, {45, 3, 100}, {29, 8, 70}}) {
    const auto& [mix, h, y] = post_case(T, S, D, seed);
    const std::vector<float> dout = test::randn(T * S * D, ++seed);
    const std::vector<float> dh0 = test::randn(T * S * D, ++seed), dy0 = test::randn(T * D, ++seed);
    const std::vector<float> dp0 = test::randn(T * S, ++seed), dc0 = test::randn(T * S * S, ++seed);
    std::vector<float> dh_cpu = dh0, dy_cpu = dy0, dp_cpu = dp0, dc_cpu = dc0;
    mhc_post_backward(mix, h.data(), y.data(), T, S, D, dout.data(), dh_cpu.data(), dy_cpu.data(), dp_cpu.data(),
                      dc_cpu.data());
    std::vector<float> dh = dh0, dy = dy0, dp = dp0, dc = dc0;
    cuda_testing::mhc_post_backward(h, y, mix.post, mix.comb, dout, T, S, D, dh, dy, dp, dc);
    const std::string at = "T=" + std::to_string(T) + " S=" + std::to_string(S) + " D=" + std::to_string(D);
    EXPECT_LE(added_rel_error(dh, dh_cpu, dh0), kTol) << "dh " << at;
    EXPECT_LE(added_rel_error(dy, dy_cpu, dy0), kTol) << "dy " << at;
    EXPECT_LE(added_rel_error(dp, dp_cpu, dp0), kTol) << "dpost " << at;
    EXPECT_LE(added_rel_error(dc, dc_cpu, dc0), kTol) << "dcomb " << at;
    // Written instead of added to (as training runs it): the CPU's sums from zero.
    std::vector<float> zh(dh0.size(), 0.0f), zy(dy0.size(), 0.0f), zp(dp0.size(), 0.0f), zc(dc0.size(), 0.0f);
    std::vector<float> wh = zh, wy = zy, wp = zp, wc = zc;
    mhc_post_backward(mix, h.data(), y.data(), T, S, D, dout.data(), zh.data(), zy.data(), zp.data(), zc.data());
    cuda_testing::mhc_post_backward(h, y, mix.post, mix.comb, dout, T, S, D, wh, wy, wp, wc, false);
    EXPECT_LE(test::norm_rel_error(wh.data(), zh.data(), zh.size()), kTol) << "written dh " << at;
    EXPECT_LE(test::norm_rel_error(wy.data(), zy.data(), zy.size()), kTol) << "written dy " << at;
    EXPECT_LE(test::norm_rel_error(wp.data(), zp.data(), zp.size()), kTol) << "written dpost " << at;
    EXPECT_LE(test::norm_rel_error(wc.data(), zc.data(), zc.size()), kTol) << "written dcomb " << at;
  }
}

// A frozen site's backward as training runs it: the pre-mix's backward forming the post-mix's dh term itself (the
// post-mix's backward writing no dh) gives the same bits as the post-mix's writing dh and the pre-mix's adding to it;
// T = 1 and 130, D = 4096 (the model's width), D = 66 (4-byte copies, the statistics kernel in place of the
// forward's mix), S = 1, 2, 3 (comb rows of 1, 4 and 9 floats).
TEST(CudaBackwardMhc, FrozenSiteFormsThePostMixTermWithTheSameBits) {
  unsigned seed = 8030;
  for (const auto& [T, S, D] : {std::tuple<int64_t, int64_t, int64_t>{130, 4, 4096}, {1, 4, 320}, {70, 4, 66},
                                {65, 2, 200}, {40, 1, 100}, {45, 3, 100}}) {
    ModelConfig c;
    const int64_t M = (2 + S) * S;
    const float eps = static_cast<float>(c.rms_norm_eps), hc_eps = static_cast<float>(c.hc_eps);
    const int iters = static_cast<int>(c.hc_sinkhorn_iters);
    const std::vector<float> fn = test::randn(M * S * D, ++seed, 0.02f), base = test::randn(M, ++seed, 0.5f);
    const std::vector<float> scale = {0.8f, 1.2f, 0.9f};
    std::vector<float> norm_w = test::randn(D, ++seed, 0.2f);
    for (float& x : norm_w) x += 1.0f;
    const std::vector<float> h = test::randn(T * S * D, ++seed), y = test::randn(T * D, ++seed);
    const std::vector<float> post = test::randn(T * S, ++seed), comb = test::randn(T * S * S, ++seed, 0.5f);
    const std::vector<float> dout = test::randn(T * S * D, ++seed), da = test::randn(T * D, ++seed);
    std::vector<float> dh, dy, dp, dc, fdh, fdy, fdp, fdc;
    cuda_testing::mhc_site_backward_frozen(h, y, post, comb, dout, fn, base, scale, norm_w, da, T, S, D, eps, hc_eps,
                                           iters, false, dh, dy, dp, dc);
    cuda_testing::mhc_site_backward_frozen(h, y, post, comb, dout, fn, base, scale, norm_w, da, T, S, D, eps, hc_eps,
                                           iters, true, fdh, fdy, fdp, fdc);
    const std::string at = "T=" + std::to_string(T) + " S=" + std::to_string(S) + " D=" + std::to_string(D);
    for (const float v : dh) ASSERT_TRUE(std::isfinite(v)) << "dh " << at;
    EXPECT_EQ(fdh, dh) << "dh " << at;
    EXPECT_EQ(fdy, dy) << "dy " << at;
    EXPECT_EQ(fdp, dp) << "dpost " << at;
    EXPECT_EQ(fdc, dc) << "dcomb " << at;
  }
}

// Training's form: dy written in bf16 (the sub-layer's GEMMs' operand) as well as in fp32 (the MoE's routing
// weights), or in bf16 alone; the bf16 bits are to_bf16's of the fp32 dy (round to nearest even), and dh, dpost and
// dcomb the same bits either way; vectorised and scalar widths. Without dpost and dcomb (the first site's, where the
// site's input gradient is not formed) the kernel reads neither h nor y (null here), with the same dh and dy bits.
TEST(CudaBackwardMhc, PostBackwardWritesBf16Gradient) {
  unsigned seed = 8050;
  for (const auto& [T, S, D] : {std::tuple<int64_t, int64_t, int64_t>{7, 4, 320}, {300, 4, 333}, {3, 4, 4096}}) {
    const auto& [mix, h, y] = post_case(T, S, D, seed);
    const std::vector<float> dout = test::randn(T * S * D, ++seed);
    std::vector<float> dh(T * S * D), dy(T * D), dp(T * S), dc(T * S * S);
    cuda_testing::mhc_post_backward(h, y, mix.post, mix.comb, dout, T, S, D, dh, dy, dp, dc, false);
    std::vector<uint16_t> expect(dy.size());
    for (size_t e = 0; e < dy.size(); ++e) expect[e] = f32_to_bf16(dy[e]);
    const std::string at = "T=" + std::to_string(T) + " D=" + std::to_string(D);
    for (const bool fp32_dy : {true, false}) {
      std::vector<float> dh2(dh.size()), dy2(dy.size(), 7.0f), dp2(dp.size()), dc2(dc.size());
      std::vector<uint16_t> dy16;
      cuda_testing::mhc_post_backward(h, y, mix.post, mix.comb, dout, T, S, D, dh2, dy2, dp2, dc2, false, &dy16,
                                      fp32_dy);
      EXPECT_EQ(dy16, expect) << at << (fp32_dy ? " with fp32 dy" : " bf16 alone");
      if (fp32_dy) {
        EXPECT_EQ(dy2, dy) << at;
      }
      EXPECT_EQ(dh2, dh) << at;
      EXPECT_EQ(dp2, dp) << at;
      EXPECT_EQ(dc2, dc) << at;
    }
    std::vector<float> dh3(dh.size()), dy3(dy.size()), no_dp, no_dc;
    std::vector<uint16_t> dy16;
    cuda_testing::mhc_post_backward({}, {}, mix.post, mix.comb, dout, T, S, D, dh3, dy3, no_dp, no_dc, false, &dy16);
    EXPECT_EQ(dh3, dh) << at << " without sums";
    EXPECT_EQ(dy3, dy) << at << " without sums";
    EXPECT_EQ(dy16, expect) << at << " without sums";
    EXPECT_TRUE(no_dp.empty() && no_dc.empty()) << at;
  }
}

// The forward's post-mix, in place (inference) and into the next site's buffer (training): the CPU's streams, the
// two forms bitwise alike, the input left alone by the second; vectorised (D % 4 == 0) and scalar widths.
TEST(CudaMhc, PostOutOfPlaceMatchesInPlaceAndCpu) {
  unsigned seed = 8100;
  for (const auto& [T, S, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 64}, {300, 4, 333}, {5, 4, 4096},
                                {45, 3, 100}}) {
    const auto& [mix, h, y] = post_case(T, S, D, seed);
    std::vector<float> cpu(h.size());
    mhc_post_forward(mix, h.data(), y.data(), T, S, D, cpu.data());
    std::vector<float> h_in_place, h_kept;
    const std::vector<float> a = cuda_testing::mhc_post(h, y, mix.post, mix.comb, T, S, D, true, h_in_place);
    const std::vector<float> b = cuda_testing::mhc_post(h, y, mix.post, mix.comb, T, S, D, false, h_kept);
    const std::string at = "T=" + std::to_string(T) + " S=" + std::to_string(S) + " D=" + std::to_string(D);
    EXPECT_LE(test::norm_rel_error(a.data(), cpu.data(), cpu.size()), 1e-6) << at;
    EXPECT_EQ(a, b) << at;
    EXPECT_EQ(h_kept, h) << at;
  }
}

// Weighted and unweighted, rows read with a stride ldx > n, row counts across the 256-row dw blocks.
TEST(CudaBackwardMhc, RmsNormMatchesCpu) {
  unsigned seed = 9000;
  struct Shape {
    int64_t rows, n, ldx;
  };
  for (const Shape sh : {Shape{1, 64, 64}, Shape{7, 300, 320}, Shape{300, 333, 400}, Shape{600, 1000, 1024}}) {
    for (const bool weighted : {true, false}) {
      const int64_t rows = sh.rows, n = sh.n, ldx = sh.ldx;
      const float eps = 1e-5f;
      std::vector<float> x = test::randn(rows * ldx, ++seed);
      for (int64_t r = 0; r < rows; ++r)  // row scales 1 … 5
        for (int64_t i = 0; i < ldx; ++i) x[r * ldx + i] *= static_cast<float>(1 + r % 5);
      std::vector<float> xc(rows * n);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i) xc[r * n + i] = x[r * ldx + i];
      std::vector<float> w;
      if (weighted) {
        w = test::randn(n, ++seed, 0.2f);
        for (float& e : w) e += 1.0f;
      }
      const std::vector<float> dy = test::randn(rows * n, ++seed);
      const std::vector<float> dx0 = test::randn(rows * n, ++seed, 0.1f), dw0 = test::randn(n, ++seed);
      std::vector<float> dx_cpu = dx0, dw_cpu = dw0;
      rmsnorm_backward(xc.data(), weighted ? w.data() : nullptr, dy.data(), rows, n, eps, dx_cpu.data(),
                       weighted ? dw_cpu.data() : nullptr);
      std::vector<float> dx = dx0, dw = dw0;
      cuda_testing::rmsnorm_backward(x, ldx, w, dy, rows, n, eps, dx, dw);
      const std::string at = "rows=" + std::to_string(rows) + " n=" + std::to_string(n) +
                             (weighted ? " weighted" : " unweighted");
      EXPECT_LE(added_rel_error(dx, dx_cpu, dx0), kTol) << "dx " << at;
      if (weighted) {
        EXPECT_LE(added_rel_error(dw, dw_cpu, dw0), kTol) << "dw " << at;
      } else {
        EXPECT_EQ(dw, dw0) << at;
      }
    }
  }
}

// The final stream mean + norm, as head_loss_backward: hm = mean_s h, RMSNorm backward, dh[t, s] += dhm[t]/S; and
// dh written instead (as training runs it, from NaN): the added values' bits.
TEST(CudaBackwardMhc, StreamMeanNormMatchesCpu) {
  unsigned seed = 9500;
  for (const auto& [T, S, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 64}, {7, 4, 320}, {300, 4, 333}}) {
    const float eps = 1e-5f;
    const std::vector<float> h = test::randn(T * S * D, ++seed), dout = test::randn(T * D, ++seed);
    std::vector<float> w = test::randn(D, ++seed, 0.2f);
    for (float& e : w) e += 1.0f;
    const std::vector<float> dh0 = test::randn(T * S * D, ++seed, 0.1f), dw0 = test::randn(D, ++seed);
    std::vector<float> hm(T * D, 0.0f), dhm(T * D, 0.0f), dh_cpu = dh0, dw_cpu = dw0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int64_t s = 0; s < S; ++s) acc += h[(t * S + s) * D + d];
        hm[t * D + d] = acc / static_cast<float>(S);
      }
    rmsnorm_backward(hm.data(), w.data(), dout.data(), T, D, eps, dhm.data(), dw_cpu.data());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d) dh_cpu[(t * S + s) * D + d] += dhm[t * D + d] / static_cast<float>(S);
    std::vector<float> dh = dh0, dw = dw0;
    cuda_testing::stream_mean_norm_backward(h, w, dout, T, S, D, eps, dh, dw);
    const std::string at = "T=" + std::to_string(T) + " S=" + std::to_string(S) + " D=" + std::to_string(D);
    EXPECT_LE(added_rel_error(dh, dh_cpu, dh0), kTol) << "dh " << at;
    EXPECT_LE(added_rel_error(dw, dw_cpu, dw0), kTol) << "dw " << at;
    std::vector<float> added(dh0.size(), 0.0f), written(dh0.size()), dw_a = dw0, dw_w = dw0;
    cuda_testing::stream_mean_norm_backward(h, w, dout, T, S, D, eps, added, dw_a);
    cuda_testing::stream_mean_norm_backward(h, w, dout, T, S, D, eps, written, dw_w, false);
    EXPECT_EQ(written, added) << "written dh " << at;
    EXPECT_EQ(dw_w, dw_a) << "dw with dh written " << at;
  }
}

}  // namespace
}  // namespace nextlm
