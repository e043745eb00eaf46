// Causal attention for a chunk of T consecutive queries over the FP16 KV cache (prefill),
// flash-attention style on the tensor cores: FP16 products, FP32 online softmax and output.
// The chunk's own K and V must already be in the cache (rope_kv_write_rows_f16), together with
// everything before it. The CPU oracle is attention_ref in attention.h, query by query.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/attention/kv_cache_cuda.h"

namespace kestrel::cuda {

// Mma: registers and mma.sync (the engine's). Wmma: WMMA fragments with S, P and O staged in
// shared memory (slower; a second implementation for tests and benchmarks).
enum class PrefillAttnKernel { Mma, Wmma };

// q: row t (the query at position pos0 + t) at q + t * q_stride, head h at + h * head_dim
// (q_stride a multiple of 8, q 16-byte aligned: the fused qkv buffer qualifies).
// k_cache, v_cache [max_ctx, n_kv_heads * head_dim], 16-byte aligned, rows < pos0 + T written.
// out [T, n_heads * head_dim]. Query t attends over positions [first, pos0 + t] with
// first = max(0, pos0 + t + 1 - sliding_window) when sliding_window > 0, else 0. Query head h
// reads KV head h / (n_heads / n_kv_heads); scale 1/sqrt(head_dim). head_dim 64 or 128;
// anything else (or n_heads not a multiple of n_kv_heads) is a kestrel::Error.
// With d_pos0 (device memory, [1]) the first position is read from *d_pos0 inside the kernel
// and pos0 is not used past the argument checks. The grid depends on T and n_heads only and
// each block derives its range of keys from the position, so a captured CUDA graph (a
// speculative verify pass) replays at whatever position the host last wrote there.
void attention_prefill_f16(const __half* q, int64_t q_stride, const __half* k_cache,
                           const __half* v_cache, int pos0, int T, int sliding_window,
                           int n_heads, int n_kv_heads, int head_dim, __half* out,
                           cudaStream_t stream, PrefillAttnKernel kernel = PrefillAttnKernel::Mma,
                           const int* d_pos0 = nullptr);

// attention_prefill_f16's Mma kernel over caches of any type (kv_cache_cuda.h, K and V each
// its own): each K/V tile dequantized (code * scale in fp32, rounded to fp16) as it is staged
// in shared memory, never into a second copy of the cache. The same contract otherwise (the
// chunk's own K/V written first, by rope_kv_write_rows_kv). A paged cache
// (KvCacheDev::blocks) reads each position's row through its block table, f16 included. A type
// without its scales, or K and V under different tables, is a kestrel::Error.
void attention_prefill_kv(const __half* q, int64_t q_stride, const KvCacheDev& k,
                          const KvCacheDev& v, int pos0, int T, int sliding_window, int n_heads,
                          int n_kv_heads, int head_dim, __half* out, cudaStream_t stream,
                          const int* d_pos0 = nullptr);

}  // namespace kestrel::cuda
