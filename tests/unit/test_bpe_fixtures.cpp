// The BPE tokenizer on small hand-made tokenizer.json files (tests/data/tokenizers/) for what
// the real files of the other tests do not use: SentencePiece-style files (Prepend and Replace
// normalizers, byte_fallback, the unknown token, a Replace/ByteFallback/Fuse/Strip decoder),
// Metaspace, ByteLevel's add_prefix_space, Split's behaviours, added tokens with lstrip,
// rstrip, single_word and normalized, and the settings around them.
//
// Two kinds of expectation:
// - @lenml/tokenizers' (transformers.js's tokenizers) ids and decodings of the fixtures,
//   patched as tests/data/tokenizers/fixture_cases.json says, over its texts: computed by
//   scripts/tokenizer-reference.js when scripts/fetch-test-tokenizers.sh runs (as for
//   test_hf_tokenizers, whose folder this reads too).
// - Ids worked out by hand from the fixture's vocabulary and merges, following the rules of
//   Hugging Face's tokenizers (the comments show the working). They stay for what
//   transformers.js does not do as tokenizers does, which fixture_cases.json lists
//   (single_word, normalized added tokens, Metaspace's prepend_scheme without
//   add_prefix_space, Split behaviours other than Isolated), and for the streaming decoder,
//   the special-token settings and the errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;
using kestrel::StreamDecoder;
using kestrel::Tokenizer;
using Ids = std::vector<int>;

namespace {

const fs::path kFixtures = KESTREL_TOKENIZER_FIXTURES;

// The SentencePiece-style fixture's ids: <unk> <s> </s>, <0x00>..<0xFF> at 3 + byte, then
const int kSpace = 259, kH = 260, kE = 261, kL = 262, kO = 263, kD = 266;  // ▁ h e l o d
const int kSpH = 267, kLL = 268, kELL = 269, kSpHello = 271, kSpWor = 274, kSpWorld = 276;
const int kMask = 277, kSep = 278, kOr = 279, kHi = 280;  // added tokens
int byte(int b) { return 3 + b; }

json read(const std::string& fixture) {
  return json::parse(std::ifstream(kFixtures / fixture / "tokenizer.json"));
}

// A model directory holding `tokenizer` as tokenizer.json and the given other files.
fs::path write_dir(const std::string& name, const json& tokenizer,
                   const std::vector<std::pair<std::string, std::string>>& files = {}) {
  const fs::path dir = fs::temp_directory_path() /
                       ("kestrel-bpe-" + std::to_string(getpid())) / name;
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << tokenizer.dump();
  for (const auto& [file, text] : files) std::ofstream(dir / file) << text;
  return dir;
}

using Files = std::vector<std::pair<std::string, std::string>>;

std::unique_ptr<Tokenizer> load(const std::string& name, const json& tokenizer,
                                const Files& files = {}) {
  return Tokenizer::load(write_dir(name, tokenizer, files).string());
}

std::string stream(const Tokenizer& tok, const Ids& ids, bool at_start) {
  StreamDecoder dec(tok, at_start);
  std::string out;
  for (int id : ids) out += dec.push(id);
  return out + dec.flush();
}

// The message of the kestrel::Error that loading gives ("(loaded)" when it loads).
std::string load_error(const std::string& name, const json& tokenizer, const Files& files = {}) {
  try {
    load(name, tokenizer, files);
  } catch (const kestrel::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not a kestrel::Error) ") + e.what();
  }
  return "(loaded)";
}

// A one-line kestrel::Error naming `file` and containing `field`.
void expect_named(const std::string& msg, const std::string& file, const std::string& field) {
  EXPECT_NE(msg.find(file), std::string::npos) << msg;
  EXPECT_NE(msg.find(field), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_EQ(msg.find("json.exception"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("(not a kestrel::Error)"), std::string::npos) << msg;
}

// The folder of scripts/fetch-test-tokenizers.sh (KESTREL_TEST_TOKENIZERS in the environment,
// else the build's test-tokenizers/).
fs::path test_tokenizers() {
  const char* env = std::getenv("KESTREL_TEST_TOKENIZERS");
  return env && *env ? fs::path(env) : fs::path(KESTREL_TEST_TOKENIZERS);
}

class BpeFixtures : public ::testing::Test {
 protected:
  static void TearDownTestSuite() {
    fs::remove_all(fs::temp_directory_path() / ("kestrel-bpe-" + std::to_string(getpid())));
  }
};

// Normalizer Prepend("▁") + Replace(" " -> "▁"), no pre-tokenizer: the whole text is one word.
TEST_F(BpeFixtures, SentencePieceStyleMerges) {
  const auto tok = load("sp", read("sentencepiece_style"));
  // "▁hello▁world": ▁+h (rank 0), l+l (1), e+ll (2), ▁h+ell (3), ▁hell+o (4), o+r (5),
  // w+or (6), ▁+wor (7), ▁wor+l (8), ▁worl+d (9).
  EXPECT_EQ(tok->encode("hello world", false), (Ids{kSpHello, kSpWorld}));
  // The post-processor's template puts <s> first.
  EXPECT_EQ(tok->encode("hello world"), (Ids{1, kSpHello, kSpWorld}));
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->bos_id(), 1);
  // "▁▁hello": ▁ stays alone, the rest merges as above.
  EXPECT_EQ(tok->encode(" hello", false), (Ids{kSpace, kSpHello}));
  // "▁word": o+r, w+or, ▁+wor; ▁wor+d is no merge.
  EXPECT_EQ(tok->encode("word", false), (Ids{kSpWor, kD}));
  EXPECT_EQ(tok->encode("", false), Ids{});
}

TEST_F(BpeFixtures, ByteFallbackAndUnknown) {
  json j = read("sentencepiece_style");
  auto tok = load("sp", j);
  // é is not in the vocabulary: its bytes C3 A9 as <0xC3> <0xA9>.
  EXPECT_EQ(tok->encode("héllo", false), (Ids{kSpH, byte(0xC3), byte(0xA9), kLL, kO}));
  // "▁ohi": i has only its byte; no merge applies.
  EXPECT_EQ(tok->encode("ohi", false), (Ids{kSpace, kO, kH, byte('i')}));

  j["model"]["byte_fallback"] = false;  // unknown characters become <unk>, runs fused
  tok = load("unk-fused", j);
  EXPECT_EQ(tok->encode("hé€llo", false), (Ids{kSpH, 0, kLL, kO}));
  EXPECT_TRUE(tok->is_unknown(0));
  j["model"]["fuse_unk"] = false;
  tok = load("unk", j);
  EXPECT_EQ(tok->encode("hé€llo", false), (Ids{kSpH, 0, 0, kLL, kO}));
  j["model"]["unk_token"] = nullptr;  // and without an unknown token they are dropped
  tok = load("no-unk", j);
  EXPECT_EQ(tok->encode("hé€llo", false), (Ids{kSpH, kLL, kO}));
}

// Decoder Replace("▁" -> " "), ByteFallback, Fuse, Strip(" ", 1, 0).
TEST_F(BpeFixtures, SentencePieceStyleDecoding) {
  const auto tok = load("sp", read("sentencepiece_style"));
  EXPECT_EQ(tok->decode({1, kSpHello, kSpWorld, 2}), "hello world");
  EXPECT_EQ(stream(*tok, {1, kSpHello, kSpWorld, 2}, true), "hello world");
  // Continuing a text: the Strip of its start does not apply.
  EXPECT_EQ(stream(*tok, {kSpHello, kSpWorld}, false), " hello world");
  EXPECT_EQ(tok->decode({kSpH, byte(0xC3), byte(0xA9), kLL, kO}), "héllo");
  // A first token that decodes to nothing leaves the Strip for the next.
  EXPECT_EQ(tok->decode({1, kSpace, kSpHello}), " hello");
  EXPECT_EQ(tok->decode({byte(0x41)}), "A");
  EXPECT_EQ(tok->decode({byte(0xC3)}), "\xEF\xBF\xBD");
  EXPECT_TRUE(tok->is_byte(byte(0xC3)));
  EXPECT_FALSE(tok->is_byte(kH));
  EXPECT_TRUE(tok->is_control(1));
  EXPECT_EQ(tok->piece(kSpHello), "\xE2\x96\x81hello");
  // The bytes of é arrive in two tokens: nothing until the second.
  StreamDecoder dec(*tok, true);
  EXPECT_EQ(dec.push(kSpH), "h");
  EXPECT_EQ(dec.push(byte(0xC3)), "");
  EXPECT_EQ(dec.push(byte(0xA9)), "é");
}

TEST_F(BpeFixtures, AddedTokensLstripRstripSingleWordNormalized) {
  const auto tok = load("sp", read("sentencepiece_style"));
  // <mask> (lstrip) takes the space before it: "hello" then <mask>.
  EXPECT_EQ(tok->encode("hello <mask>", false), (Ids{kSpHello, kMask}));
  // [SEP] (rstrip) takes the spaces after it: "hello" alone is "▁hello".
  EXPECT_EQ(tok->encode("[SEP]  hello", false), (Ids{kSep, kSpHello}));
  // "or" (single_word) matches a word of its own; then " hello" is "▁▁hello".
  EXPECT_EQ(tok->encode("or hello", false), (Ids{kOr, kSpace, kSpHello}));
  // ... and not inside "word" or "world".
  EXPECT_EQ(tok->encode("word", false), (Ids{kSpWor, kD}));
  EXPECT_EQ(tok->encode("hello world", false), (Ids{kSpHello, kSpWorld}));
  // "hi" (normalized) is matched in the normalized text as its normalized form "▁hi".
  EXPECT_EQ(tok->encode("hi", false), (Ids{kHi}));
  EXPECT_EQ(tok->encode("hid", false), (Ids{kHi, kD}));
  EXPECT_EQ(tok->encode("ohi", false), (Ids{kSpace, kO, kH, byte('i')}));
  // Special added tokens decode to nothing; the others as their text.
  EXPECT_EQ(tok->decode({kSpHello, kMask}), "hello");
  EXPECT_EQ(tok->decode({kOr, kSpace, kSpHello}), "or  hello");
  EXPECT_TRUE(tok->is_control(kMask));
  EXPECT_FALSE(tok->is_control(kOr));
  EXPECT_EQ(tok->piece_to_id("<mask>"), kMask);
}

// Metaspace pre-tokenizer and decoder, prepend_scheme "first".
TEST_F(BpeFixtures, Metaspace) {
  json j = read("metaspace");
  auto tok = load("ms", j);
  // "▁hello▁world" split before each ▁.
  EXPECT_EQ(tok->encode("hello world", false), (Ids{kSpHello, kSpWorld}));
  // After an added token the text no longer starts the input: no ▁ is prepended, and
  // "hello" merges l+l, e+ll only.
  EXPECT_EQ(tok->encode("<s>hello", false), (Ids{1, kH, kELL, kO}));
  // "▁▁hello": the first ▁ alone.
  EXPECT_EQ(tok->encode("  hello", false), (Ids{kSpace, kSpHello}));
  EXPECT_EQ(tok->decode({kSpHello, kSpWorld}), "hello world");
  EXPECT_EQ(stream(*tok, {kSpHello, kSpWorld}, false), " hello world");
  // The first token loses its ▁ (all of them), the others do not.
  EXPECT_EQ(tok->decode({kSpace, kSpHello}), " hello");
  EXPECT_EQ(tok->decode({1, kSpHello}), "hello");

  j["pre_tokenizer"]["prepend_scheme"] = "always";
  tok = load("ms-always", j);
  EXPECT_EQ(tok->encode("<s>hello", false), (Ids{1, kSpHello}));
  // Files from before prepend_scheme: add_prefix_space.
  j["pre_tokenizer"].erase("prepend_scheme");
  j["pre_tokenizer"]["add_prefix_space"] = false;
  tok = load("ms-legacy", j);
  EXPECT_EQ(tok->encode("hello", false), (Ids{kH, kELL, kO}));
}

// ByteLevel with add_prefix_space and GPT-2's regex: ids 0-255 are the bytes, Ġh 256, Ġhi 257,
// <|end|> 258.
TEST_F(BpeFixtures, ByteLevelPrefixSpace) {
  json j = read("byte_level");
  auto tok = load("bl", j);
  // " hi hi": " hi" twice, each Ġ+h then Ġh+i.
  EXPECT_EQ(tok->encode("hi hi", false), (Ids{257, 257}));
  EXPECT_EQ(tok->encode("hi hi"), (Ids{257, 257}));  // the ByteLevel post-processor adds nothing
  // Each piece between added tokens gets its space.
  EXPECT_EQ(tok->encode("hi<|end|>hi", false), (Ids{257, 258, 257}));
  EXPECT_EQ(tok->decode({257, 257}), " hi hi");
  // Invalid UTF-8 is read as U+FFFD (EF BF BD), which GPT-2's regex keeps apart from letters.
  EXPECT_EQ(tok->encode("a\xFF" "b", false), (Ids{32, 'a', 0xEF, 0xBF, 0xBD, 'b'}));
  j["pre_tokenizer"]["add_prefix_space"] = false;
  tok = load("bl-noprefix", j);
  EXPECT_EQ(tok->encode("hi hi", false), (Ids{'h', 'i', 257}));
}

TEST_F(BpeFixtures, SplitBehaviours) {
  json j = read("byte_level");
  auto with = [&](const std::string& name, const std::string& behavior, bool invert) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"String", " "}}},
                             {"behavior", behavior}, {"invert", invert}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false},
                             {"use_regex", false}}}}};
    return load(name, j);
  };
  EXPECT_EQ(with("isolated", "Isolated", false)->encode("hi hi", false),
            (Ids{'h', 'i', ' ', 'h', 'i'}));
  EXPECT_EQ(with("removed", "Removed", false)->encode("hi hi", false), (Ids{'h', 'i', 'h', 'i'}));
  // The space joins the word after it: " hi" is Ġhi.
  EXPECT_EQ(with("next", "MergedWithNext", false)->encode("hi hi", false), (Ids{'h', 'i', 257}));
  EXPECT_EQ(with("next2", "MergedWithNext", false)->encode("hi  hi", false),
            (Ids{'h', 'i', ' ', 257}));
  EXPECT_EQ(with("previous", "MergedWithPrevious", false)->encode("hi hi", false),
            (Ids{'h', 'i', ' ', 'h', 'i'}));
  // Inverted, the words are the delimiters and Removed drops them.
  EXPECT_EQ(with("inverted", "Removed", true)->encode("hi hi", false), (Ids{' '}));
}

TEST_F(BpeFixtures, SpecialTokenSettings) {
  const json j = read("sentencepiece_style");
  // add_bos_token / add_eos_token decide over the post-processor, as in transformers' Llama
  // tokenizer.
  auto tok = load("no-bos", j, {{"tokenizer_config.json", R"({"add_bos_token": false})"}});
  EXPECT_EQ(tok->encode("hello world"), (Ids{kSpHello, kSpWorld}));
  EXPECT_FALSE(tok->add_bos());
  EXPECT_EQ(tok->bos_id(), 1);
  tok = load("eos", j, {{"tokenizer_config.json",
                         R"({"add_eos_token": true, "eos_token": "</s>", "bos_token": "<s>"})"},
                        {"generation_config.json", R"({"eos_token_id": [2, 7]})"}});
  EXPECT_EQ(tok->encode("hello world"), (Ids{1, kSpHello, kSpWorld, 2}));
  EXPECT_EQ(tok->eos_ids(), (Ids{2, 7}));
  try {
    load("bad-eos", j, {{"tokenizer_config.json", R"({"eos_token": "<|nope|>"})"}});
    FAIL() << "unknown eos_token accepted";
  } catch (const kestrel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("<|nope|>"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
  }
}

// Kinds Kestrel does not read are refused with one line naming the file and the kind.
TEST_F(BpeFixtures, UnsupportedKindsAreNamed) {
  const json base = read("sentencepiece_style");
  struct Case {
    std::string field;
    json value;
    std::string kind;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "Lowercase"}}, "normalizer Lowercase"},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "BertNormalizer"}}}}},
       "normalizer BertNormalizer"},
      {"pre_tokenizer", {{"type", "Whitespace"}}, "pre_tokenizer Whitespace"},
      {"decoder", {{"type", "WordPiece"}}, "decoder WordPiece"},
      {"post_processor", {{"type", "Mystery"}}, "post_processor Mystery"},
  };
  int n = 0;
  for (const Case& c : cases) {
    json j = base;
    j[c.field] = c.value;
    const std::string name = "unsupported-" + std::to_string(n++);
    const std::string msg = load_error(name, j);
    EXPECT_NE(msg.find(c.kind), std::string::npos) << msg;
    EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  json j = base;
  j["model"]["type"] = "Unigram";
  EXPECT_NE(load_error("unigram", j).find("model Unigram is not supported"), std::string::npos);
  j = base;
  j["model"]["merges"].push_back("h zz");
  EXPECT_NE(load_error("bad-merge", j).find("\"zz\" is not in the vocabulary"), std::string::npos);
  const fs::path dir = write_dir("malformed", base);
  std::ofstream(dir / "tokenizer.json") << "{\"model\": {\"vocab\": {\"a\": 0,";
  try {
    Tokenizer::load(dir.string());
    FAIL() << "malformed tokenizer.json accepted";
  } catch (const kestrel::Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "tokenizer.json").string()), std::string::npos);
  }
}


// The fixtures, patched as fixture_cases.json says, give @lenml/tokenizers' ids (without and
// with the specials the tokenizer adds) and decodings for every text; so does the streaming
// decoder.
TEST_F(BpeFixtures, CasesEqualTheIndependentImplementation) {
  const json spec = json::parse(std::ifstream(kFixtures / "fixture_cases.json"));
  const fs::path path = test_tokenizers() / "reference" / "fixtures.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path.string() << " is missing: run scripts/fetch-test-tokenizers.sh "
                  << test_tokenizers().string() << " (scripts/test.sh does)";
  const json ref = json::parse(in);
  const std::string stale = "stale: run scripts/fetch-test-tokenizers.sh again";
  ASSERT_EQ(ref["cases"].size(), spec["cases"].size()) << stale;
  size_t compared = 0;
  for (size_t c = 0; c < spec["cases"].size(); ++c) {
    const json& sc = spec["cases"][c];
    const json& rc = ref["cases"][c];
    const std::string name = sc["name"].get<std::string>();
    ASSERT_EQ(rc["name"].get<std::string>(), name) << stale;
    ASSERT_EQ(rc["results"].size(), spec["texts"].size()) << stale;
    json j = read(sc["fixture"].get<std::string>());
    j.merge_patch(sc["patch"]);
    const auto tok = load("case-" + std::to_string(c), j);
    for (size_t t = 0; t < rc["results"].size(); ++t) {
      const json& r = rc["results"][t];
      const std::string text = spec["texts"][t].get<std::string>();
      ASSERT_EQ(r["text"].get<std::string>(), text) << stale;
      const Ids ids = r["ids"].get<Ids>();
      const std::string decoded = r["decoded"].get<std::string>();
      EXPECT_EQ(tok->encode(text, false), ids) << name << ": " << json(text).dump();
      EXPECT_EQ(tok->encode(text, true), r["ids_special"].get<Ids>())
          << name << ": " << json(text).dump();
      EXPECT_EQ(tok->decode(ids), decoded) << name << ": " << json(text).dump();
      EXPECT_EQ(stream(*tok, ids, true), decoded) << name << ": " << json(text).dump();
      ++compared;
    }
  }
  EXPECT_GE(compared, 400u);
}

// Fields of the wrong type: one line naming the file and the field, never nlohmann's message.
TEST_F(BpeFixtures, MalformedValuesAreNamed) {
  const json base = read("sentencepiece_style");
  const json tp = base["post_processor"];
  struct Case {
    json::json_pointer at;
    json value;
    std::string field;
  };
  const std::vector<Case> cases = {
      {json::json_pointer("/post_processor"), 5, "post_processor"},
      {json::json_pointer("/post_processor"), "TemplateProcessing", "post_processor"},
      {json::json_pointer("/post_processor/single/0/SpecialToken/id"), 7, "SpecialToken"},
      {json::json_pointer("/post_processor/single/0"), "<s>", "SpecialToken"},
      {json::json_pointer("/post_processor/special_tokens/<s>/ids"), json::array({"1"}),
       "special_tokens[\"<s>\"].ids"},
      {json::json_pointer("/post_processor/special_tokens/<s>/ids"), json::array({-1}),
       "special_tokens[\"<s>\"].ids"},
      {json::json_pointer("/post_processor/special_tokens"), json::array(), "special_tokens"},
      {json::json_pointer("/post_processor"),
       {{"type", "RobertaProcessing"}, {"cls", {"<s>", "1"}}, {"sep", {"</s>", 2}}}, "cls[1]"},
      {json::json_pointer("/post_processor"),
       {{"type", "BertProcessing"}, {"cls", {"<s>", 1}}, {"sep", {"</s>", 2.5}}}, "sep[1]"},
      {json::json_pointer("/pre_tokenizer"),
       {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", 3}}, "behavior"},
      {json::json_pointer("/pre_tokenizer"), {{"type", "Metaspace"}, {"replacement", 7}},
       "replacement"},
      {json::json_pointer("/pre_tokenizer"), {{"type", "Metaspace"}, {"prepend_scheme", true}},
       "prepend_scheme"},
      {json::json_pointer("/pre_tokenizer"), {{"type", "ByteLevel"}, {"add_prefix_space", "no"}},
       "add_prefix_space"},
      {json::json_pointer("/decoder"), {{"type", "Metaspace"}, {"prepend_scheme", 1}},
       "prepend_scheme"},
      {json::json_pointer("/model/type"), 5, "model: type"},
      {json::json_pointer("/model/unk_token"), 5, "unk_token"},
      {json::json_pointer("/model/byte_fallback"), "yes", "byte_fallback"},
      {json::json_pointer("/added_tokens/0/id"), "0", "added token id"},
      {json::json_pointer("/added_tokens/3/lstrip"), 1, "lstrip"},
  };
  int n = 0;
  for (const Case& c : cases) {
    json j = base;
    j[c.at] = c.value;
    SCOPED_TRACE(c.at.to_string() + " = " + c.value.dump());
    expect_named(load_error("malformed-value-" + std::to_string(n++), j), "tokenizer.json",
                 c.field);
  }
  expect_named(load_error("malformed-config", base,
                          {{"tokenizer_config.json", R"({"add_bos_token": "yes"})"}}),
               "tokenizer_config.json", "add_bos_token");
}

// A null or a boolean where the streamed reader expects a token id or a merge.
TEST_F(BpeFixtures, NullOrBooleanInVocabularyOrMergesIsRefused) {
  const json base = read("sentencepiece_style");
  const std::vector<std::pair<json::json_pointer, json>> cases = {
      {json::json_pointer("/model/vocab/zz"), nullptr},
      {json::json_pointer("/model/vocab/zz"), true},
      {json::json_pointer("/model/merges/-"), nullptr},
      {json::json_pointer("/model/merges/-"), false},
      {json::json_pointer("/model/merges/-"), json::array({"h", true})},
      {json::json_pointer("/model/merges/-"), json::array({"h", nullptr})},
  };
  int n = 0;
  for (const auto& [at, value] : cases) {
    json j = base;
    j[at] = value;
    SCOPED_TRACE(at.to_string() + " = " + value.dump());
    const std::string msg = load_error("null-in-model-" + std::to_string(n++), j);
    expect_named(msg, "tokenizer.json", value.is_array() ? "merge" : at.back());
  }
  // vocab.json, the root object of token: id.
  const fs::path dir = write_dir("null-vocab-json", json::object());
  fs::remove(dir / "tokenizer.json");
  std::ofstream(dir / "vocab.json") << R"({"a": 0, "b": null, "ab": 1})";
  std::ofstream(dir / "merges.txt") << "#version: 0.2\na b\n";
  try {
    Tokenizer::load(dir.string());
    ADD_FAILURE() << "a null id in vocab.json was accepted";
  } catch (const kestrel::Error& e) {
    expect_named(e.what(), "vocab.json", "\"b\"");
  }
}

// An id far past the number of tokens is refused before tables are sized by it; ids with
// gaps still load.
TEST_F(BpeFixtures, HugeTokenIdsAreRefused) {
  const json base = read("sentencepiece_style");
  json j = base;
  j["model"]["vocab"]["zz"] = 5000000;
  expect_named(load_error("huge-vocab-id", j), "tokenizer.json", "5000000");
  j = base;
  j["added_tokens"].push_back({{"id", 5000000}, {"content", "<big>"}, {"special", true}});
  expect_named(load_error("huge-added-id", j), "tokenizer.json", "<big>");
  expect_named(load_error("huge-config-id", base,
                          {{"tokenizer_config.json",
                            R"({"added_tokens_decoder": {"5000000": {"content": "<big>"}}})"}}),
               "tokenizer_config.json", "5000000");
  j = base;
  j["added_tokens"].push_back({{"id", 40000}, {"content", "<far>"}, {"special", true}});
  const auto tok = load("gap-id", j);
  EXPECT_EQ(tok->vocab_size(), 40001);
  EXPECT_EQ(tok->piece_to_id("<far>"), 40000);
}

// The streaming decoder holds back only a prefix that may still become a character; bytes
// no continuation can make valid come out as U+FFFD at once. Byte-level fixture: id b is
// byte b.
TEST_F(BpeFixtures, StreamingHoldsBackOnlyIncompleteCharacters) {
  const auto tok = load("bl", read("byte_level"));
  const std::string fffd = "\xEF\xBF\xBD";
  StreamDecoder dec(*tok, false);
  EXPECT_EQ(dec.push(0x80), fffd);  // a lone continuation byte
  EXPECT_EQ(dec.push(0xF5), fffd);  // never a lead byte
  EXPECT_EQ(dec.push(0xFF), fffd);
  EXPECT_EQ(dec.push(0xC0), fffd);  // only overlong forms start with it
  EXPECT_EQ(dec.push(0xE2), "");    // may still become €
  EXPECT_EQ(dec.push(0x82), "");
  EXPECT_EQ(dec.push(0xAC), "\xE2\x82\xAC");
  EXPECT_EQ(dec.push(0xE2), "");
  EXPECT_EQ(dec.push(0x41), fffd + "A");  // E2 then A: E2 can no longer complete
  EXPECT_EQ(dec.push(0xF0), "");
  EXPECT_EQ(dec.push(0x9F), "");
  EXPECT_EQ(dec.push(0xF0), fffd);  // F0 9F, then a new lead byte
  EXPECT_EQ(dec.flush(), fffd);
}

using Matches = std::vector<std::pair<size_t, size_t>>;

Matches find_all(const std::string& pattern, const std::string& subject) {
  Matches m;
  kestrel::Regex(pattern, "test").find_all(subject, m);
  return m;
}

// Matches as the onig crate's find_iter reports them, which tokenizers' regex splits and
// replacements use: the first three are the crate's own tests (find.rs). After a non-empty
// match the next empty match is dropped, wherever it is; an empty text has no matches.
TEST_F(BpeFixtures, RegexMatchesAsOniguruma) {
  EXPECT_EQ(find_all(R"(\d+)", "a12b2"), (Matches{{1, 3}, {4, 5}}));
  EXPECT_EQ(find_all(R"(\d*)", "a1bbb2"), (Matches{{0, 0}, {1, 2}, {3, 3}, {4, 4}, {5, 6}}));
  EXPECT_EQ(find_all(R"(\b)", "test string"), (Matches{{0, 0}, {4, 4}, {5, 5}, {11, 11}}));
  // (2,2) is the first empty match after "a": dropped, though it does not touch it.
  EXPECT_EQ(find_all("(?=c)|a", "abc"), (Matches{{0, 1}}));
  EXPECT_EQ(find_all("x*", ""), Matches{});
  EXPECT_EQ(kestrel::Regex("x*", "test").replace_all("axxb", "-"), "-a-b-");
}

// An empty match after a match changes words under Split's merging behaviours. Byte-level
// fixture without its own regex: Ġ+h -> Ġh (256), Ġh+i -> Ġhi (257).
TEST_F(BpeFixtures, SplitSkipsEmptyMatchesAsOniguruma) {
  json j = read("byte_level");
  auto with = [&](const std::string& name, const std::string& regex, const std::string& behavior) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", regex}}},
                             {"behavior", behavior}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false},
                             {"use_regex", false}}}}};
    return load(name, j);
  };
  // " hi": " " matches at 0; the empty (?=h) at 1 right after it is dropped, so the only
  // match " " joins "hi": " hi" is Ġhi. (Were it kept, " " would stay alone: Ġ h i.)
  EXPECT_EQ(with("next-empty", "(?=h)| ", "MergedWithNext")->encode(" hi", false), Ids{257});
  // "a hi": "a" matches; the empty (?=i) at 3 is the next empty match: dropped, so " hi" is
  // one word. (Were it kept, " h" and "i" would be two: Ġh i.)
  EXPECT_EQ(with("isolated-empty", "a|(?=i)", "Isolated")->encode("a hi", false),
            (Ids{'a', 257}));
  // " *" on "hi hi": empty matches at 0 and 1, " " at 2, the empty one at 3 dropped, empty
  // at 4 and 5; merged with the next piece: "h", "i", " h", "i".
  EXPECT_EQ(with("next-spaces", " *", "MergedWithNext")->encode("hi hi", false),
            (Ids{'h', 'i', 256, 'i'}));
}

}  // namespace
