// `xent_R2048_V154880` (see xent.h). A .cu because cuda/backward_kernels.h and cuda/testing_buffers.h include
// common.cuh, whose device helpers only nvcc compiles.
#include "xent.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda/backward_kernels.h"
#include "cuda/random_init.h"
#include "cuda/testing_buffers.h"
#include "device_timing.cuh"

namespace nextlm::bench {

namespace {

using cuda_testing::detail::Buf;
using cuda_testing::detail::download;

constexpr double kBytesPerMs = 4.14e12 / 1e3;  // ../shared/docs/performance.md
constexpr int kWarm = 3, kIters = 20;

}  // namespace

void xent_case(const std::string& name) {
  const int64_t n = 2048, V = 154880;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  {
    Buf logits(static_cast<size_t>(n * V) * sizeof(float)), target(static_cast<size_t>(n) * sizeof(int32_t)),
        loss(static_cast<size_t>(n) * sizeof(double)), dl(static_cast<size_t>(n * V) * sizeof(cuda::bf16));
    // Logits of the head's scale (σ = 3), targets spread over the vocabulary, every 97th row without a term.
    cuda::fill_random(logits.p, false, n * V, {cuda::Dist::Normal, 3.0f, 0.0f}, 11, st);
    std::vector<int32_t> tg(n);
    for (int64_t r = 0; r < n; ++r) tg[r] = r % 97 == 5 ? -1 : static_cast<int32_t>((r * 7919) % V);
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(target.p, tg.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    auto run = [&](bool stream) {
      cuda::set_xent_stream(stream);
      cuda::softmax_xent_backward(logits.as<float>(), target.as<int32_t>(), nullptr, loss.as<double>(),
                                  dl.as<cuda::bf16>(), n, V, st);
    };
    std::vector<double> ours, peer;
    alternate_medians([&] { run(true); }, [&] { run(false); }, st, kWarm, kIters, 3, ours, peer);
    auto outputs = [&](bool stream, std::vector<double>& l, std::vector<cuda::bf16>& d) {
      run(stream);
      NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
      l = download<double>(loss);
      d = download<cuda::bf16>(dl);
    };
    std::vector<double> la, lb;
    std::vector<cuda::bf16> da, db;
    outputs(true, la, da);
    outputs(false, lb, db);
    cuda::set_xent_stream(true);
    bool finite = true, same_loss = true;
    for (int64_t r = 0; r < n; ++r) {
      finite = finite && std::isfinite(la[r]);
      same_loss = same_loss && std::fabs(la[r] - lb[r]) <= 1e-6 * std::max(1.0, std::fabs(lb[r]));
    }
    // A bf16 step at the larger of the two, or 1e-8 absolute (the smallest probabilities).
    int64_t off = 0;
    for (int64_t i = 0; i < n * V; ++i) {
      const float a = __bfloat162float(da[i]), b = __bfloat162float(db[i]);
      finite = finite && std::isfinite(a);
      if (std::fabs(a - b) > std::max(1e-8f, std::max(std::fabs(a), std::fabs(b)) / 128.0f)) ++off;
    }
    const double bytes = static_cast<double>(n) * V * (sizeof(float) + sizeof(cuda::bf16));
    char note[640];
    std::snprintf(note, sizeof note,
                  "%s %lld rows x V=%lld fp32 logits (sigma 3), loss and bf16 dlogits: the streaming kernel (a "
                  "cluster of 8 CTAs a row, each logit read once) against the block-a-row kernel (peer: each row "
                  "read twice), alternately, medians of 3x%d runs: %.3f/%.3f/%.3f against %.3f/%.3f/%.3f ms; losses "
                  "%s, dlogits %s (%lld elements off by more than a bf16 step)%s; floor: the logits read once and "
                  "dlogits written (%.2f GB) at 4.14 TB/s",
                  finite && same_loss && off == 0 ? "ok" : "CHECK FAILED", static_cast<long long>(n),
                  static_cast<long long>(V), kIters, ours[0], ours[1], ours[2], peer[0], peer[1], peer[2],
                  same_loss ? "within 1e-6" : "DIFFER", off == 0 ? "within a bf16 step" : "DIFFER",
                  static_cast<long long>(off), finite ? "" : ", NON-FINITE", bytes / 1e9);
    std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"peer_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n",
                name.c_str(), ours[1], peer[1], bytes / kBytesPerMs, note);
    std::fflush(stdout);
  }
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace nextlm::bench
