// Test hooks of the mHC / RMSNorm backward kernels (see testing_mhc_backward.h).
#include "cuda/testing_mhc_backward.h"

#include "cuda/backward_kernels.h"
#include "cuda/kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

using detail::Buf;
using detail::download;
using detail::finish;
using detail::poisoned;
using detail::upload;

namespace {

// The device pointer of an uploaded vector, null for an empty one (an absent optional input).
float* ptr(const Buf& b) { return b.or_null<float>(); }

// The forward's mix of h [p.T, S, D] (cuda::mhc_pre's: fn·h and Σh² a token), in a buffer that starts as NaN (an
// entry mhc_pre left unwritten would show in every gradient).
Buf forward_mix_of(const cuda::MhcParams& p, const Buf& h) {
  const int64_t T = p.T, S = p.S, D = p.D;
  Buf mix = poisoned<float>(T * ((2 + S) * S + 1));
  if (!T) return mix;
  Buf post = poisoned<float>(T * S), comb = poisoned<float>(T * S * S), a = poisoned<cuda::bf16>(T * D);
  Buf work = poisoned<float>(cuda::mhc_pre_workspace_floats(T, S, D));
  cuda::mhc_pre(p, ptr(h), post.as<float>(), comb.as<float>(), a.as<cuda::bf16>(), work.as<float>(), nullptr,
                mix.as<float>());
  finish();
  return mix;
}

}  // namespace

void mhc_pre_backward(const std::vector<float>& h, const std::vector<float>& fn, const std::vector<float>& base,
                      const std::vector<float>& scale, const std::vector<float>& norm_w,
                      const std::vector<float>& dpost, const std::vector<float>& dcomb, const std::vector<float>& da,
                      int64_t T, int64_t S, int64_t D, float rms_eps, float hc_eps, int iters, std::vector<float>& dh,
                      std::vector<float>& dfn, std::vector<float>& dbase, std::vector<float>& dscale,
                      std::vector<float>& dnorm_w, bool forward_mix) {
  Buf gh = upload(h), gfn = upload(fn), gbase = upload(base), gscale = upload(scale), gw = upload(norm_w),
      gdpost = upload(dpost), gdcomb = upload(dcomb), gda = upload(da);
  Buf gdh = upload(dh), gdfn = upload(dfn), gdbase = upload(dbase), gdscale = upload(dscale), gdw = upload(dnorm_w);
  Buf work = poisoned<float>(cuda::mhc_pre_backward_workspace_floats(T, S, D));
  const cuda::MhcParams p{ptr(gfn), ptr(gbase), ptr(gscale), ptr(gw), T, S, D, rms_eps, hc_eps, iters};
  Buf mix = forward_mix ? forward_mix_of(p, gh) : Buf(0);
  cuda::mhc_pre_backward(p, ptr(gh), ptr(gdpost), ptr(gdcomb), ptr(gda), ptr(gdh), ptr(gdfn), ptr(gdbase), ptr(gdscale),
                         ptr(gdw), work.as<float>(), nullptr, mix.or_null<float>());
  finish();
  dh = download<float>(gdh);
  dfn = download<float>(gdfn);
  dbase = download<float>(gdbase);
  dscale = download<float>(gdscale);
  dnorm_w = download<float>(gdw);
}

void mhc_site_backward_frozen(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                              const std::vector<float>& comb, const std::vector<float>& dout,
                              const std::vector<float>& fn, const std::vector<float>& base,
                              const std::vector<float>& scale, const std::vector<float>& norm_w,
                              const std::vector<float>& da, int64_t T, int64_t S, int64_t D, float rms_eps,
                              float hc_eps, int iters, bool fold, std::vector<float>& dh, std::vector<float>& dy,
                              std::vector<float>& dpost, std::vector<float>& dcomb) {
  Buf gh = upload(h), gy = upload(y), gpost = upload(post), gcomb = upload(comb), gdout = upload(dout);
  Buf gfn = upload(fn), gbase = upload(base), gscale = upload(scale), gw = upload(norm_w), gda = upload(da);
  Buf gdh = poisoned<float>(T * S * D), gdy = poisoned<float>(T * D), gdpost = poisoned<float>(T * S),
      gdcomb = poisoned<float>(T * S * S);
  const cuda::MhcParams p{ptr(gfn), ptr(gbase), ptr(gscale), ptr(gw), T, S, D, rms_eps, hc_eps, iters};
  const Buf mix = forward_mix_of(p, gh);
  Buf work = poisoned<float>(cuda::mhc_pre_backward_workspace_floats(T, S, D));
  cuda::mhc_post_backward(ptr(gh), ptr(gy), ptr(gpost), ptr(gcomb), ptr(gdout), fold ? nullptr : ptr(gdh), ptr(gdy),
                          ptr(gdpost), ptr(gdcomb), T, S, D, nullptr, false);
  cuda::mhc_pre_backward(p, ptr(gh), ptr(gdpost), ptr(gdcomb), ptr(gda), ptr(gdh), nullptr, nullptr, nullptr, nullptr,
                         work.as<float>(), nullptr, mix.as<float>(), fold ? ptr(gdout) : nullptr,
                         fold ? ptr(gcomb) : nullptr);
  finish();
  dh = download<float>(gdh);
  dy = download<float>(gdy);
  dpost = download<float>(gdpost);
  dcomb = download<float>(gdcomb);
}

void mhc_post_backward(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                       const std::vector<float>& comb, const std::vector<float>& dout, int64_t T, int64_t S, int64_t D,
                       std::vector<float>& dh, std::vector<float>& dy, std::vector<float>& dpost,
                       std::vector<float>& dcomb, bool accumulate, std::vector<uint16_t>* dy16, bool fp32_dy) {
  auto out = [&](const std::vector<float>& v) { return accumulate ? upload(v) : detail::poisoned<float>(v.size()); };
  Buf gh = upload(h), gy = upload(y), gpost = upload(post), gcomb = upload(comb), gdout = upload(dout), gdh = out(dh),
      gdy = fp32_dy ? out(dy) : Buf(0), gdpost = out(dpost), gdcomb = out(dcomb);
  Buf gdy16 = detail::poisoned<cuda::bf16>(dy16 ? static_cast<size_t>(T * D) : 0);  // empty: null
  cuda::mhc_post_backward(ptr(gh), ptr(gy), ptr(gpost), ptr(gcomb), ptr(gdout), ptr(gdh), ptr(gdy), ptr(gdpost),
                          ptr(gdcomb), T, S, D, nullptr, accumulate, gdy16.or_null<cuda::bf16>());
  finish();
  dh = download<float>(gdh);
  if (fp32_dy) dy = download<float>(gdy);
  if (dy16) *dy16 = download<uint16_t>(gdy16);
  dpost = download<float>(gdpost);
  dcomb = download<float>(gdcomb);
}

std::vector<float> mhc_post(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                            const std::vector<float>& comb, int64_t T, int64_t S, int64_t D, bool in_place,
                            std::vector<float>& h_after) {
  Buf gh = upload(h), gy = upload(y), gpost = upload(post), gcomb = upload(comb);
  Buf gout = poisoned<float>(in_place ? 0 : h.size());
  float* out = in_place ? ptr(gh) : gout.as<float>();
  cuda::mhc_post(ptr(gh), out, ptr(gy), ptr(gpost), ptr(gcomb), T, S, D, nullptr);
  finish();
  h_after = download<float>(gh);
  return in_place ? h_after : download<float>(gout);
}

void rmsnorm_backward(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w,
                      const std::vector<float>& dy, int64_t rows, int64_t n, float eps, std::vector<float>& dx,
                      std::vector<float>& dw) {
  Buf gx = upload(x), gw = upload(w), gdy = upload(dy), gdx = upload(dx), gdw = upload(dw);
  Buf work = poisoned<float>(cuda::rmsnorm_backward_workspace_floats(rows, n));
  cuda::rmsnorm_backward(ptr(gx), ldx, ptr(gw), ptr(gdy), ptr(gdx), w.empty() ? nullptr : ptr(gdw), rows, n, eps,
                         work.as<float>(), nullptr);
  finish();
  dx = download<float>(gdx);
  if (!w.empty()) dw = download<float>(gdw);
}

void stream_mean_norm_backward(const std::vector<float>& h, const std::vector<float>& w, const std::vector<float>& dout,
                               int64_t T, int64_t S, int64_t D, float eps, std::vector<float>& dh,
                               std::vector<float>& dw, bool accumulate) {
  Buf gh = upload(h), gw = upload(w), gdout = upload(dout), gdw = upload(dw);
  Buf gdh = accumulate ? upload(dh) : poisoned<float>(dh.size());
  Buf work = poisoned<float>(cuda::rmsnorm_backward_workspace_floats(T, D) + T * D);
  cuda::stream_mean_norm_backward(ptr(gh), ptr(gw), ptr(gdout), ptr(gdh), ptr(gdw), T, S, D, eps, work.as<float>(),
                                  nullptr, accumulate);
  finish();
  dh = download<float>(gdh);
  dw = download<float>(gdw);
}

}  // namespace nextlm::cuda_testing
