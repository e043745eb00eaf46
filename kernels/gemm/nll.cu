// Row-wise log-softmax at the target token: one block of 256 threads per row, two passes over
// the row (max, then the sum of exponentials), both reading it from L2 after the first.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/nll_cuda.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;

template <class Op>
__device__ float block_reduce(float v, Op op, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // shared is reused between calls
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = shared[0];
  for (int w = 1; w < kThreads / 32; ++w) v = op(v, shared[w]);
  return v;
}

__global__ void __launch_bounds__(kThreads) nll_kernel(const float* logits, const int* targets,
                                                       int vocab, float* nll) {
  __shared__ float shared[kThreads / 32];
  const int row = blockIdx.x;
  const int target = targets[row];
  if (target < 0) {
    if (threadIdx.x == 0) nll[row] = 0.0f;
    return;
  }
  const float* l = logits + (size_t)row * vocab;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kThreads) mx = fmaxf(mx, l[i]);
  mx = block_reduce(mx, [](float a, float b) { return fmaxf(a, b); }, shared);
  float sum = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kThreads) sum += expf(l[i] - mx);
  sum = block_reduce(sum, [](float a, float b) { return a + b; }, shared);
  if (threadIdx.x == 0) nll[row] = logf(sum) + mx - l[target];
}

}  // namespace

void nll_rows_f32(const float* logits, const int* targets, int rows, int vocab, float* nll,
                  cudaStream_t s) {
  if (rows <= 0) return;
  if (vocab <= 0) throw Error("nll_rows_f32: vocab must be positive, got " + std::to_string(vocab));
  nll_kernel<<<rows, kThreads, 0, s>>>(logits, targets, vocab, nll);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
