// Host-side entry points to the KDA recurrence backward kernels (see testing_kda_backward.h).
#include "cuda/testing_kda_backward.h"

#include <algorithm>
#include <memory>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda_testing {

namespace {

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { cudaFree(p); }
  float* f() { return static_cast<float*>(p); }
};

void put(Buf& b, const std::vector<float>& v, size_t n) {
  std::vector<float> x = v.empty() ? std::vector<float>(n, 0.0f) : v;
  NEXTLM_CUDA_CHECK(cudaMemcpy(b.p, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
}

std::vector<float> get(Buf& b, size_t n) {
  std::vector<float> x(n);
  NEXTLM_CUDA_CHECK(cudaMemcpy(x.data(), b.p, n * sizeof(float), cudaMemcpyDeviceToHost));
  return x;
}

}  // namespace

KdaBackwardGrads kda_recurrent_backward(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, const std::vector<float>& g,
                                        const std::vector<float>& beta, const std::vector<float>& do_,
                                        const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                        const KdaBackwardGrads& init, double* ms) {
  const int64_t T = cu_seqlens.back(), N = static_cast<int64_t>(cu_seqlens.size()) - 1;
  const size_t nx = static_cast<size_t>(T * H * K), nb = static_cast<size_t>(T * H);
  Buf bq(nx * 4), bk(nx * 4), bv(nx * 4), bg(nx * 4), bb(nb * 4), bd(nx * 4);
  put(bq, q, nx), put(bk, k, nx), put(bv, v, nx), put(bg, g, nx), put(bb, beta, nb), put(bd, do_, nx);
  std::vector<int32_t> cu32(cu_seqlens.begin(), cu_seqlens.end());
  Buf bcu(cu32.size() * 4);
  NEXTLM_CUDA_CHECK(cudaMemcpy(bcu.p, cu32.data(), cu32.size() * 4, cudaMemcpyHostToDevice));
  Buf dq(nx * 4), dk(nx * 4), dv(nx * 4), dg(nx * 4), db(nb * 4);
  // The workspace is poisoned with NaN: the kernel must write every checkpoint it reads.
  const size_t wbytes = cuda::kda_recurrent_backward_workspace_bytes(T, N, H, K);
  Buf work(wbytes);
  NEXTLM_CUDA_CHECK(cudaMemset(work.p, 0xff, std::max<size_t>(wbytes, 1)));
  auto run = [&]() {
    put(dq, init.dq, nx), put(dk, init.dk, nx), put(dv, init.dv, nx), put(dg, init.dg, nx), put(db, init.dbeta, nb);
    cuda::kda_recurrent_backward(bq.f(), bk.f(), bv.f(), bg.f(), bb.f(), bd.f(), static_cast<const int32_t*>(bcu.p),
                                 N, T, H, K, dq.f(), dk.f(), dv.f(), dg.f(), db.f(), work.p, nullptr);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  run();
  if (ms) {
    cudaEvent_t a, b;
    NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
    NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
    NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
    put(dq, init.dq, nx), put(dk, init.dk, nx), put(dv, init.dv, nx), put(dg, init.dg, nx), put(db, init.dbeta, nb);
    NEXTLM_CUDA_CHECK(cudaEventRecord(a));
    cuda::kda_recurrent_backward(bq.f(), bk.f(), bv.f(), bg.f(), bb.f(), bd.f(), static_cast<const int32_t*>(bcu.p),
                                 N, T, H, K, dq.f(), dk.f(), dv.f(), dg.f(), db.f(), work.p, nullptr);
    NEXTLM_CUDA_CHECK(cudaEventRecord(b));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    *ms = t;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  return KdaBackwardGrads{get(dq, nx), get(dk, nx), get(dv, nx), get(dg, nx), get(db, nb)};
}

KdaBackwardGrads kda_chunked_backward(const std::vector<float>& q, const std::vector<float>& k,
                                      const std::vector<float>& v, const std::vector<float>& g,
                                      const std::vector<float>& beta, const std::vector<float>& do_,
                                      const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                      const KdaBackwardGrads& init, double* ms) {
  const int64_t T = cu_seqlens.back(), N = static_cast<int64_t>(cu_seqlens.size()) - 1;
  const size_t nx = static_cast<size_t>(T * H * K), nb = static_cast<size_t>(T * H);
  Buf bq(nx * 4), bk(nx * 4), bv(nx * 4), bg(nx * 4), bb(nb * 4), bd(nx * 4);
  put(bq, q, nx), put(bk, k, nx), put(bv, v, nx), put(bg, g, nx), put(bb, beta, nb), put(bd, do_, nx);
  // The chunks as the forward's plan (model_impl.h) lays them out: 64 tokens from each sequence's start, the last
  // one shorter; chunk starts are absolute token indices.
  std::vector<int32_t> cs, cl, sf, sn;
  for (int64_t n = 0; n < N; ++n) {
    sf.push_back(static_cast<int32_t>(cs.size()));
    for (int64_t c = cu_seqlens[n]; c < cu_seqlens[n + 1]; c += 64) {
      cs.push_back(static_cast<int32_t>(c));
      cl.push_back(static_cast<int32_t>(std::min<int64_t>(64, cu_seqlens[n + 1] - c)));
    }
    sn.push_back(static_cast<int32_t>(cs.size()) - sf.back());
  }
  auto up = [](const std::vector<int32_t>& x) {
    auto b = std::make_unique<Buf>(x.size() * 4);
    if (!x.empty()) NEXTLM_CUDA_CHECK(cudaMemcpy(b->p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    return b;
  };
  const auto bcs = up(cs), bcl = up(cl), bsf = up(sf), bsn = up(sn);
  const int64_t nc = static_cast<int64_t>(cs.size());
  const cuda::KdaChunks ch{static_cast<const int32_t*>(bcs->p), static_cast<const int32_t*>(bcl->p),
                           static_cast<const int32_t*>(bsf->p), static_cast<const int32_t*>(bsn->p), nc, N};
  Buf dq(nx * 4), dk(nx * 4), dv(nx * 4), dg(nx * 4), db(nb * 4);
  const size_t wbytes = cuda::kda_chunked_backward_workspace_bytes(nc, T, H, K);
  Buf work(wbytes);
  NEXTLM_CUDA_CHECK(cudaMemset(work.p, 0xff, std::max<size_t>(wbytes, 1)));
  auto launch = [&]() {
    cuda::kda_chunked_backward(bq.f(), bk.f(), bv.f(), bg.f(), bb.f(), bd.f(), ch, T, H, K, dq.f(), dk.f(), dv.f(),
                               dg.f(), db.f(), work.p, nullptr);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  auto reset = [&]() {
    put(dq, init.dq, nx), put(dk, init.dk, nx), put(dv, init.dv, nx), put(dg, init.dg, nx), put(db, init.dbeta, nb);
  };
  reset();
  launch();
  if (ms) {
    cudaEvent_t a, b;
    NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
    NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
    NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
    reset();
    NEXTLM_CUDA_CHECK(cudaEventRecord(a));
    launch();
    NEXTLM_CUDA_CHECK(cudaEventRecord(b));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    *ms = t;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  return KdaBackwardGrads{get(dq, nx), get(dk, nx), get(dv, nx), get(dg, nx), get(db, nb)};
}

}  // namespace nextlm::cuda_testing
