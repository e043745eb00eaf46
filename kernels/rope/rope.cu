// Rotary embedding of q and k, fused with the write of k and v into the KV cache.
//
// One thread per rotated pair (i, i + head_dim/2) of one head, q heads first, then k heads, then
// one thread per v element. At decode this is a few thousand threads moving ~10 KB: the kernel
// exists to save the separate KV-copy launches, not to stream.
//
// The frequencies are computed on the host, in float, in exactly transformers' order
// (inv_freq = 1 / theta^(2i/d), then / linear_factor), and passed by value: the kernel's
// parameters are frozen into a captured graph together with the launch, and the angles are then
// bitwise those of rope_ref. Only the angle depends on the position:
//   angle = float(pos) * inv_freq[i]   (one float product, as transformers)
// and sincosf (full range reduction, <= 2 ulp; the build never uses --use_fast_math) keeps
// cos/sin accurate even at angles of several thousand radians.
#include "kernels/rope/rope_cuda.h"

#include <cmath>
#include <string>

#include "engine/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/pdl.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kMaxHalf = 128;  // head_dim <= 256
constexpr int kThreads = 256;

struct InvFreq {
  float v[kMaxHalf];
};

__global__ void rope_kv_write_kernel(__half* qkv, __half* k_cache, __half* v_cache,
                                     const int* d_pos, int n_heads, int n_kv_heads, int head_dim,
                                     const InvFreq inv_freq) {
  pdl_wait_then_release();  // qkv comes from the GEMV before
  const int half = head_dim / 2;
  const int kv_dim = n_kv_heads * head_dim;
  const int n_pairs = (n_heads + n_kv_heads) * half;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int pos = *d_pos;
  const size_t cache_row = (size_t)pos * kv_dim;

  if (t < n_pairs) {
    const int head = t / half;  // 0 .. n_heads-1 are q heads, the rest k heads
    const int i = t % half;
    __half* xh = qkv + (size_t)head * head_dim;  // k follows q directly in qkv
    float s, c;
    sincosf((float)pos * inv_freq.v[i], &s, &c);
    const float x1 = __half2float(xh[i]), x2 = __half2float(xh[i + half]);
    const __half y1 = __float2half_rn(x1 * c - x2 * s);
    const __half y2 = __float2half_rn(x2 * c + x1 * s);
    xh[i] = y1;
    xh[i + half] = y2;
    if (head >= n_heads) {
      __half* kc = k_cache + cache_row + (size_t)(head - n_heads) * head_dim;
      kc[i] = y1;
      kc[i + half] = y2;
    }
  } else if (t < n_pairs + kv_dim) {
    const int j = t - n_pairs;
    v_cache[cache_row + j] = qkv[(size_t)n_heads * head_dim + kv_dim + j];
  }
}

}  // namespace

void rope_kv_write_f16(__half* qkv, __half* k_cache, __half* v_cache, const int* d_pos,
                       int n_heads, int n_kv_heads, int head_dim, float theta,
                       float linear_factor, cudaStream_t stream) {
  KESTREL_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim / 2 <= kMaxHalf,
                "rope_kv_write_f16: head_dim must be even and at most " +
                    std::to_string(2 * kMaxHalf) + ", got " + std::to_string(head_dim));
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0,
                "rope_kv_write_f16: bad head counts n_heads " + std::to_string(n_heads) +
                    ", n_kv_heads " + std::to_string(n_kv_heads));
  InvFreq inv_freq{};
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq.v[i] = 1.0f / std::pow(theta, (float)(2 * i) / (float)head_dim);
    inv_freq.v[i] /= linear_factor;
  }
  const int n_threads = (n_heads + n_kv_heads) * (head_dim / 2) + n_kv_heads * head_dim;
  const int blocks = (n_threads + kThreads - 1) / kThreads;
  launch_pdl(rope_kv_write_kernel, dim3(blocks), dim3(kThreads), 0, stream, qkv, k_cache, v_cache,
             d_pos, n_heads, n_kv_heads, head_dim, inv_freq);
}

}  // namespace kestrel::cuda
