// A dense, row-major fp32 tensor: the storage of the CPU reference path (weights are widened to fp32 at load).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace nextlm {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> s, float fill = 0.0f) : shape(std::move(s)), data(count(shape), fill) {}

  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim(size_t i) const { return shape.at(i); }
  bool empty() const { return data.empty(); }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }

  static size_t count(const std::vector<int64_t>& s) {
    size_t n = 1;
    for (int64_t d : s) n *= static_cast<size_t>(d);
    return n;
  }
};

}  // namespace nextlm
