// The Llama forward pass on the CPU reference ops, one token at a time, in fp32.
#include "models/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/error.h"
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

LlamaCpu::LlamaCpu(const ModelSpec& spec, int context) : cfg_(spec.config) {
  ctx_ = context > 0 ? context : cfg_.max_pos;
  const int hidden = cfg_.hidden;

  w_.embed = to_float(*spec.embed);
  w_.final_norm = to_float(*spec.final_norm);
  LinearSpec head;
  head.name = "lm_head";
  head.N = cfg_.vocab;
  head.K = hidden;
  head.weight = spec.lm_head;
  w_.lm_head = CpuLinear::load(head);
  w_.layers.reserve(cfg_.n_layers);
  for (const LayerSpec& ls : spec.layers) w_.layers.push_back(load_layer(ls));

  s_.x.resize(hidden);
  s_.xb.resize(hidden);
  s_.q.resize(cfg_.q_dim());
  s_.k.resize(cfg_.kv_dim());
  s_.v.resize(cfg_.kv_dim());
  s_.att.resize(cfg_.q_dim());
  s_.gate.resize(cfg_.intermediate);
  s_.up.resize(cfg_.intermediate);
  s_.proj.resize(hidden);
  const size_t cache = (size_t)cfg_.n_layers * ctx_ * cfg_.kv_dim();
  s_.key_cache.assign(cache, 0.0f);
  s_.value_cache.assign(cache, 0.0f);
}

void LlamaCpu::forward_token(int token, int pos, float* logits) {
  const ModelConfig& c = cfg_;
  const int hidden = c.hidden, kv_dim = c.kv_dim();
  KESTREL_CHECK(token >= 0 && token < c.vocab,
                "token id " + std::to_string(token) + " is outside the vocabulary (" +
                    std::to_string(c.vocab) + ")");
  KESTREL_CHECK(pos >= 0 && pos < ctx_, "position " + std::to_string(pos) +
                                             " is past the context of " + std::to_string(ctx_));

  // x [hidden] = embed[token]
  std::copy_n(&w_.embed[(size_t)token * hidden], hidden, s_.x.begin());

  for (int l = 0; l < c.n_layers; ++l) {
    const CpuLayer& L = w_.layers[l];
    float* k_cache = &s_.key_cache[(size_t)l * ctx_ * kv_dim];    // [ctx, kv_dim]
    float* v_cache = &s_.value_cache[(size_t)l * ctx_ * kv_dim];  // [ctx, kv_dim]

    // Attention block: xb = rmsnorm(x); q, k, v = xb Wq, xb Wk, xb Wv; RoPE on q and k.
    rms_norm_ref(s_.x.data(), L.input_norm.data(), c.rms_eps, 1, hidden, s_.xb.data());
    L.q.forward(s_.xb.data(), 1, s_.q.data());
    L.k.forward(s_.xb.data(), 1, s_.k.data());
    L.v.forward(s_.xb.data(), 1, s_.v.data());
    rope_ref(s_.q.data(), c.n_heads, c.head_dim, pos, c.rope_theta, c.rope_linear_factor);
    rope_ref(s_.k.data(), c.n_kv_heads, c.head_dim, pos, c.rope_theta, c.rope_linear_factor);
    std::copy(s_.k.begin(), s_.k.end(), k_cache + (size_t)pos * kv_dim);
    std::copy(s_.v.begin(), s_.v.end(), v_cache + (size_t)pos * kv_dim);

    // Causal attention over positions [first, pos]; Mistral's sliding window limits first.
    const int first = c.sliding_window > 0 ? std::max(0, pos - c.sliding_window + 1) : 0;
    attention_ref(s_.q.data(), k_cache + (size_t)first * kv_dim, v_cache + (size_t)first * kv_dim,
                  c.n_heads, c.n_kv_heads, c.head_dim, pos - first + 1, s_.att.data());

    // x += att Wo
    L.o.forward(s_.att.data(), 1, s_.proj.data());
    for (int i = 0; i < hidden; ++i) s_.x[i] += s_.proj[i];

    // MLP block: x += (silu(xb Wgate) * (xb Wup)) Wdown, xb = rmsnorm(x)
    rms_norm_ref(s_.x.data(), L.post_norm.data(), c.rms_eps, 1, hidden, s_.xb.data());
    L.gate.forward(s_.xb.data(), 1, s_.gate.data());
    L.up.forward(s_.xb.data(), 1, s_.up.data());
    silu_mul_ref(s_.gate.data(), s_.up.data(), c.intermediate, s_.gate.data());
    L.down.forward(s_.gate.data(), 1, s_.proj.data());
    for (int i = 0; i < hidden; ++i) s_.x[i] += s_.proj[i];
  }

  // logits [vocab] = rmsnorm(x) Wlm_head
  rms_norm_ref(s_.x.data(), w_.final_norm.data(), c.rms_eps, 1, hidden, s_.xb.data());
  w_.lm_head.forward(s_.xb.data(), 1, logits);
}

void LlamaCpu::forward(const int* tokens, int n, int pos, float* logits, float* all_logits) {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= ctx_, std::to_string(pos + n) + " tokens do not fit the context of " +
                                     std::to_string(ctx_));
  if (n > 1) return forward_batch(tokens, n, pos, logits, all_logits);  // llama_cpu_batch.cpp
  const size_t vocab = cfg_.vocab;
  for (int i = 0; i < n; ++i) {
    float* out = all_logits ? all_logits + i * vocab : logits;
    forward_token(tokens[i], pos + i, out);
  }
  if (all_logits) std::copy_n(all_logits + (size_t)(n - 1) * vocab, vocab, logits);
}

}  // namespace kestrel
