// FP16 normalisations on the GPU: rows of length n, fp32 statistics, one rounding to fp16 at the
// end. The CPU oracles are rms_norm_ref / layer_norm_ref in norm.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// y = x / sqrt(mean(x^2) + eps) * w ; x, y [rows, n] (y may alias x), w [n].
void rms_norm_f16(const __half* x, const __half* w, float eps, int rows, int n, __half* y,
                  cudaStream_t stream);

// y = (x - mean) / sqrt(var + eps) * w + b ; b [n] may be nullptr; y may alias x.
void layer_norm_f16(const __half* x, const __half* w, const __half* b, float eps, int rows, int n,
                    __half* y, cudaStream_t stream);

// The same after x += add (add [n], every row; x [rows, n] written back, rounded to fp16): a
// residual stream's pending bias (OPT's o and fc2 biases, left out of their residual GEMVs)
// added where the stream is normalised anyway. y must not alias x.
void add_layer_norm_f16(__half* x, const __half* add, const __half* w, const __half* b, float eps,
                        int rows, int n, __half* y, cudaStream_t stream);

// Qwen3's per-head norms, in place: in each of `rows` rows of qkv (ld halves apart, q heads
// [n_heads, head_dim] then k heads [n_kv_heads, head_dim]), every q head becomes
// rms_norm(head) * q_w and every k head rms_norm(head) * k_w (q_w, k_w [head_dim]); v is not
// touched. The oracle is rms_norm_ref over each head. head_dim even and <= 256.
void head_rms_norm_f16(__half* qkv, int64_t ld, int rows, int n_heads, int n_kv_heads,
                       int head_dim, const __half* q_w, const __half* k_w, float eps,
                       cudaStream_t stream);

}  // namespace kestrel::cuda
