// Kernel-level test and benchmark hooks (see testing.h).
#include "cuda/testing.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "cuda/kernels.h"

namespace nextlm::cuda_testing {

namespace {

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  Buf(Buf&& o) noexcept : p(o.p) { o.p = nullptr; }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf& operator=(Buf&&) = delete;
  ~Buf() { cudaFree(p); }
  template <class T>
  T* as() {
    return static_cast<T*>(p);
  }
};

template <class T>
Buf upload(const std::vector<T>& v) {
  Buf b(v.size() * sizeof(T));
  NEXTLM_CUDA_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

std::vector<cuda::bf16> to_bf16(const std::vector<float>& x) {
  std::vector<cuda::bf16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
  return y;
}

struct Chunks {
  std::vector<int32_t> cs, cl, sf, sn;
  explicit Chunks(const std::vector<int64_t>& cu) {
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      sf.push_back(static_cast<int32_t>(cs.size()));
      for (int64_t c = cu[n]; c < cu[n + 1]; c += 64) {
        cs.push_back(static_cast<int32_t>(c));
        cl.push_back(static_cast<int32_t>(std::min<int64_t>(64, cu[n + 1] - c)));
      }
      sn.push_back(static_cast<int32_t>(cs.size()) - sf.back());
    }
  }
};

}  // namespace

std::vector<float> kda_chunked(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                               const std::vector<float>& g, const std::vector<float>& beta,
                               const std::vector<int64_t>& cu, int64_t H, int64_t K) {
  const int64_t T = cu.back();
  Chunks ch(cu);
  Buf dq = upload(q), dk = upload(k), dv = upload(v), dg = upload(g), db = upload(beta);
  Buf cs = upload(ch.cs), cl = upload(ch.cl), sf = upload(ch.sf), sn = upload(ch.sn);
  std::vector<float> out(T * H * K, NAN);
  Buf o = upload(out);
  Buf work(cuda::kda_workspace_floats(static_cast<int64_t>(ch.cs.size()), H, K) * sizeof(float));
  cuda::KdaChunks kc{cs.as<int32_t>(), cl.as<int32_t>(), sf.as<int32_t>(), sn.as<int32_t>(),
                     static_cast<int64_t>(ch.cs.size()), static_cast<int64_t>(cu.size()) - 1};
  cuda::kda_chunked(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), db.as<float>(), o.as<float>(), kc,
                    work.as<float>(), T, H, K, nullptr);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  NEXTLM_CUDA_CHECK(cudaMemcpy(out.data(), o.p, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> kda_chunked_tc(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                  const std::vector<float>& graw, const std::vector<float>& beta,
                                  const std::vector<float>& A_log, const std::vector<float>& dt_bias, float bound,
                                  const std::vector<int64_t>& cu, int64_t H, int64_t K, const std::vector<float>& s_in,
                                  std::vector<float>* s_out) {
  const int64_t T = cu.back(), N = static_cast<int64_t>(cu.size()) - 1;
  Chunks ch(cu);
  Buf dq = upload(to_bf16(q)), dk = upload(to_bf16(k)), dv = upload(to_bf16(v)), dg = upload(graw), db = upload(beta);
  Buf da = upload(A_log), dd = upload(dt_bias);
  Buf cs = upload(ch.cs), cl = upload(ch.cl), sf = upload(ch.sf), sn = upload(ch.sn);
  Buf o = upload(std::vector<cuda::bf16>(T * H * K, __float2bfloat16(NAN)));
  Buf si = upload(s_in);
  Buf so = upload(std::vector<float>(N * H * K * K, NAN));
  const int64_t nc = static_cast<int64_t>(ch.cs.size());
  Buf work(cuda::kda_tc_workspace_bytes(nc, H, K));
  cuda::KdaChunks kc{cs.as<int32_t>(), cl.as<int32_t>(), sf.as<int32_t>(), sn.as<int32_t>(), nc, N};
  cuda::kda_chunked_tc(dq.as<cuda::bf16>(), dk.as<cuda::bf16>(), dv.as<cuda::bf16>(), dg.as<float>(), db.as<float>(),
                       dd.as<float>(), da.as<float>(), bound, o.as<cuda::bf16>(), kc,
                       cuda::kda_tc_workspace(work.p, nc, H, K), H, K, s_in.empty() ? nullptr : si.as<float>(),
                       so.as<float>(), nullptr);
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

void set_kda_tc_variant(int prepare, int tv) { cuda::set_kda_tc_tuning(cuda::KdaTcTuning{prepare, tv}); }

KdaTiming time_kda_forward_tc(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters, int prepare,
                              int tv) {
  const cuda::KdaTcTuning saved = cuda::kda_tc_tuning();
  cuda::set_kda_tc_tuning(cuda::KdaTcTuning{prepare, tv});
  std::vector<int64_t> cu{0};
  for (int64_t L : seqlens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back(), n = T * H * K;
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto rnd = [&](int64_t m, float scale) {
    std::vector<float> x(m);
    for (float& e : x) e = nd(gen) * scale;
    return x;
  };
  std::vector<float> q = rnd(n, 1.0f), k = rnd(n, 1.0f);
  for (int64_t r = 0; r < T * H; ++r) {
    double sq = 0, sk = 0;
    for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
    for (int64_t d = 0; d < K; ++d) q[r * K + d] /= std::sqrt(sq * K), k[r * K + d] /= std::sqrt(sk);
  }
  std::vector<float> beta = rnd(T * H, 1.0f);
  for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));
  Chunks ch(cu);
  const int64_t nc = static_cast<int64_t>(ch.cs.size());
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
  Buf cs = upload(ch.cs), cl = upload(ch.cl), sf = upload(ch.sf), sn = upload(ch.sn);
  cuda::KdaChunks kc{cs.as<int32_t>(), cl.as<int32_t>(), sf.as<int32_t>(), sn.as<int32_t>(), nc,
                     static_cast<int64_t>(seqlens.size())};
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
      if (part != 1) cuda::kda_tc_state(kc, w, o.as<cuda::bf16>(), H, K, nullptr, nullptr, nullptr);
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
  cuda::set_kda_tc_tuning(saved);
  return r;
}

double time_kda_forward(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters) {
  std::vector<int64_t> cu{0};
  for (int64_t L : seqlens) cu.push_back(cu.back() + L);
  const int64_t T = cu.back(), n = T * H * K;
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto rnd = [&](int64_t m, float scale) {
    std::vector<float> x(m);
    for (float& e : x) e = nd(gen) * scale;
    return x;
  };
  std::vector<float> q = rnd(n, 1.0f), k = rnd(n, 1.0f);
  for (int64_t r = 0; r < T * H; ++r) {  // unit rows, q scaled, as the conv kernel leaves them
    double sq = 0, sk = 0;
    for (int64_t d = 0; d < K; ++d) sq += q[r * K + d] * q[r * K + d], sk += k[r * K + d] * k[r * K + d];
    for (int64_t d = 0; d < K; ++d) q[r * K + d] /= std::sqrt(sq * K), k[r * K + d] /= std::sqrt(sk);
  }
  std::vector<float> beta = rnd(T * H, 1.0f);
  for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));
  Chunks ch(cu);
  Buf dq = upload(q), dk = upload(k), dv = upload(rnd(n, 1.0f)), graw = upload(rnd(n, 1.0f)), db = upload(beta);
  Buf dt = upload(rnd(H * K, 0.5f)), alog = upload(rnd(H, 0.5f));
  Buf g(n * sizeof(float)), o(n * sizeof(float));
  Buf cs = upload(ch.cs), cl = upload(ch.cl), sf = upload(ch.sf), sn = upload(ch.sn);
  Buf work(cuda::kda_workspace_floats(static_cast<int64_t>(ch.cs.size()), H, K) * sizeof(float));
  cuda::KdaChunks kc{cs.as<int32_t>(), cl.as<int32_t>(), sf.as<int32_t>(), sn.as<int32_t>(),
                     static_cast<int64_t>(ch.cs.size()), static_cast<int64_t>(seqlens.size())};
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
