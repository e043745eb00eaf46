// The model on the GPU: loading the weights, the decode step's scratch, the memory accounting
// and the warm-up. Its sessions (models/gpu/session.cpp) run the sequences; the forward it
// records is in decode_step.cpp (one token) and prefill.cpp (rows).
#include "models/gpu/decoder.h"

#include <algorithm>
#include <climits>
#include <fmt/format.h>
#include <tuple>

#include "base/device.h"
#include "base/error.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemv/gemv_format.h"
#include "kernels/sampling/sample_cuda.h"
#include "models/gpu/act_order.h"
#include "models/registry.h"

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

std::string cuda_unsupported_formats(const ModelSpec& spec) {
  for (const LayerSpec& L : spec.layers)
    for (const LinearSpec* l : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) {
      if (!l->quantized) continue;  // FP16 linears (and a ReLU MLP's absent gate) always run
      const std::string why = cuda::gemv_format_problem(l->bits, l->group_size, l->K);
      if (!why.empty())
        return fmt::format("the CUDA engine does not run {}'s {}; use --device cpu", l->name, why);
    }
  return "";
}

void GpuKvStorage::allocate(DeviceMemory& mem, const ModelConfig& c, KvCacheTypes t,
                            int64_t n_rows, const std::string& for_what,
                            const std::string& hint) {
  types = t;
  rows = n_rows;
  bytes = cache_bytes_per_position(Device::Cuda, c, t) * n_rows;
  const size_t layers = c.n_layers;
  auto alloc = [&](size_t b) { return mem.alloc(b, for_what, hint); };
  key_cache = alloc(layers * cuda::kv_data_bytes(t.k, rows, c.n_kv_heads, c.head_dim));
  value_cache = alloc(layers * cuda::kv_data_bytes(t.v, rows, c.n_kv_heads, c.head_dim));
  if (t.k != KvType::F16)
    key_scales = alloc(layers * cuda::kv_scales_bytes(t.k, rows, c.n_kv_heads, c.head_dim));
  if (t.v != KvType::F16)
    value_scales = alloc(layers * cuda::kv_scales_bytes(t.v, rows, c.n_kv_heads, c.head_dim));
}

void GpuKvStorage::copy_blocks(std::span<const KvBlockTable::Copy> copies, const ModelConfig& c,
                               cudaStream_t s) const {
  // Per array, layer l's rows start at l * (its bytes for `rows` rows); a block's rows are
  // contiguous within a layer, so each (copy, array, layer) is one copy of 16 rows.
  struct Array {
    void* base;
    size_t layer_bytes, block_bytes;
  };
  std::vector<Array> arrays;
  for (const auto& [t, data, scales] : {std::tuple{types.k, key_cache, key_scales},
                                        std::tuple{types.v, value_cache, value_scales}}) {
    arrays.push_back({data, cuda::kv_data_bytes(t, rows, c.n_kv_heads, c.head_dim),
                      cuda::kv_data_bytes(t, kKvBlock, c.n_kv_heads, c.head_dim)});
    if (scales)
      arrays.push_back({scales, cuda::kv_scales_bytes(t, rows, c.n_kv_heads, c.head_dim),
                        cuda::kv_scales_bytes(t, kKvBlock, c.n_kv_heads, c.head_dim)});
  }
  for (const KvBlockTable::Copy& cp : copies)
    for (const Array& a : arrays)
      for (int l = 0; l < c.n_layers; ++l) {
        char* layer = static_cast<char*>(a.base) + (size_t)l * a.layer_bytes;
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(layer + (size_t)cp.to * a.block_bytes,
                                           layer + (size_t)cp.from * a.block_bytes, a.block_bytes,
                                           cudaMemcpyDeviceToDevice, s));
      }
}

DecoderCuda::DecoderCuda(const ModelSpec& spec, bool quiet, const DecodeTuning& tuning,
                         KvCacheTypes cache)
    : cfg_(spec.config), tuning_(tuning), cache_(cache) {
  const CudaStatus st = cuda_status();
  if (!st.usable) throw DeviceError(st.problem + "; run with --device cpu");
  device_name_ = st.name;
  const ModelConfig& c = cfg_;
  for (const std::string& why : {cuda_unsupported(c), cuda_unsupported_formats(spec)})
    if (!why.empty()) throw Error(fmt::format("{}: {}", spec.dir, why));
  for (const auto& [option, t] : {std::pair{"--cache-type-k", cache.k}, {"--cache-type-v", cache.v}}) {
    const std::string why = kv_type_unsupported(t, c.head_dim);
    if (!why.empty()) throw Error(fmt::format("{} {}: {}", option, kv_type_name(t), why));
  }
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

// A short prompt through the prefill at load, as llama.cpp warms up: the first use of cuBLASLt
// (its handle, the modules of its kernels) otherwise lands on the first prompt, where it costs
// more than the prompt itself (docs/performance.md). It runs in the model's first session: its
// K/V at positions 0.. is written again by the first real prompt (paged, its blocks are given
// back); its memory is the prefill's scratch, which that prompt takes anyway
// (after_load_bytes_, the decode path's share, is measured before). Where the scratch does not
// fit, opening the session still succeeds: the first prompt reports it.
void DecoderCuda::warm_up(DecoderCudaSession& q) {
  const int n = std::min(cuda::kGemmMinRows, q.q_.ctx);
  if (n < 2) return;
  const std::vector<int> tokens(n, 0);
  std::vector<float> logits(cfg_.vocab);
  try {
    q.forward(tokens.data(), n, 0, logits.data(), nullptr);
  } catch (const DeviceError&) {
    prefill_.reset();
    // Out of memory leaves the device usable; anything sticky fails here and is reported.
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  q.release_kv();  // paged: the blocks it wrote go back to the pool
}

bool DecoderCuda::use_kv_pool(int64_t positions, int sessions, int context, bool quiet) {
  KvBlockPool::blocks_for(positions);  // refused before any memory is looked at
  // As many positions as asked, or as fit beside what the sessions will take of their own
  // (the attention workspace, the block table, the decode graphs) and the scratch every
  // session's constructor keeps free: the pool is what serving many requests is made of, so a
  // GPU short of memory gets a smaller one rather than none, as a session's context is
  // shortened to what fits.
  {
    const ModelConfig& c = cfg_;
    const int ctx = context > 0 ? context : c.max_pos;  // a session's, as new_session resolves it
    const size_t per_pos = cache_bytes_per_position(Device::Cuda, c, cache_);
    const size_t per_session = cuda::attention_workspace_bytes(ctx, c.n_heads, c.head_dim) +
                               ((size_t)64 << 20);  // its graphs and table, generously
    // The prefill scratch's logits of every row are made now where the scratch exists (a
    // warm-up made it), before the pool can take their room; else the scratch's bytes to come
    // stay free too, unless that alone leaves less than one context.
    if (prefill_) grow_row_logits(*prefill_);
    const size_t prefill = prefill_ ? 0 : prefill_bytes_to_come(ctx);
    size_t free_b = 0, total_b = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t fixed = ((size_t)256 << 20) + (size_t)std::max(sessions, 1) * per_session;
    const auto fitting = [&](size_t reserve) -> int64_t {
      return free_b > reserve ? (int64_t)((free_b - reserve) / per_pos) / kKvBlock * kKvBlock : 0;
    };
    const int64_t need = std::max(ctx, kKvBlock);
    int64_t fits = fitting(fixed + prefill);
    if (fits < need && fitting(fixed) >= need) {
      fits = need;
      if (!quiet)
        fmt::print(stderr, "note: GPU memory is short: the prefill scratch may not find room "
                           "beside the KV pool (batched steps then run row by row)\n");
    }
    if (positions > fits) {
      if (fits < need)
        throw DeviceError(fmt::format("out of GPU memory: {} is free, too little for a KV pool of {} "
                                      "positions beside {} for {} session{}: lower --parallel or -c",
                                      mib(free_b), need, mib(fixed + prefill), sessions,
                                      sessions == 1 ? "" : "s"));
      if (!quiet)
        fmt::print(stderr, "note: GPU memory is short: KV pool reduced from {} to {} positions\n",
                   positions, fits);
      positions = fits;
    }
  }
  const int blocks = KvBlockPool::blocks_for(positions);
  // Sessions made before keep the pool they were made with (they share its ownership).
  auto p = std::make_shared<GpuKvPool>(blocks);
  p->kv.allocate(p->mem, cfg_, cache_, blocks * kKvBlock,
                 fmt::format(" for a KV pool of {} positions", blocks * kKvBlock),
                 "; use a smaller pool");
  pool_ = std::move(p);
  return true;
}

KvPoolUse DecoderCuda::kv_pool_use() const {
  if (!pool_) return {};
  std::lock_guard<std::mutex> g(pool_->m);
  return pool_->blocks.use();
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

}  // namespace kestrel
