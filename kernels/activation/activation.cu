// FP16 silu(gate) * up over the fused gate/up GEMV output: one thread per 8 elements (one
// 16-byte load of gate, one of up, one store) when inter % 8 == 0 and the pointers are 16-byte
// aligned, else one per element. Reads 4 * inter bytes and writes 2 * inter per row.
#include "kernels/activation/activation_cuda.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/half8.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float silu_times(float g, float u) {
  // For very negative g, expf(-g) is inf and g / inf is -0: the limit, as silu_mul_ref.
  return g / (1.0f + expf(-g)) * u;
}

// Each element is read and written by the same thread, so out may alias gate_up.
template <bool kVec>
__global__ void silu_mul_kernel(const __half* gate_up, int inter, __half* out) {
  const __half* gate = gate_up + (size_t)blockIdx.y * 2 * inter;
  const __half* up = gate + inter;
  __half* o = out + (size_t)blockIdx.y * inter;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if constexpr (kVec) {
    if (i >= inter / 8) return;
    Half8 g, u, y;
    g.raw = *reinterpret_cast<const uint4*>(gate + (size_t)i * 8);
    u.raw = *reinterpret_cast<const uint4*>(up + (size_t)i * 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = __half22float2(g.h2[j]), uf = __half22float2(u.h2[j]);
      y.h2[j] = __floats2half2_rn(silu_times(gf.x, uf.x), silu_times(gf.y, uf.y));
    }
    *reinterpret_cast<uint4*>(o + (size_t)i * 8) = y.raw;
  } else {
    if (i >= inter) return;
    o[i] = __float2half_rn(silu_times(__half2float(gate[i]), __half2float(up[i])));
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void silu_mul_rows_f16(const __half* gate_up, int rows, int inter, __half* out,
                       cudaStream_t stream) {
  KESTREL_CHECK(rows >= 0 && rows <= 65535 && inter > 0,
                "silu_mul_rows_f16: bad shape rows " + std::to_string(rows) + ", inter " +
                    std::to_string(inter));
  if (rows == 0) return;
  const bool vec = inter % 8 == 0 && aligned16(gate_up) && aligned16(out);
  const int items = vec ? inter / 8 : inter;
  const dim3 grid((items + kThreads - 1) / kThreads, rows);
  if (vec) {
    silu_mul_kernel<true><<<grid, kThreads, 0, stream>>>(gate_up, inter, out);
  } else {
    silu_mul_kernel<false><<<grid, kThreads, 0, stream>>>(gate_up, inter, out);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

namespace {

__global__ void broadcast_rows_kernel(const __half* v, int64_t n, __half* y, int64_t ldy) {
  __half* row = y + (int64_t)blockIdx.y * ldy;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    row[i] = v[i];
}

}  // namespace

void broadcast_rows_f16(const __half* v, int rows, int64_t n, __half* y, int64_t ldy,
                        cudaStream_t stream) {
  KESTREL_CHECK(rows >= 0 && rows <= 65535 && n > 0 && ldy >= n,
                "broadcast_rows_f16: bad shape rows " + std::to_string(rows) + ", n " +
                    std::to_string(n) + ", ldy " + std::to_string(ldy));
  if (rows == 0) return;
  const dim3 grid((unsigned)std::min<int64_t>((n + kThreads - 1) / kThreads, 64), rows);
  broadcast_rows_kernel<<<grid, kThreads, 0, stream>>>(v, n, y, ldy);
  KESTREL_CUDA_CHECK_LAUNCH();
}

namespace {

__global__ void add_rows_kernel(__half* y, int64_t ldy, const __half* v, int64_t n) {
  __half* row = y + (int64_t)blockIdx.y * ldy;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    row[i] = __float2half_rn(__half2float(row[i]) + __half2float(v[i]));
}

__global__ void relu_kernel(__half* x, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    x[i] = __hgt(x[i], __float2half(0.0f)) ? x[i] : __float2half(0.0f);
}

}  // namespace

void add_rows_f16(__half* y, int64_t ldy, const __half* v, int rows, int64_t n,
                  cudaStream_t stream) {
  KESTREL_CHECK(rows >= 0 && rows <= 65535 && n > 0 && ldy >= n,
                "add_rows_f16: bad shape rows " + std::to_string(rows) + ", n " +
                    std::to_string(n) + ", ldy " + std::to_string(ldy));
  if (rows == 0) return;
  const dim3 grid((unsigned)std::min<int64_t>((n + kThreads - 1) / kThreads, 64), rows);
  add_rows_kernel<<<grid, kThreads, 0, stream>>>(y, ldy, v, n);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void relu_f16(__half* x, int64_t n, cudaStream_t stream) {
  KESTREL_CHECK(n >= 0, "relu_f16: negative size " + std::to_string(n));
  if (n == 0) return;
  const unsigned blocks = (unsigned)std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  relu_kernel<<<blocks, kThreads, 0, stream>>>(x, n);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
