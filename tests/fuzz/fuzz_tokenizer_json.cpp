// The Hugging Face tokenizer loader on an arbitrary tokenizer.json (the first byte: with a
// tokenizer_config.json of fixed content or none); a file that loads then encodes and
// decodes a few texts and every id up to 512.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel;
namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const fs::path dir = fuzz::scratch() / "tok";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fuzz::write_file(dir / "tokenizer.json", data + 1, size - 1);
  if (data[0] & 1) {
    const std::string cfg = R"({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true})";
    fuzz::write_file(dir / "tokenizer_config.json", reinterpret_cast<const uint8_t*>(cfg.data()), cfg.size());
  }
  fuzz::expect_only_kestrel_errors([&] {
    const std::unique_ptr<Tokenizer> tok = Tokenizer::load(dir.string());
    for (const char* text : {"Hello world", " \u00e9\u00e8 \xf0\x9f\x98\x80 <s>x</s>", "", "\xff\xfe"}) {
      const std::vector<int> ids = tok->encode(text);
      tok->decode(ids);
    }
    std::vector<int> all;
    for (int id = 0; id < std::min(tok->vocab_size(), 512); ++id) all.push_back(id);
    tok->decode(all);
    StreamDecoder stream(*tok);
    for (int id : all) stream.push(id);
    stream.flush();
  });
  return 0;
}
