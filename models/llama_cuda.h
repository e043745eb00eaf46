// The Llama family on an NVIDIA GPU: batch-1 decoding with fused dequant-GEMVs, FP16
// activations and KV cache, and the whole decode step captured as CUDA graphs (one per range of
// positions) and replayed.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/model_spec.h"
#include "kernels/gemv/gemv.h"

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
  size_t bytes = 0;

  // Bytes one run moves through device memory (weights, x, y).
  double bytes_moved() const;
  // y [N] = W x (+ residual [N]; y may alias residual)
  // `in` fuses the op before the linear (RMSNorm, SiLU * up) into its staging of x; `out` the
  // op after it (quantized only: see can_silu_epilogue).
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
  GpuLinear qkv;                 // [q_dim + 2 * kv_dim, hidden]
  GpuLinear o;                   // [hidden, q_dim]
  GpuLinear gate_up;             // [2 * intermediate, hidden]
  GpuLinear down;                // [hidden, intermediate]
  // Act-order down weights (quantized gate|up): the decode step's gate|up GEMV stores SiLU *
  // up at down_x_index (cuda::gemv_input_index), so that down_x_permuted (down's memory, no
  // permutation) stages its x without a gather. nullptr otherwise.
  const int32_t* down_x_index = nullptr;  // [intermediate]
  GpuLinear down_x_permuted;
  // Act-order models (LlamaCuda::permute_residual_stream): the decode step keeps the residual
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
  __half* lm_head = nullptr;     // [vocab, hidden] (== embed when tied)
  std::vector<GpuLayer> layers;
};

// Activations of one token and the KV cache, all FP16 on the device.
struct GpuRunState {
  int* token = nullptr;          // [1] input token of the step
  int* pos = nullptr;            // [1] its position
  int* next = nullptr;           // [1] argmax of the step's logits
  __half* x = nullptr;           // [hidden] residual stream
  __half* x2 = nullptr;          // [hidden] the residual stream between o and down, where
                                 // the layers keep it in act-order permutations (else unused)
  __half* qkv = nullptr;         // [q_dim + 2 * kv_dim]
  __half* att = nullptr;         // [q_dim]
  __half* gate_up = nullptr;     // [2 * intermediate]
  __half* logits = nullptr;      // [vocab]
  float* logits_f32 = nullptr;   // [vocab]
  float* att_workspace = nullptr;
  __half* key_cache = nullptr;   // [n_layers, ctx, kv_dim]
  __half* value_cache = nullptr; // [n_layers, ctx, kv_dim]
  TopKSampling* sampling = nullptr;  // [1] the sampled run's parameters and draw count
  void* sample_workspace = nullptr;  // the sampler's candidates, per block
};

// Tokens per prefill chunk: the longest multiple of 64 whose activations (row_bytes per token)
// fit in what is left of 5% over `base` (weights + KV cache) once `taken` is counted (the decode
// path, the prefill's fixed scratch), but never fewer than 512 and never more than max_rows.
int prefill_chunk_rows(size_t base, size_t taken, size_t row_bytes, int max_rows);
// cuBLASLt's workspace for the prefill: what is left of the same 5% once `taken` is counted (the
// chunk's activations too), at most `most`, in whole MiB; 0 when nothing is left.
size_t prefill_workspace_bytes(size_t base, size_t taken, size_t most);

class LlamaCuda final : public Backend {
 public:
  // Uploads the weights (streamed tensor by tensor, with a progress bar unless quiet) and
  // allocates the KV cache for `context` positions (0 = max_position_embeddings; reduced
  // with a message when GPU memory is short). Throws kestrel::Error / DeviceError.
  LlamaCuda(const ModelSpec& spec, int context, bool quiet);
  ~LlamaCuda() override;

  const ModelConfig& config() const override { return cfg_; }
  int context_length() const override { return ctx_; }
  std::string device_name() const override { return device_name_; }
  void forward(const int* tokens, int n, int pos, float* logits, float* all_logits) override;
  int forward_argmax(int token, int pos) override;
  // Steps chained on the device: each step's argmax feeds the next step's token and position,
  // so step i + 1 is queued before token i reaches the host (DecodeRun).
  std::unique_ptr<DecodeRun> greedy_run(int token, int pos) override;
  // The same with each token drawn on the device (kernels/sampling/sample_cuda.h).
  std::unique_ptr<DecodeRun> sampled_run(int token, int pos, const TopKSampling& s) override;
  std::vector<OpTime> profile_step(int token, int pos) override;
  size_t weight_bytes() const override { return weight_bytes_; }
  size_t cache_bytes() const override { return cache_bytes_; }
  size_t device_bytes_after_load() const override { return after_load_bytes_; }
  size_t device_bytes_in_use() const override;

  // Log-softmax on the device: only one float per token reaches the host.
  void forward_nll(const int* tokens, int n, int pos, const int* targets, double* nll) override;
  // Tokens per prefill chunk (default 2048; tests shrink it to cross chunk boundaries).
  void set_prefill_chunk(int tokens);

 private:
  // Chunked prefill (llama_cuda_prefill.cpp): many tokens per kernel, GEMMs on the tensor cores.
  struct PrefillState;
  struct PrefillPlan {
    int rows = 0;                // tokens per chunk, up to max_rows
    size_t workspace_bytes = 0;  // cuBLASLt's workspace
  };
  PrefillPlan prefill_plan(int max_rows) const;
  struct PrefillDeleter {
    void operator()(PrefillState* p) const;
  };
  void prefill(const int* tokens, int n, int pos, float* logits, float* all_logits,
               const int* targets, float* nll);
  std::unique_ptr<PrefillState, PrefillDeleter> prefill_;
  int prefill_chunk_ = 2048;

  // What a step ends with: nothing (a prompt token whose logits are not wanted), the argmax
  // read back by the host, the logits read back, or (Chain0/1) the argmax, (Sample0/1) a token
  // drawn on the device, written to the step's own {token, pos} (the next step's input, pos +
  // 1) and to host slot 0 or 1.
  enum class Head { None, Argmax, Logits, Chain0, Chain1, Sample0, Sample1 };
  static constexpr int kHeads = 7;
  // Sets GpuLayer::down_x_index and down_x_permuted for act-order down weights (at load).
  void permute_down_inputs();
  void permute_residual_stream();
  // Enqueues one decode step (the token and position are read from device memory; all heads
  // but the chained ones first copy them from host_io_) for positions below ctx_bound.
  void record_step(cudaStream_t s, Head head, int ctx_bound);
  // The decode graphs: one per head for each range of positions, [0, 512), [512, 1024),
  // [1024, 2048), ... up to the context, each with attention's grid sized for its range's end.
  void capture_graphs();
  int graph_range(int pos) const;  // the range of position pos (an index of range_end_)
  cudaGraphExec_t graph(int pos, Head head) const {
    return graphs_[(size_t)graph_range(pos) * kHeads + (int)head];
  }
  void warm_up();  // one short prefill at load (cuBLASLt's first use)
  // Runs one step through the graph for `head`; returns when the result is on the host.
  void step(int token, int pos, Head head);
  // A step's token and position, checked, into host_io_ (which the graphs copy from).
  void set_step_input(int token, int pos);
  void check_position(int pos) const;  // throws Error past the context

  // Events recorded after each op while profiling (nullptr otherwise: graphs carry none).
  struct StepProfile;
  StepProfile* profile_ = nullptr;
  int profile_pos_ = 0;
  void mark(const char* op, double bytes, cudaStream_t s);

  ModelConfig cfg_;
  int ctx_ = 0;
  std::string device_name_;
  size_t weight_bytes_ = 0, cache_bytes_ = 0;
  size_t free_at_start_ = 0, after_load_bytes_ = 0;  // device_bytes_* (cudaMemGetInfo)
  GpuWeights w_;
  GpuRunState s_;
  std::vector<void*> allocations_;
  cudaStream_t stream_ = nullptr;
  std::vector<int> range_end_;           // each range's end (exclusive), the last ctx_
  std::vector<cudaGraphExec_t> graphs_;  // [range][head]
  int* host_io_ = nullptr;        // pinned: [0] token, [1] pos, [2] next, [3..4] chain slots
  int* host_io_dev_ = nullptr;    // host_io_ as the device addresses it
  cudaEvent_t chain_done_[2] = {nullptr, nullptr};  // the chained step of each slot is done
  class ChainedRun;
  float* host_logits_ = nullptr;  // pinned [vocab]

  void* alloc(size_t bytes);
  // Every weight lives in one allocation sized before loading (cudaMalloc rounds each
  // allocation up to 2 MiB pages): a bump arena, 256-byte aligned pieces.
  char* arena_ = nullptr;
  size_t arena_size_ = 0, arena_used_ = 0;
  void* arena_alloc(size_t bytes);
  friend struct GpuLoader;
};

}  // namespace kestrel
