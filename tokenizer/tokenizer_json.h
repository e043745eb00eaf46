// Readers of the fields of tokenizer.json and tokenizer_config.json: a part's "type", a pattern
// ({"String": ...} or {"Regex": ...}), and options of a given type. A field of the wrong type
// is one kestrel::Error line naming `ctx` (the file and the part) and the field, never
// nlohmann's own message. (models/io/json_fields.h is config.json's counterpart.)
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/error.h"

namespace kestrel::tokenizer_json {

// The "type" of a part, or the part itself as JSON when it has none (for messages).
inline std::string type_of(const nlohmann::json& j) {
  auto it = j.is_object() ? j.find("type") : j.end();
  return it != j.end() && it->is_string() ? it->get<std::string>() : j.dump();
}

struct Pattern {
  std::string text;
  bool regex = false;
};

inline Pattern pattern(const nlohmann::json& j, const std::string& ctx) {
  if (j.is_object()) {
    for (const bool regex : {false, true}) {
      auto it = j.find(regex ? "Regex" : "String");
      if (it != j.end() && it->is_string()) return {it->get<std::string>(), regex};
    }
  }
  throw Error(fmt::format("{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}, found {}",
                          ctx, j.dump()));
}

// A boolean option of object `j`; nullopt when absent or null (transformers writes null for
// unset options).
inline std::optional<bool> flag(const nlohmann::json& j, const char* key, const std::string& ctx) {
  auto it = j.find(key);  // end() when `j` is not an object
  if (it == j.end() || it->is_null()) return std::nullopt;
  KESTREL_CHECK(it->is_boolean(),
                fmt::format("{}: {} must be true or false, found {}", ctx, key, it->dump()));
  return it->get<bool>();
}

// A string option of object `j`; `fallback` when absent or null.
inline std::string string_or(const nlohmann::json& j, const char* key, const std::string& fallback,
                             const std::string& ctx) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  KESTREL_CHECK(it->is_string(),
                fmt::format("{}: {} must be a string, found {}", ctx, key, it->dump()));
  return it->get<std::string>();
}

// A token id: a non-negative integer that fits an int. `what` names the field.
inline int token_id(const nlohmann::json& v, const std::string& what, const std::string& ctx) {
  KESTREL_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX,
                fmt::format("{}: {} must be a token id, found {}", ctx, what, v.dump()));
  return static_cast<int>(v.get<int64_t>());
}

}  // namespace kestrel::tokenizer_json
