// What a launch of the batch-1 GEMV kernels is given (KParams), filled in by gemv.cu from a
// GemvWeight, x, y, GemvInput and GemvEpilogue, and read by every part of the device code:
// weight_decode.cuh (the weights), input_staging.cuh (x and the prologue), epilogue.cuh and the
// kernels' stores (y and the epilogue), gemv_kernel.cuh (all of it). The fused ops sit in two
// structs of their own so that each part visibly reads only its side, and so that the
// specialized kernels (gemv_kernel.cuh, specialize) rule out each side's optional inputs in one
// place. Device code: include from .cu files only.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::gemv_detail {

// The op before the GEMV, fused into the staging of x (GemvInput): RMSNorm or LayerNorm with
// these weights, or SiLU(gate) * up over an x that holds [gate | up]; and act-order's gather,
// x'[k] = x[perm[k]], the last step of the staging.
struct Prologue {
  const int32_t* perm;   // [nch * C] (the weight's permutation), or nullptr
  const __half* norm_w;  // nullptr = no norm
  float eps;
  bool silu_mul;
  bool layer_norm;       // with norm_w: LayerNorm, x <- (x - mean) * rstd * norm_w + norm_b
  const __half* norm_b;  // LayerNorm's bias, or nullptr
};

// The op after the GEMV, fused into the store of each row (GemvEpilogue).
struct Epilogue {
  const __half* residual;  // y[i] = (W x)_i + residual[i]; may alias y; nullptr = none
  // Added after the residual (GemvEpilogue::bias, ::relu): y[i] = (W x)_i + residual + bias[i],
  // then max(., 0) with relu. Only with a residual (a bias alone is passed as the residual).
  const __half* bias;
  bool relu;
  // Quantized kernel: y[i] = SiLU(row i) * row i + pair, for i < N / 2, over a weight whose rows
  // are [gate | up] (pair = N / 2); 0 = none.
  int silu_pair;
  // With it, or with res_index, where output i is stored: y[y_index[i]] (the next GEMV's
  // act-order permutation, inverted, so that it stages its x without a gather); nullptr = y[i].
  const int32_t* y_index;
  // Where row i's residual is read: residual[res_index[i]] (the residual stream held in another
  // permutation, GemvEpilogue::residual_index); nullptr = residual[i]. Set with y_index.
  const int32_t* res_index;
};

struct KParams {
  // The weights: repacked GPTQ rows (GemvWeight), or fp16 rows as stored.
  const uint4* codes;      // row n starts at codes + n * row_stride
  int64_t row_stride;      // uint4 per row: planes * nch
  const __half* scales;    // [N][G]
  const uint8_t* zeros;    // [N][G] or nullptr
  int N, K, nch, G;        // nch: units per row (quantized), 16-byte chunks (fp16)
  int zero_const, zero_offset;
  int k_split, tiles;      // fp16 kernel: warps that share a row, tiles of rows
  const __half* x;         // [K] ([gate | up], 2K, with pro.silu_mul)
  __half* y;               // [N] ([N / 2] with epi.silu_pair)
  Prologue pro;
  Epilogue epi;
};

namespace {

// SiLU(g) * u in fp32, as the stand-alone kernel computes it (kernels/activation): shared by
// the SiLU input op of the staging and the SiLU-pair epilogue, which must agree exactly (the
// pair epilogue computes what the GEMV writing [gate | up] followed by a SiLU staging does).
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

}  // namespace
}  // namespace kestrel::cuda::gemv_detail
