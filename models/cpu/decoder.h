// The decoder families (models/io/family.h: Llama, Mistral, Qwen2, Qwen3, OPT) on the CPU
// reference ops, in fp32: one layer body (attention_block, mlp_block) whose blocks (norm,
// positions, q/k norm, MLP, biases) the config chooses, run over any number of rows. This is
// Kestrel's reference engine (`--device cpu`) and the oracle of the CUDA forward.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/io/config.h"
#include "models/io/model_spec.h"
#include "models/kv_pool.h"
#include "kernels/attention/kv_quant.h"
#include "kernels/gptq/gptq_format.h"

namespace kestrel {

// One linear layer y = x W^T + b, W is [N, K]: dense fp32, or GPTQ codes kept packed and
// dequantized on the fly by the reference matmul.
struct CpuLinear {
  int64_t N = 0, K = 0;
  bool quantized = false;
  std::vector<float> w;            // dense: [N, K]
  std::vector<uint32_t> qweight;   // GPTQ: [K*bits/32, N]
  std::vector<uint32_t> qzeros;    // [G, N*bits/32]
  std::vector<uint16_t> scales;    // [G, N] fp16 bits
  std::vector<int32_t> g_idx;      // [K] (filled from k / group_size when absent)
  int bits = 0, group_size = 0, zero_offset = 1;
  std::vector<float> bias;         // [N] or empty

  static CpuLinear load(const LinearSpec& spec);
  gptq::GptqView view() const;
  // y [M, N] = x [M, K] W^T + b
  void forward(const float* x, int64_t M, float* y) const;
  // The same product for many rows with one BLAS sgemm, y rows `ldy` floats apart (so several
  // linears can write side by side into one buffer). GPTQ weights are dequantized to fp32 once
  // per call with gptq::dequantize_ref, so this agrees with forward() to fp32 rounding.
  void forward_batch(const float* x, int64_t M, float* y, int64_t ldy) const;
};

// How a pass over several rows does its products. Exact: every row gets the arithmetic of a
// one-token decode step (the linears' fixed-order dot products, attention row by row), so a
// speculative verify pass gives token for token what decoding one at a time gives. Blas: the
// linears and attention through BLAS sgemm, each GPTQ weight dequantized once for all rows
// (prompts, perplexity windows, the quantizer's calibration), equal to Exact to fp32 rounding.
enum class RowsMath { Exact, Blas };

struct CpuLayer {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> post_norm;   // [hidden]
  std::vector<float> input_norm_bias, post_norm_bias;  // [hidden] LayerNorm; else empty
  CpuLinear q;                    // [n_heads * head_dim, hidden]
  CpuLinear k, v;                 // [n_kv_heads * head_dim, hidden]
  CpuLinear o;                    // [hidden, n_heads * head_dim]
  std::vector<float> q_norm, k_norm;  // [head_dim] per-head RMSNorm of q and k; else empty
  CpuLinear gate, up;             // [intermediate, hidden]; no gate in a ReLU MLP (up = fc1)
  CpuLinear down;                 // [hidden, intermediate]
};

// The linears of a decoder layer grouped by the input they share, in GPTQ's true-sequential
// order: q/k/v read the normalised residual, o the attention output, gate/up the normalised
// residual after attention, down the SiLU-gated product.
enum class LinearGroup { QKV = 0, O = 1, GateUp = 2, Down = 3 };

// Observers of DecoderCpu::layer_forward (the quantizer's calibration hooks).
struct LayerTaps {
  // Receives the input x [T, K] of each group's linears, as the layer computes it.
  std::function<void(LinearGroup group, const float* x, int T, int K)> input;
  // When set, the forward returns as soon as this group's input has been handed over; x and
  // the layer's KV cache are then left partly updated (the caller reruns from a saved copy).
  std::optional<LinearGroup> stop_after;
};

struct CpuWeights {
  std::vector<float> embed;       // [vocab, hidden]
  std::vector<float> positions;   // [max_pos + offset, hidden] learned positions; else empty
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> final_norm_bias;  // [hidden] LayerNorm; else empty
  CpuLinear lm_head;              // [vocab, hidden] (a copy of embed when tied)
  std::vector<CpuLayer> layers;
};

// A KV cache's bytes, zero. From calloc, not a vector: a large one comes as fresh pages that
// the kernel commits only as positions are written, so a long context costs what its used
// positions hold, not seconds of page faults before the first token (a vector writes every
// byte; 22 GB took 100 s on a busy 2-core machine).
class CacheBytes {
 public:
  CacheBytes() = default;
  explicit CacheBytes(size_t n) : p_(static_cast<uint8_t*>(std::calloc(n ? n : 1, 1))), n_(n) {
    if (!p_) throw std::bad_alloc();
  }
  uint8_t* data() { return p_.get(); }
  size_t size() const { return n_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> p_;
  size_t n_ = 0;
};

// The K or the V cache of every layer, in its type (kernels/attention/kv_quant.h): f16 keeps
// fp32 values (the reference's arithmetic; only the GPU's cache is fp16), q8_0 and fp8 their
// codes and scales, rounded when a position is written and dequantized to fp32 when read.
struct CpuKvCache {
  KvType type = KvType::F16;
  CacheBytes data;    // f16: float [n_layers, ctx, kv_dim]; else codes [n_layers, ctx, kv_dim]
  CacheBytes scales;  // [n_layers, ctx, kv_scales_per_row]; empty for f16
  size_t bytes() const { return data.size() + scales.size(); }
};

// Paged KV memory on the CPU engine (DecoderCpu::use_kv_pool): the K and V rows of every
// layer for the pool's blocks ([n_layers, rows, ...] each), and the blocks' bookkeeping. Its
// sessions take turns through the model, but adopt a prefix (Session::adopt_prefix) from their
// requests' threads: the bookkeeping is behind `m`.
struct CpuKvPool {
  CpuKvPool(int n_blocks) : blocks(n_blocks), rows((int64_t)n_blocks * kKvBlock) {}
  KvBlockPool blocks;
  int64_t rows;
  CpuKvCache key_cache, value_cache;
  std::mutex m;
};

// One sequence's state (DecoderCpuSession): its KV cache, of its own (`key_cache`,
// `value_cache`, [n_layers, ctx, ...]) or the rows of a pool through a block table.
struct CpuRunState {
  int ctx = 0;              // positions the sequence may use
  CpuKvCache key_cache;
  CpuKvCache value_cache;
  std::shared_ptr<CpuKvPool> pool;           // paged: the model's pool (kept while used)
  std::unique_ptr<KvBlockTable> table;       // paged: this sequence's blocks
};

class DecoderCpuSession;

// Where the T rows of a layer pass sit in the caches: consecutive positions pos0 .. pos0+T-1 of
// one sequence (a prompt, a decode step, a verify pass), or, for a batched decode step over many
// sequences, row i at position pos[i] of sequence seqs[i].
struct CpuRows {
  CpuRunState* seq = nullptr;
  int pos0 = 0;
  CpuRunState* const* seqs = nullptr;  // [T] when seq is null
  const int* pos = nullptr;            // [T] when seq is null
  CpuRunState& state(int i) const { return seq ? *seq : *seqs[i]; }
  int position(int i) const { return seq ? pos0 + i : pos[i]; }
};

class DecoderCpu final : public Model {
 public:
  // Loads every weight of `spec` into host memory (fp32, GPTQ codes packed). Its sessions'
  // KV caches are of the types `kv` (a type the model's heads cannot take is a kestrel::Error).
  explicit DecoderCpu(const ModelSpec& spec, KvCacheTypes kv = {});

  const ModelConfig& config() const override { return cfg_; }
  KvCacheTypes cache_types() const override { return kv_; }
  std::string device_name() const override { return "CPU (reference, fp32)"; }
  bool computes_on_host() const override { return true; }
  std::unique_ptr<Session> new_session(int context = 0, bool quiet = true) override;
  // The same, as the CPU session type (for the quantizer and the tests, which run layers).
  std::unique_ptr<DecoderCpuSession> new_cpu_session(int context = 0);
  // Activations and a zeroed KV cache of `context` positions (0 = max_position_embeddings).
  CpuRunState run_state(int context) const;
  // Bytes of one position's K and V over every layer, in the model's cache types.
  size_t cache_bytes_per_position() const;
  // Paged KV memory (Model::use_kv_pool): sessions made from now on keep their K/V in one pool.
  bool use_kv_pool(int64_t positions, int sessions = 1, int context = 0, bool quiet = true) override;
  KvPoolUse kv_pool_use() const override;

  // One token at one position (a decode step). Writes logits [vocab].
  void forward_token(CpuRunState& s, int token, int pos, float* logits) const;
  // forward() of a session: embed, layer_forward over every layer, the head. One token, and
  // short runs whose every row's logits are wanted (speculative verification, up to kRowsMax
  // rows), take RowsMath::Exact; longer runs (prompts, perplexity windows) RowsMath::Blas.
  void forward(CpuRunState& s, const int* tokens, int n, int pos, float* logits,
               float* all_logits) const;
  static constexpr int kRowsMax = 65;
  // A batched decode step (Model::forward_batch): the rows' embeddings and every linear run as
  // one pass over the B rows, so that each weight is read (a GPTQ column dequantized) once for
  // all of them, with RowsMath::Exact; attention runs per row over its own session's cache.
  // Each row's logits are bit for bit those of a one-token forward of its session.
  void forward_batch(std::span<const BatchRow> rows, float* logits) override;

  // The decoder layer, written once for every mode: layer l over T consecutive tokens at
  // positions pos0 .. pos0+T-1, x [T, hidden] the residual stream, in and out. Their K/V go
  // into the layer's cache in `s`, and token i attends causally over cache positions up to
  // pos0+i (Mistral's window applied). Taps see each linear group's input (the quantizer).
  void layer_forward(CpuRunState& s, int layer, float* x, int T, int pos0,
                     const LayerTaps* taps = nullptr, RowsMath math = RowsMath::Blas) const;
  // x [T, hidden] = the embedding rows of tokens[0..T) (plus the learned rows of positions
  // pos0 .. pos0 + T - 1 where the family has them).
  void embed(const int* tokens, int T, int pos0, float* x) const;
  // logits [T, vocab] = lm_head(norm(x)), x [T, hidden].
  void head_forward(const float* x, int T, float* logits, RowsMath math = RowsMath::Blas) const;
  // The weights of decoder layer l, to read or to replace (the quantizer swaps in quantized
  // linears, or a whole layer loaded with load_layer()).
  CpuLayer& layer(int l);
  const CpuLayer& layer(int l) const;
  const CpuWeights& weights() const { return w_; }
  static CpuLayer load_layer(const LayerSpec& spec);

 private:
  // y [rows, hidden] = the family's norm (RMSNorm, or LayerNorm with bias b) of x.
  void norm(const float* x, const std::vector<float>& w, const std::vector<float>& b, int rows,
            float* y) const;
  // q [n_heads, head_dim] and k [n_kv_heads, head_dim] of one position: the per-head norms
  // (Qwen3) and RoPE where the family has them.
  void position_qk(const CpuLayer& L, float* q, float* k, int pos) const;
  // The layer's two blocks over T rows (layer_forward); false where a tap asked to stop.
  //   attention_block: x += Wo attention(rope(Wqkv norm(x) + b)) (+ bo)
  //   mlp_block:       x += Wdown (silu(Wgate norm(x)) * Wup norm(x)), or (a ReLU MLP)
  //                    x += Wfc2 relu(Wfc1 norm(x) + b1) + b2
  bool attention_block(const CpuRows& rows, int layer, float* x, int T, const LayerTaps* taps,
                       RowsMath math) const;
  // layer_forward over rows anywhere (CpuRows): the one layer body of every mode.
  void layer_rows(const CpuRows& rows, int layer, float* x, int T, const LayerTaps* taps,
                  RowsMath math) const;
  bool mlp_block(const CpuLayer& L, float* x, int T, const LayerTaps* taps, RowsMath math) const;

  // K or V cache storage of `rows` positions per layer, zero, in type t.
  CpuKvCache cache_storage(KvType t, int64_t rows) const;

  ModelConfig cfg_;
  KvCacheTypes kv_;
  CpuWeights w_;
  std::shared_ptr<CpuKvPool> pool_;  // sessions made before another use_kv_pool keep theirs
  std::vector<float> inv_freq_;  // RoPE's frequencies [head_dim / 2] (rope_inv_freq)
};

// A sequence on the CPU reference: its activations and KV cache.
class DecoderCpuSession final : public Session {
 public:
  DecoderCpuSession(DecoderCpu& m, int context) : Session(m), m_(m), s_(m.run_state(context)) {}
  DecoderCpuSession(DecoderCpu& m, CpuRunState s) : Session(m), m_(m), s_(std::move(s)) {}
  ~DecoderCpuSession() override;

  int context_length() const override { return s_.ctx; }
  size_t cache_bytes() const override;
  void forward(const int* tokens, int n, int pos, float* logits, float* all_logits) override;
  bool adopt_prefix(std::span<const int> prompt) override;
  bool release_kv() override;
  void forward_token(int token, int pos, float* logits) { forward(&token, 1, pos, logits, nullptr); }
  // Paged: makes positions pos .. pos + n - 1 writable by this session alone (copying shared
  // blocks), or throws KvPoolFull; after the write, records the ids there (publishing the
  // blocks they fill). No-ops with a cache of its own.
  void prepare_write(int pos, int n);
  void commit_write(int pos, const int* tokens, int n);
  CpuRunState& state() { return s_; }
  // One layer over a cache of its own (the quantizer's calibration): a paged session's table
  // is prepared by forward() only.
  void layer_forward(int layer, float* x, int T, int pos0, const LayerTaps* taps = nullptr) {
    KESTREL_CHECK(!s_.pool, "layer_forward runs on a session with a KV cache of its own");
    m_.layer_forward(s_, layer, x, T, pos0, taps);
  }

 private:
  DecoderCpu& m_;
  CpuRunState s_;
};

}  // namespace kestrel
