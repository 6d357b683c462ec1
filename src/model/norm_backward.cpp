// RMSNorm backward in fp32 (row sums in double, as the forward); the gradient of Glm5NextTextRMSNorm, of the
// unweighted mHC input norm and of the per-head KDA output norm.
#include <cmath>
#include <vector>

#include "model/backward.h"

namespace nextlm {

// With r = rsqrt(mean(x²) + eps) and y = w ⊙ x·r:
//   dx = r·(w ⊙ dy) − x·r³·Σ(w ⊙ dy ⊙ x)/D,   dw = Σ_rows dy ⊙ x·r.
void rmsnorm_backward(const float* x, const float* w, const float* dy, int64_t T, int64_t D, float eps, float* dx,
                      float* dw) {
  std::vector<float> rs(static_cast<size_t>(T));
#pragma omp parallel for schedule(static) if (T * D > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    const float* gr = dy + t * D;
    double ss = 0.0, dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      ss += static_cast<double>(xr[d]) * xr[d];
      dot += static_cast<double>(w ? w[d] : 1.0f) * gr[d] * xr[d];
    }
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / D) + eps);
    rs[t] = r;
    if (!dx) continue;
    const float c = static_cast<float>(dot / D) * r * r * r;
    float* out = dx + t * D;
    for (int64_t d = 0; d < D; ++d) out[d] += r * (w ? w[d] : 1.0f) * gr[d] - c * xr[d];
  }
  if (!dw) return;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) dw[d] += dy[t * D + d] * x[t * D + d] * rs[t];
}

}  // namespace nextlm
