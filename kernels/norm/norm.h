// Normalisations over the last dimension of rows of length n.
#pragma once

#include <cstdint>

namespace kestrel {

// y = x / sqrt(mean(x^2) + eps) * w ; x, y [rows, n] (may alias), w [n].
void rms_norm_ref(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y);

// y = (x - mean) / sqrt(var + eps) * w + b ; b may be nullptr.
void layer_norm_ref(const float* x, const float* w, const float* b, float eps, int64_t rows,
                    int64_t n, float* y);

}  // namespace kestrel
