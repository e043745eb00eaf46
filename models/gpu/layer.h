// One decoder layer over T consecutive tokens on the GPU: the layer of models/gpu/blocks.h run by
// RowsOps (models/gpu/layer_rows.cpp), the step of prompts and verify passes, exposed so that the quantizer's calibration runs the engine's own
// forward one layer at a time, with taps on the inputs of the linears (the GPU counterpart of
// DecoderCpu::layer_forward and its LayerTaps).
//
//   norm -> [tap QKV] qkv GEMM -> RoPE + KV write -> causal attention over the cache
//   -> [tap O] o GEMM (+ residual) -> norm -> [tap GateUp] gate|up GEMM -> SiLU*up (or fc1,
//   ReLU) -> [tap Down] down GEMM (+ residual), with the family's blocks as in the prefill
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <functional>
#include <optional>
#include <span>

#include "models/io/config.h"
#include "kernels/attention/kv_cache_cuda.h"
#include "kernels/gemm/gemm.h"
#include "models/cpu/decoder.h"
#include "models/gpu/weights.h"

namespace kestrel {

struct GpuSequence;  // models/gpu/decoder.h

// Activations of one layer step for up to `rows` tokens, all fp16 on the device.
// xb, att and act may be one buffer (of the largest of their widths), and qkv and gate_up
// another: layer_forward_rows is done with each before it writes the next.
struct LayerRowsScratch {
  __half* xb = nullptr;       // [rows, hidden] normalised block input
  __half* qkv = nullptr;      // [rows, q_dim + 2 * kv_dim]
  __half* att = nullptr;      // [rows, q_dim]
  __half* gate_up = nullptr;  // [rows, 2 * intermediate]
  __half* act = nullptr;      // [rows, intermediate]
  __half* weights = nullptr;  // dequantized GPTQ weight (quant_gemm_scratch_elems); unused
                              // when every linear is dense
  // The fused small-M GEMM (DecodeTuning::small_gemm_max_rows): steps of 3 .. small_max_rows
  // tokens run their whole quantized linears through it, in this workspace
  // (gemm_small_workspace_bytes of the largest call, zero-filled once). 0 = never.
  int small_max_rows = 0;
  void* small_ws = nullptr;
  size_t small_ws_bytes = 0;
  // [1] device: the first position, read by the kernels in place of layer_forward_rows' pos0,
  // so that a captured CUDA graph of the step (a speculative verify pass) replays at any
  // position. nullptr = pos0.
  const int* pos0 = nullptr;
};

// Observers of layer_forward_rows (the quantizer's calibration hooks).
struct GpuLayerTaps {
  // Receives the input x [T, K] (device, fp16) of each group's linears, ready in stream order:
  // work enqueued on the same stream reads it before the layer goes on.
  std::function<void(LinearGroup group, const __half* x, int T, int K)> input;
  // When set, the step returns as soon as this group's input has been handed over; x and the
  // cache are then left partly updated (the caller reruns from a saved copy).
  std::optional<LinearGroup> stop_after;
};

// x [T, hidden] (the residual stream, in and out) through layer L at positions pos0 ..
// pos0 + T - 1 (pos0 = *b.pos0 on the device where b.pos0 is set; the argument is then only
// checked to be >= 0); their K/V go into k_cache/v_cache ([ctx, kv_dim], this layer's), and
// token i attends causally over cache rows up to pos0 + i (Mistral's window applied).
// Enqueued on s; nothing in it synchronises, so that (without taps) it may be captured in a
// CUDA graph.
void layer_forward_rows(const ModelConfig& c, const GpuLayer& L, cuda::GemmRunner& gemm, __half* x,
                        int T, int pos0, __half* k_cache, __half* v_cache,
                        const LayerRowsScratch& b, cudaStream_t s,
                        const GpuLayerTaps* taps = nullptr);
// The same over this layer's caches in any types (kernels/attention/kv_cache_cuda.h): K and V
// rounded to them as they are written, read back dequantized by the attention.
void layer_forward_rows(const ModelConfig& c, const GpuLayer& L, cuda::GemmRunner& gemm, __half* x,
                        int T, int pos0, const cuda::KvCacheDev& k_cache,
                        const cuda::KvCacheDev& v_cache, const LayerRowsScratch& b,
                        cudaStream_t s, const GpuLayerTaps* taps = nullptr);

// The rows of a batched decode step (DecoderCuda::forward_batch): row i is one token of the
// sequence seqs[i] (device: its caches, table and workspace), at the position d_pos[i]
// (device). The attention runs the rows in groups of one grid bound each: the bound of the
// decode graph range (models/gpu/graphs.h) of the row's position, which its session's own decode
// step would launch, so that a row's arithmetic does not depend on the other rows and a session
// opened for a long context but early in it does not launch a block for every chunk of that
// context. d_order (device) lists the rows group after group; group g is d_order[begin, begin +
// count). types: the rows' caches' (the model's).
struct GpuBatchGroup {
  int begin = 0, count = 0, bound = 0;
};
struct GpuBatchRows {
  const cuda::KvBatchSeq* seqs = nullptr;
  const int* d_pos = nullptr;
  const int* d_order = nullptr;
  std::span<const GpuBatchGroup> groups;
  KvCacheTypes types;
  int heads_per_block = 0;  // DecodeTuning::attention_heads_per_block, as the decode step's
};
// One decoder layer (index `layer`) over T rows of T different sequences: the linears over all
// rows at once, as layer_forward_rows runs them (each weight read once for the T rows), and per
// row the RoPE, the K/V write and the attention over its own sequence's cache at its own
// position, as the decode step runs them. Enqueued on s, nothing synchronises.
void layer_forward_batch(const ModelConfig& c, const GpuLayer& L, int layer,
                         cuda::GemmRunner& gemm, __half* x, int T, const GpuBatchRows& rows,
                         const LayerRowsScratch& b, cudaStream_t s);

// y [rows, hidden] = the family's norm of x (RMSNorm, or LayerNorm with bias b after x += add,
// add being the bias a residual GEMM left out: add_layer_norm_f16).
void norm_rows(const ModelConfig& c, __half* x, const __half* add, const __half* w,
               const __half* b, int rows, __half* y, cudaStream_t s);

// Fewer tokens than this run as batch-1 GEMVs even with the fused small-M GEMM on: two GEMVs
// cost less than one fused pass at its current efficiency (docs/performance.md).
constexpr int kSmallGemmMinRows = 3;

}  // namespace kestrel
