// KDA on the GPU: fused short conv + SiLU + L2 norm, the decay gate, the chunked delta rule (a per-chunk pass that
// builds the WY factors in parallel over chunks and heads, then a sequential pass over chunks that carries the fp32
// state, split over value columns), and the gated output norm. Matches src/model/kda.cpp (chunk 64).
#include <algorithm>
#include <type_traits>

#include "cuda/kda_conv.cuh"
#include "cuda/kernels.h"

namespace nextlm::cuda {

namespace {

constexpr int kC = 64;  // chunk length

__device__ __forceinline__ void put(float* p, float x) { *p = x; }
__device__ __forceinline__ void put(bf16* p, float x) { *p = __float2bfloat16(x); }
__device__ __forceinline__ float get(const float* p) { return *p; }
__device__ __forceinline__ float get(const bf16* p) { return __bfloat162float(*p); }

// One warp per (token, head, which of q/k/v). Each lane owns K/32 channels.
template <class OutT>
__global__ void conv_norm_kernel(const float* raw, const float* conv, const int32_t* seq_start, OutT* q, OutT* k,
                                 OutT* v, int64_t T, int64_t H, int64_t K, int64_t W) {
  const int64_t warp_id = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_id >= T * H * 3) return;
  const int64_t which = warp_id % 3, h = (warp_id / 3) % H, t = warp_id / (3 * H);
  const int64_t HK = H * K, C3 = 3 * HK, s0 = seq_start[t];
  float vals[8];  // K ≤ 256; the loops below unroll over all 8 so that it stays in registers
  float ss = 0.0f;
  const int per = static_cast<int>((K + 31) / 32);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    vals[i] = 0.0f;
    if (i >= per || lane + 32 * i >= K) continue;
    const int64_t ch = which * HK + h * K + lane + 32 * i;
    float acc = 0.0f;
    for (int64_t w = 0; w < W; ++w) {
      const int64_t src = t + w - (W - 1);
      if (src >= s0) acc += conv[ch * W + w] * raw[src * C3 + ch];
    }
    acc = silu(acc);
    vals[i] = acc;
    ss += acc * acc;
  }
  OutT* out = which == 0 ? q : (which == 1 ? k : v);
  float scale = 1.0f;
  if (which < 2) {
    ss = warp_sum(ss);
    scale = rsqrtf(ss + 1e-6f) * (which == 0 ? rsqrtf(static_cast<float>(K)) : 1.0f);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < per && lane + 32 * i < K) put(out + (t * H + h) * K + lane + 32 * i, vals[i] * scale);
}

// At the model's head size (K = 128) the rows kernel runs 32 tokens a warp with three blocks an SM (80 registers, a
// few spilled): the six calls of a LoRA step's three KDA layers at T = 4096, H = 64 took 2.42 ms on the H200 against
// 2.80 and 2.89 ms (two runs) with 16 tokens and two blocks; 8- or 16-token load groups were no faster (2.68 … 4.58
// ms). ncu put the old launch at 58 % of the SM's and 28 % of the memory's throughput with 23 % occupancy: latency
// more than bytes bound it, so more warps pay, and longer runs load the taps and the rows before a run less often.
constexpr int kLongRun = 32, kLongRunBlocks = 3;

// The same for the common shape (W taps and up to 32·PER channels a head, both compile-time): a warp runs one
// (head, which) over R consecutive tokens (kda_conv::kRunTokens unless given) with its channels' taps and last rows in
// registers (kda_conv.cuh), with at least MINB blocks an SM. Every element's arithmetic is conv_norm_kernel's, with
// the same lanes, so the same bits.
// With q16 (OutT float): each value is also stored rounded to bf16 in q16, k16, v16, and the fp32 output holds that
// rounded value (round_to_bf16 of the fp32 outputs, in the same pass).
template <class OutT, int W, int PER, int R = kda_conv::kRunTokens, int MINB = 2>
__global__ void __launch_bounds__(256, MINB)
    conv_norm_rows_kernel(const float* __restrict__ raw, const float* __restrict__ conv,
                          const int32_t* __restrict__ seq_start, OutT* q, OutT* k, OutT* v, int64_t T, int64_t H,
                          int64_t K, bf16* q16 = nullptr, bf16* k16 = nullptr, bf16* v16 = nullptr) {
  const int lane = threadIdx.x & 31;
  const int64_t C3 = 3 * H * K, nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t wid = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; wid < kda_conv::runs<R>(T, H);
       wid += nwarps) {
    const kda_conv::Run r = kda_conv::run_of<R>(wid, T, H);
    OutT* out = r.which == 0 ? q : (r.which == 1 ? k : v);
    bf16* out16 = r.which == 0 ? q16 : (r.which == 1 ? k16 : v16);
    kda_conv::Window<W, PER> win;
    win.load(raw, conv, r, H, K);
    win.walk(raw, seq_start, C3, K, r, [](int64_t) {}, [&](int, int64_t t, const float (&pre)[PER]) {
      float vals[PER];
      float ss = 0.0f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        vals[i] = 0.0f;
        if (lane + 32 * i >= K) continue;
        const float acc = silu(pre[i]);
        vals[i] = acc;
        ss += acc * acc;
      }
      float scale = 1.0f;
      if (r.which < 2) {
        ss = warp_sum(ss);
        scale = rsqrtf(ss + 1e-6f) * (r.which == 0 ? rsqrtf(static_cast<float>(K)) : 1.0f);
      }
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if (lane + 32 * i < K) {
          const int64_t e = (t * H + r.h) * K + lane + 32 * i;
          if (out16) {
            const bf16 b = __float2bfloat16(vals[i] * scale);
            out16[e] = b;
            put(out + e, __bfloat162float(b));
          } else {
            put(out + e, vals[i] * scale);
          }
        }
    });
  }
}

__device__ __forceinline__ float gate_of(float f_raw, const float* dt_bias, const float* A_log, int64_t c, int64_t K,
                                         bool has_bound, float bound) {
  return kda_gate_value(f_raw + dt_bias[c], expf(A_log[c / K]), has_bound, bound);
}

// g = gate(f) element-wise (g may be f); VEC: four at a time (HK a multiple of 4, f and g 16-byte aligned).
template <bool VEC>
__global__ void gate_kernel(const float* f, float* g, const float* dt_bias, const float* A_log, int64_t n, int64_t H,
                            int64_t K, bool has_bound, float bound) {
  const int64_t HK = H * K, stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / 4; i += stride) {
      const float4 x = reinterpret_cast<const float4*>(f)[i];
      const int64_t c = 4 * i % HK;
      reinterpret_cast<float4*>(g)[i] = make_float4(gate_of(x.x, dt_bias, A_log, c, K, has_bound, bound),
                                                    gate_of(x.y, dt_bias, A_log, c + 1, K, has_bound, bound),
                                                    gate_of(x.z, dt_bias, A_log, c + 2, K, has_bound, bound),
                                                    gate_of(x.w, dt_bias, A_log, c + 3, K, has_bound, bound));
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
      g[i] = gate_of(f[i], dt_bias, A_log, i % HK, K, has_bound, bound);
  }
}

// Per (chunk, head): gc (cumulative log decay), the inverse A of (I + strict_lower(βK∘decay·Kᵀ)), and
//   U = A(βv), Wk = A(βk∘e^gc), qg = q∘e^gc, kd = k∘e^(gl−gc), Aqk[i,j] = Σ q_i k_j e^(gc_i−gc_j) (j ≤ i), gl.
// Layout of the workspace per (chunk, head): U, Wk, qg, kd [C, K] each, Aqk [C, C], gl [K]. Shared-memory rows are
// padded by one float so that threads walking a column hit different banks.
__global__ void chunk_prepare_kernel(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                     KdaChunks ch, float* work, int64_t H, int64_t K) {
  extern __shared__ float sm[];
  const int64_t c = blockIdx.x, h = blockIdx.y;
  const int64_t t0 = ch.chunk_start[c], n = ch.chunk_len[c];
  const int64_t KP = K + 1;
  float* gc = sm;                // [C, KP]
  float* kk = gc + kC * KP;      // [C, KP]
  float* qq = kk + kC * KP;      // [C, KP]
  float* A = qq + kC * KP;       // [C, C+1]
  float* bt = A + kC * (kC + 1); // [C]
  float* rowbuf = bt + kC;       // [C]
  const int64_t AP = kC + 1;
  const int64_t per = 4 * kC * K + kC * kC + K;
  float* U = work + (c * H + h) * per;
  float* Wk = U + kC * K;
  float* qg = Wk + kC * K;
  float* kd = qg + kC * K;
  float* Aqk = kd + kC * K;
  float* gl = Aqk + kC * kC;
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t i = tid; i < kC * K; i += nt) {
    const int64_t r = i / K, d = i % K;
    const bool in = r < n;
    const int64_t src = ((t0 + r) * H + h) * K + d;
    kk[r * KP + d] = in ? k[src] : 0.0f;
    qq[r * KP + d] = in ? q[src] : 0.0f;
    gc[r * KP + d] = in ? g[src] : 0.0f;
  }
  for (int64_t r = tid; r < kC; r += nt) bt[r] = r < n ? beta[(t0 + r) * H + h] : 0.0f;
  __syncthreads();
  for (int64_t d = tid; d < K; d += nt)
    for (int64_t r = 1; r < kC; ++r) gc[r * KP + d] += gc[(r - 1) * KP + d];
  __syncthreads();
  // Strictly lower A and the causal q·k scores; thread ↔ (i, j) with j fastest.
  for (int64_t idx = tid; idx < kC * kC; idx += nt) {
    const int64_t i = idx / kC, j = idx % kC;
    float a = 0.0f, s = 0.0f;
    if (j <= i && i < n) {
      const float* gi = gc + i * KP;
      const float* gj = gc + j * KP;
      const float* ki = kk + i * KP;
      const float* kj = kk + j * KP;
      const float* qi = qq + i * KP;
      for (int64_t d = 0; d < K; ++d) {
        const float e = __expf(gi[d] - gj[d]) * kj[d];
        a += ki[d] * e;
        s += qi[d] * e;
      }
    }
    A[i * AP + j] = j < i ? -a * bt[i] : 0.0f;
    Aqk[idx] = s;
  }
  __syncthreads();
  // Forward substitution, row by row: A[i, j] = A0[i, j] + Σ_{j<m<i} A0[i, m]·A[m, j], with A0 row i as it was
  // before this step (a copy, since the threads of the row write it) and rows < i already final.
  for (int64_t i = 2; i < kC; ++i) {
    for (int64_t m = tid; m < i; m += nt) rowbuf[m] = A[i * AP + m];
    __syncthreads();
    for (int64_t j = tid; j < i - 1; j += nt) {
      float acc = rowbuf[j];
      for (int64_t m = j + 1; m < i; ++m) acc += rowbuf[m] * A[m * AP + j];
      A[i * AP + j] = acc;
    }
    __syncthreads();
  }
  // U = (A + I)(βv), Wk = (A + I)(βk∘e^gc), and the elementwise factors; thread ↔ (i, d) with d fastest.
  for (int64_t idx = tid; idx < kC * K; idx += nt) {
    const int64_t i = idx / K, d = idx % K;
    float u = 0.0f, w = 0.0f;
    for (int64_t j = 0; j <= i && j < n; ++j) {
      const float a = (j == i ? 1.0f : A[i * AP + j]) * bt[j];
      u += a * v[((t0 + j) * H + h) * K + d];
      w += a * kk[j * KP + d] * __expf(gc[j * KP + d]);
    }
    U[idx] = u;
    Wk[idx] = w;
    const float gli = gc[(kC - 1) * KP + d];
    qg[idx] = qq[i * KP + d] * __expf(gc[i * KP + d]);
    kd[idx] = kk[i * KP + d] * __expf(gli - gc[i * KP + d]);
  }
  for (int64_t d = tid; d < K; d += nt) gl[d] = gc[(kC - 1) * KP + d];
}

// Per (sequence, head, value tile of tv columns): walk the chunks in order carrying S[:, tile] in shared memory.
// Each chunk's factors are staged in shared memory first (rows padded by one float).
__global__ void chunk_state_kernel(const float* work, KdaChunks ch, float* o, int64_t H, int64_t K, int64_t tv) {
  extern __shared__ float sm[];
  const int64_t seq = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * tv;
  const int64_t KP = K + 1;
  float* S = sm;                    // [K, tv]
  float* vn = S + K * tv;           // [C, tv]
  float* Ws = vn + kC * tv;         // [C, KP]
  float* Qs = Ws + kC * KP;         // [C, KP]
  float* Ks = Qs + kC * KP;         // [C, KP]
  float* As = Ks + kC * KP;         // [C, C]
  float* Us = As + kC * kC;         // [C, tv]
  float* gls = Us + kC * tv;        // [K]
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t i = tid; i < K * tv; i += nt) S[i] = 0.0f;
  const int64_t per = 4 * kC * K + kC * kC + K;
  const int64_t first = ch.seq_first_chunk[seq], count = ch.seq_num_chunks[seq];
  for (int64_t c = first; c < first + count; ++c) {
    const float* U = work + (c * H + h) * per;
    const float* Wk = U + kC * K;
    const float* qg = Wk + kC * K;
    const float* kd = qg + kC * K;
    const float* Aqk = kd + kC * K;
    const float* gl = Aqk + kC * kC;
    const int64_t t0 = ch.chunk_start[c], n = ch.chunk_len[c];
    __syncthreads();  // the previous chunk is done with the staging buffers
    for (int64_t i = tid; i < kC * K; i += nt) {
      const int64_t r = i / K, d = i % K;
      Ws[r * KP + d] = Wk[i];
      Qs[r * KP + d] = qg[i];
      Ks[r * KP + d] = kd[i];
    }
    for (int64_t i = tid; i < kC * kC; i += nt) As[i] = Aqk[i];
    for (int64_t i = tid; i < kC * tv; i += nt) Us[i] = U[(i / tv) * K + c0 + i % tv];
    for (int64_t d = tid; d < K; d += nt) gls[d] = gl[d];
    __syncthreads();
    // v_new = U − Wk·S
    for (int64_t idx = tid; idx < kC * tv; idx += nt) {
      const int64_t i = idx / tv, e = idx % tv;
      float acc = Us[idx];
      const float* w = Ws + i * KP;
      for (int64_t d = 0; d < K; ++d) acc -= w[d] * S[d * tv + e];
      vn[idx] = acc;
    }
    __syncthreads();
    // o = qg·S + Aqk·v_new
    for (int64_t idx = tid; idx < kC * tv; idx += nt) {
      const int64_t i = idx / tv, e = idx % tv;
      if (i >= n) continue;
      float acc = 0.0f;
      const float* qr = Qs + i * KP;
      for (int64_t d = 0; d < K; ++d) acc += qr[d] * S[d * tv + e];
      const float* ar = As + i * kC;
      for (int64_t j = 0; j <= i; ++j) acc += ar[j] * vn[j * tv + e];
      o[((t0 + i) * H + h) * K + c0 + e] = acc;
    }
    __syncthreads();
    // S = e^gl∘S + kdᵀ·v_new
    for (int64_t idx = tid; idx < K * tv; idx += nt) {
      const int64_t d = idx / tv, e = idx % tv;
      float acc = __expf(gls[d]) * S[idx];
      for (int64_t j = 0; j < n; ++j) acc += Ks[j * KP + d] * vn[j * tv + e];
      S[idx] = acc;
    }
  }
}

// One warp per (token, head): RMSNorm over K with weight, times sigmoid(gate), to bf16.
template <class InT>
__global__ void out_norm_kernel(const InT* o, const float* gate, const float* w, bf16* out, int64_t T, int64_t H,
                                int64_t K, float eps) {
  const int64_t warp_id = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_id >= T * H) return;
  const InT* row = o + warp_id * K;
  float ss = 0.0f;
  for (int64_t d = lane; d < K; d += 32) ss += get(row + d) * get(row + d);
  const float r = rsqrtf(warp_sum(ss) / K + eps);
  for (int64_t d = lane; d < K; d += 32) {
    const float gt = gate[warp_id * K + d];
    out[warp_id * K + d] = __float2bfloat16(w[d] * (get(row + d) * r) * (1.0f / (1.0f + expf(-gt))));
  }
}

}  // namespace

// r16: bf16 copies as conv_norm_rows_kernel's q16 (OutT float only); the one-token-a-warp kernel's outputs are
// rounded afterwards instead.
template <class OutT>
void conv_norm(const float* raw, const float* conv, const int32_t* seq_start, OutT* q, OutT* k, OutT* v, int64_t T,
               int64_t H, int64_t K, int64_t W, cudaStream_t st, bf16* const* r16 = nullptr) {
  check(K <= 256, "CUDA KDA: linear_head_dim must be at most 256, got ", K);
  if (T <= 0 || H * K == 0) return;
  if (W == 4) {  // the config's linear_conv_kernel_dim; other tap counts take the one-token-a-warp kernel
    // Blocks of eight warps for runs of R tokens (the kernel strides past 2^20 blocks).
    auto grid = [&](int run) {
      return static_cast<unsigned>(std::min<int64_t>(ceil_div(ceil_div(T, run) * H * 3 * 32, 256), 1 << 20));
    };
    constexpr int R = kda_conv::kRunTokens;
    bf16 *q16 = r16 ? r16[0] : nullptr, *k16 = r16 ? r16[1] : nullptr, *v16 = r16 ? r16[2] : nullptr;
    if (K <= 32)
      conv_norm_rows_kernel<OutT, 4, 1><<<grid(R), 256, 0, st>>>(raw, conv, seq_start, q, k, v, T, H, K, q16, k16,
                                                                  v16);
    else if (K <= 64)
      conv_norm_rows_kernel<OutT, 4, 2><<<grid(R), 256, 0, st>>>(raw, conv, seq_start, q, k, v, T, H, K, q16, k16,
                                                                  v16);
    else if (K <= 128)  // the model's head size: see kLongRun
      conv_norm_rows_kernel<OutT, 4, 4, kLongRun, kLongRunBlocks><<<grid(kLongRun), 256, 0, st>>>(
          raw, conv, seq_start, q, k, v, T, H, K, q16, k16, v16);
    else
      conv_norm_rows_kernel<OutT, 4, 8><<<grid(R), 256, 0, st>>>(raw, conv, seq_start, q, k, v, T, H, K, q16, k16,
                                                                  v16);
    return;
  }
  const int64_t warps = T * H * 3;
  conv_norm_kernel<<<ceil_div(warps * 32, 256), 256, 0, st>>>(raw, conv, seq_start, q, k, v, T, H, K, W);
  if constexpr (std::is_same_v<OutT, float>) {
    if (r16)
      for (int i = 0; i < 3; ++i) round_to_bf16(i == 0 ? q : i == 1 ? k : v, r16[i], T * H * K, st);
  }
}

void kda_conv_norm(const float* raw, const float* conv, const int32_t* seq_start, float* q, float* k, float* v,
                   int64_t T, int64_t H, int64_t K, int64_t W, cudaStream_t st) {
  conv_norm(raw, conv, seq_start, q, k, v, T, H, K, W, st);
}
void kda_conv_norm(const float* raw, const float* conv, const int32_t* seq_start, bf16* q, bf16* k, bf16* v,
                   int64_t T, int64_t H, int64_t K, int64_t W, cudaStream_t st) {
  conv_norm(raw, conv, seq_start, q, k, v, T, H, K, W, st);
}
void kda_conv_norm_rounded(const float* raw, const float* conv, const int32_t* seq_start, float* q, float* k,
                           float* v, bf16* q16, bf16* k16, bf16* v16, int64_t T, int64_t H, int64_t K, int64_t W,
                           cudaStream_t st) {
  bf16* const r16[3] = {q16, k16, v16};
  conv_norm(raw, conv, seq_start, q, k, v, T, H, K, W, st, r16);
}

void kda_gate(const float* f, float* g, const float* dt_bias, const float* A_log, int64_t T, int64_t H, int64_t K,
              bool has_bound, float bound, cudaStream_t st) {
  const int64_t n = T * H * K;
  if (!n) return;
  const bool vec =
      H * K % 4 == 0 && reinterpret_cast<uintptr_t>(f) % 16 == 0 && reinterpret_cast<uintptr_t>(g) % 16 == 0;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(vec ? n / 4 : n, 256), 65535));
  if (vec)
    gate_kernel<true><<<grid, 256, 0, st>>>(f, g, dt_bias, A_log, n, H, K, has_bound, bound);
  else
    gate_kernel<false><<<grid, 256, 0, st>>>(f, g, dt_bias, A_log, n, H, K, has_bound, bound);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}
void kda_gate(float* g, const float* dt_bias, const float* A_log, int64_t T, int64_t H, int64_t K, bool has_bound,
              float bound, cudaStream_t st) {
  kda_gate(g, g, dt_bias, A_log, T, H, K, has_bound, bound, st);
}

int64_t kda_workspace_floats(int64_t num_chunks, int64_t H, int64_t K) {
  return num_chunks * H * (4 * kC * K + kC * kC + K);
}

void kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, float* o,
                 const KdaChunks& ch, float* work, int64_t T, int64_t H, int64_t K, cudaStream_t st) {
  if (!T) return;
  const int64_t tv = K % 32 == 0 ? 32 : K;  // value columns per block of the state pass
  check(K <= 256 && (K % 32 == 0 || K < 32), "CUDA KDA: linear_head_dim must be below 32 or a multiple of 32 up to 256");
  const int64_t KP = K + 1;
  const size_t prep_smem = (3 * kC * KP + kC * (kC + 1) + 2 * kC) * sizeof(float);
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(chunk_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(prep_smem)));
  chunk_prepare_kernel<<<dim3(static_cast<unsigned>(ch.num_chunks), static_cast<unsigned>(H)), 256, prep_smem, st>>>(
      q, k, v, g, beta, ch, work, H, K);
  const size_t state_smem = (K * tv + kC * tv + 3 * kC * KP + kC * kC + kC * tv + K) * sizeof(float);
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(state_smem)));
  chunk_state_kernel<<<dim3(static_cast<unsigned>(ch.num_seqs), static_cast<unsigned>(H),
                            static_cast<unsigned>(K / tv)),
                       256, state_smem, st>>>(work, ch, o, H, K, tv);
}

void kda_out_norm(const float* o, const float* gate, const float* w, bf16* out, int64_t T, int64_t H, int64_t K,
                  float eps, cudaStream_t st) {
  const int64_t warps = T * H;
  if (warps) out_norm_kernel<<<ceil_div(warps * 32, 256), 256, 0, st>>>(o, gate, w, out, T, H, K, eps);
}
void kda_out_norm(const bf16* o, const float* gate, const float* w, bf16* out, int64_t T, int64_t H, int64_t K,
                  float eps, cudaStream_t st) {
  const int64_t warps = T * H;
  if (warps) out_norm_kernel<<<ceil_div(warps * 32, 256), 256, 0, st>>>(o, gate, w, out, T, H, K, eps);
}

}  // namespace nextlm::cuda
