// RMSNorm and LayerNorm rows in fp32 (the sums in double so the reference does not depend on summation order).
#include "model/norm.h"

namespace nextlm {

void rmsnorm_forward(const float* x, const float* w, float* y, int64_t T, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (T * D > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    float* yr = y + t * D;
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(xr[d]) * xr[d];
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / D) + eps);
    for (int64_t d = 0; d < D; ++d) yr[d] = (w ? w[d] : 1.0f) * (xr[d] * r);
  }
}

void layernorm_forward(const float* x, const float* w, const float* b, float* y, int64_t T, int64_t D, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    float* yr = y + t * D;
    double mean = 0.0, var = 0.0;
    for (int64_t d = 0; d < D; ++d) mean += xr[d];
    mean /= D;
    for (int64_t d = 0; d < D; ++d) var += (xr[d] - mean) * (xr[d] - mean);
    var /= D;
    const float r = 1.0f / std::sqrt(static_cast<float>(var) + eps);
    const float m = static_cast<float>(mean);
    for (int64_t d = 0; d < D; ++d) yr[d] = (xr[d] - m) * r * w[d] + b[d];
  }
}

}  // namespace nextlm
