// `mhc_bwd_T4096`: the backward of one mHC site (post then pre) at T = 4096, S = 4, D = 4096, and
// `mhc_post_project_T4096` (see mhc_backward.h).
// A .cu (not .cpp) because cuda/backward_kernels.h and cuda/testing_buffers.h include common.cuh, whose device
// helpers only nvcc compiles.
#include "mhc_backward.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/backward_kernels.h"
#include "cuda/kernels.h"
#include "cuda/random_init.h"
#include "cuda/testing_buffers.h"
#include "device_timing.cuh"

namespace nextlm::bench {

namespace {

using cuda_testing::detail::Buf;

constexpr double kBytesPerMs = 4.14e12 / 1e3;  // ../shared/docs/performance.md
constexpr int kWarm = 3, kIters = 20;

// Elements of x that are not finite, added to *bad.
__global__ void count_nonfinite_kernel(const float* x, int64_t n, unsigned long long* bad) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    c += !isfinite(x[i]);
  if (c) atomicAdd(bad, c);
}

Buf floats(int64_t n) { return Buf(static_cast<size_t>(n) * sizeof(float)); }

void fill(const Buf& b, int64_t n, cuda::DistSpec d, uint64_t key, cudaStream_t st) {
  cuda::fill_random(b.p, false, n, d, key, st);
}

void zero(const Buf& b, cudaStream_t st) { NEXTLM_CUDA_CHECK(cudaMemsetAsync(b.p, 0, b.bytes, st)); }

// One site's forward inputs at T = 4096, S = 4, D = 4096, random (each tensor its own key): the streams h, the
// sub-layer output y, the mix (post, comb) and the mHC parameters (fn, base, scale, norm_w).
struct SiteInputs {
  static constexpr int64_t T = 4096, S = 4, D = 4096, M = (2 + S) * S, SD = S * D;
  Buf h = floats(T * SD), y = floats(T * D), post = floats(T * S), comb = floats(T * S * S), fn = floats(M * SD),
      base = floats(M), scale = floats(3), norm_w = floats(D);
  explicit SiteInputs(cudaStream_t st) {
    using cuda::Dist;
    fill(h, T * SD, {Dist::Normal, 1.0f, 0.0f}, 1, st);
    fill(y, T * D, {Dist::Normal, 1.0f, 0.0f}, 2, st);
    fill(post, T * S, {Dist::Uniform, 0.0f, 2.0f}, 3, st);
    fill(comb, T * S * S, {Dist::Uniform, 0.0f, 0.5f}, 4, st);
    fill(fn, M * SD, {Dist::Normal, 0.02f, 0.0f}, 7, st);
    fill(base, M, {Dist::Normal, 0.5f, 0.0f}, 8, st);
    fill(norm_w, D, {Dist::Uniform, 0.8f, 1.2f}, 9, st);
    const float sc[3] = {0.8f, 1.2f, 0.9f};
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(scale.p, sc, sizeof sc, cudaMemcpyHostToDevice, st));
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));  // sc is a host temporary
  }
  cuda::MhcParams params() const {
    return {fn.as<float>(), base.as<float>(), scale.as<float>(), norm_w.as<float>(), T, S, D, 1e-5f, 1e-6f, 20};
  }
};

// `mhc_bwd_frozen_T4096`: a frozen site's backward as the LoRA step runs it (dh alone, the forward's mix), the pre
// backward forming the post backward's dh term (ours) against the post backward writing it and the pre backward
// adding to it (peer), alternately timed; whether both give the same dh bits.
void frozen_case(const std::string& name, const cuda::MhcParams& p, const Buf& h, const Buf& y, const Buf& post,
                 const Buf& comb, const Buf& dout, const Buf& da, const Buf& mix, const Buf& work, const Buf& dh,
                 const Buf& dy, const Buf& dpost, const Buf& dcomb, cudaStream_t st) {
  const int64_t T = p.T, S = p.S, D = p.D, SD = S * D;
  auto site = [&](bool fold) {
    cuda::mhc_post_backward(h.as<float>(), y.as<float>(), post.as<float>(), comb.as<float>(), dout.as<float>(),
                            fold ? nullptr : dh.as<float>(), dy.as<float>(), dpost.as<float>(), dcomb.as<float>(), T,
                            S, D, st, false);
    cuda::mhc_pre_backward(p, h.as<float>(), dpost.as<float>(), dcomb.as<float>(), da.as<float>(), dh.as<float>(),
                           nullptr, nullptr, nullptr, nullptr, work.as<float>(), st, mix.as<float>(),
                           fold ? dout.as<float>() : nullptr, fold ? comb.as<float>() : nullptr);
  };
  std::vector<double> ours, peer;
  alternate_medians([&] { site(true); }, [&] { site(false); }, st, kWarm, kIters, 3, ours, peer);
  auto dh_bits = [&](bool fold) {
    site(fold);
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
    return cuda_testing::detail::download<float>(dh);
  };
  const std::vector<float> a = dh_bits(true), b = dh_bits(false);
  const bool same = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  bool finite = true;
  for (const float v : a) finite = finite && std::isfinite(v);
  // Bytes: post reads dout, h, y and writes dy (and dh without the fold); the statistics read h and da; the dh pass
  // reads h, da and dout (dh without the fold) and writes dh.
  const double fold_bytes = 4.0 * (5.0 * T * SD + 4.0 * T * D), two_bytes = fold_bytes + 4.0 * T * SD;
  char note[512];
  std::snprintf(note, sizeof note,
                "%s one frozen site (dh alone, the forward's mix), S=4 D=4096: the pre backward forming the post "
                "backward's dh term (%.2f GB) against the post backward writing it (peer, %.2f GB), alternately, "
                "medians of 3x%d runs: %.3f/%.3f/%.3f against %.3f/%.3f/%.3f ms; dh %s%s; floor at 4.14 TB/s",
                same && finite ? "ok" : "CHECK FAILED", fold_bytes / 1e9, two_bytes / 1e9, kIters, ours[0], ours[1],
                ours[2], peer[0], peer[1], peer[2], same ? "the same bits" : "DIFFERS", finite ? "" : ", NON-FINITE");
  std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"peer_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n",
              name.c_str(), ours[1], peer[1], fold_bytes / kBytesPerMs, note);
  std::fflush(stdout);
}

}  // namespace

void mhc_backward_case(const std::string& name) {
  constexpr int64_t T = SiteInputs::T, S = SiteInputs::S, D = SiteInputs::D, M = SiteInputs::M, SD = S * D;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  {
    const SiteInputs in(st);
    const Buf &h = in.h, &y = in.y, &post = in.post, &comb = in.comb;
    Buf dout = floats(T * SD), da = floats(T * D);
    Buf dh = floats(T * SD), dy = floats(T * D), dpost = floats(T * S), dcomb = floats(T * S * S),
        dfn = floats(M * SD), dbase = floats(M), dscale = floats(3), dnorm_w = floats(D);
    Buf work = floats(cuda::mhc_pre_backward_workspace_floats(T, S, D));
    using cuda::Dist;
    fill(dout, T * SD, {Dist::Normal, 1.0f, 0.0f}, 5, st);
    fill(da, T * D, {Dist::Normal, 1.0f, 0.0f}, 6, st);
    for (const Buf* b : {&dh, &dy, &dpost, &dcomb, &dfn, &dbase, &dscale, &dnorm_w}) zero(*b, st);
    const cuda::MhcParams p = in.params();
    // _forward_mix: the forward's mix of h (mhc_pre's, untimed), which the pre backward then reuses, as training's.
    const bool forward_mix =
        name.find("_forward_mix") != std::string::npos || name.find("_frozen") != std::string::npos;
    Buf mix = floats(forward_mix ? T * (M + 1) : 0);
    if (forward_mix) {
      Buf fpost = floats(T * S), fcomb = floats(T * S * S), fa(static_cast<size_t>(T * D) * sizeof(cuda::bf16)),
          fwork = floats(cuda::mhc_pre_workspace_floats(T, S, D));
      cuda::mhc_pre(p, h.as<float>(), fpost.as<float>(), fcomb.as<float>(), fa.as<cuda::bf16>(), fwork.as<float>(),
                    st, mix.as<float>());
      NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
    }

    auto post_bwd = [&] {
      cuda::mhc_post_backward(h.as<float>(), y.as<float>(), post.as<float>(), comb.as<float>(), dout.as<float>(),
                              dh.as<float>(), dy.as<float>(), dpost.as<float>(), dcomb.as<float>(), T, S, D, st);
    };
    auto pre_bwd = [&] {
      cuda::mhc_pre_backward(p, h.as<float>(), dpost.as<float>(), dcomb.as<float>(), da.as<float>(), dh.as<float>(),
                             dfn.as<float>(), dbase.as<float>(), dscale.as<float>(), dnorm_w.as<float>(),
                             work.as<float>(), st, mix.or_null<float>());
    };
    if (name.find("_frozen") != std::string::npos) {
      frozen_case(name, p, h, y, post, comb, dout, da, mix, work, dh, dy, dpost, dcomb, st);
      return;
    }
    // The gradients accumulate over the timed runs (the kernels add): they stay O(runs), far from overflow.
    const double ours = median_ms([&] { post_bwd(), pre_bwd(); }, st, kWarm, kIters);
    const double post_ms = median_ms(post_bwd, st, kWarm, kIters);
    const double pre_ms = median_ms(pre_bwd, st, kWarm, kIters);

    unsigned long long* bad = nullptr;
    NEXTLM_CUDA_CHECK(cudaMalloc(&bad, sizeof *bad));
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof *bad, st));
    for (const Buf* b : {&dh, &dy, &dpost, &dcomb, &dfn, &dbase, &dscale, &dnorm_w})
      count_nonfinite_kernel<<<1024, 256, 0, st>>>(b->as<float>(), static_cast<int64_t>(b->bytes / sizeof(float)),
                                                   bad);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    unsigned long long nonfinite = 0;
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(&nonfinite, bad, sizeof nonfinite, cudaMemcpyDeviceToHost, st));
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
    cudaFree(bad);

    // Two runs of the pre backward from zeroed gradients: the same bits (fixed summation orders, no atomics).
    auto pre_once = [&] {
      for (const Buf* b : {&dh, &dfn, &dbase, &dscale, &dnorm_w}) zero(*b, st);
      pre_bwd();
      NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
      std::vector<float> out;
      for (const Buf* b : {&dh, &dfn, &dbase, &dscale, &dnorm_w}) {
        const std::vector<float> v = cuda_testing::detail::download<float>(*b);
        out.insert(out.end(), v.begin(), v.end());
      }
      return out;
    };
    const std::vector<float> r1 = pre_once(), r2 = pre_once();
    const bool same = r1.size() == r2.size() && std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float)) == 0;

    const double post_bytes = 4.0 * (4.0 * T * SD + 3.0 * T * D);
    const double pre_bytes = 4.0 * (4.0 * T * SD + 2.0 * T * D + 3.0 * M * SD);
    const double floor = (post_bytes + pre_bytes) / kBytesPerMs;
    char note[512];
    std::snprintf(note, sizeof note,
                  "%s one site, S=4 D=4096%s: post %.3f ms (floor %.3f, %.2f GB), pre %.3f ms (floor %.3f, %.2f GB: h "
                  "and da read twice, dh read and written); %.0f%% of 4.14 TB/s; %llu non-finite outputs; pre "
                  "rerun %s",
                  nonfinite == 0 && same ? "ok" : "CHECK FAILED", forward_mix ? ", the forward's mix reused" : "",
                  post_ms, post_bytes / kBytesPerMs, post_bytes / 1e9,
                  pre_ms, pre_bytes / kBytesPerMs, pre_bytes / 1e9, 100.0 * floor / ours, nonfinite,
                  same ? "bitwise equal" : "DIFFERS");
    std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n", name.c_str(), ours,
                floor, note);
    std::fflush(stdout);
  }
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
}

void mhc_post_project_case(const std::string& name) {
  constexpr int64_t T = SiteInputs::T, S = SiteInputs::S, D = SiteInputs::D, M = SiteInputs::M, SD = S * D;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  {
    const SiteInputs in(st);
    const Buf &h = in.h, &y = in.y, &post = in.post, &comb = in.comb;
    Buf out = floats(T * SD), work = floats(cuda::mhc_pre_workspace_floats(T, S, D));
    const cuda::MhcParams p = in.params();
    bool fused = false;
    auto run = [&](bool fuse) {
      fused = cuda::mhc_post_project(h.as<float>(), out.as<float>(), y.as<float>(), post.as<float>(),
                                     comb.as<float>(), p, work.as<float>(), st, fuse);
    };
    std::vector<double> ours, peer;
    alternate_medians([&] { run(true); }, [&] { run(false); }, st, kWarm, kIters, 3, ours, peer);
    auto bits = [&](bool fuse) {
      for (const Buf* b : {&out, &work}) NEXTLM_CUDA_CHECK(cudaMemsetAsync(b->p, 0xFF, b->bytes, st));
      run(fuse);
      NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
      std::vector<float> v = cuda_testing::detail::download<float>(out);
      // The partials [S·D / 1024 chunks, T, M + 1] (the workspace's start).
      const std::vector<float> w = cuda_testing::detail::download<float>(work, (M + 1) * (SD / 1024) * T);
      v.insert(v.end(), w.begin(), w.end());
      return v;
    };
    const std::vector<float> a = bits(true);
    const bool one_kernel = fused;
    const std::vector<float> b = bits(false);
    bool same = a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    for (const float v : a) same = same && std::isfinite(v);
    // Bytes: h and y read, the new streams written (the two kernels read them back for the projection).
    const double bytes = 4.0 * (2.0 * T * SD + T * D), two = bytes + 4.0 * T * SD;
    char note[512];
    std::snprintf(note, sizeof note,
                  "%s one site's post-mix with the next site's projection, S=4 D=4096: one kernel%s (%.2f GB) "
                  "against the post-mix and projection kernels (peer, %.2f GB), alternately, medians of 3x%d runs: "
                  "%.3f/%.3f/%.3f against %.3f/%.3f/%.3f ms; new streams and partials %s; floor at 4.14 TB/s",
                  same && one_kernel ? "ok" : "CHECK FAILED", one_kernel ? "" : " (NOT FUSED)", bytes / 1e9,
                  two / 1e9, kIters, ours[0], ours[1], ours[2], peer[0], peer[1], peer[2],
                  same ? "the same bits" : "DIFFER or are not finite");
    std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"peer_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n",
                name.c_str(), ours[1], peer[1], bytes / kBytesPerMs, note);
    std::fflush(stdout);
  }
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace nextlm::bench
