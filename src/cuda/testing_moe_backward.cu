// Host-vector wrappers of the head, embedding and MoE backward kernels (see testing_moe_backward.h).
#include "cuda/testing_moe_backward.h"

#include <algorithm>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda_testing {

namespace {

// A device buffer of n elements of T: uploaded from a host vector, or poisoned (all bytes 0xFF: NaN in fp32,
// fp64 and bf16) when it is an output.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n * sizeof(T), 1)));
    NEXTLM_CUDA_CHECK(cudaMemset(p, 0xFF, n * sizeof(T)));
  }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) {
    NEXTLM_CUDA_CHECK(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> v(n);
    NEXTLM_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

// A null pointer for an empty optional input.
template <class T>
const T* or_null(const Dev<T>& d) {
  return d.n ? d.p : nullptr;
}

std::vector<float> widen(const std::vector<cuda::bf16>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

void finish() {
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

void softmax_xent_backward(const std::vector<float>& logits, const std::vector<int32_t>& target,
                           const std::vector<float>& wt, int64_t n, int64_t V, std::vector<double>& loss,
                           std::vector<float>& dlogits) {
  Dev<float> dl(logits), dw(wt);
  Dev<int32_t> dt(target);
  Dev<double> dloss(n);
  Dev<cuda::bf16> dd(n * V);
  cuda::softmax_xent_backward(dl.p, dt.p, or_null(dw), dloss.p, dd.p, n, V, nullptr);
  finish();
  loss = dloss.get();
  dlogits = widen(dd.get());
}

void embedding_backward(const std::vector<int32_t>& tok, const std::vector<float>& dh, std::vector<float>& dembed,
                        int64_t T, int64_t S, int64_t D, int64_t pad_id) {
  Dev<int32_t> dt(tok);
  Dev<float> dd(dh), de(dembed);
  cuda::embedding_backward(dt.p, dd.p, de.p, T, S, D, pad_id, nullptr);
  finish();
  dembed = de.get();
}

std::vector<float> swiglu_backward(const std::vector<float>& gu, const std::vector<float>& dact, int64_t n, int64_t I,
                                   float limit) {
  Dev<float> dg(gu), da(dact);
  Dev<cuda::bf16> out(n * 2 * I);
  cuda::swiglu_backward(dg.p, da.p, out.p, n, I, limit, nullptr);
  finish();
  return widen(out.get());
}

void moe_combine_backward(const std::vector<float>& dy, const std::vector<float>& out,
                          const std::vector<int32_t>& slot_of, const std::vector<float>& weights, int64_t T, int64_t k,
                          int64_t D, std::vector<float>& dout, std::vector<float>& dweights) {
  Dev<float> ddy(dy), dout_in(out), dw(weights);
  Dev<int32_t> ds(slot_of);
  Dev<cuda::bf16> dd(T * k * D);
  Dev<float> dwo(T * k);
  cuda::moe_combine_backward(ddy.p, dout_in.p, ds.p, dw.p, dd.p, dwo.p, T, k, D, nullptr);
  finish();
  dout = widen(dd.get());
  dweights = dwo.get();
}

void moe_gather_backward(const std::vector<float>& dxp, const std::vector<int32_t>& slot_of, std::vector<float>& dx,
                         int64_t T, int64_t k, int64_t D) {
  Dev<float> dp(dxp), ddx(dx);
  Dev<int32_t> ds(slot_of);
  cuda::moe_gather_backward(dp.p, ds.p, ddx.p, T, k, D, nullptr);
  finish();
  dx = ddx.get();
}

std::vector<float> moe_route_backward(const std::vector<float>& logits, const std::vector<int32_t>& experts,
                                      const std::vector<float>& dweights, int64_t T, int64_t E, int64_t k, bool norm,
                                      float scale) {
  Dev<float> dl(logits), dw(dweights);
  Dev<int32_t> de(experts);
  Dev<float> out(T * E);
  cuda::moe_route_backward(dl.p, de.p, dw.p, out.p, T, E, k, norm, scale, nullptr);
  finish();
  return out.get();
}

}  // namespace nextlm::cuda_testing
