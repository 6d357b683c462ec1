// Tiled TMA tensor maps for the Hopper kernels (cuda/tma.cuh loads through them).
#pragma once
#include <cuda.h>

namespace nextlm::cuda {

// A bf16 tensor map of `rank` dims (innermost first; strides in bytes of dims 1 …), boxes of `box`, 128-byte
// swizzle, zero fill past the bounds. `who` names the caller in the error when the driver rejects the map.
CUtensorMap bf16_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                            const cuuint32_t* box, const char* who);

}  // namespace nextlm::cuda
