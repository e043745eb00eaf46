// Dequantization of a repacked GPTQ weight (layout: kernels/gemv/weight_decode.cuh) into a plain
// FP16 matrix [N, K] for the tensor-core GEMM, and the column gather of act-order inputs.
//
// One thread per 8 consecutive codes of a row: it reads the 16-byte chunk plane(s) holding them
// (the 4 to 16 threads that share a chunk hit L1; the chunks of a warp fill whole sectors) and
// writes one 16-byte vector of 8 halves, so a warp's stores cover 512 contiguous bytes. Bytes
// per 4-bit weight: 0.5 read + 2 written (+ scales); the 7B gate|up matrix (90 M weights) is
// ~230 MB of traffic, ~55 us at 4.2 TB/s.
//
// Value: w = (q - z) * s rounded once to fp16, with no int/float conversions (they issue at a
// quarter of the ALU rate and held a first version well below the memory bandwidth:
// docs/performance.md): two codes are ORed into the mantissas of an fp16 pair 1024 + q
// (0x6400 | q, exact for q < 1024), minus the pair 1024 + z (exact) gives q - z exactly, and
// one hmul2 with the scale rounds the exact product once. That equals the GEMV kernels' value
// for 4- and 8-bit and dequantize_ref's float value rounded to fp16 for every width.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/bits.cuh"
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

__device__ __forceinline__ uint32_t plane_word(const uint4 (&v)[3], int pl, int u) {
  return pl == 0 ? word_of(v[0], u) : pl == 1 ? word_of(v[1], u) : word_of(v[2], u);
}

// The 8 codes of group e (codes 8e .. 8e+7) of a chunk, as 16-bit lanes 0x6400 | q packed in
// pairs: out[j] holds codes 2j (low half) and 2j+1 (high half).
template <int BITS>
__device__ __forceinline__ void codes8(const uint4 (&v)[3], int e, uint32_t (&out)[4]) {
  uint32_t q[8];
  if constexpr (BITS == 4) {
    // Word e holds codes 8e .. 8e+7; code i at bit nibble_pos(i).
    const uint32_t w = word_of(v[0], e);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (w >> nibble_pos(i)) & 15u;
  } else if constexpr (BITS == 2) {
    // Word e / 2 holds codes 16 (e / 2) ..; group e is its codes 8 (e % 2) .. + 7, whose
    // positions crumb_pos(8 (e % 2) + i) are crumb_pos(i) + 8 (e % 2).
    const uint32_t w = word_of(v[0], e >> 1) >> (8 * (e & 1));
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (w >> crumb_pos(i)) & 3u;
  } else if constexpr (BITS == 8) {
    const uint32_t w0 = word_of(v[0], 2 * e), w1 = word_of(v[0], 2 * e + 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[i] = (w0 >> (8 * i)) & 255u;
      q[4 + i] = (w1 >> (8 * i)) & 255u;
    }
  } else {
    // 3-bit: 32-code unit u = e / 4 is word u of planes a, b, c. Groups 0..2 of the unit are
    // 3-bit values in the nibble slots of plane (e % 4); group 3 (codes 24..31) is spread over
    // bit 3 of nibble slot i of a (bit 0), b (bit 1) and c (bit 2).
    const int u = e >> 2, sub = e & 3;
    if (sub < 3) {
      const uint32_t w = plane_word(v, sub, u);
#pragma unroll
      for (int i = 0; i < 8; ++i) q[i] = (w >> nibble_pos(i)) & 7u;
    } else {
      const uint32_t a = word_of(v[0], u), b = word_of(v[1], u), c = word_of(v[2], u);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int pos = nibble_pos(i) + 3;
        q[i] = ((a >> pos) & 1u) | (((b >> pos) & 1u) << 1) | (((c >> pos) & 1u) << 2);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = (0x6400u | q[2 * j]) | ((0x6400u | q[2 * j + 1]) << 16);
}

template <int BITS>
__global__ void __launch_bounds__(256) dequant_kernel(const DequantParams p) {
  constexpr int C = chunk_codes(BITS);
  constexpr int P = chunk_planes(BITS);
  constexpr int E = C / 8;  // 8-code groups per chunk
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t per_row = p.chunks * E;
  if (idx >= p.N * per_row) return;
  const int64_t n = idx / per_row, r = idx % per_row;
  const int64_t c = r / E;
  const int e = (int)(r % E);
  const int64_t k0 = c * C + 8 * e;
  if (k0 >= p.K) return;
  uint4 v[3];
#pragma unroll
  for (int pl = 0; pl < P; ++pl)
    v[pl] = __ldg(p.codes + n * P * p.chunks + gemv_detail::chunk_index(BITS, p.chunks, c, pl));
  if constexpr (P == 1) v[1] = v[2] = v[0];

  const int64_t g = p.group_size ? k0 / p.group_size : 0;
  const __half s = p.scales[n * p.G + g];
  const uint32_t z = p.zeros ? (uint32_t)p.zeros[n * p.G + g] + p.zero_offset : (uint32_t)p.zero_const;
  const uint32_t mz = (0x6400u + z) * 0x00010001u;  // the pair 1024 + z, 1024 + z
  const __half2 s2 = __halves2half2(s, s);
  uint32_t pairs[4];
  codes8<BITS>(v, e, pairs);
  uint32_t o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = as_u32(__hmul2(__hsub2(as_h2(pairs[j]), as_h2(mz)), s2));
  __half* dst = p.out + n * p.K + k0;
  if ((p.K % 8) == 0 && k0 + 8 <= p.K) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (k0 + i < p.K) dst[i] = __ushort_as_half((unsigned short)(o[i / 2] >> (16 * (i % 2))));
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

void dequantize_f16(const GemvWeight& w, __half* out, size_t out_elems, cudaStream_t s) {
  if (!w.device) throw Error("dequantize_f16: the weight is empty (not prepared, or freed)");
  const size_t need = (size_t)w.N * (size_t)w.K;
  if (!out || out_elems < need)
    throw Error("dequantize_f16: the output holds " + std::to_string(out ? out_elems : 0) +
                " halves, the weight [" + std::to_string(w.N) + ", " + std::to_string(w.K) +
                "] needs " + std::to_string(need));
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0)
    throw Error("dequantize_f16: the output must be 16-byte aligned");
  DequantParams p{w.codes, w.chunks, w.scales, w.zeros, w.groups, w.group_size,
                  w.zero_const, w.zero_offset, w.N, w.K, out};
  const int64_t threads = w.N * w.chunks * (chunk_codes(w.bits) / 8);
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
