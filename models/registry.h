// From a model directory to a loaded Model: config.json's `architectures` chooses the family
// (today the Llama family: LlamaForCausalLM, MistralForCausalLM; an unknown name is refused by
// load_model_spec with the list of supported ones) and the device its implementation.
#pragma once

#include <memory>
#include <string>

#include "models/io/model_spec.h"
#include "models/model.h"
#include "models/tuning.h"

namespace kestrel {

enum class Device { Cpu, Cuda };

// "cpu", "cuda" or "auto" (cuda when a GPU is usable) to a device. Throws kestrel::Error for
// any other name and DeviceError for "cuda" without a usable GPU.
Device resolve_device(const std::string& name);
const char* device_key(Device d);  // "cpu" or "cuda"

struct LoadOptions {
  Device device = Device::Cpu;
  bool quiet = true;     // no progress bar or notes on stderr
  DecodeTuning tuning;   // the CUDA decode path's choices (models/tuning.h)
};

// Loads the weights of `spec` (which must outlive the call only) on the chosen device, each
// linear in its own format. CUDA refuses a linear whose format its kernels do not run
// (cuda_unsupported_formats) in one line, before any device work.
std::unique_ptr<Model> load_model(const ModelSpec& spec, const LoadOptions& o);

}  // namespace kestrel
