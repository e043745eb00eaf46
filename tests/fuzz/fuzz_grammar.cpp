// Grammars from users (--grammar, --json-schema): the first byte selects what the rest is.
//   0: GBNF text, then (after a 0x00 byte, if any) bytes to match against it;
//   1: a JSON Schema, whose converted GBNF must compile, then a walk along it.
// A bad grammar or schema may only end in kestrel::Error; the matcher may throw only at its
// documented bounds. What compiles is matched byte by byte, and its token masks over a small
// fixed vocabulary must equal matching each token alone (the masker's shortcuts against the
// definition), so that a shortcut that allows a refused token is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/grammar/grammar.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_masker.h"
#include "tests/fuzz/fuzz_util.h"

using namespace kestrel;
using namespace kestrel::grammar;

namespace {

// Tokens as byte-level vocabularies cut text: ASCII runs, JSON punctuation, quotes and
// backslashes inside runs, and multi-byte characters split anywhere.
const TokenMasker& masker() {
  static const TokenMasker m = [] {
    std::vector<std::string> v = {""};  // id 0: a control token
    for (int b = 0; b < 256; ++b) v.push_back(std::string(1, static_cast<char>(b)));
    for (const char* t : {"{\"", "\":", "\",", "\"}", "true", "null", "false", "12", "0.", "e+", " \"",
                          "ab", "abc", "a\"", "\\n", "\\u00", "\xC3\xA9", "\xE4\xB8", "\xAD", "\xF0\x9F\x98",
                          "\x80", "\n ", "  ", "[1", "],", "-1", "é\"", "x\\\""})
      v.push_back(t);
    return TokenMasker(v, {1});  // id 1 (byte 0x00) stands for end of sequence
  }();
  return m;
}

void check_masks(GrammarState st, const std::string& input) {
  const TokenMasker& m = masker();
  MaskCache cache(4);
  std::vector<uint32_t> cached(m.mask_words());
  for (size_t step = 0; step < 6; ++step) {
    const std::vector<uint32_t> mask = m.allowed_tokens(st);
    m.allowed_tokens(st, cached.data(), cache);
    if (cached != mask) {
      std::fprintf(stderr, "the cached mask differs from the mask\n");
      std::abort();
    }
    std::vector<int> allowed;
    for (int id = 0; id < m.vocab_size(); ++id) {
      bool ok;
      if (m.is_eos(id)) {
        ok = st.is_accepting();
      } else {
        GrammarState copy = st;
        ok = !m.token_bytes(id).empty() && copy.accept_bytes(m.token_bytes(id));
      }
      if (ok != static_cast<bool>((mask[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1)) {
        std::fprintf(stderr, "token %d: the mask says %d, matching says %d\n", id, !ok, ok);
        std::abort();
      }
      if (ok && !m.is_eos(id)) allowed.push_back(id);
    }
    if (allowed.empty()) return;
    // The input picks the walk.
    const int id = allowed[step < input.size() ? static_cast<uint8_t>(input[step]) % allowed.size() : 0];
    if (!m.accept_token(st, id)) {
      std::fprintf(stderr, "an allowed token was refused\n");
      std::abort();
    }
  }
}

void run(const std::string& gbnf, const std::string& input, bool from_schema) {
  std::shared_ptr<const Grammar> g;
  try {
    g = Grammar::parse(gbnf);
  } catch (const Error& e) {
    // The converter's output must compile, unless it is past the grammar's size bound.
    if (from_schema && std::string(e.what()).find("more than") == std::string::npos) {
      std::fprintf(stderr, "converted schema does not compile: %s\n%s\n", e.what(), gbnf.c_str());
      std::abort();
    }
    return;
  }
  fuzz::expect_only_kestrel_errors([&] {
    GrammarState st(g);
    for (char c : input)
      if (!st.accept_byte(static_cast<uint8_t>(c))) break;
    (void)st.is_accepting();
    (void)st.is_finished();
    check_masks(GrammarState(g), input);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    const size_t nul = rest.find('\0');
    const std::string text = rest.substr(0, nul);
    const std::string input = nul == std::string::npos ? std::string() : rest.substr(nul + 1);
    run(text, input, false);
  } else {
    std::string gbnf;
    try {
      gbnf = json_schema_to_gbnf(rest);
    } catch (const Error&) {
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "escaped exception (not kestrel::Error): %s\n", e.what());
      std::abort();
    }
    run(gbnf, "", true);
  }
  return 0;
}
