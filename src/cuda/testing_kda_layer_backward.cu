// Test hooks of the KDA layer backward kernels outside the recurrence (see testing_kda_layer_backward.h).
#include "cuda/testing_kda_layer_backward.h"

#include <algorithm>
#include <limits>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda_testing {

namespace {

// A device copy of a host vector (or n poisoned floats), freed on scope exit.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
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

Dev<float> poisoned(size_t n) {
  return Dev<float>(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
}

void finish() {
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

void kda_conv_norm_backward(const std::vector<float>& raw, const std::vector<float>& conv,
                            const std::vector<int64_t>& cu_seqlens, const std::vector<float>& dq,
                            const std::vector<float>& dk, const std::vector<float>& dv, std::vector<float>& draw,
                            std::vector<float>& dconv, int64_t H, int64_t K, int64_t W) {
  const int64_t T = cu_seqlens.back();
  std::vector<int32_t> seq_start(static_cast<size_t>(T));
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) seq_start[t] = static_cast<int32_t>(cu_seqlens[s]);
  Dev<float> d_raw(raw), d_conv(conv), d_dq(dq), d_dk(dk), d_dv(dv), d_draw(draw), d_dconv(dconv);
  Dev<int32_t> d_ss(seq_start);
  Dev<float> work = poisoned(static_cast<size_t>(cuda::kda_conv_norm_backward_workspace_floats(T, H, K, W)));
  cuda::kda_conv_norm_backward(d_raw.p, d_conv.p, d_ss.p, d_dq.p, d_dk.p, d_dv.p, d_draw.p, d_dconv.p, T, H, K, W,
                               work.p, nullptr);
  finish();
  draw = d_draw.get();
  dconv = d_dconv.get();
}

std::vector<float> kda_gate_backward(const std::vector<float>& f, const std::vector<float>& dt_bias,
                                     const std::vector<float>& A_log, const std::vector<float>& dg,
                                     std::vector<float>& ddt_bias, std::vector<float>& dA_log, int64_t T, int64_t H,
                                     int64_t K, bool has_bound, float bound) {
  Dev<float> d_f(f), d_dt(dt_bias), d_A(A_log), d_dg(dg), d_ddt(ddt_bias), d_dA(dA_log);
  Dev<float> df = poisoned(f.size());
  Dev<float> work = poisoned(static_cast<size_t>(cuda::kda_gate_backward_workspace_floats(T, H, K)));
  cuda::kda_gate_backward(d_f.p, d_dt.p, d_A.p, d_dg.p, df.p, d_ddt.p, d_dA.p, T, H, K, has_bound, bound, work.p,
                          nullptr);
  finish();
  ddt_bias = d_ddt.get();
  dA_log = d_dA.get();
  return df.get();
}

std::vector<float> sigmoid_backward(const std::vector<float>& y, const std::vector<float>& d) {
  Dev<float> d_y(y), d_d(d);
  cuda::sigmoid_backward_inplace(d_y.p, d_d.p, static_cast<int64_t>(d.size()), nullptr);
  finish();
  return d_d.get();
}

std::vector<float> kda_out_norm_backward(const std::vector<float>& o, const std::vector<float>& gate,
                                         const std::vector<float>& w, const std::vector<float>& don,
                                         std::vector<float>& do_, std::vector<float>& dw, int64_t T, int64_t H,
                                         int64_t K, float eps) {
  Dev<float> d_o(o), d_gate(gate), d_w(w), d_don(don), d_do(do_), d_dw(dw);
  Dev<float> dgate = poisoned(gate.size());
  Dev<float> work = poisoned(static_cast<size_t>(cuda::kda_out_norm_backward_workspace_floats(T, H, K)));
  cuda::kda_out_norm_backward(d_o.p, d_gate.p, d_w.p, d_don.p, d_do.p, dgate.p, d_dw.p, T, H, K, eps, work.p,
                              nullptr);
  finish();
  do_ = d_do.get();
  dw = d_dw.get();
  return dgate.get();
}

}  // namespace nextlm::cuda_testing
