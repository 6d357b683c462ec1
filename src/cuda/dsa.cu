// DSA on the GPU: k-pool compression, pool scoring with deterministic top-k selection (ties to the lower pool, as
// the CPU path), and softmax attention over the selected keys. Matches src/model/dsa.cpp.
#include "cuda/kernels.h"

namespace nextlm::cuda {

namespace {

// One block per complete pool: per channel a softmax over the pool's tokens of gate score + position bias weighs
// the LayerNormed keys. pool_token[j] is the pool's first token.
__global__ void pool_keys_kernel(IndexerParams p, const int32_t* pool_token, float* pk) {
  const int64_t j = blockIdx.x, t0 = pool_token[j];
  for (int64_t c = threadIdx.x; c < p.ID; c += blockDim.x) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < p.P; ++i) mx = fmaxf(mx, p.gs[(t0 + i) * p.ID + c] + p.ape[i * p.ID + c]);
    float den = 0.0f, num = 0.0f;
    for (int64_t i = 0; i < p.P; ++i) {
      const float e = expf(p.gs[(t0 + i) * p.ID + c] + p.ape[i * p.ID + c] - mx);
      den += e;
      num += e * p.ki[(t0 + i) * p.ID + c];
    }
    pk[j * p.ID + c] = num / den;
  }
}

// Floats ordered as unsigned integers (larger float ⇔ larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per query token: scores of its selectable pools, the budget-th largest by a bitwise radix search, then
// the chosen pools (and the tail) written in ascending order.
__global__ void select_kernel(IndexerParams p, const int32_t* pool_base, const float* pk, int32_t* sel, int32_t* count,
                              int64_t max_sel) {
  extern __shared__ float q[];  // [IH·ID], then the pool scores [max_pools]
  const int64_t t = blockIdx.x;
  const int64_t rel = t - p.seq_start[t], len = p.seq_len[t];
  const int64_t npool = len / p.P, selectable = (rel + 1) / p.P;
  const int64_t budget = min(p.topk / p.P, npool);
  float* sc = q + p.IH * p.ID;
  const float* pkb = pk + static_cast<int64_t>(pool_base[t]) * p.ID;
  for (int64_t i = threadIdx.x; i < p.IH * p.ID; i += blockDim.x) q[i] = p.qi[t * p.IH * p.ID + i];
  __syncthreads();
  const float sscale = rsqrtf(static_cast<float>(p.ID)), wscale = rsqrtf(static_cast<float>(p.IH));
  const bool choose = selectable > budget;
  if (choose) {
    // One warp per pool.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t j = warp; j < selectable; j += nw) {
      float acc = 0.0f;
      for (int64_t h = 0; h < p.IH; ++h) {
        float dot = 0.0f;
        for (int64_t c = lane; c < p.ID; c += 32) dot += q[h * p.ID + c] * pkb[j * p.ID + c];
        dot = warp_sum(dot);
        acc += p.wts[t * p.IH + h] * wscale * fmaxf(dot * sscale, 0.0f);
      }
      if (lane == 0) sc[j] = acc;
    }
    __syncthreads();
  }
  __shared__ uint32_t kth;
  __shared__ int cnt_gt;
  if (choose) {
    // Largest key value κ with count(key ≥ κ) ≥ budget, bit by bit from the top.
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1u << bit);
      int local = 0;
      for (int64_t j = threadIdx.x; j < selectable; j += blockDim.x) local += order_key(sc[j]) >= cand;
      const int total = block_sum_int(local);
      if (total >= budget) prefix = cand;
    }
    if (threadIdx.x == 0) kth = prefix;
    __syncthreads();
    int local = 0;
    for (int64_t j = threadIdx.x; j < selectable; j += blockDim.x) local += order_key(sc[j]) > kth;
    const int gt = block_sum_int(local);
    if (threadIdx.x == 0) cnt_gt = gt;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int32_t* out = sel + t * max_sel;
    int64_t n = 0, eq_left = choose ? budget - cnt_gt : 0;
    for (int64_t j = 0; j < selectable; ++j) {
      bool take = !choose;
      if (choose) {
        const uint32_t key = order_key(sc[j]);
        take = key > kth || (key == kth && eq_left > 0);
        if (key == kth && take) --eq_left;
      }
      if (take)
        for (int64_t i = 0; i < p.P; ++i) out[n++] = static_cast<int32_t>(j * p.P + i);
    }
    if (p.tail)
      for (int64_t i = selectable * p.P; i <= rel; ++i) out[n++] = static_cast<int32_t>(i);
    count[t] = static_cast<int32_t>(n);
  }
}

// One block per (token, head): scores over the selected keys in shared memory, softmax, weighted sum of values.
__global__ void attention_kernel(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                                 const int32_t* seq_start, const int32_t* seq_len, bf16* o, int64_t NH, int64_t dqk,
                                 int64_t dv, int64_t max_sel) {
  extern __shared__ float sm[];  // q [dqk], p [n]
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y, s0 = seq_start[t];
  const int64_t dkv = dqk + dv;
  const int64_t n = count[t];
  if (n == 0) {  // an all-masked row: equal weights on every key of the sequence (transformers' eager softmax)
    const int64_t len = seq_len[t];
    for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t i = 0; i < len; ++i) acc += kv[((s0 + i) * NH + h) * dkv + dqk + d];
      o[(t * NH + h) * dv + d] = __float2bfloat16(acc / static_cast<float>(len));
    }
    return;
  }
  float* qs = sm;
  float* pr = sm + dqk;
  for (int64_t d = threadIdx.x; d < dqk; d += blockDim.x) qs[d] = q[(t * NH + h) * dqk + d];
  __syncthreads();
  const float scale = rsqrtf(static_cast<float>(dqk));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int64_t i = warp; i < n; i += nw) {
    const int64_t key = s0 + sel[t * max_sel + i];
    float dot = 0.0f;
    for (int64_t d = lane; d < dqk; d += 32) dot += qs[d] * kv[(key * NH + h) * dkv + d];
    dot = warp_sum(dot);
    if (lane == 0) pr[i] = dot * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, pr[i]);
  mx = warp_max(mx);
  __shared__ float wm[32];
  if (lane == 0) wm[warp] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int i = 0; i < nw; ++i) mx = fmaxf(mx, wm[i]);
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += (pr[i] = expf(pr[i] - mx));
  const float den = block_sum(s, scratch);
  __syncthreads();
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = s0 + sel[t * max_sel + i];
      acc += pr[i] * kv[(key * NH + h) * dkv + dqk + d];
    }
    o[(t * NH + h) * dv + d] = __float2bfloat16(acc / den);
  }
}

}  // namespace

void pool_keys(const IndexerParams& p, const int32_t* pool_token, int64_t num_pools, float* pk, cudaStream_t st) {
  if (num_pools) pool_keys_kernel<<<num_pools, 128, 0, st>>>(p, pool_token, pk);
}

void indexer_select(const IndexerParams& p, const int32_t* pool_base, const float* pk, int32_t* sel, int32_t* count,
                    int64_t max_sel, cudaStream_t st) {
  if (!p.T) return;
  const size_t smem = (p.IH * p.ID + p.max_pools) * sizeof(float);
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  select_kernel<<<p.T, 256, smem, st>>>(p, pool_base, pk, sel, count, max_sel);
}

void mla_sparse_attention(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                          const int32_t* seq_start, const int32_t* seq_len, bf16* o, int64_t T, int64_t NH,
                          int64_t dqk, int64_t dv, int64_t max_sel, cudaStream_t st) {
  if (!T) return;
  const size_t smem = (dqk + max_sel) * sizeof(float);
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  attention_kernel<<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(NH)), 128, smem, st>>>(
      q, kv, sel, count, seq_start, seq_len, o, NH, dqk, dv, max_sel);
}

}  // namespace nextlm::cuda
