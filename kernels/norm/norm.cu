// FP16 RMSNorm and LayerNorm: one block per row.
//
// At decode a row is the hidden vector (4096-8192 halves, 8-16 KB): the kernel is latency-bound,
// so the block is sized to give every thread one or two 16-byte loads and the row is read twice
// (statistics, then scale), the second time from L1/L2. Statistics accumulate in fp32, which
// for n <= 64K loses ~1e-6 relative: far below the output's fp16 rounding (2^-11).
// The whole row is reduced before any write, and each element is written by the thread that
// read it, so y may alias x.
#include "kernels/norm/norm_cuda.h"

#include <cstdint>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/half8.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kMaxThreads = 1024;

// Sum over the block; every thread gets the result. `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Element access for the two layouts: kVec reads 8 halves per index (n % 8 == 0, 16-byte aligned
// pointers), otherwise 1.
template <bool kVec>
struct Row {
  static constexpr int kWidth = kVec ? 8 : 1;
  __device__ static void load(const __half* p, int i, float (&v)[kWidth]) {
    if constexpr (kVec) {
      Half8 h;
      h.raw = *reinterpret_cast<const uint4*>(p + (size_t)i * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(h.h2[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
      }
    } else {
      v[0] = __half2float(p[i]);
    }
  }
  __device__ static void store(__half* p, int i, const float (&v)[kWidth]) {
    if constexpr (kVec) {
      Half8 h;
#pragma unroll
      for (int j = 0; j < 4; ++j) h.h2[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
      *reinterpret_cast<uint4*>(p + (size_t)i * 8) = h.raw;
    } else {
      p[i] = __float2half_rn(v[0]);
    }
  }
};

template <bool kVec>
__global__ void rms_norm_kernel(const __half* x, const __half* w, float eps, int n, __half* y) {
  using R = Row<kVec>;
  constexpr int W = R::kWidth;
  __shared__ float scratch[32];
  const __half* xr = x + (size_t)blockIdx.x * n;
  __half* yr = y + (size_t)blockIdx.x * n;
  const int n_items = n / W;

  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
    float v[W];
    R::load(xr, i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) sum_sq += v[j] * v[j];
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / (float)n + eps);

  for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
    float v[W], g[W];
    R::load(xr, i, v);
    R::load(w, i, g);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = v[j] * inv_rms * g[j];
    R::store(yr, i, v);
  }
}

template <bool kVec>
__global__ void layer_norm_kernel(__half* x, const __half* add, const __half* w, const __half* b,
                                  float eps, int n, __half* y) {
  using R = Row<kVec>;
  constexpr int W = R::kWidth;
  __shared__ float scratch[32];
  __half* xr = x + (size_t)blockIdx.x * n;
  __half* yr = y + (size_t)blockIdx.x * n;
  const int n_items = n / W;

  // x += add first (rounded to fp16, as the residual stream is kept); each thread reads back
  // only what it wrote, in the passes below.
  if (add != nullptr) {
    for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
      float v[W], a[W];
      R::load(xr, i, v);
      R::load(add, i, a);
#pragma unroll
      for (int j = 0; j < W; ++j) v[j] += a[j];
      R::store(xr, i, v);
    }
  }

  float sum = 0.0f;
  for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
    float v[W];
    R::load(xr, i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) sum += v[j];
  }
  const float mean = block_sum(sum, scratch) / (float)n;

  // Second pass over centred values: E[x^2] - mean^2 would cancel when |mean| >> std.
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
    float v[W];
    R::load(xr, i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) sum_sq += (v[j] - mean) * (v[j] - mean);
  }
  const float inv_std = rsqrtf(block_sum(sum_sq, scratch) / (float)n + eps);

  for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
    float v[W], g[W], c[W];
    R::load(xr, i, v);
    R::load(w, i, g);
    if (b != nullptr) {
      R::load(b, i, c);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) c[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = (v[j] - mean) * inv_std * g[j] + c[j];
    R::store(yr, i, v);
  }
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whole warps, enough for one load item per thread up to kMaxThreads.
int threads_for(int n_items) {
  const int t = (n_items + 31) / 32 * 32;
  return t < 32 ? 32 : (t > kMaxThreads ? kMaxThreads : t);
}

void check_shape(const char* op, int rows, int n) {
  KESTREL_CHECK(rows >= 0 && n > 0, std::string(op) + ": bad shape rows " + std::to_string(rows) +
                                        ", n " + std::to_string(n));
}

}  // namespace

void rms_norm_f16(const __half* x, const __half* w, float eps, int rows, int n, __half* y,
                  cudaStream_t stream) {
  check_shape("rms_norm_f16", rows, n);
  if (rows == 0) return;
  const bool vec = n % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  const int threads = threads_for(vec ? n / 8 : n);
  if (vec) {
    rms_norm_kernel<true><<<rows, threads, 0, stream>>>(x, w, eps, n, y);
  } else {
    rms_norm_kernel<false><<<rows, threads, 0, stream>>>(x, w, eps, n, y);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void add_layer_norm_f16(__half* x, const __half* add, const __half* w, const __half* b, float eps,
                        int rows, int n, __half* y, cudaStream_t stream) {
  check_shape("layer_norm_f16", rows, n);
  if (rows == 0) return;
  const bool vec = n % 8 == 0 && aligned16(x) && aligned16(add) && aligned16(w) && aligned16(b) &&
                   aligned16(y);
  const int threads = threads_for(vec ? n / 8 : n);
  if (vec) {
    layer_norm_kernel<true><<<rows, threads, 0, stream>>>(x, add, w, b, eps, n, y);
  } else {
    layer_norm_kernel<false><<<rows, threads, 0, stream>>>(x, add, w, b, eps, n, y);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void layer_norm_f16(const __half* x, const __half* w, const __half* b, float eps, int rows, int n,
                    __half* y, cudaStream_t stream) {
  // Without an addition x is only read.
  add_layer_norm_f16(const_cast<__half*>(x), nullptr, w, b, eps, rows, n, y, stream);
}

namespace {

// One warp per head of one row: each lane holds head_dim / 32 values (at most 8), reduces the
// sum of squares across the warp and writes what it read (fp32 product, one rounding).
__global__ void head_rms_norm_kernel(__half* qkv, int64_t ld, int n_heads, int n_heads_all,
                                     int head_dim, const __half* q_w, const __half* k_w,
                                     float eps) {
  const int head = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (head >= n_heads_all) return;
  __half* p = qkv + (int64_t)blockIdx.y * ld + (int64_t)head * head_dim;
  const __half* w = head < n_heads ? q_w : k_w;
  float v[8];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int i = lane + 32 * j;
    v[j] = i < head_dim ? __half2float(p[i]) : 0.0f;
    ss += v[j] * v[j];
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = rsqrtf(ss / (float)head_dim + eps);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int i = lane + 32 * j;
    if (i < head_dim) p[i] = __float2half_rn(v[j] * inv * __half2float(w[i]));
  }
}

}  // namespace

void head_rms_norm_f16(__half* qkv, int64_t ld, int rows, int n_heads, int n_kv_heads,
                       int head_dim, const __half* q_w, const __half* k_w, float eps,
                       cudaStream_t stream) {
  KESTREL_CHECK(rows >= 0 && rows <= 65535 && n_heads > 0 && n_kv_heads >= 0 && head_dim > 0 &&
                    head_dim <= 256 && ld >= (int64_t)(n_heads + n_kv_heads) * head_dim,
                "head_rms_norm_f16: bad shape rows " + std::to_string(rows) + ", heads " +
                    std::to_string(n_heads) + "+" + std::to_string(n_kv_heads) + ", head_dim " +
                    std::to_string(head_dim) + ", ld " + std::to_string(ld));
  if (rows == 0) return;
  constexpr int kWarps = 4;
  const int heads = n_heads + n_kv_heads;
  const dim3 grid((heads + kWarps - 1) / kWarps, rows);
  head_rms_norm_kernel<<<grid, kWarps * 32, 0, stream>>>(qkv, ld, n_heads, heads, head_dim, q_w,
                                                         k_w, eps);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
