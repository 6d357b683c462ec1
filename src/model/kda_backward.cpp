// KDA layer backward in fp32: o_proj, the gated output RMSNorm and g_a/g_b, the delta-rule recurrence (backward
// through time), beta = sigmoid(b_proj·a), both decay-gate forms with A_log and dt_bias, f_a/f_b, the L2 norms with
// the q scale, the causal depthwise convs + SiLU, and the q/k/v projections. Gradients of
// Glm5NextTextLinearAttention (transformers 5.17.0); the recurrent form is the definition both of its forward forms
// compute, so its backward is the backward of either.
#include <cmath>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "model/backward.h"
#include "model/norm.h"

namespace nextlm {

namespace {

// One recurrence step on the K×K state S (row = key dim): S ← diag(exp g)·S; u = β(v − Sᵀk); S ← S + k uᵀ.
// The same operations in the same order as kda_recurrent_forward.
void kda_step(float* S, const float* k, const float* v, const float* g, float b, int64_t K, float* u) {
  for (int64_t i = 0; i < K; ++i) {
    const float e = std::exp(g[i]);
    for (int64_t j = 0; j < K; ++j) S[i * K + j] *= e;
  }
  for (int64_t j = 0; j < K; ++j) u[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < K; ++j) u[j] += S[i * K + j] * k[i];
  for (int64_t j = 0; j < K; ++j) u[j] = b * (v[j] - u[j]);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < K; ++j) S[i * K + j] += k[i] * u[j];
}

float silu_grad(float x) {
  const float s = sigmoidf(x);
  return s * (1.0f + x * (1.0f - s));
}

// Depthwise causal conv of each sequence (zeros before its start), without the activation. x, pre [T, C]; w [C, W].
void causal_conv(const float* x, const Tensor& w, int64_t T, int64_t C, const std::vector<int64_t>& cu, float* pre) {
  const int64_t W = w.dim(1);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
#pragma omp parallel for schedule(static)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
      for (int64_t ch = 0; ch < C; ++ch) {
        float acc = 0.0f;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t src = t + i - (W - 1);
          if (src >= cu[n]) acc += w.data[ch * W + i] * x[src * C + ch];
        }
        pre[t * C + ch] = acc;
      }
  }
}

// dx [T, C] += …, dw [C, W] += … from dpre [T, C]; channels are independent, so threads own channels.
void causal_conv_backward(const float* x, const Tensor& w, int64_t T, int64_t C, const std::vector<int64_t>& cu,
                          const float* dpre, float* dx, Tensor& dw) {
  const int64_t W = w.dim(1);
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < C; ++ch)
    for (size_t n = 0; n + 1 < cu.size(); ++n)
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const float d = dpre[t * C + ch];
        for (int64_t i = 0; i < W; ++i) {
          const int64_t src = t + i - (W - 1);
          if (src < cu[n]) continue;
          dw.data[ch * W + i] += d * x[src * C + ch];
          dx[src * C + ch] += d * w.data[ch * W + i];
        }
      }
}

// y = scale·x/sqrt(Σx² + 1e-6) per row of K: dx += scale·(dy/n − x·Σ(dy⊙x)/n³).
void l2norm_backward(const float* x, const float* dy, int64_t rows, int64_t K, float scale, float* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    const float* gr = dy + r * K;
    double ss = 0.0, dot = 0.0;
    for (int64_t d = 0; d < K; ++d) {
      ss += static_cast<double>(xr[d]) * xr[d];
      dot += static_cast<double>(gr[d]) * xr[d];
    }
    const float n = std::sqrt(static_cast<float>(ss) + 1e-6f);
    const float c = static_cast<float>(dot) / (n * n * n);
    for (int64_t d = 0; d < K; ++d) dx[r * K + d] += scale * (gr[d] / n - xr[d] * c);
  }
}

void l2norm(const float* x, float* y, int64_t rows, int64_t K, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t d = 0; d < K; ++d) ss += static_cast<double>(x[r * K + d]) * x[r * K + d];
    const float inv = scale / std::sqrt(static_cast<float>(ss) + 1e-6f);
    for (int64_t d = 0; d < K; ++d) y[r * K + d] = x[r * K + d] * inv;
  }
}

}  // namespace

void kda_recurrent_backward(const KdaSeq& s, const float* do_, float* dq, float* dk, float* dv, float* dg,
                            float* dbeta, int64_t chunk) {
  const int64_t K = s.K, KK = K * K, T = s.T;
  const int64_t nchunks = (T + chunk - 1) / chunk;
  auto row = [&](const float* p, int64_t t) { return p + t * s.ld; };
  // Checkpoints: the state entering the first step of every chunk.
  std::vector<float> ckpt(static_cast<size_t>(nchunks * KK)), S(KK, 0.0f), u(K);
  for (int64_t t = 0; t < T; ++t) {
    if (t % chunk == 0) std::copy(S.begin(), S.end(), ckpt.begin() + (t / chunk) * KK);
    kda_step(S.data(), row(s.k, t), row(s.v, t), row(s.g, t), s.beta[t * s.ldb], K, u.data());
  }
  // states[j] = the state entering step t0 + j of the current chunk (j = n is the state after its last step).
  std::vector<float> states(static_cast<size_t>((chunk + 1) * KK)), dS(KK, 0.0f), St(KK), mem(K), du(K), dmem(K);
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t t0 = c * chunk, n = std::min(chunk, T - t0);
    std::copy(ckpt.begin() + c * KK, ckpt.begin() + (c + 1) * KK, states.begin());
    for (int64_t j = 0; j < n; ++j) {
      std::copy(states.begin() + j * KK, states.begin() + (j + 1) * KK, states.begin() + (j + 1) * KK);
      kda_step(&states[(j + 1) * KK], row(s.k, t0 + j), row(s.v, t0 + j), row(s.g, t0 + j), s.beta[(t0 + j) * s.ldb],
               K, u.data());
    }
    for (int64_t j = n - 1; j >= 0; --j) {
      const int64_t t = t0 + j;
      const float* q = row(s.q, t);
      const float* k = row(s.k, t);
      const float* v = row(s.v, t);
      const float* g = row(s.g, t);
      const float* dot = do_ + t * s.ld;
      const float b = s.beta[t * s.ldb];
      const float* Sprev = &states[j * KK];
      const float* Snew = &states[(j + 1) * KK];
      // Recompute the decayed state St and u = β(v − Stᵀk) of this step.
      for (int64_t i = 0; i < K; ++i) {
        const float e = std::exp(g[i]);
        for (int64_t jj = 0; jj < K; ++jj) St[i * K + jj] = Sprev[i * K + jj] * e;
      }
      for (int64_t jj = 0; jj < K; ++jj) mem[jj] = 0.0f;
      for (int64_t i = 0; i < K; ++i)
        for (int64_t jj = 0; jj < K; ++jj) mem[jj] += St[i * K + jj] * k[i];
      for (int64_t jj = 0; jj < K; ++jj) u[jj] = b * (v[jj] - mem[jj]);
      // o = Snewᵀq
      float* dqt = dq + t * s.ld;
      for (int64_t i = 0; i < K; ++i) {
        float acc = 0.0f;
        for (int64_t jj = 0; jj < K; ++jj) {
          acc += Snew[i * K + jj] * dot[jj];
          dS[i * K + jj] += q[i] * dot[jj];
        }
        dqt[i] += acc;
      }
      // Snew = St + k uᵀ
      float* dkt = dk + t * s.ld;
      for (int64_t jj = 0; jj < K; ++jj) du[jj] = 0.0f;
      for (int64_t i = 0; i < K; ++i) {
        float acc = 0.0f;
        for (int64_t jj = 0; jj < K; ++jj) {
          du[jj] += dS[i * K + jj] * k[i];
          acc += dS[i * K + jj] * u[jj];
        }
        dkt[i] += acc;
      }
      // u = β(v − mem), mem = Stᵀk
      float db = 0.0f;
      float* dvt = dv + t * s.ld;
      for (int64_t jj = 0; jj < K; ++jj) {
        db += du[jj] * (v[jj] - mem[jj]);
        dvt[jj] += b * du[jj];
        dmem[jj] = -b * du[jj];
      }
      dbeta[t * s.ldb] += db;
      for (int64_t i = 0; i < K; ++i) {
        float acc = 0.0f;
        for (int64_t jj = 0; jj < K; ++jj) {
          dS[i * K + jj] += k[i] * dmem[jj];  // dS now holds d St
          acc += St[i * K + jj] * dmem[jj];
        }
        dkt[i] += acc;
      }
      // St = diag(exp g)·Sprev
      float* dgt = dg + t * s.ld;
      for (int64_t i = 0; i < K; ++i) {
        const float e = std::exp(g[i]);
        float acc = 0.0f;
        for (int64_t jj = 0; jj < K; ++jj) {
          acc += dS[i * K + jj] * St[i * K + jj];
          dS[i * K + jj] *= e;
        }
        dgt[i] += acc;
      }
    }
  }
}

void kda_layer_forward_train(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                             const std::vector<int64_t>& cu, KdaActs& x, float* y, KdaForm form) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
  const size_t n = static_cast<size_t>(T * HK);
  for (auto* v : {&x.q_raw, &x.k_raw, &x.v_raw, &x.q_pre, &x.k_pre, &x.v_pre, &x.q_act, &x.k_act, &x.q, &x.k,
                  &x.v, &x.f, &x.g, &x.o, &x.gate, &x.on})
    v->assign(n, 0.0f);
  x.fa.assign(T * K, 0.0f);
  x.ga.assign(T * K, 0.0f);
  x.beta.assign(T * H, 0.0f);
  cpu::linear(a, T, D, w.q_proj, x.q_raw.data());
  causal_conv(x.q_raw.data(), w.q_conv, T, HK, cu, x.q_pre.data());
  cpu::linear(a, T, D, w.k_proj, x.k_raw.data());
  causal_conv(x.k_raw.data(), w.k_conv, T, HK, cu, x.k_pre.data());
  cpu::linear(a, T, D, w.v_proj, x.v_raw.data());
  causal_conv(x.v_raw.data(), w.v_conv, T, HK, cu, x.v_pre.data());
  for (size_t i = 0; i < n; ++i) {
    x.q_act[i] = siluf(x.q_pre[i]);
    x.k_act[i] = siluf(x.k_pre[i]);
    x.v[i] = siluf(x.v_pre[i]);
  }
  l2norm(x.q_act.data(), x.q.data(), T * H, K, 1.0f / std::sqrt(static_cast<float>(K)));
  l2norm(x.k_act.data(), x.k.data(), T * H, K, 1.0f);

  cpu::linear(a, T, D, w.f_a, x.fa.data());
  cpu::linear(x.fa.data(), T, K, w.f_b, x.f.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float rate = std::exp(w.A_log.data[h]);
      for (int64_t d = 0; d < K; ++d) {
        const int64_t i = t * HK + h * K + d;
        const float f = (x.f[i] += w.dt_bias.data[h * K + d]);
        if (c.linear_lower_bound) {
          x.g[i] = static_cast<float>(*c.linear_lower_bound) * sigmoidf(rate * f);
        } else {
          x.g[i] = -rate * (f > 20.0f ? f : std::log(1.0f + std::exp(f)));
        }
      }
    }
  cpu::linear(a, T, D, w.b_proj, x.beta.data());
  for (float& b : x.beta) b = sigmoidf(b);

  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t s = 0; s < N; ++s)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t t0 = cu[s], off = t0 * HK + h * K;
      KdaSeq seq{x.q.data() + off, x.k.data() + off, x.v.data() + off, x.g.data() + off, x.beta.data() + t0 * H + h,
                 cu[s + 1] - t0, K, HK, H, x.o.data() + off};
      std::vector<float> state(K * K, 0.0f);
      if (form == KdaForm::Chunked) {
        kda_chunked_forward(seq, state.data());
      } else {
        kda_recurrent_forward(seq, state.data());
      }
    }

  cpu::linear(a, T, D, w.g_a, x.ga.data());
  cpu::linear(x.ga.data(), T, K, w.g_b, x.gate.data());
  rmsnorm_forward(x.o.data(), w.o_norm.ptr(), x.on.data(), T * H, K, static_cast<float>(c.rms_norm_eps));
  for (size_t i = 0; i < n; ++i) x.on[i] *= sigmoidf(x.gate[i]);
  cpu::linear(x.on.data(), T, HK, w.o_proj, y);
}

void kda_layer_backward(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                        const std::vector<int64_t>& cu, const KdaActs& x, const float* dy, float* da, KdaWeights& dw) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K;
  const size_t n = static_cast<size_t>(T * HK);
  const float eps = static_cast<float>(c.rms_norm_eps);

  // y = o_proj(on)
  std::vector<float> don(n, 0.0f);
  cpu::linear_backward(x.on.data(), T, HK, w.o_proj, dy, don.data(), &dw.o_proj);

  // on = RMSNorm_K(o; o_norm)·sigmoid(gate)
  std::vector<float> normed(n), dnormed(n), dgate(n), dO(n, 0.0f);
  rmsnorm_forward(x.o.data(), w.o_norm.ptr(), normed.data(), T * H, K, eps);
  for (size_t i = 0; i < n; ++i) {
    const float sg = sigmoidf(x.gate[i]);
    dnormed[i] = don[i] * sg;
    dgate[i] = don[i] * normed[i] * sg * (1.0f - sg);
  }
  rmsnorm_backward(x.o.data(), w.o_norm.ptr(), dnormed.data(), T * H, K, eps, dO.data(), dw.o_norm.ptr());

  // gate = g_b(g_a(a))
  std::vector<float> dga(T * K, 0.0f);
  cpu::linear_backward(x.ga.data(), T, K, w.g_b, dgate.data(), dga.data(), &dw.g_b);
  cpu::linear_backward(a, T, D, w.g_a, dga.data(), da, &dw.g_a);

  // The recurrence, per sequence and head (disjoint slices of the gradients).
  std::vector<float> dq(n, 0.0f), dk(n, 0.0f), dv(n, 0.0f), dg(n, 0.0f), dbeta(T * H, 0.0f);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t s = 0; s < N; ++s)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t t0 = cu[s], off = t0 * HK + h * K;
      KdaSeq seq{x.q.data() + off, x.k.data() + off, x.v.data() + off, x.g.data() + off,
                 x.beta.data() + t0 * H + h, cu[s + 1] - t0, K, HK, H, nullptr};
      kda_recurrent_backward(seq, dO.data() + off, dq.data() + off, dk.data() + off, dv.data() + off,
                             dg.data() + off, dbeta.data() + t0 * H + h);
    }

  // beta = sigmoid(b_proj·a)
  for (int64_t i = 0; i < T * H; ++i) dbeta[i] *= x.beta[i] * (1.0f - x.beta[i]);
  cpu::linear_backward(a, T, D, w.b_proj, dbeta.data(), da, &dw.b_proj);

  // g = lb·sigmoid(exp(A_log)·f)  or  g = −exp(A_log)·softplus(f);  f = f_b(f_a(a)) + dt_bias
  std::vector<float> df(n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float rate = std::exp(w.A_log.data[h]);
      float dA = 0.0f;
      for (int64_t d = 0; d < K; ++d) {
        const int64_t i = t * HK + h * K + d;
        const float f = x.f[i];
        if (c.linear_lower_bound) {
          const float sg = sigmoidf(rate * f);
          const float dz = dg[i] * static_cast<float>(*c.linear_lower_bound) * sg * (1.0f - sg);
          df[i] = dz * rate;
          dA += dz * rate * f;
        } else {
          df[i] = -dg[i] * rate * (f > 20.0f ? 1.0f : sigmoidf(f));
          dA += dg[i] * x.g[i];
        }
        dw.dt_bias.data[h * K + d] += df[i];
      }
      dw.A_log.data[h] += dA;
    }
  std::vector<float> dfa(T * K, 0.0f);
  cpu::linear_backward(x.fa.data(), T, K, w.f_b, df.data(), dfa.data(), &dw.f_b);
  cpu::linear_backward(a, T, D, w.f_a, dfa.data(), da, &dw.f_a);

  // q = K^-1/2·L2(silu(conv(q_proj·a))), k = L2(silu(conv(k_proj·a))), v = silu(conv(v_proj·a))
  std::vector<float> dact(n), draw(n);
  auto branch = [&](const std::vector<float>& raw, const std::vector<float>& pre, const std::vector<float>* act,
                    const std::vector<float>& dout, float scale, const Tensor& proj, const Tensor& conv, Tensor& dproj,
                    Tensor& dconv) {
    if (act) {
      std::fill(dact.begin(), dact.end(), 0.0f);
      l2norm_backward(act->data(), dout.data(), T * H, K, scale, dact.data());
    } else {
      dact = dout;
    }
    for (size_t i = 0; i < n; ++i) dact[i] *= silu_grad(pre[i]);  // now d pre
    std::fill(draw.begin(), draw.end(), 0.0f);
    causal_conv_backward(raw.data(), conv, T, HK, cu, dact.data(), draw.data(), dconv);
    cpu::linear_backward(a, T, D, proj, draw.data(), da, &dproj);
  };
  branch(x.q_raw, x.q_pre, &x.q_act, dq, 1.0f / std::sqrt(static_cast<float>(K)), w.q_proj, w.q_conv, dw.q_proj,
         dw.q_conv);
  branch(x.k_raw, x.k_pre, &x.k_act, dk, 1.0f, w.k_proj, w.k_conv, dw.k_proj, dw.k_conv);
  branch(x.v_raw, x.v_pre, nullptr, dv, 1.0f, w.v_proj, w.v_conv, dw.v_proj, dw.v_conv);
}

}  // namespace nextlm
