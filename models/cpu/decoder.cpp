// The decoder forward pass on the CPU reference ops, in fp32: embed, then per layer
//   attention_block: norm -> q, k, v (+ biases) [-> per-head q/k norms] -> RoPE -> KV write
//                    -> causal attention over the cache -> o (+ residual, + bias)
//   mlp_block:       norm -> gate, up -> SiLU(gate) * up -> down (+ residual)
//                    [ReLU MLP: fc1 + bias -> ReLU -> fc2 + bias (+ residual)]
// then the final norm and lm_head. One layer body serves every mode: a decode step (one row), a
// speculative verify pass (a few rows, each with a decode step's arithmetic: RowsMath::Exact),
// a prompt, a perplexity window and the quantizer's calibration (many rows through BLAS:
// RowsMath::Blas), and a batched decode step (one row of each of many sequences, Exact, each
// row attending over its own sequence's cache: forward_batch).
#include "models/cpu/decoder.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "kernels/activation/activation.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/kv_quant.h"
#include "kernels/norm/norm.h"
#include "kernels/rope/rope.h"

namespace kestrel {

namespace {

// Query rows per attention chunk: bounds the score buffer to [kQueryChunk, keys] and skips
// most of the masked upper triangle.
constexpr int kQueryChunk = 128;

// Causal attention of T queries at positions pos0 .. pos0+T-1 over the cache through BLAS, every
// query head reading KV head h / (n_heads / n_kv_heads), scale 1/sqrt(head_dim):
//   q       [T, ldq]  query heads at columns 0 .. n_heads*head_dim
//   k, v    the layer's caches (positions 0 .. pos0+T-1 written)
//   out     [T, n_heads*head_dim]
// Each query's softmax runs over its visible keys only (softmax_ref), the rest get weight 0.
// An fp32 (f16) cache is multiplied where it lies; a quantized or paged one is dequantized
// (gathered) a KV head and a query chunk's keys at a time ([keys, head_dim]), never as a whole
// second cache.
void attention_blas(const ModelConfig& c, const float* q, int64_t ldq, const KvLayerRef& k,
                    const KvLayerRef& v, int T, int pos0, float* out) {
  const int hd = c.head_dim, kv_dim = c.kv_dim(), q_dim = c.q_dim();
  const int group = c.n_heads / c.n_kv_heads;
  const float scale = 1.0f / std::sqrt((float)hd);
  auto first_key = [&](int p) {
    return c.sliding_window > 0 ? std::max(0, p - c.sliding_window + 1) : 0;
  };
  std::vector<float> s;           // [rows, keys] scores, then probabilities
  std::vector<float> kbuf, vbuf;  // [keys, hd] one KV head's dequantized rows
  // The rows [k0, k1) of KV head g in fp32, and their stride.
  auto rows_of = [&](const KvLayerRef& cache, std::vector<float>& buf, int g, int k0, int k1,
                     int64_t& ld) -> const float* {
    if (cache.type == KvType::F16 && !cache.blocks) {
      ld = kv_dim;
      return cache.values + (int64_t)k0 * kv_dim + (int64_t)g * hd;
    }
    buf.resize((size_t)(k1 - k0) * hd);
    cache.read(k0, k1, g, buf.data());
    ld = hd;
    return buf.data();
  };
  for (int i0 = 0; i0 < T; i0 += kQueryChunk) {
    const int i1 = std::min(T, i0 + kQueryChunk), rows = i1 - i0;
    const int k0 = first_key(pos0 + i0), k1 = pos0 + i1;  // keys [k0, k1) cover every row
    const int keys = k1 - k0;
    s.resize((size_t)rows * keys);
    for (int g = 0; g < c.n_kv_heads; ++g) {
      int64_t ldk = 0, ldv = 0;
      const float* kg = rows_of(k, kbuf, g, k0, k1, ldk);  // [keys, hd]
      const float* vg = rows_of(v, vbuf, g, k0, k1, ldv);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        // s [rows, keys] = scale * q_h [rows, hd] k_h^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hd, scale,
                    q + (int64_t)i0 * ldq + (int64_t)h * hd, ldq, kg, ldk, 0.0f, s.data(), keys);
        for (int r = 0; r < rows; ++r) {
          const int p = pos0 + i0 + r;
          const int lo = first_key(p) - k0, hi = p - k0 + 1;  // visible keys [lo, hi)
          float* sr = s.data() + (size_t)r * keys;
          softmax_ref(sr + lo, hi - lo);
          std::fill(sr, sr + lo, 0.0f);
          std::fill(sr + hi, sr + keys, 0.0f);
        }
        // out_h [rows, hd] = s [rows, keys] v_h [keys, hd]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, keys, 1.0f, s.data(),
                    keys, vg, ldv, 0.0f, out + (int64_t)i0 * q_dim + (int64_t)h * hd, q_dim);
      }
    }
  }
}

// Layer l's part of a K or V cache of `ctx` rows per layer.
KvLayerRef cache_layer(CpuKvCache& kc, const ModelConfig& c, int l, int64_t ctx) {
  KvLayerRef r;
  r.type = kc.type;
  r.n_kv_heads = c.n_kv_heads;
  r.head_dim = c.head_dim;
  const size_t rows = (size_t)l * ctx;  // positions of the layers before l
  if (kc.type == KvType::F16) {
    r.values = reinterpret_cast<float*>(kc.data.data()) + rows * c.kv_dim();
  } else {
    r.codes = kc.data.data() + rows * c.kv_dim();
    r.scales = kc.scales.data() +
               rows * kv_scales_per_row(kc.type, c.n_kv_heads, c.head_dim) * kv_scale_bytes(kc.type);
  }
  return r;
}

// y [T, N], rows ldy floats apart, = x [T, K] W^T + b, by `math`.
void linear(const CpuLinear& L, const float* x, int T, float* y, int64_t ldy, RowsMath math) {
  if (math == RowsMath::Blas) return L.forward_batch(x, T, y, ldy);
  if (ldy == L.N) return L.forward(x, T, y);
  std::vector<float> yt((size_t)T * L.N);  // [T, N]
  L.forward(x, T, yt.data());
  for (int i = 0; i < T; ++i) std::copy_n(&yt[(size_t)i * L.N], L.N, y + (size_t)i * ldy);
}

}  // namespace

DecoderCpu::DecoderCpu(const ModelSpec& spec, KvCacheTypes kv) : cfg_(spec.config), kv_(kv) {
  const ModelConfig& c = cfg_;
  for (KvType t : {kv.k, kv.v}) {
    const std::string why = kv_type_unsupported(t, c.head_dim);
    KESTREL_CHECK(why.empty(), std::string("cache type ") + kv_type_name(t) + ": " + why);
  }
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

CpuKvCache DecoderCpu::cache_storage(KvType t, int64_t rows_per_layer) const {
  const ModelConfig& c = cfg_;
  const size_t rows = (size_t)c.n_layers * rows_per_layer;  // positions of every layer
  CpuKvCache kc;
  kc.type = t;
  const size_t scale_bytes = kv_scales_per_row(t, c.n_kv_heads, c.head_dim) * kv_scale_bytes(t);
  kc.data = CacheBytes(rows * c.kv_dim() * (t == KvType::F16 ? sizeof(float) : 1));
  kc.scales = CacheBytes(rows * scale_bytes);
  return kc;
}

CpuRunState DecoderCpu::run_state(int context) const {
  CpuRunState s;
  s.ctx = context > 0 ? context : cfg_.max_pos;
  cfg_.check_context(s.ctx);
  s.key_cache = cache_storage(kv_.k, s.ctx);
  s.value_cache = cache_storage(kv_.v, s.ctx);
  return s;
}

bool DecoderCpu::use_kv_pool(int64_t positions, int, int, bool) {
  auto p = std::make_shared<CpuKvPool>(KvBlockPool::blocks_for(positions));
  p->key_cache = cache_storage(kv_.k, p->rows);  // calloc: pages only as rows are written
  p->value_cache = cache_storage(kv_.v, p->rows);
  pool_ = std::move(p);
  return true;
}

KvPoolUse DecoderCpu::kv_pool_use() const {
  if (!pool_) return {};
  std::lock_guard<std::mutex> g(pool_->m);
  return pool_->blocks.use();
}

size_t DecoderCpu::cache_bytes_per_position() const {
  const ModelConfig& c = cfg_;
  return (size_t)c.n_layers * (kv_row_bytes(kv_.k, c.n_kv_heads, c.head_dim, sizeof(float)) +
                               kv_row_bytes(kv_.v, c.n_kv_heads, c.head_dim, sizeof(float)));
}

std::unique_ptr<DecoderCpuSession> DecoderCpu::new_cpu_session(int context) {
  if (!pool_) return std::make_unique<DecoderCpuSession>(*this, context);
  const int ctx = context > 0 ? context : cfg_.max_pos;
  cfg_.check_context(ctx);
  CpuRunState st;
  st.ctx = ctx;
  st.pool = pool_;
  st.table = std::make_unique<KvBlockTable>(pool_->blocks);
  return std::make_unique<DecoderCpuSession>(*this, std::move(st));
}

// ---- Sessions -----------------------------------------------------------------------------

DecoderCpuSession::~DecoderCpuSession() {
  if (!s_.pool) return;
  std::lock_guard<std::mutex> g(s_.pool->m);
  s_.table.reset();  // its blocks go back to the pool (cached where published)
}

size_t DecoderCpuSession::cache_bytes() const {
  if (!s_.pool) return s_.key_cache.bytes() + s_.value_cache.bytes();
  // The blocks it holds (some perhaps shared with other sequences).
  std::lock_guard<std::mutex> g(s_.pool->m);
  return s_.table->blocks().size() * kKvBlock * m_.cache_bytes_per_position();
}

void DecoderCpuSession::forward(const int* tokens, int n, int pos, float* logits, float* all_logits) {
  prepare_write(pos, n);
  m_.forward(s_, tokens, n, pos, logits, all_logits);
  commit_write(pos, tokens, n);
}

bool DecoderCpuSession::adopt_prefix(std::span<const int> prompt) {
  if (!s_.pool) return false;
  std::lock_guard<std::mutex> g(s_.pool->m);
  const int n = s_.table->adopt_prefix(prompt, std::min((int)prompt.size() - 1, s_.ctx));
  cached.assign(prompt.begin(), prompt.begin() + std::max(0, n));
  return true;
}

bool DecoderCpuSession::release_kv() {
  if (!s_.pool) return false;
  std::lock_guard<std::mutex> g(s_.pool->m);
  s_.table->clear();
  cached.clear();
  return true;
}

void DecoderCpuSession::prepare_write(int pos, int n) {
  if (!s_.pool) return;
  KESTREL_CHECK(n > 0 && pos >= 0 && pos + n <= s_.ctx,
                std::to_string(pos + n) + " tokens do not fit the context of " + std::to_string(s_.ctx));
  CpuKvPool& p = *s_.pool;
  std::vector<KvBlockTable::Copy> copies;
  {
    std::lock_guard<std::mutex> g(p.m);
    if (!s_.table->prepare_write(pos, n, copies))
      throw KvPoolFull("the KV cache pool is full: " + std::to_string(p.blocks.n_blocks()) +
                       " blocks of " + std::to_string(kKvBlock) + " positions, all held");
  }
  // A block shared with another sequence is copied before this one writes its own: every
  // layer's rows of it, codes and scales.
  const ModelConfig& c = m_.config();
  for (const KvBlockTable::Copy& cp : copies)
    for (CpuKvCache* kc : {&p.key_cache, &p.value_cache}) {
      const size_t row = kc->type == KvType::F16 ? c.kv_dim() * sizeof(float) : (size_t)c.kv_dim();
      const size_t srow = kv_scales_per_row(kc->type, c.n_kv_heads, c.head_dim) * kv_scale_bytes(kc->type);
      for (int l = 0; l < c.n_layers; ++l) {
        const size_t from = (size_t)l * p.rows + (size_t)cp.from * kKvBlock;
        const size_t to = (size_t)l * p.rows + (size_t)cp.to * kKvBlock;
        std::memcpy(kc->data.data() + to * row, kc->data.data() + from * row, kKvBlock * row);
        if (srow)
          std::memcpy(kc->scales.data() + to * srow, kc->scales.data() + from * srow, kKvBlock * srow);
      }
    }
}

void DecoderCpuSession::commit_write(int pos, const int* tokens, int n) {
  if (!s_.pool) return;
  std::lock_guard<std::mutex> g(s_.pool->m);
  s_.table->commit_write(pos, std::span<const int>(tokens, n));
}

std::unique_ptr<Session> DecoderCpu::new_session(int context, bool) { return new_cpu_session(context); }

// ---- Blocks -------------------------------------------------------------------------------

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

// Hands a group's input to the taps; true when the caller asked to stop there.
static bool tap(const LayerTaps* taps, LinearGroup g, const float* in, int T, int K) {
  if (!taps) return false;
  if (taps->input) taps->input(g, in, T, K);
  return taps->stop_after == g;
}

bool DecoderCpu::attention_block(const CpuRows& rows, int l, float* x, int T,
                                 const LayerTaps* taps, RowsMath math) const {
  const ModelConfig& c = cfg_;
  const CpuLayer& L = w_.layers[l];
  const int hidden = c.hidden, q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const int qkv_dim = q_dim + 2 * kv_dim;
  // Layer l's K and V caches of the sequence row i belongs to: its own [ctx, kv_dim], or the
  // pool's rows through its block table.
  auto layer_cache = [&](int i, CpuKvCache CpuRunState::*own, CpuKvCache CpuKvPool::*pooled) {
    CpuRunState& st = rows.state(i);
    if (!st.pool) return cache_layer(st.*own, c, l, st.ctx);
    KvLayerRef r = cache_layer((*st.pool).*pooled, c, l, st.pool->rows);
    r.blocks = st.table->blocks().data();
    return r;
  };
  auto k_cache = [&](int i) { return layer_cache(i, &CpuRunState::key_cache, &CpuKvPool::key_cache); };
  auto v_cache = [&](int i) { return layer_cache(i, &CpuRunState::value_cache, &CpuKvPool::value_cache); };
  std::vector<float> xb((size_t)T * hidden);    // [T, hidden] normalised input
  std::vector<float> qkv((size_t)T * qkv_dim);  // [T, q_dim | kv_dim | kv_dim]
  std::vector<float> att((size_t)T * q_dim);    // [T, q_dim] attention output
  std::vector<float> proj((size_t)T * hidden);  // [T, hidden] o's output

  // xb = norm(x); q, k, v side by side in each row of qkv; per-head norms and RoPE on q and k.
  // Every row's K/V goes into the cache before any row attends.
  norm(x, L.input_norm, L.input_norm_bias, T, xb.data());
  if (tap(taps, LinearGroup::QKV, xb.data(), T, hidden)) return false;
  linear(L.q, xb.data(), T, qkv.data(), qkv_dim, math);
  linear(L.k, xb.data(), T, qkv.data() + q_dim, qkv_dim, math);
  linear(L.v, xb.data(), T, qkv.data() + q_dim + kv_dim, qkv_dim, math);
  for (int i = 0; i < T; ++i) {
    float* row = qkv.data() + (size_t)i * qkv_dim;
    const int p = rows.position(i);
    position_qk(L, row, row + q_dim, p);
    k_cache(i).write(p, row + q_dim);  // rounded to the cache's type here, once
    v_cache(i).write(p, row + q_dim + kv_dim);
  }
  // Causal attention of the row at position p over [first, p]; Mistral's window limits first.
  // Blas: one sequence's rows together. Exact: row by row with attention_ref_kv (attention_ref
  // on an fp32 cache), each row as a decode step computes it, over its own sequence's cache.
  if (math == RowsMath::Blas) {
    KESTREL_CHECK(rows.seq != nullptr, "attention over many sequences runs row by row (Exact)");
    attention_blas(c, qkv.data(), qkv_dim, k_cache(0), v_cache(0), T, rows.pos0, att.data());
  } else {
    for (int i = 0; i < T; ++i) {
      const int p = rows.position(i);
      const int first = c.sliding_window > 0 ? std::max(0, p - c.sliding_window + 1) : 0;
      attention_ref_kv(qkv.data() + (size_t)i * qkv_dim, k_cache(i), v_cache(i), c.n_heads, first,
                       p, att.data() + (size_t)i * q_dim);
    }
  }

  // x += att Wo (+ bo)
  if (tap(taps, LinearGroup::O, att.data(), T, q_dim)) return false;
  linear(L.o, att.data(), T, proj.data(), hidden, math);
  for (size_t i = 0; i < proj.size(); ++i) x[i] += proj[i];
  return true;
}

bool DecoderCpu::mlp_block(const CpuLayer& L, float* x, int T, const LayerTaps* taps,
                           RowsMath math) const {
  const ModelConfig& c = cfg_;
  const int hidden = c.hidden, inter = c.intermediate;
  std::vector<float> xb((size_t)T * hidden);    // [T, hidden] normalised input
  std::vector<float> up((size_t)T * inter);     // [T, intermediate]
  std::vector<float> proj((size_t)T * hidden);  // [T, hidden] down's output

  norm(x, L.post_norm, L.post_norm_bias, T, xb.data());
  if (tap(taps, LinearGroup::GateUp, xb.data(), T, hidden)) return false;
  linear(L.up, xb.data(), T, up.data(), inter, math);
  if (c.mlp == MlpKind::GatedSiLU) {
    std::vector<float> gate((size_t)T * inter);  // [T, intermediate]
    linear(L.gate, xb.data(), T, gate.data(), inter, math);
    silu_mul_ref(gate.data(), up.data(), (int64_t)T * inter, up.data());
  } else {
    relu_ref(up.data(), (int64_t)T * inter);
  }
  if (tap(taps, LinearGroup::Down, up.data(), T, inter)) return false;
  linear(L.down, up.data(), T, proj.data(), hidden, math);
  for (size_t i = 0; i < proj.size(); ++i) x[i] += proj[i];
  return true;
}

void DecoderCpu::layer_forward(CpuRunState& st, int l, float* x, int T, int pos0,
                               const LayerTaps* taps, RowsMath math) const {
  KESTREL_CHECK(T > 0 && pos0 >= 0 && pos0 + T <= st.ctx,
                "layer_forward: positions " + std::to_string(pos0) + " .. " +
                    std::to_string(pos0 + T - 1) + " do not fit the context of " +
                    std::to_string(st.ctx));
  CpuRows rows;
  rows.seq = &st;
  rows.pos0 = pos0;
  layer_rows(rows, l, x, T, taps, math);
}

void DecoderCpu::layer_rows(const CpuRows& rows, int l, float* x, int T, const LayerTaps* taps,
                            RowsMath math) const {
  const CpuLayer& L = layer(l);
  if (!attention_block(rows, l, x, T, taps, math)) return;
  mlp_block(L, x, T, taps, math);
}

// ---- The model ----------------------------------------------------------------------------

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

void DecoderCpu::head_forward(const float* x, int T, float* logits, RowsMath math) const {
  std::vector<float> xb((size_t)T * cfg_.hidden);  // [T, hidden]
  norm(x, w_.final_norm, w_.final_norm_bias, T, xb.data());
  linear(w_.lm_head, xb.data(), T, logits, cfg_.vocab, math);
}

void DecoderCpu::forward_batch(std::span<const BatchRow> rows, float* logits) {
  check_batch_rows(*this, rows);
  const int B = (int)rows.size();
  if (B == 0) return;
  std::vector<CpuRunState*> seqs(B);
  std::vector<int> pos(B);
  const size_t hidden = cfg_.hidden;
  std::vector<float> x(B * hidden);  // [B, hidden] residual stream, row i of session i
  for (int i = 0; i < B; ++i) {
    auto* s = dynamic_cast<DecoderCpuSession*>(rows[i].session);
    KESTREL_CHECK(s != nullptr, "forward_batch: row " + std::to_string(i) +
                                    "'s session is not a CPU engine session");
    seqs[i] = &s->state();
    pos[i] = rows[i].pos;
    embed(&rows[i].token, 1, rows[i].pos, x.data() + i * hidden);  // its own learned position
    s->prepare_write(rows[i].pos, 1);
  }
  CpuRows where;
  where.seqs = seqs.data();
  where.pos = pos.data();
  // Exact: each row's products in the order of a one-token step, so a row's logits do not
  // depend on what else runs in the batch (the linears dequantize each column once for all B).
  for (int l = 0; l < cfg_.n_layers; ++l)
    layer_rows(where, l, x.data(), B, nullptr, RowsMath::Exact);
  head_forward(x.data(), B, logits, RowsMath::Exact);
  for (int i = 0; i < B; ++i)
    static_cast<DecoderCpuSession*>(rows[i].session)->commit_write(rows[i].pos, &rows[i].token, 1);
}

void DecoderCpu::forward_token(CpuRunState& st, int token, int pos, float* logits) const {
  forward(st, &token, 1, pos, logits, nullptr);
}

void DecoderCpu::forward(CpuRunState& st, const int* tokens, int n, int pos, float* logits,
                         float* all_logits) const {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= st.ctx, std::to_string(pos + n) + " tokens do not fit the context of " +
                                     std::to_string(st.ctx));
  KESTREL_CHECK(pos >= 0, "position " + std::to_string(pos) + " is negative");
  // A decode step, and a short run whose every row's logits are wanted (a speculative
  // verification, or as cheap either way), give each row a decode step's arithmetic, so that
  // the ids verified equal those decoded one at a time. Long runs take the BLAS batch.
  const RowsMath math = n == 1 || (all_logits && n <= kRowsMax) ? RowsMath::Exact : RowsMath::Blas;
  const size_t hidden = cfg_.hidden, vocab = cfg_.vocab;
  std::vector<float> x(n * hidden);  // [n, hidden] residual stream
  embed(tokens, n, pos, x.data());
  for (int l = 0; l < cfg_.n_layers; ++l) layer_forward(st, l, x.data(), n, pos, nullptr, math);
  if (all_logits) {
    head_forward(x.data(), n, all_logits, math);
    std::copy_n(all_logits + (n - 1) * vocab, vocab, logits);
  } else {
    head_forward(x.data() + (n - 1) * hidden, 1, logits, math);  // only the last token's logits
  }
}

}  // namespace kestrel
