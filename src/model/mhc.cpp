// mHC pre (norm, fn projection, sigmoid/softmax/Sinkhorn, stream collapse) and post-mix, fp32; matches
// Glm5NextTextHyperConnection.forward and the decoder layer's residual update in transformers 5.17.0.
#include "model/mhc.h"

#include <cmath>

#include "cpu/linear.h"
#include "model/norm.h"

namespace nextlm {

void sinkhorn_forward(float* C, int64_t S, int64_t iters, float eps) {
  auto normalise_cols = [&] {
    for (int64_t s = 0; s < S; ++s) {
      float sum = 0.0f;
      for (int64_t r = 0; r < S; ++r) sum += C[r * S + s];
      for (int64_t r = 0; r < S; ++r) C[r * S + s] /= sum + eps;
    }
  };
  auto normalise_rows = [&] {
    for (int64_t r = 0; r < S; ++r) {
      float sum = 0.0f;
      for (int64_t s = 0; s < S; ++s) sum += C[r * S + s];
      for (int64_t s = 0; s < S; ++s) C[r * S + s] /= sum + eps;
    }
  };
  normalise_cols();
  for (int64_t i = 0; i + 1 < iters; ++i) {
    normalise_rows();
    normalise_cols();
  }
}

void mhc_pre_forward(const HcWeights& w, const ModelConfig& c, const float* h, int64_t T, HcMix& mix, float* a) {
  const int64_t S = c.hc_mult, D = c.hidden_size, M = (2 + S) * S;
  const float hc_eps = static_cast<float>(c.hc_eps);
  // The input norm is unweighted and uses rms_norm_eps (not hc_eps), over all S·D values of a token.
  std::vector<float> flat(static_cast<size_t>(T * S * D));
  rmsnorm_forward(h, nullptr, flat.data(), T, S * D, static_cast<float>(c.rms_norm_eps));
  std::vector<float> logits(static_cast<size_t>(T * M));
  cpu::linear(flat.data(), T, S * D, w.fn, logits.data());

  mix.post.assign(T * S, 0.0f);
  mix.pre.assign(T * S, 0.0f);
  mix.comb.assign(T * S * S, 0.0f);
  const float* base = w.base.ptr();
  const float* scale = w.scale.ptr();
#pragma omp parallel for schedule(static) if (T > 64)
  for (int64_t t = 0; t < T; ++t) {
    const float* m = logits.data() + t * M;
    for (int64_t s = 0; s < S; ++s) {
      mix.pre[t * S + s] = sigmoidf(m[s] * scale[0] + base[s]) + hc_eps;
      mix.post[t * S + s] = 2.0f * sigmoidf(m[S + s] * scale[1] + base[S + s]);
    }
    float* C = mix.comb.data() + t * S * S;
    for (int64_t r = 0; r < S; ++r) {
      float mx = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        C[r * S + s] = m[2 * S + r * S + s] * scale[2] + base[2 * S + r * S + s];
        mx = std::max(mx, C[r * S + s]);
      }
      float sum = 0.0f;
      for (int64_t s = 0; s < S; ++s) sum += (C[r * S + s] = std::exp(C[r * S + s] - mx));
      for (int64_t s = 0; s < S; ++s) C[r * S + s] = C[r * S + s] / sum + hc_eps;
    }
    sinkhorn_forward(C, S, c.hc_sinkhorn_iters, hc_eps);
    float* at = a + t * D;
    for (int64_t d = 0; d < D; ++d) at[d] = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const float p = mix.pre[t * S + s];
      const float* hs = h + (t * S + s) * D;
      for (int64_t d = 0; d < D; ++d) at[d] += p * hs[d];
    }
  }
}

void mhc_post_forward(const HcMix& mix, const float* h, const float* y, int64_t T, int64_t S, int64_t D,
                      float* h_out) {
#pragma omp parallel for schedule(static) if (T > 64)
  for (int64_t t = 0; t < T; ++t) {
    const float* C = mix.comb.data() + t * S * S;
    for (int64_t s = 0; s < S; ++s) {
      float* out = h_out + (t * S + s) * D;
      const float p = mix.post[t * S + s];
      const float* yt = y + t * D;
      for (int64_t d = 0; d < D; ++d) out[d] = p * yt[d];
      for (int64_t r = 0; r < S; ++r) {
        const float cr = C[r * S + s];
        const float* hr = h + (t * S + r) * D;
        for (int64_t d = 0; d < D; ++d) out[d] += cr * hr[d];
      }
    }
  }
}

}  // namespace nextlm
