// Test hooks of the decoding GEMVs (see testing_decode_gemv.h).
#include "cuda/testing_decode_gemv.h"

#include <cmath>
#include <cstring>

#include "cuda/decode_kernels.h"
#include "cuda/moe_decode.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

using namespace detail;

namespace {

constexpr int64_t kGuard = 64;  // sentinel elements on each side of an output

// [kGuard sentinels | body | kGuard sentinels] on the device.
template <class T>
Buf guarded(const std::vector<T>& body, T sentinel) {
  std::vector<T> all(body.size() + 2 * kGuard, sentinel);
  std::copy(body.begin(), body.end(), all.begin() + kGuard);
  return upload(all);
}

// The body of a guarded buffer, after checking that the sentinels are intact.
template <class T>
std::vector<T> unguard(const Buf& b, size_t n, T sentinel, const char* what) {
  const std::vector<T> all = download<T>(b, n + 2 * kGuard);
  for (int64_t i = 0; i < kGuard; ++i)
    check(std::memcmp(&all[i], &sentinel, sizeof(T)) == 0 &&
              std::memcmp(&all[kGuard + n + i], &sentinel, sizeof(T)) == 0,
          what, ": an element outside the output was written");
  return std::vector<T>(all.begin() + kGuard, all.begin() + kGuard + n);
}

// bf16 copies of v on the device, starting `shift` elements into the allocation.
Buf upload_bf16(const std::vector<float>& v, int64_t shift) {
  const std::vector<cuda::bf16> b = to_bf16(v);
  Buf d((b.size() + 8) * sizeof(cuda::bf16));
  if (!b.empty())
    NEXTLM_CUDA_CHECK(
        cudaMemcpy(d.as<cuda::bf16>() + shift, b.data(), b.size() * sizeof(cuda::bf16), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace

std::vector<float> decode_linear_gemv(const std::vector<float>& x, const std::vector<float>& W, int64_t M,
                                      int64_t out, int64_t in, const std::vector<float>& y0, bool misalign) {
  check(int64_t(x.size()) == M * in && int64_t(W.size()) == out * in, "decode_linear_gemv: bad input sizes");
  check(y0.empty() || int64_t(y0.size()) == M * out, "decode_linear_gemv: bad y0 size");
  const int64_t shift = misalign ? 1 : 0;
  Buf dx = upload_bf16(x, shift), dw = upload_bf16(W, shift);
  const float sentinel = 1234.5f;
  Buf dy = guarded(y0.empty() ? std::vector<float>(M * out, NAN) : y0, sentinel);
  cuda::decode_linear(dx.as<cuda::bf16>() + shift, in, dw.as<cuda::bf16>() + shift, out, in, dy.as<float>() + kGuard,
                      out, M, !y0.empty(), nullptr);
  finish();
  return unguard<float>(dy, M * out, sentinel, "decode_linear");
}

std::vector<float> moe_decode_gemv(const std::vector<float>& A, const std::vector<int32_t>& offsets,
                                   const std::vector<float>& W, int N, int K, MoeGemvEpilogue epilogue, float limit,
                                   const std::vector<float>& C0) {
  check(offsets.size() >= 2, "moe_decode_gemv: offsets need E + 1 entries");
  const int E = static_cast<int>(offsets.size()) - 1;
  const int64_t n = offsets[E];
  check(int64_t(A.size()) == n * K && int64_t(W.size()) == int64_t(E) * N * K, "moe_decode_gemv: bad input sizes");
  Buf dA = upload_bf16(A, 0), doff = upload(offsets);
  // Each expert in its own allocation, as the model holds them.
  std::vector<Buf> experts;
  std::vector<const cuda::bf16*> ptrs;
  experts.reserve(E);
  for (int e = 0; e < E; ++e) {
    const auto first = W.begin() + int64_t(e) * N * K;
    experts.push_back(upload_bf16(std::vector<float>(first, first + int64_t(N) * K), 0));
    ptrs.push_back(experts.back().as<cuda::bf16>());
  }
  Buf dptr = upload(ptrs);
  const bool glu = epilogue == MoeGemvEpilogue::kSwiGLU, f32 = epilogue == MoeGemvEpilogue::kF32 ||
                                                             epilogue == MoeGemvEpilogue::kF32Add;
  const int64_t cols = glu ? N / 2 : N;
  const bool add = epilogue == MoeGemvEpilogue::kF32Add;
  check(!add || int64_t(C0.size()) == n * cols, "moe_decode_gemv: kF32Add needs C0 [n, N]");
  const auto epi = static_cast<cuda::GroupedEpilogue>(static_cast<int>(epilogue));
  static_assert(static_cast<int>(MoeGemvEpilogue::kF32) == static_cast<int>(cuda::GroupedEpilogue::kF32) &&
                static_cast<int>(MoeGemvEpilogue::kSwiGLU) == static_cast<int>(cuda::GroupedEpilogue::kSwiGLU) &&
                static_cast<int>(MoeGemvEpilogue::kBf16) == static_cast<int>(cuda::GroupedEpilogue::kBf16) &&
                static_cast<int>(MoeGemvEpilogue::kF32Add) == static_cast<int>(cuda::GroupedEpilogue::kF32Add));
  if (f32) {
    const float sentinel = 1234.5f;
    Buf dc = guarded(add ? C0 : std::vector<float>(n * cols, NAN), sentinel);
    const cuda::GroupedGemm g{dA.as<cuda::bf16>(), doff.as<int32_t>(), dptr.as<const cuda::bf16*>(),
                              dc.as<float>() + kGuard, n, E, N, K, epi, limit};
    cuda::moe_decode_gemv(g, nullptr);
    finish();
    return unguard<float>(dc, n * cols, sentinel, "moe_decode_gemv");
  }
  const cuda::bf16 sentinel = __float2bfloat16(1234.5f);
  Buf dc = guarded(std::vector<cuda::bf16>(n * cols, __float2bfloat16(NAN)), sentinel);
  const cuda::GroupedGemm g{dA.as<cuda::bf16>(), doff.as<int32_t>(), dptr.as<const cuda::bf16*>(),
                            dc.as<cuda::bf16>() + kGuard, n, E, N, K, epi, limit};
  cuda::moe_decode_gemv(g, nullptr);
  finish();
  return widen(unguard<cuda::bf16>(dc, n * cols, sentinel, "moe_decode_gemv"));
}

}  // namespace nextlm::cuda_testing
