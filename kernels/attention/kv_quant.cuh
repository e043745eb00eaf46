// Device code of the KV cache (kv_cache_cuda.h): where a position's row lies (kv_row), and for
// the 8-bit types the rounding of a value when it is written and its reading back, the arithmetic of the reference (kv_quant_ref.cpp) operation
// for operation. Include from .cu files only.
//
// Writing (one warp per head, every lane holding one value of each block of 32 dims):
//   q8_0  scale = amax / 127 (fp32), inv = 1 / scale, code = roundf(x * inv) (halves away from
//         zero), scale stored as fp16 (round to nearest even)
//   fp8   scale = amax / 448 (fp32), code = e4m3(x / scale) rounded to nearest even and
//         saturated (cvt.rn.satfinite.e4m3x2.f32, sm_89 on)
// Every operation is an IEEE-rounded fp32 one (__fdiv_rn, __fmul_rn: the build never uses
// --use_fast_math, and the explicit intrinsics keep a contraction or an approximate
// reciprocal out), so the codes equal the reference's byte for byte.
//
// Reading: int8 and E4M3 codes are exact in fp16 and fp32 (cvt.rn.f16x2.e4m3x2 is exact: E4M3's
// 3 mantissa bits and exponents 2^-9 .. 2^8 lie inside fp16's); the value is code * scale in
// fp32, as the reference reads it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/attention/kv_quant.h"

namespace kestrel::cuda::kv_detail {

// The cache row that holds position p (KvCacheDev::blocks, KvLayerRef::row): p itself in a
// contiguous cache; in a paged one row blocks[p / 16] * 16 + p % 16 of the pool's rows, whose
// layout per row is a contiguous cache's. Every kernel that reads or writes K/V maps a
// position through here and nowhere else. A contiguous cache pays a select on a kernel
// argument that is the same over the whole grid; a paged row, one 4-byte load of the table,
// which the rows of its block share.
__device__ __forceinline__ int64_t kv_row(const int32_t* __restrict__ blocks, int pos) {
  static_assert(kKvBlock == 16, "the shifts below assume blocks of 16 positions");
  return blocks ? (int64_t)__ldg(blocks + (pos >> 4)) * kKvBlock + (pos & (kKvBlock - 1))
                : (int64_t)pos;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One head's vector, held by a warp as x[b] = dim lane + 32 b (NB = head_dim / 32 blocks),
// rounded into codes (byte lane + 32 b of the head's row) and scales (q8_0: NB fp16 at
// scales[0 .. NB); fp8: one float at scales[0]). Every lane of the warp calls it.
template <int NB>
__device__ __forceinline__ void quantize_head_q8_0(const float (&x)[NB], int8_t* codes,
                                                   __half* scales, int lane) {
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const float amax = warp_max(fabsf(x[b]));
    const float scale = __fdiv_rn(amax, 127.0f);
    const float inv = scale != 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    codes[lane + 32 * b] = (int8_t)(int)roundf(__fmul_rn(x[b], inv));
    if (lane == 0) scales[b] = __float2half_rn(scale);
  }
}

__device__ __forceinline__ uint8_t fp8_e4m3(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

template <int NB>
__device__ __forceinline__ void quantize_head_fp8(const float (&x)[NB], uint8_t* codes,
                                                  float* scale_out, int lane) {
  float amax = 0.0f;
#pragma unroll
  for (int b = 0; b < NB; ++b) amax = fmaxf(amax, fabsf(x[b]));
  amax = warp_max(amax);
  const float s = __fdiv_rn(amax, kFp8Max);
#pragma unroll
  for (int b = 0; b < NB; ++b) codes[lane + 32 * b] = s != 0.0f ? fp8_e4m3(__fdiv_rn(x[b], s)) : 0;
  if (lane == 0) *scale_out = s;
}

// ---- Reading: 8 consecutive codes (one 8-byte load) to fp32, unscaled

__device__ __forceinline__ void codes8_to_float(uint2 c, KvType t, float (&f)[8]) {
  const uint32_t w[2] = {c.x, c.y};
  if (t == KvType::Q8_0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = (float)(int8_t)(w[j / 4] >> (8 * (j % 4)));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half2_raw h =
          __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[j / 2] >> (16 * (j % 2))), __NV_E4M3);
      const float2 v = __half22float2(__half2(h));
      f[2 * j] = v.x;
      f[2 * j + 1] = v.y;
    }
  }
}

// One code to fp32, unscaled.
__device__ __forceinline__ float code_to_float(uint8_t c, KvType t) {
  if (t == KvType::Q8_0) return (float)(int8_t)c;
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3)));
}

// The scale of dims d .. of head `head` in cache row `row` (kv_row; d inside one block of 32).
__device__ __forceinline__ float load_scale(const void* scales, KvType t, int64_t row,
                                            int n_kv_heads, int head_dim, int head, int d) {
  if (t == KvType::Q8_0) {
    const int64_t per_row = (int64_t)n_kv_heads * head_dim / kQ8Block;
    return __half2float(
        __ldg(static_cast<const __half*>(scales) + row * per_row + (head * head_dim + d) / kQ8Block));
  }
  return __ldg(static_cast<const float*>(scales) + row * n_kv_heads + head);
}

}  // namespace kestrel::cuda::kv_detail

// Every (K type, V type) pair of cache types the attention kernels are compiled for: X(K, V)
// once per pair, so that the decode and prefill dispatches list the same nine.
#define KESTREL_KV_TYPE_PAIRS(X)                                                 \
  X(F16, F16) X(F16, Q8_0) X(F16, Fp8) X(Q8_0, F16) X(Q8_0, Q8_0) X(Q8_0, Fp8) \
  X(Fp8, F16) X(Fp8, Q8_0) X(Fp8, Fp8)
