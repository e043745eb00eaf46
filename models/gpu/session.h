// A sequence on the GPU: a context over a DecoderCuda (models/gpu/decoder.h). It owns its KV
// cache (or, paged, a block table over the model's pool and the table's copy on the device) and
// attention workspace (GpuSequence), the decode graphs that bind them, and its verify graphs;
// its runs (steps, chained and sampled runs, prompts, verify passes, NLL) record the model's
// forward over its memory and run on the model's stream and shared scratch.
//
// Paged, every run makes the positions it writes this session's alone before it queues the
// kernels that write them (prepare_write: blocks taken, shared ones copied on the device, the
// table uploaded), and records the ids written after (commit_write), as the CPU session does.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "models/gpu/decoder.h"

namespace kestrel {

class DecoderCudaSession final : public Session {
 public:
  DecoderCudaSession(DecoderCuda& m, int context, bool quiet);
  ~DecoderCudaSession() override;

  int context_length() const override { return q_.ctx; }
  // Its own cache; paged, the blocks it holds (some perhaps shared with other sequences).
  size_t cache_bytes() const override;
  // One token: a decode step's graph; more: the chunked prefill (models/gpu/prefill.cpp).
  void forward(const int* tokens, int n, int pos, float* logits, float* all_logits) override;
  int forward_argmax(int token, int pos) override;
  // Speculative verification: the rows' argmax on the device, only n ids reach the host;
  // replayed from a CUDA graph per n once that n has run (DecodeTuning::verify_graphs;
  // models/gpu/verify.cpp).
  void forward_argmax_rows(const int* tokens, int n, int pos, int* out) override;
  // Verify-pass graphs this session holds now (for tests and diagnostics).
  int verify_graphs_held() const { return verify_graphs_.size(); }
  // Steps chained on the device: each step's argmax feeds the next step's token and position,
  // so step i + 1 is queued before token i reaches the host (DecodeRun; models/gpu/runs.cpp).
  std::unique_ptr<DecodeRun> greedy_run(int token, int pos) override;
  // The same with each token drawn on the device (kernels/sampling/sample_cuda.h).
  std::unique_ptr<DecodeRun> sampled_run(int token, int pos, const TopKSampling& s) override;
  // Log-softmax on the device: only one float per token reaches the host.
  void forward_nll(const int* tokens, int n, int pos, const int* targets, double* nll) override;
  std::vector<OpTime> profile_step(int token, int pos) override;
  bool adopt_prefix(std::span<const int> prompt) override;
  bool release_kv() override;

  // Paged: makes positions pos .. pos + n - 1 writable by this session alone (KvBlockTable::
  // prepare_write), queues the copies of shared blocks and the upload of the table's changed
  // entries on the model's stream, or throws KvPoolFull; after the write, records the ids there
  // (publishing the blocks they fill). No-ops with a cache of its own.
  void prepare_write(int pos, int n);
  void commit_write(int pos, const int* tokens, int n);
  // prepare_write, but false (nothing changed) where the pool is full.
  bool try_prepare_write(int pos, int n);

 private:
  friend class DecoderCuda;
  using Head = DecoderCuda::Head;
  void release();                      // the graphs and the device memory, once
  void check_position(int pos) const;  // throws Error past the context
  cudaGraphExec_t graph(int pos, Head head) const { return graphs_.get(pos, (int)head); }
  // A step's token and position, checked, into the model's host_io_ (which the graphs copy
  // from).
  void set_step_input(int token, int pos);
  // Runs one step through the graph for `head`; returns when the result is on the host.
  void step(int token, int pos, Head head);


  DecoderCuda& m_;
  GpuSequence q_;
  DeviceMemory mem_;
  // Paged: the model's pool, this sequence's blocks, and the pinned source of the uploads of
  // the table (host_blocks_ [ceil(ctx / kKvBlock)], whose first host_synced_ entries are what
  // the device holds). Entries from dirty_from_ on may differ from the table (adopt_prefix
  // replaced it). A chained run rewrites an entry while its previous step may still be queued,
  // but only one that no queued kernel reads: a step reads the blocks of positions up to its
  // own, and prepares the next position's block only.
  std::shared_ptr<GpuKvPool> pool_;
  std::unique_ptr<KvBlockTable> table_;
  int32_t* host_blocks_ = nullptr;
  int host_synced_ = 0;
  int dirty_from_ = 0;
  DecodeGraphs graphs_;  // per range of positions and head, bound to q_
  VerifyGraphs verify_graphs_;  // per row count, bound to q_ and the model's prefill scratch
};

}  // namespace kestrel
