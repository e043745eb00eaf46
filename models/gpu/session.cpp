// A context on the GPU: one sequence's device memory and decode graphs, and its runs over the
// model's forward. A decode step reads its token and position from device memory, so it is
// captured as a CUDA graph (one per range of positions: models/gpu/graphs.h) and replayed per
// token; the host writes two ints and reads one back. Chained and sampled runs:
// models/gpu/runs.cpp; prompts: prefill.cpp; verify passes: verify.cpp.
#include "models/gpu/session.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "base/error.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "models/registry.h"

namespace kestrel {

// Device memory of one session, freed when the session ends (or its constructor throws).
DecoderCudaSession::DecoderCudaSession(DecoderCuda& m, int context, bool quiet) : Session(m), m_(m) {
  const ModelConfig& c = m.cfg_;
  try {
    int ctx = context > 0 ? context : c.max_pos;
    c.check_context(ctx);
    auto alloc = [&](size_t bytes) {
      return mem_.alloc(bytes, fmt::format(" for a context of {}", ctx), "; use -c N");
    };
    if (m.pool_) {
      // Paged: the pool's rows through a block table, uploaded to a fixed address.
      pool_ = m.pool_;
      q_.kv = pool_->kv;  // a view: the pool owns the arrays
      const int n_blocks = (ctx + kKvBlock - 1) / kKvBlock;
      q_.blocks = static_cast<int32_t*>(alloc(n_blocks * sizeof(int32_t)));
      // Block 0 until uploaded: an entry a kernel reads is always uploaded first, and any
      // other stays inside the pool.
      KESTREL_CUDA_CHECK(cudaMemsetAsync(q_.blocks, 0, n_blocks * sizeof(int32_t), m.stream_));
      KESTREL_CUDA_CHECK(cudaMallocHost(&host_blocks_, n_blocks * sizeof(int32_t)));
      table_ = std::make_unique<KvBlockTable>(pool_->blocks);
    } else {
      // KV cache: as long as asked (or the model's maximum), shortened to what fits, in the
      // model's cache types (an 8-bit position takes about half an f16 one: twice the context).
      const size_t per_pos = cache_bytes_per_position(Device::Cuda, c, m.cache_);
      size_t free_b = 0, total_b = 0;
      KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      const size_t reserve = (size_t)256 << 20;  // scratch, graphs, the CUDA context's growth
      const size_t fits = free_b > reserve ? (free_b - reserve) / per_pos : 0;
      if ((size_t)ctx > fits) {
        if (fits < 16)
          throw DeviceError(fmt::format("out of GPU memory: the weights use {}, {} is left, too "
                                        "little for the {} of scratch kept free and a KV cache",
                                        mib(m.weight_bytes_), mib(free_b), mib(reserve)));
        if (!quiet)
          fmt::print(stderr, "note: GPU memory is short: context reduced from {} to {} tokens\n",
                     ctx, fits);
        ctx = (int)fits;
      }
      q_.kv.allocate(mem_, c, m.cache_, ctx, fmt::format(" for a context of {}", ctx), "; use -c N");
    }
    q_.ctx = ctx;
    q_.att_workspace =
        static_cast<float*>(alloc(cuda::attention_workspace_bytes(ctx, c.n_heads, c.head_dim)));
    cuda::attention_workspace_reset(q_.att_workspace, ctx, c.n_heads, c.head_dim, m.stream_);
    graphs_.capture(ctx, m.tuning_.graph_ranges, DecoderCuda::kHeads, m.stream_, [&](int head, int bound) {
      m.record_step(q_, m.stream_, (Head)head, bound);
    });
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(m.stream_));
  } catch (...) {
    release();
    throw;
  }
}

DecoderCudaSession::~DecoderCudaSession() { release(); }

void DecoderCudaSession::release() {
  if (!mem_.empty()) cudaStreamSynchronize(m_.stream_);
  graphs_.clear();
  verify_graphs_.clear();
  mem_.free_all();
  if (table_) {
    std::lock_guard<std::mutex> g(pool_->m);
    table_.reset();  // its blocks go back to the pool (cached where published)
  }
  if (host_blocks_) cudaFreeHost(host_blocks_);
  host_blocks_ = nullptr;
}

size_t DecoderCudaSession::cache_bytes() const {
  if (!pool_) return q_.kv.bytes;
  std::lock_guard<std::mutex> g(pool_->m);
  return table_->blocks().size() * kKvBlock *
         cache_bytes_per_position(Device::Cuda, m_.cfg_, q_.kv.types);
}

bool DecoderCudaSession::adopt_prefix(std::span<const int> prompt) {
  if (!pool_) return false;
  std::lock_guard<std::mutex> g(pool_->m);
  const int n = table_->adopt_prefix(prompt, std::min((int)prompt.size() - 1, q_.ctx));
  dirty_from_ = 0;
  // Entries past the new table's end are no longer the table's, whatever the device holds
  // there: a later write past a gap compares and uploads them again.
  host_synced_ = std::min(host_synced_, (int)table_->blocks().size());
  cached.assign(prompt.begin(), prompt.begin() + std::max(0, n));
  return true;
}

bool DecoderCudaSession::release_kv() {
  if (!pool_) return false;
  // The blocks may go to another sequence at once: nothing of this one's may still be queued
  // to read or write them. (Every pass returns with its work done, and a chained run waits for
  // its queued step when it ends; this makes it so whatever a caller did before.)
  // Called from destructors (the server's request guard), so it never throws: after a device
  // error (sticky: no kernel runs again) nothing is queued any more, and the blocks go back
  // as they would have.
  (void)cudaStreamSynchronize(m_.stream_);
  std::lock_guard<std::mutex> g(pool_->m);
  table_->clear();
  dirty_from_ = 0;
  host_synced_ = 0;
  cached.clear();
  return true;
}

void DecoderCudaSession::prepare_write(int pos, int n) {
  if (!try_prepare_write(pos, n))
    throw KvPoolFull(fmt::format("the KV cache pool is full: {} blocks of {} positions, all held",
                                 pool_->blocks.n_blocks(), kKvBlock));
}

bool DecoderCudaSession::try_prepare_write(int pos, int n) {
  if (!pool_) return true;
  KESTREL_CHECK(n > 0 && pos >= 0 && pos + n <= q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q_.ctx));
  std::vector<KvBlockTable::Copy> copies;
  int j0 = 0, j1 = 0;  // the entries to upload
  {
    std::lock_guard<std::mutex> g(pool_->m);
    if (!table_->prepare_write(pos, n, copies)) return false;
    // What prepare_write may have changed: the write's blocks, and the blocks it appended
    // (from the table's old end, which is past what the device holds: the table only grows
    // between adopt_prefix calls). Anything, where adopt_prefix replaced the table since.
    const std::vector<int32_t>& b = table_->blocks();
    j0 = (int)b.size();
    const int from = std::min({dirty_from_, pos / kKvBlock, host_synced_});
    for (int j = from; j < (int)b.size(); ++j) {
      if (j < host_synced_ && host_blocks_[j] == b[j]) continue;
      host_blocks_[j] = b[j];
      j0 = std::min(j0, j);
      j1 = j + 1;
    }
    host_synced_ = std::max(host_synced_, j1);
    dirty_from_ = INT_MAX;
  }
  // A block shared with another sequence is copied before this one writes its own, and the
  // kernels that follow read the new table: both queued ahead of them on the model's stream.
  q_.kv.copy_blocks(copies, m_.cfg_, m_.stream_);
  if (j1 > j0)
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(q_.blocks + j0, host_blocks_ + j0,
                                       (j1 - j0) * sizeof(int32_t), cudaMemcpyHostToDevice,
                                       m_.stream_));
  return true;
}

void DecoderCudaSession::commit_write(int pos, const int* tokens, int n) {
  if (!pool_) return;
  std::lock_guard<std::mutex> g(pool_->m);
  table_->commit_write(pos, std::span<const int>(tokens, n));
}

std::vector<OpTime> DecoderCudaSession::profile_step(int token, int pos) {
  set_step_input(token, pos);
  prepare_write(pos, 1);
  std::vector<OpTime> times = m_.profiler_.profile(m_.stream_, pos, [&] {
    m_.record_step(q_, m_.stream_, Head::Argmax, graphs_.bound(pos));
  });
  commit_write(pos, &token, 1);
  return times;
}

void DecoderCudaSession::check_position(int pos) const {
  KESTREL_CHECK(pos >= 0 && pos < q_.ctx,
                fmt::format("position {} is past the context of {}", pos, q_.ctx));
}

void DecoderCudaSession::set_step_input(int token, int pos) {
  const int vocab = m_.cfg_.vocab;
  KESTREL_CHECK(token >= 0 && token < vocab,
                fmt::format("token id {} is outside the vocabulary ({})", token, vocab));
  check_position(pos);
  m_.host_io_[0] = token;
  m_.host_io_[1] = pos;
}

void DecoderCudaSession::step(int token, int pos, Head head) {
  set_step_input(token, pos);
  prepare_write(pos, 1);
  KESTREL_CUDA_CHECK(cudaGraphLaunch(graph(pos, head), m_.stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(m_.stream_));
  commit_write(pos, &token, 1);
}

void DecoderCudaSession::forward(const int* tokens, int n, int pos, float* logits,
                                 float* all_logits) {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q_.ctx));
  if (n > 1) {  // many tokens: the chunked prefill (models/gpu/prefill.cpp)
    prepare_write(pos, n);
    m_.prefill(q_, tokens, n, pos, logits, all_logits, nullptr, nullptr);
    commit_write(pos, tokens, n);
    return;
  }
  const size_t vocab = m_.cfg_.vocab;
  for (int i = 0; i < n; ++i) {
    const bool want = all_logits || i == n - 1;
    step(tokens[i], pos + i, want ? Head::Logits : Head::None);
    if (all_logits) std::memcpy(all_logits + i * vocab, m_.host_logits_, vocab * sizeof(float));
  }
  std::memcpy(logits, m_.host_logits_, vocab * sizeof(float));
}

int DecoderCudaSession::forward_argmax(int token, int pos) {
  step(token, pos, Head::Argmax);
  return m_.host_io_[2];
}

void DecoderCudaSession::forward_nll(const int* tokens, int n, int pos, const int* targets,
                                     double* nll) {
  KESTREL_CHECK(n > 0, "forward_nll: no tokens");
  KESTREL_CHECK(pos + n <= q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q_.ctx));
  const int vocab = m_.cfg_.vocab;
  for (int i = 0; i < n; ++i)
    KESTREL_CHECK(targets[i] < vocab,
                  fmt::format("target id {} at index {} is outside the vocabulary ({})", targets[i],
                              i, vocab));
  std::vector<float> nll32(n);  // the device's log-softmax is fp32
  prepare_write(pos, n);
  m_.prefill(q_, tokens, n, pos, nullptr, nullptr, targets, nll32.data());
  commit_write(pos, tokens, n);
  std::copy(nll32.begin(), nll32.end(), nll);
}

}  // namespace kestrel
