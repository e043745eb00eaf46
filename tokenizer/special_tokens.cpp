#include "tokenizer/special_tokens.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/tokenizer_json.h"

namespace kestrel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// bos_token / eos_token / ...: a string or an AddedToken object {"content": ...}. nullopt when
// absent or null.
std::optional<std::string> token_field(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  throw Error(fmt::format("{}: {} must be a string or an object with \"content\", found {}", path,
                          key, it->dump()));
}

// bos_token_id / eos_token_id of config.json or generation_config.json: an int or a list of
// ints. Empty when absent or null.
std::vector<int> id_list_field(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  auto bad = [&] {
    return Error(fmt::format("{}: {} must be a non-negative integer or a list of them, found {}",
                             path, key, it->dump()));
  };
  auto one = [&](const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) throw bad();
    return static_cast<int>(v.get<int64_t>());
  };
  std::vector<int> ids;
  if (it->is_array()) {
    for (const auto& v : *it) ids.push_back(one(v));
  } else {
    ids.push_back(one(*it));
  }
  return ids;
}

void append_unique(std::vector<int>& dst, const std::vector<int>& src) {
  for (int id : src)
    if (std::find(dst.begin(), dst.end(), id) == dst.end()) dst.push_back(id);
}

}  // namespace

std::optional<json> read_json_file(const fs::path& path) {
  if (!path_exists(path.string())) return std::nullopt;
  const std::string text = read_regular_file(path.string());
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(e.byte <= text.size()
                    ? fmt::format("{}: not valid JSON (error at byte {})", path.string(), e.byte)
                    : fmt::format("{}: not valid JSON (it ends early)", path.string()));
  } catch (const json::exception&) {
    throw Error(fmt::format("{}: not valid JSON", path.string()));
  }
}

AddedTokenSpec parse_added_token(const json& j, int id, const std::string& where) {
  KESTREL_CHECK(j.is_object() && j.contains("content") && j["content"].is_string(),
                fmt::format("{}: added token {} must be an object with a string \"content\", "
                            "found {}", where, id, j.dump()));
  AddedTokenSpec t;
  t.id = id;
  t.content = j["content"].get<std::string>();
  const std::string ctx = fmt::format("{}: added token \"{}\"", where, t.content);
  auto flag = [&](const char* key, bool fallback) {
    return tokenizer_json::flag(j, key, ctx).value_or(fallback);
  };
  t.special = flag("special", false);
  t.lstrip = flag("lstrip", false);
  t.rstrip = flag("rstrip", false);
  t.single_word = flag("single_word", false);
  // transformers' default: special tokens are matched as written, others after normalization.
  t.normalized = flag("normalized", !t.special);
  return t;
}

TokenizerSettings read_tokenizer_settings(const fs::path& dir) {
  TokenizerSettings s;
  const fs::path tc_path = dir / "tokenizer_config.json";
  s.config_path = tc_path.string();
  if (auto tc = read_json_file(tc_path)) {
    KESTREL_CHECK(tc->is_object(), fmt::format("{}: expected a JSON object", s.config_path));
    s.add_bos_token = tokenizer_json::flag(*tc, "add_bos_token", s.config_path);
    s.add_eos_token = tokenizer_json::flag(*tc, "add_eos_token", s.config_path);
    s.add_prefix_space = tokenizer_json::flag(*tc, "add_prefix_space", s.config_path);
    s.bos_token = token_field(*tc, "bos_token", s.config_path);
    s.eos_token = token_field(*tc, "eos_token", s.config_path);
    s.unk_token = token_field(*tc, "unk_token", s.config_path);
    s.pad_token = token_field(*tc, "pad_token", s.config_path);
    auto it = tc->find("added_tokens_decoder");
    if (it != tc->end() && it->is_object()) {
      for (const auto& [key, t] : it->items()) {
        int id;
        try {
          size_t used = 0;
          id = std::stoi(key, &used);
          if (used != key.size() || id < 0) throw std::invalid_argument(key);
        } catch (const std::exception&) {
          throw Error(fmt::format("{}: added_tokens_decoder key \"{}\" is not a token id",
                                  s.config_path, key));
        }
        // Entries without a content string carry nothing Kestrel uses.
        if (!t.is_object() || !t.contains("content") || !t["content"].is_string()) continue;
        s.added_tokens_decoder.push_back(parse_added_token(t, id, s.config_path));
      }
    }
  }
  // The model's stop tokens: generation_config.json first (its list is what generation is
  // meant to stop on), then config.json. Any of them ends generation.
  for (const char* name : {"generation_config.json", "config.json"}) {
    const fs::path path = dir / name;
    if (auto j = read_json_file(path)) {
      KESTREL_CHECK(j->is_object(), fmt::format("{}: expected a JSON object", path.string()));
      append_unique(s.config_eos, id_list_field(*j, "eos_token_id", path.string()));
      if (s.config_bos.empty()) s.config_bos = id_list_field(*j, "bos_token_id", path.string());
    }
  }
  return s;
}

}  // namespace kestrel
