// Batch-1 linear layers on the GPU (decode): y = W x (+ residual), at the memory-bandwidth limit.
//
// Two families:
//   gemv      GPTQ weights (2, 3, 4, 8 bits; group 32/64/128/per-row or any multiple of 32;
//             sym/asym; act-order), repacked once at load by gemv_prepare into the layout the
//             kernels stream (kernels/gemv/weight_decode.cuh draws it).
//   gemv_f16  plain fp16 weights [N, K] row-major (lm_head, unquantized linears).
// FP16 activations, FP32 accumulation across K, FP16 output.
//
// Host-facing: includable from plain C++ (only the CUDA runtime and fp16 headers).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/gptq/gptq_format.h"

namespace kestrel::cuda {

// How a GEMV is spread over the GPU; a benchmark or a test may override it. Zero fields mean
// "choose": gemv_prepare sets k_split, and each quantized gemv call chooses its grid (at most
// the resident blocks of the kernel the call takes, whose block size depends on the fused ops
// and the shape).
struct GemvLaunch {
  int k_split = 0;  // fp16 kernel: warps of a block that share each row, each summing a slice
                    // of K: 1, 2, 4, 8 (the quantized kernel gives each lane whole units of K)
  int grid = 0;     // blocks (x is staged in shared memory once per block); each warp takes a
                    // run of rows (quantized) or blocks loop over row tiles (fp16);
                    // 0 = chosen (at most the resident blocks)
  bool pdl = true;  // programmatic dependent launch: the kernel may start (and prefetch its
                    // weights into L2) while the previous kernel in the stream drains
  // Quantized kernel only (the model's DecodeTuning sets these at load):
  int block_warps = 0;      // warps per block of the specialized kernels: 0 = by the shape, 8, 16
  // Symmetric weights run the kernels compiled for their format and fused ops
  // (gemv_kernel.cuh); false runs the one kernel that tests them at run time (what asymmetric
  // weights run). Both compute the same values, but for the fused RMSNorm
  // where the specialized kernel runs blocks of 8 warps (its sum of squares in another order).
  bool specialized = true;
};

// A GPTQ linear (or several fused along N) repacked for the GEMV kernels. Owns one device
// allocation; release it with gemv_free.
struct GemvWeight {
  int bits = 0;
  int group_size = 0;     // effective group size of the repacked scales: 32, 64, 128, 0 = per row
  int64_t N = 0, K = 0;
  bool has_perm = false;  // act-order: the K axis was permuted so that groups are contiguous

  // Layout (weight_decode.cuh): each row is `planes` planes of `chunks` 16-byte chunks (a whole
  // number of units: 4 chunks, or one 3-bit chunk).
  int64_t chunks = 0;
  int planes = 0;
  int64_t groups = 0;     // scale/zero entries per row (padded to a multiple of 8)
  int zero_const = 0;     // zero point of every group when zeros == nullptr
  int zero_offset = 0;    // z = zeros[i] + zero_offset otherwise

  const uint4* codes = nullptr;    // [N][planes * chunks] 16-byte chunks
  const __half* scales = nullptr;  // [N][groups]
  const uint8_t* zeros = nullptr;  // [N][groups] stored zero points, or nullptr (all equal)
  const int32_t* perm = nullptr;   // [chunks * codes per chunk]: x index of each permuted k
  void* device = nullptr;          // the device memory holding all of the above
  size_t device_bytes = 0;
  bool owns_device = true;         // false: placed in the caller's memory (gemv_free keeps it)

  size_t smem_bytes = 0;  // dynamic shared memory of one block
  GemvLaunch launch;      // k_split set at prepare; grid 0 (chosen per call) unless overridden

  // Bytes one gemv call must move through device memory: weights (codes, scales, zeros),
  // perm, x and y. The denominator of achieved-bandwidth figures.
  size_t bytes_moved() const;
};

// Repacks one GPTQ linear, or several that share the input (q/k/v, gate/up) fused along N in
// the given order, and uploads it on stream s (synchronises s before returning). All parts
// must agree on K, bits, group_size, zero_offset and g_idx; anything else, or a format the
// kernels do not support, throws kestrel::Error naming the part and the mismatch.
// qzeros rows hold ceil(N * bits / 32) words (N * bits / 32 whenever that divides).
GemvWeight gemv_prepare(const std::vector<gptq::GptqView>& parts, cudaStream_t s);

// The same, placed in caller-owned device memory [dst, dst + capacity) (16-byte aligned), which
// must hold the weight (at most gemv_device_bytes_bound); the weight does not own it. Lets a
// loader put every weight of a model in one allocation: cudaMalloc rounds each allocation up to
// 2 MiB pages, 1.2 MiB lost per Llama-2-7B linear (150 MiB over the model, measured).
GemvWeight gemv_prepare(const std::vector<gptq::GptqView>& parts, cudaStream_t s, void* dst,
                        size_t capacity);

// Whether every zero point of these parts (each group inside K, each output) is the same, as
// symmetric GPTQ writes them: gemv_prepare then stores none and the kernel takes the one value
// as a constant. Reads the views' format fields and qzeros only; false for a view without
// qzeros or of bits other than 2, 3, 4, 8.
bool gemv_zero_points_uniform(const std::vector<gptq::GptqView>& parts);

// An upper bound of GemvWeight::device_bytes for a weight of these parts (N their summed
// outputs), from the format: exact but for the permutation under act_order, counted as if
// present (K * 4 bytes), and the zero points, counted unless zero_points is false (pass
// !gemv_zero_points_uniform(parts): a 4-bit g128 weight's zero points are 1.6% of its bytes).
// 0 for a format gemv_prepare refuses.
size_t gemv_device_bytes_bound(int bits, int group_size, int64_t N, int64_t K, bool act_order,
                               bool zero_points = true);

// Frees the device memory of w (unless placed in the caller's) and clears it. Safe on an empty
// or already freed weight.
void gemv_free(GemvWeight& w);

// Act-order weights stage x gathered through their permutation (x'[k] = x[perm[k]]): each
// block reads the K-entry permutation and gathers x from shared memory, which costs most where
// K is large (the 7B's down GEMV, K = 11008; measured: docs/gemv-notes.md). Where the GEMV
// before writes x itself, it can write x' instead:
//   gemv_input_index(w, s): where each x[i] goes, idx[perm[k]] = k for k < K (host vector of K;
//                           copies w's permutation back, synchronising s); identity without
//                           act-order.
//   gemv_input_permuted(w): w taking x' (no permutation), sharing w's memory (not owned).
std::vector<int32_t> gemv_input_index(const GemvWeight& w, cudaStream_t s);
GemvWeight gemv_input_permuted(const GemvWeight& w);
// A second, independent device copy of w (benchmarks rotate copies to stay out of L2).
GemvWeight gemv_clone(const GemvWeight& w, cudaStream_t s);

// The op before a GEMV, fused into its staging of x (each block reads all of x anyway), which
// saves a kernel launch and a round trip of x through memory:
//   norm_w:   x <- RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * norm_w   (norm_w [K])
//     with layer_norm: x <- LayerNorm(x) = (x - mean(x)) * rsqrt(var(x) + eps) * norm_w + norm_b
//             (norm_b [K], or nullptr for none; OPT's norms)
//   silu_mul: x holds [gate | up], 2K values: x <- silu(gate) * up
// Each computes what the stand-alone kernel does (fp32 math, the staged value rounded to fp16;
// LayerNorm's variance in one pass over x shifted by x[0], not two: input_staging.cuh says why).
// One at a time.
struct GemvInput {
  const __half* norm_w = nullptr;
  float eps = 0.f;
  bool silu_mul = false;
  bool layer_norm = false;
  const __half* norm_b = nullptr;
};

// The op after a GEMV, fused into its epilogue (saves the next kernel staging 2N values and
// computing them in every block):
//   silu_mul: W holds [gate | up] (N even); y[i] = silu(g_i) * u_i for i < N/2, with g_i and
//             u_i rounded to fp16 first: exactly what the GEMV writing [gate | up] followed by a
//             GemvInput::silu_mul staging computes. Quantized weights only, no residual.
//   out_index (with silu_mul): output i is stored at y[out_index[i]], not y[i]. Given the
//             next GEMV's gemv_input_index, y is that GEMV's x already in its act-order
//             permutation, for its gemv_input_permuted view to stage without a gather.
//   out_index and residual_index (with a residual, no silu_mul): y[out_index[i]] = (W x)_i +
//             residual[residual_index[i]], y and residual in different buffers: the residual
//             stream read in one permutation and written in another (the decode step keeps it
//             in the act-order permutation of the GEMV that reads it next).
//   bias:     y[i] = (W x)_i + residual + bias[i] (bias [N]): a linear's bias beside the
//             residual stream (OPT's o and fc2). Without a residual, the bias is passed as it.
//   relu:     y[i] = max(., 0) after the bias (OPT's fc1, whose output fc2 stages as it is).
//             Not with silu_mul or out_index.
struct GemvEpilogue {
  bool silu_mul = false;
  const int32_t* out_index = nullptr;       // device, [N / 2] with silu_mul, else [N]
  const int32_t* residual_index = nullptr;  // device, [N]
  const __half* bias = nullptr;             // device, [N]
  bool relu = false;
};

// y[N] = W x + residual. x [K], residual [N] or nullptr; y may alias residual (not x).
// Pointers are device pointers; x must be 16-byte aligned when K is a multiple of 8.
void gemv(const GemvWeight& w, const __half* x, __half* y, const __half* residual,
          cudaStream_t s, GemvInput in = {}, GemvEpilogue out = {});

// y[N] = W x + residual for fp16 W [N, K] row-major. K must be a multiple of 8 and W and x
// 16-byte aligned (true of every checkpoint linear); otherwise throws kestrel::Error. Of the
// epilogues, bias and relu apply.
void gemv_f16(const __half* W, const __half* x, __half* y, int64_t N, int64_t K,
              const __half* residual, cudaStream_t s, GemvLaunch launch = {}, GemvInput in = {},
              GemvEpilogue out = {});

}  // namespace kestrel::cuda
