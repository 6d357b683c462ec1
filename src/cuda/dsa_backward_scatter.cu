// The MLA attention backward over the indexer's selection, query-major: one block per (token, head) recomputes the
// softmax over its selected keys, writes its dq and scatters its dk, dv with atomics. Its work is proportional to
// the selected (query, key) pairs, so it is the one for long sequences, where the selection is sparse in the causal
// triangle; the tiled kernel (dsa_backward.cu) costs the whole triangle's tiles but needs no atomics.
#include <algorithm>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int64_t kMinChunk = 1024;

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_max(lane < nwarps ? scratch[lane] : -INFINITY);
}

__global__ void __launch_bounds__(kThreads)
    attention_backward_scatter_kernel(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                              const int32_t* seq_start, const int32_t* seq_len, const float* do_, float* dq,
                              float* dkv, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel, int64_t cap,
                              bool vec4) {
  extern __shared__ __align__(16) float sm[];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y, s0 = seq_start[t], W = dqk + dv;
  const int64_t cnt = count[t];
  const bool uniform = cnt == 0;
  const int64_t n = uniform ? static_cast<int64_t>(seq_len[t]) : cnt;
  int64_t* rows = reinterpret_cast<int64_t*>(sm);
  float* a = sm + 2 * cap;
  float* b = a + cap;
  float* qs = b + cap;
  float* dos = qs + dqk;
  float* dqs = dos + dv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;

  for (int64_t d = tid; d < dqk; d += blockDim.x) {
    qs[d] = q[(t * NH + h) * dqk + d];
    dqs[d] = 0.0f;
  }
  for (int64_t d = tid; d < dv; d += blockDim.x) dos[d] = do_[(t * NH + h) * dv + d];
  const float scale = 1.0f / sqrtf(static_cast<float>(dqk));

  auto stage = [&](int64_t c0, int64_t cn) {
    __syncthreads();
    for (int64_t i = tid; i < cn; i += blockDim.x) {
      const int64_t key = s0 + (uniform ? c0 + i : static_cast<int64_t>(sel[t * max_sel + c0 + i]));
      rows[i] = (key * NH + h) * W;
    }
    __syncthreads();
    for (int64_t i = warp; i < cn; i += nw) {
      const float* kh = kv + rows[i];
      float s = 0.0f, g = 0.0f;
      if (!uniform)
        for (int64_t d = lane; d < dqk; d += 32) s = fmaf(qs[d], kh[d], s);
      for (int64_t d = lane; d < dv; d += 32) g = fmaf(dos[d], kh[dqk + d], g);
      s = warp_sum(s);
      g = warp_sum(g);
      if (lane == 0) a[i] = s * scale, b[i] = g;
    }
    __syncthreads();
  };

  float mx = 0.0f, den = 1.0f, pdp;
  const float inv_n = 1.0f / static_cast<float>(n);
  if (uniform) {
    float part = 0.0f;
    for (int64_t c0 = 0; c0 < n; c0 += cap) {
      const int64_t cn = min(cap, n - c0);
      stage(c0, cn);
      for (int64_t i = tid; i < cn; i += blockDim.x) part += b[i];
    }
    pdp = block_sum(part, scratch) * inv_n;
  } else {
    stage(0, n);
    float m = -INFINITY;
    for (int64_t i = tid; i < n; i += blockDim.x) m = fmaxf(m, a[i]);
    mx = block_max(m, scratch);
    float e = 0.0f, ed = 0.0f;
    for (int64_t i = tid; i < n; i += blockDim.x) {
      const float x = expf(a[i] - mx);
      e += x;
      ed = fmaf(x, b[i], ed);
    }
    den = block_sum(e, scratch);
    pdp = block_sum(ed, scratch) / den;
  }

  const bool restage = n > cap;
  for (int64_t c0 = 0; c0 < n; c0 += cap) {
    const int64_t cn = min(cap, n - c0);
    if (restage) stage(c0, cn);
    for (int64_t i = tid; i < cn; i += blockDim.x) {
      const float p = uniform ? inv_n : expf(a[i] - mx) / den;
      a[i] = p;
      b[i] = p * (b[i] - pdp) * scale;
    }
    __syncthreads();
    for (int64_t d = tid; d < dqk; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t i = 0; i < cn; ++i) acc = fmaf(b[i], kv[rows[i] + d], acc);
      dqs[d] += acc;
    }
    const int w = static_cast<int>(W);
#if __CUDA_ARCH__ >= 900
    if (vec4) {
      const int w4 = w / 4, total = static_cast<int>(cn) * w4;
      for (int idx = tid; idx < total; idx += blockDim.x) {
        const int i = idx / w4, d = (idx - i * w4) * 4;
        const float f = d < dqk ? b[i] : a[i];
        const float* x = d < dqk ? qs + d : dos + (d - dqk);
        atomicAdd(reinterpret_cast<float4*>(dkv + rows[i] + d), make_float4(f * x[0], f * x[1], f * x[2], f * x[3]));
      }
    } else
#endif
    {
      const int total = static_cast<int>(cn) * w;
      for (int idx = tid; idx < total; idx += blockDim.x) {
        const int i = idx / w, d = idx - i * w;
        atomicAdd(dkv + rows[i] + d, d < dqk ? b[i] * qs[d] : a[i] * dos[d - dqk]);
      }
    }
    __syncthreads();
  }
  for (int64_t d = tid; d < dqk; d += blockDim.x) dq[(t * NH + h) * dqk + d] += dqs[d];
}

}  // namespace

void mla_sparse_attention_backward_scatter(const float* q, const float* kv, const int32_t* sel,
                                           const int32_t* count, const int32_t* seq_start, const int32_t* seq_len,
                                           const float* do_, float* dq, float* dkv, int64_t T, int64_t NH, int64_t dqk,
                                           int64_t dv, int64_t max_sel, cudaStream_t st) {
  if (T == 0 || NH == 0) return;
  const int64_t cap = std::max(max_sel, kMinChunk);
  const size_t smem = (2 * dqk + dv + 2 * cap) * sizeof(float) + cap * sizeof(int64_t);
  check(smem <= 227 * 1024, "MLA attention backward: ", smem, " bytes of shared memory per block (max_sel ", max_sel,
        ", head dims ", dqk, "/", dv, ") exceed the 227 KiB of an H200 block");
  const bool vec4 = dqk % 4 == 0 && dv % 4 == 0 && reinterpret_cast<uintptr_t>(dkv) % 16 == 0;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(attention_backward_scatter_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(NH));
  attention_backward_scatter_kernel<<<grid, kThreads, smem, st>>>(
      q, kv, sel, count, seq_start, seq_len, do_, dq, dkv, NH, dqk, dv, max_sel, cap, vec4);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nextlm::cuda
