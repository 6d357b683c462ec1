// Kernel-level test and benchmark hooks (see testing.h).
#include "cuda/testing.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::cuda_testing {

// Buf, upload, download, to_bf16, widen, DevKdaChunks (cuda/testing_buffers.h), in every part of this file.
using namespace detail;

namespace {

// Random KDA inputs on packed sequences of the given lengths, as the conv kernel leaves them (unit-norm k, q also
// scaled by K^-1/2) with sigmoid betas; rnd() keeps drawing normals from the same generator.
struct KdaInputs {
  std::vector<int64_t> cu{0};
  int64_t T = 0, n = 0;
  std::vector<float> q, k, beta;
  std::mt19937 gen{1};
  std::normal_distribution<float> nd{0.0f, 1.0f};
  std::vector<float> rnd(int64_t m, float scale) {
    std::vector<float> x(m);
    for (float& e : x) e = nd(gen) * scale;
    return x;
  }
  KdaInputs(const std::vector<int64_t>& seqlens, int64_t H, int64_t K) {
    for (int64_t L : seqlens) cu.push_back(cu.back() + L);
    T = cu.back(), n = T * H * K;
    q = rnd(n, 1.0f), k = rnd(n, 1.0f);
    for (int64_t r = 0; r < T * H; ++r) {
      double sq = 0, sk = 0;
      for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
      for (int64_t d = 0; d < K; ++d) q[r * K + d] /= std::sqrt(sq * K), k[r * K + d] /= std::sqrt(sk);
    }
    beta = rnd(T * H, 1.0f);
    for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));
  }
};

}  // namespace

std::vector<float> kda_chunked(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                               const std::vector<float>& g, const std::vector<float>& beta,
                               const std::vector<int64_t>& cu, int64_t H, int64_t K) {
  const int64_t T = cu.back();
  const DevKdaChunks ch(cu);
  Buf dq = upload(q), dk = upload(k), dv = upload(v), dg = upload(g), db = upload(beta);
  std::vector<float> out(T * H * K, NAN);
  Buf o = upload(out);
  Buf work(cuda::kda_workspace_floats(ch.num_chunks(), H, K) * sizeof(float));
  cuda::kda_chunked(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), db.as<float>(), o.as<float>(),
                    ch.view, work.as<float>(), T, H, K, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  NEXTLM_CUDA_CHECK(cudaMemcpy(out.data(), o.p, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> kda_chunked_tc(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                  const std::vector<float>& graw, const std::vector<float>& beta,
                                  const std::vector<float>& A_log, const std::vector<float>& dt_bias, float bound,
                                  const std::vector<int64_t>& cu, int64_t H, int64_t K, const std::vector<float>& s_in,
                                  std::vector<float>* s_out, bool boundary) {
  const int64_t T = cu.back(), N = static_cast<int64_t>(cu.size()) - 1;
  const DevKdaChunks ch(cu);
  Buf dq = upload(to_bf16(q)), dk = upload(to_bf16(k)), dv = upload(to_bf16(v)), dg = upload(graw), db = upload(beta);
  Buf da = upload(A_log), dd = upload(dt_bias);
  Buf o = upload(std::vector<cuda::bf16>(T * H * K, __float2bfloat16(NAN)));
  Buf si = upload(s_in);
  Buf so = upload(std::vector<float>(N * H * K * K, NAN));
  const int64_t nc = ch.num_chunks();
  Buf work(cuda::kda_tc_workspace_bytes(nc, H, K));
  cuda::kda_chunked_tc(dq.as<cuda::bf16>(), dk.as<cuda::bf16>(), dv.as<cuda::bf16>(), dg.as<float>(), db.as<float>(),
                       dd.as<float>(), da.as<float>(), bound, o.as<cuda::bf16>(), ch.view,
                       cuda::kda_tc_workspace(work.p, nc, H, K), H, K,
                       cuda::KdaTcStates{s_in.empty() ? nullptr : si.as<float>(), so.as<float>(), nullptr, boundary},
                       nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  std::vector<cuda::bf16> out16(T * H * K);
  NEXTLM_CUDA_CHECK(cudaMemcpy(out16.data(), o.p, out16.size() * 2, cudaMemcpyDeviceToHost));
  if (s_out) {
    s_out->resize(N * H * K * K);
    NEXTLM_CUDA_CHECK(cudaMemcpy(s_out->data(), so.p, s_out->size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  std::vector<float> out(out16.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = __bfloat162float(out16[i]);
  return out;
}

KdaTiming time_kda_forward_tc(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters) {
  KdaInputs in(seqlens, H, K);
  const int64_t n = in.n;
  const std::vector<float>&q = in.q, &k = in.k, &beta = in.beta;
  auto rnd = [&](int64_t m, float scale) { return in.rnd(m, scale); };
  const DevKdaChunks ch(in.cu);
  const int64_t nc = ch.num_chunks();
  // Several input sets, rotated, so that the timed runs do not find their inputs in L2.
  constexpr int kSets = 3;
  std::vector<Buf> bq, bk, bv, bg;
  for (int i = 0; i < kSets; ++i) {
    bq.push_back(upload(to_bf16(q)));
    bk.push_back(upload(to_bf16(k)));
    bv.push_back(upload(to_bf16(rnd(n, 1.0f))));
    bg.push_back(upload(to_bf16(rnd(n, 1.0f))));
  }
  Buf db = upload(beta), dt = upload(rnd(H * K, 0.5f)), alog = upload(rnd(H, 0.5f));
  Buf o(n * 2), work(cuda::kda_tc_workspace_bytes(nc, H, K));
  const cuda::KdaChunks& kc = ch.view;
  const cuda::KdaTcWork w = cuda::kda_tc_workspace(work.p, nc, H, K);
  cudaEvent_t a, b;
  NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
  NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
  // part 0: both kernels; 1: prepare only; 2: state only (on the factors the last prepare left).
  auto timed = [&](int part) {
    std::vector<float> ms;
    for (int it = 0; it < iters + 3; ++it) {
      const int s = it % kSets;
      NEXTLM_CUDA_CHECK(cudaEventRecord(a));
      if (part != 2)
        cuda::kda_tc_prepare(bq[s].as<cuda::bf16>(), bk[s].as<cuda::bf16>(), bv[s].as<cuda::bf16>(),
                             bg[s].as<cuda::bf16>(), db.as<float>(), dt.as<float>(), alog.as<float>(), -5.0f, kc, w, H,
                             K, nullptr);
      if (part != 1) cuda::kda_tc_state(kc, w, o.as<cuda::bf16>(), H, K, cuda::KdaTcStates{}, nullptr);
      NEXTLM_CUDA_CHECK(cudaEventRecord(b));
      NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
      NEXTLM_CUDA_CHECK(cudaGetLastError());
      float t = 0;
      NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
      if (it >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return static_cast<double>(ms[ms.size() / 2]);
  };
  KdaTiming r{};
  r.total_ms = timed(0);
  r.prepare_ms = timed(1);
  r.state_ms = timed(2);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return r;
}

double time_kda_forward(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters) {
  KdaInputs in(seqlens, H, K);
  const std::vector<int64_t>& cu = in.cu;
  const int64_t T = in.T, n = in.n;
  const std::vector<float>&q = in.q, &k = in.k, &beta = in.beta;
  auto rnd = [&](int64_t m, float scale) { return in.rnd(m, scale); };
  const DevKdaChunks ch(cu);
  Buf dq = upload(q), dk = upload(k), dv = upload(rnd(n, 1.0f)), graw = upload(rnd(n, 1.0f)), db = upload(beta);
  Buf dt = upload(rnd(H * K, 0.5f)), alog = upload(rnd(H, 0.5f));
  Buf g(n * sizeof(float)), o(n * sizeof(float));
  Buf work(cuda::kda_workspace_floats(ch.num_chunks(), H, K) * sizeof(float));
  const cuda::KdaChunks& kc = ch.view;
  cudaEvent_t a, b;
  NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
  NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int it = 0; it < iters + 3; ++it) {
    NEXTLM_CUDA_CHECK(cudaMemcpy(g.p, graw.p, n * sizeof(float), cudaMemcpyDeviceToDevice));
    NEXTLM_CUDA_CHECK(cudaEventRecord(a));
    cuda::kda_gate(g.as<float>(), dt.as<float>(), alog.as<float>(), T, H, K, true, -5.0f, nullptr);
    cuda::kda_chunked(dq.as<float>(), dk.as<float>(), dv.as<float>(), g.as<float>(), db.as<float>(), o.as<float>(), kc,
                      work.as<float>(), T, H, K, nullptr);
    NEXTLM_CUDA_CHECK(cudaEventRecord(b));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    if (it >= 3) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace nextlm::cuda_testing

namespace nextlm::cuda_testing {

void mla_attention_both(const std::vector<float>& q, const std::vector<float>& kv,
                        const std::vector<std::vector<int32_t>>& sel, const std::vector<int64_t>& cu, int64_t NH,
                        int64_t dqk, int64_t dv, std::vector<float>& tc, std::vector<float>& ref) {
  const int64_t T = cu.back();
  int64_t max_sel = 1, max_len = 1;
  for (const auto& s : sel) max_sel = std::max<int64_t>(max_sel, static_cast<int64_t>(s.size()));
  std::vector<int32_t> sel_flat(T * max_sel, 0), count(T), start(T), len(T);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      start[t] = static_cast<int32_t>(cu[n]);
      len[t] = static_cast<int32_t>(cu[n + 1] - cu[n]);
      max_len = std::max<int64_t>(max_len, len[t]);
    }
  for (int64_t t = 0; t < T; ++t) {
    count[t] = static_cast<int32_t>(sel[t].size());
    std::copy(sel[t].begin(), sel[t].end(), sel_flat.begin() + t * max_sel);
  }
  std::vector<float> q32(q), kv32(kv);  // the CUDA-core kernel gets the same bf16-rounded values in fp32
  for (float& x : q32) x = __bfloat162float(__float2bfloat16(x));
  for (float& x : kv32) x = __bfloat162float(__float2bfloat16(x));
  Buf dq = upload(q32), dkv = upload(kv32), dq16 = upload(to_bf16(q)), dkv16 = upload(to_bf16(kv));
  Buf ds = upload(sel_flat), dc = upload(count), dst = upload(start), dl = upload(len);
  const int64_t words = cuda::mla_mask_words(max_len);
  Buf mask(T * words * sizeof(uint32_t));
  const std::vector<cuda::bf16> poison(T * NH * dv, __float2bfloat16(NAN));
  Buf o1 = upload(poison), o2 = upload(poison);
  cuda::mla_sparse_attention_tc(dq16.as<cuda::bf16>(), dkv16.as<cuda::bf16>(), ds.as<int32_t>(), dc.as<int32_t>(),
                                dst.as<int32_t>(), dl.as<int32_t>(), o1.as<cuda::bf16>(), mask.as<uint32_t>(), words, T,
                                NH, dqk, dv, max_sel, nullptr);
  cuda::mla_sparse_attention(dq.as<float>(), dkv.as<float>(), ds.as<int32_t>(), dc.as<int32_t>(), dst.as<int32_t>(),
                             dl.as<int32_t>(), o2.as<cuda::bf16>(), T, NH, dqk, dv, max_sel, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  std::vector<cuda::bf16> h1(T * NH * dv), h2(T * NH * dv);
  NEXTLM_CUDA_CHECK(cudaMemcpy(h1.data(), o1.p, h1.size() * 2, cudaMemcpyDeviceToHost));
  NEXTLM_CUDA_CHECK(cudaMemcpy(h2.data(), o2.p, h2.size() * 2, cudaMemcpyDeviceToHost));
  tc.resize(h1.size());
  ref.resize(h2.size());
  for (size_t i = 0; i < h1.size(); ++i) tc[i] = __bfloat162float(h1[i]), ref[i] = __bfloat162float(h2[i]);
}

}  // namespace nextlm::cuda_testing

// ---- Decoding kernels ----
#include "cuda/decode_kernels.h"

namespace nextlm::cuda_testing {

std::vector<float> decode_linear(const std::vector<float>& x, const std::vector<float>& W, int64_t M, int64_t out,
                                 int64_t in) {
  Buf dx = upload(to_bf16(x)), dw = upload(to_bf16(W)), dy = upload(std::vector<float>(M * out, NAN));
  cuda::decode_linear(dx.as<cuda::bf16>(), in, dw.as<cuda::bf16>(), out, in, dy.as<float>(), out, M, false, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  return download<float>(dy, M * out);
}

std::vector<std::vector<float>> kda_decode_steps(const KdaDecodeSteps& in, std::vector<float>& conv_hist,
                                                 std::vector<float>& state) {
  const int64_t H = in.H, K = in.K, HK = H * K;
  Buf conv = upload(in.conv), dt = upload(in.dt_bias), al = upload(in.A_log);
  Buf hist = upload(conv_hist), st = upload(state);
  std::vector<std::vector<float>> out;
  for (size_t s = 0; s < in.slots.size(); ++s) {
    const int64_t B = static_cast<int64_t>(in.slots[s].size());
    Buf raw = upload(in.raw[s]), graw = upload(in.graw[s]), beta = upload(in.beta[s]), slot = upload(in.slots[s]);
    Buf o = upload(std::vector<float>(B * HK, NAN));
    cuda::KdaDecodeParams p{raw.as<float>(), conv.as<float>(), graw.as<float>(), dt.as<float>(), al.as<float>(),
                            beta.as<float>(), slot.as<int32_t>(), hist.as<float>(), st.as<float>(), o.as<float>(),
                            B, H, K, in.W, in.has_bound, in.bound};
    cuda::kda_decode_step(p, nullptr);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    out.push_back(download<float>(o, B * HK));
  }
  conv_hist = download<float>(hist, conv_hist.size());
  state = download<float>(st, state.size());
  return out;
}

std::vector<float> kda_tc_decode(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                 const std::vector<float>& graw, const std::vector<float>& beta,
                                 const std::vector<float>& A_log, const std::vector<float>& dt_bias, float bound,
                                 const std::vector<int64_t>& cu, const std::vector<int64_t>& prompt, int64_t H,
                                 int64_t K, const std::vector<float>& s_in, std::vector<float>* s_out) {
  const int64_t N = static_cast<int64_t>(cu.size()) - 1, T = cu.back(), HK = H * K;
  check(static_cast<int64_t>(prompt.size()) == N, "kda_tc_decode: ", prompt.size(), " prompts for ", N, " sequences");
  std::vector<float> out(T * HK, NAN);
  // The prompts, packed.
  std::vector<int64_t> pcu{0};
  std::vector<float> pq, pk, pv, pg, pb;
  std::vector<int32_t> pstart, plen, slot;
  for (int64_t n = 0; n < N; ++n) {
    check(prompt[n] >= 0 && prompt[n] <= cu[n + 1] - cu[n], "kda_tc_decode: prompt ", n, " out of range");
    pstart.push_back(static_cast<int32_t>(pcu.back()));
    plen.push_back(static_cast<int32_t>(prompt[n]));
    slot.push_back(static_cast<int32_t>(n));
    pcu.push_back(pcu.back() + prompt[n]);
    auto take = [&](const std::vector<float>& x, std::vector<float>& y, int64_t w) {
      y.insert(y.end(), x.begin() + cu[n] * w, x.begin() + (cu[n] + prompt[n]) * w);
    };
    take(q, pq, HK), take(k, pk, HK), take(v, pv, HK), take(graw, pg, HK), take(beta, pb, H);
  }
  const int64_t Tp = pcu.back();
  Buf state = upload(s_in), dslot = upload(slot), da = upload(A_log), dd = upload(dt_bias);
  Buf cq = poisoned<cuda::bf16>(N * 64 * HK), ck = poisoned<cuda::bf16>(N * 64 * HK),
      cv = poisoned<cuda::bf16>(N * 64 * HK), cg = poisoned<float>(N * 64 * HK), cb = poisoned<float>(N * 64 * H);
  Buf ct = poisoned<float>(N * H * 64 * 64), cx = poisoned<float>(N * H * 64 * cuda::kKdaTcXsCols),
      cn = poisoned<cuda::bf16>(N * H * 64 * K), csb = poisoned<cuda::bf16>(N * H * K * K);
  const cuda::KdaTcRowCache rows{ct.as<float>(), cx.as<float>(), cn.as<cuda::bf16>(), csb.as<cuda::bf16>()};
  {
    // The prefill: the forward on the prompts, leaving each slot's boundary state; the partial chunks' rows.
    const DevKdaChunks ch(pcu);
    Buf dq = upload(to_bf16(pq)), dk = upload(to_bf16(pk)), dv = upload(to_bf16(pv)), dg = upload(pg), db = upload(pb);
    Buf o = poisoned<cuda::bf16>(Tp * HK), work(cuda::kda_tc_workspace_bytes(ch.num_chunks(), H, K));
    cuda::kda_chunked_tc(dq.as<cuda::bf16>(), dk.as<cuda::bf16>(), dv.as<cuda::bf16>(), dg.as<float>(),
                         db.as<float>(), dd.as<float>(), da.as<float>(), bound, o.as<cuda::bf16>(), ch.view,
                         cuda::kda_tc_workspace(work.p, ch.num_chunks(), H, K), H, K,
                         cuda::KdaTcStates{state.as<float>(), state.as<float>(), dslot.as<int32_t>(), true}, nullptr);
    cuda::kda_tc_state_frags(state.as<float>(), dslot.as<int32_t>(), N, csb.as<cuda::bf16>(), H, K, nullptr);
    Buf ps = upload(pstart), pl = upload(plen);
    cuda::kda_store_chunk_rows(dq.as<cuda::bf16>(), dk.as<cuda::bf16>(), dv.as<cuda::bf16>(), dg.as<float>(),
                               db.as<float>(), cuda::PrefillSeqs{ps.as<int32_t>(), pl.as<int32_t>(),
                                                                 dslot.as<int32_t>(), N},
                               cq.as<cuda::bf16>(), ck.as<cuda::bf16>(), cv.as<cuda::bf16>(), cg.as<float>(),
                               cb.as<float>(), H, K, nullptr);
    const cuda::KdaTailLists t(plen, slot);
    const int64_t tails = t.size();
    Buf dts = upload(t.start), dtl = upload(t.len), dtf = upload(t.first), dtn = upload(t.count),
        dtslot = upload(t.slot);
    Buf twork(cuda::kda_tc_workspace_bytes(tails, H, K));
    cuda::kda_chunked_tc(cq.as<cuda::bf16>(), ck.as<cuda::bf16>(), cv.as<cuda::bf16>(), cg.as<float>(),
                         cb.as<float>(), dd.as<float>(), da.as<float>(), bound, nullptr,
                         cuda::KdaChunks{dts.as<int32_t>(), dtl.as<int32_t>(), dtf.as<int32_t>(), dtn.as<int32_t>(),
                                         tails, tails},
                         cuda::kda_tc_workspace(twork.p, tails, H, K), H, K,
                         cuda::KdaTcStates{state.as<float>(), nullptr, dtslot.as<int32_t>(), false}, nullptr, rows);
    finish();
    const std::vector<float> po = widen(download<cuda::bf16>(o, Tp * HK));
    for (int64_t n = 0; n < N; ++n)
      std::copy(po.begin() + pcu[n] * HK, po.begin() + pcu[n + 1] * HK, out.begin() + cu[n] * HK);
  }
  // The steps: every sequence with tokens left takes its next one.
  std::vector<int64_t> pos(prompt);
  const std::vector<cuda::bf16> q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v);
  Buf o = poisoned<cuda::bf16>(N * HK);
  for (;;) {
    std::vector<int32_t> bslot, bpos;
    for (int64_t n = 0; n < N; ++n) {
      if (pos[n] == cu[n + 1] - cu[n]) continue;
      // The token into its row of the chunk buffers, as the step's append writes it.
      const int64_t t = cu[n] + pos[n], row = 64 * n + pos[n] % 64;
      auto put = [&](const Buf& b, const void* src, int64_t off, size_t bytes) {
        NEXTLM_CUDA_CHECK(cudaMemcpy(static_cast<char*>(b.p) + off, src, bytes, cudaMemcpyHostToDevice));
      };
      put(cq, q16.data() + t * HK, row * HK * 2, HK * 2);
      put(ck, k16.data() + t * HK, row * HK * 2, HK * 2);
      put(cv, v16.data() + t * HK, row * HK * 2, HK * 2);
      put(cg, graw.data() + t * HK, row * HK * 4, HK * 4);
      put(cb, beta.data() + t * H, row * H * 4, H * 4);
      bslot.push_back(static_cast<int32_t>(n));
      bpos.push_back(static_cast<int32_t>(pos[n]));
    }
    if (bslot.empty()) break;
    const int64_t B = static_cast<int64_t>(bslot.size());
    Buf ds = upload(bslot), dp = upload(bpos);
    cuda::kda_tc_step(cuda::KdaTcStepParams{nullptr, nullptr, nullptr, nullptr, nullptr, 0, cq.as<cuda::bf16>(),
                                            ck.as<cuda::bf16>(), cv.as<cuda::bf16>(), cg.as<float>(), cb.as<float>(),
                                            dd.as<float>(), da.as<float>(), bound, ds.as<int32_t>(), dp.as<int32_t>(),
                                            state.as<float>(), rows, o.as<cuda::bf16>(), nullptr, nullptr,
                                            0.0f, B, H, K},
                      nullptr);
    finish();
    const std::vector<float> so = widen(download<cuda::bf16>(o, B * HK));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = bslot[b];
      std::copy(so.begin() + b * HK, so.begin() + (b + 1) * HK, out.begin() + (cu[n] + pos[n]) * HK);
      ++pos[n];
    }
  }
  if (s_out) *s_out = download<float>(state, s_in.size());
  return out;
}

std::vector<std::vector<std::vector<int32_t>>> indexer_decode_steps(const IndexerDecodeSteps& in) {
  const int64_t ID = in.ID, P = in.P, max_sel = in.topk + in.P - 1;
  Buf ape = upload(in.ape);
  Buf pk(in.num_slots * P * ID * sizeof(float)), pg(in.num_slots * P * ID * sizeof(float));
  Buf pool = upload(std::vector<float>(in.num_slots * in.max_pools * ID, NAN));
  std::vector<int32_t> length(in.num_slots, 0);
  std::vector<std::vector<std::vector<int32_t>>> out;
  for (size_t s = 0; s < in.slots.size(); ++s) {
    const int64_t B = static_cast<int64_t>(in.slots[s].size());
    std::vector<int32_t> pos(B);
    int64_t max_selectable = 0;
    for (int64_t b = 0; b < B; ++b) {
      pos[b] = length[in.slots[s][b]]++;
      max_selectable = std::max<int64_t>(max_selectable, (pos[b] + 1) / P);
    }
    Buf qi = upload(in.qi[s]), ki = upload(in.ki[s]), gs = upload(in.gs[s]), wts = upload(in.wts[s]);
    Buf slot = upload(in.slots[s]), dpos = upload(pos), scores(B * in.max_pools * sizeof(float));
    Buf sel = upload(std::vector<int32_t>(B * max_sel, -1)), count = upload(std::vector<int32_t>(B, -1));
    cuda::IndexerDecodeParams p{qi.as<float>(), ki.as<float>(), gs.as<float>(), wts.as<float>(), ape.as<float>(),
                                slot.as<int32_t>(), dpos.as<int32_t>(), pk.as<float>(), pg.as<float>(),
                                pool.as<float>(), scores.as<float>(), B, in.IH, ID, P, in.topk, in.max_pools,
                                max_selectable, in.tail};
    cuda::indexer_decode_append(p, nullptr);
    cuda::indexer_decode_select(p, sel.as<int32_t>(), count.as<int32_t>(), max_sel, nullptr);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    const std::vector<int32_t> sh = download<int32_t>(sel, B * max_sel), ch = download<int32_t>(count, B);
    std::vector<std::vector<int32_t>> rows(B);
    for (int64_t b = 0; b < B; ++b) {
      check(ch[b] >= 0 && ch[b] <= max_sel, "indexer decoding wrote no valid count for row ", b);
      rows[b].assign(sh.begin() + b * max_sel, sh.begin() + b * max_sel + ch[b]);
    }
    out.push_back(std::move(rows));
  }
  return out;
}

bool mla_decode_on_tensor_cores(int64_t NH, int64_t KL) { return cuda::mla_decode_tc(NH, KL); }

std::vector<float> mla_decode(const std::vector<float>& q, const std::vector<float>& kv_b,
                              const std::vector<float>& latent, const std::vector<float>& new_latent,
                              const std::vector<int32_t>& slots, const std::vector<int32_t>& pos,
                              const std::vector<std::vector<int32_t>>& sel, int64_t NH, int64_t dqk, int64_t dv,
                              int64_t KL, int64_t max_len, int64_t max_sel) {
  const int64_t B = static_cast<int64_t>(slots.size());
  std::vector<int32_t> sh(B * max_sel, -1), ch(B);
  for (int64_t b = 0; b < B; ++b) {
    check(static_cast<int64_t>(sel[b].size()) <= max_sel, "mla_decode: selection too long");
    std::copy(sel[b].begin(), sel[b].end(), sh.begin() + b * max_sel);
    ch[b] = static_cast<int32_t>(sel[b].size());
  }
  Buf dq = upload(q), dkv = upload(to_bf16(kv_b)), dlat = upload(to_bf16(latent)), dnew = upload(to_bf16(new_latent));
  Buf dslot = upload(slots), dpos = upload(pos), dsel = upload(sh), dcount = upload(ch);
  Buf o = upload(std::vector<cuda::bf16>(B * NH * dv, __float2bfloat16(NAN)));
  cuda::mla_decode_append(dnew.as<cuda::bf16>(), dslot.as<int32_t>(), dpos.as<int32_t>(), dlat.as<cuda::bf16>(), B,
                          KL, max_len, nullptr);
  cuda::MlaDecodeParams p{dq.as<float>(), dkv.as<cuda::bf16>(), dlat.as<cuda::bf16>(), dslot.as<int32_t>(),
                          dpos.as<int32_t>(), dsel.as<int32_t>(), dcount.as<int32_t>(), o.as<cuda::bf16>(),
                          B, NH, dqk, dv, KL, max_len, max_sel, nullptr};
  Buf work = upload(std::vector<float>(cuda::mla_decode_workspace_floats(B, NH, KL), NAN));
  p.work = work.as<float>();
  cuda::mla_decode_attention(p, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  return widen(download<cuda::bf16>(o, B * NH * dv));
}

void kda_prefill_caches(const std::vector<float>& raw, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, const std::vector<float>& g, const std::vector<float>& beta,
                        const std::vector<int64_t>& cu, const std::vector<int32_t>& slots, int64_t H, int64_t K,
                        int64_t W, std::vector<float>& conv_hist, std::vector<float>& state) {
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  std::vector<int32_t> start(N), len(N);
  for (int64_t n = 0; n < N; ++n)
    start[n] = static_cast<int32_t>(cu[n]), len[n] = static_cast<int32_t>(cu[n + 1] - cu[n]);
  Buf draw = upload(raw), dq = upload(q), dk = upload(k), dv = upload(v), dg = upload(g), db = upload(beta);
  Buf ds = upload(start), dl = upload(len), dslot = upload(slots), hist = upload(conv_hist), st = upload(state);
  const cuda::PrefillSeqs ps{ds.as<int32_t>(), dl.as<int32_t>(), dslot.as<int32_t>(), N};
  cuda::kda_store_conv_hist(draw.as<float>(), ps, hist.as<float>(), H * K, W, nullptr);
  cuda::kda_final_state(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), db.as<float>(), ps,
                        st.as<float>(), H, K, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  conv_hist = download<float>(hist, conv_hist.size());
  state = download<float>(st, state.size());
}

}  // namespace nextlm::cuda_testing

namespace nextlm::cuda_testing {

MhcPreOut mhc_pre(const std::vector<float>& h, const std::vector<float>& fn, const std::vector<float>& base,
                  const std::vector<float>& scale, const std::vector<float>& norm_w, int64_t T, int64_t S, int64_t D,
                  float rms_eps, float hc_eps, int iters, bool apply_again) {
  Buf dh = upload(h), dfn = upload(fn), dbase = upload(base), dscale = upload(scale), dw = upload(norm_w);
  Buf post = upload(std::vector<float>(T * S, NAN)), comb = upload(std::vector<float>(T * S * S, NAN));
  Buf a = upload(std::vector<cuda::bf16>(T * D, __float2bfloat16(NAN)));
  Buf work = upload(std::vector<float>(cuda::mhc_pre_workspace_floats(T, S, D), NAN));
  const cuda::MhcParams p{dfn.as<float>(), dbase.as<float>(), dscale.as<float>(), dw.as<float>(), T, S, D,
                          rms_eps, hc_eps, iters};
  cuda::mhc_pre(p, dh.as<float>(), post.as<float>(), comb.as<float>(), a.as<cuda::bf16>(), work.as<float>(), nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (apply_again) {
    Buf post2 = upload(std::vector<float>(T * S, NAN)), comb2 = upload(std::vector<float>(T * S * S, NAN));
    Buf a2 = upload(std::vector<cuda::bf16>(T * D, __float2bfloat16(NAN)));
    cuda::mhc_pre_apply(p, dh.as<float>(), post2.as<float>(), comb2.as<float>(), a2.as<cuda::bf16>(),
                        work.as<float>(), nullptr);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    return {download<float>(post2, T * S), download<float>(comb2, T * S * S), widen(download<cuda::bf16>(a2, T * D))};
  }
  return {download<float>(post, T * S), download<float>(comb, T * S * S), widen(download<cuda::bf16>(a, T * D))};
}

MhcPostPreOut mhc_post_pre(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                           const std::vector<float>& comb, const std::vector<float>& fn,
                           const std::vector<float>& base, const std::vector<float>& scale,
                           const std::vector<float>& norm_w, int64_t T, int64_t S, int64_t D, float rms_eps,
                           float hc_eps, int iters, bool fuse, bool in_place) {
  Buf dh = upload(h), dy = upload(y), dpost = upload(post), dcomb = upload(comb);
  Buf dfn = upload(fn), dbase = upload(base), dscale = upload(scale), dw = upload(norm_w);
  Buf out = upload(std::vector<float>(in_place ? 0 : T * S * D, NAN));
  Buf npost = upload(std::vector<float>(T * S, NAN)), ncomb = upload(std::vector<float>(T * S * S, NAN));
  Buf a = upload(std::vector<cuda::bf16>(T * D, __float2bfloat16(NAN)));
  Buf work = upload(std::vector<float>(cuda::mhc_pre_workspace_floats(T, S, D), NAN));
  const cuda::MhcParams p{dfn.as<float>(), dbase.as<float>(), dscale.as<float>(), dw.as<float>(), T, S, D,
                          rms_eps, hc_eps, iters};
  float* o = in_place ? dh.as<float>() : out.as<float>();
  MhcPostPreOut r;
  if (fuse) {
    r.fused = cuda::mhc_post_project(dh.as<float>(), o, dy.as<float>(), dpost.as<float>(), dcomb.as<float>(), p,
                                     work.as<float>(), nullptr, true);
    cuda::mhc_pre_apply(p, o, npost.as<float>(), ncomb.as<float>(), a.as<cuda::bf16>(), work.as<float>(), nullptr);
  } else {
    cuda::mhc_post(dh.as<float>(), o, dy.as<float>(), dpost.as<float>(), dcomb.as<float>(), T, S, D, nullptr);
    cuda::mhc_pre(p, o, npost.as<float>(), ncomb.as<float>(), a.as<cuda::bf16>(), work.as<float>(), nullptr);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  r.out = download<float>(in_place ? dh : out, T * S * D);
  r.post = download<float>(npost, T * S);
  r.comb = download<float>(ncomb, T * S * S);
  r.a = widen(download<cuda::bf16>(a, T * D));
  return r;
}

}  // namespace nextlm::cuda_testing

namespace nextlm::cuda_testing {

namespace {

// The per-token layout the model's Plan builds for packed sequences: sequence start and length per token, the first
// pool of each token's sequence, the first token of each pool.
struct IndexerLayout {
  std::vector<int32_t> start, len, base, pool_token;
  int64_t max_pools = 0;
  IndexerLayout(const std::vector<int64_t>& cu, int64_t P) {
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t L = cu[n + 1] - cu[n];
      max_pools = std::max(max_pools, L / P);
      const int32_t b = static_cast<int32_t>(pool_token.size());
      for (int64_t j = 0; j < L / P; ++j) pool_token.push_back(static_cast<int32_t>(cu[n] + j * P));
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        start.push_back(static_cast<int32_t>(cu[n]));
        len.push_back(static_cast<int32_t>(L));
        base.push_back(b);
      }
    }
  }
};

// Device copies of an indexer prefill's inputs, its layout and poisoned outputs.
struct IndexerDevice {
  IndexerLayout lay;
  int64_t T, num_pools;
  Buf qi, ki, gs, wts, ape, start, len, base, pool_token, pk;
  cuda::IndexerParams p;
  int64_t rows, max_sel;
  Buf scores, sel, count;
  IndexerDevice(const IndexerPrefill& in, int64_t score_rows)
      : lay(in.cu_seqlens, in.P),
        T(in.cu_seqlens.back()),
        num_pools(static_cast<int64_t>(lay.pool_token.size())),
        qi(upload(in.qi)),
        ki(upload(in.ki)),
        gs(upload(in.gs)),
        wts(upload(in.wts)),
        ape(upload(in.ape)),
        start(upload(lay.start)),
        len(upload(lay.len)),
        base(upload(lay.base)),
        pool_token(upload(lay.pool_token)),
        pk(upload(std::vector<float>(num_pools * in.ID, NAN))),
        p{qi.as<float>(),     ki.as<float>(),     gs.as<float>(), wts.as<float>(), ape.as<float>(),
          start.as<int32_t>(), len.as<int32_t>(), T,              in.IH,           in.ID,
          in.P,               in.topk,            lay.max_pools,  in.tail},
        rows(score_rows > 0 ? score_rows : cuda::indexer_score_rows(p)),
        max_sel(in.topk + in.P - 1),
        scores(upload(std::vector<float>(rows * lay.max_pools, NAN))),
        sel(upload(std::vector<int32_t>(T * max_sel, -1))),
        count(upload(std::vector<int32_t>(T, -1))) {}
  void run() {
    cuda::pool_keys(p, pool_token.as<int32_t>(), num_pools, pk.as<float>(), nullptr);
    cuda::indexer_select(p, base.as<int32_t>(), pk.as<float>(), scores.as<float>(), rows, sel.as<int32_t>(),
                         count.as<int32_t>(), max_sel, nullptr);
  }
};

}  // namespace

std::vector<std::vector<int32_t>> indexer_prefill(const IndexerPrefill& in) {
  IndexerDevice d(in, in.score_rows);
  d.run();
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  const int64_t T = d.T;
  const std::vector<int32_t> sh = download<int32_t>(d.sel, T * d.max_sel), ch = download<int32_t>(d.count, T);
  std::vector<std::vector<int32_t>> rows(T);
  for (int64_t t = 0; t < T; ++t) {
    check(ch[t] >= 0 && ch[t] <= d.max_sel, "indexer prefill wrote no valid count for token ", t);
    rows[t].assign(sh.begin() + t * d.max_sel, sh.begin() + t * d.max_sel + ch[t]);
  }
  return rows;
}

}  // namespace nextlm::cuda_testing

namespace nextlm::cuda_testing {

Conversions conversions(const std::vector<float>& x, int64_t offset) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> padded(offset, NAN);
  padded.insert(padded.end(), x.begin(), x.end());
  Buf dx = upload(padded), dr = upload(padded), dw = poisoned<float>(offset + n);
  Buf db = poisoned<uint16_t>(offset + n), drb = poisoned<uint16_t>(offset + n);
  float *px = dx.as<float>() + offset, *pr = dr.as<float>() + offset, *pw = dw.as<float>() + offset;
  cuda::bf16 *pb = db.as<cuda::bf16>() + offset, *prb = drb.as<cuda::bf16>() + offset;
  cuda::to_bf16(px, pb, n, nullptr);
  cuda::round_to_bf16(pr, prb, n, nullptr);
  cuda::bf16_to_f32(pb, pw, n, nullptr);
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  auto tail = [&](auto v) {
    v.erase(v.begin(), v.begin() + offset);
    return v;
  };
  return Conversions{tail(download<uint16_t>(db)), tail(download<uint16_t>(drb)), tail(download<float>(dr)),
                     tail(download<float>(dw))};
}

KdaPrep kda_prep_both(const std::vector<float>& raw, const std::vector<float>& conv, const std::vector<int64_t>& cu,
                      const std::vector<float>& f, const std::vector<float>& dt_bias, const std::vector<float>& A_log,
                      int64_t H, int64_t K, int64_t W, bool has_bound) {
  const int64_t T = cu.back(), n = T * H * K;
  Buf draw = upload(raw), dconv = upload(conv), dstart = upload(seq_starts(cu)), df = upload(f), dg = upload(f);
  Buf ddt = upload(dt_bias), dal = upload(A_log), dgo = poisoned<float>(n);
  Buf a = poisoned<float>(3 * n), b = poisoned<float>(3 * n), a16 = poisoned<uint16_t>(3 * n),
      b16 = poisoned<uint16_t>(3 * n);
  float *pa = a.as<float>(), *pb = b.as<float>();
  cuda::bf16 *pa16 = a16.as<cuda::bf16>(), *pb16 = b16.as<cuda::bf16>();
  cuda::kda_conv_norm(draw.as<float>(), dconv.as<float>(), dstart.as<int32_t>(), pa, pa + n, pa + 2 * n, T, H, K, W,
                      nullptr);
  for (int i = 0; i < 3; ++i) cuda::round_to_bf16(pa + i * n, pa16 + i * n, n, nullptr);
  cuda::kda_conv_norm_rounded(draw.as<float>(), dconv.as<float>(), dstart.as<int32_t>(), pb, pb + n, pb + 2 * n, pb16,
                              pb16 + n, pb16 + 2 * n, T, H, K, W, nullptr);
  cuda::kda_gate(dg.as<float>(), ddt.as<float>(), dal.as<float>(), T, H, K, has_bound, -5.0f, nullptr);
  cuda::kda_gate(df.as<float>(), dgo.as<float>(), ddt.as<float>(), dal.as<float>(), T, H, K, has_bound, -5.0f,
                 nullptr);
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  return KdaPrep{download<float>(a), download<float>(b), download<float>(dg), download<float>(dgo),
                 download<uint16_t>(a16), download<uint16_t>(b16)};
}

std::vector<float> dense_gemm(const std::vector<float>& x, const std::vector<float>& W, const std::vector<float>& y0,
                              int64_t T, int64_t out, int64_t in, bool invariant) {
  Buf dx = upload(to_bf16(x)), dw = upload(to_bf16(W));
  Buf dy = upload(y0.empty() ? std::vector<float>(T * out, NAN) : y0);
  cuda::Gemm g(nullptr);
  g.set_batch_invariant(invariant);
  g.run(dx.as<cuda::bf16>(), in, dw.as<cuda::bf16>(), out, in, dy.as<float>(), out, T, !y0.empty());
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  return download<float>(dy, T * out);
}

}  // namespace nextlm::cuda_testing

#include "cuda/model_impl.h"

namespace nextlm::cuda_testing {

void arena_alloc(size_t bytes) {
  cuda::Arena arena;
  arena.alloc<unsigned char>(static_cast<int64_t>(bytes));
}

}  // namespace nextlm::cuda_testing
