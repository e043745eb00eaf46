// Tokenizer and StreamDecoder against a small byte-fallback BPE model trained here, with
// SentencePiece's own DecodeIds as the oracle for streaming.
#include <sentencepiece_trainer.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/error.h"
#include "tests/support/fifo.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using kestrel::StreamDecoder;
using kestrel::Tokenizer;

namespace {

const std::string kFFFD = "\xEF\xBF\xBD";

// Strict UTF-8 (RFC 3629): shortest forms only, no surrogates, nothing past U+10FFFF.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) { i += 1; continue; }
    if (c >= 0xC2 && c <= 0xDF) n = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) n = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) n = 4, cp = c & 0x07;
    else return false;
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto t = static_cast<uint8_t>(s[i + k]);
      if ((t & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (t & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return false;
    if (cp >= 0xD800 && cp <= 0xDFFF) return false;
    i += n;
  }
  return true;
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

const std::vector<std::string> kWords = {
    "the", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "are", "with",
    "as", "his", "they", "be", "at", "one", "have", "this", "from", "hello", "world", "model",
    "token", "stream", "quantized", "weights", "inference", "engine", "kestrel", "falcon",
    "river", "mountain", "little", "house", "water", "number", "people", "between", "under",
    "never", "always", "something", "together", "language", "question", "answer", "machine",
    "café", "naïve", "Zürich", "résumé", "façade", "straße", "über", "garçon", "niño",
    "日本語", "東京", "中文", "你好", "世界", "漢字", "😀", "🎉"};

// Texts for round trips and streaming: corpus words, characters the model has only as
// bytes, digits, punctuation, newlines and odd spacing.
std::vector<std::string> sample_texts() {
  std::vector<std::string> texts = {
      "",
      "hello world",
      " hello world",
      "  two leading spaces",
      "trailing space ",
      "a  b   c",
      "line one\nline two\n\ttabbed",
      "café naïve Zürich",
      "日本語の東京",
      "emoji 😀🎉 and a fox 🦊 plus 𝄞",
      "🦊",
      "Ωμέγα ñandú €42 ¿qué?",
      "Привет мир",
      "مرحبا",
      "numbers 1234567890 and 3.14159",
      "x",
      " ",
      "\n",
      "mixed日本語words😀together",
  };
  std::mt19937 rng(1234);
  const std::vector<std::string> extra = {"🦊", "Ω", "€", "ñ", "\n", "  ", "42", "!", "—", "𝄞"};
  for (int t = 0; t < 60; ++t) {
    std::string s;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      if (i > 0 && rng() % 4 != 0) s += ' ';
      s += rng() % 5 == 0 ? extra[rng() % extra.size()] : kWords[rng() % kWords.size()];
    }
    texts.push_back(s);
  }
  return texts;
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string tmpl = (fs::temp_directory_path() / "kestrel-tok-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;

    std::mt19937 rng(42);
    std::string corpus;
    for (int line = 0; line < 3000; ++line) {
      const int n = 3 + static_cast<int>(rng() % 10);
      for (int i = 0; i < n; ++i) {
        // The first 50 words (plain English) are common, the rest rare: the rarest
        // characters fall under the coverage threshold and exist only as bytes.
        const size_t w = rng() % 10 < 8 ? rng() % 50 : rng() % kWords.size();
        corpus += (i ? " " : "") + kWords[w];
      }
      corpus += '\n';
    }
    write_file(root_ / "corpus.txt", corpus);

    // Llama's settings: no normalization, a dummy prefix, whitespace kept as written.
    model_ = train("llama", {});
    // The two other ways SentencePiece decodes the start of a text: extra whitespace
    // removed (and NFKC), and no dummy prefix at all.
    nfkc_model_ = train("nfkc", {{"normalization_rule_name", "nmt_nfkc"},
                                 {"remove_extra_whitespaces", "true"}});
    no_prefix_model_ = train("noprefix", {{"add_dummy_prefix", "false"}});
  }

  static fs::path train(const std::string& name,
                        const std::unordered_map<std::string, std::string>& overrides) {
    std::unordered_map<std::string, std::string> args = {
        {"input", (root_ / "corpus.txt").string()},
        {"model_prefix", (root_ / name).string()},
        {"model_type", "bpe"},
        {"vocab_size", "400"},
        {"byte_fallback", "true"},
        {"character_coverage", "0.999"},
        {"normalization_rule_name", "identity"},
        {"remove_extra_whitespaces", "false"},
        {"add_dummy_prefix", "true"},
        {"split_digits", "true"},
        {"allow_whitespace_only_pieces", "true"},
        {"control_symbols", "<|im_end|>"},
        {"hard_vocab_limit", "false"},
        {"num_threads", "2"},
        {"minloglevel", "2"},
    };
    for (const auto& [k, v] : overrides) args[k] = v;
    const auto status = sentencepiece::SentencePieceTrainer::Train(args);
    EXPECT_TRUE(status.ok()) << name << ": " << status.ToString();
    return root_ / (name + ".model");
  }

  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // A fresh model directory holding tokenizer.model and the given JSON files.
  static fs::path model_dir(const std::string& name,
                            const std::vector<std::pair<std::string, std::string>>& files = {}) {
    const fs::path dir = root_ / name;
    fs::create_directories(dir);
    fs::copy_file(model_, dir / "tokenizer.model", fs::copy_options::overwrite_existing);
    for (const auto& [file, text] : files) write_file(dir / file, text);
    return dir;
  }

  static std::unique_ptr<Tokenizer> plain() {
    return Tokenizer::load(model_dir("plain").string());
  }

  // Streams ids through a StreamDecoder, checking that every chunk is valid UTF-8.
  static std::string stream(const Tokenizer& tok, const std::vector<int>& ids, bool at_start) {
    StreamDecoder dec(tok, at_start);
    std::string out;
    for (int id : ids) {
      const std::string chunk = dec.push(id);
      EXPECT_TRUE(valid_utf8(chunk)) << "chunk of id " << id << " (" << tok.piece(id) << ")";
      out += chunk;
    }
    const std::string tail = dec.flush();
    EXPECT_TRUE(valid_utf8(tail));
    return out + tail;
  }

  static int byte_id(const Tokenizer& tok, int b) {
    char piece[8];
    snprintf(piece, sizeof piece, "<0x%02X>", b);
    return tok.piece_to_id(piece);
  }

  static inline fs::path root_;
  static inline fs::path model_;
  static inline fs::path nfkc_model_;
  static inline fs::path no_prefix_model_;
};

TEST_F(TokenizerTest, ModelHasTheExpectedShape) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  EXPECT_GE(tok.vocab_size(), 300);
  EXPECT_LE(tok.vocab_size(), 600);
  EXPECT_EQ(tok.piece(0), "<unk>");
  EXPECT_EQ(tok.piece(1), "<s>");
  EXPECT_EQ(tok.piece(2), "</s>");
  EXPECT_TRUE(tok.is_unknown(0));
  EXPECT_TRUE(tok.is_control(1));
  EXPECT_TRUE(tok.is_control(2));
  EXPECT_TRUE(tok.is_control(tok.piece_to_id("<|im_end|>")));
  EXPECT_FALSE(tok.is_byte(1));
  for (int b = 0; b < 256; ++b) {
    const int id = byte_id(tok, b);
    ASSERT_GE(id, 0) << b;
    EXPECT_TRUE(tok.is_byte(id));
    EXPECT_FALSE(tok.is_control(id));
  }
  const int the = tok.piece_to_id("\xE2\x96\x81the");
  ASSERT_GE(the, 0);
  EXPECT_FALSE(tok.is_byte(the));
  EXPECT_FALSE(tok.is_control(the));
  EXPECT_EQ(tok.piece_to_id("no-such-piece-here"), -1);
  EXPECT_EQ(tok.piece_to_id("<unk>"), 0);
  EXPECT_EQ(tok.piece(tok.vocab_size()), "");
  EXPECT_EQ(tok.piece(-1), "");
  EXPECT_FALSE(tok.is_control(tok.vocab_size()));
  EXPECT_FALSE(tok.is_byte(-3));
  // The fox is not in the corpus: it must come out as its four UTF-8 bytes.
  const auto ids = tok.encode("🦊", false);
  ASSERT_GE(ids.size(), 4u);
  for (size_t i = ids.size() - 4; i < ids.size(); ++i) EXPECT_TRUE(tok.is_byte(ids[i]));
}

TEST_F(TokenizerTest, EncodeDecodeRoundTrip) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  for (const auto& text : sample_texts()) {
    const auto ids = tok.encode(text, false);
    EXPECT_EQ(tok.decode(ids), text);
    const auto with = tok.encode(text);
    ASSERT_EQ(with.size(), ids.size() + 1);
    EXPECT_EQ(with.front(), 1);
    EXPECT_EQ(std::vector<int>(with.begin() + 1, with.end()), ids);
    EXPECT_EQ(tok.decode(with), text);
  }
}

TEST_F(TokenizerTest, DecodeSkipsIdsOutsideTheVocabulary) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  auto ids = tok.encode("hello world", false);
  const int n = tok.vocab_size();
  std::vector<int> noisy = {-1, n};
  noisy.insert(noisy.end(), ids.begin(), ids.end());
  noisy.push_back(n + 1000);
  EXPECT_EQ(tok.decode(noisy), "hello world");
  StreamDecoder dec(tok, true);
  EXPECT_EQ(dec.push(n), "");
  EXPECT_EQ(dec.push(-7), "");
}

TEST_F(TokenizerTest, DefaultsWithoutConfigs) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  EXPECT_TRUE(tok.add_bos());
  EXPECT_FALSE(tok.add_eos());
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_ids(), std::vector<int>{2});
  EXPECT_TRUE(tok.is_eos(2));
  EXPECT_FALSE(tok.is_eos(1));

  const auto bare_owned = Tokenizer::from_model_file(model_.string());
  const Tokenizer& bare = *bare_owned;
  EXPECT_TRUE(bare.add_bos());
  EXPECT_EQ(bare.bos_id(), 1);
  EXPECT_EQ(bare.eos_ids(), std::vector<int>{2});
}

TEST_F(TokenizerTest, TokenizerConfigSpecialTokens) {
  const fs::path dir = model_dir("tc", {{"tokenizer_config.json", R"({
      "add_bos_token": false, "add_eos_token": true,
      "bos_token": "<s>",
      "eos_token": {"content": "<|im_end|>", "lstrip": false, "__type": "AddedToken"}})"}});
  const auto tok_owned = Tokenizer::load(dir.string());
  const Tokenizer& tok = *tok_owned;
  const int im_end = tok.piece_to_id("<|im_end|>");
  ASSERT_GE(im_end, 3);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_TRUE(tok.add_eos());
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_ids(), std::vector<int>{im_end});

  const auto ids = tok.encode("hello world");
  const auto plain_ids = tok.encode("hello world", false);
  ASSERT_EQ(ids.size(), plain_ids.size() + 1);
  EXPECT_NE(ids.front(), 1);
  EXPECT_EQ(ids.back(), im_end);
  EXPECT_EQ(tok.decode(ids), "hello world");

  const fs::path bad = model_dir("tc-bad-token", {{"tokenizer_config.json",
                                                   R"({"eos_token": "<|eot_id|>"})"}});
  try {
    Tokenizer::load(bad.string());
    FAIL() << "unknown eos_token accepted";
  } catch (const kestrel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("<|eot_id|>"), std::string::npos) << e.what();
  }
}

// A token added on top of the SentencePiece model (ChatML models add <|im_end|> this way) is
// found through added_tokens_decoder.
TEST_F(TokenizerTest, EosFromAddedTokensDecoder) {
  const fs::path dir = model_dir("tc-added", {{"tokenizer_config.json", R"({
      "eos_token": "<|turn_end|>",
      "added_tokens_decoder": {"4000": {"content": "<|turn_end|>", "special": true}}})"}});
  const auto tok_owned = Tokenizer::load(dir.string());
  const Tokenizer& tok = *tok_owned;
  ASSERT_LT(tok.piece_to_id("<|turn_end|>"), 0) << "the test needs a token the model lacks";
  EXPECT_TRUE(tok.is_eos(4000));
  EXPECT_EQ(tok.eos_ids().front(), 4000);
}

TEST_F(TokenizerTest, EosSetIsTheUnionOfConfigs) {
  const fs::path dir = model_dir("gen", {
      {"generation_config.json", R"({"bos_token_id": 1, "eos_token_id": [7, 9, 2]})"},
      {"config.json", R"({"bos_token_id": 1, "eos_token_id": 5, "hidden_size": 64})"},
  });
  const auto tok_owned = Tokenizer::load(dir.string());
  const Tokenizer& tok = *tok_owned;
  EXPECT_EQ(tok.eos_ids(), (std::vector<int>{7, 9, 2, 5}));
  for (int id : {2, 5, 7, 9}) EXPECT_TRUE(tok.is_eos(id)) << id;
  for (int id : {0, 1, 3, 6, 8}) EXPECT_FALSE(tok.is_eos(id)) << id;

  const fs::path one =
      model_dir("gen-int", {{"generation_config.json", R"({"eos_token_id": 11})"}});
  EXPECT_EQ(Tokenizer::load(one.string())->eos_ids(), (std::vector<int>{11, 2}));

  const fs::path wrong = model_dir("gen-bad", {{"config.json", R"({"eos_token_id": "two"})"}});
  try {
    Tokenizer::load(wrong.string());
    FAIL() << "string eos_token_id accepted";
  } catch (const kestrel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
  }
}

TEST_F(TokenizerTest, MalformedJsonNamesTheFile) {
  for (const char* file : {"tokenizer_config.json", "config.json", "generation_config.json"}) {
    const fs::path dir = model_dir(std::string("bad-") + file, {{file, "{\"add_bos_token\": tru"}});
    try {
      Tokenizer::load(dir.string());
      FAIL() << file << " accepted";
    } catch (const kestrel::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find((dir / file).string()), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

TEST_F(TokenizerTest, MissingModelIsAnError) {
  const fs::path dir = root_ / "empty";
  fs::create_directories(dir);
  try {
    Tokenizer::load(dir.string());
    FAIL() << "loaded without tokenizer.model";
  } catch (const kestrel::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              dir.string() + ": no tokenizer (Kestrel reads tokenizer.json, tokenizer.model, or "
                             "vocab.json with merges.txt)");
  }
}

TEST_F(TokenizerTest, CorruptModelIsAnError) {
  const fs::path dir = root_ / "corrupt";
  fs::create_directories(dir);
  write_file(dir / "tokenizer.model", "this is not a protobuf \xFF\xFF\xFF\x01\x02");
  try {
    Tokenizer::load(dir.string());
    FAIL() << "loaded a corrupt tokenizer.model";
  } catch (const kestrel::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find((dir / "tokenizer.model").string()), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// Every file the tokenizer reads is opened only when it is a regular file: a FIFO would block
// the load forever, a directory gave a C++ library message.
TEST_F(TokenizerTest, NonRegularFilesAreRefused) {
  using kestrel::test::error_without_blocking;
  using kestrel::test::make_fifo;
  for (const char* file : {"tokenizer.model", "tokenizer_config.json", "config.json",
                           "generation_config.json", "tokenizer.json"}) {
    const fs::path dir = root_ / (std::string("fifo-") + file);
    fs::create_directories(dir);
    if (std::string(file) != "tokenizer.model")
      fs::copy_file(model_, dir / "tokenizer.model", fs::copy_options::overwrite_existing);
    const std::string path = (dir / file).string();
    make_fifo(path);
    EXPECT_EQ(error_without_blocking(path, [&] { Tokenizer::load(dir.string()); }),
              path + " is not a regular file (a FIFO)");
    fs::remove(path);
    fs::create_directories(path);
    try {
      Tokenizer::load(dir.string());
      ADD_FAILURE() << file << " as a directory accepted";
    } catch (const kestrel::Error& e) {
      EXPECT_EQ(std::string(e.what()), path + " is a directory");
    }
  }
}

TEST_F(TokenizerTest, StreamingMatchesDecode) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  for (const auto& text : sample_texts()) {
    const auto ids = tok.encode(text, false);
    EXPECT_EQ(stream(tok, ids, true), tok.decode(ids)) << text;
    EXPECT_EQ(stream(tok, ids, true), text);
    const auto with = tok.encode(text);
    EXPECT_EQ(stream(tok, with, true), tok.decode(with)) << text;
  }
}

// Random id sequences (bytes that do and do not form characters, bare and doubled spaces,
// words with and without a leading space, controls, <unk>) decode the same streamed as
// whole, SentencePiece's own decoder being the oracle; for each way a model can treat the
// start of a text.
TEST_F(TokenizerTest, StreamingMatchesDecodeOnArbitraryIds) {
  int variant = 0;
  for (const fs::path& model : {model_, nfkc_model_, no_prefix_model_}) {
    const auto tok_owned = Tokenizer::from_model_file(model.string());
    const Tokenizer& tok = *tok_owned;
    std::vector<int> pool = {0, 1, 2, tok.piece_to_id("<|im_end|>")};
    int spaced = -1, unspaced = -1;
    for (int id = 0; id < tok.vocab_size(); ++id) {
      if (tok.is_control(id) || tok.is_byte(id) || tok.is_unknown(id)) continue;
      const std::string p = tok.piece(id);
      if (p == "\xE2\x96\x81" || p == "\xE2\x96\x81\xE2\x96\x81") pool.push_back(id);
      if (p.size() > 4 && p.starts_with("\xE2\x96\x81") && spaced < 0) spaced = id;
      if (p.size() > 1 && !p.starts_with("\xE2\x96\x81") && unspaced < 0) unspaced = id;
    }
    ASSERT_GE(spaced, 0);
    ASSERT_GE(unspaced, 0);
    pool.push_back(spaced);
    pool.push_back(unspaced);
    for (int b : {0x41, 0x0A, 0x20, 0x80, 0xBF, 0xC0, 0xC3, 0xA9, 0xE0, 0xA0, 0xE2, 0x82, 0xAC,
                  0xED, 0xF0, 0x9F, 0xA6, 0x8A, 0xF4, 0x90, 0xF5, 0xFF})
      pool.push_back(byte_id(tok, b));
    for (int id : pool) ASSERT_GE(id, 0);
    std::mt19937 rng(7 + variant++);
    for (int t = 0; t < 3000; ++t) {
      std::vector<int> ids(1 + rng() % 10);
      for (int& id : ids) id = pool[rng() % pool.size()];
      EXPECT_EQ(stream(tok, ids, true), tok.decode(ids)) << model << " case " << t;
    }
    for (const auto& text : sample_texts()) {
      const auto ids = tok.encode(text);
      EXPECT_EQ(stream(tok, ids, true), tok.decode(ids)) << model << ": " << text;
    }
  }
}

TEST_F(TokenizerTest, EmojiSplitOverBytesWaitsForItsLastByte) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  const auto ids = tok.encode("a 🦊", false);
  ASSERT_GE(ids.size(), 5u);
  const size_t first = ids.size() - 4;
  StreamDecoder dec(tok, true);
  std::string before;
  for (size_t i = 0; i < first; ++i) before += dec.push(ids[i]);
  EXPECT_EQ(before, "a ");
  EXPECT_EQ(dec.push(ids[first]), "");
  EXPECT_EQ(dec.push(ids[first + 1]), "");
  EXPECT_EQ(dec.push(ids[first + 2]), "");
  EXPECT_EQ(dec.push(ids[first + 3]), "🦊");
  EXPECT_EQ(dec.flush(), "");
}

TEST_F(TokenizerTest, InvalidBytesBecomeReplacementCharacters) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  {
    // 0xFF never starts a character: replaced at once, nothing held.
    StreamDecoder dec(tok, true);
    EXPECT_EQ(dec.push(byte_id(tok, 0xFF)), kFFFD);
    EXPECT_EQ(dec.flush(), "");
  }
  {
    // A truncated euro sign: held, then each byte replaced at the end.
    StreamDecoder dec(tok, true);
    EXPECT_EQ(dec.push(byte_id(tok, 0xE2)), "");
    EXPECT_EQ(dec.push(byte_id(tok, 0x82)), "");
    EXPECT_EQ(dec.flush(), kFFFD + kFFFD);
  }
  {
    // Interrupted by a word: the held bytes are replaced before it, and its space stays.
    const int the = tok.piece_to_id("\xE2\x96\x81the");
    StreamDecoder dec(tok, true);
    EXPECT_EQ(dec.push(byte_id(tok, 0xE2)), "");
    EXPECT_EQ(dec.push(the), kFFFD + " the");
  }
  {
    // E0 80 is an overlong form: known invalid as soon as 0x80 arrives.
    StreamDecoder dec(tok, true);
    EXPECT_EQ(dec.push(byte_id(tok, 0xE0)), "");
    EXPECT_EQ(dec.push(byte_id(tok, 0x80)), kFFFD + kFFFD);
  }
  {
    // ED A0 would be a surrogate.
    StreamDecoder dec(tok, true);
    EXPECT_EQ(dec.push(byte_id(tok, 0xED)), "");
    EXPECT_EQ(dec.push(byte_id(tok, 0xA0)), kFFFD + kFFFD);
  }
  {
    // A control token ends the byte run as in SentencePiece's decoder.
    StreamDecoder dec(tok, true);
    EXPECT_EQ(dec.push(byte_id(tok, 0xC3)), "");
    EXPECT_EQ(dec.push(2), kFFFD);
    EXPECT_EQ(dec.push(byte_id(tok, 0xC3)), "");
    EXPECT_EQ(dec.push(byte_id(tok, 0xA9)), "é");
  }
}

TEST_F(TokenizerTest, UnknownPieceDecodesAsSentencePieceDoes) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  EXPECT_EQ(dynamic_cast<const kestrel::SentencePieceTokenizer&>(tok).unk_surface(),
            " \xE2\x81\x87 ");
  EXPECT_EQ(tok.decode({0}), " \xE2\x81\x87 ");
  StreamDecoder dec(tok, true);
  EXPECT_EQ(dec.push(0), " \xE2\x81\x87 ");
}

TEST_F(TokenizerTest, LeadingSpaceKeptWhenNotAtTextStart) {
  const auto tok_owned = plain();
  const Tokenizer& tok = *tok_owned;
  const auto ids = tok.encode("hello world", false);
  EXPECT_EQ(stream(tok, ids, true), "hello world");
  EXPECT_EQ(stream(tok, ids, false), " hello world");
  // BOS is invisible: the first word after it is still at the start of the text.
  EXPECT_EQ(stream(tok, tok.encode("hello world"), true), "hello world");

  // Continuing a prompt: the generated ids streamed after the prompt's text give the text
  // of the whole sequence.
  const auto prompt = tok.encode("the river and the", true);
  const auto gen = tok.encode("mountain 🦊 café", false);
  std::vector<int> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end());
  EXPECT_EQ(tok.decode(prompt) + stream(tok, gen, false), tok.decode(all));
  EXPECT_EQ(tok.decode(all), "the river and the mountain 🦊 café");
}

// The bytes a grammar matches per token: the ids come from the SentencePiece library, which
// writes "▁" for each space (one before the text with add_dummy_prefix) and bytes it has no
// piece for as <0xNN> pieces, so joined they must give the text's own bytes. Characters outside
// the 400-piece vocabulary come out byte by byte, each byte piece its raw byte.
TEST_F(TokenizerTest, TokenBytesJoinToTheText) {
  const auto tok = plain();
  const auto no_prefix = Tokenizer::from_model_file(no_prefix_model_.string());
  const std::vector<std::string> bytes = tok->all_token_bytes();
  int split = 0;
  for (const auto& text : sample_texts()) {
    std::string joined;
    for (int id : tok->encode(text, false)) {
      joined += bytes[static_cast<size_t>(id)];
      split += tok->is_byte(id) && (bytes[static_cast<size_t>(id)][0] & 0x80);
    }
    EXPECT_EQ(joined, text.empty() ? text : " " + text);
    joined.clear();
    for (int id : no_prefix->encode(text, false)) joined += no_prefix->token_bytes(id);
    EXPECT_EQ(joined, text);
  }
  EXPECT_GT(split, 20) << "the texts should split characters into byte pieces";
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tok->token_bytes(byte_id(*tok, b)), std::string(1, static_cast<char>(b)));
  EXPECT_EQ(tok->token_bytes(tok->piece_to_id("\xE2\x96\x81the")), " the");
  for (int id : {0, 1, 2, tok->piece_to_id("<|im_end|>"), -1, tok->vocab_size()}) {
    EXPECT_EQ(tok->token_bytes(id), "") << id;
  }
}

}  // namespace
