// The decode step on the GPU: one token through embedding, the layers of models/gpu/blocks.h run
// by DecodeOps, and the output head. Per layer (Llama's ops; the other families' in brackets)
//   rmsnorm -> fused qkv GEMV (+ q/k/v biases) [-> per-head q/k norms] -> flash-decoding
//   attention (RoPE and the KV write inside) -> o GEMV (+ residual) -> rmsnorm -> fused gate|up
//   GEMV (SiLU*up in its epilogue) -> down GEMV (+ residual)
//   [OPT: layernorm + qkv GEMV + biases -> attention -> o GEMV (+ residual + bias)
//    -> layernorm + fc1 GEMV + bias, ReLU -> fc2 GEMV (+ residual + bias)]
// then the final norm, the lm_head GEMV and the argmax (or the sampler). The step reads its
// token and position from device memory, so that a session captures it as CUDA graphs and
// replays it per token (models/gpu/session.cpp).
#include <cstring>

#include "base/error.h"
#include "kernels/activation/activation_cuda.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/sampling/argmax_cuda.h"
#include "kernels/sampling/sample_cuda.h"
#include "models/gpu/blocks.h"
#include "models/gpu/decoder.h"

namespace kestrel {

namespace {

constexpr double kHalf = sizeof(__half);

// The blocks' ops for one token (models/gpu/blocks.h). Each GEMV stages x through the block's
// norm and ends in its residual, bias and activation. Under L.order (act-order layers) x is kept
// in the permutation of the GEMV that reads it next, so that qkv and gate|up stage it without a
// gather (models/gpu/act_order.h): x before qkv in qkv's permutation, x2 (after o) in gate|up's.
struct DecodeOps {
  const ModelConfig& c;
  const GpuRunState& r;       // the model's scratch
  const GpuSequence& q;       // the sequence's cache and attention workspace
  cuda::KvCacheDev k_cache;   // [ctx, kv_dim] this layer's, in the sequence's types (paged:
                              // the pool's rows, through the sequence's block table)
  cuda::KvCacheDev v_cache;
  int ctx_bound;              // the graph's range of positions ends here
  const DecodeTuning& tuning;
  StepProfiler& profiler;
  cudaStream_t s;

  bool layer_norm() const { return c.norm == NormKind::Layer; }

  // [q | k | v] = Wqkv norm(x) + b: the norm inside the GEMV's staging, the biases as its residual.
  bool norm_qkv(const GpuLayer& L) {
    const GpuLayer::StreamOrder& O = L.order;
    if (O.on)
      cuda::gemv(O.qkv, r.x, r.qkv, L.qkv.bias, s, {O.input_norm, c.rms_eps});
    else
      L.qkv.run(r.x, r.qkv, L.qkv.bias, s,
                {L.input_norm, c.rms_eps, false, layer_norm(), L.input_norm_bias});
    profiler.mark(layer_norm() ? "layer_norm + gemv qkv" : "rms_norm + gemv qkv",
                  L.qkv.bytes_moved(), s);
    return true;
  }

  void head_norms(const GpuLayer& L) {
    cuda::head_rms_norm_f16(r.qkv, c.q_dim() + 2 * c.kv_dim(), 1, c.n_heads, c.n_kv_heads,
                            c.head_dim, L.q_norm, L.k_norm, c.rms_eps, s);
    profiler.mark("q/k head norms", 0, s);
  }

  // RoPE of q and the new k, the KV-cache write and the attention: one split kernel, which
  // rotates as it reads qkv and merges the chunks in the last block of each head range (under
  // L.order, storing its output in o's act-order permutation). An 8-bit cache takes two: RoPE
  // with the write rounded to the cache's types, then the split kernel reading codes.
  void attention(const GpuLayer& L) {
    if (!q.kv.types.quantized()) {
      cuda::attention_decode_rope_f16(r.qkv, k_cache, v_cache, r.pos, q.ctx, c.sliding_window,
                                      c.n_heads, c.n_kv_heads, c.head_dim, c.rope_scaling(),
                                      q.att_workspace, r.att, s, L.order.att_out, ctx_bound,
                                      tuning.attention_heads_per_block);
      profiler.mark("rope + kv write + attention",
                    profiler.on() ? 2.0 * (profiler.pos() + 1) * c.kv_dim() * kHalf : 0, s);
      return;
    }
    cuda::rope_kv_write_rows_kv(r.qkv, c.q_dim() + 2 * c.kv_dim(), 1, 0, k_cache, v_cache,
                                c.n_heads, c.n_kv_heads, c.head_dim, c.rope_scaling(), s, r.pos);
    profiler.mark("rope + kv write (8-bit)", 0, s);
    cuda::attention_decode_kv(r.qkv, k_cache, v_cache, r.pos, q.ctx, c.sliding_window, c.n_heads,
                              c.n_kv_heads, c.head_dim, q.att_workspace, r.att, s,
                              L.order.att_out, ctx_bound, tuning.attention_heads_per_block);
    const double row = (double)kv_row_bytes(q.kv.types.k, c.n_kv_heads, c.head_dim, 2) +
                       (double)kv_row_bytes(q.kv.types.v, c.n_kv_heads, c.head_dim, 2);
    profiler.mark("attention (8-bit cache)", profiler.on() ? (profiler.pos() + 1) * row : 0, s);
  }

  // x += Wo att (+ bo, in the epilogue). Under L.order: x2 = Wo att + x, x read in qkv's
  // permutation, x2 stored in gate|up's.
  bool o(const GpuLayer& L) {
    const GpuLayer::StreamOrder& O = L.order;
    if (O.on)
      cuda::gemv(O.o, r.att, r.x2, r.x, s, {}, {false, O.o_out, O.o_residual});
    else
      L.o.run(r.att, r.x, r.x, s, {}, {.bias = L.o.bias});
    profiler.mark("gemv o (+residual)", L.o.bytes_moved(), s);
    return true;
  }

  // h = relu(Wfc1 norm(x) + b1): the norm in the staging, bias and ReLU in the epilogue.
  bool norm_fc1_relu(const GpuLayer& L) {
    L.gate_up.run(r.x, r.gate_up, L.gate_up.bias, s,  // [intermediate]
                  {L.post_norm, c.rms_eps, false, true, L.post_norm_bias}, {.relu = true});
    profiler.mark("layer_norm + gemv fc1 + relu", L.gate_up.bytes_moved(), s);
    return true;
  }

  // x += Wfc2 h + b2
  bool fc2(const GpuLayer& L) {
    L.down.run(r.gate_up, r.x, r.x, s, {}, {.bias = L.down.bias});
    profiler.mark("gemv fc2 (+res)", L.down.bytes_moved(), s);
    return true;
  }

  // [gate | up] = Wgate|up norm(x), the norm in the staging. A quantized gate|up applies
  // SiLU(gate) * up in its epilogue, so that down stages plain x [intermediate]; under act-order
  // stored in down's permutation (GpuLayer::down_x_index). A dense one leaves it to down's
  // staging.
  bool norm_gate_up(const GpuLayer& L) {
    const GpuLayer::StreamOrder& O = L.order;
    if (L.gate_up.can_silu_epilogue()) {
      const cuda::GemvEpilogue silu{/*silu_mul=*/true, L.down_x_index};
      if (O.on)
        cuda::gemv(O.gate_up, r.x2, r.gate_up, nullptr, s, {O.post_norm, c.rms_eps}, silu);
      else
        L.gate_up.run(r.x, r.gate_up, nullptr, s, {L.post_norm, c.rms_eps}, silu);
      profiler.mark("rms_norm + gemv gate|up + silu*up", L.gate_up.bytes_moved(), s);
    } else {
      L.gate_up.run(r.x, r.gate_up, nullptr, s, {L.post_norm, c.rms_eps});  // [gate | up]
      profiler.mark("rms_norm + gemv gate|up", L.gate_up.bytes_moved(), s);
    }
    return true;
  }

  // x += Wdown h. Under L.order: x = Wdown h + x2, x2 read in gate|up's order, x stored in the
  // next qkv's.
  bool down(const GpuLayer& L) {
    const GpuLayer::StreamOrder& O = L.order;
    if (L.gate_up.can_silu_epilogue()) {
      const GpuLinear& down = L.down_x_index ? L.down_x_permuted : L.down;
      if (O.on)
        cuda::gemv(down.q, r.gate_up, r.x, r.x2, s, {}, {false, O.down_out, O.down_residual});
      else
        down.run(r.gate_up, r.x, r.x, s);
      profiler.mark("gemv down (+res)", down.bytes_moved(), s);
    } else {
      L.down.run(r.gate_up, r.x, r.x, s, {nullptr, 0.f, /*silu_mul=*/true});
      profiler.mark("silu*up + gemv down (+res)", L.down.bytes_moved(), s);
    }
    return true;
  }
};

}  // namespace

void DecoderCuda::record_step(const GpuSequence& q, cudaStream_t s, Head head, int ctx_bound) {
  const ModelConfig& c = cfg_;
  const bool sampled = head == Head::Sample0 || head == Head::Sample1;
  const bool chained = head == Head::Chain0 || head == Head::Chain1 || sampled;
  if (!chained)
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(s_.token, host_io_, 2 * sizeof(int), cudaMemcpyHostToDevice, s));

  const bool layer_norm = c.norm == NormKind::Layer;
  if (w_.positions)  // x = embed[token] + positions[pos + offset] (OPT)
    cuda::embedding_positions_f16(w_.embed, w_.positions + (size_t)c.position_offset * c.hidden,
                                  s_.token, s_.pos, 1, c.hidden, s_.x, s);
  else if (w_.embed_perm)  // x [hidden] in layer 0's qkv permutation
    cuda::embedding_permuted_f16(w_.embed, s_.token, c.hidden, w_.embed_perm, s_.x, s);
  else
    cuda::embedding_f16(w_.embed, s_.token, c.hidden, s_.x, s);  // x [hidden]
  profiler_.mark("embedding", 2 * c.hidden * kHalf, s);
  for (int l = 0; l < c.n_layers; ++l) {
    DecodeOps op{c, s_, q, q.k_layer(l, c), q.v_layer(l, c), ctx_bound, tuning_, profiler_, s};
    decoder_layer(c, w_.layers[l], op);
  }
  if (head == Head::None) return;

  // [vocab] = lm_head norm(x)
  cuda::gemv_f16(w_.lm_head, s_.x, s_.logits, c.vocab, c.hidden, nullptr, s, {},
                 {w_.final_norm, c.rms_eps, false, layer_norm, w_.final_norm_bias});
  profiler_.mark(layer_norm ? "layer_norm + gemv lm_head" : "rms_norm + gemv lm_head",
                 (double)c.vocab * c.hidden * kHalf, s);
  if (head == Head::Argmax) {
    cuda::argmax_f16(s_.logits, c.vocab, s_.next, s);
    profiler_.mark("argmax", c.vocab * kHalf, s);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_io_ + 2, s_.next, sizeof(int), cudaMemcpyDeviceToHost, s));
  } else if (chained) {
    // s_.token and s_.pos are adjacent: the token feeds the next step and tells the host.
    int* slot = host_io_dev_ + (head == Head::Chain0 || head == Head::Sample0 ? 3 : 4);
    if (sampled) {
      cuda::sample_top_k_f16(s_.logits, c.vocab, s_.sampling, s_.sample_workspace, s_.next, s,
                             s_.token, slot);
      profiler_.mark("top-k sampling", c.vocab * kHalf, s);
    } else {
      cuda::argmax_f16(s_.logits, c.vocab, s_.next, s, s_.token, slot);
      profiler_.mark("argmax", c.vocab * kHalf, s);
    }
  } else {
    cuda::half_to_float(s_.logits, s_.logits_f32, c.vocab, s);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_logits_, s_.logits_f32, c.vocab * sizeof(float),
                                       cudaMemcpyDeviceToHost, s));
  }
}

}  // namespace kestrel
