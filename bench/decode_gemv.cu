// `decode_gemv`: decode_linear (src/cuda/gemv.cuh) at the slice's shapes against its byte floor, with cuBLASLt timed
// beside it (see decode_gemv.h).
// A .cu (not .cpp) because cuda/gemm.h and cuda/testing_buffers.h include common.cuh, whose device helpers only nvcc
// compiles.
#include "decode_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda/decode_kernels.h"
#include "cuda/gemm.h"
#include "cuda/random_init.h"
#include "cuda/testing_buffers.h"
#include "device_timing.cuh"

namespace nextlm::bench {

namespace {

using cuda::bf16;
using cuda_testing::detail::Buf;

constexpr double kBytesPerMs = 4.14e12 / 1e3;       // ../shared/docs/performance.md
constexpr int64_t kRotateBytes = int64_t{256} << 20;  // weight bytes read between two reads of the same copy
constexpr int kWarm = 3, kIters = 30;

void fill(bf16* x, int64_t n, uint64_t key, float scale, cudaStream_t st) {
  cuda::fill_random(x, true, n, {cuda::Dist::Normal, scale, 0.0f}, key, st);
}

void emit(const std::string& name, double ours, double floor, const std::string& peer, double peer_ms,
          const std::string& note) {
  std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"floor_ms\": %.4f, \"peer\": \"%s\", \"peer_ms\": %.4f, "
              "\"note\": \"%s\"}\n",
              name.c_str(), ours, floor, peer.c_str(), peer_ms, note.c_str());
  std::fflush(stdout);
}

// decode_linear on M rows of x against a weight [out, in], rotated over copies of ≥ kRotateBytes in all.
void linear_line(const std::string& name, int64_t out, int64_t in, int64_t M, cuda::Gemm& gemm, cudaStream_t st) {
  const int64_t elems = out * in, bytes = 2 * elems;
  const int64_t copies = std::max<int64_t>(1, (kRotateBytes + bytes - 1) / bytes);
  Buf w(copies * bytes), x(M * in * sizeof(bf16)), y(M * out * sizeof(float)), y_ref(M * out * sizeof(float));
  fill(w.as<bf16>(), copies * elems, 101, 1.0f / std::sqrt(float(in)), st);
  fill(x.as<bf16>(), M * in, 102, 1.0f, st);
  const bf16* w0 = w.as<bf16>();
  // Check on copy 0: the same bf16 inputs and fp32 accumulation on both sides, so ~1e-6.
  NEXTLM_CUDA_CHECK(cudaMemsetAsync(y.p, 0xFF, y.bytes, st));
  cuda::decode_linear(x.as<bf16>(), in, w0, out, in, y.as<float>(), out, M, false, st);
  gemm.run(x.as<bf16>(), in, w0, out, in, y_ref.as<float>(), out, M);
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  const double err = device_rel_err(y.as<float>(), y_ref.as<float>(), M * out);

  int64_t it = 0;
  const double ours = median_ms(
      [&] { cuda::decode_linear(x.as<bf16>(), in, w0 + it++ % copies * elems, out, in, y.as<float>(), out, M, false,
                                st); },
      st, kWarm, kIters);
  const double peer = median_ms(
      [&] { gemm.run(x.as<bf16>(), in, w0 + it++ % copies * elems, out, in, y_ref.as<float>(), out, M); }, st,
      kWarm, kIters);
  const double floor = bytes / kBytesPerMs;
  char note[400];
  std::snprintf(note, sizeof note,
                "%s decode_linear %lldx%lld M=%lld: %.0f GB/s = %.0f%% of 4.14 TB/s (%.1f MB of weights, %lld "
                "copies rotated); cuBLASLt %.0f%%; check vs cuBLASLt rel %.2g",
                err <= 1e-3 ? "ok" : "CHECK FAILED", static_cast<long long>(out), static_cast<long long>(in),
                static_cast<long long>(M), bytes / ours / 1e6, 100.0 * floor / ours, bytes / 1e6,
                static_cast<long long>(copies), 100.0 * floor / peer, err);
  emit(name, ours, floor, "cuBLASLt", peer, note);
}

}  // namespace

void decode_gemv_case(const std::string& name) {
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  {
    cuda::Gemm gemm(st);
    const struct {
      int64_t out, in;
      std::vector<int64_t> Ms;
    } shapes[] = {{154880, 4096, {1, 16, 64}},  // lm_head
                  {24576, 4096, {1, 16, 64}},   // KDA q|k|v
                  {4096, 8192, {1}},            // KDA o_proj
                  {8192, 4096, {1}},            //
                  {4096, 2048, {1}}};           // an expert's down projection
    for (const auto& s : shapes)
      for (int64_t M : s.Ms)
        linear_line(name + "_" + std::to_string(s.out) + "x" + std::to_string(s.in) + "_m" + std::to_string(M), s.out,
                    s.in, M, gemm, st);
  }  // the Gemm goes before its stream
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace nextlm::bench
