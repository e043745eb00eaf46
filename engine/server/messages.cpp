#include "engine/server/messages.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/error.h"
#include "engine/server/ordered_json.h"

namespace kestrel::server {

using nlohmann::json;

namespace {

// The tool calls' arguments of one request, read as JSON, share the bound on values that the
// body's own parse has (each is one string value to it): past it, arguments stay text.
constexpr size_t kArgumentsValues = 100000;

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

namespace {

// An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
// "arguments"}}], as OpenAI's clients send back what the model called. `arguments` is JSON text
// in OpenAI's API; the templates of Qwen, Llama 3.1 and Mistral write it with `| tojson` (or
// test `is string`), which expects the object transformers' users pass. A text that parses as a
// JSON object is passed as that object (keys in their order), as vLLM does; any other text
// stays a string.
nlohmann::ordered_json parse_tool_calls(const json& v, const std::string& at, size_t& budget) {
  const std::string param = at + ".tool_calls";
  if (!v.is_array())
    throw bad(param, param + " must be a list of {\"id\", \"type\": \"function\", \"function\"} objects");
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t k = 0; k < v.size(); ++k) {
    const json& c = v[k];
    const std::string here = fmt::format("{}[{}]", param, k);
    if (!c.is_object()) throw bad(here, here + " must be an object, got " + shown_json(c));
    if (c.contains("type") && !c["type"].is_null() && c["type"] != "function")
      throw bad(here + ".type", here + ".type must be \"function\"");
    const auto fn = c.find("function");
    if (fn == c.end() || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
      throw bad(here + ".function", here + ".function must be an object with a \"name\" string");
    nlohmann::ordered_json args = "{}";
    if (fn->contains("arguments") && !(*fn)["arguments"].is_null()) {
      const json& a = (*fn)["arguments"];
      if (a.is_string()) {
        // Given to the template as an object where the text is one (as vLLM does), else as the
        // text. The text is one value to the body's bounded parse: its own parse has the same
        // bounds, a share of them for each call, and past them the text stays text.
        args = a.get<std::string>();
        size_t used = 0;
        try {
          auto parsed = parse_ordered_json(a.get_ref<const std::string&>(),
                                           {budget, 32, 1024}, {}, &used);
          if (parsed.is_object()) args = std::move(parsed);
        } catch (const nlohmann::json::exception&) {
        } catch (const Error&) {
        }
        budget -= std::min(used, budget);
      } else if (a.is_object()) {
        args = nlohmann::ordered_json(a);
      } else {
        throw bad(here + ".function.arguments",
                  here + ".function.arguments must be a string of JSON (or an object)");
      }
    } else {
      args = nlohmann::ordered_json::object();
    }
    std::string id;
    if (c.contains("id") && !c["id"].is_null()) {
      if (!c["id"].is_string()) throw bad(here + ".id", here + ".id must be a string");
      id = c["id"].get<std::string>();
    }
    out.push_back({{"id", id},
                   {"type", "function"},
                   {"function", {{"name", (*fn)["name"].get<std::string>()}, {"arguments", args}}}});
  }
  return out;
}

}  // namespace

std::vector<ChatMessage> parse_chat_messages(const json* v) {
  if (!v) throw ApiError(400, "'messages' is required", "messages", "missing_required_parameter");
  if (!v->is_array() || v->empty())
    throw bad("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects");
  std::vector<ChatMessage> out;
  size_t arguments_budget = kArgumentsValues;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string at = fmt::format("messages[{}]", i);
    if (!m.is_object()) throw bad(at, at + " must be an object, got " + shown_json(m));
    if (!m.contains("role") || !m["role"].is_string())
      throw bad(at + ".role", at + ".role must be a string");
    std::string role = m["role"].get<std::string>();
    // OpenAI's newer name for the system role.
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      throw ApiError(400, fmt::format("{}.role: '{}' is not supported (system, developer, user, assistant, tool)",
                                      at, role),
                     at + ".role", "unsupported_value");
    ChatMessage msg;
    msg.role = role;
    const bool calls = role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (calls) {
      msg.tool_calls = parse_tool_calls(m["tool_calls"], at, arguments_budget);
      if (msg.tool_calls.empty()) msg.tool_calls = nullptr;  // [] is no call, as OpenAI reads it
    }
    // An assistant message that calls tools may have no content (OpenAI's clients send null):
    // the templates are given "", which they all read as no text.
    if (!m.contains("content") || m["content"].is_null()) {
      if (msg.tool_calls.is_null())
        throw bad(at + ".content", at + ".content is required" +
                                       std::string(role == "assistant" ? " (or tool_calls)" : ""));
    } else {
      msg.content = message_content(m["content"], i);
    }
    if (role == "tool") {
      // The call this result answers. OpenAI requires it; the templates of Qwen and Llama 3.1
      // do not write it, Mistral's does.
      if (!m.contains("tool_call_id") || !m["tool_call_id"].is_string())
        throw bad(at + ".tool_call_id", at + ".tool_call_id is required (the id of the call this answers)");
      msg.tool_call_id = m["tool_call_id"].get<std::string>();
    }
    if (m.contains("name") && !m["name"].is_null()) {
      if (!m["name"].is_string()) throw bad(at + ".name", at + ".name must be a string");
      msg.name = m["name"].get<std::string>();
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace kestrel::server
