// Finite-difference tests of every component backward (backward.h) on small random shapes, against the
// reference forwards themselves where they exist (rmsnorm_forward, mhc_*_forward, sinkhorn_forward,
// kda_recurrent_forward, kda_layer_forward, dsa_layer_forward with a given selection, mlp_forward), plus exact
// checks of the linear parts and the conventions (accumulation, frozen tensors, padding row, tied lm_head).
//
// Method: the scalar is L = Σ r ⊙ outputs with fixed random r, summed in double from the fp32 forward, and the
// derivative is the 4-point central difference (8(f(x+h) − f(x−h)) − (f(x+2h) − f(x−2h)))/12h with h = 1e-2 on O(1)
// inputs: truncation O(h⁴) ≈ 1e-8, and fp32 rounding of L (~1e-7 relative) divided by h gives ~1e-5 relative noise
// per entry. Each check samples up to 24 entries of a tensor and bounds ‖g − fd‖/‖fd‖ over them by kFdTol = 1e-3:
// far above that noise, while a wrong term (a dropped path, a sign, a missing factor) gives O(0.1–1).
// Exceptions, each explained where it is used: where a clamp clips (SwiGLU, MoE) h is 1e-3 so that a step does not
// cross the kink; the KDA recurrence uses h = 2e-2 (it is polynomial in its inputs but for g); the whole KDA layer
// uses h = 5e-3 and a 5e-3 bound (its fp32 recurrence is noisier and its L2 norms bend sharply).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "cpu/linear.h"
#include "model/backward.h"
#include "model/norm.h"
#include "model/train.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr double kFdTol = 1e-3;
constexpr double kKdaLayerTol = 5e-3;
constexpr size_t kSamples = 24;

Tensor rand_tensor(std::vector<int64_t> shape, unsigned seed, float scale = 1.0f, float offset = 0.0f) {
  Tensor t(std::move(shape));
  t.data = test::randn(t.data.size(), seed, scale);
  for (float& x : t.data) x += offset;
  return t;
}
Tensor rand_weight(int64_t out, int64_t in, unsigned seed) {
  return rand_tensor({out, in}, seed, 1.0f / std::sqrt(static_cast<float>(in)));
}

double dot(const std::vector<float>& r, const float* y) {
  double s = 0.0;
  for (size_t i = 0; i < r.size(); ++i) s += static_cast<double>(r[i]) * y[i];
  return s;
}

// ‖g − fd‖/‖fd‖ over the entries idx of x.
double fd_error_at(const std::function<double()>& f, float* x, const float* g, const std::vector<size_t>& idx,
                   float h) {
  double diff = 0.0, ref = 0.0;
  for (size_t i : idx) {
    const float x0 = x[i];
    auto at = [&](float d) {
      x[i] = x0 + d;
      const double v = f();
      x[i] = x0;
      return v;
    };
    const double fd = (8.0 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12.0 * h);
    diff += (fd - g[i]) * (fd - g[i]);
    ref += fd * fd;
  }
  if (!std::isfinite(diff)) return INFINITY;
  return std::sqrt(diff / std::max(ref, 1e-30));
}

// Up to kSamples of the indices `all`, chosen at random (all of them when there are few).
std::vector<size_t> sample(std::vector<size_t> all, unsigned seed = 7) {
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(std::min(all.size(), kSamples));
  return all;
}

// ‖g − fd‖/‖fd‖ over up to kSamples entries of x [n].
double fd_error(const std::function<double()>& f, float* x, const float* g, size_t n, float h = 1e-2f) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  return fd_error_at(f, x, g, sample(idx), h);
}

// EXPECT_FD(f, x, g, n) checks g against differences of f in x with h = 1e-2 and kFdTol; EXPECT_FD_AT adds the
// step and the bound.
#define EXPECT_FD_AT(f, x, g, n, h, tol)                 \
  do {                                                   \
    const double err_ = fd_error(f, x, g, n, h);         \
    EXPECT_LE(err_, tol) << #x;                          \
  } while (0)
#define EXPECT_FD(f, x, g, n) EXPECT_FD_AT(f, x, g, n, 1e-2f, kFdTol)

// A small config for the layer tests: D 16, 3 streams, KDA 2 heads × 8 with conv 4, MLA 2 heads, 8 experts top-2.
ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.hc_mult = 3;
  c.hc_sinkhorn_iters = 20;
  c.linear_num_heads = 2;
  c.linear_head_dim = 8;
  c.linear_conv_kernel_dim = 4;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.q_lora_rank = 12;
  c.kv_lora_rank = 10;
  c.qk_nope_head_dim = 8;
  c.v_head_dim = 6;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_group = 2;
  c.topk_group = 1;
  c.moe_intermediate_size = 6;
  c.intermediate_size = 10;
  c.n_shared_experts = 1;
  c.swiglu_limit = 10.0;
  return c;
}

std::vector<int64_t> cu_of(std::initializer_list<int64_t> lens) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// ---- RMSNorm ----------------------------------------------------------------------------------------------------

TEST(RmsNormBackward, WeightedAndUnweightedMatchFiniteDifferences) {
  for (bool weighted : {true, false}) {
    const int64_t T = 3, D = 24;
    Tensor x = rand_tensor({T, D}, 1), w = rand_tensor({D}, 2, 0.2f, 1.0f);
    const std::vector<float> r = test::randn(T * D, 3);
    const float* wp = weighted ? w.ptr() : nullptr;
    auto f = [&] {
      std::vector<float> y(T * D);
      rmsnorm_forward(x.ptr(), weighted ? w.ptr() : nullptr, y.data(), T, D, 1e-5f);
      return dot(r, y.data());
    };
    std::vector<float> dx(T * D, 0.0f), dw(D, 0.0f);
    rmsnorm_backward(x.ptr(), wp, r.data(), T, D, 1e-5f, dx.data(), weighted ? dw.data() : nullptr);
    EXPECT_FD(f, x.ptr(), dx.data(), x.data.size());
    if (weighted) EXPECT_FD(f, w.ptr(), dw.data(), w.data.size());
  }
}

// ---- Embedding --------------------------------------------------------------------------------------------------

TEST(EmbeddingBackward, SumsStreamsIntoRowsAndSkipsThePaddingRow) {
  const int64_t V = 6, D = 4, S = 3;
  const std::vector<int32_t> tokens{2, 0, 2, 5};
  const int64_t T = static_cast<int64_t>(tokens.size());
  const std::vector<float> dh = test::randn(T * S * D, 4);
  Tensor g({V, D}, 0.5f);  // accumulates onto what is there
  embedding_backward(tokens.data(), T, S, dh.data(), int64_t{0}, g);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t d = 0; d < D; ++d) {
      double want = 0.5;
      for (int64_t t = 0; t < T; ++t)
        if (tokens[t] == v && v != 0)
          for (int64_t s = 0; s < S; ++s) want += dh[(t * S + s) * D + d];
      EXPECT_NEAR(g.data[v * D + d], want, 1e-5) << v << "," << d;
    }
  // Without a pad id, token 0's row gets its gradient too.
  Tensor g2({V, D}, 0.0f);
  embedding_backward(tokens.data(), T, S, dh.data(), std::nullopt, g2);
  EXPECT_NE(g2.data[0], 0.0f);
}

// ---- mHC --------------------------------------------------------------------------------------------------------

class SinkhornBackward : public ::testing::TestWithParam<int64_t> {};

TEST_P(SinkhornBackward, MatchesFiniteDifferences) {
  const int64_t S = 4, iters = GetParam();
  std::vector<float> C0(S * S);
  for (size_t i = 0; i < C0.size(); ++i) C0[i] = 0.2f + 0.8f * sigmoidf(test::randn(S * S, 5)[i] * 2.0f);
  const std::vector<float> r = test::randn(S * S, 6);
  auto f = [&] {
    std::vector<float> C = C0;
    sinkhorn_forward(C.data(), S, iters, 1e-6f);
    return dot(r, C.data());
  };
  std::vector<float> dC0(S * S, 0.0f);
  sinkhorn_backward(C0.data(), S, iters, 1e-6f, r.data(), dC0.data());
  EXPECT_FD(f, C0.data(), dC0.data(), C0.size());
}

INSTANTIATE_TEST_SUITE_P(Iters, SinkhornBackward, ::testing::Values(1, 2, 20));

struct HcCase {
  int64_t T, iters;
};
class MhcBackward : public ::testing::TestWithParam<HcCase> {};

TEST_P(MhcBackward, PreMatchesFiniteDifferences) {
  ModelConfig c = small_config();
  c.hc_sinkhorn_iters = GetParam().iters;
  const int64_t T = GetParam().T, S = c.hc_mult, D = c.hidden_size, M = (2 + S) * S;
  HcWeights w{rand_weight(M, S * D, 10), rand_tensor({M}, 11, 0.5f), rand_tensor({3}, 12, 0.3f, 1.0f)};
  Tensor h = rand_tensor({T, S, D}, 13);
  const std::vector<float> rpost = test::randn(T * S, 14), rcomb = test::randn(T * S * S, 15),
                           ra = test::randn(T * D, 16);
  auto f = [&] {
    HcMix mix;
    std::vector<float> a(T * D);
    mhc_pre_forward(w, c, h.ptr(), T, mix, a.data());
    return dot(rpost, mix.post.data()) + dot(rcomb, mix.comb.data()) + dot(ra, a.data());
  };
  HcWeights dw = zeros_like(w);
  std::vector<float> dh(T * S * D, 0.0f);
  mhc_pre_backward(w, c, h.ptr(), T, rpost.data(), rcomb.data(), ra.data(), dh.data(), dw);
  EXPECT_FD(f, h.ptr(), dh.data(), dh.size());
  EXPECT_FD(f, w.fn.ptr(), dw.fn.ptr(), w.fn.data.size());
  EXPECT_FD(f, w.base.ptr(), dw.base.ptr(), w.base.data.size());
  EXPECT_FD(f, w.scale.ptr(), dw.scale.ptr(), w.scale.data.size());
}

TEST_P(MhcBackward, PostMatchesFiniteDifferences) {
  const int64_t T = GetParam().T, S = 3, D = 8;
  HcMix mix;
  mix.post = test::randn(T * S, 20);
  mix.comb = test::randn(T * S * S, 21);
  std::vector<float> h = test::randn(T * S * D, 22), y = test::randn(T * D, 23);
  const std::vector<float> r = test::randn(T * S * D, 24);
  auto f = [&] {
    std::vector<float> out(T * S * D);
    mhc_post_forward(mix, h.data(), y.data(), T, S, D, out.data());
    return dot(r, out.data());
  };
  std::vector<float> dh(T * S * D, 0.0f), dy(T * D, 0.0f), dpost(T * S, 0.0f), dcomb(T * S * S, 0.0f);
  mhc_post_backward(mix, h.data(), y.data(), T, S, D, r.data(), dh.data(), dy.data(), dpost.data(), dcomb.data());
  EXPECT_FD(f, h.data(), dh.data(), dh.size());
  EXPECT_FD(f, y.data(), dy.data(), dy.size());
  EXPECT_FD(f, mix.post.data(), dpost.data(), dpost.size());
  EXPECT_FD(f, mix.comb.data(), dcomb.data(), dcomb.size());
}

INSTANTIATE_TEST_SUITE_P(Shapes, MhcBackward,
                         ::testing::Values(HcCase{1, 20}, HcCase{3, 1}, HcCase{3, 20}, HcCase{65, 20}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_iters" + std::to_string(info.param.iters);
                         });

// ---- KDA --------------------------------------------------------------------------------------------------------

// Random recurrence inputs as the layer makes them: q, k L2-normed (q also K^-1/2), g in the safe gate's (−5, 0).
struct KdaInputs {
  int64_t T, H, K;
  std::vector<float> q, k, v, g, beta;
  KdaInputs(int64_t T_, int64_t H_, int64_t K_, unsigned seed) : T(T_), H(H_), K(K_) {
    q = test::randn(T * H * K, seed);
    k = test::randn(T * H * K, seed + 1);
    v = test::randn(T * H * K, seed + 2);
    g = test::randn(T * H * K, seed + 3);
    beta = test::randn(T * H, seed + 4);
    for (int64_t r = 0; r < T * H; ++r) {
      double sq = 0, sk = 0;
      for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
      for (int64_t d = 0; d < K; ++d) q[r * K + d] /= std::sqrt(sq) * std::sqrt(static_cast<double>(K));
      for (int64_t d = 0; d < K; ++d) k[r * K + d] /= std::sqrt(sk);
      beta[r] = sigmoidf(beta[r]);
    }
    for (float& x : g) x = -5.0f * sigmoidf(x);
  }
  KdaSeq seq(int64_t h, float* o) const {
    return KdaSeq{q.data() + h * K, k.data() + h * K, v.data() + h * K, g.data() + h * K, beta.data() + h,
                  T, K, H * K, H, o + h * K};
  }
};

class KdaRecurrentBackward : public ::testing::TestWithParam<int64_t> {};

TEST_P(KdaRecurrentBackward, MatchesFiniteDifferences) {
  const int64_t T = GetParam(), H = 2, K = 8;
  KdaInputs in(T, H, K, static_cast<unsigned>(30 + T));
  const std::vector<float> r = test::randn(T * H * K, 40);
  auto f = [&] {
    std::vector<float> o(T * H * K);
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float> state(K * K, 0.0f);
      kda_recurrent_forward(in.seq(h, o.data()), state.data());
    }
    return dot(r, o.data());
  };
  std::vector<float> dq(T * H * K, 0.0f), dk = dq, dv = dq, dg = dq, dbeta(T * H, 0.0f);
  for (int64_t h = 0; h < H; ++h)
    kda_recurrent_backward(in.seq(h, nullptr), r.data() + h * K, dq.data() + h * K, dk.data() + h * K,
                           dv.data() + h * K, dg.data() + h * K, dbeta.data() + h);
  // o is polynomial in q, k, v, β and smooth in g, so a larger step costs no truncation error, and it halves the
  // rounding noise on dg (a decay reaches every later token; at T = 65 h = 1e-2 measures ~6e-4, h = 2e-2 ~3.5e-4).
  const float h = 2e-2f;
  EXPECT_FD_AT(f, in.q.data(), dq.data(), dq.size(), h, kFdTol);
  EXPECT_FD_AT(f, in.k.data(), dk.data(), dk.size(), h, kFdTol);
  EXPECT_FD_AT(f, in.v.data(), dv.data(), dv.size(), h, kFdTol);
  EXPECT_FD_AT(f, in.g.data(), dg.data(), dg.size(), h, kFdTol);
  EXPECT_FD_AT(f, in.beta.data(), dbeta.data(), dbeta.size(), h, kFdTol);

  // The checkpoint spacing only changes where states are rebuilt from, not the result.
  std::vector<float> dq3(T * H * K, 0.0f), dk3 = dq3, dv3 = dq3, dg3 = dq3, dbeta3(T * H, 0.0f);
  for (int64_t h = 0; h < H; ++h)
    kda_recurrent_backward(in.seq(h, nullptr), r.data() + h * K, dq3.data() + h * K, dk3.data() + h * K,
                           dv3.data() + h * K, dg3.data() + h * K, dbeta3.data() + h, /*chunk=*/3);
  EXPECT_EQ(dq3, dq);
  EXPECT_EQ(dg3, dg);
  EXPECT_EQ(dbeta3, dbeta);
}

INSTANTIATE_TEST_SUITE_P(Lengths, KdaRecurrentBackward, ::testing::Values(1, 3, 65));

KdaWeights random_kda(const ModelConfig& c, unsigned seed) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K,
                W = c.linear_conv_kernel_dim;
  KdaWeights w;
  w.q_proj = rand_weight(HK, D, seed);
  w.k_proj = rand_weight(HK, D, seed + 1);
  w.v_proj = rand_weight(HK, D, seed + 2);
  w.q_conv = rand_tensor({HK, W}, seed + 3, 0.5f);
  w.k_conv = rand_tensor({HK, W}, seed + 4, 0.5f);
  w.v_conv = rand_tensor({HK, W}, seed + 5, 0.5f);
  w.f_a = rand_weight(K, D, seed + 6);
  w.f_b = rand_weight(HK, K, seed + 7);
  w.dt_bias = rand_tensor({HK}, seed + 8, 0.5f);
  w.A_log = rand_tensor({H}, seed + 9, 0.5f);
  w.b_proj = rand_weight(H, D, seed + 10);
  w.g_a = rand_weight(K, D, seed + 11);
  w.g_b = rand_weight(HK, K, seed + 12);
  w.o_norm = rand_tensor({K}, seed + 13, 0.2f, 1.0f);
  w.o_proj = rand_weight(D, HK, seed + 14);
  return w;
}

struct KdaCase {
  int64_t T;
  bool safe_gate;
};
class KdaLayerBackward : public ::testing::TestWithParam<KdaCase> {};

TEST_P(KdaLayerBackward, MatchesFiniteDifferences) {
  ModelConfig c = small_config();
  if (!GetParam().safe_gate) c.linear_lower_bound.reset();
  const int64_t D = c.hidden_size;
  // Two packed sequences, so that the conv and the state must restart at the second.
  const std::vector<int64_t> cu = cu_of({2, GetParam().T});
  const int64_t T = cu.back();
  KdaWeights w = random_kda(c, 50);
  Tensor a = rand_tensor({T, D}, 70);
  const std::vector<float> r = test::randn(T * D, 71);
  auto f = [&] {
    std::vector<float> y(T * D);
    kda_layer_forward(w, c, a.ptr(), T, cu, y.data(), KdaForm::Recurrent);
    return dot(r, y.data());
  };
  KdaActs acts;
  std::vector<float> y(T * D), y_ref(T * D), da(T * D, 0.0f);
  kda_layer_forward_train(w, c, a.ptr(), T, cu, acts, y.data());
  kda_layer_forward(w, c, a.ptr(), T, cu, y_ref.data(), KdaForm::Recurrent);
  EXPECT_LE(test::max_rel_error(y.data(), y_ref.data(), y.size()), 1e-6);
  KdaWeights dw = zeros_like(w);
  kda_layer_backward(w, c, a.ptr(), T, cu, acts, r.data(), da.data(), dw);
  // The layer's scalar carries the fp32 rounding of a 67-step recurrence (~3e-6 absolute), which limits h from
  // below, and the L2 norm of small q/k rows (norm ~0.25) bends sharply, which limits it from above: h = 5e-3 and a
  // bound of 5e-3 (measured worst ~1.6e-3). A wrong term still gives O(0.1); the recurrence itself is checked at
  // kFdTol above, and the whole model against transformers at 1e-3.
  const float h = 5e-3f;
  EXPECT_FD_AT(f, a.ptr(), da.data(), da.size(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.q_proj.ptr(), dw.q_proj.ptr(), w.q_proj.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.k_proj.ptr(), dw.k_proj.ptr(), w.k_proj.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.v_proj.ptr(), dw.v_proj.ptr(), w.v_proj.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.q_conv.ptr(), dw.q_conv.ptr(), w.q_conv.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.k_conv.ptr(), dw.k_conv.ptr(), w.k_conv.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.v_conv.ptr(), dw.v_conv.ptr(), w.v_conv.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.f_a.ptr(), dw.f_a.ptr(), w.f_a.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.f_b.ptr(), dw.f_b.ptr(), w.f_b.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.dt_bias.ptr(), dw.dt_bias.ptr(), w.dt_bias.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.A_log.ptr(), dw.A_log.ptr(), w.A_log.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.b_proj.ptr(), dw.b_proj.ptr(), w.b_proj.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.g_a.ptr(), dw.g_a.ptr(), w.g_a.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.g_b.ptr(), dw.g_b.ptr(), w.g_b.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.o_norm.ptr(), dw.o_norm.ptr(), w.o_norm.numel(), h, kKdaLayerTol);
  EXPECT_FD_AT(f, w.o_proj.ptr(), dw.o_proj.ptr(), w.o_proj.numel(), h, kKdaLayerTol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, KdaLayerBackward,
                         ::testing::Values(KdaCase{1, true}, KdaCase{3, false}, KdaCase{65, true},
                                           KdaCase{65, false}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + (info.param.safe_gate ? "_safe" : "_softplus");
                         });

// ---- DSA --------------------------------------------------------------------------------------------------------

DsaWeights random_dsa(const ModelConfig& c, unsigned seed) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  DsaWeights w;
  w.q_a = rand_weight(c.q_lora_rank, D, seed);
  w.q_a_norm = rand_tensor({c.q_lora_rank}, seed + 1, 0.2f, 1.0f);
  w.q_b = rand_tensor({NH * dqk, c.q_lora_rank}, seed + 2, 0.6f);  // scores of O(1), so softmax is not flat
  w.kv_a = rand_weight(c.kv_lora_rank, D, seed + 3);
  w.kv_a_norm = rand_tensor({c.kv_lora_rank}, seed + 4, 0.2f, 1.0f);
  w.kv_b = rand_tensor({NH * (dqk + dv), c.kv_lora_rank}, seed + 5, 0.6f);
  w.o_proj = rand_weight(D, NH * dv, seed + 6);
  return w;  // no indexer: the selection is given (as on a shared-indexer layer)
}

// Causal random selections: each query keeps a random subset of 0 … t (never empty unless `empty_first`).
Selection random_selection(const std::vector<int64_t>& cu, unsigned seed, int64_t empty_first) {
  std::mt19937 gen(seed);
  Selection sel(cu.back());
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = 0; t < cu[n + 1] - cu[n]; ++t) {
      auto& keys = sel[cu[n] + t];
      if (t < empty_first) continue;
      for (int64_t j = 0; j <= t; ++j)
        if (j == t || gen() % 3 != 0) keys.push_back(static_cast<int32_t>(j));
    }
  return sel;
}

class DsaLayerBackward : public ::testing::TestWithParam<int64_t> {};

TEST_P(DsaLayerBackward, MatchesFiniteDifferences) {
  const ModelConfig c = small_config();
  const int64_t D = c.hidden_size;
  const std::vector<int64_t> cu = cu_of({GetParam(), 2});
  const int64_t T = cu.back();
  DsaWeights w = random_dsa(c, 80);
  Tensor a = rand_tensor({T, D}, 90);
  const Selection sel = random_selection(cu, 91, 0);
  const std::vector<float> r = test::randn(T * D, 92);
  auto f = [&] {
    Selection s = sel;
    std::vector<float> y(T * D);
    dsa_layer_forward(w, c, a.ptr(), T, cu, s, y.data());
    return dot(r, y.data());
  };
  DsaActs acts;
  std::vector<float> y(T * D), y_ref(T * D), da(T * D, 0.0f);
  dsa_layer_forward_train(w, c, a.ptr(), T, cu, sel, acts, y.data());
  Selection s = sel;
  dsa_layer_forward(w, c, a.ptr(), T, cu, s, y_ref.data());
  EXPECT_LE(test::max_rel_error(y.data(), y_ref.data(), y.size()), 1e-6);
  DsaWeights dw = zeros_like(w);
  dsa_layer_backward(w, c, a.ptr(), T, cu, sel, acts, r.data(), da.data(), dw);
  EXPECT_FD(f, a.ptr(), da.data(), da.size());
  EXPECT_FD(f, w.q_a.ptr(), dw.q_a.ptr(), w.q_a.numel());
  EXPECT_FD(f, w.q_a_norm.ptr(), dw.q_a_norm.ptr(), w.q_a_norm.numel());
  EXPECT_FD(f, w.q_b.ptr(), dw.q_b.ptr(), w.q_b.numel());
  EXPECT_FD(f, w.kv_a.ptr(), dw.kv_a.ptr(), w.kv_a.numel());
  EXPECT_FD(f, w.kv_a_norm.ptr(), dw.kv_a_norm.ptr(), w.kv_a_norm.numel());
  EXPECT_FD(f, w.kv_b.ptr(), dw.kv_b.ptr(), w.kv_b.numel());
  EXPECT_FD(f, w.o_proj.ptr(), dw.o_proj.ptr(), w.o_proj.numel());
}

INSTANTIATE_TEST_SUITE_P(Lengths, DsaLayerBackward, ::testing::Values(1, 3, 65));

// A query with an empty selection has uniform weights over its sequence in the forward, so the true derivative of
// its output wrt q and k is zero; transformers' autograd (which the golden gradients record) still differentiates
// the softmax at the uniform output. The value path is the same either way: check it (o_proj and the v rows of
// kv_b) by finite differences, and that q_b does get autograd's gradient from those rows (the fp32_tail_off golden
// checks its value).
TEST(DsaLayerBackward, AllMaskedRowsPassGradientToValues) {
  const ModelConfig c = small_config();
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const std::vector<int64_t> cu = cu_of({6});
  const int64_t T = cu.back();
  DsaWeights w = random_dsa(c, 100);
  Tensor a = rand_tensor({T, D}, 101);
  const Selection sel = random_selection(cu, 102, /*empty_first=*/3);
  // Only the all-masked rows contribute to the loss.
  std::vector<float> r = test::randn(T * D, 103);
  std::fill(r.begin() + 3 * D, r.end(), 0.0f);
  auto f = [&] {
    Selection s = sel;
    std::vector<float> y(T * D);
    dsa_layer_forward(w, c, a.ptr(), T, cu, s, y.data());
    return dot(r, y.data());
  };
  DsaActs acts;
  std::vector<float> y(T * D), da(T * D, 0.0f);
  dsa_layer_forward_train(w, c, a.ptr(), T, cu, sel, acts, y.data());
  DsaWeights dw = zeros_like(w);
  dsa_layer_backward(w, c, a.ptr(), T, cu, sel, acts, r.data(), da.data(), dw);
  EXPECT_FD(f, w.o_proj.ptr(), dw.o_proj.ptr(), w.o_proj.numel());
  std::vector<size_t> v_rows;
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t j = 0; j < dv; ++j)
      for (int64_t l = 0; l < c.kv_lora_rank; ++l) v_rows.push_back((h * (dqk + dv) + dqk + j) * c.kv_lora_rank + l);
  EXPECT_LE(fd_error_at(f, w.kv_b.ptr(), dw.kv_b.ptr(), sample(v_rows), 1e-2f), kFdTol);
  double qb = 0.0;
  for (float x : dw.q_b.data) qb += std::fabs(x);
  EXPECT_GT(qb, 0.0);
}

// ---- MLP and MoE ------------------------------------------------------------------------------------------------

TEST(MlpBackward, ClampThatClipsMatchesFiniteDifferences) {
  const int64_t T = 5, D = 8, I = 12;
  const float L = 0.5f;  // clips a good share of gate·x (above) and up·x (both sides)
  MlpWeights w{rand_weight(I, D, 110), rand_weight(I, D, 111), rand_weight(D, I, 112)};
  Tensor x = rand_tensor({T, D}, 113, 1.5f);
  std::vector<float> g(T * I), u(T * I);
  cpu::linear(x.ptr(), T, D, w.gate, g.data());
  cpu::linear(x.ptr(), T, D, w.up, u.data());
  int clipped_gate = 0, clipped_up_low = 0, clipped_up_high = 0;
  for (int64_t i = 0; i < T * I; ++i) {
    clipped_gate += g[i] > L;
    clipped_up_low += u[i] < -L;
    clipped_up_high += u[i] > L;
  }
  ASSERT_GT(clipped_gate, 0);
  ASSERT_GT(clipped_up_low, 0);
  ASSERT_GT(clipped_up_high, 0);
  const std::vector<float> r = test::randn(T * D, 114);
  auto f = [&] {
    std::vector<float> y(T * D);
    mlp_forward(w, L, x.ptr(), T, D, y.data());
    return dot(r, y.data());
  };
  MlpWeights dw = zeros_like(w);
  std::vector<float> dx(T * D, 0.0f);
  mlp_backward(w, L, x.ptr(), T, D, r.data(), dx.data(), dw);
  const float h = 1e-3f;
  EXPECT_FD_AT(f, x.ptr(), dx.data(), dx.size(), h, kFdTol);
  EXPECT_FD_AT(f, w.gate.ptr(), dw.gate.ptr(), w.gate.numel(), h, kFdTol);
  EXPECT_FD_AT(f, w.up.ptr(), dw.up.ptr(), w.up.numel(), h, kFdTol);
  EXPECT_FD_AT(f, w.down.ptr(), dw.down.ptr(), w.down.numel(), h, kFdTol);
  // A clipped entry passes no gradient: with x[:, 0] = 1 and gate row 0 = 100·e_0, gate·x is 100 > L in row 0 for
  // every token, so gate row 0 gets none.
  MlpWeights one = w;
  Tensor xs = x;
  for (int64_t d = 0; d < D; ++d) one.gate.data[d] = d == 0 ? 100.0f : 0.0f;
  for (int64_t t = 0; t < T; ++t) xs.data[t * D] = 1.0f;
  MlpWeights d1 = zeros_like(one);
  std::vector<float> dxs(T * D, 0.0f);
  mlp_backward(one, L, xs.ptr(), T, D, r.data(), dxs.data(), d1);
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(d1.gate.data[d], 0.0f) << d;
}

MoeWeights random_moe(const ModelConfig& c, unsigned seed) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size;
  MoeWeights w;
  w.router = rand_weight(E, D, seed);
  w.correction_bias = rand_tensor({E}, seed + 1, 0.1f);
  for (int64_t e = 0; e < E; ++e)
    w.experts.push_back(MlpWeights{rand_weight(I, D, seed + 10 + 3 * e), rand_weight(I, D, seed + 11 + 3 * e),
                                   rand_weight(D, I, seed + 12 + 3 * e)});
  w.shared = MlpWeights{rand_weight(I, D, seed + 2), rand_weight(I, D, seed + 3), rand_weight(D, I, seed + 4)};
  return w;
}

class MoeBackward : public ::testing::TestWithParam<bool> {};

TEST_P(MoeBackward, RoutedMatchesFiniteDifferences) {
  ModelConfig c = small_config();
  c.norm_topk_prob = GetParam();
  c.swiglu_limit = 1.0;
  const int64_t T = 3, D = c.hidden_size, E = c.n_routed_experts;
  MoeWeights w = random_moe(c, 120);
  Tensor x = rand_tensor({T, D}, 121);
  const Routing routing = route_forward(w, c, x.ptr(), T);
  // The routed form with the router's own choice is the MoE.
  std::vector<float> y(T * D), y_ref(T * D);
  moe_forward_routed(w, c, x.ptr(), T, routing, y.data());
  moe_forward(w, c, x.ptr(), T, y_ref.data());
  EXPECT_LE(test::max_rel_error(y.data(), y_ref.data(), y.size()), 1e-6);

  const std::vector<float> r = test::randn(T * D, 122);
  auto f = [&] {
    std::vector<float> out(T * D);
    moe_forward_routed(w, c, x.ptr(), T, routing, out.data());
    return dot(r, out.data());
  };
  MoeWeights dw = zeros_like(w);
  EXPECT_TRUE(dw.correction_bias.empty());  // frozen
  std::vector<float> dx(T * D, 0.0f);
  moe_backward(w, c, x.ptr(), T, routing, r.data(), dx.data(), dw);
  const float h = 1e-3f;  // the clamp (limit 1) clips here
  EXPECT_FD_AT(f, x.ptr(), dx.data(), dx.size(), h, kFdTol);
  EXPECT_FD_AT(f, w.router.ptr(), dw.router.ptr(), w.router.numel(), h, kFdTol);
  EXPECT_FD_AT(f, w.shared->gate.ptr(), dw.shared->gate.ptr(), w.shared->gate.numel(), h, kFdTol);
  EXPECT_FD_AT(f, w.shared->down.ptr(), dw.shared->down.ptr(), w.shared->down.numel(), h, kFdTol);
  // 3 tokens × top-2 of 8 experts: some experts get no token and no gradient; the used ones match FD.
  int unused = 0;
  for (int64_t e = 0; e < E; ++e) {
    const bool used = std::count(routing.experts.begin(), routing.experts.end(), e) > 0;
    if (!used) {
      ++unused;
      for (const Tensor* t : {&dw.experts[e].gate, &dw.experts[e].up, &dw.experts[e].down})
        for (float v : t->data) EXPECT_EQ(v, 0.0f) << "expert " << e;
      continue;
    }
    EXPECT_FD_AT(f, w.experts[e].gate.ptr(), dw.experts[e].gate.ptr(), w.experts[e].gate.numel(), h, kFdTol);
    EXPECT_FD_AT(f, w.experts[e].up.ptr(), dw.experts[e].up.ptr(), w.experts[e].up.numel(), h, kFdTol);
    EXPECT_FD_AT(f, w.experts[e].down.ptr(), dw.experts[e].down.ptr(), w.experts[e].down.numel(), h, kFdTol);
  }
  EXPECT_GT(unused, 0);
}

INSTANTIATE_TEST_SUITE_P(Norm, MoeBackward, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "normalised" : "unnormalised"; });

// ---- Head and loss ----------------------------------------------------------------------------------------------

TEST(HeadLossBackward, MatchesFiniteDifferencesAndLogSoftmax) {
  const ModelConfig c = small_config();
  const int64_t S = c.hc_mult, D = c.hidden_size, V = c.vocab_size;
  const std::vector<int32_t> tokens{3, 7, 1, 30, 5, 9};
  const std::vector<int64_t> cu = cu_of({1, 3, 2});  // a one-token sequence predicts nothing
  const int64_t T = static_cast<int64_t>(tokens.size());
  ModelWeights w;
  w.final_norm = rand_tensor({D}, 130, 0.2f, 1.0f);
  w.lm_head = rand_weight(V, D, 131);
  Tensor h = rand_tensor({T, S, D}, 132);
  auto f = [&] { return head_loss_forward(w, c, h.ptr(), tokens, cu); };

  // L against an independent log-softmax of the logits.
  double want = 0.0;
  std::vector<float> hm(T * D), logits(T * V);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc += h.data[(t * S + s) * D + d];
      hm[t * D + d] = acc / S;
    }
  rmsnorm_forward(hm.data(), w.final_norm.ptr(), hm.data(), T, D, static_cast<float>(c.rms_norm_eps));
  cpu::linear(hm.data(), T, D, w.lm_head, logits.data());
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t + 1 < cu[n + 1]; ++t) {
      double z = 0.0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(logits[t * V + v]));
      want -= logits[t * V + tokens[t + 1]] - std::log(z);
    }
  EXPECT_NEAR(f(), want, 1e-5 * std::fabs(want));

  ModelWeights dw;
  dw.final_norm = Tensor({D}, 0.0f);
  dw.lm_head = Tensor({V, D}, 0.0f);
  std::vector<float> dh(T * S * D, 0.0f);
  const double loss = head_loss_backward(w, c, h.ptr(), tokens, cu, dh.data(), dw);
  EXPECT_NEAR(loss, want, 1e-5 * std::fabs(want));
  EXPECT_FD(f, h.ptr(), dh.data(), dh.size());
  EXPECT_FD(f, w.final_norm.ptr(), dw.final_norm.ptr(), w.final_norm.numel());
  EXPECT_FD(f, w.lm_head.ptr(), dw.lm_head.ptr(), w.lm_head.numel());
}

// ---- Model-level conventions ------------------------------------------------------------------------------------

TEST(ModelBackward, GradientsAccumulateAcrossCalls) {
  const Model m = Model::load(test::golden_dir("fp32_tail_off"));
  PackedBatch b;
  b.add({5, 9, 200, 17, 3});
  ModelWeights once = zeros_like(m.weights()), twice = zeros_like(m.weights());
  const double l1 = model_forward_backward(m, b, once);
  model_forward_backward(m, b, twice);
  model_forward_backward(m, b, twice);
  const auto n1 = hub_gradients(m.config(), once, "");
  const auto n2 = hub_gradients(m.config(), twice, "");
  ASSERT_EQ(n1.size(), n2.size());
  for (size_t i = 0; i < n1.size(); ++i)
    for (size_t j = 0; j < Tensor::count(n1[i].shape); ++j)
      ASSERT_NEAR(n2[i].data[j], 2.0f * n1[i].data[j], 1e-5f * (1.0f + std::fabs(n1[i].data[j]))) << n1[i].name;
  // The loss is the negative sum of the forward's log-probabilities.
  double lp = 0.0;
  for (const auto& seq : m.next_token_logprobs(b))
    for (double x : seq) lp += x;
  EXPECT_NEAR(l1, -lp, 1e-5 * std::fabs(lp));
  // Frozen tensors have no gradient: no indexer, no correction bias.
  for (const auto& g : n1) {
    EXPECT_EQ(g.name.find("indexer"), std::string::npos) << g.name;
    EXPECT_EQ(g.name.find("e_score_correction_bias"), std::string::npos) << g.name;
  }
  for (const LayerWeights& l : once.layers) {
    if (l.dsa) {
      EXPECT_FALSE(l.dsa->indexer.has_value());
    }
    if (l.moe) {
      EXPECT_TRUE(l.moe->correction_bias.empty());
    }
  }
}

TEST(ModelBackward, TiedEmbeddingsGetBothGradients) {
  const Model untied = Model::load(test::golden_dir("fp32_tail_off"));
  ModelConfig c = untied.config();
  ModelWeights w = untied.weights();
  w.lm_head = w.embed;
  c.tie_word_embeddings = true;
  const Model tied(c, w);
  ModelConfig cu = untied.config();
  const Model same_weights_untied(cu, w);
  PackedBatch b;
  b.add({5, 9, 200, 17, 3, 44, 2});
  ModelWeights gt = zeros_like(tied.weights()), gu = zeros_like(same_weights_untied.weights());
  model_forward_backward(tied, b, gt);
  model_forward_backward(same_weights_untied, b, gu);
  std::vector<float> want(gu.embed.data);
  for (size_t i = 0; i < want.size(); ++i) want[i] += gu.lm_head.data[i];
  EXPECT_LE(test::norm_rel_error(gt.embed.ptr(), want.data(), want.size()), 1e-6);
  for (const auto& g : hub_gradients(c, gt, "model.language_model.")) EXPECT_NE(g.name, "lm_head.weight");
}

}  // namespace
}  // namespace nextlm
