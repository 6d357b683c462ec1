// Device buffers of the kernel test hooks (src/cuda/testing*.cu) and the GPU benchmarks: an owning allocation,
// host-vector upload and download, poisoning, and the KDA chunk lists as the forward's plan lays them out.
// Internal to those files (nvcc only: it includes common.cuh); not part of the testing*.h interfaces.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace nextlm::cuda_testing::detail {

// `bytes` of device memory, freed on scope exit. At least one byte is allocated, so an empty buffer still has a
// valid pointer to hand a kernel that must not touch it.
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n_bytes) : bytes(n_bytes) { NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  Buf(Buf&& o) noexcept : p(o.p), bytes(o.bytes) {
    o.p = nullptr;
    o.bytes = 0;
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf& operator=(Buf&&) = delete;
  ~Buf() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
  // Null for an empty buffer: an optional input that is absent.
  template <class T>
  T* or_null() const {
    return bytes ? as<T>() : nullptr;
  }
};

// v copied to the start of b.
template <class T>
void copy_to(Buf& b, const std::vector<T>& v) {
  check(v.size() * sizeof(T) <= b.bytes, "test buffer: upload of ", v.size() * sizeof(T), " bytes into ", b.bytes);
  if (!v.empty()) NEXTLM_CUDA_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// A device copy of v.
template <class T>
Buf upload(const std::vector<T>& v) {
  Buf b(v.size() * sizeof(T));
  copy_to(b, v);
  return b;
}

// The first n elements of b (the default stream's work before it is done first, as with any cudaMemcpy).
template <class T>
std::vector<T> download(const Buf& b, size_t n) {
  check(n * sizeof(T) <= b.bytes, "test buffer: download of ", n * sizeof(T), " bytes from ", b.bytes);
  std::vector<T> v(n);
  if (n) NEXTLM_CUDA_CHECK(cudaMemcpy(v.data(), b.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// All of b.
template <class T>
std::vector<T> download(const Buf& b) {
  return download<T>(b, b.bytes / sizeof(T));
}

// n elements of T with every byte 0xFF: NaN in fp32, fp64 and bf16, so an output element or workspace entry a
// kernel fails to write shows (and a read of one makes NaN). Without T: n bytes (workspaces).
template <class T = std::byte>
Buf poisoned(size_t n) {
  Buf b(n * sizeof(T));
  NEXTLM_CUDA_CHECK(cudaMemset(b.p, 0xFF, n * sizeof(T)));
  return b;
}

inline std::vector<cuda::bf16> to_bf16(const std::vector<float>& x) {
  std::vector<cuda::bf16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
  return y;
}

inline std::vector<float> widen(const std::vector<cuda::bf16>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

// The first token of each token's sequence (what the kernels take as seq_start) for packed sequences cu.
inline std::vector<int32_t> seq_starts(const std::vector<int64_t>& cu) {
  std::vector<int32_t> start(cu.empty() ? 0 : static_cast<size_t>(cu.back()));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) start[t] = static_cast<int32_t>(cu[s]);
  return start;
}

// Launch errors, then the device's completion (and its asynchronous errors).
inline void finish() {
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
}

// The KDA chunk lists of packed sequences cu [N+1] as the forward's plan (model_impl.h) lays them out: 64 tokens from
// each sequence's start, the last one shorter, chunk starts absolute token indices; an empty sequence has none.
struct KdaChunkLists {
  std::vector<int32_t> cs, cl, sf, sn;  // chunk start, chunk length, each sequence's first chunk and chunk count
  explicit KdaChunkLists(const std::vector<int64_t>& cu) {
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

// Device copies of the chunk lists and the cuda::KdaChunks view of them that the kernels take.
struct DevKdaChunks {
  KdaChunkLists lists;
  Buf cs, cl, sf, sn;
  cuda::KdaChunks view;
  explicit DevKdaChunks(const std::vector<int64_t>& cu)
      : lists(cu),
        cs(upload(lists.cs)),
        cl(upload(lists.cl)),
        sf(upload(lists.sf)),
        sn(upload(lists.sn)),
        view{cs.as<int32_t>(),
             cl.as<int32_t>(),
             sf.as<int32_t>(),
             sn.as<int32_t>(),
             static_cast<int64_t>(lists.cs.size()),
             static_cast<int64_t>(cu.size()) - 1} {}
  int64_t num_chunks() const { return view.num_chunks; }
};

}  // namespace nextlm::cuda_testing::detail
