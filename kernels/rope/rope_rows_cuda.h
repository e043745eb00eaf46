// Rotary embedding fused with the KV-cache write for a chunk of consecutive positions (prefill).
// Same convention and the same float arithmetic as rope_kv_write_f16 (rope_cuda.h), so a token's
// cached K is bitwise what the decode step would have written for it.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/rope/rope.h"

namespace kestrel::cuda {

// qkv [T, row_stride]: row t = q [n_heads, head_dim] | k [n_kv_heads, head_dim] | v [likewise]
// (row_stride >= (n_heads + 2 * n_kv_heads) * head_dim), the token at position pos0 + t.
// Rotates q and k of every row in place and copies the rotated k and v into rows pos0 + t of
// k_cache and v_cache ([max_ctx, n_kv_heads * head_dim], this layer's slice); the caller keeps
// pos0 + T <= max_ctx. head_dim even and <= 256, T >= 1, else kestrel::Error.
// With d_pos0 (device memory, [1]) the first position is read from *d_pos0 inside the kernel
// and pos0 is not used past the argument checks: a captured CUDA graph (a speculative verify
// pass) then replays at whatever position the host last wrote there.
void rope_kv_write_rows_f16(__half* qkv, int64_t row_stride, int T, int pos0, __half* k_cache,
                            __half* v_cache, int n_heads, int n_kv_heads, int head_dim,
                            const RopeScaling& rope, cudaStream_t stream,
                            const int* d_pos0 = nullptr);

}  // namespace kestrel::cuda
