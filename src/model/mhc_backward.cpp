// mHC backward in fp32: the stream collapse, the sigmoid pre/post weights, the softmax + Sinkhorn mixer (through
// every iteration), the fn projection and the unweighted input norm; and the post-mix. Gradients of
// Glm5NextTextHyperConnection.forward and the decoder layer's residual update (transformers 5.17.0).
#include <cmath>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "model/backward.h"
#include "model/norm.h"

namespace nextlm {

namespace {

// One normalisation step out = in / (sum + eps), over columns (sum over r) or rows (sum over s), and its backward:
// d in = (d out − Σ d out ⊙ out) / (sum + eps) along the same direction.
void normalise(const float* in, float* out, int64_t S, float eps, bool cols) {
  for (int64_t a = 0; a < S; ++a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < S; ++b) sum += cols ? in[b * S + a] : in[a * S + b];
    for (int64_t b = 0; b < S; ++b) {
      const int64_t i = cols ? b * S + a : a * S + b;
      out[i] = in[i] / (sum + eps);
    }
  }
}

void normalise_backward(const float* in, const float* out, const float* dout, float* din, int64_t S, float eps,
                        bool cols) {
  for (int64_t a = 0; a < S; ++a) {
    float sum = 0.0f, dot = 0.0f;
    for (int64_t b = 0; b < S; ++b) {
      const int64_t i = cols ? b * S + a : a * S + b;
      sum += in[i];
      dot += dout[i] * out[i];
    }
    for (int64_t b = 0; b < S; ++b) {
      const int64_t i = cols ? b * S + a : a * S + b;
      din[i] = (dout[i] - dot) / (sum + eps);
    }
  }
}

}  // namespace

void sinkhorn_backward(const float* C0, int64_t S, int64_t iters, float eps, const float* dC, float* dC0) {
  // The forward's steps: columns, then (iters − 1) times rows and columns. mats[i] is the input of step i.
  const int64_t steps = 1 + 2 * (iters - 1), SS = S * S;
  std::vector<float> mats(static_cast<size_t>((steps + 1) * SS));
  std::copy(C0, C0 + SS, mats.begin());
  auto is_cols = [](int64_t step) { return step % 2 == 0; };
  for (int64_t i = 0; i < steps; ++i) normalise(&mats[i * SS], &mats[(i + 1) * SS], S, eps, is_cols(i));
  std::vector<float> grad(dC, dC + SS), prev(SS);
  for (int64_t i = steps - 1; i >= 0; --i) {
    normalise_backward(&mats[i * SS], &mats[(i + 1) * SS], grad.data(), prev.data(), S, eps, is_cols(i));
    grad.swap(prev);
  }
  for (int64_t i = 0; i < SS; ++i) dC0[i] += grad[i];
}

void mhc_pre_backward(const HcWeights& w, const ModelConfig& c, const float* h, int64_t T, const float* dpost,
                      const float* dcomb, const float* da, float* dh, HcWeights& dw) {
  const int64_t S = c.hc_mult, D = c.hidden_size, M = (2 + S) * S, SD = S * D;
  const float hc_eps = static_cast<float>(c.hc_eps), eps = static_cast<float>(c.rms_norm_eps);
  // Recompute the normed flat streams and the mixing logits m = fn·f̂, as the forward.
  std::vector<float> flat(static_cast<size_t>(T * SD)), m(static_cast<size_t>(T * M));
  rmsnorm_forward(h, nullptr, flat.data(), T, SD, eps);
  cpu::linear(flat.data(), T, SD, w.fn, m.data());
  const float* base = w.base.ptr();
  const float* scale = w.scale.ptr();

  // dz [T, M]: gradient of the scaled-and-shifted logits z = m·scale + base (pre, post, comb parts).
  std::vector<float> dz(static_cast<size_t>(T * M), 0.0f);
#pragma omp parallel for schedule(static) if (T > 64)
  for (int64_t t = 0; t < T; ++t) {
    const float* mt = m.data() + t * M;
    float* dzt = dz.data() + t * M;
    for (int64_t s = 0; s < S; ++s) {
      // pre = sigmoid(z) + hc_eps; a = Σ_s pre[s]·h[s]
      const float sg = sigmoidf(mt[s] * scale[0] + base[s]);
      if (da) {
        const float* hs = h + (t * S + s) * D;
        const float* dat = da + t * D;
        float dpre = 0.0f;
        for (int64_t d = 0; d < D; ++d) dpre += dat[d] * hs[d];
        dzt[s] = dpre * sg * (1.0f - sg);
        if (dh) {
          float* dhs = dh + (t * S + s) * D;
          const float pre = sg + hc_eps;
          for (int64_t d = 0; d < D; ++d) dhs[d] += pre * dat[d];
        }
      }
      // post = 2·sigmoid(z)
      if (dpost) {
        const float sp = sigmoidf(mt[S + s] * scale[1] + base[S + s]);
        dzt[S + s] = dpost[t * S + s] * 2.0f * sp * (1.0f - sp);
      }
    }
    if (dcomb) {
      // comb = Sinkhorn(softmax_rows(z) + hc_eps)
      std::vector<float> P(S * S), dC0(S * S, 0.0f);
      for (int64_t r = 0; r < S; ++r) {
        float mx = -INFINITY;
        for (int64_t s = 0; s < S; ++s) {
          P[r * S + s] = mt[2 * S + r * S + s] * scale[2] + base[2 * S + r * S + s];
          mx = std::max(mx, P[r * S + s]);
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < S; ++s) sum += (P[r * S + s] = std::exp(P[r * S + s] - mx));
        for (int64_t s = 0; s < S; ++s) P[r * S + s] /= sum;
      }
      std::vector<float> C0(S * S);
      for (int64_t i = 0; i < S * S; ++i) C0[i] = P[i] + hc_eps;
      sinkhorn_backward(C0.data(), S, c.hc_sinkhorn_iters, hc_eps, dcomb + t * S * S, dC0.data());
      for (int64_t r = 0; r < S; ++r) {
        float dot = 0.0f;
        for (int64_t s = 0; s < S; ++s) dot += P[r * S + s] * dC0[r * S + s];
        for (int64_t s = 0; s < S; ++s) dzt[2 * S + r * S + s] = P[r * S + s] * (dC0[r * S + s] - dot);
      }
    }
  }

  // z = m·scale[part] + base: dbase = Σ_t dz, dscale[part] = Σ_t Σ dz·m, dm = dz·scale[part].
  std::vector<float> dm(static_cast<size_t>(T * M));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < M; ++j) {
      const int part = j < S ? 0 : j < 2 * S ? 1 : 2;
      dw.base.data[j] += dz[t * M + j];
      dw.scale.data[part] += dz[t * M + j] * m[t * M + j];
      dm[t * M + j] = dz[t * M + j] * scale[part];
    }
  // m = fn·f̂, f̂ = unweighted RMSNorm of the flat streams.
  std::vector<float> dflat(static_cast<size_t>(T * SD), 0.0f);
  cpu::linear_backward(flat.data(), T, SD, w.fn, dm.data(), dflat.data(), &dw.fn);
  if (dh) rmsnorm_backward(h, nullptr, dflat.data(), T, SD, eps, dh, nullptr);
}

void mhc_post_backward(const HcMix& mix, const float* h, const float* y, int64_t T, int64_t S, int64_t D,
                       const float* dout, float* dh, float* dy, float* dpost, float* dcomb) {
#pragma omp parallel for schedule(static) if (T > 64)
  for (int64_t t = 0; t < T; ++t) {
    const float* C = mix.comb.data() + t * S * S;
    const float* yt = y + t * D;
    for (int64_t s = 0; s < S; ++s) {
      const float* g = dout + (t * S + s) * D;
      const float p = mix.post[t * S + s];
      if (dy)
        for (int64_t d = 0; d < D; ++d) dy[t * D + d] += p * g[d];
      if (dpost) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += g[d] * yt[d];
        dpost[t * S + s] += acc;
      }
      for (int64_t r = 0; r < S; ++r) {
        const float* hr = h + (t * S + r) * D;
        if (dh) {
          float* dhr = dh + (t * S + r) * D;
          const float cr = C[r * S + s];
          for (int64_t d = 0; d < D; ++d) dhr[d] += cr * g[d];
        }
        if (dcomb) {
          float acc = 0.0f;
          for (int64_t d = 0; d < D; ++d) acc += g[d] * hr[d];
          dcomb[t * S * S + r * S + s] += acc;
        }
      }
    }
  }
}

}  // namespace nextlm
