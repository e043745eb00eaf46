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
  KvCacheTypes cache;    // the sessions' K and V cache types (kernels/attention/kv_quant.h)
};

// Why `device` cannot run caches of types `kv` on a model of config c ("" where it can), as
// one line naming the option: a type the heads cannot take (q8_0 on heads not a multiple of 32).
// Both engines run every type, so the device does not change the answer today.
std::string cache_types_unsupported(Device device, const ModelConfig& c, KvCacheTypes kv);
// Bytes of one position's K and V over every layer on `device`: the CPU reference keeps f16
// as fp32, the GPU as fp16; q8_0 and fp8 are the same bytes on both.
size_t cache_bytes_per_position(Device device, const ModelConfig& c, KvCacheTypes kv);

// Loads the weights of `spec` (which must outlive the call only) on the chosen device, each
// linear in its own format. CUDA refuses a linear whose format its kernels do not run
// (cuda_unsupported_formats) in one line, before any device work.
std::unique_ptr<Model> load_model(const ModelSpec& spec, const LoadOptions& o);

}  // namespace kestrel
