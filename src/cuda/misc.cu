// Small bf16-forward kernels: embedding into streams, row RMSNorm / LayerNorm, conversions, the final stream mean,
// and the log-softmax of lm_head rows.
#include "cuda/kernels.h"

#include <cstdint>

namespace nextlm::cuda {

namespace {

// Blocks for a grid-stride loop over n items.
int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, 256), 65535)); }

// Grid (tokens, column blocks); VEC: 4 columns a thread (D a multiple of 4, the bases aligned for it).
template <bool VEC>
__global__ void embed_kernel(const int32_t* tok, const bf16* embed, float* h, int64_t S, int64_t D) {
  const int64_t t = blockIdx.x;
  const bf16* row = embed + static_cast<int64_t>(tok[t]) * D;
  const int64_t d = (blockIdx.y * int64_t(blockDim.x) + threadIdx.x) * (VEC ? 4 : 1);
  if (d >= D) return;
  if constexpr (VEC) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(row + d));
    const float4 v = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                                 __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
    for (int64_t s = 0; s < S; ++s) *reinterpret_cast<float4*>(h + (t * S + s) * D + d) = v;
  } else {
    const float v = __bfloat162float(row[d]);
    for (int64_t s = 0; s < S; ++s) h[(t * S + s) * D + d] = v;
  }
}

// Rows of a vocabulary slice: x[t] = embed[tok[t] − begin] when the token falls in [begin, begin + rows), else 0.
__global__ void embed_range_kernel(const int32_t* tok, const bf16* embed, int64_t begin, int64_t rows, float* x,
                                   int64_t D) {
  const int64_t t = blockIdx.x, r = static_cast<int64_t>(tok[t]) - begin;
  const bool held = r >= 0 && r < rows;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) x[t * D + d] = held ? __bfloat162float(embed[r * D + d]) : 0.0f;
}

__global__ void expand_streams_kernel(const float* x, float* h, int64_t S, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    for (int64_t s = 0; s < S; ++s) h[(t * S + s) * D + d] = x[t * D + d];
}

__global__ void rmsnorm_kernel(const float* x, int64_t ldx, const float* w, bf16* y, float* y32, int64_t n, float eps) {
  __shared__ float scratch[32];
  const float* row = x + blockIdx.x * ldx;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += row[i] * row[i];
  const float r = rsqrtf(block_sum(ss, scratch) / n + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = w[i] * (row[i] * r);
    y[blockIdx.x * n + i] = __float2bfloat16(v);
    if (y32) y32[blockIdx.x * n + i] = v;
  }
}

__global__ void layernorm_kernel(float* x, const float* w, const float* b, int64_t n, float eps) {
  __shared__ float scratch[32];
  float* row = x + blockIdx.x * n;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += row[i];
  const float mean = block_sum(s, scratch) / n;
  float v = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += (row[i] - mean) * (row[i] - mean);
  const float r = rsqrtf(block_sum(v, scratch) / n + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) row[i] = (row[i] - mean) * r * w[i] + b[i];
}

// ---- fp32 ↔ bf16 conversions ----
// Element-wise over n values, four at a time (a 16-byte fp32 and an 8-byte bf16 access) when both bases allow it,
// the rest one at a time; every element is converted as the scalar form would (round to nearest even).
enum class Convert { kToBf16, kRoundToBf16, kToF32 };

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// kToBf16: y = bf16(x). kRoundToBf16: y = bf16(x) and x ← float(y). kToF32: x = float(y).
template <Convert C, bool VEC>
__global__ void convert_kernel(float* x, bf16* y, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if constexpr (VEC) {
    float4* x4 = reinterpret_cast<float4*>(x);
    uint2* y4 = reinterpret_cast<uint2*>(y);
    for (; i < n / 4; i += stride) {
      if constexpr (C == Convert::kToF32) {
        const uint2 u = y4[i];
        x4[i] = make_float4(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
      } else {
        const float4 v = x4[i];
        const uint2 u = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
        y4[i] = u;
        if constexpr (C == Convert::kRoundToBf16)
          x4[i] = make_float4(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
      }
    }
  } else {
    for (; i < n; i += stride) {
      if constexpr (C == Convert::kToF32) {
        x[i] = __bfloat162float(y[i]);
      } else {
        y[i] = __float2bfloat16(x[i]);
        if constexpr (C == Convert::kRoundToBf16) x[i] = __bfloat162float(y[i]);
      }
    }
  }
}

template <Convert C>
void convert(float* x, bf16* y, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  const bool vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (reinterpret_cast<uintptr_t>(y) & 7) == 0;
  const int64_t head = vec ? n / 4 * 4 : 0;  // elements of the vector pass
  if (head) {
    convert_kernel<C, true><<<grid_for(head / 4), 256, 0, st>>>(x, y, head);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  if (n > head) {
    convert_kernel<C, false><<<grid_for(n - head), 256, 0, st>>>(x + head, y + head, n - head);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
}

__global__ void sigmoid_kernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = 1.0f / (1.0f + expf(-x[i]));
}

// One block a token. VEC: 4 columns a thread with 16-byte loads, the streams' loads all issued before the sums
// (the loop over a token's columns is otherwise a chain of dependent load latencies at decoding's one token).
template <bool VEC>
__global__ void stream_mean_norm_kernel(const float* h, const float* w, bf16* out, float* mean_out, int64_t S,
                                        int64_t D, float eps) {
  extern __shared__ float mean[];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  float ss = 0.0f;
  if constexpr (VEC) {
    for (int64_t d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int64_t s = 0; s < S; ++s) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(h + (t * S + s) * D + d));
        acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
      }
      const float n = static_cast<float>(S);
      acc.x /= n, acc.y /= n, acc.z /= n, acc.w /= n;
      *reinterpret_cast<float4*>(mean + d) = acc;
      ss += acc.x * acc.x, ss += acc.y * acc.y, ss += acc.z * acc.z, ss += acc.w * acc.w;
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc += h[(t * S + s) * D + d];
      acc /= static_cast<float>(S);
      mean[d] = acc;
      ss += acc * acc;
    }
  }
  const float r = rsqrtf(block_sum(ss, scratch) / D + eps);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) out[t * D + d] = __float2bfloat16(w[d] * (mean[d] * r));
  if (mean_out)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) mean_out[t * D + d] = mean[d];
}

// A row's max mx and Σ exp(x − mx) over the block (every thread gets both; the whole block calls it).
__device__ __forceinline__ void row_max_sumexp(const float* row, int64_t V, float& mx, float& s) {
  __shared__ float scratch[32];
  __shared__ float wmax[32];
  mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, row[v]);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int i = 0; i < (blockDim.x + 31) / 32; ++i) mx = fmaxf(mx, wmax[i]);
  s = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += expf(row[v] - mx);
  s = block_sum(s, scratch);
}

__global__ void row_logprob_kernel(const float* logits, const int32_t* target, double* out, int64_t V) {
  const float* row = logits + blockIdx.x * V;
  float mx, s;
  row_max_sumexp(row, V, mx, s);
  if (threadIdx.x == 0) {
    const int32_t tg = target[blockIdx.x];
    out[blockIdx.x] = tg < 0 ? 0.0 : static_cast<double>(row[tg]) - mx - log(static_cast<double>(s));
  }
}

// The vocabulary slice [begin, begin + V) of a row: its max, Σ exp(x − max) and the target's logit (0 when the target
// is not in the slice or is < 0).
__global__ void row_lse_partial_kernel(const float* logits, const int32_t* target, int64_t begin, int64_t V,
                                       float* mx_out, float* sum_out, float* tl_out) {
  const float* row = logits + blockIdx.x * V;
  float mx, s;
  row_max_sumexp(row, V, mx, s);
  if (threadIdx.x == 0) {
    const int64_t tg = static_cast<int64_t>(target[blockIdx.x]) - begin;
    mx_out[blockIdx.x] = mx;
    sum_out[blockIdx.x] = s;
    tl_out[blockIdx.x] = target[blockIdx.x] >= 0 && tg >= 0 && tg < V ? row[tg] : 0.0f;
  }
}

__global__ void lse_rescale_kernel(float* sum, const float* mx, const float* gmx, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) sum[i] = sum[i] == 0.0f ? 0.0f : sum[i] * expf(mx[i] - gmx[i]);
}

__global__ void lse_finish_kernel(const float* tl, const float* gmx, const float* sum, const int32_t* target,
                                  double* out, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n)
    out[i] = target[i] < 0 ? 0.0
                           : static_cast<double>(tl[i]) - gmx[i] - log(static_cast<double>(sum[i]));
}

}  // namespace

void embed_streams(const int32_t* tok, const bf16* embed, float* h, int64_t T, int64_t S, int64_t D, cudaStream_t st) {
  if (!T || !D) return;
  // 8-byte bf16 loads of the row, 16-byte stores into the streams.
  if (D % 4 == 0 && reinterpret_cast<uintptr_t>(embed) % 8 == 0 && is_aligned16(h)) {
    embed_kernel<true><<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(ceil_div(D / 4, 256))), 256, 0, st>>>(
        tok, embed, h, S, D);
  } else {
    embed_kernel<false><<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(ceil_div(D, 256))), 256, 0, st>>>(
        tok, embed, h, S, D);
  }
}

void embed_rows_range(const int32_t* tok, const bf16* embed, int64_t begin, int64_t rows, float* x, int64_t T,
                      int64_t D, cudaStream_t st) {
  if (T) embed_range_kernel<<<T, 256, 0, st>>>(tok, embed, begin, rows, x, D);
}

void expand_streams(const float* x, float* h, int64_t T, int64_t S, int64_t D, cudaStream_t st) {
  if (T) expand_streams_kernel<<<T, 256, 0, st>>>(x, h, S, D);
}

void rmsnorm_rows(const float* x, int64_t ldx, const float* w, bf16* y, float* y32, int64_t rows, int64_t n, float eps,
                  cudaStream_t st) {
  if (rows) rmsnorm_kernel<<<rows, 256, 0, st>>>(x, ldx, w, y, y32, n, eps);
}

void layernorm_rows(float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps, cudaStream_t st) {
  if (rows) layernorm_kernel<<<rows, 128, 0, st>>>(x, w, b, n, eps);
}

void to_bf16(const float* x, bf16* y, int64_t n, cudaStream_t st) {
  convert<Convert::kToBf16>(const_cast<float*>(x), y, n, st);  // x is only read
}
void round_to_bf16(float* x, bf16* y, int64_t n, cudaStream_t st) { convert<Convert::kRoundToBf16>(x, y, n, st); }
void bf16_to_f32(const bf16* x, float* y, int64_t n, cudaStream_t st) {
  convert<Convert::kToF32>(y, const_cast<bf16*>(x), n, st);  // x is only read
}

void sigmoid_inplace(float* x, int64_t n, cudaStream_t st) {
  if (n) sigmoid_kernel<<<grid_for(n), 256, 0, st>>>(x, n);
}

void stream_mean_norm(const float* h, const float* w, bf16* out, int64_t T, int64_t S, int64_t D, float eps,
                      cudaStream_t st, float* mean) {
  if (!T) return;
  const size_t smem = D * sizeof(float);
  const bool vec = D % 4 == 0 && is_aligned16(h);
  auto kernel = vec ? stream_mean_norm_kernel<true> : stream_mean_norm_kernel<false>;
  if (smem > 48 * 1024)
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // 1024 threads a token on the vector path: at D = 4096 one 16-byte column group each, so a decoding step's single
  // token does not walk its row in four dependent rounds.
  kernel<<<T, vec ? 1024 : 256, smem, st>>>(h, w, out, mean, S, D, eps);
}

void row_logprob(const float* logits, const int32_t* target, double* out, int64_t n, int64_t V, cudaStream_t st) {
  if (n) row_logprob_kernel<<<n, 256, 0, st>>>(logits, target, out, V);
}

void row_lse_partial(const float* logits, const int32_t* target, int64_t begin, int64_t n, int64_t V, float* mx,
                     float* sum, float* tl, cudaStream_t st) {
  if (n) row_lse_partial_kernel<<<n, 256, 0, st>>>(logits, target, begin, V, mx, sum, tl);
}

void lse_rescale(float* sum, const float* mx, const float* gmx, int64_t n, cudaStream_t st) {
  if (n) lse_rescale_kernel<<<ceil_div(n, 256), 256, 0, st>>>(sum, mx, gmx, n);
}

void lse_finish(const float* tl, const float* gmx, const float* sum, const int32_t* target, double* out, int64_t n,
                cudaStream_t st) {
  if (n) lse_finish_kernel<<<ceil_div(n, 256), 256, 0, st>>>(tl, gmx, sum, target, out, n);
}

}  // namespace nextlm::cuda
