// The GPU quantizer's kernels (gptq_kernels.h). The arithmetic that decides codes and scales
// repeats gptq.cpp's float operations one by one with explicitly rounded intrinsics
// (__fdiv_rn, __fmul_rn, __fsub_rn): nvcc would otherwise contract a*b - c into an FMA,
// which rounds once instead of twice and so differs from the CPU's result in the last bit.
#include "tools/quantize/gptq_kernels.h"

#include <math_constants.h>

#include "kernels/common/cuda_utils.h"
#include "kernels/common/dynamic_smem.h"

namespace kestrel::quant::kern {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

int blocks_for(int64_t n, int per_block = kThreads) {
  const int64_t b = (n + per_block - 1) / per_block;
  return (int)(b < 65535 * 32 ? b : 65535 * 32);  // grid-stride loops cover the rest
}

// --- find_params --------------------------------------------------------------------------
// The scale and zero of the range [lo, hi], as find_params' fit: the fp16 scale (fp16's
// smallest subnormal where it rounds to zero), the zero point 2^(bits-1) or rint(-lo / scale).
__device__ __forceinline__ void fit_range(float lo, float hi, float maxq, bool sym, float& s,
                                          float& z) {
  s = __half2float(__float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), maxq)));  // round_to_half
  if (s == 0.0f) s = 5.9604644775390625e-8f;  // fp16's smallest subnormal, half_to_float(1)
  z = (maxq + 1.0f) / 2.0f;
  if (!sym) z = fminf(fmaxf(rintf(__fdiv_rn(-lo, s)), 0.0f), maxq);
}

// The full range [min(x, 0), max(x, 0)] of a row's columns from min and max: symmetric when
// `sym`, (-1, 1) when empty.
__device__ __forceinline__ void settle_range(bool sym, float& lo, float& hi) {
  if (sym) {
    hi = fmaxf(-lo, hi);
    lo = -hi;
  }
  if (lo == 0.0f && hi == 0.0f) {
    lo = -1.0f;
    hi = 1.0f;
  }
}

// One warp per (range, row): the lanes stride over the range's columns for min and max (exact
// in any order), lane 0 turns them into the scale and zero exactly as find_params does.
__global__ void find_params_kernel(const float* __restrict__ W, int64_t ld, int64_t N, int64_t K,
                                   int64_t c0, int64_t width, int64_t groups, int64_t g0,
                                   float maxq, bool sym, float* __restrict__ scale,
                                   float* __restrict__ zero, int* __restrict__ bad) {
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= groups * N) return;  // whole warps leave together
  const int64_t gi = warp / N, n = warp % N;
  const int64_t begin = c0 + gi * width;
  const int64_t end = begin + width < K ? begin + width : K;
  float lo = 0.0f, hi = 0.0f;
  for (int64_t c = begin + lane; c < end; c += 32) {
    const float v = W[n * ld + c];
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(kFull, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(kFull, hi, o));
  }
  if (lane != 0) return;
  settle_range(sym, lo, hi);
  float s, z;
  fit_range(lo, hi, maxq, sym, s, z);
  if (!isfinite(s)) atomicExch(bad, 1);
  scale[(g0 + gi) * N + n] = s;
  zero[(g0 + gi) * N + n] = z;
}

// The range search (find_params with mse > 0): one CTA per (range, row), one thread per shrink
// factor p = 1 - i/100, i < 80. Each thread sums its |w - q(w)|^norm over the range's columns
// itself, in column order, into a double, as the CPU does: a tree reduction would round the
// sum differently, and two shrinks whose sums lie that close would then be chosen apart. Each
// term is the power taken in double and rounded to float once, the correctly rounded float
// power, which glibc's powf (0.82 ulp at worst) returns for all but a few terms in ten
// thousand. Thread 0 then scans the 80 sums in order, keeping the first least.
constexpr int kShrinks = 80;  // grid 100, maxshrink 0.8
constexpr int kMseThreads = 96;  // whole warps, one thread per shrink

__global__ void __launch_bounds__(kMseThreads)
find_params_mse_kernel(const float* __restrict__ W, int64_t ld, int64_t N, int64_t K, int64_t c0,
                       int64_t width, int64_t groups, int64_t g0, float maxq, bool sym,
                       float norm, float* __restrict__ scale, float* __restrict__ zero,
                       int* __restrict__ bad) {
  __shared__ float lo_w[kMseThreads / 32], hi_w[kMseThreads / 32];
  __shared__ double err_s[kShrinks];
  __shared__ float scale_s[kShrinks], zero_s[kShrinks];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Every thread of the CTA runs every iteration: the barriers below see all of them.
  for (int64_t pair = blockIdx.x; pair < groups * N; pair += gridDim.x) {
    const int64_t gi = pair / N, n = pair % N;
    const int64_t begin = c0 + gi * width;
    const int64_t end = begin + width < K ? begin + width : K;
    const float* row = W + n * ld;
    float lo = 0.0f, hi = 0.0f;
    for (int64_t c = begin + threadIdx.x; c < end; c += kMseThreads) {
      lo = fminf(lo, row[c]);
      hi = fmaxf(hi, row[c]);
    }
    for (int o = 16; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(kFull, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(kFull, hi, o));
    }
    if (lane == 0) {
      lo_w[warp] = lo;
      hi_w[warp] = hi;
    }
    __syncthreads();
    lo = 0.0f;
    hi = 0.0f;
    for (int w = 0; w < kMseThreads / 32; ++w) {
      lo = fminf(lo, lo_w[w]);
      hi = fmaxf(hi, hi_w[w]);
    }
    settle_range(sym, lo, hi);
    if (threadIdx.x < kShrinks) {
      const float p = __fsub_rn(1.0f, __fdiv_rn((float)threadIdx.x, 100.0f));
      float s, z;
      fit_range(__fmul_rn(p, lo), __fmul_rn(p, hi), maxq, sym, s, z);
      if (threadIdx.x == 0 && !isfinite(s)) atomicExch(bad, 1);  // p = 1: the full range
      double err = 0.0;
      for (int64_t c = begin; c < end; ++c) {  // every thread reads the same column: a broadcast
        const float w = row[c];
        float q = __fadd_rn(rintf(__fdiv_rn(w, s)), z);  // quantize_code
        q = q < 0.0f ? 0.0f : (q > maxq ? maxq : q);
        const float d = __fsub_rn(__fmul_rn(s, __fsub_rn(q, z)), w);
        err += (double)__double2float_rn(pow((double)fabsf(d), (double)norm));
      }
      err_s[threadIdx.x] = err;
      scale_s[threadIdx.x] = s;
      zero_s[threadIdx.x] = z;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // p = 1 is the full range's fit: kept where no sum is below infinity (a NaN weight).
      double best = CUDART_INF;
      float bs = scale_s[0], bz = zero_s[0];
      for (int i = 0; i < kShrinks; ++i)
        if (err_s[i] < best) {
          best = err_s[i];
          bs = scale_s[i];
          bz = zero_s[i];
        }
      scale[(g0 + gi) * N + n] = bs;
      zero[(g0 + gi) * N + n] = bz;
    }
    __syncthreads();  // the shared sums are rewritten by the next pair
  }
}

// --- permutations and the Hessian -----------------------------------------------------------
__global__ void gather_columns_kernel(const float* __restrict__ W, int64_t N, int64_t K,
                                      const int32_t* __restrict__ src,
                                      const uint8_t* __restrict__ dead, float* __restrict__ out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / K, j = i % K;
    const int64_t k = src ? src[j] : j;
    out[i] = (dead && dead[k]) ? 0.0f : W[n * K + k];
  }
}

__global__ void permute_damp_kernel(const float* __restrict__ H, int64_t K,
                                    const int32_t* __restrict__ perm, float damp,
                                    float* __restrict__ out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < K * K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t a = i / K, b = i % K;
    float v = H[(int64_t)perm[a] * K + perm[b]];
    if (a == b) v = __fadd_rn(v == 0.0f ? 1.0f : v, damp);
    out[i] = v;
  }
}

__global__ void zero_lower_kernel(float* __restrict__ A, int64_t K) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < K * K;
       i += (int64_t)gridDim.x * blockDim.x)
    if (i % K < i / K) A[i] = 0.0f;
}

// --- the column loop of one lazy block ------------------------------------------------------
// A CTA of kWarps warps loads the block's square of U, [cnt, cnt], into shared memory; each
// warp then runs one row. Lane l holds the row's block columns l, l + 32, l + 64, l + 96 in
// registers. For column i the owner lane's value is broadcast with a shuffle, every lane
// computes the (identical) code and error, the owner stores them, and each lane updates its
// own later columns: w[j] -= err * U[col, j]. Per row and block that is cnt shuffles and
// cnt^2 / 2 multiply-subtracts, with no memory traffic beyond reading the block once.
constexpr int kWarps = 8;

__global__ void __launch_bounds__(kWarps * 32)
gptq_block_kernel(const float* __restrict__ W, int64_t ld, int64_t N, int64_t i1, int cnt,
                  const float* __restrict__ U, int64_t K, const int32_t* __restrict__ gcol,
                  const float* __restrict__ scale, const float* __restrict__ zero, float maxq,
                  uint8_t* __restrict__ codes, float* __restrict__ E) {
  extern __shared__ float Us[];  // [cnt, cnt] = U[i1 + a, i1 + b]
  for (int i = threadIdx.x; i < cnt * cnt; i += blockDim.x)
    Us[i] = U[(i1 + i / cnt) * K + i1 + i % cnt];
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int64_t n = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (n >= N) return;  // whole warps leave together; the shuffles below see full warps
  constexpr int kPer = kMaxBlock / 32;
  float w[kPer];
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    const int j = s * 32 + lane;
    w[s] = j < cnt ? W[n * ld + i1 + j] : 0.0f;
  }
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    for (int t = 0; t < 32; ++t) {
      const int i = s * 32 + t;
      if (i >= cnt) break;
      const int64_t col = i1 + i;
      const float x = __shfl_sync(kFull, w[s], t);
      const int64_t g = gcol[col];
      const float sc = scale[g * N + n], z = zero[g * N + n];
      // quantize_code: clamp(rint(w / scale) + zero, 0, maxq)
      float q = __fadd_rn(rintf(__fdiv_rn(x, sc)), z);
      q = q < 0.0f ? 0.0f : (q > maxq ? maxq : q);
      const float deq = __fmul_rn(sc, __fsub_rn(q, z));
      const float err = __fdiv_rn(__fsub_rn(x, deq), Us[i * cnt + i]);
      if (lane == t) {
        codes[n * K + col] = (uint8_t)q;
        E[n * cnt + i] = err;
      }
#pragma unroll
      for (int s2 = 0; s2 < kPer; ++s2) {
        const int j = s2 * 32 + lane;
        if (j > i && j < cnt) w[s2] = __fsub_rn(w[s2], __fmul_rn(err, Us[i * cnt + j]));
      }
    }
  }
}

// --- results --------------------------------------------------------------------------------
__global__ void scatter_codes_kernel(const uint8_t* __restrict__ codes_p, int64_t N, int64_t K,
                                     const int32_t* __restrict__ perm, uint8_t* __restrict__ codes) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / K, j = i % K;
    codes[n * K + perm[j]] = codes_p[i];
  }
}

__global__ void rtn_codes_kernel(const float* __restrict__ W, int64_t N, int64_t K,
                                 const int32_t* __restrict__ g_idx, const float* __restrict__ scale,
                                 const float* __restrict__ zero, float maxq,
                                 uint8_t* __restrict__ codes) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / K, k = i % K, g = g_idx[k];
    const float sc = scale[g * N + n], z = zero[g * N + n];
    float q = __fadd_rn(rintf(__fdiv_rn(W[i], sc)), z);
    q = q < 0.0f ? 0.0f : (q > maxq ? maxq : q);
    codes[i] = (uint8_t)q;
  }
}

__global__ void dequantize_kernel(const uint8_t* __restrict__ codes, int64_t N, int64_t K,
                                  const int32_t* __restrict__ g_idx,
                                  const float* __restrict__ scale, const float* __restrict__ zero,
                                  const float* __restrict__ W, float* __restrict__ Q,
                                  float* __restrict__ D, __half* __restrict__ Q16) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / K, k = i % K, g = g_idx[k];
    const float q = __fmul_rn(scale[g * N + n], __fsub_rn((float)codes[i], zero[g * N + n]));
    if (Q) Q[i] = q;
    if (D) D[i] = __fsub_rn(W[i], q);
    if (Q16) Q16[i] = __float2half_rn(q);
  }
}

__global__ void half_to_float_kernel(const __half* __restrict__ in, int64_t n,
                                     float* __restrict__ out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __half2float(in[i]);
}

// *out += the sum of every thread's s over the block (kThreads threads): warp shuffles, then
// the warps' partial sums in order, one atomic add per block.
__device__ void block_add(double s, double* __restrict__ out) {
  __shared__ double partial[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) t += partial[w];
    atomicAdd(out, t);
  }
}

__global__ void dot_add_kernel(const float* __restrict__ a, const float* __restrict__ b, int64_t n,
                               double* __restrict__ out) {
  double s = 0.0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    s += (double)a[i] * (double)b[i];
  block_add(s, out);
}

__global__ void sum_squares_kernel(const __half* __restrict__ x, int64_t n,
                                   double* __restrict__ out) {
  double s = 0.0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const double v = (double)__half2float(x[i]);
    s += v * v;
  }
  block_add(s, out);
}

}  // namespace

void find_params(const float* W, int64_t ld, int64_t N, int64_t K, int64_t c0, int64_t width,
                 int64_t groups, int64_t g0, int bits, bool sym, float mse, float* scale,
                 float* zero, int* bad, cudaStream_t s) {
  if (groups <= 0 || N <= 0) return;
  const float maxq = (float)((1 << bits) - 1);
  if (mse > 0.0f) {
    const int64_t pairs = groups * N;
    const unsigned blocks = (unsigned)(pairs < 65535 * 32 ? pairs : 65535 * 32);
    find_params_mse_kernel<<<blocks, kMseThreads, 0, s>>>(W, ld, N, K, c0, width, groups, g0,
                                                         maxq, sym, mse, scale, zero, bad);
    KESTREL_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t warps = groups * N;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  find_params_kernel<<<(unsigned)blocks, kThreads, 0, s>>>(W, ld, N, K, c0, width, groups, g0,
                                                         maxq, sym, scale, zero, bad);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void gather_columns(const float* W, int64_t N, int64_t K, const int32_t* src, const uint8_t* dead,
                    float* out, cudaStream_t s) {
  gather_columns_kernel<<<blocks_for(N * K), kThreads, 0, s>>>(W, N, K, src, dead, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void permute_damp_hessian(const float* H, int64_t K, const int32_t* perm, float damp, float* out,
                          cudaStream_t s) {
  permute_damp_kernel<<<blocks_for(K * K), kThreads, 0, s>>>(H, K, perm, damp, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void zero_lower(float* A, int64_t K, cudaStream_t s) {
  zero_lower_kernel<<<blocks_for(K * K), kThreads, 0, s>>>(A, K);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void gptq_block(const float* W, int64_t ld, int64_t N, int64_t i1, int cnt, const float* U,
                int64_t K, const int32_t* gcol, const float* scale, const float* zero, int bits,
                uint8_t* codes, float* E, cudaStream_t s) {
  if (cnt <= 0 || cnt > kMaxBlock)
    throw Error("gptq_block: " + std::to_string(cnt) + " columns per block; 1 to " +
                std::to_string(kMaxBlock) + " are supported");
  const size_t smem = (size_t)cnt * cnt * sizeof(float);
  // The 64 KiB square of U needs the opt-in above 48 KiB, on whichever device is current.
  cuda::ensure_dynamic_smem(gptq_block_kernel, smem, "gptq_block");
  const int64_t blocks = (N + kWarps - 1) / kWarps;
  gptq_block_kernel<<<(unsigned)blocks, kWarps * 32, smem, s>>>(
      W, ld, N, i1, cnt, U, K, gcol, scale, zero, (float)((1 << bits) - 1), codes, E);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void scatter_codes(const uint8_t* codes_p, int64_t N, int64_t K, const int32_t* perm,
                   uint8_t* codes, cudaStream_t s) {
  scatter_codes_kernel<<<blocks_for(N * K), kThreads, 0, s>>>(codes_p, N, K, perm, codes);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void rtn_codes(const float* W, int64_t N, int64_t K, const int32_t* g_idx, const float* scale,
               const float* zero, int bits, uint8_t* codes, cudaStream_t s) {
  rtn_codes_kernel<<<blocks_for(N * K), kThreads, 0, s>>>(W, N, K, g_idx, scale, zero,
                                                          (float)((1 << bits) - 1), codes);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void dequantize(const uint8_t* codes, int64_t N, int64_t K, const int32_t* g_idx,
                const float* scale, const float* zero, const float* W, float* Q, float* D,
                __half* Q16, cudaStream_t s) {
  dequantize_kernel<<<blocks_for(N * K), kThreads, 0, s>>>(codes, N, K, g_idx, scale, zero, W, Q,
                                                           D, Q16);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void half_to_float(const __half* in, int64_t n, float* out, cudaStream_t s) {
  half_to_float_kernel<<<blocks_for(n), kThreads, 0, s>>>(in, n, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void sum_squares(const __half* x, int64_t n, double* out, cudaStream_t s) {
  const int blocks = blocks_for(n) < 1024 ? blocks_for(n) : 1024;
  sum_squares_kernel<<<blocks, kThreads, 0, s>>>(x, n, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void dot_add(const float* a, const float* b, int64_t n, double* out, cudaStream_t s) {
  const int blocks = blocks_for(n) < 1024 ? blocks_for(n) : 1024;
  dot_add_kernel<<<blocks, kThreads, 0, s>>>(a, b, n, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::quant::kern
