// FP16 normalisations on the GPU: rows of length n, fp32 statistics, one rounding to fp16 at the
// end. The CPU oracles are rms_norm_ref / layer_norm_ref in norm.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kestrel::cuda {

// y = x / sqrt(mean(x^2) + eps) * w ; x, y [rows, n] (y may alias x), w [n].
void rms_norm_f16(const __half* x, const __half* w, float eps, int rows, int n, __half* y,
                  cudaStream_t stream);

// y = (x - mean) / sqrt(var + eps) * w + b ; b [n] may be nullptr; y may alias x.
void layer_norm_f16(const __half* x, const __half* w, const __half* b, float eps, int rows, int n,
                    __half* y, cudaStream_t stream);

}  // namespace kestrel::cuda
