// Multi-tensor gradient norm and AdamW update (see optim.h): a chunk prefix scan and work list, a per-chunk double
// sum of squares with a fixed-order final sum, and a per-chunk elementwise AdamW. The reference is
// src/model/optim.cpp's clip_grad_norm and AdamW::step.
#include "cuda/optim.h"

#include <cmath>
#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;        // one block per chunk; a chunk of 16384 elements is 16 float4 groups per thread
constexpr int kScanThreads = 512;    // the chunk prefix scan (one block)
constexpr int kSumThreads = 1024;    // the final sum of the norm (one block)
constexpr int kMapThreads = 256;
static_assert(kOptimChunk % 4 == 0, "chunks start on 16-byte boundaries of a 16-byte aligned tensor");
static_assert(kOptimChunk / 4 <= int64_t{1} << 30, "a chunk's group count fits an int");

// The workspace: prefix [count + 1] chunk counts (int64), the work list [chunks] (tensor, chunk within it), and the
// per-chunk partial sums of squares [chunks] (double); each part 256-byte aligned.
struct Workspace {
  int64_t* prefix;
  int2* work;
  double* partial;
};

int64_t align256(int64_t bytes) { return (bytes + 255) & ~int64_t{255}; }

Workspace carve(void* base, int count, int64_t chunks) {
  char* p = static_cast<char*>(base);
  Workspace w;
  w.prefix = reinterpret_cast<int64_t*>(p);
  p += align256((int64_t(count) + 1) * int64_t(sizeof(int64_t)));
  w.work = reinterpret_cast<int2*>(p);
  p += align256(chunks * int64_t(sizeof(int2)));
  w.partial = reinterpret_cast<double*>(p);
  return w;
}

__host__ __device__ __forceinline__ int64_t chunks_of(int64_t n) {
  return n > 0 ? (n + kOptimChunk - 1) / kOptimChunk : 0;
}

// prefix[k] = chunks of tensors 0..k-1 (prefix[0] = 0, prefix[count] = chunks). The total must equal the host's
// `chunks` (the grids are sized by it); a mismatch means the device list is not the one optim_chunks saw, and traps
// rather than update a wrong set of elements.
__global__ void __launch_bounds__(kScanThreads)
    chunk_prefix_kernel(const DeviceParam* __restrict__ params, int count, int64_t chunks, int64_t* prefix) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  if (threadIdx.x == 0) prefix[0] = 0;
  int64_t carry = 0;
  for (int base = 0; base < count; base += kScanThreads) {
    const int k = base + static_cast<int>(threadIdx.x);
    int64_t x = k < count ? chunks_of(params[k].n) : 0, total = 0;
    Scan(tmp).InclusiveSum(x, x, total);
    if (k < count) prefix[k + 1] = carry + x;
    carry += total;
    __syncthreads();  // tmp is reused by the next tile
  }
  if (threadIdx.x == 0 && carry != chunks) __trap();
}

// work[c] = (tensor k, chunk c − prefix[k] of it) with prefix[k] <= c < prefix[k+1]: the last tensor whose chunks
// start at or before c (empty tensors own no chunk and are skipped by the search).
__global__ void __launch_bounds__(kMapThreads)
    chunk_map_kernel(const int64_t* __restrict__ prefix, int count, int64_t chunks, int2* __restrict__ work) {
  const int64_t c = int64_t(blockIdx.x) * kMapThreads + threadIdx.x;
  if (c >= chunks) return;
  int lo = 0, hi = count;  // prefix[lo] <= c < prefix[hi]
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= c) lo = mid;
    else hi = mid;
  }
  work[c] = make_int2(lo, static_cast<int>(c - prefix[lo]));
}

// The chunk of work item c: its tensor, first element and length (1 .. kOptimChunk).
struct Chunk {
  int tensor;
  int64_t off;
  int len;
};
__device__ __forceinline__ Chunk chunk_at(const int2* work, const DeviceParam* params, int64_t c) {
  const int2 wk = work[c];
  Chunk ch;
  ch.tensor = wk.x;
  ch.off = int64_t(wk.y) * kOptimChunk;
  ch.len = static_cast<int>(min(kOptimChunk, params[wk.x].n - ch.off));
  return ch;
}

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Sum over the block of one double per thread in a fixed order (a shuffle tree per warp, then over the warps);
// the result is valid in thread 0. `scratch` holds one double per warp.
template <int THREADS>
__device__ __forceinline__ double block_sum_fixed(double v, double* scratch) {
  constexpr int kWarps = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double r = 0.0;
  if (warp == 0) {
    r = lane < kWarps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) r += __shfl_down_sync(0xffffffffu, r, o);
  }
  return r;
}

// (double)(scale·x)², exact: a product of two 24-bit significands fits a double's 53 bits.
__device__ __forceinline__ double sq_term(float scale, float x) {
  const double s = static_cast<double>(__fmul_rn(scale, x));
  return __dmul_rn(s, s);
}

// partial[c] = Σ over chunk c of (scale·g)². Thread j sums its groups q ≡ j (mod kThreads) in increasing q, the 4
// elements of a group in order, whether they were read as a float4 or as scalars: the order depends on the chunk's
// length only. The partial group at the end (len % 4 elements) is group len / 4, owned and summed last by its thread.
__global__ void __launch_bounds__(kThreads)
    grad_sq_partial_kernel(const DeviceParam* __restrict__ params, const int2* __restrict__ work, float scale,
                           double* __restrict__ partial) {
  __shared__ double scratch[kThreads / 32];
  const Chunk ch = chunk_at(work, params, blockIdx.x);
  const float* __restrict__ g = params[ch.tensor].g + ch.off;
  const int groups = ch.len / 4;
  double acc = 0.0;
  if (aligned(g, 16)) {
    const float4* g4 = reinterpret_cast<const float4*>(g);
    for (int q = threadIdx.x; q < groups; q += kThreads) {
      const float4 x = g4[q];
      acc = __dadd_rn(acc, sq_term(scale, x.x));
      acc = __dadd_rn(acc, sq_term(scale, x.y));
      acc = __dadd_rn(acc, sq_term(scale, x.z));
      acc = __dadd_rn(acc, sq_term(scale, x.w));
    }
  } else {
    for (int q = threadIdx.x; q < groups; q += kThreads)
      for (int j = 0; j < 4; ++j) acc = __dadd_rn(acc, sq_term(scale, g[4 * q + j]));
  }
  if (static_cast<int>(threadIdx.x) == groups % kThreads)
    for (int i = 4 * groups; i < ch.len; ++i) acc = __dadd_rn(acc, sq_term(scale, g[i]));
  const double s = block_sum_fixed<kThreads>(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// *sq = Σ partial[0..chunks) in a fixed order: thread j sums c ≡ j (mod kSumThreads) in increasing c, then the block.
__global__ void __launch_bounds__(kSumThreads)
    grad_sq_final_kernel(const double* __restrict__ partial, int64_t chunks, double* __restrict__ sq) {
  __shared__ double scratch[kSumThreads / 32];
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += kSumThreads) acc = __dadd_rn(acc, partial[c]);
  const double s = block_sum_fixed<kSumThreads>(acc, scratch);
  if (threadIdx.x == 0) *sq = s;
}

// AdamW::step's constants, rounded to fp32 on the host exactly as it rounds them.
struct AdamWConsts {
  float scale;                    // applied to g before the clipping coefficient (the caller's gradient scale)
  float b1, one_minus_b1;         // (float)β1 and 1 − (float)β1 in fp32, as the host's (1.0f − b1)
  float b2, one_minus_b2;
  float step_size;                // (float)(lr / (1 − β1^t))
  float sqrt_bc2;                 // (float)sqrt(1 − β2^t)
  float eps;                      // (float)ε
  float decay;                    // (float)(1 − lr·wd), for tensors with decay = 1
  double max_norm;                // clipping threshold; <= 0: none
  const double* sq;               // the squared norm (device); read only when max_norm > 0
};

// One element of AdamW::step with explicit round-to-nearest operations, so that nvcc contracts nothing into an FMA
// and the result is the host's bit for bit: w *= decay; m = b1·m + (1−b1)·g; v = b2·v + ((1−b2)·g)·g;
// w −= (step_size·m) / (sqrt(v)/sqrt_bc2 + eps).
__device__ __forceinline__ void adamw_element(float& w, float g, float& m, float& v, float decay,
                                              const AdamWConsts& a) {
  w = __fmul_rn(w, decay);
  m = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.one_minus_b1, g));
  v = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(__fmul_rn(a.one_minus_b2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), a.sqrt_bc2), a.eps);
  w = __fsub_rn(w, __fdiv_rn(__fmul_rn(a.step_size, m), denom));
}

// One chunk per block. The clipping coefficient is computed by every thread from *sq (one broadcast load), the same
// double arithmetic as clip_grad_norm: coef = (float)(max_norm / (sqrt(sq) + 1e-6)) when sqrt(sq) > max_norm.
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const DeviceParam* __restrict__ params, const int2* __restrict__ work, AdamWConsts a) {
  float coef = 1.0f;
  if (a.max_norm > 0.0) {
    const double norm = __dsqrt_rn(*a.sq);
    if (norm > a.max_norm) coef = __double2float_rn(__ddiv_rn(a.max_norm, __dadd_rn(norm, 1e-6)));
  }
  const Chunk ch = chunk_at(work, params, blockIdx.x);
  const DeviceParam& p = params[ch.tensor];
  float* __restrict__ w = p.w + ch.off;
  const float* __restrict__ g = p.g + ch.off;
  float* __restrict__ m = p.m + ch.off;
  float* __restrict__ v = p.v + ch.off;
  bf16* __restrict__ w16 = p.w16 ? p.w16 + ch.off : nullptr;
  const float decay = p.decay ? a.decay : 1.0f;
  const int groups = ch.len / 4;
  // (scale·g)·coef: the gradient the host sees after its scaling and clip_grad_norm's in-place multiply (coef = 1
  // when not clipping, an exact multiply).
  auto grad = [&](float x) { return __fmul_rn(__fmul_rn(a.scale, x), coef); };
  auto one = [&](int i) {
    float wi = w[i], mi = m[i], vi = v[i];
    adamw_element(wi, grad(g[i]), mi, vi, decay, a);
    w[i] = wi, m[i] = mi, v[i] = vi;
    if (w16) w16[i] = __float2bfloat16_rn(wi);
  };
  if (aligned(w, 16) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16) && (!w16 || aligned(w16, 8))) {
    float4* w4 = reinterpret_cast<float4*>(w);
    const float4* g4 = reinterpret_cast<const float4*>(g);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    for (int q = threadIdx.x; q < groups; q += kThreads) {
      float4 wq = w4[q], mq = m4[q], vq = v4[q];
      const float4 gq = g4[q];
      adamw_element(wq.x, grad(gq.x), mq.x, vq.x, decay, a);
      adamw_element(wq.y, grad(gq.y), mq.y, vq.y, decay, a);
      adamw_element(wq.z, grad(gq.z), mq.z, vq.z, decay, a);
      adamw_element(wq.w, grad(gq.w), mq.w, vq.w, decay, a);
      w4[q] = wq, m4[q] = mq, v4[q] = vq;
      if (w16) {
        __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(w16 + 4 * q);
        o[0] = __floats2bfloat162_rn(wq.x, wq.y);
        o[1] = __floats2bfloat162_rn(wq.z, wq.w);
      }
    }
  } else {
    for (int q = threadIdx.x; q < groups; q += kThreads)
      for (int j = 0; j < 4; ++j) one(4 * q + j);
  }
  if (static_cast<int>(threadIdx.x) == groups % kThreads)
    for (int i = 4 * groups; i < ch.len; ++i) one(i);
}

void check_args(const DeviceParam* params, int count, int64_t chunks, void* workspace, const char* who) {
  check(count >= 0 && chunks >= 0, who, ": bad count ", count, " or chunks ", chunks);
  check(chunks < (int64_t{1} << 31), who, ": ", chunks, " chunks exceed the grid");
  check(chunks == 0 || (params && workspace), who, ": null params or workspace");
  check(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, who, ": the workspace must be 16-byte aligned");
}

// The work list of the tensors into the workspace (chunks > 0).
void build_work_list(const DeviceParam* params, int count, int64_t chunks, const Workspace& ws,
                     cudaStream_t stream) {
  chunk_prefix_kernel<<<1, kScanThreads, 0, stream>>>(params, count, chunks, ws.prefix);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  chunk_map_kernel<<<static_cast<unsigned>(ceil_div(chunks, kMapThreads)), kMapThreads, 0, stream>>>(
      ws.prefix, count, chunks, ws.work);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int64_t optim_chunks(const DeviceParam* host_params, int count) {
  check(count >= 0 && (count == 0 || host_params), "optim_chunks: bad tensor list (count ", count, ")");
  int64_t chunks = 0;
  for (int k = 0; k < count; ++k) {
    check(host_params[k].n >= 0, "optim_chunks: tensor ", k, " has ", host_params[k].n, " elements");
    chunks += chunks_of(host_params[k].n);
  }
  return chunks;
}

int64_t optim_workspace_bytes(int count, int64_t chunks) {
  check(count >= 0 && chunks >= 0, "optim_workspace_bytes: bad count ", count, " or chunks ", chunks);
  return align256((int64_t(count) + 1) * int64_t(sizeof(int64_t))) + align256(chunks * int64_t(sizeof(int2))) +
         chunks * int64_t(sizeof(double));
}

void grad_sq_norm(const DeviceParam* params, int count, int64_t chunks, float scale, double* sq, void* workspace,
                  cudaStream_t stream) {
  check_args(params, count, chunks, workspace, "grad_sq_norm");
  check(sq != nullptr, "grad_sq_norm: null sq");
  const double* partial = nullptr;
  if (chunks > 0) {
    const Workspace ws = carve(workspace, count, chunks);
    build_work_list(params, count, chunks, ws, stream);
    grad_sq_partial_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(params, ws.work, scale,
                                                                                   ws.partial);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    partial = ws.partial;
  }
  grad_sq_final_kernel<<<1, kSumThreads, 0, stream>>>(partial, chunks, sq);  // writes 0 when there are no elements
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

void adamw_update(const DeviceParam* params, int count, int64_t chunks, const double* sq, float scale,
                  double max_norm, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t t,
                  void* workspace, cudaStream_t stream) {
  check_args(params, count, chunks, workspace, "adamw_update");
  check(t >= 1, "adamw_update: the step count after the update must be >= 1, got ", t);
  check(max_norm <= 0.0 || sq != nullptr, "adamw_update: clipping (max_norm ", max_norm, ") needs the norm");
  if (chunks == 0) return;
  // AdamW::step's host arithmetic, the same expressions in the same types.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  AdamWConsts a;
  a.scale = scale;
  a.b1 = static_cast<float>(beta1);
  a.b2 = static_cast<float>(beta2);
  a.one_minus_b1 = 1.0f - a.b1;
  a.one_minus_b2 = 1.0f - a.b2;
  a.step_size = static_cast<float>(lr / bc1);
  a.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  a.eps = static_cast<float>(eps);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.max_norm = max_norm;
  a.sq = sq;
  const Workspace ws = carve(workspace, count, chunks);
  build_work_list(params, count, chunks, ws, stream);
  adamw_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(params, ws.work, a);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nextlm::cuda
