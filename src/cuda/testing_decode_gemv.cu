// Test hook of the decoding GEMV (see testing_decode_gemv.h).
#include "cuda/testing_decode_gemv.h"

#include <cmath>
#include <cstring>

#include "cuda/decode_kernels.h"
#include "cuda/decode_linear.h"
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

std::vector<std::vector<float>> decode_linear_multi_gemv(const std::vector<GemvSegment>& segs, int64_t M) {
  check(segs.size() <= static_cast<size_t>(cuda::kMaxLinearSegs), "decode_linear_multi_gemv: too many segments");
  const float sentinel = 1234.5f;
  std::vector<Buf> xs, ws, ys;
  std::vector<cuda::LinearSeg> list;
  for (const GemvSegment& s : segs) {
    check(int64_t(s.x.size()) == M * s.in && int64_t(s.W.size()) == s.out * s.in,
          "decode_linear_multi_gemv: bad input sizes");
    const int64_t shift = s.misalign ? 1 : 0;
    xs.push_back(upload_bf16(s.x, shift));
    ws.push_back(upload_bf16(s.W, 0));
    ys.push_back(guarded(std::vector<float>(M * s.out, NAN), sentinel));
    list.push_back({xs.back().as<cuda::bf16>() + shift, s.in, ws.back().as<cuda::bf16>(), s.out, s.in,
                    ys.back().as<float>() + kGuard, s.out});
  }
  cuda::decode_linear_multi(list.data(), list.size(), M, nullptr);
  finish();
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < segs.size(); ++i)
    out.push_back(unguard<float>(ys[i], M * segs[i].out, sentinel, "decode_linear_multi"));
  return out;
}

}  // namespace nextlm::cuda_testing
