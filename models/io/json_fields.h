// Typed reads of config.json fields, each failure one line naming the file and the field
// (shared by the config reader and the family descriptions; JSON does not leave models/io).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

namespace kestrel::json_fields {

// Objects keep the file's key order: a quantization config's `dynamic` rules apply in order.
using json = nlohmann::ordered_json;

// Parses JSON text; `where` names it in the one-line error.
json parse_json(const std::string& text, const std::string& where);
// Reads a JSON file that must hold an object (a regular file: base/files.h).
json read_json_object(const std::filesystem::path& path);
// A field that is absent or null counts as absent: transformers writes null for unset options.
const json* field(const json& j, const char* key);
int to_int(const json& v, const char* key, const std::string& where);
int req_int(const json& j, const char* key, const std::string& where);
int opt_int(const json& j, const char* key, const std::string& where, int def);
float opt_float(const json& j, const char* key, const std::string& where, float def);
bool opt_bool(const json& j, const char* key, const std::string& where, bool def);
std::string opt_string(const json& j, const char* key, const std::string& where,
                       const std::string& def);

}  // namespace kestrel::json_fields

namespace kestrel {
struct ModelConfig;
// config.json's architectures, shape and blocks, read by the family it names (families.cpp).
void read_family_config(const json_fields::json& j, const std::string& where, ModelConfig& c);
}  // namespace kestrel
