// Single-query (decode) attention over the FP16 KV cache, flash-decoding style: the context is
// cut into fixed chunks that separate blocks process in parallel, and the last block of each
// head range to finish merges the chunks' partial softmaxes. The CPU oracle is attention_ref in
// attention.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/attention/kv_cache_cuda.h"
#include "kernels/rope/rope.h"

namespace kestrel::cuda {

// Positions per block (a chunk) in a grid over ctx_bound positions at head_dim: 32 at 128 and 64
// at 64 up to 1,024 positions, twice that beyond. Chunks of different lengths sum a context's
// terms in another order.
int attention_chunk_positions(int ctx_bound, int head_dim);

// Bytes of scratch attention_decode_f16 needs for a context of up to max_ctx positions.
size_t attention_workspace_bytes(int max_ctx, int n_heads, int head_dim);

// Zeroes the workspace's counters (its last n_heads ints) on `stream`: once after allocating
// it, before the first attention call. Every call leaves them zero again.
void attention_workspace_reset(float* workspace, int max_ctx, int n_heads, int head_dim,
                               cudaStream_t stream);

// q [n_heads, head_dim]; k_cache, v_cache [max_ctx, n_kv_heads, head_dim] (16-byte aligned);
// out [n_heads, head_dim]. The query at position *d_pos attends over positions
// [first, *d_pos] with first = max(0, *d_pos + 1 - sliding_window) when sliding_window > 0,
// else 0; rows outside that range are never read. Query head h reads KV head
// h / (n_heads / n_kv_heads); scale 1/sqrt(head_dim).
// Grids are sized for ctx_bound positions (0: max_ctx; at most max_ctx) and the position is read
// on the device, so a captured CUDA graph replays every step unchanged; the caller guarantees
// 0 <= *d_pos < ctx_bound. Blocks past *d_pos exit at once, but each still costs its launch,
// so a caller replaying graphs keeps one per range of positions.
// heads_per_block: query heads one block serves where a KV group has several; 0 = chosen (2 at
// head_dim 64, 1 at 128, twice that where ctx_bound is over 1,024 positions), else 1, 2 or 4.
// workspace: attention_workspace_bytes(max_ctx, n_heads, head_dim) bytes, 4-byte aligned,
// reset by attention_workspace_reset before its first use.
// head_dim 64 or 128; anything else is a kestrel::Error.
void attention_decode_f16(const __half* q, const __half* k_cache, const __half* v_cache,
                          const int* d_pos, int max_ctx, int sliding_window, int n_heads,
                          int n_kv_heads, int head_dim, float* workspace, __half* out,
                          cudaStream_t stream, int ctx_bound = 0, int heads_per_block = 0);

// attention_decode_f16 over caches of any type (kv_cache_cuda.h: f16, q8_0, fp8, K and V each
// its own), dequantized as they are read (code * scale in fp32, as KvLayerRef::read), never
// into a second copy. The query is already rotated and its K/V row written
// (rope_kv_write_rows_kv at *d_pos). out_index as attention_decode_rope_f16's. The same grid,
// chunks and checks as attention_decode_f16; an 8-bit row of a head is head_dim bytes (plus
// its scales), half the bytes an f16 step reads. A paged cache (KvCacheDev::blocks) reads each
// position's row through its block table; max_ctx is then the sequence's context (the table's
// positions), not the pool's rows. A type without its scales, or K and V under different
// tables, is a kestrel::Error.
void attention_decode_kv(const __half* q, const KvCacheDev& k, const KvCacheDev& v,
                         const int* d_pos, int max_ctx, int sliding_window, int n_heads,
                         int n_kv_heads, int head_dim, float* workspace, __half* out,
                         cudaStream_t stream, const int32_t* out_index = nullptr,
                         int ctx_bound = 0, int heads_per_block = 0);

// The decode step's RoPE, KV-cache write and attention in one, over f16 caches (contiguous or
// paged, as attention_decode_kv): qkv is the new token's un-rotated [q | k | v] row (n_heads +
// 2 n_kv_heads heads, 16-byte aligned); q and k are rotated for position *d_pos (frequencies,
// arithmetic and fp16 rounding as rope_kv_write_f16), k and v are written to the caches' row
// of position *d_pos, and q attends as in attention_decode_f16. The same values as rope_kv_write_f16 followed by attention_decode_f16,
// one launch fewer; qkv itself is not modified. out_index [n_heads * head_dim] (device), when
// given: output e is stored at out[out_index[e]] (the o GEMV's act-order permutation, so that
// it stages its x without a gather).
void attention_decode_rope_f16(const __half* qkv, const KvCacheDev& k, const KvCacheDev& v,
                               const int* d_pos, int max_ctx, int sliding_window, int n_heads,
                               int n_kv_heads, int head_dim, const RopeScaling& rope,
                               float* workspace, __half* out, cudaStream_t stream,
                               const int32_t* out_index = nullptr, int ctx_bound = 0,
                               int heads_per_block = 0);

// The decode attention of a batched step, B rows in one launch: launch row j runs row i =
// d_rows[j] (device; null: i = j) of qkv (qkv + i * q_stride), the new token of sequence
// seqs[i] (device array, kv_cache_cuda.h) at position d_pos[i] (device), attending over that
// sequence's layer-`layer` caches of the types `types` through its block table where it has
// one, and using its own workspace; its output goes to out + i * out_stride. rope_fused (f16
// caches, and only they): the row is the un-rotated q|k|v, rotated and written here as
// attention_decode_rope_f16 does; else (8-bit caches) q is already rotated and the row written
// (rope_kv_write_batch). The grid covers ctx_bound positions, at least every row's position + 1
// (a row whose context is shorter has more blocks that exit at once). Row for row the values of
// attention_decode_rope_f16 / attention_decode_kv over the same sequence with the same
// ctx_bound: rows grouped by their decode graphs' bounds (models/gpu/batch.cpp) compute what
// their sessions' own decode steps compute (heads_per_block as the decode step's).
void attention_decode_batch(const __half* qkv, int64_t q_stride, int B, const int* d_rows,
                            const int* d_pos, const KvBatchSeq* seqs, int layer,
                            KvCacheTypes types, bool rope_fused, int ctx_bound,
                            int sliding_window, int n_heads, int n_kv_heads, int head_dim,
                            const RopeScaling& rope, __half* out, int64_t out_stride,
                            cudaStream_t stream, int heads_per_block = 0);

}  // namespace kestrel::cuda
