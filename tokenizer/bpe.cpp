#include "tokenizer/bpe.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "base/error.h"
#include "tokenizer/special_tokens.h"
#include "tokenizer/tokenizer_file.h"
#include "tokenizer/tokenizer_json.h"
#include "tokenizer/utf8.h"

namespace kestrel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint8_t kUsed = 1;     // some token has this id
constexpr uint8_t kSpecial = 2;  // a special added token: skipped by decode
constexpr uint8_t kAdded = 4;    // an added token

// The model's vocabulary and merges in its own alphabet: for a byte-level tokenizer, bytes.
// Tokens and merges that use characters outside the byte alphabet cannot occur in a byte-level
// word and are left out of the model (their ids still decode).
void to_model_alphabet(std::vector<std::pair<std::string, int>>& vocab,
                       std::vector<std::pair<std::string, std::string>>& merges) {
  std::string a, b;
  size_t k = 0;
  for (auto& [token, id] : vocab)
    if (utf8::byte_level_to_bytes(token, a)) vocab[k++] = {a, id};
  vocab.resize(k);
  k = 0;
  for (auto& [l, r] : merges)
    if (utf8::byte_level_to_bytes(l, a) && utf8::byte_level_to_bytes(r, b)) merges[k++] = {a, b};
  merges.resize(k);
}

// Token ids leave gaps (removed tokens, reserved ranges), but an id far past the number of
// tokens a file defines is a broken file: honouring it would size the id tables by it
// (gigabytes for an id near 2^30) before failing.
size_t id_limit(size_t tokens) { return 2 * tokens + 65536; }

void check_id_limit(int id, const std::string& token, size_t tokens, const std::string& file) {
  KESTREL_CHECK(static_cast<size_t>(id) < id_limit(tokens),
                fmt::format("{}: token \"{}\" has id {}, far past the {} tokens the tokenizer "
                            "defines",
                            file, token, id, tokens));
}

// The ids a post-processor puts before and after a single text.
struct Template {
  std::vector<int> prefix, suffix;
};

Template read_post_processor(const json& j, const std::string& where) {
  Template t;
  if (j.is_null()) return t;
  KESTREL_CHECK(j.is_object(),
                fmt::format("{}: post_processor must be an object, found {}", where, j.dump()));
  const std::string type = tokenizer_json::type_of(j);
  const std::string ctx = where + ": post_processor " + type;
  if (type == "Sequence") {
    KESTREL_CHECK(j.contains("processors") && j["processors"].is_array(),
                  ctx + " needs a list \"processors\"");
    // Each processor wraps what the ones before it produced.
    for (const json& p : j["processors"]) {
      const Template inner = read_post_processor(p, where);
      t.prefix.insert(t.prefix.begin(), inner.prefix.begin(), inner.prefix.end());
      t.suffix.insert(t.suffix.end(), inner.suffix.begin(), inner.suffix.end());
    }
  } else if (type == "ByteLevel") {
    // Offsets only.
  } else if (type == "TemplateProcessing") {
    KESTREL_CHECK(j.contains("single") && j["single"].is_array(), ctx + " needs a list \"single\"");
    static const json kNoSpecials = json::object();
    const auto sp = j.find("special_tokens");
    const json& specials = sp == j.end() || sp->is_null() ? kNoSpecials : *sp;
    KESTREL_CHECK(specials.is_object(),
                  fmt::format("{}: special_tokens must be an object, found {}", ctx,
                              specials.dump()));
    bool after = false;
    for (const json& piece : j["single"]) {
      if (piece.is_object() && piece.contains("Sequence")) {
        after = true;
        continue;
      }
      KESTREL_CHECK(piece.is_object() && piece.contains("SpecialToken") &&
                        piece["SpecialToken"].is_object() &&
                        piece["SpecialToken"].contains("id") &&
                        piece["SpecialToken"]["id"].is_string(),
                    fmt::format("{}: template piece {} is neither {{\"Sequence\": ...}} nor "
                                "{{\"SpecialToken\": {{\"id\": \"...\"}}}}",
                                ctx, piece.dump()));
      const std::string name = piece["SpecialToken"]["id"].get<std::string>();
      KESTREL_CHECK(specials.contains(name) && specials[name].is_object() &&
                        specials[name].contains("ids") && specials[name]["ids"].is_array(),
                    fmt::format("{}: special token \"{}\" has no ids in special_tokens", ctx,
                                name));
      for (const json& id : specials[name]["ids"])
        (after ? t.suffix : t.prefix)
            .push_back(tokenizer_json::token_id(
                id, fmt::format("special_tokens[\"{}\"].ids", name), ctx));
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    KESTREL_CHECK(j.contains("cls") && j.contains("sep") && j["cls"].is_array() &&
                      j["sep"].is_array() && j["cls"].size() == 2 && j["sep"].size() == 2,
                  ctx + " needs \"cls\" and \"sep\" as [token, id]");
    t.prefix = {tokenizer_json::token_id(j["cls"][1], "cls[1]", ctx)};
    t.suffix = {tokenizer_json::token_id(j["sep"][1], "sep[1]", ctx)};
  } else {
    throw Error(fmt::format("{}: post_processor {} is not supported (Kestrel reads "
                            "TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing and "
                            "Sequence)",
                            where, type));
  }
  return t;
}

}  // namespace

// The streaming decode: each token's compiled bytes (its first-position spelling for the first
// token of a text), the Strip of the text's start applied while it lasts, and the bytes of a
// character split over tokens held until it completes.
class BpeStream final : public DecodeStream {
 public:
  BpeStream(const BpeTokenizer& tok, bool at_text_start)
      : tok_(&tok),
        first_(at_text_start),
        strip_left_(at_text_start ? tok.decoder_.strip_count() : 0) {}

  std::string push(int id) override {
    if (id < 0 || id >= tok_->vocab_size()) return "";
    const uint8_t f = tok_->flags_[id];
    if (!(f & kUsed) || (f & kSpecial)) return "";
    std::string_view b = tok_->decoder_.bytes(id, first_);
    first_ = false;
    const std::string& strip = tok_->decoder_.strip_content();
    while (strip_left_ > 0 && !b.empty()) {
      if (!b.starts_with(strip)) {
        strip_left_ = 0;
      } else {
        b.remove_prefix(strip.size());
        --strip_left_;
      }
    }
    pending_.append(b);
    return utf8::drain(pending_, /*final=*/false);
  }

  std::string flush() override { return utf8::drain(pending_, /*final=*/true); }

 private:
  const BpeTokenizer* tok_;
  bool first_;
  int strip_left_;
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

std::unique_ptr<BpeTokenizer> BpeTokenizer::load_tokenizer_json(const std::string& dir) {
  const std::string where = (fs::path(dir) / "tokenizer.json").string();
  // The readers check each field's type; this catches any nlohmann error they let through, so
  // that a malformed file is still one line naming it.
  try {
    return read_tokenizer_json(dir);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: malformed tokenizer ({})", where, e.what()));
  }
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::read_tokenizer_json(const std::string& dir) {
  const fs::path path = fs::path(dir) / "tokenizer.json";
  const std::string where = path.string();
  TokenizerFile file = read_tokenizer_file(path, {"model", "vocab"}, {"model", "merges"});
  const json& j = file.root;
  KESTREL_CHECK(j.is_object(), fmt::format("{}: expected a JSON object", where));
  std::unique_ptr<BpeTokenizer> tok(new BpeTokenizer());

  static const json kNull;
  auto field = [&](const json& o, const char* key) -> const json& {
    auto it = o.find(key);
    return it == o.end() ? kNull : *it;
  };
  const json& model = field(j, "model");
  KESTREL_CHECK(model.is_object(), fmt::format("{}: no \"model\"", where));
  const std::string type = tokenizer_json::string_or(model, "type", "BPE", where + ": model");
  if (type != "BPE")
    throw Error(fmt::format("{}: model {} is not supported (Kestrel reads BPE)", where, type));
  auto option_string = [&](const char* key) {
    return tokenizer_json::string_or(model, key, "", where + ": model");
  };
  auto option_bool = [&](const char* key) {
    return tokenizer_json::flag(model, key, where + ": model").value_or(false);
  };
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!option_string(key).empty())
      throw Error(fmt::format("{}: model.{} \"{}\" is not supported", where, key,
                              option_string(key)));
  const json& dropout = field(model, "dropout");
  KESTREL_CHECK(dropout.is_null() || (dropout.is_number() && dropout.get<double>() == 0.0),
                fmt::format("{}: model.dropout {} is not supported (it makes encoding random)",
                            where, dropout.dump()));
  KESTREL_CHECK(file.has_vocab && file.has_merges,
                fmt::format("{}: model needs a \"vocab\" object and a \"merges\" list", where));

  std::vector<std::pair<std::string, int>> vocab = std::move(file.vocab);
  std::vector<std::pair<std::string, std::string>> merges = std::move(file.merges);
  tok->normalizer_ = Normalizer::from_json(field(j, "normalizer"), where);
  tok->pre_tokenizer_ = PreTokenizer::from_json(field(j, "pre_tokenizer"), where);
  tok->decoder_ = TokenDecoder::from_json(field(j, "decoder"), where);
  const Template tpl = read_post_processor(field(j, "post_processor"), where);

  BpeOptions o;
  o.byte_level = tok->pre_tokenizer_.byte_level();
  o.ignore_merges = option_bool("ignore_merges");
  o.byte_fallback = tok->byte_fallback_ = option_bool("byte_fallback");
  o.fuse_unk = option_bool("fuse_unk");
  const std::string unk = option_string("unk_token");
  if (!unk.empty()) {
    auto it = std::find_if(vocab.begin(), vocab.end(),
                           [&](const auto& v) { return v.first == unk; });
    KESTREL_CHECK(it != vocab.end(),
                  fmt::format("{}: model.unk_token \"{}\" is not in the vocabulary", where, unk));
    o.unk_id = tok->unk_id_ = it->second;
  }

  // Added tokens: tokenizer.json's, and those of tokenizer_config.json's added_tokens_decoder
  // it lacks (transformers adds them on load).
  std::vector<AddedTokenSpec> added;
  if (const json& list = field(j, "added_tokens"); !list.is_null()) {
    KESTREL_CHECK(list.is_array(), fmt::format("{}: added_tokens must be a list", where));
    for (const json& t : list) {
      KESTREL_CHECK(t.is_object() && t.contains("id"),
                    fmt::format("{}: added token without an \"id\": {}", where, t.dump()));
      added.push_back(parse_added_token(
          t, tokenizer_json::token_id(t["id"], "added token id", where), where));
    }
  }
  const TokenizerSettings s = read_tokenizer_settings(dir);
  const size_t tokens = vocab.size() + added.size() + s.added_tokens_decoder.size();
  for (const auto& [t, id] : vocab) check_id_limit(id, t, tokens, where);
  for (const AddedTokenSpec& t : added) check_id_limit(t.id, t.content, tokens, where);
  for (const AddedTokenSpec& t : s.added_tokens_decoder) {
    check_id_limit(t.id, t.content, tokens, s.config_path);
    if (std::none_of(added.begin(), added.end(), [&](const auto& a) { return a.id == t.id; }))
      added.push_back(t);
  }

  std::vector<std::pair<std::string, int>> model_vocab = vocab;
  if (o.byte_level) to_model_alphabet(model_vocab, merges);
  tok->model_ = std::make_unique<BpeModel>(std::move(model_vocab), merges, o, where);
  tok->finish(std::move(vocab), std::move(added), where);

  // BOS and EOS: tokenizer_config.json's tokens, else the post-processor's. Its add_bos_token
  // and add_eos_token, where given, decide what encode adds (as transformers' Llama and Gemma
  // tokenizers rebuild the template from them); otherwise the post-processor does.
  int bos = tpl.prefix.empty() ? -1 : tpl.prefix.front();
  std::vector<int> eos;
  if (!tpl.suffix.empty()) eos = {tpl.suffix.back()};
  if (s.bos_token) bos = tok->config_token_id(s, "bos_token", *s.bos_token, where);
  if (s.eos_token) eos = {tok->config_token_id(s, "eos_token", *s.eos_token, where)};
  if (s.add_bos_token || s.add_eos_token) {
    tok->set_special_tokens(s, bos, eos, s.add_bos_token.value_or(!tpl.prefix.empty()),
                            s.add_eos_token.value_or(!tpl.suffix.empty()), dir);
  } else {
    tok->set_special_tokens(s, bos, eos, false, false, dir);
    tok->prefix_ = tpl.prefix;
    tok->suffix_ = tpl.suffix;
  }
  for (int id : tok->prefix_)
    KESTREL_CHECK(id >= 0 && id < tok->vocab_size(),
                  fmt::format("{}: the post-processor adds id {}, which no token has", where, id));
  for (int id : tok->suffix_)
    KESTREL_CHECK(id >= 0 && id < tok->vocab_size(),
                  fmt::format("{}: the post-processor adds id {}, which no token has", where, id));
  return tok;
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::load_vocab_merges(const std::string& dir) {
  const fs::path vocab_path = fs::path(dir) / "vocab.json";
  const fs::path merges_path = fs::path(dir) / "merges.txt";
  std::unique_ptr<BpeTokenizer> tok(new BpeTokenizer());
  TokenizerFile file = read_tokenizer_file(vocab_path, {}, {"-"});
  KESTREL_CHECK(file.has_vocab, fmt::format("{}: expected an object of token: id",
                                            vocab_path.string()));
  std::vector<std::pair<std::string, int>> vocab = std::move(file.vocab);

  // merges.txt: a "#version" line, then one "a b" per line.
  std::vector<std::pair<std::string, std::string>> merges;
  {
    const std::string text = read_file_bytes(merges_path);
    size_t pos = 0, line_no = 0;
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      std::string_view line = std::string_view(text).substr(pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
      const size_t sp = line.find(' ');
      KESTREL_CHECK(sp != std::string_view::npos &&
                        line.find(' ', sp + 1) == std::string_view::npos,
                    fmt::format("{}: line {} is not two tokens separated by a space",
                                merges_path.string(), line_no));
      merges.emplace_back(std::string(line.substr(0, sp)), std::string(line.substr(sp + 1)));
    }
  }

  const TokenizerSettings s = read_tokenizer_settings(dir);
  tok->pre_tokenizer_ = PreTokenizer::gpt2(/*add_prefix_space=*/false);
  tok->prefix_space_ = s.add_prefix_space.value_or(false);
  tok->decoder_ = TokenDecoder::byte_level();

  // GPT2Tokenizer's special tokens (bos, eos and unk default to <|endoftext|>) and the added
  // tokens of tokenizer_config.json, all matched in the text before BPE.
  std::vector<AddedTokenSpec> added = s.added_tokens_decoder;
  const size_t tokens = vocab.size() + added.size();
  for (const auto& [t, id] : vocab) check_id_limit(id, t, tokens, vocab_path.string());
  for (const AddedTokenSpec& t : added) check_id_limit(t.id, t.content, tokens, s.config_path);
  auto vocab_id = [&](const std::string& t) {
    for (const auto& a : added)
      if (a.content == t) return a.id;
    auto it = std::find_if(vocab.begin(), vocab.end(), [&](const auto& v) { return v.first == t; });
    return it == vocab.end() ? -1 : it->second;
  };
  const std::string eot = "<|endoftext|>";
  const std::string bos_text = s.bos_token.value_or(eot), eos_text = s.eos_token.value_or(eot);
  const std::string unk_text = s.unk_token.value_or(eot), pad_text = s.pad_token.value_or("");
  for (const std::string& t : {bos_text, eos_text, unk_text, pad_text}) {
    const int id = t.empty() ? -1 : vocab_id(t);
    auto same = [&](const AddedTokenSpec& a) { return a.id == id; };
    if (id >= 0 && std::none_of(added.begin(), added.end(), same))
      added.push_back({id, t, /*special=*/true, false, false, false, /*normalized=*/false});
  }

  const int bos = vocab_id(bos_text), eos = vocab_id(eos_text);

  BpeOptions o;
  o.byte_level = true;
  std::vector<std::pair<std::string, int>> model_vocab = vocab;
  to_model_alphabet(model_vocab, merges);
  tok->model_ = std::make_unique<BpeModel>(std::move(model_vocab), merges, o, merges_path.string());
  tok->finish(std::move(vocab), std::move(added), vocab_path.string());
  tok->set_special_tokens(s, bos, eos >= 0 ? std::vector<int>{eos} : std::vector<int>{},
                          s.add_bos_token.value_or(false), s.add_eos_token.value_or(false), dir);
  return tok;
}

void BpeTokenizer::finish(std::vector<std::pair<std::string, int>> vocab,
                          std::vector<AddedTokenSpec> added, const std::string& where) {
  int n = 0;
  for (const auto& [t, id] : vocab) n = std::max(n, id + 1);
  for (const AddedTokenSpec& a : added) n = std::max(n, a.id + 1);
  tokens_.assign(n, std::string());
  flags_.assign(n, 0);
  ids_.reserve(vocab.size() + added.size());
  // A token string names the added token first, then the model's (tokenizers' token_to_id).
  for (const AddedTokenSpec& a : added) {
    KESTREL_CHECK(!a.content.empty(), fmt::format("{}: added token {} is empty", where, a.id));
    ids_.insert(a.content, a.id, /*replace=*/true);
  }
  for (auto& [t, id] : vocab) {
    flags_[id] |= kUsed;
    ids_.insert(t, id);
    tokens_[id] = std::move(t);
  }
  std::vector<AddedTokenSpec> raw, normalized;
  std::vector<std::string> raw_patterns, normalized_patterns;
  for (const AddedTokenSpec& a : added) {
    tokens_[a.id] = a.content;
    flags_[a.id] = kUsed | kAdded | (a.special ? kSpecial : 0);
    if (a.normalized) {
      normalized.push_back(a);
      normalized_patterns.push_back(normalizer_.apply(a.content));
    } else {
      raw.push_back(a);
      raw_patterns.push_back(a.content);
    }
  }
  raw_tokens_ = AddedTokenMatcher(raw, raw_patterns);
  normalized_tokens_ = AddedTokenMatcher(normalized, normalized_patterns);
  decoder_.build(tokens_);
}

void BpeTokenizer::encode_piece(std::string_view text, bool at_text_start,
                                std::vector<int>& ids) const {
  thread_local Words words;
  pre_tokenizer_.split(text, at_text_start, words);
  for (auto [a, b] : words.spans)
    model_->encode_word(std::string_view(words.text).substr(a, b - a), ids);
}

std::vector<int> BpeTokenizer::encode_text(const std::string& input) const {
  std::string fixed;
  const std::string* text = &input;
  if (prefix_space_ || !utf8::valid(input)) {
    fixed = prefix_space_ ? " " : "";
    fixed += utf8::sanitize(input);
    text = &fixed;
  }
  std::vector<int> ids;
  ids.reserve(text->size() / 3 + 4);
  std::vector<AddedTokenMatcher::Segment> raw, norm;
  if (raw_tokens_.empty()) {
    raw.push_back({0, text->size(), -1});
  } else {
    raw_tokens_.split(*text, raw);
  }
  for (const auto& seg : raw) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    const std::string_view piece = std::string_view(*text).substr(seg.start, seg.end - seg.start);
    const bool at_start = seg.start == 0;
    if (normalizer_.empty() && normalized_tokens_.empty()) {
      encode_piece(piece, at_start, ids);
      continue;
    }
    const std::string normal = normalizer_.apply(std::string(piece));
    norm.clear();
    if (normalized_tokens_.empty()) {
      norm.push_back({0, normal.size(), -1});
    } else {
      normalized_tokens_.split(normal, norm);
    }
    for (const auto& n : norm) {
      if (n.id >= 0) {
        ids.push_back(n.id);
      } else {
        encode_piece(std::string_view(normal).substr(n.start, n.end - n.start),
                     at_start && n.start == 0, ids);
      }
    }
  }
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int>& ids) const {
  BpeStream s(*this, /*at_text_start=*/true);
  std::string out;
  for (int id : ids) out += s.push(id);
  return out + s.flush();
}

std::string BpeTokenizer::piece(int id) const {
  return id >= 0 && id < vocab_size() ? tokens_[id] : std::string();
}

std::string BpeTokenizer::token_bytes(int id) const {
  if (id < 0 || id >= vocab_size() || id == unk_id_) return "";
  const uint8_t f = flags_[id];
  if (!(f & kUsed) || (f & kSpecial)) return "";
  // Not the first position: Metaspace's dropped leading space and the Strip of the text's
  // start apply only there.
  return std::string(decoder_.bytes(id, /*first=*/false));
}

bool BpeTokenizer::is_control(int id) const {
  return id >= 0 && id < vocab_size() && (flags_[id] & kSpecial);
}

bool BpeTokenizer::is_byte(int id) const {
  if (!byte_fallback_ || id < 0 || id >= vocab_size() || (flags_[id] & kAdded)) return false;
  return utf8::byte_token(tokens_[id]) >= 0;
}

int BpeTokenizer::piece_to_id(const std::string& piece) const { return ids_.find(piece); }

std::unique_ptr<DecodeStream> BpeTokenizer::decode_stream(bool at_text_start) const {
  return std::make_unique<BpeStream>(*this, at_text_start);
}

}  // namespace kestrel
