// Calibration-like inputs, weights and Hessians for the quantizer's tests (CPU and GPU).
#pragma once

#include <algorithm>
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

}  // namespace kestrel::test
