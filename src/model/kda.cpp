// KDA forward in fp32, matching Glm5NextTextLinearAttention, recurrent_kimi_delta_attention and
// chunk_kimi_delta_attention of transformers 5.17.0 (and fla's naive references).
#include "model/kda.h"

#include <cmath>

#include "core/error.h"
#include "cpu/linear.h"
#include "model/norm.h"

namespace nextlm {

void kda_recurrent_forward(const KdaSeq& s, float* S) {
  const int64_t K = s.K;
  std::vector<float> mem(K);
  for (int64_t t = 0; t < s.T; ++t) {
    const float* q = s.q + t * s.ld;
    const float* k = s.k + t * s.ld;
    const float* v = s.v + t * s.ld;
    const float* g = s.g + t * s.ld;
    const float b = s.beta[t * s.ldb];
    for (int64_t i = 0; i < K; ++i) {
      const float e = std::exp(g[i]);
      for (int64_t j = 0; j < K; ++j) S[i * K + j] *= e;
    }
    // u = beta·(v − Sᵀk); S += k uᵀ; o = Sᵀq
    for (int64_t j = 0; j < K; ++j) mem[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) mem[j] += S[i * K + j] * k[i];
    for (int64_t j = 0; j < K; ++j) mem[j] = b * (v[j] - mem[j]);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) S[i * K + j] += k[i] * mem[j];
    float* o = s.o + t * s.ld;
    for (int64_t j = 0; j < K; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) o[j] += S[i * K + j] * q[i];
  }
}

// Chunked WY form: within a chunk of C tokens, with gc the in-chunk cumulative log decay,
//   A = (I + strict_lower(diag(β) K ⊙ decay Kᵀ))⁻¹ by forward substitution,
//   U = A·(β v),  Wk = A·(β k ⊙ exp(gc)),  v_new = U − Wk·S,
//   o = (q ⊙ exp(gc))·S + causal(q ⊙ decay · kᵀ)·v_new,
//   S ← exp(gc_last) ⊙ S + (k ⊙ exp(gc_last − gc))ᵀ·v_new.
void kda_chunked_forward(const KdaSeq& s, float* S, int64_t C) {
  const int64_t K = s.K;
  std::vector<float> gc(C * K), kb(C * K), A(C * C), U(C * K), Wk(C * K), vnew(C * K), qa(C * C), row(C);
  for (int64_t c0 = 0; c0 < s.T; c0 += C) {
    const int64_t n = std::min(C, s.T - c0);
    auto q = [&](int64_t i) { return s.q + (c0 + i) * s.ld; };
    auto k = [&](int64_t i) { return s.k + (c0 + i) * s.ld; };
    auto v = [&](int64_t i) { return s.v + (c0 + i) * s.ld; };
    for (int64_t i = 0; i < n; ++i) {
      const float* g = s.g + (c0 + i) * s.ld;
      const float b = s.beta[(c0 + i) * s.ldb];
      for (int64_t d = 0; d < K; ++d) {
        gc[i * K + d] = g[d] + (i ? gc[(i - 1) * K + d] : 0.0f);
        kb[i * K + d] = k(i)[d] * b;
      }
    }
    // Strictly lower A[i, j] = −Σ_d kb[i,d] k[j,d] exp(gc[i,d] − gc[j,d]), then the forward substitution.
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float acc = 0.0f;
        if (j < i)
          for (int64_t d = 0; d < K; ++d) acc += kb[i * K + d] * k(j)[d] * std::exp(gc[i * K + d] - gc[j * K + d]);
        A[i * C + j] = -acc;
      }
    for (int64_t i = 1; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) row[j] = A[i * C + j];
      for (int64_t j = 0; j < i; ++j) {
        float acc = row[j];
        for (int64_t m = j + 1; m < i; ++m) acc += row[m] * A[m * C + j];
        A[i * C + j] = acc;
      }
    }
    for (int64_t i = 0; i < n; ++i) A[i * C + i] = 1.0f;
    // U = A·(β v), Wk = A·(β k exp(gc)); A is lower triangular.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < K; ++d) U[i * K + d] = Wk[i * K + d] = 0.0f;
      for (int64_t j = 0; j <= i; ++j) {
        const float a = A[i * C + j];
        const float b = s.beta[(c0 + j) * s.ldb];
        for (int64_t d = 0; d < K; ++d) {
          U[i * K + d] += a * b * v(j)[d];
          Wk[i * K + d] += a * kb[j * K + d] * std::exp(gc[j * K + d]);
        }
      }
    }
    // v_new = U − Wk·S
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < K; ++e) {
        float acc = U[i * K + e];
        for (int64_t d = 0; d < K; ++d) acc -= Wk[i * K + d] * S[d * K + e];
        vnew[i * K + e] = acc;
      }
    // Intra-chunk scores qa[i, j] = Σ_d q[i,d] k[j,d] exp(gc[i,d] − gc[j,d]) for j ≤ i.
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        float acc = 0.0f;
        for (int64_t d = 0; d < K; ++d) acc += q(i)[d] * k(j)[d] * std::exp(gc[i * K + d] - gc[j * K + d]);
        qa[i * C + j] = acc;
      }
    for (int64_t i = 0; i < n; ++i) {
      float* o = s.o + (c0 + i) * s.ld;
      for (int64_t e = 0; e < K; ++e) {
        float acc = 0.0f;
        for (int64_t d = 0; d < K; ++d) acc += q(i)[d] * std::exp(gc[i * K + d]) * S[d * K + e];
        for (int64_t j = 0; j <= i; ++j) acc += qa[i * C + j] * vnew[j * K + e];
        o[e] = acc;
      }
    }
    // State update to the end of the chunk.
    const float* gl = gc.data() + (n - 1) * K;
    for (int64_t d = 0; d < K; ++d) {
      const float e = std::exp(gl[d]);
      for (int64_t f = 0; f < K; ++f) S[d * K + f] *= e;
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < K; ++d) {
        const float kd = k(j)[d] * std::exp(gl[d] - gc[j * K + d]);
        for (int64_t f = 0; f < K; ++f) S[d * K + f] += kd * vnew[j * K + f];
      }
  }
}

namespace {

// Depthwise causal conv over each sequence (zeros before its start), then SiLU. x, y [T, C]; w [C, W].
void causal_conv_silu(const float* x, const Tensor& w, int64_t T, int64_t C, const std::vector<int64_t>& cu,
                      float* y) {
  const int64_t W = w.dim(1);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
#pragma omp parallel for schedule(static)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      for (int64_t ch = 0; ch < C; ++ch) {
        float acc = 0.0f;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t src = t + i - (W - 1);
          if (src >= cu[n]) acc += w.data[ch * W + i] * x[src * C + ch];
        }
        y[t * C + ch] = siluf(acc);
      }
    }
  }
}

void l2norm_rows(float* x, int64_t rows, int64_t K, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = x + r * K;
    double ss = 0.0;
    for (int64_t d = 0; d < K; ++d) ss += static_cast<double>(p[d]) * p[d];
    const float inv = scale / std::sqrt(static_cast<float>(ss) + 1e-6f);
    for (int64_t d = 0; d < K; ++d) p[d] *= inv;
  }
}

// The decay gate g [T, H·K] (log space: the safe gate lb·sigmoid(exp(A_log)·f) or −exp(A_log)·softplus(f), with
// f = f_b(f_a(a)) + dt_bias) and beta [T, H] = sigmoid(b_proj·a).
void kda_gates(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T, float* g, float* beta) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
  std::vector<float> fa(T * K);
  cpu::linear(a, T, D, w.f_a, fa.data());
  cpu::linear(fa.data(), T, K, w.f_b, g);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float rate = std::exp(w.A_log.data[h]);
      for (int64_t d = 0; d < K; ++d) {
        float& x = g[t * HK + h * K + d];
        const float f = x + w.dt_bias.data[h * K + d];
        if (c.linear_lower_bound) {
          x = static_cast<float>(*c.linear_lower_bound) * sigmoidf(rate * f);
        } else {
          x = -rate * (f > 20.0f ? f : std::log(1.0f + std::exp(f)));
        }
      }
    }
  cpu::linear(a, T, D, w.b_proj, beta);
  for (int64_t i = 0; i < T * H; ++i) beta[i] = sigmoidf(beta[i]);
}

}  // namespace

void kda_layer_forward(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu, float* y, KdaForm form) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
  std::vector<float> raw(T * HK), q(T * HK), k(T * HK), v(T * HK);
  cpu::linear(a, T, D, w.q_proj, raw.data());
  causal_conv_silu(raw.data(), w.q_conv, T, HK, cu, q.data());
  cpu::linear(a, T, D, w.k_proj, raw.data());
  causal_conv_silu(raw.data(), w.k_conv, T, HK, cu, k.data());
  cpu::linear(a, T, D, w.v_proj, raw.data());
  causal_conv_silu(raw.data(), w.v_conv, T, HK, cu, v.data());
  l2norm_rows(q.data(), T * H, K, 1.0f / std::sqrt(static_cast<float>(K)));
  l2norm_rows(k.data(), T * H, K, 1.0f);

  // Decay gate g [T, H·K] (log space) and beta [T, H].
  std::vector<float> g(T * HK), beta(T * H);
  kda_gates(w, c, a, T, g.data(), beta.data());

  std::vector<float> o(T * HK);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t t0 = cu[n], off = t0 * HK + h * K;
      KdaSeq s{q.data() + off, k.data() + off, v.data() + off, g.data() + off, beta.data() + t0 * H + h,
               cu[n + 1] - t0, K, HK, H, o.data() + off};
      std::vector<float> state(K * K, 0.0f);
      if (form == KdaForm::Chunked) {
        kda_chunked_forward(s, state.data());
      } else {
        kda_recurrent_forward(s, state.data());
      }
    }

  // Gated output norm per head: RMSNorm_K(o)·w ⊙ sigmoid(g_b(g_a(a))).
  std::vector<float> ga(T * K), gate(T * HK);
  cpu::linear(a, T, D, w.g_a, ga.data());
  cpu::linear(ga.data(), T, K, w.g_b, gate.data());
  rmsnorm_forward(o.data(), w.o_norm.ptr(), o.data(), T * H, K, static_cast<float>(c.rms_norm_eps));
  for (int64_t i = 0; i < T * HK; ++i) o[i] *= sigmoidf(gate[i]);
  cpu::linear(o.data(), T, HK, w.o_proj, y);
}

KdaCache::KdaCache(const ModelConfig& c)
    : conv(3 * (c.linear_conv_kernel_dim - 1) * c.linear_num_heads * c.linear_head_dim, 0.0f),
      state(c.linear_num_heads * c.linear_head_dim * c.linear_head_dim, 0.0f) {}

// The same steps as kda_layer_forward, for one sequence whose conv history and recurrent state come from `cache`
// (transformers' cached path: causal_conv1d_update / update_conv_state and the initial_state of the KDA core).
void kda_layer_forward_cached(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T, KdaCache& cache,
                              float* y, KdaForm form) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
  const int64_t W1 = c.linear_conv_kernel_dim - 1;
  check(static_cast<int64_t>(cache.conv.size()) == 3 * W1 * HK && static_cast<int64_t>(cache.state.size()) == H * K * K,
        "KDA cache does not fit this layer");

  // The conv runs over [W−1 cached projections; T new ones], so its first W−1 outputs are dropped; the cache then
  // keeps the last W−1 projections.
  std::vector<float> q(T * HK), k(T * HK), v(T * HK), ext((W1 + T) * HK), conv_out((W1 + T) * HK);
  const Tensor* proj[3] = {&w.q_proj, &w.k_proj, &w.v_proj};
  const Tensor* conv[3] = {&w.q_conv, &w.k_conv, &w.v_conv};
  float* out[3] = {q.data(), k.data(), v.data()};
  for (int i = 0; i < 3; ++i) {
    float* hist = cache.conv.data() + i * W1 * HK;
    std::copy_n(hist, W1 * HK, ext.data());
    cpu::linear(a, T, D, *proj[i], ext.data() + W1 * HK);
    causal_conv_silu(ext.data(), *conv[i], W1 + T, HK, {0, W1 + T}, conv_out.data());
    std::copy_n(conv_out.data() + W1 * HK, T * HK, out[i]);
    std::copy_n(ext.data() + T * HK, W1 * HK, hist);
  }
  l2norm_rows(q.data(), T * H, K, 1.0f / std::sqrt(static_cast<float>(K)));
  l2norm_rows(k.data(), T * H, K, 1.0f);

  // Decay gate g [T, H·K] (log space) and beta [T, H].
  std::vector<float> g(T * HK), beta(T * H);
  kda_gates(w, c, a, T, g.data(), beta.data());

  std::vector<float> o(T * HK);
#pragma omp parallel for schedule(dynamic) if (T > 1)
  for (int64_t h = 0; h < H; ++h) {
    KdaSeq s{q.data() + h * K, k.data() + h * K, v.data() + h * K, g.data() + h * K, beta.data() + h, T, K, HK, H,
             o.data() + h * K};
    float* state = cache.state.data() + h * K * K;
    if (form == KdaForm::Chunked) {
      kda_chunked_forward(s, state);
    } else {
      kda_recurrent_forward(s, state);
    }
  }

  std::vector<float> ga(T * K), gate(T * HK);
  cpu::linear(a, T, D, w.g_a, ga.data());
  cpu::linear(ga.data(), T, K, w.g_b, gate.data());
  rmsnorm_forward(o.data(), w.o_norm.ptr(), o.data(), T * H, K, static_cast<float>(c.rms_norm_eps));
  for (int64_t i = 0; i < T * HK; ++i) o[i] *= sigmoidf(gate[i]);
  cpu::linear(o.data(), T, HK, w.o_proj, y);
}

}  // namespace nextlm
