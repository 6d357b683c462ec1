// Test hooks of the DSA attention backward kernels (see testing_dsa_backward.h).
#include "cuda/testing_dsa_backward.h"

#include <algorithm>
#include <cmath>

#include "cuda/backward_kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

namespace {

using detail::Buf;
using detail::download;
using detail::upload;

constexpr size_t kGuard = 64;
constexpr float kGuardValue = 1234.5f;
constexpr int32_t kFarKey = 1 << 30;  // an unused selection slot: kv row far past any buffer

enum class Kernel { Tiled, Scatter, TensorCore, TensorCoreFromForward };

// The shared body of the entry points: uploads, one run, guard checks, downloads.
void run_backward(Kernel kernel, const std::vector<float>& q, const std::vector<float>& kv,
                  const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                  const std::vector<int64_t>& cu, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                  std::vector<float>& dq, std::vector<float>& dkv, bool bf16_out = false) {
  const int64_t T = cu.back(), W = dqk + dv;
  check(static_cast<int64_t>(sel.size()) == T && static_cast<int64_t>(q.size()) == T * NH * dqk &&
            static_cast<int64_t>(kv.size()) == T * NH * W && static_cast<int64_t>(dout.size()) == T * NH * dv &&
            dq.size() == q.size() && dkv.size() == kv.size(),
        "mla_sparse_attention_backward test hook: inconsistent sizes");
  std::vector<int32_t> sel_flat(std::max<int64_t>(T * max_sel, 1), kFarKey), count(T), start(T), len(T);
  int64_t max_len = 1;
  for (size_t n = 0; n + 1 < cu.size(); ++n) max_len = std::max(max_len, cu[n + 1] - cu[n]);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      start[t] = static_cast<int32_t>(cu[n]);
      len[t] = static_cast<int32_t>(cu[n + 1] - cu[n]);
    }
  for (int64_t t = 0; t < T; ++t) {
    check(static_cast<int64_t>(sel[t].size()) <= max_sel, "test hook: selection of token ", t, " exceeds max_sel");
    count[t] = static_cast<int32_t>(sel[t].size());
    std::copy(sel[t].begin(), sel[t].end(), sel_flat.begin() + t * max_sel);
  }
  auto guarded = [](const std::vector<float>& v) {
    std::vector<float> g(v);
    g.insert(g.end(), kGuard, kGuardValue);
    return g;
  };
  const bool tc = kernel == Kernel::TensorCore || kernel == Kernel::TensorCoreFromForward;
  // The tensor-core kernel reads bf16 q and kv, the others fp32.
  const Buf bq = tc ? upload(detail::to_bf16(q)) : upload(q), bkv = tc ? upload(detail::to_bf16(kv)) : upload(kv);
  const Buf bdo = upload(dout), bsel = upload(sel_flat), bcount = upload(count), bstart = upload(start),
            blen = upload(len);
  Buf bdq = upload(guarded(dq)), bdkv = upload(guarded(dkv));
  // bf16 outputs: poisoned (0xff bytes, a NaN) past their ends too, and no fp32 arrays at all.
  Buf bdq16 = detail::poisoned<cuda::bf16>(bf16_out ? dq.size() + kGuard : 0),
      bdkv16 = detail::poisoned<cuda::bf16>(bf16_out ? dkv.size() + kGuard : 0);
  Buf work = detail::poisoned(tc ? cuda::mla_sparse_attention_backward_tc_workspace_bytes(T, NH, max_len, dqk, dv)
                                 : cuda::mla_sparse_attention_backward_workspace_bytes(T, NH, max_len));
  switch (kernel) {
    case Kernel::Scatter:
      cuda::mla_sparse_attention_backward_scatter(bq.as<float>(), bkv.as<float>(), bsel.as<int32_t>(),
                                                  bcount.as<int32_t>(), bstart.as<int32_t>(), blen.as<int32_t>(),
                                                  bdo.as<float>(), bdq.as<float>(), bdkv.as<float>(), T, NH, dqk, dv,
                                                  max_sel, nullptr);
      break;
    case Kernel::Tiled:
      cuda::mla_sparse_attention_backward(bq.as<float>(), bkv.as<float>(), bsel.as<int32_t>(), bcount.as<int32_t>(),
                                          bstart.as<int32_t>(), blen.as<int32_t>(), bdo.as<float>(), bdq.as<float>(),
                                          bdkv.as<float>(), T, NH, dqk, dv, max_sel, max_len, work.p, nullptr);
      break;
    case Kernel::TensorCore:
    case Kernel::TensorCoreFromForward: {
      const bool fwd = kernel == Kernel::TensorCoreFromForward;
      const int64_t words = cuda::mla_mask_words(max_len);
      Buf o = detail::poisoned<cuda::bf16>(fwd ? T * NH * dv : 0), lse2 = detail::poisoned<float>(fwd ? T * NH : 0),
          mask = detail::poisoned<uint32_t>(fwd ? T * words : 0);
      if (fwd)
        cuda::mla_sparse_attention_tc(bq.as<cuda::bf16>(), bkv.as<cuda::bf16>(), bsel.as<int32_t>(),
                                      bcount.as<int32_t>(), bstart.as<int32_t>(), blen.as<int32_t>(),
                                      o.as<cuda::bf16>(), mask.as<uint32_t>(), words, T, NH, dqk, dv, max_sel, nullptr,
                                      lse2.as<float>());
      cuda::mla_sparse_attention_backward_tc(bq.as<cuda::bf16>(), bkv.as<cuda::bf16>(), bsel.as<int32_t>(),
                                             bcount.as<int32_t>(), bstart.as<int32_t>(), blen.as<int32_t>(),
                                             bdo.as<float>(), bf16_out ? nullptr : bdq.as<float>(),
                                             bf16_out ? nullptr : bdkv.as<float>(), T, NH, dqk, dv, max_sel, max_len,
                                             work.p, nullptr, fwd ? lse2.as<float>() : nullptr,
                                             fwd ? o.as<cuda::bf16>() : nullptr,
                                             bf16_out ? bdq16.as<cuda::bf16>() : nullptr,
                                             bf16_out ? bdkv16.as<cuda::bf16>() : nullptr);
      NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());  // before o, lse2 and mask are freed
      break;
    }
  }
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  if (bf16_out) {
    const std::vector<float> gq = detail::widen(download<cuda::bf16>(bdq16)),
                             gkv = detail::widen(download<cuda::bf16>(bdkv16));
    for (size_t i = 0; i < kGuard; ++i)
      check(std::isnan(gq[dq.size() + i]) && std::isnan(gkv[dkv.size() + i]),
            "mla_sparse_attention_backward_tc wrote past the end of its bf16 dq or dkv");
    std::copy(gq.begin(), gq.begin() + dq.size(), dq.begin());
    std::copy(gkv.begin(), gkv.begin() + dkv.size(), dkv.begin());
    return;
  }
  const std::vector<float> gq = download<float>(bdq), gkv = download<float>(bdkv);
  for (size_t i = 0; i < kGuard; ++i)
    check(gq[dq.size() + i] == kGuardValue && gkv[dkv.size() + i] == kGuardValue,
          "mla_sparse_attention_backward wrote past the end of dq or dkv");
  std::copy(gq.begin(), gq.begin() + dq.size(), dq.begin());
  std::copy(gkv.begin(), gkv.begin() + dkv.size(), dkv.begin());
}

}  // namespace

void mla_sparse_attention_backward(const std::vector<float>& q, const std::vector<float>& kv,
                                   const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                                   const std::vector<int64_t>& cu, int64_t NH, int64_t dqk, int64_t dv,
                                   int64_t max_sel, std::vector<float>& dq, std::vector<float>& dkv, bool scatter) {
  run_backward(scatter ? Kernel::Scatter : Kernel::Tiled, q, kv, dout, sel, cu, NH, dqk, dv, max_sel, dq, dkv);
}

void mla_sparse_attention_backward_tc(const std::vector<float>& q, const std::vector<float>& kv,
                                      const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                                      const std::vector<int64_t>& cu, int64_t NH, int64_t dqk, int64_t dv,
                                      int64_t max_sel, std::vector<float>& dq, std::vector<float>& dkv,
                                      bool from_forward, bool bf16_out) {
  run_backward(from_forward ? Kernel::TensorCoreFromForward : Kernel::TensorCore, q, kv, dout, sel, cu, NH, dqk, dv,
               max_sel, dq, dkv, bf16_out);
}

bool mla_backward_tc_bf16_outputs(int64_t dqk, int64_t dv) { return cuda::mla_backward_tc_bf16_outputs(dqk, dv); }

}  // namespace nextlm::cuda_testing
