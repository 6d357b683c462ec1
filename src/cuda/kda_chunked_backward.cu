// Backward of the KDA delta rule in the chunked (WY) form on the GPU, fp32 throughout: the chunk-parallel
// counterpart of kda_recurrent_backward (src/cuda/kda_backward.cu) and of the CPU definition in
// src/model/kda_backward.cpp, over chunks of 64 tokens laid out as the forward's plan lays them out (KdaChunks).
//
// Per chunk (rows i < n, S0 the state entering it, Γ the in-chunk cumulative log decay, γ = Γ of its last row):
//   M = strict_lower(k·decay·kᵀ), A = (I + diag(β)·M)⁻¹, U = A·(β v), W = A·(β k∘e^Γ),
//   u = U − W·S0,  o = (q∘e^Γ)·S0 + Aqk·u (Aqk = lower(q·decay·kᵀ)),  S_end = e^γ∘S0 + (k∘e^(γ−Γ))ᵀ·u,
// with decay[i, j, d] = exp(Γ[i, d] − Γ[j, d]) ≤ 1 (j ≤ i): within a 16-row block formed element by element, across
// blocks split at a block boundary r (j < r ≤ i) into exp(Γ_i − Γ_r)·exp(Γ_r − Γ_j), both ≤ 1, so no exponent
// overflows for any g ≤ 0 and the cross-block sums are plain products. The backward, with dSe the gradient of S_end:
//   du = Aqkᵀ·dO + Kd·dSe,  dS0 = Qgᵀ·dO + e^γ∘dSe − Wᵀ·du   (sequential over chunks, value columns apart; the
//                                                             products with dO are formed beforehand, in parallel)
//   dW = −du·S0ᵀ, dQg = dO·S0ᵀ, dKd = u·dSeᵀ, dγ ∋ e^γ∘rowsum(S0∘dSe)  (kernel "inter")
//   dAqk = lower(dO·uᵀ), d(βv) = Aᵀ·du, d(βKg) = Aᵀ·dW, dL = −strict_lower(Aᵀ·dA·Aᵀ) with
//   dA = strict_lower(du·(βv)ᵀ + dW·(βKg)ᵀ), then the products through the decay for dq, dk, dΓ  (kernel "intra")
//   dg = reverse cumsum of dΓ over the chunk's rows, + dγ on every row.
//
// Five kernels: prep (per chunk and head: the factors), fwd_state (per sequence, head and 64 value columns: the
// states entering every chunk and u), bwd_state (the same grid, backward: dSe of every chunk and du), inter and intra
// (per chunk and head). All products are fp32 FMAs on CUDA cores from shared memory, 16×16 threads each owning a
// strided tile of the output; fp32 keeps the result within rounding of the recurrent definition (tensor cores in
// bf16 or tf32 would cost 1e-3 … 1e-2 relative error in the gradients). Every output element is written by one
// thread with sums in a fixed order (no atomics): reproducible run to run. Kernels of one call run in stream order,
// so inter and intra both add into dq, dk and dg without a race.
#include "cuda/backward_kernels.h"

namespace nextlm::cuda {

namespace {

constexpr int kC = 64;        // chunk length (the forward's plan)
constexpr int kCP = kC + 1;   // padded row stride of C×C matrices in shared memory
// Value columns per block of the state passes: 64 gives 4×4 and 8×4 output tiles per thread (fewer shared-memory
// loads per FMA than narrower tiles) and, at H = 64, 128 blocks per sequence, about one per SM of the H200.
template <int K>
constexpr int state_cols() {
  return K < 64 ? K : 64;
}
constexpr int kThreads = 256; // 16×16 threads: the tile layout of mm()

// Per (chunk, head) workspace block, in floats (385 KiB at K = 128). From prep: U, W, Kd = k∘e^(γ−Γ), Γ [C, K];
// A (unit lower), M (strictly lower) [C, C]; γ [K]; and the parts of the state pass that do not depend on the carried
// gradient, Qgᵀ·dO [K, K] in the dh slot and Aqkᵀ·dO [C, K] in the du slot. From fwd_state: h = S0 [K, K] and
// u [C, K]; from bwd_state (over what prep left there): dSe [K, K] and du [C, K]; from inter: dW [C, K]. Rows ≥ n of
// a chunk hold zeros (U, W, u, du) or are unused.
struct Layout {
  int64_t K;
  __host__ __device__ int64_t ck() const { return kC * K; }
  __host__ __device__ int64_t U() const { return 0; }
  __host__ __device__ int64_t W() const { return ck(); }
  __host__ __device__ int64_t Kd() const { return 2 * ck(); }
  __host__ __device__ int64_t G() const { return 3 * ck(); }
  __host__ __device__ int64_t A() const { return 4 * ck(); }
  __host__ __device__ int64_t M() const { return A() + kC * kC; }
  __host__ __device__ int64_t gl() const { return M() + kC * kC; }
  __host__ __device__ int64_t h() const { return gl() + K; }
  __host__ __device__ int64_t dh() const { return h() + K * K; }
  __host__ __device__ int64_t u() const { return dh() + K * K; }
  __host__ __device__ int64_t du() const { return u() + ck(); }
  __host__ __device__ int64_t dW() const { return du() + ck(); }
  __host__ __device__ int64_t per() const { return dW() + ck(); }
};

struct Params {
  const float *q, *k, *v, *g, *beta, *do_;
  KdaChunks ch;
  int64_t H;
  float *dq, *dk, *dv, *dg, *dbeta;
  float* ws;
};

// acc[a][b] += Σ_{k < kc} A(i, k)·B(k, j) for i = ty + 16a, j = tx + 16b (ty = tid / 16, tx = tid % 16), with
// A(i, k) = pa[i·sai + k·sak] and B(k, j) = pb[k·sbk + j·sbj] in shared memory. With odd row strides both operand
// orientations are free of bank conflicts (a warp reads two rows i, sixteen columns j).
template <int TM, int TN>
__device__ __forceinline__ void mm(float (&acc)[TM][TN], const float* pa, int sai, int sak, const float* pb, int sbk,
                                   int sbj, int kc) {
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  pa += ty * sai;
  pb += tx * sbj;
#pragma unroll 4
  for (int k = 0; k < kc; ++k) {
    float av[TM], bv[TN];
#pragma unroll
    for (int a = 0; a < TM; ++a) av[a] = pa[16 * a * sai + k * sak];
#pragma unroll
    for (int b = 0; b < TN; ++b) bv[b] = pb[k * sbk + 16 * b * sbj];
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) acc[a][b] = fmaf(av[a], bv[b], acc[a][b]);
  }
}

template <int TM, int TN>
__device__ __forceinline__ void zero(float (&acc)[TM][TN]) {
#pragma unroll
  for (int a = 0; a < TM; ++a)
#pragma unroll
    for (int b = 0; b < TN; ++b) acc[a][b] = 0.0f;
}

// Sum over the 16 threads tx of one row (a half warp); every lane must call it.
__device__ __forceinline__ float row_sum16(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Asynchronous copies global → shared (cp.async, 4 bytes each so that padded rows need no alignment): a whole
// staging loop is in flight at once, without registers. A thread's copies are complete after cp_async_wait<n>()
// leaves at most n of its committed groups pending (sync_staged: none), and visible to the block after a barrier.
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void sync_staged() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
}

// dst[r·ld + c] = src[r·lds + c] for r < rows, c < cols, asynchronously; rows ≥ valid are zeroed directly.
__device__ __forceinline__ void stage(float* dst, int ld, const float* src, int64_t lds, int rows, int cols,
                                     int valid) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += kThreads) {
    const int r = idx / cols, c = idx - r * cols;
    if (r < valid) {
      cp_async4(dst + r * ld + c, src + r * lds + c);
    } else {
      dst[r * ld + c] = 0.0f;
    }
  }
}

// ---- prep: per (chunk, head), the forward's factors (as kda.cu's chunk_prepare, with A and M kept apart) and the
// state pass's products with dO ----

template <int K>
__global__ void __launch_bounds__(kThreads, 1) prep_kernel(Params p) {
  constexpr int KP = K + 1, TK = K / 16;
  extern __shared__ float sm[];
  float* sg = sm;              // [C, KP] Γ
  float* sk = sg + kC * KP;    // [C, KP] k, then β k∘e^Γ
  float* sq = sk + kC * KP;    // [C, KP] q, then β v
  float* sa = sq + kC * KP;    // [C, CP] A
  float* sqk = sa + kC * kCP;  // [C, CP] Aqk
  float* sb = sqk + kC * kCP;  // [C] β
  float* xs = sb + kC;         // [C + 16, KP] scratch
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.H, HK = H * K;
  const int t0 = p.ch.chunk_start[c], n = p.ch.chunk_len[c];
  const int tid = threadIdx.x;
  const Layout lay{K};
  float* ws = p.ws + (c * H + h) * lay.per();
  const int64_t base = t0 * HK + h * K;
  stage(sg, KP, p.g + base, HK, kC, K, n);
  stage(sk, KP, p.k + base, HK, kC, K, n);
  stage(sq, KP, p.q + base, HK, kC, K, n);
  for (int i = tid; i < kC; i += kThreads) sb[i] = i < n ? p.beta[(t0 + i) * H + h] : 0.0f;
  sync_staged();
  for (int d = tid; d < K; d += kThreads)
    for (int i = 1; i < kC; ++i) sg[i * KP + d] += sg[(i - 1) * KP + d];
  __syncthreads();
  // Aqk[i, j] = Σ_d q_i k_j decay (j ≤ i), M[i, j] = Σ_d k_i k_j decay (j < i); −β_i M into A for the substitution.
  // Zeros first where nothing is computed (j > i, rows ≥ n); then the element-wise factors.
  for (int idx = tid; idx < kC * kC; idx += kThreads) {
    const int i = idx / kC, j = idx - i * kC;
    sqk[i * kCP + j] = 0.0f;
    sa[i * kCP + j] = 0.0f;
    ws[lay.M() + idx] = 0.0f;
  }
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, d = idx - i * K;
    const float gi = sg[i * KP + d], gl = sg[(kC - 1) * KP + d];  // rows ≥ n have g = 0: Γ[C−1] = Γ[n−1]
    ws[lay.Kd() + idx] = sk[i * KP + d] * __expf(gl - gi);
    ws[lay.G() + idx] = gi;
  }
  for (int d = tid; d < K; d += kThreads) ws[lay.gl() + d] = sg[(kC - 1) * KP + d];
  __syncthreads();
  // Pairs within a 16-row block, the decay element by element: 64 threads per block, each a 2×2 tile of pairs.
  {
    const int blk = tid >> 6, ti = (tid >> 3) & 7, tj = tid & 7;
    const int i0 = 16 * blk + 2 * ti, j0 = 16 * blk + 2 * tj;
    if (tj <= ti && i0 < n) {
      float s[2][2] = {}, m[2][2] = {};
#pragma unroll 2
      for (int d = 0; d < K; ++d) {
        const float gi[2] = {sg[i0 * KP + d], sg[(i0 + 1) * KP + d]};
        const float gj[2] = {sg[j0 * KP + d], sg[(j0 + 1) * KP + d]};
        const float ki[2] = {sk[i0 * KP + d], sk[(i0 + 1) * KP + d]};
        const float qi[2] = {sq[i0 * KP + d], sq[(i0 + 1) * KP + d]};
        const float kj[2] = {sk[j0 * KP + d], sk[(j0 + 1) * KP + d]};
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            // min(…, 0) only matters for the pair above the diagonal of a diagonal tile, which is dropped
            const float e = __expf(fminf(gi[a] - gj[b], 0.0f)) * kj[b];
            s[a][b] = fmaf(qi[a], e, s[a][b]);
            m[a][b] = fmaf(ki[a], e, m[a][b]);
          }
      }
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int i = i0 + a, j = j0 + b;
          if (i < n && j <= i) sqk[i * kCP + j] = s[a][b];
          if (i < n && j < i) {
            ws[lay.M() + i * kC + j] = m[a][b];
            sa[i * kCP + j] = -sb[i] * m[a][b];
          }
        }
    }
  }
  // Rows of block ib against the earlier rows j < r = 16·ib, the decay split at r into e^(Γ_i − Γ_r)·e^(Γ_r − Γ_j),
  // both ≤ 1: the scratch holds k_j e^(Γ_r − Γ_j) (rows < r ≤ 48), and q_i, k_i times e^(Γ_i − Γ_r) (rows 48 …
  // 63 and 64 … 79).
#pragma unroll
  for (int ib = 1; ib < 4; ++ib) {
    const int r0 = 16 * ib;
    if (r0 >= n) break;
    __syncthreads();  // the scratch is no longer read
    for (int idx = tid; idx < r0 * K; idx += kThreads) {
      const int j = idx / K, d = idx - j * K;
      xs[j * KP + d] = sk[j * KP + d] * __expf(sg[r0 * KP + d] - sg[j * KP + d]);
    }
    for (int idx = tid; idx < 16 * K; idx += kThreads) {
      const int il = idx / K, d = idx - il * K, i = r0 + il;
      const float e = __expf(sg[i * KP + d] - sg[r0 * KP + d]);
      xs[(48 + il) * KP + d] = sq[i * KP + d] * e;
      xs[(64 + il) * KP + d] = sk[i * KP + d] * e;
    }
    __syncthreads();
    const int ty = tid >> 4, tx = tid & 15, i = r0 + ty;
    float s[3] = {}, m[3] = {};
#pragma unroll 2
    for (int d = 0; d < K; ++d) {
      const float qe = xs[(48 + ty) * KP + d], ke = xs[(64 + ty) * KP + d];
#pragma unroll
      for (int jb = 0; jb < 3; ++jb)
        if (jb < ib) {
          const float kr = xs[(tx + 16 * jb) * KP + d];
          s[jb] = fmaf(qe, kr, s[jb]);
          m[jb] = fmaf(ke, kr, m[jb]);
        }
    }
    if (i < n) {
#pragma unroll
      for (int jb = 0; jb < 3; ++jb)
        if (jb < ib) {
          const int j = tx + 16 * jb;
          sqk[i * kCP + j] = s[jb];
          ws[lay.M() + i * kC + j] = m[jb];
          sa[i * kCP + j] = -sb[i] * m[jb];
        }
    }
  }
  __syncthreads();
  // A = (I + L)⁻¹ from A0 = −L (strictly lower) in blocks of 16: first each diagonal block by forward substitution
  // within one warp (row i: A[i, j] = A0[i, j] + Σ_{j<m<i} A0[i, m]·A[m, j], lane j, row i of A0 broadcast by
  // shuffles), then the block rows in order: A[ib, jb] = A[ib, ib]·Σ_{jb≤kb<ib} A0[ib, kb]·A[kb, jb]. Rows ≥ n are
  // zero off the diagonal and stay so.
  if (tid < 4 * 32) {
    const int lane = tid & 31, r0 = 16 * (tid >> 5);
    for (int il = 2; il < 16; ++il) {
      const int i = r0 + il;
      const float a0 = lane < 16 ? sa[i * kCP + r0 + lane] : 0.0f;
      float acc = a0;
      for (int m = 1; m < il; ++m) {
        const float am = __shfl_sync(0xffffffffu, a0, m);
        if (lane < m) acc = fmaf(am, sa[(r0 + m) * kCP + r0 + lane], acc);
      }
      __syncwarp();
      if (lane < il) sa[i * kCP + r0 + lane] = acc;
      __syncwarp();
    }
  }
  for (int i = tid; i < kC; i += kThreads) sa[i * kCP + i] = 1.0f;
  __syncthreads();
#pragma unroll
  for (int ib = 1; ib < 4; ++ib) {
    if (16 * ib >= n) break;
    for (int idx = tid; idx < ib * 256; idx += kThreads) {  // xs[jb][il][jl] = Σ_kb A0[ib, kb]·A[kb, jb]
      const int jb = idx >> 8, il = (idx >> 4) & 15, jl = idx & 15;
      const float* ar = sa + (16 * ib + il) * kCP;
      float acc = 0.0f;
      for (int m = 16 * jb; m < 16 * ib; ++m) acc = fmaf(ar[m], sa[m * kCP + 16 * jb + jl], acc);
      xs[idx] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < ib * 256; idx += kThreads) {
      const int jb = idx >> 8, il = (idx >> 4) & 15, jl = idx & 15;
      const float* br = sa + (16 * ib + il) * kCP + 16 * ib;
      float acc = 0.0f;
      for (int ml = 0; ml <= il; ++ml) acc = fmaf(br[ml], xs[(jb << 8) + (ml << 4) + jl], acc);
      sa[(16 * ib + il) * kCP + 16 * jb + jl] = acc;
    }
    __syncthreads();
  }
  // β v and β k∘e^Γ in place of q and k (each thread rewrites what it reads).
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, d = idx - i * K;
    sq[i * KP + d] = i < n ? sb[i] * p.v[base + int64_t(i) * HK + d] : 0.0f;
    sk[i * KP + d] *= sb[i] * __expf(sg[i * KP + d]);
  }
  __syncthreads();
  for (int idx = tid; idx < kC * kC; idx += kThreads) ws[lay.A() + idx] = sa[(idx / kC) * kCP + idx % kC];
  const int ty = tid >> 4, tx = tid & 15;
  {
    float acc[4][TK];
    zero(acc);
    mm(acc, sa, kCP, 1, sq, KP, 1, kC);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) ws[lay.U() + (ty + 16 * a) * K + tx + 16 * b] = acc[a][b];
  }
  {
    float acc[4][TK];
    zero(acc);
    mm(acc, sa, kCP, 1, sk, KP, 1, kC);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) ws[lay.W() + (ty + 16 * a) * K + tx + 16 * b] = acc[a][b];
  }
  // Qgᵀ·dO and Aqkᵀ·dO, with Qg in place of β v and dO in place of β Kg.
  __syncthreads();
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, d = idx - i * K;
    sq[i * KP + d] = i < n ? p.q[base + int64_t(i) * HK + d] * __expf(sg[i * KP + d]) : 0.0f;
  }
  stage(sk, KP, p.do_ + base, HK, kC, K, n);
  sync_staged();
  {
    float acc[TK][TK];
    zero(acc);
    mm(acc, sq, 1, KP, sk, KP, 1, n);
#pragma unroll
    for (int a = 0; a < TK; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) ws[lay.dh() + (ty + 16 * a) * K + tx + 16 * b] = acc[a][b];
  }
  {
    float acc[4][TK];
    zero(acc);
    mm(acc, sqk, 1, kCP, sk, KP, 1, n);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) ws[lay.du() + (ty + 16 * a) * K + tx + 16 * b] = acc[a][b];
  }
}

// ---- fwd_state: per (sequence, head, TV value columns), the states entering the chunks, and u = U − W·S ----
// W of the next chunk is copied in while this chunk's state update runs, Kd while the next chunk's u runs: one
// cp.async group per matrix, W's always the older of the two pending.

template <int K>
__global__ void __launch_bounds__(kThreads, 1) fwd_state_kernel(Params p) {
  constexpr int KP = K + 1, TK = K / 16, TV = state_cols<K>(), TN = TV / 16, TP = TV + 1;
  extern __shared__ float sm[];
  float* sS = sm;               // [K, TP] the state's columns c0 …
  float* su = sS + K * TP;      // [C, TP]
  float* sw = su + kC * TP;     // [C, KP] W
  float* skd = sw + kC * KP;    // [C, KP] Kd
  const int64_t seq = blockIdx.x, h = blockIdx.y, H = p.H;
  const int c0 = blockIdx.z * TV;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const Layout lay{K};
  const int64_t first = p.ch.seq_first_chunk[seq], count = p.ch.seq_num_chunks[seq];
  if (count <= 0) return;  // the whole block leaves
  for (int i = tid; i < K * TP; i += kThreads) sS[i] = 0.0f;
  auto chunk_ws = [&](int64_t c) { return p.ws + (c * H + h) * lay.per(); };
  stage(sw, KP, chunk_ws(first) + lay.W(), K, kC, K, kC);
  cp_async_commit();
  stage(skd, KP, chunk_ws(first) + lay.Kd(), K, kC, K, kC);
  cp_async_commit();
  for (int64_t c = first; c < first + count; ++c) {
    float* ws = chunk_ws(c);
    const int n = p.ch.chunk_len[c];
    float U[4][TN], eg[TK];  // loaded ahead of the products, which hide their latency
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) U[a][b] = ws[lay.U() + (ty + 16 * a) * K + c0 + tx + 16 * b];
#pragma unroll
    for (int a = 0; a < TK; ++a) eg[a] = __expf(ws[lay.gl() + ty + 16 * a]);
    cp_async_wait<1>();  // W of this chunk
    __syncthreads();     // … and everyone's copies of it; the previous state update is complete
    for (int idx = tid; idx < K * TV; idx += kThreads) {
      const int d = idx / TV, j = idx - d * TV;
      ws[lay.h() + d * K + c0 + j] = sS[d * TP + j];
    }
    {
      float acc[4][TN];
      zero(acc);
      mm(acc, sw, KP, 1, sS, TP, 1, K);
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < TN; ++b) {
          const int i = ty + 16 * a, j = tx + 16 * b;
          const float u = U[a][b] - acc[a][b];
          su[i * TP + j] = u;
          ws[lay.u() + i * K + c0 + j] = u;
        }
    }
    cp_async_wait<0>();  // Kd of this chunk
    __syncthreads();     // u complete, W no longer read
    if (c + 1 < first + count) stage(sw, KP, chunk_ws(c + 1) + lay.W(), K, kC, K, kC);
    cp_async_commit();
    {
      float acc[TK][TN];
      zero(acc);
      mm(acc, skd, 1, KP, su, TP, 1, n);
#pragma unroll
      for (int a = 0; a < TK; ++a)
#pragma unroll
        for (int b = 0; b < TN; ++b) {
          const int d = ty + 16 * a, j = tx + 16 * b;
          sS[d * TP + j] = fmaf(eg[a], sS[d * TP + j], acc[a][b]);
        }
    }
    __syncthreads();  // Kd and u no longer read
    if (c + 1 < first + count) stage(skd, KP, chunk_ws(c + 1) + lay.Kd(), K, kC, K, kC);
    cp_async_commit();
  }
}

// ---- bwd_state: per (sequence, head, TV value columns), backward over the chunks carrying dS ----
// The same pipeline as fwd_state, backward: Kd of the previous chunk is copied in while this chunk's dS runs, W
// while the previous chunk's du runs.

template <int K>
__global__ void __launch_bounds__(kThreads, 1) bwd_state_kernel(Params p) {
  constexpr int KP = K + 1, TK = K / 16, TV = state_cols<K>(), TN = TV / 16, TP = TV + 1;
  extern __shared__ float sm[];
  float* sdS = sm;              // [K, TP] the gradient of the state leaving the chunk
  float* sdu = sdS + K * TP;    // [C, TP]
  float* skd = sdu + kC * TP;   // [C, KP] Kd
  float* sw = skd + kC * KP;    // [C, KP] W
  const int64_t seq = blockIdx.x, h = blockIdx.y, H = p.H;
  const int c0 = blockIdx.z * TV;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const Layout lay{K};
  const int64_t first = p.ch.seq_first_chunk[seq], count = p.ch.seq_num_chunks[seq];
  if (count <= 0) return;  // the whole block leaves
  for (int i = tid; i < K * TP; i += kThreads) sdS[i] = 0.0f;
  auto chunk_ws = [&](int64_t c) { return p.ws + (c * H + h) * lay.per(); };
  const int64_t last = first + count - 1;
  stage(skd, KP, chunk_ws(last) + lay.Kd(), K, kC, K, kC);
  cp_async_commit();
  stage(sw, KP, chunk_ws(last) + lay.W(), K, kC, K, kC);
  cp_async_commit();
  for (int64_t c = last; c >= first; --c) {
    float* ws = chunk_ws(c);
    const int n = p.ch.chunk_len[c];
    float du0[4][TN], eg[TK];  // Aqkᵀ·dO from prep (in the du slot) and e^γ, loaded ahead of the products
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) du0[a][b] = ws[lay.du() + (ty + 16 * a) * K + c0 + tx + 16 * b];
#pragma unroll
    for (int a = 0; a < TK; ++a) eg[a] = __expf(ws[lay.gl() + ty + 16 * a]);
    cp_async_wait<1>();  // Kd of this chunk
    __syncthreads();     // … and everyone's copies of it; the previous dS update is complete
    {  // du = Aqkᵀ·dO + Kd·dSe
      float acc[4][TN];
      zero(acc);
      mm(acc, skd, KP, 1, sdS, TP, 1, K);
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < TN; ++b) {
          const int i = ty + 16 * a, j = tx + 16 * b;
          const float du = du0[a][b] + acc[a][b];
          sdu[i * TP + j] = du;
          ws[lay.du() + i * K + c0 + j] = du;
        }
    }
    float p0[TK][TN];  // Qgᵀ·dO from prep (in the dh slot)
#pragma unroll
    for (int a = 0; a < TK; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) p0[a][b] = ws[lay.dh() + (ty + 16 * a) * K + c0 + tx + 16 * b];
    cp_async_wait<0>();  // W of this chunk
    __syncthreads();     // du complete, Kd and dS no longer read
    if (c > first) stage(skd, KP, chunk_ws(c - 1) + lay.Kd(), K, kC, K, kC);
    cp_async_commit();
    {  // dS0 = Qgᵀ·dO + e^γ∘dSe − Wᵀ·du; dSe takes the dh slot. Each thread reads and rewrites only its own
       // elements of dS and of the slot.
      float acc[TK][TN];
      zero(acc);
      mm(acc, sw, 1, KP, sdu, TP, 1, n);
#pragma unroll
      for (int a = 0; a < TK; ++a)
#pragma unroll
        for (int b = 0; b < TN; ++b) {
          const int d = ty + 16 * a, j = tx + 16 * b;
          const float dse = sdS[d * TP + j];
          ws[lay.dh() + d * K + c0 + j] = dse;
          sdS[d * TP + j] = fmaf(eg[a], dse, p0[a][b]) - acc[a][b];
        }
    }
    __syncthreads();  // W and du no longer read
    if (c > first) stage(sw, KP, chunk_ws(c - 1) + lay.W(), K, kC, K, kC);
    cp_async_commit();
  }
}

// ---- inter: per (chunk, head), the products with S0 and dSe (contractions over the value dim) ----

template <int K>
__global__ void __launch_bounds__(kThreads, 2) inter_kernel(Params p) {
  constexpr int KP = K + 1, TK = K / 16;
  extern __shared__ float sm[];
  float* ss = sm;               // [K, KP] S0, then dSe
  float* sx = ss + K * KP;      // [C, KP] du, dO, u, then dΓ
  float* sdir = sx + kC * KP;   // [K] rowsum(S0∘dSe)
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.H, HK = H * K;
  const int t0 = p.ch.chunk_start[c], n = p.ch.chunk_len[c];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15, lane = tid & 31, warp = tid >> 5;
  const Layout lay{K};
  const float* ws = p.ws + (c * H + h) * lay.per();
  float* dW = p.ws + (c * H + h) * lay.per() + lay.dW();
  const int64_t base = t0 * HK + h * K;
  float dG[4][TK];  // dΓ of this thread's elements
  float colp[TK];   // Σ over its rows of dKd∘Kd (for dγ)

  // rowsum(S0∘dSe) from global memory, a warp per row.
  for (int d = warp; d < K; d += kThreads / 32) {
    float s = 0.0f;
    for (int v = lane; v < K; v += 32) s = fmaf(ws[lay.h() + d * K + v], ws[lay.dh() + d * K + v], s);
    s = warp_sum(s);
    if (lane == 0) sdir[d] = s;
  }
  stage(ss, KP, ws + lay.h(), K, K, K, K);
  stage(sx, KP, ws + lay.du(), K, kC, K, kC);
  sync_staged();
  {  // dW = −du·S0ᵀ
    float acc[4][TK];
    zero(acc);
    mm(acc, sx, KP, 1, ss, 1, KP, K);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) dW[(ty + 16 * a) * K + tx + 16 * b] = -acc[a][b];
  }
  __syncthreads();
  stage(sx, KP, p.do_ + base, HK, kC, K, n);
  sync_staged();
  {  // dQg = dO·S0ᵀ: dq += dQg∘e^Γ, dΓ += dQg∘Qg
    float acc[4][TK];
    zero(acc);
    mm(acc, sx, KP, 1, ss, 1, KP, K);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int i = ty + 16 * a, d = tx + 16 * b;
        dG[a][b] = 0.0f;
        if (i < n) {
          const int64_t e = base + int64_t(i) * HK + d;
          const float dqg = acc[a][b] * __expf(ws[lay.G() + i * K + d]);
          p.dq[e] += dqg;
          dG[a][b] = dqg * p.q[e];
        }
      }
  }
  __syncthreads();
  stage(ss, KP, ws + lay.dh(), K, K, K, K);
  stage(sx, KP, ws + lay.u(), K, kC, K, kC);
  sync_staged();
  {  // dKd = u·dSeᵀ: dk += dKd∘e^(γ−Γ), dΓ −= dKd∘Kd, dγ += Σ_i dKd∘Kd
    float acc[4][TK];
    zero(acc);
    mm(acc, sx, KP, 1, ss, 1, KP, K);
#pragma unroll
    for (int b = 0; b < TK; ++b) colp[b] = 0.0f;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int i = ty + 16 * a, d = tx + 16 * b;
        if (i < n) {
          const int64_t e = base + int64_t(i) * HK + d;
          const float kd = ws[lay.Kd() + i * K + d];
          p.dk[e] += acc[a][b] * __expf(ws[lay.gl() + d] - ws[lay.G() + i * K + d]);
          dG[a][b] -= acc[a][b] * kd;
          colp[b] = fmaf(acc[a][b], kd, colp[b]);
        }
      }
  }
  __syncthreads();
  // Partial column sums by ty into ss, dΓ into sx; then per column d: dγ and the reverse cumsum over the rows.
#pragma unroll
  for (int b = 0; b < TK; ++b) ss[ty * K + tx + 16 * b] = colp[b];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < TK; ++b) sx[(ty + 16 * a) * KP + tx + 16 * b] = dG[a][b];
  __syncthreads();
  for (int d = tid; d < K; d += kThreads) {
    float dgam = 0.0f;
    for (int y = 0; y < 16; ++y) dgam += ss[y * K + d];
    dgam = fmaf(__expf(ws[lay.gl() + d]), sdir[d], dgam);
    float run = 0.0f;
    for (int i = n - 1; i >= 0; --i) {
      run += sx[i * KP + d];
      p.dg[base + int64_t(i) * HK + d] += run + dgam;
    }
  }
}

// ---- intra: per (chunk, head), the WY factors' and the intra-chunk products' gradients ----

template <int K>
__global__ void __launch_bounds__(kThreads, 1) intra_kernel(Params p) {
  constexpr int KP = K + 1, TK = K / 16;
  extern __shared__ float sm[];
  float* x1 = sm;               // [C, KP] dO, du, q, dΓ
  float* x2 = x1 + kC * KP;     // [C, KP] u, β v, β Kg, k
  float* x3 = x2 + kC * KP;     // [C, KP] dW, Γ
  float* pa = x3 + kC * KP;     // [C, CP] A
  float* pm = pa + kC * kCP;    // [C, CP] M
  float* pp = pm + kC * kCP;    // [C, CP] dAqk
  float* pg = pp + kC * kCP;    // [C, CP] strict_lower(dA), then dM
  float* pt = pg + kC * kCP;    // [C, CP] Aᵀ·dA
  float* sb = pt + kC * kCP;    // [C] β
  float* sdb = sb + kC;         // [C] dβ
  float* xs2 = sdb + kC;        // [C, KP] scratch
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.H, HK = H * K;
  const int t0 = p.ch.chunk_start[c], n = p.ch.chunk_len[c];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const Layout lay{K};
  const float* ws = p.ws + (c * H + h) * lay.per();
  const int64_t base = t0 * HK + h * K;
  float dk[4][TK], dG[4][TK];  // this thread's elements of dk and dΓ

  stage(x1, KP, p.do_ + base, HK, kC, K, n);
  stage(x2, KP, ws + lay.u(), K, kC, K, kC);
  stage(pa, kCP, ws + lay.A(), kC, kC, kC, kC);
  stage(pm, kCP, ws + lay.M(), kC, kC, kC, kC);
  for (int i = tid; i < kC; i += kThreads) {
    sb[i] = i < n ? p.beta[(t0 + i) * H + h] : 0.0f;
    sdb[i] = 0.0f;
  }
  sync_staged();
  {  // dAqk = lower(dO·uᵀ)
    float acc[4][4];
    zero(acc);
    mm(acc, x1, KP, 1, x2, 1, KP, K);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int i = ty + 16 * a, j = tx + 16 * b;
        pp[i * kCP + j] = j <= i ? acc[a][b] : 0.0f;
      }
  }
  __syncthreads();
  stage(x1, KP, ws + lay.du(), K, kC, K, kC);
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, d = idx - i * K;
    x2[i * KP + d] = i < n ? sb[i] * p.v[base + int64_t(i) * HK + d] : 0.0f;
  }
  stage(x3, KP, ws + lay.dW(), K, kC, K, kC);
  sync_staged();
  {  // d(βv) = Aᵀ·du: dv += β·d(βv), dβ += rowsum(v∘d(βv))
    float acc[4][TK];
    zero(acc);
    mm(acc, pa, 1, kCP, x1, KP, 1, kC);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = ty + 16 * a;
      float r = 0.0f;
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int d = tx + 16 * b;
        if (i < n) {
          const int64_t e = base + int64_t(i) * HK + d;
          p.dv[e] += sb[i] * acc[a][b];
          r = fmaf(p.v[e], acc[a][b], r);
        }
      }
      r = row_sum16(r);
      if (tx == 0) sdb[i] += r;
    }
  }
  {  // d(βKg) = Aᵀ·dW: dKg = β·d(βKg); dk += dKg∘e^Γ, dΓ += dKg∘Kg, dβ += rowsum(Kg∘d(βKg))
    float acc[4][TK];
    zero(acc);
    mm(acc, pa, 1, kCP, x3, KP, 1, kC);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = ty + 16 * a;
      float r = 0.0f;
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int d = tx + 16 * b;
        dk[a][b] = 0.0f;
        dG[a][b] = 0.0f;
        if (i < n) {
          const float eg = __expf(ws[lay.G() + i * K + d]);
          const float kg = p.k[base + int64_t(i) * HK + d] * eg;
          const float dkg = sb[i] * acc[a][b];
          dk[a][b] = dkg * eg;
          dG[a][b] = dkg * kg;
          r = fmaf(kg, acc[a][b], r);
        }
      }
      r = row_sum16(r);
      if (tx == 0) sdb[i] += r;
    }
  }
  float accA[4][4];  // dA = du·(βv)ᵀ + dW·(βKg)ᵀ
  zero(accA);
  mm(accA, x1, KP, 1, x2, 1, KP, K);
  __syncthreads();
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, d = idx - i * K;
    x2[i * KP + d] =
        i < n ? sb[i] * p.k[base + int64_t(i) * HK + d] * __expf(ws[lay.G() + i * K + d]) : 0.0f;
  }
  __syncthreads();
  mm(accA, x3, KP, 1, x2, 1, KP, K);
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int i = ty + 16 * a, j = tx + 16 * b;
      pg[i * kCP + j] = j < i ? accA[a][b] : 0.0f;
    }
  __syncthreads();
  {  // Aᵀ·dA
    float acc[4][4];
    zero(acc);
    mm(acc, pa, 1, kCP, pg, kCP, 1, kC);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) pt[(ty + 16 * a) * kCP + tx + 16 * b] = acc[a][b];
  }
  __syncthreads();
  {  // dL = −strict_lower(Aᵀ·dA·Aᵀ); dβ += rowsum(dL∘M), dM = β·dL (into pg: dA is no longer read)
    float acc[4][4];
    zero(acc);
    mm(acc, pt, kCP, 1, pa, 1, kCP, kC);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = ty + 16 * a;
      float r = 0.0f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int j = tx + 16 * b;
        const float dl = j < i ? -acc[a][b] : 0.0f;
        r = fmaf(dl, pm[i * kCP + j], r);
        pg[i * kCP + j] = sb[i] * dl;
      }
      r = row_sum16(r);
      if (tx == 0) sdb[i] += r;
    }
  }
  stage(x1, KP, p.q + base, HK, kC, K, n);
  stage(x2, KP, p.k + base, HK, kC, K, n);
  stage(x3, KP, ws + lay.G(), K, kC, K, kC);
  sync_staged();
  // Through Aqk and M with the decay e^(Γ_i − Γ_j), j ≤ i:
  //   X_i = Σ_j dAqk[i,j] k_j e, Y_i = Σ_j dM[i,j] k_j e, Z_j = Σ_i (dAqk[i,j] q_i + dM[i,j] k_i) e;
  //   dq_i += X_i, dk_i += Y_i, dk_j += Z_j, dΓ_i += q_i X_i + k_i Y_i, dΓ_j −= k_j Z_j.
  // Pairs within one 16-row block take the decay element by element. Pairs across blocks split it at a block
  // boundary (j < r ≤ i) into e^(Γ_i − Γ_r)·e^(Γ_r − Γ_j), both ≤ 1, so that their sums become products with a
  // rescaled k (or q, k) shared by all the rows of a block, formed once in a scratch buffer.
  float* xs = pa;  // [C, KP] scratch over A and M (contiguous, no longer read)
  static_assert(2 * kCP >= KP, "A and M together hold a [C, KP] scratch");
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = ty + 16 * a;
    if (i < n) {
      float gi[TK], X[TK], Y[TK], Z[TK];
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        gi[b] = x3[i * KP + tx + 16 * b];
        X[b] = Y[b] = Z[b] = 0.0f;
      }
      for (int j = 16 * a; j <= i; ++j) {
        const float pj = pp[i * kCP + j], qj = pg[i * kCP + j];
#pragma unroll
        for (int b = 0; b < TK; ++b) {
          const int d = tx + 16 * b;
          const float kj = x2[j * KP + d] * __expf(gi[b] - x3[j * KP + d]);
          X[b] = fmaf(pj, kj, X[b]);
          Y[b] = fmaf(qj, kj, Y[b]);
        }
      }
      const int rend = min(16 * a + 16, n);
      for (int r = i; r < rend; ++r) {
        const float pr = pp[r * kCP + i], qr = pg[r * kCP + i];
#pragma unroll
        for (int b = 0; b < TK; ++b) {
          const int d = tx + 16 * b;
          const float e = __expf(x3[r * KP + d] - gi[b]);
          Z[b] = fmaf(fmaf(pr, x1[r * KP + d], qr * x2[r * KP + d]), e, Z[b]);
        }
      }
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int d = tx + 16 * b;
        p.dq[base + int64_t(i) * HK + d] += X[b];
        dk[a][b] += Y[b] + Z[b];
        dG[a][b] += x1[i * KP + d] * X[b] + x2[i * KP + d] * (Y[b] - Z[b]);
      }
    }
  }
  // Rows of block bi against the earlier rows j < r = 16·bi: the scratch holds k_j e^(Γ_r − Γ_j).
#pragma unroll
  for (int bi = 1; bi < 4; ++bi) {
    const int r0 = 16 * bi;
    if (r0 >= n) break;
    __syncthreads();  // the scratch is no longer read
    for (int idx = tid; idx < r0 * K; idx += kThreads) {
      const int j = idx / K, d = idx - j * K;
      xs[j * KP + d] = x2[j * KP + d] * __expf(x3[r0 * KP + d] - x3[j * KP + d]);
    }
    __syncthreads();
    const int i = r0 + ty;
    float X[TK], Y[TK];
#pragma unroll
    for (int b = 0; b < TK; ++b) X[b] = Y[b] = 0.0f;
    for (int j = 0; j < r0; ++j) {
      const float pj = pp[i * kCP + j], qj = pg[i * kCP + j];
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const float kv = xs[j * KP + tx + 16 * b];
        X[b] = fmaf(pj, kv, X[b]);
        Y[b] = fmaf(qj, kv, Y[b]);
      }
    }
    if (i < n) {
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int d = tx + 16 * b;
        const float e = __expf(x3[i * KP + d] - x3[r0 * KP + d]);
        p.dq[base + int64_t(i) * HK + d] += X[b] * e;
        dk[bi][b] = fmaf(Y[b], e, dk[bi][b]);
        dG[bi][b] += (x1[i * KP + d] * X[b] + x2[i * KP + d] * Y[b]) * e;
      }
    }
  }
  // Rows of block bj against the later rows r > s = 16·bj + 15: the scratches hold q_r and k_r times e^(Γ_r − Γ_s).
#pragma unroll
  for (int bj = 0; bj < 3; ++bj) {
    const int s0 = 16 * bj + 15;
    if (s0 + 1 >= n) break;
    __syncthreads();  // the scratches are no longer read
    for (int idx = tid; idx < (n - s0 - 1) * K; idx += kThreads) {
      const int r = s0 + 1 + idx / K, d = idx % K;
      const float e = __expf(x3[r * KP + d] - x3[s0 * KP + d]);
      xs[r * KP + d] = x1[r * KP + d] * e;
      xs2[r * KP + d] = x2[r * KP + d] * e;
    }
    __syncthreads();
    const int i = 16 * bj + ty;  // ≤ s0 < n
    float Z[TK];
#pragma unroll
    for (int b = 0; b < TK; ++b) Z[b] = 0.0f;
    for (int r = s0 + 1; r < n; ++r) {
      const float pr = pp[r * kCP + i], qr = pg[r * kCP + i];
#pragma unroll
      for (int b = 0; b < TK; ++b) {
        const int d = tx + 16 * b;
        Z[b] = fmaf(pr, xs[r * KP + d], fmaf(qr, xs2[r * KP + d], Z[b]));
      }
    }
#pragma unroll
    for (int b = 0; b < TK; ++b) {
      const int d = tx + 16 * b;
      const float z = Z[b] * __expf(x3[s0 * KP + d] - x3[i * KP + d]);
      dk[bj][b] += z;
      dG[bj][b] -= x2[i * KP + d] * z;
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < TK; ++b) {
      const int i = ty + 16 * a;
      if (i < n) p.dk[base + int64_t(i) * HK + tx + 16 * b] += dk[a][b];
    }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < TK; ++b) x1[(ty + 16 * a) * KP + tx + 16 * b] = dG[a][b];
  __syncthreads();
  for (int d = tid; d < K; d += kThreads) {
    float run = 0.0f;
    for (int i = n - 1; i >= 0; --i) {
      run += x1[i * KP + d];
      p.dg[base + int64_t(i) * HK + d] += run;
    }
  }
  for (int i = tid; i < n; i += kThreads) p.dbeta[(t0 + i) * H + h] += sdb[i];
}

template <class Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int K>
void launch(const Params& p, cudaStream_t st) {
  constexpr int KP = K + 1;
  const auto nc = static_cast<unsigned>(p.ch.num_chunks), ns = static_cast<unsigned>(p.ch.num_seqs);
  const auto H = static_cast<unsigned>(p.H);
  constexpr int TP = state_cols<K>() + 1;
  const dim3 per_chunk(nc, H), per_seq(ns, H, K / state_cols<K>());
  const size_t prep = (3 * kC * KP + 2 * kC * kCP + kC + (kC + 16) * KP) * sizeof(float);
  const size_t fwd = (K * TP + kC * TP + 2 * kC * KP) * sizeof(float);
  const size_t bwd = fwd;
  const size_t inter = (K * KP + kC * KP + K) * sizeof(float);
  const size_t intra = (4 * kC * KP + 5 * kC * kCP + 2 * kC) * sizeof(float);
  set_smem(prep_kernel<K>, prep);
  set_smem(fwd_state_kernel<K>, fwd);
  set_smem(bwd_state_kernel<K>, bwd);
  set_smem(inter_kernel<K>, inter);
  set_smem(intra_kernel<K>, intra);
  prep_kernel<K><<<per_chunk, kThreads, prep, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (ns > 0) {
    fwd_state_kernel<K><<<per_seq, kThreads, fwd, st>>>(p);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    bwd_state_kernel<K><<<per_seq, kThreads, bwd, st>>>(p);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  inter_kernel<K><<<per_chunk, kThreads, inter, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  intra_kernel<K><<<per_chunk, kThreads, intra, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t kda_chunked_backward_workspace_bytes(int64_t num_chunks, int64_t T, int64_t H, int64_t K) {
  if (T <= 0 || num_chunks <= 0 || H <= 0 || K <= 0) return 0;
  return static_cast<size_t>(num_chunks * H * Layout{K}.per()) * sizeof(float);
}

void kda_chunked_backward(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          const float* do_, const KdaChunks& ch, int64_t T, int64_t H, int64_t K, float* dq,
                          float* dk, float* dv, float* dg, float* dbeta, void* work, cudaStream_t st) {
  if (T <= 0 || H <= 0 || K <= 0 || ch.num_chunks <= 0) return;
  check(K == 32 || K == 64 || K == 128, "kda_chunked_backward: K must be 32, 64 or 128, got ", K);
  check(ch.num_chunks <= 0x7fffffff && ch.num_seqs <= 0x7fffffff && H <= 65535,
        "kda_chunked_backward: grid too large");
  const Params p{q, k, v, g, beta, do_, ch, H, dq, dk, dv, dg, dbeta, static_cast<float*>(work)};
  switch (K) {
    case 32: launch<32>(p, st); break;
    case 64: launch<64>(p, st); break;
    default: launch<128>(p, st); break;
  }
}

}  // namespace nextlm::cuda
