// Random weights generated on the device (for benchmarking full-width models without a checkpoint): a counter-based
// generator, so a tensor's values depend only on (seed, tensor name, element index), not on the launch shape.
#pragma once
#include <cstdint>
#include <string>

#include "cuda/common.cuh"

namespace nextlm::cuda {

// The distributions of transformers' _init_weights (see src/model/init.h, which does the same on the host).
enum class Dist {
  Normal,      // normal(0, a)
  Uniform,     // U(a, b)
  Const,       // a
  DtBias,      // inverse softplus of dt = max(exp(U(log a, log b)), 1e-4) (FLA's gate init)
  LogUniform,  // log(U(a, b))
};
struct DistSpec {
  Dist kind = Dist::Const;
  float a = 0.0f, b = 0.0f;
};

// The per-tensor stream of random numbers: a hash of the seed and the tensor's checkpoint name.
uint64_t tensor_key(uint64_t seed, const std::string& name);

// Fills n elements of dst (bf16 when bf16_out, else fp32) with the distribution d from stream `key`.
void fill_random(void* dst, bool bf16_out, int64_t n, const DistSpec& d, uint64_t key, cudaStream_t st);

}  // namespace nextlm::cuda
