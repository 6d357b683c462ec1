// mHC on the GPU: one fused pass for the stream norm, the fn projection, sigmoid/softmax/Sinkhorn and the collapse
// (with the sub-layer's RMSNorm), and one for the post-mix. Matches src/model/mhc.cpp.
#include "cuda/kernels.h"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;

template <int S>
__global__ void __launch_bounds__(kThreads) mhc_pre_kernel(MhcParams p, const float* h, float* post, float* comb,
                                                           bf16* a) {
  constexpr int M = (2 + S) * S;
  extern __shared__ float smem[];  // collapsed [D]
  __shared__ float partial[kThreads / 32][M];
  __shared__ float mix[M];
  __shared__ float coef[2 * S + S * S];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, D = p.D, SD = S * D;
  const float* ht = h + t * SD;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < SD; i += kThreads) {
    const float x = ht[i];
    ss += x * x;
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] += x * p.fn[m * SD + i];
  }
  const float r = rsqrtf(block_sum(ss, scratch) / SD + p.rms_eps);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float v = warp_sum(acc[m]);
    if (lane == 0) partial[warp][m] = v;
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float v = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) v += partial[w][threadIdx.x];
    mix[threadIdx.x] = v * r;  // fn·(f·r) = r·(fn·f)
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float* base = p.base;
    const float* sc = p.scale;
    float* pre = coef;
    float* pst = coef + S;
    float* C = coef + 2 * S;
    for (int s = 0; s < S; ++s) {
      pre[s] = 1.0f / (1.0f + expf(-(mix[s] * sc[0] + base[s]))) + p.hc_eps;
      pst[s] = 2.0f / (1.0f + expf(-(mix[S + s] * sc[1] + base[S + s])));
    }
    for (int rr = 0; rr < S; ++rr) {
      float mx = -INFINITY;
      for (int s = 0; s < S; ++s) {
        C[rr * S + s] = mix[2 * S + rr * S + s] * sc[2] + base[2 * S + rr * S + s];
        mx = fmaxf(mx, C[rr * S + s]);
      }
      float sum = 0.0f;
      for (int s = 0; s < S; ++s) sum += (C[rr * S + s] = expf(C[rr * S + s] - mx));
      for (int s = 0; s < S; ++s) C[rr * S + s] = C[rr * S + s] / sum + p.hc_eps;
    }
    auto cols = [&] {
      for (int s = 0; s < S; ++s) {
        float sum = 0.0f;
        for (int rr = 0; rr < S; ++rr) sum += C[rr * S + s];
        for (int rr = 0; rr < S; ++rr) C[rr * S + s] /= sum + p.hc_eps;
      }
    };
    cols();
    for (int it = 0; it + 1 < p.iters; ++it) {
      for (int rr = 0; rr < S; ++rr) {
        float sum = 0.0f;
        for (int s = 0; s < S; ++s) sum += C[rr * S + s];
        for (int s = 0; s < S; ++s) C[rr * S + s] /= sum + p.hc_eps;
      }
      cols();
    }
    for (int s = 0; s < S; ++s) post[t * S + s] = pst[s];
    for (int i = 0; i < S * S; ++i) comb[t * S * S + i] = C[i];
  }
  __syncthreads();
  float ss2 = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) v += coef[s] * ht[s * D + d];
    smem[d] = v;
    ss2 += v * v;
  }
  const float r2 = rsqrtf(block_sum(ss2, scratch) / D + p.rms_eps);
  for (int64_t d = threadIdx.x; d < D; d += kThreads) a[t * D + d] = __float2bfloat16(p.norm_w[d] * (smem[d] * r2));
}

template <int S>
__global__ void mhc_post_kernel(float* h, const float* y, const float* post, const float* comb, int64_t D) {
  const int64_t t = blockIdx.y;
  const int64_t d = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (d >= D) return;
  float old[S];
#pragma unroll
  for (int r = 0; r < S; ++r) old[r] = h[(t * S + r) * D + d];
  const float yt = y[t * D + d];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    float v = post[t * S + s] * yt;
#pragma unroll
    for (int r = 0; r < S; ++r) v += comb[(t * S + r) * S + s] * old[r];
    h[(t * S + s) * D + d] = v;
  }
}

template <int S>
void launch_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, cudaStream_t st) {
  mhc_pre_kernel<S><<<p.T, kThreads, p.D * sizeof(float), st>>>(p, h, post, comb, a);
}
template <int S>
void launch_post(float* h, const float* y, const float* post, const float* comb, int64_t T, int64_t D,
                 cudaStream_t st) {
  mhc_post_kernel<S><<<dim3(static_cast<unsigned>(ceil_div(D, 256)), static_cast<unsigned>(T)), 256, 0, st>>>(
      h, y, post, comb, D);
}

}  // namespace

// The stream count is a template parameter so that the per-thread projection accumulators stay in registers.
#define NEXTLM_MHC_DISPATCH(S_, CALL)                     \
  switch (S_) {                                           \
    case 1: CALL(1); break;                               \
    case 2: CALL(2); break;                               \
    case 3: CALL(3); break;                               \
    case 4: CALL(4); break;                               \
    case 6: CALL(6); break;                               \
    case 8: CALL(8); break;                               \
    default: fail("CUDA mHC: hc_mult ", S_, " is not instantiated (1, 2, 3, 4, 6, 8)"); \
  }

void mhc_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, cudaStream_t st) {
  if (!p.T) return;
#define CALL(S) launch_pre<S>(p, h, post, comb, a, st)
  NEXTLM_MHC_DISPATCH(p.S, CALL)
#undef CALL
}

void mhc_post(float* h, const float* y, const float* post, const float* comb, int64_t T, int64_t S, int64_t D,
              cudaStream_t st) {
  if (!T) return;
#define CALL(S) launch_post<S>(h, y, post, comb, T, D, st)
  NEXTLM_MHC_DISPATCH(S, CALL)
#undef CALL
}

}  // namespace nextlm::cuda
