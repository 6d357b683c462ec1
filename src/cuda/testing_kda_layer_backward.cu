// Test hooks of the KDA layer backward kernels outside the recurrence (see testing_kda_layer_backward.h).
#include "cuda/testing_kda_layer_backward.h"

#include "cuda/backward_kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

using detail::Buf;
using detail::download;
using detail::finish;
using detail::poisoned;
using detail::upload;

namespace {

// Both forms: draw (fp32, added to) or, when draw is null, draw16 (bf16 bits, written).
void conv_norm_backward(const std::vector<float>& raw, const std::vector<float>& conv,
                        const std::vector<int64_t>& cu_seqlens, const std::vector<float>& dq,
                        const std::vector<float>& dk, const std::vector<float>& dv, std::vector<float>* draw,
                        std::vector<uint16_t>* draw16, std::vector<float>& dconv, int64_t H, int64_t K, int64_t W,
                        bool two_pass) {
  const int64_t T = cu_seqlens.back();
  const std::vector<int32_t> seq_start = detail::seq_starts(cu_seqlens);
  Buf d_raw = upload(raw), d_conv = upload(conv), d_dq = upload(dq), d_dk = upload(dk), d_dv = upload(dv),
      d_draw = draw ? upload(*draw) : Buf(0), d_draw16 = poisoned<uint16_t>(draw ? 0 : raw.size()),
      d_dconv = upload(dconv);
  Buf d_ss = upload(seq_start);
  Buf work =
      poisoned<float>(static_cast<size_t>(cuda::kda_conv_norm_backward_workspace_floats(T, H, K, W, two_pass)));
  cuda::kda_conv_norm_backward(d_raw.as<float>(), d_conv.as<float>(), d_ss.as<int32_t>(), d_dq.as<float>(),
                               d_dk.as<float>(), d_dv.as<float>(), draw ? d_draw.as<float>() : nullptr,
                               dconv.empty() ? nullptr : d_dconv.as<float>(), T, H, K, W, work.as<float>(), nullptr,
                               draw ? nullptr : d_draw16.as<cuda::bf16>(), two_pass);
  finish();
  if (draw) *draw = download<float>(d_draw);
  else *draw16 = download<uint16_t>(d_draw16);
  if (!dconv.empty()) dconv = download<float>(d_dconv);
}

}  // namespace

void kda_conv_norm_backward(const std::vector<float>& raw, const std::vector<float>& conv,
                            const std::vector<int64_t>& cu_seqlens, const std::vector<float>& dq,
                            const std::vector<float>& dk, const std::vector<float>& dv, std::vector<float>& draw,
                            std::vector<float>& dconv, int64_t H, int64_t K, int64_t W, bool two_pass) {
  conv_norm_backward(raw, conv, cu_seqlens, dq, dk, dv, &draw, nullptr, dconv, H, K, W, two_pass);
}

std::vector<uint16_t> kda_conv_norm_backward_bf16(const std::vector<float>& raw, const std::vector<float>& conv,
                                                  const std::vector<int64_t>& cu_seqlens, const std::vector<float>& dq,
                                                  const std::vector<float>& dk, const std::vector<float>& dv,
                                                  std::vector<float>& dconv, int64_t H, int64_t K, int64_t W,
                                                  bool two_pass) {
  std::vector<uint16_t> draw16;
  conv_norm_backward(raw, conv, cu_seqlens, dq, dk, dv, nullptr, &draw16, dconv, H, K, W, two_pass);
  return draw16;
}

std::vector<float> kda_gate_backward(const std::vector<float>& f, const std::vector<float>& dt_bias,
                                     const std::vector<float>& A_log, const std::vector<float>& dg,
                                     std::vector<float>& ddt_bias, std::vector<float>& dA_log, int64_t T, int64_t H,
                                     int64_t K, bool has_bound, float bound, std::vector<uint16_t>* df16) {
  Buf d_f = upload(f), d_dt = upload(dt_bias), d_A = upload(A_log), d_dg = upload(dg), d_ddt = upload(ddt_bias),
      d_dA = upload(dA_log);
  Buf df = poisoned<float>(df16 ? 0 : f.size()), df_16 = poisoned<cuda::bf16>(df16 ? f.size() : 0);
  Buf work = poisoned<float>(static_cast<size_t>(cuda::kda_gate_backward_workspace_floats(T, H, K)));
  cuda::kda_gate_backward(d_f.as<float>(), d_dt.as<float>(), d_A.as<float>(), d_dg.as<float>(), df.or_null<float>(),
                          d_ddt.as<float>(), d_dA.as<float>(), T, H, K, has_bound, bound, work.as<float>(), nullptr,
                          df_16.or_null<cuda::bf16>());
  finish();
  ddt_bias = download<float>(d_ddt);
  dA_log = download<float>(d_dA);
  if (df16) *df16 = download<uint16_t>(df_16);
  return download<float>(df);
}

std::vector<float> sigmoid_backward(const std::vector<float>& y, const std::vector<float>& d) {
  Buf d_y = upload(y), d_d = upload(d);
  cuda::sigmoid_backward_inplace(d_y.as<float>(), d_d.as<float>(), static_cast<int64_t>(d.size()), nullptr);
  finish();
  return download<float>(d_d);
}

std::vector<float> kda_out_norm_backward(const std::vector<float>& o, const std::vector<float>& gate,
                                         const std::vector<float>& w, const std::vector<float>& don,
                                         std::vector<float>& do_, std::vector<float>& dw, int64_t T, int64_t H,
                                         int64_t K, float eps, bool written, bool bf16_o,
                                         std::vector<uint16_t>* dgate16, std::vector<uint16_t>* do16) {
  Buf d_o = bf16_o ? upload(detail::to_bf16(o)) : upload(o), d_gate = upload(gate), d_w = upload(w),
      d_don = upload(don), d_dw = upload(dw);
  Buf d_do = do16 ? Buf(0) : (written ? poisoned<float>(do_.size()) : upload(do_));
  Buf d_do16 = poisoned<cuda::bf16>(do16 ? do_.size() : 0);
  Buf dgate = poisoned<float>(dgate16 ? 0 : gate.size()), dg16 = poisoned<cuda::bf16>(dgate16 ? gate.size() : 0);
  Buf work = poisoned<float>(static_cast<size_t>(cuda::kda_out_norm_backward_workspace_floats(T, H, K)));
  if (bf16_o)
    cuda::kda_out_norm_backward(d_o.as<cuda::bf16>(), d_gate.as<float>(), d_w.as<float>(), d_don.as<float>(),
                                d_do.or_null<float>(), dgate.or_null<float>(), d_dw.as<float>(), T, H, K, eps,
                                work.as<float>(), nullptr, !written, dg16.or_null<cuda::bf16>(),
                                d_do16.or_null<cuda::bf16>());
  else
    cuda::kda_out_norm_backward(d_o.as<float>(), d_gate.as<float>(), d_w.as<float>(), d_don.as<float>(),
                                d_do.or_null<float>(), dgate.or_null<float>(), d_dw.as<float>(), T, H, K, eps,
                                work.as<float>(), nullptr, !written, dg16.or_null<cuda::bf16>(),
                                d_do16.or_null<cuda::bf16>());
  finish();
  if (do16) *do16 = download<uint16_t>(d_do16);
  else do_ = download<float>(d_do);
  dw = download<float>(d_dw);
  if (dgate16) *dgate16 = download<uint16_t>(dg16);
  return download<float>(dgate);
}

}  // namespace nextlm::cuda_testing
