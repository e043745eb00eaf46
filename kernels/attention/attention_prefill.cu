// Causal prefill attention: flash-attention over the KV cache with WMMA tensor-core tiles.
//
// A block of 4 warps owns 64 consecutive queries of one head; each warp owns 16 of them. For
// every tile of 64 cached keys (from the first position any of the 64 queries may see up to the
// last query's own position):
//
//   K, V tile -> shared (16-byte loads, rows past the chunk zero-filled)
//   S  = Q K^T            per warp: 16 x 64, FP16 WMMA, FP32 accumulators -> shared
//   online softmax        2 lanes per row, 32 columns each: mask (causal, sliding window),
//                         running max m and sum l in FP32 registers, P = exp2(S' - m) -> FP16
//   O  = O * alpha + P V  per warp, 64 output columns at a time through the S band in shared
//
// O lives in shared memory in FP32 (WMMA does not expose which row an accumulator element
// belongs to, and the rescaling by alpha is per row). At the end O / l is written in FP16.
// Scores are scaled by log2(e) / sqrt(head_dim) so that exp2 replaces exp.
//
// Flops: 4 * head_dim per (query, key) pair; a causal 2048-token chunk of Llama-2-7B is
// ~34 GFLOP per layer. Blocks are issued heaviest first (the last query tiles see the most keys).
#include <mma.h>

#include <cmath>
#include <string>

#include "engine/error.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/common/cuda_utils.h"

namespace kestrel::cuda {
namespace {

using namespace nvcuda;

constexpr int kBQ = 64;  // queries per block
constexpr int kBK = 64;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

// Shared-memory layout for head dimension D. Row paddings keep WMMA's 32-byte alignment of
// every 16-row / 16-column fragment and spread rows over the banks.
template <int D>
struct Layout {
  static constexpr int LDH = D + 8;    // halves per Q / K / V row
  static constexpr int LDS = kBK + 4;  // floats per S row (also the PV partials)
  static constexpr int LDP = kBK + 8;  // halves per P row
  static constexpr int LDO = D + 4;    // floats per O row
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = q_off + size_t(kBQ) * LDH * 2;
  static constexpr size_t v_off = k_off + size_t(kBK) * LDH * 2;
  static constexpr size_t s_off = v_off + size_t(kBK) * LDH * 2;
  static constexpr size_t p_off = s_off + size_t(kBQ) * LDS * 4;
  static constexpr size_t o_off = p_off + size_t(kBQ) * LDP * 2;
  static constexpr size_t bytes = o_off + size_t(kBQ) * LDO * 4;
  static_assert(k_off % 128 == 0 && s_off % 128 == 0 && p_off % 128 == 0 && o_off % 128 == 0);
};

struct Params {
  const __half* q;
  int64_t q_stride;
  const __half* k;
  const __half* v;
  int pos0, T, window, group, kv_dim, out_stride;
  __half* out;
  float scale_log2;
};

template <int D>
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(const Params p) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + L::q_off);
  __half* Ks = reinterpret_cast<__half*>(smem + L::k_off);
  __half* Vs = reinterpret_cast<__half*>(smem + L::v_off);
  float* Ss = reinterpret_cast<float*>(smem + L::s_off);
  __half* Ps = reinterpret_cast<__half*>(smem + L::p_off);
  float* Os = reinterpret_cast<float*>(smem + L::o_off);
  constexpr int V8 = D / 8;  // 16-byte vectors per row

  const int tile = gridDim.x - 1 - blockIdx.x;  // heaviest tiles first
  const int h = blockIdx.y, g = h / p.group;
  const int t0 = tile * kBQ;
  const int rows = min(kBQ, p.T - t0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  for (int i = tid; i < kBQ * V8; i += kThreads) {
    const int r = i / V8, c = (i % V8) * 8;
    uint4 val = zero;
    if (r < rows)
      val = *reinterpret_cast<const uint4*>(p.q + (int64_t)(t0 + r) * p.q_stride + (int64_t)h * D + c);
    *reinterpret_cast<uint4*>(Qs + r * L::LDH + c) = val;
  }
  for (int i = tid; i < kBQ * L::LDO; i += kThreads) Os[i] = 0.0f;
  __syncthreads();

  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> qf[D / 16];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wmma::load_matrix_sync(qf[kk], Qs + warp * 16 * L::LDH + kk * 16, L::LDH);

  const int row = warp * 16 + (lane >> 1);  // this lane's query row in the block
  const int qpos = p.pos0 + t0 + row;
  const int hc = (lane & 1) * 32;           // its 32 of the tile's 64 columns
  float m_run = -INFINITY, l_run = 0.0f;

  const int hi = p.pos0 + t0 + rows - 1;  // the last key any query of the block sees
  const int lo = p.window > 0 ? max(0, p.pos0 + t0 + 1 - p.window) : 0;
  for (int kv0 = lo; kv0 <= hi; kv0 += kBK) {
    __syncthreads();  // every warp is done with the previous K, V tile
    for (int i = tid; i < kBK * V8; i += kThreads) {
      const int r = i / V8, c = (i % V8) * 8;
      const int kp = kv0 + r;
      uint4 kv = zero, vv = zero;
      if (kp <= hi) {
        const int64_t off = (int64_t)kp * p.kv_dim + (int64_t)g * D + c;
        kv = *reinterpret_cast<const uint4*>(p.k + off);
        vv = *reinterpret_cast<const uint4*>(p.v + off);
      }
      *reinterpret_cast<uint4*>(Ks + r * L::LDH + c) = kv;
      *reinterpret_cast<uint4*>(Vs + r * L::LDH + c) = vv;
    }
    __syncthreads();

    // S [16, 64] = Q_warp K^T
#pragma unroll
    for (int j = 0; j < kBK / 16; ++j) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
      wmma::fill_fragment(sf, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> kf;
        wmma::load_matrix_sync(kf, Ks + j * 16 * L::LDH + kk * 16, L::LDH);
        wmma::mma_sync(sf, qf[kk], kf, sf);
      }
      wmma::store_matrix_sync(Ss + warp * 16 * L::LDS + j * 16, sf, L::LDS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax over this tile's columns.
    const float* srow = Ss + row * L::LDS + hc;
    float sv[32];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int kp = kv0 + hc + c;
      const bool ok = kp <= qpos && (p.window <= 0 || kp > qpos - p.window);
      sv[c] = ok ? srow[c] * p.scale_log2 : -INFINITY;
      mx = fmaxf(mx, sv[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m_run, mx);
    const bool none = m_new == -INFINITY;  // nothing visible yet (window before this tile)
    const float alpha = none ? 1.0f : exp2f(m_run - m_new);
    float sum = 0.0f;
    __half* prow = Ps + row * L::LDP + hc;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const float e = none ? 0.0f : exp2f(sv[c] - m_new);
      sum += e;
      prow[c] = __float2half_rn(e);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l_run = l_run * alpha + sum;
    m_run = m_new;
    __syncwarp();

    // O = O * alpha + P V, 64 output columns at a time.
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> pf[kBK / 16];
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      wmma::load_matrix_sync(pf[kk], Ps + warp * 16 * L::LDP + kk * 16, L::LDP);
#pragma unroll
    for (int c0 = 0; c0 < D; c0 += 64) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
        wmma::fill_fragment(of, 0.0f);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> vf;
          wmma::load_matrix_sync(vf, Vs + kk * 16 * L::LDH + c0 + j * 16, L::LDH);
          wmma::mma_sync(of, pf[kk], vf, of);
        }
        wmma::store_matrix_sync(Ss + warp * 16 * L::LDS + j * 16, of, L::LDS, wmma::mem_row_major);
      }
      __syncwarp();
      float* orow = Os + row * L::LDO + c0 + hc;
      const float* trow = Ss + row * L::LDS + hc;
#pragma unroll
      for (int c = 0; c < 32; ++c) orow[c] = orow[c] * alpha + trow[c];
      __syncwarp();
    }
  }

  if (row < rows) {
    const float inv = 1.0f / l_run;
    const int c_begin = (lane & 1) * (D / 2);
    const float* orow = Os + row * L::LDO;
    __half* dst = p.out + (int64_t)(t0 + row) * p.out_stride + (int64_t)h * D;
#pragma unroll
    for (int c = c_begin; c < c_begin + D / 2; c += 8) {
      __align__(16) __half v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __float2half_rn(orow[c + i] * inv);
      *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

template <int D>
void launch(const Params& p, int n_heads, cudaStream_t stream) {
  static bool configured = false;  // the attribute is per function; setting it twice is harmless
  if (!configured) {
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel<D>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)Layout<D>::bytes));
    configured = true;
  }
  const dim3 grid((p.T + kBQ - 1) / kBQ, n_heads);
  attention_prefill_kernel<D><<<grid, kThreads, Layout<D>::bytes, stream>>>(p);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_prefill_f16(const __half* q, int64_t q_stride, const __half* k_cache,
                           const __half* v_cache, int pos0, int T, int sliding_window,
                           int n_heads, int n_kv_heads, int head_dim, __half* out,
                           cudaStream_t stream) {
  KESTREL_CHECK(head_dim == 64 || head_dim == 128,
                "attention_prefill_f16: head_dim " + std::to_string(head_dim) +
                    " is not supported (64 or 128)");
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                "attention_prefill_f16: n_heads " + std::to_string(n_heads) +
                    " is not a multiple of n_kv_heads " + std::to_string(n_kv_heads));
  KESTREL_CHECK(T >= 1 && pos0 >= 0 && n_heads <= 65535,
                "attention_prefill_f16: bad chunk T " + std::to_string(T) + " at position " +
                    std::to_string(pos0));
  KESTREL_CHECK(q_stride % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_cache) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0,
                "attention_prefill_f16: q, the caches and out must be 16-byte aligned and the q "
                "row stride a multiple of 8, got " + std::to_string(q_stride));
  Params p;
  p.q = q;
  p.q_stride = q_stride;
  p.k = k_cache;
  p.v = v_cache;
  p.pos0 = pos0;
  p.T = T;
  p.window = sliding_window;
  p.group = n_heads / n_kv_heads;
  p.kv_dim = n_kv_heads * head_dim;
  p.out_stride = n_heads * head_dim;
  p.out = out;
  p.scale_log2 = (float)(1.4426950408889634 / std::sqrt((double)head_dim));
  if (head_dim == 64)
    launch<64>(p, n_heads, stream);
  else
    launch<128>(p, n_heads, stream);
}

}  // namespace kestrel::cuda
