// cuTensorMapEncodeTiled from the driver, reached through the runtime (no link against libcuda).
#include "cuda/tensor_map.h"

#include <cudaTypedefs.h>

#include "cuda/common.cuh"

namespace nextlm::cuda {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    NEXTLM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    check(q == cudaDriverEntryPointSuccess && p, "TMA: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

CUtensorMap bf16_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                            const cuuint32_t* box, const char* who) {
  CUtensorMap m;
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_tiled()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims,
                                    strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  check(r == CUDA_SUCCESS, who, ": cuTensorMapEncodeTiled failed (", static_cast<int>(r), ") for a ", rank,
        "-d map");
  return m;
}

}  // namespace nextlm::cuda
