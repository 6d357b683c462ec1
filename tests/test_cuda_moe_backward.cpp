// The head, embedding and MoE backward kernels (src/cuda/moe_backward.cu) against the CPU fp32 backward
// (src/model/backward.h, moe_backward.cpp, head_backward.cpp). Outputs are poisoned with NaN before the kernels run
// (testing_moe_backward.cu), so an unwritten element fails.
//
// Tolerances: fp32 outputs differ from the CPU's only by the summation order and expf's last bits: 1e-5 relative
// (norm). bf16 outputs are compared element-wise with the CPU value rounded to bf16: rounding both sides can land
// one bf16 ulp apart (2^-8 relative), so each element must be within 2^-7 relative, plus an absolute 1e-6 of the
// output's scale for elements that are a cancellation of larger terms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include "cuda/testing_moe_backward.h"
#include "io/safetensors.h"
#include "model/backward.h"
#include "model/norm.h"
#include "test_util.h"

namespace nextlm {
namespace {

// x rounded to the nearest bf16 (ties to even), as __float2bfloat16.
float bf16_round(float x) {
  if (std::isnan(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}

// Every element of a bf16 output against the fp32 reference rounded to bf16 (see the file comment).
void expect_bf16_close(const std::vector<float>& gpu, const std::vector<float>& ref, const char* what) {
  ASSERT_EQ(gpu.size(), ref.size()) << what;
  float scale = 0.0f;
  for (float r : ref) scale = std::max(scale, std::fabs(r));
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float r = bf16_round(ref[i]);
    const bool ok = std::isfinite(gpu[i]) && std::fabs(gpu[i] - r) <= 0x1p-7f * std::fabs(r) + 1e-6f * scale;
    if (!ok && bad++ < 5) ADD_FAILURE() << what << "[" << i << "]: gpu " << gpu[i] << " vs cpu " << ref[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

// I [n, n] row-major. The CPU functions below take an input x and apply a linear layer to it; with x = I the layer's
// output is its weight transposed and its weight gradient is the input gradient transposed (exactly: products with
// 0 and 1), so the exposed CPU backward functions act on arbitrary pre-activations and return their gradients.
std::vector<float> identity(int64_t n) {
  std::vector<float> x(n * n, 0.0f);
  for (int64_t i = 0; i < n; ++i) x[i * n + i] = 1.0f;
  return x;
}

// ---- Cross-entropy ----

// The CPU head_block's arithmetic for one set of rows: loss and wt·(softmax − onehot), zero rows without a term.
void xent_reference(const std::vector<float>& logits, const std::vector<int32_t>& target, const std::vector<float>& wt,
                    int64_t n, int64_t V, std::vector<double>& loss, std::vector<float>& dlogits) {
  loss.assign(n, 0.0);
  dlogits.assign(n * V, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = logits.data() + r * V;
    const int64_t tg = target[r];
    const float w = wt.empty() || tg < 0 ? 1.0f : wt[r];
    if (tg < 0 || w == 0.0f) continue;
    const float mx = *std::max_element(row, row + V);
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    const double lse = mx + std::log(sum);
    loss[r] = w * (lse - row[tg]);
    for (int64_t v = 0; v < V; ++v)
      dlogits[r * V + v] = w * (static_cast<float>(std::exp(static_cast<double>(row[v]) - lse)) - (v == tg ? 1.0f : 0.0f));
  }
}

void check_xent(int64_t n, int64_t V, bool weighted, unsigned seed) {
  SCOPED_TRACE("n=" + std::to_string(n) + " V=" + std::to_string(V) + (weighted ? " weighted" : ""));
  const std::vector<float> logits = test::randn(n * V, seed, 3.0f);
  std::mt19937 gen(seed);
  std::vector<int32_t> target(n);
  std::vector<float> wt;
  for (int64_t r = 0; r < n; ++r) target[r] = r % 5 == 3 ? -1 : static_cast<int32_t>(gen() % V);
  if (n > 1) target[1] = static_cast<int32_t>(V - 1);  // the last column (a partial block)
  if (weighted) {
    std::uniform_real_distribution<float> u(0.2f, 2.0f);
    for (int64_t r = 0; r < n; ++r) wt.push_back(u(gen));
    if (n > 2) wt[2] = 0.0f;  // a row weighted out: no term, as the CPU
  }
  std::vector<double> loss, ref_loss;
  std::vector<float> dl, ref_dl;
  cuda_testing::softmax_xent_backward(logits, target, wt, n, V, loss, dl);
  xent_reference(logits, target, wt, n, V, ref_loss, ref_dl);
  ASSERT_EQ(loss.size(), static_cast<size_t>(n));
  int terms = 0;
  for (int64_t r = 0; r < n; ++r) {
    // fp32 sum of exponentials against the CPU's double sum: a few 1e-7 of the log-sum-exp.
    EXPECT_NEAR(loss[r], ref_loss[r], 1e-5 * std::max(1.0, std::fabs(ref_loss[r]))) << "row " << r;
    if (ref_loss[r] != 0.0) ++terms;
    if (target[r] < 0 || (weighted && wt[r] == 0.0f)) {
      EXPECT_EQ(loss[r], 0.0) << "row " << r;
      for (int64_t v = 0; v < V; ++v) ASSERT_EQ(dl[r * V + v], 0.0f) << "row " << r << " v " << v;
    }
  }
  EXPECT_GT(terms, 0);
  expect_bf16_close(dl, ref_dl, "dlogits");
}

TEST(CudaBackwardMoe, SoftmaxXentMatchesCpuHeadLoss) {
  check_xent(29, 1000, false, 1);
  check_xent(29, 1000, true, 2);
  check_xent(17, 1037, true, 3);  // V not a multiple of the block
  check_xent(1, 5, false, 4);     // V smaller than a warp: idle threads
}

TEST(CudaBackwardMoe, SoftmaxXentFullVocabulary) { check_xent(4, 154880, true, 5); }

// Wide rows go through the streaming kernel (a cluster of CTAs a row, each segment loaded while the row before is
// worked on): more rows than clusters fit at once (each cluster walks several, its buffer refilled), rows without a
// term among them, a last segment shorter than the others (V = 20004: seven of 2504 floats and one of 2476), and the
// largest segments it takes (V = 163840: 10 float4 a thread); V = 204800 is past it (the block-a-row kernel); and the
// same rows through the block-a-row kernel with the switch off.
TEST(CudaBackwardMoe, SoftmaxXentStreamsWideRows) {
  ASSERT_TRUE(cuda_testing::xent_stream());
  check_xent(300, 20004, true, 8);
  check_xent(41, 154880, false, 9);
  check_xent(9, 163840, true, 10);
  check_xent(5, 204800, true, 11);
  cuda_testing::set_xent_stream(false);
  check_xent(41, 154880, false, 9);
  check_xent(300, 20004, true, 8);
  cuda_testing::set_xent_stream(true);
}

// The vector path (V a multiple of 4) with a row narrower than a block (most threads idle) and many rows.
TEST(CudaBackwardMoe, SoftmaxXentNarrowRows) {
  check_xent(20000, 12, true, 6);
  check_xent(3, 4, false, 7);
}

// ---- Embedding ----

void check_embedding(int64_t pad_id) {
  SCOPED_TRACE("pad_id=" + std::to_string(pad_id));
  const int64_t T = 37, S = 4, D = 48, V = 20;
  std::mt19937 gen(7);
  std::vector<int32_t> tok(T);
  for (int32_t& t : tok) t = static_cast<int32_t>(gen() % V);  // repeats: several tokens add into one row
  tok[0] = tok[5] = tok[36] = 3;
  const std::vector<float> dh = test::randn(T * S * D, 8);
  const std::vector<float> init = test::randn(V * D, 9);  // accumulates into a non-zero gradient
  std::vector<float> gpu = init;
  cuda_testing::embedding_backward(tok, dh, gpu, T, S, D, pad_id);
  Tensor ref({V, D});
  ref.data = init;
  embedding_backward(tok.data(), T, S, dh.data(), pad_id >= 0 ? std::optional<int64_t>(pad_id) : std::nullopt, ref);
  EXPECT_LE(test::norm_rel_error(gpu.data(), ref.ptr(), ref.data.size()), 1e-5);
  // The difference from the initial values, alone, to 1e-5 too (so that a small error cannot hide under init).
  std::vector<float> dg(V * D), dr(V * D);
  for (int64_t i = 0; i < V * D; ++i) dg[i] = gpu[i] - init[i], dr[i] = ref.data[i] - init[i];
  EXPECT_LE(test::norm_rel_error(dg.data(), dr.data(), dr.size()), 1e-5);
  if (pad_id >= 0) {
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(gpu[pad_id * D + d], init[pad_id * D + d]);
  } else {
    EXPECT_NE(gpu[3 * D], init[3 * D]);
  }
}

TEST(CudaBackwardMoe, EmbeddingBackwardMatchesCpu) {
  check_embedding(3);
  check_embedding(-1);
}

// ---- Clamped SwiGLU ----

// gu [n, 2I] (gate | up) of scale 4 (with limit 7, a few percent of each clamp is active), plus exact boundary
// values: gate = L and up = ±L pass the gradient, gate = −L is not clamped at all.
std::vector<float> swiglu_inputs(int64_t n, int64_t I, float L) {
  std::vector<float> gu = test::randn(n * 2 * I, 11, 4.0f);
  gu[0 * 2 * I + 0] = L;          // gate at the upper limit
  gu[1 * 2 * I + 1] = -L;         // gate at −L (min only: no clamp)
  gu[2 * 2 * I + I + 2] = L;      // up at +L
  gu[3 * 2 * I + I + 3] = -L;     // up at −L
  gu[4 * 2 * I + 4] = 10.0f;      // gate clamped
  gu[5 * 2 * I + I + 5] = 10.0f;  // up clamped above
  gu[6 * 2 * I + I + 6] = -10.0f; // up clamped below
  return gu;
}

// I = 24 takes the kernel's four-columns-at-a-time form, I = 10 the scalar one.
TEST(CudaBackwardMoe, SwigluBackwardMatchesCpuMlpBackward) {
  for (const int64_t I : {24, 10}) {
    SCOPED_TRACE("I " + std::to_string(I));
    const int64_t n = 37 * 3;
    const float L = 7.0f;
    const std::vector<float> gu = swiglu_inputs(n, I, L);
    const std::vector<float> dact = test::randn(n * I, 12);
    const std::vector<float> gpu = cuda_testing::swiglu_backward(gu, dact, n, I, L);

    // mlp_backward on x = I [n, n]: gate·x = gateᵀ, so gate[c, t] = gu[t, c] (up likewise); with dy = I the gradient
    // of act is down itself, so down = dact; and dgate = dgᵀ (dup = duᵀ).
    MlpWeights w{Tensor({I, n}), Tensor({I, n}), Tensor({n, I})};
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < I; ++c) {
        w.gate.data[c * n + t] = gu[t * 2 * I + c];
        w.up.data[c * n + t] = gu[t * 2 * I + I + c];
      }
    w.down.data = dact;
    MlpWeights dw = zeros_like(w);
    const std::vector<float> x = identity(n);
    mlp_backward(w, L, x.data(), n, n, x.data(), nullptr, dw);
    std::vector<float> ref(n * 2 * I);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < I; ++c) {
        ref[t * 2 * I + c] = dw.gate.data[c * n + t];
        ref[t * 2 * I + I + c] = dw.up.data[c * n + t];
      }
    expect_bf16_close(gpu, ref, "dgu");

    // The clamps are active on both halves and give exact zeros; the boundary values pass.
    int gate_clamped = 0, up_clamped = 0;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < I; ++c) {
        const float g = gu[t * 2 * I + c], u = gu[t * 2 * I + I + c];
        if (g > L) {
          ++gate_clamped;
          EXPECT_EQ(gpu[t * 2 * I + c], 0.0f);
        }
        if (u > L || u < -L) {
          ++up_clamped;
          EXPECT_EQ(gpu[t * 2 * I + I + c], 0.0f);
        }
      }
    EXPECT_GE(gate_clamped, 5);
    EXPECT_GE(up_clamped, 10);

    // Under expert parallelism only the first rows_held rows are this rank's: the others' gu and dact are never
    // computed here (NaN below stands for whatever the arena holds) and their gradient is zero; the held rows' bits
    // are unchanged.
    std::vector<float> gu_ep = gu, dact_ep = dact;
    const int64_t held = 40;
    for (int64_t i = held * 2 * I; i < n * 2 * I; ++i) gu_ep[i] = NAN;
    for (int64_t i = held * I; i < n * I; ++i) dact_ep[i] = NAN;
    const std::vector<float> ep = cuda_testing::swiglu_backward(gu_ep, dact_ep, n, I, L, static_cast<int32_t>(held));
    ASSERT_EQ(ep.size(), gpu.size());
    for (int64_t i = 0; i < n * 2 * I; ++i) {
      if (i < held * 2 * I)
        ASSERT_EQ(ep[i], gpu[i]) << "held row element " << i;
      else
        ASSERT_EQ(ep[i], 0.0f) << "other rank's row element " << i;
    }
    EXPECT_NE(gpu[0 * 2 * I + 0], 0.0f);
    EXPECT_NE(gpu[1 * 2 * I + 1], 0.0f);
    EXPECT_NE(gpu[2 * 2 * I + I + 2], 0.0f);
    EXPECT_NE(gpu[3 * 2 * I + I + 3], 0.0f);

    // gu and dact in bf16 (what the training step keeps): the fp32 form's result on the rounded values, bit for bit.
    std::vector<float> gu_r = gu, dact_r = dact;
    for (float& x : gu_r) x = bf16_round(x);
    for (float& x : dact_r) x = bf16_round(x);
    for (const auto& [g16, d16] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      SCOPED_TRACE(std::string(g16 ? "gu bf16 " : "gu fp32 ") + (d16 ? "dact bf16" : "dact fp32"));
      EXPECT_EQ(cuda_testing::swiglu_backward(gu, dact, n, I, L, -1, g16, d16),
                cuda_testing::swiglu_backward(g16 ? gu_r : gu, d16 ? dact_r : dact, n, I, L));
    }
  }
}

// ---- MoE combine and gather ----

// slot_of [T, k]: a random permutation of the T·k permuted rows.
std::vector<int32_t> random_slots(int64_t T, int64_t k, unsigned seed) {
  std::vector<int32_t> s(T * k);
  std::iota(s.begin(), s.end(), 0);
  std::shuffle(s.begin(), s.end(), std::mt19937(seed));
  return s;
}

// D = 48 and 300 take the kernel's four-at-a-time form (300: rows over several passes of a warp), 45 the scalar one.
TEST(CudaBackwardMoe, CombineBackwardMatchesCpu) {
  for (const int64_t D : {48, 300, 45}) {
    SCOPED_TRACE("D " + std::to_string(D));
    const int64_t T = 37, k = 3;
    const std::vector<int32_t> slot_of = random_slots(T, k, 13);
    const std::vector<float> dy = test::randn(T * D, 14), w = test::randn(T * k, 16);
    const std::vector<float> dout = cuda_testing::moe_combine_backward(dy, slot_of, w, T, k, D);
    // expert_backward's loop: dout[slot] = w·dy[t].
    std::vector<float> ref_dout(T * k * D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t d = 0; d < D; ++d) ref_dout[slot_of[t * k + i] * D + d] = w[t * k + i] * dy[t * D + d];
    expect_bf16_close(dout, ref_dout, "dout");
  }
}

// The routing weights' gradient from the down projection's input: with out[p] = act[p]·Wᵀ and dact[p] = (w·dy[t])·W,
// act[p]·dact[p] / w is dy[t]·out[p], the weights' gradient through the combine. Also: a zero weight and other
// ranks' rows (rows_held) give zero.
TEST(CudaBackwardMoe, WeightsBackwardFromTheDownInputEqualsDyDotOut) {
  for (const int64_t I : {72, 520, 70}) {  // eight a lane (one pass, three passes), one a lane
    SCOPED_TRACE("I " + std::to_string(I));
    const int64_t T = 29, k = 3, D = 40, n = T * k;
    const std::vector<int32_t> slot_of = random_slots(T, k, 23);
    std::vector<float> act = test::randn(n * I, 24), W = test::randn(D * I, 25, 0.2f), dy = test::randn(T * D, 26);
    std::vector<float> w = test::randn(n, 27);
    for (float& x : w) x = 0.1f + std::fabs(x);
    w[5] = 0.0f;
    for (float& x : act) x = bf16_round(x);  // the kernel reads act in bf16
    std::vector<float> dact(n * I, 0.0f), want(n, 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j = t * k + i, p = slot_of[j];
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          double o = 0.0;
          for (int64_t c = 0; c < I; ++c) o += double(act[p * I + c]) * W[d * I + c];
          dot += double(dy[t * D + d]) * o;
        }
        for (int64_t c = 0; c < I; ++c) {
          double g = 0.0;
          for (int64_t d = 0; d < D; ++d) g += double(w[j]) * dy[t * D + d] * W[d * I + c];
          dact[p * I + c] = static_cast<float>(g);
        }
        want[j] = w[j] == 0.0f ? 0.0f : static_cast<float>(dot);
      }
    const std::vector<float> got = cuda_testing::moe_weights_backward(act, dact, slot_of, w, T, k, I);
    ASSERT_EQ(got.size(), size_t(n));
    EXPECT_EQ(got[5], 0.0f);
    EXPECT_LE(test::norm_rel_error(got.data(), want.data(), want.size()), 1e-5);
    // Rows from 40 on are another rank's: zero whatever act and dact hold there.
    std::vector<float> act_ep = act, dact_ep = dact;
    for (int64_t r = 40; r < n; ++r)
      for (int64_t c = 0; c < I; ++c) act_ep[r * I + c] = NAN, dact_ep[r * I + c] = NAN;
    const std::vector<float> ep = cuda_testing::moe_weights_backward(act_ep, dact_ep, slot_of, w, T, k, I, 40);
    for (int64_t j = 0; j < n; ++j) {
      if (slot_of[j] >= 40)
        EXPECT_EQ(ep[j], 0.0f) << "choice " << j;
      else
        EXPECT_EQ(ep[j], got[j]) << "choice " << j;
    }
    // dact in bf16: the fp32 form's result on the rounded values, bit for bit.
    std::vector<float> dact_r = dact;
    for (float& x : dact_r) x = bf16_round(x);
    EXPECT_EQ(cuda_testing::moe_weights_backward(act, dact, slot_of, w, T, k, I, -1, true),
              cuda_testing::moe_weights_backward(act, dact_r, slot_of, w, T, k, I));
  }
}

// D = 300 and 1300 take the kernel's four-columns-a-thread form (1300: over two passes of the block), 45 the scalar
// one; dxp in fp32 and in bf16.
TEST(CudaBackwardMoe, GatherBackwardMatchesCpu) {
  for (const int64_t D : {300, 1300, 45}) {
    SCOPED_TRACE("D " + std::to_string(D));
    const int64_t T = 37, k = 3;
    const std::vector<int32_t> slot_of = random_slots(T, k, 17);
    const std::vector<float> dxp = test::randn(T * k * D, 18), init = test::randn(T * D, 19);
    std::vector<float> gpu = init;
    cuda_testing::moe_gather_backward(dxp, slot_of, gpu, T, k, D);
    std::vector<float> ref = init, dg(T * D), dr(T * D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t d = 0; d < D; ++d) ref[t * D + d] += dxp[slot_of[t * k + i] * D + d];
    for (int64_t i = 0; i < T * D; ++i) dg[i] = gpu[i] - init[i], dr[i] = ref[i] - init[i];
    EXPECT_LE(test::norm_rel_error(gpu.data(), ref.data(), ref.size()), 1e-5);
    EXPECT_LE(test::norm_rel_error(dg.data(), dr.data(), dr.size()), 1e-5);
    // In bf16: the fp32 form's result on the rounded values, bit for bit.
    std::vector<float> dxp_r = dxp, got16 = init, want16 = init;
    for (float& x : dxp_r) x = bf16_round(x);
    cuda_testing::moe_gather_backward(dxp, slot_of, got16, T, k, D, true);
    cuda_testing::moe_gather_backward(dxp_r, slot_of, want16, T, k, D);
    EXPECT_EQ(got16, want16);
  }
}

// ---- Router weights ----

void check_route(bool norm) {
  SCOPED_TRACE(norm ? "norm_topk_prob" : "no normalisation");
  const int64_t T = 37, E = 10, k = 3;
  const float scale = 2.5f;
  const std::vector<float> logits = test::randn(T * E, 21, 2.0f), dweights = test::randn(T * k, 22);
  std::mt19937 gen(23);
  Routing r;
  for (int64_t t = 0; t < T; ++t) {  // k distinct experts, in a random order
    std::vector<int32_t> e(E);
    std::iota(e.begin(), e.end(), 0);
    std::shuffle(e.begin(), e.end(), gen);
    r.experts.insert(r.experts.end(), e.begin(), e.begin() + k);
  }
  const std::vector<float> gpu = cuda_testing::moe_route_backward(logits, r.experts, dweights, T, E, k, norm, scale);

  // routed_weights / router_backward on x = I [T, T]: the router logits are routerᵀ, so router[e, t] = logits[t, e],
  // and dw.router = dlogitsᵀ.
  ModelConfig c;
  c.hidden_size = T, c.n_routed_experts = E, c.num_experts_per_tok = k;
  c.norm_topk_prob = norm, c.routed_scaling_factor = scale;
  MoeWeights w;
  w.router = Tensor({E, T});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) w.router.data[e * T + t] = logits[t * E + e];
  MoeWeights dw;
  dw.router = Tensor({E, T});
  const std::vector<float> x = identity(T);
  std::vector<float> s, weights;
  routed_weights(w, c, x.data(), T, r, s, weights);
  router_backward(w, c, x.data(), T, r, s, dweights.data(), nullptr, dw);
  std::vector<float> ref(T * E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) ref[t * E + e] = dw.router.data[e * T + t];
  EXPECT_LE(test::norm_rel_error(gpu.data(), ref.data(), ref.size()), 1e-5);
  // Written for every expert: exact zeros off the chosen ones.
  for (int64_t t = 0; t < T; ++t) {
    const auto first = r.experts.begin() + t * k, last = first + k;
    for (int64_t e = 0; e < E; ++e) {
      if (std::find(first, last, e) == last) {
        EXPECT_EQ(gpu[t * E + e], 0.0f) << t << ", " << e;
      }
    }
  }
}

TEST(CudaBackwardMoe, RouteBackwardMatchesCpuRouterBackward) {
  check_route(true);
  check_route(false);
}

TEST(CudaBackwardMoe, EmptyInputsAreNoOps) {
  std::vector<float> dembed = test::randn(5 * 8, 41);
  const std::vector<float> before = dembed;
  cuda_testing::embedding_backward({}, {}, dembed, 0, 4, 8, -1);
  EXPECT_EQ(dembed, before);
  std::vector<float> dx = before;
  cuda_testing::moe_gather_backward({}, {}, dx, 0, 3, 8);
  EXPECT_EQ(dx, before);
  EXPECT_TRUE(cuda_testing::moe_route_backward({}, {}, {}, 0, 10, 3, true, 2.5f).empty());
  EXPECT_TRUE(cuda_testing::swiglu_backward({}, {}, 0, 24, 7.0f).empty());
  std::vector<double> loss;
  std::vector<float> dl;
  cuda_testing::softmax_xent_backward({}, {}, {}, 0, 1000, loss, dl);
  EXPECT_TRUE(loss.empty() && dl.empty());
}

// A decoding step's routing in one launch (moe_route_permute_small) equals moe_route + moe_permute + gather_rows bit
// for bit: choices, weights, the permutation, the expert offsets and the gathered rows; with many tied scores (the
// logits on a coarse grid: ties go to the lower expert either way), grouped top-k, and the gather both inside the
// block (few rows) and as the separate kernel (many).
TEST(CudaMoeRouting, FusedSmallRoutingEqualsThreeKernels) {
  struct Case {
    int64_t T, E, G, TG, k, D;
  };
  for (const Case& c : {Case{1, 288, 1, 1, 8, 4096}, Case{3, 288, 1, 1, 8, 64}, Case{32, 64, 8, 4, 6, 40},
                        Case{32, 288, 1, 1, 8, 4096}, Case{5, 300, 4, 2, 9, 16}}) {
    std::vector<float> logits = test::randn(c.T * c.E, 7 + c.T), bias = test::randn(c.E, 8);
    for (float& v : logits) v = std::round(v * 4.0f) / 4.0f;
    for (float& v : bias) v = std::round(v * 8.0f) / 64.0f;
    const std::vector<float> x = test::randn(c.T * c.D, 9);
    const auto three = cuda_testing::moe_route_permute(logits, bias, x, c.T, c.E, c.G, c.TG, c.k, c.D, true, 2.5f,
                                                       false);
    const auto one = cuda_testing::moe_route_permute(logits, bias, x, c.T, c.E, c.G, c.TG, c.k, c.D, true, 2.5f, true);
    const std::string what = "T " + std::to_string(c.T) + " E " + std::to_string(c.E);
    EXPECT_EQ(one.experts, three.experts) << what;
    EXPECT_EQ(one.keys, three.keys) << what;
    EXPECT_EQ(one.slots, three.slots) << what;
    EXPECT_EQ(one.token_of, three.token_of) << what;
    EXPECT_EQ(one.slot_of, three.slot_of) << what;
    EXPECT_EQ(one.offsets, three.offsets) << what;
    ASSERT_EQ(one.weights.size(), three.weights.size()) << what;
    EXPECT_EQ(std::memcmp(one.weights.data(), three.weights.data(), one.weights.size() * sizeof(float)), 0) << what;
    ASSERT_EQ(one.xp.size(), three.xp.size()) << what;
    EXPECT_EQ(std::memcmp(one.xp.data(), three.xp.data(), one.xp.size() * sizeof(float)), 0) << what;
    // Every routing slot is placed, and the gathered rows are written (no NaN left from the poison).
    for (float v : one.xp) ASSERT_FALSE(std::isnan(v)) << what;
    EXPECT_EQ(one.offsets.back(), c.T * c.k) << what;
  }
}

// The gather of a training step's size (its copy larger than the 16 MiB past which gather_rows stores it as
// streaming) and of a small one: row r of xp is the bf16 row of the token routed to slot r, every row written.
TEST(CudaMoeRouting, GatheredRowsAreTheRoutedTokensRows) {
  for (const int64_t T : {int64_t{1024}, int64_t{16}}) {
    const int64_t E = 64, k = 8, D = 2048;
    const std::vector<float> logits = test::randn(T * E, 21), bias(E, 0.0f), x = test::randn(T * D, 22);
    const auto r = cuda_testing::moe_route_permute(logits, bias, x, T, E, 1, 1, k, D, true, 1.0f, false);
    ASSERT_EQ(r.xp.size(), static_cast<size_t>(T * k * D));
    for (int64_t s = 0; s < T * k; ++s) {
      const int64_t t = r.token_of[s];
      ASSERT_TRUE(t >= 0 && t < T) << "slot " << s;
      for (int64_t d = 0; d < D; ++d)
        ASSERT_EQ(r.xp[s * D + d], bf16_to_f32(f32_to_bf16(x[t * D + d]))) << "T " << T << " slot " << s << " d " << d;
    }
  }
}

}  // namespace
}  // namespace nextlm
