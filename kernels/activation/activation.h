// Elementwise activations and softmax.
#pragma once

#include <cstdint>

namespace kestrel {

// out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)). out may alias gate.
void silu_mul_ref(const float* gate, const float* up, int64_t n, float* out);

// In-place numerically stable softmax over n values.
void softmax_ref(float* x, int64_t n);
// x = max(x, 0), in place (OPT's MLP).
void relu_ref(float* x, int64_t n);

}  // namespace kestrel
