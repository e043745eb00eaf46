#include "tools/kestrel/server/access.h"

#include <fmt/format.h>

#include <cctype>

#include <nlohmann/json.hpp>

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
