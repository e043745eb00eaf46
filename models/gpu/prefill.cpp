// Runs of rows on the GPU: the prompt runs through the model in chunks of up to prefill_chunk_
// tokens, each op over the whole chunk at once. Per chunk of T tokens: embedding [T, hidden]
// (+ learned positions), then the layers of models/gpu/blocks.h run by RowsOps
// (models/gpu/layer_rows.cpp), then the output head for the rows whose logits are wanted. The
// chunk's K and V stay in the cache for the decode graph that follows. A prompt's chunks are
// launched from the host: a chunk is a few hundred launches doing milliseconds of work. A
// speculative verify pass runs the same rows from a CUDA graph (models/gpu/verify.cpp).
#include <algorithm>
#include <cstring>
#include <fmt/format.h>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/nll_cuda.h"
#include "kernels/sampling/argmax_cuda.h"
#include "models/gpu/decoder.h"
#include "models/gpu/layer.h"
#include "models/gpu/prefill_state.h"

namespace kestrel {

void DecoderCuda::check_tokens(const int* tokens, int n) const {
  for (int i = 0; i < n; ++i)
    KESTREL_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab,
                  fmt::format("token id {} at prompt index {} is outside the vocabulary ({})",
                              tokens[i], i, cfg_.vocab));
}

void DecoderCuda::record_rows(PrefillState& S, const GpuSequence& q, const int* d_tokens, int T,
                            int p0, const int* d_pos, cudaStream_t s) {
  const ModelConfig& c = cfg_;
  if (w_.positions)  // x [T, hidden] = embedding + learned positions (OPT), from row p0 or *d_pos
    cuda::embedding_positions_f16(
        w_.embed, w_.positions + (size_t)((d_pos ? 0 : p0) + c.position_offset) * c.hidden,
        d_tokens, d_pos, T, c.hidden, S.x, s);
  else
    cuda::embedding_tokens_f16(w_.embed, d_tokens, T, c.hidden, S.x, s);  // x [T, hidden]

  LayerRowsScratch scratch{S.xb, S.qkv, S.att, S.gate_up, S.act, S.scratch};
  scratch.small_max_rows = S.small_max_rows;
  scratch.small_ws = S.small_ws;
  scratch.small_ws_bytes = S.small_ws_bytes;
  scratch.pos0 = d_pos;
  for (int l = 0; l < c.n_layers; ++l)
    layer_forward_rows(c, w_.layers[l], S.gemm, S.x, T, d_pos ? 0 : p0, q.k_layer(l, c),
                       q.v_layer(l, c), scratch, s);
}

// Output head: FP32 logits straight from the GEMM's FP32 accumulators.
void DecoderCuda::record_rows_logits(PrefillState& S, int T, cudaStream_t s) {
  const ModelConfig& c = cfg_;
  norm_rows(c, S.x, nullptr, w_.final_norm, w_.final_norm_bias, T, S.xb, s);
  S.gemm.gemm_f32(S.xb, w_.lm_head, T, c.vocab, c.hidden, S.logits, s);  // [T, vocab]
}

void DecoderCuda::prefill(const GpuSequence& q, const int* tokens, int n, int pos, float* logits,
                        float* all_logits, const int* targets, float* nll, int* argmax) {
  const ModelConfig& c = cfg_;
  check_tokens(tokens, n);
  const size_t vocab = c.vocab;
  const bool want_rows = all_logits || nll || argmax;
  PrefillState& S = prefill_state(q, want_rows);

  cudaStream_t s = stream_;
  for (int c0 = 0; c0 < n; c0 += S.rows) {
    const int T = std::min(S.rows, n - c0);
    const int p0 = pos + c0;
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.tokens, tokens + c0, T * sizeof(int), cudaMemcpyHostToDevice, s));
    record_rows(S, q, S.tokens, T, p0, nullptr, s);

    const bool last = c0 + T == n;
    if (want_rows) {
      record_rows_logits(S, T, s);
      if (nll) {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(S.targets, targets + c0, T * sizeof(int),
                                           cudaMemcpyHostToDevice, s));
        cuda::nll_rows_f32(S.logits, S.targets, T, c.vocab, S.nll, s);
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(nll + c0, S.nll, T * sizeof(float), cudaMemcpyDeviceToHost, s));
      }
      if (argmax) {  // into targets' buffer, which only the NLL uses
        cuda::argmax_rows_f32(S.logits, T, c.vocab, S.targets, s);
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(argmax + c0, S.targets, T * sizeof(int),
                                           cudaMemcpyDeviceToHost, s));
      }
      if (all_logits)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(all_logits + (size_t)c0 * vocab, S.logits,
                                           (size_t)T * vocab * sizeof(float), cudaMemcpyDeviceToHost, s));
      if (last && logits)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits, S.logits + (size_t)(T - 1) * vocab,
                                           vocab * sizeof(float), cudaMemcpyDeviceToHost, s));
    } else if (last && logits) {
      __half* x_last = S.x + (size_t)(T - 1) * c.hidden;
      norm_rows(c, x_last, nullptr, w_.final_norm, w_.final_norm_bias, 1, S.xb, s);
      S.gemm.gemm_f32(S.xb, w_.lm_head, 1, c.vocab, c.hidden, S.logits, s);  // [1, vocab]
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits, S.logits, vocab * sizeof(float), cudaMemcpyDeviceToHost, s));
    }
    // The next chunk overwrites tokens, targets and the head's buffers: wait for the copies.
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  }
}

}  // namespace kestrel
