// Host-vector wrappers of the head, embedding and MoE backward kernels (see testing_moe_backward.h).
#include "cuda/testing_moe_backward.h"

#include "cuda/backward_kernels.h"
#include "cuda/kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

using detail::Buf;
using detail::download;
using detail::finish;
using detail::poisoned;
using detail::upload;
using detail::to_bf16;
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

void set_xent_stream(bool on) { cuda::set_xent_stream(on); }
bool xent_stream() { return cuda::xent_stream(); }

void embedding_backward(const std::vector<int32_t>& tok, const std::vector<float>& dh, std::vector<float>& dembed,
                        int64_t T, int64_t S, int64_t D, int64_t pad_id) {
  Buf dt = upload(tok);
  Buf dd = upload(dh), de = upload(dembed);
  cuda::embedding_backward(dt.as<int32_t>(), dd.as<float>(), de.as<float>(), T, S, D, pad_id, nullptr);
  finish();
  dembed = download<float>(de);
}

std::vector<float> swiglu_backward(const std::vector<float>& gu, const std::vector<float>& dact, int64_t n, int64_t I,
                                   float limit, int32_t rows_held, bool gu16, bool dact16) {
  Buf dg = gu16 ? upload(to_bf16(gu)) : upload(gu), da = dact16 ? upload(to_bf16(dact)) : upload(dact);
  Buf held = upload(std::vector<int32_t>{rows_held});
  Buf out = poisoned<cuda::bf16>(n * 2 * I);
  const int32_t* h = rows_held >= 0 ? held.as<int32_t>() : nullptr;
  cuda::bf16* o = out.as<cuda::bf16>();
  if (gu16 && dact16) cuda::swiglu_backward(dg.as<cuda::bf16>(), da.as<cuda::bf16>(), o, n, I, limit, nullptr, h);
  else if (gu16) cuda::swiglu_backward(dg.as<cuda::bf16>(), da.as<float>(), o, n, I, limit, nullptr, h);
  else if (dact16) cuda::swiglu_backward(dg.as<float>(), da.as<cuda::bf16>(), o, n, I, limit, nullptr, h);
  else cuda::swiglu_backward(dg.as<float>(), da.as<float>(), o, n, I, limit, nullptr, h);
  finish();
  return widen(download<cuda::bf16>(out));
}

std::vector<float> moe_combine_backward(const std::vector<float>& dy, const std::vector<int32_t>& slot_of,
                                        const std::vector<float>& weights, int64_t T, int64_t k, int64_t D) {
  Buf ddy = upload(dy), dw = upload(weights), ds = upload(slot_of);
  Buf dd = poisoned<cuda::bf16>(T * k * D);
  cuda::moe_combine_backward(ddy.as<float>(), ds.as<int32_t>(), dw.as<float>(), dd.as<cuda::bf16>(), T, k, D, nullptr);
  finish();
  return widen(download<cuda::bf16>(dd));
}

std::vector<float> moe_weights_backward(const std::vector<float>& act, const std::vector<float>& dact,
                                        const std::vector<int32_t>& slot_of, const std::vector<float>& weights,
                                        int64_t T, int64_t k, int64_t I, int32_t rows_held, bool dact16) {
  Buf da = upload(to_bf16(act)), dd = dact16 ? upload(to_bf16(dact)) : upload(dact), ds = upload(slot_of),
      dw = upload(weights);
  Buf held = upload(std::vector<int32_t>{rows_held}), out = poisoned<float>(T * k);
  const int32_t* h = rows_held >= 0 ? held.as<int32_t>() : nullptr;
  if (dact16)
    cuda::moe_weights_backward(da.as<cuda::bf16>(), dd.as<cuda::bf16>(), ds.as<int32_t>(), dw.as<float>(),
                               out.as<float>(), T, k, I, nullptr, h);
  else
    cuda::moe_weights_backward(da.as<cuda::bf16>(), dd.as<float>(), ds.as<int32_t>(), dw.as<float>(),
                               out.as<float>(), T, k, I, nullptr, h);
  finish();
  return download<float>(out);
}

void moe_gather_backward(const std::vector<float>& dxp, const std::vector<int32_t>& slot_of, std::vector<float>& dx,
                         int64_t T, int64_t k, int64_t D, bool dxp16) {
  Buf dp = dxp16 ? upload(to_bf16(dxp)) : upload(dxp), ddx = upload(dx);
  Buf ds = upload(slot_of);
  if (dxp16) cuda::moe_gather_backward(dp.as<cuda::bf16>(), ds.as<int32_t>(), ddx.as<float>(), T, k, D, nullptr);
  else cuda::moe_gather_backward(dp.as<float>(), ds.as<int32_t>(), ddx.as<float>(), T, k, D, nullptr);
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

MoeRouting moe_route_permute(const std::vector<float>& logits, const std::vector<float>& bias,
                             const std::vector<float>& x, int64_t T, int64_t E, int64_t G, int64_t topk_group,
                             int64_t k, int64_t D, bool norm, float scale, bool fused) {
  const int64_t n = T * k;
  Buf dl = upload(logits), db = upload(bias), dx = upload(to_bf16(x));
  Buf experts = poisoned<int32_t>(n), weights = poisoned<float>(n), keys = poisoned<int32_t>(n),
      slots_in = poisoned<int32_t>(n), slots = poisoned<int32_t>(n), token_of = poisoned<int32_t>(n),
      slot_of = poisoned<int32_t>(n), offsets = poisoned<int32_t>(E + 1), xp = poisoned<cuda::bf16>(n * D);
  if (fused) {
    check(cuda::moe_route_permute_small(dl.as<float>(), db.as<float>(), experts.as<int32_t>(), weights.as<float>(), T,
                                        E, G, topk_group, k, norm, scale, keys.as<int32_t>(), slots.as<int32_t>(),
                                        token_of.as<int32_t>(), slot_of.as<int32_t>(), offsets.as<int32_t>(),
                                        dx.as<cuda::bf16>(), xp.as<cuda::bf16>(), D, nullptr),
          "moe_route_permute_small declined T = ", T);
  } else {
    cuda::moe_route(dl.as<float>(), db.as<float>(), experts.as<int32_t>(), weights.as<float>(), T, E, G, topk_group, k,
                    norm, scale, nullptr);
    const size_t temp_bytes = cuda::moe_permute_temp_bytes(n);
    Buf temp(temp_bytes);
    cuda::moe_permute(experts.as<int32_t>(), T, k, E, keys.as<int32_t>(), slots_in.as<int32_t>(), slots.as<int32_t>(),
                      token_of.as<int32_t>(), slot_of.as<int32_t>(), offsets.as<int32_t>(), temp.p, temp_bytes,
                      nullptr);
    cuda::gather_rows(dx.as<cuda::bf16>(), token_of.as<int32_t>(), xp.as<cuda::bf16>(), n, D, nullptr);
  }
  finish();
  return MoeRouting{download<int32_t>(experts), download<int32_t>(keys),     download<int32_t>(slots),
                    download<int32_t>(token_of), download<int32_t>(slot_of), download<int32_t>(offsets),
                    download<float>(weights),    widen(download<cuda::bf16>(xp))};
}

}  // namespace nextlm::cuda_testing
