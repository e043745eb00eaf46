// The Llama decode step on the GPU. Per token: embedding, then per layer
//   rmsnorm -> fused qkv GEMV -> flash-decoding attention (RoPE and the KV write inside)
//   -> o GEMV (+ residual) -> rmsnorm -> fused gate|up GEMV (SiLU*up in its epilogue) -> down GEMV
//   (+ residual)
// then the final norm, the lm_head GEMV and the argmax. The step reads its token and position
// from device memory, so it is captured as a CUDA graph (one per range of positions:
// capture_graphs) and replayed per token; the host writes two ints and reads one back. Greedy
// runs (ChainedRun) chain the steps on the device: the argmax writes the next step's token and
// position itself, so the next step is queued before the host has read the token.
#include "models/llama_cuda.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "engine/base/device.h"
#include "engine/base/error.h"
#include "engine/base/progress.h"
#include "kernels/activation/activation_cuda.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/gemm.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/sampling/argmax_cuda.h"
#include "kernels/sampling/sample_cuda.h"
#include "models/host_gptq.h"

namespace kestrel {

namespace {

std::string mb(size_t bytes) { return fmt::format("{:.0f} MiB", bytes / 1048576.0); }

// cudaMalloc, the allocation recorded in `owned` (its owner frees it); where it fails, one
// DeviceError: "out of GPU memory: <bytes> more needed<for_what>, <free> free of <total>
// (<CUDA's reason>)<hint>".
void* device_alloc(size_t bytes, std::vector<void*>& owned, const std::string& for_what = "",
                   const std::string& hint = "") {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 16));
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw DeviceError(fmt::format("out of GPU memory: {} more needed{}, {} free of {} ({}){}",
                                  mb(bytes), for_what, mb(free_b), mb(total_b),
                                  cudaGetErrorString(err), hint));
  }
  owned.push_back(p);
  return p;
}

// Tensor data as fp16 bits (converting BF16/F32), for upload.
std::vector<uint16_t> as_f16(const TensorInfo& t) {
  std::vector<uint16_t> out(t.numel());
  if (t.dtype == DType::F16) {
    std::memcpy(out.data(), t.data, t.nbytes);
  } else {
    const std::vector<float> f = to_float(t);
    for (size_t i = 0; i < f.size(); ++i) out[i] = float_to_half(f[i]);
  }
  return out;
}

// Can these GPTQ linears run as one GEMV over their concatenated outputs?
bool fusable(const std::vector<const LinearSpec*>& parts) {
  const LinearSpec& a = *parts[0];
  for (const LinearSpec* p : parts) {
    if (!p->quantized || p->K != a.K || p->bits != a.bits || p->group_size != a.group_size ||
        p->zero_offset != a.zero_offset || (p->g_idx == nullptr) != (a.g_idx == nullptr))
      return false;
    if (p->g_idx && std::memcmp(p->g_idx->data, a.g_idx->data, a.g_idx->nbytes) != 0) return false;
  }
  return true;
}

bool all_dense(const std::vector<const LinearSpec*>& parts) {
  for (const LinearSpec* p : parts)
    if (p->quantized) return false;
  return true;
}

// Copies v to device memory at `cursor` and moves the cursor past it; returns where it went.
const int32_t* upload_at(int32_t*& cursor, const std::vector<int32_t>& v) {
  KESTREL_CUDA_CHECK(
      cudaMemcpy(cursor, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  cursor += v.size();
  return cursor - v.size();
}

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// Whether gemv_prepare keeps zero points for these fusable parts: not when all are equal, as in
// every symmetric checkpoint (1.6% of a 4-bit g128 weight's bytes, which the weights'
// allocation would otherwise hold unused). Reads the parts' qzeros only.
bool keeps_zero_points(const std::vector<const LinearSpec*>& parts) {
  std::vector<std::vector<uint32_t>> qzeros;
  qzeros.reserve(parts.size());
  std::vector<gptq::GptqView> views;
  for (const LinearSpec* p : parts) {
    if (!p->qzeros) return true;
    qzeros.push_back(p->qzeros->copy_as<uint32_t>());
    views.push_back(format_view(*p));
    views.back().qzeros = qzeros.back().data();
  }
  return !cuda::gemv_zero_points_uniform(views);
}

// The linears of a layer as the engine fuses them, in GpuLayer's order: qkv, o, gate|up, down.
// (The loader and the bound on its memory must group them alike.)
std::array<std::vector<const LinearSpec*>, 4> layer_linears(const LayerSpec& ls) {
  return {{{&ls.q, &ls.k, &ls.v}, {&ls.o}, {&ls.gate, &ls.up}, {&ls.down}}};
}

// Device bytes the loader places for these linears: a fused GPTQ weight (bounded from its
// format and whether it keeps zero points), their FP16 rows, or each part on its own.
size_t linear_bound(const std::vector<const LinearSpec*>& parts) {
  int64_t N = 0;
  for (const LinearSpec* p : parts) N += p->N;
  const LinearSpec& a = *parts[0];
  if (fusable(parts))
    return align256(cuda::gemv_device_bytes_bound(a.bits, a.group_size, N, a.K,
                                                  a.g_idx != nullptr, keeps_zero_points(parts)));
  if (all_dense(parts)) return align256((size_t)N * a.K * sizeof(__half));
  size_t total = 0;
  for (const LinearSpec* p : parts) total += linear_bound({p});
  return total;
}

// Device bytes of every weight the loader uploads, each piece 256-byte aligned.
size_t weights_bound(const ModelSpec& spec) {
  auto tensor = [](const TensorInfo* t) { return t ? align256(t->numel() * sizeof(__half)) : 0; };
  size_t total = tensor(spec.embed) + tensor(spec.final_norm) +
                 (spec.lm_head != spec.embed ? tensor(spec.lm_head) : 0);
  for (const LayerSpec& ls : spec.layers) {
    total += tensor(ls.input_norm) + tensor(ls.post_norm);
    for (const auto& parts : layer_linears(ls)) total += linear_bound(parts);
  }
  return total;
}

}  // namespace

std::vector<const GpuLinear*> GpuLinear::leaves() const {
  if (parts.empty()) return {this};
  std::vector<const GpuLinear*> out;
  for (const GpuLinear& p : parts) out.push_back(&p);
  return out;
}

double GpuLinear::bytes_moved() const {
  double b = 0;
  for (const GpuLinear& p : parts) b += p.bytes_moved();
  if (!parts.empty()) return b;
  return quantized ? (double)q.bytes_moved() : (double)N * K * sizeof(__half) + (K + 2.0 * N) * sizeof(__half);
}

void GpuLinear::run(const __half* x, __half* y, const __half* residual, cudaStream_t s,
                    cuda::GemvInput in, cuda::GemvEpilogue out) const {
  if (!parts.empty()) {
    if (out.silu_mul)
      throw Error("GpuLinear::run: the SiLU epilogue needs one fused [gate | up] weight");
    int64_t n0 = 0;  // each part into its columns; the input op (RMSNorm) runs in each
    for (const GpuLinear& p : parts) {
      p.run(x, y + n0, residual ? residual + n0 : nullptr, s, in, out);
      n0 += p.N;
    }
  } else if (quantized)
    cuda::gemv(q, x, y, residual, s, in, out);
  else if (out.silu_mul)
    throw Error("GpuLinear::run: the SiLU epilogue needs a quantized [gate | up] weight");
  else
    cuda::gemv_f16(dense, x, y, N, K, residual, s, {}, in);
}

// Streams the checkpoint's tensors to the GPU, one at a time, counting bytes for the bar.
struct GpuLoader {
  LlamaCuda& m;
  Progress bar;
  double done = 0;

  __half* upload(const TensorInfo& t) {
    const std::vector<uint16_t> h = as_f16(t);
    auto* d = static_cast<__half*>(m.arena_alloc(h.size() * 2));
    KESTREL_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    m.weight_bytes_ += h.size() * 2;
    advance(t.nbytes);
    return d;
  }

  void advance(size_t bytes) { bar.update(done += bytes / 1048576.0); }

  // Several linears with the same input, fused along N where their formats agree (GPTQ) or
  // all are FP16; otherwise each on its own (GpuLinear::parts), so that GPTQ weights stay
  // quantized and keep their own act-order permutations.
  GpuLinear linear(const std::vector<const LinearSpec*>& parts) {
    if (!fusable(parts) && !all_dense(parts)) {
      GpuLinear out;
      out.K = parts[0]->K;
      for (const LinearSpec* p : parts) {
        out.parts.push_back(linear({p}));
        out.N += p->N;
        out.bytes += out.parts.back().bytes;
      }
      return out;
    }
    GpuLinear out;
    out.K = parts[0]->K;
    for (const LinearSpec* p : parts) {
      out.N += p->N;
      if (p->bias)
        throw Error(p->name + ".bias: the CUDA engine does not run linear biases; use --device cpu");
    }
    size_t src_bytes = 0;
    for (const LinearSpec* p : parts)
      for (const TensorInfo* t : {p->weight, p->qweight, p->qzeros, p->scales, p->g_idx})
        if (t) src_bytes += t->nbytes;

    if (fusable(parts)) {
      std::vector<HostGptq> host;
      host.reserve(parts.size());
      for (const LinearSpec* p : parts) host.emplace_back(*p);
      std::vector<gptq::GptqView> views;
      for (const HostGptq& h : host) views.push_back(h.view);
      out.quantized = true;
      out.q = cuda::gemv_prepare(views, m.stream_, m.arena_ + m.arena_used_,
                                 m.arena_size_ - m.arena_used_);
      m.arena_alloc(out.q.device_bytes);  // what it took
      out.q.launch.block_warps = m.tuning_.gemv_block_warps;
      out.q.launch.specialized = m.tuning_.gemv_specialized;
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(m.stream_));
      out.bytes = out.q.device_bytes;
    } else {
      // Dense FP16 rows, concatenated.
      std::vector<uint16_t> rows;
      rows.reserve((size_t)out.N * out.K);
      for (const LinearSpec* p : parts) {
        const std::vector<uint16_t> h = as_f16(*p->weight);
        rows.insert(rows.end(), h.begin(), h.end());
      }
      out.dense = static_cast<__half*>(m.arena_alloc(rows.size() * 2));
      KESTREL_CUDA_CHECK(cudaMemcpy(out.dense, rows.data(), rows.size() * 2, cudaMemcpyHostToDevice));
      out.bytes = rows.size() * 2;
    }
    m.weight_bytes_ += out.bytes;
    advance(src_bytes);
    return out;
  }
};

void* LlamaCuda::alloc(size_t bytes) { return device_alloc(bytes, allocations_); }

void* LlamaCuda::arena_alloc(size_t bytes) {
  const size_t take = align256(bytes);
  if (arena_used_ + take > arena_size_)  // weights_bound undercounted: a bug, not the user's
    throw Error(fmt::format("internal: the weights need more than the {} sized for them",
                            mb(arena_size_)));
  void* p = arena_ + arena_used_;
  arena_used_ += take;
  return p;
}

LlamaCuda::LlamaCuda(const ModelSpec& spec, bool quiet, const DecodeTuning& tuning)
    : cfg_(spec.config), tuning_(tuning) {
  const CudaStatus st = cuda_status();
  if (!st.usable) throw DeviceError(st.problem + "; run with --device cpu");
  device_name_ = st.name;
  const ModelConfig& c = cfg_;
  if (c.head_dim != 64 && c.head_dim != 128)
    throw Error(fmt::format("{}: head_dim {} is not supported by the CUDA engine (64 or 128); use --device cpu",
                            spec.dir, c.head_dim));
  // The first call that needs device memory: where even that fails, say so as any shortage.
  const cudaError_t stream_err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (stream_err == cudaErrorMemoryAllocation) {
    size_t f = 0, t = 0;
    const bool known = cudaMemGetInfo(&f, &t) == cudaSuccess && t > 0;
    cudaGetLastError();
    throw DeviceError(fmt::format("out of GPU memory: {}too little to start (the weights alone need {})",
                                  known ? mb(f) + " free of " + mb(t) + ", " : "",
                                  mb(weights_bound(spec))));
  }
  KESTREL_CUDA_CHECK(stream_err);
  {
    size_t total = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_at_start_, &total));
  }

  // Weights, streamed tensor by tensor into one allocation.
  arena_size_ = weights_bound(spec);
  arena_ = static_cast<char*>(alloc(arena_size_));
  {
    GpuLoader L{*this, Progress("loading", spec.files.total_bytes() / 1048576.0, "MiB", !quiet)};
    w_.embed = L.upload(*spec.embed);
    w_.final_norm = L.upload(*spec.final_norm);
    w_.lm_head = spec.lm_head == spec.embed ? w_.embed : L.upload(*spec.lm_head);
    for (const LayerSpec& ls : spec.layers) {
      GpuLayer g;
      g.input_norm = L.upload(*ls.input_norm);
      g.post_norm = L.upload(*ls.post_norm);
      const auto lin = layer_linears(ls);
      g.qkv = L.linear(lin[0]);
      g.o = L.linear(lin[1]);
      g.gate_up = L.linear(lin[2]);
      g.down = L.linear(lin[3]);
      w_.layers.push_back(g);
    }
    L.bar.finish();
  }
  permute_down_inputs();
  permute_residual_stream();

  // Activations.
  int* io = static_cast<int*>(alloc(4 * sizeof(int)));
  s_.token = io;
  s_.pos = io + 1;
  s_.next = io + 2;
  auto halves = [&](size_t n) { return static_cast<__half*>(alloc(n * sizeof(__half))); };
  s_.x = halves(c.hidden);
  if (w_.embed_perm) s_.x2 = halves(c.hidden);
  s_.qkv = halves(c.q_dim() + 2 * c.kv_dim());
  s_.att = halves(c.q_dim());
  s_.gate_up = halves(2 * (size_t)c.intermediate);
  s_.logits = halves(c.vocab);
  s_.logits_f32 = static_cast<float*>(alloc(c.vocab * sizeof(float)));
  s_.sampling = static_cast<TopKSampling*>(alloc(sizeof(TopKSampling)));
  s_.sample_workspace = alloc(cuda::sample_top_k_workspace_bytes());
  cuda::sample_top_k_workspace_reset(s_.sample_workspace, stream_);
  KESTREL_CUDA_CHECK(cudaMallocHost(&host_io_, 5 * sizeof(int)));
  KESTREL_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_io_dev_), host_io_, 0));
  for (cudaEvent_t& e : chain_done_)
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaMallocHost(&host_logits_, c.vocab * sizeof(float)));

  // The weights and indices went up with cudaMemcpy on the legacy stream, which stream_ (non-
  // blocking) does not wait for, and a pageable copy may return before it lands: the whole
  // device, not only stream_, is done before the first step.
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t in_use = device_bytes_in_use();
  scratch_bytes_ = in_use > weight_bytes_ ? in_use - weight_bytes_ : 0;
  after_load_bytes_ = in_use;
}

std::unique_ptr<LlamaCudaSession> LlamaCuda::new_cuda_session(int context, bool quiet) {
  auto q = std::make_unique<LlamaCudaSession>(*this, context, quiet);
  if (!warmed_up_) {
    // The decode path's footprint: weights, scratch and the first session (before the warm-up
    // takes the prefill's scratch).
    after_load_bytes_ = device_bytes_in_use();
    warmed_up_ = true;
    warm_up(*q);
  }
  return q;
}

std::unique_ptr<Session> LlamaCuda::new_session(int context, bool quiet) {
  return new_cuda_session(context, quiet);
}

// Device memory of one session, freed when the session ends (or its constructor throws).
LlamaCudaSession::LlamaCudaSession(LlamaCuda& m, int context, bool quiet) : Session(m), m_(m) {
  const ModelConfig& c = m.cfg_;
  try {
    // KV cache: as long as asked (or the model's maximum), shortened to what fits.
    int ctx = context > 0 ? context : c.max_pos;
    const size_t per_pos = 2ull * c.n_layers * c.kv_dim() * sizeof(__half);
    size_t free_b = 0, total_b = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t reserve = (size_t)256 << 20;  // scratch, graphs, the CUDA context's growth
    const size_t fits = free_b > reserve ? (free_b - reserve) / per_pos : 0;
    if ((size_t)ctx > fits) {
      if (fits < 16)
        throw DeviceError(fmt::format("out of GPU memory: the weights use {}, {} is left, too little "
                                      "for the {} of scratch kept free and a KV cache",
                                      mb(m.weight_bytes_), mb(free_b), mb(reserve)));
      if (!quiet)
        fmt::print(stderr, "note: GPU memory is short: context reduced from {} to {} tokens\n", ctx, fits);
      ctx = (int)fits;
    }
    q_.ctx = ctx;
    q_.cache_bytes = per_pos * ctx;
    auto alloc = [&](size_t bytes) {
      return device_alloc(bytes, allocations_, fmt::format(" for a context of {}", ctx),
                          "; use -c N");
    };
    q_.key_cache = static_cast<__half*>(alloc(q_.cache_bytes / 2));
    q_.value_cache = static_cast<__half*>(alloc(q_.cache_bytes / 2));
    q_.att_workspace =
        static_cast<float*>(alloc(cuda::attention_workspace_bytes(ctx, c.n_heads, c.head_dim)));
    cuda::attention_workspace_reset(q_.att_workspace, ctx, c.n_heads, c.head_dim, m.stream_);
    m.capture_graphs(*this);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(m.stream_));
  } catch (...) {
    release();
    throw;
  }
}

LlamaCudaSession::~LlamaCudaSession() { release(); }

void LlamaCudaSession::release() {
  if (!allocations_.empty()) cudaStreamSynchronize(m_.stream_);
  for (cudaGraphExec_t g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  graphs_.clear();
  for (void* p : allocations_) cudaFree(p);
  allocations_.clear();
}

// A short prompt through the prefill at load, as llama.cpp warms up: the first use of cuBLASLt
// (its handle, the modules of its kernels) otherwise lands on the first prompt, where it costs
// more than the prompt itself (docs/performance.md). It runs in the model's first session: its
// K/V at positions 0.. is written again by the first real prompt; its memory is the prefill's
// scratch, which that prompt takes anyway (after_load_bytes_, the decode path's share, is
// measured before). Where the scratch does not fit, opening the session still succeeds: the
// first prompt reports it.
void LlamaCuda::warm_up(LlamaCudaSession& q) {
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

size_t LlamaCuda::device_bytes_in_use() const {
  size_t free_b = 0, total = 0;
  if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
  return free_at_start_ > free_b ? free_at_start_ - free_b : 0;
}

LlamaCuda::~LlamaCuda() {
  prefill_.reset();
  for (cudaEvent_t e : chain_done_)
    if (e) cudaEventDestroy(e);
  for (void* p : allocations_) cudaFree(p);
  if (host_io_) cudaFreeHost(host_io_);
  if (host_logits_) cudaFreeHost(host_logits_);
  for (GpuLayer& l : w_.layers)
    for (GpuLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      if (lin->quantized) cuda::gemv_free(lin->q);
      for (GpuLinear& p : lin->parts)
        if (p.quantized) cuda::gemv_free(p.q);
    }
  if (stream_) cudaStreamDestroy(stream_);
}

// Act-order down weights gather their x through the permutation in every block (K = 11008 on
// a 7B: 44 KB of indices per block); the gate|up GEMV before writes x in that order instead
// (GpuLayer::down_x_index).
void LlamaCuda::permute_down_inputs() {
  auto wants = [&](const GpuLayer& g) {
    return g.gate_up.can_silu_epilogue() && g.down.quantized && g.down.q.has_perm;
  };
  size_t n = 0;
  for (const GpuLayer& g : w_.layers)
    if (wants(g)) n += (size_t)g.down.K;
  if (n == 0) return;
  auto* d = static_cast<int32_t*>(alloc(n * sizeof(int32_t)));
  for (GpuLayer& g : w_.layers) {
    if (!wants(g)) continue;
    g.down_x_index = upload_at(d, cuda::gemv_input_index(g.down.q, stream_));
    g.down_x_permuted = g.down;
    g.down_x_permuted.q = cuda::gemv_input_permuted(g.down.q);
  }
}

// Act-order models: the decode step keeps the residual stream in the permutation of the GEMV
// that reads it next (GpuLayer::StreamOrder), so that the qkv and gate|up GEMVs stage x as it
// is, without a gather; o and down read their residual through one index and store through
// another. All layers or none, as each down writes the next layer's order: every linear
// quantized and fused, qkv and gate|up act-order. Where o has act-order too, attention stores
// its output in o's permutation.
void LlamaCuda::permute_residual_stream() {
  if (w_.layers.empty()) return;
  auto single = [](const GpuLinear& l) { return l.quantized && l.parts.empty(); };
  for (const GpuLayer& g : w_.layers)
    if (!single(g.qkv) || !single(g.o) || !single(g.gate_up) || !single(g.down) ||
        !g.qkv.q.has_perm || !g.gate_up.q.has_perm)
      return;
  const int64_t H = cfg_.hidden;
  const size_t n = w_.layers.size();
  // Per layer where each element of x sits before qkv (a) and before gate|up (b): idx[i] is
  // the position of element i (gemv_input_index), so x'[idx[i]] = x[i].
  std::vector<std::vector<int32_t>> a(n), b(n);
  for (size_t l = 0; l < n; ++l) {
    a[l] = cuda::gemv_input_index(w_.layers[l].qkv.q, stream_);
    b[l] = cuda::gemv_input_index(w_.layers[l].gate_up.q, stream_);
  }
  std::vector<int32_t> natural(H), embed_perm(H);
  for (int64_t i = 0; i < H; ++i) {
    natural[i] = (int32_t)i;
    embed_perm[a[0][i]] = (int32_t)i;  // out[j] = row[embed_perm[j]]
  }
  auto* d = static_cast<int32_t*>(alloc((2 * n + 2) * H * sizeof(int32_t)));
  const int64_t Q = cfg_.q_dim();
  size_t n_att = 0;  // layers whose o has act-order: attention stores in its permutation
  for (const GpuLayer& g : w_.layers) n_att += g.o.q.has_perm;
  auto* d_att = n_att ? static_cast<int32_t*>(alloc(n_att * Q * sizeof(int32_t))) : nullptr;
  auto* dn = static_cast<__half*>(alloc(2 * n * H * sizeof(__half)));
  auto put_norm = [&](const __half* norm, const std::vector<int32_t>& idx) {
    std::vector<uint16_t> h(H), p(H);
    KESTREL_CUDA_CHECK(cudaMemcpy(h.data(), norm, H * sizeof(__half), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < H; ++i) p[idx[i]] = h[i];
    KESTREL_CUDA_CHECK(cudaMemcpy(dn, p.data(), H * sizeof(__half), cudaMemcpyHostToDevice));
    dn += H;
    return dn - H;
  };
  std::vector<const int32_t*> da(n), db(n);
  for (size_t l = 0; l < n; ++l) {
    da[l] = upload_at(d, a[l]);
    db[l] = upload_at(d, b[l]);
  }
  const int32_t* d_natural = upload_at(d, natural);
  w_.embed_perm = upload_at(d, embed_perm);
  for (size_t l = 0; l < n; ++l) {
    GpuLayer& g = w_.layers[l];
    GpuLayer::StreamOrder& o = g.order;
    o.on = true;
    o.input_norm = put_norm(g.input_norm, a[l]);
    o.post_norm = put_norm(g.post_norm, b[l]);
    o.qkv = cuda::gemv_input_permuted(g.qkv.q);
    o.gate_up = cuda::gemv_input_permuted(g.gate_up.q);
    o.o = g.o.q;
    if (g.o.q.has_perm) {
      o.att_out = upload_at(d_att, cuda::gemv_input_index(g.o.q, stream_));
      o.o = cuda::gemv_input_permuted(g.o.q);
    }
    o.o_residual = da[l];
    o.o_out = db[l];
    o.down_residual = db[l];
    o.down_out = l + 1 < n ? da[l + 1] : d_natural;
  }
}

void LlamaCuda::record_step(const GpuSequence& q, cudaStream_t s, Head head, int ctx_bound) {
  const ModelConfig& c = cfg_;
  const size_t kv_layer = (size_t)q.ctx * c.kv_dim();
  const double h2 = sizeof(__half);
  const bool sampled = head == Head::Sample0 || head == Head::Sample1;
  const bool chained = head == Head::Chain0 || head == Head::Chain1 || sampled;
  if (!chained)
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(s_.token, host_io_, 2 * sizeof(int), cudaMemcpyHostToDevice, s));

  if (w_.embed_perm)  // x [hidden] in layer 0's qkv permutation
    cuda::embedding_permuted_f16(w_.embed, s_.token, c.hidden, w_.embed_perm, s_.x, s);
  else
    cuda::embedding_f16(w_.embed, s_.token, c.hidden, s_.x, s);  // x [hidden]
  mark("embedding", 2 * c.hidden * h2, s);
  for (int l = 0; l < c.n_layers; ++l) {
    const GpuLayer& L = w_.layers[l];
    __half* k_cache = q.key_cache + l * kv_layer;    // [ctx, kv_dim]
    __half* v_cache = q.value_cache + l * kv_layer;  // [ctx, kv_dim]

    // Attention block: x += Wo attention(rope(Wqkv rmsnorm(x))); the RMSNorm runs inside
    // the qkv GEMV as it stages x. Under L.order, x is in qkv's act-order permutation (and the
    // norm weights with it), so that qkv stages it without a gather.
    const GpuLayer::StreamOrder& O = L.order;
    if (O.on)
      cuda::gemv(O.qkv, s_.x, s_.qkv, nullptr, s, {O.input_norm, c.rms_eps});
    else
      L.qkv.run(s_.x, s_.qkv, nullptr, s, {L.input_norm, c.rms_eps});  // [q_dim | kv_dim | kv_dim]
    mark("rms_norm + gemv qkv", L.qkv.bytes_moved(), s);
    // RoPE of q and the new k, the KV-cache write and the attention: one split kernel, which
    // rotates as it reads qkv and merges the chunks in the last block of each head range
    // (under L.order, storing its output in o's act-order permutation).
    cuda::attention_decode_rope_f16(s_.qkv, k_cache, v_cache, s_.pos, q.ctx, c.sliding_window,
                                    c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta,
                                    c.rope_linear_factor, q.att_workspace, s_.att, s,
                                    O.att_out, ctx_bound, tuning_.attention_heads_per_block);
    mark("rope + kv write + attention", profile_ ? 2.0 * (profile_pos_ + 1) * c.kv_dim() * h2 : 0, s);
    if (O.on)  // x2 = Wo att + x, x read in qkv's permutation, x2 stored in gate|up's
      cuda::gemv(O.o, s_.att, s_.x2, s_.x, s, {}, {false, O.o_out, O.o_residual});
    else
      L.o.run(s_.att, s_.x, s_.x, s);
    mark("gemv o (+residual)", L.o.bytes_moved(), s);

    // MLP block: x += Wdown (silu(Wgate xb) * Wup xb), xb = rmsnorm(x); the norm runs inside
    // the gate|up GEMV, SiLU * up in its epilogue (quantized) or in the down GEMV's staging.
    if (L.gate_up.can_silu_epilogue()) {
      // SiLU(gate) * up in the gate|up GEMV's epilogue: down stages plain x [intermediate].
      // Under act-order, stored in down's permutation (GpuLayer::down_x_index).
      const cuda::GemvEpilogue silu{/*silu_mul=*/true, L.down_x_index};
      if (O.on)
        cuda::gemv(O.gate_up, s_.x2, s_.gate_up, nullptr, s, {O.post_norm, c.rms_eps}, silu);
      else
        L.gate_up.run(s_.x, s_.gate_up, nullptr, s, {L.post_norm, c.rms_eps}, silu);
      mark("rms_norm + gemv gate|up + silu*up", L.gate_up.bytes_moved(), s);
      const GpuLinear& down = L.down_x_index ? L.down_x_permuted : L.down;
      if (O.on)  // x = Wdown h + x2, x2 read in gate|up's order, x stored in the next qkv's
        cuda::gemv(down.q, s_.gate_up, s_.x, s_.x2, s, {}, {false, O.down_out, O.down_residual});
      else
        down.run(s_.gate_up, s_.x, s_.x, s);
      mark("gemv down (+res)", down.bytes_moved(), s);
    } else {
      L.gate_up.run(s_.x, s_.gate_up, nullptr, s, {L.post_norm, c.rms_eps});  // [gate | up]
      mark("rms_norm + gemv gate|up", L.gate_up.bytes_moved(), s);
      L.down.run(s_.gate_up, s_.x, s_.x, s, {nullptr, 0.f, /*silu_mul=*/true});
      mark("silu*up + gemv down (+res)", L.down.bytes_moved(), s);
    }
  }
  if (head == Head::None) return;

  cuda::gemv_f16(w_.lm_head, s_.x, s_.logits, c.vocab, c.hidden, nullptr, s, {},
                 {w_.final_norm, c.rms_eps});  // [vocab] = lm_head rmsnorm(x)
  mark("rms_norm + gemv lm_head", (double)c.vocab * c.hidden * h2, s);
  if (head == Head::Argmax) {
    cuda::argmax_f16(s_.logits, c.vocab, s_.next, s);
    mark("argmax", c.vocab * h2, s);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_io_ + 2, s_.next, sizeof(int), cudaMemcpyDeviceToHost, s));
  } else if (chained) {
    // s_.token and s_.pos are adjacent: the token feeds the next step and tells the host.
    int* slot = host_io_dev_ + (head == Head::Chain0 || head == Head::Sample0 ? 3 : 4);
    if (sampled) {
      cuda::sample_top_k_f16(s_.logits, c.vocab, s_.sampling, s_.sample_workspace, s_.next, s,
                             s_.token, slot);
      mark("top-k sampling", c.vocab * h2, s);
    } else {
      cuda::argmax_f16(s_.logits, c.vocab, s_.next, s, s_.token, slot);
      mark("argmax", c.vocab * h2, s);
    }
  } else {
    cuda::half_to_float(s_.logits, s_.logits_f32, c.vocab, s);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_logits_, s_.logits_f32, c.vocab * sizeof(float),
                                       cudaMemcpyDeviceToHost, s));
  }
}

struct LlamaCuda::StepProfile {
  cudaEvent_t start = nullptr;
  std::vector<std::pair<std::string, double>> ops;  // name, bytes
  std::vector<cudaEvent_t> events;
};

void LlamaCuda::mark(const char* op, double bytes, cudaStream_t s) {
  if (!profile_) return;
  cudaEvent_t e;
  KESTREL_CUDA_CHECK(cudaEventCreate(&e));
  KESTREL_CUDA_CHECK(cudaEventRecordWithFlags(e, s, cudaEventRecordExternal));
  profile_->ops.emplace_back(op, bytes);
  profile_->events.push_back(e);
}

std::vector<OpTime> LlamaCuda::profile_step(LlamaCudaSession& q, int token, int pos) {
  set_step_input(q, token, pos);
  StepProfile prof;
  profile_pos_ = pos;
  KESTREL_CUDA_CHECK(cudaEventCreate(&prof.start));
  // Captured as a graph with an event node after every op, so that the step runs as in
  // decoding (no host launch gaps), and replayed twice: the second replay is timed.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  profile_ = &prof;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    KESTREL_CUDA_CHECK(cudaEventRecordWithFlags(prof.start, stream_, cudaEventRecordExternal));
    record_step(q.q_, stream_, Head::Argmax, q.range_end_[q.graph_range(pos)]);
  } catch (...) {
    profile_ = nullptr;
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  profile_ = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  KESTREL_CUDA_CHECK(err);
  for (int i = 0; i < 2; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cudaGraphExecDestroy(exec);
  std::vector<OpTime> out;
  cudaEvent_t prev = prof.start;
  for (size_t i = 0; i < prof.ops.size(); ++i) {
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, prev, prof.events[i]));
    prev = prof.events[i];
    auto it = std::find_if(out.begin(), out.end(), [&](const OpTime& t) { return t.op == prof.ops[i].first; });
    if (it == out.end()) it = out.insert(out.end(), OpTime{prof.ops[i].first});
    it->launches += 1;
    it->us += ms * 1000.0;
    it->bytes += prof.ops[i].second;
  }
  cudaEventDestroy(prof.start);
  for (cudaEvent_t e : prof.events) cudaEventDestroy(e);
  return out;
}

// Attention's grid covers the positions its graph may be replayed at; blocks past the position
// exit at once but each is still launched, and the blocks per query head (heads_per_block in
// kernels/attention/attention.cu) are best chosen by the context's length. So the step is
// captured once per range of positions, each range twice the last: 3 ranges at 2,048
// positions, 4 at 4,096, 9 at 131,072 (7 graphs each). The range's end is a position bound
// only: a graph reads its token and position from device memory like the others.
void LlamaCuda::capture_graphs(LlamaCudaSession& q) {
  const int ctx = q.q_.ctx;
  q.range_end_.clear();
  for (int end = 512; end < ctx && tuning_.graph_ranges; end *= 2) q.range_end_.push_back(end);
  q.range_end_.push_back(ctx);
  q.graphs_.assign(q.range_end_.size() * kHeads, nullptr);
  for (size_t r = 0; r < q.range_end_.size(); ++r)
    for (Head h : {Head::None, Head::Argmax, Head::Logits, Head::Chain0, Head::Chain1,
                   Head::Sample0, Head::Sample1}) {
      cudaGraph_t graph = nullptr;
      KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      try {
        record_step(q.q_, stream_, h, q.range_end_[r]);
      } catch (...) {
        cudaStreamEndCapture(stream_, &graph);
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
      const cudaError_t err = cudaGraphInstantiate(&q.graphs_[r * kHeads + (int)h], graph, 0);
      cudaGraphDestroy(graph);
      KESTREL_CUDA_CHECK(err);
    }
}

int LlamaCudaSession::graph_range(int pos) const {
  return (int)(std::upper_bound(range_end_.begin(), range_end_.end(), pos) - range_end_.begin());
}

void LlamaCudaSession::check_position(int pos) const {
  KESTREL_CHECK(pos >= 0 && pos < q_.ctx,
                fmt::format("position {} is past the context of {}", pos, q_.ctx));
}

void LlamaCuda::set_step_input(const LlamaCudaSession& q, int token, int pos) {
  KESTREL_CHECK(token >= 0 && token < cfg_.vocab,
                fmt::format("token id {} is outside the vocabulary ({})", token, cfg_.vocab));
  q.check_position(pos);
  host_io_[0] = token;
  host_io_[1] = pos;
}

void LlamaCuda::step(LlamaCudaSession& q, int token, int pos, Head head) {
  set_step_input(q, token, pos);
  KESTREL_CUDA_CHECK(cudaGraphLaunch(q.graph(pos, head), stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void LlamaCuda::forward(LlamaCudaSession& q, const int* tokens, int n, int pos, float* logits,
                        float* all_logits) {
  KESTREL_CHECK(n > 0, "forward: no tokens");
  KESTREL_CHECK(pos + n <= q.q_.ctx,
                fmt::format("{} tokens do not fit the context of {}", pos + n, q.q_.ctx));
  if (n > 1) {  // many tokens: the chunked prefill (llama_cuda_prefill.cpp)
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

int LlamaCuda::forward_argmax(LlamaCudaSession& q, int token, int pos) {
  step(q, token, pos, Head::Argmax);
  return host_io_[2];
}

// Step k of the run goes through the chained graph of slot k % 2 and its event. At most two
// steps are queued (the one being handed out and the one after it), so a slot's graph is
// relaunched, and its host slot rewritten, only after the host has read it. A sampled run's
// parameters go to the device first; its draws then count up there, step by step.
class LlamaCuda::ChainedRun final : public DecodeRun {
 public:
  ChainedRun(LlamaCudaSession& q, int token, int pos, const TopKSampling* sampling)
      : q_(q), m_(q.m_), pos0_(pos), sampled_(sampling != nullptr) {
    LlamaCuda& m = m_;
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

  LlamaCudaSession& q_;
  LlamaCuda& m_;
  const int pos0_;
  const bool sampled_;
  TopKSampling sampling_;  // the source of the copy to the device, alive until it is done
  int queued_ = 0, handed_ = 0;  // steps launched, tokens returned
};

std::unique_ptr<DecodeRun> LlamaCudaSession::greedy_run(int token, int pos) {
  return std::make_unique<LlamaCuda::ChainedRun>(*this, token, pos, nullptr);
}

std::unique_ptr<DecodeRun> LlamaCudaSession::sampled_run(int token, int pos, const TopKSampling& s) {
  const int vocab = config().vocab;
  const bool ok = vocab <= kDeviceSampleMax && s.top_k >= 1 &&
                  s.top_k <= kDeviceTopKMax && s.top_k <= vocab &&
                  s.temperature > 0.0f && std::isfinite(s.temperature) && s.top_p > 0.0f &&
                  s.min_p >= 0.0f && s.min_p <= 1.0f;
  if (!ok) return nullptr;  // the host samples what the device's sampler does not cover
  return std::make_unique<LlamaCuda::ChainedRun>(*this, token, pos, &s);
}

}  // namespace kestrel
