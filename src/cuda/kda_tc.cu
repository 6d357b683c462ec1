// The chunked KDA forward on tensor cores (mma.sync bf16 → fp32), for the safe gate, in two kernels:
//
// 1. prepare, parallel over (chunk, head): the gate from the raw f_b output, its cumulative sum gc within the chunk
//    (fp32), the decay-weighted scores Akk = (k∘e^gc)(k∘e^−gc)ᵀ and Aqk = (q∘e^gc)(k∘e^−gc)ᵀ on tensor cores, the
//    inverse T = (I + β·strict(Akk))⁻¹ in fp32, and W = T(βk∘e^gc), U = T(βv) on tensor cores; written as bf16 with
//    qg = q∘e^gc, kd = k∘e^(gl−gc), Aqk (causal) and gl = gc of the last row (fp32).
// 2. state, sequential over the chunks of a sequence, parallel over (sequence, head, value tile): carries the fp32
//    state S[:, tile] in registers and per chunk computes v_new = U − W·S, o = qg·S + Aqk·v_new and
//    S ← e^gl∘S + kdᵀ·v_new, with the chunk's factors double-buffered into shared memory by cp.async.
//
// References: e^gc and e^−gc are never formed across a whole chunk. Row block I (16 rows) uses the reference
// m_I = gc[16I − 1] + c (gc[−1] = 0), c = min(0, 16·bound + 80): the cumulative gate just before the block, shifted
// by c only when the bound is below −5. Every factor then lies in [e^−80, e^80] (with the safe gate, bound ≥ −10),
// the off-diagonal right factors e^(m_J − gc_j) and the per-block constants e^(m_J − m_I) (J ≥ I), e^(gl − m_I),
// e^(m_I) are at most e^c ≤ 1, and what underflows is a product below e^−7 when c < 0 (bound < −5), below e^−80
// otherwise. A reference taken from the rows at or before a block's first row makes the chunk's results for rows
// 0 … r depend on those rows only: a chunk cut after row r (a decoding step recomputing its partial chunk, padded
// with zeros) gives those rows bit for bit what the whole chunk gives them. The softplus gate has no bound: it uses
// the fp32 kernels of kda.cu.
#include "cuda/kernels.h"
#include "cuda/mma.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kC = 64;         // chunk length
constexpr int kThreads = 128;  // the state kernel: four warps; warp w owns rows 16w..16w+15 of a chunk

constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <class T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_f<bf16>(bf16 x) {
  return __bfloat162float(x);
}

__device__ __forceinline__ void store2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// Kernel 1. Eight warps; thread (d, half) owns channel d over rows 0–31 or 32–63, and each element costs two
// exponentials, base = e^(m_I − gc_i) and left = e^(gc_i − m_I), the rest coming from per-channel constants
// (e^(m_J − m_I) ≤ 1 for J ≥ I, e^(gl − m_I), e^(m_I)).
constexpr int kPrepThreads = 256;

template <int K>
struct PrepLayout {
  static constexpr int KS = K + 8, tile = kC * KS, IS = kC + 1;
  // R is stored unpadded with its 16-byte pieces XOR-swizzled by row (so that the layout fits two blocks per SM).
  static constexpr int region = cmax(cmax(kC * K * 4, 160 * K * 2), (2 * kC * IS + 3 * 16 * 17) * 4);
  static constexpr int bytes = 4 * tile * 2 + region + kC * 4 + 5 * K * 4;  // + β, m_I and gl per channel
};

// Element (row, col) of the swizzled R: piece col/8 of row `row` sits at piece (col/8) ^ (row mod 8) (mod the
// pieces of a row, which are fewer than 8 when K < 64).
template <int K>
__device__ __forceinline__ int rsw(int row, int col) {
  constexpr int pieces = K / 8, mask = (pieces < 8 ? pieces : 8) - 1;
  return row * K + (((col >> 3) ^ (row & mask)) << 3) + (col & 7);
}

template <int K, class GT>
__global__ void __launch_bounds__(kPrepThreads, 2)
    prepare_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                    const GT* __restrict__ graw, const float* __restrict__ beta, const float* __restrict__ dt_bias,
                    const float* __restrict__ A_log, float bound, KdaChunks ch, KdaTcWork w, int H,
                    KdaTcRowCache rc) {
  using L = PrepLayout<K>;
  constexpr int KS = L::KS, IS = L::IS;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* QT = reinterpret_cast<bf16*>(smem);
  bf16* KT = QT + L::tile;
  bf16* VT = KT + L::tile;
  bf16* KB = VT + L::tile;
  unsigned char* region = smem + 4 * L::tile * 2;
  GT* gst = reinterpret_cast<GT*>(region);
  bf16* R = reinterpret_cast<bf16*>(region);
  float* Bm = reinterpret_cast<float*>(region);
  float* Tm = Bm + kC * IS;
  float* Xs = Tm + kC * IS;
  float* bt = reinterpret_cast<float*>(region + L::region);
  float* mref = bt + kC;      // [4][K]
  float* glv = mref + 4 * K;  // [K]; first the sum of rows 0–31 per channel, then gl

  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int64_t t0 = ch.chunk_start[c];
  const int n = ch.chunk_len[c];
  const int64_t HK = int64_t(H) * K;
  const int64_t ch_head = int64_t(c) * H + h;

  constexpr int qp = K / 8;
  for (int i = tid; i < kC * qp; i += kPrepThreads) {
    const int r = i / qp, p = i % qp;
    const bool in = r < n;
    const int64_t src = (t0 + (in ? r : 0)) * HK + int64_t(h) * K + p * 8;
    cp_async16(QT + r * KS + p * 8, q + src, in);
    cp_async16(KT + r * KS + p * 8, k + src, in);
    cp_async16(VT + r * KS + p * 8, v + src, in);
  }
  constexpr int gper = 16 / int(sizeof(GT)), gp = K / gper;
  for (int i = tid; i < kC * gp; i += kPrepThreads) {
    const int r = i / gp, p = i % gp;
    const bool in = r < n;
    cp_async16(gst + r * K + p * gper, graw + (t0 + (in ? r : 0)) * HK + int64_t(h) * K + p * gper, in);
  }
  cp_async_commit();
  if (tid < kC) bt[tid] = tid < n ? beta[(t0 + tid) * H + h] : 0.0f;
  cp_async_wait<0>();
  __syncthreads();

  // Thread (d, hf) owns channel d over rows 32hf..32hf+31.
  const int d = tid & 127, hf = tid >> 7, i0 = 32 * hf;
  const bool active = d < K;
  float gcol[32];
  if (active) {
    const float rate = expf(A_log[h]), bias = dt_bias[h * K + d];
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      float gi = 0.0f;
      if (i0 + i < n) gi = bound / (1.0f + expf(-rate * (to_f(gst[(i0 + i) * K + d]) + bias)));
      acc += gi;
      gcol[i] = acc;
    }
    if (hf == 0) glv[d] = acc;
  }
  __syncthreads();
  if (active) {
    float before = 0.0f;  // gc of the row before this half
    if (hf == 1) {
      before = glv[d];
#pragma unroll
      for (int i = 0; i < 32; ++i) gcol[i] += before;
      glv[d] = gcol[31];
    }
    const float shift = fminf(0.0f, 16.0f * bound + 80.0f);
    mref[(2 * hf) * K + d] = before + shift;
    mref[(2 * hf + 1) * K + d] = gcol[15] + shift;
  }
  __syncthreads();  // the gate staging is free for R; m_I and gl are known

  if (active) {
    const float gl = glv[d];
    const int64_t out0 = ch_head * kC * K + d;
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const int I = 2 * hf + ii;
      const float mi = mref[I * K + d], em = __expf(mi), eg = __expf(gl - mi);
      float cj[4];
#pragma unroll
      for (int J = 0; J < 4; ++J) cj[J] = __expf(mref[J * K + d] - mi);  // used for J ≥ I only (≤ 1 there)
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int i = 16 * I + r;
        const float gi = gcol[16 * ii + r];
        const float kv = __bfloat162float(KT[i * KS + d]), qv = __bfloat162float(QT[i * KS + d]);
        const float vv = __bfloat162float(VT[i * KS + d]), b = bt[i];
        const float base = __expf(mi - gi), left = __expf(gi - mi);
        const float e = em * left;
        KT[i * KS + d] = __float2bfloat16(kv * left);
        QT[i * KS + d] = __float2bfloat16(qv * left);
        VT[i * KS + d] = __float2bfloat16(b * vv);
        KB[i * KS + d] = __float2bfloat16(b * kv * e);
        const float kb = kv * base;
#pragma unroll
        for (int J = 0; J < 4; ++J)
          if (J >= I) R[rsw<K>(8 * J * (J + 1) + i, d)] = __float2bfloat16(kb * cj[J]);
        w.qg[out0 + i * K] = __float2bfloat16(qv * e);
        w.kd[out0 + i * K] = __float2bfloat16(kb * eg);
      }
    }
    if (hf == 1) w.gl[ch_head * K + d] = gl;
  }
  __syncthreads();

  // Score blocks (I, J ≤ I), ten of them: warp w takes pairs w and w + 8.
  bf16* aqk = w.aqk + ch_head * kC * kC;
  // Pair p ↔ (I, J) with p = I(I+1)/2 + J.
  auto pair_i = [](int p) { return p < 1 ? 0 : (p < 3 ? 1 : (p < 6 ? 2 : 3)); };
  float akk[2][2][4];
#pragma unroll
  for (int pi = 0; pi < 2; ++pi) {
    const int pr = warp + 8 * pi;
    if (pr >= 10) continue;
    const int I = pair_i(pr), J = pr - I * (I + 1) / 2;
    // This lane's row of R for the B fragments ([n][k] layout, as load_b_nk), swizzled.
    const int rrow = 8 * I * (I + 1) + 16 * J + (lane & 7) + (lane >> 4) * 8, rcol = ((lane >> 3) & 1) * 8;
    float ck[2][4] = {}, cq[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t ak[4], aq[4], b[4];
      load_a(ak, KT + 16 * I * KS + 16 * kk, KS);
      load_a(aq, QT + 16 * I * KS + 16 * kk, KS);
      ldsm_x4(b, R + rsw<K>(rrow, 16 * kk + rcol));
      mma_bf16(ck[0], ak, b[0], b[1]);
      mma_bf16(ck[1], ak, b[2], b[3]);
      mma_bf16(cq[0], aq, b[0], b[1]);
      mma_bf16(cq[1], aq, b[2], b[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * I + gq + 8 * hh, j = 16 * J + 8 * nt + 2 * tq;
        store2(aqk + i * kC + j, j <= i ? cq[nt][2 * hh] : 0.0f, j + 1 <= i ? cq[nt][2 * hh + 1] : 0.0f);
        akk[pi][nt][2 * hh] = ck[nt][2 * hh];
        akk[pi][nt][2 * hh + 1] = ck[nt][2 * hh + 1];
      }
  }
  // The six blocks above the diagonal are zero.
  for (int e = tid; e < 6 * 128; e += kPrepThreads) {
    const int blk = e / 128, x = e % 128, r = x / 8, cc = 2 * (x % 8);
    const int I = blk < 3 ? 0 : (blk < 5 ? 1 : 2), J = blk < 3 ? blk + 1 : (blk < 5 ? blk - 1 : 3);
    store2(aqk + (16 * I + r) * kC + 16 * J + cc, 0.0f, 0.0f);
  }
  __syncthreads();  // R is dead
#pragma unroll
  for (int pi = 0; pi < 2; ++pi) {
    const int pr = warp + 8 * pi;
    if (pr >= 10) continue;
    const int I = pair_i(pr), J = pr - I * (I + 1) / 2;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * I + gq + 8 * hh, j = 16 * J + 8 * nt + 2 * tq;
        Bm[i * IS + j] = j < i ? bt[i] * akk[pi][nt][2 * hh] : 0.0f;
        Bm[i * IS + j + 1] = j + 1 < i ? bt[i] * akk[pi][nt][2 * hh + 1] : 0.0f;
      }
  }
  __syncthreads();

  if (warp < 4) {
    const int w0 = 16 * warp, j = lane & 15;
    float tc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) tc[i] = i == j ? 1.0f : 0.0f;
#pragma unroll
    for (int i = 1; i < 16; ++i) {
      float s = 0.0f;
#pragma unroll
      for (int mm = 0; mm < i; ++mm) s += Bm[(w0 + i) * IS + w0 + mm] * tc[mm];
      if (i > j) tc[i] = -s;
    }
    if (lane < 16)
#pragma unroll
      for (int i = 0; i < 16; ++i) Tm[(w0 + i) * IS + w0 + j] = tc[i];
  }
  __syncthreads();
#pragma unroll 1
  for (int BI = 1; BI < 4; ++BI) {
    for (int e = tid; e < BI * 256; e += kPrepThreads) {
      const int J = e >> 8, r = (e >> 4) & 15, cc = e & 15;
      float s = 0.0f;
      for (int M = J; M < BI; ++M)
#pragma unroll
        for (int mm = 0; mm < 16; ++mm) s += Bm[(16 * BI + r) * IS + 16 * M + mm] * Tm[(16 * M + mm) * IS + 16 * J + cc];
      Xs[(J * 16 + r) * 17 + cc] = s;
      if (rc.xs) rc.xs[((t0 / kC * H + h) * kC + 16 * BI + r) * kKdaTcXsCols + 16 * J + cc] = s;
    }
    __syncthreads();
    for (int e = tid; e < BI * 256; e += kPrepThreads) {
      const int J = e >> 8, r = (e >> 4) & 15, cc = e & 15;
      float s = 0.0f;
      for (int q2 = 0; q2 <= r; ++q2) s += Tm[(16 * BI + r) * IS + 16 * BI + q2] * Xs[(J * 16 + q2) * 17 + cc];
      Tm[(16 * BI + r) * IS + 16 * J + cc] = -s;
    }
    __syncthreads();
  }

  // A decoding slot's partial chunk (rc): T's blocks on and left of the diagonal (the others are zero).
  if (rc.t) {
    float* dst = rc.t + (t0 / kC * H + h) * kC * kC;
    for (int e = tid; e < kC * kC; e += kPrepThreads) {
      const int i = e / kC, j = e % kC;
      dst[e] = j / 16 <= i / 16 ? Tm[i * IS + j] : 0.0f;
    }
  }

  // W = T·KB (warps 0–3) and U = T·VT (warps 4–7), rows 16(w mod 4)..+15.
  const int rb = warp & 3, r0 = 16 * rb;
  const bf16* Bt = warp < 4 ? KB : VT;
  bf16* out = (warp < 4 ? w.w : w.u) + ch_head * kC * K;
  float acc[K / 8][4];
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  for (int kb = 0; kb <= rb; ++kb) {
    const float* tr0 = Tm + (r0 + gq) * IS + 16 * kb + 2 * tq;
    const float* tr1 = tr0 + 8 * IS;
    const uint32_t a[4] = {pack_bf16(tr0[0], tr0[1]), pack_bf16(tr1[0], tr1[1]), pack_bf16(tr0[8], tr0[9]),
                           pack_bf16(tr1[8], tr1[9])};
#pragma unroll
    for (int np = 0; np < K / 16; ++np) {
      uint32_t b[4];
      load_b_kn(b, Bt + 16 * kb * KS + 16 * np, KS);
      mma_bf16(acc[2 * np], a, b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    store2(out + (r0 + gq) * K + 8 * nt + 2 * tq, acc[nt][0], acc[nt][1]);
    store2(out + (r0 + gq + 8) * K + 8 * nt + 2 * tq, acc[nt][2], acc[nt][3]);
  }
}

template <int K, int TV>
struct StateLayout {
  static constexpr int KS = K + 8, AS = kC + 8, VS = TV + 8;
  static constexpr int stage_elems = 3 * kC * KS + kC * AS + kC * VS;  // W, QG, KD, AQ, U (bf16), then GL (fp32)
  static constexpr int stage_bytes = stage_elems * 2 + K * 4;
  static constexpr int bytes = 2 * stage_bytes + K * VS * 2 + kC * VS * 2;
};

template <int K, int TV>
__global__ void __launch_bounds__(kThreads)
    state_kernel(KdaTcWork w, KdaChunks ch, bf16* __restrict__ o, KdaTcStates states, int H, KdaTcRowCache rc) {
  using L = StateLayout<K, TV>;
  constexpr int KS = L::KS, AS = L::AS, VS = L::VS;
  constexpr int MT = K / 16, MTW = (MT + 3) / 4, NT = TV / 8;
  static_assert(L::stage_bytes % 16 == 0 && (L::stage_elems * 2) % 16 == 0, "16-byte aligned stages");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Sb = reinterpret_cast<bf16*>(smem + 2 * L::stage_bytes);  // S as bf16 [K][VS]
  bf16* VN = Sb + K * VS;                                         // v_new as bf16 [64][VS]

  const int seq = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * TV;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int64_t HK = int64_t(H) * K;
  const int first = ch.seq_first_chunk[seq], count = ch.seq_num_chunks[seq];
  const int64_t state0 = (int64_t(states.row ? states.row[seq] : seq) * H + h) * K * K;
  const float* s_in = states.in;  // may be states.out (decoding reads and writes a slot's state in place)
  float* s_out = states.out;
  float s[MTW][NT][4];
#pragma unroll
  for (int qi = 0; qi < MTW; ++qi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int mt = warp + 4 * qi, dd = 16 * mt + gq + 8 * (x >> 1), e = c0 + 8 * nt + 2 * tq + (x & 1);
        s[qi][nt][x] = (s_in && mt < MT) ? s_in[state0 + int64_t(dd) * K + e] : 0.0f;
      }

  // The chunk after which s_out is written in boundary mode: the last complete one (−1: none, s_out untouched).
  const int boundary_it = count > 0 && ch.chunk_len[first + count - 1] == kC ? count - 1 : count - 2;
  auto store_state = [&]() {
#pragma unroll
    for (int qi = 0; qi < MTW; ++qi)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int mt = warp + 4 * qi, dd = 16 * mt + gq + 8 * (x >> 1), e = c0 + 8 * nt + 2 * tq + (x & 1);
          if (mt < MT) s_out[state0 + int64_t(dd) * K + e] = s[qi][nt][x];
        }
  };

  auto stage_ptr = [&](int st) { return smem + st * L::stage_bytes; };
  auto load_stage = [&](int cidx, int st) {
    bf16* Ws = reinterpret_cast<bf16*>(stage_ptr(st));
    bf16* Qs = Ws + kC * KS;
    bf16* Ks = Qs + kC * KS;
    bf16* As = Ks + kC * KS;
    bf16* Us = As + kC * AS;
    float* Gs = reinterpret_cast<float*>(stage_ptr(st) + L::stage_elems * 2);
    const int64_t ch_head = int64_t(cidx) * H + h;
    const bf16* gw = w.w + ch_head * kC * K;
    const bf16* gqg = w.qg + ch_head * kC * K;
    const bf16* gkd = w.kd + ch_head * kC * K;
    constexpr int kp = K / 8;
    for (int i = tid; i < kC * kp; i += kThreads) {
      const int r = i / kp, p = i % kp;
      cp_async16(Ws + r * KS + p * 8, gw + r * K + p * 8, true);
      cp_async16(Qs + r * KS + p * 8, gqg + r * K + p * 8, true);
      cp_async16(Ks + r * KS + p * 8, gkd + r * K + p * 8, true);
    }
    const bf16* ga = w.aqk + ch_head * kC * kC;
    for (int i = tid; i < kC * (kC / 8); i += kThreads) {
      const int r = i / (kC / 8), p = i % (kC / 8);
      cp_async16(As + r * AS + p * 8, ga + r * kC + p * 8, true);
    }
    const bf16* gu = w.u + ch_head * kC * K + c0;
    for (int i = tid; i < kC * (TV / 8); i += kThreads) {
      const int r = i / (TV / 8), p = i % (TV / 8);
      cp_async16(Us + r * VS + p * 8, gu + r * K + p * 8, true);
    }
    for (int i = tid; i < K / 4; i += kThreads) cp_async16(Gs + 4 * i, w.gl + ch_head * K + 4 * i, true);
  };

  if (count > 0) load_stage(first, 0);
  cp_async_commit();
  const int r0 = 16 * warp;
#pragma unroll 1
  for (int it = 0; it < count; ++it) {
    const int cidx = first + it, st = it & 1;
    if (it + 1 < count) load_stage(cidx + 1, st ^ 1);
    cp_async_commit();
    // S → bf16 for the products below (Sb is free: the last iteration ended with a barrier); the backward's copy.
    float* keep_h = states.chunk_h ? states.chunk_h + (int64_t(cidx) * H + h) * K * K + c0 : nullptr;
#pragma unroll
    for (int qi = 0; qi < MTW; ++qi) {
      const int mt = warp + 4 * qi;
      if (mt >= MT) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        store2(Sb + (16 * mt + gq) * VS + 8 * nt + 2 * tq, s[qi][nt][0], s[qi][nt][1]);
        store2(Sb + (16 * mt + gq + 8) * VS + 8 * nt + 2 * tq, s[qi][nt][2], s[qi][nt][3]);
        if (keep_h) {
          const int col = 8 * nt + 2 * tq;
          *reinterpret_cast<float2*>(keep_h + (16 * mt + gq) * K + col) = make_float2(s[qi][nt][0], s[qi][nt][1]);
          *reinterpret_cast<float2*>(keep_h + (16 * mt + gq + 8) * K + col) = make_float2(s[qi][nt][2], s[qi][nt][3]);
        }
      }
    }
    cp_async_wait<1>();
    __syncthreads();
    const bf16* Ws = reinterpret_cast<const bf16*>(stage_ptr(st));
    const bf16* Qs = Ws + kC * KS;
    const bf16* Ks = Qs + kC * KS;
    const bf16* As = Ks + kC * KS;
    const bf16* Us = As + kC * AS;
    const float* Gs = reinterpret_cast<const float*>(stage_ptr(st) + L::stage_elems * 2);
    const int64_t t0 = ch.chunk_start[cidx];
    const int n = ch.chunk_len[cidx];

    // v_new = U − W·S and the first half of o = qg·S.
    float p[NT][4], oc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) p[nt][x] = oc[nt][x] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t aw[4], aq[4];
      load_a(aw, Ws + r0 * KS + 16 * kk, KS);
      load_a(aq, Qs + r0 * KS + 16 * kk, KS);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, Sb + 16 * kk * VS + 16 * np, VS);
        mma_bf16(p[2 * np], aw, b[0], b[1]);
        mma_bf16(p[2 * np + 1], aw, b[2], b[3]);
        mma_bf16(oc[2 * np], aq, b[0], b[1]);
        mma_bf16(oc[2 * np + 1], aq, b[2], b[3]);
      }
    }
    const int64_t u_at = (int64_t(cidx) * H + h) * kC * K + c0;
    float* keep_u = states.chunk_u ? states.chunk_u + u_at : nullptr;
    bf16* keep_u16 = states.chunk_u16 ? states.chunk_u16 + u_at : nullptr;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = r0 + gq + 8 * hf, col = 8 * nt + 2 * tq;
        const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(Us + row * VS + col);
        const float v0 = __low2float(u) - p[nt][2 * hf], v1 = __high2float(u) - p[nt][2 * hf + 1];
        store2(VN + row * VS + col, v0, v1);
        if (keep_u && row < n) *reinterpret_cast<float2*>(keep_u + row * K + col) = make_float2(v0, v1);
        if (keep_u16 && row < n) store2(keep_u16 + row * K + col, v0, v1);
      }
    __syncthreads();
    if (rc.vn && it == count - 1) {  // a decoding slot's partial chunk: its v_new rows
      bf16* dst = rc.vn + (t0 / kC * H + h) * kC * K + c0;
      for (int i = tid; i < n * (TV / 8); i += kThreads) {
        const int row = i / (TV / 8), p8 = 8 * (i % (TV / 8));
        *reinterpret_cast<uint4*>(dst + row * K + p8) = *reinterpret_cast<const uint4*>(VN + row * VS + p8);
      }
    }

    // o += Aqk·v_new (causal: column blocks kb ≤ warp), then out.
    for (int kb = 0; kb <= warp; ++kb) {
      uint32_t a[4];
      load_a(a, As + r0 * AS + 16 * kb, AS);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, VN + 16 * kb * VS + 16 * np, VS);
        mma_bf16(oc[2 * np], a, b[0], b[1]);
        mma_bf16(oc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = r0 + gq + 8 * hf;
        if (o && row < n)
          store2(o + (t0 + row) * HK + int64_t(h) * K + c0 + 8 * nt + 2 * tq, oc[nt][2 * hf], oc[nt][2 * hf + 1]);
      }

    // S ← e^gl∘S + kdᵀ·v_new.
#pragma unroll
    for (int qi = 0; qi < MTW; ++qi) {
      const int mt = warp + 4 * qi;
      if (mt >= MT) continue;
      const float e0 = __expf(Gs[16 * mt + gq]), e1 = __expf(Gs[16 * mt + gq + 8]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[qi][nt][0] *= e0;
        s[qi][nt][1] *= e0;
        s[qi][nt][2] *= e1;
        s[qi][nt][3] *= e1;
      }
    }
#pragma unroll
    for (int kb = 0; kb < kC / 16; ++kb) {
      uint32_t b[NT / 2][4];
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) load_b_kn(b[np], VN + 16 * kb * VS + 16 * np, VS);
#pragma unroll
      for (int qi = 0; qi < MTW; ++qi) {
        const int mt = warp + 4 * qi;
        if (mt >= MT) continue;
        uint32_t a[4];
        load_a_t(a, Ks + 16 * kb * KS + 16 * mt, KS);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          mma_bf16(s[qi][2 * np], a, b[np][0], b[np][1]);
          mma_bf16(s[qi][2 * np + 1], a, b[np][2], b[np][3]);
        }
      }
    }
    if (s_out && states.boundary && it == boundary_it) store_state();
    __syncthreads();  // everyone is done with this stage and with VN and Sb
  }
  cp_async_wait<0>();
  if (s_out && !states.boundary) store_state();
}

template <int K, class GT>
void launch_prepare(const bf16* q, const bf16* k, const bf16* v, const GT* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, const KdaChunks& ch, const KdaTcWork& w,
                    int64_t H, cudaStream_t st, const KdaTcRowCache& rc) {
  if (!ch.num_chunks) return;
  const dim3 grid(static_cast<unsigned>(ch.num_chunks), static_cast<unsigned>(H));
  const int bytes = PrepLayout<K>::bytes;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<K, GT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  prepare_kernel<K, GT><<<grid, kPrepThreads, bytes, st>>>(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w,
                                                           static_cast<int>(H), rc);
}

template <int K, int TV>
void launch_state_tv(const KdaChunks& ch, const KdaTcWork& w, bf16* o, int64_t H, const KdaTcStates& states,
                     cudaStream_t st, const KdaTcRowCache& rc) {
  if (!ch.num_seqs) return;
  const int bytes = StateLayout<K, TV>::bytes;
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(state_kernel<K, TV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  state_kernel<K, TV><<<dim3(static_cast<unsigned>(ch.num_seqs), static_cast<unsigned>(H), K / TV), kThreads, bytes,
                        st>>>(w, ch, o, states, static_cast<int>(H), rc);
}

// Value tiles of 64 columns (two blocks per head at K = 128: on the H200 a 32-column tile took 0.73 ms against
// 0.45 ms at T = 8192).
template <int K>
void launch_state(const KdaChunks& ch, const KdaTcWork& w, bf16* o, int64_t H, const KdaTcStates& states,
                  cudaStream_t st, const KdaTcRowCache& rc) {
  launch_state_tv<K, (K < 64 ? K : 64)>(ch, w, o, H, states, st, rc);
}

template <class GT>
void prepare_dispatch(const bf16* q, const bf16* k, const bf16* v, const GT* graw, const float* beta,
                      const float* dt_bias, const float* A_log, float bound, const KdaChunks& ch, const KdaTcWork& w,
                      int64_t H, int64_t K, cudaStream_t st, const KdaTcRowCache& rc) {
  switch (K) {
    case 16: return launch_prepare<16>(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, st, rc);
    case 32: return launch_prepare<32>(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, st, rc);
    case 64: return launch_prepare<64>(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, st, rc);
    case 128: return launch_prepare<128>(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, st, rc);
    default: fail("CUDA KDA (tensor cores): linear_head_dim must be 16, 32, 64 or 128, got ", K);
  }
}

}  // namespace

bool kda_tc_supported(int64_t K, bool has_bound, float bound) {
  return has_bound && bound >= -10.0f && bound < 0.0f && (K == 16 || K == 32 || K == 64 || K == 128);
}

size_t kda_tc_workspace_bytes(int64_t num_chunks, int64_t H, int64_t K) {
  // W, U, qg, kd [64, K] and Aqk [64, 64] in bf16, gl [K] in fp32, per (chunk, head); each array 256-byte aligned.
  const size_t per = static_cast<size_t>(num_chunks * H);
  auto al = [](size_t b) { return (b + 255) / 256 * 256; };
  return 4 * al(per * kC * K * 2) + al(per * kC * kC * 2) + al(per * K * 4);
}

KdaTcWork kda_tc_workspace(void* base, int64_t num_chunks, int64_t H, int64_t K) {
  const size_t per = static_cast<size_t>(num_chunks * H);
  auto al = [](size_t b) { return (b + 255) / 256 * 256; };
  auto* p = static_cast<unsigned char*>(base);
  KdaTcWork w{};
  w.w = reinterpret_cast<bf16*>(p);
  p += al(per * kC * K * 2);
  w.u = reinterpret_cast<bf16*>(p);
  p += al(per * kC * K * 2);
  w.qg = reinterpret_cast<bf16*>(p);
  p += al(per * kC * K * 2);
  w.kd = reinterpret_cast<bf16*>(p);
  p += al(per * kC * K * 2);
  w.aqk = reinterpret_cast<bf16*>(p);
  p += al(per * kC * kC * 2);
  w.gl = reinterpret_cast<float*>(p);
  return w;
}

void kda_tc_prepare(const bf16* q, const bf16* k, const bf16* v, const float* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, const KdaChunks& ch, const KdaTcWork& w,
                    int64_t H, int64_t K, cudaStream_t st, const KdaTcRowCache& rc) {
  prepare_dispatch(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, K, st, rc);
}
void kda_tc_prepare(const bf16* q, const bf16* k, const bf16* v, const bf16* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, const KdaChunks& ch, const KdaTcWork& w,
                    int64_t H, int64_t K, cudaStream_t st, const KdaTcRowCache& rc) {
  prepare_dispatch(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, K, st, rc);
}

void kda_tc_state(const KdaChunks& ch, const KdaTcWork& w, bf16* o, int64_t H, int64_t K, const KdaTcStates& states,
                  cudaStream_t st, const KdaTcRowCache& rc) {
  check(!states.chunk_u || !states.chunk_u16, "CUDA KDA (tensor cores): v_new is kept in fp32 or in bf16, not both");
  switch (K) {
    case 16: return launch_state<16>(ch, w, o, H, states, st, rc);
    case 32: return launch_state<32>(ch, w, o, H, states, st, rc);
    case 64: return launch_state<64>(ch, w, o, H, states, st, rc);
    case 128: return launch_state<128>(ch, w, o, H, states, st, rc);
    default: fail("CUDA KDA (tensor cores): linear_head_dim must be 16, 32, 64 or 128, got ", K);
  }
}

void kda_chunked_tc(const bf16* q, const bf16* k, const bf16* v, const float* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, bf16* o, const KdaChunks& ch,
                    const KdaTcWork& w, int64_t H, int64_t K, const KdaTcStates& states, cudaStream_t st,
                    const KdaTcRowCache& rc) {
  kda_tc_prepare(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, K, st, rc);
  kda_tc_state(ch, w, o, H, K, states, st, rc);
}

void kda_chunked_tc(const bf16* q, const bf16* k, const bf16* v, const bf16* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, bf16* o, const KdaChunks& ch,
                    const KdaTcWork& w, int64_t H, int64_t K, const KdaTcStates& states, cudaStream_t st,
                    const KdaTcRowCache& rc) {
  kda_tc_prepare(q, k, v, graw, beta, dt_bias, A_log, bound, ch, w, H, K, st, rc);
  kda_tc_state(ch, w, o, H, K, states, st, rc);
}

}  // namespace nextlm::cuda
