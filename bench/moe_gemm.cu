// `moe_grouped_gemm` and `moe_grouped_gemm_dx`: the grouped expert GEMM at the 4-layer slice's shapes (the forward
// pair, and the backward's input-gradient pair in the w_kn form) against cuBLASLt in the same run.
// A .cu (not .cpp) because cuda/gemm.h includes common.cuh, whose device helpers only nvcc compiles; it also holds
// the benchmark's random-fill kernel.
#include "moe_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/gemm.h"
#include "cuda/device_model.h"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_lora.h"
#include "cuda/kernels.h"
#include "device_timing.cuh"

namespace nextlm::bench {

namespace {

using cuda::bf16;

constexpr double kFlopsPerMs = 729e12 / 1e3;  // ../shared/docs/performance.md
constexpr double kBytesPerMs = 4.14e12 / 1e3;

// Normal(0, scale) from a counter hash (splitmix64 → Box–Muller), independent of the launch shape.
__global__ void fill_normal_kernel(bf16* x, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * uint64_t(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u1 = (float(uint32_t(z >> 40)) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = float(uint32_t(z) & 0xFFFFFFu) * (1.0f / 16777216.0f);
    x[i] = __float2bfloat16(scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

void fill_normal(bf16* x, int64_t n, uint64_t seed, float scale, cudaStream_t st) {
  fill_normal_kernel<<<1024, 256, 0, st>>>(x, n, seed, scale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <class T>
T* dev_alloc(int64_t n) {
  void* p = nullptr;
  NEXTLM_CUDA_CHECK(cudaMalloc(&p, size_t(n) * sizeof(T)));
  return static_cast<T*>(p);
}

// Routing: k distinct experts per token at random. skew = 0: uniformly (roughly balanced, ~114 rows per expert at the
// slice's shapes); skew > 0: each expert drawn in proportion to a popularity exp(skew·z_e), z_e standard normal, so
// that the rows per expert are about log-normal. Skew 1 gives about the spread the randomly initialised slice routes
// with in the LoRA step: 10th/50th/90th percentile 17/64/272 rows here against ~20/70/250 there, 1.68 times n rows
// in 128-row tiles against 1.59–1.68 there; the largest expert takes 2947 rows here, ~650–1000 there. Returns the
// offsets [E+1]; min_rows, max_rows: the smallest and largest expert.
std::vector<int32_t> random_routing(int64_t T, int64_t k, int64_t E, double skew, int32_t* min_rows,
                                    int32_t* max_rows) {
  std::mt19937 rng(1234);
  std::normal_distribution<double> z;
  std::vector<double> popularity(E, 1.0);
  if (skew > 0)
    for (double& w : popularity) w = std::exp(skew * z(rng));
  std::discrete_distribution<int32_t> pick(popularity.begin(), popularity.end());
  std::vector<int32_t> count(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> chosen;
    while (int64_t(chosen.size()) < k) {
      const int32_t e = skew > 0 ? pick(rng) : static_cast<int32_t>(rng() % E);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int32_t e : chosen) ++count[e];
  }
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + count[e];
  *min_rows = *std::min_element(count.begin(), count.end());
  *max_rows = *std::max_element(count.begin(), count.end());
  return off;
}

// The routing skew a case name asks for: "_skewed" in it → 1.
double skew_of(const std::string& name) { return name.find("_skewed") != std::string::npos ? 1.0 : 0.0; }

// Variant v of the cases' loops: every kernel on row-major weights, then the two TMA kernels on the weights in column
// blocks and in tiles.
std::pair<cuda::GroupedGemmKernel, cuda::GroupedWeightLayout> variant(int v) {
  if (v < cuda::kGroupedGemmKernels) return {static_cast<cuda::GroupedGemmKernel>(v), cuda::GroupedWeightLayout::kRows};
  v -= cuda::kGroupedGemmKernels;
  return {v % 2 ? cuda::GroupedGemmKernel::kWgmmaTma128x256c4 : cuda::GroupedGemmKernel::kWgmmaTma128x256,
          v / 2 ? cuda::GroupedWeightLayout::kTiles : cuda::GroupedWeightLayout::kColumnBlocks};
}

// The experts' weights (row-major w_gu [E, 2I, D] and w_dn [E, D, I]) for a variant of `layout`: themselves on rows,
// else their copies w_gu_b and w_dn_b laid out so.
std::pair<const bf16*, const bf16*> laid_out(cuda::GroupedWeightLayout layout, const bf16* w_gu, const bf16* w_dn,
                                             bf16* w_gu_b, bf16* w_dn_b, int64_t E, int64_t I, int64_t D,
                                             cudaStream_t st) {
  if (layout == cuda::GroupedWeightLayout::kRows) return {w_gu, w_dn};
  cuda::block_expert_weights(w_gu, w_gu_b, E, 2 * I, D, layout, st);
  cuda::block_expert_weights(w_dn, w_dn_b, E, D, I, layout, st);
  return {w_gu_b, w_dn_b};
}

// A variant's name in the cases' names and notes: the kernel's, and "_blocks" or "_tiles" for those layouts.
std::string variant_name(cuda::GroupedGemmKernel k, cuda::GroupedWeightLayout layout) {
  return std::string(cuda::grouped_gemm_kernel_name(k)) +
         (layout == cuda::GroupedWeightLayout::kColumnBlocks ? "_blocks"
          : layout == cuda::GroupedWeightLayout::kTiles     ? "_tiles"
                                                            : "");
}

}  // namespace

void moe_grouped_gemm_case(const std::string& name) {
  const int64_t T = 4096, k = 8, E = 288, D = 4096, I = 2048, n = T * k;
  const float limit = 10.0f;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));

  int32_t min_rows = 0, max_rows = 0;
  const std::vector<int32_t> off = random_routing(T, k, E, skew_of(name), &min_rows, &max_rows);

  // Expert weights (9.7 GB gate_up + 4.8 GB down, far beyond L2), activations, outputs.
  bf16* w_gu = dev_alloc<bf16>(E * 2 * I * D);
  bf16* w_dn = dev_alloc<bf16>(E * D * I);
  bf16* x = dev_alloc<bf16>(n * D);
  bf16* act = dev_alloc<bf16>(n * I);
  float* out = dev_alloc<float>(n * D);
  bf16* act_ref = dev_alloc<bf16>(n * I);
  float* gu_ref = dev_alloc<float>(n * 2 * I);
  float* out_ref = dev_alloc<float>(n * D);
  bf16* dense_gu = dev_alloc<bf16>(n * 2 * I);
  int32_t* d_off = dev_alloc<int32_t>(E + 1);
  int32_t* ws = dev_alloc<int32_t>(cuda::grouped_gemm_workspace_ints(static_cast<int>(E)));
  const bf16** p_gu = dev_alloc<const bf16*>(E);
  const bf16** p_dn = dev_alloc<const bf16*>(E);
  fill_normal(w_gu, E * 2 * I * D, 1, 1.0f / std::sqrt(float(D)), st);
  fill_normal(w_dn, E * D * I, 2, 1.0f / std::sqrt(float(I)), st);
  fill_normal(x, n * D, 3, 1.0f, st);
  std::vector<const bf16*> h_gu(E), h_dn(E);
  for (int64_t e = 0; e < E; ++e) h_gu[e] = w_gu + e * 2 * I * D, h_dn[e] = w_dn + e * D * I;
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(d_off, off.data(), (E + 1) * 4, cudaMemcpyHostToDevice, st));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(p_gu, h_gu.data(), E * sizeof(void*), cudaMemcpyHostToDevice, st));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(p_dn, h_dn.data(), E * sizeof(void*), cudaMemcpyHostToDevice, st));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));

  const double flops_gu = 2.0 * n * D * 2 * I, flops_dn = 2.0 * n * I * D, flops = flops_gu + flops_dn;
  // Bytes the grouped pair must move at least: every expert's weights once, x read, act written and read, out written.
  const double bytes = 2.0 * E * (2 * I * D + D * I) + 2.0 * n * D + 2.0 * 2 * n * I + 4.0 * n * D;
  const int warm = 3, iters = 15;

  // The current path: one cuBLASLt GEMM per expert (host offsets; the device→host sync is not timed), the separate
  // SwiGLU kernel, and the dense cuBLASLt GEMMs of the same FLOPs with one weight.
  cuda::Gemm gemm(st);
  auto loop = [&] {
    for (int64_t e = 0; e < E; ++e)
      if (const int64_t m = off[e + 1] - off[e])
        gemm.run(x + off[e] * D, D, h_gu[e], 2 * I, D, gu_ref + off[e] * 2 * I, 2 * I, m);
    cuda::swiglu(gu_ref, act_ref, n, I, limit, st);
    for (int64_t e = 0; e < E; ++e)
      if (const int64_t m = off[e + 1] - off[e])
        gemm.run(act_ref + off[e] * I, I, h_dn[e], D, I, out_ref + off[e] * D, D, m);
  };
  const double loop_ms = median_ms(loop, st, 2, 5);
  const double dense_gu_ms =
      median_ms([&] { gemm.run_bf16(x, D, w_gu, 2 * I, D, dense_gu, 2 * I, n); }, st, warm, iters);
  const double dense_dn_ms = median_ms([&] { gemm.run(act_ref, I, w_dn, D, I, out_ref, D, n); }, st, warm, iters);
  const double dense_ms = dense_gu_ms + dense_dn_ms;
  loop();  // out_ref again holds the per-expert result (the dense down overwrote it)
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));

  // The TMA variants also run on the weights in the other layouts (block_expert_weights), one more copy of them.
  bf16 *w_gu_b = dev_alloc<bf16>(E * 2 * I * D), *w_dn_b = dev_alloc<bf16>(E * D * I);
  for (int v = 0; v < cuda::kGroupedGemmKernels + 4; ++v) {
    const auto [kern, layout] = variant(v);
    const auto [gu_w, dn_w] = laid_out(layout, w_gu, w_dn, w_gu_b, w_dn_b, E, I, D, st);
    cuda::GroupedGemm g_gu{x, d_off, p_gu, act, n, static_cast<int>(E), static_cast<int>(2 * I),
                           static_cast<int>(D), cuda::GroupedEpilogue::kSwiGLU, limit, kern};
    cuda::GroupedGemm g_dn{act, d_off, p_dn, out, n, static_cast<int>(E), static_cast<int>(D),
                           static_cast<int>(I), cuda::GroupedEpilogue::kF32, 0.0f, kern};
    g_gu.W_all = gu_w, g_dn.W_all = dn_w;
    g_gu.w_layout = g_dn.w_layout = layout;
    // Poisoned outputs: the check below also catches unwritten rows.
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(act, 0xFF, n * I * sizeof(bf16), st));
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, n * D * sizeof(float), st));
    cuda::grouped_gemm(g_gu, ws, st);
    cuda::grouped_gemm(g_dn, ws, st);
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
    // Same inputs as the per-expert loop; both round act to bf16, so ~1e-3 is expected (bf16 ulps of act).
    const double err_act = device_rel_err(act, act_ref, n * I), err_out = device_rel_err(out, out_ref, n * D);
    const bool ok = err_act <= 1e-2 && err_out <= 1e-2;

    const double gu_ms = median_ms([&] { cuda::grouped_gemm(g_gu, ws, st); }, st, warm, iters);
    const double dn_ms = median_ms([&] { cuda::grouped_gemm(g_dn, ws, st); }, st, warm, iters);
    const double ours = gu_ms + dn_ms;
    const double tf = flops / ours / 1e9, tf_dense = flops / dense_ms / 1e9;
    char note[900];
    std::snprintf(note, sizeof note,
                  "%s %s: ours %.0f TFLOP/s (gate_up+SwiGLU %.3f ms, down %.3f ms), cuBLAS dense %.0f TFLOP/s "
                  "(%.3f + %.3f ms) -> ours/dense %.0f%% (target 85%%), per-expert loop %.3f ms (%.2fx ours, "
                  "sync not timed); byte floor %.3f ms (%.1f GB of expert weights read once); rows/expert %d..%d; "
                  "check vs per-expert loop: act rel %.2g, out rel %.2g",
                  ok ? "ok" : "CHECK FAILED", variant_name(kern, layout).c_str(), tf, gu_ms, dn_ms, tf_dense,
                  dense_gu_ms, dense_dn_ms, 100.0 * dense_ms / ours, loop_ms, loop_ms / ours, bytes / kBytesPerMs,
                  2.0 * E * 3 * I * D / 1e9, min_rows, max_rows, err_act, err_out);
    // The case itself is the variant the model runs (set_moe_expert_gemm); the others carry their kernel's name.
    const std::string case_name = v == moe_expert_gemm() ? name : name + "_" + variant_name(kern, layout);
    std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n", case_name.c_str(),
                ours, flops / kFlopsPerMs, note);
    std::fflush(stdout);
  }

  for (void* p : std::initializer_list<void*>{w_gu, w_dn, w_gu_b, w_dn_b, x, act, out, act_ref, gu_ref, out_ref,
                                              dense_gu, d_off, ws, p_gu, p_dn})
    cudaFree(p);
  cudaStreamDestroy(st);
}

void moe_grouped_gemm_dx_case(const std::string& name) {
  const int64_t T = 4096, k = 8, E = 288, D = 4096, I = 2048, n = T * k;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  int32_t min_rows = 0, max_rows = 0;
  // The forward case's routing.
  const std::vector<int32_t> off = random_routing(T, k, E, skew_of(name), &min_rows, &max_rows);

  // Expert weights as the model holds them (W_gu_e [2I, D], W_down_e [D, I]), the output gradients of the two
  // projections, and the input gradients: ours and the per-expert loop's.
  bf16* w_gu = dev_alloc<bf16>(E * 2 * I * D);
  bf16* w_dn = dev_alloc<bf16>(E * D * I);
  bf16* dout = dev_alloc<bf16>(n * D);      // d out (of down), bf16 [n, D]
  bf16* dgu = dev_alloc<bf16>(n * 2 * I);   // d gu (gate and up), bf16 [n, 2I]
  float* dact = dev_alloc<float>(n * I);    // dout · W_down_e, fp32 [n, I]
  float* dxp = dev_alloc<float>(n * D);     // dgu · W_gu_e, fp32 [n, D]
  float* dact_ref = dev_alloc<float>(n * I);
  float* dxp_ref = dev_alloc<float>(n * D);
  int32_t* d_off = dev_alloc<int32_t>(E + 1);
  int32_t* ws = dev_alloc<int32_t>(cuda::grouped_gemm_workspace_ints(static_cast<int>(E)));
  const bf16** p_gu = dev_alloc<const bf16*>(E);
  const bf16** p_dn = dev_alloc<const bf16*>(E);
  fill_normal(w_gu, E * 2 * I * D, 1, 1.0f / std::sqrt(float(D)), st);
  fill_normal(w_dn, E * D * I, 2, 1.0f / std::sqrt(float(I)), st);
  fill_normal(dout, n * D, 4, 1.0f, st);
  fill_normal(dgu, n * 2 * I, 5, 1.0f, st);
  std::vector<const bf16*> h_gu(E), h_dn(E);
  for (int64_t e = 0; e < E; ++e) h_gu[e] = w_gu + e * 2 * I * D, h_dn[e] = w_dn + e * D * I;
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(d_off, off.data(), (E + 1) * 4, cudaMemcpyHostToDevice, st));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(p_gu, h_gu.data(), E * sizeof(void*), cudaMemcpyHostToDevice, st));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(p_dn, h_dn.data(), E * sizeof(void*), cudaMemcpyHostToDevice, st));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));

  const double flops = 2.0 * n * D * I + 2.0 * n * 2 * I * D;
  // Bytes the pair must move at least: every expert's weights once, dout and dgu read, dact and dxp written (fp32).
  const double bytes = 2.0 * E * 3 * I * D + 2.0 * n * D + 2.0 * n * 2 * I + 4.0 * n * I + 4.0 * n * D;
  const int warm = 3, iters = 15;

  // What Step::moe_backward does today: one cuBLASLt dx GEMM per expert on host offsets (the device→host sync is not
  // timed); and the dense cuBLASLt dx GEMMs of the same FLOPs with one weight.
  cuda::Gemm gemm(st);
  auto loop = [&] {
    for (int64_t e = 0; e < E; ++e)
      if (const int64_t m = off[e + 1] - off[e])
        gemm.run_dx(dout + off[e] * D, D, h_dn[e], D, I, dact_ref + off[e] * I, I, m, false);
    for (int64_t e = 0; e < E; ++e)
      if (const int64_t m = off[e + 1] - off[e])
        gemm.run_dx(dgu + off[e] * 2 * I, 2 * I, h_gu[e], 2 * I, D, dxp_ref + off[e] * D, D, m, false);
  };
  const double loop_ms = median_ms(loop, st, 2, 5);
  const double dense_da_ms =
      median_ms([&] { gemm.run_dx(dout, D, w_dn, D, I, dact_ref, I, n, false); }, st, warm, iters);
  const double dense_dx_ms =
      median_ms([&] { gemm.run_dx(dgu, 2 * I, w_gu, 2 * I, D, dxp_ref, D, n, false); }, st, warm, iters);
  const double dense_ms = dense_da_ms + dense_dx_ms;
  loop();  // the references again hold the per-expert result (the dense GEMMs overwrote them)
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));

  // As in moe_grouped_gemm: the TMA variants on the weights in the other layouts too.
  bf16 *w_gu_b = dev_alloc<bf16>(E * 2 * I * D), *w_dn_b = dev_alloc<bf16>(E * D * I);
  for (int v = 0; v < cuda::kGroupedGemmKernels + 4; ++v) {
    const auto [kern, layout] = variant(v);
    const auto [gu_w, dn_w] = laid_out(layout, w_gu, w_dn, w_gu_b, w_dn_b, E, I, D, st);
    // W_down_e [D, I] is [K = D, N = I]; W_gu_e [2I, D] is [K = 2I, N = D].
    cuda::GroupedGemm g_da{dout, d_off, p_dn, dact, n, static_cast<int>(E), static_cast<int>(I),
                           static_cast<int>(D), cuda::GroupedEpilogue::kF32, 0.0f, kern};
    cuda::GroupedGemm g_dx{dgu, d_off, p_gu, dxp, n, static_cast<int>(E), static_cast<int>(D),
                           static_cast<int>(2 * I), cuda::GroupedEpilogue::kF32, 0.0f, kern};
    g_da.w_kn = g_dx.w_kn = true;
    g_da.W_all = dn_w, g_dx.W_all = gu_w;
    g_da.w_layout = g_dx.w_layout = layout;
    // Poisoned outputs: the check below also catches unwritten rows.
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(dact, 0xFF, n * I * sizeof(float), st));
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(dxp, 0xFF, n * D * sizeof(float), st));
    cuda::grouped_gemm(g_da, ws, st);
    cuda::grouped_gemm(g_dx, ws, st);
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
    // Same bf16 inputs, fp32 accumulation and fp32 outputs on both sides: only the summation order differs (~1e-6).
    const double err_da = device_rel_err(dact, dact_ref, n * I), err_dx = device_rel_err(dxp, dxp_ref, n * D);
    const bool ok = err_da <= 1e-2 && err_dx <= 1e-2;

    const double da_ms = median_ms([&] { cuda::grouped_gemm(g_da, ws, st); }, st, warm, iters);
    const double dx_ms = median_ms([&] { cuda::grouped_gemm(g_dx, ws, st); }, st, warm, iters);
    const double ours = da_ms + dx_ms;
    const double tf = flops / ours / 1e9, tf_dense = flops / dense_ms / 1e9;
    char note[900];
    std::snprintf(note, sizeof note,
                  "%s %s w_kn: ours %.0f TFLOP/s (dact = dout.W_down %.3f ms, dxp = dgu.W_gu %.3f ms), cuBLAS dense "
                  "%.0f TFLOP/s (%.3f + %.3f ms) -> ours/dense %.0f%%, per-expert cuBLASLt loop %.3f ms (%.2fx ours, "
                  "sync not timed); byte floor %.3f ms (%.1f GB of expert weights read once); rows/expert %d..%d; "
                  "check vs per-expert loop: dact rel %.2g, dxp rel %.2g",
                  ok ? "ok" : "CHECK FAILED", variant_name(kern, layout).c_str(), tf, da_ms, dx_ms, tf_dense,
                  dense_da_ms, dense_dx_ms, 100.0 * dense_ms / ours, loop_ms, loop_ms / ours, bytes / kBytesPerMs,
                  2.0 * E * 3 * I * D / 1e9, min_rows, max_rows, err_da, err_dx);
    // As in moe_grouped_gemm: the variant training runs (set_moe_expert_gemm_dx) carries the case's name.
    const std::string case_name = v == moe_expert_gemm_dx() ? name : name + "_" + variant_name(kern, layout);
    std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n", case_name.c_str(),
                ours, flops / kFlopsPerMs, note);
    std::fflush(stdout);
  }

  for (void* p : std::initializer_list<void*>{w_gu, w_dn, w_gu_b, w_dn_b, dout, dgu, dact, dxp, dact_ref, dxp_ref,
                                              d_off, ws, p_gu, p_dn})
    cudaFree(p);
  cudaStreamDestroy(st);
}

void grouped_lora_case(const std::string& name) {
  const int64_t T = 4096, k = 8, E = 288, D = 4096, I = 2048, n = T * k;
  const int r = 16, ld = cuda::grouped_lora_ld(r);
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  int32_t min_rows = 0, max_rows = 0;
  const std::vector<int32_t> off = random_routing(T, k, E, 1.0, &min_rows, &max_rows);
  int32_t* d_off = dev_alloc<int32_t>(E + 1);
  NEXTLM_CUDA_CHECK(cudaMemcpy(d_off, off.data(), (E + 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
  // Activations: x [n, D], act [n, I], dgu [n, 2I], dout [n, D]; the adapters of gate, up (A [r, D], B [I, r]) and
  // down (A [r, I], B [D, r]) for every expert, one allocation each, and their fp32 gradients.
  bf16* x = dev_alloc<bf16>(n * D);
  bf16* act = dev_alloc<bf16>(n * I);
  bf16* dgu = dev_alloc<bf16>(n * 2 * I);
  bf16* dout = dev_alloc<bf16>(n * D);
  fill_normal(x, n * D, 1, 1.0f, st);
  fill_normal(act, n * I, 2, 1.0f, st);
  fill_normal(dgu, n * 2 * I, 3, 1.0f, st);
  fill_normal(dout, n * D, 4, 1.0f, st);
  struct Adapter {
    int64_t in, out;
    bf16 *A, *B;
    float *dA, *dB;
    const bf16** pA;
    const bf16** pB;
    float** pdA;
    float** pdB;
  };
  auto make = [&](int64_t in, int64_t out, uint64_t seed) {
    Adapter a{in, out};
    a.A = dev_alloc<bf16>(E * r * in);
    a.B = dev_alloc<bf16>(E * out * r);
    fill_normal(a.A, E * r * in, seed, 0.02f, st);
    fill_normal(a.B, E * out * r, seed + 1, 0.02f, st);
    a.dA = dev_alloc<float>(E * r * in);
    a.dB = dev_alloc<float>(E * out * r);
    std::vector<const bf16*> hA(E), hB(E);
    std::vector<float*> hdA(E), hdB(E);
    for (int64_t e = 0; e < E; ++e) {
      hA[e] = a.A + e * r * in;
      hB[e] = a.B + e * out * r;
      hdA[e] = a.dA + e * r * in;
      hdB[e] = a.dB + e * out * r;
    }
    a.pA = dev_alloc<const bf16*>(E);
    a.pB = dev_alloc<const bf16*>(E);
    a.pdA = dev_alloc<float*>(E);
    a.pdB = dev_alloc<float*>(E);
    NEXTLM_CUDA_CHECK(cudaMemcpy(a.pA, hA.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    NEXTLM_CUDA_CHECK(cudaMemcpy(a.pB, hB.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    NEXTLM_CUDA_CHECK(cudaMemcpy(a.pdA, hdA.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    NEXTLM_CUDA_CHECK(cudaMemcpy(a.pdB, hdB.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    return a;
  };
  Adapter gate = make(D, I, 10), up = make(D, I, 20), down = make(I, D, 30);
  auto grouped = [&](const Adapter& a) {
    return cuda::GroupedLora{d_off, static_cast<int>(E), r, static_cast<int>(a.in), static_cast<int>(a.out), a.pA,
                             a.pB, 2.0f};
  };
  const cuda::GroupedLora g_gate = grouped(gate), g_up = grouped(up), g_down = grouped(down);
  // Outputs: u of gate, up and down, gs of the three.
  std::vector<bf16*> outs;
  for (int i = 0; i < 6; ++i) outs.push_back(dev_alloc<bf16>(n * ld));
  // The layer's calls in the step's order; `part` picks forward (0), backward (1) or both (2).
  auto run = [&](int part) {
    bf16** o = outs.data();
    if (part != 1) {
      cuda::grouped_lora_factor2(g_gate, g_up, x, D, n, o[0], o[1], st);
      cuda::grouped_lora_factor(g_down, act, I, n, o[2], st);
    }
    if (part != 0) {
      cuda::grouped_lora_backward(g_down, down.pdA, down.pdB, act, I, o[2], dout, D, n, o[5], nullptr, 0, 0, st,
                                  true);
      cuda::grouped_lora_backward2(g_gate, g_up, gate.pdA, gate.pdB, up.pdA, up.pdB, x, D, o[0], o[1], dgu, 2 * I,
                                   n, o[3], o[4], nullptr, 0, 0, I, st, true);
    }
  };
  std::vector<double> all;
  for (int rep = 0; rep < 3; ++rep) all.push_back(median_ms([&] { run(2); }, st, 2, 10));
  std::sort(all.begin(), all.end());
  double part_ms[2];
  for (int part = 0; part < 2; ++part) part_ms[part] = median_ms([&] { run(part); }, st, 2, 10);
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  // Every factor and gradient finite (device_rel_err of an array against itself is +inf where one is not).
  bool finite = true;
  for (bf16* p : outs) finite = finite && std::isfinite(device_rel_err(p, p, n * ld));
  for (const Adapter* a : {&gate, &up, &down})
    finite = finite && std::isfinite(device_rel_err(a->dA, a->dA, E * r * a->in)) &&
             std::isfinite(device_rel_err(a->dB, a->dB, E * r * a->out));
  // Bytes: the factors read x and act (forward); the backward reads dout twice (dB, gs) and act (dA), dgu twice and
  // x (dA of both); it writes the fp32 gradients (E·r·(in + out) each) and the bf16 u and gs (6 · n · ld).
  const int64_t grads = E * r * (2 * D + I) + E * r * (2 * I + D);
  const double bytes = 2.0 * (n * D + n * I) + 2.0 * (2 * n * D + n * I + 2 * n * 2 * I + n * D) + 4.0 * grads +
                       2.0 * 6 * n * ld;
  char note[600];
  std::snprintf(note, sizeof note,
                "%s one MoE layer's grouped LoRA kernels (rank 16, 288 experts, %lld rows, %d to %d an expert): "
                "factor2 + factor, backward + backward2 as the step calls them; medians of 3x10 runs: %.3f/%.3f/%.3f "
                "ms; forward %.3f, backward %.3f ms; floor: %.2f GB at 4.14 TB/s",
                finite ? "ok" : "NOT FINITE", static_cast<long long>(n), min_rows, max_rows, all[0], all[1], all[2],
                part_ms[0], part_ms[1], bytes / 1e9);
  std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n", name.c_str(), all[1],
              bytes / kBytesPerMs, note);
  std::fflush(stdout);
  for (bf16* p : outs) cudaFree(p);
  for (Adapter* a : {&gate, &up, &down}) {
    for (void* p : {static_cast<void*>(a->A), static_cast<void*>(a->B), static_cast<void*>(a->dA),
                    static_cast<void*>(a->dB), static_cast<void*>(a->pA), static_cast<void*>(a->pB),
                    static_cast<void*>(a->pdA), static_cast<void*>(a->pdB)})
      cudaFree(p);
  }
  for (void* p : {static_cast<void*>(x), static_cast<void*>(act), static_cast<void*>(dgu), static_cast<void*>(dout),
                  static_cast<void*>(d_off)})
    cudaFree(p);
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace nextlm::bench
