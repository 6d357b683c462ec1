// A device allocation for the GPU tests written as plain C++ (src/cuda/testing_buffers.h includes common.cuh, which
// only nvcc compiles): DevBuf, freed on scope exit, with gtest-checked copies to and from host vectors.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

namespace nextlm::test {

// One device allocation of at least one byte (p is null if cudaMalloc failed; the copies below then fail the test).
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n_bytes) : bytes(n_bytes) {
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// v into the start of b.
template <class T>
void upload(const DevBuf& b, const std::vector<T>& v) {
  ASSERT_NE(b.p, nullptr);
  ASSERT_LE(v.size() * sizeof(T), b.bytes);
  if (!v.empty()) {
    ASSERT_EQ(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
}

// The first n elements of b.
template <class T>
std::vector<T> download(const DevBuf& b, size_t n) {
  std::vector<T> v(n);
  EXPECT_NE(b.p, nullptr);
  EXPECT_LE(n * sizeof(T), b.bytes);
  if (n && b.p && n * sizeof(T) <= b.bytes) {
    EXPECT_EQ(cudaMemcpy(v.data(), b.p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

}  // namespace nextlm::test
