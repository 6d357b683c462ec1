// The KDA layer backward outside the recurrence: the fused causal conv + SiLU + L2 norm, the decay gate (both forms),
// the β/gate sigmoid and the gated per-head output RMSNorm. The device counterparts of the matching parts of
// kda_layer_backward (src/model/kda_backward.cpp) and rmsnorm_backward (src/model/norm_backward.cpp); the inverses of
// kda_conv_norm, kda_gate and kda_out_norm (src/cuda/kda.cu), whose data layouts they share.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/backward_kernels.h"
#include "cuda/kda_conv.cuh"

namespace nextlm::cuda {

namespace {

constexpr int kMaxW = 8;          // conv taps kept in registers
constexpr int kMaxPer = 8;        // K/32 values per lane, K ≤ 256
constexpr int kMaxParts = 128;    // token ranges of the deterministic parameter-gradient reductions
constexpr int kPartTokens = 64;   // fewest tokens per range
constexpr int kChanThreads = 128; // threads (= channels) per block of the per-channel passes
constexpr int kOutNormRows = 2;   // rows a warp of out_norm_backward_kernel loads together

// Token ranges for the per-channel passes: a function of T only, so the order of every sum is fixed by the shapes.
int64_t num_parts(int64_t T) { return std::min<int64_t>(ceil_div(T, kPartTokens), kMaxParts); }

// Grid of a warp-per-row kernel of 256 threads, capped (the kernels stride over rows).
unsigned warp_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(ceil_div(rows * 32, 256), 1 << 20)); }

// The fast forms (__expf, __fdividef: a few ulp, ~1e-6 relative, against the CPU's 1e-4 bound on these gradients;
// the forward's SiLU is __expf's too). The accurate expf and IEEE division cost the conv + norm backward a sixth of its
// time and the gate backward two fifths (H200, slice4_lora_step_T4096: 2.03 -> 1.74 and 0.61 -> 0.36 ms over 3 layers).
// As x → −∞ the denominator overflows to +∞ and σ is 0, as it should be.
__device__ __forceinline__ float sigm(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
// SiLU'(x) from s = sigm(x).
__device__ __forceinline__ float silu_grad(float x, float s) { return s * (1.0f + x * (1.0f - s)); }

// ---- conv + SiLU + L2 norm ----

// One row (token, head, which of q/k/v) of dpre [T, 3·HK] from its pre-activations: pre[i] and dy[i] are channel
// lane + 32i's (i < per, channel < K) pre-activation and output gradient; dpre = SiLU'(pre)·(L2-norm backward of dy),
// with act = SiLU(pre), y = scale·act/n, n = sqrt(Σact² + 1e-6): dact = scale·(dy/n − act·Σ(dy⊙act)/n³). v has no
// norm.
// dpre_vals leaves the row in registers (out[i] for channel lane + 32i, 0 for the others); dpre_row stores it.
template <int N>
__device__ __forceinline__ void dpre_vals(const float (&pre)[N], int per, const float (&dy)[N], int64_t which,
                                          float qscale, int64_t K, float (&out)[N]) {
  const int lane = threadIdx.x & 31;
  float act[N], g[N], sg[N];  // sg: the sigmoid, formed once for act and for SiLU'
  float ss = 0.0f, dot = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    act[i] = g[i] = sg[i] = 0.0f;
    const int64_t d = lane + 32 * i;
    if (i >= per || d >= K) continue;
    sg[i] = sigm(pre[i]);
    act[i] = pre[i] * sg[i];
    g[i] = dy[i];
    ss += act[i] * act[i];
    dot += g[i] * act[i];
  }
  float scale = 1.0f, inv_n = 1.0f, c = 0.0f;
  if (which < 2) {
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float n = sqrtf(ss + 1e-6f);
    inv_n = 1.0f / n;
    c = dot / (n * n * n);
    scale = which == 0 ? qscale : 1.0f;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    out[i] = 0.0f;
    const int64_t d = lane + 32 * i;
    if (i >= per || d >= K) continue;
    const float dact = which < 2 ? scale * (g[i] * inv_n - act[i] * c) : g[i];
    out[i] = dact * silu_grad(pre[i], sg[i]);
  }
}
template <int N>
__device__ __forceinline__ void dpre_row(const float (&pre)[N], int per, const float (&dy)[N], int64_t which,
                                         float qscale, int64_t K, float* out) {
  const int lane = threadIdx.x & 31;
  float v[N];
  dpre_vals(pre, per, dy, which, qscale, K, v);
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < per && lane + 32 * i < K) out[lane + 32 * i] = v[i];
}

// One warp per (token, head, which), as conv_norm_kernel: recompute pre = conv(raw) of its K channels, then its dpre
// row. The per-lane arrays stay in registers: every loop over them unrolls over kMaxPer with `per` as a guard.
__global__ void conv_norm_dpre_kernel(const float* raw, const float* conv, const int32_t* seq_start, const float* dq,
                                      const float* dk, const float* dv, float* dpre, int64_t T, int64_t H, int64_t K,
                                      int64_t W, float qscale) {
  const int lane = threadIdx.x & 31;
  const int64_t HK = H * K, C3 = 3 * HK, rows = T * H * 3;
  const int per = static_cast<int>((K + 31) / 32);
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t wid = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; wid < rows; wid += nwarps) {
    const int64_t which = wid % 3, h = (wid / 3) % H, t = wid / (3 * H);
    const int64_t s0 = seq_start[t];
    float pre[kMaxPer];
#pragma unroll
    for (int i = 0; i < kMaxPer; ++i) {
      pre[i] = 0.0f;
      const int64_t d = lane + 32 * i;
      if (i >= per || d >= K) continue;
      const int64_t ch = which * HK + h * K + d;
      float acc = 0.0f;
      for (int64_t w = 0; w < W; ++w) {
        const int64_t src = t + w - (W - 1);
        if (src >= s0) acc += conv[ch * W + w] * raw[src * C3 + ch];
      }
      pre[i] = acc;
    }
    const float* dy = (which == 0 ? dq : (which == 1 ? dk : dv)) + (t * H + h) * K;
    float g[kMaxPer];
#pragma unroll
    for (int i = 0; i < kMaxPer; ++i) g[i] = i < per && lane + 32 * i < K ? dy[lane + 32 * i] : 0.0f;
    dpre_row(pre, per, g, which, qscale, K, dpre + t * C3 + which * HK + h * K);
  }
}

// The same for W taps and up to 32·PER channels a head (compile-time): a warp runs one (head, which) over
// kda_conv::kRunTokens consecutive tokens with its channels' taps and last rows in registers (kda_conv.cuh), as
// kda.cu's conv_norm_rows_kernel; every element's arithmetic and lanes are conv_norm_dpre_kernel's, so the same bits.
template <int W, int PER>
__global__ void __launch_bounds__(256, 2)
    conv_norm_dpre_rows_kernel(const float* __restrict__ raw, const float* __restrict__ conv,
                               const int32_t* __restrict__ seq_start, const float* __restrict__ dq,
                               const float* __restrict__ dk, const float* __restrict__ dv, float* __restrict__ dpre,
                               int64_t T, int64_t H, int64_t K, float qscale) {
  const int lane = threadIdx.x & 31;
  const int64_t HK = H * K, C3 = 3 * HK, nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t wid = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; wid < kda_conv::runs(T, H);
       wid += nwarps) {
    const kda_conv::Run r = kda_conv::run_of(wid, T, H);
    const float* dsrc = r.which == 0 ? dq : (r.which == 1 ? dk : dv);
    kda_conv::Window<W, PER> win;
    win.load(raw, conv, r, H, K);
    kda_conv::Group<PER> dy;  // the output gradients of the group's tokens, loaded with their rows of raw
    win.walk(
        raw, seq_start, C3, K, r,
        [&](int64_t t0) {
          dy.load(t0, r.t1, K, [&](int64_t t, int i) { return dsrc[(t * H + r.h) * K + lane + 32 * i]; });
        },
        [&](int u, int64_t t, const float (&pre)[PER]) {
          dpre_row(pre, PER, dy.x[u], r.which, qscale, K, dpre + t * C3 + r.which * HK + r.h * K);
        });
  }
}

// Grid (channel blocks, token ranges); a thread owns one channel of one token range. pre[t] = Σ_i w[i]·x[t+i−(W−1)]
// over taps inside t's sequence, so
//   dx[s] += Σ_i w[i]·dpre[s+(W−1)−i]   (the later token in s's sequence, i.e. seq_start of it ≤ s),
//   dw[i] += Σ_t dpre[t]·x[t+i−(W−1)]   (per-range partials [parts, C3, W] in part, summed by conv_dw_reduce_kernel).
// The W rows of x before t and of dpre (with their seq_start) from t on slide along in registers, so each token
// reads one new row of each; those of kda_conv::kGroup tokens are loaded together.
// OutT float: draw += dx; bf16: draw = bf16(dx) (every element of the token range has one writer).
template <int W, class OutT>
__global__ void conv_backward_kernel(const float* __restrict__ raw, const float* __restrict__ conv,
                                     const int32_t* __restrict__ seq_start, const float* __restrict__ dpre,
                                     OutT* __restrict__ draw, float* __restrict__ part, int64_t T, int64_t C3,
                                     int64_t span) {
  constexpr bool kAdd = std::is_same_v<OutT, float>;
  const int64_t ch = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (ch >= C3) return;
  const int64_t t_begin = blockIdx.y * span, t_end = t_begin + span < T ? t_begin + span : T;
  // At token t: xr[i] = x[t+i−(W−1)] (0 before the start), dp[j] = dpre[t+j] and sd[j] = seq_start[t+j] (0 and
  // INT32_MAX past the end).
  float w[W], acc[W], xr[W], dp[W];
  int32_t sd[W];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    w[i] = conv[ch * W + i];
    acc[i] = 0.0f;
    const int64_t src = t_begin + i - (W - 1), dst = t_begin + i;
    xr[i] = i < W - 1 && src >= 0 && src < T ? raw[src * C3 + ch] : 0.0f;  // a range past T is empty
    dp[i] = i < W - 1 && dst < T ? dpre[dst * C3 + ch] : 0.0f;
    sd[i] = i < W - 1 && dst < T ? seq_start[dst] : INT32_MAX;
  }
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kda_conv::kGroup) {
    // The new rows of kda_conv::kGroup tokens, all loads issued before the first is used.
    float xg[kda_conv::kGroup], dg[kda_conv::kGroup], rg[kda_conv::kGroup];
    int32_t sg[kda_conv::kGroup];
#pragma unroll
    for (int u = 0; u < kda_conv::kGroup; ++u) {
      const int64_t t = t0 + u, last = t + W - 1;
      const bool in = t < t_end, tail = in && last < T;
      xg[u] = in ? raw[t * C3 + ch] : 0.0f;
      if constexpr (kAdd) rg[u] = in ? draw[t * C3 + ch] : 0.0f;
      dg[u] = tail ? dpre[last * C3 + ch] : 0.0f;
      sg[u] = tail ? seq_start[last] : INT32_MAX;
    }
#pragma unroll
    for (int u = 0; u < kda_conv::kGroup; ++u) {
      const int64_t t = t0 + u;
      if (t >= t_end) break;
      xr[W - 1] = xg[u], dp[W - 1] = dg[u], sd[W - 1] = sg[u];
      const float d = dp[0];
      const int64_t s0 = sd[0];
      float dx = 0.0f;
#pragma unroll
      for (int i = 0; i < W; ++i) {
        if (t + i - (W - 1) >= s0) acc[i] += d * xr[i];
        if (t + (W - 1) - i < T && sd[W - 1 - i] <= t) dx += w[i] * dp[W - 1 - i];  // the token whose tap i reads t
      }
      if constexpr (kAdd) draw[t * C3 + ch] = rg[u] + dx;
      else draw[t * C3 + ch] = __float2bfloat16(dx);
#pragma unroll
      for (int i = 0; i + 1 < W; ++i) xr[i] = xr[i + 1], dp[i] = dp[i + 1], sd[i] = sd[i + 1];
    }
  }
  float* out = part + (blockIdx.y * C3 + ch) * W;
#pragma unroll
  for (int i = 0; i < W; ++i) out[i] = acc[i];
}

// dconv [C3·W] += Σ_p part[p] in p order.
__global__ void conv_dw_reduce_kernel(const float* part, float* dconv, int64_t n, int64_t parts) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  float s = 0.0f;
  for (int64_t p = 0; p < parts; ++p) s += part[p * n + i];
  dconv[i] += s;
}

// Blocks of 4 warps, as many an SM as the registers of the lanes' PER channels allow without spilling much (at PER 4,
// three: ~170 registers, 12 warps an SM).
constexpr int kFusedThreads = 128;

// The two passes above in one kernel, for compile-time W taps and up to 32·PER channels a head: a warp takes one
// (head, q/k/v block) over one token range of the per-channel pass (span tokens), its lanes holding channels
// lane + 32i as conv_norm_dpre_rows_kernel does. It forms dpre of the range's tokens and of the W − 1 after it (the
// taps of those read the range's last rows) in registers and never stores them: at token t it adds dpre[t] into the
// dw partials and emits dx of token t − (W−1), whose taps' dpre are then all in the ring. Every element's arithmetic,
// and the order of every sum, is the two kernels' (the same bits, tested): dpre by dpre_vals, dx over the taps in
// order, dw over the range's tokens in order. raw and the output gradients are read once (the W − 1 rows past each
// range twice) and dpre never goes through memory. DW false: the conv frozen, no partials.
template <int W, int PER, class OutT, bool DW>
__global__ void __launch_bounds__(kFusedThreads, PER >= 8 ? 2 : (PER == 4 ? 3 : 4))
    conv_norm_bwd_fused_kernel(const float* __restrict__ raw, const float* __restrict__ conv,
                               const int32_t* __restrict__ seq_start, const float* __restrict__ dq,
                               const float* __restrict__ dk, const float* __restrict__ dv,
                               OutT* __restrict__ draw, float* __restrict__ part, int64_t T, int64_t H, int64_t K,
                               float qscale, int64_t span, int64_t parts) {
  constexpr bool kAdd = std::is_same_v<OutT, float>;
  constexpr int G = kda_conv::kGroup;
  const int lane = threadIdx.x & 31;
  const int64_t HK = H * K, C3 = 3 * HK;
  const int64_t wid = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (wid >= parts * H * 3) return;
  const int64_t which = wid % 3, h = (wid / 3) % H, p = wid / (3 * H);
  // Token indices in 32 bits (T < 2^31 tokens: seq_start is int32): the per-tap tests are most of the kernel's
  // integer work. The branches on them below are warp-uniform (a token's sequence start is the same for every lane).
  const int Ti = static_cast<int>(T);
  const int t_begin = static_cast<int>(std::min<int64_t>(p * span, T));
  const int t_end = static_cast<int>(std::min<int64_t>(p * span + span, T));
  const int t_last = t_end + W - 1;                                   // steps run over tokens t_begin … t_last − 1
  const int t_stop = t_last < Ti ? t_last : Ti;                       // dpre is formed for tokens < t_stop
  const float* dsrc = (which == 0 ? dq : (which == 1 ? dk : dv)) + h * K + lane;
  // The taps and the W − 1 rows of raw before the range (t_begin ≤ T: those rows are inside raw).
  kda_conv::Window<W, PER> win;
  win.load(raw, conv, kda_conv::Run{which, h, t_begin, t_end}, H, K);
  const int64_t col = win.col;
  bool on[PER];
  float dp[PER][W], acc[PER][W];
  int sd[W];  // seq_start of the ring's tokens (INT32_MAX past T)
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    on[i] = lane + 32 * i < K;
#pragma unroll
    for (int w = 0; w < W; ++w) dp[i][w] = acc[i][w] = 0.0f;
  }
#pragma unroll
  for (int w = 0; w < W; ++w) sd[w] = INT32_MAX;
  // Tokens t_begin … t_last − 1: the last W − 1 of them only complete dx of the range's last tokens.
  for (int t0 = t_begin; t0 < t_last; t0 += G) {
    float xg[G][PER], gg[G][PER];
    int sg[G];
#pragma unroll
    for (int u = 0; u < G; ++u) {
      const int t = t0 + u;
      const bool in = t < t_stop;
      sg[u] = in ? seq_start[t] : INT32_MAX;
      const float* xr = raw + int64_t(t) * C3 + col;
      const float* gr = dsrc + int64_t(t) * HK;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        xg[u][i] = in && on[i] ? xr[32 * i] : 0.0f;
        gg[u][i] = in && on[i] ? gr[32 * i] : 0.0f;
      }
    }
    // Token t0 + u of the group. FAST: the whole group away from the range's ends and from sequence starts (every
    // tap of its tokens, and of those whose dx they complete, inside one sequence: the common case), so every test
    // below is known true and the four tokens' straight-line code can interleave.
    auto step = [&](int u, auto fast) {
      constexpr bool F = decltype(fast)::value;
      const int t = t0 + u;
      float d[PER];
      if (F || t < t_stop) {
        const bool inside = F || t - (W - 1) >= sg[u];
        float pre[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const float a = F ? win.conv_inside(xg[u][i], i) : win.conv_at(xg[u][i], t, sg[u], i);
          pre[i] = on[i] ? a : 0.0f;
        }
        dpre_vals(pre, PER, gg[u], which, qscale, K, d);
        if (DW && (F || t < t_end)) {
          if (inside) {
#pragma unroll
            for (int i = 0; i < PER; ++i)
#pragma unroll
              for (int w = 0; w < W; ++w) acc[i][w] += d[i] * win.rows[i][w];
          } else {
#pragma unroll
            for (int i = 0; i < PER; ++i)
#pragma unroll
              for (int w = 0; w < W; ++w)
                if (t + w - (W - 1) >= sg[u]) acc[i][w] += d[i] * win.rows[i][w];
          }
        }
        win.shift();
      } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) d[i] = 0.0f;
      }
      // The ring: dp[·][j] = dpre[t − (W−1) + j].
#pragma unroll
      for (int w = 0; w + 1 < W; ++w) sd[w] = sd[w + 1];
      sd[W - 1] = sg[u];
#pragma unroll
      for (int i = 0; i < PER; ++i) {
#pragma unroll
        for (int w = 0; w + 1 < W; ++w) dp[i][w] = dp[i][w + 1];
        dp[i][W - 1] = d[i];
      }
      const int s = t - (W - 1);
      if (!F && s < t_begin) return;
      // The ring's tokens all in s's sequence (seq_start is non-decreasing, so the last one's start decides) and
      // before T: every tap adds, in the same order as the tested form.
      const bool whole = F || (t < Ti && sd[W - 1] <= s);
      OutT* o = draw + int64_t(s) * C3 + col;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        if (!on[i]) continue;
        float dx = 0.0f;
        if (whole) {
#pragma unroll
          for (int w = 0; w < W; ++w) dx += win.taps[i][w] * dp[i][W - 1 - w];
        } else {
#pragma unroll
          for (int w = 0; w < W; ++w)  // the token whose tap w reads s
            if (s + (W - 1) - w < Ti && sd[W - 1 - w] <= s) dx += win.taps[i][w] * dp[i][W - 1 - w];
        }
        if constexpr (kAdd) o[32 * i] = o[32 * i] + dx;
        else o[32 * i] = __float2bfloat16(dx);
      }
    };
    // (t0 + G ≤ t_end ≤ T: all four are formed and are the range's; sg[G − 1], the group's last sequence start, is
    // the largest.)
    if (t0 + G <= t_end && t0 - (W - 1) >= t_begin && t0 - (W - 1) >= sg[G - 1]) {
#pragma unroll
      for (int u = 0; u < G; ++u) step(u, std::true_type{});
    } else {
#pragma unroll
      for (int u = 0; u < G; ++u)
        if (t0 + u < t_last) step(u, std::false_type{});
    }
  }
  if constexpr (DW) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (!on[i]) continue;
      float* out = part + (p * C3 + col + 32 * i) * W;
#pragma unroll
      for (int w = 0; w < W; ++w) out[w] = acc[i][w];
    }
  }
}

// ---- the decay gate ----

// Grid (column blocks, token ranges); a thread owns one column c = h·K + d of one token range: df (written) and the
// range's partial sums of df (for dt_bias) and of the A_log gradient of that column, in part [2, parts, HK].
//   bound:    g = lb·sigmoid(rate·f):      dz = dg·lb·σ(1−σ); df = dz·rate; dA = dz·rate·f;
//   softplus: g = −rate·softplus(f):       df = −dg·rate·sigmoid(f) (1 past the f > 20 cutoff); dA = dg·g.
__global__ void gate_backward_kernel(const float* f, const float* dt_bias, const float* A_log, const float* dg,
                                     float* df, bf16* df16, float* part, int64_t T, int64_t H, int64_t K,
                                     bool has_bound, float bound, int64_t span, int64_t parts) {
  const int64_t HK = H * K, c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= HK) return;
  const int64_t t_begin = blockIdx.y * span, t_end = t_begin + span < T ? t_begin + span : T;
  const float rate = expf(A_log[c / K]), bias = dt_bias[c];
  float sdf = 0.0f, sdA = 0.0f;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t i = t * HK + c;
    const float x = f[i] + bias, gd = dg[i];
    float d;
    if (has_bound) {
      const float s = sigm(rate * x);
      const float dz = gd * bound * s * (1.0f - s);
      d = dz * rate;
      sdA += dz * rate * x;
    } else {
      d = -gd * rate * (x > 20.0f ? 1.0f : sigm(x));
      sdA += gd * (-rate * (x > 20.0f ? x : logf(1.0f + expf(x))));
    }
    if (df16)
      df16[i] = __float2bfloat16_rn(d);
    else
      df[i] = d;
    sdf += d;
  }
  part[blockIdx.y * HK + c] = sdf;
  part[(parts + blockIdx.y) * HK + c] = sdA;
}

// ddt_bias [HK] += Σ_p part_df[p] in p order.
__global__ void gate_dt_reduce_kernel(const float* part, float* ddt_bias, int64_t HK, int64_t parts) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= HK) return;
  float s = 0.0f;
  for (int64_t p = 0; p < parts; ++p) s += part[p * HK + c];
  ddt_bias[c] += s;
}

// One block per head: dA_log[h] += Σ over (range, d) of part_dA, each thread summing a fixed subset, then block_sum.
__global__ void gate_dA_reduce_kernel(const float* part_dA, float* dA_log, int64_t H, int64_t K, int64_t parts) {
  __shared__ float scratch[32];
  const int64_t h = blockIdx.x, HK = H * K, n = parts * K;
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += part_dA[(j / K) * HK + h * K + j % K];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) dA_log[h] += s;
}

// ---- sigmoid ----

__global__ void sigmoid_backward_kernel(const float* y, float* d, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    d[i] *= y[i] * (1.0f - y[i]);
}

// ---- the gated output norm ----

// Warps stride over the rows (token, head) of K. With r = rsqrt(mean(o²) + eps), σ = sigmoid(gate), dn = don·σ:
//   dgate = don·(w⊙o·r)·σ(1−σ) (written), do += r·w⊙dn − o·r³·Σ(w⊙dn⊙o)/K (= without accumulate),
//   dw += Σ_rows dn⊙o·r.
// A lane keeps its columns' dw sums over the warp's rows; the block adds its warps in order into part [blocks, K].
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(bf16 x) { return __bfloat162float(x); }

// OT: o in fp32, or in bf16 as the tensor-core recurrence writes it (widened exactly: the same sums).
template <int PER, class OT>
__global__ void __launch_bounds__(256, 4)
    out_norm_backward_kernel(const OT* o, const float* gate, const float* w, const float* don, float* do_,
                             bf16* do16, float* dgate, bf16* dgate16, float* part, int64_t rows, int64_t K, float eps,
                             bool accumulate) {
  __shared__ float red[8][PER * 32];  // [warp, K] (K ≤ 32·PER, 256 threads)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  float wv[PER], dwacc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int64_t d = lane + 32 * i;
    wv[i] = d < K ? w[d] : 0.0f;
    dwacc[i] = 0.0f;
  }
  // A warp's rows are row0, row0 + nwarps, …; kOutNormRows of them at a time, all their loads issued first.
  for (int64_t row0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; row0 < rows;
       row0 += kOutNormRows * nwarps) {
    float x[kOutNormRows][PER], gt[kOutNormRows][PER], dr[kOutNormRows][PER], dold[kOutNormRows][PER];
#pragma unroll
    for (int j = 0; j < kOutNormRows; ++j) {
      const int64_t row = row0 + j * nwarps;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int64_t d = lane + 32 * i;
        const bool on = row < rows && d < K;
        x[j][i] = on ? widen(o[row * K + d]) : 0.0f;
        gt[j][i] = on ? gate[row * K + d] : 0.0f;
        dr[j][i] = on ? don[row * K + d] : 0.0f;
        dold[j][i] = on && accumulate ? do_[row * K + d] : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kOutNormRows; ++j) {
      const int64_t row = row0 + j * nwarps;
      if (row >= rows) break;
      float dn[PER], sg[PER];
      float ss = 0.0f, dot = 0.0f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        dn[i] = sg[i] = 0.0f;
        const int64_t d = lane + 32 * i;
        if (d >= K) continue;
        sg[i] = sigm(gt[j][i]);
        dn[i] = dr[j][i] * sg[i];
        ss += x[j][i] * x[j][i];
        dot += wv[i] * dn[i] * x[j][i];
      }
      ss = warp_sum(ss);
      dot = warp_sum(dot);
      const float r = 1.0f / sqrtf(ss / K + eps);
      const float c = dot / K * r * r * r;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int64_t d = lane + 32 * i;
        if (d >= K) continue;
        const float xr = x[j][i] * r;
        const float dgv = dr[j][i] * (wv[i] * xr) * sg[i] * (1.0f - sg[i]);
        if (dgate16)
          dgate16[row * K + d] = __float2bfloat16_rn(dgv);
        else
          dgate[row * K + d] = dgv;
        const float dov = dold[j][i] + (r * wv[i] * dn[i] - c * x[j][i]);
        if (do16)
          do16[row * K + d] = __float2bfloat16_rn(dov);
        else
          do_[row * K + d] = dov;
        dwacc[i] += dn[i] * xr;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < PER; ++i)
    red[warp][lane + 32 * i] = dwacc[i];
  __syncthreads();
  const int nw = blockDim.x >> 5;
  for (int64_t d = threadIdx.x; d < K; d += blockDim.x) {
    float s = 0.0f;
    for (int j = 0; j < nw; ++j) s += red[j][d];
    part[blockIdx.x * K + d] = s;
  }
}

// dw [K] += Σ_b part[b] in b order.
__global__ void out_norm_dw_reduce_kernel(const float* part, float* dw, int64_t K, int64_t blocks) {
  const int64_t d = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (d >= K) return;
  float s = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) s += part[b * K + d];
  dw[d] += s;
}

// Blocks of the output-norm backward: a function of the row count only (fixed reduction order).
int64_t out_norm_blocks(int64_t rows) { return std::min<int64_t>(ceil_div(rows, 8), 512); }

}  // namespace

// The fused kernel's path: the model's 4 taps, unless the test asks for the two passes.
bool conv_fused(int64_t W, bool two_pass) { return W == 4 && !two_pass; }

int64_t kda_conv_norm_backward_workspace_floats(int64_t T, int64_t H, int64_t K, int64_t W, bool two_pass) {
  return (conv_fused(W, two_pass) ? 0 : T * 3 * H * K) + num_parts(T) * 3 * H * K * W;
}

void kda_conv_norm_backward(const float* raw, const float* conv, const int32_t* seq_start, const float* dq,
                            const float* dk, const float* dv, float* draw, float* dconv, int64_t T, int64_t H,
                            int64_t K, int64_t W, float* work, cudaStream_t st, bf16* draw16, bool two_pass) {
  check(K <= 32 * kMaxPer, "CUDA KDA backward: linear_head_dim must be at most 256, got ", K);
  check(!draw != !draw16, "CUDA KDA backward: the conv's input gradient goes to exactly one of draw and draw16");
  check(W >= 1 && W <= kMaxW, "CUDA KDA backward: conv kernel size must be 1..", kMaxW, ", got ", W);
  if (T <= 0 || H * K == 0) return;
  const int64_t C3 = 3 * H * K, parts = num_parts(T), span = ceil_div(T, parts);
  const float qscale = rsqrtf(static_cast<float>(K));
  if (conv_fused(W, two_pass)) {
    check(T < INT32_MAX, "CUDA KDA backward: ", T, " tokens, more than the conv kernel's 32-bit token indices");
    float* part = work;  // [parts, C3, W]
    const unsigned g = static_cast<unsigned>(ceil_div(parts * H * 3 * 32, kFusedThreads));
    auto fused = [&](auto per, auto dw) {
      constexpr int kPer = decltype(per)::value;
      constexpr bool kDw = decltype(dw)::value;
      if (draw16)
        conv_norm_bwd_fused_kernel<4, kPer, bf16, kDw><<<g, kFusedThreads, 0, st>>>(
            raw, conv, seq_start, dq, dk, dv, draw16, part, T, H, K, qscale, span, parts);
      else
        conv_norm_bwd_fused_kernel<4, kPer, float, kDw><<<g, kFusedThreads, 0, st>>>(
            raw, conv, seq_start, dq, dk, dv, draw, part, T, H, K, qscale, span, parts);
    };
    auto by_width = [&](auto dw) {
      if (K <= 32) fused(std::integral_constant<int, 1>{}, dw);
      else if (K <= 64) fused(std::integral_constant<int, 2>{}, dw);
      else if (K <= 128) fused(std::integral_constant<int, 4>{}, dw);
      else fused(std::integral_constant<int, 8>{}, dw);
    };
    if (dconv) by_width(std::true_type{});
    else by_width(std::false_type{});
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    if (!dconv) return;  // the conv frozen
    const int64_t n = C3 * W;
    conv_dw_reduce_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, st>>>(part, dconv, n, parts);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  float* dpre = work;                  // [T, C3]
  float* part = work + T * C3;         // [parts, C3, W]
  if (W == 4) {  // the config's tap count (linear_conv_kernel_dim); others take the one-token-a-warp kernel
    const unsigned g = warp_grid(ceil_div(T, kda_conv::kRunTokens) * H * 3);
    if (K <= 32)
      conv_norm_dpre_rows_kernel<4, 1><<<g, 256, 0, st>>>(raw, conv, seq_start, dq, dk, dv, dpre, T, H, K, qscale);
    else if (K <= 64)
      conv_norm_dpre_rows_kernel<4, 2><<<g, 256, 0, st>>>(raw, conv, seq_start, dq, dk, dv, dpre, T, H, K, qscale);
    else if (K <= 128)
      conv_norm_dpre_rows_kernel<4, 4><<<g, 256, 0, st>>>(raw, conv, seq_start, dq, dk, dv, dpre, T, H, K, qscale);
    else
      conv_norm_dpre_rows_kernel<4, 8><<<g, 256, 0, st>>>(raw, conv, seq_start, dq, dk, dv, dpre, T, H, K, qscale);
  } else {
    conv_norm_dpre_kernel<<<warp_grid(T * H * 3), 256, 0, st>>>(raw, conv, seq_start, dq, dk, dv, dpre, T, H, K, W,
                                                                qscale);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  const dim3 grid(static_cast<unsigned>(ceil_div(C3, kChanThreads)), static_cast<unsigned>(parts));
  auto conv_bwd = [&](auto tap_count) {
    constexpr int kW = decltype(tap_count)::value;
    if (draw16)
      conv_backward_kernel<kW, bf16><<<grid, kChanThreads, 0, st>>>(raw, conv, seq_start, dpre, draw16, part, T, C3,
                                                                     span);
    else
      conv_backward_kernel<kW, float><<<grid, kChanThreads, 0, st>>>(raw, conv, seq_start, dpre, draw, part, T, C3,
                                                                      span);
  };
  switch (W) {  // the taps as a compile-time count (1 … kMaxW, checked above)
    case 1: conv_bwd(std::integral_constant<int, 1>{}); break;
    case 2: conv_bwd(std::integral_constant<int, 2>{}); break;
    case 3: conv_bwd(std::integral_constant<int, 3>{}); break;
    case 4: conv_bwd(std::integral_constant<int, 4>{}); break;
    case 5: conv_bwd(std::integral_constant<int, 5>{}); break;
    case 6: conv_bwd(std::integral_constant<int, 6>{}); break;
    case 7: conv_bwd(std::integral_constant<int, 7>{}); break;
    default: conv_bwd(std::integral_constant<int, 8>{}); break;
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (!dconv) return;  // the conv frozen
  const int64_t n = C3 * W;
  conv_dw_reduce_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, st>>>(part, dconv, n, parts);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

int64_t kda_gate_backward_workspace_floats(int64_t T, int64_t H, int64_t K) { return 2 * num_parts(T) * H * K; }

void kda_gate_backward(const float* f, const float* dt_bias, const float* A_log, const float* dg, float* df,
                       float* ddt_bias, float* dA_log, int64_t T, int64_t H, int64_t K, bool has_bound, float bound,
                       float* work, cudaStream_t st, bf16* df16) {
  if (T <= 0 || H * K == 0) return;
  const int64_t HK = H * K, parts = num_parts(T), span = ceil_div(T, parts);
  const unsigned cblocks = static_cast<unsigned>(ceil_div(HK, kChanThreads));
  gate_backward_kernel<<<dim3(cblocks, static_cast<unsigned>(parts)), kChanThreads, 0, st>>>(
      f, dt_bias, A_log, dg, df, df16, work, T, H, K, has_bound, bound, span, parts);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (ddt_bias) {
    gate_dt_reduce_kernel<<<cblocks, kChanThreads, 0, st>>>(work, ddt_bias, HK, parts);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
  if (dA_log) {
    gate_dA_reduce_kernel<<<static_cast<unsigned>(H), 256, 0, st>>>(work + parts * HK, dA_log, H, K, parts);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  }
}

void sigmoid_backward_inplace(const float* y, float* d, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  sigmoid_backward_kernel<<<static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 65535)), 256, 0, st>>>(y, d, n);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

int64_t kda_out_norm_backward_workspace_floats(int64_t T, int64_t H, int64_t K) {
  return out_norm_blocks(T * H) * K;
}

namespace {

template <class OT>
void out_norm_backward(const OT* o, const float* gate, const float* w, const float* don, float* do_, float* dgate,
                       float* dw, int64_t T, int64_t H, int64_t K, float eps, float* work, cudaStream_t st,
                       bool accumulate, bf16* dgate16, bf16* do16) {
  check(K <= 32 * kMaxPer, "CUDA KDA backward: linear_head_dim must be at most 256, got ", K);
  check(!do_ != !do16 && !(do16 && accumulate),
        "CUDA KDA backward: the output norm's dO goes to exactly one of do_ and do16 (written, not added to)");
  const int64_t rows = T * H;
  if (rows <= 0 || K == 0) return;
  const int64_t blocks = out_norm_blocks(rows);
  auto run = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), 256, 0, st>>>(o, gate, w, don, do_, do16, dgate, dgate16, work, rows, K,
                                                          eps, accumulate);
  };
  if (K <= 32) run(out_norm_backward_kernel<1, OT>);
  else if (K <= 64) run(out_norm_backward_kernel<2, OT>);
  else if (K <= 128) run(out_norm_backward_kernel<4, OT>);
  else run(out_norm_backward_kernel<8, OT>);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (!dw) return;  // the norm frozen
  out_norm_dw_reduce_kernel<<<static_cast<unsigned>(ceil_div(K, 256)), 256, 0, st>>>(work, dw, K, blocks);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void kda_out_norm_backward(const float* o, const float* gate, const float* w, const float* don, float* do_,
                           float* dgate, float* dw, int64_t T, int64_t H, int64_t K, float eps, float* work,
                           cudaStream_t st, bool accumulate, bf16* dgate16, bf16* do16) {
  out_norm_backward(o, gate, w, don, do_, dgate, dw, T, H, K, eps, work, st, accumulate, dgate16, do16);
}
void kda_out_norm_backward(const bf16* o, const float* gate, const float* w, const float* don, float* do_,
                           float* dgate, float* dw, int64_t T, int64_t H, int64_t K, float eps, float* work,
                           cudaStream_t st, bool accumulate, bf16* dgate16, bf16* do16) {
  out_norm_backward(o, gate, w, don, do_, dgate, dw, T, H, K, eps, work, st, accumulate, dgate16, do16);
}

}  // namespace nextlm::cuda
