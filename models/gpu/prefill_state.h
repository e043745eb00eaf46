// The prefill's scratch (DecoderCuda::PrefillState): one chunk's activations, the
// dequantization scratch, the fused small-M GEMM's workspace and the cuBLASLt state, shared by
// every session of a model. Planned and made in models/gpu/prefill_plan.cpp, used by
// prefill.cpp and verify.cpp. Internal to models/gpu.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/gemm/gemm.h"
#include "models/gpu/decoder.h"
#include "models/gpu/memory.h"

namespace kestrel {

// Activations of one chunk, the dequantization scratch and the cuBLASLt state. The layer's
// buffers share memory where their lives do not overlap (LayerRowsScratch): xb, att and act are
// one buffer, qkv and gate_up another.
struct DecoderCuda::PrefillState {
  explicit PrefillState(cuda::GemmMemory mem) : gemm(mem) {}
  int rows = 0;                    // chunk capacity in tokens
  cuda::GemmRunner gemm;
  DeviceMemory mem;
  int* tokens = nullptr;           // [rows]
  int* targets = nullptr;          // [rows]
  float* nll = nullptr;            // [rows]
  __half* x = nullptr;             // [rows, hidden] residual stream
  __half* xb = nullptr;            // [rows, hidden] normalised block input (xb_att_act_cols)
  __half* qkv = nullptr;           // [rows, q_dim + 2 * kv_dim] (qkv_gate_up_cols)
  __half* att = nullptr;           // [rows, q_dim] (= xb)
  __half* gate_up = nullptr;       // [rows, 2 * intermediate] (= qkv)
  __half* act = nullptr;           // [rows, intermediate] (= xb)
  __half* scratch = nullptr;       // dequantized weight (+ gathered input under act-order)
  float* logits = nullptr;         // [rows, vocab] or [1, vocab] until all rows are wanted
  int logits_rows = 0;
  int small_max_rows = 0;          // the fused small-M GEMM's steps (LayerRowsScratch)
  void* small_ws = nullptr;
  size_t small_ws_bytes = 0;
  int* rows_in = nullptr;          // [1 + kVerifyMaxRows] a verify graph's position, tokens
  cuda::KvBatchSeq* batch_seqs = nullptr;  // [rows] a batched step's sequences (GpuBatchRows)
  int* batch_order = nullptr;              // [rows] its rows by grid bound (GpuBatchRows)
  uint64_t generation = 0;         // which of the model's PrefillStates (VerifyGraphs)

  // Allocates or throws DeviceError (the caller retries with fewer rows).
  void* take(size_t bytes) { return mem.alloc(bytes, " for the prefill scratch"); }
};

}  // namespace kestrel
