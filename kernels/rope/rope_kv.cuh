// The rotation of one token's q|k|v row and its K/V cache write, shared by the decode kernel
// (rope.cu, one token at *d_pos) and the prefill kernel (rope_rows.cu, T tokens): both compute
// bitwise the same values. Device code: include from .cu files only.
//
// Frequencies are computed on the host by the reference's rope_inv_freq (rope.h: float, in
// exactly transformers' order, with the model's scaling), and passed by value. The angle is one
// float product, float(pos) * inv_freq[i], as in transformers; sincosf (full range reduction,
// <= 2 ulp; the build never uses --use_fast_math) stays accurate at thousands of radians.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "base/error.h"
#include "kernels/rope/rope.h"

namespace kestrel::cuda::rope_detail {

constexpr int kMaxHalf = 128;  // head_dim <= 256
constexpr int kThreads = 256;

struct InvFreq {
  float v[kMaxHalf];
};

inline InvFreq make_inv_freq(const char* who, int head_dim, const RopeScaling& rope) {
  KESTREL_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim / 2 <= kMaxHalf,
                std::string(who) + ": head_dim must be even and at most " +
                    std::to_string(2 * kMaxHalf) + ", got " + std::to_string(head_dim));
  InvFreq f{};
  const std::vector<float> table = rope_inv_freq(head_dim, rope);
  for (int i = 0; i < head_dim / 2; ++i) f.v[i] = table[i];
  return f;
}

// Threads one row needs: one per rotated pair (i, i + head_dim/2) of each q and k head, then one
// per v element.
inline int threads_per_row(int n_heads, int n_kv_heads, int head_dim) {
  return (n_heads + n_kv_heads) * (head_dim / 2) + n_kv_heads * head_dim;
}

// The rotation of the pair (x1, x2) = (x[i], x[i + head_dim/2]) of one head at position pos.
// Every path that applies RoPE at decode (rope_kv_row, the attention kernel that rotates as it
// reads) calls it, so that they agree bitwise.
// The angle's cosine and sine, and the rotation by them, apart so that a kernel can share one
// table of angles between many pairs.
__device__ __forceinline__ float2 rope_angle(int pos, float inv_freq) {
  float s, c;
  sincosf((float)pos * inv_freq, &s, &c);
  return make_float2(c, s);
}
__device__ __forceinline__ void rotate_pair(__half x1h, __half x2h, float2 cs, __half& y1,
                                            __half& y2) {
  const float x1 = __half2float(x1h), x2 = __half2float(x2h);
  y1 = __float2half_rn(x1 * cs.x - x2 * cs.y);
  y2 = __float2half_rn(x2 * cs.x + x1 * cs.y);
}

// Thread t of a row at position pos: rotates its pair in place (q heads first, then k heads,
// which follow q directly in the row) and writes rotated k, or copies one v element, into the
// caches at row pos.
__device__ __forceinline__ void rope_kv_row(__half* row, __half* k_cache, __half* v_cache, int pos,
                                            int t, int n_heads, int n_kv_heads, int head_dim,
                                            const InvFreq& inv_freq) {
  const int half = head_dim / 2;
  const int kv_dim = n_kv_heads * head_dim;
  const int n_pairs = (n_heads + n_kv_heads) * half;
  const size_t cache_row = (size_t)pos * kv_dim;
  if (t < n_pairs) {
    const int head = t / half;
    const int i = t % half;
    __half* xh = row + (size_t)head * head_dim;
    __half y1, y2;
    rotate_pair(xh[i], xh[i + half], rope_angle(pos, inv_freq.v[i]), y1, y2);
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

}  // namespace kestrel::cuda::rope_detail
