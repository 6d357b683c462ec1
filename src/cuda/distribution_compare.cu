// One block per row: max/argmax of both rows, the log-sum-exp of ours, then the KL sum (in double: the KL of two
// close distributions is a small difference of O(1) terms).
#include "cuda/distribution_compare.h"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 512;

// (value, index) max with ties to the lower index, over the block; every thread gets the result.
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  v = -INFINITY, i = 0x7fffffff;
  for (int w = 0; w < nwarps; ++w)
    if (sv[w] > v || (sv[w] == v && si[w] < i)) v = sv[w], i = si[w];
}

__device__ double block_sum_double(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double r = 0.0;
  for (int w = 0; w < nwarps; ++w) r += scratch[w];
  return r;
}

__global__ void compare_kernel(const float* logits, const float* ref_logp, const int32_t* target, int64_t V,
                               double* kl, int32_t* argmax, int32_t* ref_argmax, double* logp) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ double sd[32];
  const float* x = logits + blockIdx.x * V;
  const float* r = ref_logp + blockIdx.x * V;
  float mx = -INFINITY, rmx = -INFINITY;
  int mi = 0x7fffffff, rmi = 0x7fffffff;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    if (x[v] > mx) mx = x[v], mi = static_cast<int>(v);  // v ascends per thread: the first max wins ties
    if (r[v] > rmx) rmx = r[v], rmi = static_cast<int>(v);
  }
  block_argmax(mx, mi, sv, si);
  block_argmax(rmx, rmi, sv, si);
  double s = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += exp(static_cast<double>(x[v] - mx));
  const double lse = static_cast<double>(mx) + log(block_sum_double(s, sd));
  double k = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const double rv = r[v];
    if (rv > -INFINITY) k += exp(rv) * (rv - (static_cast<double>(x[v]) - lse));
  }
  k = block_sum_double(k, sd);
  if (threadIdx.x == 0) {
    kl[blockIdx.x] = k;
    argmax[blockIdx.x] = mi;
    ref_argmax[blockIdx.x] = rmi;
    const int32_t t = target[blockIdx.x];
    logp[blockIdx.x] = t < 0 ? 0.0 : static_cast<double>(x[t]) - lse;
  }
}

}  // namespace

void compare_rows(const float* logits, const float* ref_logp, const int32_t* target, int64_t rows, int64_t V,
                  double* kl, int32_t* argmax, int32_t* ref_argmax, double* logp, cudaStream_t st) {
  if (rows <= 0) return;
  compare_kernel<<<static_cast<unsigned>(rows), kThreads, 0, st>>>(logits, ref_logp, target, V, kl, argmax,
                                                                   ref_argmax, logp);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nextlm::cuda
