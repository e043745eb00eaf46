// The CUDA kernels of the GPU quantizer (gptq_cuda.cpp drives them). Each is one step of
// gptq.cpp's gptq_quantize / rtn_quantize, written with the same float operations in the same
// order, so that equal inputs give bit-equal outputs; the tests compare the whole quantization
// with the CPU implementation. All pointers are device pointers; every matrix is row-major.
// Host-facing: includable from plain C++.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::quant::kern {

// Columns per lazy block the column-loop kernel holds (4 per lane of a warp).
constexpr int kMaxBlock = 128;

// find_params (gptq.h) for `groups` consecutive column ranges of every row of W [N, ld]:
// range i is [c0 + i * width, min(c0 + (i + 1) * width, K)); its parameters go to
// scale[(g0 + i) * N + n] and zero[(g0 + i) * N + n]. A full range whose scale is not finite
// sets *bad. With mse > 0, the range search: each range's 80 shrunk fits scored by
// sum |w - q(w)|^mse in the CPU's order; the scores can differ from the CPU's only where a
// term's float power does (glibc's powf is not correctly rounded), so a different shrink is
// chosen only where two shrinks' sums tie to about 1e-7.
void find_params(const float* W, int64_t ld, int64_t N, int64_t K, int64_t c0, int64_t width,
                 int64_t groups, int64_t g0, int bits, bool sym, float mse, float* scale,
                 float* zero, int* bad, cudaStream_t s);

// out [N, K]: out[n, j] = W[n, src[j]] (src nullptr: j), or 0 where dead[that column] is set
// (dead nullptr: none).
void gather_columns(const float* W, int64_t N, int64_t K, const int32_t* src, const uint8_t* dead,
                    float* out, cudaStream_t s);

// out [K, K] = H[perm, perm], each diagonal entry v becoming (v == 0 ? 1 : v) + damp: the dead
// inputs' fix, the permutation and the damping of gptq_quantize in one pass.
void permute_damp_hessian(const float* H, int64_t K, const int32_t* perm, float damp, float* out,
                          cudaStream_t s);

// Zeroes the strictly lower triangle of A [K, K].
void zero_lower(float* A, int64_t K, cudaStream_t s);

// One lazy block: columns [i1, i1 + cnt) (cnt <= kMaxBlock) of W [N, ld] in processing order,
// for every row, as gptq_quantize's inner loop: each column quantized with the parameters of
// its group gcol[col] (scale/zero [G, N]), its error divided by U[col, col] fed to the block's
// later columns through U's row. Writes codes [N, K] at the block's columns and the scaled
// errors E [N, cnt]. W itself is only read (the block's columns are done after it).
void gptq_block(const float* W, int64_t ld, int64_t N, int64_t i1, int cnt, const float* U,
                int64_t K, const int32_t* gcol, const float* scale, const float* zero, int bits,
                uint8_t* codes, float* E, cudaStream_t s);

// codes [N, K]: codes[n, perm[j]] = codes_p[n, j] (act-order's permutation undone).
void scatter_codes(const uint8_t* codes_p, int64_t N, int64_t K, const int32_t* perm,
                   uint8_t* codes, cudaStream_t s);

// Round-to-nearest codes [N, K] of W with the parameters of group g_idx[k] of each column.
void rtn_codes(const float* W, int64_t N, int64_t K, const int32_t* g_idx, const float* scale,
               const float* zero, int bits, uint8_t* codes, cudaStream_t s);

// q = scale[g_idx[k], n] * (codes[n, k] - zero[g_idx[k], n]) for every weight, written as any
// of: Q fp32 [N, K], D = W - q fp32 [N, K] (needs W), q rounded to fp16 [N, K] (nullptr: not
// written).
void dequantize(const uint8_t* codes, int64_t N, int64_t K, const int32_t* g_idx,
                const float* scale, const float* zero, const float* W, float* Q, float* D,
                __half* Q16, cudaStream_t s);

// out [n] = float(in [n]).
void half_to_float(const __half* in, int64_t n, float* out, cudaStream_t s);

// *out += sum a[i] b[i] over n elements, accumulated in double.
void dot_add(const float* a, const float* b, int64_t n, double* out, cudaStream_t s);

// *out += sum x[i]^2 over n fp16 elements, accumulated in double.
void sum_squares(const __half* x, int64_t n, double* out, cudaStream_t s);

}  // namespace kestrel::quant::kern
