// RoPE + KV write for T tokens: the decode kernel's thread layout (rope.cu) on grid.y = token.
// Frequencies come from the host in transformers' float order, the angle is one float product
// float(pos) * inv_freq and sincosf is accurate at any angle: bitwise the decode kernel's result.
#include "kernels/rope/rope_rows_cuda.h"

#include <cmath>
#include <string>

#include "engine/error.h"
#include "kernels/common/cuda_utils.h"

namespace kestrel::cuda {
namespace {

constexpr int kMaxHalf = 128;  // head_dim <= 256
constexpr int kThreads = 256;

struct InvFreq {
  float v[kMaxHalf];
};

__global__ void rope_kv_write_rows_kernel(__half* qkv, int64_t row_stride, int pos0,
                                          __half* k_cache, __half* v_cache, int n_heads,
                                          int n_kv_heads, int head_dim, const InvFreq inv_freq) {
  const int half = head_dim / 2;
  const int kv_dim = n_kv_heads * head_dim;
  const int n_pairs = (n_heads + n_kv_heads) * half;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int token = blockIdx.y;
  const int pos = pos0 + token;
  __half* row = qkv + (int64_t)token * row_stride;
  const size_t cache_row = (size_t)pos * kv_dim;

  if (t < n_pairs) {
    const int head = t / half;  // q heads, then k heads
    const int i = t % half;
    __half* xh = row + (size_t)head * head_dim;
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
    v_cache[cache_row + j] = row[(size_t)n_heads * head_dim + kv_dim + j];
  }
}

}  // namespace

void rope_kv_write_rows_f16(__half* qkv, int64_t row_stride, int T, int pos0, __half* k_cache,
                            __half* v_cache, int n_heads, int n_kv_heads, int head_dim,
                            float theta, float linear_factor, cudaStream_t stream) {
  KESTREL_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim / 2 <= kMaxHalf,
                "rope_kv_write_rows_f16: head_dim must be even and at most " +
                    std::to_string(2 * kMaxHalf) + ", got " + std::to_string(head_dim));
  KESTREL_CHECK(n_heads > 0 && n_kv_heads > 0 && T >= 1 && pos0 >= 0 && T <= 65535,
                "rope_kv_write_rows_f16: bad sizes n_heads " + std::to_string(n_heads) +
                    ", n_kv_heads " + std::to_string(n_kv_heads) + ", T " + std::to_string(T) +
                    ", pos0 " + std::to_string(pos0));
  KESTREL_CHECK(row_stride >= (int64_t)(n_heads + 2 * n_kv_heads) * head_dim,
                "rope_kv_write_rows_f16: row stride " + std::to_string(row_stride) +
                    " is shorter than q|k|v");
  InvFreq inv_freq{};
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq.v[i] = 1.0f / std::pow(theta, (float)(2 * i) / (float)head_dim);
    inv_freq.v[i] /= linear_factor;
  }
  const int n_threads = (n_heads + n_kv_heads) * (head_dim / 2) + n_kv_heads * head_dim;
  const dim3 grid((n_threads + kThreads - 1) / kThreads, T);
  rope_kv_write_rows_kernel<<<grid, kThreads, 0, stream>>>(qkv, row_stride, pos0, k_cache, v_cache,
                                                           n_heads, n_kv_heads, head_dim, inv_freq);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
