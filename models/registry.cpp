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

std::unique_ptr<Model> load_model(const ModelSpec& spec, const LoadOptions& o) {
  // Every architecture load_model_spec accepts is the Llama family's layer.
  if (o.device == Device::Cuda) {
    // Each linear runs in its own format (GPTQModel's `dynamic` mixes them): a format the
    // kernels do not take is refused here, before any device work, naming the linear.
    const std::string why = cuda_unsupported_formats(spec);
    KESTREL_CHECK(why.empty(), fmt::format("{}: {}", spec.dir, why));
    return std::make_unique<DecoderCuda>(spec, o.quiet, o.tuning);
  }
  return std::make_unique<DecoderCpu>(spec);
}

}  // namespace kestrel
