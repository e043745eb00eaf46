// A context on the GPU: one sequence's device memory and decode graphs, and its runs over the
// model's forward. A decode step reads its token and position from device memory, so it is
// captured as a CUDA graph (one per range of positions: models/gpu/graphs.h) and replayed per
// token; the host writes two ints and reads one back. Chained and sampled runs:
// models/gpu/runs.cpp; prompts: prefill.cpp; verify passes: verify.cpp.
#include "models/gpu/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "base/error.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"

namespace kestrel {

// Device memory of one session, freed when the session ends (or its constructor throws).
DecoderCudaSession::DecoderCudaSession(DecoderCuda& m, int context, bool quiet) : Session(m), m_(m) {
  const ModelConfig& c = m.cfg_;
  try {
    // KV cache: as long as asked (or the model's maximum), shortened to what fits, in the
    // model's cache types (an 8-bit position takes about half an f16 one: twice the context).
    int ctx = context > 0 ? context : c.max_pos;
    c.check_context(ctx);
    const KvCacheTypes kv = m.cache_;
    const size_t per_pos =
        (size_t)c.n_layers * (kv_row_bytes(kv.k, c.n_kv_heads, c.head_dim, sizeof(__half)) +
                              kv_row_bytes(kv.v, c.n_kv_heads, c.head_dim, sizeof(__half)));
    size_t free_b = 0, total_b = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t reserve = (size_t)256 << 20;  // scratch, graphs, the CUDA context's growth
    const size_t fits = free_b > reserve ? (free_b - reserve) / per_pos : 0;
    if ((size_t)ctx > fits) {
      if (fits < 16)
        throw DeviceError(fmt::format("out of GPU memory: the weights use {}, {} is left, too little "
                                      "for the {} of scratch kept free and a KV cache",
                                      mib(m.weight_bytes_), mib(free_b), mib(reserve)));
      if (!quiet)
        fmt::print(stderr, "note: GPU memory is short: context reduced from {} to {} tokens\n", ctx, fits);
      ctx = (int)fits;
    }
    q_.ctx = ctx;
    q_.cache_bytes = per_pos * ctx;
    q_.types = kv;
    auto alloc = [&](size_t bytes) {
      return mem_.alloc(bytes, fmt::format(" for a context of {}", ctx), "; use -c N");
    };
    const size_t layers = c.n_layers;
    q_.key_cache = alloc(layers * cuda::kv_data_bytes(kv.k, ctx, c.n_kv_heads, c.head_dim));
    q_.value_cache = alloc(layers * cuda::kv_data_bytes(kv.v, ctx, c.n_kv_heads, c.head_dim));
    if (kv.k != KvType::F16)
      q_.key_scales = alloc(layers * cuda::kv_scales_bytes(kv.k, ctx, c.n_kv_heads, c.head_dim));
    if (kv.v != KvType::F16)
      q_.value_scales = alloc(layers * cuda::kv_scales_bytes(kv.v, ctx, c.n_kv_heads, c.head_dim));
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
}

std::vector<OpTime> DecoderCudaSession::profile_step(int token, int pos) {
  set_step_input(token, pos);
  return m_.profiler_.profile(m_.stream_, pos, [&] {
    m_.record_step(q_, m_.stream_, Head::Argmax, graphs_.bound(pos));
  });
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
  KESTREL_CUDA_CHECK(cudaGraphLaunch(graph(pos, head), m_.stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(m_.stream_));
}

void DecoderCudaSession::forward(const int* tokens, int n, int pos, float* logits,
                                 float* all_logits) {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q_.ctx));
  if (n > 1) {  // many tokens: the chunked prefill (models/gpu/prefill.cpp)
    m_.prefill(q_, tokens, n, pos, logits, all_logits, nullptr, nullptr);
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
  m_.prefill(q_, tokens, n, pos, nullptr, nullptr, targets, nll32.data());
  std::copy(nll32.begin(), nll32.end(), nll);
}

}  // namespace kestrel
