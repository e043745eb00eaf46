// The decoder forward pass over many tokens at once, in fp32 on the CPU: the same ops as the
// per-token forward_token() in cpu/decoder.cpp, with the dense products (linears, attention
// scores and the weighted sum of values) done by BLAS sgemm. It serves prompt prefill,
// perplexity over long texts and the quantizer's calibration, where the per-token path's
// matrix-vector loops would take hours.
#include <cblas.h>

#include <algorithm>
#include <utility>
#include <cmath>
#include <string>
#include <vector>

#include "base/error.h"
#include "kernels/activation/activation.h"
#include "kernels/norm/norm.h"
#include "kernels/rope/rope.h"
#include "models/cpu/decoder.h"

namespace kestrel {

namespace {

// Query rows per attention chunk: bounds the score buffer to [kQueryChunk, keys] and skips
// most of the masked upper triangle.
constexpr int kQueryChunk = 128;

// Causal attention of T queries at positions pos0 .. pos0+T-1 over the cache, every query
// head reading KV head h / (n_heads / n_kv_heads), scale 1/sqrt(head_dim):
//   q       [T, ldq]  query heads at columns 0 .. n_heads*head_dim
//   k_cache [ctx, kv_dim], v_cache likewise (positions 0 .. pos0+T-1 written)
//   out     [T, n_heads*head_dim]
// Each query's softmax runs over its visible keys only (softmax_ref), the rest get weight 0.
void attention_batch(const ModelConfig& c, const float* q, int64_t ldq, const float* k_cache,
                     const float* v_cache, int T, int pos0, float* out) {
  const int hd = c.head_dim, kv_dim = c.kv_dim(), q_dim = c.q_dim();
  const int group = c.n_heads / c.n_kv_heads;
  const float scale = 1.0f / std::sqrt((float)hd);
  auto first_key = [&](int p) {
    return c.sliding_window > 0 ? std::max(0, p - c.sliding_window + 1) : 0;
  };
  std::vector<float> s;  // [rows, keys] scores, then probabilities
  for (int i0 = 0; i0 < T; i0 += kQueryChunk) {
    const int i1 = std::min(T, i0 + kQueryChunk), rows = i1 - i0;
    const int k0 = first_key(pos0 + i0), k1 = pos0 + i1;  // keys [k0, k1) cover every row
    const int keys = k1 - k0;
    s.resize((size_t)rows * keys);
    for (int h = 0; h < c.n_heads; ++h) {
      const int64_t kv_off = (int64_t)(h / group) * hd;
      // s [rows, keys] = scale * q_h [rows, hd] k_h^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hd, scale,
                  q + (int64_t)i0 * ldq + (int64_t)h * hd, ldq, k_cache + (int64_t)k0 * kv_dim + kv_off,
                  kv_dim, 0.0f, s.data(), keys);
      for (int r = 0; r < rows; ++r) {
        const int p = pos0 + i0 + r;
        const int lo = first_key(p) - k0, hi = p - k0 + 1;  // visible keys [lo, hi)
        float* sr = s.data() + (size_t)r * keys;
        softmax_ref(sr + lo, hi - lo);
        std::fill(sr, sr + lo, 0.0f);
        std::fill(sr + hi, sr + keys, 0.0f);
      }
      // out_h [rows, hd] = s [rows, keys] v_h [keys, hd]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, keys, 1.0f, s.data(), keys,
                  v_cache + (int64_t)k0 * kv_dim + kv_off, kv_dim, 0.0f,
                  out + (int64_t)i0 * q_dim + (int64_t)h * hd, q_dim);
    }
  }
}

}  // namespace

void CpuLinear::forward_batch(const float* x, int64_t M, float* y, int64_t ldy) const {
  std::vector<float> dequantized;
  const float* W = w.data();  // [N, K]
  if (quantized) {
    dequantized.resize((size_t)N * K);
    gptq::dequantize_ref(view(), dequantized.data());
    W = dequantized.data();
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, W, K, 0.0f, y, ldy);
  if (!bias.empty())
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * ldy + n] += bias[n];
}

CpuLayer DecoderCpu::load_layer(const LayerSpec& ls) {
  CpuLayer l;
  auto opt = [](const TensorInfo* t) { return t ? to_float(*t) : std::vector<float>(); };
  l.input_norm = to_float(*ls.input_norm);
  l.post_norm = to_float(*ls.post_norm);
  l.input_norm_bias = opt(ls.input_norm_bias);
  l.post_norm_bias = opt(ls.post_norm_bias);
  l.q = CpuLinear::load(ls.q);
  l.k = CpuLinear::load(ls.k);
  l.v = CpuLinear::load(ls.v);
  l.o = CpuLinear::load(ls.o);
  l.q_norm = opt(ls.q_norm);
  l.k_norm = opt(ls.k_norm);
  if (!ls.gate.name.empty()) l.gate = CpuLinear::load(ls.gate);
  l.up = CpuLinear::load(ls.up);
  l.down = CpuLinear::load(ls.down);
  return l;
}

CpuLayer& DecoderCpu::layer(int l) { return const_cast<CpuLayer&>(std::as_const(*this).layer(l)); }

const CpuLayer& DecoderCpu::layer(int l) const {
  KESTREL_CHECK(l >= 0 && l < (int)w_.layers.size(),
                "layer " + std::to_string(l) + " is outside the model's " +
                    std::to_string(w_.layers.size()) + " layers");
  return w_.layers[l];
}

void DecoderCpu::embed(const int* tokens, int T, int pos0, float* x) const {
  const int hidden = cfg_.hidden;
  for (int i = 0; i < T; ++i) {
    KESTREL_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab,
                  "token id " + std::to_string(tokens[i]) + " is outside the vocabulary (" +
                      std::to_string(cfg_.vocab) + ")");
    float* row = x + (size_t)i * hidden;
    std::copy_n(&w_.embed[(size_t)tokens[i] * hidden], hidden, row);
    if (!w_.positions.empty()) {
      const float* p = &w_.positions[(size_t)(pos0 + i + cfg_.position_offset) * hidden];
      for (int j = 0; j < hidden; ++j) row[j] += p[j];
    }
  }
}

void DecoderCpu::head_forward(const float* x, int T, float* logits) const {
  const int hidden = cfg_.hidden;
  std::vector<float> xb((size_t)T * hidden);  // [T, hidden]
  norm(x, w_.final_norm, w_.final_norm_bias, T, xb.data());
  w_.lm_head.forward_batch(xb.data(), T, logits, cfg_.vocab);
}

void DecoderCpu::layer_forward(CpuRunState& st, int l, float* x, int T, int pos0,
                             const LayerTaps* taps) const {
  const ModelConfig& c = cfg_;
  const CpuLayer& L = layer(l);
  KESTREL_CHECK(T > 0 && pos0 >= 0 && pos0 + T <= st.ctx,
                "layer_forward: positions " + std::to_string(pos0) + " .. " +
                    std::to_string(pos0 + T - 1) + " do not fit the context of " +
                    std::to_string(st.ctx));
  const int hidden = c.hidden, q_dim = c.q_dim(), kv_dim = c.kv_dim(), inter = c.intermediate;
  const int qkv_dim = q_dim + 2 * kv_dim;
  float* k_cache = &st.key_cache[(size_t)l * st.ctx * kv_dim];    // [ctx, kv_dim]
  float* v_cache = &st.value_cache[(size_t)l * st.ctx * kv_dim];  // [ctx, kv_dim]
  // Hands a group's input to the taps; true when the caller asked to stop there.
  auto tap = [&](LinearGroup g, const float* in, int K) {
    if (!taps) return false;
    if (taps->input) taps->input(g, in, T, K);
    return taps->stop_after == g;
  };

  std::vector<float> xb((size_t)T * hidden);     // [T, hidden] normalised input of a block
  std::vector<float> qkv((size_t)T * qkv_dim);   // [T, q_dim | kv_dim | kv_dim]
  std::vector<float> att((size_t)T * q_dim);     // [T, q_dim] attention output
  std::vector<float> proj((size_t)T * hidden);   // [T, hidden] output of o_proj / down_proj

  // Attention block: xb = norm(x); q, k, v side by side in each row of qkv.
  norm(x, L.input_norm, L.input_norm_bias, T, xb.data());
  if (tap(LinearGroup::QKV, xb.data(), hidden)) return;
  L.q.forward_batch(xb.data(), T, qkv.data(), qkv_dim);
  L.k.forward_batch(xb.data(), T, qkv.data() + q_dim, qkv_dim);
  L.v.forward_batch(xb.data(), T, qkv.data() + q_dim + kv_dim, qkv_dim);
  for (int i = 0; i < T; ++i) {
    float* row = qkv.data() + (size_t)i * qkv_dim;
    position_qk(L, row, row + q_dim, pos0 + i);
    std::copy_n(row + q_dim, kv_dim, k_cache + (size_t)(pos0 + i) * kv_dim);
    std::copy_n(row + q_dim + kv_dim, kv_dim, v_cache + (size_t)(pos0 + i) * kv_dim);
  }
  attention_batch(c, qkv.data(), qkv_dim, k_cache, v_cache, T, pos0, att.data());

  // x += att Wo
  if (tap(LinearGroup::O, att.data(), q_dim)) return;
  L.o.forward_batch(att.data(), T, proj.data(), hidden);
  for (size_t i = 0; i < proj.size(); ++i) x[i] += proj[i];

  // MLP block, xb = norm(x): x += (silu(xb Wgate) * (xb Wup)) Wdown, or (ReLU MLP)
  // x += relu(xb Wfc1) Wfc2.
  norm(x, L.post_norm, L.post_norm_bias, T, xb.data());
  if (tap(LinearGroup::GateUp, xb.data(), hidden)) return;
  std::vector<float> up((size_t)T * inter);  // [T, intermediate]
  L.up.forward_batch(xb.data(), T, up.data(), inter);
  if (c.mlp == MlpKind::GatedSiLU) {
    std::vector<float> gate((size_t)T * inter);
    L.gate.forward_batch(xb.data(), T, gate.data(), inter);
    silu_mul_ref(gate.data(), up.data(), (int64_t)T * inter, up.data());
  } else {
    relu_ref(up.data(), (int64_t)T * inter);
  }
  if (tap(LinearGroup::Down, up.data(), inter)) return;
  L.down.forward_batch(up.data(), T, proj.data(), hidden);
  for (size_t i = 0; i < proj.size(); ++i) x[i] += proj[i];
}

void DecoderCpu::forward_batch(CpuRunState& st, const int* tokens, int n, int pos, float* logits,
                             float* all_logits) const {
  const size_t hidden = cfg_.hidden, vocab = cfg_.vocab;
  std::vector<float> x(n * hidden);  // [n, hidden] residual stream
  embed(tokens, n, pos, x.data());
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(st, l, x.data(), n, pos);
  if (all_logits) {
    head_forward(x.data(), n, all_logits);
    std::copy_n(all_logits + (n - 1) * vocab, vocab, logits);
  } else {
    head_forward(x.data() + (n - 1) * hidden, 1, logits);  // only the last token's logits
  }
}

}  // namespace kestrel
