// Greedy sampling on the GPU, and the conversion that hands logits to the host sampler.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kestrel::cuda {

// *d_out_token = the index of the largest of logits[0 .. n-1]; the first such index on ties
// (as the host sampler's argmax). NaN never wins; if no value beats -inf the result is 0.
// Writing the token to device memory lets the next step's embedding read it inside the graph.
// With `feed` (a step's {token, pos} in device memory) the token is also written to feed[0] and
// feed[1] is advanced by one, so that the next step can run without the host; with `host_out`
// (pinned host memory) the token is also written there, for the host once the step is done.
void argmax_f16(const __half* logits, int n, int* d_out_token, cudaStream_t stream,
                int* feed = nullptr, int* host_out = nullptr);

// out[r] = the index of the largest of logits[r * n .. r * n + n - 1] (fp32), for each of
// `rows` rows, with argmax_f16's rules (the first index on ties, NaN never wins, 0 when
// nothing beats -inf): a speculative verify pass's greedy successors, one block per row.
// out is device memory [rows].
void argmax_rows_f32(const float* logits, int rows, int n, int* out, cudaStream_t stream);

// out[i] = float(in[i]) for i < n.
void half_to_float(const __half* in, float* out, int n, cudaStream_t stream);

}  // namespace kestrel::cuda
