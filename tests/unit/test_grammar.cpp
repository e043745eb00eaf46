// The GBNF parser, the matcher and the token masks (engine/grammar). The matcher's cases are
// written by hand from the grammars' meaning; the masks are checked against the plainest
// oracle there is: each token's bytes fed through a fresh copy of the state.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/token_masker.h"

using namespace kestrel;
using namespace kestrel::grammar;

namespace {

std::string parse_error(const std::string& text) {
  try {
    Grammar::parse(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool matches(const std::string& gbnf, const std::string& input) {
  GrammarState st(Grammar::parse(gbnf));
  return st.accept_bytes(input) && st.is_accepting();
}

// Whether `input` can be extended to a match (every byte accepted).
bool viable(const std::string& gbnf, const std::string& input) {
  GrammarState st(Grammar::parse(gbnf));
  return st.accept_bytes(input);
}

}  // namespace

TEST(GbnfParse, ErrorsNameLineAndColumn) {
  EXPECT_EQ(parse_error("root ::= [a-z"), "grammar:1:14: expected ']'");
  EXPECT_EQ(parse_error("root ::= \"a\"\nfoo ::= (\"b\" \"c\"\n"), "grammar:3:1: expected ')'");
  EXPECT_EQ(parse_error("root ::= \"abc"), "grammar:1:10: unterminated string");
  EXPECT_EQ(parse_error("root := \"a\""), "grammar:1:6: expected '::='");
  EXPECT_EQ(parse_error("root ::= \"a\" }"), "grammar:1:14: unexpected '}'");
  EXPECT_EQ(parse_error("root ::= \"\\q\""), "grammar:1:11: unknown escape '\\q'");
  EXPECT_EQ(parse_error("root ::= \"\\x4\""), "grammar:1:14: expected 2 hex digits in escape");
  EXPECT_EQ(parse_error("root ::= [z-a]"), "grammar:1:10: character range is backwards");
  EXPECT_EQ(parse_error("root ::= \"a\"{3,2}"), "grammar:1:13: repetition {m,n} with n < m");
  EXPECT_EQ(parse_error("root ::= * \"a\""), "grammar:1:10: '*' repeats nothing");
  EXPECT_EQ(parse_error("root ::= \"é\" [\xff]"), "grammar:1:15: invalid UTF-8");
}

TEST(GbnfParse, RuleErrorsNameTheRule) {
  EXPECT_EQ(parse_error("root ::= item \"x\"\n\n  item ::= thing"), "grammar:3:12: undefined rule 'thing'");
  EXPECT_EQ(parse_error("foo ::= \"a\""), "grammar: no rule 'root' (the start rule)");
  EXPECT_EQ(parse_error(""), "grammar: no rule 'root' (the start rule)");
  EXPECT_EQ(parse_error("root ::= \"a\"\nroot ::= \"b\""), "grammar:2:1: rule 'root' is defined twice");
  EXPECT_EQ(parse_error("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]"),
            "grammar: rule 'expr' is left-recursive: it can reach itself before matching a character");
  // Through a nullable prefix, and through a repetition of something that matches nothing.
  EXPECT_EQ(parse_error("root ::= a\na ::= b a \"x\" | \"y\"\nb ::= \"\" | \"z\""),
            "grammar: rule 'a' is left-recursive: it can reach itself before matching a character");
  EXPECT_NE(parse_error("root ::= (\"a\"?)*").find("rule 'root' is left-recursive"), std::string::npos);
  EXPECT_EQ(parse_error("root ::= \"a\"{100001}"), "grammar:1:14: repetition count over 100000");
}

TEST(GrammarMatch, LiteralsClassesAndEscapes) {
  const std::string g = R"(root ::= "ab\n\t\\\"\x41\u00e9\U0001F600" [^a-c] [x-z0-2] . "!")";
  EXPECT_TRUE(matches(g, "ab\n\t\\\"Aé😀dy中!"));
  EXPECT_TRUE(matches(g, "ab\n\t\\\"Aé😀z1\n!"));
  EXPECT_FALSE(matches(g, "ab\n\t\\\"Aé😀by中!"));   // b is in [a-c], refused by [^a-c]
  EXPECT_FALSE(matches(g, "ab\n\t\\\"Aé😀d3中!"));   // 3 is not in [x-z0-2]
  EXPECT_FALSE(matches(g, "ab\n\t\\\"Aé😀dy中"));    // incomplete
  EXPECT_TRUE(viable(g, "ab\n\t\\\"Aé😀dy中"));
  EXPECT_FALSE(viable(g, "ab\n\t\\\"Aé😀dy中!x"));  // nothing may follow
}

TEST(GrammarMatch, Repetitions) {
  const std::string g = "root ::= \"a\"{2,4} \"b\"* (\"c\" \"d\")+ \"e\"? [0-9]{3} \"f\"{2,}";
  EXPECT_TRUE(matches(g, "aacd000ff"));
  EXPECT_TRUE(matches(g, "aaaabbbcdcde123fff"));
  EXPECT_FALSE(matches(g, "acd000ff"));       // one a
  EXPECT_FALSE(matches(g, "aaaaacd000ff"));   // five a
  EXPECT_FALSE(matches(g, "aa000ff"));        // no cd
  EXPECT_FALSE(matches(g, "aacdee000ff"));    // two e
  EXPECT_FALSE(matches(g, "aacd00ff"));       // two digits
  EXPECT_FALSE(matches(g, "aacd000f"));       // one f
  EXPECT_FALSE(matches(g, "aacd000c"));
}

TEST(GrammarMatch, RulesRecursionCommentsAndLines) {
  const std::string g = R"(# balanced brackets and a list
root ::= list
list ::= "[" ws ( item ( "," ws item )* )? "]"   # a comment
item ::= list
       | [0-9]+ ws
ws ::= " "?
)";
  EXPECT_TRUE(matches(g, "[]"));
  EXPECT_TRUE(matches(g, "[1, [2,[]], 33 ]"));
  EXPECT_FALSE(matches(g, "[1,]"));
  EXPECT_FALSE(matches(g, "[1  ]"));
  EXPECT_FALSE(matches(g, "[[]"));
}

TEST(GrammarMatch, Utf8IsStrictAndPartialCodePointsAreChecked) {
  const std::string g = "root ::= [a-zé] [\\u4e00-\\u9fff]*";
  GrammarState st(Grammar::parse(g));
  EXPECT_FALSE(st.accept_byte(0x80));  // a continuation byte first
  EXPECT_FALSE(st.accept_byte(0xC0));  // an overlong lead
  EXPECT_TRUE(st.accept_byte(0xC3));   // é = C3 A9
  EXPECT_FALSE(st.is_accepting());
  EXPECT_FALSE(st.accept_byte(0xA8));  // è is not in the class
  EXPECT_TRUE(st.accept_byte(0xA9));
  EXPECT_TRUE(st.is_accepting());
  EXPECT_FALSE(st.accept_byte(0xC3));  // no two-byte code point can follow
  EXPECT_TRUE(st.accept_byte(0xE4));   // 中 = E4 B8 AD
  EXPECT_FALSE(st.accept_byte(0xA0));  // E4 A0 .. is U+4800.., below the class
  EXPECT_TRUE(st.accept_byte(0xB8));
  EXPECT_TRUE(st.accept_byte(0xAD));
  EXPECT_TRUE(st.is_accepting());
  GrammarState any(Grammar::parse("root ::= .*"));
  EXPECT_FALSE(any.accept_bytes("\xED\xA0\x80"));  // a surrogate
  EXPECT_FALSE(any.accept_bytes("\xF4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_TRUE(any.accept_bytes("\xF4\x8F\xBF\xBF"));
}

TEST(GrammarMatch, AmbiguityIsCappedWithAnError) {
  // Each "a" doubles the ways to parse unless equal stacks merge; merging keeps this small.
  GrammarState st(Grammar::parse("root ::= (\"a\" | \"a\" | [a-b])*"));
  EXPECT_TRUE(st.accept_bytes(std::string(200, 'a')));
  EXPECT_LE(st.stacks().count, 8u);
  // Genuinely many live parses: x{0,n} nested in x{0,n} keeps every split of the a's alive.
  GrammarState wide(Grammar::parse("root ::= ((\"a\"{0,80}) \"b\"?){0,80} \"c\""));
  EXPECT_THROW(
      {
        for (int i = 0; i < 200; ++i) wide.accept_byte('a');
      },
      Error);
}

namespace {

// The oracle: a token is allowed when a fresh copy of the state takes all its bytes.
std::vector<uint32_t> brute_force_mask(const TokenMasker& m, const GrammarState& st) {
  std::vector<uint32_t> mask(m.mask_words(), 0);
  for (int id = 0; id < m.vocab_size(); ++id) {
    bool ok;
    if (m.is_eos(id)) {
      ok = st.is_accepting();
    } else {
      GrammarState copy = st;
      ok = !m.token_bytes(id).empty() && copy.accept_bytes(m.token_bytes(id));
    }
    if (ok) mask[id >> 5] |= 1u << (id & 31);
  }
  return mask;
}

// Random byte strings over pieces a grammar below uses, split anywhere (so that tokens end
// and start inside multi-byte characters, as byte-level BPE tokens do).
std::vector<std::string> random_vocab(std::mt19937& rng, int n) {
  const std::vector<std::string> pieces = {"a", "b", "c", "{", "}", "\"", ":", ",", " ", "\n", "1", "2",
                                           "é", "中", "😀", "\\", "x", "true", "null", "[", "]"};
  std::string text;
  for (int i = 0; i < 20000; ++i) text += pieces[rng() % pieces.size()];
  std::vector<std::string> vocab = {""};  // id 0: a control token, never allowed
  for (int b = 0; b < 256; ++b) vocab.push_back(std::string(1, static_cast<char>(b)));
  while (static_cast<int>(vocab.size()) < n) {
    size_t at = rng() % (text.size() - 16);
    vocab.push_back(text.substr(at, 1 + rng() % 12));
  }
  return vocab;
}

std::string random_grammar(std::mt19937& rng) {
  const std::vector<std::string> atoms = {"\"a\"", "\"b\"", "\"ab\"", "[a-c]", "[^a]", "\"é\"", "[\\u4e00-\\u9fff]",
                                          ".", "\"\\\"\"", "\" \"", "\"{\"", "\"}\"", "[0-9]"};
  const int rules = 1 + static_cast<int>(rng() % 4);
  std::string g;
  for (int r = 0; r < rules; ++r) {
    g += (r == 0 ? std::string("root") : "r" + std::to_string(r)) + " ::= ";
    const int alts = 1 + static_cast<int>(rng() % 3);
    for (int a = 0; a < alts; ++a) {
      if (a) g += " | ";
      const int len = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < len; ++e) {
        // References only to later rules: no left recursion by construction.
        std::string atom = (r + 1 < rules && rng() % 3 == 0)
                               ? "r" + std::to_string(r + 1 + static_cast<int>(rng() % (rules - r - 1)))
                               : atoms[rng() % atoms.size()];
        const char* ops[] = {"", "", "*", "+", "?", "{2}", "{1,3}", "{2,}"};
        g += "(" + atom + ")" + ops[rng() % 8] + " ";
      }
    }
    g += "\n";
  }
  return g;
}

// Also through a mask cache small enough to evict (shared by the walks of a test, so that
// states of different grammars and walks meet in it).
void expect_masks_match(const TokenMasker& m, GrammarState st, std::mt19937& rng, int steps,
                        MaskCache* cache = nullptr) {
  std::vector<uint32_t> cached(m.mask_words());
  for (int step = 0; step < steps; ++step) {
    const auto got = m.allowed_tokens(st);
    const auto want = brute_force_mask(m, st);
    ASSERT_EQ(got, want) << "step " << step;
    if (cache) {
      m.allowed_tokens(st, cached.data(), *cache);
      ASSERT_EQ(cached, want) << "step " << step << " through the cache";
    }
    std::vector<int> allowed;
    for (int id = 0; id < m.vocab_size(); ++id) {
      if (((want[id >> 5] >> (id & 31)) & 1) && !m.is_eos(id)) allowed.push_back(id);
    }
    if (allowed.empty()) return;
    ASSERT_TRUE(m.accept_token(st, allowed[rng() % allowed.size()]));
  }
}

}  // namespace

TEST(TokenMasks, EqualPerTokenMatchingOnRandomGrammars) {
  std::mt19937 rng(7);
  std::vector<std::string> vocab = random_vocab(rng, 3000);
  TokenMasker m(vocab, {1});  // id 1 (byte 0x00) stands for end of sequence
  int compiled = 0;
  MaskCache cache(3);
  for (int trial = 0; trial < 80; ++trial) {
    const std::string g = random_grammar(rng);
    SCOPED_TRACE(g);
    std::shared_ptr<const Grammar> gr;
    try {
      gr = Grammar::parse(g);
    } catch (const Error& e) {
      // A repetition of a rule that can match nothing: refused, as it must be.
      EXPECT_NE(std::string(e.what()).find("left-recursive"), std::string::npos) << e.what();
      continue;
    }
    ++compiled;
    expect_masks_match(m, GrammarState(gr), rng, 8, &cache);
  }
  EXPECT_GE(compiled, 50);
  EXPECT_GT(cache.hits(), 20u);
}

TEST(TokenMasks, EqualPerTokenMatchingInsideJsonStrings) {
  // Strings are where whole subtrees are allowed at once (the loop test): many tokens of
  // plain text, some with quotes, backslashes and split characters.
  std::mt19937 rng(11);
  std::vector<std::string> vocab = random_vocab(rng, 6000);
  TokenMasker m(vocab, {1});
  auto g = Grammar::parse(R"(root ::= "{" ws "\"" char* "\"" ws ":" ws "[" ws ("\"" char* "\"" ws)? "]" ws "}"
char ::= [^"\\\x00-\x1F] | "\\" (["\\nt] | "u" [0-9a-f]{4})
ws ::= " "{0,3})");
  MaskCache cache(4);
  for (int trial = 0; trial < 20; ++trial) expect_masks_match(m, GrammarState(g), rng, 12, &cache);
  EXPECT_GT(cache.hits(), 20u);
  // Bounded strings (maxLength, minLength): every character leads to a new state, the next
  // count, so whole subtrees are allowed by following the chain of counts (kChainMax deep),
  // and near the bound only the tokens short enough may be.
  for (const char* bounded : {R"(root ::= "\"" [^"\\]{0,9} "\"" [ ]?)",
                              R"(root ::= "{" "\"" ([^"\\] | "\\" ["\\nt]){2,40} "\"" ":" [0-9]{1,3} "}")",
                              R"(root ::= ([a-c] | "é" | [\u4e00-\u9fff]){3,50} "\"" [ ]{0,20} "x")"}) {
    SCOPED_TRACE(bounded);
    auto gb = Grammar::parse(bounded);
    for (int trial = 0; trial < 12; ++trial) expect_masks_match(m, GrammarState(gb), rng, 40, &cache);
  }
  // The end-of-sequence id only at a complete match.
  GrammarState st(g);
  EXPECT_FALSE((m.allowed_tokens(st)[0] >> 1) & 1);
  ASSERT_TRUE(st.accept_bytes("{\"k\":[]}"));
  EXPECT_TRUE((m.allowed_tokens(st)[0] >> 1) & 1);
  EXPECT_TRUE(m.accept_token(st, 1));
}
