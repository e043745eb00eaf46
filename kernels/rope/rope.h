// Rotary position embedding, Hugging Face "rotate half" convention: within each head of
// size d, element i (< d/2) pairs with element i + d/2, rotated by angle
// pos / (theta^(2i/d) * linear_factor).
#pragma once

#include <cstdint>

namespace kestrel {

// Rotates x [n_heads, head_dim] in place for one position.
void rope_ref(float* x, int n_heads, int head_dim, int64_t pos, float theta, float linear_factor);

}  // namespace kestrel
