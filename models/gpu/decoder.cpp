// The decode step on the GPU. Per token: embedding, then per layer (Llama's blocks; the other
// families' in brackets)
//   rmsnorm -> fused qkv GEMV (+ q/k/v biases) [-> per-head q/k norms] -> flash-decoding
//   attention (RoPE and the KV write inside) -> o GEMV (+ residual) -> rmsnorm -> fused gate|up
//   GEMV (SiLU*up in its epilogue) -> down GEMV (+ residual)
//   [OPT: layernorm + qkv GEMV + biases -> attention -> o GEMV (+ residual + bias)
//    -> layernorm + fc1 GEMV + bias, ReLU -> fc2 GEMV (+ residual + bias)]
// then the final norm, the lm_head GEMV and the argmax. The step reads its token and position
// from device memory, so it is captured as a CUDA graph (one per range of positions:
// models/gpu/graphs.h) and replayed per token; the host writes two ints and reads one back. Greedy
// runs (ChainedRun) chain the steps on the device: the argmax writes the next step's token and
// position itself, so the next step is queued before the host has read the token.
#include "models/gpu/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/device.h"
#include "base/error.h"
#include "kernels/activation/activation_cuda.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/gemm.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/sampling/argmax_cuda.h"
#include "kernels/sampling/sample_cuda.h"
#include "models/gpu/act_order.h"

namespace kestrel {

std::string cuda_unsupported(const ModelConfig& c) {
  std::string why;
  if (c.head_dim != 64 && c.head_dim != 128) why = fmt::format("head_dim {} (64 or 128)", c.head_dim);
  // The decode step pairs LayerNorm with the ReLU MLP and its biases (OPT), RMSNorm with the
  // gated SiLU MLP and no biases past q/k/v (Llama, Mistral, Qwen).
  else if ((c.norm == NormKind::Layer) != (c.mlp == MlpKind::ReLU))
    why = "a norm and MLP that no family it runs pairs";
  else if (c.norm == NormKind::RMS && (c.o_bias || c.mlp_bias))
    why = "biases on o or the MLP with RMSNorm";
  if (why.empty()) return "";
  return fmt::format("the CUDA engine does not run {} ({}); use --device cpu", c.architecture, why);
}

DecoderCuda::DecoderCuda(const ModelSpec& spec, bool quiet, const DecodeTuning& tuning)
    : cfg_(spec.config), tuning_(tuning) {
  const CudaStatus st = cuda_status();
  if (!st.usable) throw DeviceError(st.problem + "; run with --device cpu");
  device_name_ = st.name;
  const ModelConfig& c = cfg_;
  if (const std::string why = cuda_unsupported(c); !why.empty())
    throw Error(fmt::format("{}: {}", spec.dir, why));
  // The first call that needs device memory: where even that fails, say so as any shortage.
  const cudaError_t stream_err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (stream_err == cudaErrorMemoryAllocation) {
    size_t f = 0, t = 0;
    const bool known = cudaMemGetInfo(&f, &t) == cudaSuccess && t > 0;
    cudaGetLastError();
    throw DeviceError(fmt::format("out of GPU memory: {}too little to start (the weights alone need {})",
                                  known ? mib(f) + " free of " + mib(t) + ", " : "",
                                  mib(gpu_weights_bound(spec))));
  }
  KESTREL_CUDA_CHECK(stream_err);
  {
    size_t total = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_at_start_, &total));
  }

  // Weights, streamed tensor by tensor into one allocation.
  arena_.reserve(mem_, gpu_weights_bound(spec));
  w_ = load_gpu_weights(spec, tuning_, arena_, stream_, quiet, weight_bytes_);
  plan_act_order(w_, cfg_, mem_, stream_);
  // The decode step's stream-order branches stage RMSNorm and carry no o bias.
  KESTREL_CHECK(c.norm == NormKind::RMS || w_.layers.empty() || !w_.layers[0].order.on,
                "internal: act-order stream order planned for a LayerNorm family");

  // Activations.
  int* io = mem_.alloc_n<int>(4);
  s_.token = io;
  s_.pos = io + 1;
  s_.next = io + 2;
  auto halves = [&](size_t n) { return mem_.alloc_n<__half>(n); };
  s_.x = halves(c.hidden);
  if (w_.embed_perm) s_.x2 = halves(c.hidden);
  s_.qkv = halves(c.q_dim() + 2 * c.kv_dim());
  s_.att = halves(c.q_dim());
  s_.gate_up = halves(2 * (size_t)c.intermediate);
  s_.logits = halves(c.vocab);
  s_.logits_f32 = mem_.alloc_n<float>(c.vocab);
  s_.sampling = mem_.alloc_n<TopKSampling>(1);
  s_.sample_workspace = mem_.alloc(cuda::sample_top_k_workspace_bytes());
  cuda::sample_top_k_workspace_reset(s_.sample_workspace, stream_);
  KESTREL_CUDA_CHECK(cudaMallocHost(&host_io_, 5 * sizeof(int)));
  KESTREL_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_io_dev_), host_io_, 0));
  for (cudaEvent_t& e : chain_done_)
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaMallocHost(&host_logits_, c.vocab * sizeof(float)));
  KESTREL_CUDA_CHECK(cudaMallocHost(&host_rows_, (1 + 2 * kVerifyMaxRows) * sizeof(int)));

  // The weights and indices went up with cudaMemcpy on the legacy stream, which stream_ (non-
  // blocking) does not wait for, and a pageable copy may return before it lands: the whole
  // device, not only stream_, is done before the first step.
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t in_use = device_bytes_in_use();
  scratch_bytes_ = in_use > weight_bytes_ ? in_use - weight_bytes_ : 0;
  after_load_bytes_ = in_use;
}

std::unique_ptr<DecoderCudaSession> DecoderCuda::new_cuda_session(int context, bool quiet) {
  auto q = std::make_unique<DecoderCudaSession>(*this, context, quiet);
  if (!warmed_up_) {
    // The decode path's footprint: weights, scratch and the first session (before the warm-up
    // takes the prefill's scratch).
    after_load_bytes_ = device_bytes_in_use();
    warmed_up_ = true;
    warm_up(*q);
  }
  return q;
}

std::unique_ptr<Session> DecoderCuda::new_session(int context, bool quiet) {
  return new_cuda_session(context, quiet);
}

// Device memory of one session, freed when the session ends (or its constructor throws).
DecoderCudaSession::DecoderCudaSession(DecoderCuda& m, int context, bool quiet) : Session(m), m_(m) {
  const ModelConfig& c = m.cfg_;
  try {
    // KV cache: as long as asked (or the model's maximum), shortened to what fits.
    int ctx = context > 0 ? context : c.max_pos;
    c.check_context(ctx);
    const size_t per_pos = 2ull * c.n_layers * c.kv_dim() * sizeof(__half);
    size_t free_b = 0, total_b = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t reserve = (size_t)256 << 20;  // scratch, graphs, the CUDA context's growth
    const size_t fits = free_b > reserve ? (free_b - reserve) / per_pos : 0;
    if ((size_t)ctx > fits) {
      if (fits < 16)
        throw DeviceError(fmt::format("out of GPU memory: the weights use {}, {} is left, too little "
                                      "for the {} of scratch kept free and a KV cache",
                                      mib(m.weight_bytes_), mib(free_b), mib(reserve)));
      if (!quiet)
        fmt::print(stderr, "note: GPU memory is short: context reduced from {} to {} tokens\n", ctx, fits);
      ctx = (int)fits;
    }
    q_.ctx = ctx;
    q_.cache_bytes = per_pos * ctx;
    auto alloc = [&](size_t bytes) {
      return mem_.alloc(bytes, fmt::format(" for a context of {}", ctx), "; use -c N");
    };
    q_.key_cache = static_cast<__half*>(alloc(q_.cache_bytes / 2));
    q_.value_cache = static_cast<__half*>(alloc(q_.cache_bytes / 2));
    q_.att_workspace =
        static_cast<float*>(alloc(cuda::attention_workspace_bytes(ctx, c.n_heads, c.head_dim)));
    cuda::attention_workspace_reset(q_.att_workspace, ctx, c.n_heads, c.head_dim, m.stream_);
    graphs_.capture(ctx, m.tuning_.graph_ranges, DecoderCuda::kHeads, m.stream_, [&](int head, int bound) {
      m.record_step(q_, m.stream_, (DecoderCuda::Head)head, bound);
    });
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(m.stream_));
  } catch (...) {
    release();
    throw;
  }
}

DecoderCudaSession::~DecoderCudaSession() { release(); }

void DecoderCudaSession::release() {
  if (!mem_.empty()) cudaStreamSynchronize(m_.stream_);
  graphs_.clear();
  verify_graphs_.clear();
  mem_.free_all();
}

// A short prompt through the prefill at load, as llama.cpp warms up: the first use of cuBLASLt
// (its handle, the modules of its kernels) otherwise lands on the first prompt, where it costs
// more than the prompt itself (docs/performance.md). It runs in the model's first session: its
// K/V at positions 0.. is written again by the first real prompt; its memory is the prefill's
// scratch, which that prompt takes anyway (after_load_bytes_, the decode path's share, is
// measured before). Where the scratch does not fit, opening the session still succeeds: the
// first prompt reports it.
void DecoderCuda::warm_up(DecoderCudaSession& q) {
  const int n = std::min(cuda::kGemmMinRows, q.q_.ctx);
  if (n < 2) return;
  const std::vector<int> tokens(n, 0);
  std::vector<float> logits(cfg_.vocab);
  try {
    forward(q, tokens.data(), n, 0, logits.data(), nullptr);
  } catch (const DeviceError&) {
    prefill_.reset();
    // Out of memory leaves the device usable; anything sticky fails here and is reported.
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
}

size_t DecoderCuda::device_bytes_in_use() const {
  size_t free_b = 0, total = 0;
  if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
  return free_at_start_ > free_b ? free_at_start_ - free_b : 0;
}

DecoderCuda::~DecoderCuda() {
  prefill_.reset();
  for (cudaEvent_t e : chain_done_)
    if (e) cudaEventDestroy(e);
  if (stream_) cudaStreamSynchronize(stream_);
  mem_.free_all();  // the weights sit in its arena: the GEMV weights own no memory of their own
  if (host_io_) cudaFreeHost(host_io_);
  if (host_logits_) cudaFreeHost(host_logits_);
  if (host_rows_) cudaFreeHost(host_rows_);
  if (stream_) cudaStreamDestroy(stream_);
}

void DecoderCuda::record_step(const GpuSequence& q, cudaStream_t s, Head head, int ctx_bound) {
  const ModelConfig& c = cfg_;
  const size_t kv_layer = (size_t)q.ctx * c.kv_dim();
  const double h2 = sizeof(__half);
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
  profiler_.mark("embedding", 2 * c.hidden * h2, s);
  for (int l = 0; l < c.n_layers; ++l) {
    const GpuLayer& L = w_.layers[l];
    __half* k_cache = q.key_cache + l * kv_layer;    // [ctx, kv_dim]
    __half* v_cache = q.value_cache + l * kv_layer;  // [ctx, kv_dim]

    // Attention block: x += Wo attention(rope(Wqkv norm(x) + b)) (+ bo). The norm runs inside
    // the qkv GEMV as it stages x; under L.order, x is in qkv's act-order permutation (and the
    // norm weights with it), so that qkv stages it without a gather. The q|k|v biases enter as
    // the GEMV's residual.
    const GpuLayer::StreamOrder& O = L.order;
    if (O.on)
      cuda::gemv(O.qkv, s_.x, s_.qkv, L.qkv.bias, s, {O.input_norm, c.rms_eps});
    else  // [q | k | v]
      L.qkv.run(s_.x, s_.qkv, L.qkv.bias, s,
                {L.input_norm, c.rms_eps, false, layer_norm, L.input_norm_bias});
    profiler_.mark(layer_norm ? "layer_norm + gemv qkv" : "rms_norm + gemv qkv",
                   L.qkv.bytes_moved(), s);
    if (c.qk_norm) {  // Qwen3: RMSNorm over each head of q and k, before RoPE
      cuda::head_rms_norm_f16(s_.qkv, c.q_dim() + 2 * c.kv_dim(), 1, c.n_heads, c.n_kv_heads,
                              c.head_dim, L.q_norm, L.k_norm, c.rms_eps, s);
      profiler_.mark("q/k head norms", 0, s);
    }
    // RoPE of q and the new k, the KV-cache write and the attention: one split kernel, which
    // rotates as it reads qkv and merges the chunks in the last block of each head range
    // (under L.order, storing its output in o's act-order permutation).
    cuda::attention_decode_rope_f16(s_.qkv, k_cache, v_cache, s_.pos, q.ctx, c.sliding_window,
                                    c.n_heads, c.n_kv_heads, c.head_dim, c.rope_scaling(),
                                    q.att_workspace, s_.att, s,
                                    O.att_out, ctx_bound, tuning_.attention_heads_per_block);
    profiler_.mark("rope + kv write + attention", profiler_.on() ? 2.0 * (profiler_.pos() + 1) * c.kv_dim() * h2 : 0, s);
    if (O.on)  // x2 = Wo att + x, x read in qkv's permutation, x2 stored in gate|up's
      cuda::gemv(O.o, s_.att, s_.x2, s_.x, s, {}, {false, O.o_out, O.o_residual});
    else
      L.o.run(s_.att, s_.x, s_.x, s, {}, {.bias = L.o.bias});
    profiler_.mark("gemv o (+residual)", L.o.bytes_moved(), s);

    // MLP block, xb = norm(x): x += Wdown (silu(Wgate xb) * Wup xb), or (ReLU) x += Wfc2
    // relu(Wfc1 xb + b1) + b2. The norm runs inside the gate|up (fc1) GEMV, SiLU * up in its
    // epilogue (quantized) or in the down GEMV's staging; ReLU in fc1's epilogue.
    if (c.mlp == MlpKind::ReLU) {
      L.gate_up.run(s_.x, s_.gate_up, L.gate_up.bias, s,  // [intermediate]
                    {L.post_norm, c.rms_eps, false, true, L.post_norm_bias}, {.relu = true});
      profiler_.mark("layer_norm + gemv fc1 + relu", L.gate_up.bytes_moved(), s);
      L.down.run(s_.gate_up, s_.x, s_.x, s, {}, {.bias = L.down.bias});
      profiler_.mark("gemv fc2 (+res)", L.down.bytes_moved(), s);
    } else if (L.gate_up.can_silu_epilogue()) {
      // SiLU(gate) * up in the gate|up GEMV's epilogue: down stages plain x [intermediate].
      // Under act-order, stored in down's permutation (GpuLayer::down_x_index).
      const cuda::GemvEpilogue silu{/*silu_mul=*/true, L.down_x_index};
      if (O.on)
        cuda::gemv(O.gate_up, s_.x2, s_.gate_up, nullptr, s, {O.post_norm, c.rms_eps}, silu);
      else
        L.gate_up.run(s_.x, s_.gate_up, nullptr, s, {L.post_norm, c.rms_eps}, silu);
      profiler_.mark("rms_norm + gemv gate|up + silu*up", L.gate_up.bytes_moved(), s);
      const GpuLinear& down = L.down_x_index ? L.down_x_permuted : L.down;
      if (O.on)  // x = Wdown h + x2, x2 read in gate|up's order, x stored in the next qkv's
        cuda::gemv(down.q, s_.gate_up, s_.x, s_.x2, s, {}, {false, O.down_out, O.down_residual});
      else
        down.run(s_.gate_up, s_.x, s_.x, s);
      profiler_.mark("gemv down (+res)", down.bytes_moved(), s);
    } else {
      L.gate_up.run(s_.x, s_.gate_up, nullptr, s, {L.post_norm, c.rms_eps});  // [gate | up]
      profiler_.mark("rms_norm + gemv gate|up", L.gate_up.bytes_moved(), s);
      L.down.run(s_.gate_up, s_.x, s_.x, s, {nullptr, 0.f, /*silu_mul=*/true});
      profiler_.mark("silu*up + gemv down (+res)", L.down.bytes_moved(), s);
    }
  }
  if (head == Head::None) return;

  // [vocab] = lm_head norm(x)
  cuda::gemv_f16(w_.lm_head, s_.x, s_.logits, c.vocab, c.hidden, nullptr, s, {},
                 {w_.final_norm, c.rms_eps, false, layer_norm, w_.final_norm_bias});
  profiler_.mark(layer_norm ? "layer_norm + gemv lm_head" : "rms_norm + gemv lm_head",
                 (double)c.vocab * c.hidden * h2, s);
  if (head == Head::Argmax) {
    cuda::argmax_f16(s_.logits, c.vocab, s_.next, s);
    profiler_.mark("argmax", c.vocab * h2, s);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_io_ + 2, s_.next, sizeof(int), cudaMemcpyDeviceToHost, s));
  } else if (chained) {
    // s_.token and s_.pos are adjacent: the token feeds the next step and tells the host.
    int* slot = host_io_dev_ + (head == Head::Chain0 || head == Head::Sample0 ? 3 : 4);
    if (sampled) {
      cuda::sample_top_k_f16(s_.logits, c.vocab, s_.sampling, s_.sample_workspace, s_.next, s,
                             s_.token, slot);
      profiler_.mark("top-k sampling", c.vocab * h2, s);
    } else {
      cuda::argmax_f16(s_.logits, c.vocab, s_.next, s, s_.token, slot);
      profiler_.mark("argmax", c.vocab * h2, s);
    }
  } else {
    cuda::half_to_float(s_.logits, s_.logits_f32, c.vocab, s);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_logits_, s_.logits_f32, c.vocab * sizeof(float),
                                       cudaMemcpyDeviceToHost, s));
  }
}

std::vector<OpTime> DecoderCuda::profile_step(DecoderCudaSession& q, int token, int pos) {
  set_step_input(q, token, pos);
  return profiler_.profile(stream_, pos, [&] {
    record_step(q.q_, stream_, Head::Argmax, q.graphs_.bound(pos));
  });
}

void DecoderCudaSession::check_position(int pos) const {
  KESTREL_CHECK(pos >= 0 && pos < q_.ctx,
                fmt::format("position {} is past the context of {}", pos, q_.ctx));
}

void DecoderCuda::set_step_input(const DecoderCudaSession& q, int token, int pos) {
  KESTREL_CHECK(token >= 0 && token < cfg_.vocab,
                fmt::format("token id {} is outside the vocabulary ({})", token, cfg_.vocab));
  q.check_position(pos);
  host_io_[0] = token;
  host_io_[1] = pos;
}

void DecoderCuda::step(DecoderCudaSession& q, int token, int pos, Head head) {
  set_step_input(q, token, pos);
  KESTREL_CUDA_CHECK(cudaGraphLaunch(q.graph(pos, head), stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DecoderCuda::forward(DecoderCudaSession& q, const int* tokens, int n, int pos, float* logits,
                        float* all_logits) {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= q.q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q.q_.ctx));
  if (n > 1) {  // many tokens: the chunked prefill (gpu/prefill.cpp)
    prefill(q.q_, tokens, n, pos, logits, all_logits, nullptr, nullptr);
    return;
  }
  const size_t vocab = cfg_.vocab;
  for (int i = 0; i < n; ++i) {
    const bool want = all_logits || i == n - 1;
    step(q, tokens[i], pos + i, want ? Head::Logits : Head::None);
    if (all_logits) std::memcpy(all_logits + i * vocab, host_logits_, vocab * sizeof(float));
  }
  std::memcpy(logits, host_logits_, vocab * sizeof(float));
}

int DecoderCuda::forward_argmax(DecoderCudaSession& q, int token, int pos) {
  step(q, token, pos, Head::Argmax);
  return host_io_[2];
}

// Step k of the run goes through the chained graph of slot k % 2 and its event. At most two
// steps are queued (the one being handed out and the one after it), so a slot's graph is
// relaunched, and its host slot rewritten, only after the host has read it. A sampled run's
// parameters go to the device first; its draws then count up there, step by step.
class DecoderCuda::ChainedRun final : public DecodeRun {
 public:
  ChainedRun(DecoderCudaSession& q, int token, int pos, const TopKSampling* sampling)
      : q_(q), m_(q.m_), pos0_(pos), sampled_(sampling != nullptr) {
    DecoderCuda& m = m_;
    m.set_step_input(q, token, pos);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(m.s_.token, m.host_io_, 2 * sizeof(int),
                                       cudaMemcpyHostToDevice, m.stream_));
    if (sampling) {
      sampling_ = *sampling;
      sampling_.draws = 0;
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(m.s_.sampling, &sampling_, sizeof(sampling_),
                                         cudaMemcpyHostToDevice, m.stream_));
    }
    queue();
  }
  ~ChainedRun() override { cudaStreamSynchronize(m_.stream_); }

  int next(bool ahead) override {
    if (handed_ == queued_) queue();
    if (ahead && queued_ == handed_ + 1 && pos0_ + queued_ < q_.q_.ctx) queue();
    const int slot = handed_ % 2;
    KESTREL_CUDA_CHECK(cudaEventSynchronize(m_.chain_done_[slot]));
    ++handed_;
    return m_.host_io_[3 + slot];
  }

 private:
  void queue() {
    const int pos = pos0_ + queued_;
    q_.check_position(pos);
    const int slot = queued_ % 2;
    const Head head = sampled_ ? (slot ? Head::Sample1 : Head::Sample0)
                               : (slot ? Head::Chain1 : Head::Chain0);
    KESTREL_CUDA_CHECK(cudaGraphLaunch(q_.graph(pos, head), m_.stream_));
    KESTREL_CUDA_CHECK(cudaEventRecord(m_.chain_done_[slot], m_.stream_));
    ++queued_;
  }

  DecoderCudaSession& q_;
  DecoderCuda& m_;
  const int pos0_;
  const bool sampled_;
  TopKSampling sampling_;  // the source of the copy to the device, alive until it is done
  int queued_ = 0, handed_ = 0;  // steps launched, tokens returned
};

std::unique_ptr<DecodeRun> DecoderCudaSession::greedy_run(int token, int pos) {
  return std::make_unique<DecoderCuda::ChainedRun>(*this, token, pos, nullptr);
}

std::unique_ptr<DecodeRun> DecoderCudaSession::sampled_run(int token, int pos, const TopKSampling& s) {
  const int vocab = config().vocab;
  const bool ok = vocab <= kDeviceSampleMax && s.top_k >= 1 &&
                  s.top_k <= kDeviceTopKMax && s.top_k <= vocab &&
                  s.temperature > 0.0f && std::isfinite(s.temperature) && s.top_p > 0.0f &&
                  s.min_p >= 0.0f && s.min_p <= 1.0f;
  if (!ok) return nullptr;  // the host samples what the device's sampler does not cover
  return std::make_unique<DecoderCuda::ChainedRun>(*this, token, pos, &s);
}

}  // namespace kestrel
