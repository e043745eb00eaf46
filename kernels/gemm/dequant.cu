// Dequantization of a repacked GPTQ weight (kernels/gemv/gemv.cu draws the layout) into a plain
// FP16 matrix [N, K] for the tensor-core GEMM, and the column gather of act-order inputs.
//
// One thread per (row, chunk): it loads the chunk's 16-byte plane(s) (consecutive threads read
// consecutive chunks of a row: coalesced), decodes the C codes with shifts by compile-time
// positions (every loop is unrolled, so the codes never leave registers) and writes 8 halves per
// 16-byte store. Bytes per 4-bit weight: 0.5 read + 2 written (+ scales); the 7B gate|up matrix
// (90 M weights) is ~230 MB of traffic, ~55 us at the H200's 4.2 TB/s.
//
// Value: w = (q - z) * s rounded once to fp16. q - z is an exact small integer and its float
// product with an fp16 scale is exact, so the single rounding equals the GEMV kernels' hmul2 for
// 4- and 8-bit, and equals dequantize_ref's float value rounded to fp16 for every width.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda {
namespace {

using gemv_detail::chunk_codes;
using gemv_detail::chunk_planes;
using gemv_detail::crumb_pos;
using gemv_detail::nibble_pos;

struct DequantParams {
  const uint4* codes;
  int64_t chunks;
  const __half* scales;   // [N][G]
  const uint8_t* zeros;   // [N][G] or nullptr
  int64_t G;
  int group_size;         // 0 = one group per row
  int zero_const, zero_offset;
  int64_t N, K;
  __half* out;            // [N, K]
};

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// Code i (0 <= i < chunk_codes(BITS), a compile-time constant after unrolling) of a chunk.
template <int BITS>
__device__ __forceinline__ int code_at(const uint4 (&v)[3], int i) {
  if constexpr (BITS == 4) {
    return (word_of(v[0], i / 8) >> nibble_pos(i % 8)) & 15u;
  } else if constexpr (BITS == 2) {
    return (word_of(v[0], i / 16) >> crumb_pos(i % 16)) & 3u;
  } else if constexpr (BITS == 8) {
    return (word_of(v[0], i / 4) >> (8 * (i % 4))) & 255u;
  } else {
    // 3-bit: unit u = i / 32 is word u of planes a, b, c. Codes 0..23 of the unit are 3-bit
    // values in nibble slots of a (0..7), b (8..15), c (16..23); code 24 + s is spread over
    // bit 3 of nibble slot s of a (bit 0), b (bit 1) and c (bit 2).
    const int u = i / 32, r = i % 32;
    if (r < 24) return (word_of(v[r / 8], u) >> nibble_pos(r % 8)) & 7u;
    const int pos = nibble_pos(r - 24) + 3;
    return ((word_of(v[0], u) >> pos) & 1u) | (((word_of(v[1], u) >> pos) & 1u) << 1) |
           (((word_of(v[2], u) >> pos) & 1u) << 2);
  }
}

template <int BITS>
__global__ void __launch_bounds__(256) dequant_kernel(const DequantParams p) {
  constexpr int C = chunk_codes(BITS);
  constexpr int P = chunk_planes(BITS);
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.N * p.chunks) return;
  const int64_t n = idx / p.chunks, c = idx % p.chunks;
  uint4 v[3];
#pragma unroll
  for (int pl = 0; pl < P; ++pl) v[pl] = p.codes[(n * P + pl) * p.chunks + c];
  const int64_t k_begin = c * C;
  __half* out_row = p.out + n * p.K;
  const bool vec = (p.K % 8) == 0;
#pragma unroll
  for (int e = 0; e < C / 8; ++e) {  // 8 codes at a time: one group, one 16-byte store
    const int64_t k0 = k_begin + 8 * e;
    if (k0 >= p.K) break;
    const int64_t g = p.group_size ? k0 / p.group_size : 0;
    const float s = __half2float(p.scales[n * p.G + g]);
    const int z = p.zeros ? (int)p.zeros[n * p.G + g] + p.zero_offset : p.zero_const;
    __align__(16) __half h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = __float2half_rn((float)(code_at<BITS>(v, 8 * e + i) - z) * s);
    if (vec && k0 + 8 <= p.K) {
      *reinterpret_cast<uint4*>(out_row + k0) = *reinterpret_cast<const uint4*>(h);
    } else {
      for (int i = 0; i < 8 && k0 + i < p.K; ++i) out_row[k0 + i] = h[i];
    }
  }
}

__global__ void gather_kernel(const __half* x, const int32_t* perm, int64_t M, int64_t K,
                              __half* out) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= M * K) return;
  const int64_t m = idx / K, j = idx % K;
  out[idx] = x[m * K + perm[j]];
}

}  // namespace

void dequantize_f16(const GemvWeight& w, __half* out, cudaStream_t s) {
  if (!w.device) throw Error("dequantize_f16: the weight is empty (not prepared, or freed)");
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0)
    throw Error("dequantize_f16: the output must be 16-byte aligned");
  DequantParams p{w.codes, w.chunks, w.scales, w.zeros, w.groups, w.group_size,
                  w.zero_const, w.zero_offset, w.N, w.K, out};
  const int64_t threads = w.N * w.chunks;
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  switch (w.bits) {
    case 2: dequant_kernel<2><<<blocks, 256, 0, s>>>(p); break;
    case 3: dequant_kernel<3><<<blocks, 256, 0, s>>>(p); break;
    case 4: dequant_kernel<4><<<blocks, 256, 0, s>>>(p); break;
    case 8: dequant_kernel<8><<<blocks, 256, 0, s>>>(p); break;
    default:
      throw Error("dequantize_f16: bits=" + std::to_string(w.bits) + " is not supported (2, 3, 4, 8)");
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void gather_columns_f16(const __half* x, const int32_t* perm, int64_t M, int64_t K, __half* out,
                        cudaStream_t s) {
  const int64_t n = M * K;
  if (n == 0) return;
  gather_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(x, perm, M, K, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
