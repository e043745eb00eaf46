// Plain C++ normalisations. The reductions run in double: it costs nothing at these sizes and
// keeps the oracle's own rounding error well below that of any fp32/fp16 kernel it checks.
#include "kernels/norm/norm.h"

#include <cmath>

namespace kestrel {

void rms_norm_ref(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < n; ++i) sum_sq += (double)xr[i] * xr[i];
    // The whole row is reduced before anything is written, so y may alias x.
    const float inv_rms = (float)(1.0 / std::sqrt(sum_sq / (double)n + (double)eps));
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv_rms * w[i];
  }
}

void layer_norm_ref(const float* x, const float* w, const float* b, float eps, int64_t rows,
                    int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += xr[i];
    const double mean = sum / (double)n;
    double sum_sq = 0.0;  // two passes: the variance of centred values does not cancel
    for (int64_t i = 0; i < n; ++i) sum_sq += ((double)xr[i] - mean) * ((double)xr[i] - mean);
    const double inv_std = 1.0 / std::sqrt(sum_sq / (double)n + (double)eps);
    for (int64_t i = 0; i < n; ++i) {
      const float v = (float)(((double)xr[i] - mean) * inv_std) * w[i];
      yr[i] = b ? v + b[i] : v;
    }
  }
}

}  // namespace kestrel
