// The BPE tokenizer on small hand-made tokenizer.json files (tests/data/tokenizers/) for what
// the real files of the other tests do not use: SentencePiece-style files (Prepend and Replace
// normalizers, byte_fallback, the unknown token, a Replace/ByteFallback/Fuse/Strip decoder),
// Metaspace, ByteLevel's add_prefix_space, Split's behaviours, added tokens with lstrip,
// rstrip, single_word and normalized, and the settings around them. Every expected id is
// worked out by hand from the fixture's vocabulary and merges, following the rules of Hugging
// Face's tokenizers; the comments show the working.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/base/error.h"
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

std::string load_error(const std::string& name, const json& tokenizer) {
  try {
    load(name, tokenizer);
  } catch (const kestrel::Error& e) {
    return e.what();
  }
  return "(loaded)";
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

}  // namespace
