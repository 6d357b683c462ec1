// The CUDA backward of the MLA attention over DSA selections (src/cuda/dsa_backward.cu, tiled, and
// src/cuda/dsa_backward_scatter.cu) against the attention part of the CPU dsa_layer_backward
// (src/model/dsa_backward.cpp), restated here because it is not callable on its own, and, through the kv_b and q_b
// weight gradients, against dsa_layer_backward itself. The tensor-core kernel (src/cuda/mla_tc_backward.cu) against
// the same reference and the tiled kernel, with its own tolerance (below).
//
// Tolerance: fp32 against fp32 with sums in different orders (softmax over up to 2200 keys, dot products over up to
// 256 channels): rounding gives ~1e-6 relative; a wrong term (a dropped path, a missed key, the wrong weights of an
// empty row) gives O(1e-2) or more. Bound: ‖gpu − cpu‖/‖cpu‖ ≤ 1e-4, per tensor part. The tiled kernel has no
// atomics: two runs must agree bit for bit.
//
// The kernels are timed at the model's shape (and the tensor-core one checked against the tiled one there) by
// nextlm_bench's mla_bwd_T4096_NH64 (bench/backward.cu), not here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "core/error.h"
#include "cpu/linear_backward.h"
#include "cuda/testing_dsa_backward.h"
#include "model/backward.h"
#include "model/dsa.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr double kTol = 1e-4;

std::vector<int64_t> cu_of(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// The attention loop of dsa_layer_backward: dQ [T, NH, dqk] and dKV [T, NH, dqk+dv] += the gradients from dO.
void attention_backward_reference(const std::vector<float>& q, const std::vector<float>& kv,
                                  const std::vector<float>& dO, const Selection& sel, const std::vector<int64_t>& cu,
                                  int64_t NH, int64_t dqk, int64_t dv, std::vector<float>& dQ,
                                  std::vector<float>& dKV) {
  const int64_t dkv = dqk + dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dqk));
  std::vector<float> p, dp;
  for (int64_t h = 0; h < NH; ++h)
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t t0 = cu[n], L = cu[n + 1] - cu[n];
      for (int64_t t = 0; t < L; ++t) {
        std::vector<int32_t> keys = sel[t0 + t];
        const bool uniform = keys.empty();
        if (uniform) {
          keys.resize(L);
          std::iota(keys.begin(), keys.end(), 0);
        }
        const float* qh = q.data() + ((t0 + t) * NH + h) * dqk;
        const float* doh = dO.data() + ((t0 + t) * NH + h) * dv;
        attention_weights(qh, kv.data(), NH, h, dqk, dkv, t0, keys, uniform, scale, p);
        dp.assign(keys.size(), 0.0f);
        float pdp = 0.0f;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* vh = kv.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          float* dvh = dKV.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          for (int64_t d = 0; d < dv; ++d) {
            dp[i] += doh[d] * vh[d];
            dvh[d] += p[i] * doh[d];
          }
          pdp += p[i] * dp[i];
        }
        float* dqh = dQ.data() + ((t0 + t) * NH + h) * dqk;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float ds = p[i] * (dp[i] - pdp) * scale;
          const float* kh = kv.data() + ((t0 + keys[i]) * NH + h) * dkv;
          float* dkh = dKV.data() + ((t0 + keys[i]) * NH + h) * dkv;
          for (int64_t d = 0; d < dqk; ++d) {
            dqh[d] += ds * kh[d];
            dkh[d] += ds * qh[d];
          }
        }
      }
    }
}

// x −= x0 element by element: the increments of gradients that the kernels add into non-zero starting values.
void subtract(std::vector<float>& x, const std::vector<float>& x0) {
  ASSERT_EQ(x.size(), x0.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] -= x0[i];
}

// Random sorted selections of sequence-relative keys (not causal: the kernel must not assume it). One row in
// `special` is empty and one has min(L, max_sel) keys; the rest have 1 … min(L, max_sel, small) keys. Every
// sequence's first token is empty and its last one full-sized, so both kinds occur.
Selection random_selection(const std::vector<int64_t>& cu, int64_t max_sel, int64_t small, unsigned special,
                           unsigned seed) {
  std::mt19937 gen(seed);
  Selection sel(cu.back());
  std::vector<int32_t> all;
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t L = cu[n + 1] - cu[n];
    all.resize(L);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t t = 0; t < L; ++t) {
      const unsigned u = t == 0 ? 0 : t == L - 1 ? 1 : gen() % special;
      if (u == 0) continue;
      const int64_t full = std::min(L, max_sel);
      const int64_t size = u == 1 ? full : 1 + static_cast<int64_t>(gen() % std::min(full, small));
      std::sample(all.begin(), all.end(), std::back_inserter(sel[cu[n] + t]), size, gen);  // keeps the order
    }
  }
  return sel;
}

// Columns [c0, c1) of every row of width w.
std::vector<float> columns(const std::vector<float>& x, int64_t w, int64_t c0, int64_t c1) {
  std::vector<float> y;
  for (size_t r = 0; r < x.size() / w; ++r) y.insert(y.end(), x.begin() + r * w + c0, x.begin() + r * w + c1);
  return y;
}

// Rows [t, ·] of x (row width w) for the tokens whose selection is (not) empty.
std::vector<float> token_rows(const std::vector<float>& x, int64_t w, const Selection& sel, bool empty) {
  std::vector<float> y;
  for (size_t t = 0; t < sel.size(); ++t)
    if (sel[t].empty() == empty) y.insert(y.end(), x.begin() + t * w, x.begin() + (t + 1) * w);
  return y;
}

bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
}

struct DsaCase {
  const char* name;
  std::vector<int64_t> lens;
  int64_t NH, dqk, dv, max_sel, small;
  unsigned special;
};
void PrintTo(const DsaCase& c, std::ostream* os) { *os << c.name; }

class CudaBackwardDsa : public ::testing::TestWithParam<DsaCase> {};

TEST_P(CudaBackwardDsa, MatchesCpuReference) {
  const DsaCase& c = GetParam();
  const std::vector<int64_t> cu = cu_of(c.lens);
  const int64_t T = cu.back(), NH = c.NH, dqk = c.dqk, dv = c.dv, W = dqk + dv;
  const std::vector<float> q = test::randn(T * NH * dqk, 1), kv = test::randn(T * NH * W, 2),
                           dO = test::randn(T * NH * dv, 3);
  const Selection sel = random_selection(cu, c.max_sel, c.small, c.special, 4);
  int64_t longest = 0;
  for (const auto& s : sel) longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  ASSERT_EQ(longest, std::min(c.max_sel, *std::max_element(c.lens.begin(), c.lens.end())));

  std::vector<float> rq(T * NH * dqk, 0.0f), rkv(T * NH * W, 0.0f);
  attention_backward_reference(q, kv, dO, sel, cu, NH, dqk, dv, rq, rkv);
  // Both kernels: the tiled one and the scatter one.
  for (const bool scatter : {false, true}) {
    // Non-zero starting gradients: the kernel must add into them.
    const std::vector<float> dq0 = test::randn(T * NH * dqk, 5, 0.1f), dkv0 = test::randn(T * NH * W, 6, 0.1f);
    std::vector<float> dq = dq0, dkv = dkv0;
    cuda_testing::mla_sparse_attention_backward(q, kv, dO, sel, cu, NH, dqk, dv, c.max_sel, dq, dkv, scatter);
    ASSERT_TRUE(all_finite(dq));
    ASSERT_TRUE(all_finite(dkv));
    subtract(dq, dq0);
    subtract(dkv, dkv0);

    auto err = [](const std::vector<float>& a, const std::vector<float>& b) {
      EXPECT_EQ(a.size(), b.size());
      return test::norm_rel_error(a.data(), b.data(), b.size());
    };
    // dq of tokens with and without a selection apart (an empty row's Jacobian is small beside a selective one's);
    // dk and dv apart.
    const double e_q_sel = err(token_rows(dq, NH * dqk, sel, false), token_rows(rq, NH * dqk, sel, false));
    const double e_q_uni = err(token_rows(dq, NH * dqk, sel, true), token_rows(rq, NH * dqk, sel, true));
    const double e_k = err(columns(dkv, W, 0, dqk), columns(rkv, W, 0, dqk));
    const double e_v = err(columns(dkv, W, dqk, W), columns(rkv, W, dqk, W));
    std::printf("[cuda] DSA attention backward %s (%s): dq %.2e (empty rows %.2e), dk %.2e, dv %.2e\n", c.name,
                scatter ? "scatter" : "tiled", e_q_sel, e_q_uni, e_k, e_v);
    EXPECT_LE(e_q_sel, kTol) << (scatter ? "scatter" : "tiled");
    EXPECT_LE(e_q_uni, kTol) << (scatter ? "scatter" : "tiled");
    EXPECT_LE(e_k, kTol) << (scatter ? "scatter" : "tiled");
    EXPECT_LE(e_v, kTol) << (scatter ? "scatter" : "tiled");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaBackwardDsa,
    ::testing::Values(
        DsaCase{"small_dims", {5, 40, 129}, 3, 16, 32, 100, 100, 6},
        DsaCase{"glm_dims", {5, 40, 129}, 3, 192, 256, 100, 100, 6},
        DsaCase{"awkward_lengths", {1, 63, 65}, 3, 16, 32, 65, 65, 5},
        DsaCase{"odd_dims", {5, 40, 129}, 3, 17, 31, 100, 100, 6},  // rows not in float4s: scalar atomics
        // A real-size budget (topk 2048 + pool 64 − 1 = 2111 ≥ 2100) with max_sel-sized selections, and empty rows
        // of a sequence longer than the staged chunk (its keys go in two chunks).
        DsaCase{"long", {7, 2200}, 3, 192, 256, 2100, 48, 64}),
    [](const auto& info) { return std::string(info.param.name); });

// Two runs from the same inputs give the same bits: no atomics, sums in an order fixed by the shapes. The long case,
// whose keys are selected by many queries of several query tiles.
TEST(CudaBackwardDsaEdge, Deterministic) {
  const std::vector<int64_t> cu = cu_of({7, 2200});
  const int64_t T = cu.back(), NH = 3, dqk = 192, dv = 256, W = dqk + dv, max_sel = 2100;
  const std::vector<float> q = test::randn(T * NH * dqk, 1), kv = test::randn(T * NH * W, 2),
                           dO = test::randn(T * NH * dv, 3);
  const Selection sel = random_selection(cu, max_sel, 48, 64, 4);
  std::vector<float> dq1(T * NH * dqk, 0.0f), dkv1(T * NH * W, 0.0f), dq2 = dq1, dkv2 = dkv1;
  cuda_testing::mla_sparse_attention_backward(q, kv, dO, sel, cu, NH, dqk, dv, max_sel, dq1, dkv1);
  cuda_testing::mla_sparse_attention_backward(q, kv, dO, sel, cu, NH, dqk, dv, max_sel, dq2, dkv2);
  EXPECT_EQ(std::memcmp(dq1.data(), dq2.data(), dq1.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(dkv1.data(), dkv2.data(), dkv1.size() * sizeof(float)), 0);
}

TEST(CudaBackwardDsaEdge, EmptyBatchIsANoOp) {
  std::vector<float> dq, dkv;
  cuda_testing::mla_sparse_attention_backward({}, {}, {}, {}, {0}, 3, 16, 32, 8, dq, dkv);
  EXPECT_TRUE(dq.empty() && dkv.empty());
}

// The whole CPU layer backward: the kernel's dq, dkv pushed through kv_b and q_b give dsa_layer_backward's weight
// gradients of those projections (dW = dyᵀ·x over tokens of the latents, the same in both).
TEST(CudaBackwardDsaEdge, MatchesDsaLayerBackwardWeightGradients) {
  ModelConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 3;
  c.q_lora_rank = 24;
  c.kv_lora_rank = 20;
  c.qk_nope_head_dim = 16;
  c.v_head_dim = 32;
  const int64_t D = c.hidden_size, NH = 3, dqk = 16, dv = 32, W = dqk + dv, QL = 24, KL = 20;
  const std::vector<int64_t> cu = cu_of({5, 40, 129});
  const int64_t T = cu.back(), max_sel = 100;
  auto weight = [](int64_t out, int64_t in, unsigned seed, float gain) {
    Tensor t({out, in});
    t.data = test::randn(t.data.size(), seed, gain / std::sqrt(static_cast<float>(in)));
    return t;
  };
  auto norm_weight = [](int64_t n, unsigned seed) {
    Tensor t({n});
    t.data = test::randn(n, seed, 0.2f);
    for (float& x : t.data) x += 1.0f;
    return t;
  };
  DsaWeights w;
  w.q_a = weight(QL, D, 10, 1.0f);
  w.q_a_norm = norm_weight(QL, 11);
  w.q_b = weight(NH * dqk, QL, 12, 2.0f);  // q·k/√dqk of O(1): a softmax that is not flat
  w.kv_a = weight(KL, D, 13, 1.0f);
  w.kv_a_norm = norm_weight(KL, 14);
  w.kv_b = weight(NH * W, KL, 15, 2.0f);
  w.o_proj = weight(D, NH * dv, 16, 1.0f);
  const std::vector<float> a = test::randn(T * D, 17), dy = test::randn(T * D, 18);
  const Selection sel = random_selection(cu, max_sel, max_sel, 6, 19);

  DsaActs acts;
  std::vector<float> y(T * D), da(T * D, 0.0f);
  dsa_layer_forward_train(w, c, a.data(), T, cu, sel, acts, y.data());
  DsaWeights dw;
  for (auto [g, p] : {std::pair{&dw.q_a, &w.q_a}, {&dw.q_a_norm, &w.q_a_norm}, {&dw.q_b, &w.q_b}, {&dw.kv_a, &w.kv_a},
                      {&dw.kv_a_norm, &w.kv_a_norm}, {&dw.kv_b, &w.kv_b}, {&dw.o_proj, &w.o_proj}})
    *g = Tensor(p->shape);
  dsa_layer_backward(w, c, a.data(), T, cu, sel, acts, dy.data(), da.data(), dw);

  std::vector<float> dO(T * NH * dv, 0.0f), dq(T * NH * dqk, 0.0f), dkv(T * NH * W, 0.0f);
  cpu::linear_backward(acts.o.data(), T, NH * dv, w.o_proj, dy.data(), dO.data(), nullptr);
  cuda_testing::mla_sparse_attention_backward(acts.q, acts.kv, dO, sel, cu, NH, dqk, dv, max_sel, dq, dkv);
  Tensor gq_b(w.q_b.shape), gkv_b(w.kv_b.shape);
  cpu::linear_backward(acts.qr.data(), T, QL, w.q_b, dq.data(), nullptr, &gq_b);
  cpu::linear_backward(acts.lat.data(), T, KL, w.kv_b, dkv.data(), nullptr, &gkv_b);
  const double e_q = test::norm_rel_error(gq_b.ptr(), dw.q_b.ptr(), gq_b.data.size());
  const double e_kv = test::norm_rel_error(gkv_b.ptr(), dw.kv_b.ptr(), gkv_b.data.size());
  std::printf("[cuda] DSA attention backward through the layer: dq_b %.2e, dkv_b %.2e\n", e_q, e_kv);
  EXPECT_LE(e_q, kTol);
  EXPECT_LE(e_kv, kTol);
}

// ---- The tensor-core kernel (src/cuda/mla_tc_backward.cu) ----
//
// q and kv are rounded to bf16 before both the CPU reference and the kernels run, so the inputs are the same values;
// what differs is the kernel's own rounding: do, the softmax weights p and their gradients ds are rounded to bf16
// (relative error ≤ 2⁻⁹ each) before the products, whose sums run in fp32. Each output element is a sum of many such
// terms with independent roundings, so its norm-relative error is a few times 2⁻⁹/√3 ≈ 1e-3; measured, it should be
// ~1e-3 … 4e-3. Bound: 1e-2 per tensor part. A wrong term (a skipped tile, a missed or extra key, the wrong weights of
// an empty row, a mis-indexed fragment) gives O(1e-1) or more. Against the fp32 tiled GPU kernel the same bound holds.

constexpr double kTcTol = 1e-2;

// x rounded to the nearest bf16 (ties to even), as the GPU path stores q and kv.
std::vector<float> round_bf16(std::vector<float> x) {
  for (float& v : x) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    std::memcpy(&v, &u, 4);
  }
  return x;
}

struct TcErrors {
  double q_sel, q_uni, k, v;
};

// Norm-relative errors of (dq, dkv) against (rq, rkv): dq of tokens with and without a selection apart, dk and dv
// apart (an empty row's Jacobian is small beside a selective one's; a part without rows gives 0).
TcErrors tc_errors(const std::vector<float>& dq, const std::vector<float>& dkv, const std::vector<float>& rq,
                   const std::vector<float>& rkv, const Selection& sel, int64_t NH, int64_t dqk, int64_t dv) {
  const int64_t W = dqk + dv;
  auto err = [](const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    return b.empty() ? 0.0 : test::norm_rel_error(a.data(), b.data(), b.size());
  };
  return {err(token_rows(dq, NH * dqk, sel, false), token_rows(rq, NH * dqk, sel, false)),
          err(token_rows(dq, NH * dqk, sel, true), token_rows(rq, NH * dqk, sel, true)),
          err(columns(dkv, W, 0, dqk), columns(rkv, W, 0, dqk)), err(columns(dkv, W, dqk, W), columns(rkv, W, dqk, W))};
}

void expect_within(const TcErrors& e, double tol, const char* what) {
  EXPECT_LE(e.q_sel, tol) << what;
  EXPECT_LE(e.q_uni, tol) << what;
  EXPECT_LE(e.k, tol) << what;
  EXPECT_LE(e.v, tol) << what;
}

class CudaBackwardMlaTc : public ::testing::TestWithParam<DsaCase> {};

TEST_P(CudaBackwardMlaTc, MatchesCpuReferenceAndTiledKernel) {
  const DsaCase& c = GetParam();
  const std::vector<int64_t> cu = cu_of(c.lens);
  const int64_t T = cu.back(), NH = c.NH, dqk = c.dqk, dv = c.dv, W = dqk + dv;
  const std::vector<float> q = round_bf16(test::randn(T * NH * dqk, 1)), kv = round_bf16(test::randn(T * NH * W, 2)),
                           dO = test::randn(T * NH * dv, 3);
  const Selection sel = random_selection(cu, c.max_sel, c.small, c.special, 4);
  int64_t longest = 0;
  for (const auto& s : sel) longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  ASSERT_EQ(longest, std::min(c.max_sel, *std::max_element(c.lens.begin(), c.lens.end())));

  std::vector<float> rq(T * NH * dqk, 0.0f), rkv(T * NH * W, 0.0f);
  attention_backward_reference(q, kv, dO, sel, cu, NH, dqk, dv, rq, rkv);

  // Non-zero starting gradients: the kernel must add into them.
  const std::vector<float> dq0 = test::randn(T * NH * dqk, 5, 0.1f), dkv0 = test::randn(T * NH * W, 6, 0.1f);
  std::vector<float> dq = dq0, dkv = dkv0;
  cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, dqk, dv, c.max_sel, dq, dkv);
  ASSERT_TRUE(all_finite(dq));
  ASSERT_TRUE(all_finite(dkv));
  subtract(dq, dq0);
  subtract(dkv, dkv0);
  const TcErrors e = tc_errors(dq, dkv, rq, rkv, sel, NH, dqk, dv);
  std::printf("[cuda] MLA tc backward %s vs CPU: dq %.2e (empty rows %.2e), dk %.2e, dv %.2e\n", c.name, e.q_sel,
              e.q_uni, e.k, e.v);
  expect_within(e, kTcTol, "tensor cores against the CPU");

  // The fp32 tiled kernel on the same inputs.
  std::vector<float> tq(T * NH * dqk, 0.0f), tkv(T * NH * W, 0.0f);
  cuda_testing::mla_sparse_attention_backward(q, kv, dO, sel, cu, NH, dqk, dv, c.max_sel, tq, tkv);
  const TcErrors et = tc_errors(dq, dkv, tq, tkv, sel, NH, dqk, dv);
  std::printf("[cuda] MLA tc backward %s vs tiled: dq %.2e (empty rows %.2e), dk %.2e, dv %.2e\n", c.name, et.q_sel,
              et.q_uni, et.k, et.v);
  expect_within(et, kTcTol, "tensor cores against the tiled kernel");

  // With the forward's log-sum-exp and output in place of the stats pass, as training runs it. The forward takes
  // the indexer's selections to be causal (keys after the query are never selected), so these are made causal: a
  // row keeps its keys up to itself, or just itself if none is left.
  Selection csel = sel;
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      std::vector<int32_t>& keys = csel[t];
      if (keys.empty()) continue;
      const int32_t self = static_cast<int32_t>(t - cu[n]);
      keys.erase(std::upper_bound(keys.begin(), keys.end(), self), keys.end());
      if (keys.empty()) keys.push_back(self);
    }
  std::vector<float> cq(T * NH * dqk, 0.0f), ckv(T * NH * W, 0.0f);
  attention_backward_reference(q, kv, dO, csel, cu, NH, dqk, dv, cq, ckv);
  std::vector<float> fq = dq0, fkv = dkv0;
  cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, csel, cu, NH, dqk, dv, c.max_sel, fq, fkv, true);
  ASSERT_TRUE(all_finite(fq));
  ASSERT_TRUE(all_finite(fkv));
  subtract(fq, dq0);
  subtract(fkv, dkv0);
  const TcErrors ef = tc_errors(fq, fkv, cq, ckv, csel, NH, dqk, dv);
  std::printf("[cuda] MLA tc backward %s from the forward's stats vs CPU: dq %.2e (empty rows %.2e), dk %.2e, "
              "dv %.2e\n", c.name, ef.q_sel, ef.q_uni, ef.k, ef.v);
  expect_within(ef, kTcTol, "tensor cores from the forward's stats against the CPU");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaBackwardMlaTc,
    ::testing::Values(
        // The model's head dims; uneven packed lengths around the 64-token tile; selections up to 300 keys (several
        // key tiles), one in six tokens with an empty selection (uniform over its sequence).
        DsaCase{"glm_dims", {1, 63, 64, 65, 200, 300}, 2, 256, 256, 300, 150, 6},
        DsaCase{"dims_64", {1, 63, 64, 65, 200, 300}, 3, 64, 64, 300, 150, 6},
        DsaCase{"dims_192_128", {5, 40, 129}, 3, 192, 128, 100, 100, 6},
        DsaCase{"dims_128", {65, 200}, 2, 128, 128, 200, 200, 4},
        // A real-size budget (2100 ≥ top-k 2048 + pool − 1) with max_sel-sized selections, and empty rows of a
        // sequence that spans 35 key tiles.
        DsaCase{"long", {7, 2200}, 2, 256, 256, 2100, 48, 64}),
    [](const auto& info) { return std::string(info.param.name); });

// Two runs from the same inputs give the same bits: no atomics, sums in an order fixed by the shapes.
TEST(CudaBackwardMlaTcEdge, Deterministic) {
  const std::vector<int64_t> cu = cu_of({7, 2200});
  const int64_t T = cu.back(), NH = 2, dqk = 256, dv = 256, W = dqk + dv, max_sel = 2100;
  const std::vector<float> q = round_bf16(test::randn(T * NH * dqk, 1)), kv = round_bf16(test::randn(T * NH * W, 2)),
                           dO = test::randn(T * NH * dv, 3);
  const Selection sel = random_selection(cu, max_sel, 48, 64, 4);
  std::vector<float> dq1(T * NH * dqk, 0.0f), dkv1(T * NH * W, 0.0f), dq2 = dq1, dkv2 = dkv1;
  cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, dqk, dv, max_sel, dq1, dkv1);
  cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, dqk, dv, max_sel, dq2, dkv2);
  EXPECT_TRUE(all_finite(dq1) && all_finite(dkv1));
  EXPECT_EQ(std::memcmp(dq1.data(), dq2.data(), dq1.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(dkv1.data(), dkv2.data(), dkv1.size() * sizeof(float)), 0);
}

// The bf16 outputs (what training's projections take) are the fp32 gradients rounded once, bit for bit: at both head
// dims that have them, from the backward's own stats and from the forward's. The other head dims refuse them.
TEST(CudaBackwardMlaTcEdge, Bf16OutputsAreTheFp32OnesRounded) {
  const std::vector<int64_t> cu = cu_of({7, 300});
  const int64_t T = cu.back(), NH = 2, max_sel = 260;
  const Selection sel = random_selection(cu, max_sel, 48, 64, 5);
  for (const int64_t d : {256, 128}) {
    const int64_t W = 2 * d;
    const std::vector<float> q = round_bf16(test::randn(T * NH * d, 11)), kv = round_bf16(test::randn(T * NH * W, 12)),
                             dO = test::randn(T * NH * d, 13);
    for (const bool fwd : {false, true}) {
      SCOPED_TRACE("head dim " + std::to_string(d) + (fwd ? ", the forward's stats" : ", own stats"));
      std::vector<float> dq(T * NH * d, 0.0f), dkv(T * NH * W, 0.0f), hq(T * NH * d), hkv(T * NH * W);
      cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, d, d, max_sel, dq, dkv, fwd);
      cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, d, d, max_sel, hq, hkv, fwd, true);
      const std::vector<float> rq = round_bf16(dq), rkv = round_bf16(dkv);
      ASSERT_TRUE(all_finite(rq) && all_finite(rkv));
      EXPECT_EQ(std::memcmp(hq.data(), rq.data(), rq.size() * sizeof(float)), 0) << "dq";
      EXPECT_EQ(std::memcmp(hkv.data(), rkv.data(), rkv.size() * sizeof(float)), 0) << "dkv";
    }
  }
  EXPECT_TRUE(cuda_testing::mla_backward_tc_bf16_outputs(256, 256) &&
              cuda_testing::mla_backward_tc_bf16_outputs(128, 128));
  EXPECT_FALSE(cuda_testing::mla_backward_tc_bf16_outputs(192, 128) ||
               cuda_testing::mla_backward_tc_bf16_outputs(64, 64));
  const std::vector<int64_t> small = cu_of({20});
  std::vector<float> dq(20 * 64, 0.0f), dkv(20 * 128, 0.0f);
  EXPECT_THROW(cuda_testing::mla_sparse_attention_backward_tc(test::randn(20 * 64, 1), test::randn(20 * 128, 2),
                                                              test::randn(20 * 64, 3), Selection(20), small, 1, 64, 64,
                                                              4, dq, dkv, false, true),
               Error);
}

TEST(CudaBackwardMlaTcEdge, EmptyBatchIsANoOp) {
  std::vector<float> dq, dkv;
  cuda_testing::mla_sparse_attention_backward_tc({}, {}, {}, {}, {0}, 3, 256, 256, 8, dq, dkv);
  EXPECT_TRUE(dq.empty() && dkv.empty());
}

// Every selection empty: uniform weights over each whole sequence (the build's tile ranges, not the bitmask), in
// sequences that start and end mid-tile.
TEST(CudaBackwardMlaTcEdge, AllSelectionsEmpty) {
  const std::vector<int64_t> cu = cu_of({30, 100, 1, 70});
  const int64_t T = cu.back(), NH = 2, dqk = 64, dv = 64, W = dqk + dv;
  const std::vector<float> q = round_bf16(test::randn(T * NH * dqk, 7)), kv = round_bf16(test::randn(T * NH * W, 8)),
                           dO = test::randn(T * NH * dv, 9);
  const Selection sel(T);
  std::vector<float> rq(T * NH * dqk, 0.0f), rkv(T * NH * W, 0.0f), dq = rq, dkv = rkv;
  attention_backward_reference(q, kv, dO, sel, cu, NH, dqk, dv, rq, rkv);
  cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, dqk, dv, 4, dq, dkv);
  ASSERT_TRUE(all_finite(dq) && all_finite(dkv));
  const TcErrors e = tc_errors(dq, dkv, rq, rkv, sel, NH, dqk, dv);
  std::printf("[cuda] MLA tc backward, all selections empty: dq %.2e, dk %.2e, dv %.2e\n", e.q_uni, e.k, e.v);
  expect_within(e, kTcTol, "all empty");
  std::vector<float> fq(T * NH * dqk, 0.0f), fkv(T * NH * W, 0.0f);
  cuda_testing::mla_sparse_attention_backward_tc(q, kv, dO, sel, cu, NH, dqk, dv, 4, fq, fkv, true);
  ASSERT_TRUE(all_finite(fq) && all_finite(fkv));
  expect_within(tc_errors(fq, fkv, rq, rkv, sel, NH, dqk, dv), kTcTol, "all empty, from the forward's stats");
}

}  // namespace
}  // namespace nextlm
