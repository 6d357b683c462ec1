// One decoding step of the tensor-core KDA (decode_kernels.h, kda_tc_step): the new token's output, bit for bit what
// the forward's kernels (kda_tc.cu) give it when they run the slot's partial chunk, computed for that one row.
//
// Row r of a chunk depends on the rows before it only through values that do not change as rows are added: the
// rows of T = (I + β·strict(Akk))⁻¹ (lower triangular, so row r needs T's rows before it), the products Xs of T's
// off-diagonal blocks and v_new = U − W·S, the chunk's start state S being fixed. The slot keeps those and S in bf16
// as the MMAs' B fragments (KdaTcRowCache). One block per (row, head) first appends the new token (its conv step as
// the forward's kda_conv_norm computes it, β's sigmoid), then computes row r's share of every quantity with the
// forward's operations in the forward's order: the cumulative gate and block references m_I from the chunk's gates,
// row r's scores against rows 0 … r on tensor cores (the same m16n8k16 tiles, row r at its place in its 16-row
// block), row r of T by the forward's substitution from the cached rows, W and U for row r, v_new = U − W·S and
// o = qg·S + Aqk·v_new, then kda_out_norm's gated norm. The row completing the chunk (r = 63) also moves the state
// on, S ← e^gl∘S + kdᵀ·v_new, as the forward's state kernel does, with its fragments for the next chunk.
//
// Anything the forward computes from a run-time value must stay run-time here: a constant folded by the compiler
// (rsqrtf of the head size) is correctly rounded, the GPU's run-time one need not be.
#include "cuda/decode_kernels.h"
#include "cuda/kda_decode_token.cuh"
#include "cuda/kernels.h"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kC = 64;          // chunk length
constexpr int kThreads = 256;   // eight warps; thread (d, half) owns channel d over rows 0–31 or 32–63
constexpr int kXs = kKdaTcXsCols;

__device__ __forceinline__ void store2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// Element x (0, 1) of an m16n8 accumulator's row gq + 8·half, selected without indexing the registers at run time.
__device__ __forceinline__ float row_of(const float (&c)[4], int half, int x) {
  return half ? (x ? c[3] : c[2]) : (x ? c[1] : c[0]);
}

// Shared memory (K = 128: two blocks fit an SM): bf16 arrays of row stride KS = K + 8 (AS = 72 for the score row),
// then fp32 ones. The chunk's last row reuses R_I for KD = k∘e^(gl − gc), then R_I and KB for the new state in bf16.
template <int K>
struct StepLayout {
  static constexpr int KS = K + 8, AS = kC + 8, IS = kC + 4;  // IS: 16-byte rows for cp.async
  static constexpr int r_off = 0;  // R_I [64][KS]: first k, then k_j·e^(m_I − gc_j), the scores' right factors
  static constexpr int kb_off = r_off + kC * KS;   // KB [64][KS]: β·k∘e^gc (W = T·KB)
  static constexpr int vt_off = kb_off + kC * KS;  // VT [64][KS]: first v, then β·v (U = T·VT)
  static constexpr int vn_off = vt_off + kC * KS;  // VN [64][KS]: v_new
  // 16-row tiles holding row r at its place in block I (zero elsewhere): k, q (both ∘e^(gc − m_I)), qg, W, Aqk.
  static constexpr int kt_off = vn_off + kC * KS;
  static constexpr int qt_off = kt_off + 16 * KS;
  static constexpr int qg_off = qt_off + 16 * KS;
  static constexpr int w_off = qg_off + 16 * KS;
  static constexpr int a_off = w_off + 16 * KS;
  static constexpr int u_off = a_off + 16 * AS;  // U row r [K], then the output row before the gated norm
  static constexpr int bf16_elems = u_off + K;
  // fp32: Tm [64][IS] (T's rows), Xs [16][kXs] (block I's rows), Bm row r [64], β [64], m_I [4][K], gl [K], the
  // cumulative gate of rows 0–31 [K].
  static constexpr int f32_floats = kC * IS + 16 * kXs + kC + kC + 4 * K + K + K;
  static constexpr int bytes = bf16_elems * 2 + f32_floats * 4;
  static_assert((bf16_elems * 2) % 16 == 0, "fp32 arrays 16-byte aligned");
  static_assert(2 * kC * KS >= K * KS, "the new bf16 state fits R_I and KB");
};

// The state S [K][K] (fp32 in registers or memory, staged as bf16 in Sb [K][KS]) as the B fragments of the products
// qg·S and W·S: fragment (kk, np) (rows 16kk…, columns 16np…) as load_b_kn gives it, one uint4 per lane, so that a
// step loads each lane's fragments with one coalesced 16-byte load. Every warp of the block calls it.
template <int K>
__device__ __forceinline__ void store_state_frags(const bf16* Sb, uint4* frags) {
  constexpr int KS = K + 8, NP = K / 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int f = warp; f < NP * NP; f += kThreads / 32) {
    uint32_t bb[4];
    load_b_kn(bb, Sb + 16 * (f / NP) * KS + 16 * (f % NP), KS);
    frags[f * 32 + lane] = make_uint4(bb[0], bb[1], bb[2], bb[3]);
  }
}

template <int K>
__global__ void __launch_bounds__(kThreads, 2) kda_tc_step_kernel(KdaTcStepParams p) {
  using L = StepLayout<K>;
  constexpr int KS = L::KS, AS = L::AS, IS = L::IS, NP = K / 16;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sm = reinterpret_cast<bf16*>(smem);
  bf16 *RI = sm + L::r_off, *KB = sm + L::kb_off, *VT = sm + L::vt_off, *VN = sm + L::vn_off;
  bf16 *KT = sm + L::kt_off, *QT = sm + L::qt_off, *QG = sm + L::qg_off, *W16 = sm + L::w_off;
  bf16 *A16 = sm + L::a_off, *Ur = sm + L::u_off;
  float* Tm = reinterpret_cast<float*>(smem + L::bf16_elems * 2);
  float* Xs = Tm + kC * IS;
  float* Bm = Xs + 16 * kXs;
  float* bt = Bm + kC;
  float* mref = bt + kC;
  float* glv = mref + 4 * K;
  float* before32 = glv + K;
  __shared__ float qkv[3][kKdaMaxK];
  __shared__ float scale[2];

  const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int64_t H = p.H, HK = H * K, slot = p.slot[b];
  const int r = p.pos[b] % kC, I = r >> 4, rr = r & 15, r0 = 16 * I, hh = rr >> 3;
  const bool my_row = gq == (rr & 7);  // this lane holds row rr of a warp's 16-row accumulator tile
  const bool append = p.raw != nullptr;
  const int64_t row0 = slot * kC, sh = slot * H + h;
  float* state = p.state + sh * K * K;
  float* tcache = p.rows.t + sh * kC * kC;
  float* xcache = p.rows.xs + sh * kC * kXs;
  bf16* vcache = p.rows.vn + sh * kC * K;
  uint4* sfrag = reinterpret_cast<uint4*>(p.rows.sb + sh * K * K);

  // Every load first. Asynchronous copies: the chunk's k and v rows before r (row r too when the step does not
  // append it; zeros after), the cached v_new rows before r (zeros from r on: the forward's padded rows give zeros
  // there), T's cached rows before r in the blocks ≤ I (block I's rows from r on zero; row r is made below) and
  // block I's cached Xs rows before r.
  const int kv_rows = append ? r : r + 1;
  constexpr int kp = K / 8;
  for (int i = tid; i < kC * kp; i += kThreads) {
    const int row = i / kp, c8 = 8 * (i % kp);
    const bool in = row < kv_rows;
    const int64_t src = (row0 + (in ? row : 0)) * HK + h * K + c8;
    cp_async16(RI + row * KS + c8, p.k + src, in);
    cp_async16(VT + row * KS + c8, p.v + src, in);
    cp_async16(VN + row * KS + c8, vcache + row * K + c8, row < r);
  }
  const int tcols = 16 * (I + 1), t4 = tcols / 4;
  for (int i = tid; i < (r0 + 16) * t4; i += kThreads) {
    const int row = i / t4, c4 = 4 * (i % t4);
    cp_async16(Tm + row * IS + c4, tcache + (row < r ? row : 0) * kC + c4, row < r);
  }
  for (int i = tid; i < rr * (r0 / 4); i += kThreads) {
    const int row = i / (r0 / 4), c4 = 4 * (i % (r0 / 4));
    cp_async16(Xs + row * kXs + c4, xcache + (r0 + row) * kXs + c4, true);
  }
  cp_async_commit();
  // The raw gates of rows 0 … r (thread (d, half): channel d, rows 32·half …) and β, row r's from the step's inputs
  // when it appends; the start state's fragments of this warp's 16 value columns.
  const int d = tid & 127, hf = tid >> 7, i0 = 32 * hf;
  const bool active = d < K;
  float graw[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int row = i0 + i;
    graw[i] = 0.0f;
    if (active && row <= r)
      graw[i] = append && row == r ? p.graw[b * HK + h * K + d] : p.g[(row0 + row) * HK + h * K + d];
  }
  auto sigmoid = [](float x) { return 1.0f / (1.0f + expf(-x)); };  // as sigmoid_inplace
  if (tid < kC)
    bt[tid] = tid > r ? 0.0f : append && tid == r ? sigmoid(p.beta_new[b * H + h]) : p.beta[(row0 + tid) * H + h];
  // The gated norm's inputs of warp 0's channels lane + 32j.
  constexpr int kNorm = (K + 31) / 32;
  float gate_in[kNorm], norm_w[kNorm];
  if (p.gate && warp == 0)
#pragma unroll
    for (int j = 0; j < kNorm; ++j) {
      const int dd = lane + 32 * j;
      gate_in[j] = dd < K ? p.gate[b * HK + h * K + dd] : 0.0f;
      norm_w[j] = dd < K ? p.o_norm[dd] : 0.0f;
    }
  const int np = warp;  // the value columns 16·np … of the products with S
  uint4 sf[NP];
#pragma unroll
  for (int kk = 0; kk < NP; ++kk) sf[kk] = np < NP ? sfrag[(kk * NP + np) * 32 + lane] : make_uint4(0, 0, 0, 0);
  // The row tiles start as zeros; so do KB's rows after r.
  {
    uint4* z = reinterpret_cast<uint4*>(KT);
    for (int i = tid; i < (L::u_off - L::kt_off) / 8; i += kThreads) z[i] = make_uint4(0, 0, 0, 0);
    for (int i = tid; i < (kC - 1 - r) * kp; i += kThreads)
      *reinterpret_cast<uint4*>(KB + (r + 1 + i / kp) * KS + 8 * (i % kp)) = make_uint4(0, 0, 0, 0);
  }
  // The new token: its conv step into qkv, and into row r of the chunk buffers for the steps after this one. The
  // head size goes in as the run-time value, as kda_conv_norm has it: with the template constant, rsqrtf(K) (q's
  // scale) would be folded at compile time, correctly rounded, where the forward's run-time rsqrtf may differ by an
  // ulp (exact at K = 16, not at 128).
  if (append) {
    conv_norm_token(p.raw, p.conv, p.conv_hist, b, h, slot, H, p.K, p.W, true, qkv, scale);
    for (int dd = tid; dd < K; dd += kThreads) {
      const int64_t c = (row0 + r) * HK + h * K + dd;
      p.q[c] = __float2bfloat16(qkv[0][dd]);
      p.k[c] = __float2bfloat16(qkv[1][dd]);
      p.v[c] = __float2bfloat16(qkv[2][dd]);
      p.g[c] = p.graw[b * HK + h * K + dd];
    }
    if (tid == 0) p.beta[(row0 + r) * H + h] = sigmoid(p.beta_new[b * H + h]);
  }

  // The gate and its cumulative sum over rows 0 … r (the rows after r count as zero gates), as prepare_kernel.
  const float rate = expf(p.A_log[h]), bias = active ? p.dt_bias[h * K + d] : 0.0f;
  float gcol[32];
  auto cumulative_gate = [&]() {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      float gi = 0.0f;
      if (i0 + i <= r) gi = p.bound / (1.0f + expf(-rate * (graw[i] + bias)));
      acc += gi;
      gcol[i] = acc;
    }
    return acc;
  };
  {
    const float acc = cumulative_gate();
    if (active && hf == 0) glv[d] = acc;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (active) {
    float before = 0.0f;
    if (hf == 1) {
      before = glv[d];
      before32[d] = before;
#pragma unroll
      for (int i = 0; i < 32; ++i) gcol[i] += before;
      glv[d] = gcol[31];
    }
    const float shift = fminf(0.0f, 16.0f * p.bound + 80.0f);
    mref[(2 * hf) * K + d] = before + shift;
    mref[(2 * hf + 1) * K + d] = gcol[15] + shift;
  }
  __syncthreads();

  // Rows 0 … r of R_I, KB and VT; row r of k and q (∘e^(gc − m_I)) and of qg.
  if (active) {
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const int Iw = 2 * hf + ii;
      if (16 * Iw > r) break;
      const float mi = mref[Iw * K + d], em = __expf(mi);
      const float cI = __expf(mref[I * K + d] - mi);  // I ≥ Iw
#pragma unroll
      for (int q = 0; q < 16; ++q) {
        const int i = 16 * Iw + q;
        if (i <= r) {
          const float gi = gcol[16 * ii + q];
          // Row r's k, v and q from the append (bf16 values), the others as copied.
          const bool mine = append && i == r;
          const float kv = mine ? qkv[1][d] : __bfloat162float(RI[i * KS + d]);
          const float vv = mine ? qkv[2][d] : __bfloat162float(VT[i * KS + d]), bb = bt[i];
          const float base = __expf(mi - gi), left = __expf(gi - mi);
          const float e = em * left;
          KB[i * KS + d] = __float2bfloat16(bb * kv * e);
          VT[i * KS + d] = __float2bfloat16(bb * vv);
          RI[i * KS + d] = __float2bfloat16(kv * base * cI);
          if (i == r) {
            const float qv = append ? qkv[0][d] : __bfloat162float(p.q[(row0 + i) * HK + h * K + d]);
            KT[rr * KS + d] = __float2bfloat16(kv * left);
            QT[rr * KS + d] = __float2bfloat16(qv * left);
            QG[rr * KS + d] = __float2bfloat16(qv * e);
          }
        }
      }
    }
  }
  __syncthreads();

  // Row r's scores against column block J (warp J ≤ I): Aqk (causal, bf16) and β_r·Akk (strictly lower).
  if (warp <= I) {
    const int J = warp;
    float ck[2][4] = {}, cq[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t ak[4], aq[4], bb[4];
      load_a(ak, KT + 16 * kk, KS);
      load_a(aq, QT + 16 * kk, KS);
      load_b_nk(bb, RI + 16 * J * KS + 16 * kk, KS);
      mma_bf16(ck[0], ak, bb[0], bb[1]);
      mma_bf16(ck[1], ak, bb[2], bb[3]);
      mma_bf16(cq[0], aq, bb[0], bb[1]);
      mma_bf16(cq[1], aq, bb[2], bb[3]);
    }
    if (my_row)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int j = 16 * J + 8 * nt + 2 * tq;
        store2(A16 + rr * AS + j, j <= r ? row_of(cq[nt], hh, 0) : 0.0f, j + 1 <= r ? row_of(cq[nt], hh, 1) : 0.0f);
        Bm[j] = j < r ? bt[r] * row_of(ck[nt], hh, 0) : 0.0f;
        Bm[j + 1] = j + 1 < r ? bt[r] * row_of(ck[nt], hh, 1) : 0.0f;
      }
  }
  __syncthreads();

  // Row r of T: its diagonal block by the forward's substitution over the block's earlier rows, then the blocks
  // left of it through Xs (this row's, cached for the rows after it, and the cached ones of the rows before it).
  if (tid < 16) {
    const int j = tid;
    float s = 0.0f;
    for (int mm = 0; mm < rr; ++mm) s += Bm[r0 + mm] * Tm[(r0 + mm) * IS + r0 + j];
    Tm[r * IS + r0 + j] = rr > j ? -s : (rr == j ? 1.0f : 0.0f);
  }
  __syncthreads();
  if (I > 0) {
    if (tid < 16 * I) {
      const int J = tid >> 4, cc = tid & 15;
      float s = 0.0f;
      for (int M = J; M < I; ++M)
#pragma unroll
        for (int mm = 0; mm < 16; ++mm) s += Bm[16 * M + mm] * Tm[(16 * M + mm) * IS + 16 * J + cc];
      Xs[rr * kXs + 16 * J + cc] = s;
      xcache[r * kXs + 16 * J + cc] = s;
    }
    __syncthreads();
    if (tid < 16 * I) {
      const int J = tid >> 4, cc = tid & 15;
      float s = 0.0f;
      for (int q2 = 0; q2 <= rr; ++q2) s += Tm[r * IS + r0 + q2] * Xs[q2 * kXs + 16 * J + cc];
      Tm[r * IS + 16 * J + cc] = -s;
    }
    __syncthreads();
  }
  if (tid < kC) tcache[r * kC + tid] = tid < tcols ? Tm[r * IS + tid] : 0.0f;

  // W and U for row r: T's row times KB and VT over the column blocks ≤ I; task (which, np) for 16 columns.
  for (int task = warp; task < 2 * NP; task += kThreads / 32) {
    const bool is_w = task < NP;
    const int cb = is_w ? task : task - NP;  // columns 16·cb …
    const bf16* Bt = is_w ? KB : VT;
    float acc[2][4] = {};
    for (int kb = 0; kb <= I; ++kb) {
      const float* tr0 = Tm + (r0 + gq) * IS + 16 * kb + 2 * tq;
      const float* tr1 = tr0 + 8 * IS;
      const uint32_t a[4] = {pack_bf16(tr0[0], tr0[1]), pack_bf16(tr1[0], tr1[1]), pack_bf16(tr0[8], tr0[9]),
                             pack_bf16(tr1[8], tr1[9])};
      uint32_t bb[4];
      load_b_kn(bb, Bt + 16 * kb * KS + 16 * cb, KS);
      mma_bf16(acc[0], a, bb[0], bb[1]);
      mma_bf16(acc[1], a, bb[2], bb[3]);
    }
    if (my_row)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = 16 * cb + 8 * nt + 2 * tq;
        store2((is_w ? W16 + rr * KS : Ur) + col, row_of(acc[nt], hh, 0), row_of(acc[nt], hh, 1));
      }
  }
  __syncthreads();

  // v_new = U − W·S and o = qg·S for row r (warp np: 16 value columns), then o += Aqk·v_new.
  float oc[2][4] = {};
  if (np < NP) {
    float pw[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t aw[4], aq[4];
      load_a(aw, W16 + 16 * kk, KS);
      load_a(aq, QG + 16 * kk, KS);
      mma_bf16(pw[0], aw, sf[kk].x, sf[kk].y);
      mma_bf16(pw[1], aw, sf[kk].z, sf[kk].w);
      mma_bf16(oc[0], aq, sf[kk].x, sf[kk].y);
      mma_bf16(oc[1], aq, sf[kk].z, sf[kk].w);
    }
    if (my_row)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = 16 * np + 8 * nt + 2 * tq;
        const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(Ur + col);
        store2(VN + r * KS + col, __low2float(u) - row_of(pw[nt], hh, 0), __high2float(u) - row_of(pw[nt], hh, 1));
        *reinterpret_cast<__nv_bfloat162*>(vcache + r * K + col) =
            *reinterpret_cast<const __nv_bfloat162*>(VN + r * KS + col);
      }
  }
  __syncthreads();
  if (np < NP) {
    for (int kb = 0; kb <= I; ++kb) {
      uint32_t a[4], bb[4];
      load_a(a, A16 + 16 * kb, AS);
      load_b_kn(bb, VN + 16 * kb * KS + 16 * np, KS);
      mma_bf16(oc[0], a, bb[0], bb[1]);
      mma_bf16(oc[1], a, bb[2], bb[3]);
    }
    if (my_row)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        store2((p.gate ? Ur : p.o + b * HK + h * K) + 16 * np + 8 * nt + 2 * tq, row_of(oc[nt], hh, 0),
               row_of(oc[nt], hh, 1));
  }
  // The gated norm of kda_out_norm (its warp's order): RMSNorm over K with weight, times sigmoid(gate), to bf16.
  if (p.gate) {
    __syncthreads();  // the output row is in Ur
    if (warp == 0) {
      float ss = 0.0f;
#pragma unroll
      for (int j = 0; j < kNorm; ++j) {
        const int dd = lane + 32 * j;
        if (dd < K) ss += __bfloat162float(Ur[dd]) * __bfloat162float(Ur[dd]);
      }
      const float rn = rsqrtf(warp_sum(ss) / static_cast<float>(K) + p.eps);
#pragma unroll
      for (int j = 0; j < kNorm; ++j) {
        const int dd = lane + 32 * j;
        if (dd < K)
          p.o[b * HK + h * K + dd] =
              __float2bfloat16(norm_w[j] * (__bfloat162float(Ur[dd]) * rn) * (1.0f / (1.0f + expf(-gate_in[j]))));
      }
    }
  }

  // The chunk's last row: S ← e^gl∘S + kdᵀ·v_new (fp32, the state kernel's tiles and order), in place, and the new
  // state's fragments for the next chunk's steps. KD = k∘e^(gl − gc) goes where R_I was (the gates recomputed as above,
  // the same values), the bf16 state where R_I and KB were.
  if (r == kC - 1) {
    bf16* KD = RI;
#pragma unroll
    for (int i = 0; i < 32; ++i) graw[i] = active ? p.g[(row0 + i0 + i) * HK + h * K + d] : 0.0f;
    cumulative_gate();
    if (active) {
      const float gl = glv[d];
#pragma unroll
      for (int ii = 0; ii < 2; ++ii) {
        const int Iw = 2 * hf + ii;
        const float mi = mref[Iw * K + d], eg = __expf(gl - mi), before = hf == 1 ? before32[d] : 0.0f;
#pragma unroll
        for (int q = 0; q < 16; ++q) {
          const int i = 16 * Iw + q;
          const float gi = hf == 1 ? gcol[16 * ii + q] + before : gcol[16 * ii + q];
          const float kv = __bfloat162float(p.k[(row0 + i) * HK + h * K + d]);
          KD[i * KS + d] = __float2bfloat16(kv * __expf(mi - gi) * eg);
        }
      }
    }
    __syncthreads();
    float s[K / 8][4];
    const int mt = warp;  // rows 16·mt … of the state
    if (mt < K / 16) {
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int dd = 16 * mt + gq + 8 * (x >> 1), e = 8 * nt + 2 * tq + (x & 1);
          s[nt][x] = state[dd * K + e];
        }
      const float e0 = __expf(glv[16 * mt + gq]), e1 = __expf(glv[16 * mt + gq + 8]);
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) {
        s[nt][0] *= e0;
        s[nt][1] *= e0;
        s[nt][2] *= e1;
        s[nt][3] *= e1;
      }
#pragma unroll
      for (int kb = 0; kb < kC / 16; ++kb) {
        uint32_t a[4];
        load_a_t(a, KD + 16 * kb * KS + 16 * mt, KS);
#pragma unroll
        for (int q = 0; q < NP; ++q) {
          uint32_t bb[4];
          load_b_kn(bb, VN + 16 * kb * KS + 16 * q, KS);
          mma_bf16(s[2 * q], a, bb[0], bb[1]);
          mma_bf16(s[2 * q + 1], a, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int dd = 16 * mt + gq + 8 * (x >> 1), e = 8 * nt + 2 * tq + (x & 1);
          state[dd * K + e] = s[nt][x];
        }
    }
    __syncthreads();  // KD is read
    bf16* Sb = RI;
    if (mt < K / 16)
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) {
        store2(Sb + (16 * mt + gq) * KS + 8 * nt + 2 * tq, s[nt][0], s[nt][1]);
        store2(Sb + (16 * mt + gq + 8) * KS + 8 * nt + 2 * tq, s[nt][2], s[nt][3]);
      }
    __syncthreads();
    store_state_frags<K>(Sb, sfrag);
  }
}

// One block per (listed slot, head): the fragments of the slot's state (KdaTcRowCache::sb).
template <int K>
__global__ void __launch_bounds__(kThreads) state_frags_kernel(const float* state, const int32_t* slots, int64_t H,
                                                                bf16* sb) {
  constexpr int KS = K + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Sb = reinterpret_cast<bf16*>(smem);
  const int64_t sh = int64_t(slots[blockIdx.x]) * H + blockIdx.y;
  const float* S = state + sh * K * K;
  for (int i = threadIdx.x; i < K * K / 2; i += kThreads)
    store2(Sb + (2 * i / K) * KS + 2 * i % K, S[2 * i], S[2 * i + 1]);
  __syncthreads();
  store_state_frags<K>(Sb, reinterpret_cast<uint4*>(sb + sh * K * K));
}

template <int K>
void launch_frags(const float* state, const int32_t* slots, int64_t n, int64_t H, bf16* sb, cudaStream_t st) {
  const int bytes = K * (K + 8) * 2;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(state_frags_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  state_frags_kernel<K><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(H)), kThreads, bytes, st>>>(state, slots,
                                                                                                         H, sb);
}

template <int K>
void launch_step(const KdaTcStepParams& p, cudaStream_t st) {
  const int bytes = StepLayout<K>::bytes;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kda_tc_step_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kda_tc_step_kernel<K><<<dim3(static_cast<unsigned>(p.B), static_cast<unsigned>(p.H)), kThreads, bytes, st>>>(p);
}

}  // namespace

void kda_tc_step(const KdaTcStepParams& p, cudaStream_t st) {
  if (!p.B) return;
  check(!p.raw || p.W >= 1, "CUDA KDA decoding: conv kernel size must be positive");
  switch (p.K) {
    case 16: return launch_step<16>(p, st);
    case 32: return launch_step<32>(p, st);
    case 64: return launch_step<64>(p, st);
    case 128: return launch_step<128>(p, st);
    default: fail("CUDA KDA decoding (tensor cores): linear_head_dim must be 16, 32, 64 or 128, got ", p.K);
  }
}

void kda_tc_state_frags(const float* state, const int32_t* slots, int64_t n, bf16* sb, int64_t H, int64_t K,
                        cudaStream_t st) {
  if (!n) return;
  switch (K) {
    case 16: return launch_frags<16>(state, slots, n, H, sb, st);
    case 32: return launch_frags<32>(state, slots, n, H, sb, st);
    case 64: return launch_frags<64>(state, slots, n, H, sb, st);
    case 128: return launch_frags<128>(state, slots, n, H, sb, st);
    default: fail("CUDA KDA decoding (tensor cores): linear_head_dim must be 16, 32, 64 or 128, got ", K);
  }
}

}  // namespace nextlm::cuda
