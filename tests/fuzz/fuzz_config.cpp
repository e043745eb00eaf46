// config.json and quantize_config.json readers on arbitrary text, then the checkpoint checks
// (load_model_spec) of the config against a real tiny GPTQ checkpoint's tensors: every family's
// fields, the GPTQ shape checks, the refusals. The first byte chooses the file.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "models/io/config.h"
#include "models/io/model_spec.h"
#include "tests/fuzz/fuzz_util.h"

using namespace kestrel;
namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const fs::path dir = fuzz::scratch() / "cfg";
  static const bool ready = [&] {
    fs::create_directories(dir);
    // The weights and quantization config of a transformers-saved tiny Llama, GPTQ-packed.
    const fs::path src = fs::path(KESTREL_SOURCE_DIR) / "tests/data/families/llama-gptq";
    fs::copy_file(src / "model.safetensors", dir / "model.safetensors",
                  fs::copy_options::overwrite_existing);
    return true;
  }();
  (void)ready;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  fs::remove(dir / "quantize_config.json");
  if (data[0] & 1) {
    fuzz::write_file(dir / "config.json", data + 1, size - 1);
    fuzz::expect_only_kestrel_errors([&] { load_model_spec(dir.string()); });
  } else {
    fuzz::expect_only_kestrel_errors([&] { parse_quant_config(text, "quantize_config.json"); });
  }
  return 0;
}
