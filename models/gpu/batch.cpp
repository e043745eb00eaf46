// The batched decode step on the GPU (Model::forward_batch): one token of each of B sequences,
// each at its own position in its own cache, through the model in one pass. Per chunk of up to
// the prefill scratch's rows:
//   embedding [B, hidden] -> per layer (layer_forward_batch, models/gpu/layer_rows.cpp): the
//   norms and linears over the B rows as a prompt chunk runs them (the fused small-M GEMM from
//   3 rows, each weight read once for all of them), and RoPE + K/V write + attention of every
//   row over its own cache in one launch (the decode step's flash-decoding kernel with the rows
//   in its grid: attention_decode_batch) -> the output head over the B rows -> fp32 logits
//   [B, vocab] to the host.
// It runs on the prefill's scratch, launched from the host (about a dozen launches per layer,
// whatever B). The rows' sequences (caches, tables, workspaces: cuda::KvBatchSeq) go to the
// device with their tokens and positions.
// One row runs the session's own decode step (its CUDA graphs) instead.
#include <algorithm>
#include <fmt/format.h>
#include <vector>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding_cuda.h"
#include "models/gpu/decoder.h"
#include "models/gpu/layer.h"
#include "models/gpu/prefill_state.h"
#include "models/gpu/session.h"

namespace kestrel {

void DecoderCuda::forward_batch(std::span<const BatchRow> rows, float* logits) {
  check_batch_rows(*this, rows);
  const int B = static_cast<int>(rows.size());
  if (B == 0) return;
  std::vector<DecoderCudaSession*> sessions(B);
  std::vector<cuda::KvBatchSeq> seqs(B);
  std::vector<int> tokens(B), positions(B), bounds(B);
  for (int i = 0; i < B; ++i) {
    auto* session = dynamic_cast<DecoderCudaSession*>(rows[i].session);
    KESTREL_CHECK(session != nullptr,
                  fmt::format("forward_batch: row {}'s session is not a CUDA engine session", i));
    sessions[i] = session;
    KESTREL_CHECK(session->q_.kv.types == cache_,
                  fmt::format("forward_batch: row {}'s session has other cache types", i));
    tokens[i] = rows[i].token;
    positions[i] = rows[i].pos;
    // The grid the session's own decode step would launch at this position (its graphs' range).
    bounds[i] = session->graphs_.bound(rows[i].pos);
  }
  if (B == 1) {
    rows[0].session->forward(&rows[0].token, 1, rows[0].pos, logits);
    return;
  }
  // Paged sessions: each row's position made its session's own, the tables uploaded, before
  // the first kernel.
  for (int i = 0; i < B; ++i) sessions[i]->prepare_write(rows[i].pos, 1);
  for (int i = 0; i < B; ++i) seqs[i] = sessions[i]->q_.batch_seq(cfg_);

  const ModelConfig& c = cfg_;
  const size_t vocab = c.vocab;
  PrefillState& S = prefill_state(sessions[0]->q_, /*want_rows=*/true);
  cudaStream_t s = stream_;
  LayerRowsScratch scratch{S.xb, S.qkv, S.att, S.gate_up, S.act, S.scratch};
  scratch.small_max_rows = S.small_max_rows;
  scratch.small_ws = S.small_ws;
  scratch.small_ws_bytes = S.small_ws_bytes;
  for (int r0 = 0; r0 < B; r0 += S.rows) {
    const int T = std::min(S.rows, B - r0);
    // The rows' tokens, and their positions in the targets' buffer (which only the NLL uses).
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.tokens, tokens.data() + r0, T * sizeof(int),
                                       cudaMemcpyHostToDevice, s));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.targets, positions.data() + r0, T * sizeof(int),
                                       cudaMemcpyHostToDevice, s));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.batch_seqs, seqs.data() + r0,
                                       T * sizeof(cuda::KvBatchSeq), cudaMemcpyHostToDevice, s));
    // The chunk's rows by grid bound, and the groups of one bound each.
    std::vector<int> order(T);
    for (int i = 0; i < T; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return bounds[r0 + a] < bounds[r0 + b]; });
    std::vector<GpuBatchGroup> groups;
    for (int k = 0; k < T; ++k) {
      const int bound = bounds[r0 + order[k]];
      if (groups.empty() || groups.back().bound != bound) groups.push_back({k, 0, bound});
      ++groups.back().count;
    }
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.batch_order, order.data(), T * sizeof(int),
                                       cudaMemcpyHostToDevice, s));
    if (w_.positions) {  // x_i = embed[token_i] + positions[pos_i + offset] (OPT), row by row
      const __half* table = w_.positions + (size_t)c.position_offset * c.hidden;
      for (int i = 0; i < T; ++i)
        cuda::embedding_positions_f16(w_.embed, table, S.tokens + i, S.targets + i, 1, c.hidden,
                                      S.x + (size_t)i * c.hidden, s);
    } else {
      cuda::embedding_tokens_f16(w_.embed, S.tokens, T, c.hidden, S.x, s);  // x [T, hidden]
    }
    const GpuBatchRows where{S.batch_seqs, S.targets, S.batch_order, groups, cache_,
                             tuning_.attention_heads_per_block};
    for (int l = 0; l < c.n_layers; ++l)
      layer_forward_batch(c, w_.layers[l], l, S.gemm, S.x, T, where, scratch, s);
    record_rows_logits(S, T, s);  // [T, vocab] fp32
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits + (size_t)r0 * vocab, S.logits,
                                       (size_t)T * vocab * sizeof(float), cudaMemcpyDeviceToHost, s));
    // The next chunk overwrites the tokens, positions and logits: wait for the copies.
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  for (int i = 0; i < B; ++i) sessions[i]->commit_write(rows[i].pos, &rows[i].token, 1);
}

}  // namespace kestrel
