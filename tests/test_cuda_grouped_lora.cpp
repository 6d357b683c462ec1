// The grouped per-expert LoRA kernels (src/cuda/grouped_lora.cu) against a host reference of train.cu's per-expert
// lora_forward / lora_backward: u = bf16(s·x·A_eᵀ), y += u·B_eᵀ, dB_e += dyᵀ·u, gs = bf16(s·dy·B_e), dA_e += gsᵀ·x,
// dx += gs·A_e on each expert's rows. Uneven experts (empty ones first, in the middle and last, one row, one over
// four 64-row tiles), widths and ranks that are not multiples of any tile, strided rows and a column offset, rows past
// offsets[E] (another EP rank's) that must stay untouched. Inputs the kernels must not read (those rows, x's padding
// columns, dy's columns outside the adapter) are NaN, so reading one shows; u, gs and everything outside the written
// regions start as NaN bit patterns and are checked bit for bit. y, dx, dA and dB start non-zero: the kernels add.
//
// Tolerances: u and gs are fp32 sums rounded to bf16 on both sides; a sum that lands near a rounding boundary can
// round one bf16 ulp apart (2^-8 relative), so 1e-2 in norm. y, dx, dA and dB increments are fp32 sums of products
// of the same bf16 values (the device's own u and gs feed their reference), differing only in summation order:
// 2e-3 in norm with a wide margin. Runs on a GPU machine (part of test_cuda, CTest label "gpu").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/grouped_lora.h"
#include "io/safetensors.h"
#include "cuda_test_buffer.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr uint16_t kPoison16 = 0xFFFF;      // a bf16 NaN
constexpr uint32_t kPoison32 = 0xFFFFFFFFu;  // an fp32 NaN

float poison32() {
  float f;
  std::memcpy(&f, &kPoison32, 4);
  return f;
}
uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
  return b;
}
float bf(uint16_t b) { return bf16_to_f32(b); }

using test::DevBuf;
using test::download;
using test::upload;

struct Case {
  std::string name;
  std::vector<int> rows;  // per expert
  int extra;              // rows past offsets[E]
  int r, in, out;
  int64_t ldx, ldy, col0, lddx;  // dy has y's layout (lddy = ldy)
  bool with_dx = true;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// The host side of a problem: bf16 inputs as bit patterns, fp32 starting values of the accumulated outputs.
struct Host {
  Case c;
  int E = 0, ldr = 0;
  std::vector<int32_t> off;  // [E+1]
  int64_t m = 0, n = 0;      // rows of the experts, all rows (m + extra)
  float scale = 2.0f;        // alpha / r with alpha = 2r
  std::vector<uint16_t> x, A, B, dy;     // x [n, ldx], A [E, r, in], B [E, out, r], dy [n, ldy]
  std::vector<float> y0, dx0, dA0, dB0;  // y0 [n, ldy], dx0 [n, lddx], dA0 [E, r, in], dB0 [E, out, r]
};

Host make_host(const Case& c, unsigned seed) {
  Host h;
  h.c = c;
  h.E = static_cast<int>(c.rows.size());
  h.ldr = cuda::grouped_lora_ld(c.r);
  h.off.push_back(0);
  for (int r : c.rows) h.off.push_back(h.off.back() + r);
  h.m = h.off.back();
  h.n = h.m + c.extra;
  const int64_t E = h.E, r = c.r, in = c.in, out = c.out;
  h.x = to_bf16(test::randn(h.n * c.ldx, seed));
  h.A = to_bf16(test::randn(E * r * in, seed + 1, 1.0f / std::sqrt(float(in))));
  h.B = to_bf16(test::randn(E * out * r, seed + 2, 0.1f / std::sqrt(float(r))));
  h.dy = to_bf16(test::randn(h.n * c.ldy, seed + 3));
  h.y0 = test::randn(h.n * c.ldy, seed + 4);
  h.dx0 = test::randn(h.n * c.lddx, seed + 5);
  h.dA0 = test::randn(E * r * in, seed + 6, 0.1f);
  h.dB0 = test::randn(E * out * r, seed + 7, 0.1f);
  // What the kernels must not read is NaN; the rows of no expert in y and dx are NaN patterns that must survive.
  for (int64_t i = 0; i < h.n; ++i) {
    for (int64_t k = 0; k < c.ldx; ++k)
      if (i >= h.m || k >= in) h.x[i * c.ldx + k] = kPoison16;
    for (int64_t k = 0; k < c.ldy; ++k) {
      if (i >= h.m || k < c.col0 || k >= c.col0 + out) h.dy[i * c.ldy + k] = kPoison16;
      if (i >= h.m) h.y0[i * c.ldy + k] = poison32();
    }
    if (i >= h.m)
      for (int64_t k = 0; k < c.lddx; ++k) h.dx0[i * c.lddx + k] = poison32();
  }
  return h;
}

struct Out {
  std::vector<uint16_t> u, gs;
  std::vector<float> y, dx, dA, dB;
};

// Forward then backward on the device (eagerly, or captured into a CUDA graph and replayed) from the host's starting
// values; u and gs start poisoned.
Out run_device(const Host& h, bool graph = false) {
  const Case& c = h.c;
  const int64_t E = h.E, r = c.r, in = c.in, out = c.out;
  Out o;
  DevBuf x(h.x.size() * 2), A(h.A.size() * 2), B(h.B.size() * 2), dy(h.dy.size() * 2), off(h.off.size() * 4),
      y(h.y0.size() * 4), dx(h.dx0.size() * 4), dA(h.dA0.size() * 4), dB(h.dB0.size() * 4),
      u(h.n * h.ldr * 2), gs(h.n * h.ldr * 2), pA(E * sizeof(void*)), pB(E * sizeof(void*)),
      pdA(E * sizeof(void*)), pdB(E * sizeof(void*));
  for (const DevBuf* b : {&x, &A, &B, &dy, &off, &y, &dx, &dA, &dB, &u, &gs, &pA, &pB, &pdA, &pdB})
    if (!b->p) {
      ADD_FAILURE() << "cudaMalloc failed";
      return o;
    }
  upload(x, h.x), upload(dy, h.dy), upload(off, h.off), upload(y, h.y0), upload(dx, h.dx0);
  EXPECT_EQ(cudaMemset(u.p, 0xFF, h.n * h.ldr * 2), cudaSuccess);
  EXPECT_EQ(cudaMemset(gs.p, 0xFF, h.n * h.ldr * 2), cudaSuccess);
  // Each expert's adapter and gradients, in reverse order in memory (the kernels must follow the pointers).
  std::vector<const cuda::bf16*> va(E), vb(E);
  std::vector<float*> vda(E), vdb(E);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = E - 1 - e;
    va[e] = A.as<cuda::bf16>() + s * r * in;
    vb[e] = B.as<cuda::bf16>() + s * out * r;
    vda[e] = dA.as<float>() + s * r * in;
    vdb[e] = dB.as<float>() + s * out * r;
  }
  upload(pA, va), upload(pB, vb), upload(pdA, vda), upload(pdB, vdb);
  // The starting values in the same reversed layout.
  std::vector<float> dA0(h.dA0.size()), dB0(h.dB0.size());
  std::vector<uint16_t> A16(h.A.size()), B16(h.B.size());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = E - 1 - e;
    std::copy_n(h.A.begin() + e * r * in, r * in, A16.begin() + s * r * in);
    std::copy_n(h.B.begin() + e * out * r, out * r, B16.begin() + s * out * r);
    std::copy_n(h.dA0.begin() + e * r * in, r * in, dA0.begin() + s * r * in);
    std::copy_n(h.dB0.begin() + e * out * r, out * r, dB0.begin() + s * out * r);
  }
  upload(A, A16), upload(B, B16), upload(dA, dA0), upload(dB, dB0);

  const cuda::GroupedLora g{off.as<int32_t>(), h.E, c.r, c.in, c.out, pA.as<const cuda::bf16* const>(),
                            pB.as<const cuda::bf16* const>(), h.scale};
  cudaStream_t st;
  EXPECT_EQ(cudaStreamCreate(&st), cudaSuccess);
  auto enqueue = [&] {
    cuda::grouped_lora_forward(g, x.as<cuda::bf16>(), c.ldx, h.n, u.as<cuda::bf16>(), y.as<float>(), c.ldy, c.col0,
                               st);
    cuda::grouped_lora_backward(g, pdA.as<float* const>(), pdB.as<float* const>(), x.as<cuda::bf16>(), c.ldx,
                                u.as<cuda::bf16>(), dy.as<cuda::bf16>(), c.ldy, h.n, gs.as<cuda::bf16>(),
                                c.with_dx ? dx.as<float>() : nullptr, c.lddx, c.col0, st);
  };
  if (graph) {
    cudaGraph_t gr = nullptr;
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
    enqueue();
    EXPECT_EQ(cudaStreamEndCapture(st, &gr), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, gr, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(gr);
  } else {
    enqueue();
  }
  EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaStreamDestroy(st);

  o.u = download<uint16_t>(u, h.n * h.ldr);
  o.gs = download<uint16_t>(gs, h.n * h.ldr);
  o.y = download<float>(y, h.y0.size());
  o.dx = download<float>(dx, h.dx0.size());
  const std::vector<float> dAr = download<float>(dA, h.dA0.size()), dBr = download<float>(dB, h.dB0.size());
  o.dA.resize(dAr.size());
  o.dB.resize(dBr.size());
  for (int64_t e = 0; e < E; ++e) {  // back to expert order
    const int64_t s = E - 1 - e;
    std::copy_n(dAr.begin() + s * r * in, r * in, o.dA.begin() + e * r * in);
    std::copy_n(dBr.begin() + s * out * r, out * r, o.dB.begin() + e * out * r);
  }
  return o;
}

// bf16(scale · sum) of a double sum first rounded to fp32, as the device's fp32 GEMM result then scaled_bf16.
float scaled_round(double sum, float scale) { return bf(f32_to_bf16(scale * static_cast<float>(sum))); }

struct Report {
  double u = 0, gs = 0, y = 0, dx = 0, dA = 0, dB = 0;
};

// Compares o with the host reference of h; returns the relative errors (failures are recorded as it goes).
Report check_outputs(const Host& h, const Out& o) {
  const Case& c = h.c;
  const int64_t r = c.r, in = c.in, out = c.out, ldr = h.ldr;
  Report rep;
  if (o.u.size() != size_t(h.n * ldr) || o.y.size() != h.y0.size()) {
    ADD_FAILURE() << "missing device outputs";
    return rep;
  }
  std::vector<float> got, want;
  auto flush = [&](double* err, const char* what) {
    *err = test::norm_rel_error(got.data(), want.data(), got.size());
    EXPECT_FALSE(got.empty()) << what;
    got.clear(), want.clear();
  };
  auto xv = [&](int64_t i, int64_t k) { return double(bf(h.x[i * c.ldx + k])); };
  auto dyv = [&](int64_t i, int64_t o_) { return double(bf(h.dy[i * c.ldy + c.col0 + o_])); };
  auto Av = [&](int64_t e, int64_t j, int64_t k) { return double(bf(h.A[(e * r + j) * in + k])); };
  auto Bv = [&](int64_t e, int64_t o_, int64_t j) { return double(bf(h.B[(e * out + o_) * r + j])); };
  auto uv = [&](int64_t i, int64_t j) { return double(bf(o.u[i * ldr + j])); };
  auto gv = [&](int64_t i, int64_t j) { return double(bf(o.gs[i * ldr + j])); };

  // u and gs: written on every expert row (zeros past r), untouched past offsets[E].
  size_t bad_u = 0, bad_g = 0;
  for (int64_t i = 0; i < h.n; ++i)
    for (int64_t j = 0; j < ldr; ++j) {
      const uint16_t want_pad = i >= h.m ? kPoison16 : 0;
      if (i >= h.m || j >= r) {
        bad_u += o.u[i * ldr + j] != want_pad;
        bad_g += o.gs[i * ldr + j] != want_pad;
      }
    }
  EXPECT_EQ(bad_u, 0u) << "u: padding columns not zero, or rows past offsets[E] written";
  EXPECT_EQ(bad_g, 0u) << "gs: padding columns not zero, or rows past offsets[E] written";
  for (int e = 0; e < h.E; ++e)
    for (int64_t i = h.off[e]; i < h.off[e + 1]; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double s = 0;
        for (int64_t k = 0; k < in; ++k) s += xv(i, k) * Av(e, j, k);
        got.push_back(float(uv(i, j)));
        want.push_back(scaled_round(s, h.scale));
      }
  flush(&rep.u, "u");
  for (int e = 0; e < h.E; ++e)
    for (int64_t i = h.off[e]; i < h.off[e + 1]; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double s = 0;
        for (int64_t k = 0; k < out; ++k) s += dyv(i, k) * Bv(e, k, j);
        got.push_back(float(gv(i, j)));
        want.push_back(scaled_round(s, h.scale));
      }
  flush(&rep.gs, "gs");

  // y: y0 + u·B_eᵀ on the adapted block, every other bit unchanged.
  size_t bad_y = 0;
  for (int e = 0; e < h.E; ++e)
    for (int64_t i = h.off[e]; i < h.off[e + 1]; ++i)
      for (int64_t k = 0; k < out; ++k) {
        double s = 0;
        for (int64_t j = 0; j < r; ++j) s += uv(i, j) * Bv(e, k, j);
        const int64_t at = i * c.ldy + c.col0 + k;
        got.push_back(o.y[at] - h.y0[at]);
        want.push_back(float(s));
      }
  flush(&rep.y, "y");
  for (int64_t i = 0; i < h.n; ++i)
    for (int64_t k = 0; k < c.ldy; ++k)
      if (i >= h.m || k < c.col0 || k >= c.col0 + out) bad_y += bits(o.y[i * c.ldy + k]) != bits(h.y0[i * c.ldy + k]);
  EXPECT_EQ(bad_y, 0u) << "y changed outside the adapter's rows and columns";

  // dx: dx0 + gs·A_e on the experts' rows and the first `in` columns (or nothing without dx).
  size_t bad_dx = 0;
  for (int64_t i = 0; i < h.n; ++i)
    for (int64_t k = 0; k < c.lddx; ++k)
      if (!c.with_dx || i >= h.m || k >= in) bad_dx += bits(o.dx[i * c.lddx + k]) != bits(h.dx0[i * c.lddx + k]);
  EXPECT_EQ(bad_dx, 0u) << "dx changed outside the experts' rows and columns (or without dx)";
  if (c.with_dx) {
    for (int e = 0; e < h.E; ++e)
      for (int64_t i = h.off[e]; i < h.off[e + 1]; ++i)
        for (int64_t k = 0; k < in; ++k) {
          double s = 0;
          for (int64_t j = 0; j < r; ++j) s += gv(i, j) * Av(e, j, k);
          const int64_t at = i * c.lddx + k;
          got.push_back(o.dx[at] - h.dx0[at]);
          want.push_back(float(s));
        }
    flush(&rep.dx, "dx");
  }

  // dA_e, dB_e: sums over the expert's rows added to the starting values; empty experts' bits unchanged.
  size_t bad_empty = 0;
  for (int e = 0; e < h.E; ++e) {
    const bool empty = h.off[e] == h.off[e + 1];
    for (int64_t j = 0; j < r; ++j)
      for (int64_t k = 0; k < in; ++k) {
        const int64_t at = (e * r + j) * in + k;
        if (empty) {
          bad_empty += bits(o.dA[at]) != bits(h.dA0[at]);
          continue;
        }
        double s = 0;
        for (int64_t i = h.off[e]; i < h.off[e + 1]; ++i) s += gv(i, j) * xv(i, k);
        got.push_back(o.dA[at] - h.dA0[at]);
        want.push_back(float(s));
      }
  }
  flush(&rep.dA, "dA");
  for (int e = 0; e < h.E; ++e) {
    const bool empty = h.off[e] == h.off[e + 1];
    for (int64_t k = 0; k < out; ++k)
      for (int64_t j = 0; j < r; ++j) {
        const int64_t at = (e * out + k) * r + j;
        if (empty) {
          bad_empty += bits(o.dB[at]) != bits(h.dB0[at]);
          continue;
        }
        double s = 0;
        for (int64_t i = h.off[e]; i < h.off[e + 1]; ++i) s += dyv(i, k) * uv(i, j);
        got.push_back(o.dB[at] - h.dB0[at]);
        want.push_back(float(s));
      }
  }
  flush(&rep.dB, "dB");
  EXPECT_EQ(bad_empty, 0u) << "an empty expert's dA or dB changed";

  // Every accumulated output finite (the NaN starting values of the untouched rows are checked bit for bit above).
  size_t nonfinite = 0;
  for (float v : o.dA) nonfinite += !std::isfinite(v);
  for (float v : o.dB) nonfinite += !std::isfinite(v);
  EXPECT_EQ(nonfinite, 0u) << "non-finite dA / dB";

  EXPECT_LE(rep.u, 1e-2);
  EXPECT_LE(rep.gs, 1e-2);
  EXPECT_LE(rep.y, 2e-3);
  EXPECT_LE(rep.dx, 2e-3);
  EXPECT_LE(rep.dA, 2e-3);
  EXPECT_LE(rep.dB, 2e-3);
  return rep;
}

bool same_bits(const Out& a, const Out& b) {
  auto eq = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  return eq(a.u, b.u) && eq(a.gs, b.gs) && eq(a.y, b.y) && eq(a.dx, b.dx) && eq(a.dA, b.dA) && eq(a.dB, b.dB);
}

// Empty experts first, in the middle and last; one row; 64 (one full tile), 65 and 129 (a tile and a bit), 300
// (over four tiles and not a multiple of the gradient kernel's 32-row chunks); 9 rows of no expert after them.
const std::vector<int> kRagged{0, 37, 1, 0, 300, 64, 65, 0, 129, 0};

Case ragged(const std::string& name, int r) {
  // in = 200, out = 136: no multiple of 64 or 128; x, y and dx rows strided; the adapter at column 16 of y.
  return Case{name, kRagged, 9, r, 200, 136, 208, 160, 16, 216};
}

class CudaGroupedLora : public ::testing::TestWithParam<Case> {};

TEST_P(CudaGroupedLora, MatchesPerExpertReference) {
  const Host h = make_host(GetParam(), 11);
  const Out o = run_device(h);
  const Report rep = check_outputs(h, o);
  std::printf("[grouped_lora %s] n %lld, E %d, r %d, in %d, out %d: rel err u %.3g gs %.3g y %.3g dx %.3g dA %.3g "
              "dB %.3g\n",
              GetParam().name.c_str(), static_cast<long long>(h.n), h.E, h.c.r, h.c.in, h.c.out, rep.u, rep.gs,
              rep.y, rep.dx, rep.dA, rep.dB);
  // Deterministic: a second run from the same starting values gives the same bits.
  const Out o2 = run_device(h);
  EXPECT_TRUE(same_bits(o, o2)) << "two runs differ";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaGroupedLora,
    ::testing::Values(ragged("r12", 12), ragged("r16", 16), ragged("r1", 1), ragged("r8", 8), ragged("r33", 33),
                      ragged("r64", 64),
                      [] {
                        Case c = ragged("r16_no_dx", 16);
                        c.with_dx = false;
                        return c;
                      }(),
                      // Several 128-column chunks and 512-column slices, K over many pipeline stages; the adapter
                      // on the second half of a merged [gate | up] output.
                      Case{"wide", {5, 0, 200, 71}, 3, 16, 1160, 1096, 1160, 2192, 1096, 1160},
                      Case{"wide_r24", {130, 1, 0, 66}, 0, 24, 520, 1032, 528, 1032, 0, 520}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// MoE-like routing at a small width: 4096 rows over 288 experts drawn unevenly (many get none), the adapter on the up
// half of gu [n, 2I].
TEST(CudaGroupedLoraRouting, RandomRouting288Experts) {
  const int E = 288;
  std::mt19937 rng(5);
  std::vector<int> rows(E, 0);
  std::uniform_int_distribution<int> pick(0, E / 2);
  for (int i = 0; i < 4096; ++i) ++rows[pick(rng) * 2 % E];
  int empty = 0;
  for (int r : rows) empty += r == 0;
  ASSERT_GT(empty, 100);
  const Host h = make_host(Case{"routing", rows, 0, 16, 256, 128, 256, 256, 128, 256}, 23);
  const Out o = run_device(h);
  const Report rep = check_outputs(h, o);
  std::printf("[grouped_lora routing] 4096 rows / 288 experts (%d empty): rel err u %.3g gs %.3g y %.3g dx %.3g "
              "dA %.3g dB %.3g\n",
              empty, rep.u, rep.gs, rep.y, rep.dx, rep.dA, rep.dB);
}

// No host synchronisation: forward and backward capture into a CUDA graph, whose replay gives the eager run's bits.
TEST(CudaGroupedLoraRouting, CapturedGraphMatchesEager) {
  const Host h = make_host(ragged("graph", 16), 31);
  const Out eager = run_device(h);  // also makes the one-time shared-memory attribute calls
  const Out replay = run_device(h, true);
  check_outputs(h, replay);
  EXPECT_TRUE(same_bits(eager, replay)) << "graph replay differs from the eager run";
}

// Two adapters on the same rows and input (an MoE layer's gate and up, both on x, on the two halves of dy = dgu):
// grouped_lora_factor2 / grouped_lora_backward2 give the bits of one call per adapter, at ranks 8 and 16 (one
// padded rank, RP 16) and 24 and 32 (RP 32), with dx and without, over uneven experts (empty, one row, several
// tiles). Every output buffer starts from the same values in both runs (u and gs poisoned, the sums random). And
// with `overwrite`, the gradients are set instead of added to. And both forms reading x by index (GroupedLora::x_rows,
// as a training step reads the MoE's input by each row's token: rows repeated, in no order) give the bits of the
// gathered copy.
TEST(CudaGroupedLoraRouting, PairedFormsMatchOneCallPerAdapter) {
  const std::vector<int> rows{0, 5, 130, 0, 64, 200, 1};
  const int E = static_cast<int>(rows.size()), in = 200, out = 136;
  std::vector<int32_t> off{0};
  for (int r : rows) off.push_back(off.back() + r);
  const int64_t n = off.back() + 3, ldx = in + 8, lddy = 2 * out, lddx = in;  // 3 rows of another rank
  for (const int r : {8, 16, 24, 32})
    for (const bool with_dx : {true, false}) {
      SCOPED_TRACE("r " + std::to_string(r) + (with_dx ? " with dx" : " without dx"));
      const int ldr = cuda::grouped_lora_ld(r);
      const unsigned seed = 100 + r;
      // x [n, ldx] is the gather of src [T, ldx] by token (T = n/2 + 1 rows, each used about twice, in no order).
      const int64_t T = n / 2 + 1;
      const std::vector<uint16_t> src = to_bf16(test::randn(T * ldx, seed));
      std::vector<int32_t> token(n);
      std::vector<uint16_t> x(n * ldx);
      for (int64_t i = 0; i < n; ++i) {
        token[i] = static_cast<int32_t>((i * 37 + 11) % T);
        std::copy_n(src.begin() + token[i] * ldx, ldx, x.begin() + i * ldx);
      }
      const std::vector<uint16_t> dy = to_bf16(test::randn(n * lddy, seed + 1));
      std::vector<uint16_t> ab[4];  // A0, B0, A1, B1
      for (int i = 0; i < 4; ++i)
        ab[i] = to_bf16(test::randn(int64_t(E) * r * (i % 2 ? out : in), seed + 2 + i, i % 2 ? 0.05f : 0.07f));
      const std::vector<float> g0 = test::randn(int64_t(E) * r * (in + out) * 2, seed + 6, 0.1f);
      const std::vector<float> zero(g0.size(), 0.0f), nan(g0.size(), poison32());
      const std::vector<float> dx0 = test::randn(n * lddx, seed + 7);
      // paired: the two-part forms; overwrite: onto gradients that start as NaN.
      // by_index: x as src and the tokens (GroupedLora::x_rows).
      auto run = [&](bool paired, const std::vector<float>& grads0, bool overwrite = false, bool by_index = false) {
        DevBuf dsrc(src.size() * 2), dtok(token.size() * 4);
        upload(dsrc, src), upload(dtok, token);
        DevBuf dx_(x.size() * 2), ddy(dy.size() * 2), doff(off.size() * 4), dxo(dx0.size() * 4), grads(g0.size() * 4),
            u(2 * n * ldr * 2), gs(2 * n * ldr * 2), w(4 * ab[0].size() * 2 + 4 * ab[1].size() * 2),
            ptrs(6 * E * sizeof(void*));
        upload(dx_, x), upload(ddy, dy), upload(doff, off), upload(dxo, dx0), upload(grads, grads0);
        EXPECT_EQ(cudaMemset(u.p, 0xFF, u.bytes), cudaSuccess);
        EXPECT_EQ(cudaMemset(gs.p, 0xFF, gs.bytes), cudaSuccess);
        std::vector<const void*> p(6 * E);  // A0[E], B0[E], A1[E], B1[E], then dA0 | dB0 | dA1 | dB1 as float*
        cuda::bf16* wp = w.as<cuda::bf16>();
        for (int i = 0; i < 4; ++i) {
          EXPECT_EQ(cudaMemcpy(wp, ab[i].data(), ab[i].size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
          const int64_t each = int64_t(r) * (i % 2 ? out : in);
          for (int e = 0; e < E; ++e) p[i * E + e] = wp + e * each;
          wp += ab[i].size();
        }
        std::vector<float*> gp(4 * E);
        float* gq = grads.as<float>();
        for (int i = 0; i < 4; ++i) {
          const int64_t each = int64_t(r) * (i % 2 ? out : in);
          for (int e = 0; e < E; ++e) gp[i * E + e] = gq + e * each;
          gq += E * each;
        }
        DevBuf gptr(4 * E * sizeof(void*));
        upload(ptrs, p), upload(gptr, gp);
        const auto* pa = ptrs.as<const cuda::bf16* const>();
        float* const* pg = gptr.as<float* const>();
        const int32_t* rows = by_index ? dtok.as<int32_t>() : nullptr;
        const cuda::GroupedLora a0{doff.as<int32_t>(), E, r, in, out, pa, pa + E, 1.5f, rows};
        const cuda::GroupedLora a1{doff.as<int32_t>(), E, r, in, out, pa + 2 * E, pa + 3 * E, 1.5f, rows};
        EXPECT_TRUE(cuda::grouped_lora_pairable(a0, a1));
        cuda::bf16 *u0 = u.as<cuda::bf16>(), *u1 = u0 + n * ldr, *gs0 = gs.as<cuda::bf16>(), *gs1 = gs0 + n * ldr;
        const cuda::bf16 *xb = by_index ? dsrc.as<cuda::bf16>() : dx_.as<cuda::bf16>(), *dyb = ddy.as<cuda::bf16>();
        float* dxp = with_dx ? dxo.as<float>() : nullptr;
        if (paired) {
          cuda::grouped_lora_factor2(a0, a1, xb, ldx, n, u0, u1, nullptr);
          cuda::grouped_lora_backward2(a0, a1, pg, pg + E, pg + 2 * E, pg + 3 * E, xb, ldx, u0, u1, dyb, lddy, n, gs0,
                                       gs1, dxp, lddx, 0, out, nullptr, overwrite);
        } else {
          cuda::grouped_lora_factor(a0, xb, ldx, n, u0, nullptr);
          cuda::grouped_lora_factor(a1, xb, ldx, n, u1, nullptr);
          cuda::grouped_lora_backward(a0, pg, pg + E, xb, ldx, u0, dyb, lddy, n, gs0, dxp, lddx, 0, nullptr,
                                      overwrite);
          cuda::grouped_lora_backward(a1, pg + 2 * E, pg + 3 * E, xb, ldx, u1, dyb, lddy, n, gs1, dxp, lddx, out,
                                      nullptr, overwrite);
        }
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<uint16_t> uu = download<uint16_t>(u, 2 * n * ldr), gg = download<uint16_t>(gs, 2 * n * ldr);
        const std::vector<float> dd = download<float>(dxo, dx0.size()), gr = download<float>(grads, g0.size());
        std::vector<uint32_t> all;
        for (uint16_t v : uu) all.push_back(v);
        for (uint16_t v : gg) all.push_back(v);
        for (float v : dd) all.push_back(bits(v));
        for (float v : gr) all.push_back(bits(v));
        return all;
      };
      const std::vector<uint32_t> one = run(false, g0), two = run(true, g0);
      ASSERT_EQ(one.size(), two.size());
      size_t differ = 0;
      for (size_t i = 0; i < one.size(); ++i) differ += one[i] != two[i];
      EXPECT_EQ(differ, 0u) << "of " << one.size() << " output values";
      for (const bool paired : {false, true}) {
        const std::vector<uint32_t> indexed = run(paired, g0, false, true);
        ASSERT_EQ(indexed.size(), one.size());
        differ = 0;
        for (size_t i = 0; i < one.size(); ++i) differ += one[i] != indexed[i];
        EXPECT_EQ(differ, 0u) << (paired ? "paired" : "one call each") << ", x by index";
      }
      // Overwriting NaN gradients gives the sums added onto zeros (equal values: 0 + (−0) is +0), the empty experts'
      // zeros included; both forms.
      const std::vector<uint32_t> from_zero = run(false, zero);
      for (const bool paired : {false, true}) {
        const std::vector<uint32_t> over = run(paired, nan, true);
        ASSERT_EQ(over.size(), from_zero.size());
        const size_t grads_at = from_zero.size() - g0.size();
        size_t bad = 0;
        for (size_t i = 0; i < over.size(); ++i) {
          float a, b;
          std::memcpy(&a, &over[i], 4), std::memcpy(&b, &from_zero[i], 4);
          bad += i < grads_at ? over[i] != from_zero[i] : !(a == b);
        }
        EXPECT_EQ(bad, 0u) << (paired ? "paired" : "one call each") << ", overwriting";
      }
    }
}

// No rows: nothing is launched and nothing is touched.
TEST(CudaGroupedLoraRouting, NoRowsIsANoOp) {
  const Host h = make_host(Case{"empty", {0, 0, 0}, 0, 16, 64, 64, 64, 64, 0, 64}, 41);
  const Out o = run_device(h);
  ASSERT_EQ(o.dA.size(), h.dA0.size());
  ASSERT_EQ(o.dB.size(), h.dB0.size());
  EXPECT_EQ(std::memcmp(o.dA.data(), h.dA0.data(), h.dA0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(o.dB.data(), h.dB0.data(), h.dB0.size() * 4), 0);
}

}  // namespace
}  // namespace nextlm
