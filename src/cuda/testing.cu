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
