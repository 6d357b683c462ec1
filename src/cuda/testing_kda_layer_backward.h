// Host-side entry points to the KDA layer backward kernels outside the recurrence (src/cuda/kda_layer_backward.cu),
// for the kernel tests: host vectors in and out; outputs that are written (not added to) are poisoned with NaN first
// and so is the workspace, so an unwritten element or a read of an unwritten partial shows.
#pragma once
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// kda_conv_norm_backward on packed sequences (cu_seqlens [N+1]): raw [T, 3·HK], conv [3·HK, W], dq, dk, dv [T, H, K].
// draw [T, 3·HK] and dconv [3·HK, W] hold the starting values on entry and the accumulated gradients on return;
// dconv empty: not formed (a null dconv, the conv frozen). two_pass: kda_conv_norm_backward's two-kernel path.
void kda_conv_norm_backward(const std::vector<float>& raw, const std::vector<float>& conv,
                            const std::vector<int64_t>& cu_seqlens, const std::vector<float>& dq,
                            const std::vector<float>& dk, const std::vector<float>& dv, std::vector<float>& draw,
                            std::vector<float>& dconv, int64_t H, int64_t K, int64_t W, bool two_pass = false);
// The same with draw written in bf16 (kda_conv_norm_backward's draw16, poisoned first): returns its bits.
std::vector<uint16_t> kda_conv_norm_backward_bf16(const std::vector<float>& raw, const std::vector<float>& conv,
                                                  const std::vector<int64_t>& cu_seqlens, const std::vector<float>& dq,
                                                  const std::vector<float>& dk, const std::vector<float>& dv,
                                                  std::vector<float>& dconv, int64_t H, int64_t K, int64_t W,
                                                  bool two_pass = false);

// kda_gate_backward: f [T, HK] the f_b output, dt_bias [HK], A_log [H], dg [T, HK]. Returns df [T, HK]; ddt_bias
// [HK] and dA_log [H] are accumulated into. With df16, df is written in bf16 there instead (the returned one empty).
std::vector<float> kda_gate_backward(const std::vector<float>& f, const std::vector<float>& dt_bias,
                                     const std::vector<float>& A_log, const std::vector<float>& dg,
                                     std::vector<float>& ddt_bias, std::vector<float>& dA_log, int64_t T, int64_t H,
                                     int64_t K, bool has_bound, float bound, std::vector<uint16_t>* df16 = nullptr);

// sigmoid_backward_inplace: returns d·y·(1 − y).
std::vector<float> sigmoid_backward(const std::vector<float>& y, const std::vector<float>& d);

// kda_out_norm_backward: o [T, H, K], gate [T, HK], w [K], don [T, HK]. Returns dgate [T, HK]; do_ [T, H, K] and
// dw [K] are accumulated into, or with written do_ is written (its device buffer starting as NaN). bf16_o: o goes to
// the device rounded to bf16, through the bf16 overload. With dgate16, dgate is written in bf16 there instead (the
// returned one empty); with do16 (and written), do_ likewise (do_ left as it is).
std::vector<float> kda_out_norm_backward(const std::vector<float>& o, const std::vector<float>& gate,
                                         const std::vector<float>& w, const std::vector<float>& don,
                                         std::vector<float>& do_, std::vector<float>& dw, int64_t T, int64_t H,
                                         int64_t K, float eps, bool written = false, bool bf16_o = false,
                                         std::vector<uint16_t>* dgate16 = nullptr,
                                         std::vector<uint16_t>* do16 = nullptr);

}  // namespace nextlm::cuda_testing
