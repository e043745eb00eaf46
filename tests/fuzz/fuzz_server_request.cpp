// kestrel serve's request bodies on arbitrary bytes, as a client may send them: each endpoint's
// parser answers an ApiError (the 400 the client gets) or a request, nothing else: no other
// exception, no crash, no hang. The first byte picks the endpoint, so that one corpus covers all.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/server/api_error.h"
#include "engine/server/request.h"

using namespace kestrel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 4) {
      case 0: server::parse_completion_request(server::Endpoint::Chat, body, {}, 1); break;
      case 1: server::parse_completion_request(server::Endpoint::Completion, body, {}, 1); break;
      case 2: server::parse_tokenize_request(body); break;
      default: server::parse_detokenize_request(body, 32000); break;
    }
  } catch (const server::ApiError&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "escaped exception (not an ApiError): %s\n", e.what());
    std::abort();
  }
  return 0;
}
