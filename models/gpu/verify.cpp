// Speculative verify passes on the GPU: 2 .. kVerifyMaxRows rows through the prefill's layers,
// the output head and each row's argmax, with only n ids reaching the host. A pass is a few
// hundred launches doing microseconds of work on a small model, so it is captured as a CUDA
// graph per session and row count and replayed (models/gpu/graphs.h, VerifyGraphs).
#include <cstring>
#include <fmt/format.h>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/sampling/argmax_cuda.h"
#include "models/gpu/decoder.h"
#include "models/gpu/prefill_state.h"

namespace kestrel {

// The verify pass of n rows as the uncaptured prefill runs it (one chunk, the rows' argmax into
// targets' buffer), with the position and the tokens read on the device from rows_in, which
// the graph fills from host_rows_ first, and the ids copied to host_rows_ last. Only pinned
// memory on the host side, and no synchronisation: the whole of it is captured.
void DecoderCuda::record_verify(const GpuSequence& q, int n, cudaStream_t s) {
  PrefillState& S = *prefill_;
  KESTREL_CHECK(n >= 2 && n <= kVerifyMaxRows && n <= S.rows && S.logits_rows >= n,
                fmt::format("internal: a verify graph of {} rows over a scratch of {} rows and "
                            "logits of {}", n, S.rows, S.logits_rows));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.rows_in, host_rows_, (1 + n) * sizeof(int),
                                     cudaMemcpyHostToDevice, s));
  record_rows(S, q, S.rows_in + 1, n, 0, S.rows_in, s);
  record_rows_logits(S, n, s);
  cuda::argmax_rows_f32(S.logits, n, cfg_.vocab, S.targets, s);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_rows_ + 1 + kVerifyMaxRows, S.targets, n * sizeof(int),
                                     cudaMemcpyDeviceToHost, s));
}

void DecoderCudaSession::forward_argmax_rows(const int* tokens, int n, int pos, int* out) {
  KESTREL_CHECK(n > 0, "forward_argmax_rows: no tokens");
  KESTREL_CHECK(pos + n <= q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q_.ctx));
  if (n == 1) {  // one row: the decode step's graph, as plain greedy decoding runs it
    out[0] = forward_argmax(tokens[0], pos);
    return;
  }
  DecoderCuda& m = m_;
  constexpr int kMaxRows = DecoderCuda::kVerifyMaxRows;
  // A pass longer than a chunk (a chunk shortened by set_prefill_chunk or short memory) runs
  // uncaptured, in chunks.
  const bool graphs = m.tuning_.verify_graphs && n <= kMaxRows;
  if (graphs && m.prefill_) {
    if (cudaGraphExec_t g = verify_graphs_.get(n, m.prefill_->generation)) {
      KESTREL_CHECK(pos >= 0, fmt::format("position {} is negative", pos));
      m.check_tokens(tokens, n);
      prepare_write(pos, n);
      m.host_rows_[0] = pos;
      std::memcpy(m.host_rows_ + 1, tokens, n * sizeof(int));
      KESTREL_CUDA_CHECK(cudaGraphLaunch(g, m.stream_));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(m.stream_));
      std::memcpy(out, m.host_rows_ + 1 + kMaxRows, n * sizeof(int));
      commit_write(pos, tokens, n);
      return;
    }
  }
  prepare_write(pos, n);
  m.prefill(q_, tokens, n, pos, nullptr, nullptr, nullptr, nullptr, out);
  commit_write(pos, tokens, n);
  // The pass just run made what the graph binds (the scratch, the logits of every row) and
  // chose cuBLASLt's algorithms and the fused GEMM's plans for these shapes, so that the
  // capture only records launches. It is replayed from the next pass of n rows on.
  if (graphs && n <= m.prefill_->rows)
    verify_graphs_.put(n, m.prefill_->generation,
                       capture_graph(m.stream_, [&] { m.record_verify(q_, n, m.stream_); }));
}

}  // namespace kestrel
