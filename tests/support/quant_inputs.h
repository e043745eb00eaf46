// Calibration-like inputs, weights and Hessians for the quantizer's tests (CPU and GPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tools/quantize/gptq.h"

namespace kestrel::test {

// Inputs with correlated features, as real activations have: a few latent directions, a few
// loud channels, some noise. x [n, K].
inline std::vector<float> correlated_inputs(int64_t n, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int latent = 8;
  std::vector<float> mix(latent * K), loud(K);
  for (float& m : mix) m = g(rng);
  for (int64_t k = 0; k < K; ++k) loud[k] = (k % 37 == 0) ? 8.0f : 1.0f;
  std::vector<float> x(n * K);
  for (int64_t i = 0; i < n; ++i) {
    float z[latent];
    for (float& v : z) v = g(rng);
    for (int64_t k = 0; k < K; ++k) {
      float s = 0.3f * g(rng);
      for (int j = 0; j < latent; ++j) s += z[j] * mix[j * K + k];
      x[i * K + k] = s * loud[k];
    }
  }
  return x;
}

inline std::vector<float> random_weights(int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 0.02f);
  std::vector<float> w(N * K);
  for (float& v : w) v = g(rng);
  return w;
}

inline std::vector<float> hessian_of(const std::vector<float>& x, int64_t n, int64_t K) {
  quant::Hessian h(K);
  for (int64_t i = 0; i < n; i += 100) h.add(&x[i * K], std::min<int64_t>(100, n - i));
  return h.matrix();
}

// How well U, the upper Cholesky factor of H^-1 (H^-1 = U^T U), inverts H [K, K] (row-major,
// float or double): the largest |(H U^T U - I)_ij|, and how many entries below U's diagonal are
// not zero.
struct FactorCheck {
  double worst = 0;
  int64_t below_diagonal = 0;
};

template <class T>
FactorCheck check_inverse_factor(const std::vector<T>& H, const std::vector<float>& U, int64_t K) {
  FactorCheck c;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < K; ++j) {
      if (i > j && U[i * K + j] != 0.0f) ++c.below_diagonal;
      double s = 0;
      for (int64_t a = 0; a < K; ++a) {
        double inv_aj = 0;
        for (int64_t p = 0; p <= std::min(a, j); ++p) inv_aj += (double)U[p * K + a] * U[p * K + j];
        s += (double)H[i * K + a] * inv_aj;
      }
      c.worst = std::max(c.worst, std::abs(s - (i == j ? 1.0 : 0.0)));
    }
  return c;
}

}  // namespace kestrel::test
