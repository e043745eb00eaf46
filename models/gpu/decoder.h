// The decoder families (models/io/family.h) on an NVIDIA GPU: batch-1 decoding with fused
// dequant-GEMVs, FP16 activations and KV cache, and the whole decode step captured as CUDA graphs
// (one per range of positions) and replayed, as are speculative verify passes (one graph per
// token count). (Named after the first family it ran.)
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/gpu/graphs.h"
#include "models/gpu/memory.h"
#include "models/gpu/profiler.h"
#include "models/gpu/weights.h"
#include "models/io/model_spec.h"
#include "models/model.h"
#include "models/tuning.h"

namespace kestrel {

// Activations of one token, all FP16 on the device: the model's scratch, which its sessions
// share as they take turns.
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
  TopKSampling* sampling = nullptr;  // [1] the sampled run's parameters and draw count
  void* sample_workspace = nullptr;  // the sampler's candidates, per block
};

// One sequence's memory on the device (DecoderCudaSession): its KV cache and attention's
// workspace, which is sized by the context.
struct GpuSequence {
  int ctx = 0;                   // positions the cache holds
  size_t cache_bytes = 0;        // of key_cache and value_cache together
  __half* key_cache = nullptr;   // [n_layers, ctx, kv_dim]
  __half* value_cache = nullptr; // [n_layers, ctx, kv_dim]
  float* att_workspace = nullptr;
};

// Tokens per prefill chunk: the longest multiple of 64 whose activations (row_bytes per token)
// fit in what is left of 5% over `base` (weights + KV cache) once `taken` is counted (the decode
// path, the prefill's fixed scratch), but never fewer than 512 and never more than max_rows.
int prefill_chunk_rows(size_t base, size_t taken, size_t row_bytes, int max_rows);
// cuBLASLt's workspace for the prefill: what is left of the same 5% once `taken` is counted (the
// chunk's activations too), at most `most`, in whole MiB; 0 when nothing is left.
size_t prefill_workspace_bytes(size_t base, size_t taken, size_t most);

// Why the CUDA engine cannot run a model of this config ("" when it can): the blocks of the
// families it does not run yet, named for the user.
std::string cuda_unsupported(const ModelConfig& c);

class DecoderCudaSession;

class DecoderCuda final : public Model {
 public:
  // Uploads the weights (streamed tensor by tensor, with a progress bar unless quiet) and
  // allocates the decode step's scratch. Throws kestrel::Error / DeviceError.
  DecoderCuda(const ModelSpec& spec, bool quiet, const DecodeTuning& tuning = {});
  ~DecoderCuda() override;

  const ModelConfig& config() const override { return cfg_; }
  std::string device_name() const override { return device_name_; }
  // Allocates the session's KV cache for `context` positions (0 = max_position_embeddings;
  // reduced with a note when GPU memory is short) and captures its decode graphs.
  std::unique_ptr<Session> new_session(int context = 0, bool quiet = true) override;
  std::unique_ptr<DecoderCudaSession> new_cuda_session(int context = 0, bool quiet = true);
  size_t weight_bytes() const override { return weight_bytes_; }
  // After loading and opening the first session (its KV cache and graphs), before any prompt.
  size_t device_bytes_after_load() const override { return after_load_bytes_; }
  size_t device_bytes_in_use() const override;
  const DecodeTuning& tuning() const { return tuning_; }

  // Tokens per prefill chunk (default 2048; tests shrink it to cross chunk boundaries).
  void set_prefill_chunk(int tokens);

 private:
  friend class DecoderCudaSession;
  friend struct GpuLoader;

  // What a step ends with: nothing (a prompt token whose logits are not wanted), the argmax
  // read back by the host, the logits read back, or (Chain0/1) the argmax, (Sample0/1) a token
  // drawn on the device, written to the step's own {token, pos} (the next step's input, pos +
  // 1) and to host slot 0 or 1.
  enum class Head { None, Argmax, Logits, Chain0, Chain1, Sample0, Sample1 };
  static constexpr int kHeads = 7;

  // Session-facing steps (DecoderCudaSession forwards to these with its sequence).
  void forward(DecoderCudaSession& q, const int* tokens, int n, int pos, float* logits,
               float* all_logits);
  int forward_argmax(DecoderCudaSession& q, int token, int pos);
  void forward_argmax_rows(DecoderCudaSession& q, const int* tokens, int n, int pos, int* out);
  void forward_nll(DecoderCudaSession& q, const int* tokens, int n, int pos, const int* targets,
                   double* nll);
  std::vector<OpTime> profile_step(DecoderCudaSession& q, int token, int pos);

  // Chunked prefill (gpu/prefill.cpp): many tokens per kernel, GEMMs on the tensor cores.
  struct PrefillState;
  struct PrefillPlan {
    int rows = 0;                // tokens per chunk, up to max_rows
    size_t workspace_bytes = 0;  // cuBLASLt's workspace
  };
  PrefillPlan prefill_plan(const GpuSequence& q, int max_rows) const;
  struct PrefillDeleter {
    void operator()(PrefillState* p) const;
  };
  // Runs tokens[0..n) at positions pos.. in chunks. Per row, on request: all_logits (to the
  // host), nll of targets (the log-softmax on the device), argmax (each row's greedy successor,
  // taken on the device); logits: the last row's.
  void prefill(const GpuSequence& q, const int* tokens, int n, int pos, float* logits,
               float* all_logits, const int* targets, float* nll, int* argmax = nullptr);
  // The prefill's scratch, made on first use (for chunks of up to min(prefill_chunk_, q.ctx)
  // tokens, fewer where memory is short), with the logits of every row where want_rows.
  PrefillState& prefill_state(const GpuSequence& q, bool want_rows);
  // Enqueues a chunk of T rows through the embedding and the layers into the scratch's x: the
  // tokens in d_tokens (device), at positions p0 .. p0 + T - 1, or from *d_pos (device) on
  // where d_pos is set.
  void record_rows(PrefillState& S, const GpuSequence& q, const int* d_tokens, int T, int p0,
                   const int* d_pos, cudaStream_t s);
  // Enqueues the output head over the chunk's T rows: their fp32 logits into the scratch.
  void record_rows_logits(PrefillState& S, int T, cudaStream_t s);
  void check_tokens(const int* tokens, int n) const;  // throws Error on an id past the vocab
  std::unique_ptr<PrefillState, PrefillDeleter> prefill_;
  int prefill_chunk_ = 2048;
  uint64_t prefill_generations_ = 0;  // PrefillStates made so far (each one's generation)

  // Speculative verify passes of 2 .. kVerifyMaxRows rows as CUDA graphs
  // (DecodeTuning::verify_graphs): one per session and row count (VerifyGraphs), captured after
  // the first pass of that count, which runs uncaptured. Each graph copies the position and
  // the tokens from host_rows_, runs the rows, the output head and the rows' argmax over the
  // prefill's scratch of one generation, and copies the ids back to host_rows_.
  static constexpr int kVerifyMaxRows = 65;  // a draft of up to 64 and the token before it
  void record_verify(const GpuSequence& q, int n, cudaStream_t s);
  // pinned: [0] pos, [1 .. 1 + kVerifyMaxRows) tokens, [1 + kVerifyMaxRows ..) the ids
  int* host_rows_ = nullptr;

  // Enqueues one decode step over sequence q (the token and position are read from device
  // memory; all heads but the chained ones first copy them from host_io_) for positions
  // below ctx_bound.
  void record_step(const GpuSequence& q, cudaStream_t s, Head head, int ctx_bound);
  void warm_up(DecoderCudaSession& q);  // one short prefill (cuBLASLt's first use)
  // Runs one step through the graph for `head`; returns when the result is on the host.
  void step(DecoderCudaSession& q, int token, int pos, Head head);
  // A step's token and position, checked, into host_io_ (which the graphs copy from).
  void set_step_input(const DecoderCudaSession& q, int token, int pos);

  ModelConfig cfg_;
  DecodeTuning tuning_;
  std::string device_name_;
  size_t weight_bytes_ = 0;
  size_t free_at_start_ = 0, after_load_bytes_ = 0;  // device_bytes_* (cudaMemGetInfo)
  size_t scratch_bytes_ = 0;  // the decode step's scratch and buffers, measured at load
  bool warmed_up_ = false;
  DeviceMemory mem_;     // the weights' arena, the act-order indices, the step's scratch
  DeviceArena arena_;    // the weights
  GpuWeights w_;
  GpuRunState s_;
  StepProfiler profiler_;
  cudaStream_t stream_ = nullptr;
  int* host_io_ = nullptr;        // pinned: [0] token, [1] pos, [2] next, [3..4] chain slots
  int* host_io_dev_ = nullptr;    // host_io_ as the device addresses it
  cudaEvent_t chain_done_[2] = {nullptr, nullptr};  // the chained step of each slot is done
  class ChainedRun;
  float* host_logits_ = nullptr;  // pinned [vocab]
};

// A sequence on the GPU: its KV cache and attention workspace (allocated here, freed with the
// session) and the decode graphs that bind them. The steps run on the model's stream and
// scratch.
class DecoderCudaSession final : public Session {
 public:
  DecoderCudaSession(DecoderCuda& m, int context, bool quiet);
  ~DecoderCudaSession() override;

  int context_length() const override { return q_.ctx; }
  size_t cache_bytes() const override { return q_.cache_bytes; }
  void forward(const int* tokens, int n, int pos, float* logits, float* all_logits) override {
    m_.forward(*this, tokens, n, pos, logits, all_logits);
  }
  int forward_argmax(int token, int pos) override { return m_.forward_argmax(*this, token, pos); }
  // Speculative verification: the rows' argmax on the device, only n ids reach the host;
  // replayed from a CUDA graph per n once that n has run (DecodeTuning::verify_graphs).
  void forward_argmax_rows(const int* tokens, int n, int pos, int* out) override {
    m_.forward_argmax_rows(*this, tokens, n, pos, out);
  }
  // Verify-pass graphs this session holds now (for tests and diagnostics).
  int verify_graphs_held() const { return verify_graphs_.size(); }
  // Steps chained on the device: each step's argmax feeds the next step's token and position,
  // so step i + 1 is queued before token i reaches the host (DecodeRun).
  std::unique_ptr<DecodeRun> greedy_run(int token, int pos) override;
  // The same with each token drawn on the device (kernels/sampling/sample_cuda.h).
  std::unique_ptr<DecodeRun> sampled_run(int token, int pos, const TopKSampling& s) override;
  // Log-softmax on the device: only one float per token reaches the host.
  void forward_nll(const int* tokens, int n, int pos, const int* targets, double* nll) override {
    m_.forward_nll(*this, tokens, n, pos, targets, nll);
  }
  std::vector<OpTime> profile_step(int token, int pos) override {
    return m_.profile_step(*this, token, pos);
  }

 private:
  friend class DecoderCuda;
  void release();                      // the graphs and the device memory, once
  void check_position(int pos) const;  // throws Error past the context
  cudaGraphExec_t graph(int pos, DecoderCuda::Head head) const { return graphs_.get(pos, (int)head); }

  DecoderCuda& m_;
  GpuSequence q_;
  DeviceMemory mem_;
  DecodeGraphs graphs_;  // per range of positions and head, bound to q_
  VerifyGraphs verify_graphs_;  // per row count, bound to q_ and the model's prefill scratch
};

}  // namespace kestrel
