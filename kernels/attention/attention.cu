// Decode attention (one query position) over the FP16 KV cache, flash-decoding style.
//
// Work split. The context is cut into chunks of kChunk positions aligned to absolute positions
// (kChunk = chunk_for(head_dim, passes_for(ctx_bound)): 32 at 128, 64 at 64, twice that where
// the grid covers more than 1,024 positions): chunk s covers [s * kChunk, (s + 1) * kChunk).
// The kernel has one block per (KV head, chunk):
//   grid = (n_kv_heads, ceil(ctx_bound / kChunk), ceil(group / GMAX)), group = n_heads / n_kv_heads
// ctx_bound (at most max_ctx, the cache's length) is fixed at capture time: the engine captures
// a decode graph per range of positions (512, 1,024, 2,048, ...), so that few blocks are dead.
// A block whose chunk holds no live position (past *d_pos, or before the sliding window) exits
// at once. A block serves up to GMAX <= 4 query heads of its KV group; a larger group takes
// more blocks in z, which read the same K and V rows (all but the first from L2), so HBM sees
// each row once per step. At 4096 positions a Llama-2-7B layer gives 32 x 128 = 4096 live
// blocks: every SM streams.
//
// Inside a block (kThreads = 128):
//   K/V row of one head: head_dim halves = kLanes 16-byte pieces, kLanes = head_dim / 8 threads.
//
//     row r:  | t0 : d0-7 | t1 : d8-15 | ... | t(kLanes-1) |     kRows = 128 / kLanes rows at once
//
//   0. before waiting on the previous kernel: every K row of the chunk into registers (kChunk /
//      kRows 16-byte loads in flight per thread) and every V row into shared memory (cp.async).
//   1. scores: each thread dots its 8 dims of its kChunk / kRows rows with the group's queries
//      (shared memory, pre-scaled by log2(e) / sqrt(head_dim)), then the kLanes threads of a row
//      sum by xor-shuffles. Scores of the chunk go to shared memory.
//   2. per head: m = max score, p = exp2(score - m), l = sum p  (p overwrites the scores).
//   3. V: each thread owns GMAX * D / kThreads consecutive outputs (head, dims) and sums
//      p * v over every row of the chunk (p and V from shared memory), so no partial sums meet
//      across threads. (Splitting the rows across threads instead, as the scores are, left a
//      GMAX x kRows x D reduction through shared memory, which was slower: docs/performance.md.)
//   Per (head, chunk) the block writes m, l and the unnormalised output o to the fp32 workspace.
// The merge (merge_heads), by the last block of each head range to finish (a counter per range
// in the workspace; that block resets it), for all the range's heads at once:
//   M = max m_s,  out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s.
// (A second kernel, one block per head, did this first: its launch cost more than the merge
// itself (docs/performance.md). A last block that merged its heads one after the other was
// slower still for a group of 8.)
//
// A batched decode step (attention_decode_batch) runs B rows of B sequences in one grid:
//   grid = (n_kv_heads, ceil(ctx_bound / kChunk), B * ceil(group / GMAX))
// Block z serves launch row z / ceil(group / GMAX), which reads its row's sequence (caches of
// every layer, block table, workspace: KvBatchSeq) and position from device memory; from there
// it is the one-row kernel, block for block. The engine groups rows by their sessions' graph
// bounds, one launch per group, so that each row's chunking is its own decode step's.
//
// Only positions inside [first, n_ctx) are ever loaded: rows beyond the live context may hold
// anything (a NaN there would otherwise survive a multiplication by p = 0).
//
// Bytes: 2 * n_ctx * n_kv_heads * head_dim * 2 (K and V, once each) plus
// n_heads * live_chunks * (head_dim + 2) * 4 * 2 for the workspace, small next to K/V. With an
// 8-bit cache (attention_decode_kv) a row is head_dim bytes of codes and 2 * head_dim / 32
// (q8_0) or 4 (fp8) bytes of scales: K and V move 8.5 or 8 + 32 / head_dim bits a value.
//
// 8-bit caches (kv_cache_cuda.h): the same threads and rows, each thread's 8 dims an 8-byte
// load of codes (K into registers, V into shared memory by an 8-byte cp.async) and the scale
// of its block (q8_0) or head (fp8); K is dequantized in registers before the dot, V's scale is
// folded into p in step 3.
//
//     row r:  | t0 : c0-7 | t1 : c8-15 | ... |        8 codes (bytes) per thread
//     q8_0 scales of row r:  | b0 (t0-t3) | b1 (t4-t7) | ...  fp16, one per 32 dims
//     fp8  scale of row r:   one fp32 for the head
#include "kernels/attention/attention_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/cp_async.cuh"
#include "kernels/common/half8.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/attention/kv_quant.cuh"
#include "kernels/rope/rope_kv.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxGroup = 4;     // query heads one block can serve (largest GMAX compiled)

// Query heads one block serves (GMAX: 1, 2 or kMaxGroup) for a KV group of `group`, in a grid
// that covers the positions below ctx_bound: two at head_dim 64 and one at 128 up to 1,024
// positions, twice that beyond. A group larger than that takes several blocks per chunk, which
// read the same K and V rows (all but the first from L2). Fewer heads shorten each block's chain
// after the wait (the scores and p * V per head); at long contexts the extra blocks' reads of
// each row cost more than that. The defaults are the fastest of 1, 2 and 4 heads per block on
// GQA models of both head sizes, at short and at long contexts (measured:
// docs/attention-notes.md); attention_decode*_f16's heads_per_block overrides them.
constexpr int kLongContext = 1024;  // positions past which a block serves twice the heads

// `forced` 1, 2 or 4 (attention_decode*_f16's heads_per_block) overrides the choice.
int heads_per_block(int group, int head_dim, int ctx_bound, int forced) {
  const int g =
      forced ? forced : (head_dim >= 128 ? 1 : 2) * (ctx_bound > kLongContext ? 2 : 1);
  return group <= 1 ? 1 : std::min(g, group <= 2 ? 2 : kMaxGroup);
}

// Positions per block (a chunk): 4 passes of the block over K rows, so each thread keeps 4 rows
// in flight (32 positions at head_dim 128, 64 at 64), where the grid covers up to 1,024
// positions; 8 passes beyond. Short chunks keep a block's serial passes few and let many blocks
// stream at once: at a few hundred positions, chunks of 32 positions beat 64 at head_dim 128
// (head_dim 64, with more heads per block, keeps 64), and much longer chunks leave a few blocks
// with long serial chains. At long contexts the blocks are many anyway, and 8 passes halve them
// and the partials each merge reads (measured: docs/attention-notes.md, docs/performance.md).
// (72-95 registers at 8 passes, 56 at 4; no spill.)
constexpr int kShortPasses = 4, kLongPasses = 8;

constexpr int chunk_for(int head_dim, int passes = kShortPasses) {
  return head_dim > 0 ? passes * kThreads * 8 / head_dim : 64;
}

int passes_for(int ctx_bound) {
  return ctx_bound > kLongContext ? kLongPasses : kShortPasses;
}

// Chunks of a grid over max_ctx positions (the workspace's layout: 4 passes, the most chunks).
int n_chunks(int max_ctx, int head_dim, int passes = kShortPasses) {
  return (max_ctx + chunk_for(head_dim, passes) - 1) / chunk_for(head_dim, passes);
}

__device__ __forceinline__ void to_float8(const Half8& h, float (&f)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __half22float2(h.h2[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

// The first position attended to by a query at n_ctx - 1.
__device__ __forceinline__ int window_start(int n_ctx, int sliding_window) {
  return sliding_window > 0 ? max(0, n_ctx - sliding_window) : 0;
}

// 8-byte counterparts of ldg16 and cp_async16, for 8 codes of an 8-bit cache. cp.async moves 8
// bytes only through L1 (.ca; .cg takes 16): the rows it reads are older than the step, and
// the new row, which the kernel before wrote, is read through L2 (__ldcg) instead.
__device__ __forceinline__ uint2 ldg8(const void* p, uint64_t policy) {
  uint2 r;
  asm volatile("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
               : "=r"(r.x), "=r"(r.y)
               : "l"(p), "l"(policy));
  return r;
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2;" ::"r"(dst),
               "l"(src), "l"(policy)
               : "memory");
}

// 4 consecutive codes (a 4-byte shared load) to fp32, unscaled.
__device__ __forceinline__ void codes4_to_float(uint32_t w, KvType t, float (&f)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) f[j] = kv_detail::code_to_float((uint8_t)(w >> (8 * j)), t);
}

// 8 consecutive dims d0 .. d0+7 (inside one half of the head) of the rotated head x: each pairs
// with d + head_dim/2 (or d - head_dim/2), as rope_kv_row rotates them. cs: the angles'
// (cos, sin) per pair index, rope_angle of this position.
template <int D>
__device__ __forceinline__ uint4 rotate8(const __half* x, int d0, const float2* cs) {
  constexpr int H = D / 2;
  const bool first = d0 < H;
  Half8 own, other, out;
  own.raw = __ldcg(reinterpret_cast<const uint4*>(x + d0));
  other.raw = __ldcg(reinterpret_cast<const uint4*>(x + (first ? d0 + H : d0 - H)));
  const int i0 = first ? d0 : d0 - H;  // pair index of dim d0
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __half a[2] = {__low2half(own.h2[j]), __high2half(own.h2[j])};
    const __half b[2] = {__low2half(other.h2[j]), __high2half(other.h2[j])};
    __half r[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      __half y1, y2;
      if (first)
        rope_detail::rotate_pair(a[e], b[e], cs[i0 + 2 * j + e], y1, y2);
      else
        rope_detail::rotate_pair(b[e], a[e], cs[i0 + 2 * j + e], y1, y2);
      r[e] = first ? y1 : y2;
    }
    out.h2[j] = __halves2half2(r[0], r[1]);
  }
  return out.raw;
}

// The merge of chunks c0 .. c1 for query heads h0 .. h0 + nh - 1 (nh <= GMAX), by one block of
// kThreads, every head at once:
//   M = max m_c,  out = sum_c 2^(m_c - M) o_c / sum_c 2^(m_c - M) l_c.
// The block's outputs are GMAX * D / 4 float4 vectors (head g, dims 4j .. 4j + 3). A thread
// owns kVecs of them and one of kSlices slices of the chunks (c0 + slice, + kSlices, ...); it
// folds kInFlight chunks per round into a running (m, l, o) (online softmax), all their loads
// issued before the first use. The slices then meet through shared memory (red: >= 6 *
// kThreads floats). Reads go through L2 (ld.global.cg): other blocks wrote them this kernel.
template <int D, int GMAX>
__device__ void merge_heads(const float* ws_o, const float* ws_ml, int h0, int nh, int c0,
                            int c1, int n_chunks_all, __half* out, const int32_t* out_index,
                            float* red) {
  constexpr int kVectors = GMAX * D / 4;
  constexpr int kVecs = kVectors > kThreads ? kVectors / kThreads : 1;    // per thread
  constexpr int kSlices = kVectors < kThreads ? kThreads / kVectors : 1;  // of the chunks
  constexpr int kInFlight = 8 / kVecs;
  static_assert(kVecs * kThreads == kVectors * kSlices, "vectors tile the block");
  const int slice = threadIdx.x / (kThreads / kSlices);
  float m[kVecs], l[kVecs];
  float4 o[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    o[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int v = threadIdx.x % (kThreads / kSlices) + i * kThreads;
    const int g = v / (D / 4);
    if (g >= nh) continue;  // a head past the range (nh < GMAX): nothing to merge
    const int h = h0 + g;
    const float* ml = ws_ml + (size_t)h * n_chunks_all * 2;
    const float4* oh =
        reinterpret_cast<const float4*>(ws_o + (size_t)h * n_chunks_all * D) + v % (D / 4);
    for (int c = c0 + slice; c <= c1; c += kSlices * kInFlight) {
      float2 mlc[kInFlight];
      float4 oc[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        const int cc = c + j * kSlices;
        mlc[j] = cc <= c1 ? __ldcg(reinterpret_cast<const float2*>(ml) + cc)
                          : make_float2(-INFINITY, 0.0f);
        oc[j] = cc <= c1 ? __ldcg(oh + (size_t)cc * (D / 4)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
      float mn = m[i];  // finite after this round: chunk c is live
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) mn = fmaxf(mn, mlc[j].x);
      const float r = exp2f(m[i] - mn);  // 0 on the first round (m = -inf)
      float L = l[i] * r;
      float4 O = make_float4(o[i].x * r, o[i].y * r, o[i].z * r, o[i].w * r);
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        const float w = exp2f(mlc[j].x - mn);  // 0 for the padding past c1
        L = fmaf(w, mlc[j].y, L);
        O.x = fmaf(w, oc[j].x, O.x);
        O.y = fmaf(w, oc[j].y, O.y);
        O.z = fmaf(w, oc[j].z, O.z);
        O.w = fmaf(w, oc[j].w, O.w);
      }
      m[i] = mn;
      l[i] = L;
      o[i] = O;
    }
  }
  if constexpr (kSlices > 1) {
    // Slice s of vector v at red[(s * kVectors + v) * 6]: m, l, o.
    float* mine = red + (size_t)threadIdx.x * 6;
    mine[0] = m[0];
    mine[1] = l[0];
    mine[2] = o[0].x;
    mine[3] = o[0].y;
    mine[4] = o[0].z;
    mine[5] = o[0].w;
    __syncthreads();
    if (slice == 0) {
      float M = m[0];
#pragma unroll
      for (int s = 1; s < kSlices; ++s) M = fmaxf(M, red[(s * kVectors + threadIdx.x) * 6]);
      const float r0 = exp2f(m[0] - M);
      float L = l[0] * r0;
      float4 O = make_float4(o[0].x * r0, o[0].y * r0, o[0].z * r0, o[0].w * r0);
#pragma unroll
      for (int s = 1; s < kSlices; ++s) {
        const float* t = red + (s * kVectors + threadIdx.x) * 6;
        const float w = exp2f(t[0] - M);  // 0 for a slice with no chunk (m = -inf)
        L = fmaf(w, t[1], L);
        O.x = fmaf(w, t[2], O.x);
        O.y = fmaf(w, t[3], O.y);
        O.z = fmaf(w, t[4], O.z);
        O.w = fmaf(w, t[5], O.w);
      }
      l[0] = L;
      o[0] = O;
    }
  }
  if (slice != 0) return;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int v = threadIdx.x + i * kThreads;
    if (v / (D / 4) >= nh) continue;
    const float inv = 1.0f / l[i];
    if (out_index) {  // output e at out[out_index[e]] (the o GEMV's act-order permutation)
      const int e = h0 * D + 4 * v;
      const float r[4] = {o[i].x * inv, o[i].y * inv, o[i].z * inv, o[i].w * inv};
#pragma unroll
      for (int j = 0; j < 4; ++j) out[__ldg(out_index + e + j)] = __float2half_rn(r[j]);
      continue;
    }
    __half2* dst = reinterpret_cast<__half2*>(out + (size_t)h0 * D) + 2 * v;
    dst[0] = __floats2half2_rn(o[i].x * inv, o[i].y * inv);
    dst[1] = __floats2half2_rn(o[i].z * inv, o[i].w * inv);
  }
}

template <int D, int GMAX, int PASSES>
__device__ __forceinline__ void merge_if_last(const float* ws_o, const float* ws_ml,
                                              int* counters, __half* out,
                                              const int32_t* out_index, float* buf, int h0,
                                              int nh, int n_ctx, int sliding_window,
                                              int n_chunks_all);

// D: head_dim. GMAX: query heads per block, rounded up to a power of two; the live count `nh`
// is a runtime value <= GMAX, and every loop over heads is unrolled to GMAX with a uniform
// `g < nh` test so that the accumulators stay in registers.
// ROPE: q points at the un-rotated [q | k | v] row of the new token; the block rotates its query
// heads, and the block whose chunk holds *d_pos rotates the new k, writes k and v into the
// caches' row of *d_pos and uses them from registers (rope_kv_write_f16 + this kernel, in one).
// KT, VT: the K and V caches' types (kv_cache_cuda.h). An 8-bit row of one head is D bytes, so a
// thread's 8 dims are one 8-byte load instead of 16 (half the bytes a step reads), plus its
// scale: q8_0's fp16 scale of the block of 32 its 8 dims lie in, fp8's fp32 scale of the head.
// K is dequantized in registers (code * scale, fp32, as the reference reads it) before the
// dot; V's codes go to shared memory as they are (8 bytes per thread and row) with one scale
// per row and block in vs_s, and step 3 folds the scale into p (p * scale * code). The
// quantized caches run without ROPE: their new row is rounded and written by
// rope_kv_write_rows_kv, the kernel before.
//
// Latency: the K rows of the chunk (registers) and its V rows (cp.async into shared memory) are
// all requested at once, before the wait on the previous kernel: rows before *d_pos were
// written by earlier steps, and *d_pos itself before the step's first kernel. Only q and the
// new row come after the wait. The cache rows are read with an evict_first L2 policy, as the
// weights are: a step reads each once (blocks of one KV group in z re-read them within
// microseconds), and kept in L2 they would evict what the next kernels read again (measured:
// docs/performance.md).
// Paged caches (blocks non-null): each row is the one its position's block maps it to
// (kv_detail::kv_row), K, V and their scales alike. The engine writes the table before the
// step's first kernel, as it does the position, so it too may be read before the wait. A chunk
// (32 to 128 positions, aligned to them) covers whole blocks, so its rows lie in 2 to 8 runs of
// 16 contiguous rows.
// Registers: 56 per thread, 7,168 per block. The qkv GEMV's two 8-warp blocks per SM (84
// registers; quant_reg_cap in kernels/gemv/gemv_kernel.cuh) leave 20,480 free on
// each SM, room for two such blocks, which start and load their K and V while the GEMV runs;
// past 80 registers only one would fit there.
// BATCH (attention_decode_batch): blockIdx.z = j * batch.zblocks + the block's z within the
// row, where launch row j runs row i = batch.rows[row0 + j] (i = row0 + j without rows); row
// i's query (or q|k|v) row is q + i * batch.q_stride, its output out + i * batch.out_stride,
// its position batch.d_pos[i], and its caches, block table and workspace those of
// batch.seqs[i] at layer batch.layer (the arguments they replace are unused). Its workspace's
// chunk stride is its own context's (the grid may cover more positions than it holds).
struct BatchArgs {
  const KvBatchSeq* seqs = nullptr;
  const int* d_pos = nullptr;
  const int* rows = nullptr;
  int row0 = 0;
  int layer = 0, zblocks = 1;
  int64_t q_stride = 0, out_stride = 0;
};

template <int D, int GMAX, bool ROPE, int PASSES, KvType KT, KvType VT, bool BATCH>
__global__ void __launch_bounds__(kThreads)
    attention_split_kernel(const __half* __restrict__ q, void* __restrict__ k_data,
                           void* __restrict__ v_data, const void* __restrict__ k_scales,
                           const void* __restrict__ v_scales,
                           const int32_t* __restrict__ blocks, const int* __restrict__ d_pos,
                           int sliding_window, int n_heads, int n_kv_heads, int group,
                           float q_scale, const rope_detail::InvFreq inv_freq,
                           float* __restrict__ ws_o, float* __restrict__ ws_ml,
                           int* __restrict__ counters, __half* __restrict__ out,
                           const int32_t* __restrict__ out_index, const BatchArgs batch) {
  constexpr int kChunk = chunk_for(D, PASSES);
  constexpr int kLanes = D / 8;             // threads per K/V row
  constexpr int kRows = kThreads / kLanes;  // rows covered by one pass of the block
  constexpr int kPasses = kChunk / kRows;   // passes over the chunk
  // Step 3 gives each thread kPer consecutive outputs (head, dims) of the block's GMAX * D,
  // over every row; with fewer outputs than threads, kSplit threads share one over the rows.
  constexpr int kOuts = GMAX * D;
  constexpr int kPer = kOuts >= kThreads ? kOuts / kThreads : 1;
  constexpr int kSplit = kOuts >= kThreads ? 1 : kThreads / kOuts;
  static_assert(kPer <= 16 && D % kPer == 0, "a thread's outputs lie in one head");
  constexpr int kScoreFloats = GMAX * kChunk;
  constexpr int kMergeFloats = 6 * kThreads;  // merge_heads' exchange of the chunk slices
  constexpr int kBufFloats = kScoreFloats > kMergeFloats ? kScoreFloats : kMergeFloats;
  static_assert(D % 8 == 0 && 32 % kLanes == 0, "a row's threads must lie inside one warp");
  static_assert(kChunk % kRows == 0, "whole passes per chunk");
  constexpr bool KQ = KT != KvType::F16, VQ = VT != KvType::F16;  // 8-bit K, V
  static_assert(!ROPE || (!KQ && !VQ), "the fused RoPE writes an f16 cache only");
  using KRaw = std::conditional_t<KQ, uint2, uint4>;  // a thread's 8 dims of one K row
  using VRaw = std::conditional_t<VQ, uint2, uint4>;
  constexpr int kVScales = VT == KvType::Q8_0 ? D / kQ8Block : 1;  // V scales per row (VQ)

  __shared__ __align__(16) float q_s[GMAX * D];
  __shared__ __align__(16) float buf[kBufFloats];  // scores [GMAX][kChunk], then the merge's
  __shared__ __align__(16) VRaw v_s[kChunk * kLanes];  // the chunk's V rows, [row][8 dims]
  __shared__ float vs_s[VQ ? kChunk * kVScales : 1];   // their scales, [row][block]
  __shared__ float2 cs[ROPE ? D / 2 : 1];                 // RoPE (cos, sin) per pair index
  __shared__ __align__(16) uint4 knew_s[kLanes];          // K of the new token's row

  int zb = blockIdx.z;               // this block's query heads: the zb-th GMAX of the group
  int n_chunks_all = gridDim.y;      // the workspace's chunks per head
  if constexpr (BATCH) {
    const int j = batch.row0 + (int)blockIdx.z / batch.zblocks;
    const int row = batch.rows ? __ldg(batch.rows + j) : j;
    zb = blockIdx.z % batch.zblocks;
    d_pos = batch.d_pos + row;
    const int pos = __ldg(d_pos);
    const int lo = max((int)blockIdx.y * kChunk, window_start(pos + 1, sliding_window));
    if (lo >= min((int)blockIdx.y * kChunk + kChunk, pos + 1)) return;  // no live position
    const KvBatchSeq& sq = batch.seqs[row];
    const KvCacheDev kc = sq.k_layer(KT, batch.layer), vc = sq.v_layer(VT, batch.layer);
    k_data = kc.data;
    v_data = vc.data;
    if constexpr (KT != KvType::F16) k_scales = kc.scales;  // f16: none to read
    if constexpr (VT != KvType::F16) v_scales = vc.scales;
    blocks = sq.blocks;
    q += row * batch.q_stride;
    out += row * batch.out_stride;
    // The workspace of the row's context, laid out as attention_decode lays it (ws_ml after
    // n_chunks(ctx) chunks at 4 passes, then the counters), with this grid's chunks per head.
    const int chunks4 = (sq.ctx + chunk_for(D) - 1) / chunk_for(D);
    n_chunks_all = (sq.ctx + kChunk - 1) / kChunk;
    ws_o = sq.workspace;
    ws_ml = ws_o + (size_t)n_heads * chunks4 * D;
    counters = reinterpret_cast<int*>(ws_ml + (size_t)n_heads * chunks4 * 2);
  }
  __half* const k_cache = static_cast<__half*>(k_data);  // f16 views (KT, VT f16 only)
  __half* const v_cache = static_cast<__half*>(v_data);
  const uint8_t* const k_codes = static_cast<const uint8_t*>(k_data);
  const uint8_t* const v_codes = static_cast<const uint8_t*>(v_data);
  const int pos = *d_pos, n_ctx = pos + 1;
  const int chunk = blockIdx.y;
  const int lo = max(chunk * kChunk, window_start(n_ctx, sliding_window));
  const int hi = min(chunk * kChunk + kChunk, n_ctx);
  if (lo >= hi) return;  // the whole block: no position of this chunk is live
  const int n_rows = hi - lo;
  const int new_row = pos - lo;  // the new token's row, when it is in this chunk (< n_rows)

  const int kvh = blockIdx.x;
  const int h0 = kvh * group + zb * GMAX;  // first query head of this block
  const int nh = min(GMAX, group - zb * GMAX);

  const int seg = threadIdx.x % kLanes;  // which 8 dims
  const int r0 = threadIdx.x / kLanes;   // which row of a pass
  const size_t row_stride = (size_t)n_kv_heads * D;
  const size_t head_elem = (size_t)kvh * D + seg * 8;  // this thread's dims inside a row

  KRaw kraw[kPasses];
  float ksc[kPasses], vsc[kPasses];  // 8-bit K, V: the scales of this thread's dims per row
  const uint64_t kv_pol = evict_first_policy();  // read once per step
  // The scale a thread's 8 dims take: q8_0's block of 32 (dims seg * 8 ..), fp8's head. A V
  // scale goes to shared memory from the thread at its block's start (every dim's thread needs it).
  const bool stores_vscale = VT == KvType::Q8_0 ? seg % (kQ8Block / 8) == 0 : seg == 0;
  const int vscale_slot = VT == KvType::Q8_0 ? seg * 8 / kQ8Block : 0;
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int r = u * kRows + r0;
    kraw[u] = KRaw{};
    ksc[u] = vsc[u] = 0.0f;
    if (r < n_rows && r != new_row) {
      const int64_t row = kv_detail::kv_row(blocks, lo + r);
      const size_t e = (size_t)row * row_stride + head_elem;
      if constexpr (KQ) {
        kraw[u] = ldg8(k_codes + e, kv_pol);
        ksc[u] = kv_detail::load_scale(k_scales, KT, row, n_kv_heads, D, kvh, seg * 8);
      } else {
        kraw[u] = ldg16(k_cache + e, kv_pol);
      }
      if constexpr (VQ) {
        cp_async8(smem_u32(&v_s[r * kLanes + seg]), v_codes + e, kv_pol);
        if (stores_vscale)
          vsc[u] = kv_detail::load_scale(v_scales, VT, row, n_kv_heads, D, kvh, seg * 8);
      } else {
        cp_async16(smem_u32(&v_s[r * kLanes + seg]), v_cache + e, kv_pol);
      }
    }
  }
  if constexpr (ROPE) {
    for (int i = threadIdx.x; i < D / 2; i += kThreads) cs[i] = rope_detail::rope_angle(pos, inv_freq.v[i]);
    __syncthreads();
  }
  pdl_wait_then_release();  // q and the new k, v come from the kernels before

  const bool has_new = new_row < n_rows && new_row % kRows == r0;  // this thread's row
  // 8-bit K: the new row's codes and scale, kept by the thread whose pass holds it.
  uint2 knew = make_uint2(0, 0);
  float knew_sc = 0.0f;
  if constexpr (!ROPE) {
    if (has_new) {  // written to the caches by the kernel before: read through L2, not L1
      const int64_t p = kv_detail::kv_row(blocks, pos);  // the new token's cache row
      const size_t e = (size_t)p * row_stride + head_elem;
      if constexpr (KQ) {
        knew = __ldcg(reinterpret_cast<const uint2*>(k_codes + e));
        knew_sc = KT == KvType::Q8_0
                      ? __half2float(__ldcg(static_cast<const __half*>(k_scales) +
                                            p * (n_kv_heads * D / kQ8Block) +
                                            (kvh * D + seg * 8) / kQ8Block))
                      : __ldcg(static_cast<const float*>(k_scales) + p * n_kv_heads + kvh);
      } else {
        knew_s[seg] = __ldcg(reinterpret_cast<const uint4*>(k_cache + e));
      }
      if constexpr (VQ) {
        v_s[new_row * kLanes + seg] = __ldcg(reinterpret_cast<const uint2*>(v_codes + e));
        if (stores_vscale)
          vs_s[new_row * kVScales + vscale_slot] =
              VT == KvType::Q8_0
                  ? __half2float(__ldcg(static_cast<const __half*>(v_scales) +
                                        p * (n_kv_heads * D / kQ8Block) +
                                        (kvh * D + seg * 8) / kQ8Block))
                  : __ldcg(static_cast<const float*>(v_scales) + p * n_kv_heads + kvh);
      } else {
        cp_async16(smem_u32(&v_s[new_row * kLanes + seg]), v_cache + e);
      }
    }
  }
  if constexpr (VQ) {
    if (stores_vscale) {
#pragma unroll
      for (int u = 0; u < kPasses; ++u) {
        const int r = u * kRows + r0;
        if (r < n_rows && r != new_row) vs_s[r * kVScales + vscale_slot] = vsc[u];
      }
    }
  }
  if constexpr (ROPE) {
    if (has_new) {
      // This thread's 8 dims of the new row: k rotated, v as is; both into the caches.
      const __half* kx = q + (size_t)n_heads * D + (size_t)kvh * D;
      const __half* vx = kx + (size_t)n_kv_heads * D;
      const uint4 kr = rotate8<D>(kx, seg * 8, cs);
      const uint4 vr = __ldcg(reinterpret_cast<const uint4*>(vx + seg * 8));
      knew_s[seg] = kr;
      v_s[new_row * kLanes + seg] = vr;
      if (zb == 0) {
        const size_t e = (size_t)kv_detail::kv_row(blocks, pos) * row_stride + head_elem;
        *reinterpret_cast<uint4*>(k_cache + e) = kr;
        *reinterpret_cast<uint4*>(v_cache + e) = vr;
      }
    }
    for (int i = threadIdx.x; i < nh * D / 8; i += kThreads) {
      const int g = i / kLanes, d0 = (i % kLanes) * 8;
      Half8 h;
      h.raw = rotate8<D>(q + (size_t)(h0 + g) * D, d0, cs);
      float f[8];
      to_float8(h, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) q_s[g * D + d0 + j] = f[j] * q_scale;
    }
  } else {
    for (int i = threadIdx.x; i < nh * D; i += kThreads)
      q_s[i] = __half2float(q[(size_t)h0 * D + i]) * q_scale;
  }
  cp_async_wait_all();
  __syncthreads();
  float* scores = buf;

  // 1. scores, in the log2 domain (q carries log2(e) / sqrt(D)).
  {
    float kf[kPasses][8];
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      if constexpr (KQ) {  // code * scale in fp32, as the reference reads a value
        const bool is_new = u * kRows + r0 == new_row;
        const float sc = is_new ? knew_sc : ksc[u];
        kv_detail::codes8_to_float(is_new ? knew : kraw[u], KT, kf[u]);
#pragma unroll
        for (int j = 0; j < 8; ++j) kf[u][j] *= sc;
      } else {
        Half8 h;
        h.raw = u * kRows + r0 == new_row ? knew_s[seg] : kraw[u];
        to_float8(h, kf[u]);
      }
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= nh) break;  // uniform over the block: the shuffles below stay convergent
      const float4 qa = *reinterpret_cast<const float4*>(&q_s[g * D + seg * 8]);
      const float4 qb = *reinterpret_cast<const float4*>(&q_s[g * D + seg * 8 + 4]);
      float dot[kPasses];
#pragma unroll
      for (int u = 0; u < kPasses; ++u) {
        dot[u] = qa.x * kf[u][0] + qa.y * kf[u][1] + qa.z * kf[u][2] + qa.w * kf[u][3] +
                 qb.x * kf[u][4] + qb.y * kf[u][5] + qb.z * kf[u][6] + qb.w * kf[u][7];
      }
#pragma unroll
      for (int o = kLanes / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int u = 0; u < kPasses; ++u) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
      }
      if (seg == 0) {
#pragma unroll
        for (int u = 0; u < kPasses; ++u) {
          const int r = u * kRows + r0;
          if (r < n_rows) scores[g * kChunk + r] = dot[u];
        }
      }
    }
  }
  __syncthreads();

  // 2. softmax statistics of the chunk, one warp per head.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = warp; g < nh; g += kThreads / 32) {
    float* s = scores + g * kChunk;
    float m = -INFINITY;
    for (int r = lane; r < n_rows; r += 32) m = fmaxf(m, s[r]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.0f;
    for (int r = lane; r < n_rows; r += 32) {
      const float p = exp2f(s[r] - m);
      s[r] = p;
      l += p;
    }
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
      float* ml = ws_ml + ((size_t)(h0 + g) * n_chunks_all + chunk) * 2;
      ml[0] = m;
      ml[1] = l;
    }
  }
  __syncthreads();

  // 3. o = sum_r p_r v_r: each thread its kPer outputs of head g over every row (rows
  //    split + kSplit * i with kSplit > 1), p from the scores and v from shared memory; no
  //    reduction across threads (kSplit > 1: one exchange through shared memory).
  {
    const int t = threadIdx.x % (kThreads / kSplit), split = threadIdx.x / (kThreads / kSplit);
    const int g = t * kPer / D, d0 = t * kPer % D;
    const __half* v_h = reinterpret_cast<const __half*>(v_s) + d0;
    const float* p_g = scores + g * kChunk;
    float acc[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
    if constexpr (VQ) {
      // The codes of row r, dims d0 .. d0 + kPer - 1 (inside one block of 32: kPer <= 16
      // divides D), and their scale, folded into p.
      const uint8_t* v_b = reinterpret_cast<const uint8_t*>(v_s) + d0;
      const float* vs_g = vs_s + (VT == KvType::Q8_0 ? d0 / kQ8Block : 0);
      if (g < nh) {
#pragma unroll 4
        for (int r = split; r < n_rows; r += kSplit) {
          const float pr = p_g[r] * vs_g[r * kVScales];
          const uint8_t* vr = v_b + r * D;
          if constexpr (kPer % 4 == 0) {
#pragma unroll
            for (int q4 = 0; q4 < kPer / 4; ++q4) {
              float vf[4];
              codes4_to_float(*reinterpret_cast<const uint32_t*>(vr + 4 * q4), VT, vf);
#pragma unroll
              for (int j = 0; j < 4; ++j) acc[4 * q4 + j] = fmaf(pr, vf[j], acc[4 * q4 + j]);
            }
          } else {
#pragma unroll
            for (int j = 0; j < kPer; ++j)
              acc[j] = fmaf(pr, kv_detail::code_to_float(vr[j], VT), acc[j]);
          }
        }
      }
    } else if (g < nh) {
#pragma unroll 4
      for (int r = split; r < n_rows; r += kSplit) {
        const float pr = p_g[r];
        const __half* vr = v_h + r * D;
        if constexpr (kPer >= 8) {
#pragma unroll
          for (int q8 = 0; q8 < kPer / 8; ++q8) {
            Half8 h;
            h.raw = *reinterpret_cast<const uint4*>(vr + 8 * q8);
            float vf[8];
            to_float8(h, vf);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[8 * q8 + j] = fmaf(pr, vf[j], acc[8 * q8 + j]);
          }
        } else if constexpr (kPer == 1) {
          acc[0] = fmaf(pr, __half2float(vr[0]), acc[0]);
        } else {
#pragma unroll
          for (int j = 0; j < kPer; j += 2) {
            const float2 vf = __half22float2(*reinterpret_cast<const __half2*>(vr + j));
            acc[j] = fmaf(pr, vf.x, acc[j]);
            acc[j + 1] = fmaf(pr, vf.y, acc[j + 1]);
          }
        }
      }
    }
    if constexpr (kSplit > 1) {
      __syncthreads();  // every read of the scores is done: buf takes the row splits' sums
      if (split > 0) buf[(split - 1) * kOuts + t] = acc[0];
      __syncthreads();
#pragma unroll
      for (int sp = 1; sp < kSplit; ++sp) acc[0] += buf[(sp - 1) * kOuts + t];
    }
    if (split == 0 && g < nh) {
      float* dst = ws_o + ((size_t)(h0 + g) * n_chunks_all + chunk) * D + d0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) dst[j] = acc[j];
    }
  }

  // 4. The last block of this head range to finish merges the live chunks of all its heads
  //    at once (a counter per head range; the last one resets it for the next step): no
  //    second kernel, no second launch.
  merge_if_last<D, GMAX, PASSES>(ws_o, ws_ml, counters, out, out_index, buf, h0, nh, n_ctx,
                                 sliding_window, n_chunks_all);
}

template <int D, int GMAX, int PASSES>
__device__ __forceinline__ void merge_if_last(const float* ws_o, const float* ws_ml,
                                              int* counters, __half* out,
                                              const int32_t* out_index, float* buf, int h0,
                                              int nh, int n_ctx, int sliding_window,
                                              int n_chunks_all) {
  __shared__ int is_last;
  // The barrier orders every thread's m, l and o before thread 0's count, whose release makes
  // them visible at GPU scope to the block that merges; its acquire (in that block) and the
  // second barrier order the merge's reads after every other block's count (the pattern of a
  // CUTLASS semaphore). It replaced a __threadfence in every thread before the count and one in
  // the merging block after it: the ordering now costs one atomic in one thread per block
  // (measured: docs/performance.md).
  __syncthreads();
  constexpr int kChunk = chunk_for(D, PASSES);
  const int c0 = window_start(n_ctx, sliding_window) / kChunk, c1 = (n_ctx - 1) / kChunk;
  if (threadIdx.x == 0) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(counters + h0)
                 : "memory");
    is_last = before + 1 == c1 - c0 + 1;
    if (is_last) counters[h0] = 0;
  }
  __syncthreads();
  if (!is_last) return;
  merge_heads<D, GMAX>(ws_o, ws_ml, h0, nh, c0, c1, n_chunks_all, out, out_index, buf);
}

// rows > 0: a batched step of that many rows (batch), each its own z range of the grid.
template <int D, int GMAX, bool ROPE, int PASSES, KvType KT, KvType VT>
void launch_split(const __half* q, const KvCacheDev& k, const KvCacheDev& v, const int* d_pos,
                  int ctx_bound, int sliding_window, int n_heads, int n_kv_heads,
                  const rope_detail::InvFreq& inv_freq, float* ws_o, float* ws_ml,
                  int* counters, __half* out, const int32_t* out_index, cudaStream_t stream,
                  BatchArgs batch, int rows) {
  const int group = n_heads / n_kv_heads;
  const int zblocks = (group + GMAX - 1) / GMAX;
  // log2(e) folded into the scale: the softmax then uses exp2f, one instruction.
  const float q_scale = 1.4426950408889634f / std::sqrt((float)D);
  if (rows == 0) {
    const dim3 grid(n_kv_heads, n_chunks(ctx_bound, D, PASSES), zblocks);
    launch_pdl(attention_split_kernel<D, GMAX, ROPE, PASSES, KT, VT, false>, grid,
               dim3(kThreads), 0, stream, q, k.data, v.data, (const void*)k.scales,
               (const void*)v.scales, k.blocks, d_pos, sliding_window, n_heads, n_kv_heads,
               group, q_scale, inv_freq, ws_o, ws_ml, counters, out, out_index, BatchArgs{});
    return;
  }
  // A batch of f16 caches runs the fused RoPE; the unfused f16 pair is not compiled batched.
  if constexpr (ROPE || KT != KvType::F16 || VT != KvType::F16) {
    batch.zblocks = zblocks;
    // grid.z holds at most 65,535: more rows (a large MQA group at one head per block) take
    // several launches.
    const int per_launch = 65535 / zblocks;
    for (int r0 = 0; r0 < rows; r0 += per_launch) {
      const int n = std::min(per_launch, rows - r0);
      BatchArgs part = batch;
      part.row0 = batch.row0 + r0;
      const dim3 grid(n_kv_heads, n_chunks(ctx_bound, D, PASSES), n * zblocks);
      launch_pdl(attention_split_kernel<D, GMAX, ROPE, PASSES, KT, VT, true>, grid,
                 dim3(kThreads), 0, stream, q, nullptr, nullptr, nullptr, nullptr, nullptr,
                 nullptr, sliding_window, n_heads, n_kv_heads, group, q_scale, inv_freq,
                 nullptr, nullptr, nullptr, out, nullptr, part);
    }
  } else {
    throw Error("attention_decode_batch: f16 caches run with the fused RoPE");
  }
}

// The chunk length of a grid (passes_for): the short or the long kernel of one configuration.
template <int D, int GMAX, bool ROPE, KvType KT, KvType VT, class... Args>
void launch_chunked(int passes, Args... args) {
  if (passes == kLongPasses)
    launch_split<D, GMAX, ROPE, kLongPasses, KT, VT>(args...);
  else
    launch_split<D, GMAX, ROPE, kShortPasses, KT, VT>(args...);
}

// The compiled configurations: head_dim 64 and 128; heads per block 1, 2, 4, as
// heads_per_block chooses (at 2, a group of 8 runs as four blocks and a group of 5 as 2 + 2 + 1;
// at 4, a group of 3 runs with one head idle; at 1, a block per query head); chunks of 4 or 8
// passes, as passes_for chooses; each pair of K and V cache types (the fused RoPE: f16 only).
template <int D, bool ROPE, KvType KT, KvType VT>
void dispatch_group(const __half* q, const KvCacheDev& k, const KvCacheDev& v, const int* d_pos,
                    int ctx_bound, int sliding_window, int n_heads, int n_kv_heads,
                    const rope_detail::InvFreq& inv_freq, float* ws_o, float* ws_ml,
                    int* counters, __half* out, const int32_t* out_index, cudaStream_t stream,
                    int forced_heads, BatchArgs batch, int rows) {
  const int passes = passes_for(ctx_bound);
#define KESTREL_ATTN_CALL(G)                                                                   \
  launch_chunked<D, G, ROPE, KT, VT>(passes, q, k, v, d_pos, ctx_bound, sliding_window,        \
                             n_heads, n_kv_heads, inv_freq, ws_o, ws_ml, counters, out,       \
                             out_index, stream, batch, rows)
  switch (heads_per_block(n_heads / n_kv_heads, D, ctx_bound, forced_heads)) {
    case 1: KESTREL_ATTN_CALL(1); break;
    case 2: KESTREL_ATTN_CALL(2); break;
    default: KESTREL_ATTN_CALL(kMaxGroup); break;
  }
#undef KESTREL_ATTN_CALL
}

// Both entry points: checks, then the split kernel (which merges in its last blocks).
// The compiled pairs of cache types: every pair without RoPE, f16 with it.
template <int D, bool ROPE, class... Args>
void dispatch_types(KvType kt, KvType vt, Args... args) {
  if constexpr (ROPE) {
    dispatch_group<D, true, KvType::F16, KvType::F16>(args...);
  } else {
#define KESTREL_ATTN_TYPES(K, V)                                                \
  if (kt == KvType::K && vt == KvType::V)                                       \
    return dispatch_group<D, false, KvType::K, KvType::V>(args...);
    KESTREL_KV_TYPE_PAIRS(KESTREL_ATTN_TYPES)
#undef KESTREL_ATTN_TYPES
    throw Error(std::string("attention_decode_kv: no kernel for a ") + kv_type_name(kt) +
                " K cache with a " + kv_type_name(vt) + " V cache");
  }
}

template <bool ROPE>
void attention_decode(const __half* q, const KvCacheDev& k, const KvCacheDev& v, const int* d_pos,
                      int max_ctx, int sliding_window, int n_heads, int n_kv_heads, int head_dim,
                      const rope_detail::InvFreq& inv_freq, float* workspace, __half* out,
                      const int32_t* out_index, cudaStream_t stream, int ctx_bound,
                      int heads_per_block, const char* who) {
  KESTREL_CHECK(n_kv_heads > 0 && n_heads > 0 && n_heads % n_kv_heads == 0,
                std::string(who) + ": n_heads " + std::to_string(n_heads) +
                    " is not a positive multiple of n_kv_heads " + std::to_string(n_kv_heads));
  KESTREL_CHECK(max_ctx > 0 && sliding_window >= 0,
                std::string(who) + ": bad max_ctx " + std::to_string(max_ctx) +
                    " or sliding_window " + std::to_string(sliding_window));
  if (ctx_bound == 0) ctx_bound = max_ctx;
  KESTREL_CHECK(ctx_bound > 0 && ctx_bound <= max_ctx,
                std::string(who) + ": ctx_bound " + std::to_string(ctx_bound) +
                    " outside [1, max_ctx " + std::to_string(max_ctx) + "]");
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(k.data) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v.data) % 16 == 0,
                std::string(who) + ": the K/V caches must be 16-byte aligned");
  for (const KvCacheDev* c : {&k, &v})
    KESTREL_CHECK(c->type == KvType::F16 || c->scales,
                  std::string(who) + ": a " + kv_type_name(c->type) + " cache without its scales");
  KESTREL_CHECK(k.blocks == v.blocks,
                std::string(who) + ": K and V of a paged cache must share one block table");
  KESTREL_CHECK(!ROPE || (k.type == KvType::F16 && v.type == KvType::F16),
                std::string(who) + ": the fused RoPE writes an f16 cache only");
  KESTREL_CHECK(!ROPE || reinterpret_cast<uintptr_t>(q) % 16 == 0,
                std::string(who) + ": the qkv row must be 16-byte aligned");
  KESTREL_CHECK(heads_per_block == 0 || heads_per_block == 1 || heads_per_block == 2 ||
                    heads_per_block == kMaxGroup,
                std::string(who) + ": heads_per_block must be 0, 1, 2 or 4, got " +
                    std::to_string(heads_per_block));
  float* ws_o = workspace;
  float* ws_ml = workspace + (size_t)n_heads * n_chunks(max_ctx, head_dim) * head_dim;
  int* counters =
      reinterpret_cast<int*>(ws_ml + (size_t)n_heads * n_chunks(max_ctx, head_dim) * 2);
  switch (head_dim) {
    case 64:
      dispatch_types<64, ROPE>(k.type, v.type, q, k, v, d_pos, ctx_bound, sliding_window,
                               n_heads, n_kv_heads, inv_freq, ws_o, ws_ml, counters, out,
                               out_index, stream, heads_per_block, BatchArgs{}, 0);
      break;
    case 128:
      dispatch_types<128, ROPE>(k.type, v.type, q, k, v, d_pos, ctx_bound, sliding_window,
                                n_heads, n_kv_heads, inv_freq, ws_o, ws_ml, counters, out,
                                out_index, stream, heads_per_block, BatchArgs{}, 0);
      break;
    default:
      throw Error(std::string(who) + ": head_dim " + std::to_string(head_dim) +
                  " is not compiled (supported: 64, 128)");
  }
}

}  // namespace

int attention_chunk_positions(int ctx_bound, int head_dim) {
  return chunk_for(head_dim, passes_for(ctx_bound));
}

// Workspace: o [n_heads][n_chunks][head_dim], (m, l) [n_heads][n_chunks][2] (fp32), then one
// int counter per query head (used by the first head of each block's range).
size_t attention_workspace_bytes(int max_ctx, int n_heads, int head_dim) {
  return (size_t)n_heads * n_chunks(max_ctx, head_dim) * (head_dim + 2) * sizeof(float) +
         (size_t)n_heads * sizeof(int);
}

void attention_workspace_reset(float* workspace, int max_ctx, int n_heads, int head_dim,
                               cudaStream_t stream) {
  const size_t counters =
      (size_t)n_heads * n_chunks(max_ctx, head_dim) * (head_dim + 2) * sizeof(float);
  KESTREL_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<char*>(workspace) + counters, 0,
                                     (size_t)n_heads * sizeof(int), stream));
}

void attention_decode_f16(const __half* q, const __half* k_cache, const __half* v_cache,
                          const int* d_pos, int max_ctx, int sliding_window, int n_heads,
                          int n_kv_heads, int head_dim, float* workspace, __half* out,
                          cudaStream_t stream, int ctx_bound, int heads_per_block) {
  // The caches are only read without RoPE.
  const KvCacheDev k{KvType::F16, const_cast<__half*>(k_cache), nullptr};
  const KvCacheDev v{KvType::F16, const_cast<__half*>(v_cache), nullptr};
  attention_decode<false>(q, k, v, d_pos, max_ctx, sliding_window, n_heads, n_kv_heads,
                          head_dim, rope_detail::InvFreq{}, workspace, out, nullptr, stream,
                          ctx_bound, heads_per_block, "attention_decode_f16");
}

void attention_decode_kv(const __half* q, const KvCacheDev& k, const KvCacheDev& v,
                         const int* d_pos, int max_ctx, int sliding_window, int n_heads,
                         int n_kv_heads, int head_dim, float* workspace, __half* out,
                         cudaStream_t stream, const int32_t* out_index, int ctx_bound,
                         int heads_per_block) {
  attention_decode<false>(q, k, v, d_pos, max_ctx, sliding_window, n_heads, n_kv_heads,
                          head_dim, rope_detail::InvFreq{}, workspace, out, out_index, stream,
                          ctx_bound, heads_per_block, "attention_decode_kv");
}

void attention_decode_rope_f16(const __half* qkv, const KvCacheDev& k, const KvCacheDev& v,
                               const int* d_pos, int max_ctx, int sliding_window, int n_heads,
                               int n_kv_heads, int head_dim, const RopeScaling& rope,
                               float* workspace, __half* out, cudaStream_t stream,
                               const int32_t* out_index, int ctx_bound,
                               int heads_per_block) {
  const rope_detail::InvFreq inv_freq =
      rope_detail::make_inv_freq("attention_decode_rope_f16", head_dim, rope);
  attention_decode<true>(qkv, k, v, d_pos, max_ctx, sliding_window, n_heads,
                         n_kv_heads, head_dim, inv_freq, workspace, out, out_index, stream,
                         ctx_bound, heads_per_block, "attention_decode_rope_f16");
}

void attention_decode_batch(const __half* qkv, int64_t q_stride, int B, const int* d_rows,
                            const int* d_pos, const KvBatchSeq* seqs, int layer,
                            KvCacheTypes types, bool rope_fused, int ctx_bound,
                            int sliding_window, int n_heads, int n_kv_heads, int head_dim,
                            const RopeScaling& rope, __half* out, int64_t out_stride,
                            cudaStream_t stream, int heads_per_block) {
  const char* who = "attention_decode_batch";
  KESTREL_CHECK(n_kv_heads > 0 && n_heads > 0 && n_heads % n_kv_heads == 0,
                std::string(who) + ": n_heads " + std::to_string(n_heads) +
                    " is not a positive multiple of n_kv_heads " + std::to_string(n_kv_heads));
  KESTREL_CHECK(B >= 1 && ctx_bound > 0 && sliding_window >= 0 && layer >= 0 && seqs && d_pos,
                std::string(who) + ": bad rows " + std::to_string(B) + ", ctx_bound " +
                    std::to_string(ctx_bound) + " or sliding_window " +
                    std::to_string(sliding_window));
  KESTREL_CHECK(rope_fused == (types.k == KvType::F16 && types.v == KvType::F16),
                std::string(who) + ": f16 caches run with the fused RoPE, 8-bit ones without");
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(qkv) % 16 == 0 && q_stride % 8 == 0,
                std::string(who) + ": the rows must be 16-byte aligned");
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(out) % 4 == 0 && out_stride % 2 == 0,
                std::string(who) + ": the output rows must be 4-byte aligned");
  KESTREL_CHECK(heads_per_block == 0 || heads_per_block == 1 || heads_per_block == 2 ||
                    heads_per_block == kMaxGroup,
                std::string(who) + ": heads_per_block must be 0, 1, 2 or 4, got " +
                    std::to_string(heads_per_block));
  BatchArgs batch;
  batch.seqs = seqs;
  batch.d_pos = d_pos;
  batch.rows = d_rows;
  batch.layer = layer;
  batch.q_stride = q_stride;
  batch.out_stride = out_stride;
  const KvCacheDev k{types.k, nullptr, nullptr, nullptr}, v{types.v, nullptr, nullptr, nullptr};
  const rope_detail::InvFreq inv_freq =
      rope_fused ? rope_detail::make_inv_freq(who, head_dim, rope) : rope_detail::InvFreq{};
  const auto run = [&](auto d, auto fused) {
    constexpr int D = decltype(d)::value;
    dispatch_types<D, decltype(fused)::value>(
        types.k, types.v, qkv, k, v, d_pos, ctx_bound, sliding_window, n_heads, n_kv_heads,
        inv_freq, (float*)nullptr, (float*)nullptr, (int*)nullptr, out, (const int32_t*)nullptr,
        stream, heads_per_block, batch, B);
  };
  switch (head_dim) {
    case 64:
      rope_fused ? run(std::integral_constant<int, 64>{}, std::true_type{})
                 : run(std::integral_constant<int, 64>{}, std::false_type{});
      break;
    case 128:
      rope_fused ? run(std::integral_constant<int, 128>{}, std::true_type{})
                 : run(std::integral_constant<int, 128>{}, std::false_type{});
      break;
    default:
      throw Error(std::string(who) + ": head_dim " + std::to_string(head_dim) +
                  " is not compiled (supported: 64, 128)");
  }
}

}  // namespace kestrel::cuda
