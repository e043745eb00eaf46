// Dense linear layers, y = x W^T (+ b).
#pragma once

#include <cstdint>

namespace kestrel {

// x [M, K] fp32, W [N, K] fp32 row-major, bias [N] or nullptr, y [M, N].
void matmul_ref(const float* x, const float* W, const float* bias, int64_t M, int64_t N,
                int64_t K, float* y);

// Same with W stored as fp16 bits (what an unquantized checkpoint linear or lm_head holds).
void matmul_f16w_ref(const float* x, const uint16_t* W, const float* bias, int64_t M, int64_t N,
                     int64_t K, float* y);

}  // namespace kestrel
