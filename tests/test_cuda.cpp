// The CUDA bf16 path against the CPU fp32 reference (runs on a GPU machine: CTest label "gpu", excluded from the
// CPU-only suite). Kernel tests poison outputs with NaN so that an unwritten element fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include <cuda_runtime.h>

#include "core/error.h"
#include "cuda/device_model.h"
#include "cuda/testing.h"
#include "io/safetensors.h"
#include "model/dsa.h"
#include "model/kda.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "model/norm.h"
#include "model/model.h"
#include "test_util.h"

namespace nextlm {
namespace {

// KDA inputs as the layer produces them: unit-norm k, q scaled by K^-1/2, safe-gate decays, sigmoid betas.
struct KdaCase {
  std::vector<float> q, k, v, g, beta;
};
KdaCase make_kda(int64_t T, int64_t H, int64_t K, unsigned seed) {
  KdaCase c{test::randn(T * H * K, seed), test::randn(T * H * K, seed + 1), test::randn(T * H * K, seed + 2),
            test::randn(T * H * K, seed + 3), test::randn(T * H, seed + 4)};
  for (int64_t r = 0; r < T * H; ++r) {
    double sq = 0, sk = 0;
    for (int64_t d = 0; d < K; ++d) sq += c.q[r * K + d] * c.q[r * K + d], sk += c.k[r * K + d] * c.k[r * K + d];
    for (int64_t d = 0; d < K; ++d) c.q[r * K + d] /= std::sqrt(sq * K), c.k[r * K + d] /= std::sqrt(sk);
    c.beta[r] = 1.0f / (1.0f + std::exp(-c.beta[r]));
  }
  for (float& x : c.g) x = -5.0f / (1.0f + std::exp(-x));
  return c;
}

TEST(CudaKda, ChunkedKernelMatchesCpuRecurrentOnPackedSequences) {
  const int64_t H = 3, K = 64;
  const std::vector<int64_t> lens{1, 63, 64, 65, 150, 7};
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back();
  const KdaCase c = make_kda(T, H, K, 3);
  const std::vector<float> gpu = cuda_testing::kda_chunked(c.q, c.k, c.v, c.g, c.beta, cu, H, K);
  std::vector<float> cpu(T * H * K);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = cu[n] * H * K + h * K;
      std::vector<float> st(K * K, 0.0f);
      kda_recurrent_forward(KdaSeq{c.q.data() + off, c.k.data() + off, c.v.data() + off, c.g.data() + off,
                                   c.beta.data() + cu[n] * H + h, cu[n + 1] - cu[n], K, H * K, H, cpu.data() + off},
                            st.data());
    }
  // Both are fp32; the GPU uses fast exp and another summation order: ~1e-6 relative.
  EXPECT_LE(test::norm_rel_error(gpu.data(), cpu.data(), cpu.size()), 1e-4);
}

// The tensor-core kernels (bf16 operands, safe gate computed in the kernel) against the CPU fp32 recurrence fed the
// same bf16-rounded q, k, v, over packed lengths that cross chunk boundaries, from zero and from given states.
class CudaKdaTc : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaKdaTc, MatchesCpuRecurrentOnPackedSequences) {
  const int64_t K = GetParam(), H = K == 128 ? 2 : 3;
  const float bound = -5.0f;
  const std::vector<int64_t> lens{1, 63, 64, 65, 150, 7, 300};
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back(), N = static_cast<int64_t>(lens.size());
  KdaCase c = make_kda(T, H, K, 11);
  for (std::vector<float>* x : {&c.q, &c.k, &c.v})
    for (float& e : *x) e = bf16_to_f32(f32_to_bf16(e));
  const std::vector<float> graw = test::randn(T * H * K, 21), A_log = test::randn(H, 22), dt = test::randn(H * K, 23);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < H * K; ++j) {
      const float f = graw[t * H * K + j] + dt[j] * 0.5f;
      c.g[t * H * K + j] = bound / (1.0f + std::exp(-std::exp(A_log[j / K] * 0.5f) * f));
    }
  std::vector<float> A_half(A_log), dt_half(dt);
  for (float& x : A_half) x *= 0.5f;
  for (float& x : dt_half) x *= 0.5f;
  for (bool from_state : {false, true}) {
    std::vector<float> s_in;
    if (from_state) {
      s_in = test::randn(N * H * K * K, 31);
      for (float& x : s_in) x *= 0.3f;
    }
    std::vector<float> s_gpu;
    const std::vector<float> gpu =
        cuda_testing::kda_chunked_tc(c.q, c.k, c.v, graw, c.beta, A_half, dt_half, bound, cu, H, K, s_in, &s_gpu);
    std::vector<float> cpu(T * H * K), s_cpu(N * H * K * K, 0.0f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = cu[n] * H * K + h * K;
        float* st = s_cpu.data() + (n * H + h) * K * K;
        if (from_state) std::copy_n(s_in.data() + (n * H + h) * K * K, K * K, st);
        kda_recurrent_forward(KdaSeq{c.q.data() + off, c.k.data() + off, c.v.data() + off, c.g.data() + off,
                                     c.beta.data() + cu[n] * H + h, cu[n + 1] - cu[n], K, H * K, H, cpu.data() + off},
                              st);
      }
    // bf16 operands (the factors, v_new and the state's copy for the products) with fp32 accumulation: ~0.4%. (Carrying
    // the state and v_new as bf16 value + residual pairs left this at 4.0e-3 on the H200: the factors dominate.)
    const double eo = test::norm_rel_error(gpu.data(), cpu.data(), cpu.size());
    const double es = test::norm_rel_error(s_gpu.data(), s_cpu.data(), s_cpu.size());
    std::printf("[cuda] KDA tensor cores K=%lld from_state=%d: output %.2e, final state %.2e (norm-relative)\n",
                static_cast<long long>(K), from_state, eo, es);
    EXPECT_LE(eo, 2e-2);
    EXPECT_LE(es, 2e-2);
    for (float x : gpu) ASSERT_TRUE(std::isfinite(x));
  }
}
INSTANTIATE_TEST_SUITE_P(HeadDims, CudaKdaTc, ::testing::Values(16, 32, 64, 128));

// Heads never mix: each head run alone (H = 1, as a tensor-parallel rank holding that head runs it) gives the same
// bits as inside a batch of heads.
TEST(CudaKdaTcHeads, EachHeadAloneGivesTheSameBits) {
  for (const int64_t K : {16, 128}) {
    const int64_t H = 3;
    const std::vector<int64_t> cu{0, 70, 200};
    const int64_t T = cu.back();
    KdaCase c = make_kda(T, H, K, 61);
    const std::vector<float> graw = test::randn(T * H * K, 62), A_log = test::randn(H, 63), dt = test::randn(H * K, 64);
    const std::vector<float> all =
        cuda_testing::kda_chunked_tc(c.q, c.k, c.v, graw, c.beta, A_log, dt, -5.0f, cu, H, K, {}, nullptr);
    for (int64_t h = 0; h < H; ++h) {
      auto head = [&](const std::vector<float>& x, int64_t width) {  // columns [h·width, (h+1)·width) of every row
        std::vector<float> out;
        for (int64_t t = 0; t < T; ++t)
          out.insert(out.end(), x.begin() + t * H * width + h * width, x.begin() + t * H * width + (h + 1) * width);
        return out;
      };
      const std::vector<float> one = cuda_testing::kda_chunked_tc(
          head(c.q, K), head(c.k, K), head(c.v, K), head(graw, K), head(c.beta, 1), {A_log[h]},
          std::vector<float>(dt.begin() + h * K, dt.begin() + (h + 1) * K), -5.0f, cu, 1, K, {}, nullptr);
      const std::vector<float> want = head(all, K);
      ASSERT_EQ(one.size(), want.size());
      EXPECT_EQ(std::memcmp(one.data(), want.data(), one.size() * sizeof(float)), 0) << "K " << K << " head " << h;
    }
  }
}

// Decoding recomputes a sequence's partial chunk from the state at its last chunk boundary, so the kernels must give
// a chunk's rows 0 … r the same bits whether the chunk ends there or runs on: rows of a cut sequence equal the
// whole sequence's, the boundary state of a cut equals the final state at that boundary, and the rows after the
// boundary recomputed alone from it equal the whole sequence's. At the model's bound and at one that needs the
// shifted references (kda_tc.cu).
TEST(CudaKdaTcPrefix, CutChunksGiveTheSameBits) {
  const int64_t K = 128, H = 2, L = 200;
  for (float bound : {-5.0f, -8.0f}) {
    KdaCase c = make_kda(L, H, K, 51);
    const std::vector<float> graw = test::randn(L * H * K, 52), A_log = test::randn(H, 53), dt = test::randn(H * K, 54);
    std::vector<float> s_in = test::randn(H * K * K, 55);
    for (float& x : s_in) x *= 0.3f;
    auto rows = [&](const std::vector<float>& x, int64_t width, int64_t a, int64_t b) {
      return std::vector<float>(x.begin() + a * width, x.begin() + b * width);
    };
    auto run = [&](int64_t a, int64_t b, const std::vector<float>& s0, std::vector<float>* s_out, bool boundary) {
      return cuda_testing::kda_chunked_tc(rows(c.q, H * K, a, b), rows(c.k, H * K, a, b), rows(c.v, H * K, a, b),
                                          rows(graw, H * K, a, b), rows(c.beta, H, a, b), A_log, dt, bound, {0, b - a},
                                          H, K, s0, s_out, boundary);
    };
    std::vector<float> s_full;
    const std::vector<float> full = run(0, L, s_in, &s_full, false);
    for (int64_t n : {1, 6, 16, 17, 41, 63, 64, 65, 100, 127, 128, 150, 199}) {
      std::vector<float> s_cut;
      const std::vector<float> cut = run(0, n, s_in, &s_cut, true);
      ASSERT_EQ(std::memcmp(cut.data(), full.data(), cut.size() * sizeof(float)), 0)
          << "rows of a sequence cut at " << n << ", bound " << bound;
      if (n < 64) {
        for (float x : s_cut) ASSERT_TRUE(std::isnan(x)) << "a cut with no complete chunk leaves the state alone";
        continue;
      }
      const int64_t edge = n / 64 * 64;
      std::vector<float> s_edge;
      run(0, edge, s_in, &s_edge, false);
      ASSERT_EQ(std::memcmp(s_cut.data(), s_edge.data(), s_cut.size() * sizeof(float)), 0)
          << "boundary state of a cut at " << n;
      if (edge == n) continue;
      const std::vector<float> tail = run(edge, n, s_cut, nullptr, false);
      ASSERT_EQ(std::memcmp(tail.data(), full.data() + edge * H * K, tail.size() * sizeof(float)), 0)
          << "rows " << edge << " … " << n - 1 << " recomputed from the boundary state";
    }
  }
}

// The tensor-core MLA attention against the CUDA-core one (which the sub-layer tests hold to the CPU), on packed
// sequences with random selections, some empty (uniform over the sequence), and a long sequence whose queries skip
// whole key blocks.
class CudaMlaTc : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(CudaMlaTc, MatchesSparseKernel) {
  const auto [dqk, dv] = GetParam();
  const int64_t NH = 3;
  const std::vector<int64_t> lens{1, 5, 64, 130, 70, 300};
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back();
  std::vector<float> q = test::randn(T * NH * dqk, 41), kv = test::randn(T * NH * (dqk + dv), 42);
  std::mt19937 gen(43);
  std::vector<std::vector<int32_t>> sel(T);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      const int64_t rel = t - cu[n];
      if (rel % 37 == 3) continue;  // an empty selection
      // Mostly recent keys and a random sprinkle of older ones (the long sequence leaves whole blocks unselected).
      for (int64_t j = 0; j <= rel; ++j)
        if (rel - j < 8 || (j < 64 && gen() % 3 == 0) || (lens[n] < 300 && gen() % 2 == 0))
          sel[t].push_back(static_cast<int32_t>(j));
    }
  std::vector<float> tc, ref;
  cuda_testing::mla_attention_both(q, kv, sel, cu, NH, dqk, dv, tc, ref);
  for (float x : tc) ASSERT_TRUE(std::isfinite(x));
  const double e = test::norm_rel_error(tc.data(), ref.data(), ref.size());
  std::printf("[cuda] MLA attention tensor cores %lld/%lld: ||do||/||o|| = %.2e\n", static_cast<long long>(dqk),
              static_cast<long long>(dv), e);
  EXPECT_LE(e, 1e-2);  // bf16 probabilities and values with fp32 accumulation
}
INSTANTIATE_TEST_SUITE_P(HeadDims, CudaMlaTc,
                         ::testing::Values(std::pair<int64_t, int64_t>{64, 64}, std::pair<int64_t, int64_t>{128, 128},
                                           std::pair<int64_t, int64_t>{192, 128},
                                           std::pair<int64_t, int64_t>{256, 256}));

class CudaGolden : public ::testing::TestWithParam<std::string> {};


// The whole forward: bf16 activations against the fp32 reference (with the same bf16-rounded weights). On these
// tiny random models a bf16 rounding can flip an MoE routing or an indexer choice, which moves that token's logits
// by O(1), so the figures are reported and the bound is on the mean log-probability error; the kernels themselves
// are held to tight bounds one sub-layer at a time below.
TEST_P(CudaGolden, LogitsMatchCpuReference) {
  const Model cpu = test::bf16_weights_reference(test::golden_dir(GetParam()));
  CudaModel gpu(cpu);
  PackedBatch b;
  for (int64_t L : {1, 3, 63, 65, 150}) {
    std::vector<int32_t> s(L);
    for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 37 + L) % cpu.config().vocab_size);
    b.add(s);
  }
  const Tensor want = cpu.forward(b);
  const Tensor got = gpu.forward(b);
  ASSERT_EQ(got.data.size(), want.data.size());
  for (float x : got.data) ASSERT_TRUE(std::isfinite(x));
  const double err = test::max_rel_error(got.ptr(), want.ptr(), want.data.size());
  const auto lp_cpu = cpu.next_token_logprobs(b);
  const auto lp_gpu = gpu.next_token_logprobs(b);
  double mean_abs = 0;
  int64_t n = 0;
  for (size_t s = 0; s < lp_cpu.size(); ++s)
    for (size_t i = 0; i < lp_cpu[s].size(); ++i) mean_abs += std::fabs(lp_cpu[s][i] - lp_gpu[s][i]), ++n;
  mean_abs /= n;
  std::printf("[cuda] %s: max|dlogit|/max|logit| = %.3g, mean |dlogprob| = %.3g\n", GetParam().c_str(), err,
              mean_abs);
  EXPECT_LE(mean_abs, 0.1);
  // bf16_stable keeps every routing and indexer choice far from a tie (tests/golden/make_goldens.py), so there the
  // whole forward's error is bf16 rounding alone. Issue 3 asks for 2e-2; the H200 measured 3.3e-2 (2026-11-29,
  // sub-layers 0.2-0.6 %), so this bound guards against regressions while that target stays open.
  if (GetParam() == "bf16_stable") {
    EXPECT_LE(err, 5e-2);
  }
}

std::vector<float> round_bf16(std::vector<float> x) {
  for (float& v : x) v = bf16_to_f32(f32_to_bf16(v));
  return x;
}

// Each sub-layer alone on the same bf16-rounded input as the CPU reference, so that no routing or selection choice
// can differ upstream: what remains is bf16 rounding of the intermediate activations (~1e-2 relative in norm).
TEST_P(CudaGolden, EverySublayerMatchesCpu) {
  const Model cpu = test::bf16_weights_reference(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  PackedBatch b;
  for (int64_t L : {1, 63, 65, 150}) b.add(std::vector<int32_t>(L, 1));
  const int64_t T = b.num_tokens(), D = c.hidden_size, S = c.hc_mult;
  const std::vector<float> a = round_bf16(test::randn(T * D, 17));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& lw = cpu.weights().layers[i];
    // mHC pre of both sites on random streams.
    const std::vector<float> h = test::randn(T * S * D, 100 + static_cast<unsigned>(i));
    for (bool ffn : {false, true}) {
      HcMix mix;
      std::vector<float> a_cpu(T * D);
      mhc_pre_forward(ffn ? lw.hc_ffn : lw.hc_attn, c, h.data(), T, mix, a_cpu.data());
      rmsnorm_forward(a_cpu.data(), (ffn ? lw.post_attention_norm : lw.input_norm).ptr(), a_cpu.data(), T, D,
                      static_cast<float>(c.rms_norm_eps));
      std::vector<float> post, comb, a_gpu;
      gpu.mhc_pre(i, ffn, h, post, comb, a_gpu);
      EXPECT_LE(test::max_rel_error(post.data(), mix.post.data(), post.size()), 1e-4) << "mhc post, layer " << i;
      EXPECT_LE(test::max_rel_error(comb.data(), mix.comb.data(), comb.size()), 1e-4) << "mhc comb, layer " << i;
      EXPECT_LE(test::norm_rel_error(a_gpu.data(), a_cpu.data(), a_cpu.size()), 1e-2) << "mhc a, layer " << i;
    }
    std::vector<float> want(T * D);
    if (lw.kda) {
      kda_layer_forward(*lw.kda, c, a.data(), T, b.cu_seqlens, want.data());
    } else if (lw.dsa->indexer) {
      Selection sel;
      dsa_layer_forward(*lw.dsa, c, a.data(), T, b.cu_seqlens, sel, want.data());
    } else {
      continue;
    }
    const std::vector<float> got = gpu.sublayer(i, false, a, b);
    const double e = test::norm_rel_error(got.data(), want.data(), want.size());
    std::printf("[cuda] %s layer %lld %s: ||dy||/||y|| = %.3g\n", GetParam().c_str(), static_cast<long long>(i),
                lw.kda ? "kda" : "dsa", e);
    // KDA: bf16 rounding of q/k/v inputs and gates, ~2e-3 measured. DSA: also a few indexer choices can flip on the
    // bf16-rounded latent (~1e-2 to 3e-2 measured).
    EXPECT_LE(e, lw.kda ? 1e-2 : 5e-2) << "attention sub-layer " << i;
    std::vector<float> want_f(T * D);
    if (lw.moe) {
      moe_forward(*lw.moe, c, a.data(), T, want_f.data());
    } else {
      mlp_forward(*lw.mlp, static_cast<float>(c.swiglu_limit), a.data(), T, D, want_f.data());
    }
    const std::vector<float> got_f = gpu.sublayer(i, true, a, b);
    const double ef = test::norm_rel_error(got_f.data(), want_f.data(), want_f.size());
    std::printf("[cuda] %s layer %lld %s: ||dy||/||y|| = %.3g\n", GetParam().c_str(), static_cast<long long>(i),
                lw.moe ? "moe" : "mlp", ef);
    EXPECT_LE(ef, 1e-2) << "feed-forward sub-layer " << i;  // ~2e-3 measured
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGolden, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

}  // namespace
}  // namespace nextlm

namespace nextlm {
namespace {

// mHC pre on awkward shapes (S·D across the 1024-column chunks with a ragged last tile, S·D or D not a multiple of
// 4, token tiles cut short) and the model's (S = 4, D = 4096: 16 full chunks) against the CPU reference; and batch
// invariance: each token's outputs are bitwise the same alone and in batches of 2, 5, 9 and 16 (the decode path's
// per-chunk-chain projection, whose chains the apply kernel sums), 17, 45 and 300 (the tiled one, whose threads
// skip token rows past T in a short tile), since every sum runs in an order fixed by S and D alone.
TEST(CudaMhc, PreMatchesCpuAndIsBatchInvariant) {
  struct Shape {
    int64_t S, D;
  };
  unsigned seed = 500;
  for (const Shape sh : {Shape{4, 300}, Shape{4, 256}, Shape{3, 333}, Shape{1, 70}, Shape{2, 130}, Shape{6, 100},
                         Shape{8, 130}, Shape{4, 4096}}) {
    const int64_t S = sh.S, D = sh.D, M = (2 + S) * S, T = 300;
    ModelConfig c;
    c.hc_mult = S;
    c.hidden_size = D;
    const float eps = static_cast<float>(c.rms_norm_eps), hc_eps = static_cast<float>(c.hc_eps);
    const int iters = static_cast<int>(c.hc_sinkhorn_iters);
    HcWeights w{Tensor({M, S * D}), Tensor({M}), Tensor({3})};
    w.fn.data = test::randn(M * S * D, ++seed, 1.0f / std::sqrt(static_cast<float>(S * D)));
    w.base.data = test::randn(M, ++seed, 0.5f);
    w.scale.data = {0.8f, 1.2f, 0.9f};
    std::vector<float> norm_w = test::randn(D, ++seed, 0.2f);
    for (float& x : norm_w) x += 1.0f;
    std::vector<float> h = test::randn(T * S * D, ++seed);
    for (int64_t t = 0; t < T; ++t)  // token scales 1 … 7, so that the input norm matters
      for (int64_t i = 0; i < S * D; ++i) h[t * S * D + i] *= static_cast<float>(1 + t % 7);

    HcMix mix;
    std::vector<float> a_cpu(T * D);
    mhc_pre_forward(w, c, h.data(), T, mix, a_cpu.data());
    rmsnorm_forward(a_cpu.data(), norm_w.data(), a_cpu.data(), T, D, eps);
    const cuda_testing::MhcPreOut all =
        cuda_testing::mhc_pre(h, w.fn.data, w.base.data, w.scale.data, norm_w, T, S, D, eps, hc_eps, iters);
    const std::string at = "S=" + std::to_string(S) + " D=" + std::to_string(D);
    // fp32 throughout, another summation order than the CPU's BLAS: ~1e-6; a is rounded to bf16 (2^-9 relative).
    EXPECT_LE(test::max_rel_error(all.post.data(), mix.post.data(), all.post.size()), 1e-4) << at;
    EXPECT_LE(test::max_rel_error(all.comb.data(), mix.comb.data(), all.comb.size()), 1e-4) << at;
    EXPECT_LE(test::norm_rel_error(all.a.data(), a_cpu.data(), a_cpu.size()), 1e-2) << at;

    auto same = [](const float* x, const float* y, int64_t n) {
      for (int64_t i = 0; i < n; ++i)
        if (!(x[i] == y[i] && std::signbit(x[i]) == std::signbit(y[i]))) return false;  // NaN never passes
      return true;
    };
    // The second half alone from the first's partials (training's recomputation of the mix): the same bits.
    const cuda_testing::MhcPreOut again =
        cuda_testing::mhc_pre(h, w.fn.data, w.base.data, w.scale.data, norm_w, T, S, D, eps, hc_eps, iters, true);
    EXPECT_TRUE(same(again.post.data(), all.post.data(), T * S)) << at;
    EXPECT_TRUE(same(again.comb.data(), all.comb.data(), T * S * S)) << at;
    EXPECT_TRUE(same(again.a.data(), all.a.data(), T * D)) << at;
    for (int64_t n : {1, 2, 5, 9, 16, 17, 45}) {
      std::vector<int64_t> pick(n);
      for (int64_t i = 0; i < n; ++i) pick[i] = (i * 67 + n * 13) % T;  // distinct: 67 is prime to 300
      std::vector<float> hs(n * S * D);
      for (int64_t i = 0; i < n; ++i) std::copy_n(h.data() + pick[i] * S * D, S * D, hs.data() + i * S * D);
      const cuda_testing::MhcPreOut sub =
          cuda_testing::mhc_pre(hs, w.fn.data, w.base.data, w.scale.data, norm_w, n, S, D, eps, hc_eps, iters);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = pick[i];
        const std::string where = at + " batch " + std::to_string(n) + " token " + std::to_string(t);
        EXPECT_TRUE(same(sub.post.data() + i * S, all.post.data() + t * S, S)) << where;
        EXPECT_TRUE(same(sub.comb.data() + i * S * S, all.comb.data() + t * S * S, S * S)) << where;
        EXPECT_TRUE(same(sub.a.data() + i * D, all.a.data() + t * D, D)) << where;
      }
    }
  }
}

// The post-mix fused with the next site's projection (cuda::mhc_post_project, as training's forward and the prefill
// run it) against mhc_post then mhc_pre: the new streams and the next site's post, comb and input bit for bit, out
// of place and in place, on shapes the fused kernel takes (D a multiple of 1024, S <= 4, more than 16 tokens; token
// tiles cut short) and on shapes it leaves to the two kernels (16 tokens: the decoding projection; D = 1056;
// S = 6), where it must say that it did not fuse.
TEST(CudaMhc, PostProjectGivesTheSameBits) {
  struct Shape {
    int64_t S, D, T;
    bool fuses;
  };
  unsigned seed = 900;
  for (const Shape sh : {Shape{4, 4096, 300, true}, Shape{4, 1024, 64, true}, Shape{4, 2048, 17, true},
                         Shape{3, 1024, 100, true}, Shape{2, 2048, 45, true}, Shape{1, 1024, 33, true},
                         Shape{4, 1024, 16, false}, Shape{4, 1056, 50, false}, Shape{6, 1024, 40, false}}) {
    const int64_t S = sh.S, D = sh.D, T = sh.T, M = (2 + S) * S;
    ModelConfig c;
    const float eps = static_cast<float>(c.rms_norm_eps), hc_eps = static_cast<float>(c.hc_eps);
    const int iters = static_cast<int>(c.hc_sinkhorn_iters);
    const std::vector<float> fn = test::randn(M * S * D, ++seed, 1.0f / std::sqrt(static_cast<float>(S * D)));
    const std::vector<float> base = test::randn(M, ++seed, 0.5f), scale{0.8f, 1.2f, 0.9f};
    std::vector<float> norm_w = test::randn(D, ++seed, 0.2f), post = test::randn(T * S, ++seed, 0.3f);
    std::vector<float> comb = test::randn(T * S * S, ++seed, 0.1f);
    for (float& x : norm_w) x += 1.0f;
    for (float& x : post) x += 1.0f;
    for (float& x : comb) x += 1.0f / static_cast<float>(S);
    std::vector<float> h = test::randn(T * S * D, ++seed);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < S * D; ++i) h[t * S * D + i] *= static_cast<float>(1 + t % 5);
    const std::vector<float> y = test::randn(T * D, ++seed, 2.0f);
    auto same = [](const std::vector<float>& x, const std::vector<float>& z) {
      if (x.size() != z.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!(x[i] == z[i] && std::signbit(x[i]) == std::signbit(z[i]))) return false;  // NaN never passes
      return true;
    };
    for (const bool in_place : {false, true}) {
      const std::string at = "S=" + std::to_string(S) + " D=" + std::to_string(D) + " T=" + std::to_string(T) +
                             (in_place ? " in place" : "");
      const cuda_testing::MhcPostPreOut ref = cuda_testing::mhc_post_pre(
          h, y, post, comb, fn, base, scale, norm_w, T, S, D, eps, hc_eps, iters, false, in_place);
      const cuda_testing::MhcPostPreOut got = cuda_testing::mhc_post_pre(
          h, y, post, comb, fn, base, scale, norm_w, T, S, D, eps, hc_eps, iters, true, in_place);
      EXPECT_FALSE(ref.fused) << at;
      EXPECT_EQ(got.fused, sh.fuses) << at;
      EXPECT_TRUE(same(got.out, ref.out)) << at;
      EXPECT_TRUE(same(got.post, ref.post)) << at;
      EXPECT_TRUE(same(got.comb, ref.comb)) << at;
      EXPECT_TRUE(same(got.a, ref.a)) << at;
      // The reference's new streams are the post-mix's (to float rounding of the CPU's order).
      double err = 0;
      for (int64_t t = 0; t < T; t += 7)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t d = 0; d < D; d += 13) {
            double v = static_cast<double>(post[t * S + s]) * y[t * D + d];
            for (int64_t r = 0; r < S; ++r)
              v += static_cast<double>(comb[(t * S + r) * S + s]) * h[(t * S + r) * D + d];
            err = std::max(err, std::abs(v - ref.out[(t * S + s) * D + d]) / (1.0 + std::abs(v)));
          }
      EXPECT_LE(err, 1e-5) << at;
    }
  }
}

}  // namespace
}  // namespace nextlm

// ---- DSA indexer prefill (src/cuda/dsa.cu) ----
#include <algorithm>
#include <functional>

#include "cpu/linear.h"

namespace nextlm {
namespace {

struct IndexerPrefillCase {
  int64_t IH, ID, P, topk;
  bool tail;
  int64_t score_rows;  // 0: as the model sizes the workspace; else chunks of that many tokens
};

void PrintTo(const IndexerPrefillCase& c, std::ostream* os) {
  *os << "IH=" << c.IH << " ID=" << c.ID << " P=" << c.P << " topk=" << c.topk << (c.tail ? " tail" : " no tail")
      << " rows=" << c.score_rows;
}

class CudaIndexerPrefill : public ::testing::TestWithParam<IndexerPrefillCase> {};

// The prefill selection (tiled fp32 scores, radix top-k) against the CPU indexer on packed sequences whose tiles of
// 32 tokens straddle sequence starts (two sequences that both choose in one tile when topk/P is small), the first
// P−1 tokens empty without the tail, ID below, at and not a multiple of 32. Both sides are fp32 with different
// summation orders, so a token whose budget-th and next scores are within 1e-5 of its score scale (double-precision
// scores of the spec) may differ at that boundary; every other token must match exactly. Then batch invariance:
// each sequence alone and the tokens scored in chunks give bitwise the same selections, and so does decoding.
TEST_P(CudaIndexerPrefill, SelectionsEqualCpuAndAreBatchInvariant) {
  const IndexerPrefillCase pc = GetParam();
  ModelConfig c;
  c.hidden_size = 24, c.q_lora_rank = 20, c.index_n_heads = pc.IH, c.index_head_dim = pc.ID;
  c.index_kpool = pc.P, c.index_topk = pc.topk, c.index_kpool_always_select_tail = pc.tail;
  const int64_t D = c.hidden_size, QL = c.q_lora_rank, IH = pc.IH, ID = pc.ID, P = pc.P;
  auto tensor = [](std::vector<int64_t> shape, unsigned seed, float scale) {
    Tensor t(shape);
    t.data = test::randn(t.data.size(), seed, scale);
    return t;
  };
  IndexerWeights w;
  w.wq_b = tensor({IH * ID, QL}, 11, 0.3f);
  w.wk = tensor({ID, D}, 12, 0.3f);
  w.k_norm_w = tensor({ID}, 13, 0.2f);
  for (float& x : w.k_norm_w.data) x += 1.0f;
  w.k_norm_b = tensor({ID}, 14, 0.1f);
  w.weights_proj = tensor({IH, D}, 15, 0.3f);
  w.ape = tensor({P, ID}, 16, 0.5f);
  w.gate = tensor({ID, D}, 17, 0.3f);

  const std::vector<int64_t> lens{300, 47, 1030, 90};
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back();
  const std::vector<float> a = test::randn(T * D, 21), qr = test::randn(T * QL, 22);
  const Selection want = indexer_forward(w, c, a.data(), qr.data(), T, cu);

  cuda_testing::IndexerPrefill in;
  in.IH = IH, in.ID = ID, in.P = P, in.topk = pc.topk, in.tail = pc.tail, in.score_rows = pc.score_rows;
  in.cu_seqlens = cu, in.ape = w.ape.data;
  in.qi.resize(T * IH * ID), in.ki.resize(T * ID), in.gs.resize(T * ID), in.wts.resize(T * IH);
  cpu::linear(qr.data(), T, QL, w.wq_b, in.qi.data());
  cpu::linear(a.data(), T, D, w.wk, in.ki.data());
  layernorm_forward(in.ki.data(), w.k_norm_w.ptr(), w.k_norm_b.ptr(), in.ki.data(), T, ID, 1e-6f);
  cpu::linear(a.data(), T, D, w.gate, in.gs.data());
  cpu::linear(a.data(), T, D, w.weights_proj, in.wts.data());
  const std::vector<std::vector<int32_t>> got = cuda_testing::indexer_prefill(in);
  ASSERT_EQ(static_cast<int64_t>(got.size()), T);

  // Double-precision scores of the spec, for telling a rounding-order boundary from a wrong selection.
  const int64_t budget = pc.topk / P;
  int64_t chosen = 0, near_ties = 0, mismatched = 0;
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t t0 = cu[n], L = cu[n + 1] - cu[n], npool = L / P;
    std::vector<double> pk(npool * ID);
    for (int64_t j = 0; j < npool; ++j)
      for (int64_t ch = 0; ch < ID; ++ch) {
        double mx = -INFINITY, den = 0, num = 0;
        auto logit = [&](int64_t i) { return double(in.gs[(t0 + j * P + i) * ID + ch]) + w.ape.data[i * ID + ch]; };
        for (int64_t i = 0; i < P; ++i) mx = std::max(mx, logit(i));
        for (int64_t i = 0; i < P; ++i) {
          const double e = std::exp(logit(i) - mx);
          den += e, num += e * in.ki[(t0 + j * P + i) * ID + ch];
        }
        pk[j * ID + ch] = num / den;
      }
    for (int64_t r = 0; r < L; ++r) {
      const int64_t t = t0 + r, selectable = (r + 1) / P;
      bool tie = false;
      if (selectable > budget) {
        ++chosen;
        std::vector<double> s(selectable);
        double scale = 0;
        for (int64_t j = 0; j < selectable; ++j) {
          double acc = 0;
          for (int64_t h = 0; h < IH; ++h) {
            double dot = 0;
            for (int64_t ch = 0; ch < ID; ++ch) dot += double(in.qi[(t * IH + h) * ID + ch]) * pk[j * ID + ch];
            acc += in.wts[t * IH + h] / std::sqrt(double(IH)) * std::max(dot / std::sqrt(double(ID)), 0.0);
          }
          s[j] = acc, scale = std::max(scale, std::abs(acc));
        }
        std::nth_element(s.begin(), s.begin() + budget, s.end(), std::greater<double>());
        const double next = s[budget], kth = *std::min_element(s.begin(), s.begin() + budget);
        // Pools that every head scores ≤ 0 are exactly 0 on both sides: ties among them break alike.
        tie = budget > 0 && kth - next <= 1e-5 * scale && !(kth == 0.0 && next == 0.0);
      }
      if (tie) {
        ++near_ties;
        EXPECT_EQ(got[t].size(), want[t].size()) << "token " << t;
      } else if (got[t] != want[t]) {
        if (++mismatched <= 3) ADD_FAILURE() << "sequence " << n << " position " << r << ": selection differs";
      }
    }
  }
  std::printf("[cuda] indexer prefill IH=%lld ID=%lld P=%lld topk=%lld tail=%d rows=%lld: %lld tokens (%lld chose "
              "by score, %lld near ties), %lld mismatched\n",
              static_cast<long long>(IH), static_cast<long long>(ID), static_cast<long long>(P),
              static_cast<long long>(pc.topk), pc.tail, static_cast<long long>(pc.score_rows),
              static_cast<long long>(T), static_cast<long long>(chosen), static_cast<long long>(near_ties),
              static_cast<long long>(mismatched));
  EXPECT_GT(chosen, 500);  // the top-k path was exercised
  EXPECT_LE(near_ties, T / 50);  // the data separates the scores: the comparison above is nearly all exact
  EXPECT_EQ(mismatched, 0);

  // Batch invariance: each sequence alone; all tokens scored in chunks of 45 rows.
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    cuda_testing::IndexerPrefill one = in;
    const int64_t t0 = cu[n], t1 = cu[n + 1];
    one.cu_seqlens = {0, t1 - t0};
    one.qi.assign(in.qi.begin() + t0 * IH * ID, in.qi.begin() + t1 * IH * ID);
    one.ki.assign(in.ki.begin() + t0 * ID, in.ki.begin() + t1 * ID);
    one.gs.assign(in.gs.begin() + t0 * ID, in.gs.begin() + t1 * ID);
    one.wts.assign(in.wts.begin() + t0 * IH, in.wts.begin() + t1 * IH);
    const std::vector<std::vector<int32_t>> alone = cuda_testing::indexer_prefill(one);
    for (int64_t r = 0; r < t1 - t0; ++r) EXPECT_EQ(alone[r], got[t0 + r]) << "sequence " << n << " position " << r;
  }
  cuda_testing::IndexerPrefill chunked = in;
  chunked.score_rows = 45;
  EXPECT_EQ(cuda_testing::indexer_prefill(chunked), got);

  // Decoding the first sequence a token at a time selects bitwise alike, near ties included: its scores add in the
  // same order.
  cuda_testing::IndexerDecodeSteps dec;
  dec.IH = IH, dec.ID = ID, dec.P = P, dec.topk = pc.topk, dec.num_slots = 1, dec.max_pools = lens[0] / P + 1;
  dec.tail = pc.tail, dec.ape = w.ape.data;
  for (int64_t t = 0; t < lens[0]; ++t) {
    dec.slots.push_back({0});
    dec.qi.emplace_back(in.qi.begin() + t * IH * ID, in.qi.begin() + (t + 1) * IH * ID);
    dec.ki.emplace_back(in.ki.begin() + t * ID, in.ki.begin() + (t + 1) * ID);
    dec.gs.emplace_back(in.gs.begin() + t * ID, in.gs.begin() + (t + 1) * ID);
    dec.wts.emplace_back(in.wts.begin() + t * IH, in.wts.begin() + (t + 1) * IH);
  }
  const auto steps = cuda_testing::indexer_decode_steps(dec);
  for (int64_t t = 0; t < lens[0]; ++t) EXPECT_EQ(steps[t][0], got[t]) << "decoding position " << t;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaIndexerPrefill,
                         ::testing::Values(IndexerPrefillCase{4, 32, 4, 64, true, 0},
                                           IndexerPrefillCase{4, 32, 4, 64, false, 0},
                                           IndexerPrefillCase{4, 32, 1, 64, true, 0},
                                           IndexerPrefillCase{4, 32, 1, 64, false, 37},
                                           IndexerPrefillCase{3, 40, 1, 16, true, 0},
                                           IndexerPrefillCase{2, 16, 4, 16, false, 0},
                                           IndexerPrefillCase{8, 128, 4, 32, true, 0}),
                         [](const auto& info) {
                           const IndexerPrefillCase& c = info.param;
                           return "IH" + std::to_string(c.IH) + "_ID" + std::to_string(c.ID) + "_P" +
                                  std::to_string(c.P) + "_topk" + std::to_string(c.topk) +
                                  (c.tail ? "_tail" : "_notail") + (c.score_rows ? "_chunked" : "");
                         });

}  // namespace
}  // namespace nextlm

namespace nextlm {
namespace {

// The batch-invariant GEMM mode (cuda/gemm.h) against a host reference of the bf16-rounded operands (on the rows
// r0 … r0+96), over shapes the model has: a long reduction, a width off the 256-column tile with accumulation, a narrow output (which takes the
// decoding GEMV); and each row of a 97-row product bitwise equal to the same row inside a 2031-row product. The
// cuBLASLt default is held to the reference too; its batch dependence is only reported.
// The fp32 ↔ bf16 conversions, on the four-at-a-time path with a tail and on the one-at-a-time path (misaligned):
// round to nearest even as the host's f32_to_bf16, infinities and signed zeros included; a NaN stays a NaN (the
// device's NaN encoding is its own).
TEST(CudaConvert, MatchesHostRoundingOnEveryPath) {
  std::vector<float> x = test::randn(1003, 41, 3.0f);
  x[5] = NAN, x[6] = INFINITY, x[7] = -INFINITY, x[8] = 0.0f, x[9] = -0.0f, x[1002] = 1.00390625f;  // a tie
  for (int64_t offset : {0, 1, 2, 4}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    const cuda_testing::Conversions c = cuda_testing::conversions(x, offset);
    ASSERT_EQ(c.to_bf16.size(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(x[i])) {
        EXPECT_GT(c.to_bf16[i] & 0x7fff, 0x7f80) << "to_bf16 at " << i;
        EXPECT_GT(c.rounded_bits[i] & 0x7fff, 0x7f80) << "round_to_bf16 at " << i;
        EXPECT_TRUE(std::isnan(c.rounded[i]) && std::isnan(c.widened[i])) << "at " << i;
        continue;
      }
      const uint16_t want = f32_to_bf16(x[i]);
      const float wide = bf16_to_f32(want);
      ASSERT_EQ(c.to_bf16[i], want) << "to_bf16 at " << i;
      ASSERT_EQ(c.rounded_bits[i], want) << "round_to_bf16 at " << i;
      ASSERT_EQ(std::memcmp(&c.rounded[i], &wide, 4), 0) << "round_to_bf16's x at " << i;
      ASSERT_EQ(std::memcmp(&c.widened[i], &wide, 4), 0) << "bf16_to_f32 at " << i;
    }
  }
}

// The training forward's fused KDA input steps give the bits of the separate ones: kda_conv_norm_rounded against
// kda_conv_norm + round_to_bf16 (W = 4 on the rows kernel at K = 64 and 128; W = 3 on the one-token kernel), and the
// gate out of place against in place (four at a time at H·K % 4 == 0, one at a time at K = 18, both gate forms).
TEST(CudaKda, FusedInputStepsGiveTheSeparateStepsBits) {
  struct Shape {
    int64_t H, K, W;
  };
  const std::vector<int64_t> cu{0, 37, 38, 170};
  for (const Shape sh : {Shape{2, 128, 4}, Shape{3, 64, 4}, Shape{2, 64, 3}, Shape{3, 18, 4}}) {
    for (bool has_bound : {true, false}) {
      SCOPED_TRACE("H " + std::to_string(sh.H) + " K " + std::to_string(sh.K) + " W " + std::to_string(sh.W) +
                   (has_bound ? " safe gate" : " softplus gate"));
      const int64_t T = cu.back(), HK = sh.H * sh.K;
      const cuda_testing::KdaPrep r = cuda_testing::kda_prep_both(
          test::randn(T * 3 * HK, 51, 2.0f), test::randn(3 * HK * sh.W, 52, 0.5f), cu,
          test::randn(T * HK, 53, 3.0f), test::randn(HK, 54, 0.5f), test::randn(sh.H, 55, 0.5f), sh.H, sh.K, sh.W,
          has_bound);
      ASSERT_EQ(r.fused.size(), size_t(3 * T * HK));
      size_t bad = 0, nonfinite = 0;
      for (size_t i = 0; i < r.fused.size(); ++i) {
        bad += std::memcmp(&r.fused[i], &r.separate[i], 4) != 0 || r.fused_bits[i] != r.separate_bits[i];
        nonfinite += !std::isfinite(r.fused[i]);
      }
      EXPECT_EQ(bad, 0u) << "q, k, v elements that differ";
      EXPECT_EQ(nonfinite, 0u);
      for (size_t i = 0; i < r.fused.size(); ++i)
        ASSERT_EQ(bf16_to_f32(r.fused_bits[i]), r.fused[i]) << "the fp32 output is the bf16 value, at " << i;
      ASSERT_EQ(r.gate_out_of_place.size(), size_t(T * HK));
      bad = 0;
      for (size_t i = 0; i < r.gate_out_of_place.size(); ++i)
        bad += std::memcmp(&r.gate_out_of_place[i], &r.gate_in_place[i], 4) != 0 ||
               !std::isfinite(r.gate_out_of_place[i]);
      EXPECT_EQ(bad, 0u) << "gate elements that differ (or are not finite)";
    }
  }
}

TEST(CudaGemm, BatchInvariantModeMatchesHostAndIgnoresTheBatch) {
  struct Shape {
    int64_t out, in;
    bool accumulate;
  };
  const int64_t T = 2031, r0 = 700, Ts = 97;
  unsigned seed = 900;
  for (const Shape sh : {Shape{1024, 12288, false}, Shape{4104, 1024, true}, Shape{2, 48, false}}) {
    std::vector<float> x = test::randn(T * sh.in, ++seed), W = test::randn(sh.out * sh.in, ++seed);
    for (float& e : W) e *= 0.05f;
    for (std::vector<float>* v : {&x, &W})
      for (float& e : *v) e = bf16_to_f32(f32_to_bf16(e));
    std::vector<float> y0;
    if (sh.accumulate) y0 = test::randn(T * sh.out, ++seed);
    std::vector<double> ref(Ts * sh.out);  // rows r0 … r0+Ts−1
    for (int64_t t = 0; t < Ts; ++t)
      for (int64_t o = 0; o < sh.out; ++o) {
        double acc = sh.accumulate ? y0[(r0 + t) * sh.out + o] : 0.0;
        for (int64_t i = 0; i < sh.in; ++i) acc += double(x[(r0 + t) * sh.in + i]) * W[o * sh.in + i];
        ref[t * sh.out + o] = acc;
      }
    const std::vector<float> xs(x.begin() + r0 * sh.in, x.begin() + (r0 + Ts) * sh.in);
    const std::vector<float> y0s =
        sh.accumulate ? std::vector<float>(y0.begin() + r0 * sh.out, y0.begin() + (r0 + Ts) * sh.out) : y0;
    for (bool inv : {false, true}) {
      const std::vector<float> big = cuda_testing::dense_gemm(x, W, y0, T, sh.out, sh.in, inv);
      const std::vector<float> small = cuda_testing::dense_gemm(xs, W, y0s, Ts, sh.out, sh.in, inv);
      double num = 0, den = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double d = big[r0 * sh.out + i] - ref[i];
        num += d * d, den += ref[i] * ref[i];
      }
      int64_t differ = 0;
      for (int64_t i = 0; i < Ts * sh.out; ++i) differ += small[i] != big[r0 * sh.out + i];
      std::printf("[cuda] GEMM %lldx%lld%s, %s: ||dy||/||y|| = %.2e vs the host; %lld of %lld values differ between "
                  "97 and 2031 rows\n",
                  static_cast<long long>(sh.out), static_cast<long long>(sh.in), sh.accumulate ? " (+=)" : "",
                  inv ? "batch-invariant" : "cuBLASLt", std::sqrt(num / den), static_cast<long long>(differ),
                  static_cast<long long>(Ts * sh.out));
      EXPECT_LE(std::sqrt(num / den), 5e-5);  // fp32 sums of up to 12288 terms: 1.4e-5 on the H200
      if (inv) {
        EXPECT_EQ(differ, 0);
      }
    }
  }
}

// More activations than the device holds: a clear one-line error naming the shortfall, not a CUDA error string,
// and the device stays usable afterwards (the allocation failure is not sticky).
TEST(CudaArena, OutOfMemoryIsAClearErrorAndLeavesTheDeviceUsable) {
  try {
    cuda_testing::arena_alloc(size_t{1} << 50);  // 1 PiB
    FAIL() << "a 1 PiB arena allocation succeeded";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of device memory: 1073741824 MiB more of activations wanted"), std::string::npos)
        << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_NO_THROW(cuda_testing::arena_alloc(size_t{1} << 20));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace nextlm
