// At the door of `kestrel serve`: the API key check and the access log's lines.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kestrel::server {

// Whether an Authorization header is "Bearer KEY". The comparison takes the same time wherever
// the first wrong byte is, so that timing tells a guesser nothing about the key.
bool bearer_matches(std::string_view authorization, std::string_view key);

// One request as the access log records it.
struct AccessEntry {
  std::string remote;  // address:port of the client
  std::string method, path;
  int status = 0;
  int prompt_tokens = -1, completion_tokens = -1;  // -1: not a generation
  std::string finish;                              // the generation's finish_reason
  double ms = 0;                                   // from the request read to the answer sent
  std::optional<std::string> prompt;               // only with --log-prompts
};

// "127.0.0.1:50312 POST /v1/chat/completions 200 prompt=12 completion=30 finish=stop 45.1 ms".
// Never the API key; the prompt only where the entry holds it, as a JSON string.
std::string access_line(const AccessEntry& e);

}  // namespace kestrel::server
