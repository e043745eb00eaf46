// FP16 SiLU-times-up on the GPU. The CPU oracle is silu_mul_ref in activation.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kestrel::cuda {

// gate_up [2 * inter] = gate | up (the fused gate/up GEMV's output);
// out [inter] = silu(gate) * up. out may alias gate_up (its gate half).
void silu_mul_f16(const __half* gate_up, int inter, __half* out, cudaStream_t stream);

// Row-wise: gate_up [rows, 2 * inter], out [rows, inter] (prefill).
void silu_mul_rows_f16(const __half* gate_up, int rows, int inter, __half* out,
                       cudaStream_t stream);

}  // namespace kestrel::cuda
