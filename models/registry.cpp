#include "models/registry.h"

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
    // The CUDA path (its prefill GEMMs, act-order permutations and graphs) is built and
    // tested for one quantized format per model; FP16 linears among them it has always run.
    // Mixed formats are refused before any device work rather than half-supported.
    const std::string mixed = mixed_formats(spec);
    KESTREL_CHECK(mixed.empty(), "mixed per-module formats (dynamic) run on the CPU engine only so "
                                 "far: --device cpu (" + mixed + ")");
    return std::make_unique<DecoderCuda>(spec, o.quiet, o.tuning);
  }
  return std::make_unique<DecoderCpu>(spec);
}

}  // namespace kestrel
