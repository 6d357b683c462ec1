// The device gradient norm and AdamW update (src/cuda/optim.cu) against the host's clip_grad_norm and AdamW::step
// (src/model/optim.cpp) over several consecutive steps: tensors of odd sizes (1, 3, 1000, 65537, 300000, an empty
// one with null pointers), decay on some, gradients that change from step to step, a gradient scale, clipping
// disabled, enabled but inactive, and active, 16-byte aligned tensors (the float4 path) and tensors packed at odd
// offsets (the scalar path), a bf16 copy of the weights, and a LoRA-like list of hundreds of tensors. Every tensor
// sits in a flat buffer between guard elements that must survive; the bf16 copy starts poisoned. Runs on a GPU
// machine (part of test_cuda, CTest label "gpu").
//
// Tolerances: the device applies the host's fp32 operations in the host's order with IEEE sqrt and division and no
// FMA, so with the same clipping coefficient the update is the host's bit for bit (checked where the host build
// cannot contract FMAs). The norm sums the same exact double terms in another order: ~1e-16 relative, checked at
// 1e-12. When clipping is active the coefficient (float)(max_norm / (norm + 1e-6)) could round one fp32 ulp apart,
// moving g', m, v and w by about an ulp: w, m and v are checked to 1e-6 (~8 ulps) relative to the element, with an
// absolute floor of 1e-6 × the tensor's RMS for elements where a subtraction cancelled.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/optim.h"
#include "io/safetensors.h"
#include "model/optim.h"
#include "cuda_test_buffer.h"
#include "test_util.h"

namespace nextlm {
namespace {

using cuda::DeviceParam;

using test::DevBuf;
using test::download;
using test::upload;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Guard values between and after the tensors: the fp32 state's must stay as they are; the gradient's are huge, so a
// norm that read one would be off by orders of magnitude; the bf16 copy's are NaN (the poison of the whole buffer).
constexpr float kGuard = -12345.0f;
constexpr float kGradGuard = 1e18f;
constexpr uint16_t kPoison16 = 0xFFFF;

struct Case {
  std::string name;
  std::vector<int64_t> sizes;
  float scale;        // the gradient scale (the device multiplies the raw gradient, the host is given scale·g)
  double max_norm;    // 0: clipping off (sq passed as null); otherwise the clip_grad_norm threshold
  bool aligned;       // tensors 16-byte aligned in their flat buffers (else packed at odd offsets)
  bool bf16_copy;
  int64_t start_t;    // 0: zero moments; else random moments and AdamW resumed at this step count
  int steps;
  bool expect_clip;   // at least one step clips and at least one does not (checked, so the case is what it says)
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// The flat-buffer layout: tensor k at element off[k] of every buffer, gaps of guard elements between tensors and at
// both ends. Aligned: offsets are multiples of 64 elements. Packed: one guard element apart, from offset 1, so the
// tensors' starts fall on every residue mod 4 (most take the scalar path, those that land on a 16-byte boundary in
// every buffer the float4 path).
struct Layout {
  std::vector<int64_t> off;
  int64_t total = 0;
  Layout(const std::vector<int64_t>& sizes, bool aligned) {
    int64_t pos = aligned ? 0 : 1;
    for (int64_t n : sizes) {
      off.push_back(pos);
      pos += n + 1;
      if (aligned) pos = (pos + 63) / 64 * 64;
    }
    total = pos + 64;
  }
};

struct Outcome {
  std::vector<double> sq;                        // the device's squared norm at each step
  std::vector<std::vector<float>> w, m, v;       // each tensor after the last step
  std::vector<std::vector<uint16_t>> w16;
};

// Elements of got outside |got − want| <= 1e-6·(|want| + rms(want)), or not finite; counts bitwise-equal ones.
struct Compare {
  size_t bad = 0, equal = 0, total = 0;
  double worst = 0.0;  // the largest |got − want| / (|want| + rms)
  double equal_share() const { return total ? double(equal) / double(total) : 1.0; }
  void add(const float* got, const float* want, int64_t n) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += double(want[i]) * want[i];
    const double rms = n ? std::sqrt(ss / double(n)) : 0.0;
    for (int64_t i = 0; i < n; ++i) {
      ++total;
      equal += bits(got[i]) == bits(want[i]);
      const double d = std::fabs(double(got[i]) - want[i]), lim = std::fabs(double(want[i])) + rms;
      if (!std::isfinite(got[i]) || !(d <= 1e-6 * lim)) {
        ++bad;
        continue;
      }
      if (lim > 0) worst = std::max(worst, d / lim);
    }
  }
};

// The host build has no FMA to contract into (x86-64 without -mfma): AdamW::step's arithmetic is then the device's
// exactly, and with an equal clipping coefficient every element must match bit for bit.
#if defined(__x86_64__) && !defined(__FMA__)
constexpr bool kHostIsPlainIeee = true;
#else
constexpr bool kHostIsPlainIeee = false;
#endif

// Runs c.steps updates on the host and the device from the same initial state; checks each step's norm, w, m, v,
// the bf16 copy, finiteness and the guards. Returns the device's results.
Outcome run_case(const Case& c, unsigned seed) {
  const int count = static_cast<int>(c.sizes.size());
  const Layout L(c.sizes, c.aligned);
  const AdamWOptions opt;  // lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1
  Outcome out;

  // Host state: weights, moments, and the step count.
  std::vector<std::vector<float>> hw(count), hg(count);
  std::vector<int> decay(count);
  std::vector<ParamRef> refs(count);
  for (int k = 0; k < count; ++k) {
    hw[k] = test::randn(c.sizes[k], seed + 100 * k + 1, 0.02f);
    hg[k].assign(c.sizes[k], 0.0f);
    decay[k] = k % 3 != 1;
    refs[k].name = "t" + std::to_string(k);
    refs[k].w = hw[k].data();
    refs[k].g = hg[k].data();
    refs[k].n = c.sizes[k];
    refs[k].decay = decay[k] != 0;
  }
  AdamW adam(refs, opt);
  if (c.start_t > 0) {
    adam.set_steps(c.start_t);
    for (int k = 0; k < count; ++k) {
      adam.m()[k] = test::randn(c.sizes[k], seed + 100 * k + 2, 0.01f);
      adam.v()[k] = test::randn(c.sizes[k], seed + 100 * k + 3, 0.01f);
      for (float& x : adam.v()[k]) x *= x;
    }
  }

  // Device state: flat buffers with guards; the descriptors; the workspace.
  auto flat = [&](const std::vector<std::vector<float>>& per_tensor, float guard) {
    std::vector<float> f(L.total, guard);
    for (int k = 0; k < count; ++k) std::copy(per_tensor[k].begin(), per_tensor[k].end(), f.begin() + L.off[k]);
    return f;
  };
  const size_t bytes = size_t(L.total) * 4;
  DevBuf dw(bytes), dg(bytes), dm(bytes), dv(bytes), dw16(size_t(L.total) * 2), dparams(count * sizeof(DeviceParam)),
      dsq(sizeof(double));
  EXPECT_TRUE(dw.p && dg.p && dm.p && dv.p && dw16.p && dparams.p && dsq.p);
  if (!dw.p || !dg.p || !dm.p || !dv.p || !dw16.p || !dparams.p || !dsq.p) return out;
  upload(dw, flat(hw, kGuard));
  upload(dm, flat(adam.m(), kGuard));
  upload(dv, flat(adam.v(), kGuard));
  EXPECT_EQ(cudaMemset(dw16.p, 0xFF, size_t(L.total) * 2), cudaSuccess);
  std::vector<DeviceParam> host_params(count);
  for (int k = 0; k < count; ++k) {
    const bool empty = c.sizes[k] == 0;  // an empty tensor gets null pointers: the kernels must not touch it
    const int64_t o = L.off[k];
    host_params[k] = DeviceParam{empty ? nullptr : dw.as<float>() + o,
                                 empty ? nullptr : dg.as<float>() + o,
                                 empty ? nullptr : dm.as<float>() + o,
                                 empty ? nullptr : dv.as<float>() + o,
                                 empty || !c.bf16_copy ? nullptr : dw16.as<cuda::bf16>() + o,
                                 c.sizes[k],
                                 decay[k]};
  }
  upload(dparams, host_params);
  const int64_t chunks = cuda::optim_chunks(host_params.data(), count);
  DevBuf dws(size_t(cuda::optim_workspace_bytes(count, chunks)));
  EXPECT_EQ(cudaMemset(dws.p, 0xFF, dws.bytes), cudaSuccess);  // the launchers must not rely on its contents
  cudaStream_t st;
  EXPECT_EQ(cudaStreamCreate(&st), cudaSuccess);

  int clipped = 0, unclipped = 0;
  const float gstd[] = {1.0f, 0.25f, 3.0f, 0.5f};
  for (int s = 0; s < c.steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    // The raw gradient to the device; the host is given scale·g in fp32, the trainer's gradient after its scaling.
    std::vector<std::vector<float>> raw(count);
    for (int k = 0; k < count; ++k) {
      raw[k] = test::randn(c.sizes[k], seed + 100 * k + 10 + s, gstd[s % 4]);
      for (int64_t i = 0; i < c.sizes[k]; ++i) hg[k][i] = c.scale * raw[k][i];
    }
    upload(dg, flat(raw, kGradGuard));

    const double lr = lr_at(c.start_t + s, 100, 10, opt.lr);
    const double norm = clip_grad_norm(refs, c.max_norm);
    adam.step(refs, lr);
    const bool clips = c.max_norm > 0 && norm > c.max_norm;
    (clips ? clipped : unclipped) += 1;

    EXPECT_EQ(cudaMemset(dsq.p, 0xFF, sizeof(double)), cudaSuccess);
    cuda::grad_sq_norm(dparams.as<DeviceParam>(), count, chunks, c.scale, dsq.as<double>(), dws.p, st);
    cuda::adamw_update(dparams.as<DeviceParam>(), count, chunks, c.max_norm > 0 ? dsq.as<double>() : nullptr,
                       c.scale, c.max_norm, lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, adam.steps(), dws.p,
                       st);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);

    const double sq = download<double>(dsq, 1)[0];
    out.sq.push_back(sq);
    EXPECT_TRUE(std::isfinite(sq));
    EXPECT_NEAR(std::sqrt(sq), norm, 1e-12 * norm) << "the device norm";

    const std::vector<float> gw = download<float>(dw, L.total), gm = download<float>(dm, L.total),
                             gv = download<float>(dv, L.total);
    const std::vector<uint16_t> gw16 = download<uint16_t>(dw16, L.total);
    Compare cw, cm, cv;
    size_t w16_bad = 0, guard_bad = 0;
    std::vector<char> inside(L.total, 0);
    for (int k = 0; k < count; ++k) {
      const int64_t o = L.off[k], n = c.sizes[k];
      cw.add(gw.data() + o, hw[k].data(), n);
      cm.add(gm.data() + o, adam.m()[k].data(), n);
      cv.add(gv.data() + o, adam.v()[k].data(), n);
      for (int64_t i = 0; i < n; ++i) {
        inside[o + i] = 1;
        // The copy is bf16 of the device's own new w (round to nearest even), or untouched when absent.
        const uint16_t want = c.bf16_copy ? f32_to_bf16(gw[o + i]) : kPoison16;
        w16_bad += gw16[o + i] != want;
      }
    }
    for (int64_t i = 0; i < L.total; ++i)
      if (!inside[i])
        guard_bad += bits(gw[i]) != bits(kGuard) || bits(gm[i]) != bits(kGuard) || bits(gv[i]) != bits(kGuard) ||
                     gw16[i] != kPoison16;
    std::printf("[optim %s] step %d (t=%lld, %s): norm %.6g rel diff %.2g; bitwise equal w %.4f m %.4f v %.4f; "
                "worst rel w %.2g m %.2g v %.2g\n",
                c.name.c_str(), s, static_cast<long long>(adam.steps()), clips ? "clipped" : "not clipped", norm,
                norm > 0 ? std::fabs(std::sqrt(sq) - norm) / norm : 0.0, cw.equal_share(), cm.equal_share(),
                cv.equal_share(), cw.worst, cm.worst, cv.worst);
    EXPECT_EQ(cw.bad, 0u) << "w elements outside the tolerance (of " << cw.total << ")";
    EXPECT_EQ(cm.bad, 0u) << "m elements outside the tolerance";
    EXPECT_EQ(cv.bad, 0u) << "v elements outside the tolerance";
    EXPECT_EQ(w16_bad, 0u) << "bf16 copy elements that are not bf16(w)" << (c.bf16_copy ? "" : " (absent: untouched)");
    EXPECT_EQ(guard_bad, 0u) << "guard elements overwritten (a write outside a tensor)";
    if (kHostIsPlainIeee && !clips) {
      // coef = 1 on both sides: AdamW::step's arithmetic exactly.
      EXPECT_EQ(cw.equal, cw.total) << "w differs from AdamW::step's in some bits: a different operation order or an "
                                       "FMA contraction on the device";
      EXPECT_EQ(cm.equal, cm.total);
      EXPECT_EQ(cv.equal, cv.total);
    }
    if (s + 1 == c.steps) {
      for (int k = 0; k < count; ++k) {
        const int64_t o = L.off[k], n = c.sizes[k];
        out.w.emplace_back(gw.begin() + o, gw.begin() + o + n);
        out.m.emplace_back(gm.begin() + o, gm.begin() + o + n);
        out.v.emplace_back(gv.begin() + o, gv.begin() + o + n);
        out.w16.emplace_back(gw16.begin() + o, gw16.begin() + o + n);
      }
    }
  }
  if (c.expect_clip) {
    EXPECT_GT(clipped, 0) << "the case should clip at some step";
    EXPECT_GT(unclipped, 0) << "the case should not clip at some step";
  } else if (c.max_norm > 0) {
    EXPECT_EQ(clipped, 0) << "the case should never clip";
  }
  cudaStreamDestroy(st);
  return out;
}

// Odd sizes: one element, three (no full float4 group), 1000, an empty tensor, 65537 (four full chunks and one
// element), 300000 (19 chunks, the last partial), and 4 (one group). With scale 1/64 and gradient stds 1, 0.25, 3
// the norms are ~9.6, 2.4, 29: max_norm 5 clips the first and third step and not the second.
const std::vector<int64_t> kOdd{1, 3, 1000, 0, 65537, 300000, 4};

// A LoRA-like list: 300 tensors of 4K to 131K elements (sizes not multiples of 4 included) and one of 1.5M.
std::vector<int64_t> lora_like_sizes() {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int64_t> pick(4096, 131072);
  std::vector<int64_t> s;
  for (int i = 0; i < 300; ++i) s.push_back(i % 5 == 0 ? pick(rng) : pick(rng) / 16 * 16);
  s.insert(s.begin() + 150, 1500000);
  return s;
}

class CudaOptim : public ::testing::TestWithParam<Case> {};

TEST_P(CudaOptim, MatchesHostClipAndAdamW) { run_case(GetParam(), 1000); }

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaOptim,
    ::testing::Values(Case{"off_aligned", kOdd, 1.0f / 64, 0.0, true, true, 0, 3, false},
                      Case{"clip_aligned", kOdd, 1.0f / 64, 5.0, true, true, 0, 3, true},
                      Case{"clip_packed", kOdd, 1.0f / 64, 5.0, false, true, 0, 3, true},
                      Case{"inactive_packed_no_bf16", kOdd, 1.0f, 1e6, false, false, 0, 3, false},
                      Case{"resumed_clip_aligned", kOdd, 0.5f, 200.0, true, true, 10, 4, true},
                      Case{"lora_like", lora_like_sizes(), 1.0f / 1024, 3.0, true, true, 0, 2, true}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
bool same_bits(const Outcome& a, const Outcome& b) {
  if (!same_bits(a.sq, b.sq) || a.w.size() != b.w.size()) return false;
  for (size_t k = 0; k < a.w.size(); ++k)
    if (!same_bits(a.w[k], b.w[k]) || !same_bits(a.m[k], b.m[k]) || !same_bits(a.v[k], b.v[k]) ||
        !same_bits(a.w16[k], b.w16[k]))
      return false;
  return true;
}

// Two runs are bitwise equal, and so is the same list at other alignments: the norm's summation order depends on
// the sizes only (float4 or scalar reads sum the same groups in the same order), and the update is elementwise.
TEST(CudaOptimDeterminism, RepeatableAndIndependentOfAlignment) {
  const Case aligned{"det_aligned", kOdd, 1.0f / 64, 5.0, true, true, 0, 3, true};
  Case packed = aligned;
  packed.name = "det_packed";
  packed.aligned = false;
  const Outcome a = run_case(aligned, 77), b = run_case(aligned, 77), p = run_case(packed, 77);
  ASSERT_EQ(a.sq.size(), 3u);
  EXPECT_TRUE(same_bits(a, b)) << "two runs differ";
  EXPECT_TRUE(same_bits(a, p)) << "the packed (scalar path) run differs from the aligned (float4 path) one";
}

// Lists with nothing to update: no tensors, or only empty ones (null pointers). The norm is 0, the update enqueues
// nothing, and neither fails.
TEST(CudaOptimEdge, EmptyListsAreNoOps) {
  DevBuf dsq(sizeof(double));
  ASSERT_TRUE(dsq.p);
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  std::vector<DeviceParam> empties(3, DeviceParam{nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1});
  DevBuf dparams(empties.size() * sizeof(DeviceParam));
  ASSERT_TRUE(dparams.p);
  upload(dparams, empties);
  for (int count : {0, 3}) {
    SCOPED_TRACE("count " + std::to_string(count));
    const DeviceParam* params = count ? dparams.as<DeviceParam>() : nullptr;
    const int64_t chunks = cuda::optim_chunks(empties.data(), count);
    EXPECT_EQ(chunks, 0);
    DevBuf ws(size_t(cuda::optim_workspace_bytes(count, chunks)));
    ASSERT_TRUE(ws.p);
    ASSERT_EQ(cudaMemset(dsq.p, 0xFF, sizeof(double)), cudaSuccess);
    cuda::grad_sq_norm(params, count, chunks, 1.0f, dsq.as<double>(), ws.p, st);
    cuda::adamw_update(params, count, chunks, dsq.as<double>(), 1.0f, 1.0, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, ws.p, st);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(download<double>(dsq, 1)[0], 0.0);
  }
  cudaStreamDestroy(st);
}

// The host-side checks: the chunk count of a list, and the arguments the launchers refuse.
TEST(CudaOptimEdge, ChunkCountsAndArgumentChecks) {
  std::vector<DeviceParam> ps(4, DeviceParam{nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0});
  ps[0].n = 1, ps[1].n = cuda::kOptimChunk, ps[2].n = cuda::kOptimChunk + 1, ps[3].n = 0;
  EXPECT_EQ(cuda::optim_chunks(ps.data(), 4), 1 + 1 + 2 + 0);
  ps[3].n = -1;
  EXPECT_THROW(cuda::optim_chunks(ps.data(), 4), Error);
  EXPECT_THROW(cuda::adamw_update(nullptr, 0, 0, nullptr, 1.0f, 1.0, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, nullptr, nullptr),
               Error);  // clipping without a norm
  EXPECT_THROW(cuda::adamw_update(nullptr, 0, 0, nullptr, 1.0f, 0.0, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0, nullptr, nullptr),
               Error);  // t = 0
}

// No host synchronisation inside: one step captures into a CUDA graph, and its replay equals direct launches from
// the same state bit for bit.
TEST(CudaOptimEdge, StepCapturesIntoAGraph) {
  const std::vector<int64_t> sizes{5, 40000, 123};
  const int count = 3;
  const Layout L(sizes, false);
  const std::vector<float> w0 = test::randn(L.total, 5, 0.02f), g = test::randn(L.total, 6, 1.0f),
                           mv(L.total, 0.0f);
  std::vector<std::vector<float>> result;
  for (bool graph : {false, true}) {
    DevBuf dw(L.total * 4), dg(L.total * 4), dm(L.total * 4), dv(L.total * 4), dsq(8),
        dparams(count * sizeof(DeviceParam));
    ASSERT_TRUE(dw.p && dg.p && dm.p && dv.p && dsq.p && dparams.p);
    upload(dw, w0);
    upload(dg, g);
    upload(dm, mv);
    upload(dv, mv);
    std::vector<DeviceParam> ps(count);
    for (int k = 0; k < count; ++k)
      ps[k] = DeviceParam{dw.as<float>() + L.off[k], dg.as<float>() + L.off[k], dm.as<float>() + L.off[k],
                          dv.as<float>() + L.off[k], nullptr, sizes[k], 1};
    upload(dparams, ps);
    const int64_t chunks = cuda::optim_chunks(ps.data(), count);
    DevBuf ws(size_t(cuda::optim_workspace_bytes(count, chunks)));
    ASSERT_TRUE(ws.p);
    cudaStream_t st;
    ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
    auto step = [&] {
      cuda::grad_sq_norm(dparams.as<DeviceParam>(), count, chunks, 0.5f, dsq.as<double>(), ws.p, st);
      cuda::adamw_update(dparams.as<DeviceParam>(), count, chunks, dsq.as<double>(), 0.5f, 10.0, 1e-3, 0.9, 0.95,
                         1e-8, 0.1, 1, ws.p, st);
    };
    if (graph) {
      cudaGraph_t gr = nullptr;
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
      step();
      ASSERT_EQ(cudaStreamEndCapture(st, &gr), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec, gr, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(gr);
    } else {
      step();
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    }
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    result.push_back(download<float>(dw, L.total));
    cudaStreamDestroy(st);
  }
  ASSERT_EQ(result.size(), 2u);
  EXPECT_TRUE(same_bits(result[0], result[1])) << "graph replay differs from direct launches";
  EXPECT_FALSE(same_bits(result[0], w0)) << "the step changed nothing";
}

}  // namespace
}  // namespace nextlm
