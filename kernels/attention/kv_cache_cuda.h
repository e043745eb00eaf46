// The KV cache on the GPU in any of its types (--cache-type-k / -v, kernels/attention/kv_quant.h):
// one layer's K or V cache as the kernels take it, and the kernel that writes a position into
// it (RoPE of q and k, then k and v rounded to the cache's type). The attention kernels that read
// it are attention_decode_kv (attention_cuda.h) and attention_prefill_kv
// (attention_prefill_cuda.h); both dequantize as they read, into registers or their shared
// tiles, never into a second FP16 copy of the cache.
//
// Layout of one layer's cache of ctx positions (kv_dim = n_kv_heads * head_dim), the CPU
// reference's (kv_quant.h) on the device:
//
//   f16    data   __half [ctx, kv_dim]
//   q8_0   data   int8   [ctx, kv_dim]          position p, head h, dim d at p * kv_dim + h * D + d
//          scales __half [ctx, kv_dim / 32]     block (h * D + d) / 32 of position p
//   fp8    data   E4M3   [ctx, kv_dim]          (OCP E4M3, __NV_E4M3)
//          scales float  [ctx, n_kv_heads]      head h of position p
//
// A value reads as code * scale in fp32; the codes and scales are those KvLayerRef::write
// makes of the same (fp16) input, byte for byte.
//
// Paged caches (models/kv_pool.h): the same arrays over a pool's rows (n_blocks * 16 of them,
// where ctx stands above), and a block table that maps a sequence's position p to
//
//   row(p) = blocks[p / 16] * 16 + p % 16       (kKvBlock = 16; KvLayerRef::row)
//
//   positions  0 .. 15 | 16 .. 31 | 32 .. 47 | ...        blocks = {5, 0, 2, ...}
//   rows      80 .. 95 |  0 .. 15 | 32 .. 47 | ...
//
// so that p * kv_dim above becomes row(p) * kv_dim (and likewise for the scales). Every kernel
// that takes a KvCacheDev reads and writes through it (kv_detail::kv_row); the entry points that
// take bare __half pointers (attention_decode_f16, attention_prefill_f16,
// rope_kv_write_rows_f16) address a contiguous cache only.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/attention/kv_quant.h"
#include "kernels/rope/rope.h"

namespace kestrel::cuda {

// One layer's K or V cache on the device (it owns nothing). `data` is 16-byte aligned; `scales`
// is null for f16. `blocks` (device memory, one int32 per 16 positions up to the context) is
// null for a contiguous cache; the attention kernels take K and V of one sequence and want
// them under the same table.
struct KvCacheDev {
  KvType type = KvType::F16;
  void* data = nullptr;
  void* scales = nullptr;
  const int32_t* blocks = nullptr;

  const __half* f16() const { return static_cast<const __half*>(data); }
};

// One sequence of a batched decode step (rope_kv_write_batch, attention_decode_batch): its K
// and V caches of every layer, laid layer after layer (models/gpu/decoder.h GpuKvStorage), and
// the attention workspace of its context. Layer l's K data is at k_data + l * k_stride bytes
// (likewise the scales and V), read through `blocks` where the sequence is paged (null: a
// contiguous cache). The kernels take an array of them in device memory, one per row.
struct KvBatchSeq {
  char* k_data = nullptr;
  char* v_data = nullptr;
  char* k_scales = nullptr;  // 8-bit types; else null
  char* v_scales = nullptr;
  size_t k_stride = 0, v_stride = 0;                // bytes of one layer's data
  size_t k_scales_stride = 0, v_scales_stride = 0;  // bytes of one layer's scales
  const int32_t* blocks = nullptr;
  float* workspace = nullptr;  // attention_workspace_bytes(ctx, n_heads, head_dim), counters zero
  int ctx = 0;                 // positions the sequence may hold (its workspace's layout)

  __host__ __device__ KvCacheDev k_layer(KvType t, int l) const {
    return {t, k_data + (size_t)l * k_stride, k_scales ? k_scales + (size_t)l * k_scales_stride : nullptr,
            blocks};
  }
  __host__ __device__ KvCacheDev v_layer(KvType t, int l) const {
    return {t, v_data + (size_t)l * v_stride, v_scales ? v_scales + (size_t)l * v_scales_stride : nullptr,
            blocks};
  }
};

// Bytes of data and of scales of one layer's cache of ctx positions.
inline size_t kv_data_bytes(KvType t, int64_t ctx, int n_kv_heads, int head_dim) {
  return (size_t)ctx * n_kv_heads * head_dim * (t == KvType::F16 ? 2 : 1);
}
inline size_t kv_scales_bytes(KvType t, int64_t ctx, int n_kv_heads, int head_dim) {
  return (size_t)ctx * kv_scales_per_row(t, n_kv_heads, head_dim) * kv_scale_bytes(t);
}

// RoPE + KV write into caches of any type, for T consecutive tokens (T = 1 at a decode step):
// qkv [T, row_stride], row t = q [n_heads, head_dim] | k [n_kv_heads, head_dim] | v (likewise),
// the token at position pos0 + t (pos0 = *d_pos0 where d_pos0 is set, so that a captured graph
// replays at any position). Rotates q and k of every row in place, bitwise as
// rope_kv_write_rows_f16 does, and writes the rotated k and v at positions pos0 + t of k and v,
// each rounded to its cache's type from its fp16 value as KvLayerRef::write rounds it (f16:
// copied). Launched with programmatic dependent launch (it waits for the kernel before).
// head_dim 64 or 128; q8_0 needs head_dim a multiple of 32 (both are); anything else, a
// row_stride shorter than q|k|v or T outside [1, 65535] is a kestrel::Error.
void rope_kv_write_rows_kv(__half* qkv, int64_t row_stride, int T, int pos0, const KvCacheDev& k,
                           const KvCacheDev& v, int n_heads, int n_kv_heads, int head_dim,
                           const RopeScaling& rope, cudaStream_t stream,
                           const int* d_pos0 = nullptr);

// rope_kv_write_rows_kv for the B rows of a batched decode step, in one launch: row i of qkv
// is the new token of sequence seqs[i] (device array) at position d_pos[i] (device); its q and k
// are rotated in place and its k and v written into that sequence's layer-`layer` caches, of the
// types `types`, through its block table where it has one. The same values, row for row, as
// rope_kv_write_rows_kv with T = 1 on each sequence's caches. B in [1, 65535].
void rope_kv_write_batch(__half* qkv, int64_t row_stride, int B, const int* d_pos,
                         const KvBatchSeq* seqs, int layer, KvCacheTypes types, int n_heads,
                         int n_kv_heads, int head_dim, const RopeScaling& rope,
                         cudaStream_t stream);

}  // namespace kestrel::cuda
