// Backward of the KDA delta rule in the chunked (WY) form on the GPU, its matrix products on tensor cores in split
// bf16: the chunk-parallel counterpart of kda_recurrent_backward (src/cuda/kda_backward.cu) and of the CPU definition
// in src/model/kda_backward.cpp, over chunks of 64 tokens laid out as the forward's plan lays them out (KdaChunks).
//
// Per chunk (rows i < n, S0 the state entering it, Γ the in-chunk cumulative log decay, γ = Γ of its last row):
//   M = strict_lower(k·decay·kᵀ), A = (I + diag(β)·M)⁻¹, U = A·(β v), W = A·(β k∘e^Γ),
//   u = U − W·S0,  o = (q∘e^Γ)·S0 + Aqk·u (Aqk = lower(q·decay·kᵀ)),  S_end = e^γ∘S0 + (k∘e^(γ−Γ))ᵀ·u,
// with decay[i, j, d] = exp(Γ[i, d] − Γ[j, d]) ≤ 1 (j ≤ i): across blocks of 16 rows split at a block boundary r
// (j < r ≤ i) into exp(Γ_i − Γ_r)·exp(Γ_r − Γ_j), both ≤ 1, so no exponent overflows for any g ≤ 0 and the
// cross-block sums are plain products; within a block split at its middle row (factors within e^±60) where the
// chunk's decays allow it (kDiagSpan: any safe gate with lb ≥ −7.5), else formed element by element. The backward,
// with dSe the gradient of S_end:
//   du = Aqkᵀ·dO + Kd·dSe,  dS0 = Qgᵀ·dO + e^γ∘dSe − Wᵀ·du   (sequential over chunks, value columns apart; the
//                                                             products with dO are formed beforehand, in parallel)
//   dW = −du·S0ᵀ, dQg = dO·S0ᵀ, dKd = u·dSeᵀ, dγ ∋ e^γ∘rowsum(S0∘dSe), dAqk = lower(dO·uᵀ)  (kernel "inter")
//   d(βv) = Aᵀ·du, d(βKg) = Aᵀ·dW, dL = −strict_lower(Aᵀ·dA·Aᵀ) with dA = strict_lower(du·(βv)ᵀ + dW·(βKg)ᵀ),
//   then the products through the decay for dq, dk, dΓ  (kernel "intra")
//   dg = reverse cumsum of dΓ over the chunk's rows, + dγ on every row.
//
// Five kernels: prep (per chunk and head: the factors, and the state pass's products with dO), fwd_state (per
// sequence, head and 64 value columns: the states entering every chunk and u), bwd_state (the same grid, backward:
// dSe of every chunk and du), inter and intra (per chunk and head). A block of prep, inter or intra has sixteen warps
// (eight at K = 32: chunk_warps), of a state pass eight; a product's output is cut into one 16-row tile per warp
// (WarpTile), and the state passes keep their fp32 state in the accumulators. Given the states and u the tensor-core
// forward kept (kept_h, kept_u: a training step's kept site), fwd_state does not run and inter reads those.
// q, k and v come in fp32 or as the tensor-core forward's bf16 (a training step's, widened as they are loaded: the
// same values), and g as given or formed by prep from f, dt_bias and A_log (KdaGateInputs, kda_gate_value's bits).
//
// Precision. Every matrix product runs on tensor cores (mma.sync m16n8k16, bf16 inputs, fp32 accumulation) in split
// bf16: an operand x is held as x_hi = bf16(x) and x_lo = bf16(x − x_hi), and a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi
// (three MMAs; about 16 mantissa bits, ~1e-5 relative per product, where plain bf16 or tf32 products would cost
// 1e-3 … 1e-2 in the gradients). On tensor cores: U, W, Aqk and M (within a block where its decay is split, across
// blocks always), Qgᵀ·dO and Aqkᵀ·dO (prep); W·S and Kdᵀ·u (fwd_state); Kd·dSe and Wᵀ·du (bwd_state); du·S0ᵀ,
// dO·S0ᵀ, u·dSeᵀ and dO·uᵀ (inter); Aᵀ·du, Aᵀ·dW, dA, Aᵀ·dA, (Aᵀ·dA)·Aᵀ and the products through the decay, as Aqk
// and M (intra). In fp32 on CUDA cores: the cumulative gates, the pairs within a block whose decay is not split
// (element by element) and intra's pairs i = j, the inverse A, and every element-wise step. The chunked form is thus
// expected ~1e-5 (norm-relative) from the recurrent one instead of within fp32 rounding of it (dg ~2e-5 since the
// split within blocks, 8.5e-6 before, at T = 4096 in kda_bwd_T4096_H64); the tests and the bench hold it to 1e-4.
// KdaBackwardProducts::Bf16 drops the lo terms (one MMA a product, the hi planes alone, as the tensor-core forward
// of kda_tc.cu rounds its factors to bf16): the products then round their operands to bf16, ~1e-3 relative.
// Every output element is written by one thread with sums in a fixed order (no atomics; an MMA's sum order is fixed
// too): reproducible run to run. Kernels of one call run in stream order, so inter and intra both add into dq, dk
// and dg without a race; without accumulate, inter's contributions are the first (stored, not added) and intra's dv
// and dβ are stored.
#include <type_traits>

#include "core/env.h"
#include "cuda/backward_kernels.h"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kC = 64;         // chunk length (the forward's plan)
constexpr int kCP = kC + 1;    // padded row stride of fp32 C×C matrices in shared memory
constexpr int kCS = kC + 8;    // row stride of split C×C matrices in shared memory (ldmatrix without bank conflicts)
// Value columns per block of the state passes: at H = 64, K = 128, 128 blocks per sequence, about one per SM.
template <int K>
constexpr int state_cols() {
  return K < 64 ? K : 64;
}

// Per (chunk, head) workspace block, in floats (385 KiB at K = 128). "Split" slots hold a matrix as its hi plane
// (bf16, rows × cols) followed by its lo plane, in the space of the fp32 matrix. From prep: U [C, K] (fp32), W and
// Kd = k∘e^(γ−Γ) [C, K] (split), Γ [C, K]; A [C, C] (split, unit lower), M [C, C] (strictly lower); γ [K]; and the
// parts of the state pass that do not depend on the carried gradient, Qgᵀ·dO [K, K] in the dh slot and Aqkᵀ·dO
// [C, K] in the du slot. From fwd_state: h = S0 [K, K] and u [C, K] (unused given kept_h, kept_u); from bwd_state
// (over what prep left there): dSe [K, K] and du [C, K]; from inter: dW [C, K] (split) and dAqk [C, C] in the U slot
// (U is dead by then). Rows ≥ n of a chunk hold zeros (U, W, Kd, u, du, dW, dAqk) or are unused.
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
  bool accumulate;  // add into dq, dk, dv, dg, dbeta; else write them (inter writes dq, dk, dg first, intra dv, dβ)
  bool lo;          // split bf16 (the lo terms of every product); else the hi planes alone (KdaBackwardProducts::Bf16)
  // The forward's S0 [C·H, K, K] and u [C·H, C, K] per (chunk, head) (KdaTcStates::chunk_h, chunk_u), or null: then
  // fwd_state forms them in the workspace's h and u slots.
  const float *kh, *ku;
  // q, k and v in bf16 instead of q, k, v (the tensor-core forward's inputs, as a training step keeps them), or null.
  const bf16 *q16 = nullptr, *k16 = nullptr, *v16 = nullptr;
  KdaGateInputs gate;  // with gate.f, prep forms g from it (then g is null)
  // dO and the forward's u in bf16 instead of do_ and ku (KdaBf16Operands; with the bf16 products alone, which read
  // nothing else of them), or null.
  const bf16 *do16 = nullptr, *ku16 = nullptr;
};

// The q, k and v that prep, inter and intra read: fp32, or with B16 the bf16 ones.
template <bool B16>
__device__ __forceinline__ auto in_q(const Params& p) {
  if constexpr (B16) return p.q16;
  else return p.q;
}
template <bool B16>
__device__ __forceinline__ auto in_k(const Params& p) {
  if constexpr (B16) return p.k16;
  else return p.k;
}
template <bool B16>
__device__ __forceinline__ auto in_v(const Params& p) {
  if constexpr (B16) return p.v16;
  else return p.v;
}

// e^x as __expf forms it (ex2.approx of x·log2(e)), with results below 2^−126 flushed to zero: without the flush
// ex2.approx needs a range check and two rescalings around it, three more instructions an exponential in loops that
// are issue-bound (the pairs within a block in prep and intra). Every exponential here is of a non-positive decay
// difference or a gate, so the flushed values are below fp32's normal range, far under the products' 1e-5, or of a
// difference within ±kDiagSpan (the split at a block's middle row, below), whose results are normal.
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * 1.44269502f); }

// The pairs within a 16-row block (rows r0 … r0 + 15) run on tensor cores with the decay split at the block's middle
// row rm = r0 + 8: e^(Γ_i − Γ_j) = e^(Γ_i − Γ_rm)·e^(Γ_rm − Γ_j), one factor per operand, each at most e^kDiagSpan
// and at least e^−kDiagSpan (normal fp32, and their products with the other operands far from overflow) as long as
// the decay over either half of every block stays within kDiagSpan in every column. A safe gate (g ≥ lb a step) keeps
// it for lb ≥ −7.5 (8·|lb| ≤ 60); where a chunk's gates decay faster, its blocks form the decay element by element.
constexpr float kDiagSpan = 60.0f;
// Whether a column's decay over a block (Γ at its rows r0, rm and r0 + 15) is too wide for the split.
__device__ __forceinline__ bool diag_wide(float g0, float gm, float g1) {
  return !(g0 - gm <= kDiagSpan && gm - g1 <= kDiagSpan);
}

// ---- Split bf16 and tensor-core products ----

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// x0, x1 (adjacent columns) into a split matrix at p: hi there, lo `plane` elements further on. With lo false
// (KdaBackwardProducts::Bf16, whose products read no lo plane) the hi plane alone: the lo plane is left as it was.
__device__ __forceinline__ void put2(bf16* p, int plane, float x0, float x1, bool lo) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  *reinterpret_cast<__nv_bfloat162*>(p) = hi;
  if (lo)
    *reinterpret_cast<__nv_bfloat162*>(p + plane) =
        __floats2bfloat162_rn(x0 - __low2float(hi), x1 - __high2float(hi));
}
// Four adjacent columns (p 8-byte aligned).
__device__ __forceinline__ void put4(bf16* p, int plane, float4 x, bool lo) {
  const __nv_bfloat162 h0 = __floats2bfloat162_rn(x.x, x.y), h1 = __floats2bfloat162_rn(x.z, x.w);
  *reinterpret_cast<uint2*>(p) = make_uint2(bits(h0), bits(h1));
  if (!lo) return;
  const __nv_bfloat162 l0 = __floats2bfloat162_rn(x.x - __low2float(h0), x.y - __high2float(h0));
  const __nv_bfloat162 l1 = __floats2bfloat162_rn(x.z - __low2float(h1), x.w - __high2float(h1));
  *reinterpret_cast<uint2*>(p + plane) = make_uint2(bits(l0), bits(l1));
}
// hi + lo of four adjacent columns (with lo false, as put4 stored them then, hi alone).
__device__ __forceinline__ float4 get4(const bf16* p, int plane, bool lo) {
  const uint2 h = *reinterpret_cast<const uint2*>(p), l = lo ? *reinterpret_cast<const uint2*>(p + plane) : uint2{};
  auto lo16 = [](uint32_t x) { return __uint_as_float(x << 16); };
  auto hi16 = [](uint32_t x) { return __uint_as_float(x & 0xffff0000u); };
  return make_float4(lo16(h.x) + lo16(l.x), hi16(h.x) + hi16(l.x), lo16(h.y) + lo16(l.y), hi16(h.y) + hi16(l.y));
}

__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
// The same from bf16 (the forward's q, k and v, Params::q16 …), widened as they are loaded: exactly the values an
// fp32 copy of them would hold.
__device__ __forceinline__ float2 ld2(const bf16* p) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float4 ld4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ void st2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }

// The cut of an R × N output among NW warps into one tile of 16·MT rows × 8·NT columns per warp: RT row tiles times
// CG column groups, warps beyond them idle (only for K = 32).
template <int R, int N, int MT, int NW>
struct WarpTile {
  static constexpr int RT = R / (16 * MT);
  static constexpr int CG = NW / RT < N / 16 ? NW / RT : N / 16;
  static constexpr int NT = N / (8 * CG);
  static_assert(RT >= 1 && RT <= NW && CG >= 1 && NT % 2 == 0, "a tile per warp, n-tiles in pairs");
  __device__ static int row0(int w) { return 16 * MT * (w % RT); }
  __device__ static int col0(int w) { return (N / CG) * (w / RT); }
  __device__ static bool active(int w) { return w / RT < CG; }
};

// acc[mt][nt] += a[mt]·(n-tile nt of b) for every tile of the warp; b holds the n-tiles in pairs (load_b_*).
template <int MT, int NT>
__device__ __forceinline__ void mma_tiles(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4],
                                          const uint32_t (&b)[NT / 2][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[mt][nt], a[mt], b[nt / 2][2 * (nt % 2)], b[nt / 2][2 * (nt % 2) + 1]);
}

// acc += A·B on this warp's tile of 16·MT rows × 8·NT columns, over the k-steps kb ≤ kk < ke (16 each), in split
// bf16: A_lo·B_hi + A_hi·B_lo + A_hi·B_hi with fp32 accumulation, in that order per k-step (each pass over all the
// tiles, so that consecutive MMAs are independent). a points at A's element (row 0, k 0) in the hi plane of a split
// matrix (lo plane pa elements on): row-major [m][k] with row stride lda or, with AT, stored as [k][m]; m-tile mt
// starts amt elements after a. b points at B's element (k 0, column 0): stored [k][n] with row stride ldb or, with
// BT, as [n][k]; lo plane pb elements on. With lo false, A_hi·B_hi alone (KdaBackwardProducts::Bf16; the lo planes
// are not read).
// With PIPE and lo false the k-steps go in pairs: the next step's fragments are loaded before this step's MMAs are
// issued, so that the MMAs do not wait for their own shared-memory loads (the same registers as a split step's four
// fragment sets, and the same MMAs in the same order: the same bits). The state pass takes it; in the chunk kernels,
// at 128 registers, it spilled and made prep and inter slower (in the LoRA step's trace, 3.35 → 3.49 and 2.35 → 2.47
// ms over three layers on an H100; intra 3.87 → 3.81).
template <int MT, int NT, bool AT, bool BT>
__device__ __forceinline__ void load_hi(uint32_t (&ah)[MT][4], uint32_t (&bh)[NT / 2][4], const bf16* a, int lda,
                                        int amt, const bf16* b, int ldb, int kk) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const bf16* t = a + mt * amt + (AT ? 16 * kk * lda : 16 * kk);
    if constexpr (AT) load_a_t(ah[mt], t, lda);
    else load_a(ah[mt], t, lda);
  }
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    const bf16* t = b + (BT ? 16 * np * ldb + 16 * kk : 16 * kk * ldb + 16 * np);
    if constexpr (BT) load_b_nk(bh[np], t, ldb);
    else load_b_kn(bh[np], t, ldb);
  }
}

template <int MT, int NT, bool AT, bool BT, bool PIPE = false>
__device__ __forceinline__ void mma3(float (&acc)[MT][NT][4], const bf16* a, int lda, int amt, int pa, const bf16* b,
                                     int ldb, int pb, int kb, int ke, bool lo) {
  static_assert(NT % 2 == 0, "B fragments come in pairs of n-tiles");
  if (PIPE && !lo) {
    if (kb >= ke) return;
    uint32_t a0[MT][4], b0[NT / 2][4], a1[MT][4], b1[NT / 2][4];
    load_hi<MT, NT, AT, BT>(a0, b0, a, lda, amt, b, ldb, kb);
#pragma unroll 1
    for (int kk = kb; kk < ke; kk += 2) {
      if (kk + 1 < ke) load_hi<MT, NT, AT, BT>(a1, b1, a, lda, amt, b, ldb, kk + 1);
      mma_tiles(acc, a0, b0);
      if (kk + 1 >= ke) break;
      if (kk + 2 < ke) load_hi<MT, NT, AT, BT>(a0, b0, a, lda, amt, b, ldb, kk + 2);
      mma_tiles(acc, a1, b1);
    }
    return;
  }
#pragma unroll 1
  for (int kk = kb; kk < ke; ++kk) {
    uint32_t ah[MT][4], al[MT][4], bh[NT / 2][4], bl[NT / 2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const bf16* t = a + mt * amt + (AT ? 16 * kk * lda : 16 * kk);
      if constexpr (AT) {
        load_a_t(ah[mt], t, lda);
        if (lo) load_a_t(al[mt], t + pa, lda);
      } else {
        load_a(ah[mt], t, lda);
        if (lo) load_a(al[mt], t + pa, lda);
      }
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      const bf16* t = b + (BT ? 16 * np * ldb + 16 * kk : 16 * kk * ldb + 16 * np);
      if constexpr (BT) {
        load_b_nk(bh[np], t, ldb);
        if (lo) load_b_nk(bl[np], t + pb, ldb);
      } else {
        load_b_kn(bh[np], t, ldb);
        if (lo) load_b_kn(bl[np], t + pb, ldb);
      }
    }
    if (lo) {
      mma_tiles(acc, al, bh);
      mma_tiles(acc, ah, bl);
    }
    mma_tiles(acc, ah, bh);
  }
}

// The split (hi, lo) B fragment of one n-tile from this thread's four fp32 elements, at k = 2t, 2t + 1, 2t + 8 and
// 2t + 9 of column g (mma.cuh's layout), formed in registers.
__device__ __forceinline__ void split_b(uint32_t (&hi)[2], uint32_t (&lo)[2], const float (&x)[4]) {
  const __nv_bfloat162 h0 = __floats2bfloat162_rn(x[0], x[1]), h1 = __floats2bfloat162_rn(x[2], x[3]);
  hi[0] = bits(h0);
  hi[1] = bits(h1);
  lo[0] = pack_bf16(x[0] - __low2float(h0), x[1] - __high2float(h0));
  lo[1] = pack_bf16(x[2] - __low2float(h1), x[3] - __high2float(h1));
}
// Zeroes the diagonal of a 16×16 A block in its fragment (entries (m, m): in a0 and a3, on the lanes g = 2t, 2t + 1).
__device__ __forceinline__ void drop_diagonal(uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t keep = g == 2 * t ? 0xffff0000u : (g == 2 * t + 1 ? 0x0000ffffu : 0xffffffffu);
  a[0] &= keep;
  a[3] &= keep;
}
// acc += a·b on one 16×8 tile over one k-step in split bf16, in mma3's order (a_lo·b_hi, a_hi·b_lo, a_hi·b_hi);
// with lo false a_hi·b_hi alone.
__device__ __forceinline__ void mma_split(float (&acc)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const uint32_t (&bh)[2], const uint32_t (&bl)[2], bool lo) {
  if (lo) {
    mma_bf16(acc, al, bh[0], bh[1]);
    mma_bf16(acc, ah, bl[0], bl[1]);
  }
  mma_bf16(acc, ah, bh[0], bh[1]);
}

// ---- Staging into shared memory ----

// dst[r·ld + c] = src[r·lds + c] for r < ROWS, c < COLS (16-byte aligned rows, ld and lds multiples of 4) by
// 16-byte cp.async, a whole staging loop in flight at once without registers; rows ≥ valid are zero-filled.
// From bf16 rows (the forward's q and k, Src bf16) widened on the way by plain 8-byte loads and 16-byte stores.
// Complete after sync_staged().
template <int ROWS, int COLS, int NTH, class Src>
__device__ __forceinline__ void stage(float* dst, int ld, const Src* src, int64_t lds, int valid) {
  constexpr int c4 = COLS / 4;
  static_assert(COLS % 4 == 0, "whole pieces of four");
  for (int idx = threadIdx.x; idx < ROWS * c4; idx += NTH) {
    const int r = idx / c4, c = 4 * (idx - r * c4);
    if constexpr (std::is_same_v<Src, float>)
      cp_async16(dst + r * ld + c, r < valid ? src + r * lds + c : src, r < valid);
    else
      *reinterpret_cast<float4*>(dst + r * ld + c) =
          r < valid ? ld4(src + r * lds + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}
__device__ __forceinline__ void sync_staged() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
}

// Visits the ROWS × COLS elements of a matrix four columns at a time, in batches of about 32 loaded floats per
// thread (of NTH): load(r, c) for every element of the batch first (so that its global loads are in flight together),
// then put(r, c, x). Rows ≥ valid are not loaded: put gets a zero-initialised x for them.
template <int ROWS, int COLS, int NTH, class Load, class Put>
__device__ __forceinline__ void staged(int valid, Load load, Put put) {
  using X = decltype(load(0, 0));
  constexpr int floats = sizeof(X) / 4, depth = floats <= 4 ? 8 : (floats <= 8 ? 4 : 2);
  constexpr int c4 = COLS / 4, per = ROWS * c4 / NTH, B = per < depth ? per : depth;
  static_assert(ROWS * c4 % NTH == 0 && per % B == 0, "whole rounds of the block");
#pragma unroll
  for (int e0 = 0; e0 < per; e0 += B) {
    X x[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int idx = threadIdx.x + (e0 + b) * NTH, r = idx / c4, c = 4 * (idx - r * c4);
      x[b] = r < valid ? load(r, c) : X{};
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int idx = threadIdx.x + (e0 + b) * NTH, r = idx / c4, c = 4 * (idx - r * c4);
      put(r, c, x[b]);
    }
  }
}

// A ROWS × COLS fp32 matrix (row stride lds, 16-byte aligned rows) split into shared memory (row stride ld, lo plane
// `plane` elements on; with lo false the hi plane alone, as put4); rows ≥ valid are zero.
template <int ROWS, int COLS, int NTH>
__device__ __forceinline__ void stage_split(bf16* dst, int ld, int plane, const float* src, int64_t lds, int valid,
                                            bool lo) {
  staged<ROWS, COLS, NTH>(
      valid, [&](int r, int c) { return ld4(src + r * lds + c); },
      [&](int r, int c, float4 x) { put4(dst + r * ld + c, plane, x, lo); });
}

// A ROWS × COLS bf16 matrix (row stride lds, 16-byte aligned rows) into shared memory (row stride ld) as it is, the
// hi plane of a split matrix without lo, by 16-byte cp.async; rows ≥ valid are zero-filled. Complete after
// sync_staged().
template <int ROWS, int COLS, int NTH>
__device__ __forceinline__ void stage_bf16(bf16* dst, int ld, const bf16* src, int64_t lds, int valid) {
  constexpr int c8 = COLS / 8;
  static_assert(COLS % 8 == 0, "whole pieces of eight");
  for (int idx = threadIdx.x; idx < ROWS * c8; idx += NTH) {
    const int r = idx / c8, c = 8 * (idx - r * c8);
    cp_async16(dst + r * ld + c, r < valid ? src + r * lds + c : src, r < valid);
  }
}

// A split ROWS × COLS matrix stored densely (hi plane, then lo plane) → shared memory (row stride ld, planes `plane`
// elements apart) by cp.async (with lo false the hi plane alone); the caller commits and waits.
template <int ROWS, int COLS, int NTH>
__device__ __forceinline__ void copy_split(bf16* dst, int ld, int plane, const bf16* src, bool lo) {
  constexpr int pieces = COLS / 8, per_plane = ROWS * pieces;
  for (int idx = threadIdx.x; idx < (lo ? 2 : 1) * per_plane; idx += NTH) {
    const int pl = idx / per_plane, rem = idx - pl * per_plane, r = rem / pieces, c = 8 * (rem - r * pieces);
    cp_async16(dst + pl * plane + r * ld + c, src + pl * (ROWS * COLS) + r * COLS + c, true);
  }
}

// Adds the row sums rs (of this thread's columns on its rows r0 + g and r0 + g + 8) over the four threads of a row
// into part[row]; lane t = 0 of the row writes.
__device__ __forceinline__ void add_rows(float* part, int r0, const float (&rs)[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float s = rs[hf];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if ((lane & 3) == 0) part[r0 + (lane >> 2) + 8 * hf] += s;
  }
}

// add_tile in two halves, so that several tiles' loads can be in flight together (intra's dq, dk and dg, whose three
// memory latencies in a row were a sixth of its stall samples in ncu; 3.85 → 3.53 ms over the LoRA step's three
// layers on an H100): TileRegs holds a thread's elements of dst between load_tile and store_tile.
template <int K, int NTH>
struct TileRegs {
  static constexpr int c4 = K / 4, per = kC * c4 / NTH;
  float4 x[per];
};
template <int K, int NTH>
__device__ __forceinline__ void load_tile(TileRegs<K, NTH>& t, const float* dst, int64_t ld, int n, bool add) {
  using T = TileRegs<K, NTH>;
#pragma unroll
  for (int e = 0; e < T::per; ++e) {
    const int idx = threadIdx.x + e * NTH, r = idx / T::c4, c = 4 * (idx - r * T::c4);
    t.x[e] = add && r < n ? ld4(dst + r * ld + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}
template <int K, int NTH>
__device__ __forceinline__ void store_tile(float* dst, int64_t ld, const TileRegs<K, NTH>& t, const float* src, int ls,
                                           int n) {
  using T = TileRegs<K, NTH>;
#pragma unroll
  for (int e = 0; e < T::per; ++e) {
    const int idx = threadIdx.x + e * NTH, r = idx / T::c4, c = 4 * (idx - r * T::c4);
    if (r < n) {
      const float4 y = ld4(src + r * ls + c);
      float4* out = reinterpret_cast<float4*>(dst + r * ld + c);
      *out = make_float4(t.x[e].x + y.x, t.x[e].y + y.y, t.x[e].z + y.z, t.x[e].w + y.w);
    }
  }
}
// dst[r·ld + c] += src[r·ls + c] (src in shared memory) for the rows r < n of a [C, K] tile, by all threads, each
// issuing all its loads of dst before its stores (a load after a store to dst could not be hoisted above it).
// With add false, dst[r·ld + c] = src[r·ls + c] (dst is not read).
template <int K, int NTH>
__device__ __forceinline__ void add_tile(float* dst, int64_t ld, const float* src, int ls, int n, bool add = true) {
  TileRegs<K, NTH> t;
  load_tile<K, NTH>(t, dst, ld, n, add);
  store_tile<K, NTH>(dst, ld, t, src, ls, n);
}

// The epilogues below read the global operands of a group of NG n-tiles into registers first, then compute and
// store: a global load that follows a store cannot be hoisted above it, and one memory latency per element would
// dominate the kernels.
template <int NT>
constexpr int group_of() {
  return NT < 4 ? NT : 4;
}

// Warps of the per-chunk kernels (prep, inter, intra): sixteen where their [C, K] outputs cut into 16 tiles of 16
// rows × 16 or more columns, else eight. Their shared memory holds one block an SM, whose phases are chains of loads,
// products and barriers: sixteen warps hide more of their latency than eight (at T = 4096, H = 64, K = 128 on the
// H200, prep 1.67 → 1.45, inter 1.20 → 0.96, intra 2.07 → 1.70 ms). The state passes keep eight: with sixteen,
// each chunk's two products are cut finer and the passes ran slower (fwd_state 0.33 → 0.36, bwd_state 0.54 →
// 0.63 ms).
constexpr int kStateWarps = 8;
template <int K>
constexpr int chunk_warps() {
  return K >= 64 ? 16 : 8;
}

// ---- prep: per (chunk, head), the forward's factors (as kda.cu's chunk_prepare, with A and M kept apart) and the
// state pass's products with dO ----

// The compact form (kCompact, for KdaBackwardProducts::Bf16 alone): no lo planes in the scratch and q, k read from
// global memory where they are used instead of staged, so that its shared memory (109 KiB at K = 128 against 223)
// and eight warps' registers let two blocks share an SM: the phases of one overlap the other's (a block alone is a
// chain of loads, products and barriers). The same operations on the same values: the same bits as the full form.
template <int K, bool kCompact = false>
struct PrepSmem {
  static constexpr int KP = K + 4, KS = K + 8;  // KP: 16-byte rows (staged and read as float4)
  static constexpr int NP = kCompact ? 1 : 2;   // planes of a split matrix in the scratch
  static constexpr int floats = (kCompact ? 1 : 3) * kC * KP + 2 * kC * kCP + kC;  // Γ (, k, q); A, Aqk (fp32); β
  static constexpr int cross = NP * 128 * KS;                                       // split [128, KS]
  static constexpr int factors = NP * (kC * kCS + 2 * kC * KS);  // split [C, CS] and two split [C, KS]
  static constexpr size_t bytes = size_t(floats) * 4 + size_t(cross > factors ? cross : factors) * 2;
};
template <int K, bool kCompact>
constexpr int prep_warps() {
  return kCompact ? 8 : chunk_warps<K>();
}

template <int K, bool kCompact, bool B16>
__global__ void __launch_bounds__(32 * prep_warps<K, kCompact>(), kCompact ? 2 : 1) prep_kernel(Params p) {
  constexpr int NW = prep_warps<K, kCompact>(), NTH = 32 * NW, NP = PrepSmem<K, kCompact>::NP;
  constexpr int KP = PrepSmem<K>::KP, KS = K + 8, pX = kC * KS, pC = kC * kCS;
  using OT = WarpTile<kC, K, 1, NW>;
  static_assert(OT::RT * OT::CG == NW, "every warp has a tile of the [C, K] outputs");
  extern __shared__ __align__(16) unsigned char smem[];
  float* sg = reinterpret_cast<float*>(smem);          // [C, KP] Γ
  float* sk = sg + kC * KP;                            // [C, KP] k (full form)
  float* sq = sk + kC * KP;                            // [C, KP] q (full form)
  float* sa = kCompact ? sg + kC * KP : sq + kC * KP;  // [C, CP] A
  float* sqk = sa + kC * kCP;                          // [C, CP] Aqk
  float* sb = sqk + kC * kCP;                          // [C] β
  bf16* xs = reinterpret_cast<bf16*>(sb + kC);         // split scratch
  float* xf = reinterpret_cast<float*>(xs);     // the same, as fp32 scratch of the inverse
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.H, HK = H * K;
  const int t0 = p.ch.chunk_start[c], n = p.ch.chunk_len[c];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const Layout lay{K};
  float* ws = p.ws + (c * H + h) * lay.per();
  const int64_t base = t0 * HK + h * K;
  const bool lo = !kCompact && p.lo;  // the compact form is the bf16 products' alone
  const auto *kin = in_k<B16>(p) + base, *qin = in_q<B16>(p) + base;
  // Row i's k and q at columns d …: staged (full form) or from global memory (compact); zero at rows ≥ n.
  auto rowk = [&](int i) { return kin + int64_t(i) * HK; };  // the compact form's
  auto k2 = [&](int i, int d) {
    if constexpr (kCompact) return i < n ? ld2(rowk(i) + d) : make_float2(0.0f, 0.0f);
    else return ld2(sk + i * KP + d);
  };
  auto q2 = [&](int i, int d) {
    if constexpr (kCompact) return i < n ? ld2(qin + int64_t(i) * HK + d) : make_float2(0.0f, 0.0f);
    else return ld2(sq + i * KP + d);
  };
  auto k4 = [&](int i, int d) {
    if constexpr (kCompact) return i < n ? ld4(rowk(i) + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    else return ld4(sk + i * KP + d);
  };
  auto q4 = [&](int i, int d) {
    if constexpr (kCompact) return i < n ? ld4(qin + int64_t(i) * HK + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    else return ld4(sq + i * KP + d);
  };
  stage<kC, K, NTH>(sg, KP, (p.gate.f ? p.gate.f : p.g) + base, HK, n);
  if constexpr (!kCompact) {
    stage<kC, K, NTH>(sk, KP, kin, HK, n);
    stage<kC, K, NTH>(sq, KP, qin, HK, n);
  }
  for (int i = tid; i < kC; i += NTH) sb[i] = i < n ? p.beta[(t0 + i) * H + h] : 0.0f;
  sync_staged();
  if (p.gate.f) {  // the gate from f in place (rows ≥ n stay zero), the values the forward's gate kernel forms
    const float rate = expf(p.gate.A_log[h]);
    for (int idx = tid; idx < n * K; idx += NTH) {
      const int i = idx / K, d = idx - i * K;
      sg[i * KP + d] = kda_gate_value(sg[i * KP + d] + p.gate.dt_bias[h * K + d], rate, p.gate.has_bound,
                                      p.gate.bound);
    }
    __syncthreads();
  }
  bool wide = false;  // a block of this thread's column too wide for the split at its middle row
  for (int d = tid; d < K; d += NTH) {
    for (int i = 1; i < kC; ++i) sg[i * KP + d] += sg[(i - 1) * KP + d];
    for (int b = 0; b < kC / 16; ++b)
      wide |= diag_wide(sg[16 * b * KP + d], sg[(16 * b + 8) * KP + d], sg[(16 * b + 15) * KP + d]);
  }
  const bool diag_mma = !__syncthreads_or(wide);
  // Aqk[i, j] = Σ_d q_i k_j decay (j ≤ i), M[i, j] = Σ_d k_i k_j decay (j < i); −β_i M into A for the substitution.
  // Zeros first where nothing is computed (j > i, rows ≥ n); then the element-wise factors: Kd (split) and Γ.
  for (int idx = tid; idx < kC * kC; idx += NTH) {
    const int i = idx / kC, j = idx - i * kC;
    sqk[i * kCP + j] = 0.0f;
    sa[i * kCP + j] = 0.0f;
    ws[lay.M() + idx] = 0.0f;
  }
  {
    bf16* wkd = reinterpret_cast<bf16*>(ws + lay.Kd());
    for (int idx = tid; idx < kC * K / 2; idx += NTH) {
      const int i = idx / (K / 2), d = 2 * (idx - i * (K / 2));
      const float2 g = ld2(sg + i * KP + d);  // rows ≥ n have g = 0: Γ[C−1] = Γ[n−1]
      const float2 l = ld2(sg + (kC - 1) * KP + d), kk = k2(i, d);
      put2(wkd + i * K + d, kC * K, kk.x * exp_ftz(l.x - g.x), kk.y * exp_ftz(l.y - g.y), lo);
      st2(ws + lay.G() + i * K + d, g.x, g.y);
    }
  }
  for (int d = tid; d < K; d += NTH) ws[lay.gl() + d] = sg[(kC - 1) * KP + d];
  __syncthreads();
  // Pairs within a 16-row block, the decay element by element where a block is too wide for the split (else on
  // tensor cores, below): NTH/4 threads per block, each an RI×2 tile of pairs (the same sums in the same order
  // whatever RI).
  if (!diag_mma) {
    constexpr int RI = NTH >= 512 ? 1 : 2, per_blk = NTH / 4;
    const int blk = tid / per_blk, ti = (tid % per_blk) >> 3, tj = tid & 7;
    const int i0 = 16 * blk + RI * ti, j0 = 16 * blk + 2 * tj;
    if (j0 < i0 + RI && i0 < n) {
      float s[RI][2] = {}, m[RI][2] = {};
      // Four elements d … d + 3 a load (float4), summed in order of d.
#pragma unroll 1
      for (int d = 0; d < K; d += 4) {
        float4 gi[RI], ki[RI], qi[RI];
#pragma unroll
        for (int a = 0; a < RI; ++a)
          gi[a] = ld4(sg + (i0 + a) * KP + d), ki[a] = k4(i0 + a, d), qi[a] = q4(i0 + a, d);
        const float4 gj[2] = {ld4(sg + j0 * KP + d), ld4(sg + (j0 + 1) * KP + d)};
        const float4 kj[2] = {k4(j0, d), k4(j0 + 1, d)};
        auto at = [](const float4& v, int x) { return x == 0 ? v.x : (x == 1 ? v.y : (x == 2 ? v.z : v.w)); };
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
          for (int a = 0; a < RI; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              // min(…, 0) only matters for the pair above the diagonal of a diagonal tile, which is dropped
              const float e = exp_ftz(fminf(at(gi[a], x) - at(gj[b], x), 0.0f)) * at(kj[b], x);
              s[a][b] = fmaf(at(qi[a], x), e, s[a][b]);
              m[a][b] = fmaf(at(ki[a], x), e, m[a][b]);
            }
      }
#pragma unroll
      for (int a = 0; a < RI; ++a)
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
  // Rows of block ib against the earlier rows j < r0 = 16·ib, on tensor cores, the decay split at r0 into
  // e^(Γ_i − Γ_r0)·e^(Γ_r0 − Γ_j), both ≤ 1: the split scratch holds k_j e^(Γ_r0 − Γ_j) (rows j < r0 ≤ 48), then q_i
  // and k_i times e^(Γ_i − Γ_r0) (rows 48 … 63 and 64 … 79). Warp w < 2·ib forms columns 16·(w/2) … of Aqk (even w)
  // or M (odd w) on the block's rows. With diag_mma, the pairs within block ib too (from ib = 0), split at its middle
  // row rm: k_j e^(Γ_rm − Γ_j), q_i and k_i times e^(Γ_i − Γ_rm) at rows 80 …, 96 … and 112 …; the last two warps
  // form the block's Aqk (j ≤ i) and M (j < i), the MMA's other entries dropped.
  {
    constexpr int pl = 128 * KS;
#pragma unroll 1
    for (int ib = diag_mma ? 0 : 1; ib < 4; ++ib) {
      const int r0 = 16 * ib, rm = r0 + 8;
      if (r0 >= n) break;
      __syncthreads();  // the scratch is no longer read
      for (int idx = tid; idx < r0 * K / 2; idx += NTH) {
        const int j = idx / (K / 2), d = 2 * (idx - j * (K / 2));
        const float2 kj = k2(j, d), gj = ld2(sg + j * KP + d), gr = ld2(sg + r0 * KP + d);
        put2(xs + j * KS + d, pl, kj.x * exp_ftz(gr.x - gj.x), kj.y * exp_ftz(gr.y - gj.y), lo);
      }
      for (int idx = tid; idx < (ib > 0 ? 16 * K / 2 : 0); idx += NTH) {
        const int il = idx / (K / 2), d = 2 * (idx - il * (K / 2)), i = r0 + il;
        const float2 gi = ld2(sg + i * KP + d), gr = ld2(sg + r0 * KP + d);
        const float2 qi = q2(i, d), ki = k2(i, d);
        const float e0 = exp_ftz(gi.x - gr.x), e1 = exp_ftz(gi.y - gr.y);
        put2(xs + (48 + il) * KS + d, pl, qi.x * e0, qi.y * e1, lo);
        put2(xs + (64 + il) * KS + d, pl, ki.x * e0, ki.y * e1, lo);
      }
      for (int idx = tid; idx < (diag_mma ? 16 * K / 2 : 0); idx += NTH) {
        const int il = idx / (K / 2), d = 2 * (idx - il * (K / 2)), i = r0 + il;
        const float2 gi = ld2(sg + i * KP + d), gm = ld2(sg + rm * KP + d);
        const float2 qi = q2(i, d), ki = k2(i, d);
        const float u0 = exp_ftz(gi.x - gm.x), u1 = exp_ftz(gi.y - gm.y);  // e^(Γ_i − Γ_rm)
        const float w0 = exp_ftz(gm.x - gi.x), w1 = exp_ftz(gm.y - gi.y);  // e^(Γ_rm − Γ_i)
        put2(xs + (80 + il) * KS + d, pl, ki.x * w0, ki.y * w1, lo);
        put2(xs + (96 + il) * KS + d, pl, qi.x * u0, qi.y * u1, lo);
        put2(xs + (112 + il) * KS + d, pl, ki.x * u0, ki.y * u1, lo);
      }
      __syncthreads();
      if (diag_mma && warp >= NW - 2) {
        const int is_m = warp - (NW - 2);
        float acc[1][2][4] = {};
        mma3<1, 2, false, true>(acc, xs + (96 + 16 * is_m) * KS, KS, 0, pl, xs + 80 * KS, KS, pl, 0, K / 16, lo);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int i = r0 + gq + 8 * (x >> 1), j = r0 + 8 * nt + 2 * tq + (x & 1);
            const float val = acc[0][nt][x];
            if (i < n && j <= i) {
              if (!is_m) {
                sqk[i * kCP + j] = val;
              } else if (j < i) {
                ws[lay.M() + i * kC + j] = val;
                sa[i * kCP + j] = -sb[i] * val;
              }
            }
          }
      }
      if (warp < 2 * ib) {
        const int is_m = warp & 1, j0 = 16 * (warp >> 1);
        float acc[1][2][4] = {};
        mma3<1, 2, false, true>(acc, xs + (48 + 16 * is_m) * KS, KS, 0, pl, xs + j0 * KS, KS, pl, 0, K / 16, lo);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int i = r0 + gq + 8 * (x >> 1), j = j0 + 8 * nt + 2 * tq + (x & 1);
            const float val = acc[0][nt][x];
            if (i < n) {
              if (is_m) {
                ws[lay.M() + i * kC + j] = val;
                sa[i * kCP + j] = -sb[i] * val;
              } else {
                sqk[i * kCP + j] = val;
              }
            }
          }
      }
    }
  }
  __syncthreads();
  // A = (I + L)⁻¹ from A0 = −L (strictly lower) in blocks of 16, in fp32: first each diagonal block by forward
  // substitution within one warp (row i: A[i, j] = A0[i, j] + Σ_{j<m<i} A0[i, m]·A[m, j], lane j, row i of A0
  // broadcast by shuffles), then the block rows in order: A[ib, jb] = A[ib, ib]·Σ_{jb≤kb<ib} A0[ib, kb]·A[kb, jb].
  // Rows ≥ n are zero off the diagonal and stay so.
  if (tid < 4 * 32) {
    const int r0 = 16 * (tid >> 5);
    for (int il = 2; il < 16; ++il) {
      const int i = r0 + il;
      const float a0 = lane < il ? sa[i * kCP + r0 + lane] : 0.0f;  // not the diagonal, which others set to 1
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
  for (int i = tid; i < kC; i += NTH) sa[i * kCP + i] = 1.0f;
  __syncthreads();
#pragma unroll
  for (int ib = 1; ib < 4; ++ib) {
    if (16 * ib >= n) break;
    for (int idx = tid; idx < ib * 256; idx += NTH) {  // xf[jb][il][jl] = Σ_kb A0[ib, kb]·A[kb, jb]
      const int jb = idx >> 8, il = (idx >> 4) & 15, jl = idx & 15;
      const float* ar = sa + (16 * ib + il) * kCP;
      float acc = 0.0f;
      for (int m = 16 * jb; m < 16 * ib; ++m) acc = fmaf(ar[m], sa[m * kCP + 16 * jb + jl], acc);
      xf[idx] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < ib * 256; idx += NTH) {
      const int jb = idx >> 8, il = (idx >> 4) & 15, jl = idx & 15;
      const float* br = sa + (16 * ib + il) * kCP + 16 * ib;
      float acc = 0.0f;
      for (int ml = 0; ml <= il; ++ml) acc = fmaf(br[ml], xf[(jb << 8) + (ml << 4) + jl], acc);
      sa[(16 * ib + il) * kCP + 16 * jb + jl] = acc;
    }
    __syncthreads();
  }
  // U = A·(β v) and W = A·(β k∘e^Γ); A split into the scratch and into its workspace slot (for intra).
  const int r0 = OT::row0(warp), c0 = OT::col0(warp), rt = r0 / 16;
  {
    bf16* sA = xs;              // [C, CS] A
    bf16* sV = sA + NP * pC;    // [C, KS] β v
    bf16* sKg = sV + NP * pX;   // [C, KS] β k∘e^Γ
    bf16* wA = reinterpret_cast<bf16*>(ws + lay.A());
    for (int idx = tid; idx < kC * kC / 2; idx += NTH) {
      const int i = idx / (kC / 2), j = 2 * (idx - i * (kC / 2));
      const float a0 = sa[i * kCP + j], a1 = sa[i * kCP + j + 1];
      put2(sA + i * kCS + j, pC, a0, a1, lo);
      put2(wA + i * kC + j, kC * kC, a0, a1, lo);
    }
    struct VK {  // four elements of a row's v and k
      float4 v, k;
    };
    staged<kC, K, NTH>(
        n,
        [&](int i, int d) {
          return VK{ld4(in_v<B16>(p) + base + int64_t(i) * HK + d), kCompact ? ld4(rowk(i) + d) : float4{}};
        },
        [&](int i, int d, const VK& x) {
          const float b = sb[i];
          const float4 v = x.v, kk = kCompact ? x.k : ld4(sk + i * KP + d), g4 = ld4(sg + i * KP + d);
          put4(sV + i * KS + d, pX, make_float4(b * v.x, b * v.y, b * v.z, b * v.w), lo);
          put4(sKg + i * KS + d, pX,
               make_float4(kk.x * (b * exp_ftz(g4.x)), kk.y * (b * exp_ftz(g4.y)), kk.z * (b * exp_ftz(g4.z)),
                           kk.w * (b * exp_ftz(g4.w))), lo);
        });
    __syncthreads();
    // A is lower triangular: row tile rt needs the k-steps 0 … rt. U is read by fwd_state alone, which does not run
    // given the forward's states.
    if (!p.kh) {
      float acc[1][OT::NT][4] = {};
      mma3<1, OT::NT, false, false>(acc, sA + r0 * kCS, kCS, 0, pC, sV + c0, KS, pX, 0, rt + 1, lo);
#pragma unroll
      for (int nt = 0; nt < OT::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
          st2(ws + lay.U() + i * K + d, acc[0][nt][2 * hf], acc[0][nt][2 * hf + 1]);
        }
    }
    {
      bf16* wW = reinterpret_cast<bf16*>(ws + lay.W());
      float acc[1][OT::NT][4] = {};
      mma3<1, OT::NT, false, false>(acc, sA + r0 * kCS, kCS, 0, pC, sKg + c0, KS, pX, 0, rt + 1, lo);
#pragma unroll
      for (int nt = 0; nt < OT::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
          put2(wW + i * K + d, kC * K, acc[0][nt][2 * hf], acc[0][nt][2 * hf + 1], lo);
        }
    }
  }
  __syncthreads();
  // Qgᵀ·dO [K, K] and Aqkᵀ·dO [C, K], sums over the chunk's rows (rows ≥ n are zero in Qg, dO and Aqk).
  {
    bf16* sQg = xs;             // [C, KS] q∘e^Γ
    bf16* sDo = sQg + NP * pX;  // [C, KS] dO
    bf16* sQk = sDo + NP * pX;  // [C, CS] Aqk
    for (int idx = tid; idx < kC * K / 2; idx += NTH) {
      const int i = idx / (K / 2), d = 2 * (idx - i * (K / 2));
      const float2 qi = q2(i, d), gi = ld2(sg + i * KP + d);
      put2(sQg + i * KS + d, pX, qi.x * exp_ftz(gi.x), qi.y * exp_ftz(gi.y), lo);
    }
    if (p.do16) stage_bf16<kC, K, NTH>(sDo, KS, p.do16 + base, HK, n);
    else stage_split<kC, K, NTH>(sDo, KS, pX, p.do_ + base, HK, n, lo);
    for (int idx = tid; idx < kC * kC / 2; idx += NTH) {
      const int i = idx / (kC / 2), j = 2 * (idx - i * (kC / 2));
      put2(sQk + i * kCS + j, pC, sqk[i * kCP + j], sqk[i * kCP + j + 1], lo);
    }
    sync_staged();
    const int kend = (n + 15) / 16;
    {
      constexpr int MT = K >= 64 ? 2 : 1;
      using HT = WarpTile<K, K, MT, NW>;
      if (HT::active(warp)) {
        const int d0 = HT::row0(warp), v0 = HT::col0(warp);
        float acc[MT][HT::NT][4] = {};
        mma3<MT, HT::NT, true, false>(acc, sQg + d0, KS, 16, pX, sDo + v0, KS, pX, 0, kend, lo);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < HT::NT; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              const int d = d0 + 16 * mt + gq + 8 * hf, v = v0 + 8 * nt + 2 * tq;
              st2(ws + lay.dh() + d * K + v, acc[mt][nt][2 * hf], acc[mt][nt][2 * hf + 1]);
            }
      }
    }
    {  // Aqkᵀ is upper triangular: row tile rt needs the k-steps rt … kend − 1.
      float acc[1][OT::NT][4] = {};
      mma3<1, OT::NT, true, false>(acc, sQk + r0, kCS, 16, pC, sDo + c0, KS, pX, rt, kend, lo);
#pragma unroll
      for (int nt = 0; nt < OT::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
          st2(ws + lay.du() + i * K + d, acc[0][nt][2 * hf], acc[0][nt][2 * hf + 1]);
        }
    }
  }
}

// ---- The state passes: per (sequence, head, TV value columns), sequential over the sequence's chunks. The state
// (or its gradient) [K, TV] stays in fp32 accumulators of the warps, and goes to shared memory in split bf16 as the
// operand of the chunk's first product. W and Kd are staged by cp.async from their split slots: in fwd_state the
// next chunk's one while this chunk's other product runs (one cp.async group per matrix, the older one always awaited
// first); bwd_state double-buffers them (below). ----

template <int K>
struct StateSmem {
  static constexpr int KS = K + 8, TV = state_cols<K>(), VS = TV + 8;
  static constexpr size_t bytes = size_t(2 * (K * VS + kC * VS + 2 * kC * KS)) * 2;
};

// fwd_state: S entering each chunk (into the h slot) and u = U − W·S; S ← e^γ∘S + Kdᵀ·u.
template <int K>
__global__ void __launch_bounds__(32 * kStateWarps, 1) fwd_state_kernel(Params p) {
  constexpr int NW = kStateWarps, NTH = 32 * NW;
  constexpr int KS = K + 8, TV = state_cols<K>(), VS = TV + 8;
  using ST = WarpTile<K, TV, 1, NW>;   // the state [K, TV]
  using UT = WarpTile<kC, TV, 1, NW>;  // u [C, TV]
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sS = reinterpret_cast<bf16*>(smem);  // [K, VS] the state's columns c0 …
  bf16* su = sS + 2 * K * VS;                // [C, VS] u
  bf16* sw = su + 2 * kC * VS;               // [C, KS] W
  bf16* skd = sw + 2 * kC * KS;              // [C, KS] Kd
  const int64_t seq = blockIdx.x, h = blockIdx.y, H = p.H;
  const int c0 = blockIdx.z * TV;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const Layout lay{K};
  const int64_t first = p.ch.seq_first_chunk[seq], count = p.ch.seq_num_chunks[seq];
  if (count <= 0) return;  // the whole block leaves
  const bool s_on = ST::active(warp);
  const int sr = ST::row0(warp), sc = ST::col0(warp), ur = UT::row0(warp), uc = UT::col0(warp);
  auto chunk_ws = [&](int64_t c) { return p.ws + (c * H + h) * lay.per(); };
  auto split_at = [&](int64_t c, int64_t off) { return reinterpret_cast<const bf16*>(chunk_ws(c) + off); };
  float S[1][ST::NT][4] = {};  // zero entering the sequence
  copy_split<kC, K, NTH>(sw, KS, kC * KS, split_at(first, lay.W()), p.lo);
  cp_async_commit();
  copy_split<kC, K, NTH>(skd, KS, kC * KS, split_at(first, lay.Kd()), p.lo);
  cp_async_commit();
  for (int64_t c = first; c < first + count; ++c) {
    float* ws = chunk_ws(c);
    const int n = p.ch.chunk_len[c];
    float U[UT::NT][4], eg[2] = {1.0f, 1.0f};  // loaded ahead of the products, which hide their latency
#pragma unroll
    for (int nt = 0; nt < UT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 x = ld2(ws + lay.U() + (ur + gq + 8 * hf) * K + c0 + uc + 8 * nt + 2 * tq);
        U[nt][2 * hf] = x.x;
        U[nt][2 * hf + 1] = x.y;
      }
    if (s_on) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) eg[hf] = exp_ftz(ws[lay.gl() + sr + gq + 8 * hf]);
#pragma unroll
      for (int nt = 0; nt < ST::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int d = sr + gq + 8 * hf, j = sc + 8 * nt + 2 * tq;
          put2(sS + d * VS + j, K * VS, S[0][nt][2 * hf], S[0][nt][2 * hf + 1], p.lo);
          st2(ws + lay.h() + d * K + c0 + j, S[0][nt][2 * hf], S[0][nt][2 * hf + 1]);
        }
    }
    cp_async_wait<1>();  // W of this chunk
    __syncthreads();     // … and everyone's copies of it; the state is in shared memory
    {
      float acc[1][UT::NT][4] = {};
      mma3<1, UT::NT, false, false>(acc, sw + ur * KS, KS, 0, kC * KS, sS + uc, VS, K * VS, 0, K / 16, p.lo);
#pragma unroll
      for (int nt = 0; nt < UT::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = ur + gq + 8 * hf, j = uc + 8 * nt + 2 * tq;
          const float u0 = U[nt][2 * hf] - acc[0][nt][2 * hf], u1 = U[nt][2 * hf + 1] - acc[0][nt][2 * hf + 1];
          put2(su + i * VS + j, kC * VS, u0, u1, p.lo);
          st2(ws + lay.u() + i * K + c0 + j, u0, u1);
        }
    }
    cp_async_wait<0>();  // Kd of this chunk
    __syncthreads();     // u complete, W and the state's copy no longer read
    if (c + 1 < first + count) copy_split<kC, K, NTH>(sw, KS, kC * KS, split_at(c + 1, lay.W()), p.lo);
    cp_async_commit();
    if (s_on) {  // rows ≥ n of Kd and u are zero
#pragma unroll
      for (int nt = 0; nt < ST::NT; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) S[0][nt][x] *= eg[x >> 1];
      mma3<1, ST::NT, true, false>(S, skd + sr, KS, 16, kC * KS, su + sc, VS, kC * VS, 0, (n + 15) / 16, p.lo);
    }
    __syncthreads();  // Kd and u no longer read
    if (c + 1 < first + count) copy_split<kC, K, NTH>(skd, KS, kC * KS, split_at(c + 1, lay.Kd()), p.lo);
    cp_async_commit();
  }
}

// bwd_state: backward over the chunks carrying dS: dSe of each chunk (into the dh slot, over Qgᵀ·dO, which this
// thread has read), du = Aqkᵀ·dO + Kd·dSe (over Aqkᵀ·dO in the du slot), dS0 = e^γ∘dSe + Qgᵀ·dO − Wᵀ·du. Each thread
// reads and rewrites only its own elements of the two slots. The chain over the chunks waits on nothing but its own
// products: W and Kd are double-buffered, the previous chunk's copies issued as a chunk starts (a whole chunk ahead
// of their use), and the slots' values of the previous chunk are loaded into registers while this one's products
// run (1.98 → 1.49 ms over the LoRA step's three layers on an H100, with mma3's PIPE). The split planes take shared
// memory only with lo (BwdStateSmem). At 250 registers a thread the pass holds every register of its SM: work on
// another stream gets only the SMs it leaves free (the output gate's backward beside it, train.cu).
template <int K>
struct BwdStateSmem {
  static constexpr int KS = K + 8, TV = state_cols<K>(), VS = TV + 8;
  static constexpr size_t bytes(bool lo) { return size_t(lo ? 2 : 1) * (K * VS + kC * VS + 4 * kC * KS) * 2; }
};

template <int K>
__global__ void __launch_bounds__(32 * kStateWarps, 1) bwd_state_kernel(Params p) {
  constexpr int NW = kStateWarps, NTH = 32 * NW;
  constexpr int KS = K + 8, TV = state_cols<K>(), VS = TV + 8;
  using ST = WarpTile<K, TV, 1, NW>;
  using UT = WarpTile<kC, TV, 1, NW>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int np = p.lo ? 2 : 1;                // planes held (the lo plane's place is never read without lo)
  bf16* sdS = reinterpret_cast<bf16*>(smem);  // [K, VS] the gradient of the state leaving the chunk
  bf16* sdu = sdS + np * K * VS;              // [C, VS]
  bf16* sbuf = sdu + np * kC * VS;            // buffer b: W at sbuf + 2b·np·C·KS, Kd one matrix on ([C, KS] each)
  auto sw = [&](int b) { return sbuf + (2 * b) * np * kC * KS; };
  auto skd = [&](int b) { return sbuf + (2 * b + 1) * np * kC * KS; };
  const int64_t seq = blockIdx.x, h = blockIdx.y, H = p.H;
  const int c0 = blockIdx.z * TV;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const Layout lay{K};
  const int64_t first = p.ch.seq_first_chunk[seq], count = p.ch.seq_num_chunks[seq];
  if (count <= 0) return;  // the whole block leaves
  const bool s_on = ST::active(warp);
  const int sr = ST::row0(warp), sc = ST::col0(warp), ur = UT::row0(warp), uc = UT::col0(warp);
  auto chunk_ws = [&](int64_t c) { return p.ws + (c * H + h) * lay.per(); };
  auto split_at = [&](int64_t c, int64_t off) { return reinterpret_cast<const bf16*>(chunk_ws(c) + off); };
  // Aqkᵀ·dO, Qgᵀ·dO and e^γ of a chunk: this thread's elements.
  auto load_parts = [&](int64_t c, float (&du0)[UT::NT][4], float (&p0)[ST::NT][4], float (&eg)[2]) {
    const float* ws = chunk_ws(c);
#pragma unroll
    for (int nt = 0; nt < UT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 x = ld2(ws + lay.du() + (ur + gq + 8 * hf) * K + c0 + uc + 8 * nt + 2 * tq);
        du0[nt][2 * hf] = x.x;
        du0[nt][2 * hf + 1] = x.y;
      }
    if (s_on) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) eg[hf] = exp_ftz(ws[lay.gl() + sr + gq + 8 * hf]);
#pragma unroll
      for (int nt = 0; nt < ST::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 x = ld2(ws + lay.dh() + (sr + gq + 8 * hf) * K + c0 + sc + 8 * nt + 2 * tq);
          p0[nt][2 * hf] = x.x;
          p0[nt][2 * hf + 1] = x.y;
        }
    }
  };
  float dS[1][ST::NT][4] = {};  // zero leaving the sequence
  const int64_t last = first + count - 1;
  copy_split<kC, K, NTH>(skd(0), KS, kC * KS, split_at(last, lay.Kd()), p.lo);
  copy_split<kC, K, NTH>(sw(0), KS, kC * KS, split_at(last, lay.W()), p.lo);
  cp_async_commit();
  float du0[UT::NT][4], p0[ST::NT][4], eg[2] = {1.0f, 1.0f};
  load_parts(last, du0, p0, eg);
  for (int64_t c = last; c >= first; --c) {
    const int b = static_cast<int>((last - c) & 1);
    float* ws = chunk_ws(c);
    const int n = p.ch.chunk_len[c];
    // The previous chunk's W and Kd into the other buffer (read last by the chunk after this one, before its final
    // barrier).
    if (c > first) {
      copy_split<kC, K, NTH>(skd(b ^ 1), KS, kC * KS, split_at(c - 1, lay.Kd()), p.lo);
      copy_split<kC, K, NTH>(sw(b ^ 1), KS, kC * KS, split_at(c - 1, lay.W()), p.lo);
    }
    cp_async_commit();
    if (s_on) {
#pragma unroll
      for (int nt = 0; nt < ST::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int d = sr + gq + 8 * hf, j = sc + 8 * nt + 2 * tq;
          put2(sdS + d * VS + j, K * VS, dS[0][nt][2 * hf], dS[0][nt][2 * hf + 1], p.lo);
          st2(ws + lay.dh() + d * K + c0 + j, dS[0][nt][2 * hf], dS[0][nt][2 * hf + 1]);
        }
    }
    cp_async_wait<1>();  // W and Kd of this chunk
    __syncthreads();     // … and everyone's copies of them; dSe is in shared memory
    {  // du = Aqkᵀ·dO + Kd·dSe
      float acc[1][UT::NT][4] = {};
      mma3<1, UT::NT, false, false, true>(acc, skd(b) + ur * KS, KS, 0, kC * KS, sdS + uc, VS, K * VS, 0, K / 16, p.lo);
#pragma unroll
      for (int nt = 0; nt < UT::NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = ur + gq + 8 * hf, j = uc + 8 * nt + 2 * tq;
          const float a0 = du0[nt][2 * hf] + acc[0][nt][2 * hf], a1 = du0[nt][2 * hf + 1] + acc[0][nt][2 * hf + 1];
          put2(sdu + i * VS + j, kC * VS, a0, a1, p.lo);
          st2(ws + lay.du() + i * K + c0 + j, a0, a1);
        }
    }
    __syncthreads();  // du complete
    float p1[ST::NT][4], eg1[2] = {1.0f, 1.0f};
    if (c > first) load_parts(c - 1, du0, p1, eg1);  // du0 is consumed; p0 and e^γ are in use below
    if (s_on) {  // dS0 = e^γ∘dSe + Qgᵀ·dO − Wᵀ·du (rows ≥ n of W and du are zero)
      float acc[1][ST::NT][4] = {};
      mma3<1, ST::NT, true, false, true>(acc, sw(b) + sr, KS, 16, kC * KS, sdu + sc, VS, kC * VS, 0, (n + 15) / 16,
                                         p.lo);
#pragma unroll
      for (int nt = 0; nt < ST::NT; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) dS[0][nt][x] = fmaf(eg[x >> 1], dS[0][nt][x], p0[nt][x]) - acc[0][nt][x];
    }
#pragma unroll
    for (int nt = 0; nt < ST::NT; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) p0[nt][x] = p1[nt][x];
    eg[0] = eg1[0], eg[1] = eg1[1];
    __syncthreads();  // W, Kd, du and dSe's copy no longer read
  }
}

// ---- inter: per (chunk, head), the products with S0 and dSe (contractions over the value dim) and dAqk ----

template <int K>
struct InterSmem {
  static constexpr int KS = K + 8, FS = K + 8;  // FS: row stride of the fp32 [C, K] staging of dq and dk
  static constexpr size_t bytes = size_t(2 * K * KS + 4 * kC * KS) * 2 + size_t(5 * K + kC * FS) * 4;
};

template <int K, bool B16>
__global__ void __launch_bounds__(32 * chunk_warps<K>(), 1) inter_kernel(Params p) {
  constexpr int NW = chunk_warps<K>(), NTH = 32 * NW;
  constexpr int KS = K + 8, FS = InterSmem<K>::FS, pX = kC * KS, pS = K * KS;
  using OT = WarpTile<kC, K, 1, NW>;   // the [C, K] outputs: rows 16·(w % 4) …, columns K/CG·(w / 4) …
  using CT = WarpTile<kC, kC, 1, NW>;  // dAqk: rows 16·(w % 4) …, columns 64/CG·(w / 4) …
  constexpr int NT = OT::NT;
  static_assert(OT::RT == 4 && OT::RT * OT::CG == NW && CT::RT == 4 && CT::RT * CT::CG == NW, "one tile per warp");
  static_assert(kC * K * 4 <= (2 * K * KS + 2 * kC * KS) * 2, "dΓ fits over S0 and du");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sS = reinterpret_cast<bf16*>(smem);                  // [K, KS] S0, then dSe
  bf16* sx = sS + 2 * pS;                                    // [C, KS] du, then u
  bf16* so = sx + 2 * pX;                                    // [C, KS] dO
  float* sdir = reinterpret_cast<float*>(so + 2 * pX);       // [K] rowsum(S0∘dSe)
  float* scol = sdir + K;                                    // [4, K] Σ over a row tile of dKd∘Kd
  float* sst = scol + 4 * K;                                 // [C, FS] dq's, then dk's terms, for add_tile
  float* sdg = reinterpret_cast<float*>(smem);               // [C, K] dΓ, at the end (over S and sx)
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.H, HK = H * K;
  const int t0 = p.ch.chunk_start[c], n = p.ch.chunk_len[c];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const Layout lay{K};
  float* ws = p.ws + (c * H + h) * lay.per();
  const int64_t base = t0 * HK + h * K;
  const int r0 = OT::row0(warp), c0 = OT::col0(warp), rt = r0 / 16;
  float dG[NT][4];  // dΓ of this thread's elements

  // S0 with its lo plane in either mode: rowsum(S0∘dSe) below reads it whole (get4), not through the products.
  stage_split<K, K, NTH>(sS, KS, pS, p.kh ? p.kh + (c * H + h) * K * K : ws + lay.h(), K, K, true);
  stage_split<kC, K, NTH>(sx, KS, pX, ws + lay.du(), K, kC, p.lo);
  if (p.do16) stage_bf16<kC, K, NTH>(so, KS, p.do16 + base, HK, n);
  else stage_split<kC, K, NTH>(so, KS, pX, p.do_ + base, HK, n, p.lo);
  sync_staged();
  // dq and dk leave through sst: the accumulators are pairs on 8 rows a warp, while add_tile moves the staged tile in
  // 16-byte pieces along whole rows, a quarter of the global accesses and in whole sectors.
  {  // dW = −du·S0ᵀ (into its slot, split) and dQg = dO·S0ᵀ: dq += dQg∘e^Γ, dΓ = dQg∘Qg (du and dO as two m-tiles)
    float acc[2][NT][4] = {};
    mma3<2, NT, false, true>(acc, sx + r0 * KS, KS, 2 * pX, pX, sS + c0 * KS, KS, pS, 0, K / 16, p.lo);
    bf16* wdW = reinterpret_cast<bf16*>(ws + lay.dW());
    constexpr int NG = group_of<NT>();
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += NG) {
      float2 g2[NG][2], q2[NG][2];  // Γ and q at this thread's elements
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * (n0 + j) + 2 * tq;
          const bool in = i < n;
          g2[j][hf] = in ? ld2(ws + lay.G() + i * K + d) : make_float2(0.0f, 0.0f);
          q2[j][hf] = in ? ld2(in_q<B16>(p) + base + int64_t(i) * HK + d) : make_float2(0.0f, 0.0f);
        }
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int nt = n0 + j, i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
          put2(wdW + i * K + d, kC * K, -acc[0][nt][2 * hf], -acc[0][nt][2 * hf + 1], p.lo);
          const float d0 = acc[1][nt][2 * hf] * exp_ftz(g2[j][hf].x);
          const float d1 = acc[1][nt][2 * hf + 1] * exp_ftz(g2[j][hf].y);
          dG[nt][2 * hf] = d0 * q2[j][hf].x;  // zero on rows ≥ n (q = 0 there)
          dG[nt][2 * hf + 1] = d1 * q2[j][hf].y;
          st2(sst + i * FS + d, d0, d1);
        }
    }
  }
  __syncthreads();  // S0 and du no longer read; dq's terms staged
  add_tile<K, NTH>(p.dq + base, HK, sst, FS, n, p.accumulate);
  // dSe over S0 in place (each thread rewrites what it reads), with rowsum(S0∘dSe) on the way: the K/4 threads of a
  // row are neighbours within a warp. u over du.
  static_assert(32 % (K / 4) == 0, "whole rows of the staging per warp");
  staged<K, K, NTH>(
      K, [&](int r, int cc) { return ld4(ws + lay.dh() + r * K + cc); },
      [&](int r, int cc, float4 x) {
        bf16* at = sS + r * KS + cc;
        const float4 s0 = get4(at, pS, true);
        float s = s0.x * x.x + s0.y * x.y + s0.z * x.z + s0.w * x.w;
        put4(at, pS, x, p.lo);
#pragma unroll
        for (int o = K / 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (cc == 0) sdir[r] = s;
      });
  // (The forward's u holds the chunk's rows alone; the workspace's rows ≥ n are zeros.)
  if (p.ku16) stage_bf16<kC, K, NTH>(sx, KS, p.ku16 + (c * H + h) * kC * K, K, n);
  else if (p.ku) stage_split<kC, K, NTH>(sx, KS, pX, p.ku + (c * H + h) * kC * K, K, n, p.lo);
  else stage_split<kC, K, NTH>(sx, KS, pX, ws + lay.u(), K, kC, p.lo);
  sync_staged();
  float colp[NT][2];  // Σ over this thread's rows of dKd∘Kd, per column
  {  // dKd = u·dSeᵀ: dk += dKd∘e^(γ−Γ), dΓ −= dKd∘Kd, dγ += Σ_i dKd∘Kd
    float acc[1][NT][4] = {};
    mma3<1, NT, false, true>(acc, sx + r0 * KS, KS, 0, pX, sS + c0 * KS, KS, pS, 0, K / 16, p.lo);
    constexpr int NG = group_of<NT>();
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += NG) {
      float2 g2[NG][2], l2[NG], k2[NG][2];  // Γ, γ and k at this thread's elements
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        l2[j] = ld2(ws + lay.gl() + c0 + 8 * (n0 + j) + 2 * tq);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * (n0 + j) + 2 * tq;
          const bool in = i < n;
          g2[j][hf] = in ? ld2(ws + lay.G() + i * K + d) : make_float2(0.0f, 0.0f);
          k2[j][hf] = in ? ld2(in_k<B16>(p) + base + int64_t(i) * HK + d) : make_float2(0.0f, 0.0f);
        }
      }
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        const int nt = n0 + j;
        colp[nt][0] = colp[nt][1] = 0.0f;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
          const float e0 = exp_ftz(l2[j].x - g2[j][hf].x), e1 = exp_ftz(l2[j].y - g2[j][hf].y);
          const float a0 = acc[0][nt][2 * hf], a1 = acc[0][nt][2 * hf + 1];
          const float kd0 = k2[j][hf].x * e0, kd1 = k2[j][hf].y * e1;  // zero on rows ≥ n (k = 0 there)
          dG[nt][2 * hf] -= a0 * kd0;
          dG[nt][2 * hf + 1] -= a1 * kd1;
          colp[nt][0] = fmaf(a0, kd0, colp[nt][0]);
          colp[nt][1] = fmaf(a1, kd1, colp[nt][1]);
          st2(sst + i * FS + d, a0 * e0, a1 * e1);
        }
      }
    }
  }
  {  // dAqk = lower(dO·uᵀ) into the U slot; tiles wholly above the diagonal are zero
    const int i0 = CT::row0(warp), j0 = CT::col0(warp);
    float acc[1][CT::NT][4] = {};
    if (j0 < i0 + 16) mma3<1, CT::NT, false, true>(acc, so + i0 * KS, KS, 0, pX, sx + j0 * KS, KS, pX, 0, K / 16, p.lo);
#pragma unroll
    for (int nt = 0; nt < CT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = i0 + gq + 8 * hf, j = j0 + 8 * nt + 2 * tq;
        st2(ws + lay.U() + i * kC + j, j <= i ? acc[0][nt][2 * hf] : 0.0f, j + 1 <= i ? acc[0][nt][2 * hf + 1] : 0.0f);
      }
  }
  // Column sums of dKd∘Kd over the warp's 16 rows (lanes of equal t), one partial per row tile.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float s = colp[nt][e];
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      s += __shfl_xor_sync(0xffffffffu, s, 8);
      s += __shfl_xor_sync(0xffffffffu, s, 16);
      if (gq == 0) scol[rt * K + c0 + 8 * nt + 2 * tq + e] = s;
    }
  __syncthreads();  // dSe and u no longer read; dk's terms staged
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      st2(sdg + (r0 + gq + 8 * hf) * K + c0 + 8 * nt + 2 * tq, dG[nt][2 * hf], dG[nt][2 * hf + 1]);
  add_tile<K, NTH>(p.dk + base, HK, sst, FS, n, p.accumulate);
  __syncthreads();
  // Per column d: dγ, then the reverse cumsum of dΓ over the rows, in place; then into dg.
  for (int d = tid; d < K; d += NTH) {
    float dgam = scol[d] + scol[K + d] + scol[2 * K + d] + scol[3 * K + d];
    dgam = fmaf(exp_ftz(ws[lay.gl() + d]), sdir[d], dgam);
    float run = 0.0f;
    for (int i = n - 1; i >= 0; --i) {
      run += sdg[i * K + d];
      sdg[i * K + d] = run + dgam;
    }
  }
  __syncthreads();
  add_tile<K, NTH>(p.dg + base, HK, sdg, K, n, p.accumulate);
}

// ---- intra: per (chunk, head), the WY factors' and the intra-chunk products' gradients ----

// Shared memory, byte offsets. Phases 1–4 (the WY factors): A, du (then T1 = Aᵀ·dA), dW, β v, β Kg, dA (all split).
// Phase 5 (the products through the decay): Γ, q, k (fp32), dAqk and dM (fp32 and split) and a split scratch of 96
// rows; dM is written at the end of phase 4, clear of A and T1, which that phase reads.
template <int K>
struct IntraSmem {
  static constexpr int CG = WarpTile<kC, K, 1, chunk_warps<K>()>::CG;  // column groups of the [C, K] tiles
  static constexpr int KS = K + 8, FS = K + 8;  // FS: row stride of the fp32 [C, K] matrices (float2 per lane)
  static constexpr int XS = kC * KS * 4, CSB = kC * kCS * 4, F = kC * FS * 4, FC = kC * kCP * 4;
  static constexpr int A = 0, du = CSB, T1 = CSB, dW = CSB + XS, bv = CSB + 2 * XS, bk = CSB + 3 * XS,
                       dA = CSB + 4 * XS, end14 = 2 * CSB + 4 * XS;
  static constexpr int G = 0, q = F, k = 2 * F, qkf = 3 * F, mf = 3 * F + FC, qks = 3 * F + 2 * FC, ms = qks + CSB,
                       xs = ms + CSB, end5 = xs + 96 * KS * 4;
  static constexpr int misc = end14 > end5 ? end14 : end5;  // β [C], dβ partials [CG, C]
  static constexpr int dv = end14;  // fp32 [C, FS] staging of dv's terms, phases 1–4 (past their matrices)
  static constexpr size_t bytes = size_t(misc) + (1 + CG) * kC * 4;
  static_assert(mf >= T1 + CSB, "dM clears A and T1");
  static_assert(dv + F <= misc, "dv's staging clears β");
};

template <int K, bool B16>
__global__ void __launch_bounds__(32 * chunk_warps<K>(), 1) intra_kernel(Params p) {
  using L = IntraSmem<K>;
  constexpr int NW = chunk_warps<K>(), NTH = 32 * NW;
  constexpr int KS = K + 8, FS = L::FS, pX = kC * KS, pC = kC * kCS, pS = 96 * KS;
  using OT = WarpTile<kC, K, 1, NW>;
  using CT = WarpTile<kC, kC, 1, NW>;
  constexpr int NT = OT::NT, CG = OT::CG;
  static_assert(OT::RT == 4 && OT::RT * CG == NW && CT::RT == 4 && CT::RT * CT::CG == NW,
                "one tile per warp, rows alike");
  extern __shared__ __align__(16) unsigned char smem[];
  auto bfp = [&](int off) { return reinterpret_cast<bf16*>(smem + off); };
  auto flp = [&](int off) { return reinterpret_cast<float*>(smem + off); };
  bf16 *sA = bfp(L::A), *sdu = bfp(L::du), *sT1 = bfp(L::T1), *sdW = bfp(L::dW), *sbv = bfp(L::bv),
       *sbk = bfp(L::bk), *sdA = bfp(L::dA);
  float *fG = flp(L::G), *fq = flp(L::q), *fk = flp(L::k), *fqk = flp(L::qkf), *fm = flp(L::mf), *fdv = flp(L::dv);
  bf16 *sqk = bfp(L::qks), *sms = bfp(L::ms), *sx = bfp(L::xs);
  float* sb = flp(L::misc);  // [C] β
  float* sdb = sb + kC;      // [CG, C] dβ, per column group
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.H, HK = H * K;
  const int t0 = p.ch.chunk_start[c], n = p.ch.chunk_len[c], nb = (n + 15) / 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const Layout lay{K};
  const float* ws = p.ws + (c * H + h) * lay.per();
  const int64_t base = t0 * HK + h * K;
  // The warp's tiles: rows r0 … r0+15 (row block rt); [C, K] outputs on columns c0 … (column group cg), [C, C] ones
  // on j0 ….
  const int r0 = OT::row0(warp), c0 = OT::col0(warp), rt = r0 / 16, cg = warp / OT::RT, j0 = CT::col0(warp);
  float* sdbh = sdb + cg * kC;
  float dq[NT][4], dk[NT][4], dG[NT][4];  // this thread's elements of dq, dk and dΓ

  // Phase 1: A, dW (split slots), du, β v, β Kg.
  copy_split<kC, kC, NTH>(sA, kCS, pC, reinterpret_cast<const bf16*>(ws + lay.A()), p.lo);
  copy_split<kC, K, NTH>(sdW, KS, pX, reinterpret_cast<const bf16*>(ws + lay.dW()), p.lo);
  cp_async_commit();
  for (int i = tid; i < kC; i += NTH) sb[i] = i < n ? p.beta[(t0 + i) * H + h] : 0.0f;
  for (int i = tid; i < CG * kC; i += NTH) sdb[i] = 0.0f;
  stage_split<kC, K, NTH>(sdu, KS, pX, ws + lay.du(), K, kC, p.lo);
  struct VB {  // a row's β and four elements of v (or k) and Γ
    float4 x, g;
    float b;
  };
  staged<kC, K, NTH>(
      n,
      [&](int r, int cc) {
        return VB{ld4(in_v<B16>(p) + base + int64_t(r) * HK + cc), {}, p.beta[(t0 + r) * H + h]};
      },
      [&](int r, int cc, const VB& a) {
        put4(sbv + r * KS + cc, pX, make_float4(a.b * a.x.x, a.b * a.x.y, a.b * a.x.z, a.b * a.x.w), p.lo);
      });
  staged<kC, K, NTH>(
      n,
      [&](int r, int cc) {
        return VB{ld4(in_k<B16>(p) + base + int64_t(r) * HK + cc), ld4(ws + lay.G() + r * K + cc),
                  p.beta[(t0 + r) * H + h]};
      },
      [&](int r, int cc, const VB& a) {
        put4(sbk + r * KS + cc, pX,
             make_float4(a.b * a.x.x * exp_ftz(a.g.x), a.b * a.x.y * exp_ftz(a.g.y), a.b * a.x.z * exp_ftz(a.g.z),
                         a.b * a.x.w * exp_ftz(a.g.w)), p.lo);
      });
  bool wide = false;  // as prep decides it, from the same Γ
  for (int idx = tid; idx < (kC / 16) * K; idx += NTH) {
    const int b = idx / K, d = idx - b * K;
    const float* gc = ws + lay.G() + d;
    wide |= diag_wide(gc[16 * b * K], gc[(16 * b + 8) * K], gc[(16 * b + 15) * K]);
  }
  cp_async_wait<0>();
  const bool diag_mma = !__syncthreads_or(wide);
  // Aᵀ is upper triangular: row tile rt needs the k-steps rt …; rows ≥ n of du and dW are zero.
  // dv, dq and dk leave through fp32 staging tiles (add_tile: 16-byte pieces along whole rows, a quarter of the
  // global accesses of the accumulators' pairs on 8 rows a warp).
  {  // d(βv) = Aᵀ·du: dv += β·d(βv), dβ += rowsum(v∘d(βv))
    float acc[1][NT][4] = {}, rs[2] = {0.0f, 0.0f};
    mma3<1, NT, true, false>(acc, sA + r0, kCS, 16, pC, sdu + c0, KS, pX, rt, nb, p.lo);
    constexpr int NG = group_of<NT>();
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += NG) {
      float2 v2[NG][2];  // v at this thread's elements
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = r0 + gq + 8 * hf, d = c0 + 8 * (n0 + j) + 2 * tq;
          v2[j][hf] = i < n ? ld2(in_v<B16>(p) + base + int64_t(i) * HK + d) : make_float2(0.0f, 0.0f);
        }
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int nt = n0 + j, i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
          const float a0 = acc[0][nt][2 * hf], a1 = acc[0][nt][2 * hf + 1];
          rs[hf] = fmaf(v2[j][hf].x, a0, fmaf(v2[j][hf].y, a1, rs[hf]));
          st2(fdv + i * FS + d, sb[i] * a0, sb[i] * a1);
        }
    }
    add_rows(sdbh, r0, rs);
  }
  {  // d(βKg) = Aᵀ·dW: dKg = β·d(βKg); dk = dKg∘e^Γ, dΓ = dKg∘Kg, dβ += rowsum(Kg∘d(βKg))
    float acc[1][NT][4] = {}, rs[2] = {0.0f, 0.0f};
    mma3<1, NT, true, false>(acc, sA + r0, kCS, 16, pC, sdW + c0, KS, pX, rt, nb, p.lo);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq;
#pragma unroll
        for (int x = 2 * hf; x < 2 * hf + 2; ++x) dq[nt][x] = dk[nt][x] = dG[nt][x] = 0.0f;
        if (i < n) {
          const int64_t e = base + int64_t(i) * HK + d;
          const float2 g2 = ld2(ws + lay.G() + i * K + d), k2 = ld2(in_k<B16>(p) + e);
          const float eg[2] = {exp_ftz(g2.x), exp_ftz(g2.y)}, kg[2] = {k2.x * eg[0], k2.y * eg[1]};
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const float a = acc[0][nt][2 * hf + b], dkg = sb[i] * a;
            dk[nt][2 * hf + b] = dkg * eg[b];
            dG[nt][2 * hf + b] = dkg * kg[b];
            rs[hf] = fmaf(kg[b], a, rs[hf]);
          }
        }
      }
    add_rows(sdbh, r0, rs);
  }
  {  // Phase 2: dA = strict_lower(du·(βv)ᵀ + dW·(βKg)ᵀ); tiles wholly above the diagonal are zero
    float acc[1][CT::NT][4] = {};
    if (j0 < r0 + 16) {
      mma3<1, CT::NT, false, true>(acc, sdu + r0 * KS, KS, 0, pX, sbv + j0 * KS, KS, pX, 0, K / 16, p.lo);
      mma3<1, CT::NT, false, true>(acc, sdW + r0 * KS, KS, 0, pX, sbk + j0 * KS, KS, pX, 0, K / 16, p.lo);
    }
#pragma unroll
    for (int nt = 0; nt < CT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = r0 + gq + 8 * hf, j = j0 + 8 * nt + 2 * tq;
        put2(sdA + i * kCS + j, pC, j < i ? acc[0][nt][2 * hf] : 0.0f, j + 1 < i ? acc[0][nt][2 * hf + 1] : 0.0f,
             p.lo);
      }
  }
  __syncthreads();
  add_tile<K, NTH>(p.dv + base, HK, fdv, FS, n, p.accumulate);  // read before phase 5's scratch covers it
  {  // Phase 3: T1 = Aᵀ·dA (over du; rows ≥ n of dA are zero)
    float acc[1][CT::NT][4] = {};
    mma3<1, CT::NT, true, false>(acc, sA + r0, kCS, 16, pC, sdA + j0, kCS, pC, rt, nb, p.lo);
#pragma unroll
    for (int nt = 0; nt < CT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        put2(sT1 + (r0 + gq + 8 * hf) * kCS + j0 + 8 * nt + 2 * tq, pC, acc[0][nt][2 * hf], acc[0][nt][2 * hf + 1],
             p.lo);
  }
  __syncthreads();
  {  // Phase 4: dL = −strict_lower(T1·Aᵀ); dβ += rowsum(dL∘M), dM = β·dL (split and fp32). Aᵀ[m, j] = A[j, m] is
     // zero for m > j and T1[i, m] for m ≥ n: the k-steps below min(nb, (j0 + 8·NT + 15)/16).
    float acc[1][CT::NT][4] = {}, rs[2] = {0.0f, 0.0f};
    float2 m2[CT::NT][2];  // M at this thread's elements, loaded ahead of the product
#pragma unroll
    for (int nt = 0; nt < CT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) m2[nt][hf] = ld2(ws + lay.M() + (r0 + gq + 8 * hf) * kC + j0 + 8 * nt + 2 * tq);
    if (j0 < r0 + 16)
      mma3<1, CT::NT, false, true>(acc, sT1 + r0 * kCS, kCS, 0, pC, sA + j0 * kCS, kCS, pC, 0,
                                   min(nb, (j0 + 8 * CT::NT + 15) / 16), p.lo);
#pragma unroll
    for (int nt = 0; nt < CT::NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = r0 + gq + 8 * hf, j = j0 + 8 * nt + 2 * tq;
        const float l0 = j < i ? -acc[0][nt][2 * hf] : 0.0f, l1 = j + 1 < i ? -acc[0][nt][2 * hf + 1] : 0.0f;
        rs[hf] = fmaf(l0, m2[nt][hf].x, fmaf(l1, m2[nt][hf].y, rs[hf]));  // M rows ≥ n are zero
        const float m0 = sb[i] * l0, m1 = sb[i] * l1;
        put2(sms + i * kCS + j, pC, m0, m1, p.lo);
        fm[i * kCP + j] = m0;
        fm[i * kCP + j + 1] = m1;
      }
    add_rows(sdbh, r0, rs);
  }
  __syncthreads();
  // Phase 5. Through Aqk and M with the decay e^(Γ_i − Γ_j), j ≤ i:
  //   X_i = Σ_j dAqk[i,j] k_j e, Y_i = Σ_j dM[i,j] k_j e, Z_j = Σ_i (dAqk[i,j] q_i + dM[i,j] k_i) e;
  //   dq_i += X_i, dk_i += Y_i, dk_j += Z_j, dΓ_i += q_i X_i + k_i Y_i, dΓ_j −= k_j Z_j.
  // Γ, q, k and dAqk staged; then, for X and Y across blocks, the scratch rows 8·bi·(bi − 1) + j hold
  // k_j e^(Γ_r − Γ_j), j < r = 16·bi, for the row blocks bi = 1 … 3.
  {
    struct GQK {
      float4 g, q, k;
    };
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    staged<kC, K, NTH>(
        kC,  // Γ on every row, q and k zero on rows ≥ n
        [&](int i, int cc) {
          const int64_t e = base + int64_t(i) * HK + cc;
          return GQK{ld4(ws + lay.G() + i * K + cc), i < n ? ld4(in_q<B16>(p) + e) : zero,
                     i < n ? ld4(in_k<B16>(p) + e) : zero};
        },
        [&](int i, int cc, const GQK& x) {
          *reinterpret_cast<float4*>(fG + i * FS + cc) = x.g;
          *reinterpret_cast<float4*>(fq + i * FS + cc) = x.q;
          *reinterpret_cast<float4*>(fk + i * FS + cc) = x.k;
        });
    staged<kC, kC, NTH>(
        kC, [&](int i, int j) { return ld4(ws + lay.U() + i * kC + j); },
        [&](int i, int j, float4 a) {
          float* f = fqk + i * kCP + j;
          f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
          put4(sqk + i * kCS + j, pC, a, p.lo);
        });
  }
  __syncthreads();
  for (int idx = tid; idx < 96 * K / 2; idx += NTH) {
    const int row = idx / (K / 2), d = 2 * (idx - row * (K / 2));
    const int bi = row < 16 ? 1 : (row < 48 ? 2 : 3), j = row - 8 * bi * (bi - 1), r = 16 * bi;
    const float2 kj = ld2(fk + j * FS + d), gj = ld2(fG + j * FS + d), gr = ld2(fG + r * FS + d);
    put2(sx + row * KS + d, pS, kj.x * exp_ftz(gr.x - gj.x), kj.y * exp_ftz(gr.y - gj.y), p.lo);
  }
  __syncthreads();
  // Pairs within the warp's own 16-row block. With diag_mma on tensor cores, the decay split at the block's middle
  // row rm = r0 + 8 (as in prep): X = e^(Γ_i − Γ_rm)·(dAqk·k̂), Y = e^(Γ_i − Γ_rm)·(dM·k̂) and
  // Z = e^(Γ_rm − Γ_j)·(dAqkᵀ·q̃ + dMᵀ·k̃) over the block's 16 rows, with k̂_j = k_j e^(Γ_rm − Γ_j) and
  // q̃_i, k̃_i = q_i, k_i times e^(Γ_i − Γ_rm) formed in registers as the B fragments; the blocks of dAqk and dM are
  // zero above their diagonals (dM on it too), which drops the pairs j > i. The pairs i = j (decay 1) are left out of
  // the products and added in fp32: dq_i += dAqk[i, i]·k_i, dk_i += dAqk[i, i]·q_i, and nothing to dΓ_i, where their
  // terms q_i·X_i and −k_i·Z_i cancel exactly. Taken through the products, each with its own ~1e-5 rounding, they
  // left that rounding of the largest pairs in dg (1.5e-4 from the recurrence under strong decays; 2.9e-5 at most now).
  if (diag_mma) {
    if (r0 < n) {
      const int rm = r0 + 8;
      // X and Y, then Z; the A fragments loaded again for each n-tile (fewer registers live at once).
#pragma unroll 1
      for (int which = 0; which < 2; ++which) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t aqh[4], aql[4], amh[4], aml[4];
          if (which == 0) {
            load_a(aqh, sqk + r0 * kCS + r0, kCS);
            load_a(aql, sqk + pC + r0 * kCS + r0, kCS);
            load_a(amh, sms + r0 * kCS + r0, kCS);
            load_a(aml, sms + pC + r0 * kCS + r0, kCS);
          } else {
            load_a_t(aqh, sqk + r0 * kCS + r0, kCS);
            load_a_t(aql, sqk + pC + r0 * kCS + r0, kCS);
            load_a_t(amh, sms + r0 * kCS + r0, kCS);
            load_a_t(aml, sms + pC + r0 * kCS + r0, kCS);
          }
          drop_diagonal(aqh);
          drop_diagonal(aql);
          const int db = c0 + 8 * nt + gq;  // the B fragments' column
          const float gmb = fG[rm * FS + db];
          float b1[4], b2[4];  // k̂ (X, Y), or q̃ and k̃ (Z)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = r0 + 2 * tq + (e & 1) + 8 * (e >> 1), at = r * FS + db;
            const float kr = fk[at];
            if (which == 0) {
              b1[e] = kr * exp_ftz(gmb - fG[at]);
            } else {
              const float u = exp_ftz(fG[at] - gmb);
              b1[e] = fq[at] * u;
              b2[e] = kr * u;
            }
          }
          uint32_t bh[2], bl[2];
          float acc[2][4] = {};
          split_b(bh, bl, b1);
          mma_split(acc[0], aqh, aql, bh, bl, p.lo);
          if (which == 0) {
            mma_split(acc[1], amh, aml, bh, bl, p.lo);
          } else {
            split_b(bh, bl, b2);
            mma_split(acc[0], amh, aml, bh, bl, p.lo);
          }
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = r0 + gq + 8 * hf, d = c0 + 8 * nt + 2 * tq, at = i * FS + d;
            const float2 g2 = ld2(fG + at), gm2 = ld2(fG + rm * FS + d), q2 = ld2(fq + at), k2 = ld2(fk + at);
            const float gi[2] = {g2.x, g2.y}, gm[2] = {gm2.x, gm2.y}, qi[2] = {q2.x, q2.y}, ki[2] = {k2.x, k2.y};
            const float dii = fqk[i * kCP + i];  // dAqk[i, i]
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const int x = 2 * hf + b;
              if (which == 0) {
                const float u = exp_ftz(gi[b] - gm[b]), X = acc[0][x] * u, Y = acc[1][x] * u;
                dq[nt][x] += fmaf(dii, ki[b], X);
                dk[nt][x] += Y;
                dG[nt][x] += qi[b] * X + ki[b] * Y;
              } else {
                const float Z = acc[0][x] * exp_ftz(gm[b] - gi[b]);
                dk[nt][x] += fmaf(dii, qi[b], Z);
                dG[nt][x] -= ki[b] * Z;
              }
            }
          }
        }
      }
    }
  }
  // Else element by element: for row m = r0 + l and this thread's row i, e = e^(−|Γ_i − Γ_m|) is e^(Γ_i − Γ_m) when
  // m ≤ i (X, Y of row i) and e^(Γ_m − Γ_i) when m ≥ i (Z of row i as the earlier row). Two n-tiles a pass.
  if (!diag_mma) {
#pragma unroll
    for (int pass = 0; pass < NT / 2; ++pass) {
      float X[2][4] = {}, Y[2][4] = {}, Z[2][4] = {}, gi[2][4];
#pragma unroll
      for (int pn = 0; pn < 2; ++pn)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 g2 = ld2(fG + (r0 + gq + 8 * hf) * FS + c0 + 8 * (2 * pass + pn) + 2 * tq);
          gi[pn][2 * hf] = g2.x;
          gi[pn][2 * hf + 1] = g2.y;
        }
#pragma unroll 2
      for (int l = 0; l < 16; ++l) {
        const int m = r0 + l;
        float cx[2], cy[2], cz[2], cw[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int il = gq + 8 * hf, i = r0 + il;
          cx[hf] = l <= il ? fqk[i * kCP + m] : 0.0f;
          cy[hf] = l <= il ? fm[i * kCP + m] : 0.0f;
          cz[hf] = l >= il ? fqk[m * kCP + i] : 0.0f;
          cw[hf] = l >= il ? fm[m * kCP + i] : 0.0f;
        }
#pragma unroll
        for (int pn = 0; pn < 2; ++pn) {
          const int d = c0 + 8 * (2 * pass + pn) + 2 * tq;
          const float2 k2 = ld2(fk + m * FS + d), q2 = ld2(fq + m * FS + d), g2 = ld2(fG + m * FS + d);
          const float km[2] = {k2.x, k2.y}, qm[2] = {q2.x, q2.y}, gm[2] = {g2.x, g2.y};
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int hf = x >> 1, b = x & 1;
            const float e = exp_ftz(-fabsf(gi[pn][x] - gm[b])), t = km[b] * e;
            X[pn][x] = fmaf(cx[hf], t, X[pn][x]);
            Y[pn][x] = fmaf(cy[hf], t, Y[pn][x]);
            Z[pn][x] = fmaf(fmaf(cz[hf], qm[b], cw[hf] * km[b]), e, Z[pn][x]);
          }
        }
      }
#pragma unroll
      for (int pn = 0; pn < 2; ++pn)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int nt = 2 * pass + pn, at = (r0 + gq + 8 * hf) * FS + c0 + 8 * nt + 2 * tq;
          const float2 q2 = ld2(fq + at), k2 = ld2(fk + at);
          const float qi[2] = {q2.x, q2.y}, ki[2] = {k2.x, k2.y};
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int x = 2 * hf + b;
            dq[nt][x] += X[pn][x];
            dk[nt][x] += Y[pn][x] + Z[pn][x];
            dG[nt][x] += qi[b] * X[pn][x] + ki[b] * (Y[pn][x] - Z[pn][x]);
          }
        }
    }
  }
  // X and Y of row block rt ≥ 1 against the earlier rows j < r0: e^(Γ_i − Γ_r0) times dAqk (dM) · the scratch.
  if (rt >= 1 && r0 < n) {
    const bf16* xb = sx + 8 * rt * (rt - 1) * KS + c0;
#pragma unroll
    for (int which = 0; which < 2; ++which) {  // unrolled: dq or dk is chosen at compile time
      float acc[1][NT][4] = {};
      mma3<1, NT, false, false>(acc, (which ? sms : sqk) + r0 * kCS, kCS, 0, pC, xb, KS, pS, 0, rt, p.lo);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int d = c0 + 8 * nt + 2 * tq, at = (r0 + gq + 8 * hf) * FS + d;
          const float2 g2 = ld2(fG + at), gr = ld2(fG + r0 * FS + d), o2 = ld2((which ? fk : fq) + at);
          const float y[2] = {acc[0][nt][2 * hf] * exp_ftz(g2.x - gr.x), acc[0][nt][2 * hf + 1] * exp_ftz(g2.y - gr.y)};
          const float o[2] = {o2.x, o2.y};
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            (which ? dk : dq)[nt][2 * hf + b] += y[b];
            dG[nt][2 * hf + b] += o[b] * y[b];
          }
        }
    }
  }
  __syncthreads();  // the scratch is no longer read
  // For Z across blocks, row block br = 1 … 3 with s = 16·br: q_r and k_r times e^(Γ_r − Γ_s), r = s + l, at scratch
  // rows 32·(br − 1) + l and 32·(br − 1) + 16 + l.
  for (int idx = tid; idx < 48 * K / 2; idx += NTH) {
    const int rr = idx / (K / 2), d = 2 * (idx - rr * (K / 2)), br = 1 + rr / 16, l = rr % 16;
    const int r = 16 * br + l, s = 16 * br;
    const float2 gr = ld2(fG + r * FS + d), gs = ld2(fG + s * FS + d), qr = ld2(fq + r * FS + d),
                 kr = ld2(fk + r * FS + d);
    const float e0 = exp_ftz(gr.x - gs.x), e1 = exp_ftz(gr.y - gs.y);
    put2(sx + (32 * (br - 1) + l) * KS + d, pS, qr.x * e0, qr.y * e1, p.lo);
    put2(sx + (32 * (br - 1) + 16 + l) * KS + d, pS, kr.x * e0, kr.y * e1, p.lo);
  }
  __syncthreads();
  // Z of row block rt ≤ 2 against each later block br: e^(Γ_s − Γ_j) times (dAqk[br, rt]ᵀ·q̃ + dM[br, rt]ᵀ·k̃).
  if (r0 < n) {
#pragma unroll 1
    for (int br = rt + 1; br < 4 && 16 * br < n; ++br) {
      const int s = 16 * br;
      float acc[1][NT][4] = {};
      mma3<1, NT, true, false>(acc, sqk + s * kCS + r0, kCS, 16, pC, sx + 32 * (br - 1) * KS + c0, KS, pS, 0, 1, p.lo);
      mma3<1, NT, true, false>(acc, sms + s * kCS + r0, kCS, 16, pC, sx + (32 * (br - 1) + 16) * KS + c0, KS, pS,
                               0, 1, p.lo);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int d = c0 + 8 * nt + 2 * tq, at = (r0 + gq + 8 * hf) * FS + d;
          const float2 g2 = ld2(fG + at), gs = ld2(fG + s * FS + d), k2 = ld2(fk + at);
          const float z[2] = {acc[0][nt][2 * hf] * exp_ftz(gs.x - g2.x), acc[0][nt][2 * hf + 1] * exp_ftz(gs.y - g2.y)};
          const float ki[2] = {k2.x, k2.y};
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            dk[nt][2 * hf + b] += z[b];
            dG[nt][2 * hf + b] -= ki[b] * z[b];
          }
        }
    }
  }
  __syncthreads();  // Γ, q and k no longer read: dq, dΓ and dk take their places
  float *fdq = fG, *fdg = fq, *fdk = fk;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int at = (r0 + gq + 8 * hf) * FS + c0 + 8 * nt + 2 * tq;
      st2(fdq + at, dq[nt][2 * hf], dq[nt][2 * hf + 1]);
      st2(fdk + at, dk[nt][2 * hf], dk[nt][2 * hf + 1]);
      st2(fdg + at, dG[nt][2 * hf], dG[nt][2 * hf + 1]);
    }
  // inter's dq, dk and dg, loaded together ahead of the cumsum (one memory latency instead of three in a row).
  TileRegs<K, NTH> xq, xk, xg;
  load_tile<K, NTH>(xq, p.dq + base, HK, n, true);
  load_tile<K, NTH>(xk, p.dk + base, HK, n, true);
  load_tile<K, NTH>(xg, p.dg + base, HK, n, true);
  __syncthreads();
  // The reverse cumsum of dΓ over the rows, in place per column d; dq and dk added meanwhile; then dΓ into dg.
  for (int d = tid; d < K; d += NTH) {
    float run = 0.0f;
    for (int i = n - 1; i >= 0; --i) {
      run += fdg[i * FS + d];
      fdg[i * FS + d] = run;
    }
  }
  store_tile<K, NTH>(p.dq + base, HK, xq, fdq, FS, n);
  store_tile<K, NTH>(p.dk + base, HK, xk, fdk, FS, n);
  __syncthreads();
  store_tile<K, NTH>(p.dg + base, HK, xg, fdg, FS, n);
  for (int i = tid; i < n; i += NTH) {
    float* db = p.dbeta + (t0 + i) * H + h;
    float sum = sdb[i];  // the column groups' partials in order
    for (int g = 1; g < CG; ++g) sum += sdb[g * kC + i];
    *db = (p.accumulate ? *db : 0.0f) + sum;
  }
}

EnvSwitch g_compact_prep{"NEXTLM_KDA_PREP_COMPACT"};

template <class Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int K, bool B16>
void launch(const Params& p, cudaStream_t st) {
  const auto nc = static_cast<unsigned>(p.ch.num_chunks), ns = static_cast<unsigned>(p.ch.num_seqs);
  const auto H = static_cast<unsigned>(p.H);
  const dim3 per_chunk(nc, H), per_seq(ns, H, K / state_cols<K>());
  constexpr size_t prep = PrepSmem<K>::bytes, state = StateSmem<K>::bytes, inter = InterSmem<K>::bytes,
                   intra = IntraSmem<K>::bytes;
  constexpr size_t limit = 227 * 1024;  // dynamic shared memory of one block on the H100/H200
  static_assert(prep <= limit && state <= limit && BwdStateSmem<K>::bytes(true) <= limit && inter <= limit &&
                    intra <= limit,
                "shared memory");
  // Two compact prep blocks an SM: 228 KiB of shared memory less 1 KiB reserved per block.
  constexpr size_t prep_compact = PrepSmem<K, true>::bytes;
  static_assert(2 * (prep_compact + 1024) <= 228 * 1024, "two compact prep blocks an SM");
  const bool compact = !p.lo && kda_backward_compact_prep();
  set_smem(fwd_state_kernel<K>, state);
  set_smem(bwd_state_kernel<K>, BwdStateSmem<K>::bytes(true));
  set_smem(inter_kernel<K, B16>, inter);
  set_smem(intra_kernel<K, B16>, intra);
  if (compact) {
    set_smem(prep_kernel<K, true, B16>, prep_compact);
    NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(prep_kernel<K, true, B16>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
    prep_kernel<K, true, B16><<<per_chunk, 32 * prep_warps<K, true>(), prep_compact, st>>>(p);
  } else {
    set_smem(prep_kernel<K, false, B16>, prep);
    prep_kernel<K, false, B16><<<per_chunk, 32 * prep_warps<K, false>(), prep, st>>>(p);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (ns > 0) {
    if (!p.kh) {  // else the forward's states
      fwd_state_kernel<K><<<per_seq, 32 * kStateWarps, state, st>>>(p);
      NEXTLM_CUDA_CHECK(cudaGetLastError());
    }
    bwd_state_kernel<K><<<per_seq, 32 * kStateWarps, BwdStateSmem<K>::bytes(p.lo), st>>>(p);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  inter_kernel<K, B16><<<per_chunk, 32 * chunk_warps<K>(), inter, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  intra_kernel<K, B16><<<per_chunk, 32 * chunk_warps<K>(), intra, st>>>(p);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

template <int K>
void launch(const Params& p, cudaStream_t st) {
  if (p.q16) launch<K, true>(p, st);
  else launch<K, false>(p, st);
}

void run(const Params& p, int64_t K, cudaStream_t st) {
  switch (K) {
    case 32: launch<32>(p, st); break;
    case 64: launch<64>(p, st); break;
    default: launch<128>(p, st); break;
  }
}

}  // namespace

void set_kda_backward_compact_prep(bool on) { g_compact_prep.set(on); }

bool kda_backward_compact_prep() { return g_compact_prep.on(); }

size_t kda_chunked_backward_workspace_bytes(int64_t num_chunks, int64_t T, int64_t H, int64_t K) {
  if (T <= 0 || num_chunks <= 0 || H <= 0 || K <= 0) return 0;
  return static_cast<size_t>(num_chunks * H * Layout{K}.per()) * sizeof(float);
}

namespace {

// The checks of both entry points; q, k and v are fp32 or bf16 (rows of K read as 8- and 16-byte pieces either way).
void check_args(const void* q, const void* k, const void* v, const float* g, const float* do_, const KdaChunks& ch,
                int64_t H, int64_t K, const float* dq, const float* dk, const float* dv, const float* dg,
                const void* work, const float* kept_h, const float* kept_u, const KdaGateInputs& gate,
                KdaBackwardProducts products, const KdaBf16Operands& b16) {
  check(kda_chunked_backward_supported(K), "kda_chunked_backward: K must be 32, 64 or 128, got ", K);
  check(ch.num_chunks <= 0x7fffffff && ch.num_seqs <= 0x7fffffff && H <= 65535,
        "kda_chunked_backward: grid too large");
  check(!gate.f == !!g && (!gate.f || (gate.dt_bias && gate.A_log)),
        "kda_chunked_backward: g, or the gate's f with dt_bias and A_log, not both");
  check(!do_ != !b16.do_, "kda_chunked_backward: dO goes in as exactly one of do_ and its bf16 form");
  check(!kept_u || !b16.kept_u, "kda_chunked_backward: the forward's u goes in as at most one of fp32 and bf16");
  check(products == KdaBackwardProducts::Bf16 || (!b16.do_ && !b16.kept_u),
        "kda_chunked_backward: dO and u in bf16 go with the bf16 products alone");
  const float* g_or_f = gate.f ? gate.f : g;
  const void* d_o = do_ ? static_cast<const void*>(do_) : b16.do_;
  const void* u = kept_u ? static_cast<const void*>(kept_u) : b16.kept_u;
  for (const void* ptr : {q, k, v, static_cast<const void*>(g_or_f), d_o,
                          static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv),
                          static_cast<const void*>(dg), work})
    check(is_aligned16(ptr), "kda_chunked_backward: tensors must be 16-byte aligned");
  check(!kept_h == !u && is_aligned16(kept_h) && is_aligned16(u),
        "kda_chunked_backward: the forward's states and u go together, 16-byte aligned");
}

}  // namespace

template <class In>
void kda_chunked_backward(const In* q, const In* k, const In* v, const float* g, const float* beta, const float* do_,
                          const KdaChunks& ch, int64_t T, int64_t H, int64_t K, float* dq, float* dk, float* dv,
                          float* dg, float* dbeta, void* work, cudaStream_t st, bool accumulate,
                          KdaBackwardProducts products, const float* kept_h, const float* kept_u,
                          const KdaGateInputs& gate, const KdaBf16Operands& b16) {
  if (T <= 0 || H <= 0 || K <= 0 || ch.num_chunks <= 0) return;
  check(q && k && v, "kda_chunked_backward: q, k and v must be given");
  check_args(q, k, v, g, do_, ch, H, K, dq, dk, dv, dg, work, kept_h, kept_u, gate, products, b16);
  Params p{nullptr, nullptr, nullptr, g, beta, do_, ch, H, dq, dk, dv, dg, dbeta, static_cast<float*>(work),
           accumulate, products == KdaBackwardProducts::SplitBf16, kept_h, kept_u};
  if constexpr (std::is_same_v<In, float>) p.q = q, p.k = k, p.v = v;
  else p.q16 = q, p.k16 = k, p.v16 = v;
  p.gate = gate;
  p.do16 = b16.do_, p.ku16 = b16.kept_u;
  run(p, K, st);
}

template void kda_chunked_backward(const float*, const float*, const float*, const float*, const float*,
                                   const float*, const KdaChunks&, int64_t, int64_t, int64_t, float*, float*, float*,
                                   float*, float*, void*, cudaStream_t, bool, KdaBackwardProducts, const float*,
                                   const float*, const KdaGateInputs&, const KdaBf16Operands&);
template void kda_chunked_backward(const bf16*, const bf16*, const bf16*, const float*, const float*, const float*,
                                   const KdaChunks&, int64_t, int64_t, int64_t, float*, float*, float*, float*,
                                   float*, void*, cudaStream_t, bool, KdaBackwardProducts, const float*,
                                   const float*, const KdaGateInputs&, const KdaBf16Operands&);

}  // namespace nextlm::cuda
