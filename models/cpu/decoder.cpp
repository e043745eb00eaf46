// The decoder forward pass on the CPU reference ops, one token at a time, in fp32.
#include "models/cpu/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "kernels/activation/activation.h"
#include "kernels/attention/attention.h"
#include "kernels/matmul/matmul.h"
#include "kernels/norm/norm.h"
#include "kernels/rope/rope.h"

namespace kestrel {

CpuLinear CpuLinear::load(const LinearSpec& spec) {
  CpuLinear l;
  l.N = spec.N;
  l.K = spec.K;
  l.quantized = spec.quantized;
  if (spec.quantized) {
    l.bits = spec.bits;
    l.group_size = spec.group_size;
    l.zero_offset = spec.zero_offset;
    l.qweight = spec.qweight->copy_as<uint32_t>();
    l.qzeros = spec.qzeros->copy_as<uint32_t>();
    l.scales = spec.scales->copy_as<uint16_t>();
    if (spec.g_idx) {
      l.g_idx = spec.g_idx->copy_as<int32_t>();
    } else {
      l.g_idx.resize(l.K);
      for (int64_t k = 0; k < l.K; ++k) l.g_idx[k] = spec.group_size > 0 ? k / spec.group_size : 0;
    }
  } else {
    l.w = to_float(*spec.weight);
  }
  if (spec.bias) l.bias = to_float(*spec.bias);
  return l;
}

gptq::GptqView CpuLinear::view() const {
  gptq::GptqView v;
  v.bits = bits;
  v.group_size = group_size;
  v.K = K;
  v.N = N;
  v.zero_offset = zero_offset;
  v.qweight = qweight.data();
  v.qzeros = qzeros.data();
  v.scales = scales.data();
  v.g_idx = g_idx.data();
  return v;
}

void CpuLinear::forward(const float* x, int64_t M, float* y) const {
  if (!quantized) {
    matmul_ref(x, w.data(), bias.empty() ? nullptr : bias.data(), M, N, K, y);
    return;
  }
  gptq::matmul_ref(view(), x, M, y);
  if (!bias.empty())
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

DecoderCpu::DecoderCpu(const ModelSpec& spec) : cfg_(spec.config) {
  const ModelConfig& c = cfg_;
  w_.embed = to_float(*spec.embed);
  if (spec.positions) w_.positions = to_float(*spec.positions);
  w_.final_norm = to_float(*spec.final_norm);
  if (spec.final_norm_bias) w_.final_norm_bias = to_float(*spec.final_norm_bias);
  inv_freq_ = rope_inv_freq(c.head_dim, c.rope_scaling());
  LinearSpec head;
  head.name = "lm_head";
  head.N = cfg_.vocab;
  head.K = cfg_.hidden;
  head.weight = spec.lm_head;
  w_.lm_head = CpuLinear::load(head);
  w_.layers.reserve(cfg_.n_layers);
  for (const LayerSpec& ls : spec.layers) w_.layers.push_back(load_layer(ls));
}

CpuRunState DecoderCpu::run_state(int context) const {
  CpuRunState s;
  s.ctx = context > 0 ? context : cfg_.max_pos;
  cfg_.check_context(s.ctx);
  const size_t cache = (size_t)cfg_.n_layers * s.ctx * cfg_.kv_dim();
  s.key_cache.assign(cache, 0.0f);
  s.value_cache.assign(cache, 0.0f);
  return s;
}

std::unique_ptr<DecoderCpuSession> DecoderCpu::new_cpu_session(int context) {
  return std::make_unique<DecoderCpuSession>(*this, context);
}

std::unique_ptr<Session> DecoderCpu::new_session(int context, bool) { return new_cpu_session(context); }

void DecoderCpu::norm(const float* x, const std::vector<float>& w, const std::vector<float>& b,
                    int rows, float* y) const {
  if (cfg_.norm == NormKind::Layer)
    layer_norm_ref(x, w.data(), b.data(), cfg_.rms_eps, rows, cfg_.hidden, y);
  else
    rms_norm_ref(x, w.data(), cfg_.rms_eps, rows, cfg_.hidden, y);
}

void DecoderCpu::position_qk(const CpuLayer& L, float* q, float* k, int pos) const {
  const ModelConfig& c = cfg_;
  if (c.qk_norm) {  // RMSNorm over each head, one weight of head_dim shared by the heads
    rms_norm_ref(q, L.q_norm.data(), c.rms_eps, c.n_heads, c.head_dim, q);
    rms_norm_ref(k, L.k_norm.data(), c.rms_eps, c.n_kv_heads, c.head_dim, k);
  }
  if (c.positions == PositionKind::Rope) {
    rope_ref(q, c.n_heads, c.head_dim, pos, inv_freq_.data());
    rope_ref(k, c.n_kv_heads, c.head_dim, pos, inv_freq_.data());
  }
}

void DecoderCpu::forward_token(CpuRunState& st, int token, int pos, float* logits) const {
  forward_rows(st, &token, 1, pos, logits);
}

// The readable forward pass, over n consecutive tokens (one, for a decode step; a speculative
// draft's few, for its verification): each linear takes the n rows in one call, and every row
// gets the arithmetic it would get alone.
void DecoderCpu::forward_rows(CpuRunState& st, const int* tokens, int n, int pos,
                            float* logits) const {
  const ModelConfig& c = cfg_;
  const int hidden = c.hidden, kv_dim = c.kv_dim(), q_dim = c.q_dim(), inter = c.intermediate;
  KESTREL_CHECK(n > 0 && pos >= 0 && pos + n <= st.ctx,
                std::to_string(n) + " tokens at position " + std::to_string(pos) +
                    " do not fit the context of " + std::to_string(st.ctx));
  const size_t N = n;
  std::vector<float> x(N * hidden), xb(N * hidden), proj(N * hidden);  // [n, hidden]
  std::vector<float> q(N * q_dim), att(N * q_dim);                     // [n, q_dim]
  std::vector<float> k(N * kv_dim), v(N * kv_dim);                     // [n, kv_dim]
  std::vector<float> gate(N * inter), up(N * inter);                   // [n, intermediate]

  // x = embed[token] (+ the learned row of its position)
  embed(tokens, n, pos, x.data());

  for (int l = 0; l < c.n_layers; ++l) {
    const CpuLayer& L = w_.layers[l];
    float* k_cache = &st.key_cache[(size_t)l * st.ctx * kv_dim];    // [ctx, kv_dim]
    float* v_cache = &st.value_cache[(size_t)l * st.ctx * kv_dim];  // [ctx, kv_dim]

    // Attention block: xb = norm(x); q, k, v = xb Wq, xb Wk, xb Wv (+ biases); per-head norms
    // and RoPE on q and k. Every row's K/V goes into the cache before any row attends.
    norm(x.data(), L.input_norm, L.input_norm_bias, n, xb.data());
    L.q.forward(xb.data(), n, q.data());
    L.k.forward(xb.data(), n, k.data());
    L.v.forward(xb.data(), n, v.data());
    for (int i = 0; i < n; ++i) {
      position_qk(L, &q[i * q_dim], &k[i * kv_dim], pos + i);
      std::copy_n(&k[i * kv_dim], kv_dim, k_cache + (size_t)(pos + i) * kv_dim);
      std::copy_n(&v[i * kv_dim], kv_dim, v_cache + (size_t)(pos + i) * kv_dim);
    }

    // Causal attention of the row at position p over [first, p]; Mistral's sliding window
    // limits first.
    for (int i = 0; i < n; ++i) {
      const int p = pos + i;
      const int first = c.sliding_window > 0 ? std::max(0, p - c.sliding_window + 1) : 0;
      attention_ref(&q[i * q_dim], k_cache + (size_t)first * kv_dim,
                    v_cache + (size_t)first * kv_dim, c.n_heads, c.n_kv_heads, c.head_dim,
                    p - first + 1, &att[i * q_dim]);
    }

    // x += att Wo
    L.o.forward(att.data(), n, proj.data());
    for (size_t i = 0; i < N * hidden; ++i) x[i] += proj[i];

    // MLP block, xb = norm(x): x += (silu(xb Wgate) * (xb Wup)) Wdown, or (ReLU MLP)
    // x += relu(xb Wfc1) Wfc2.
    norm(x.data(), L.post_norm, L.post_norm_bias, n, xb.data());
    L.up.forward(xb.data(), n, up.data());
    if (c.mlp == MlpKind::GatedSiLU) {
      L.gate.forward(xb.data(), n, gate.data());
      silu_mul_ref(gate.data(), up.data(), N * inter, up.data());
    } else {
      relu_ref(up.data(), N * inter);
    }
    L.down.forward(up.data(), n, proj.data());
    for (size_t i = 0; i < N * hidden; ++i) x[i] += proj[i];
  }

  // logits [n, vocab] = norm(x) Wlm_head
  norm(x.data(), w_.final_norm, w_.final_norm_bias, n, xb.data());
  w_.lm_head.forward(xb.data(), n, logits);
}

void DecoderCpu::forward(CpuRunState& st, const int* tokens, int n, int pos, float* logits,
                       float* all_logits) const {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= st.ctx, std::to_string(pos + n) + " tokens do not fit the context of " +
                                     std::to_string(st.ctx));
  // Every row's logits of a short run are a speculative verification (or as cheap either
  // way): forward_rows gives each row the arithmetic of a decode step, so that the ids
  // verified equal those decoded one at a time. Long runs (prompts, perplexity windows) take
  // the BLAS batch.
  if (all_logits && n > 1 && n <= kRowsMax) {
    forward_rows(st, tokens, n, pos, all_logits);
    std::copy_n(all_logits + (size_t)(n - 1) * cfg_.vocab, cfg_.vocab, logits);
    return;
  }
  if (n > 1) return forward_batch(st, tokens, n, pos, logits, all_logits);  // cpu/decoder_batch.cpp
  const size_t vocab = cfg_.vocab;
  for (int i = 0; i < n; ++i) {
    float* out = all_logits ? all_logits + i * vocab : logits;
    forward_token(st, tokens[i], pos + i, out);
  }
  if (all_logits) std::copy_n(all_logits + (size_t)(n - 1) * vocab, vocab, logits);
}

}  // namespace kestrel
