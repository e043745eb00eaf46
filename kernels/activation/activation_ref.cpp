// Plain C++ activations.
#include "kernels/activation/activation.h"

#include <cmath>

namespace kestrel {

void silu_mul_ref(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    // For very negative g, exp(-g) is inf and g / inf is -0: the limit, without a NaN.
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void softmax_ref(float* x, int64_t n) {
  if (n <= 0) return;
  // Subtracting the max keeps every exponent <= 0: no overflow whatever the inputs' size.
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void relu_ref(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

}  // namespace kestrel
