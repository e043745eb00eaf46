// Reading tokenizer.json and vocab.json: the vocabulary and the merges are streamed into
// vectors as the JSON parser meets them, everything else becomes JSON values as usual. The
// tokenizer keeps them in flat tables, so building them as JSON first (a std::map node per
// token, a string per merge) would be work thrown away; docs/tokenizers.md says what it costs.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kestrel {

struct TokenizerFile {
  nlohmann::json root;  // the file, with null where the vocabulary and the merges were
  std::vector<std::pair<std::string, int>> vocab;                  // token -> id, in file order
  std::vector<std::pair<std::string, std::string>> merges;         // in rank order
  bool has_vocab = false, has_merges = false;
};

// Reads `path`. `vocab_at` and `merges_at` are the keys leading to the vocabulary object and
// the merges list from the root ({} for the root itself; merges as "a b" strings or ["a", "b"]
// pairs). Throws kestrel::Error naming the file when it is not valid JSON or its vocabulary
// or merges are malformed.
TokenizerFile read_tokenizer_file(const std::filesystem::path& path,
                                  std::vector<std::string> vocab_at,
                                  std::vector<std::string> merges_at);

// The bytes of a file; throws kestrel::Error naming it when it cannot be read.
std::string read_file_bytes(const std::filesystem::path& path);

}  // namespace kestrel
