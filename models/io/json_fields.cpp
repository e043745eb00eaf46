#include "models/io/json_fields.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "base/error.h"
#include "base/files.h"

namespace kestrel::json_fields {

namespace fs = std::filesystem;

json parse_json(const std::string& text, const std::string& where) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    // The parser reports one byte past the end when the text stops inside a value.
    throw Error(e.byte <= text.size()
                    ? fmt::format("{}: not valid JSON (error at byte {})", where, e.byte)
                    : fmt::format("{}: not valid JSON (it ends early)", where));
  } catch (const json::out_of_range&) {
    throw Error(fmt::format("{}: not valid JSON (a number too large to represent)", where));
  }
}

json read_json_object(const fs::path& path) {
  const std::string p = path.string();
  const json j = parse_json(read_regular_file(p), p);
  KESTREL_CHECK(j.is_object(), fmt::format("{}: holds a JSON {}, not an object", p, j.type_name()));
  return j;
}

// A field that is absent or null counts as absent: transformers writes null for unset options.
const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return (it == j.end() || it->is_null()) ? nullptr : &*it;
}

int to_int(const json& v, const char* key, const std::string& where) {
  KESTREL_CHECK(v.is_number_integer(),
                fmt::format("{}: {} must be an integer, found {}", where, key, v.dump()));
  const int64_t x = v.get<int64_t>();
  KESTREL_CHECK(x >= std::numeric_limits<int>::min() && x <= std::numeric_limits<int>::max(),
                fmt::format("{}: {} = {} is out of range", where, key, x));
  return (int)x;
}

int req_int(const json& j, const char* key, const std::string& where) {
  const json* v = field(j, key);
  KESTREL_CHECK(v, fmt::format("{}: missing {}", where, key));
  return to_int(*v, key, where);
}

int opt_int(const json& j, const char* key, const std::string& where, int def) {
  const json* v = field(j, key);
  return v ? to_int(*v, key, where) : def;
}

float opt_float(const json& j, const char* key, const std::string& where, float def) {
  const json* v = field(j, key);
  if (!v) return def;
  KESTREL_CHECK(v->is_number(), fmt::format("{}: {} must be a number, found {}", where, key, v->dump()));
  const float x = v->get<float>();
  KESTREL_CHECK(std::isfinite(x), fmt::format("{}: {} = {} is too large", where, key, v->dump()));
  return x;
}

bool opt_bool(const json& j, const char* key, const std::string& where, bool def) {
  const json* v = field(j, key);
  if (!v) return def;
  KESTREL_CHECK(v->is_boolean(), fmt::format("{}: {} must be true or false, found {}", where, key,
                                             v->dump()));
  return v->get<bool>();
}

std::string opt_string(const json& j, const char* key, const std::string& where,
                       const std::string& def) {
  const json* v = field(j, key);
  if (!v) return def;
  KESTREL_CHECK(v->is_string(), fmt::format("{}: {} must be a string, found {}", where, key, v->dump()));
  return v->get<std::string>();
}

}  // namespace kestrel::json_fields
