// RoPE + KV write for T tokens: the decode kernel's thread layout (rope.cu) on grid.y = token.
// Frequencies come from the host in transformers' float order, the angle is one float product
// float(pos) * inv_freq and sincosf is accurate at any angle: bitwise the decode kernel's result.
#include "kernels/rope/rope_rows_cuda.h"

#include <cmath>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/rope/rope_kv.cuh"

namespace kestrel::cuda {
namespace {

using namespace rope_detail;

// The first position is *d_pos0 where given (a graph replayed at any position), else pos0.
__global__ void rope_kv_write_rows_kernel(__half* qkv, int64_t row_stride, int pos0,
                                          const int* __restrict__ d_pos0, __half* k_cache,
                                          __half* v_cache, int n_heads, int n_kv_heads,
                                          int head_dim, const InvFreq inv_freq) {
  const int token = blockIdx.y;
  const int first = d_pos0 ? __ldg(d_pos0) : pos0;
  rope_kv_row(qkv + (int64_t)token * row_stride, k_cache, v_cache, first + token,
              blockIdx.x * blockDim.x + threadIdx.x, n_heads, n_kv_heads, head_dim, inv_freq);
}

}  // namespace

void rope_kv_write_rows_f16(__half* qkv, int64_t row_stride, int T, int pos0, __half* k_cache,
                            __half* v_cache, int n_heads, int n_kv_heads, int head_dim,
                            const RopeScaling& rope, cudaStream_t stream,
                            const int* d_pos0) {
  const InvFreq inv_freq = make_inv_freq("rope_kv_write_rows_f16", head_dim, rope);
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0 && T >= 1 && pos0 >= 0 && T <= 65535,
                "rope_kv_write_rows_f16: bad sizes n_heads " + std::to_string(n_heads) +
                    ", n_kv_heads " + std::to_string(n_kv_heads) + ", T " + std::to_string(T) +
                    ", pos0 " + std::to_string(pos0));
  KESTREL_CHECK(row_stride >= (int64_t)(n_heads + 2 * n_kv_heads) * head_dim,
                "rope_kv_write_rows_f16: row stride " + std::to_string(row_stride) +
                    " is shorter than q|k|v");
  const dim3 grid((threads_per_row(n_heads, n_kv_heads, head_dim) + kThreads - 1) / kThreads, T);
  rope_kv_write_rows_kernel<<<grid, kThreads, 0, stream>>>(qkv, row_stride, pos0, d_pos0, k_cache,
                                                           v_cache, n_heads, n_kv_heads, head_dim,
                                                           inv_freq);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
