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

#include "base/error.h"

namespace kestrel {

std::vector<float> rope_inv_freq(int head_dim, const RopeScaling& r) {
  KESTREL_CHECK(head_dim > 0 && head_dim % 2 == 0,
                "rope: head_dim must be positive and even, got " + std::to_string(head_dim));
  const int half = head_dim / 2;
  std::vector<float> f(half);
  if (!r.rotate) return f;  // zeros: angle 0, cos 1, sin 0
  for (int i = 0; i < half; ++i) {
    f[i] = 1.0f / std::pow(r.theta, (float)(2 * i) / (float)head_dim);
    f[i] /= r.linear_factor;
  }
  if (r.llama3_factor > 0) {
    const float llama3_factor = r.llama3_factor, low_freq_factor = r.low_freq_factor;
    const float high_freq_factor = r.high_freq_factor;
    const int original_max_pos = r.original_max_pos;
    // transformers' _compute_llama3_parameters, in float32 as it runs there.
    const float pi = 3.14159265358979323846f;
    const float low_wavelen = (float)original_max_pos / low_freq_factor;
    const float high_wavelen = (float)original_max_pos / high_freq_factor;
    for (float& x : f) {
      const float wavelen = 2 * pi / x;
      const float scaled = wavelen > low_wavelen ? x / llama3_factor : x;
      if (wavelen < high_wavelen || wavelen > low_wavelen) {
        x = scaled;
      } else {
        const float smooth = ((float)original_max_pos / wavelen - low_freq_factor) /
                             (high_freq_factor - low_freq_factor);
        x = (1 - smooth) * scaled / llama3_factor + smooth * scaled;
      }
    }
  }
  return f;
}

void rope_ref(float* x, int n_heads, int head_dim, int64_t pos, const float* inv_freq) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float angle = (float)pos * inv_freq[i];
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

void rope_ref(float* x, int n_heads, int head_dim, int64_t pos, float theta, float linear_factor) {
  const std::vector<float> f = rope_inv_freq(head_dim, RopeScaling{theta, linear_factor});
  rope_ref(x, n_heads, head_dim, pos, f.data());
}

}  // namespace kestrel
