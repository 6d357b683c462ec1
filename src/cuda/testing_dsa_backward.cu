// Test hooks of the DSA attention backward kernels (see testing_dsa_backward.h).
#include "cuda/testing_dsa_backward.h"

#include <algorithm>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda_testing {

namespace {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
  template <class T>
  T* as() {
    return static_cast<T*>(p);
  }
};

template <class T>
void put(DevBuf& b, const std::vector<T>& v) {
  NEXTLM_CUDA_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> get(const DevBuf& b, size_t n) {
  std::vector<T> v(n);
  NEXTLM_CUDA_CHECK(cudaMemcpy(v.data(), b.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

constexpr size_t kGuard = 64;
constexpr float kGuardValue = 1234.5f;
constexpr int32_t kFarKey = 1 << 30;  // an unused selection slot: kv row far past any buffer

}  // namespace

namespace {

enum class Kernel { Tiled, Scatter, TensorCore };

// The shared body of the entry points: uploads, one run (plus one timed when ms), guard checks, downloads.
void run_backward(Kernel kernel, const std::vector<float>& q, const std::vector<float>& kv,
                  const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                  const std::vector<int64_t>& cu, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                  std::vector<float>& dq, std::vector<float>& dkv, double* ms) {
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
  auto half = [](const std::vector<float>& v) {
    std::vector<cuda::bf16> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(v[i]);
    return h;
  };
  const bool tc = kernel == Kernel::TensorCore;
  const size_t elem = tc ? sizeof(cuda::bf16) : sizeof(float);
  DevBuf bq(q.size() * elem), bkv(kv.size() * elem), bdo(dout.size() * 4), bsel(sel_flat.size() * 4),
      bcount(T * 4), bstart(T * 4), blen(T * 4), bdq((dq.size() + kGuard) * 4), bdkv((dkv.size() + kGuard) * 4);
  if (tc) {
    put(bq, half(q)), put(bkv, half(kv));
  } else {
    put(bq, q), put(bkv, kv);
  }
  put(bdo, dout), put(bsel, sel_flat), put(bcount, count), put(bstart, start);
  put(blen, len), put(bdq, guarded(dq)), put(bdkv, guarded(dkv));
  const size_t work_bytes = tc ? cuda::mla_sparse_attention_backward_tc_workspace_bytes(T, NH, max_len, dqk, dv)
                               : cuda::mla_sparse_attention_backward_workspace_bytes(T, NH, max_len);
  DevBuf work(work_bytes);
  NEXTLM_CUDA_CHECK(cudaMemset(work.p, 0xff, work_bytes));
  auto run = [&](float* dq_dev, float* dkv_dev) {
    switch (kernel) {
      case Kernel::Scatter:
        cuda::mla_sparse_attention_backward_scatter(bq.as<float>(), bkv.as<float>(), bsel.as<int32_t>(),
                                                    bcount.as<int32_t>(), bstart.as<int32_t>(), blen.as<int32_t>(),
                                                    bdo.as<float>(), dq_dev, dkv_dev, T, NH, dqk, dv, max_sel, nullptr);
        return;
      case Kernel::Tiled:
        cuda::mla_sparse_attention_backward(bq.as<float>(), bkv.as<float>(), bsel.as<int32_t>(), bcount.as<int32_t>(),
                                            bstart.as<int32_t>(), blen.as<int32_t>(), bdo.as<float>(), dq_dev, dkv_dev,
                                            T, NH, dqk, dv, max_sel, max_len, work.p, nullptr);
        return;
      case Kernel::TensorCore:
        cuda::mla_sparse_attention_backward_tc(bq.as<cuda::bf16>(), bkv.as<cuda::bf16>(), bsel.as<int32_t>(),
                                               bcount.as<int32_t>(), bstart.as<int32_t>(), blen.as<int32_t>(),
                                               bdo.as<float>(), dq_dev, dkv_dev, T, NH, dqk, dv, max_sel, max_len,
                                               work.p, nullptr);
        return;
    }
  };
  run(bdq.as<float>(), bdkv.as<float>());
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> gq = get<float>(bdq, dq.size() + kGuard), gkv = get<float>(bdkv, dkv.size() + kGuard);
  if (ms && T > 0) {
    cudaEvent_t a, b;
    NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
    NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
    NEXTLM_CUDA_CHECK(cudaEventRecord(a));
    run(bdq.as<float>(), bdkv.as<float>());
    NEXTLM_CUDA_CHECK(cudaEventRecord(b));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    *ms = t;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
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
                                   int64_t max_sel, std::vector<float>& dq, std::vector<float>& dkv, double* ms,
                                   bool scatter) {
  run_backward(scatter ? Kernel::Scatter : Kernel::Tiled, q, kv, dout, sel, cu, NH, dqk, dv, max_sel, dq, dkv, ms);
}

void mla_sparse_attention_backward_tc(const std::vector<float>& q, const std::vector<float>& kv,
                                      const std::vector<float>& dout, const std::vector<std::vector<int32_t>>& sel,
                                      const std::vector<int64_t>& cu, int64_t NH, int64_t dqk, int64_t dv,
                                      int64_t max_sel, std::vector<float>& dq, std::vector<float>& dkv, double* ms) {
  run_backward(Kernel::TensorCore, q, kv, dout, sel, cu, NH, dqk, dv, max_sel, dq, dkv, ms);
}

}  // namespace nextlm::cuda_testing
