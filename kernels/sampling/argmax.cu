// Greedy argmax over the fp16 logits in one block of 1024 threads: a vocabulary of 32K-128K
// halves is 64-256 KB, one or a few 16-byte loads per thread per pass, and a single block needs
// no second kernel and no cross-block atomics. Each thread scans increasing indices and keeps
// the first maximum it meets (strict >); the block reduction prefers the smaller index on equal
// values, so the result is the first index of the maximum.
#include "kernels/sampling/argmax_cuda.h"

#include <climits>
#include <cstdint>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/half8.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/sampling/hand_out.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kArgmaxThreads = 1024;
constexpr int kConvertThreads = 256;

// a := the better of a and b: larger value, smaller index on equal values.
__device__ __forceinline__ void take_better(float& av, int& ai, float bv, int bi) {
  if (bv > av || (bv == av && bi < ai)) {
    av = bv;
    ai = bi;
  }
}

// The block's best (value, index) from each thread's, in thread 0 (other threads: unspecified).
__device__ __forceinline__ void block_best(float& best, int& idx) {
  for (int o = 16; o > 0; o >>= 1)
    take_better(best, idx, __shfl_xor_sync(0xffffffffu, best, o),
                __shfl_xor_sync(0xffffffffu, idx, o));
  __shared__ float s_val[kArgmaxThreads / 32];
  __shared__ int s_idx[kArgmaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_val[warp] = best;
    s_idx[warp] = idx;
  }
  __syncthreads();
  if (warp == 0) {
    best = s_val[lane];
    idx = s_idx[lane];
    for (int o = 16; o > 0; o >>= 1)
      take_better(best, idx, __shfl_xor_sync(0xffffffffu, best, o),
                  __shfl_xor_sync(0xffffffffu, idx, o));
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const __half* __restrict__ x, int n, int* __restrict__ out, int* feed,
                  int* host_out) {
  pdl_wait_then_release();  // the logits come from the lm_head GEMV
  // INT_MAX marks "nothing beat -inf" (every value -inf or NaN); it loses all index ties.
  float best = -INFINITY;
  int idx = INT_MAX;
  if constexpr (kVec) {
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 8; i += kArgmaxThreads) {
      Half8 h;
      h.raw = __ldg(reinterpret_cast<const uint4*>(x) + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(h.h2[j]);
        if (f.x > best) { best = f.x; idx = i * 8 + 2 * j; }
        if (f.y > best) { best = f.y; idx = i * 8 + 2 * j + 1; }
      }
    }
  } else {
    for (int i = threadIdx.x; i < n; i += kArgmaxThreads) {
      const float v = __half2float(x[i]);
      if (v > best) { best = v; idx = i; }
    }
  }
  block_best(best, idx);
  if (threadIdx.x == 0) hand_out_token(idx == INT_MAX ? 0 : idx, out, feed, host_out);
}

// One block per row of fp32 logits; the same scan and reduction as argmax_kernel.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ x, int n, int* __restrict__ out) {
  const float* row = x + (size_t)blockIdx.x * n;
  float best = -INFINITY;
  int idx = INT_MAX;  // as argmax_kernel: "nothing beat -inf"
  for (int i = threadIdx.x; i < n; i += kArgmaxThreads) {
    const float v = __ldg(row + i);
    if (v > best) { best = v; idx = i; }
  }
  block_best(best, idx);
  if (threadIdx.x == 0) out[blockIdx.x] = idx == INT_MAX ? 0 : idx;
}

__global__ void half_to_float_kernel(const __half* __restrict__ in, float* __restrict__ out,
                                     int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __half2float(in[i]);
}

}  // namespace

void argmax_f16(const __half* logits, int n, int* d_out_token, cudaStream_t stream, int* feed,
                int* host_out) {
  KESTREL_CHECK(n > 0, "argmax_f16: n must be positive, got " + std::to_string(n));
  if (n % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0) {
    launch_pdl(argmax_kernel<true>, dim3(1), dim3(kArgmaxThreads), 0, stream, logits, n, d_out_token,
               feed, host_out);
  } else {
    launch_pdl(argmax_kernel<false>, dim3(1), dim3(kArgmaxThreads), 0, stream, logits, n,
               d_out_token, feed, host_out);
  }
}

void argmax_rows_f32(const float* logits, int rows, int n, int* out, cudaStream_t stream) {
  KESTREL_CHECK(rows > 0 && n > 0, "argmax_rows_f32: rows and n must be positive, got " +
                                       std::to_string(rows) + " and " + std::to_string(n));
  argmax_rows_kernel<<<rows, kArgmaxThreads, 0, stream>>>(logits, n, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void half_to_float(const __half* in, float* out, int n, cudaStream_t stream) {
  KESTREL_CHECK(n >= 0, "half_to_float: negative n " + std::to_string(n));
  if (n == 0) return;
  half_to_float_kernel<<<(n + kConvertThreads - 1) / kConvertThreads, kConvertThreads, 0,
                         stream>>>(in, out, n);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
