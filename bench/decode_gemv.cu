// `decode_gemv`: decode_linear and moe_decode_gemv (src/cuda/gemv.cuh) at the slice's shapes against their byte
// floors, with cuBLASLt and the grouped GEMM timed beside them (see decode_gemv.h).
// A .cu (not .cpp) because cuda/gemm.h and cuda/testing_buffers.h include common.cuh, whose device helpers only nvcc
// compiles.
#include "decode_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include "cuda/decode_kernels.h"
#include "cuda/gemm.h"
#include "cuda/grouped_gemm.h"
#include "cuda/moe_decode.h"
#include "cuda/random_init.h"
#include "cuda/testing_buffers.h"

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

// Median milliseconds of f() (enqueued on st) after kWarm untimed runs.
template <class F>
double median_ms(F&& f, cudaStream_t st) {
  for (int i = 0; i < kWarm; ++i) f();
  cudaEvent_t a, b;
  NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
  NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < kIters; ++i) {
    NEXTLM_CUDA_CHECK(cudaEventRecord(a, st));
    f();
    NEXTLM_CUDA_CHECK(cudaEventRecord(b, st));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// ‖a − b‖ / ‖b‖ over n device elements (fp32 or bf16); a non-finite element gives +inf.
template <class T>
double rel_err(const T* a, const T* b, int64_t n) {
  std::vector<T> ha(n), hb(n);
  NEXTLM_CUDA_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(T), cudaMemcpyDeviceToHost));
  NEXTLM_CUDA_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(T), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    double x, y;
    if constexpr (sizeof(T) == 2) {
      x = __bfloat162float(ha[i]);
      y = __bfloat162float(hb[i]);
    } else {
      x = ha[i];
      y = hb[i];
    }
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
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
  const double err = rel_err(y.as<float>(), y_ref.as<float>(), M * out);

  int64_t it = 0;
  const double ours = median_ms(
      [&] { cuda::decode_linear(x.as<bf16>(), in, w0 + it++ % copies * elems, out, in, y.as<float>(), out, M, false,
                                st); },
      st);
  const double peer = median_ms(
      [&] { gemm.run(x.as<bf16>(), in, w0 + it++ % copies * elems, out, in, y_ref.as<float>(), out, M); }, st);
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

// Offsets [E+1] of `count` rows per expert.
std::vector<int32_t> offsets_of(const std::vector<int32_t>& count) {
  std::vector<int32_t> off(count.size() + 1, 0);
  for (size_t e = 0; e < count.size(); ++e) off[e + 1] = off[e] + count[e];
  return off;
}

// One MoE routing scenario: R rotations of the offsets (each over different experts, so that a rotation cycle reads
// far more than L2 holds).
struct Routing {
  std::string what;
  std::vector<std::vector<int32_t>> offsets;
};

// 8 experts with r rows each; rotation j takes experts 8j … 8j+7.
Routing eight_experts(int r, int rotations, int64_t E) {
  Routing ro{"8 distinct experts x " + std::to_string(r) + " rows", {}};
  for (int j = 0; j < rotations; ++j) {
    std::vector<int32_t> count(E, 0);
    for (int e = 8 * j; e < 8 * j + 8; ++e) count[e % E] = r;
    ro.offsets.push_back(offsets_of(count));
  }
  return ro;
}

// B tokens, each choosing k distinct experts uniformly at random; a different draw per rotation.
Routing random_tokens(int64_t B, int64_t k, int64_t E, int rotations) {
  Routing ro{"random top-" + std::to_string(k) + " routing of " + std::to_string(B) + " tokens", {}};
  std::mt19937 rng(4321);
  for (int j = 0; j < rotations; ++j) {
    std::vector<int32_t> count(E, 0);
    for (int64_t t = 0; t < B; ++t) {
      std::set<int32_t> chosen;
      while (int64_t(chosen.size()) < k) chosen.insert(static_cast<int32_t>(rng() % E));
      for (int32_t e : chosen) ++count[e];
    }
    ro.offsets.push_back(offsets_of(count));
  }
  return ro;
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
  }

  // The MoE experts of the slice: every expert's weights distinct (14.5 GB), as in moe_gemm.cu.
  const int64_t E = 288, D = 4096, I = 2048, k = 8;
  const float limit = 10.0f;
  const double expert_bytes = 2.0 * (2 * I * D + D * I);
  Buf w_gu(E * 2 * I * D * sizeof(bf16)), w_dn(E * D * I * sizeof(bf16));
  fill(w_gu.as<bf16>(), E * 2 * I * D, 201, 1.0f / std::sqrt(float(D)), st);
  fill(w_dn.as<bf16>(), E * D * I, 202, 1.0f / std::sqrt(float(I)), st);
  std::vector<const bf16*> h_gu(E), h_dn(E);
  for (int64_t e = 0; e < E; ++e) h_gu[e] = w_gu.as<bf16>() + e * 2 * I * D, h_dn[e] = w_dn.as<bf16>() + e * D * I;
  Buf p_gu = cuda_testing::detail::upload(h_gu), p_dn = cuda_testing::detail::upload(h_dn);
  Buf ws(cuda::grouped_gemm_workspace_ints(static_cast<int>(E)) * sizeof(int32_t));
  const int rotations = 4;
  const std::vector<std::pair<std::string, Routing>> scenarios{
      {"moe_8x1", eight_experts(1, rotations, E)},   {"moe_8x4", eight_experts(4, rotations, E)},
      {"moe_8x16", eight_experts(16, rotations, E)}, {"moe_8x32", eight_experts(32, rotations, E)},
      {"moe_b16", random_tokens(16, k, E, rotations)}, {"moe_b64", random_tokens(64, k, E, rotations)}};
  for (const auto& [suffix, ro] : scenarios) {
    const int64_t n = ro.offsets[0][E];
    std::vector<Buf> d_off;
    double distinct = 0;
    int max_rows = 0;
    for (const auto& off : ro.offsets) {
      d_off.push_back(cuda_testing::detail::upload(off));
      for (int64_t e = 0; e < E; ++e) {
        distinct += off[e + 1] > off[e];
        max_rows = std::max(max_rows, off[e + 1] - off[e]);
      }
    }
    distinct /= rotations;
    Buf x(n * D * sizeof(bf16)), act(n * I * sizeof(bf16)), out(n * D * sizeof(float));
    Buf act_p(n * I * sizeof(bf16)), out_p(n * D * sizeof(float));
    fill(x.as<bf16>(), n * D, 203, 1.0f, st);
    auto gemv_pair = [&](int r, bool gu, bool dn) {
      const int32_t* off = d_off[r].as<int32_t>();
      if (gu)
        cuda::moe_decode_gemv({x.as<bf16>(), off, p_gu.as<const bf16*>(), act.p, n, int(E), int(2 * I), int(D),
                               cuda::GroupedEpilogue::kSwiGLU, limit},
                              st);
      if (dn)
        cuda::moe_decode_gemv({act.as<bf16>(), off, p_dn.as<const bf16*>(), out.p, n, int(E), int(D), int(I),
                               cuda::GroupedEpilogue::kF32},
                              st);
    };
    auto gemm_pair = [&](int r) {
      const int32_t* off = d_off[r].as<int32_t>();
      const auto kern = cuda::GroupedGemmKernel::kWgmma128x256;
      cuda::grouped_gemm({x.as<bf16>(), off, p_gu.as<const bf16*>(), act_p.p, n, int(E), int(2 * I), int(D),
                          cuda::GroupedEpilogue::kSwiGLU, limit, kern},
                         ws.as<int32_t>(), st);
      cuda::grouped_gemm({act_p.as<bf16>(), off, p_dn.as<const bf16*>(), out_p.p, n, int(E), int(D), int(I),
                          cuda::GroupedEpilogue::kF32, 0.0f, kern},
                         ws.as<int32_t>(), st);
    };
    // Check on rotation 0 from poisoned outputs: act differs by bf16 roundings of sums in another order (~1e-3).
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(act.p, 0xFF, act.bytes, st));
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(out.p, 0xFF, out.bytes, st));
    gemv_pair(0, true, true);
    gemm_pair(0);
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
    const double err_act = rel_err(act.as<bf16>(), act_p.as<bf16>(), n * I),
                 err_out = rel_err(out.as<float>(), out_p.as<float>(), n * D);
    const bool ok = err_act <= 1e-2 && err_out <= 1e-2;

    int it = 0;
    const double ours = median_ms([&] { gemv_pair(it++ % rotations, true, true); }, st);
    const double ours_gu = median_ms([&] { gemv_pair(it++ % rotations, true, false); }, st);
    const double ours_dn = median_ms([&] { gemv_pair(it++ % rotations, false, true); }, st);
    const double peer = median_ms([&] { gemm_pair(it++ % rotations); }, st);
    const double floor = distinct * expert_bytes / kBytesPerMs;
    char note[600];
    std::snprintf(note, sizeof note,
                  "%s moe_decode_gemv, %s (%lld rows, %.1f experts, at most %d rows each): %.0f%% of 4.14 TB/s "
                  "(gate_up+SwiGLU %.4f ms, down %.4f ms); grouped_gemm %.0f%%, ours/peer %.2fx; check vs "
                  "grouped_gemm: act rel %.2g, out rel %.2g",
                  ok ? "ok" : "CHECK FAILED", ro.what.c_str(), static_cast<long long>(n), distinct, max_rows,
                  100.0 * floor / ours, ours_gu, ours_dn, 100.0 * floor / peer, peer / ours, err_act, err_out);
    emit(name + "_" + suffix, ours, floor, "grouped_gemm wgmma128x256", peer, note);
  }
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace nextlm::bench
