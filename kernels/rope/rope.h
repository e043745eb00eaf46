// Rotary position embedding, Hugging Face "rotate half" convention: within each head of
// size d, element i (< d/2) pairs with element i + d/2, rotated by angle
// pos / (theta^(2i/d) * linear_factor).
#pragma once

#include <cstdint>
#include <vector>

namespace kestrel {

// Rotates x [n_heads, head_dim] in place for one position.
void rope_ref(float* x, int n_heads, int head_dim, int64_t pos, float theta, float linear_factor);

// How a model's RoPE frequencies are made: 1 / theta^(2i/d), divided by linear_factor; with
// llama3_factor > 0, Llama 3's scaling on top: wavelengths longer than original_max_pos /
// low_freq_factor divided by llama3_factor, shorter than original_max_pos / high_freq_factor
// kept, those between blended linearly in original_max_pos / wavelength.
struct RopeScaling {
  float theta = 10000.0f;
  float linear_factor = 1.0f;
  float llama3_factor = 0.0f;
  float low_freq_factor = 1.0f, high_freq_factor = 4.0f;
  int original_max_pos = 8192;
  // false: every frequency 0, so the rotation is the identity, bit for bit (a family with
  // learned positions runs the RoPE kernels unchanged).
  bool rotate = true;
};

// The frequencies [head_dim / 2], in float32 in transformers' order of operations.
std::vector<float> rope_inv_freq(int head_dim, const RopeScaling& r);
// Rotates x [n_heads, head_dim] in place for one position by those frequencies.
void rope_ref(float* x, int n_heads, int head_dim, int64_t pos, const float* inv_freq);

}  // namespace kestrel
