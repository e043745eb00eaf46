// RoPE + KV write into a cache of any type (kv_cache_cuda.h).
//
// One warp per head of a token's q|k|v row: warps 0 .. n_heads - 1 the q heads, then the
// n_kv_heads k heads, then the v heads; grid.y = token. A q or k head's lane owns the rotated
// pairs (i, i + D/2) for i = lane + 32 j, j < D / 64, so that after the rotation it holds one
// value of each block of 32 dims:
//
//   D = 64:   lane: dims lane (block 0), lane + 32 (block 1)              (pair i = lane)
//   D = 128:  lane: dims lane, lane + 32, lane + 64, lane + 96 (blocks 0-3) (pairs lane, lane + 32)
//
// so q8_0's amax of a block and fp8's of the head are warp reductions by shuffles, and the
// warp stores each block's 32 codes as 32 consecutive bytes. A v head's lane takes the same
// dims without rotating. The rotation is rope_detail::rotate_pair on rope_angle(pos,
// inv_freq[i]), the functions rope_kv_row calls: the fp16 q and k are bitwise those of
// rope_kv_write_rows_f16, and the cache's codes are rounded from them.
//
// Bytes: a token's q|k|v read and q|k written back (fp16), its K and V rows written in their
// types; a decode step's few KB, a prefill chunk's activations once more. The kernel exists to
// round the cache where it is written, not to stream. A paged cache's row is its block's
// (kv_detail::kv_row): a 4-byte read of the table per head written.
#include "kernels/attention/kv_cache_cuda.h"

#include <string>

#include "base/error.h"
#include "kernels/attention/kv_quant.cuh"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/pdl.cuh"
#include "kernels/rope/rope_kv.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8;  // heads per block

// Stores one head's values x[b] = dim lane + 32 b of position pos, KV head `head`, in the
// cache's type, at the position's row (kv_row: its block's, in a paged cache).
template <int D>
__device__ __forceinline__ void store_head(const KvCacheDev& c, const float (&x)[D / 32],
                                           const __half (&xh)[D / 32], int pos, int head,
                                           int n_kv_heads, int lane) {
  constexpr int NB = D / 32;
  const int64_t kv_dim = (int64_t)n_kv_heads * D;
  const int64_t row = kv_detail::kv_row(c.blocks, pos);
  const int64_t e0 = row * kv_dim + (int64_t)head * D;
  switch (c.type) {
    case KvType::F16: {
      __half* dst = static_cast<__half*>(c.data) + e0;
#pragma unroll
      for (int b = 0; b < NB; ++b) dst[lane + 32 * b] = xh[b];
      break;
    }
    case KvType::Q8_0:
      kv_detail::quantize_head_q8_0<NB>(
          x, static_cast<int8_t*>(c.data) + e0,
          static_cast<__half*>(c.scales) + (row * kv_dim + (int64_t)head * D) / kQ8Block, lane);
      break;
    case KvType::Fp8:
      kv_detail::quantize_head_fp8<NB>(x, static_cast<uint8_t*>(c.data) + e0,
                                       static_cast<float*>(c.scales) + row * n_kv_heads + head,
                                       lane);
      break;
  }
}

// seqs (a batched decode step, rope_kv_write_batch): token t is the new row of sequence
// seqs[t], at position d_pos0[t], into that sequence's caches of layer `layer` (k and v give
// only the types); else every token writes into k and v at position *d_pos0 (or pos0) + t.
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    rope_kv_write_kv_kernel(__half* qkv, int64_t row_stride, int pos0,
                            const int* __restrict__ d_pos0, KvCacheDev k, KvCacheDev v,
                            int n_heads, int n_kv_heads, const rope_detail::InvFreq inv_freq,
                            const KvBatchSeq* __restrict__ seqs, int layer) {
  constexpr int H = D / 2, NB = D / 32, NP = D / 64;  // pairs per lane: NP
  pdl_wait_then_release();  // qkv comes from the GEMM or GEMV before
  const int head = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (head >= n_heads + 2 * n_kv_heads) return;  // the whole warp
  const int token = blockIdx.y;
  int pos;
  if (seqs) {
    const KvBatchSeq& sq = seqs[token];
    k = sq.k_layer(k.type, layer);
    v = sq.v_layer(v.type, layer);
    pos = __ldg(d_pos0 + token);
  } else {
    pos = (d_pos0 ? __ldg(d_pos0) : pos0) + token;
  }
  __half* xh = qkv + (int64_t)token * row_stride + (int64_t)head * D;
  float x[NB];
  __half h[NB];
  if (head < n_heads + n_kv_heads) {  // q or k: rotate in place
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const int i = lane + 32 * j;
      __half y1, y2;
      rope_detail::rotate_pair(xh[i], xh[i + H], rope_detail::rope_angle(pos, inv_freq.v[i]), y1,
                               y2);
      xh[i] = y1;
      xh[i + H] = y2;
      h[j] = y1;           // dim i:     block j
      h[j + NP] = y2;      // dim i + H: block j + H / 32
    }
    if (head < n_heads) return;
  } else {
#pragma unroll
    for (int b = 0; b < NB; ++b) h[b] = xh[lane + 32 * b];
  }
#pragma unroll
  for (int b = 0; b < NB; ++b) x[b] = __half2float(h[b]);
  if (head < n_heads + n_kv_heads)
    store_head<D>(k, x, h, pos, head - n_heads, n_kv_heads, lane);
  else
    store_head<D>(v, x, h, pos, head - n_heads - n_kv_heads, n_kv_heads, lane);
}

}  // namespace

namespace {

// Both entry points: the checks of their shapes, then the launch over `rows` rows (grid.y).
void launch_write(const char* who, __half* qkv, int64_t row_stride, int rows, int pos0,
                  const int* d_pos, const KvCacheDev& k, const KvCacheDev& v, int n_heads,
                  int n_kv_heads, int head_dim, const RopeScaling& rope, const KvBatchSeq* seqs,
                  int layer, cudaStream_t stream) {
  const std::string w(who);
  const rope_detail::InvFreq inv_freq = rope_detail::make_inv_freq(who, head_dim, rope);
  KESTREL_CHECK(head_dim == 64 || head_dim == 128,
                w + ": head_dim " + std::to_string(head_dim) +
                    " is not compiled (supported: 64, 128)");
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0 && rows >= 1 && rows <= 65535 && pos0 >= 0 &&
                    layer >= 0,
                w + ": bad sizes n_heads " + std::to_string(n_heads) + ", n_kv_heads " +
                    std::to_string(n_kv_heads) + ", rows " + std::to_string(rows) + ", pos0 " +
                    std::to_string(pos0) + ", layer " + std::to_string(layer));
  KESTREL_CHECK(row_stride >= (int64_t)(n_heads + 2 * n_kv_heads) * head_dim,
                w + ": row stride " + std::to_string(row_stride) + " is shorter than q|k|v");
  const dim3 grid((n_heads + 2 * n_kv_heads + kWarps - 1) / kWarps, rows);
  const auto kernel = head_dim == 64 ? rope_kv_write_kv_kernel<64> : rope_kv_write_kv_kernel<128>;
  launch_pdl(kernel, grid, dim3(kWarps * 32), 0, stream, qkv, row_stride, pos0, d_pos, k, v,
             n_heads, n_kv_heads, inv_freq, seqs, layer);
}

}  // namespace

void rope_kv_write_rows_kv(__half* qkv, int64_t row_stride, int T, int pos0, const KvCacheDev& k,
                           const KvCacheDev& v, int n_heads, int n_kv_heads, int head_dim,
                           const RopeScaling& rope, cudaStream_t stream, const int* d_pos0) {
  for (const KvCacheDev* c : {&k, &v})
    KESTREL_CHECK(c->data && (c->type == KvType::F16 || c->scales),
                  std::string("rope_kv_write_rows_kv: a ") + kv_type_name(c->type) +
                      " cache without its " + (c->data ? "scales" : "data"));
  launch_write("rope_kv_write_rows_kv", qkv, row_stride, T, pos0, d_pos0, k, v, n_heads,
               n_kv_heads, head_dim, rope, nullptr, 0, stream);
}

void rope_kv_write_batch(__half* qkv, int64_t row_stride, int B, const int* d_pos,
                         const KvBatchSeq* seqs, int layer, KvCacheTypes types, int n_heads,
                         int n_kv_heads, int head_dim, const RopeScaling& rope,
                         cudaStream_t stream) {
  KESTREL_CHECK(seqs && d_pos, "rope_kv_write_batch: no sequences or positions");
  const KvCacheDev k{types.k, nullptr, nullptr, nullptr}, v{types.v, nullptr, nullptr, nullptr};
  launch_write("rope_kv_write_batch", qkv, row_stride, B, 0, d_pos, k, v, n_heads, n_kv_heads,
               head_dim, rope, seqs, layer, stream);
}

}  // namespace kestrel::cuda
