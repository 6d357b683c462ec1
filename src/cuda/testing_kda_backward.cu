// Host-side entry points to the KDA recurrence backward kernels (see testing_kda_backward.h).
#include "cuda/testing_kda_backward.h"

#include "cuda/backward_kernels.h"
#include "cuda/kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

namespace {

using detail::Buf;

// The inputs and gradient buffers of both kernels: dq, dk, dv, dg [T, H, K] and dbeta [T, H] start from `init`.
struct KdaBackwardBuffers {
  size_t nx, nb;
  Buf q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta;
  KdaBackwardBuffers(const std::vector<float>& hq, const std::vector<float>& hk, const std::vector<float>& hv,
                     const std::vector<float>& hg, const std::vector<float>& hbeta, const std::vector<float>& hdo,
                     const KdaBackwardGrads& init, int64_t T, int64_t H, int64_t K)
      : nx(static_cast<size_t>(T * H * K)),
        nb(static_cast<size_t>(T * H)),
        q(put(nx, hq)),
        k(put(nx, hk)),
        v(put(nx, hv)),
        g(put(nx, hg)),
        beta(put(nb, hbeta)),
        dout(put(nx, hdo)),
        dq(put(nx, init.dq)),
        dk(put(nx, init.dk)),
        dv(put(nx, init.dv)),
        dg(put(nx, init.dg)),
        dbeta(put(nb, init.dbeta)) {}
  // n floats holding v, or zeros for an empty v.
  static Buf put(size_t n, const std::vector<float>& v) {
    Buf b(n * sizeof(float));
    if (v.empty())
      NEXTLM_CUDA_CHECK(cudaMemset(b.p, 0, n * sizeof(float)));
    else
      detail::copy_to(b, v);
    return b;
  }
  KdaBackwardGrads get() const {
    detail::finish();
    return KdaBackwardGrads{detail::download<float>(dq, nx), detail::download<float>(dk, nx),
                            detail::download<float>(dv, nx), detail::download<float>(dg, nx),
                            detail::download<float>(dbeta, nb)};
  }
};

}  // namespace

KdaBackwardGrads kda_recurrent_backward(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, const std::vector<float>& g,
                                        const std::vector<float>& beta, const std::vector<float>& do_,
                                        const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                        const KdaBackwardGrads& init) {
  const int64_t T = cu_seqlens.back(), N = static_cast<int64_t>(cu_seqlens.size()) - 1;
  KdaBackwardBuffers b(q, k, v, g, beta, do_, init, T, H, K);
  const Buf cu = detail::upload(std::vector<int32_t>(cu_seqlens.begin(), cu_seqlens.end()));
  // The workspace is poisoned with NaN: the kernel must write every checkpoint it reads.
  const Buf work = detail::poisoned(cuda::kda_recurrent_backward_workspace_bytes(T, N, H, K));
  cuda::kda_recurrent_backward(b.q.as<float>(), b.k.as<float>(), b.v.as<float>(), b.g.as<float>(), b.beta.as<float>(),
                               b.dout.as<float>(), cu.as<int32_t>(), N, T, H, K, b.dq.as<float>(), b.dk.as<float>(),
                               b.dv.as<float>(), b.dg.as<float>(), b.dbeta.as<float>(), work.p, nullptr);
  return b.get();
}

KdaBackwardGrads kda_chunked_backward(const std::vector<float>& q, const std::vector<float>& k,
                                      const std::vector<float>& v, const std::vector<float>& g,
                                      const std::vector<float>& beta, const std::vector<float>& do_,
                                      const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                      const KdaBackwardGrads& init, bool written, bool bf16_products,
                                      bool bf16_inputs) {
  const int64_t T = cu_seqlens.back();
  KdaBackwardBuffers b(q, k, v, g, beta, do_, init, T, H, K);
  if (written)
    for (const Buf* o : {&b.dq, &b.dk, &b.dv, &b.dg, &b.dbeta}) NEXTLM_CUDA_CHECK(cudaMemset(o->p, 0xFF, o->bytes));
  const detail::DevKdaChunks ch(cu_seqlens);
  const Buf work = detail::poisoned(cuda::kda_chunked_backward_workspace_bytes(ch.num_chunks(), T, H, K));
  const auto products = bf16_products ? cuda::KdaBackwardProducts::Bf16 : cuda::KdaBackwardProducts::SplitBf16;
  auto run = [&](const auto* dq, const auto* dk, const auto* dv) {
    cuda::kda_chunked_backward(dq, dk, dv, b.g.as<float>(), b.beta.as<float>(), b.dout.as<float>(), ch.view, T, H, K,
                               b.dq.as<float>(), b.dk.as<float>(), b.dv.as<float>(), b.dg.as<float>(),
                               b.dbeta.as<float>(), work.p, nullptr, !written, products);
  };
  if (bf16_inputs) {
    const Buf q16 = detail::upload(detail::to_bf16(q)), k16 = detail::upload(detail::to_bf16(k)),
              v16 = detail::upload(detail::to_bf16(v));
    run(q16.as<cuda::bf16>(), k16.as<cuda::bf16>(), v16.as<cuda::bf16>());
  } else {
    run(b.q.as<float>(), b.k.as<float>(), b.v.as<float>());
  }
  return b.get();
}

KdaBackwardGrads kda_chunked_backward_gated(const std::vector<float>& q, const std::vector<float>& k,
                                            const std::vector<float>& v, const std::vector<float>& f,
                                            const std::vector<float>& dt_bias, const std::vector<float>& A_log,
                                            bool has_bound, float bound, const std::vector<float>& beta,
                                            const std::vector<float>& do_, const std::vector<int64_t>& cu_seqlens,
                                            int64_t H, int64_t K, bool from_f, bool bf16_products) {
  const int64_t T = cu_seqlens.back();
  KdaBackwardBuffers b(q, k, v, f, beta, do_, {}, T, H, K);  // b.g holds f
  for (const Buf* o : {&b.dq, &b.dk, &b.dv, &b.dg, &b.dbeta}) NEXTLM_CUDA_CHECK(cudaMemset(o->p, 0xFF, o->bytes));
  const Buf bias = detail::upload(dt_bias), alog = detail::upload(A_log);
  const detail::DevKdaChunks ch(cu_seqlens);
  const Buf work = detail::poisoned(cuda::kda_chunked_backward_workspace_bytes(ch.num_chunks(), T, H, K));
  const auto products = bf16_products ? cuda::KdaBackwardProducts::Bf16 : cuda::KdaBackwardProducts::SplitBf16;
  cuda::KdaGateInputs gate;
  const Buf g = detail::poisoned(from_f ? 0 : static_cast<size_t>(T * H * K) * sizeof(float));  // kda_gate's
  if (from_f) {
    gate = {b.g.as<float>(), bias.as<float>(), alog.as<float>(), has_bound, bound};
  } else {
    cuda::kda_gate(b.g.as<float>(), g.as<float>(), bias.as<float>(), alog.as<float>(), T, H, K, has_bound, bound,
                   nullptr);
  }
  cuda::kda_chunked_backward(b.q.as<float>(), b.k.as<float>(), b.v.as<float>(), g.or_null<float>(),
                             b.beta.as<float>(), b.dout.as<float>(), ch.view, T, H, K, b.dq.as<float>(),
                             b.dk.as<float>(), b.dv.as<float>(), b.dg.as<float>(), b.dbeta.as<float>(), work.p,
                             nullptr, false, products, nullptr, nullptr, gate);
  return b.get();
}

KdaBackwardGrads kda_chunked_backward_kept(const std::vector<float>& q, const std::vector<float>& k,
                                           const std::vector<float>& v, const std::vector<float>& f,
                                           const std::vector<float>& dt_bias, const std::vector<float>& A_log,
                                           float bound, const std::vector<float>& beta, const std::vector<float>& do_,
                                           const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                           bool bf16_operands) {
  const int64_t T = cu_seqlens.back(), n = T * H * K;
  const detail::DevKdaChunks ch(cu_seqlens);
  const int64_t nc = ch.num_chunks();
  const Buf q16 = detail::upload(detail::to_bf16(q)), k16 = detail::upload(detail::to_bf16(k)),
            v16 = detail::upload(detail::to_bf16(v)), df = detail::upload(f), bias = detail::upload(dt_bias),
            alog = detail::upload(A_log), db = detail::upload(beta);
  // The forward, keeping its chunk states and v_new (NaN first: the backward must read only what it wrote).
  const Buf o = detail::poisoned<cuda::bf16>(static_cast<size_t>(n)), fwork(cuda::kda_tc_workspace_bytes(nc, H, K));
  const Buf kh = detail::poisoned<float>(static_cast<size_t>(nc * H * K * K));
  const Buf ku = detail::poisoned<float>(bf16_operands ? 0 : static_cast<size_t>(nc * H * 64 * K)),
            ku16 = detail::poisoned<cuda::bf16>(bf16_operands ? static_cast<size_t>(nc * H * 64 * K) : 0);
  cuda::KdaTcStates keep;
  keep.chunk_h = kh.as<float>(), keep.chunk_u = ku.or_null<float>(), keep.chunk_u16 = ku16.or_null<cuda::bf16>();
  cuda::kda_chunked_tc(q16.as<cuda::bf16>(), k16.as<cuda::bf16>(), v16.as<cuda::bf16>(), df.as<float>(),
                       db.as<float>(), bias.as<float>(), alog.as<float>(), bound, o.as<cuda::bf16>(), ch.view,
                       cuda::kda_tc_workspace(fwork.p, nc, H, K), H, K, keep, nullptr);
  // The backward on them, dO as the bf16 rounding of do_ (in fp32 or in bf16).
  const std::vector<cuda::bf16> do_r = detail::to_bf16(do_);
  KdaBackwardBuffers b(q, k, v, {}, beta, detail::widen(do_r), {}, T, H, K);
  for (const Buf* out : {&b.dq, &b.dk, &b.dv, &b.dg, &b.dbeta})
    NEXTLM_CUDA_CHECK(cudaMemset(out->p, 0xFF, out->bytes));
  const Buf do16 = detail::upload(bf16_operands ? do_r : std::vector<cuda::bf16>());
  const Buf work = detail::poisoned(cuda::kda_chunked_backward_workspace_bytes(nc, T, H, K));
  const cuda::KdaGateInputs gate{df.as<float>(), bias.as<float>(), alog.as<float>(), true, bound};
  const cuda::KdaBf16Operands b16{do16.or_null<cuda::bf16>(), ku16.or_null<cuda::bf16>()};
  cuda::kda_chunked_backward(q16.as<cuda::bf16>(), k16.as<cuda::bf16>(), v16.as<cuda::bf16>(), nullptr,
                             b.beta.as<float>(), bf16_operands ? nullptr : b.dout.as<float>(), ch.view, T, H, K,
                             b.dq.as<float>(), b.dk.as<float>(), b.dv.as<float>(), b.dg.as<float>(),
                             b.dbeta.as<float>(), work.p, nullptr, false, cuda::KdaBackwardProducts::Bf16,
                             kh.as<float>(), ku.or_null<float>(), gate, b16);
  return b.get();
}

void set_kda_backward_compact_prep(bool on) { cuda::set_kda_backward_compact_prep(on); }
bool kda_backward_compact_prep() { return cuda::kda_backward_compact_prep(); }

}  // namespace nextlm::cuda_testing
