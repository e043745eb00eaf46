// Linear layers over a few tokens (M = 1..64): y [M, N] = x [M, K] W^T (+ epilogue) with the
// GPTQ weight dequantized in registers and multiplied on the tensor cores, streaming the packed
// weight once (Marlin's idea, on the GEMV kernels' own layout: no second copy of the weights).
// Between the batch-1 GEMVs (kernels/gemv/gemv.h, M GEMVs read the weight M times) and the
// dequantize + cuBLASLt path (kernels/gemm/gemm.h, which writes and reads an FP16 copy of the
// weight). Design: docs/gemm-small.md.
//
// Host-facing: includable from plain C++.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gemv/gemv.h"

namespace kestrel::cuda {

// The largest token count gemm_small takes (8 n-tiles of 8 tokens).
constexpr int kGemmSmallMaxRows = 64;

// How a call is spread over the GPU: the launch plan. Every field 0 (false) is chosen by the
// planner (docs/gemm-small.md, "The launch plan"); a benchmark (kestrel-bench-gemm
// --fused-sweep) or a test may set any of them. None of them changes the result beyond the
// order of fp32 sums (split-K). A plan that does not fit (shared memory, a split count past
// the stages) is refused with kestrel::Error.
struct GemmSmallLaunch {
  int splits = 0;       // split-K ranges per row block (1 .. the weight's stages of 512 codes,
                        // at most 16); 0 = chosen to fill the SMs
  int warps = 0;        // warps per block, 16 weight rows each (8 SiLU pairs): 2, 4 or 8;
                        // 0 = 8 (4 at 8 bits)
  int stages = 0;       // depth of the cp.async ring of weight stages: 2 .. 8; 0 = 4 at up to
                        // 16 tokens a block, 3 at 32, 2 at 64
  int token_tiles = 0;  // n-tiles of 8 tokens a block computes: 1, 2, 4, 8; fewer than M needs
                        // runs the tokens as groups of blocks side by side over the same rows
                        // (each dequantizes the weights again; they read them from L2);
                        // 0 = all of M in one block
  bool x_once = false;  // x of a block's whole K range staged into shared memory before the
                        // first stage, not with each stage (needs room for all of it)
  bool pdl = true;      // programmatic dependent launch (the weight loads start before the
                        // previous kernel in the stream ends)
  bool stream = false;  // the streaming kernel (gemm_stream_kernel.cuh): each warp loads its
                        // rows' weights straight into registers, no shared-memory ring; 2- and
                        // 4-bit weights, M <= 16; x is staged once (x_once), `stages` unused
  int k_slices = 0;     // with stream: warps of a block that share one m-tile, each a slice of
                        // the block's stages (1, 2, 4, 8; at most warps); 0 = 2
};

// The plan a gemm_small call of M tokens on w makes for `launch`: every 0 field resolved (for
// the current device). Throws kestrel::Error, as the call would, for arguments or a plan it
// refuses. Queries the device.
GemmSmallLaunch gemm_small_plan(const GemvWeight& w, int64_t M, GemmSmallLaunch launch = {},
                                GemvEpilogue out = {});

// Bytes of device workspace a gemm_small call of M tokens on w needs (split-K partial sums and
// their counters; act-order, or K not a multiple of 8: x gathered into its permuted, padded
// layout),
// for the current device and this launch. 0 when the call needs none. Queries the device.
size_t gemm_small_workspace_bytes(const GemvWeight& w, int64_t M, GemmSmallLaunch launch = {},
                                  GemvEpilogue out = {});

// y [M, N] = x [M, K] W^T + residual (+ bias, ReLU), or with out.silu_mul over a [gate | up]
// weight y [M, N/2] = silu(gate) * up, each output as the GEMV computes it (gemv.h's
// GemvEpilogue: the same rounding of gate and up, the same order of residual and bias).
//   x [M, K], y [M, N] (or [M, N/2]), residual [M, N] or nullptr (may alias y, not x),
//   row-major, x contiguous; device pointers, x 16-byte aligned. M in 1 .. kGemmSmallMaxRows.
//   ldy: elements between rows of y and of residual (0 = their columns, N or N/2; larger when
//        y is a column slice of a wider matrix, as for the parts of a linear that could not be
//        fused, each of which runs into its columns of the layer's output).
//   out: silu_mul, bias and relu as in GemvEpilogue (silu_mul without residual, bias or relu);
//        out_index and residual_index are not supported.
//   workspace: gemm_small_workspace_bytes(w, M, launch, out) bytes, 16-byte aligned
//        (nullptr when that is 0), zero-filled once when allocated: every call leaves its
//        split-K counters at zero again. Calls of any M, weight and plan may share one (as
//        large as the largest they need): the counters have a fixed place at its start that
//        no call's other data overlaps. Calls that share one may not run concurrently.
// The argument checks come before any CUDA call and throw kestrel::Error with one line; the
// size of the workspace is checked once the launch is planned (that queries the device).
void gemm_small(const GemvWeight& w, const __half* x, int64_t M, __half* y,
                const __half* residual, void* workspace, size_t workspace_bytes, cudaStream_t s,
                GemvEpilogue out = {}, GemmSmallLaunch launch = {}, int64_t ldy = 0);

}  // namespace kestrel::cuda
