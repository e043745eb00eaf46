// Rotary position embedding fused with the KV-cache write, for one decode position.
// Same convention as rope_ref (rope.h): Hugging Face rotate-half with linear scaling.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/rope/rope.h"

namespace kestrel::cuda {

// qkv [q_dim + 2 * kv_dim] = q [n_heads, head_dim] | k [n_kv_heads, head_dim] | v [likewise],
// the fused qkv GEMV's output. Rotates q and k in place by position *d_pos and copies the
// rotated k and v into row *d_pos of k_cache and v_cache (each [max_ctx, n_kv_heads * head_dim],
// this layer's slice). The position is read on the device so that a captured CUDA graph replays
// every step unchanged; the caller guarantees 0 <= *d_pos < max_ctx (the engine checks the
// position on the host before each step). head_dim even and <= 256, else kestrel::Error.
void rope_kv_write_f16(__half* qkv, __half* k_cache, __half* v_cache, const int* d_pos,
                       int n_heads, int n_kv_heads, int head_dim, const RopeScaling& rope,
                       cudaStream_t stream);

}  // namespace kestrel::cuda
