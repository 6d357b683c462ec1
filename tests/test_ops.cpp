// Component tests of the CPU reference: KDA chunked (WY) form against the recurrent definition, Sinkhorn output
// doubly stochastic, the MoE router against a brute-force choice, the clamped SwiGLU, the indexer's selection rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "model/dsa.h"
#include "model/kda.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "model/norm.h"
#include "test_util.h"

namespace nextlm {
namespace {

// Random KDA inputs for H heads of width K over T tokens, laid out [T, H, K] as the layer does.
struct KdaInputs {
  int64_t T, H, K;
  std::vector<float> q, k, v, g, beta;
  KdaInputs(int64_t T_, int64_t H_, int64_t K_, unsigned seed, float gmin) : T(T_), H(H_), K(K_) {
    q = test::randn(T * H * K, seed);
    k = test::randn(T * H * K, seed + 1);
    v = test::randn(T * H * K, seed + 2);
    g = test::randn(T * H * K, seed + 3);
    beta = test::randn(T * H, seed + 4);
    for (int64_t r = 0; r < T * H; ++r) {  // L2-normalise q, k rows; q also times K^-1/2
      double sq = 0, sk = 0;
      for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
      for (int64_t d = 0; d < K; ++d) q[r * K + d] /= std::sqrt(sq) * std::sqrt(static_cast<double>(K));
      for (int64_t d = 0; d < K; ++d) k[r * K + d] /= std::sqrt(sk);
      beta[r] = sigmoidf(beta[r]);
    }
    for (float& x : g) x = gmin * sigmoidf(x);  // the safe gate's range (gmin, 0)
  }
  KdaSeq seq(int64_t h, int64_t t0, int64_t t1, float* o) const {
    const int64_t off = t0 * H * K + h * K;
    return KdaSeq{q.data() + off, k.data() + off, v.data() + off, g.data() + off, beta.data() + t0 * H + h,
                  t1 - t0, K, H * K, H, o + off};
  }
};

// Both forms are algebraically equal; in fp32 they differ by rounding only (sums of ≤ 64·K terms of O(1) values),
// ~1e-6 relative, so 1e-5 is a safe bound that a wrong mask, decay or substitution step would exceed by far.
constexpr double kFormTol = 1e-5;

class KdaForms : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, float>> {};

TEST_P(KdaForms, ChunkedEqualsRecurrent) {
  const auto [T, K, gmin] = GetParam();
  const int64_t H = 2;
  KdaInputs in(T, H, K, static_cast<unsigned>(T * 7 + K), gmin);
  std::vector<float> o_rec(T * H * K, NAN), o_chk(T * H * K, NAN);
  for (int64_t h = 0; h < H; ++h) {
    std::vector<float> s_rec(K * K, 0.0f), s_chk(K * K, 0.0f);
    kda_recurrent_forward(in.seq(h, 0, T, o_rec.data()), s_rec.data());
    kda_chunked_forward(in.seq(h, 0, T, o_chk.data()), s_chk.data(), 64);
    EXPECT_LE(test::norm_rel_error(s_chk.data(), s_rec.data(), s_rec.size()), kFormTol) << "final state, head " << h;
  }
  // Poisoned with NaN: every output element must have been written.
  EXPECT_LE(test::norm_rel_error(o_chk.data(), o_rec.data(), o_rec.size()), kFormTol);
  EXPECT_LE(test::max_rel_error(o_chk.data(), o_rec.data(), o_rec.size()), 10 * kFormTol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, KdaForms,
                         ::testing::Combine(::testing::Values(1, 63, 64, 65, 150), ::testing::Values(16, 32),
                                            ::testing::Values(-5.0f, -12.0f)));

TEST(Kda, StateCarriesAcrossCalls) {
  // Running [0, 70) then [70, 150) with the state handed over equals one call: what a decode cache relies on.
  const int64_t T = 150, H = 1, K = 16, split = 70;
  KdaInputs in(T, H, K, 11, -5.0f);
  for (bool chunked : {false, true}) {
    std::vector<float> whole(T * K), parts(T * K), s1(K * K, 0.0f), s2(K * K, 0.0f);
    auto run = [&](const KdaSeq& s, float* st) {
      chunked ? kda_chunked_forward(s, st, 64) : kda_recurrent_forward(s, st);
    };
    run(in.seq(0, 0, T, whole.data()), s1.data());
    run(in.seq(0, 0, split, parts.data()), s2.data());
    run(in.seq(0, split, T, parts.data()), s2.data());
    EXPECT_LE(test::norm_rel_error(parts.data(), whole.data(), whole.size()), kFormTol) << "chunked=" << chunked;
    EXPECT_LE(test::norm_rel_error(s2.data(), s1.data(), s1.size()), kFormTol) << "chunked=" << chunked;
  }
}

TEST(Kda, ChunkSizeDoesNotChangeTheFunction) {
  const int64_t T = 100, K = 16;
  KdaInputs in(T, 1, K, 5, -5.0f);
  std::vector<float> a(T * K), b(T * K), sa(K * K, 0.0f), sb(K * K, 0.0f);
  kda_chunked_forward(in.seq(0, 0, T, a.data()), sa.data(), 64);
  kda_chunked_forward(in.seq(0, 0, T, b.data()), sb.data(), 16);
  EXPECT_LE(test::norm_rel_error(b.data(), a.data(), a.size()), kFormTol);
}

TEST(Kda, SingleTokenIsBetaTimesVScaledByQk) {
  // With a zero state, o_0 = (q·k)·beta·v: a hand-checkable case of the delta rule.
  const int64_t K = 4;
  std::vector<float> q{0.5f, 0.0f, 0.0f, 0.0f}, k{1.0f, 0.0f, 0.0f, 0.0f}, v{1.0f, 2.0f, 3.0f, 4.0f},
      g{-1.0f, -1.0f, -1.0f, -1.0f}, beta{0.25f}, o(K), st(K * K, 0.0f);
  kda_recurrent_forward(KdaSeq{q.data(), k.data(), v.data(), g.data(), beta.data(), 1, K, K, 1, o.data()}, st.data());
  for (int64_t j = 0; j < K; ++j) EXPECT_FLOAT_EQ(o[j], 0.5f * 0.25f * v[j]);
}

TEST(Sinkhorn, OutputIsDoublyStochastic) {
  for (int64_t S : {2, 3, 4, 6}) {
    auto x = test::randn(S * S, static_cast<unsigned>(S), 2.0f);
    std::vector<float> C(S * S);
    for (int64_t r = 0; r < S; ++r) {  // softmax rows + eps, as mHC feeds it
      float mx = *std::max_element(x.begin() + r * S, x.begin() + (r + 1) * S), sum = 0;
      for (int64_t s = 0; s < S; ++s) sum += C[r * S + s] = std::exp(x[r * S + s] - mx);
      for (int64_t s = 0; s < S; ++s) C[r * S + s] = C[r * S + s] / sum + 1e-6f;
    }
    sinkhorn_forward(C.data(), S, 20, 1e-6f);
    for (int64_t i = 0; i < S; ++i) {
      float row = 0, col = 0;
      for (int64_t j = 0; j < S; ++j) {
        row += C[i * S + j];
        col += C[j * S + i];
        EXPECT_GT(C[i * S + j], 0.0f);
      }
      EXPECT_NEAR(col, 1.0f, 1e-5f) << "S=" << S;  // the last step normalises columns
      EXPECT_NEAR(row, 1.0f, 1e-3f) << "S=" << S;  // rows have converged after 20 iterations
    }
  }
}

TEST(Sinkhorn, OneIterationOnlyNormalisesColumns) {
  std::vector<float> C{1, 3, 1, 1};  // columns sum to 2 and 4
  sinkhorn_forward(C.data(), 2, 1, 0.0f);
  EXPECT_FLOAT_EQ(C[0], 0.5f);
  EXPECT_FLOAT_EQ(C[1], 0.75f);
  EXPECT_FLOAT_EQ(C[2], 0.5f);
  EXPECT_FLOAT_EQ(C[3], 0.25f);
}

// A MoE config and random router parameters.
ModelConfig router_config(int64_t E, int64_t G, int64_t TG, int64_t k, bool norm) {
  ModelConfig c;
  c.hidden_size = 8;
  c.n_routed_experts = E;
  c.n_group = G;
  c.topk_group = TG;
  c.num_experts_per_tok = k;
  c.norm_topk_prob = norm;
  c.routed_scaling_factor = 2.5;
  return c;
}

// Brute force: the group subset with the largest sum of group scores, then the k-subset of its experts with the
// largest sum of choice scores (top-k by score maximises the sum).
std::set<int32_t> brute_force_choice(const std::vector<float>& choice, int64_t G, int64_t TG, int64_t k) {
  const int64_t E = static_cast<int64_t>(choice.size()), EG = E / G;
  std::vector<float> gs(G);
  for (int64_t g = 0; g < G; ++g) {
    std::vector<float> v(choice.begin() + g * EG, choice.begin() + (g + 1) * EG);
    std::sort(v.rbegin(), v.rend());
    gs[g] = v[0] + v[1];
  }
  float best = -INFINITY;
  uint32_t best_groups = 0;
  for (uint32_t m = 0; m < (1u << G); ++m) {
    if (__builtin_popcount(m) != TG) continue;
    float s = 0;
    for (int64_t g = 0; g < G; ++g)
      if (m >> g & 1) s += gs[g];
    if (s > best) best = s, best_groups = m;
  }
  std::vector<int64_t> cand;
  for (int64_t e = 0; e < E; ++e)
    if (best_groups >> (e / EG) & 1) cand.push_back(e);
  float best_sum = -INFINITY;
  std::set<int32_t> out;
  const int64_t n = static_cast<int64_t>(cand.size());
  for (uint32_t m = 0; m < (1u << n); ++m) {
    if (__builtin_popcount(m) != k) continue;
    float s = 0;
    std::set<int32_t> pick;
    for (int64_t i = 0; i < n; ++i)
      if (m >> i & 1) s += choice[cand[i]], pick.insert(static_cast<int32_t>(cand[i]));
    if (s > best_sum) best_sum = s, out = pick;
  }
  return out;
}

TEST(Router, MatchesBruteForce) {
  for (auto [E, G, TG, k, norm] : {std::tuple{16, 4, 2, 3, true}, std::tuple{12, 1, 1, 4, false},
                                    std::tuple{16, 8, 3, 2, true}}) {
    ModelConfig c = router_config(E, G, TG, k, norm);
    MoeWeights w;
    w.router = Tensor({E, c.hidden_size});
    w.router.data = test::randn(E * c.hidden_size, static_cast<unsigned>(E + G));
    w.correction_bias = Tensor({E});
    w.correction_bias.data = test::randn(E, 99, 0.3f);
    const int64_t T = 40;
    const auto x = test::randn(T * c.hidden_size, 7);
    const Routing r = route_forward(w, c, x.data(), T);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> s(E), choice(E);
      for (int64_t e = 0; e < E; ++e) {
        float logit = 0;
        for (int64_t d = 0; d < c.hidden_size; ++d) logit += x[t * c.hidden_size + d] * w.router.data[e * c.hidden_size + d];
        s[e] = sigmoidf(logit);
        choice[e] = s[e] + w.correction_bias.data[e];
      }
      const std::set<int32_t> want = brute_force_choice(choice, G, TG, k);
      const std::set<int32_t> got(r.experts.begin() + t * k, r.experts.begin() + (t + 1) * k);
      ASSERT_EQ(got, want) << "token " << t << " E=" << E << " G=" << G;
      // Weights are the sigmoid scores (not the biased choice scores), normalised if asked, times the scale.
      float sum = 0;
      for (int32_t e : want) sum += s[e];
      for (int64_t i = 0; i < k; ++i) {
        const float expect = s[r.experts[t * k + i]] / (norm ? sum : 1.0f) * 2.5f;
        EXPECT_NEAR(r.weights[t * k + i], expect, 1e-6f);
      }
    }
  }
}

TEST(Mlp, ClampsGateFromAboveAndUpOnBothSides) {
  // D = I = 1: gate·x = g, up·x = u, down = 1, limit L = 2.
  auto run = [](float g, float u) {
    MlpWeights w{Tensor({1, 1}, g), Tensor({1, 1}, u), Tensor({1, 1}, 1.0f)};
    float x = 1.0f, y = 0.0f;
    mlp_forward(w, 2.0f, &x, 1, 1, &y);
    return y;
  };
  EXPECT_FLOAT_EQ(run(3.0f, -4.0f), siluf(2.0f) * -2.0f);   // both clipped
  EXPECT_FLOAT_EQ(run(-5.0f, 1.5f), siluf(-5.0f) * 1.5f);   // gate is not clipped from below
  EXPECT_FLOAT_EQ(run(1.0f, 5.0f), siluf(1.0f) * 2.0f);     // up clipped from above
}

TEST(Norm, RmsNormMatchesHandValue) {
  const float x[2] = {3.0f, 4.0f}, w[2] = {2.0f, 0.5f};
  float y[2];
  rmsnorm_forward(x, w, y, 1, 2, 0.0f);
  const float r = 1.0f / std::sqrt(12.5f);
  EXPECT_FLOAT_EQ(y[0], 2.0f * 3.0f * r);
  EXPECT_FLOAT_EQ(y[1], 0.5f * 4.0f * r);
}

// Random indexer parameters for the selection-rule tests.
IndexerWeights random_indexer(const ModelConfig& c, unsigned seed) {
  const int64_t D = c.hidden_size, IH = c.index_n_heads, ID = c.index_head_dim, P = c.index_kpool;
  auto t = [&](std::vector<int64_t> s, unsigned k, float scale) {
    Tensor x(s);
    x.data = test::randn(x.data.size(), seed + k, scale);
    return x;
  };
  return IndexerWeights{t({IH * ID, c.q_lora_rank}, 1, 0.3f), t({ID, D}, 2, 0.3f), Tensor({ID}, 1.0f), Tensor({ID}, 0.0f),
                        t({IH, D}, 3, 0.3f), t({P, ID}, 4, 0.5f), t({ID, D}, 5, 0.3f)};
}

class IndexerRules : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(IndexerRules, SelectionFollowsPoolsBudgetAndTail) {
  const auto [P, tail] = GetParam();
  ModelConfig c;
  c.hidden_size = 16;
  c.q_lora_rank = 8;
  c.index_n_heads = 4;
  c.index_head_dim = 8;
  c.index_kpool = P;
  c.index_topk = 8 * P;
  c.index_kpool_always_select_tail = tail;
  const IndexerWeights w = random_indexer(c, 3);
  const std::vector<int64_t> lens{150, 1, P + 1, 3 * P - 1};
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back();
  const auto a = test::randn(T * c.hidden_size, 1), qr = test::randn(T * c.q_lora_rank, 2);
  const Selection sel = indexer_forward(w, c, a.data(), qr.data(), T, cu);
  ASSERT_EQ(static_cast<int64_t>(sel.size()), T);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = 0; t < cu[n + 1] - cu[n]; ++t) {
      const auto& s = sel[cu[n] + t];
      const int64_t selectable = (t + 1) / P, budget = std::min<int64_t>(8, (cu[n + 1] - cu[n]) / P);
      const int64_t tail_len = (tail && P > 1) ? (t + 1) % P : 0;
      ASSERT_EQ(static_cast<int64_t>(s.size()), std::min(selectable, budget) * P + tail_len) << "t=" << t;
      EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
      EXPECT_EQ(std::set<int32_t>(s.begin(), s.end()).size(), s.size());
      for (int32_t i : s) EXPECT_LE(i, t);  // causal, sequence-relative
      if (t + 1 <= c.index_topk && tail) {  // short prefixes attend densely
        std::vector<int32_t> all(t + 1);
        std::iota(all.begin(), all.end(), 0);
        EXPECT_EQ(s, all) << "t=" << t;
      }
      for (size_t i = 0; i + tail_len < s.size(); i += P)  // whole pools, aligned to the sequence start
        EXPECT_EQ(s[i] % P, 0);
    }
}

INSTANTIATE_TEST_SUITE_P(Pools, IndexerRules,
                         ::testing::Combine(::testing::Values(1, 4, 16), ::testing::Values(true, false)));

}  // namespace
}  // namespace nextlm
