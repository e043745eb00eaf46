// Linear layers over many tokens at once (prefill): y [M, N] = x [M, K] W^T (+ residual), on the
// tensor cores.
//
// A GPTQ weight (in the GEMV kernels' repacked layout, kernels/gemv/gemv.h) is dequantized into
// an FP16 scratch matrix [N, K] and multiplied with cuBLASLt (FP16 operands, FP32 accumulation).
// The dequantization moves 2.5 bytes per 4-bit weight; the GEMM does 2 M flops per weight, so
// from a few dozen tokens on the product dominates and the quantized path runs at nearly the
// speed of a plain FP16 GEMM (tools/bench_gemm measures both in one run). Below a crossover in
// M the dequantization costs more than M batch-1 GEMVs over the packed codes, and the launcher
// runs those instead.
//
// act-order: the repacked codes run along the permuted K axis (groups contiguous), so the
// dequantized matrix is W[:, perm] and x is gathered through the same permutation first
// (M x K halves, small next to the weight).
//
// Host-facing: includable from plain C++.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "kernels/gemv/gemv.h"

namespace kestrel::cuda {

// Rows from which the dequantize + GEMM path beats M GEMVs over the packed codes. Up to a few
// dozen rows the GEMM path costs about the same at any M (the dequantization and the weight
// read dominate), while every row run as a GEMV streams the packed weights again; on the
// Llama-2-7B shapes at 4-bit g128 the GEMVs cost more from M = 6 on (kestrel-bench-gemm
// measures both; docs/performance.md).
constexpr int kGemmMinRows = 6;

// out [N, K] (row-major, fp16) = the weight dequantized, (q - z) * s rounded once to fp16 (the
// value the GEMV kernels use for 4- and 8-bit weights), along the weight's own K order
// (permuted under act-order, see w.perm). out holds out_elems halves, at least N * K (checked:
// the kernel writes all of them), and is 16-byte aligned. The checks come before any CUDA call.
void dequantize_f16(const GemvWeight& w, __half* out, size_t out_elems, cudaStream_t s);

// out [M, K] = x [M, K] with columns gathered: out[m][j] = x[m][perm[j]].
void gather_columns_f16(const __half* x, const int32_t* perm, int64_t M, int64_t K, __half* out,
                        cudaStream_t s);

// cuBLASLt's workspace (32 MiB lets it pick any Hopper algorithm).
constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;
// Rows of a quantized weight dequantized at once: at most this many halves (32 MiB).
constexpr size_t kDequantSliceHalves = size_t(16) << 20;

// The device memory of a GemmRunner: cuBLASLt's workspace, and the size of the dequantized
// weight slice quant_gemm works in (its scratch: quant_gemm_scratch_elems).
struct GemmMemory {
  size_t workspace_bytes = kGemmWorkspaceBytes;
  size_t slice_halves = kDequantSliceHalves;
};

// cuBLASLt with a workspace and a cache of the chosen algorithm per shape and alignment.
// Not thread-safe per instance beyond the internal cache lock; one per engine.
class GemmRunner {
 public:
  explicit GemmRunner(GemmMemory mem = {});
  const GemmMemory& memory() const { return mem_; }
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // y [M, N] = x [M, K] W [N, K]^T + residual [M, N] (nullptr: none; may alias y). FP16 in
  // and out, FP32 accumulation. ldy: elements between rows of y and of residual (0 = N; larger
  // when y is a column slice of a wider matrix).
  void gemm(const __half* x, const __half* W, int64_t M, int64_t N, int64_t K, __half* y,
            const __half* residual, cudaStream_t s, int64_t ldy = 0);
  // The same with an FP32 result (the logits of the output head): y [M, N] fp32.
  void gemm_f32(const __half* x, const __half* W, int64_t M, int64_t N, int64_t K, float* y,
                cudaStream_t s);

 private:
  struct Plan;
  void run(const void* x, const void* W, int64_t M, int64_t N, int64_t K, void* y,
           const void* residual, bool f32_out, cudaStream_t s, int64_t ldy);
  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  GemmMemory mem_;
  std::mutex mu_;
  // (M, N, K, ldy, f32 out, alignments of W, x, y)
  using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int, int, int, int>;
  std::map<PlanKey, std::shared_ptr<Plan>> plans_;
};

// Output rows of a quantized weight dequantized at once by quant_gemm: the scratch holds at
// most slice_halves of them (a multiple of 128 rows, at least 128), so a prompt's scratch is not
// the largest fused weight in fp16 (Llama-2-7B gate|up: 180 MB; GPU memory target: weights + KV
// cache + 5%), and each slice is its own GEMM into a column slice of y.
int64_t dequant_slice_rows(const GemvWeight& w, size_t slice_halves = kDequantSliceHalves);

// FP16 scratch a quantized linear needs for up to max_rows rows: one dequantized slice of the
// weight and, under act-order, the gathered input. In halves.
size_t quant_gemm_scratch_elems(const GemvWeight& w, int64_t max_rows,
                                size_t slice_halves = kDequantSliceHalves);

// y [M, N] = x [M, K] W^T + residual through dequantize + GEMM, whatever M, in slices of
// r.memory().slice_halves. scratch holds quant_gemm_scratch_elems(w, M, that) halves (16-byte
// aligned). ldy: elements between rows of y and of residual (0 = N; larger when y is a column
// slice of a wider matrix, as for the parts of a linear that could not be fused).
void quant_gemm(GemmRunner& r, const GemvWeight& w, const __half* x, int64_t M, __half* y,
                const __half* residual, __half* scratch, cudaStream_t s, int64_t ldy = 0);

// As quant_gemm, but M < min_gemm_rows runs M batch-1 GEMVs (no scratch touched).
void quant_linear_rows(GemmRunner& r, const GemvWeight& w, const __half* x, int64_t M, __half* y,
                       const __half* residual, __half* scratch, cudaStream_t s, int64_t ldy = 0,
                       int min_gemm_rows = kGemmMinRows);

// Dense FP16 W [N, K]: M < min_gemm_rows runs batch-1 GEMVs, otherwise one GEMM. ldy as above.
void dense_linear_rows(GemmRunner& r, const __half* W, int64_t N, int64_t K, const __half* x,
                       int64_t M, __half* y, const __half* residual, cudaStream_t s,
                       int64_t ldy = 0, int min_gemm_rows = kGemmMinRows);

}  // namespace kestrel::cuda
