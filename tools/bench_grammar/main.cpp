// kestrel-bench-grammar: the time of one token mask (engine/grammar/token_masker.h) for a JSON
// grammar at typical positions, and per step of a whole generated document, over a real
// vocabulary's token bytes (Tokenizer::token_bytes; e.g. Qwen3's from
// scripts/fetch-test-tokenizers.sh). Each position's mask is also checked against matching
// every token alone, so a fast wrong mask cannot pass for a fast one.
//   kestrel-bench-grammar TOKENIZER_DIR_OR_JSON [REPEATS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "base/error.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_masker.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel::grammar;
namespace fs = std::filesystem;

namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// Whether `mask` is what matching each token's bytes on a copy of the state gives.
bool mask_is_exact(const TokenMasker& m, const GrammarState& st, const std::vector<uint32_t>& mask) {
  for (int id = 0; id < m.vocab_size(); ++id) {
    GrammarState copy = st;
    const bool ok = m.is_eos(id) ? st.is_accepting() : !m.token_bytes(id).empty() && copy.accept_bytes(m.token_bytes(id));
    if (ok != static_cast<bool>((mask[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1)) return false;
  }
  return true;
}

struct Spread {
  double median, p90, max, mean;
};
Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  return {v[v.size() / 2], v[v.size() * 9 / 10], v.back(), sum / static_cast<double>(v.size())};
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kestrel-bench-grammar TOKENIZER_DIR_OR_JSON [REPEATS]\n");
    return 2;
  }
  const int repeats = argc > 2 ? std::max(1, std::atoi(argv[2])) : 20;
  fs::path dir = argv[1];
  if (fs::is_regular_file(dir)) dir = dir.parent_path();
  const auto tok = kestrel::Tokenizer::load(dir.string());
  auto t0 = std::chrono::steady_clock::now();
  TokenMasker masker(tok->all_token_bytes(), tok->eos_ids());
  std::printf("vocabulary %d tokens, trie %zu nodes, built in %.0f ms\n", masker.vocab_size(), masker.trie_nodes(),
              ms_since(t0));

  const std::string schema = R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":150},"tags":{"type":"array","items":{"type":"string"}},"address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["city"]}},"required":["name","age"]})";
  const std::string bounded = R"({"type":"object","properties":{"note":{"type":"string","minLength":1,"maxLength":200}},"required":["note"]})";
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
      // maxLength: each character leads to the next count, a new state every time.
      {"bounded", json_schema_to_gbnf(bounded), "{\"note\": \"some text"},
      {"bounded", json_schema_to_gbnf(bounded), "{\"note\": \"" + std::string(180, 'x')},
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
    const double first = ms_since(a);
    std::vector<double> ms;
    for (int r = 0; r < repeats; ++r) {
      auto x = std::chrono::steady_clock::now();
      masker.allowed_tokens(st, mask.data());
      ms.push_back(ms_since(x));
    }
    if (!mask_is_exact(masker, st, mask)) {
      std::fprintf(stderr, "the mask after '%s' differs from per-token matching\n", c.prefix.c_str());
      return 1;
    }
    size_t allowed = 0;
    for (uint32_t w : mask) allowed += static_cast<size_t>(__builtin_popcount(w));
    std::printf("%-12s after %-55s first %.3f ms, median %.3f ms, %zu allowed\n", c.grammar,
                ("'" + c.prefix + "'").c_str(), first, spread(ms).median, allowed);
  }

  // A whole document as a generation meets it: its tokens one by one, a mask before each, with
  // and without the per-generation cache of masks (a fresh cache per pass, as a generation has).
  const std::string doc =
      "{\"name\": \"Ada Lovelace, née Byron — 数学者 and writer\", \"age\": 36, \"tags\": [\"analytical engine\", "
      "\"notes on the \\\"Sketch\\\"\", \"poetical science\"], \"address\": {\"city\": \"London\", \"zip\": \"12345\"}}";
  const std::string bounded_doc =
      "{\"note\": \"Ada Lovelace wrote the first published program — for Babbage's engine, 数学 — in 1843.\"}";
  for (const auto& [what, text, sch] : {std::tuple{"document", doc, schema}, std::tuple{"bounded document", bounded_doc, bounded}})
  for (const bool cached : {false, true}) {
    const std::vector<int> ids = tok->encode(text, false);
    std::vector<double> ms;
    size_t hits = 0;
    for (int r = 0; r < std::max(1, repeats / 4); ++r) {
      GrammarState st(Grammar::parse(json_schema_to_gbnf(sch)));
      MaskCache cache;
      std::vector<uint32_t> mask(masker.mask_words());
      for (int id : ids) {
        auto x = std::chrono::steady_clock::now();
        if (cached) masker.allowed_tokens(st, mask.data(), cache);
        else masker.allowed_tokens(st, mask.data());
        ms.push_back(ms_since(x));
        if (!((mask[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1) || !masker.accept_token(st, id)) {
          std::fprintf(stderr, "the document's token %d was refused\n", id);
          return 1;
        }
      }
      hits = cache.hits();
    }
    const Spread sp = spread(ms);
    std::printf("%s of %zu tokens, %s: per mask median %.3f ms, p90 %.3f ms, max %.3f ms, mean %.3f ms",
                what, ids.size(), cached ? "with the mask cache" : "no cache", sp.median, sp.p90, sp.max, sp.mean);
    if (cached) std::printf(" (%zu of %zu from the cache)", hits, ids.size());
    std::printf("\n");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kestrel-bench-grammar: %s\n", e.what());
  return 1;
}
