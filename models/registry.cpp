#include "models/registry.h"

#include <fmt/format.h>

#include "base/device.h"
#include "base/error.h"
#include "models/cpu/decoder.h"
#include "models/gpu/decoder.h"

namespace kestrel {

Device resolve_device(const std::string& name) {
  if (name == "cpu") return Device::Cpu;
  if (name == "auto") return cuda_status().usable ? Device::Cuda : Device::Cpu;
  if (name == "cuda") {
    const CudaStatus s = cuda_status();
    if (!s.usable) throw DeviceError(s.problem + "; run with --device cpu");
    return Device::Cuda;
  }
  throw Error("unknown device '" + name + "' (cpu, cuda or auto)");
}

const char* device_key(Device d) { return d == Device::Cuda ? "cuda" : "cpu"; }

std::string cache_types_unsupported(Device device, const ModelConfig& c, KvCacheTypes kv) {
  const std::pair<const char*, KvType> options[] = {{"--cache-type-k", kv.k}, {"--cache-type-v", kv.v}};
  for (const auto& [option, t] : options) {
    const std::string why = kv_type_unsupported(t, c.head_dim);
    if (!why.empty()) return std::string(option) + " " + kv_type_name(t) + ": " + why;
  }
  // Both engines run every type in K and V (the CUDA kernels: kernels/attention/kv_cache_cuda.h).
  (void)device;
  return "";
}

size_t cache_bytes_per_position(Device device, const ModelConfig& c, KvCacheTypes kv) {
  const size_t f16 = device == Device::Cpu ? sizeof(float) : 2;
  return (size_t)c.n_layers * (kv_row_bytes(kv.k, c.n_kv_heads, c.head_dim, f16) +
                               kv_row_bytes(kv.v, c.n_kv_heads, c.head_dim, f16));
}

std::unique_ptr<Model> load_model(const ModelSpec& spec, const LoadOptions& o) {
  const std::string cache = cache_types_unsupported(o.device, spec.config, o.cache);
  KESTREL_CHECK(cache.empty(), cache);
  // Every architecture load_model_spec accepts is the Llama family's layer.
  if (o.device == Device::Cuda) {
    // Each linear runs in its own format (GPTQModel's `dynamic` mixes them): a format the
    // kernels do not take is refused here, before any device work, naming the linear.
    const std::string why = cuda_unsupported_formats(spec);
    KESTREL_CHECK(why.empty(), fmt::format("{}: {}", spec.dir, why));
    return std::make_unique<DecoderCuda>(spec, o.quiet, o.tuning, o.cache);
  }
  return std::make_unique<DecoderCpu>(spec, o.cache);
}

}  // namespace kestrel
