// The grouped expert GEMM (src/cuda/grouped_gemm.cu) against a host fp32 reference: nn.Linear per expert on the
// same bf16-rounded inputs, then moe.cu's clamped SwiGLU. Every kernel variant, every epilogue, uneven experts (empty
// ones, one row, one larger than several tiles), and n, N, K, I none a multiple of the tile. Outputs are poisoned with
// NaN and followed by a sentinel guard, so an unwritten element or a write past the end fails. The w_kn form (W_e
// given as [K, N], C = A·W_e: the backward's input gradients) is checked on the same reference with each W_e uploaded
// transposed. Runs on a GPU machine (part of test_cuda, CTest label "gpu").
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/grouped_gemm.h"
#include "cuda_test_buffer.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace nextlm {
namespace {

using cuda::GroupedEpilogue;
using cuda::GroupedGemmKernel;
using cuda::GroupedWeightLayout;

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
  return b;
}
std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_to_f32(b[i]);
  return x;
}

using test::DevBuf;

// A routed problem: experts' row counts, A [n, K] and W_e [N, K] (bf16-rounded values), on host and device.
struct Problem {
  std::vector<int32_t> offsets;  // [E+1]
  int64_t n = 0;
  int E = 0, N = 0, K = 0;
  std::vector<float> A, W;  // A [n, K]; W [E, N, K]
};

Problem make_problem(const std::vector<int>& rows, int N, int K, float w_scale, unsigned seed) {
  Problem p;
  p.E = static_cast<int>(rows.size());
  p.N = N;
  p.K = K;
  p.offsets.push_back(0);
  for (int r : rows) p.offsets.push_back(p.offsets.back() + r);
  p.n = p.offsets.back();
  p.A = widen(to_bf16(test::randn(p.n * K, seed)));
  p.W = widen(to_bf16(test::randn(int64_t(p.E) * N * K, seed + 1, w_scale / std::sqrt(float(K)))));
  return p;
}

// C [n, N] = A · W_eᵀ per expert, in double.
std::vector<float> reference(const Problem& p) {
  std::vector<float> C(p.n * p.N);
  for (int e = 0; e < p.E; ++e)
    for (int64_t r = p.offsets[e]; r < p.offsets[e + 1]; ++r)
      for (int o = 0; o < p.N; ++o) {
        const float* a = &p.A[r * p.K];
        const float* w = &p.W[(int64_t(e) * p.N + o) * p.K];
        double s = 0;
        for (int k = 0; k < p.K; ++k) s += double(a[k]) * w[k];
        C[r * p.N + o] = static_cast<float>(s);
      }
  return C;
}

// moe.cu's swiglu on C [n, 2I] → act [n, I].
std::vector<float> swiglu_reference(const std::vector<float>& gu, int64_t n, int I, float L) {
  std::vector<float> act(n * I);
  for (int64_t r = 0; r < n; ++r)
    for (int c = 0; c < I; ++c) {
      const float g = std::fmin(gu[r * 2 * I + c], L);
      const float u = std::fmin(std::fmax(gu[r * 2 * I + I + c], -L), L);
      act[r * I + c] = g / (1.0f + std::exp(-g)) * u;
    }
  return act;
}

// W [E, N, K] → [E, K, N]: each expert's weight as the w_kn form takes it (C = A·W_e with W_e [K, N]).
std::vector<float> transpose_experts(const std::vector<float>& W, int E, int N, int K) {
  std::vector<float> t(W.size());
  for (int e = 0; e < E; ++e)
    for (int o = 0; o < N; ++o)
      for (int k = 0; k < K; ++k) t[(int64_t(e) * K + k) * N + o] = W[(int64_t(e) * N + o) * K + k];
  return t;
}

constexpr size_t kGuardBytes = 4096;

// A low-rank term (GroupedGemm::low_rank) on the host: part p has rank r[p], U_p [n, r_p] and per expert V_p,e,
// [width_p, r_p] added to columns c0_p … c0_p + width_p (or, with w_kn, [r_p, N] added to every column); values
// bf16-rounded.
struct LowRankHost {
  int parts = 0;
  int r[2] = {}, c0[2] = {}, width[2] = {};
  std::vector<float> U[2], V[2];
};

LowRankHost make_low_rank(const Problem& p, std::vector<int> ranks, std::vector<int> c0, std::vector<int> width,
                          bool w_kn, unsigned seed) {
  LowRankHost lr;
  lr.parts = static_cast<int>(ranks.size());
  for (int q = 0; q < lr.parts; ++q) {
    lr.r[q] = ranks[q];
    lr.c0[q] = w_kn ? 0 : c0[q];
    lr.width[q] = w_kn ? p.N : width[q];
    lr.U[q] = widen(to_bf16(test::randn(p.n * ranks[q], seed + 2 * q)));
    lr.V[q] = widen(to_bf16(test::randn(int64_t(p.E) * lr.width[q] * ranks[q], seed + 2 * q + 1)));
  }
  return lr;
}

// C += the low-rank term, in double per element.
void add_low_rank(std::vector<float>& C, const Problem& p, const LowRankHost& lr, bool w_kn) {
  for (int q = 0; q < lr.parts; ++q) {
    const int r = lr.r[q];
    for (int e = 0; e < p.E; ++e)
      for (int64_t row = p.offsets[e]; row < p.offsets[e + 1]; ++row)
        for (int o = 0; o < lr.width[q]; ++o) {
          double s = 0;
          for (int j = 0; j < r; ++j) {
            const float v =
                w_kn ? lr.V[q][(int64_t(e) * r + j) * p.N + o] : lr.V[q][(int64_t(e) * lr.width[q] + o) * r + j];
            s += double(lr.U[q][row * r + j]) * v;
          }
          C[row * p.N + lr.c0[q] + o] += static_cast<float>(s);
        }
  }
}

// How run_gpu calls grouped_gemm beyond the problem and the epilogue.
struct RunOptions {
  bool w_kn = false;                         // upload each W_e transposed ([K, N]) and set GroupedGemm::w_kn
  const std::vector<float>* base = nullptr;  // C before the call (fp32 [n, N], for kF32Add); else poisoned
  const LowRankHost* low_rank = nullptr;     // uploaded and set as GroupedGemm::low_rank
  std::vector<float>* pre = nullptr;         // kSwiGLU: GroupedGemm::pre's output, fp32 [n, N]
  std::vector<float>* pre16 = nullptr;       // kSwiGLU: GroupedGemm::pre16's output, bf16 [n, N] widened
  bool w_all = true;                         // set GroupedGemm::W_all (the experts are back to back either way)
  GroupedWeightLayout layout = GroupedWeightLayout::kRows;  // W_all's (block_expert_weights), GroupedGemm::w_layout
};

// Runs grouped_gemm on p and returns the output widened to fp32 (n × out_cols). Fails the test on a CUDA error, on
// a non-finite element (unwritten: poisoned with 0xFF bytes, a NaN in fp32 and bf16) or a changed guard byte.
std::vector<float> run_gpu(const Problem& p, GroupedEpilogue epi, GroupedGemmKernel kernel, float limit,
                           const RunOptions& opt = {}) {
  const int out_cols = epi == GroupedEpilogue::kSwiGLU ? p.N / 2 : p.N;
  const size_t elem = epi == GroupedEpilogue::kF32 || epi == GroupedEpilogue::kF32Add ? 4 : 2;
  const size_t out_bytes = size_t(p.n) * out_cols * elem;
  const std::vector<uint16_t> A16 = to_bf16(p.A);
  const std::vector<uint16_t> W16 = to_bf16(opt.w_kn ? transpose_experts(p.W, p.E, p.N, p.K) : p.W);
  DevBuf dA(A16.size() * 2), dW(W16.size() * 2), dOff(p.offsets.size() * 4), dPtr(p.E * sizeof(void*)),
      dC(out_bytes + kGuardBytes), dWs(cuda::grouped_gemm_workspace_ints(p.E) * 4);
  std::vector<float> none;
  EXPECT_TRUE(dA.p && dW.p && dOff.p && dPtr.p && dC.p && dWs.p);
  if (!dA.p || !dW.p || !dOff.p || !dPtr.p || !dC.p || !dWs.p) return none;
  std::vector<const cuda::bf16*> ptrs(p.E);
  for (int e = 0; e < p.E; ++e) ptrs[e] = dW.as<cuda::bf16>() + int64_t(e) * p.N * p.K;
  EXPECT_TRUE(!opt.base || (elem == 4 && opt.base->size() == size_t(p.n) * out_cols));
  if (opt.base && (elem != 4 || opt.base->size() != size_t(p.n) * out_cols)) return none;
  if (!A16.empty()) {
    EXPECT_EQ(cudaMemcpy(dA.p, A16.data(), A16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  EXPECT_EQ(cudaMemcpy(dW.p, W16.data(), W16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dOff.p, p.offsets.data(), p.offsets.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dPtr.p, ptrs.data(), p.E * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(dC.p, 0xFF, out_bytes + kGuardBytes), cudaSuccess);
  if (opt.base && out_bytes) {
    EXPECT_EQ(cudaMemcpy(dC.p, opt.base->data(), out_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  EXPECT_EQ(cudaMemset(dWs.p, 0xFF, cuda::grouped_gemm_workspace_ints(p.E) * 4), cudaSuccess);

  cuda::GroupedGemm g{dA.as<cuda::bf16>(),
                      dOff.as<int32_t>(),
                      dPtr.as<const cuda::bf16*>(),
                      dC.p,
                      p.n,
                      p.E,
                      p.N,
                      p.K,
                      epi,
                      limit,
                      kernel};
  g.w_kn = opt.w_kn;
  if (opt.w_all) g.W_all = dW.as<cuda::bf16>();  // the experts back to back (the TMA kernel's tensor map)
  DevBuf dWb(opt.layout != GroupedWeightLayout::kRows ? W16.size() * 2 : 0);
  if (opt.layout != GroupedWeightLayout::kRows) {
    // The natural matrices are [N, K], or [K, N] with w_kn.
    cuda::block_expert_weights(dW.as<cuda::bf16>(), dWb.as<cuda::bf16>(), p.E, opt.w_kn ? p.K : p.N,
                               opt.w_kn ? p.N : p.K, opt.layout, nullptr);
    g.W_all = dWb.as<cuda::bf16>(), g.w_layout = opt.layout;
  }
  std::deque<DevBuf> lr_bufs;  // per part: U, V, V's expert pointers
  if (const LowRankHost* lr = opt.low_rank) {
    g.low_rank.parts = lr->parts;
    for (int q = 0; q < lr->parts; ++q) {
      const std::vector<uint16_t> U16 = to_bf16(lr->U[q]), V16 = to_bf16(lr->V[q]);
      DevBuf& dU = lr_bufs.emplace_back(U16.size() * 2);
      DevBuf& dV = lr_bufs.emplace_back(V16.size() * 2);
      DevBuf& dVp = lr_bufs.emplace_back(p.E * sizeof(void*));
      const int64_t per = int64_t(lr->width[q]) * lr->r[q];
      std::vector<const cuda::bf16*> vp(p.E);
      for (int e = 0; e < p.E; ++e) vp[e] = dV.as<cuda::bf16>() + e * per;
      EXPECT_EQ(cudaMemcpy(dU.p, U16.data(), U16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(dV.p, V16.data(), V16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(dVp.p, vp.data(), p.E * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
      g.low_rank.U[q] = dU.as<cuda::bf16>();
      g.low_rank.ldu[q] = g.low_rank.r[q] = lr->r[q];
      g.low_rank.V[q] = dVp.as<const cuda::bf16*>();
      g.low_rank.c0[q] = lr->c0[q];
      g.low_rank.width[q] = lr->width[q];
    }
  }
  DevBuf dPre(opt.pre ? size_t(p.n) * p.N * 4 : 0);
  if (opt.pre) {
    EXPECT_EQ(cudaMemset(dPre.p, 0xFF, size_t(p.n) * p.N * 4), cudaSuccess);
    g.pre = dPre.as<float>();
  }
  DevBuf dPre16(opt.pre16 ? size_t(p.n) * p.N * 2 : 0);
  if (opt.pre16) {
    EXPECT_EQ(cudaMemset(dPre16.p, 0xFF, size_t(p.n) * p.N * 2), cudaSuccess);
    g.pre16 = dPre16.as<cuda::bf16>();
  }
  cuda::grouped_gemm(g, dWs.as<int32_t>(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (opt.pre) {
    opt.pre->resize(size_t(p.n) * p.N);
    EXPECT_EQ(cudaMemcpy(opt.pre->data(), dPre.p, opt.pre->size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  if (opt.pre16) {
    std::vector<uint16_t> b(size_t(p.n) * p.N);
    EXPECT_EQ(cudaMemcpy(b.data(), dPre16.p, b.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    *opt.pre16 = widen(b);
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  std::vector<unsigned char> raw(out_bytes + kGuardBytes);
  EXPECT_EQ(cudaMemcpy(raw.data(), dC.p, raw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  size_t guard_bad = 0;
  for (size_t i = out_bytes; i < raw.size(); ++i) guard_bad += raw[i] != 0xFF;
  EXPECT_EQ(guard_bad, 0u) << "bytes written past the output's end";
  std::vector<float> out(size_t(p.n) * out_cols);
  if (elem == 4) {
    std::memcpy(out.data(), raw.data(), out_bytes);
  } else {
    std::vector<uint16_t> b(out.size());
    std::memcpy(b.data(), raw.data(), out_bytes);
    out = widen(b);
  }
  size_t bad = 0;
  for (float x : out) bad += !std::isfinite(x);
  EXPECT_EQ(bad, 0u) << "non-finite (unwritten) output elements";
  return out;
}

class CudaGroupedGemm : public ::testing::TestWithParam<int> {
 protected:
  GroupedGemmKernel kernel() const { return static_cast<GroupedGemmKernel>(GetParam()); }
};

// Experts: empty ones (first, middle, last), one row, one row short of / exactly / one past a tile, and one over five
// tiles; n = 1577. K = 264 is not a multiple of any BK; N = 200 not a multiple of any BN.
const std::vector<int> kRows{0, 1, 300, 0, 17, 129, 128, 0, 64, 255, 3, 681, 0};

// fp32 epilogue: both sides accumulate in fp32 (GPU) / double (host) on identical bf16 inputs, so only the
// summation order differs: ~1e-6 relative.
TEST_P(CudaGroupedGemm, F32EpilogueMatchesHostReference) {
  const Problem p = make_problem(kRows, 200, 264, 1.0f, 1);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f);
  ASSERT_EQ(got.size(), size_t(p.n) * p.N);
  const std::vector<float> want = reference(p);
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] fp32: norm rel err %.3g, max rel err %.3g\n", cuda::grouped_gemm_kernel_name(kernel()),
              err, test::max_rel_error(got.data(), want.data(), want.size()));
  EXPECT_LE(err, 1e-4);
  EXPECT_LE(test::max_rel_error(got.data(), want.data(), want.size()), 1e-3);
}

// bf16 epilogue: the store rounds to 8 mantissa bits (≤ 2^-9 relative per element): ~2e-3 in norm.
TEST_P(CudaGroupedGemm, Bf16EpilogueMatchesHostReference) {
  const Problem p = make_problem(kRows, 136, 72, 1.0f, 5);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kBf16, kernel(), 0.0f);
  ASSERT_EQ(got.size(), size_t(p.n) * p.N);
  const std::vector<float> want = reference(p);
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] bf16: norm rel err %.3g\n", cuda::grouped_gemm_kernel_name(kernel()), err);
  EXPECT_LE(err, 1e-2);
}

// SwiGLU epilogue: W = [gate; up] with I = 200 (not a multiple of any tile's 64 or 128 act columns). The weights are
// scaled so that gate and up have std ≈ 8 against L = 7: a large share of both clamps is exercised. The act is
// bf16, so the bound is bf16 rounding (~2e-3 in norm) with margin.
TEST_P(CudaGroupedGemm, SwiGluEpilogueMatchesHostReference) {
  const int I = 200;
  const float L = 7.0f;
  const Problem p = make_problem(kRows, 2 * I, 264, 8.0f, 9);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kSwiGLU, kernel(), L);
  ASSERT_EQ(got.size(), size_t(p.n) * I);
  const std::vector<float> gu = reference(p);
  const std::vector<float> want = swiglu_reference(gu, p.n, I, L);
  size_t clamped_g = 0, clamped_u = 0;
  for (int64_t r = 0; r < p.n; ++r)
    for (int c = 0; c < I; ++c) {
      clamped_g += gu[r * 2 * I + c] > L;
      clamped_u += std::fabs(gu[r * 2 * I + I + c]) > L;
    }
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] swiglu: norm rel err %.3g (gate clamped %.1f%%, up clamped %.1f%%)\n",
              cuda::grouped_gemm_kernel_name(kernel()), err, 100.0 * clamped_g / want.size(),
              100.0 * clamped_u / want.size());
  EXPECT_GT(clamped_g, want.size() / 10);  // the test exercises the clamps
  EXPECT_GT(clamped_u, want.size() / 10);
  EXPECT_LE(err, 1e-2);
}

// MoE-like routing at a small width: 4096 rows over 288 experts drawn at random (some experts get none), the exact
// shapes' divisibility (K, N multiples of 128), both projections chained as the model runs them.
TEST_P(CudaGroupedGemm, RandomRoutingGateUpThenDown) {
  const int E = 288, D = 256, I = 128;
  std::mt19937 rng(7);
  std::vector<int> rows(E, 0);
  std::uniform_int_distribution<int> pick(0, E / 2);  // half the experts at most: many get nothing
  for (int i = 0; i < 4096; ++i) ++rows[pick(rng) * 2 % E];
  int empty = 0;
  for (int r : rows) empty += r == 0;
  ASSERT_GT(empty, 100);
  const Problem up = make_problem(rows, 2 * I, D, 1.0f, 21);
  const std::vector<float> act = run_gpu(up, GroupedEpilogue::kSwiGLU, kernel(), 10.0f);
  ASSERT_EQ(act.size(), size_t(up.n) * I);
  const std::vector<float> act_want = swiglu_reference(reference(up), up.n, I, 10.0f);
  const double err_up = test::norm_rel_error(act.data(), act_want.data(), act_want.size());
  EXPECT_LE(err_up, 1e-2);
  // Down: the GPU's bf16 act as its input (exactly what the model feeds it), against the reference on that input.
  Problem down = make_problem(rows, D, I, 1.0f, 31);
  down.A = act;
  const std::vector<float> out = run_gpu(down, GroupedEpilogue::kF32, kernel(), 0.0f);
  ASSERT_EQ(out.size(), size_t(down.n) * D);
  const std::vector<float> out_want = reference(down);
  const double err_down = test::norm_rel_error(out.data(), out_want.data(), out_want.size());
  std::printf("[grouped_gemm %s] routed 4096 rows / 288 experts (%d empty): gate_up %.3g, down %.3g\n",
              cuda::grouped_gemm_kernel_name(kernel()), empty, err_up, err_down);
  EXPECT_LE(err_down, 1e-4);
}

// No host synchronisation: the pair of kernels captures into a CUDA graph, and a replay after the offsets changed on
// the device (same n, another split between experts, other experts empty) computes the new split.
TEST_P(CudaGroupedGemm, CapturedGraphFollowsNewOffsets) {
  Problem p = make_problem(kRows, 200, 264, 1.0f, 41);
  Problem q = p;
  std::vector<int> rows2(p.E, 0);
  rows2[0] = 700, rows2[3] = 1, rows2[12] = static_cast<int>(p.n) - 701;  // experts that were empty in kRows
  q.offsets.assign(1, 0);
  for (int r : rows2) q.offsets.push_back(q.offsets.back() + r);
  ASSERT_EQ(q.offsets.back(), p.n);
  const std::vector<uint16_t> A16 = to_bf16(p.A), W16 = to_bf16(p.W);
  const size_t out_bytes = size_t(p.n) * p.N * 4;
  DevBuf dA(A16.size() * 2), dW(W16.size() * 2), dOff(p.offsets.size() * 4), dPtr(p.E * sizeof(void*)), dC(out_bytes),
      dWs(cuda::grouped_gemm_workspace_ints(p.E) * 4);
  ASSERT_TRUE(dA.p && dW.p && dOff.p && dPtr.p && dC.p && dWs.p);
  std::vector<const cuda::bf16*> ptrs(p.E);
  for (int e = 0; e < p.E; ++e) ptrs[e] = dW.as<cuda::bf16>() + int64_t(e) * p.N * p.K;
  ASSERT_EQ(cudaMemcpy(dA.p, A16.data(), A16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dW.p, W16.data(), W16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dPtr.p, ptrs.data(), p.E * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  cuda::GroupedGemm g{dA.as<cuda::bf16>(),
                      dOff.as<int32_t>(),
                      dPtr.as<const cuda::bf16*>(),
                      dC.p,
                      p.n,
                      p.E,
                      p.N,
                      p.K,
                      GroupedEpilogue::kF32,
                      0.0f,
                      kernel()};
  g.W_all = dW.as<cuda::bf16>();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::grouped_gemm(g, dWs.as<int32_t>(), st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const Problem* cur : {&p, &q}) {
    ASSERT_EQ(cudaMemcpy(dOff.p, cur->offsets.data(), cur->offsets.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dC.p, 0xFF, out_bytes), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    std::vector<float> got(size_t(p.n) * p.N);
    ASSERT_EQ(cudaMemcpy(got.data(), dC.p, out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    const std::vector<float> want = reference(*cur);
    const double err = test::norm_rel_error(got.data(), want.data(), want.size());
    std::printf("[grouped_gemm %s] graph replay (%s offsets): norm rel err %.3g\n",
                cuda::grouped_gemm_kernel_name(kernel()), cur == &p ? "captured" : "changed", err);
    EXPECT_LE(err, 1e-4);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
}

// No rows at all: nothing is launched and nothing is touched (the output stays poisoned).
TEST_P(CudaGroupedGemm, NoRowsIsANoOp) {
  const Problem p = make_problem({0, 0, 0}, 64, 64, 1.0f, 3);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f);
  EXPECT_TRUE(got.empty());
}

// More experts than the scheduling kernel's block has threads (its prefix sum runs in chunks of 1024): 2500
// experts of 0 … 300 rows, many empty; every row lands once in the right place.
TEST_P(CudaGroupedGemm, ManyExpertsInTheSchedule) {
  std::mt19937 rng(11);
  std::vector<int> rows(2500);
  std::discrete_distribution<int> pick({30, 30, 20, 10, 6, 4});
  const int sizes[6] = {0, 1, 3, 64, 129, 300};
  for (int& r : rows) r = sizes[pick(rng)];
  const Problem p = make_problem(rows, 64, 64, 1.0f, 13);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f);
  ASSERT_EQ(got.size(), size_t(p.n) * p.N);
  const std::vector<float> want = reference(p);
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] %d experts, %lld rows: fp32 norm rel err %.3g\n",
              cuda::grouped_gemm_kernel_name(kernel()), p.E, static_cast<long long>(p.n), err);
  EXPECT_LE(err, 1e-4);
  EXPECT_LE(test::max_rel_error(got.data(), want.data(), want.size()), 1e-3);
}

// Experts with an odd number of M tiles (3, 5 and 1; short last tiles of 44, 12 and 64 rows) beside even ones, over
// three N tiles of the widest kernels (N = 600, I = 296): the paired schedule's last-tile units go between its weight
// pairs, and a last tile of at most 64 rows loads half an A tile. fp32 and w_kn fp32 at ~1e-6, SwiGLU at bf16.
TEST_P(CudaGroupedGemm, OddTileCountsOverSeveralNTiles) {
  const std::vector<int> rows{300, 64, 524, 0, 129, 12, 385, 256};
  for (bool w_kn : {false, true}) {
    const Problem p = make_problem(rows, 600, 136, 1.0f, w_kn ? 93 : 91);
    const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f, {.w_kn = w_kn});
    ASSERT_EQ(got.size(), size_t(p.n) * p.N);
    const std::vector<float> want = reference(p);
    const double err = test::norm_rel_error(got.data(), want.data(), want.size());
    const double max_err = test::max_rel_error(got.data(), want.data(), want.size());
    std::printf("[grouped_gemm %s] odd M tiles, 3 N tiles%s: norm rel err %.3g, max rel err %.3g\n",
                cuda::grouped_gemm_kernel_name(kernel()), w_kn ? " (w_kn)" : "", err, max_err);
    EXPECT_LE(err, 1e-4);
    EXPECT_LE(max_err, 1e-3);
  }
  const int I = 296;  // 2I a multiple of 16, as the SwiGLU epilogue needs
  const Problem g = make_problem(rows, 2 * I, 136, 1.0f, 95);
  const std::vector<float> act = run_gpu(g, GroupedEpilogue::kSwiGLU, kernel(), 10.0f);
  ASSERT_EQ(act.size(), size_t(g.n) * I);
  const std::vector<float> want = swiglu_reference(reference(g), g.n, I, 10.0f);
  const double err = test::norm_rel_error(act.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] odd M tiles, swiglu: norm rel err %.3g\n", cuda::grouped_gemm_kernel_name(kernel()),
              err);
  EXPECT_LE(err, 1e-2);
}

// ---- The w_kn form: C = A·W_e with W_e [K, N] (the backward's dact = dout·W_down_e and dxp = dgu·W_gu_e). The
// problems keep W as [E, N, K] for the reference and upload each W_e transposed, so the reference is unchanged.

// fp32: K = 200 and N = 136 are multiples of 8 but of no tile size (BK 32/64, BN 128/256, wgmma's 64-column blocks);
// same inputs and fp32 accumulation on both sides, so ~1e-6 relative as in the [N, K] form.
TEST_P(CudaGroupedGemm, WknF32MatchesHostReference) {
  const Problem p = make_problem(kRows, 136, 200, 1.0f, 51);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f, {.w_kn = true});
  ASSERT_EQ(got.size(), size_t(p.n) * p.N);
  const std::vector<float> want = reference(p);
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  const double max_err = test::max_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] w_kn fp32: norm rel err %.3g, max rel err %.3g\n",
              cuda::grouped_gemm_kernel_name(kernel()), err, max_err);
  EXPECT_LE(err, 1e-4);
  EXPECT_LE(max_err, 1e-3);
}

// fp32 accumulate: C starts as random values of the product's size; C += A·W_e must hold everywhere, so a row left
// out (C stays the base: an O(1) miss against max |want| of a few) or written over (the base is lost) fails the max
// error. N = 200 leaves a partial 64-column block and a partial BN tile.
TEST_P(CudaGroupedGemm, WknF32AddAccumulatesOntoC) {
  const Problem p = make_problem(kRows, 200, 264, 1.0f, 55);
  const std::vector<float> base = test::randn(size_t(p.n) * p.N, 57);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32Add, kernel(), 0.0f, {.w_kn = true, .base = &base});
  ASSERT_EQ(got.size(), size_t(p.n) * p.N);
  std::vector<float> want = reference(p);
  for (size_t i = 0; i < want.size(); ++i) want[i] += base[i];
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  const double max_err = test::max_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] w_kn fp32 add: norm rel err %.3g, max rel err %.3g\n",
              cuda::grouped_gemm_kernel_name(kernel()), err, max_err);
  EXPECT_LE(err, 1e-4);
  EXPECT_LE(max_err, 1e-3);
}

// bf16 store: bf16 rounding of the result (~2e-3 in norm), bound with margin as in the [N, K] form.
TEST_P(CudaGroupedGemm, WknBf16MatchesHostReference) {
  const Problem p = make_problem(kRows, 264, 136, 1.0f, 61);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kBf16, kernel(), 0.0f, {.w_kn = true});
  ASSERT_EQ(got.size(), size_t(p.n) * p.N);
  const std::vector<float> want = reference(p);
  const double err = test::norm_rel_error(got.data(), want.data(), want.size());
  std::printf("[grouped_gemm %s] w_kn bf16: norm rel err %.3g\n", cuda::grouped_gemm_kernel_name(kernel()), err);
  EXPECT_LE(err, 1e-2);
}

// The model's two input-gradient products at a small width: 777 tokens routed top-2 over E = 9 experts, expert 4
// never chosen (empty), the others ~194 rows each at random (a full and a partial M tile), D = 256, I = 128:
//   dact [n, I]  = dout [n, D]  · W_down_e [D, I]   (K = D,  N = I)
//   dxp  [n, D]  = dgu  [n, 2I] · W_gu_e   [2I, D]  (K = 2I, N = D)
TEST_P(CudaGroupedGemm, WknModelInputGradientShapes) {
  const int E = 9, D = 256, I = 128, T = 777, k = 2;
  std::mt19937 rng(71);
  std::vector<int> rows(E, 0);
  std::uniform_int_distribution<int> pick(0, E - 1);
  for (int t = 0; t < T; ++t) {
    int chosen[k];
    for (int j = 0; j < k; ++j) {
      int e;
      do e = pick(rng);
      while (e == 4 || (j == 1 && e == chosen[0]));
      chosen[j] = e;
      ++rows[e];
    }
  }
  ASSERT_EQ(rows[4], 0);
  const Problem dact = make_problem(rows, I, D, 1.0f, 73);
  const Problem dxp = make_problem(rows, D, 2 * I, 1.0f, 79);
  for (const Problem* p : {&dact, &dxp}) {
    const std::vector<float> got = run_gpu(*p, GroupedEpilogue::kF32, kernel(), 0.0f, {.w_kn = true});
    ASSERT_EQ(got.size(), size_t(p->n) * p->N);
    const std::vector<float> want = reference(*p);
    const double err = test::norm_rel_error(got.data(), want.data(), want.size());
    const double max_err = test::max_rel_error(got.data(), want.data(), want.size());
    std::printf("[grouped_gemm %s] w_kn %s (K %d, N %d, %lld rows): norm rel err %.3g, max rel err %.3g\n",
                cuda::grouped_gemm_kernel_name(kernel()), p == &dact ? "dact" : "dxp", p->K, p->N,
                static_cast<long long>(p->n), err, max_err);
    EXPECT_LE(err, 1e-4);
    EXPECT_LE(max_err, 1e-3);
  }
}

// No rows: nothing is launched and the (poisoned) output is untouched.
TEST_P(CudaGroupedGemm, WknNoRowsIsANoOp) {
  const Problem p = make_problem({0, 0, 0}, 64, 64, 1.0f, 83);
  const std::vector<float> got = run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f, {.w_kn = true});
  EXPECT_TRUE(got.empty());
}

// The low-rank term (the routed experts' LoRA folded into their GEMMs) on the wgmma kernels, against the host's
// product plus Σ_p U_p·V_p,e: gate and up parts (ranks 16 and 32) on their column halves, through the fp32 and the
// SwiGLU epilogue; one rank-64 part on a column range that starts and ends inside tiles; the w_kn form (dx += gs·A_e)
// with two parts. The other kernels refuse it on the host.
TEST_P(CudaGroupedGemm, LowRankTermInTheAccumulators) {
  const bool wgmma = cuda::grouped_gemm_is_wgmma(kernel());
  const int I = 200;
  Problem p = make_problem(kRows, 2 * I, 264, 1.0f, 71);
  const LowRankHost gate_up = make_low_rank(p, {16, 32}, {0, I}, {I, I}, false, 73);
  if (!wgmma) {
    cuda::GroupedGemm g{nullptr, nullptr, nullptr, nullptr, 128, 4, 256, 128, GroupedEpilogue::kF32, 0.0f, kernel()};
    g.low_rank.parts = 1;
    EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
    g.low_rank.parts = 0;
    g.epilogue = GroupedEpilogue::kSwiGLU;
    g.pre = reinterpret_cast<float*>(16);
    EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);  // the kept pre-activations: wgmma only
    g.pre = nullptr;
    g.pre16 = reinterpret_cast<cuda::bf16*>(16);
    EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
    return;
  }
  auto check = [&](const std::vector<float>& got, const std::vector<float>& want, double tol, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    const double err = test::norm_rel_error(got.data(), want.data(), want.size());
    std::printf("[grouped_gemm %s] low rank, %s: norm rel err %.3g, max rel err %.3g\n",
                cuda::grouped_gemm_kernel_name(kernel()), what, err,
                test::max_rel_error(got.data(), want.data(), want.size()));
    EXPECT_LE(err, tol) << what;
  };
  std::vector<float> want = reference(p);
  add_low_rank(want, p, gate_up, false);
  check(run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f, {.low_rank = &gate_up}), want, 1e-4, "gate|up fp32");
  std::vector<float> pre;
  check(run_gpu(p, GroupedEpilogue::kSwiGLU, kernel(), 7.0f, {.low_rank = &gate_up, .pre = &pre}),
        swiglu_reference(want, p.n, I, 7.0f), 1e-2, "gate|up swiglu");
  check(pre, want, 1e-4, "gate|up swiglu's kept pre-activations");
  // The same kept in bf16: the fp32 ones rounded, bit for bit (and the act unchanged).
  std::vector<float> pre16;
  const std::vector<float> act =
      run_gpu(p, GroupedEpilogue::kSwiGLU, kernel(), 7.0f, {.low_rank = &gate_up, .pre = &pre});
  EXPECT_EQ(run_gpu(p, GroupedEpilogue::kSwiGLU, kernel(), 7.0f, {.low_rank = &gate_up, .pre16 = &pre16}), act);
  EXPECT_EQ(pre16, widen(to_bf16(pre)));

  const LowRankHost one = make_low_rank(p, {64}, {8}, {2 * I - 24}, false, 77);
  want = reference(p);
  add_low_rank(want, p, one, false);
  check(run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f, {.low_rank = &one}), want, 1e-4, "rank 64, columns 8 … 383");

  const LowRankHost dx = make_low_rank(p, {16, 24}, {}, {}, true, 79);
  want = reference(p);
  add_low_rank(want, p, dx, true);
  check(run_gpu(p, GroupedEpilogue::kF32, kernel(), 0.0f, {.w_kn = true, .low_rank = &dx}), want, 1e-4, "w_kn");

  // Bad parts are refused: a rank past the slot, one not a multiple of 8, columns past N.
  cuda::GroupedGemm g{nullptr, nullptr, nullptr, nullptr, 128, 4, 256, 128, GroupedEpilogue::kF32, 0.0f, kernel()};
  const cuda::bf16* const* vp = reinterpret_cast<const cuda::bf16* const*>(16);
  const cuda::bf16* up = reinterpret_cast<const cuda::bf16*>(16);
  g.low_rank = cuda::GroupedLowRank{2, {up, up}, {40, 40}, {40, 16}, {vp, vp}, {0, 128}, {128, 128}};
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.low_rank.r[0] = 12, g.low_rank.ldu[0] = 16;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.low_rank.r[0] = 16, g.low_rank.width[1] = 136;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
}

// The SwiGLU epilogue needs W as [N, K]; with w_kn it is refused on the host, before anything is enqueued.
// Without W_all (a caller's own pointer array, experts anywhere) the TMA variant runs as the cp.async kernel
// (kWgmma128x256): the same results through the pointer array, for both weight layouts.
TEST(CudaGroupedGemmTma, WithoutWAllFallsBackToPointerArray) {
  const Problem p = make_problem(kRows, 200, 264, 1.0f, 3);
  const std::vector<float> want = reference(p);
  for (const bool w_kn : {false, true}) {
    RunOptions opt;
    opt.w_kn = w_kn;
    opt.w_all = false;
    const std::vector<float> got =
        run_gpu(p, GroupedEpilogue::kF32, GroupedGemmKernel::kWgmmaTma128x256, 0.0f, opt);
    ASSERT_EQ(got.size(), want.size());
    const double err = test::norm_rel_error(got.data(), want.data(), want.size());
    EXPECT_LE(err, 1e-4) << (w_kn ? "w_kn" : "w_nk");
  }
}

// The weights in column blocks or tiles give the TMA variants the same tiles from other places in memory: the same
// bits as the rows, for each epilogue, w_kn and a low-rank term; block_expert_weights and its inverse round-trip.
TEST(CudaGroupedGemmTma, BlockedWeightLayoutsGiveTheSameBits) {
  const Problem p = make_problem(kRows, 512, 256, 8.0f, 11);
  const LowRankHost lr = make_low_rank(p, {16}, {64}, {128}, false, 13);
  const LowRankHost lr_kn = make_low_rank(p, {16}, {}, {}, true, 17);
  for (const auto layout : {GroupedWeightLayout::kColumnBlocks, GroupedWeightLayout::kTiles})
    for (const auto kern : {GroupedGemmKernel::kWgmmaTma128x256, GroupedGemmKernel::kWgmmaTma128x256c4}) {
      const std::string at = std::string(cuda::grouped_gemm_kernel_name(kern)) +
                             (layout == GroupedWeightLayout::kTiles ? " tiles " : " column blocks ");
      const auto same = [&](GroupedEpilogue epi, RunOptions opt, const std::string& what) {
        std::vector<float> pre, pre_b;
        if (epi == GroupedEpilogue::kSwiGLU) opt.pre16 = &pre;
        const std::vector<float> want = run_gpu(p, epi, kern, 7.0f, opt);
        opt.layout = layout;
        if (epi == GroupedEpilogue::kSwiGLU) opt.pre16 = &pre_b;
        const std::vector<float> got = run_gpu(p, epi, kern, 7.0f, opt);
        ASSERT_EQ(got.size(), want.size()) << at << what;
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << at << what;
        EXPECT_EQ(pre_b, pre) << at << what << ": pre-activations";
      };
      same(GroupedEpilogue::kF32, {}, "f32");
      same(GroupedEpilogue::kSwiGLU, {.low_rank = &lr}, "swiglu + low rank");
      same(GroupedEpilogue::kBf16, {.w_kn = true}, "w_kn bf16");
      same(GroupedEpilogue::kF32, {.w_kn = true, .low_rank = &lr_kn}, "w_kn f32 + low rank");
    }
  // The layouts and back: the weights again, and the layout not the rows.
  const int64_t E = 3, R = 256, C = 192;
  const std::vector<uint16_t> w = to_bf16(test::randn(E * R * C, 19));
  DevBuf d(w.size() * 2), b(w.size() * 2), back(w.size() * 2);
  ASSERT_EQ(cudaMemcpy(d.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  for (const auto layout : {GroupedWeightLayout::kColumnBlocks, GroupedWeightLayout::kTiles}) {
    cuda::block_expert_weights(d.as<cuda::bf16>(), b.as<cuda::bf16>(), E, R, C, layout, nullptr);
    cuda::block_expert_weights(b.as<cuda::bf16>(), back.as<cuda::bf16>(), E, R, C, layout, nullptr, false);
    std::vector<uint16_t> got(w.size()), mid(w.size());
    ASSERT_EQ(cudaMemcpy(got.data(), back.p, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(mid.data(), b.p, mid.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, w);
    EXPECT_NE(mid, w);
    // Expert 1's row 130, column 70: column block 1 / tile (1, 1).
    const size_t at = (1 * R + 130) * C + 70;
    const size_t want_at = layout == GroupedWeightLayout::kTiles ? R * C + (1 * (C / 64) + 1) * 8192 + 2 * 64 + 6
                                                                 : R * C + (1 * R + 130) * 64 + 6;
    EXPECT_EQ(mid[want_at], w[at]);
  }
  // Refused: another kernel variant, no W_all, columns not a multiple of 64, tiles' rows not of 128 (256 with
  // SwiGLU).
  cuda::GroupedGemm g{nullptr, nullptr, nullptr, nullptr, 128, 4, 256, 128, GroupedEpilogue::kF32, 0.0f,
                      GroupedGemmKernel::kWgmma128x256};
  g.w_layout = GroupedWeightLayout::kColumnBlocks;
  g.W_all = reinterpret_cast<const cuda::bf16*>(16);
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.kernel = GroupedGemmKernel::kWgmmaTma128x256, g.W_all = nullptr;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.W_all = reinterpret_cast<const cuda::bf16*>(16), g.K = 136;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.K = 128, g.w_kn = true, g.N = 200;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.w_kn = false, g.N = 192, g.w_layout = GroupedWeightLayout::kTiles;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  g.N = 384, g.epilogue = GroupedEpilogue::kSwiGLU;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::block_expert_weights(d.as<cuda::bf16>(), b.as<cuda::bf16>(), E, 192, C,
                                          GroupedWeightLayout::kTiles, nullptr),
               Error);
}

TEST(CudaGroupedGemmWkn, RejectsSwiGluEpilogue) {
  cuda::GroupedGemm g{nullptr, nullptr, nullptr, nullptr, 128, 4, 256, 128, GroupedEpilogue::kSwiGLU, 7.0f};
  g.w_kn = true;
  EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  for (int v = 0; v < cuda::kGroupedGemmKernels; ++v) {
    g.kernel = static_cast<GroupedGemmKernel>(v);
    EXPECT_THROW(cuda::grouped_gemm(g, nullptr, nullptr), Error);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaGroupedGemm, ::testing::Range(0, cuda::kGroupedGemmKernels),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(cuda::grouped_gemm_kernel_name(static_cast<GroupedGemmKernel>(i.param)));
                         });

}  // namespace
}  // namespace nextlm
