// The --messages conversation reader (`kestrel tokenize --messages FILE`) on arbitrary text:
// kestrel::Error or a list of messages, nothing else. It reads by the server's rules
// (engine/server/messages.h), whose ApiError it must turn into a kestrel::Error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "tools/kestrel/inputs.h"

using namespace kestrel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only_kestrel_errors([&] { cli::parse_messages(text, "messages.json"); });
  return 0;
}
