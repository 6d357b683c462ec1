// Test hooks of the mHC / RMSNorm backward kernels (see testing_mhc_backward.h).
#include "cuda/testing_mhc_backward.h"

#include <algorithm>
#include <cmath>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda_testing {

namespace {

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { cudaFree(p); }
  float* f() { return static_cast<float*>(p); }
};

// A device copy of v (null pointer for an empty v when nullable).
struct Dev {
  Buf b;
  bool empty;
  explicit Dev(const std::vector<float>& v) : b(v.size() * sizeof(float)), empty(v.empty()) {
    if (!v.empty()) NEXTLM_CUDA_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  float* ptr() { return empty ? nullptr : b.f(); }
  void get(std::vector<float>& v) {
    NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
    NEXTLM_CUDA_CHECK(cudaMemcpy(v.data(), b.p, v.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
};

std::vector<float> poison(int64_t n) { return std::vector<float>(static_cast<size_t>(std::max<int64_t>(n, 1)), NAN); }

}  // namespace

void mhc_pre_backward(const std::vector<float>& h, const std::vector<float>& fn, const std::vector<float>& base,
                      const std::vector<float>& scale, const std::vector<float>& norm_w,
                      const std::vector<float>& dpost, const std::vector<float>& dcomb, const std::vector<float>& da,
                      int64_t T, int64_t S, int64_t D, float rms_eps, float hc_eps, int iters, std::vector<float>& dh,
                      std::vector<float>& dfn, std::vector<float>& dbase, std::vector<float>& dscale,
                      std::vector<float>& dnorm_w) {
  Dev gh(h), gfn(fn), gbase(base), gscale(scale), gw(norm_w), gdpost(dpost), gdcomb(dcomb), gda(da);
  Dev gdh(dh), gdfn(dfn), gdbase(dbase), gdscale(dscale), gdw(dnorm_w);
  Dev work(poison(cuda::mhc_pre_backward_workspace_floats(T, S, D)));
  const cuda::MhcParams p{gfn.ptr(), gbase.ptr(), gscale.ptr(), gw.ptr(), T, S, D, rms_eps, hc_eps, iters};
  cuda::mhc_pre_backward(p, gh.ptr(), gdpost.ptr(), gdcomb.ptr(), gda.ptr(), gdh.ptr(), gdfn.ptr(), gdbase.ptr(),
                         gdscale.ptr(), gdw.ptr(), work.ptr(), nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  gdh.get(dh), gdfn.get(dfn), gdbase.get(dbase), gdscale.get(dscale), gdw.get(dnorm_w);
}

void mhc_post_backward(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                       const std::vector<float>& comb, const std::vector<float>& dout, int64_t T, int64_t S, int64_t D,
                       std::vector<float>& dh, std::vector<float>& dy, std::vector<float>& dpost,
                       std::vector<float>& dcomb) {
  Dev gh(h), gy(y), gpost(post), gcomb(comb), gdout(dout), gdh(dh), gdy(dy), gdpost(dpost), gdcomb(dcomb);
  cuda::mhc_post_backward(gh.ptr(), gy.ptr(), gpost.ptr(), gcomb.ptr(), gdout.ptr(), gdh.ptr(), gdy.ptr(),
                          gdpost.ptr(), gdcomb.ptr(), T, S, D, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  gdh.get(dh), gdy.get(dy), gdpost.get(dpost), gdcomb.get(dcomb);
}

void rmsnorm_backward(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w,
                      const std::vector<float>& dy, int64_t rows, int64_t n, float eps, std::vector<float>& dx,
                      std::vector<float>& dw) {
  Dev gx(x), gw(w), gdy(dy), gdx(dx), gdw(dw);
  Dev work(poison(cuda::rmsnorm_backward_workspace_floats(rows, n)));
  cuda::rmsnorm_backward(gx.ptr(), ldx, gw.ptr(), gdy.ptr(), gdx.ptr(), w.empty() ? nullptr : gdw.ptr(), rows, n, eps,
                         work.ptr(), nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  gdx.get(dx);
  if (!w.empty()) gdw.get(dw);
}

void stream_mean_norm_backward(const std::vector<float>& h, const std::vector<float>& w,
                               const std::vector<float>& dout, int64_t T, int64_t S, int64_t D, float eps,
                               std::vector<float>& dh, std::vector<float>& dw) {
  Dev gh(h), gw(w), gdout(dout), gdh(dh), gdw(dw);
  Dev work(poison(cuda::rmsnorm_backward_workspace_floats(T, D) + T * D));
  cuda::stream_mean_norm_backward(gh.ptr(), gw.ptr(), gdout.ptr(), gdh.ptr(), gdw.ptr(), T, S, D, eps, work.ptr(),
                                  nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  gdh.get(dh), gdw.get(dw);
}

}  // namespace nextlm::cuda_testing
