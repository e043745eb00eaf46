// Readers of the fields that tokenizer.json's parts share: a part's "type", a pattern
// ({"String": ...} or {"Regex": ...}) and a boolean option. Errors name `ctx` (the file and
// the part).
#pragma once

#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/base/error.h"

namespace kestrel::tokenizer_json {

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

// A boolean option; `fallback` when absent or null.
inline bool flag(const nlohmann::json& j, const char* key, bool fallback, const std::string& ctx) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  KESTREL_CHECK(it->is_boolean(), fmt::format("{}: {} must be true or false", ctx, key));
  return it->get<bool>();
}

}  // namespace kestrel::tokenizer_json
