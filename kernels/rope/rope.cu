// Rotary embedding of q and k, fused with the write of k and v into the KV cache.
//
// One thread per rotated pair (i, i + head_dim/2) of one head, q heads first, then k heads, then
// one thread per v element. At decode this is a few thousand threads moving ~10 KB: the kernel
// exists to save the separate KV-copy launches, not to stream.
//
// The arithmetic is in rope_kv.cuh, shared with the prefill kernel.
#include "kernels/rope/rope_cuda.h"

#include <cmath>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/pdl.cuh"
#include "kernels/rope/rope_kv.cuh"

namespace kestrel::cuda {
namespace {

using namespace rope_detail;

__global__ void rope_kv_write_kernel(__half* qkv, __half* k_cache, __half* v_cache,
                                     const int* d_pos, int n_heads, int n_kv_heads, int head_dim,
                                     const InvFreq inv_freq) {
  pdl_wait_then_release();  // qkv comes from the GEMV before
  rope_kv_row(qkv, k_cache, v_cache, *d_pos, blockIdx.x * blockDim.x + threadIdx.x, n_heads,
              n_kv_heads, head_dim, inv_freq);
}

}  // namespace

void rope_kv_write_f16(__half* qkv, __half* k_cache, __half* v_cache, const int* d_pos,
                       int n_heads, int n_kv_heads, int head_dim, const RopeScaling& rope,
                       cudaStream_t stream) {
  const InvFreq inv_freq = make_inv_freq("rope_kv_write_f16", head_dim, rope);
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0,
                "rope_kv_write_f16: bad head counts n_heads " + std::to_string(n_heads) +
                    ", n_kv_heads " + std::to_string(n_kv_heads));
  const int blocks = (threads_per_row(n_heads, n_kv_heads, head_dim) + kThreads - 1) / kThreads;
  launch_pdl(rope_kv_write_kernel, dim3(blocks), dim3(kThreads), 0, stream, qkv, k_cache, v_cache,
             d_pos, n_heads, n_kv_heads, head_dim, inv_freq);
}

}  // namespace kestrel::cuda
