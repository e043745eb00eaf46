// The decoder layer over T rows on the GPU (layer_forward_rows): the blocks of
// models/gpu/blocks.h run by RowsOps. Per layer
//   norm -> [tap QKV] qkv GEMM (+ biases) [-> q/k head norms] -> RoPE + KV write (T rows)
//   -> causal tensor-core attention over the cache -> [tap O] o GEMM (+ residual) -> norm
//   -> [tap GateUp] gate|up GEMM -> SiLU*up -> [tap Down] down GEMM (+ residual)
//   [OPT: fc1 GEMM + bias -> ReLU -> fc2 GEMM + residual + bias]
// GPTQ linears (each part of an unfused one in its own format) over 3 .. 64 rows run the fused
// small-M GEMM (kernels/gemm/gemm_small.h, DecodeTuning::small_gemm_max_rows); over more they
// dequantize into an FP16 scratch and run cuBLASLt; over 1 or 2 rows they run batch-1 GEMVs.
#include "models/gpu/layer.h"

#include "kernels/activation/activation_cuda.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/gemm/gemm_small.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/rope/rope_rows_cuda.h"
#include "models/gpu/blocks.h"
#include "models/gpu/decoder.h"

namespace kestrel {

namespace {

void run_linear(cuda::GemmRunner& g, const GpuLinear& L, const __half* x, int T, __half* y,
                const __half* residual, const LayerRowsScratch& b, cudaStream_t s) {
  // Over a few tokens a quantized weight runs the fused small-M GEMM (one pass over its codes);
  // a linear that could not be fused (siblings of different formats) runs each part in its own
  // format into its columns of y [T, L.N], FP16 parts as GEMVs or a GEMM.
  const bool small = T >= kSmallGemmMinRows && T <= b.small_max_rows;
  __half* scratch = b.weights;
  int64_t n0 = 0;
  for (const GpuLinear* p : L.leaves()) {
    __half* yp = y + n0;
    const __half* rp = residual ? residual + n0 : nullptr;
    if (p->quantized && small)
      cuda::gemm_small(p->q, x, T, yp, rp, b.small_ws, b.small_ws_bytes, s, {}, {}, L.N);
    else if (p->quantized)
      cuda::quant_linear_rows(g, p->q, x, T, yp, rp, scratch, s, L.N);
    else
      cuda::dense_linear_rows(g, p->dense, p->N, p->K, x, T, yp, rp, s, L.N);
    n0 += p->N;
  }
}

// The blocks' ops over T rows (models/gpu/blocks.h), each a kernel of its own over the rows,
// in the scratch's buffers (LayerRowsScratch: xb, att and act share one, qkv and gate_up
// another). The o bias of a LayerNorm family is added by the norm after it
// (add_layer_norm_f16), so that o's GEMM needs no bias epilogue.
struct RowsOps {
  const ModelConfig& c;
  cuda::GemmRunner& gemm;
  __half* x;                  // [T, hidden] the residual stream
  int T, pos0;
  cuda::KvCacheDev k_cache;   // [ctx, kv_dim] this layer's, in its types
  cuda::KvCacheDev v_cache;
  const LayerRowsScratch& b;
  cudaStream_t s;
  const GpuLayerTaps* taps;
  // A batched decode step (layer_forward_batch): row i is one token of sequence i, at its own
  // position, over its own cache; k_cache, v_cache and pos0 are then unused.
  const GpuBatchRows* batch = nullptr;
  int layer = 0;

  int qkv_n() const { return c.q_dim() + 2 * c.kv_dim(); }
  // Hands a group's input to the taps; false when the caller asked to stop there.
  bool go_on(LinearGroup g, const __half* in, int K) const {
    if (!taps) return true;
    if (taps->input) taps->input(g, in, T, K);
    return taps->stop_after != g;
  }

  // [T, q | k | v] = Wqkv norm(x) (+ the q|k|v biases, laid down first and accumulated onto
  // as a residual)
  bool norm_qkv(const GpuLayer& L) {
    norm_rows(c, x, nullptr, L.input_norm, L.input_norm_bias, T, b.xb, s);
    if (!go_on(LinearGroup::QKV, b.xb, c.hidden)) return false;
    if (L.qkv.bias) cuda::broadcast_rows_f16(L.qkv.bias, T, qkv_n(), b.qkv, qkv_n(), s);
    run_linear(gemm, L.qkv, b.xb, T, b.qkv, L.qkv.bias ? b.qkv : nullptr, b, s);
    return true;
  }

  void head_norms(const GpuLayer& L) {
    cuda::head_rms_norm_f16(b.qkv, qkv_n(), T, c.n_heads, c.n_kv_heads, c.head_dim, L.q_norm,
                            L.k_norm, c.rms_eps, s);
  }

  // RoPE + the KV write, then causal attention over the cache. 8-bit caches: the write rounds
  // to their types and the attention dequantizes its tiles (kernels/attention/kv_cache_cuda.h).
  // A paged cache takes the same two kernels, which read and write through its block table (in
  // f16 too: their f16 path is the f16 kernels' arithmetic).
  void attention(const GpuLayer& L) {
    if (batch) return batch_attention(L);
    if (k_cache.type == KvType::F16 && v_cache.type == KvType::F16 && !k_cache.blocks) {
      __half* kc = static_cast<__half*>(k_cache.data);
      __half* vc = static_cast<__half*>(v_cache.data);
      cuda::rope_kv_write_rows_f16(b.qkv, qkv_n(), T, pos0, kc, vc, c.n_heads, c.n_kv_heads,
                                   c.head_dim, c.rope_scaling(), s, b.pos0);
      cuda::attention_prefill_f16(b.qkv, qkv_n(), kc, vc, pos0, T, c.sliding_window, c.n_heads,
                                  c.n_kv_heads, c.head_dim, b.att, s,  // [T, q_dim]
                                  cuda::PrefillAttnKernel::Mma, b.pos0);
      return;
    }
    cuda::rope_kv_write_rows_kv(b.qkv, qkv_n(), T, pos0, k_cache, v_cache, c.n_heads,
                                c.n_kv_heads, c.head_dim, c.rope_scaling(), s, b.pos0);
    cuda::attention_prefill_kv(b.qkv, qkv_n(), k_cache, v_cache, pos0, T, c.sliding_window,
                               c.n_heads, c.n_kv_heads, c.head_dim, b.att, s,  // [T, q_dim]
                               b.pos0);
  }

  // Row i: RoPE at its sequence's position, the K/V write into that sequence's cache and its
  // attention there, as the decode step runs them (the split flash-decoding kernel: one row
  // over a long cache wants its parallelism over the cache, not over query tiles), all rows in
  // one launch per group of rows of one grid bound (and one write before them all with an
  // 8-bit cache).
  void batch_attention(const GpuLayer&) {
    const bool fused = !batch->types.quantized();
    if (!fused)
      cuda::rope_kv_write_batch(b.qkv, qkv_n(), T, batch->d_pos, batch->seqs, layer,
                                batch->types, c.n_heads, c.n_kv_heads, c.head_dim,
                                c.rope_scaling(), s);
    for (const GpuBatchGroup& g : batch->groups)
      cuda::attention_decode_batch(b.qkv, qkv_n(), g.count, batch->d_order + g.begin,
                                   batch->d_pos, batch->seqs, layer, batch->types, fused, g.bound,
                                   c.sliding_window, c.n_heads, c.n_kv_heads, c.head_dim,
                                   c.rope_scaling(), b.att, c.q_dim(), s, batch->heads_per_block);
  }

  // x += Wo att (bo: in the next norm)
  bool o(const GpuLayer& L) {
    if (!go_on(LinearGroup::O, b.att, c.q_dim())) return false;
    run_linear(gemm, L.o, b.att, T, x, x, b, s);
    return true;
  }

  // h = relu(Wfc1 norm(x + bo) + b1), into the gate|up buffer (xb, which it reads, shares act's)
  bool norm_fc1_relu(const GpuLayer& L) {
    norm_rows(c, x, L.o.bias, L.post_norm, L.post_norm_bias, T, b.xb, s);
    if (!go_on(LinearGroup::GateUp, b.xb, c.hidden)) return false;
    const int64_t inter = c.intermediate;
    cuda::broadcast_rows_f16(L.gate_up.bias, T, inter, b.gate_up, inter, s);
    run_linear(gemm, L.gate_up, b.xb, T, b.gate_up, b.gate_up, b, s);  // [T, inter] + b1
    cuda::relu_f16(b.gate_up, (int64_t)T * inter, s);
    return true;
  }

  // x += Wfc2 h + b2
  bool fc2(const GpuLayer& L) {
    if (!go_on(LinearGroup::Down, b.gate_up, c.intermediate)) return false;
    run_linear(gemm, L.down, b.gate_up, T, x, x, b, s);
    cuda::add_rows_f16(x, c.hidden, L.down.bias, T, c.hidden, s);  // + b2
    return true;
  }

  // act = silu(gate) * up, [gate | up] = Wgate|up norm(x)
  bool norm_gate_up(const GpuLayer& L) {
    norm_rows(c, x, L.o.bias, L.post_norm, L.post_norm_bias, T, b.xb, s);
    if (!go_on(LinearGroup::GateUp, b.xb, c.hidden)) return false;
    run_linear(gemm, L.gate_up, b.xb, T, b.gate_up, nullptr, b, s);  // [T, gate | up]
    cuda::silu_mul_rows_f16(b.gate_up, T, c.intermediate, b.act, s);
    return true;
  }

  // x += Wdown act
  bool down(const GpuLayer& L) {
    if (!go_on(LinearGroup::Down, b.act, c.intermediate)) return false;
    run_linear(gemm, L.down, b.act, T, x, x, b, s);
    return true;
  }
};

}  // namespace

void norm_rows(const ModelConfig& c, __half* x, const __half* add, const __half* w,
               const __half* b, int rows, __half* y, cudaStream_t s) {
  if (c.norm == NormKind::Layer)
    cuda::add_layer_norm_f16(x, add, w, b, c.rms_eps, rows, c.hidden, y, s);
  else
    cuda::rms_norm_f16(x, w, c.rms_eps, rows, c.hidden, y, s);
}

void layer_forward_rows(const ModelConfig& c, const GpuLayer& L, cuda::GemmRunner& gemm, __half* x,
                        int T, int pos0, const cuda::KvCacheDev& k_cache,
                        const cuda::KvCacheDev& v_cache, const LayerRowsScratch& b,
                        cudaStream_t s, const GpuLayerTaps* taps) {
  RowsOps op{c, gemm, x, T, pos0, k_cache, v_cache, b, s, taps};
  decoder_layer(c, L, op);
}

void layer_forward_batch(const ModelConfig& c, const GpuLayer& L, int layer,
                         cuda::GemmRunner& gemm, __half* x, int T, const GpuBatchRows& rows,
                         const LayerRowsScratch& b, cudaStream_t s) {
  RowsOps op{c, gemm, x, T, 0, {}, {}, b, s, nullptr, &rows, layer};
  decoder_layer(c, L, op);
}

void layer_forward_rows(const ModelConfig& c, const GpuLayer& L, cuda::GemmRunner& gemm, __half* x,
                        int T, int pos0, __half* k_cache, __half* v_cache,
                        const LayerRowsScratch& b, cudaStream_t s, const GpuLayerTaps* taps) {
  layer_forward_rows(c, L, gemm, x, T, pos0, cuda::KvCacheDev{KvType::F16, k_cache, nullptr},
                     cuda::KvCacheDev{KvType::F16, v_cache, nullptr}, b, s, taps);
}

}  // namespace kestrel
