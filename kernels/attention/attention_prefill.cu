// Causal prefill attention: flash-attention over the KV cache on the tensor cores.
//
// Two kernels with the same contract (attention_prefill_cuda.h):
//
// Mma (the engine's): FlashAttention-2 in registers with mma.sync m16n8k16 (FP16 in, FP32
// accumulate). A block of 4 warps owns 64 consecutive queries of one head, each warp 16 rows.
// Q fragments stay in registers for the whole block; per tile of 64 cached keys:
//
//   K, V tile -> shared (cp.async, rows past the chunk zero-filled)
//   S  = Q K^T            16 x 64 per warp in registers (K fragments by ldmatrix)
//   online softmax        in registers: each thread holds 2 rows x 16 columns of S; row max
//                         and sum over the 4 threads of a quad by shuffles; FP32 m and l
//   O  = O * alpha + P V  P goes from the S accumulators straight into A fragments (the
//                         m16n8k16 accumulator layout of two n-tiles is the A layout of one
//                         k-step), V fragments by ldmatrix.trans; O [16, D] in registers
//
// Wmma (the first version, kept as a second implementation for the tests and the benchmark):
// the same tiling with WMMA fragments; S, P and O pass through shared memory, since WMMA does
// not say which row an accumulator element belongs to and the rescaling by alpha is per row.
// Slower than Mma by the shared-memory round trips (tools/bench_gemm prints both;
// docs/performance.md).
//
// 8-bit caches (kv_cache_cuda.h; Mma only): the K and V tiles are dequantized as they are
// staged, so the tensor cores see the same fp16 tiles as with an f16 cache and no fp16 copy of
// the cache exists outside one block's shared memory. A thread takes 8 dims of a row: one
// 8-byte load of codes and the scale of their block of 32 (q8_0, fp16) or head (fp8, fp32),
// then code * scale in fp32, rounded to fp16 into the tile:
//
//   global  row kp, head g:  | c0..c7 | c8..c15 | ... |       head_dim bytes
//   shared  tile row r:      | h0..h7 | h8..h15 | ... | pad |  (LD halves, as the f16 tile)
//
// The fp16 rounding of the dequantized value (2^-11 relative) is the f16 cache's own
// rounding of K and V; the rest of the arithmetic is unchanged. Loads are plain (not
// cp.async), all of a thread's rows issued before the first conversion.
//
// Paged caches (attention_prefill_kv with a block table): a tile's 64 positions are four
// blocks' worth, each key's row mapped as it is staged (kv_detail::kv_row; a tile starting
// inside a sliding window straddles five). The tile in shared memory is the same.
//
// Scores are scaled by log2(e) / sqrt(head_dim) so that exp2 replaces exp. Flops: 4 * head_dim
// per (query, key) pair; a causal 2048-token chunk of Llama-2-7B is ~34 GFLOP per layer. Blocks
// are issued heaviest first (the last query tiles see the most keys).
#include <mma.h>

#include <cmath>
#include <string>

#include "base/error.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/attention/kv_quant.cuh"
#include "kernels/common/cp_async.cuh"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/dynamic_smem.h"
#include "kernels/common/half8.cuh"

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
  const void* k_scales;  // 8-bit caches (attention_prefill_kv): k and v hold codes
  const void* v_scales;
  const int32_t* blocks;  // paged caches (attention_prefill_kv): K's and V's block table
  int pos0, T, window, group, kv_dim, n_kv_heads, out_stride;
  const int* d_pos0;  // where set, the first position is read from it (pos0 unused)
  __half* out;
  float scale_log2;
};

__device__ __forceinline__ int first_position(const Params& p) {
  return p.d_pos0 ? __ldg(p.d_pos0) : p.pos0;
}

// ---- Wmma kernel -----------------------------------------------------------------------------

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
  const int pos0 = first_position(p);
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
  const int qpos = pos0 + t0 + row;
  const int hc = (lane & 1) * 32;           // its 32 of the tile's 64 columns
  float m_run = -INFINITY, l_run = 0.0f;

  const int hi = pos0 + t0 + rows - 1;  // the last key any query of the block sees
  const int lo = p.window > 0 ? max(0, pos0 + t0 + 1 - p.window) : 0;
  for (int kv0 = lo; kv0 <= hi; kv0 += kBK) {
    __syncthreads();  // every warp is done with the previous K, V tile
    for (int i = tid; i < kBK * V8; i += kThreads) {
      const int r = i / V8, c = (i % V8) * 8;
      const int kp = kv0 + r;
      uint4 kv = zero, vv = zero;
      if (kp <= hi) {
        const int64_t off = kv_detail::kv_row(p.blocks, kp) * p.kv_dim + (int64_t)g * D + c;
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


// ---- Mma kernel ------------------------------------------------------------------------------

template <int D>
struct MmaLayout {
  static constexpr int LD = D + 8;  // halves per row: 16-byte aligned, ldmatrix conflict-free
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = q_off + size_t(kBQ) * LD * 2;
  static constexpr size_t v_off = k_off + size_t(kBK) * LD * 2;
  static constexpr size_t bytes = v_off + size_t(kBK) * LD * 2;
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// c += a b: a 16x16 (row), b 16x8 (col), c 16x8 FP32. Thread (g = lane / 4, t = lane % 4) holds
// a: (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); b: (2t.., g), (2t+8.., g);
// c: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof u);
  return u;
}

// Copies positions [kv0, kv0 + 64) of a cache (this block's KV head; each at its row, kv_row)
// into a shared tile; positions past `hi` are zero-filled (never visible, and never
// uninitialised).
template <int D>
__device__ __forceinline__ void load_tile(__half* tile, const __half* cache,
                                          const int32_t* blocks, int kv0, int hi,
                                          int64_t kv_dim, int g, int tid) {
  constexpr int V8 = D / 8, LD = MmaLayout<D>::LD;
  for (int i = tid; i < kBK * V8; i += kThreads) {
    const int r = i / V8, c = (i % V8) * 8;
    const int kp = kv0 + r;
    if (kp <= hi)
      cp_async16(smem_u32(tile + r * LD + c),
                 cache + kv_detail::kv_row(blocks, kp) * kv_dim + (int64_t)g * D + c);
    else
      *reinterpret_cast<uint4*>(tile + r * LD + c) = make_uint4(0, 0, 0, 0);
  }
}

// load_tile for a cache of type T: f16 by cp.async (the caller waits), 8-bit codes dequantized
// into the fp16 tile (plain loads, every row of the thread's before the first conversion).
template <int D, KvType T>
__device__ __forceinline__ void load_tile_kv(__half* tile, const void* cache, const void* scales,
                                             const int32_t* blocks, int kv0, int hi,
                                             int64_t kv_dim, int n_kv_heads, int g, int tid) {
  if constexpr (T == KvType::F16) {
    load_tile<D>(tile, static_cast<const __half*>(cache), blocks, kv0, hi, kv_dim, g, tid);
  } else {
    constexpr int V8 = D / 8, LD = MmaLayout<D>::LD, kPer = kBK * V8 / kThreads;
    static_assert(kBK * V8 % kThreads == 0, "whole pieces per thread");
    const uint8_t* codes = static_cast<const uint8_t*>(cache);
    uint2 raw[kPer];
    float sc[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = tid + j * kThreads, r = i / V8, c = (i % V8) * 8, kp = kv0 + r;
      raw[j] = make_uint2(0, 0);
      sc[j] = 0.0f;
      if (kp <= hi) {
        const int64_t row = kv_detail::kv_row(blocks, kp);
        raw[j] = __ldg(reinterpret_cast<const uint2*>(codes + row * kv_dim + (int64_t)g * D + c));
        sc[j] = kv_detail::load_scale(scales, T, row, n_kv_heads, D, g, c);
      }
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = tid + j * kThreads, r = i / V8, c = (i % V8) * 8;
      float f[8];
      kv_detail::codes8_to_float(raw[j], T, f);  // rows past hi: codes 0, scale 0 -> zeros
      Half8 h;
#pragma unroll
      for (int e = 0; e < 4; ++e) h.h2[e] = __floats2half2_rn(f[2 * e] * sc[j], f[2 * e + 1] * sc[j]);
      *reinterpret_cast<uint4*>(tile + r * LD + c) = h.raw;
    }
  }
}

template <int D, KvType KT = KvType::F16, KvType VT = KvType::F16>
__global__ void __launch_bounds__(kThreads) attention_prefill_mma_kernel(const Params p) {
  using L = MmaLayout<D>;
  constexpr int LD = L::LD, V8 = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + L::q_off);
  __half* Ks = reinterpret_cast<__half*>(smem + L::k_off);
  __half* Vs = reinterpret_cast<__half*>(smem + L::v_off);

  const int tile = gridDim.x - 1 - blockIdx.x;  // heaviest tiles first
  const int h = blockIdx.y, g = h / p.group;
  const int t0 = tile * kBQ;
  const int rows = min(kBQ, p.T - t0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gq = lane >> 2, tq = lane & 3;
  const int pos0 = first_position(p);

  for (int i = tid; i < kBQ * V8; i += kThreads) {
    const int r = i / V8, c = (i % V8) * 8;
    if (r < rows)
      cp_async16(smem_u32(Qs + r * LD + c), p.q + (int64_t)(t0 + r) * p.q_stride + (int64_t)h * D + c);
    else
      *reinterpret_cast<uint4*>(Qs + r * LD + c) = make_uint4(0, 0, 0, 0);
  }
  cp_async_wait_all();
  __syncthreads();

  // Q fragments of the warp's 16 rows: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15).
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int r = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
    ldmatrix_x4(qf[kk], smem_u32(Qs + r * LD + kk * 16 + 8 * (lane / 16)));
  }

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const int qpos[2] = {pos0 + t0 + warp * 16 + gq, pos0 + t0 + warp * 16 + gq + 8};

  const int hi = pos0 + t0 + rows - 1;  // the last key any query of the block sees
  const int lo = p.window > 0 ? max(0, pos0 + t0 + 1 - p.window) : 0;
  for (int kv0 = lo; kv0 <= hi; kv0 += kBK) {
    __syncthreads();  // every warp is done with the previous K, V tile
    load_tile_kv<D, KT>(Ks, p.k, p.k_scales, p.blocks, kv0, hi, p.kv_dim, p.n_kv_heads, g, tid);
    load_tile_kv<D, VT>(Vs, p.v, p.v_scales, p.blocks, kv0, hi, p.kv_dim, p.n_kv_heads, g, tid);
    cp_async_wait_all();
    __syncthreads();

    // S [16, 64] = Q K^T: 8 n-tiles of 8 keys; one ldmatrix.x4 feeds two n-tiles.
    float s[kBK / 8][4];
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBK / 16; ++np) {
        uint32_t b[4];
        const int key = np * 16 + (lane % 8) + 8 * (lane / 16);
        ldmatrix_x4(b, smem_u32(Ks + key * LD + kk * 16 + 8 * ((lane / 8) % 2)));
        mma16816(s[2 * np], qf[kk], b[0], b[1]);
        mma16816(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }

    // Mask and online softmax; element e of n-tile j is row gq (+8 for e >= 2), key 8j+2tq+(e&1).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kv0 + 8 * j + 2 * tq + (e & 1);
        const int qp = qpos[e >> 1];
        const bool ok = key <= qp && (p.window <= 0 || key > qp - p.window);
        s[j][e] = ok ? s[j][e] * p.scale_log2 : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    float alpha[2], m_new[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      m_new[r] = fmaxf(m_run[r], mx[r]);
      // Nothing visible yet (a sliding window before this tile): keep O, add nothing.
      alpha[r] = m_new[r] == -INFINITY ? 1.0f : exp2f(m_run[r] - m_new[r]);
    }
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float pe = m_new[r] == -INFINITY ? 0.0f : exp2f(s[j][e] - m_new[r]);
        s[j][e] = pe;
        sum[r] += pe;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      l_run[r] = l_run[r] * alpha[r] + sum[r];
      m_run[r] = m_new[r];
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }

    // O += P V: k-step kk2 covers keys 16kk2 .. +15 = n-tiles 2kk2 and 2kk2+1 of S.
#pragma unroll
    for (int kk2 = 0; kk2 < kBK / 16; ++kk2) {
      uint32_t a[4];
      a[0] = pack_half2(s[2 * kk2][0], s[2 * kk2][1]);
      a[1] = pack_half2(s[2 * kk2][2], s[2 * kk2][3]);
      a[2] = pack_half2(s[2 * kk2 + 1][0], s[2 * kk2 + 1][1]);
      a[3] = pack_half2(s[2 * kk2 + 1][2], s[2 * kk2 + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        const int key = kk2 * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
        ldmatrix_x4_trans(b, smem_u32(Vs + key * LD + dp * 16 + 8 * (lane / 16)));
        mma16816(o[2 * dp], a, b[0], b[1]);
        mma16816(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + gq + 8 * r;
    if (row >= rows) continue;
    const float inv = 1.0f / l_run[r];
    __half* dst = p.out + (int64_t)(t0 + row) * p.out_stride + (int64_t)h * D + 2 * tq;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<__half2*>(dst + 8 * j) =
          __floats2half2_rn(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
  }
}

// The Mma kernel over a K cache of type KT and a V cache of type VT.
template <int D, KvType KT, KvType VT>
void launch_kv(const Params& p, int n_heads, cudaStream_t stream) {
  const dim3 grid((p.T + kBQ - 1) / kBQ, n_heads);
  ensure_dynamic_smem(attention_prefill_mma_kernel<D, KT, VT>, MmaLayout<D>::bytes,
                      "attention_prefill_kv");
  attention_prefill_mma_kernel<D, KT, VT><<<grid, kThreads, MmaLayout<D>::bytes, stream>>>(p);
  KESTREL_CUDA_CHECK_LAUNCH();
}

// Every pair of compiled cache types.
template <int D>
void dispatch_kv(const Params& p, KvType kt, KvType vt, int n_heads, cudaStream_t stream) {
#define KESTREL_PREFILL_TYPES(K, V)                   \
  if (kt == KvType::K && vt == KvType::V)             \
    return launch_kv<D, KvType::K, KvType::V>(p, n_heads, stream);
  KESTREL_KV_TYPE_PAIRS(KESTREL_PREFILL_TYPES)
#undef KESTREL_PREFILL_TYPES
  throw Error(std::string("attention_prefill_kv: no kernel for a ") + kv_type_name(kt) +
              " K cache with a " + kv_type_name(vt) + " V cache");
}

template <int D>
void launch(const Params& p, int n_heads, PrefillAttnKernel kernel, cudaStream_t stream) {
  const dim3 grid((p.T + kBQ - 1) / kBQ, n_heads);
  if (kernel == PrefillAttnKernel::Mma) {
    ensure_dynamic_smem(attention_prefill_mma_kernel<D>, MmaLayout<D>::bytes,
                        "attention_prefill_f16");
    attention_prefill_mma_kernel<D><<<grid, kThreads, MmaLayout<D>::bytes, stream>>>(p);
  } else {
    ensure_dynamic_smem(attention_prefill_kernel<D>, Layout<D>::bytes, "attention_prefill_f16");
    attention_prefill_kernel<D><<<grid, kThreads, Layout<D>::bytes, stream>>>(p);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

namespace {

// The checks and parameters both entry points share; `who` names the entry point.
Params make_params(const char* who_c, const __half* q, int64_t q_stride, const void* k_cache,
                   const void* v_cache, int pos0, int T, int sliding_window, int n_heads,
                   int n_kv_heads, int head_dim, __half* out, const int* d_pos0) {
  const std::string who = who_c;
  KESTREL_CHECK(head_dim == 64 || head_dim == 128,
                who + ": head_dim " + std::to_string(head_dim) + " is not supported (64 or 128)");
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                who + ": n_heads " + std::to_string(n_heads) +
                    " is not a multiple of n_kv_heads " + std::to_string(n_kv_heads));
  KESTREL_CHECK(T >= 1 && pos0 >= 0 && n_heads <= 65535,
                who + ": bad chunk T " + std::to_string(T) + " at position " +
                    std::to_string(pos0));
  KESTREL_CHECK(q_stride % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_cache) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0,
                who + ": q, the caches and out must be 16-byte aligned and the q "
                "row stride a multiple of 8, got " + std::to_string(q_stride));
  Params p{};
  p.q = q;
  p.q_stride = q_stride;
  p.k = static_cast<const __half*>(k_cache);
  p.v = static_cast<const __half*>(v_cache);
  p.n_kv_heads = n_kv_heads;
  p.pos0 = pos0;
  p.d_pos0 = d_pos0;
  p.T = T;
  p.window = sliding_window;
  p.group = n_heads / n_kv_heads;
  p.kv_dim = n_kv_heads * head_dim;
  p.out_stride = n_heads * head_dim;
  p.out = out;
  p.scale_log2 = (float)(1.4426950408889634 / std::sqrt((double)head_dim));
  return p;
}

}  // namespace

void attention_prefill_f16(const __half* q, int64_t q_stride, const __half* k_cache,
                           const __half* v_cache, int pos0, int T, int sliding_window,
                           int n_heads, int n_kv_heads, int head_dim, __half* out,
                           cudaStream_t stream, PrefillAttnKernel kernel,
                           const int* d_pos0) {
  const Params p = make_params("attention_prefill_f16", q, q_stride, k_cache, v_cache, pos0, T,
                               sliding_window, n_heads, n_kv_heads, head_dim, out, d_pos0);
  if (head_dim == 64)
    launch<64>(p, n_heads, kernel, stream);
  else
    launch<128>(p, n_heads, kernel, stream);
}

void attention_prefill_kv(const __half* q, int64_t q_stride, const KvCacheDev& k,
                          const KvCacheDev& v, int pos0, int T, int sliding_window, int n_heads,
                          int n_kv_heads, int head_dim, __half* out, cudaStream_t stream,
                          const int* d_pos0) {
  for (const KvCacheDev* c : {&k, &v})
    KESTREL_CHECK(c->type == KvType::F16 || c->scales,
                  std::string("attention_prefill_kv: a ") + kv_type_name(c->type) +
                      " cache without its scales");
  KESTREL_CHECK(k.blocks == v.blocks,
                "attention_prefill_kv: K and V of a paged cache must share one block table");
  Params p = make_params("attention_prefill_kv", q, q_stride, k.data, v.data, pos0, T,
                         sliding_window, n_heads, n_kv_heads, head_dim, out, d_pos0);
  p.k_scales = k.scales;
  p.v_scales = v.scales;
  p.blocks = k.blocks;
  if (head_dim == 64)
    dispatch_kv<64>(p, k.type, v.type, n_heads, stream);
  else
    dispatch_kv<128>(p, k.type, v.type, n_heads, stream);
}

}  // namespace kestrel::cuda
