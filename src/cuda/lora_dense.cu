// Dense LoRA products (see lora_dense.h), mma.sync m16n8k16 bf16 → fp32 kernels streaming X [T, Q] through
// cp.async stages of kBand rows × kBC columns:
//   skinny_kernel  a block per (column tile, chunk of rows): the column side (D = Xᵀ·P) and optionally the row side
//                  with W = B (G = X·B, the backward's pass over dy)
//   factor_kernel  a block per (group of column tiles, kBand rows): the row side alone with W = A (u = x·Aᵀ), the
//                  group's tiles one after another into the same sums, so that few partial sums are left
// and two small kernels that add up the partial sums in a fixed order.
#include "cuda/lora_dense.h"

#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kThreads = 256;  // eight warps
constexpr int kBC = 256;       // X columns a block covers
constexpr int kBand = 128;     // X rows a stage holds
constexpr int kStages = 2;
constexpr int kLdX = kBC + 8;  // padded rows: the 8 rows of an ldmatrix phase fall in distinct bank groups
// Blocks the split aims at (about one an SM of an H100 or H200: a block takes most of an SM's shared memory). A
// constant, not the device's count, so that the split and with it the bits do not depend on the card.
constexpr int kTargetBlocks = 132;


struct Args {
  const bf16* X;
  int64_t ldx;
  const bf16* P;  // column side: [T, r], row stride ldp
  int64_t ldp;
  const bf16* W;  // row side: B [Q, r] (skinny_kernel) or A [r, Q] (factor_kernel)
  int r, Q, T;
  int chunk;        // rows of a row chunk, a multiple of kBand
  float* D;         // column side, written directly when one chunk covers T: [Q, r] or (d_jmajor) [r, Q]
  bool d_jmajor, accumulate;
  float* dpart;     // else [chunks][D's layout] partial sums
  float* g32;       // row side, written directly when one tile covers Q: fp32 [T, ldg]
  bf16* g16;        // or bf16(scale · G)
  int64_t ldg;
  float scale;
  float* gpart;     // else [tiles][T, r] partial sums
};

__device__ __forceinline__ int64_t d_index(const Args& a, int q, int j) {
  return a.d_jmajor ? int64_t(j) * a.Q + q : int64_t(q) * a.r + j;
}

// One block per (column tile blockIdx.x, row chunk blockIdx.y). Column side: warp w owns the tile's columns
// 32w … 32w + 31 and sums over the chunk's rows, stage after stage in order, in registers. Row side (kG, W = B):
// warp w owns the stage's rows 16w … 16w + 15 and sums over the tile's kBC columns; that partial (or with one tile
// the whole sum) is written after each stage. B's rows for the tile are staged once, with the first stage. Rows past
// the chunk, columns past Q and rank columns past r zero-fill.
template <int RP, bool kG>
__global__ void __launch_bounds__(kThreads, 1) skinny_kernel(Args a) {
  constexpr int LDP = RP + 8, NT = RP / 8;
  constexpr int STAGE = kBand * kLdX + kBand * LDP;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  bf16* ws = smem + kStages * STAGE;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int c0 = blockIdx.x * kBC;
  const int r0 = blockIdx.y * a.chunk, r1 = min(r0 + a.chunk, a.T);
  const int NB = (r1 - r0 + kBand - 1) / kBand;

  if constexpr (kG) {  // B's rows c0 … c0 + kBC − 1, stored [c][j]
    for (int p = tid; p < kBC * (RP / 8); p += kThreads) {
      const int c = p / (RP / 8), j = p % (RP / 8) * 8;
      const bool v = c0 + c < a.Q && j < a.r;
      cp_async16(ws + c * LDP + j, v ? a.W + int64_t(c0 + c) * a.r + j : a.W, v);
    }
  }
  auto load_stage = [&](int b) {
    bf16* xs = smem + (b % kStages) * STAGE;
    const int rb = r0 + b * kBand;
#pragma unroll
    for (int i = 0; i < kBand * (kBC / 8) / kThreads; ++i) {
      const int p = tid + i * kThreads, row = p / (kBC / 8), c = p % (kBC / 8) * 8;
      const bool v = rb + row < r1 && c0 + c < a.Q;
      cp_async16(xs + row * kLdX + c, v ? a.X + int64_t(rb + row) * a.ldx + c0 + c : a.X, v);
    }
    bf16* ps = xs + kBand * kLdX;
    for (int p = tid; p < kBand * (RP / 8); p += kThreads) {
      const int row = p / (RP / 8), j = p % (RP / 8) * 8;
      const bool v = rb + row < r1 && j < a.r;
      cp_async16(ps + row * LDP + j, v ? a.P + int64_t(rb + row) * a.ldp + j : a.P, v);
    }
  };

  float accd[2][NT][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) accd[mi][nt][0] = accd[mi][nt][1] = accd[mi][nt][2] = accd[mi][nt][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < NB) load_stage(s);
    cp_async_commit();  // the first group holds W's rows too
  }
#pragma unroll 1
  for (int b = 0; b < NB; ++b) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage b is in for every thread; every warp is done with stage b − 1, whose buffer refills
    if (b + kStages - 1 < NB) load_stage(b + kStages - 1);
    cp_async_commit();
    const bf16* xs = smem + (b % kStages) * STAGE;
    if constexpr (kG) {
      float acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll 4
      for (int kk = 0; kk < kBC; kk += 16) {
        uint32_t af[4];
        load_a(af, xs + warp * 16 * kLdX + kk, kLdX);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bf[4];
          load_b_kn(bf, ws + kk * LDP + np * 16, LDP);
          mma_bf16(acc[2 * np], af, bf[0], bf[1]);
          mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      const bool direct = gridDim.x == 1;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r0 + b * kBand + warp * 16 + g + 8 * h;
        if (row >= r1) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int j = nt * 8 + 2 * t4;  // r is a multiple of 8: j < r covers j + 1
          if (j >= a.r) continue;
          const float x0 = acc[nt][2 * h], x1 = acc[nt][2 * h + 1];
          if (!direct)
            *reinterpret_cast<float2*>(a.gpart + (int64_t(blockIdx.x) * a.T + row) * a.r + j) = make_float2(x0, x1);
          else if (a.g32)
            *reinterpret_cast<float2*>(a.g32 + row * a.ldg + j) = make_float2(x0, x1);
          else
            *reinterpret_cast<__nv_bfloat162*>(a.g16 + row * a.ldg + j) =
                __floats2bfloat162_rn(a.scale * x0, a.scale * x1);
        }
      }
    }
    {
      const bf16* ps = xs + kBand * kLdX;
#pragma unroll 2
      for (int kk = 0; kk < kBand; kk += 16) {
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) load_a_t(af[mi], xs + kk * kLdX + warp * 32 + mi * 16, kLdX);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bf[4];
          load_b_kn(bf, ps + kk * LDP + np * 16, LDP);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma_bf16(accd[mi][2 * np], af[mi], bf[0], bf[1]);
            mma_bf16(accd[mi][2 * np + 1], af[mi], bf[2], bf[3]);
          }
        }
      }
    }
  }
  {
    const bool direct = gridDim.y == 1;
    float* part = a.dpart + int64_t(blockIdx.y) * a.Q * a.r;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int q = c0 + warp * 32 + mi * 16 + g + 8 * h;
        if (q >= a.Q) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = nt * 8 + 2 * t4 + c;
            if (j >= a.r) continue;
            const float v = accd[mi][nt][2 * h + c];
            const int64_t i = d_index(a, q, j);
            if (!direct) part[i] = v;
            else a.D[i] = a.accumulate ? a.D[i] + v : v;
          }
      }
  }
}

// One block per (group of column tiles blockIdx.x, kBand rows blockIdx.y): warp w owns the rows 16w … 16w + 15 and
// sums over the group's tiles, which stream through the stages with A's columns for each; the sum (or, with several
// groups, the group's partial) is written at the end. Rows past T, columns past Q and rank rows past r zero-fill.
template <int RP>
__global__ void __launch_bounds__(kThreads, 1) factor_kernel(Args a, int tiles_per_group) {
  constexpr int NT = RP / 8, STAGE = (kBand + RP) * kLdX;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int tiles = (a.Q + kBC - 1) / kBC, t0 = blockIdx.x * tiles_per_group;
  const int NS = min(t0 + tiles_per_group, tiles) - t0;
  const int rb = blockIdx.y * kBand;
  auto load_stage = [&](int s) {
    bf16* xs = smem + (s % kStages) * STAGE;
    bf16* ws = xs + kBand * kLdX;
    const int c0 = (t0 + s) * kBC;
#pragma unroll
    for (int i = 0; i < kBand * (kBC / 8) / kThreads; ++i) {
      const int p = tid + i * kThreads, row = p / (kBC / 8), c = p % (kBC / 8) * 8;
      const bool v = rb + row < a.T && c0 + c < a.Q;
      cp_async16(xs + row * kLdX + c, v ? a.X + int64_t(rb + row) * a.ldx + c0 + c : a.X, v);
    }
    for (int p = tid; p < RP * (kBC / 8); p += kThreads) {  // A's rows j, stored [j][c]
      const int j = p / (kBC / 8), c = p % (kBC / 8) * 8;
      const bool v = j < a.r && c0 + c < a.Q;
      cp_async16(ws + j * kLdX + c, v ? a.W + int64_t(j) * a.Q + c0 + c : a.W, v);
    }
  };
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < NS) load_stage(s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int s = 0; s < NS; ++s) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage s is in for every thread; every warp is done with stage s − 1, whose buffer refills
    if (s + kStages - 1 < NS) load_stage(s + kStages - 1);
    cp_async_commit();
    const bf16* xs = smem + (s % kStages) * STAGE;
    const bf16* ws = xs + kBand * kLdX;
#pragma unroll 4
    for (int kk = 0; kk < kBC; kk += 16) {
      uint32_t af[4];
      load_a(af, xs + warp * 16 * kLdX + kk, kLdX);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        load_b_nk(bf, ws + np * 16 * kLdX + kk, kLdX);
        mma_bf16(acc[2 * np], af, bf[0], bf[1]);
        mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
      }
    }
  }
  const bool direct = gridDim.x == 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = rb + warp * 16 + g + 8 * h;
    if (row >= a.T) continue;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int j = nt * 8 + 2 * t4;
      if (j >= a.r) continue;
      const float x0 = acc[nt][2 * h], x1 = acc[nt][2 * h + 1];
      if (!direct)
        *reinterpret_cast<float2*>(a.gpart + (int64_t(blockIdx.x) * a.T + row) * a.r + j) = make_float2(x0, x1);
      else
        *reinterpret_cast<__nv_bfloat162*>(a.g16 + row * a.ldg + j) = __floats2bfloat162_rn(a.scale * x0, a.scale * x1);
    }
  }
}

// G[row, j] = Σ over the tiles, in order, of gpart[tile][row, j]; written as fp32 or bf16(scale · G). Pairs of j.
__global__ void reduce_g_kernel(const float* __restrict__ part, int tiles, int T, int r, float* g32, bf16* g16,
                                int64_t ldg, float scale) {
  const int64_t n = int64_t(T) * r;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 2; i < n;
       i += int64_t(gridDim.x) * blockDim.x * 2) {
    float2 s = make_float2(0.0f, 0.0f);
    for (int t = 0; t < tiles; ++t) {
      const float2 v = *reinterpret_cast<const float2*>(part + t * n + i);
      s.x += v.x, s.y += v.y;
    }
    const int64_t row = i / r, j = i % r;
    if (g32) *reinterpret_cast<float2*>(g32 + row * ldg + j) = s;
    else *reinterpret_cast<__nv_bfloat162*>(g16 + row * ldg + j) = __floats2bfloat162_rn(scale * s.x, scale * s.y);
  }
}

// D[i] (+)= Σ over the chunks, in order, of dpart[chunk][i] (the partials are in D's layout).
__global__ void reduce_d_kernel(const float* __restrict__ part, int chunks, int64_t n, float* D, bool accumulate) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int c = 0; c < chunks; ++c) s += part[c * n + i];
    D[i] = accumulate ? D[i] + s : s;
  }
}

struct Split {
  int tiles = 0, chunks = 0, chunk = 0;
};
// skinny_kernel's: column tiles of kBC, and row chunks (whole stages) so that tiles × chunks is about kTargetBlocks.
Split split_of(int64_t T, int64_t Q) {
  Split s;
  s.tiles = static_cast<int>(ceil_div(Q, kBC));
  const int64_t bands = ceil_div(T, kBand);
  const int64_t want = std::clamp<int64_t>(ceil_div(kTargetBlocks, s.tiles), 1, std::max<int64_t>(bands, 1));
  s.chunk = static_cast<int>(ceil_div(bands, want) * kBand);
  s.chunks = static_cast<int>(ceil_div(T, s.chunk));
  return s;
}
struct FactorSplit {
  int groups = 0, per_group = 0, bands = 0;
};
// factor_kernel's: bands of kBand rows, and groups of column tiles so that groups × bands is about kTargetBlocks.
FactorSplit factor_split_of(int64_t T, int64_t Q) {
  FactorSplit s;
  const int64_t tiles = ceil_div(Q, kBC);
  s.bands = static_cast<int>(ceil_div(T, kBand));
  const int64_t want = std::clamp<int64_t>(ceil_div(kTargetBlocks, std::max(s.bands, 1)), 1, tiles);
  s.per_group = static_cast<int>(ceil_div(tiles, want));
  s.groups = static_cast<int>(ceil_div(tiles, s.per_group));
  return s;
}

// The padded rank RP (16 or 32) picks the instantiation; f(std::integral_constant<int, RP>).
template <class F>
void with_rank(int r, F&& f) {
  if (r <= 16) f(std::integral_constant<int, 16>{});
  else f(std::integral_constant<int, 32>{});
}

template <bool kG>
void launch_skinny(const Args& a, const Split& s, cudaStream_t st) {
  with_rank(a.r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    const auto kernel = skinny_kernel<RP, kG>;
    constexpr int smem = (kStages * kBand * (kLdX + RP + 8) + (kG ? kBC * (RP + 8) : 0)) * 2;
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<dim3(s.tiles, s.chunks), kThreads, smem, st>>>(a);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  });
}

unsigned reduce_blocks(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, 256), 1, 2048)); }

void reduce_g(const float* part, int parts, int64_t T, int r, float* g32, bf16* g16, int64_t ldg, float scale,
              cudaStream_t st) {
  reduce_g_kernel<<<reduce_blocks(T * r / 2), 256, 0, st>>>(part, parts, static_cast<int>(T), r, g32, g16, ldg,
                                                            scale);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}
void reduce_d(const float* part, int parts, int64_t n, float* D, bool accumulate, cudaStream_t st) {
  reduce_d_kernel<<<reduce_blocks(n), 256, 0, st>>>(part, parts, n, D, accumulate);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void check_shape(const char* what, int r, int64_t Q, int64_t T) {
  check(r > 0 && r <= 32 && r % 8 == 0, what, ": rank ", r, " must be a multiple of 8 up to 32");
  check(Q > 0 && Q % 8 == 0 && Q <= INT32_MAX, what, ": width ", Q, " must be a positive multiple of 8");
  check(T >= 0 && T <= INT32_MAX, what, ": bad row count ", T);
}

}  // namespace

bool lora_dense_takes(int r, int64_t Q, const void* x, int64_t ldx, const void* p, int64_t ldp) {
  return r > 0 && r <= 32 && r % 8 == 0 && Q > 0 && Q % 8 == 0 && Q <= INT32_MAX && ldx % 8 == 0 && ldx >= Q &&
         aligned(x, 16) && (!p || (ldp % 8 == 0 && ldp >= r && aligned(p, 16)));
}

int64_t lora_dense_work(int64_t T, int64_t Q, int r, bool row_side, bool column_side) {
  if (T <= 0) return 0;
  if (!column_side) {  // factor_kernel
    const FactorSplit f = factor_split_of(T, Q);
    return f.groups > 1 ? f.groups * T * r : 0;
  }
  const Split s = split_of(T, Q);
  return (row_side && s.tiles > 1 ? s.tiles * T * r : 0) + (s.chunks > 1 ? s.chunks * Q * r : 0);
}

void lora_dense_dy(const bf16* dy, int64_t lddy, const bf16* u, int64_t ldu, const bf16* B, int r, int64_t Q,
                   int64_t T, float* dB, bool accumulate, float* g32, bf16* g16, int64_t ldg, float scale, float* work,
                   cudaStream_t stream) {
  check_shape("lora_dense_dy", r, Q, T);
  check(lora_dense_takes(r, Q, dy, lddy, u, ldu) && aligned(B, 16) && ldg >= r && ldg % 2 == 0 &&
            (g32 ? aligned(g32, 8) : g16 && aligned(g16, 4)),
        "lora_dense_dy: operands without aligned rows");
  if (T == 0) {
    if (!accumulate) NEXTLM_CUDA_CHECK(cudaMemsetAsync(dB, 0, Q * r * sizeof(float), stream));
    return;
  }
  const Split s = split_of(T, Q);
  Args a{dy, lddy, u, ldu, B, r, static_cast<int>(Q), static_cast<int>(T), s.chunk, dB, false, accumulate, nullptr,
         g32, g16, ldg, scale, nullptr};
  if (s.tiles > 1) a.gpart = work, work += s.tiles * T * r;
  if (s.chunks > 1) a.dpart = work;
  launch_skinny<true>(a, s, stream);
  if (s.tiles > 1) reduce_g(a.gpart, s.tiles, T, r, g32, g16, ldg, scale, stream);
  if (s.chunks > 1) reduce_d(a.dpart, s.chunks, Q * r, dB, accumulate, stream);
}

void lora_dense_grad(const bf16* x, int64_t ldx, const bf16* p, int64_t ldp, int r, int64_t Q, int64_t T, float* dA,
                     bool accumulate, float* work, cudaStream_t stream) {
  check_shape("lora_dense_grad", r, Q, T);
  check(lora_dense_takes(r, Q, x, ldx, p, ldp), "lora_dense_grad: operands without 16-byte aligned rows");
  if (T == 0) {
    if (!accumulate) NEXTLM_CUDA_CHECK(cudaMemsetAsync(dA, 0, Q * r * sizeof(float), stream));
    return;
  }
  const Split s = split_of(T, Q);
  Args a{x, ldx, p, ldp, nullptr, r, static_cast<int>(Q), static_cast<int>(T), s.chunk, dA, true, accumulate, work,
         nullptr, nullptr, 0, 1.0f, nullptr};
  launch_skinny<false>(a, s, stream);
  if (s.chunks > 1) reduce_d(work, s.chunks, Q * r, dA, accumulate, stream);
}

void lora_dense_factor(const bf16* x, int64_t ldx, const bf16* A, int r, int64_t Q, int64_t T, float scale, bf16* u,
                       int64_t ldu, float* work, cudaStream_t stream) {
  check_shape("lora_dense_factor", r, Q, T);
  check(lora_dense_takes(r, Q, x, ldx, nullptr, 0) && aligned(A, 16) && ldu >= r && ldu % 2 == 0 && aligned(u, 4),
        "lora_dense_factor: operands without aligned rows");
  if (T == 0) return;
  const FactorSplit f = factor_split_of(T, Q);
  Args a{x, ldx, nullptr, 0, A, r, static_cast<int>(Q), static_cast<int>(T), 0, nullptr, false, false, nullptr,
         nullptr, u, ldu, scale, work};
  with_rank(r, [&](auto rp) {
    constexpr int RP = decltype(rp)::value;
    const auto kernel = factor_kernel<RP>;
    constexpr int smem = kStages * (kBand + RP) * kLdX * 2;
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<dim3(f.groups, f.bands), kThreads, smem, stream>>>(a, f.per_group);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  });
  if (f.groups > 1) reduce_g(work, f.groups, T, r, nullptr, u, ldu, scale, stream);
}

}  // namespace nextlm::cuda
