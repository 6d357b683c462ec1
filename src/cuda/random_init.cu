// Device-side random initialisation (see random_init.h): element i of a tensor takes its uniforms from
// splitmix64(key + (i + 1)·φ), so the values do not depend on the grid, and normals come by Box–Muller.
#include "cuda/random_init.h"

#include <algorithm>

namespace nextlm::cuda {

namespace {

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

template <class Out>
__global__ void fill_kernel(Out* dst, int64_t n, DistSpec d, uint64_t key) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(key + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ULL);
    // Two 24-bit uniforms in (0, 1): never 0, so the logarithms below are finite.
    const float u1 = (static_cast<float>(r >> 40) + 0.5f) * 0x1.0p-24f;
    const float u2 = (static_cast<float>(r & 0xffffffu) + 0.5f) * 0x1.0p-24f;
    float v = 0.0f;
    switch (d.kind) {
      case Dist::Normal:
        v = d.a * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        break;
      case Dist::Uniform:
        v = d.a + (d.b - d.a) * u1;
        break;
      case Dist::Const:
        v = d.a;
        break;
      case Dist::DtBias: {
        const float lo = logf(d.a), hi = logf(d.b);
        const float dt = fmaxf(expf(lo + (hi - lo) * u1), 1e-4f);
        v = dt + logf(-expm1f(-dt));
        break;
      }
      case Dist::LogUniform:
        v = logf(d.a + (d.b - d.a) * u1);
        break;
    }
    if constexpr (sizeof(Out) == 2) {
      dst[i] = __float2bfloat16(v);
    } else {
      dst[i] = v;
    }
  }
}

}  // namespace

uint64_t tensor_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a of the name, then mixed with the seed
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return mix64(h ^ mix64(seed + 0x632be59bd9b4e019ULL));
}

void fill_random(void* dst, bool bf16_out, int64_t n, const DistSpec& d, uint64_t key, cudaStream_t st) {
  if (n <= 0) return;
  const int grid = static_cast<int>(std::min<int64_t>(ceil_div(n, 256), 65535));
  if (bf16_out) {
    fill_kernel<<<grid, 256, 0, st>>>(static_cast<bf16*>(dst), n, d, key);
  } else {
    fill_kernel<<<grid, 256, 0, st>>>(static_cast<float*>(dst), n, d, key);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nextlm::cuda
