// FP16 SiLU-times-up on the GPU. The CPU oracle is silu_mul_ref in activation.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// Row-wise, for the prefill (the decode step does this in its gate|up GEMV's epilogue):
// gate_up [rows, 2 * inter] = gate | up, out [rows, inter] = silu(gate) * up. With one row, out
// may alias gate_up (its gate half).
void silu_mul_rows_f16(const __half* gate_up, int rows, int inter, __half* out,
                       cudaStream_t stream);

// y [rows, n] (rows ldy halves apart) = v [n] in every row: a bias laid down before a GEMM
// that accumulates onto y (its residual), which adds the bias without an epilogue of its own.
void broadcast_rows_f16(const __half* v, int rows, int64_t n, __half* y, int64_t ldy,
                        cudaStream_t stream);

// y [rows, n] (rows ldy halves apart) += v [n] in every row: a bias added after a GEMM that
// has already used its residual (OPT's fc2 in the prefill).
void add_rows_f16(__half* y, int64_t ldy, const __half* v, int rows, int64_t n,
                  cudaStream_t stream);

// x [n] = max(x, 0) in place (OPT's MLP in the prefill; the decode step applies it while the
// fc2 GEMV stages its input, GemvInput::relu).
void relu_f16(__half* x, int64_t n, cudaStream_t stream);

}  // namespace kestrel::cuda
