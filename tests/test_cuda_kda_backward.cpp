// The CUDA backwards of the KDA delta-rule recurrence (src/cuda/kda_backward.cu, the recurrent form;
// src/cuda/kda_chunked_backward.cu, the chunked form) against the CPU kda_recurrent_backward run per sequence and
// head, on packed sequences of uneven lengths. Both kernels are timed at the model's shape (and their agreement there
// checked) by nextlm_bench's kda_bwd_T4096_H64 (bench/backward.cu), not here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "cuda/testing_kda_backward.h"
#include "io/safetensors.h"
#include "model/backward.h"
#include "model/kda.h"
#include "test_util.h"

namespace nextlm {
namespace {

// Inputs as the layer produces them: unit-norm k, q scaled by K^-1/2, safe-gate decays g = −gate·sigmoid(x), sigmoid
// betas; do ~ N(0, 1).
struct Case {
  int64_t H = 0, K = 0;
  std::vector<int64_t> cu{0};
  std::vector<float> q, k, v, g, beta, dout;
};

Case make_case(const std::vector<int64_t>& lens, int64_t H, int64_t K, unsigned seed, float gate = 5.0f) {
  Case c;
  c.H = H;
  c.K = K;
  for (int64_t L : lens) c.cu.push_back(c.cu.back() + L);
  const int64_t T = c.cu.back();
  c.q = test::randn(T * H * K, seed);
  c.k = test::randn(T * H * K, seed + 1);
  c.v = test::randn(T * H * K, seed + 2);
  c.g = test::randn(T * H * K, seed + 3);
  c.beta = test::randn(T * H, seed + 4);
  c.dout = test::randn(T * H * K, seed + 5);
  for (int64_t r = 0; r < T * H; ++r) {
    double sq = 0, sk = 0;
    for (int64_t d = 0; d < K; ++d) sq += c.q[r * K + d] * c.q[r * K + d], sk += c.k[r * K + d] * c.k[r * K + d];
    for (int64_t d = 0; d < K; ++d) c.q[r * K + d] /= std::sqrt(sq * K), c.k[r * K + d] /= std::sqrt(sk);
    c.beta[r] = 1.0f / (1.0f + std::exp(-c.beta[r]));
  }
  for (float& x : c.g) x = -gate / (1.0f + std::exp(-x));
  return c;
}

// The CPU reference, added into the given buffers (as the kernel adds into its outputs).
void cpu_backward(const Case& c, cuda_testing::KdaBackwardGrads& d) {
  const int64_t H = c.H, K = c.K, HK = H * K;
  for (size_t n = 0; n + 1 < c.cu.size(); ++n)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t t0 = c.cu[n], off = t0 * HK + h * K;
      const KdaSeq s{c.q.data() + off, c.k.data() + off, c.v.data() + off, c.g.data() + off,
                     c.beta.data() + t0 * H + h, c.cu[n + 1] - t0, K, HK, H, nullptr};
      kda_recurrent_backward(s, c.dout.data() + off, d.dq.data() + off, d.dk.data() + off, d.dv.data() + off,
                             d.dg.data() + off, d.dbeta.data() + t0 * H + h);
    }
}

bool all_finite(const std::vector<float>& x) {
  for (float e : x)
    if (!std::isfinite(e)) return false;
  return true;
}

// Both sides are fp32 with expf decays; they differ in the summation order over the key and value dims (~1e-6
// relative), far below 1e-4, while a wrong term in any gradient moves it by O(1).
constexpr double kTol = 1e-4;

void expect_close(const cuda_testing::KdaBackwardGrads& gpu, const cuda_testing::KdaBackwardGrads& cpu,
                  double tol = kTol) {
  const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>> outs[] = {
      {"dq", {&gpu.dq, &cpu.dq}}, {"dk", {&gpu.dk, &cpu.dk}},          {"dv", {&gpu.dv, &cpu.dv}},
      {"dg", {&gpu.dg, &cpu.dg}}, {"dbeta", {&gpu.dbeta, &cpu.dbeta}},
  };
  for (const auto& [name, p] : outs) {
    ASSERT_EQ(p.first->size(), p.second->size()) << name;
    EXPECT_TRUE(all_finite(*p.first)) << name;
    const double e = test::norm_rel_error(p.first->data(), p.second->data(), p.second->size());
    EXPECT_LE(e, tol) << name;
    std::printf("%s rel err %.3g\n", name, e);
  }
}

// Every gradient of b the same bits as a's.
void expect_same_bits(const cuda_testing::KdaBackwardGrads& a, const cuda_testing::KdaBackwardGrads& b) {
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.dg, b.dg);
  EXPECT_EQ(a.dbeta, b.dbeta);
}

// Restores the process-wide compact-prep switch when a test that sets it ends.
struct RestoreCompactPrep {
  bool was = cuda_testing::kda_backward_compact_prep();
  ~RestoreCompactPrep() { cuda_testing::set_kda_backward_compact_prep(was); }
};

cuda_testing::KdaBackwardGrads zeros(int64_t T, int64_t H, int64_t K) {
  const size_t nx = static_cast<size_t>(T * H * K), nb = static_cast<size_t>(T * H);
  return {std::vector<float>(nx, 0.0f), std::vector<float>(nx, 0.0f), std::vector<float>(nx, 0.0f),
          std::vector<float>(nx, 0.0f), std::vector<float>(nb, 0.0f)};
}

class CudaBackwardKda : public ::testing::TestWithParam<int64_t> {};

// Lengths 1, 37 and 130/200 cross no, part of one and several 64-step checkpoint chunks and 8-step sub-chunks; the
// empty sequence must be skipped.
TEST_P(CudaBackwardKda, MatchesCpuOnPackedSequences) {
  const int64_t K = GetParam(), H = K == 128 ? 2 : 3;
  const Case c = make_case({1, 37, 64, 0, 130, 200}, H, K, 100 + static_cast<unsigned>(K));
  const int64_t T = c.cu.back();
  const auto gpu = cuda_testing::kda_recurrent_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  auto cpu = zeros(T, H, K);
  cpu_backward(c, cpu);
  expect_close(gpu, cpu);
}

// The gradients are added into what the buffers hold.
TEST_P(CudaBackwardKda, AccumulatesIntoOutputs) {
  const int64_t K = GetParam(), H = 2;
  const Case c = make_case({65, 9}, H, K, 200 + static_cast<unsigned>(K));
  const int64_t T = c.cu.back();
  auto cpu = zeros(T, H, K);
  cpu_backward(c, cpu);
  // Initial values of the gradients' own scale, so that subtracting them back costs little precision.
  cuda_testing::KdaBackwardGrads init;
  unsigned seed = 1;
  for (auto [dst, ref] : {std::pair{&init.dq, &cpu.dq}, {&init.dk, &cpu.dk}, {&init.dv, &cpu.dv},
                          {&init.dg, &cpu.dg}, {&init.dbeta, &cpu.dbeta}}) {
    double ss = 0;
    for (float x : *ref) ss += double(x) * x;
    *dst = test::randn(ref->size(), seed++, static_cast<float>(std::sqrt(ss / ref->size())));
  }
  const auto gpu = cuda_testing::kda_recurrent_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, init);
  // What the kernel added, against the CPU gradient alone: an overwrite would leave −init here.
  auto added = gpu;
  for (auto [a, i] : {std::pair{&added.dq, &init.dq}, {&added.dk, &init.dk}, {&added.dv, &init.dv},
                      {&added.dg, &init.dg}, {&added.dbeta, &init.dbeta}})
    for (size_t e = 0; e < a->size(); ++e) (*a)[e] -= (*i)[e];
  expect_close(added, cpu);
}

// K = 40: key rows and value columns that fill neither a warp nor a block.
// T = 0 (and empty sequences only) is a no-op that touches nothing.
TEST(CudaBackwardKdaEdge, EmptyBatch) {
  const Case c = make_case({0, 0}, 2, 64, 9);
  const auto gpu = cuda_testing::kda_recurrent_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, 2, 64);
  EXPECT_TRUE(gpu.dq.empty());
  EXPECT_TRUE(gpu.dbeta.empty());
}

// Only length-1 sequences: one step each, in many clusters.
TEST(CudaBackwardKdaEdge, SingleTokenSequences) {
  const int64_t H = 3, K = 128;
  const Case c = make_case(std::vector<int64_t>(5, 1), H, K, 19);
  const auto gpu = cuda_testing::kda_recurrent_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  auto cpu = zeros(c.cu.back(), H, K);
  cpu_backward(c, cpu);
  expect_close(gpu, cpu);
}

INSTANTIATE_TEST_SUITE_P(K, CudaBackwardKda, ::testing::Values(16, 40, 64, 128),
                         [](const auto& info) { return "K" + std::to_string(info.param); });

// ---- The chunked form (kda_chunked_backward) ----

// The chunked form runs its matrix products on tensor cores in split bf16 (each operand as a bf16 pair hi + lo,
// about 16 mantissa bits) and reassociates the sums over the chunk's tokens (through the WY factors, the inverse of
// the chunk's unit-lower matrix and __expf decays of cumulative gates). An emulation of that arithmetic at these
// shapes puts the gradients 5e-6 … 1.1e-5 (norm-relative) from a double-precision recurrence, an order below kTol,
// while a wrong or missing term moves a gradient by O(1) relative.
class CudaBackwardKdaChunked : public ::testing::TestWithParam<int64_t> {};

// Lengths 1, 63, 64, 65, 200 and 300: a single token, a chunk cut short, a full one, one token over, several chunks
// with a short last one; the empty sequence has no chunk. Decays g in about [−0.5, 0] (the trained gates' scale).
TEST_P(CudaBackwardKdaChunked, MatchesCpuOnPackedSequences) {
  const int64_t K = GetParam(), H = 3;
  const Case c = make_case({1, 63, 64, 0, 65, 200, 300}, H, K, 300 + static_cast<unsigned>(K), 0.5f);
  const auto gpu = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  auto cpu = zeros(c.cu.back(), H, K);
  cpu_backward(c, cpu);
  expect_close(gpu, cpu);
}

// Strong decays (g down to −5 a step, so cumulative gates down to about −300 within a chunk): the decays are formed
// as exp(Γ_i − Γ_j) ≤ 1, or within a block as a product of factors within e^±60, never as a quotient of
// exponentials that would overflow.
TEST_P(CudaBackwardKdaChunked, StrongDecays) {
  const int64_t K = GetParam(), H = 2;
  const Case c = make_case({130, 64, 7}, H, K, 400 + static_cast<unsigned>(K), 5.0f);
  const auto gpu = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  auto cpu = zeros(c.cu.back(), H, K);
  cpu_backward(c, cpu);
  expect_close(gpu, cpu);
}

// The pairs within a 16-row block run on tensor cores with the decay split at the block's middle row, unless a
// column decays by more than 60 over half a block somewhere in the chunk: then that chunk and head form them element
// by element. Head 0 here decays by at most 0.5 a step (split), head 1 by up to 40 (about 20 a step on average:
// element by element), in one call; both against the CPU.
TEST_P(CudaBackwardKdaChunked, NarrowAndWideDecaysInOneCall) {
  const int64_t K = GetParam(), H = 2;
  Case c = make_case({130, 64, 7}, H, K, 450 + static_cast<unsigned>(K), 0.5f);
  for (int64_t r = 0; r < c.cu.back(); ++r)
    for (int64_t d = 0; d < K; ++d) c.g[(r * H + 1) * K + d] *= 80.0f;
  const auto gpu = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  auto cpu = zeros(c.cu.back(), H, K);
  cpu_backward(c, cpu);
  expect_close(gpu, cpu);
}

// The same gradients as the GPU recurrent kernel (the reference the training step used before).
TEST_P(CudaBackwardKdaChunked, MatchesGpuRecurrent) {
  const int64_t K = GetParam(), H = 3;
  const Case c = make_case({257, 1, 128, 90}, H, K, 500 + static_cast<unsigned>(K), 0.5f);
  const auto chunked = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  const auto recurrent = cuda_testing::kda_recurrent_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  expect_close(chunked, recurrent);
}

// One sequence of 24 chunks (the last one cut short): the state passes carry the split-bf16 rounding of every
// chunk's products into the next, and the gradients must stay within kTol of the recurrent kernel's.
TEST_P(CudaBackwardKdaChunked, LongSequenceMatchesGpuRecurrent) {
  const int64_t K = GetParam(), H = 2;
  const Case c = make_case({1500}, H, K, 800 + static_cast<unsigned>(K), 0.5f);
  const auto chunked = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  const auto recurrent = cuda_testing::kda_recurrent_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  expect_close(chunked, recurrent);
}

// The gradients are added into what the buffers hold (two kernels add into dq, dk and dg in turn).
TEST_P(CudaBackwardKdaChunked, AccumulatesIntoOutputs) {
  const int64_t K = GetParam(), H = 2;
  const Case c = make_case({65, 9}, H, K, 600 + static_cast<unsigned>(K), 0.5f);
  const int64_t T = c.cu.back();
  auto cpu = zeros(T, H, K);
  cpu_backward(c, cpu);
  cuda_testing::KdaBackwardGrads init;
  unsigned seed = 11;
  for (auto [dst, ref] : {std::pair{&init.dq, &cpu.dq}, {&init.dk, &cpu.dk}, {&init.dv, &cpu.dv},
                          {&init.dg, &cpu.dg}, {&init.dbeta, &cpu.dbeta}}) {
    double ss = 0;
    for (float x : *ref) ss += double(x) * x;
    *dst = test::randn(ref->size(), seed++, static_cast<float>(std::sqrt(ss / ref->size())));
  }
  const auto gpu = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, init);
  auto added = gpu;
  for (auto [a, i] : {std::pair{&added.dq, &init.dq}, {&added.dk, &init.dk}, {&added.dv, &init.dv},
                      {&added.dg, &init.dg}, {&added.dbeta, &init.dbeta}})
    for (size_t e = 0; e < a->size(); ++e) (*a)[e] -= (*i)[e];
  expect_close(added, cpu);
}

// Written instead of added to (training's form, no zeroing pass): every element written, bitwise what adding into
// zeros gives; several sequences, a partial last chunk and one of a single token.
TEST_P(CudaBackwardKdaChunked, WrittenEqualsAddedIntoZeros) {
  const int64_t K = GetParam(), H = 2;
  const Case c = make_case({65, 1, 130}, H, K, 650 + static_cast<unsigned>(K), 0.5f);
  const auto added = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  const auto written = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, {}, true);
  EXPECT_EQ(written.dq, added.dq);
  EXPECT_EQ(written.dk, added.dk);
  EXPECT_EQ(written.dv, added.dv);
  EXPECT_EQ(written.dg, added.dg);
  EXPECT_EQ(written.dbeta, added.dbeta);
}

// With bf16 products (KdaBackwardProducts::Bf16: the hi planes alone, one MMA a product) on inputs as training feeds
// them (q, k and v bf16 values, as the tensor-core forward read them): every operand formed in the kernel (the WY
// factors, the decay-weighted keys, the states and their gradients) is rounded to bf16 (2^-9 relative) before its
// product, so the gradients sit ~1e-3 from the CPU's, well inside 2e-2, while a wrong or missing term moves one by
// O(1). Narrow and strong decays; the lo terms must be what is dropped (the split products are closer to the CPU).
TEST_P(CudaBackwardKdaChunked, Bf16ProductsStayNearTheCpu) {
  const int64_t K = GetParam(), H = 2;
  for (const float gate : {0.5f, 5.0f}) {
    Case c = make_case({130, 64, 1, 77}, H, K, 900 + static_cast<unsigned>(K), gate);
    for (std::vector<float>* x : {&c.q, &c.k, &c.v})
      for (float& e : *x) e = bf16_to_f32(f32_to_bf16(e));
    auto cpu = zeros(c.cu.back(), H, K);
    cpu_backward(c, cpu);
    const auto bf16 = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, {}, false,
                                                         true);
    const auto split = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
    std::printf("gate %g, bf16 products:\n", gate);
    expect_close(bf16, cpu, 2e-2);
    const double eb = test::norm_rel_error(bf16.dk.data(), cpu.dk.data(), cpu.dk.size());
    const double es = test::norm_rel_error(split.dk.data(), cpu.dk.data(), cpu.dk.size());
    EXPECT_LT(es, eb) << "gate " << gate << ": the bf16 products should drop the lo terms";
  }
}

// The bf16 products' compact prep kernel (two blocks an SM) gives the full form's bits, on both paths of the pairs
// within a block (gate 0.5: on tensor cores; 5: element by element) and on partial chunks.
TEST_P(CudaBackwardKdaChunked, CompactPrepGivesTheSameBits) {
  const int64_t K = GetParam(), H = 2;
  const RestoreCompactPrep restore;
  for (const float gate : {0.5f, 5.0f}) {
    const Case c = make_case({130, 64, 1, 77}, H, K, 950 + static_cast<unsigned>(K), gate);
    cuda_testing::set_kda_backward_compact_prep(true);
    const auto a = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, {}, false, true);
    cuda_testing::set_kda_backward_compact_prep(false);
    const auto b = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, {}, false, true);
    SCOPED_TRACE("gate " + std::to_string(gate));
    expect_same_bits(a, b);
  }
}

// q, k and v given in bf16 (the overload a training step calls with the tensor-core forward's inputs) give the bits
// of fp32 copies of the same values: every form (split and bf16 products, the full and compact prep), both paths of
// the pairs within a block (gate 0.5 and 5), partial chunks, gradients written (NaN-filled first) and added to.
TEST_P(CudaBackwardKdaChunked, Bf16InputsGiveTheSameBits) {
  const int64_t K = GetParam(), H = 2;
  const RestoreCompactPrep restore;
  for (const float gate : {0.5f, 5.0f}) {
    Case c = make_case({130, 64, 1, 77}, H, K, 970 + static_cast<unsigned>(K), gate);
    for (std::vector<float>* x : {&c.q, &c.k, &c.v})
      for (float& e : *x) e = bf16_to_f32(f32_to_bf16(e));
    for (const bool products : {false, true})
      for (const bool compact : {false, true})
        for (const bool written : {false, true}) {
          if (compact && !products) continue;  // the compact prep is the bf16 products' alone
          cuda_testing::set_kda_backward_compact_prep(compact);
          const auto a = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, {},
                                                            written, products);
          const auto b = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K, {},
                                                            written, products, true);
          SCOPED_TRACE("gate " + std::to_string(gate) + (products ? ", bf16 products" : ", split") +
                       (compact ? ", compact prep" : "") + (written ? ", written" : ", added"));
          expect_same_bits(a, b);
        }
  }
}

// The gate's inputs for T tokens: f ~ N(0, 1) [T, H, K], dt_bias ~ N(0, 1) [H·K], A_log ~ N(0, 0.3²) [H].
struct GateInputs {
  std::vector<float> f, bias, alog;
};
GateInputs gate_inputs(int64_t T, int64_t H, int64_t K, unsigned seed) {
  GateInputs g{test::randn(T * H * K, seed), test::randn(H * K, seed + 1), test::randn(H, seed + 2)};
  for (float& x : g.alog) x *= 0.3f;
  return g;
}

// The gate formed in the kernel from f, dt_bias and A_log (KdaGateInputs, as a training step passes them) gives the
// bits of kda_gate's g passed in: both gate forms (the safe gate's bound, softplus with f past its cutoff of 20 on
// some elements), split and bf16 products, the full and compact prep, partial chunks.
TEST_P(CudaBackwardKdaChunked, GateFormedFromFGivesTheSameBits) {
  const int64_t K = GetParam(), H = 2;
  const RestoreCompactPrep restore;
  const Case c = make_case({130, 64, 1, 77}, H, K, 990 + static_cast<unsigned>(K));
  auto [f, bias, alog] = gate_inputs(c.cu.back(), H, K, 31);
  for (float& x : f) x *= 2.0f;
  for (size_t e = 0; e < f.size(); e += 97) f[e] = 25.0f;
  for (const bool bounded : {true, false})
    for (const bool products : {false, true})
      for (const bool compact : {false, true}) {
        if (compact && !products) continue;  // the compact prep is the bf16 products' alone
        cuda_testing::set_kda_backward_compact_prep(compact);
        const auto a = cuda_testing::kda_chunked_backward_gated(c.q, c.k, c.v, f, bias, alog, bounded, -5.0f, c.beta,
                                                                c.dout, c.cu, H, K, false, products);
        const auto b = cuda_testing::kda_chunked_backward_gated(c.q, c.k, c.v, f, bias, alog, bounded, -5.0f, c.beta,
                                                                c.dout, c.cu, H, K, true, products);
        SCOPED_TRACE(std::string(bounded ? "safe gate" : "softplus") + (products ? ", bf16 products" : ", split") +
                     (compact ? ", compact prep" : ""));
        expect_same_bits(a, b);
        bool finite = true;
        for (float x : b.dg) finite = finite && std::isfinite(x);
        EXPECT_TRUE(finite) << "every dg written and finite";
      }
}

// dO and the forward's v_new in bf16 (KdaBf16Operands, KdaTcStates::chunk_u16: how a training step with bf16
// products passes them) give the bits of fp32 copies of the same values, behind the tensor-core forward's kept
// states with the gate from f: the full and compact prep, partial chunks. Those gradients are the ones the backward
// forming its own states gives, but for the rounding that separates the two computations of the states (the forward's
// v_new from its bf16 U) within the bf16 products' noise.
TEST_P(CudaBackwardKdaChunked, Bf16OperandsGiveTheSameBits) {
  const int64_t K = GetParam(), H = 2;
  const RestoreCompactPrep restore;
  const Case c = make_case({130, 64, 1, 77}, H, K, 1010 + static_cast<unsigned>(K));
  const auto [f, bias, alog] = gate_inputs(c.cu.back(), H, K, 41);
  std::vector<float> do_r = c.dout, q = c.q, k = c.k, v = c.v;  // the bf16 values both forms take
  for (std::vector<float>* x : {&do_r, &q, &k, &v})
    for (float& e : *x) e = bf16_to_f32(f32_to_bf16(e));
  const auto own = cuda_testing::kda_chunked_backward_gated(q, k, v, f, bias, alog, true, -5.0f, c.beta, do_r, c.cu,
                                                            H, K, true, true);
  for (const bool compact : {false, true}) {
    cuda_testing::set_kda_backward_compact_prep(compact);
    const auto a = cuda_testing::kda_chunked_backward_kept(c.q, c.k, c.v, f, bias, alog, -5.0f, c.beta, c.dout, c.cu,
                                                           H, K, false);
    const auto b = cuda_testing::kda_chunked_backward_kept(c.q, c.k, c.v, f, bias, alog, -5.0f, c.beta, c.dout, c.cu,
                                                           H, K, true);
    SCOPED_TRACE(compact ? "compact prep" : "full prep");
    expect_same_bits(a, b);
    expect_close(b, own, 5e-2);
  }
}

// No atomics: two runs give the same bits.
TEST_P(CudaBackwardKdaChunked, Reproducible) {
  const int64_t K = GetParam(), H = 2;
  const Case c = make_case({100, 170}, H, K, 700 + static_cast<unsigned>(K), 0.5f);
  const auto a = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  const auto b = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, H, K);
  expect_same_bits(a, b);
}

INSTANTIATE_TEST_SUITE_P(K, CudaBackwardKdaChunked, ::testing::Values(32, 64, 128),
                         [](const auto& info) { return "K" + std::to_string(info.param); });

// T = 0 (and empty sequences only) is a no-op; a head size without an instantiation is refused.
TEST(CudaBackwardKdaChunkedEdge, EmptyBatchAndUnsupportedK) {
  const Case c = make_case({0, 0}, 2, 64, 9);
  const auto gpu = cuda_testing::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, c.dout, c.cu, 2, 64);
  EXPECT_TRUE(gpu.dq.empty());
  EXPECT_TRUE(gpu.dbeta.empty());
  const Case d = make_case({5}, 1, 40, 10);
  EXPECT_ANY_THROW(cuda_testing::kda_chunked_backward(d.q, d.k, d.v, d.g, d.beta, d.dout, d.cu, 1, 40));
}

}  // namespace
}  // namespace nextlm
