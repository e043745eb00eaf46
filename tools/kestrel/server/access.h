// At the door of `kestrel serve`: where the API key comes from, the key check, whether the
// address listened on is loopback, and the access log's lines.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kestrel::server {

// Whether an Authorization header is "Bearer KEY". The comparison takes the same time wherever
// the first wrong byte is, so that timing tells a guesser nothing about the key.
bool bearer_matches(std::string_view authorization, std::string_view key);

// Where the API key may come from, in the order they are taken: --api-key, --api-key-file,
// then the environment's KESTREL_API_KEY (which, like the file, keeps the key out of `ps`).
// A source not given is nullopt.
struct ApiKeySources {
  std::optional<std::string> flag;  // --api-key KEY
  std::optional<std::string> file;  // --api-key-file FILE (the path)
  std::optional<std::string> env;   // KESTREL_API_KEY
};

// The key to require, or "" for none (no source given). Throws kestrel::Error, in one line,
// where auth would be off or wrong by accident: an empty --api-key (`--api-key "$KEY"` with KEY
// unset), an empty or unreadable key file, an empty KESTREL_API_KEY, or both --api-key and
// --api-key-file. The file's key is its first line, trailing whitespace stripped.
std::string resolve_api_key(const ApiKeySources& s);

// Whether `host` (as --host takes it) is a loopback address: 127.0.0.0/8, ::1 (IPv4-mapped
// included) or "localhost". Anything else may be reachable from other machines.
bool is_loopback_host(std::string_view host);

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
