#include "tools/kestrel/server/access.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "base/error.h"

namespace kestrel::server {

bool bearer_matches(std::string_view authorization, std::string_view key) {
  // The scheme's name is case-insensitive (RFC 7235); the token is not.
  constexpr std::string_view kScheme = "bearer ";
  bool scheme = authorization.size() >= kScheme.size();
  for (size_t i = 0; scheme && i < kScheme.size(); ++i)
    scheme = std::tolower((unsigned char)authorization[i]) == kScheme[i];
  const std::string_view given =
      scheme ? authorization.substr(kScheme.size()) : std::string_view();
  // Every byte of the key is compared, whatever the given token's length.
  unsigned diff = given.size() != key.size();
  for (size_t i = 0; i < key.size(); ++i)
    diff |= (unsigned char)key[i] ^ (unsigned char)(i < given.size() ? given[i] : 0);
  return scheme && !key.empty() && diff == 0;
}

namespace {

// The first line of `path`, trailing whitespace (the newline, a CR) stripped.
std::string read_key_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) throw Error(fmt::format("cannot read the API key file {}: {}", path, std::strerror(errno)));
  char* buf = nullptr;
  size_t cap = 0;
  errno = 0;
  const ssize_t n = getline(&buf, &cap, f);
  const int err = errno;
  const bool failed = n < 0 && std::ferror(f);
  std::string line = n > 0 ? std::string(buf, (size_t)n) : std::string();
  std::free(buf);
  std::fclose(f);
  if (failed) throw Error(fmt::format("cannot read the API key file {}: {}", path, std::strerror(err)));
  while (!line.empty() && std::isspace((unsigned char)line.back())) line.pop_back();
  if (line.empty())
    throw Error(fmt::format("the API key file {} is empty (its first line must hold the key)", path));
  return line;
}

}  // namespace

std::string resolve_api_key(const ApiKeySources& s) {
  if (s.flag && s.file) throw Error("--api-key and --api-key-file both given: give the key one way");
  if (s.flag) {
    if (s.flag->empty())
      throw Error("--api-key is empty (an unset variable?): give a key, or leave --api-key out "
                  "to serve without one");
    return *s.flag;
  }
  if (s.file) return read_key_file(*s.file);
  if (s.env) {
    if (s.env->empty())
      throw Error("KESTREL_API_KEY is set but empty: give it a key, or unset it to serve without one");
    return *s.env;
  }
  return "";
}

bool is_loopback_host(std::string_view host) {
  std::string h(host);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  std::string lower;
  for (char c : h) lower += (char)std::tolower((unsigned char)c);
  if (lower == "localhost" || lower == "localhost.") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

std::string access_line(const AccessEntry& e) {
  std::string s = fmt::format("{} {} {} {}", e.remote, e.method, e.path, e.status);
  if (e.prompt_tokens >= 0) s += fmt::format(" prompt={}", e.prompt_tokens);
  if (e.completion_tokens >= 0) s += fmt::format(" completion={}", e.completion_tokens);
  if (!e.finish.empty()) s += " finish=" + e.finish;
  s += fmt::format(" {:.1f} ms", e.ms);
  if (e.prompt)
    s += " prompt_text=" +
         nlohmann::json(*e.prompt).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return s;
}

}  // namespace kestrel::server
