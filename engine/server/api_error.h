// A request refused in OpenAI's error shape, {"error": {"message", "type", "param", "code"}},
// with the HTTP status it is answered with. Everything a client sends wrong ends as one of
// these, never as a dropped connection.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace kestrel::server {

class ApiError : public std::runtime_error {
 public:
  // `param` names the request field at fault and `code` is a machine-readable reason
  // ("context_length_exceeded"); both may be empty (null in the JSON). The type follows from
  // the status as OpenAI spells it.
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "");

  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  nlohmann::json to_json() const;

 private:
  int status_;
  std::string type_, param_, code_;
};

}  // namespace kestrel::server
