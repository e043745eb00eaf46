#include "engine/server/api_error.h"

namespace kestrel::server {

using nlohmann::json;

namespace {

std::string type_of(int status) {
  // As OpenAI answers: a key it does not know, a rate limit, its own failure, the rest.
  if (status == 401) return "authentication_error";
  if (status == 429) return "rate_limit_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

}  // namespace

ApiError::ApiError(int status, const std::string& message, std::string param, std::string code)
    : std::runtime_error(message),
      status_(status),
      type_(type_of(status)),
      param_(std::move(param)),
      code_(std::move(code)) {}

json ApiError::to_json() const {
  auto or_null = [](const std::string& s) { return s.empty() ? json() : json(s); };
  return {{"error",
           {{"message", what()}, {"type", type_}, {"param", or_null(param_)}, {"code", or_null(code_)}}}};
}

}  // namespace kestrel::server
