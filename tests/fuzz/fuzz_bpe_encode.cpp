// The byte-level BPE encoder and the decoders on arbitrary text, with a committed fixture
// tokenizer: encoding never fails, and decoding what was encoded gives the text back (valid
// UTF-8 input; invalid bytes become U+FFFD, so those are only decoded), with the space the
// pre-tokenizer's add_prefix_space puts in front of a text that has none, as transformers
// decodes it too.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel;

namespace {

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (int k = 1; k < n; ++k) {
      const unsigned char d = s[i + k];
      if ((d & 0xc0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3f);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<Tokenizer> tok =
      Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/tests/data/tokenizers/byte_level");
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<int> ids = tok->encode(text, /*with_specials=*/false);
  const std::string back = tok->decode(ids);
  if (valid_utf8(text) && text.find("<|end|>") == std::string::npos && back != text &&
      back != " " + text) {
    std::fprintf(stderr, "round trip differs: %zu bytes in, %zu out\n", text.size(), back.size());
    std::abort();
  }
  return 0;
}
