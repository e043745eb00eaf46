// The prefill on the GPU: the prompt runs through the model in chunks of up to prefill_chunk_
// tokens, each op over the whole chunk at once. Per chunk of T tokens:
//   embedding [T, hidden] (+ learned positions), then per layer
//     norm -> qkv GEMM (+ biases) [-> q/k head norms] -> RoPE + KV write (T rows) -> causal
//     tensor-core attention over the cache -> o GEMM (+ residual) -> norm -> gate|up GEMM ->
//     SiLU*up -> down GEMM (+ residual)   [OPT: fc1 GEMM + bias -> ReLU -> fc2 GEMM + residual
//     + bias]
//   then the output head for the rows whose logits are wanted.
// GPTQ linears over 3 .. 64 rows run the fused small-M GEMM (kernels/gemm/gemm_small.h,
// DecodeTuning::small_gemm_max_rows); over more they dequantize into an FP16 scratch and run
// cuBLASLt; over 1 or 2 rows they run batch-1 GEMVs. The chunk's K and V stay in the cache for the
// decode graph that follows. A prompt's chunks are launched from the host: a chunk is a few
// hundred launches doing milliseconds of work. A speculative verify pass (2 .. 65 rows, the
// rows' argmax on the device) is a few hundred launches doing microseconds of work on a small
// model, so it is captured as a CUDA graph per session and row count and replayed
// (forward_argmax_rows; models/gpu/graphs.h, VerifyGraphs).
#include <algorithm>
#include <cstring>
#include <fmt/format.h>

#include "base/error.h"
#include "kernels/activation/activation_cuda.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_small.h"
#include "kernels/gemm/nll_cuda.h"
#include "kernels/sampling/argmax_cuda.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/rope/rope_rows_cuda.h"
#include "models/gpu/decoder.h"
#include "models/gpu/layer.h"

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
  uint64_t generation = 0;         // which of the model's PrefillStates (VerifyGraphs)

  // Allocates or throws DeviceError (the caller retries with fewer rows).
  void* take(size_t bytes) { return mem.alloc(bytes, " for the prefill scratch"); }
};

void DecoderCuda::PrefillDeleter::operator()(PrefillState* p) const { delete p; }

void DecoderCuda::set_prefill_chunk(int tokens) {
  KESTREL_CHECK(tokens >= 1, fmt::format("prefill chunk must be at least 1 token, got {}", tokens));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  prefill_.reset();
  prefill_chunk_ = tokens;
}

namespace {

// Columns of the two shared activation buffers (PrefillState): qkv | gate_up, and xb | att | act.
size_t qkv_gate_up_cols(const ModelConfig& c) {
  return std::max<size_t>(c.q_dim() + 2 * c.kv_dim(), 2 * (size_t)c.intermediate);
}
size_t xb_att_act_cols(const ModelConfig& c) {
  return std::max({(size_t)c.hidden, (size_t)c.q_dim(), (size_t)c.intermediate});
}

// Bytes of the prefill's activations per token of a chunk (PrefillState's buffers).
size_t prefill_row_bytes(const ModelConfig& c) {
  const size_t halves = c.hidden + qkv_gate_up_cols(c) + xb_att_act_cols(c);
  return halves * sizeof(__half) + 3 * sizeof(int);
}

// Halves of dequantization scratch for chunks of `rows` tokens: the largest any linear needs.
size_t dequant_scratch_elems(const std::vector<GpuLayer>& layers, int rows) {
  size_t e = 0;
  for (const GpuLayer& l : layers)
    for (const GpuLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down})
      for (const GpuLinear* leaf : lin->leaves())
        if (leaf->quantized) e = std::max(e, cuda::quant_gemm_scratch_elems(leaf->q, rows));
  return e;
}

// What is left of the memory target's 5% over `base` (weights + KV cache) once `taken` is.
size_t room_in_target(size_t base, size_t taken) {
  const size_t target = base / 20;
  return target > taken ? target - taken : 0;
}

}  // namespace

int prefill_chunk_rows(size_t base, size_t taken, size_t row_bytes, int max_rows) {
  const size_t room = room_in_target(base, taken);
  const int64_t fit = (int64_t)(room / std::max<size_t>(row_bytes, 1)) / 64 * 64;
  return (int)std::min<int64_t>(max_rows, std::max<int64_t>(fit, 512));
}

size_t prefill_workspace_bytes(size_t base, size_t taken, size_t most) {
  return std::min(most, room_in_target(base, taken)) >> 20 << 20;
}

// The prefill's scratch within the GPU memory target (weights + KV cache + 5%) where that costs
// the prompt little. The decode path took its part at load (device memory in use then, beyond
// the weights); the prefill gets the rest of the 5%, in this order: one dequantized weight
// slice (fixed, 32 MiB), the chunk's activations (prefill_chunk_rows), then cuBLASLt's
// workspace, up to 32 MiB, from what is left (prefill_workspace_bytes; small linears run as
// fast without one). Chunks are never cut below 512 tokens (one 512-token prompt in one pass),
// and the slice never below 32 MiB: each chunk dequantizes every weight again, and smaller
// slices leave SMs idle in their GEMMs. A model too small for that to fit in 5% goes over it
// rather than lose most of its prompt speed (the figures: docs/performance.md).
DecoderCuda::PrefillPlan DecoderCuda::prefill_plan(const GpuSequence& q, int max_rows) const {
  const size_t base = weight_bytes_ + q.cache_bytes;
  const size_t decode = scratch_bytes_;
  // 16 MiB for what the runtime takes as the prefill first runs (cuBLASLt's handle, the
  // modules of its kernels and of the prefill's), which would otherwise push a long prompt's
  // footprint over the target.
  const size_t runtime = size_t(16) << 20;
  const size_t taken = decode + runtime +
                       dequant_scratch_elems(w_.layers, max_rows) * sizeof(__half) +
                       (size_t)cfg_.vocab * sizeof(float);
  PrefillPlan plan;
  plan.rows = prefill_chunk_rows(base, taken, prefill_row_bytes(cfg_), max_rows);
  plan.workspace_bytes = prefill_workspace_bytes(
      base, taken + (size_t)plan.rows * prefill_row_bytes(cfg_), cuda::kGemmWorkspaceBytes);
  return plan;
}

namespace {

// Fewer tokens than this run as batch-1 GEMVs even with the fused small-M GEMM on: two GEMVs
// cost less than one fused pass at its current efficiency (docs/performance.md).
constexpr int kSmallGemmMinRows = 3;

void run_linear(cuda::GemmRunner& g, const GpuLinear& L, const __half* x, int T, __half* y,
                const __half* residual, const LayerRowsScratch& b, cudaStream_t s) {
  // A whole quantized linear over a few tokens: one fused pass over its codes. (Its parts,
  // when it could not be fused, write column slices of y, which gemm_small does not.)
  if (T >= kSmallGemmMinRows && T <= b.small_max_rows && L.quantized) {
    cuda::gemm_small(L.q, x, T, y, residual, b.small_ws, b.small_ws_bytes, s);
    return;
  }
  __half* scratch = b.weights;
  int64_t n0 = 0;  // unfused parts: each into its columns of y [T, L.N]
  for (const GpuLinear* p : L.leaves()) {
    __half* yp = y + n0;
    const __half* rp = residual ? residual + n0 : nullptr;
    if (p->quantized)
      cuda::quant_linear_rows(g, p->q, x, T, yp, rp, scratch, s, L.N);
    else
      cuda::dense_linear_rows(g, p->dense, p->N, p->K, x, T, yp, rp, s, L.N);
    n0 += p->N;
  }
}

// y [rows, hidden] = the family's norm of x (RMSNorm, or LayerNorm with bias b after x += add,
// add being the bias a residual GEMM left out: add_layer_norm_f16).
void norm_rows(const ModelConfig& c, __half* x, const __half* add, const __half* w,
               const __half* b, int rows, __half* y, cudaStream_t s) {
  if (c.norm == NormKind::Layer)
    cuda::add_layer_norm_f16(x, add, w, b, c.rms_eps, rows, c.hidden, y, s);
  else
    cuda::rms_norm_f16(x, w, c.rms_eps, rows, c.hidden, y, s);
}

}  // namespace

void layer_forward_rows(const ModelConfig& c, const GpuLayer& L, cuda::GemmRunner& gemm, __half* x,
                        int T, int pos0, __half* k_cache, __half* v_cache,
                        const LayerRowsScratch& b, cudaStream_t s, const GpuLayerTaps* taps) {
  const int qkv_n = c.q_dim() + 2 * c.kv_dim();
  // Hands a group's input to the taps; true when the caller asked to stop there.
  auto tap = [&](LinearGroup g, const __half* in, int K) {
    if (!taps) return false;
    if (taps->input) taps->input(g, in, T, K);
    return taps->stop_after == g;
  };

  // Attention block: x += Wo attention(rope(Wqkv norm(x) + b)) (+ bo)
  norm_rows(c, x, nullptr, L.input_norm, L.input_norm_bias, T, b.xb, s);
  if (tap(LinearGroup::QKV, b.xb, c.hidden)) return;
  // [T, q | k | v] (+ the q|k|v biases, laid down first and accumulated onto as a residual)
  if (L.qkv.bias) cuda::broadcast_rows_f16(L.qkv.bias, T, qkv_n, b.qkv, qkv_n, s);
  run_linear(gemm, L.qkv, b.xb, T, b.qkv, L.qkv.bias ? b.qkv : nullptr, b, s);
  if (c.qk_norm)  // Qwen3: RMSNorm over each head of q and k, before RoPE
    cuda::head_rms_norm_f16(b.qkv, qkv_n, T, c.n_heads, c.n_kv_heads, c.head_dim, L.q_norm,
                            L.k_norm, c.rms_eps, s);
  cuda::rope_kv_write_rows_f16(b.qkv, qkv_n, T, pos0, k_cache, v_cache, c.n_heads, c.n_kv_heads,
                               c.head_dim, c.rope_scaling(), s, b.pos0);
  cuda::attention_prefill_f16(b.qkv, qkv_n, k_cache, v_cache, pos0, T, c.sliding_window,
                              c.n_heads, c.n_kv_heads, c.head_dim, b.att, s,  // [T, q_dim]
                              cuda::PrefillAttnKernel::Mma, b.pos0);
  if (tap(LinearGroup::O, b.att, c.q_dim())) return;
  run_linear(gemm, L.o, b.att, T, x, x, b, s);

  // MLP block, xb = norm(x + bo): x += Wdown (silu(Wgate xb) * Wup xb), or (ReLU)
  // x += Wfc2 relu(Wfc1 xb + b1) + b2
  norm_rows(c, x, L.o.bias, L.post_norm, L.post_norm_bias, T, b.xb, s);
  if (tap(LinearGroup::GateUp, b.xb, c.hidden)) return;
  if (c.mlp == MlpKind::ReLU) {
    // fc1 into the gate|up buffer (xb, which it reads, shares act's)
    const int64_t inter = c.intermediate;
    cuda::broadcast_rows_f16(L.gate_up.bias, T, inter, b.gate_up, inter, s);
    run_linear(gemm, L.gate_up, b.xb, T, b.gate_up, b.gate_up, b, s);  // [T, inter] + b1
    cuda::relu_f16(b.gate_up, (int64_t)T * inter, s);
    if (tap(LinearGroup::Down, b.gate_up, c.intermediate)) return;
    run_linear(gemm, L.down, b.gate_up, T, x, x, b, s);
    cuda::add_rows_f16(x, c.hidden, L.down.bias, T, c.hidden, s);  // + b2
    return;
  }
  run_linear(gemm, L.gate_up, b.xb, T, b.gate_up, nullptr, b, s);  // [T, gate | up]
  cuda::silu_mul_rows_f16(b.gate_up, T, c.intermediate, b.act, s);
  if (tap(LinearGroup::Down, b.act, c.intermediate)) return;
  run_linear(gemm, L.down, b.act, T, x, x, b, s);
}

void DecoderCuda::check_tokens(const int* tokens, int n) const {
  for (int i = 0; i < n; ++i)
    KESTREL_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab,
                  fmt::format("token id {} at prompt index {} is outside the vocabulary ({})",
                              tokens[i], i, cfg_.vocab));
}

DecoderCuda::PrefillState& DecoderCuda::prefill_state(const GpuSequence& q, bool want_rows) {
  const ModelConfig& c = cfg_;
  const size_t vocab = c.vocab;
  // Scratch for the largest chunk that fits: halve on out-of-memory (the KV cache may have
  // taken most of the GPU), down to 16 tokens.
  if (!prefill_) {
    int rows = std::min(prefill_chunk_, q.ctx);
    for (;;) {
      try {
        const PrefillPlan plan = prefill_plan(q, rows);
        rows = plan.rows;
        const size_t scratch = dequant_scratch_elems(w_.layers, rows);
        cuda::GemmMemory mem;
        mem.workspace_bytes = plan.workspace_bytes;
        auto st = std::unique_ptr<PrefillState, PrefillDeleter>(new PrefillState(mem));
        st->rows = rows;
        auto halves = [&](size_t k) { return static_cast<__half*>(st->take(k * sizeof(__half))); };
        st->tokens = static_cast<int*>(st->take(rows * sizeof(int)));
        st->targets = static_cast<int*>(st->take(rows * sizeof(int)));
        st->nll = static_cast<float*>(st->take(rows * sizeof(float)));
        st->x = halves((size_t)rows * c.hidden);
        st->xb = st->att = st->act = halves((size_t)rows * xb_att_act_cols(c));
        st->qkv = st->gate_up = halves((size_t)rows * qkv_gate_up_cols(c));
        st->scratch = halves(scratch);
        st->logits = static_cast<float*>(st->take(vocab * sizeof(float)));
        st->logits_rows = 1;
        st->rows_in = static_cast<int*>(st->take((1 + kVerifyMaxRows) * sizeof(int)));
        if (tuning_.small_gemm_max_rows >= kSmallGemmMinRows) {
          // Outside the memory plan: the split-K partials and gathered x of the largest call
          // (gemm_small_workspace_bytes; under 20 MiB on a 7B), which the halving of the rows
          // below also covers when the device is short.
          st->small_max_rows = std::min({tuning_.small_gemm_max_rows, cuda::kGemmSmallMaxRows, rows});
          size_t ws = 0;
          for (const GpuLayer& L : w_.layers)
            for (const GpuLinear* lin : {&L.qkv, &L.o, &L.gate_up, &L.down})
              if (lin->quantized)
                for (int m = kSmallGemmMinRows; m <= st->small_max_rows; ++m)
                  ws = std::max(ws, cuda::gemm_small_workspace_bytes(lin->q, m));
          if (ws > 0) {
            st->small_ws = st->take(ws);
            KESTREL_CUDA_CHECK(cudaMemsetAsync(st->small_ws, 0, ws, stream_));
          }
          st->small_ws_bytes = ws;
        }
        st->generation = ++prefill_generations_;
        prefill_ = std::move(st);
        break;
      } catch (const DeviceError&) {
        if (rows <= 16) throw;
        rows /= 2;
      }
    }
  }
  PrefillState& S = *prefill_;
  // The head's logits grow once, to every row of a chunk: the buffer a verify graph binds is
  // never replaced after that (the one-row buffer before it stays allocated with the state).
  if (want_rows && S.logits_rows < S.rows) {
    S.logits = static_cast<float*>(S.take((size_t)S.rows * vocab * sizeof(float)));
    S.logits_rows = S.rows;
  }
  return S;
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
  const size_t kv_layer = (size_t)q.ctx * c.kv_dim();
  for (int l = 0; l < c.n_layers; ++l)
    layer_forward_rows(c, w_.layers[l], S.gemm, S.x, T, d_pos ? 0 : p0, q.key_cache + l * kv_layer,
                       q.value_cache + l * kv_layer, scratch, s);
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

void DecoderCuda::forward_argmax_rows(DecoderCudaSession& q, const int* tokens, int n, int pos,
                                    int* out) {
  KESTREL_CHECK(n > 0, "forward_argmax_rows: no tokens");
  KESTREL_CHECK(pos + n <= q.q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q.q_.ctx));
  if (n == 1) {  // one row: the decode step's graph, as plain greedy decoding runs it
    out[0] = forward_argmax(q, tokens[0], pos);
    return;
  }
  // A pass longer than a chunk (a chunk shortened by set_prefill_chunk or short memory) runs
  // uncaptured, in chunks.
  const bool graphs = tuning_.verify_graphs && n <= kVerifyMaxRows;
  if (graphs && prefill_) {
    if (cudaGraphExec_t g = q.verify_graphs_.get(n, prefill_->generation)) {
      KESTREL_CHECK(pos >= 0, fmt::format("position {} is negative", pos));
      check_tokens(tokens, n);
      host_rows_[0] = pos;
      std::memcpy(host_rows_ + 1, tokens, n * sizeof(int));
      KESTREL_CUDA_CHECK(cudaGraphLaunch(g, stream_));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::memcpy(out, host_rows_ + 1 + kVerifyMaxRows, n * sizeof(int));
      return;
    }
  }
  prefill(q.q_, tokens, n, pos, nullptr, nullptr, nullptr, nullptr, out);
  // The pass just run made what the graph binds (the scratch, the logits of every row) and
  // chose cuBLASLt's algorithms and the fused GEMM's plans for these shapes, so that the
  // capture only records launches. It is replayed from the next pass of n rows on.
  if (graphs && n <= prefill_->rows)
    q.verify_graphs_.put(n, prefill_->generation,
                         capture_graph(stream_, [&] { record_verify(q.q_, n, stream_); }));
}

void DecoderCuda::forward_nll(DecoderCudaSession& q, const int* tokens, int n, int pos,
                            const int* targets, double* nll) {
  KESTREL_CHECK(n > 0, "forward_nll: no tokens");
  KESTREL_CHECK(pos + n <= q.q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q.q_.ctx));
  for (int i = 0; i < n; ++i)
    KESTREL_CHECK(targets[i] < cfg_.vocab,
                  fmt::format("target id {} at index {} is outside the vocabulary ({})", targets[i],
                              i, cfg_.vocab));
  std::vector<float> nll32(n);  // the device's log-softmax is fp32
  prefill(q.q_, tokens, n, pos, nullptr, nullptr, targets, nll32.data());
  std::copy(nll32.begin(), nll32.end(), nll);
}

}  // namespace kestrel
