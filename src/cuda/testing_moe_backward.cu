// Host-vector wrappers of the head, embedding and MoE backward kernels (see testing_moe_backward.h).
#include "cuda/testing_moe_backward.h"

#include "cuda/backward_kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

using detail::Buf;
using detail::download;
using detail::finish;
using detail::poisoned;
using detail::upload;
using detail::widen;

void softmax_xent_backward(const std::vector<float>& logits, const std::vector<int32_t>& target,
                           const std::vector<float>& wt, int64_t n, int64_t V, std::vector<double>& loss,
                           std::vector<float>& dlogits) {
  Buf dl = upload(logits), dw = upload(wt);
  Buf dt = upload(target);
  Buf dloss = poisoned<double>(n);
  Buf dd = poisoned<cuda::bf16>(n * V);
  cuda::softmax_xent_backward(dl.as<float>(), dt.as<int32_t>(), dw.or_null<float>(), dloss.as<double>(),
                              dd.as<cuda::bf16>(), n, V, nullptr);
  finish();
  loss = download<double>(dloss);
  dlogits = widen(download<cuda::bf16>(dd));
}

void embedding_backward(const std::vector<int32_t>& tok, const std::vector<float>& dh, std::vector<float>& dembed,
                        int64_t T, int64_t S, int64_t D, int64_t pad_id) {
  Buf dt = upload(tok);
  Buf dd = upload(dh), de = upload(dembed);
  cuda::embedding_backward(dt.as<int32_t>(), dd.as<float>(), de.as<float>(), T, S, D, pad_id, nullptr);
  finish();
  dembed = download<float>(de);
}

std::vector<float> swiglu_backward(const std::vector<float>& gu, const std::vector<float>& dact, int64_t n, int64_t I,
                                   float limit) {
  Buf dg = upload(gu), da = upload(dact);
  Buf out = poisoned<cuda::bf16>(n * 2 * I);
  cuda::swiglu_backward(dg.as<float>(), da.as<float>(), out.as<cuda::bf16>(), n, I, limit, nullptr);
  finish();
  return widen(download<cuda::bf16>(out));
}

void moe_combine_backward(const std::vector<float>& dy, const std::vector<float>& out,
                          const std::vector<int32_t>& slot_of, const std::vector<float>& weights, int64_t T, int64_t k,
                          int64_t D, std::vector<float>& dout, std::vector<float>& dweights) {
  Buf ddy = upload(dy), dout_in = upload(out), dw = upload(weights);
  Buf ds = upload(slot_of);
  Buf dd = poisoned<cuda::bf16>(T * k * D);
  Buf dwo = poisoned<float>(T * k);
  cuda::moe_combine_backward(ddy.as<float>(), dout_in.as<float>(), ds.as<int32_t>(), dw.as<float>(),
                             dd.as<cuda::bf16>(), dwo.as<float>(), T, k, D, nullptr);
  finish();
  dout = widen(download<cuda::bf16>(dd));
  dweights = download<float>(dwo);
}

void moe_gather_backward(const std::vector<float>& dxp, const std::vector<int32_t>& slot_of, std::vector<float>& dx,
                         int64_t T, int64_t k, int64_t D) {
  Buf dp = upload(dxp), ddx = upload(dx);
  Buf ds = upload(slot_of);
  cuda::moe_gather_backward(dp.as<float>(), ds.as<int32_t>(), ddx.as<float>(), T, k, D, nullptr);
  finish();
  dx = download<float>(ddx);
}

std::vector<float> moe_route_backward(const std::vector<float>& logits, const std::vector<int32_t>& experts,
                                      const std::vector<float>& dweights, int64_t T, int64_t E, int64_t k, bool norm,
                                      float scale) {
  Buf dl = upload(logits), dw = upload(dweights);
  Buf de = upload(experts);
  Buf out = poisoned<float>(T * E);
  cuda::moe_route_backward(dl.as<float>(), de.as<int32_t>(), dw.as<float>(), out.as<float>(), T, E, k, norm, scale,
                           nullptr);
  finish();
  return download<float>(out);
}

}  // namespace nextlm::cuda_testing
