// GPU decoding against the CPU decode path (runs on a GPU machine, CTest label "gpu"): the decoding kernels against
// the CPU references one at a time (kda_recurrent_forward with the conv history, indexer_forward_cached, the expanded
// attention of attention_weights), each also checked for batch invariance (a row alone gives the same bits).
// Kernel outputs are poisoned with NaN first, so an unwritten element fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>

#include "cpu/linear.h"
#include "cuda/device_model.h"
#include "cuda/testing.h"
#include "model/config.h"
#include "model/dsa.h"
#include "model/kda.h"
#include "model/model.h"
#include "model/norm.h"
#include "test_util.h"

namespace nextlm {
namespace {

float bf16r(float x) { return bf16_to_f32(f32_to_bf16(x)); }

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How many of two runs' step outputs differ bitwise, in order (an output one run lacks counts as differing).
int64_t differing_steps(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  int64_t n = std::abs(static_cast<int64_t>(a.size()) - static_cast<int64_t>(b.size()));
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += !bitwise_equal(a[i], b[i]);
  return n;
}

// ---- GEMV ----

TEST(CudaDecode, LinearMatchesCpuAndIsBatchInvariant) {
  // in = 72 takes the vectorised path, in = 50 the scalar one.
  for (int64_t in : {72, 50}) {
    const int64_t M = 13, out = 37;
    const std::vector<float> x = test::randn(M * in, 1), W = test::randn(out * in, 2);
    const std::vector<float> y = cuda_testing::decode_linear(x, W, M, out, in);
    std::vector<float> want(M * out);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < out; ++n) {
        double acc = 0;
        for (int64_t i = 0; i < in; ++i) acc += double(bf16r(x[m * in + i])) * bf16r(W[n * in + i]);
        want[m * out + n] = static_cast<float>(acc);
      }
    const double err = test::norm_rel_error(y.data(), want.data(), want.size());
    std::printf("[cuda decode] linear in=%lld: ||dy||/||y|| = %.2e\n", static_cast<long long>(in), err);
    EXPECT_LE(err, 1e-5);  // fp32 accumulation of exact bf16 products
    for (int64_t m : {0, 5, 12}) {
      const std::vector<float> row(x.begin() + m * in, x.begin() + (m + 1) * in);
      const std::vector<float> alone = cuda_testing::decode_linear(row, W, 1, out, in);
      EXPECT_TRUE(bitwise_equal(alone, std::vector<float>(y.begin() + m * out, y.begin() + (m + 1) * out)))
          << "row " << m << " differs when computed alone (in=" << in << ")";
    }
  }
}

// ---- KDA ----

struct KdaStepCase {
  int64_t K;
  bool has_bound;
};

void PrintTo(const KdaStepCase& c, std::ostream* os) {
  *os << "K=" << c.K << (c.has_bound ? " safe" : " softplus");
}

class CudaDecodeKda : public ::testing::TestWithParam<KdaStepCase> {};

// The CPU reference of one token of one slot: conv over [history; raw] (history shifted), SiLU, L2 norms, the gate,
// then kda_recurrent_forward on the slot's state. Mirrors kda_layer_forward_cached's core.
std::vector<float> cpu_kda_token(const cuda_testing::KdaDecodeSteps& in, const float* raw, const float* graw,
                                 const float* beta, float* hist, float* state) {
  const int64_t H = in.H, K = in.K, HK = H * K, W = in.W, W1 = W - 1;
  std::vector<float> qkv(3 * HK), g(HK), o(HK);
  for (int64_t ch = 0; ch < 3 * HK; ++ch) {
    const int64_t which = ch / HK, c = ch % HK;
    float* hs = hist + which * W1 * HK + c;
    float acc = 0.0f;
    for (int64_t i = 0; i < W1; ++i) acc += in.conv[ch * W + i] * hs[i * HK];
    acc += in.conv[ch * W + W1] * raw[ch];
    for (int64_t i = 0; i + 1 < W1; ++i) hs[i * HK] = hs[(i + 1) * HK];
    if (W1 > 0) hs[(W1 - 1) * HK] = raw[ch];
    qkv[ch] = acc / (1.0f + std::exp(-acc));
  }
  for (int which = 0; which < 2; ++which)
    for (int64_t h = 0; h < H; ++h) {
      float* x = qkv.data() + which * HK + h * K;
      double ss = 0;
      for (int64_t d = 0; d < K; ++d) ss += double(x[d]) * x[d];
      const float inv = (which == 0 ? 1.0f / std::sqrt(float(K)) : 1.0f) / std::sqrt(float(ss) + 1e-6f);
      for (int64_t d = 0; d < K; ++d) x[d] *= inv;
    }
  for (int64_t c = 0; c < HK; ++c) {
    const float rate = std::exp(in.A_log[c / K]), f = graw[c] + in.dt_bias[c];
    g[c] = in.has_bound ? in.bound / (1.0f + std::exp(-rate * f))
                        : -rate * (f > 20.0f ? f : std::log(1.0f + std::exp(f)));
  }
  for (int64_t h = 0; h < H; ++h)
    kda_recurrent_forward(KdaSeq{qkv.data() + h * K, qkv.data() + HK + h * K, qkv.data() + 2 * HK + h * K,
                                 g.data() + h * K, beta + h, 1, K, HK, H, o.data() + h * K},
                          state + h * K * K);
  return o;
}

TEST_P(CudaDecodeKda, StepMatchesCpuRecurrenceAndIsBatchInvariant) {
  const KdaStepCase pc = GetParam();
  cuda_testing::KdaDecodeSteps in;
  in.H = 3, in.K = pc.K, in.W = 4, in.num_slots = 5, in.has_bound = pc.has_bound;
  const int64_t H = in.H, K = in.K, HK = H * K, W1 = in.W - 1, NS = in.num_slots;
  in.conv = test::randn(3 * HK * in.W, 1, 0.5f);
  in.dt_bias = test::randn(HK, 2, 0.5f);
  in.A_log = test::randn(H, 3, 0.5f);
  // Slot 2 never steps (its caches must stay as they are); the others join and pause in a staggered pattern.
  const int steps = 70;
  std::mt19937 gen(7);
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> sl;
    for (int32_t slot : {4, 0, 3, 1})
      if ((s + slot) % 4 != 0) sl.push_back(slot);
    const int64_t B = static_cast<int64_t>(sl.size());
    in.slots.push_back(sl);
    in.raw.push_back(test::randn(B * 3 * HK, 100 + s));
    in.graw.push_back(test::randn(B * HK, 300 + s));
    std::vector<float> beta = test::randn(B * H, 500 + s);
    for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));
    in.beta.push_back(beta);
  }
  std::vector<float> hist0 = test::randn(NS * 3 * W1 * HK, 8, 0.5f), state0 = test::randn(NS * H * K * K, 9, 0.1f);
  std::vector<float> hist = hist0, state = state0;
  const std::vector<std::vector<float>> gpu = cuda_testing::kda_decode_steps(in, hist, state);

  std::vector<float> hist_cpu = hist0, state_cpu = state0;
  double num = 0, den = 0;
  for (int s = 0; s < steps; ++s)
    for (size_t b = 0; b < in.slots[s].size(); ++b) {
      const int64_t slot = in.slots[s][b];
      const std::vector<float> o =
          cpu_kda_token(in, in.raw[s].data() + b * 3 * HK, in.graw[s].data() + b * HK, in.beta[s].data() + b * H,
                        hist_cpu.data() + slot * 3 * W1 * HK, state_cpu.data() + slot * H * K * K);
      for (int64_t i = 0; i < HK; ++i) {
        const double d = double(gpu[s][b * HK + i]) - o[i];
        ASSERT_TRUE(std::isfinite(gpu[s][b * HK + i])) << "step " << s << " row " << b;
        num += d * d, den += double(o[i]) * o[i];
      }
    }
  const double eo = std::sqrt(num / den);
  const double es = test::norm_rel_error(state.data(), state_cpu.data(), state.size());
  const double eh = test::max_rel_error(hist.data(), hist_cpu.data(), hist.size());
  std::printf("[cuda decode] KDA step K=%lld %s gate: output %.2e, final state %.2e, conv history %.2e\n",
              static_cast<long long>(K), pc.has_bound ? "safe" : "softplus", eo, es, eh);
  // Both fp32; the GPU's SiLU uses a fast exp and its sums run in another order: ~1e-6 relative.
  EXPECT_LE(eo, 1e-4);
  EXPECT_LE(es, 1e-4);
  EXPECT_EQ(eh, 0.0);  // the history is moved, never computed
  const int64_t s2 = 2 * H * K * K;
  EXPECT_TRUE(std::equal(state.begin() + s2, state.begin() + s2 + H * K * K, state0.begin() + s2)) << "idle slot";

  // Batch invariance: every row stepped alone gives the same bits.
  cuda_testing::KdaDecodeSteps alone = in;
  alone.slots.clear(), alone.raw.clear(), alone.graw.clear(), alone.beta.clear();
  for (int s = 0; s < steps; ++s)
    for (size_t b = 0; b < in.slots[s].size(); ++b) {
      alone.slots.push_back({in.slots[s][b]});
      alone.raw.emplace_back(in.raw[s].begin() + b * 3 * HK, in.raw[s].begin() + (b + 1) * 3 * HK);
      alone.graw.emplace_back(in.graw[s].begin() + b * HK, in.graw[s].begin() + (b + 1) * HK);
      alone.beta.emplace_back(in.beta[s].begin() + b * H, in.beta[s].begin() + (b + 1) * H);
    }
  std::vector<float> hist1 = hist0, state1 = state0;
  const std::vector<std::vector<float>> one = cuda_testing::kda_decode_steps(alone, hist1, state1);
  size_t r = 0;
  for (int s = 0; s < steps; ++s)
    for (size_t b = 0; b < in.slots[s].size(); ++b, ++r)
      ASSERT_TRUE(bitwise_equal(one[r], std::vector<float>(gpu[s].begin() + b * HK, gpu[s].begin() + (b + 1) * HK)))
          << "step " << s << " slot " << in.slots[s][b] << " differs when stepped alone";
  EXPECT_TRUE(bitwise_equal(state1, state));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeKda,
                         ::testing::Values(KdaStepCase{16, true}, KdaStepCase{64, false}, KdaStepCase{128, true}),
                         [](const auto& info) {
                           return "K" + std::to_string(info.param.K) + (info.param.has_bound ? "_safe" : "_softplus");
                         });

// The tensor-core KDA's decoding steps (kda_tc_step, which computes only the new row of the slot's partial chunk from
// what the chunk's earlier rows left in the row cache) against the forward (kda_chunked_tc over the whole sequences,
// from the same random start states): every decoded row's output and the state each slot ends with, bit for bit.
// Prompts end mid-block, on a chunk boundary, mid-chunk past a block boundary, or are empty; four sequences step
// together across 16-row blocks and two chunk boundaries; the caches start as NaN, so a read of a row not yet made
// shows. K from 16 to 128; a bound of −5 keeps the references unshifted, −8 shifts them (kda_tc.cu).
struct KdaTcStepCase {
  int64_t K;
  float bound;
};
class CudaDecodeKdaTc : public ::testing::TestWithParam<KdaTcStepCase> {};

TEST_P(CudaDecodeKdaTc, StepsEqualTheForwardBitwise) {
  const int64_t H = 2, K = GetParam().K, HK = H * K;
  const float bound = GetParam().bound;
  const std::vector<int64_t> len{150, 131, 70, 66}, prompt{1, 64, 37, 0};
  std::vector<int64_t> cu{0};
  for (int64_t L : len) cu.push_back(cu.back() + L);
  const int64_t T = cu.back(), N = static_cast<int64_t>(len.size());
  std::vector<float> q = test::randn(T * HK, 1), k = test::randn(T * HK, 2), v = test::randn(T * HK, 3);
  for (int64_t r = 0; r < T * H; ++r) {  // unit k, q of norm K^-1/2 (as kda_conv_norm leaves them)
    double sq = 0, sk = 0;
    for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
    for (int64_t d = 0; d < K; ++d)
      q[r * K + d] = static_cast<float>(q[r * K + d] / std::sqrt(sq * K)),
                k[r * K + d] = static_cast<float>(k[r * K + d] / std::sqrt(sk));
  }
  const std::vector<float> graw = test::randn(T * HK, 4), A_log = test::randn(H, 5, 0.5f),
                           dt_bias = test::randn(HK, 6, 0.5f), s_in = test::randn(N * H * K * K, 7, 0.1f);
  std::vector<float> beta = test::randn(T * H, 8);
  for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));

  std::vector<float> s_full, s_dec;
  const std::vector<float> full =
      cuda_testing::kda_chunked_tc(q, k, v, graw, beta, A_log, dt_bias, bound, cu, H, K, s_in, &s_full, true);
  const std::vector<float> dec =
      cuda_testing::kda_tc_decode(q, k, v, graw, beta, A_log, dt_bias, bound, cu, prompt, H, K, s_in, &s_dec);
  int64_t differing = 0, nonfinite = 0;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> a(full.begin() + t * HK, full.begin() + (t + 1) * HK),
        b(dec.begin() + t * HK, dec.begin() + (t + 1) * HK);
    differing += !bitwise_equal(a, b);
    for (float x : b) nonfinite += !std::isfinite(x);
  }
  int64_t states_differing = 0;
  for (int64_t n = 0; n < N; ++n) {
    // The forward leaves the state after the last complete chunk (none: the start state stays).
    const std::vector<float>& want = len[n] >= 64 ? s_full : s_in;
    states_differing += std::memcmp(want.data() + n * H * K * K, s_dec.data() + n * H * K * K,
                                    H * K * K * sizeof(float)) != 0;
  }
  std::printf("[cuda decode] tensor-core KDA steps K=%lld bound %g: %lld of %lld rows and %lld of %lld states differ "
              "bitwise from the forward\n",
              static_cast<long long>(K), bound, static_cast<long long>(differing), static_cast<long long>(T),
              static_cast<long long>(states_differing), static_cast<long long>(N));
  EXPECT_EQ(nonfinite, 0);
  EXPECT_EQ(differing, 0);
  EXPECT_EQ(states_differing, 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeKdaTc,
                         ::testing::Values(KdaTcStepCase{16, -5.0f}, KdaTcStepCase{32, -8.0f},
                                           KdaTcStepCase{64, -5.0f}, KdaTcStepCase{128, -5.0f},
                                           KdaTcStepCase{128, -8.0f}),
                         [](const auto& info) {
                           return "K" + std::to_string(info.param.K) + "_bound" +
                                  std::to_string(static_cast<int>(-info.param.bound));
                         });

// The caches a prefill leaves: each sequence's last W−1 pre-conv projections (zeros before its start) and its final
// recurrent state, against the CPU recurrence over the whole sequence; an unlisted slot keeps its contents.
TEST(CudaDecode, KdaPrefillCachesMatchCpu) {
  const int64_t H = 2, K = 32, W = 4, W1 = W - 1, HK = H * K, NS = 5;
  const std::vector<int64_t> lens{1, 2, 70, 5};
  const std::vector<int32_t> slots{3, 0, 4, 1};
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back(), N = static_cast<int64_t>(lens.size());
  std::vector<float> raw = test::randn(T * 3 * HK, 1), q = test::randn(T * HK, 2), k = test::randn(T * HK, 3),
                     v = test::randn(T * HK, 4), g = test::randn(T * HK, 5), beta = test::randn(T * H, 6);
  for (int64_t r = 0; r < T * H; ++r) {
    double sq = 0, sk = 0;
    for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
    for (int64_t d = 0; d < K; ++d) q[r * K + d] /= std::sqrt(sq * K), k[r * K + d] /= std::sqrt(sk);
    beta[r] = 1.0f / (1.0f + std::exp(-beta[r]));
  }
  for (float& x : g) x = -5.0f / (1.0f + std::exp(-x));
  const std::vector<float> hist0 = test::randn(NS * 3 * W1 * HK, 7), state0 = test::randn(NS * H * K * K, 8);
  std::vector<float> hist = hist0, state = state0;
  cuda_testing::kda_prefill_caches(raw, q, k, v, g, beta, cu, slots, H, K, W, hist, state);
  std::vector<float> want_hist = hist0, want_state = state0, o(T * HK);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s0 = cu[n], L = lens[n], slot = slots[n];
    for (int64_t which = 0; which < 3; ++which)
      for (int64_t i = 0; i < W1; ++i)
        for (int64_t c = 0; c < HK; ++c) {
          const int64_t t = L - W1 + i;
          want_hist[((slot * 3 + which) * W1 + i) * HK + c] = t >= 0 ? raw[(s0 + t) * 3 * HK + which * HK + c] : 0.0f;
        }
    for (int64_t h = 0; h < H; ++h) {
      float* st = want_state.data() + (slot * H + h) * K * K;
      std::fill(st, st + K * K, 0.0f);
      const int64_t off = s0 * HK + h * K;
      kda_recurrent_forward(KdaSeq{q.data() + off, k.data() + off, v.data() + off, g.data() + off,
                                   beta.data() + s0 * H + h, L, K, HK, H, o.data() + off},
                            st);
    }
  }
  EXPECT_TRUE(bitwise_equal(hist, want_hist)) << "conv histories";
  const double es = test::norm_rel_error(state.data(), want_state.data(), state.size());
  std::printf("[cuda decode] KDA prefill caches: final states %.2e (norm-relative)\n", es);
  EXPECT_LE(es, 1e-4);  // fp32 both, other summation order
  const int64_t s2 = 2 * H * K * K;
  EXPECT_TRUE(std::equal(state.begin() + s2, state.begin() + s2 + H * K * K, state0.begin() + s2)) << "unlisted slot";
}

// ---- Indexer ----

struct IndexerCase {
  int64_t P, topk;
  bool tail;
};

void PrintTo(const IndexerCase& c, std::ostream* os) {
  *os << "P=" << c.P << " topk=" << c.topk << (c.tail ? " tail" : " no tail");
}

class CudaDecodeIndexer : public ::testing::TestWithParam<IndexerCase> {};

// Three sequences in slots 2, 0, 1 joining at steps 0, 5 and 10, up to 100 tokens: pools complete, the top-k starts
// choosing once a query has more than topk/P selectable pools, and the tail grows and empties.
TEST_P(CudaDecodeIndexer, SelectionsEqualCpuCached) {
  const IndexerCase pc = GetParam();
  ModelConfig c;
  c.hidden_size = 24, c.q_lora_rank = 20, c.index_n_heads = 8, c.index_head_dim = 40;
  c.index_kpool = pc.P, c.index_topk = pc.topk, c.index_kpool_always_select_tail = pc.tail;
  const int64_t D = c.hidden_size, QL = c.q_lora_rank, IH = c.index_n_heads, ID = c.index_head_dim, P = pc.P;
  auto tensor = [](std::vector<int64_t> shape, unsigned seed, float scale) {
    Tensor t(shape);
    t.data = test::randn(t.data.size(), seed, scale);
    return t;
  };
  IndexerWeights w;
  w.wq_b = tensor({IH * ID, QL}, 1, 0.3f);
  w.wk = tensor({ID, D}, 2, 0.3f);
  w.k_norm_w = tensor({ID}, 3, 0.2f);
  for (float& x : w.k_norm_w.data) x += 1.0f;
  w.k_norm_b = tensor({ID}, 4, 0.1f);
  w.weights_proj = tensor({IH, D}, 5, 0.3f);
  w.ape = tensor({P, ID}, 6, 0.5f);
  w.gate = tensor({ID, D}, 7, 0.3f);

  const int steps = 110, max_len = 100;
  const std::vector<int32_t> order{2, 0, 1};
  cuda_testing::IndexerDecodeSteps in;
  in.IH = IH, in.ID = ID, in.P = P, in.topk = pc.topk, in.num_slots = 3, in.max_pools = max_len / P + 1;
  in.tail = pc.tail, in.ape = w.ape.data;
  std::vector<DsaCache> cache(3);
  std::vector<std::vector<std::vector<int32_t>>> want;
  int64_t chosen = 0;
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> sl;
    for (int32_t i = 0; i < 3; ++i)
      if (s >= 5 * i && s - 5 * i < max_len) sl.push_back(order[i]);
    const int64_t B = static_cast<int64_t>(sl.size());
    const std::vector<float> a = test::randn(B * D, 1000 + s), qr = test::randn(B * QL, 2000 + s);
    std::vector<float> qi(B * IH * ID), ki(B * ID), gs(B * ID), wts(B * IH);
    cpu::linear(qr.data(), B, QL, w.wq_b, qi.data());
    cpu::linear(a.data(), B, D, w.wk, ki.data());
    layernorm_forward(ki.data(), w.k_norm_w.ptr(), w.k_norm_b.ptr(), ki.data(), B, ID, 1e-6f);
    cpu::linear(a.data(), B, D, w.gate, gs.data());
    cpu::linear(a.data(), B, D, w.weights_proj, wts.data());
    in.slots.push_back(sl), in.qi.push_back(qi), in.ki.push_back(ki), in.gs.push_back(gs), in.wts.push_back(wts);
    std::vector<std::vector<int32_t>> rows;
    for (int64_t b = 0; b < B; ++b) {
      DsaCache& dc = cache[sl[b]];
      if ((dc.length + 1) / P > pc.topk / P) ++chosen;
      Selection sel = indexer_forward_cached(w, c, a.data() + b * D, qr.data() + b * QL, 1, dc);
      dc.length += 1;
      rows.push_back(sel[0]);
    }
    want.push_back(rows);
  }
  const auto got = cuda_testing::indexer_decode_steps(in);
  int64_t rows = 0, mismatched = 0;
  for (int s = 0; s < steps; ++s)
    for (size_t b = 0; b < in.slots[s].size(); ++b, ++rows)
      if (got[s][b] != want[s][b]) {
        if (++mismatched <= 3) ADD_FAILURE() << "step " << s << " slot " << in.slots[s][b] << ": selection differs";
      }
  std::printf("[cuda decode] indexer P=%lld topk=%lld tail=%d: %lld rows (%lld chose by score), %lld mismatched\n",
              static_cast<long long>(P), static_cast<long long>(pc.topk), pc.tail, static_cast<long long>(rows),
              static_cast<long long>(chosen), static_cast<long long>(mismatched));
  EXPECT_GT(chosen, 50);  // the top-k path was exercised
  EXPECT_EQ(mismatched, 0);

  // Batch invariance: the sequence in slot 0 alone.
  cuda_testing::IndexerDecodeSteps alone = in;
  alone.slots.clear(), alone.qi.clear(), alone.ki.clear(), alone.gs.clear(), alone.wts.clear();
  std::vector<std::vector<int32_t>> want0;
  for (int s = 0; s < steps; ++s)
    for (size_t b = 0; b < in.slots[s].size(); ++b)
      if (in.slots[s][b] == 0) {
        alone.slots.push_back({0});
        alone.qi.emplace_back(in.qi[s].begin() + b * IH * ID, in.qi[s].begin() + (b + 1) * IH * ID);
        alone.ki.emplace_back(in.ki[s].begin() + b * ID, in.ki[s].begin() + (b + 1) * ID);
        alone.gs.emplace_back(in.gs[s].begin() + b * ID, in.gs[s].begin() + (b + 1) * ID);
        alone.wts.emplace_back(in.wts[s].begin() + b * IH, in.wts[s].begin() + (b + 1) * IH);
        want0.push_back(got[s][b]);
      }
  const auto one = cuda_testing::indexer_decode_steps(alone);
  for (size_t i = 0; i < want0.size(); ++i) EXPECT_EQ(one[i][0], want0[i]) << "token " << i << " alone";
}

INSTANTIATE_TEST_SUITE_P(Pools, CudaDecodeIndexer,
                         ::testing::Values(IndexerCase{4, 32, true}, IndexerCase{1, 16, true},
                                           IndexerCase{4, 16, false}),
                         [](const auto& info) {
                           return "P" + std::to_string(info.param.P) + "_topk" + std::to_string(info.param.topk) +
                                  (info.param.tail ? "_tail" : "_notail");
                         });

// Decoding against the prefill indexer (the forward's scores and selection, which CudaIndexerPrefill holds to the
// CPU) on long sequences: more pools than one round of the selection kernel's threads (P = 1: 1100 pools; P = 4: 520)
// and more heads than a warp's lanes (IH = 40: a full and a part-filled group of 32), ID not a multiple of 32. Two
// sequences step together, in alternating row order; every selection must equal the forward's bit for bit, near
// ties included, since both score in the same order.
TEST(CudaDecodeIndexerForward, LongSequencesSelectAsThePrefill) {
  struct Case {
    int64_t P, topk;
    bool tail;
    std::vector<int64_t> lens;
  };
  for (const Case& k : {Case{1, 64, true, {1100, 700}}, Case{4, 64, false, {2080, 900}}}) {
    const int64_t IH = 40, ID = 72, P = k.P;
    const std::vector<int64_t> cu{0, k.lens[0], k.lens[0] + k.lens[1]};
    const int64_t T = cu.back();
    cuda_testing::IndexerPrefill in;
    in.IH = IH, in.ID = ID, in.P = P, in.topk = k.topk, in.tail = k.tail, in.cu_seqlens = cu;
    in.qi = test::randn(T * IH * ID, 31), in.ki = test::randn(T * ID, 32), in.gs = test::randn(T * ID, 33, 0.5f);
    in.wts = test::randn(T * IH, 34), in.ape = test::randn(P * ID, 35, 0.5f);
    const std::vector<std::vector<int32_t>> want = cuda_testing::indexer_prefill(in);

    cuda_testing::IndexerDecodeSteps dec;
    dec.IH = IH, dec.ID = ID, dec.P = P, dec.topk = k.topk, dec.num_slots = 2, dec.max_pools = k.lens[0] / P + 1;
    dec.tail = k.tail, dec.ape = in.ape;
    std::vector<std::vector<int64_t>> tokens;  // the packed token of each row of each step
    for (int64_t s = 0; s < k.lens[0]; ++s) {
      std::vector<int32_t> sl{0};
      if (s < k.lens[1]) sl.push_back(1);
      if (s % 2) std::reverse(sl.begin(), sl.end());
      std::vector<int64_t> tk;
      std::vector<float> qi, ki, gs, wts;
      for (int32_t slot : sl) {
        const int64_t t = cu[slot] + s;
        tk.push_back(t);
        qi.insert(qi.end(), in.qi.begin() + t * IH * ID, in.qi.begin() + (t + 1) * IH * ID);
        ki.insert(ki.end(), in.ki.begin() + t * ID, in.ki.begin() + (t + 1) * ID);
        gs.insert(gs.end(), in.gs.begin() + t * ID, in.gs.begin() + (t + 1) * ID);
        wts.insert(wts.end(), in.wts.begin() + t * IH, in.wts.begin() + (t + 1) * IH);
      }
      dec.slots.push_back(sl), dec.qi.push_back(qi), dec.ki.push_back(ki), dec.gs.push_back(gs);
      dec.wts.push_back(wts), tokens.push_back(tk);
    }
    const auto got = cuda_testing::indexer_decode_steps(dec);
    int64_t rows = 0, chosen = 0, mismatched = 0;
    for (size_t s = 0; s < tokens.size(); ++s)
      for (size_t b = 0; b < tokens[s].size(); ++b, ++rows) {
        const int64_t t = tokens[s][b], rel = t - cu[dec.slots[s][b]];
        chosen += (rel + 1) / P > k.topk / P;
        if (got[s][b] != want[t] && ++mismatched <= 3)
          ADD_FAILURE() << "P=" << P << " sequence " << dec.slots[s][b] << " position " << rel << ": selection differs";
      }
    std::printf("[cuda decode] indexer IH=%lld ID=%lld P=%lld vs prefill: %lld rows (%lld chose by score), %lld "
                "mismatched\n",
                static_cast<long long>(IH), static_cast<long long>(ID), static_cast<long long>(P),
                static_cast<long long>(rows), static_cast<long long>(chosen), static_cast<long long>(mismatched));
    EXPECT_GT(chosen, rows / 2);  // the scoring and top-k paths carry most rows
    EXPECT_EQ(mismatched, 0);
  }
}

// ---- MLA ----

// Absorbed attention over cached bf16 latents against the expanded form (k, v = kv_b·c, attention_weights), with
// the same bf16-rounded latents and kv_b: selections of several sizes, and empty ones (uniform over 0 … pos). On
// CUDA cores (KL = 40) and on tensor cores (one head group; two groups, the second part-filled, with splits of
// several 64-key tiles and a uniform row over 1200 keys; the model's KL = 512 with four head groups and twelve rows,
// which take the single-buffered split kernel and the qa and combine kernels that serve 8 rows at once, while each
// row alone takes the double-buffered and one-row ones). Then each row alone must give the same bits.
struct MlaDecodeCase {
  int64_t NH, KL, max_len, max_sel, dqk = 16, dv = 24, B = 4;
};
void PrintTo(const MlaDecodeCase& c, std::ostream* os) {
  *os << "NH=" << c.NH << " KL=" << c.KL << " dqk=" << c.dqk << " dv=" << c.dv << " B=" << c.B;
}
class CudaDecodeMla : public ::testing::TestWithParam<MlaDecodeCase> {};

TEST_P(CudaDecodeMla, AbsorbedMatchesExpandedCpuAndIsBatchInvariant) {
  const MlaDecodeCase c = GetParam();
  const int64_t NH = c.NH, KL = c.KL, max_len = c.max_len, max_sel = c.max_sel, dqk = c.dqk, dv = c.dv, B = c.B;
  const int64_t NS = std::max<int64_t>(B, 4), dkv = dqk + dv;
  std::vector<float> latent = test::randn(NS * max_len * KL, 1), kv_b = test::randn(NH * dkv * KL, 2, 0.3f);
  for (float& x : latent) x = bf16r(x);
  for (float& x : kv_b) x = bf16r(x);
  // Rows 0–3: a short selection, an empty one at position 0, a long one, an empty one over (nearly) the whole cache.
  // Rows past 3, each in its own slot: selections of varied lengths, every third one empty.
  std::vector<int32_t> slots{2, 0, 1, 3};
  std::vector<int32_t> pos{10, 0, static_cast<int32_t>(max_len - 27),
                           static_cast<int32_t>(max_len > 64 ? max_len - 1 : 5)};
  for (int64_t b = 4; b < B; ++b) {
    slots.push_back(static_cast<int32_t>(b));
    pos.push_back(static_cast<int32_t>(max_len - 1 - (b * 53) % (max_len / 2)));
  }
  std::vector<float> q = test::randn(B * NH * dqk, 3), nl = test::randn(B * KL, 4);
  for (float& x : nl) x = bf16r(x);
  std::vector<std::vector<int32_t>> sel(B);
  std::mt19937 gen(5);
  auto choose = [&](int64_t b, int64_t n) {  // n earlier keys at random, and the query's own position (the tail's)
    std::vector<int32_t> all(pos[b] + 1);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end() - 1, gen);
    sel[b].assign(all.begin(), all.begin() + n);
    sel[b].push_back(pos[b]);
    std::sort(sel[b].begin(), sel[b].end());
    sel[b].erase(std::unique(sel[b].begin(), sel[b].end()), sel[b].end());
  };
  choose(0, 5);
  choose(2, max_sel - 1);
  for (int64_t b = 4; b < B; ++b)
    if (b % 3 != 0) choose(b, std::max<int64_t>(1, std::min<int64_t>(max_sel - 1, pos[b]) - (b * 37) % (max_sel / 2)));
  const std::vector<float> got =
      cuda_testing::mla_decode(q, kv_b, latent, nl, slots, pos, sel, NH, dqk, dv, KL, max_len, max_sel);
  std::vector<float> want(B * NH * dv, 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> lat(latent.begin() + slots[b] * max_len * KL, latent.begin() + (slots[b] + 1) * max_len * KL);
    std::copy(nl.begin() + b * KL, nl.begin() + (b + 1) * KL, lat.begin() + pos[b] * KL);
    std::vector<float> kv((pos[b] + 1) * NH * dkv);
    cpu::linear(lat.data(), pos[b] + 1, KL, [&] {
      Tensor t({NH * dkv, KL});
      t.data = kv_b;
      return t;
    }(), kv.data());
    std::vector<int32_t> keys = sel[b];
    const bool uniform = keys.empty();
    if (uniform) {
      keys.resize(pos[b] + 1);
      std::iota(keys.begin(), keys.end(), 0);
    }
    std::vector<float> p;
    for (int64_t h = 0; h < NH; ++h) {
      attention_weights(q.data() + (b * NH + h) * dqk, kv.data(), NH, h, dqk, dkv, 0, keys, uniform,
                        1.0f / std::sqrt(float(dqk)), p);
      for (size_t i = 0; i < keys.size(); ++i)
        for (int64_t e = 0; e < dv; ++e)
          want[(b * NH + h) * dv + e] += p[i] * kv[(keys[i] * NH + h) * dkv + dqk + e];
    }
  }
  for (float x : got) ASSERT_TRUE(std::isfinite(x));
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  const bool tc = cuda_testing::mla_decode_on_tensor_cores(NH, KL);
  std::printf("[cuda decode] MLA absorbed (%s) NH=%lld KL=%lld B=%lld vs expanded: ||do||/||o|| = %.2e\n",
              tc ? "tensor cores" : "fp32", static_cast<long long>(NH), static_cast<long long>(KL),
              static_cast<long long>(B), err);
  // fp32: the bf16 output rounding (~2e-3); tensor cores also round qa and the softmax weights to bf16 pairs.
  EXPECT_LE(err, 1e-2);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> one = cuda_testing::mla_decode(
        std::vector<float>(q.begin() + b * NH * dqk, q.begin() + (b + 1) * NH * dqk), kv_b, latent,
        std::vector<float>(nl.begin() + b * KL, nl.begin() + (b + 1) * KL), {slots[b]}, {pos[b]}, {sel[b]}, NH, dqk,
        dv, KL, max_len, max_sel);
    EXPECT_TRUE(bitwise_equal(one, std::vector<float>(got.begin() + b * NH * dv, got.begin() + (b + 1) * NH * dv)))
        << "row " << b << " differs when computed alone";
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeMla,
                         ::testing::Values(MlaDecodeCase{3, 40, 64, 23}, MlaDecodeCase{3, 64, 64, 23},
                                           MlaDecodeCase{20, 128, 1200, 1100},
                                           MlaDecodeCase{64, 512, 700, 640, 40, 72, 12}),
                         [](const auto& info) {
                           const MlaDecodeCase& c = info.param;
                           return "NH" + std::to_string(c.NH) + "_KL" + std::to_string(c.KL) +
                                  (c.B != 4 ? "_B" + std::to_string(c.B) : std::string());
                         });

// ---- The device decode session (CudaDecoder) on the golden models ----

std::vector<int32_t> golden_tokens(int64_t L, int64_t V, int64_t seed) {
  std::vector<int32_t> s(L);
  for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 37 + seed * 101 + (i * i) % 13) % V);
  return s;
}

// log p(target | ·) from logits [V], in double.
double logprob_of(const std::vector<float>& logits, int32_t target) {
  double mx = -INFINITY, sum = 0;
  for (float x : logits) mx = std::max<double>(mx, x);
  for (float x : logits) sum += std::exp(double(x) - mx);
  return double(logits[target]) - mx - std::log(sum);
}

class CudaDecodeGolden : public ::testing::TestWithParam<std::string> {};


// Mean |Δlogprob| allowed between decoding and the CUDA forward in the default mode (cuBLASLt and the expanded MLA
// attention in the forward; the decoding GEMV and the absorbed attention in the steps; batch-invariant mode is
// bitwise, test (d)). Measured on the H200 (2026-11-29), decode steps / generate-then-score against the forward,
// tensor-core KDA (whose steps recompute the forward's chunks): 6.3e-4 / 2.6e-4 (bf16_stable), 1.8e-3 / 1.4e-3
// (fp32_tail_off), 9.8e-4 / 2.2e-4 (bf16_sharded), 1.1e-2 / 8.9e-3 (tiny-glm5-next, a random model full of
// near-ties); fp32 KDA kernels (forward chunked, steps recurrent): 7.3e-4 / 1.4e-3, 1.7e-3 / 1.5e-3, 1.9e-3 /
// 8.5e-4, 1.7e-2 / 1.1e-2, and 7.8e-3 / 6.1e-3 on fp32_flat_softplus (whose softplus gate has only the fp32
// kernels). Differences come from the GEMMs' summation orders and the two attention forms, amplified where a
// rounding flips an MoE routing or an indexer choice.
double decode_bound(const std::string& golden) {
  const bool tie_free = golden == "bf16_stable" || golden == "fp32_tail_off";
  return tie_free ? 4e-3 : 5e-2;
}

// Prefills the first prompt_len[n] tokens of each seqs[n] into slots[n], then steps every sequence that has a next
// token to predict, all of them together, to its end; record(n, t, logits) gets the logits after x[..t] of every
// position from the prompt's last on. Stops early after a fatal failure in record.
void decode_sequences(CudaDecoder& dec, const std::vector<std::vector<int32_t>>& seqs,
                      const std::vector<int64_t>& prompt_len, const std::vector<int64_t>& slots,
                      const std::function<void(size_t, int64_t, const std::vector<float>&)>& record) {
  std::vector<std::vector<int32_t>> prompts;
  for (size_t n = 0; n < seqs.size(); ++n) prompts.emplace_back(seqs[n].begin(), seqs[n].begin() + prompt_len[n]);
  const std::vector<std::vector<float>> first = dec.prefill(slots, prompts);
  for (size_t n = 0; n < seqs.size(); ++n) record(n, prompt_len[n] - 1, first[n]);
  for (int64_t t = 0;; ++t) {
    std::vector<int64_t> sl;
    std::vector<int32_t> tok;
    std::vector<size_t> which;
    for (size_t n = 0; n < seqs.size(); ++n) {
      const int64_t pos = prompt_len[n] + t;  // the token fed now
      if (pos + 1 < static_cast<int64_t>(seqs[n].size()))
        sl.push_back(slots[n]), tok.push_back(seqs[n][pos]), which.push_back(n);
    }
    if (sl.empty() || ::testing::Test::HasFatalFailure()) return;
    const std::vector<std::vector<float>> out = dec.step(sl, tok);
    for (size_t i = 0; i < which.size(); ++i) record(which[i], prompt_len[which[i]] + t, out[i]);
  }
}

// (a) Prefill, then one token at a time, three sequences stepping together (prompts of 1, 7 and 66 tokens, decoded
// to 150 or 140 tokens: across KDA chunks of 64, pool boundaries and past index_topk), each step's log-prob of the
// next token against the CUDA full forward of the whole sequence (next_token_logprobs, same bf16 weights, empty
// selections on the keys seen so far as decoding does). With the tensor-core KDA the steps recompute the forward's
// chunks; with the fp32 kernels they run the recurrence against the forward's chunked form. The rest of the
// difference is the GEMMs' summation orders (cuBLASLt against the decoding GEMV), amplified when a bf16 rounding
// flips an MoE routing or an indexer choice: see decode_bound, which a broken decoder (O(1) differences) fails.
TEST_P(CudaDecodeGolden, StepsMatchFullForward) {
  const Model cpu = Model::load(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  gpu.set_empty_selection(EmptySelection::SeenKeys);
  const std::vector<int64_t> prompt_len{1, 7, 66}, full_len{150, 140, 150};
  std::vector<std::vector<int32_t>> seqs;
  PackedBatch whole;
  for (size_t n = 0; n < prompt_len.size(); ++n) {
    seqs.push_back(golden_tokens(full_len[n], c.vocab_size, static_cast<int64_t>(n)));
    whole.add(seqs.back());
  }
  // With the tensor-core KDA (where the config has it: the safe gate) and with the fp32 KDA kernels, in the forward
  // and the prefill alike (the steps follow: chunk recomputation on the tensor-core path, the recurrence otherwise).
  for (bool tc : {true, false}) {
    gpu.set_kda_tensor_cores(tc);
    const std::vector<std::vector<double>> ref = gpu.next_token_logprobs(whole);
    CudaDecoder dec(gpu, 4, 160);
    const std::vector<int64_t> slots{3, 0, 2};  // slot 1 stays empty
    double sum = 0, worst = 0;
    int64_t count = 0;
    auto record = [&](size_t n, int64_t t, const std::vector<float>& logits) {  // logits after x[..t]
      ASSERT_EQ(static_cast<int64_t>(logits.size()), c.vocab_size);
      for (float x : logits) ASSERT_TRUE(std::isfinite(x)) << "sequence " << n << " position " << t;
      const double d = std::fabs(logprob_of(logits, seqs[n][t + 1]) - ref[n][t]);
      sum += d, worst = std::max(worst, d), ++count;
    };
    decode_sequences(dec, seqs, prompt_len, slots, record);
    if (HasFatalFailure()) return;
    for (size_t n = 0; n < seqs.size(); ++n) EXPECT_EQ(dec.length(slots[n]), full_len[n] - 1);
    EXPECT_EQ(dec.length(1), 0);
    const double mean = sum / count;
    std::printf("[cuda decode] %s (%s KDA in the forward): %lld decoded positions, mean |dlogprob| vs the CUDA "
                "forward = %.3g (max %.3g)\n",
                GetParam().c_str(), tc ? "tensor-core" : "fp32", static_cast<long long>(count), mean, worst);
    EXPECT_LE(mean, decode_bound(GetParam())) << (tc ? "tensor-core" : "fp32") << " KDA";
  }
  gpu.set_kda_tensor_cores(true);
}

// (b) Batch invariance: a sequence decoded alone and in batches of changing make-up, in another slot, gives bitwise
// identical logits at every step. Each prompt is prefilled by itself in both runs (a prefill's GEMMs are cuBLASLt's,
// whose algorithm may depend on the batch; decoding steps never are).
TEST_P(CudaDecodeGolden, StepsAreBatchInvariant) {
  const Model cpu = Model::load(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  const std::vector<int32_t> a = golden_tokens(120, c.vocab_size, 5), b = golden_tokens(90, c.vocab_size, 6),
                             d = golden_tokens(100, c.vocab_size, 7);
  const int64_t prompt = 9, steps = 100;
  std::vector<std::vector<float>> alone;
  {
    CudaDecoder dec(gpu, 1, 128);
    alone.push_back(dec.prefill({0}, {std::vector<int32_t>(a.begin(), a.begin() + prompt)})[0]);
    for (int64_t t = 0; t < steps; ++t) alone.push_back(dec.step({0}, {a[prompt + t]})[0]);
  }
  CudaDecoder dec(gpu, 4, 128);
  dec.prefill({1}, {std::vector<int32_t>(b.begin(), b.begin() + 30)});
  std::vector<std::vector<float>> together{dec.prefill({3}, {std::vector<int32_t>(a.begin(), a.begin() + prompt)})[0]};
  dec.prefill({0}, {std::vector<int32_t>(d.begin(), d.begin() + 4)});
  int64_t pb = 30, pd = 4;
  for (int64_t t = 0; t < steps; ++t) {
    // The companions come and go: both, one, none, in varying order around sequence a.
    std::vector<int64_t> sl;
    std::vector<int32_t> tok;
    size_t mine = 0;
    if (t % 3 != 2 && pb < static_cast<int64_t>(b.size()) - 1) sl.push_back(1), tok.push_back(b[pb++]);
    mine = sl.size();
    sl.push_back(3), tok.push_back(a[prompt + t]);
    if (t % 4 != 0 && pd < static_cast<int64_t>(d.size()) - 1) sl.push_back(0), tok.push_back(d[pd++]);
    if (t % 5 == 1) {
      std::reverse(sl.begin(), sl.end());
      std::reverse(tok.begin(), tok.end());
      mine = sl.size() - 1 - mine;
    }
    together.push_back(dec.step(sl, tok)[mine]);
  }
  const int64_t differing = differing_steps(alone, together);
  std::printf("[cuda decode] %s: %lld of %zu steps differ bitwise between alone and batched\n", GetParam().c_str(),
              static_cast<long long>(differing), alone.size());
  EXPECT_EQ(differing, 0);
}

// (b2) Steps replayed from CUDA graphs (the default) equal plain steps bit for bit, for two batch sizes, in the
// default and the batch-invariant mode, across a KDA chunk boundary and past index_topk.
TEST_P(CudaDecodeGolden, GraphStepsEqualPlainSteps) {
  const Model cpu = Model::load(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  const std::vector<int32_t> a = golden_tokens(140, c.vocab_size, 11), b = golden_tokens(140, c.vocab_size, 12);
  for (bool invariant : {false, true}) {
    gpu.set_batch_invariant(invariant);
    std::vector<std::vector<float>> out[2];
    for (int graphs = 0; graphs < 2; ++graphs) {
      CudaDecoder dec(gpu, 2, 140);
      dec.set_graphs(graphs == 1);
      dec.prefill({0}, {std::vector<int32_t>(a.begin(), a.begin() + 50)});
      dec.prefill({1}, {std::vector<int32_t>(b.begin(), b.begin() + 3)});
      for (int64_t t = 0; t < 80; ++t) {
        // Both slots, then slot 0 alone every third step: two graphs, each replayed.
        if (t % 3 == 2) {
          out[graphs].push_back(dec.step({0}, {a[50 + t]})[0]);
        } else {
          for (auto& l : dec.step({1, 0}, {b[3 + t], a[50 + t]})) out[graphs].push_back(l);
        }
      }
    }
    ASSERT_EQ(out[0].size(), out[1].size());
    const int64_t differing = differing_steps(out[0], out[1]);
    std::printf("[cuda decode] %s%s: %lld of %zu step outputs differ between graph replays and plain steps\n",
                GetParam().c_str(), invariant ? " (batch-invariant)" : "", static_cast<long long>(differing),
                out[0].size());
    EXPECT_EQ(differing, 0);
  }
}

// (b3) Steps whose independent kernel chains run side by side on a second stream (set_decode_overlap, the default)
// equal steps with every kernel in line, bit for bit, replayed from graphs or plain, for two batch sizes: the
// branches must not race (the shared expert writes y while the routed experts run; the appends, the absorption and
// the indexer's selection meet before the attention).
TEST_P(CudaDecodeGolden, OverlappedStepsEqualInLineSteps) {
  const Model cpu = Model::load(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  const std::vector<int32_t> a = golden_tokens(140, c.vocab_size, 13), b = golden_tokens(140, c.vocab_size, 14);
  std::vector<std::vector<float>> out[4];  // [2·overlap + graphs]
  for (int run = 0; run < 4; ++run) {
    gpu.set_decode_overlap(run >= 2);
    CudaDecoder dec(gpu, 2, 140);
    dec.set_graphs(run % 2 == 1);
    dec.prefill({0}, {std::vector<int32_t>(a.begin(), a.begin() + 40)});
    dec.prefill({1}, {std::vector<int32_t>(b.begin(), b.begin() + 5)});
    for (int64_t t = 0; t < 90; ++t) {
      if (t % 4 == 3) {
        out[run].push_back(dec.step({1}, {b[5 + t]})[0]);
      } else {
        for (auto& l : dec.step({0, 1}, {a[40 + t], b[5 + t]})) out[run].push_back(l);
      }
    }
  }
  gpu.set_decode_overlap(true);
  for (int run = 1; run < 4; ++run) {
    ASSERT_EQ(out[run].size(), out[0].size());
    const int64_t differing = differing_steps(out[0], out[run]);
    std::printf("[cuda decode] %s: %lld of %zu step outputs differ from in-line plain steps (%s, %s)\n",
                GetParam().c_str(), static_cast<long long>(differing), out[0].size(),
                run >= 2 ? "overlapped" : "in line", run % 2 ? "graphs" : "plain");
    EXPECT_EQ(differing, 0) << "run " << run;
  }
}

// (c) Train–inference agreement (issue 5, item 4): the log-probs cuda_generate reports while sampling against the
// CUDA forward's score of the finished sequence (next_token_logprobs, as `nextlm score --device cuda` computes it;
// with SeenKeys, which only the tail-off case tells apart).
TEST_P(CudaDecodeGolden, GenerateLogprobsMatchScore) {
  const Model cpu = Model::load(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  gpu.set_empty_selection(EmptySelection::SeenKeys);
  for (bool tc : {true, false}) {
    gpu.set_kda_tensor_cores(tc);
    double sum = 0;
    int64_t count = 0;
    for (uint64_t seed : {1, 2, 3}) {
      const std::vector<int32_t> prompt = golden_tokens(5 + 20 * seed, c.vocab_size, 20 + seed);
      GenerateOptions opt;
      opt.max_new_tokens = 100;
      opt.sampling.temperature = 1.0;
      opt.sampling.seed = seed;
      const Generation g = cuda_generate(gpu, prompt, opt);
      ASSERT_EQ(g.tokens.size(), g.logprobs.size());
      std::vector<int32_t> whole = prompt;
      whole.insert(whole.end(), g.tokens.begin(), g.tokens.end());
      PackedBatch b;
      b.add(whole);
      const std::vector<double> score = gpu.next_token_logprobs(b)[0];
      for (size_t i = 0; i < g.tokens.size(); ++i) {
        ASSERT_TRUE(std::isfinite(g.logprobs[i]));
        sum += std::fabs(g.logprobs[i] - score[prompt.size() - 1 + i]), ++count;
      }
    }
    const double mean = sum / count;
    std::printf("[cuda decode] %s (%s KDA in the forward): generate vs score over %lld sampled tokens: mean "
                "|dlogprob| = %.3g\n",
                GetParam().c_str(), tc ? "tensor-core" : "fp32", static_cast<long long>(count), mean);
    EXPECT_LE(mean, decode_bound(GetParam()));
  }
  gpu.set_kda_tensor_cores(true);
}

// (d) Batch-invariant mode (`--batch-invariant`): decoding runs the forward's arithmetic (its GEMM for every
// projection, the tensor-core KDA recomputing each slot's partial chunk, the forward running the decoding MLA
// kernels), so every decoded position's logits equal the full forward's bit for bit, and the log-probs reported
// while generating equal the score of the finished sequence: issue 5's train–inference agreement at 0. Bitwise
// where the config has the tensor-core KDA (the safe gate, as GLM-5.3); the softplus gate's fp32 kernels decode by
// the recurrence, held to the bound of (a).
TEST_P(CudaDecodeGolden, BatchInvariantStepsEqualForwardBitwise) {
  const Model cpu = Model::load(test::golden_dir(GetParam()));
  const ModelConfig& c = cpu.config();
  CudaModel gpu(cpu);
  gpu.set_empty_selection(EmptySelection::SeenKeys);
  gpu.set_batch_invariant(true);
  const bool tc = gpu.kda_on_tensor_cores();
  const std::vector<int64_t> prompt_len{1, 70, 7}, full_len{150, 140, 131};
  std::vector<std::vector<int32_t>> seqs;
  PackedBatch whole;
  for (size_t n = 0; n < prompt_len.size(); ++n) {
    seqs.push_back(golden_tokens(full_len[n], c.vocab_size, static_cast<int64_t>(n) + 40));
    whole.add(seqs.back());
  }
  const Tensor ref = gpu.forward(whole);
  const int64_t V = c.vocab_size;
  CudaDecoder dec(gpu, 3, 160);
  int64_t positions = 0, differing = 0;
  double sum = 0;
  auto record = [&](size_t n, int64_t t, const std::vector<float>& logits) {  // logits after x[..t]
    const float* want = ref.ptr() + (whole.cu_seqlens[n] + t) * V;
    differing += std::memcmp(logits.data(), want, V * sizeof(float)) != 0;
    sum += std::fabs(logprob_of(logits, seqs[n][t + 1]) -
                     logprob_of(std::vector<float>(want, want + V), seqs[n][t + 1]));
    ++positions;
  };
  decode_sequences(dec, seqs, prompt_len, {2, 0, 1}, record);
  std::printf("[cuda decode] %s batch-invariant (%s KDA): %lld of %lld decoded positions differ bitwise from the "
              "forward; mean |dlogprob| = %.3g\n",
              GetParam().c_str(), tc ? "tensor-core" : "fp32", static_cast<long long>(differing),
              static_cast<long long>(positions), sum / positions);
  if (tc) {
    EXPECT_EQ(differing, 0);
  } else {
    EXPECT_LE(sum / positions, decode_bound(GetParam()));
  }

  // Generate, then score the finished sequence.
  double gsum = 0;
  int64_t count = 0;
  for (uint64_t seed : {1, 2}) {
    const std::vector<int32_t> prompt = golden_tokens(5 + 60 * seed, c.vocab_size, 30 + seed);
    GenerateOptions opt;
    opt.max_new_tokens = 90;
    opt.sampling.temperature = 1.0;
    opt.sampling.seed = seed;
    const Generation g = cuda_generate(gpu, prompt, opt);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), g.tokens.begin(), g.tokens.end());
    PackedBatch b;
    b.add(golden_tokens(33, c.vocab_size, 9));  // another sequence in the scored batch
    b.add(all);
    const std::vector<double> score = gpu.next_token_logprobs(b)[1];
    for (size_t i = 0; i < g.tokens.size(); ++i) gsum += std::fabs(g.logprobs[i] - score[prompt.size() - 1 + i]), ++count;
  }
  std::printf("[cuda decode] %s batch-invariant: generate vs score over %lld sampled tokens: mean |dlogprob| = "
              "%.3g\n",
              GetParam().c_str(), static_cast<long long>(count), gsum / count);
  EXPECT_LE(gsum / count, tc ? 1e-6 : decode_bound(GetParam()));
}

// (e) The bitwise agreement of (d) at GLM-5.3's head size (128; the goldens have 16), on random weights, with the
// new tokens' conv, β's sigmoid and the gated output norm inside the KDA step: a compile-time 1/√K (folded correctly
// rounded) once differed there from the forward's run-time rsqrtf by an ulp, which 16 (a power of 4) cannot show.
// Prompts end on a chunk boundary and mid-chunk; the steps cross a chunk boundary.
TEST(CudaDecodeWide, BatchInvariantStepsEqualForwardBitwiseAtHeadSize128) {
  ModelConfig c = load_config(test::golden_dir("bf16_stable") + "/config.json");
  c.linear_head_dim = 128;
  c.linear_num_heads = 2;
  auto gpu = CudaModel::random(c, 7);
  gpu->set_empty_selection(EmptySelection::SeenKeys);
  gpu->set_batch_invariant(true);
  ASSERT_TRUE(gpu->kda_on_tensor_cores());
  const std::vector<int64_t> prompt_len{64, 70}, full_len{140, 100};
  std::vector<std::vector<int32_t>> seqs;
  PackedBatch whole;
  for (size_t n = 0; n < prompt_len.size(); ++n) {
    seqs.push_back(golden_tokens(full_len[n], c.vocab_size, static_cast<int64_t>(n) + 60));
    whole.add(seqs.back());
  }
  const Tensor ref = gpu->forward(whole);
  const int64_t V = c.vocab_size;
  CudaDecoder dec(*gpu, 2, 160);
  int64_t positions = 0, differing = 0;
  auto record = [&](size_t n, int64_t t, const std::vector<float>& logits) {  // logits after x[..t]
    ASSERT_EQ(static_cast<int64_t>(logits.size()), V);
    differing += std::memcmp(logits.data(), ref.ptr() + (whole.cu_seqlens[n] + t) * V, V * sizeof(float)) != 0;
    ++positions;
  };
  decode_sequences(dec, seqs, prompt_len, {1, 0}, record);
  std::printf("[cuda decode] head size 128, batch-invariant: %lld of %lld decoded positions differ bitwise from the "
              "forward\n",
              static_cast<long long>(differing), static_cast<long long>(positions));
  EXPECT_EQ(differing, 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDecodeGolden, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

}  // namespace
}  // namespace nextlm
