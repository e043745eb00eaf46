// The safetensors reader on arbitrary bytes: as a single-file model (header, offsets, dtypes,
// shapes), and as an index (model.safetensors.index.json) pointing at a valid shard. The
// first byte chooses which.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "models/io/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

using namespace kestrel;
namespace fs = std::filesystem;

namespace {

// A small valid shard for the index to name: two F16 tensors.
void write_valid_shard(const fs::path& path) {
  SafetensorsWriter w;
  const uint16_t a[6] = {0x3c00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600};
  w.add_data("model.embed_tokens.weight", DType::F16, {2, 3}, a);
  w.add_data("model.norm.weight", DType::F16, {3}, a);
  w.write(path.string());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const fs::path dir = fuzz::scratch() / "st";
  fs::remove_all(dir);
  fs::create_directories(dir);
  if (data[0] & 1) {
    fuzz::write_file(dir / "model.safetensors", data + 1, size - 1);
  } else {
    write_valid_shard(dir / "model-00001-of-00001.safetensors");
    fuzz::write_file(dir / "model.safetensors.index.json", data + 1, size - 1);
  }
  fuzz::expect_only_kestrel_errors([&] {
    const ModelFiles files = ModelFiles::open(dir.string());
    for (const std::string& name : files.names()) {
      const TensorInfo& t = files.get(name);
      volatile uint8_t sink = 0;  // touch the first and last byte of every tensor
      if (t.nbytes) sink = t.data[0] ^ t.data[t.nbytes - 1];
      (void)sink;
    }
  });
  return 0;
}
