// The end of a row step in the GEMV kernels: the lanes' partial sums reduced to one sum per
// row, and the row stored with the op after the GEMV fused in (Epilogue: the residual, read
// through an index or not, a bias, ReLU, the store through an output permutation, and the
// SiLU(gate) * up of a gate/up row pair). The quantized kernel chooses among these stores in its
// body (gemv_kernel.cuh), where it keeps the residual and the output index it loaded early.
// Device code: include from .cu files only.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/gemv/gemv_params.cuh"

namespace kestrel::cuda::gemv_detail {
namespace {

// Sums a row pair's partials over each group of kWidth lanes (32: the warp; 16: each half-warp
// of the half-warp kernels, holding a pair of its own). The first exchange leaves row 0 on the
// group's low half and row 1 on its high half, which then sum as one: at kWidth 32, 7 shuffles
// and 5 adds instead of 10 and 10, a shorter epilogue at the end of every row pair (measured:
// docs/gemv-notes.md). acc becomes the group's two sums; lane l < 64 / kWidth gets row l of
// the warp's step (group l / 2, row l % 2).
template <int kWidth>
__device__ __forceinline__ float sum_row_pairs(float (&acc)[2], int lane) {
  constexpr int kHalfWidth = kWidth / 2;
  const bool hi = lane & kHalfWidth;
  float v = hi ? acc[1] : acc[0];
  v += __shfl_xor_sync(0xFFFFFFFFu, hi ? acc[0] : acc[1], kHalfWidth);
#pragma unroll
  for (int off = kHalfWidth / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  const int first = lane & ~(kWidth - 1) & 31;  // the group's first lane
  acc[0] = __shfl_sync(0xFFFFFFFFu, v, first);
  acc[1] = __shfl_sync(0xFFFFFFFFu, v, first | kHalfWidth);
  if constexpr (kWidth == 32) return lane == 1 ? acc[1] : acc[0];
  return __shfl_sync(0xFFFFFFFFu, v, (kHalfWidth * lane) & 31);
}

// Sums each of a warp's R row partials over its 32 lanes (every lane gets every sum, in acc)
// and returns row `lane`'s sum to lanes 0 .. R-1, which store the rows. R = 2 is the quantized
// kernel's (at K = 4096 every step ends a row pair): sum_row_pairs.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&acc)[R], int lane) {
  if constexpr (R == 2) {
    return sum_row_pairs<32>(acc, lane);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
    float mine = acc[0];
#pragma unroll
    for (int r = 1; r < R; ++r)
      if (lane == r) mine = acc[r];
    return mine;
  }
}

// The residual and bias of row i as the epilogue adds them (the bias from a weight: read with
// ld.global.nc; the residual, written by the kernel before, with ld.global.cg).
__device__ __forceinline__ float residual_of(const KParams& p, int row) {
  float r = __half2float(
      __ldcg(p.epi.residual + (p.epi.res_index ? __ldg(p.epi.res_index + row) : row)));
  if (p.epi.bias) r += __half2float(__ldg(p.epi.bias + row));
  return r;
}
__device__ __forceinline__ __half finish(const KParams& p, float v) {
  return __float2half_rn(p.epi.relu ? fmaxf(v, 0.f) : v);
}
__device__ __forceinline__ void store_row(const KParams& p, int row, float v) {
  if (row >= p.N) return;
  if (p.epi.residual) v += residual_of(p, row);
  p.y[p.epi.y_index ? __ldg(p.epi.y_index + row) : row] = finish(p, v);
}
// The same with the residual (and bias) already loaded (r).
__device__ __forceinline__ void store_row_plus(const KParams& p, int row, float v, float r) {
  if (row < p.N) p.y[row] = finish(p, v + r);
}

// The SiLU-pair epilogue's output from its gate and up rows' sums: as the gate|up GEMV writing
// fp16 and a silu_mul staging of it compute it, both rounded to fp16, then fp32 math, one
// rounding.
__device__ __forceinline__ __half silu_pair_out(float gate, float up) {
  return __float2half_rn(silu_times(__half2float(__float2half_rn(gate)),
                                    __half2float(__float2half_rn(up))));
}

}  // namespace
}  // namespace kestrel::cuda::gemv_detail
