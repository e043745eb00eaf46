#include "engine/server/messages.h"

#include <fmt/format.h>

namespace kestrel::server {

using nlohmann::json;

namespace {

ApiError bad(const std::string& param, const std::string& message) {
  return ApiError(400, message, param, "invalid_value");
}

std::string message_content(const json& content, size_t i) {
  const std::string param = fmt::format("messages[{}].content", i);
  if (content.is_string()) return content.get<std::string>();
  // Content parts: text parts are joined, anything else (images, audio) this engine cannot read.
  if (content.is_array()) {
    std::string text;
    for (const json& part : content) {
      if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
          !part.contains("text") || !part["text"].is_string())
        throw ApiError(400, param + ": only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                       param, "unsupported_content");
      text += part["text"].get<std::string>();
    }
    return text;
  }
  throw bad(param, param + " must be a string or a list of text parts, got " + shown_json(content));
}

}  // namespace

std::string shown_json(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

std::vector<ChatMessage> parse_chat_messages(const json* v) {
  if (!v) throw ApiError(400, "'messages' is required", "messages", "missing_required_parameter");
  if (!v->is_array() || v->empty())
    throw bad("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string at = fmt::format("messages[{}]", i);
    if (!m.is_object()) throw bad(at, at + " must be an object, got " + shown_json(m));
    if (!m.contains("role") || !m["role"].is_string())
      throw bad(at + ".role", at + ".role must be a string");
    std::string role = m["role"].get<std::string>();
    // OpenAI's newer name for the system role.
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant")
      throw ApiError(400, fmt::format("{}.role: '{}' is not supported (system, developer, user, assistant)",
                                      at, role),
                     at + ".role", "unsupported_value");
    if (!m.contains("content") || m["content"].is_null())
      throw bad(at + ".content", at + ".content is required (tool calls are not supported)");
    out.push_back({role, message_content(m["content"], i)});
  }
  return out;
}

}  // namespace kestrel::server
