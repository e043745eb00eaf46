// A Llama-shaped model's weights on the GPU, and the loader that streams them there from a
// checkpoint: each linear fused with its neighbours of the same input where their formats
// agree, GPTQ weights repacked for the GEMV, everything placed in one arena.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <vector>

#include "kernels/gemv/gemv.h"
#include "models/gpu/memory.h"
#include "models/io/model_spec.h"
#include "models/tuning.h"

namespace kestrel {

// One linear layer on the GPU, or several fused along N (q|k|v, gate|up): GPTQ parts run as
// one fused dequant-GEMV; dense FP16 parts as one FP16 GEMV over concatenated rows.
struct GpuLinear {
  int64_t N = 0, K = 0;
  bool quantized = false;
  cuda::GemvWeight q;         // quantized
  __half* dense = nullptr;    // [N, K] FP16, dense
  // Linears of one input that could not be fused (GPTQ formats or act-order permutations that
  // differ): each keeps its own format and runs into its columns of y, one after the other.
  // Neither q nor dense is set then.
  std::vector<GpuLinear> parts;
  // [N] over all parts (q|k|v biases), or nullptr. run() does not add it: callers pass it as
  // the residual where there is none, or add it where the stream is next normalised.
  __half* bias = nullptr;
  size_t bytes = 0;

  // Bytes one run moves through device memory (weights, x, y).
  double bytes_moved() const;
  // y [N] = W x (+ residual [N]; y may alias residual)
  // `in` fuses the op before the linear (RMSNorm or LayerNorm, SiLU * up) into its staging of
  // x; `out` the op after it (a bias, ReLU; SiLU * up quantized only: see can_silu_epilogue).
  void run(const __half* x, __half* y, const __half* residual, cudaStream_t s,
           cuda::GemvInput in = {}, cuda::GemvEpilogue out = {}) const;
  // Whether run can apply SiLU(gate) * up in its epilogue (a quantized fused [gate | up]).
  bool can_silu_epilogue() const { return quantized; }
  // The single linears that make it up: itself, or its parts.
  std::vector<const GpuLinear*> leaves() const;
};

struct GpuLayer {
  __half* input_norm = nullptr;  // [hidden]
  __half* post_norm = nullptr;   // [hidden]
  __half* input_norm_bias = nullptr;  // [hidden] LayerNorm's, or nullptr
  __half* post_norm_bias = nullptr;   // [hidden]
  __half* q_norm = nullptr;      // [head_dim] Qwen3's per-head norms, or nullptr
  __half* k_norm = nullptr;      // [head_dim]
  GpuLinear qkv;                 // [q_dim + 2 * kv_dim, hidden]
  GpuLinear o;                   // [hidden, q_dim]
  GpuLinear gate_up;             // [2 * intermediate, hidden]; a ReLU MLP's fc1 [intermediate, hidden]
  GpuLinear down;                // [hidden, intermediate]
  // Act-order down weights (quantized gate|up): the decode step's gate|up GEMV stores SiLU *
  // up at down_x_index (cuda::gemv_input_index), so that down_x_permuted (down's memory, no
  // permutation) stages its x without a gather. nullptr otherwise.
  const int32_t* down_x_index = nullptr;  // [intermediate]
  GpuLinear down_x_permuted;
  // Act-order models (models/gpu/act_order.h): the decode step keeps the residual
  // stream in the act-order permutation of the GEMV that reads it next, so that qkv and gate|up
  // stage x without a gather: x before qkv in qkv's permutation, after o in gate|up's, after
  // down in the next layer's qkv's (natural after the last layer). o and down read the
  // residual through one index and store through another, into the other buffer. Unset
  // (order.on false) otherwise.
  struct StreamOrder {
    bool on = false;
    const __half* input_norm = nullptr;  // [hidden] input_norm in qkv's permutation
    const __half* post_norm = nullptr;   // [hidden] post_norm in gate|up's
    cuda::GemvWeight qkv, gate_up;       // gemv_input_permuted views of qkv and gate|up
    // o's input, attention's output, stored in o's permutation where o has one (att_out, and
    // o its gemv_input_permuted view); else att_out nullptr and o is o's weight.
    const int32_t* att_out = nullptr;    // [q_dim]
    cuda::GemvWeight o;
    const int32_t* o_residual = nullptr;     // [hidden] where o reads its row i's residual
    const int32_t* o_out = nullptr;          // [hidden] where o stores row i
    const int32_t* down_residual = nullptr;  // [hidden]
    const int32_t* down_out = nullptr;       // [hidden]
  } order;
};

struct GpuWeights {
  __half* embed = nullptr;       // [vocab, hidden]
  // [hidden]: the decode step's embedding row in layer 0's qkv permutation (GpuLayer::order);
  // nullptr = natural order.
  const int32_t* embed_perm = nullptr;
  __half* final_norm = nullptr;  // [hidden]
  __half* final_norm_bias = nullptr;  // [hidden] LayerNorm's, or nullptr
  __half* positions = nullptr;   // [max_pos + offset, hidden] learned positions, or nullptr
  __half* lm_head = nullptr;     // [vocab, hidden] (== embed when tied)
  std::vector<GpuLayer> layers;
};

// Device bytes load_gpu_weights places: what its arena must hold.
size_t gpu_weights_bound(const ModelSpec& spec);

// Uploads every weight of `spec` into `arena` (reserved from gpu_weights_bound), tensor by
// tensor with a progress bar unless quiet, and sets the GEMVs' launch knobs from `tuning`.
// `bytes` receives the weights' device bytes. The copies may still be in flight on the legacy
// stream when it returns.
GpuWeights load_gpu_weights(const ModelSpec& spec, const DecodeTuning& tuning, DeviceArena& arena,
                            cudaStream_t s, bool quiet, size_t& bytes);

}  // namespace kestrel
