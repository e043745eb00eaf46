// Plain C++ rotary embedding, computed in float exactly as transformers does it:
//   inv_freq[i] = 1 / theta^(2i/d)               (float32 pow and divide)
//   inv_freq[i] /= linear_factor                  ("linear" rope scaling)
//   angle       = float(pos) * inv_freq[i]        (float32 product)
//   cos, sin of the float angle.
// Mathematically angle = (pos / linear_factor) * inv_freq; keeping transformers' float order
// makes the angles bitwise equal to the reference implementation the models were run with.
// (A power-of-two factor divides exactly, so factor 2 at pos 2p equals factor 1 at pos p.)
#include "kernels/rope/rope.h"

#include <cmath>

#include "engine/base/error.h"

namespace kestrel {

void rope_ref(float* x, int n_heads, int head_dim, int64_t pos, float theta, float linear_factor) {
  KESTREL_CHECK(head_dim > 0 && head_dim % 2 == 0,
                "rope_ref: head_dim must be positive and even, got " + std::to_string(head_dim));
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    float inv_freq = 1.0f / std::pow(theta, (float)(2 * i) / (float)head_dim);
    inv_freq /= linear_factor;
    const float angle = (float)pos * inv_freq;
    const float c = std::cos(angle), s = std::sin(angle);
    for (int h = 0; h < n_heads; ++h) {
      float* xh = x + (int64_t)h * head_dim;
      // rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
      const float x1 = xh[i], x2 = xh[i + half];
      xh[i] = x1 * c - x2 * s;
      xh[i + half] = x2 * c + x1 * s;
    }
  }
}

}  // namespace kestrel
