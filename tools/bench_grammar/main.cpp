// kestrel-bench-grammar: the time of one token mask (engine/grammar/token_masker.h) for a JSON
// grammar at typical positions, over a real byte-level BPE vocabulary (a tokenizer.json's
// model.vocab, e.g. Qwen3's from scripts/fetch-test-tokenizers.sh).
//   kestrel-bench-grammar TOKENIZER_JSON [REPEATS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/grammar/grammar.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_masker.h"

using namespace kestrel::grammar;

namespace {

// GPT-2's byte-to-character map, inverted: a byte-level BPE token string to its bytes.
std::string byte_level_bytes(const std::string& tok) {
  static const std::map<uint32_t, uint8_t> inv = [] {
    std::map<uint32_t, uint8_t> m;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool direct = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      m[direct ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++)] = static_cast<uint8_t>(b);
    }
    return m;
  }();
  std::string out;
  for (size_t i = 0; i < tok.size();) {
    unsigned char c = static_cast<unsigned char>(tok[i]);
    uint32_t cp = c;
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : 3;
    if (n == 2) cp = ((c & 0x1F) << 6) | (tok[i + 1] & 0x3F);
    if (n == 3) cp = ((c & 0x0F) << 12) | ((tok[i + 1] & 0x3F) << 6) | (tok[i + 2] & 0x3F);
    auto it = inv.find(cp);
    if (it == inv.end()) return "";
    out += static_cast<char>(it->second);
    i += n;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kestrel-bench-grammar TOKENIZER_JSON [REPEATS]\n");
    return 2;
  }
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 20;
  std::ifstream f(argv[1]);
  nlohmann::json tj = nlohmann::json::parse(f);
  std::vector<std::string> vocab;
  for (const auto& [piece, id] : tj["model"]["vocab"].items()) {
    size_t i = id.get<size_t>();
    if (vocab.size() <= i) vocab.resize(i + 1);
    vocab[i] = byte_level_bytes(piece);
  }
  auto t0 = std::chrono::steady_clock::now();
  TokenMasker masker(vocab, {});
  auto t1 = std::chrono::steady_clock::now();
  std::printf("vocabulary %zu tokens, trie %zu nodes, built in %.0f ms\n", vocab.size(), masker.trie_nodes(),
              std::chrono::duration<double, std::milli>(t1 - t0).count());

  const std::string schema = R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":150},"tags":{"type":"array","items":{"type":"string"}},"address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["city"]}},"required":["name","age"]})";
  struct Case {
    const char* grammar;
    std::string gbnf;
    std::string prefix;
  };
  std::vector<Case> cases = {
      {"json_object", json_object_gbnf(), "{"},
      {"json_object", json_object_gbnf(), "{\"key\": "},
      {"json_object", json_object_gbnf(), "{\"key\": \"some text"},
      {"json_object", json_object_gbnf(), "{\"key\": [1, 2"},
      {"schema", json_schema_to_gbnf(schema), "{\"name\": \"Ada Love"},
      {"schema", json_schema_to_gbnf(schema), "{\"name\": \"Ada\", \"age\": 3"},
      {"schema", json_schema_to_gbnf(schema), "{\"name\": \"Ada\", \"age\": 36, \"tags\": [\"x\", "},
      {"schema", json_schema_to_gbnf(schema), "{\"name\": \"Ada\", \"age\": 36, \"address\": {\"city\": \"Lon"},
  };
  for (const auto& c : cases) {
    GrammarState st(Grammar::parse(c.gbnf));
    if (!st.accept_bytes(c.prefix)) {
      std::fprintf(stderr, "prefix refused: %s\n", c.prefix.c_str());
      return 1;
    }
    std::vector<uint32_t> mask(masker.mask_words());
    // The first call per state includes finding which bytes loop (cached per thread).
    auto a = std::chrono::steady_clock::now();
    masker.allowed_tokens(st, mask.data());
    auto b = std::chrono::steady_clock::now();
    std::vector<double> ms;
    for (int r = 0; r < repeats; ++r) {
      auto x = std::chrono::steady_clock::now();
      masker.allowed_tokens(st, mask.data());
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - x).count());
    }
    std::sort(ms.begin(), ms.end());
    size_t allowed = 0;
    for (uint32_t w : mask) allowed += static_cast<size_t>(__builtin_popcount(w));
    std::printf("%-12s after %-55s first %.3f ms, median %.3f ms, %zu allowed\n", c.grammar,
                ("'" + c.prefix + "'").c_str(), std::chrono::duration<double, std::milli>(b - a).count(),
                ms[ms.size() / 2], allowed);
  }
  return 0;
}
