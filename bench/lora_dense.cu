// `lora_dense_T4096`: the dense LoRA adapters' rank-r products of the slice's LoRA step on lora_dense.h's kernels
// against the cuBLASLt GEMMs they replace (see lora_dense.h in bench/). A .cu because cuda/gemm.h and
// cuda/testing_buffers.h include common.cuh.
#include "lora_dense.h"

#include <cstdio>
#include <string>
#include <vector>

#include "cuda/gemm.h"
#include "cuda/lora_dense.h"
#include "cuda/random_init.h"
#include "cuda/testing_buffers.h"
#include "device_timing.cuh"

namespace nextlm::bench {

namespace {

using cuda::bf16;
using cuda_testing::detail::Buf;

constexpr double kBytesPerMs = 4.14e12 / 1e3;  // ../shared/docs/performance.md
constexpr int kWarm = 3, kIters = 20;
constexpr int64_t kT = 4096;

__global__ void scale_bf16_kernel(const float* x, float s, bf16* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(s * x[i]);
}
void scale_bf16(const float* x, float s, bf16* y, int64_t n, cudaStream_t st) {
  scale_bf16_kernel<<<static_cast<unsigned>(std::min<int64_t>(cuda::ceil_div(n, 256), 4096)), 256, 0, st>>>(x, s, y, n);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

Buf bf16s(int64_t n) { return Buf(static_cast<size_t>(n) * sizeof(bf16)); }
Buf floats(int64_t n) { return Buf(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float)); }

// One adapter of the step (or a stacked group's A side: `dy` false).
struct Shape {
  const char* name;
  int64_t in, out, r;
  bool dy;  // the dy pass (dB and s·dy·B) runs for it; the A side (u, dA) always
};

struct Timing {
  double ours = 0, peer = 0, bytes = 0, err = 0;
};

Timing run_shape(const Shape& s, cuda::Gemm& gemm, cudaStream_t st) {
  const int64_t T = kT, in = s.in, out = s.out, r = s.r;
  const float scale = 2.0f;
  Buf x = bf16s(T * in), dy = bf16s(T * out), A = bf16s(r * in), B = bf16s(out * r);
  uint64_t key = 11;
  for (const Buf* b : {&x, &dy, &A, &B})
    cuda::fill_random(b->p, true, static_cast<int64_t>(b->bytes / 2), {cuda::Dist::Normal, 1.0f, 0.0f}, key++, st);
  Buf u = bf16s(T * r), u2 = bf16s(T * r), gs = bf16s(T * r), gs2 = bf16s(T * r), g32 = floats(T * r);
  Buf dA = floats(r * in), dA2 = floats(r * in), dB = floats(out * r), dB2 = floats(out * r);
  int64_t work_n = 0;
  for (int64_t j0 = 0; j0 < r; j0 += 32) {
    const int rj = static_cast<int>(std::min<int64_t>(32, r - j0));
    work_n = std::max({work_n, cuda::lora_dense_work(T, in, rj, true, false),
                       cuda::lora_dense_work(T, in, rj, false, true)});
  }
  if (s.dy) work_n = std::max(work_n, cuda::lora_dense_work(T, out, static_cast<int>(r), true, true));
  Buf work = floats(work_n);
  // As train.cu runs them: forward u; backward dB and s·dy·B, then dA (r > 32: in pieces of 32).
  auto ours = [&] {
    for (int64_t j0 = 0; j0 < r; j0 += 32) {
      const int rj = static_cast<int>(std::min<int64_t>(32, r - j0));
      cuda::lora_dense_factor(x.as<bf16>(), in, A.as<bf16>() + j0 * in, rj, in, T, scale, u.as<bf16>() + j0, r,
                              work.as<float>(), st);
    }
    if (s.dy)
      cuda::lora_dense_dy(dy.as<bf16>(), out, u.as<bf16>(), r, B.as<bf16>(), static_cast<int>(r), out, T,
                          dB.as<float>(), false, nullptr, gs.as<bf16>(), r, scale, work.as<float>(), st);
    for (int64_t j0 = 0; j0 < r; j0 += 32) {
      const int rj = static_cast<int>(std::min<int64_t>(32, r - j0));
      cuda::lora_dense_grad(x.as<bf16>(), in, (s.dy ? gs : u).as<bf16>() + j0, r, rj, in, T,
                            dA.as<float>() + j0 * in, false, work.as<float>(), st);
    }
  };
  auto peer = [&] {
    gemm.run(x.as<bf16>(), in, A.as<bf16>(), r, in, g32.as<float>(), r, T);
    scale_bf16(g32.as<float>(), scale, u2.as<bf16>(), T * r, st);
    if (s.dy) {
      gemm.run_dw(dy.as<bf16>(), out, u2.as<bf16>(), r, out, r, T, dB2.as<float>(), false);
      gemm.run_dx(dy.as<bf16>(), out, B.as<bf16>(), out, r, g32.as<float>(), r, T, false);
      scale_bf16(g32.as<float>(), scale, gs2.as<bf16>(), T * r, st);
    }
    gemm.run_dw((s.dy ? gs2 : u2).as<bf16>(), r, x.as<bf16>(), in, r, in, T, dA2.as<float>(), false);
  };
  Timing t;
  std::vector<double> a, b;
  for (int rep = 0; rep < 3; ++rep) {
    a.push_back(median_ms(ours, st, kWarm, kIters));
    b.push_back(median_ms(peer, st, kWarm, kIters));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  t.ours = a[1], t.peer = b[1];
  // Bytes an ideal pass moves: x read twice (u, dA), dy once, the r-wide outputs written.
  t.bytes = 2.0 * (2.0 * T * in + (s.dy ? T * out : 0)) + 4.0 * r * (in + (s.dy ? out : 0)) + 2.0 * T * r * 2;
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  t.err = std::max({device_rel_err(u.as<bf16>(), u2.as<bf16>(), T * r),
                    device_rel_err(dA.as<float>(), dA2.as<float>(), r * in)});
  if (s.dy)
    t.err = std::max({t.err, device_rel_err(gs.as<bf16>(), gs2.as<bf16>(), T * r),
                      device_rel_err(dB.as<float>(), dB2.as<float>(), out * r)});
  return t;
}

}  // namespace

void lora_dense_case(const std::string& name) {
  // The slice's dense adapters at rank 16 (bench/slice4/config.json): single adapters with their dy pass, and the
  // stacked groups' A side (KDA q|k|v|f_a|g_a|b: 96 columns; the MLA's q_a|kv_a, the MLPs' gate|up: 32).
  const std::vector<Shape> shapes{
      {"kda_q", 4096, 8192, 16, true},        {"kda_f_b", 128, 8192, 16, true}, {"kda_o", 8192, 4096, 16, true},
      {"kda_group", 4096, 0, 96, false},      {"mla_q_b", 1536, 16384, 16, true},
      {"mla_kv_b", 512, 32768, 16, true},     {"mla_o", 16384, 4096, 16, true},
      {"pair_group", 4096, 0, 32, false},     {"mlp_down", 12288, 4096, 16, true},
      {"shared_down", 2048, 4096, 16, true},  {"mlp_gate", 4096, 12288, 16, true}};
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  double ours = 0, peer = 0, bytes = 0, err = 0;
  std::string parts;
  {
    cuda::Gemm gemm(st);
    for (const Shape& s : shapes) {
      const Timing t = run_shape(s, gemm, st);
      ours += t.ours, peer += t.peer, bytes += t.bytes, err = std::max(err, t.err);
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s%s %.3f/%.3f", parts.empty() ? "" : ", ", s.name, t.ours, t.peer);
      parts += buf;
    }
  }
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
  char note[1024];
  std::snprintf(note, sizeof note,
                "%s T=4096, rank 16: each adapter's u, dB with s*dy*B, and dA (a stacked group's u and dA alone) on "
                "lora_dense.h's kernels (ours) against cuBLASLt GEMMs and rounding passes (peer), medians of 3x%d "
                "runs each, ms ours/peer: %s; largest relative difference %.2g; floor: each operand read once "
                "(x twice) at 4.14 TB/s",
                err < 1e-2 ? "ok" : "CHECK FAILED", kIters, parts.c_str(), err);
  std::printf("{\"case\": \"%s\", \"ours_ms\": %.4f, \"peer_ms\": %.4f, \"floor_ms\": %.4f, \"note\": \"%s\"}\n",
              name.c_str(), ours, peer, bytes / kBytesPerMs, note);
  std::fflush(stdout);
}

}  // namespace nextlm::bench
