// The special-token settings around a tokenizer: tokenizer_config.json (BOS/EOS tokens,
// add_bos_token/add_eos_token, added_tokens_decoder) and the stop and BOS ids of
// generation_config.json and config.json. Read once; raw JSON stops here.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kestrel {

// A token added on top of a tokenizer's vocabulary, with transformers' matching options.
struct AddedTokenSpec {
  int id = -1;
  std::string content;
  bool special = false;      // skipped by decode, never split by the model
  bool lstrip = false;       // the match takes the whitespace on its left
  bool rstrip = false;       // and on its right
  bool single_word = false;  // matches only where no word character touches it
  bool normalized = false;   // matched in the normalized text rather than the raw one
};

struct TokenizerSettings {
  std::string config_path;  // <dir>/tokenizer_config.json, for messages
  std::optional<bool> add_bos_token, add_eos_token, add_prefix_space;
  std::optional<std::string> bos_token, eos_token, unk_token, pad_token;
  std::vector<AddedTokenSpec> added_tokens_decoder;
  std::vector<int> config_eos;  // generation_config.json's eos_token_id, then config.json's
  std::vector<int> config_bos;  // the first of their bos_token_id
};

// Reads the settings files of model directory `dir` (each optional). Throws kestrel::Error
// naming the file for malformed JSON and fields of the wrong type.
TokenizerSettings read_tokenizer_settings(const std::filesystem::path& dir);

// Parses <path> when it exists (nullopt when absent); throws kestrel::Error naming it when it
// does not parse.
std::optional<nlohmann::json> read_json_file(const std::filesystem::path& path);

// One entry of added_tokens_decoder or of tokenizer.json's added_tokens ({"content", "special",
// "lstrip", ...}); `where` names the file for errors.
AddedTokenSpec parse_added_token(const nlohmann::json& j, int id, const std::string& where);

}  // namespace kestrel
