#include "models/gpu/weights.h"

#include <array>
#include <cstring>
#include <fmt/format.h>

#include "base/error.h"
#include "base/progress.h"
#include "kernels/common/cuda_utils.h"
#include "models/host_gptq.h"

namespace kestrel {

namespace {

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
// A ReLU MLP (no gate) has fc1 alone in the gate|up slot.
std::array<std::vector<const LinearSpec*>, 4> layer_linears(const LayerSpec& ls) {
  std::vector<const LinearSpec*> mlp_in = {&ls.up};
  if (!ls.gate.name.empty()) mlp_in.insert(mlp_in.begin(), &ls.gate);
  return {{{&ls.q, &ls.k, &ls.v}, {&ls.o}, mlp_in, {&ls.down}}};
}

// Device bytes the loader places for these linears: a fused GPTQ weight (bounded from its
// format and whether it keeps zero points), their FP16 rows, or each part on its own.
size_t weights_bound(const std::vector<const LinearSpec*>& parts) {
  int64_t N = 0;
  for (const LinearSpec* p : parts) N += p->N;
  const LinearSpec& a = *parts[0];
  if (fusable(parts))
    return align256(cuda::gemv_device_bytes_bound(a.bits, a.group_size, N, a.K,
                                                  a.g_idx != nullptr, keeps_zero_points(parts)));
  if (all_dense(parts)) return align256((size_t)N * a.K * sizeof(__half));
  size_t total = 0;
  for (const LinearSpec* p : parts) total += weights_bound({p});
  return total;
}

// The same with the parts' biases, one fp16 vector over the concatenated outputs.
size_t linear_bound(const std::vector<const LinearSpec*>& parts) {
  int64_t N = 0;
  for (const LinearSpec* p : parts) N += p->N;
  return weights_bound(parts) + (parts[0]->bias ? align256((size_t)N * sizeof(__half)) : 0);
}

}  // namespace

size_t gpu_weights_bound(const ModelSpec& spec) {
  auto tensor = [](const TensorInfo* t) { return t ? align256(t->numel() * sizeof(__half)) : 0; };
  size_t total = tensor(spec.embed) + tensor(spec.final_norm) + tensor(spec.final_norm_bias) +
                 tensor(spec.positions) +
                 (spec.lm_head != spec.embed ? tensor(spec.lm_head) : 0);
  for (const LayerSpec& ls : spec.layers) {
    total += tensor(ls.input_norm) + tensor(ls.post_norm) + tensor(ls.q_norm) + tensor(ls.k_norm) +
             tensor(ls.input_norm_bias) + tensor(ls.post_norm_bias);
    for (const auto& parts : layer_linears(ls)) total += linear_bound(parts);
  }
  return total;
}

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
      cuda::GemvEpilogue part_out = out;
      if (out.bias) part_out.bias = out.bias + n0;
      p.run(x, y + n0, residual ? residual + n0 : nullptr, s, in, part_out);
      n0 += p.N;
    }
  } else if (quantized)
    cuda::gemv(q, x, y, residual, s, in, out);
  else if (out.silu_mul)
    throw Error("GpuLinear::run: the SiLU epilogue needs a quantized [gate | up] weight");
  else
    cuda::gemv_f16(dense, x, y, N, K, residual, s, {}, in, out);
}

namespace {

// Streams the checkpoint's tensors to the GPU, one at a time, counting bytes for the bar.
struct GpuLoader {
  DeviceArena& arena;
  const DecodeTuning& tuning;
  cudaStream_t stream;
  Progress bar;
  size_t bytes = 0;  // placed on the device
  double done = 0;   // read from the checkpoint, MiB

  __half* upload(const TensorInfo& t) {
    const std::vector<uint16_t> h = as_f16(t);
    auto* d = static_cast<__half*>(arena.take(h.size() * 2));
    KESTREL_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    bytes += h.size() * 2;
    advance(t.nbytes);
    return d;
  }

  void advance(size_t read) { bar.update(done += read / 1048576.0); }

  // Several linears with the same input, fused along N where their formats agree (GPTQ) or
  // all are FP16; otherwise each on its own (GpuLinear::parts), so that GPTQ weights stay
  // quantized and keep their own act-order permutations.
  // Their biases, where they have them, as one vector [N] over the concatenated outputs.
  GpuLinear linear(const std::vector<const LinearSpec*>& parts) {
    GpuLinear out = weights(parts);
    if (!parts[0]->bias) return out;
    std::vector<uint16_t> b;
    for (const LinearSpec* p : parts) {
      KESTREL_CHECK(p->bias, fmt::format("{}: has no bias where {} has one", p->name, parts[0]->name));
      const std::vector<uint16_t> h = as_f16(*p->bias);
      b.insert(b.end(), h.begin(), h.end());
    }
    out.bias = static_cast<__half*>(arena.take(b.size() * 2));
    KESTREL_CUDA_CHECK(cudaMemcpy(out.bias, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    bytes += b.size() * 2;
    return out;
  }

  GpuLinear weights(const std::vector<const LinearSpec*>& parts) {
    if (!fusable(parts) && !all_dense(parts)) {
      GpuLinear out;
      out.K = parts[0]->K;
      for (const LinearSpec* p : parts) {
        out.parts.push_back(weights({p}));
        out.N += p->N;
        out.bytes += out.parts.back().bytes;
      }
      return out;
    }
    GpuLinear out;
    out.K = parts[0]->K;
    for (const LinearSpec* p : parts) out.N += p->N;
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
      out.q = cuda::gemv_prepare(views, stream, arena.next(), arena.left());
      arena.take(out.q.device_bytes);  // what it took
      out.q.launch.block_warps = tuning.gemv_block_warps;
      out.q.launch.specialized = tuning.gemv_specialized;
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
      out.bytes = out.q.device_bytes;
    } else {
      // Dense FP16 rows, concatenated.
      std::vector<uint16_t> rows;
      rows.reserve((size_t)out.N * out.K);
      for (const LinearSpec* p : parts) {
        const std::vector<uint16_t> h = as_f16(*p->weight);
        rows.insert(rows.end(), h.begin(), h.end());
      }
      out.dense = static_cast<__half*>(arena.take(rows.size() * 2));
      KESTREL_CUDA_CHECK(cudaMemcpy(out.dense, rows.data(), rows.size() * 2, cudaMemcpyHostToDevice));
      out.bytes = rows.size() * 2;
    }
    bytes += out.bytes;
    advance(src_bytes);
    return out;
  }
};

}  // namespace

GpuWeights load_gpu_weights(const ModelSpec& spec, const DecodeTuning& tuning, DeviceArena& arena,
                            cudaStream_t s, bool quiet, size_t& bytes) {
  GpuLoader L{arena, tuning, s, Progress("loading", spec.files.total_bytes() / 1048576.0, "MiB", !quiet)};
  GpuWeights w;
  w.embed = L.upload(*spec.embed);
  w.final_norm = L.upload(*spec.final_norm);
  if (spec.final_norm_bias) w.final_norm_bias = L.upload(*spec.final_norm_bias);
  if (spec.positions) w.positions = L.upload(*spec.positions);
  w.lm_head = spec.lm_head == spec.embed ? w.embed : L.upload(*spec.lm_head);
  for (const LayerSpec& ls : spec.layers) {
    GpuLayer g;
    g.input_norm = L.upload(*ls.input_norm);
    g.post_norm = L.upload(*ls.post_norm);
    if (ls.input_norm_bias) g.input_norm_bias = L.upload(*ls.input_norm_bias);
    if (ls.post_norm_bias) g.post_norm_bias = L.upload(*ls.post_norm_bias);
    if (ls.q_norm) g.q_norm = L.upload(*ls.q_norm);
    if (ls.k_norm) g.k_norm = L.upload(*ls.k_norm);
    const auto lin = layer_linears(ls);
    g.qkv = L.linear(lin[0]);
    g.o = L.linear(lin[1]);
    g.gate_up = L.linear(lin[2]);
    g.down = L.linear(lin[3]);
    w.layers.push_back(g);
  }
  L.bar.finish();
  bytes = L.bytes;
  return w;
}

}  // namespace kestrel
