// One line of a `kestrel generate --batch-file` on arbitrary text: parse_batch_line never
// throws (a bad line is its error, reported with the line's number), and a line it accepts has
// settings that apply_batch_settings takes without a type error.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "tools/kestrel/inputs.h"

using namespace kestrel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  cli::BatchItem it;
  try {
    it = cli::parse_batch_line(text, 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parse_batch_line threw: %s\n", e.what());
    std::abort();
  }
  if (it.error.empty()) {
    if (it.prompt.empty()) {
      std::fprintf(stderr, "an accepted line without a prompt\n");
      std::abort();
    }
    GenerateOptions opt;
    fuzz::expect_only_kestrel_errors([&] { cli::apply_batch_settings(it.settings, opt); });
  }
  return 0;
}
