// The decoder families (models/io/family.h) on an NVIDIA GPU, split as llama.cpp splits
// llama-model from llama-context:
//   - DecoderCuda (this file): the model. The weights, the stream, and what its sequences share
//     as they take turns: the decode step's scratch (GpuRunState), the prefill's scratch
//     (PrefillState, planned in models/gpu/prefill_plan.cpp), pinned host buffers. It records
//     the forward over a sequence's memory (GpuSequence): the decode step
//     (models/gpu/decode_step.cpp), a run of rows (models/gpu/prefill.cpp), a verify pass
//     (models/gpu/verify.cpp), each built from the layer of models/gpu/blocks.h.
//   - DecoderCudaSession (models/gpu/session.h): a context. One sequence's KV cache, its decode
//     and verify graphs, and the runs over it: steps, chained and sampled runs
//     (models/gpu/runs.cpp), prompts, verify passes, NLL.
// The model records its forward over whichever sequence it is handed and binds none, so a step
// over several sequences (forward_batch, models/gpu/batch.cpp) records the same blocks over a
// list of GpuSequences on the prefill's scratch.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kernels/attention/kv_cache_cuda.h"
#include "models/gpu/graphs.h"
#include "models/gpu/memory.h"
#include "models/gpu/profiler.h"
#include "models/gpu/weights.h"
#include "models/io/model_spec.h"
#include "models/kv_pool.h"
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

// The K and V rows of every layer, each in its type (--cache-type-k/-v; the layout of
// kernels/attention/kv_cache_cuda.h, layer after layer): a session's own cache (rows = its
// context) or the model's paged pool (rows = its blocks * kKvBlock).
struct GpuKvStorage {
  KvCacheTypes types;            // of the K and V caches
  int64_t rows = 0;              // per layer
  size_t bytes = 0;              // of K and V together, scales included
  void* key_cache = nullptr;     // [n_layers, rows, kv_dim]: fp16 values (f16) or 8-bit codes
  void* value_cache = nullptr;   // [n_layers, rows, kv_dim]
  void* key_scales = nullptr;    // [n_layers, rows, scales per row] (8-bit types; else null)
  void* value_scales = nullptr;

  // Allocates the arrays in `mem` (a DeviceError naming `for_what` where they do not fit).
  void allocate(DeviceMemory& mem, const ModelConfig& c, KvCacheTypes t, int64_t rows,
                const std::string& for_what, const std::string& hint);
  // Every layer's K and V rows, read through `blocks` where paged, as the kernels step through
  // them (KvBatchSeq: layer l at l times one layer's bytes of `rows` rows; no workspace).
  cuda::KvBatchSeq layers(const ModelConfig& c, const int32_t* blocks) const {
    cuda::KvBatchSeq s;
    s.k_data = static_cast<char*>(key_cache);
    s.v_data = static_cast<char*>(value_cache);
    s.k_scales = static_cast<char*>(key_scales);
    s.v_scales = static_cast<char*>(value_scales);
    s.k_stride = cuda::kv_data_bytes(types.k, rows, c.n_kv_heads, c.head_dim);
    s.v_stride = cuda::kv_data_bytes(types.v, rows, c.n_kv_heads, c.head_dim);
    s.k_scales_stride = cuda::kv_scales_bytes(types.k, rows, c.n_kv_heads, c.head_dim);
    s.v_scales_stride = cuda::kv_scales_bytes(types.v, rows, c.n_kv_heads, c.head_dim);
    s.blocks = blocks;
    return s;
  }
  // Layer l's K (or V) rows as the kernels take them, read through `blocks` where paged.
  cuda::KvCacheDev k_layer(int l, const ModelConfig& c, const int32_t* blocks) const {
    return layers(c, blocks).k_layer(types.k, l);
  }
  cuda::KvCacheDev v_layer(int l, const ModelConfig& c, const int32_t* blocks) const {
    return layers(c, blocks).v_layer(types.v, l);
  }
  // Stream-ordered copies of whole blocks (KvBlockTable::Copy: rows from * kKvBlock .. onto
  // to * kKvBlock ..) of every layer's K and V, codes and scales.
  void copy_blocks(std::span<const KvBlockTable::Copy> copies, const ModelConfig& c,
                   cudaStream_t s) const;
};

// Paged KV memory on the GPU (DecoderCuda::use_kv_pool): the K and V rows of every layer for
// the pool's blocks, and the blocks' bookkeeping. Sessions made after it share it (and keep it
// alive while they last); they take turns through the model, but adopt a prefix
// (Session::adopt_prefix) from their requests' threads: the bookkeeping is behind `m`.
struct GpuKvPool {
  explicit GpuKvPool(int n_blocks) : blocks(n_blocks) {}
  KvBlockPool blocks;
  GpuKvStorage kv;  // rows = blocks * kKvBlock
  DeviceMemory mem;
  std::mutex m;
};

// One sequence's memory on the device (DecoderCudaSession): its KV cache and attention's
// workspace, which is sized by the context. What the model's recorded forward reads and writes
// of a sequence: its own cache, or the pool's rows through its block table (`blocks`, device
// memory of ceil(ctx / kKvBlock) entries that stays at one address for the session's life, so
// that its captured graphs read whatever the host last uploaded there).
struct GpuSequence {
  int ctx = 0;                   // positions the sequence may hold
  GpuKvStorage kv;               // its own cache, or a view of the pool's
  int32_t* blocks = nullptr;     // paged: the block of each kKvBlock positions; else null
  float* att_workspace = nullptr;

  // Layer l's K and V caches as the kernels take them.
  cuda::KvCacheDev k_layer(int l, const ModelConfig& c) const { return kv.k_layer(l, c, blocks); }
  cuda::KvCacheDev v_layer(int l, const ModelConfig& c) const { return kv.v_layer(l, c, blocks); }
  // Every layer's, with the workspace, as a batched step's kernels take a row's sequence.
  cuda::KvBatchSeq batch_seq(const ModelConfig& c) const {
    cuda::KvBatchSeq s = kv.layers(c, blocks);
    s.workspace = att_workspace;
    s.ctx = ctx;
    return s;
  }
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
// The same for the formats of its linears ("" when the GEMVs take every one): a GPTQ linear
// whose format the kernels do not run (kernels/gemv/gemv_format.h), named. Any
// mix of the formats they do run loads, one per linear (GPTQModel's `dynamic` rules).
std::string cuda_unsupported_formats(const ModelSpec& spec);

class DecoderCudaSession;

class DecoderCuda final : public Model {
 public:
  // Uploads the weights (streamed tensor by tensor, with a progress bar unless quiet) and
  // allocates the decode step's scratch. Its sessions' caches hold K and V in `cache`'s types.
  // Throws kestrel::Error / DeviceError.
  DecoderCuda(const ModelSpec& spec, bool quiet, const DecodeTuning& tuning = {},
              KvCacheTypes cache = {});
  ~DecoderCuda() override;

  const ModelConfig& config() const override { return cfg_; }
  KvCacheTypes cache_types() const override { return cache_; }
  std::string device_name() const override { return device_name_; }
  // Allocates the session's KV cache for `context` positions (0 = max_position_embeddings;
  // reduced with a note when GPU memory is short) and captures its decode graphs.
  std::unique_ptr<Session> new_session(int context = 0, bool quiet = true) override;
  std::unique_ptr<DecoderCudaSession> new_cuda_session(int context = 0, bool quiet = true);
  // One token of each row's session in one pass (models/gpu/batch.cpp): the linears over all
  // rows, each weight read once; RoPE, the K/V write and attention per row over its own cache.
  void forward_batch(std::span<const BatchRow> rows, float* logits) override;
  // Paged KV memory (Model::use_kv_pool): one device allocation per K and V array of the pool's
  // rows, in the model's cache types; sessions made from now on keep their K/V there.
  bool use_kv_pool(int64_t positions, int sessions = 1, int context = 0, bool quiet = true) override;
  KvPoolUse kv_pool_use() const override;
  size_t weight_bytes() const override { return weight_bytes_; }
  // After loading and opening the first session (its KV cache and graphs), before any prompt.
  size_t device_bytes_after_load() const override { return after_load_bytes_; }
  size_t device_bytes_in_use() const override;
  const DecodeTuning& tuning() const { return tuning_; }
  // The weights as loaded: which linears fused, each one's format and bytes (for tests).
  const GpuWeights& weights() const { return w_; }

  // Tokens per prefill chunk (default 2048; tests shrink it to cross chunk boundaries).
  void set_prefill_chunk(int tokens);

 private:
  friend class DecoderCudaSession;

  // What a step ends with: nothing (a prompt token whose logits are not wanted), the argmax
  // read back by the host, the logits read back, or (Chain0/1) the argmax, (Sample0/1) a token
  // drawn on the device, written to the step's own {token, pos} (the next step's input, pos +
  // 1) and to host slot 0 or 1.
  enum class Head { None, Argmax, Logits, Chain0, Chain1, Sample0, Sample1 };
  static constexpr int kHeads = 7;
  class ChainedRun;  // models/gpu/runs.cpp

  // ---- The decode step (models/gpu/decode_step.cpp)
  // Enqueues one decode step over sequence q (the token and position are read from device
  // memory; all heads but the chained ones first copy them from host_io_) for positions
  // below ctx_bound.
  void record_step(const GpuSequence& q, cudaStream_t s, Head head, int ctx_bound);

  // ---- Runs of rows (models/gpu/prefill.cpp): many tokens per kernel, GEMMs on the tensor
  // cores, over the prefill's scratch (models/gpu/prefill_plan.cpp).
  struct PrefillState;
  struct PrefillPlan {
    int rows = 0;                // tokens per chunk, up to max_rows
    size_t workspace_bytes = 0;  // cuBLASLt's workspace
  };
  PrefillPlan prefill_plan(const GpuSequence& q, int max_rows) const;
  // Bytes the prefill scratch, not made yet, will take for sessions of `context` positions (0:
  // the model's), logits of every row included: use_kv_pool leaves them free.
  size_t prefill_bytes_to_come(int context) const;
  // The scratch's logits of every row, which batched steps and verify passes need and a warm-up
  // leaves at one row's: made once, never replaced (a verify graph binds the buffer).
  void grow_row_logits(PrefillState& S);
  struct PrefillDeleter {
    void operator()(PrefillState* p) const;
  };
  // The prefill's scratch, made on first use (for chunks of up to min(prefill_chunk_, q.ctx)
  // tokens, fewer where memory is short), with the logits of every row where want_rows.
  PrefillState& prefill_state(const GpuSequence& q, bool want_rows);
  // Runs tokens[0..n) at positions pos.. in chunks. Per row, on request: all_logits (to the
  // host), nll of targets (the log-softmax on the device), argmax (each row's greedy successor,
  // taken on the device); logits: the last row's.
  void prefill(const GpuSequence& q, const int* tokens, int n, int pos, float* logits,
               float* all_logits, const int* targets, float* nll, int* argmax = nullptr);
  // Enqueues a chunk of T rows through the embedding and the layers into the scratch's x: the
  // tokens in d_tokens (device), at positions p0 .. p0 + T - 1, or from *d_pos (device) on
  // where d_pos is set.
  void record_rows(PrefillState& S, const GpuSequence& q, const int* d_tokens, int T, int p0,
                   const int* d_pos, cudaStream_t s);
  // Enqueues the output head over the chunk's T rows: their fp32 logits into the scratch.
  void record_rows_logits(PrefillState& S, int T, cudaStream_t s);
  void check_tokens(const int* tokens, int n) const;  // throws Error on an id past the vocab

  // ---- Verify passes (models/gpu/verify.cpp): 2 .. kVerifyMaxRows rows, captured per session
  // and row count (DecodeTuning::verify_graphs). Each graph copies the position and the tokens
  // from host_rows_, runs the rows, the output head and the rows' argmax over the prefill's
  // scratch of one generation, and copies the ids back to host_rows_.
  static constexpr int kVerifyMaxRows = 65;  // a draft of up to 64 and the token before it
  void record_verify(const GpuSequence& q, int n, cudaStream_t s);

  void warm_up(DecoderCudaSession& q);  // one short prefill (cuBLASLt's first use)

  ModelConfig cfg_;
  DecodeTuning tuning_;
  KvCacheTypes cache_;  // the sessions' K and V cache types
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
  float* host_logits_ = nullptr;  // pinned [vocab]
  // pinned: [0] pos, [1 .. 1 + kVerifyMaxRows) tokens, [1 + kVerifyMaxRows ..) the ids
  int* host_rows_ = nullptr;
  std::unique_ptr<PrefillState, PrefillDeleter> prefill_;
  std::shared_ptr<GpuKvPool> pool_;  // paged KV memory, where use_kv_pool made one
  int prefill_chunk_ = 2048;
  uint64_t prefill_generations_ = 0;  // PrefillStates made so far (each one's generation)
};

}  // namespace kestrel

// The context: the session class, which names DecoderCuda::Head (after the model, so that either
// header may be included first).
#include "models/gpu/session.h"
