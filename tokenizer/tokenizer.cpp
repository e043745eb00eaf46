#include "tokenizer/tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/base/error.h"

namespace kestrel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";       // U+2581, SentencePiece's space
constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";   // U+FFFD

// Parses <path> when it exists. Absent files are optional settings, so nullopt; a file that
// exists but does not parse is the user's problem and is reported with its path.
std::optional<json> read_json(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  std::ifstream in(path);
  KESTREL_CHECK(in, fmt::format("{}: cannot open", path.string()));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON ({})", path.string(), e.what()));
  }
}

// A bool setting of tokenizer_config.json; `fallback` when absent or null.
bool bool_field(const json& j, const char* key, bool fallback, const fs::path& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  KESTREL_CHECK(it->is_boolean(),
                fmt::format("{}: {} must be true or false, found {}", path.string(), key,
                            it->dump()));
  return it->get<bool>();
}

// bos_token / eos_token of tokenizer_config.json: a string or an AddedToken object
// {"content": ...}. nullopt when absent or null.
std::optional<std::string> token_field(const json& j, const char* key, const fs::path& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  throw Error(fmt::format("{}: {} must be a string or an object with \"content\", found {}",
                          path.string(), key, it->dump()));
}

// bos_token_id / eos_token_id of config.json or generation_config.json: an int or a list of
// ints. Empty when absent or null.
std::vector<int> id_list_field(const json& j, const char* key, const fs::path& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  auto bad = [&] {
    return Error(fmt::format("{}: {} must be a non-negative integer or a list of them, found {}",
                             path.string(), key, it->dump()));
  };
  auto one = [&](const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) throw bad();
    return static_cast<int>(v.get<int64_t>());
  };
  std::vector<int> ids;
  if (it->is_array()) {
    for (const auto& v : *it) ids.push_back(one(v));
  } else {
    ids.push_back(one(*it));
  }
  return ids;
}

void append_unique(std::vector<int>& dst, const std::vector<int>& src) {
  for (int id : src)
    if (std::find(dst.begin(), dst.end(), id) == dst.end()) dst.push_back(id);
}

// Length of the UTF-8 character at the start of `s` when it is complete and valid, else 0.
// Follows SentencePiece's DecodeUTF8: no overlong forms, no surrogates, nothing past
// U+10FFFF; every rejected lead byte costs exactly one U+FFFD.
size_t valid_char_len(std::string_view s) {
  auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  auto trail = [&](size_t i) { return (b(i) & 0xC0) == 0x80; };
  auto ok_cp = [](uint32_t cp) { return cp < 0xD800 || (cp >= 0xE000 && cp <= 0x10FFFF); };
  if (s.empty()) return 0;
  if (b(0) < 0x80) return 1;
  if ((b(0) & 0xE0) == 0xC0 && s.size() >= 2) {
    uint32_t cp = ((b(0) & 0x1Fu) << 6) | (b(1) & 0x3Fu);
    return trail(1) && cp >= 0x80 && ok_cp(cp) ? 2 : 0;
  }
  if ((b(0) & 0xF0) == 0xE0 && s.size() >= 3) {
    uint32_t cp = ((b(0) & 0x0Fu) << 12) | ((b(1) & 0x3Fu) << 6) | (b(2) & 0x3Fu);
    return trail(1) && trail(2) && cp >= 0x800 && ok_cp(cp) ? 3 : 0;
  }
  if ((b(0) & 0xF8) == 0xF0 && s.size() >= 4) {
    uint32_t cp = ((b(0) & 0x07u) << 18) | ((b(1) & 0x3Fu) << 12) | ((b(2) & 0x3Fu) << 6) |
                  (b(3) & 0x3Fu);
    return trail(1) && trail(2) && trail(3) && cp >= 0x10000 && ok_cp(cp) ? 4 : 0;
  }
  return 0;
}

// Whether `s`, shorter than the character its lead byte announces, can still become a valid
// character with more bytes. Only such prefixes are held back; anything else is already
// known to decode to U+FFFD whatever follows, so holding it would only delay the output.
bool completable_prefix(std::string_view s) {
  auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  size_t need;
  uint32_t cp, min_cp;
  if ((b(0) & 0xE0) == 0xC0) {
    need = 2, cp = b(0) & 0x1Fu, min_cp = 0x80;
  } else if ((b(0) & 0xF0) == 0xE0) {
    need = 3, cp = b(0) & 0x0Fu, min_cp = 0x800;
  } else if ((b(0) & 0xF8) == 0xF0) {
    need = 4, cp = b(0) & 0x07u, min_cp = 0x10000;
  } else {
    return false;
  }
  if (s.size() >= need) return false;
  for (size_t i = 1; i < s.size(); ++i) {
    if ((b(i) & 0xC0) != 0x80) return false;
    cp = (cp << 6) | (b(i) & 0x3Fu);
  }
  // The code points the missing trail bytes can still reach, against the valid ranges.
  const unsigned free_bits = 6 * static_cast<unsigned>(need - s.size());
  const uint32_t lo = cp << free_bits, hi = lo | ((1u << free_bits) - 1);
  auto meets = [&](uint32_t a, uint32_t z) { return lo <= z && hi >= a; };
  return meets(min_cp, 0xD7FF) || meets(std::max(min_cp, 0xE000u), 0x10FFFF);
}

// Decodes the leading bytes of `bytes` that are final and erases them. When `final` is
// false, a trailing prefix that may still complete a character stays in `bytes`.
std::string drain_bytes(std::string& bytes, bool final) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    std::string_view rest = std::string_view(bytes).substr(i);
    if (size_t n = valid_char_len(rest)) {
      out.append(rest.substr(0, n));
      i += n;
    } else if (!final && completable_prefix(rest)) {
      break;
    } else {
      out.append(kReplacementChar);
      i += 1;
    }
  }
  bytes.erase(0, i);
  return out;
}

// The text of a piece: each "▁" is a space.
std::string spaces_for_symbols(std::string_view p) {
  std::string out;
  out.reserve(p.size());
  while (!p.empty()) {
    if (p.starts_with(kSpaceSymbol)) {
      out += ' ';
      p.remove_prefix(kSpaceSymbol.size());
    } else {
      out += p.front();
      p.remove_prefix(1);
    }
  }
  return out;
}

// The byte of a byte-fallback piece "<0xNN>".
uint8_t piece_byte(const std::string& piece) {
  KESTREL_CHECK(piece.size() == 6 && piece.compare(0, 3, "<0x") == 0 && piece[5] == '>',
                fmt::format("byte piece \"{}\" is not of the form <0xNN>", piece));
  return static_cast<uint8_t>(std::stoi(piece.substr(3, 2), nullptr, 16));
}

}  // namespace

Tokenizer::Tokenizer() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_model_file(const std::string& path) {
  std::error_code ec;
  KESTREL_CHECK(fs::is_regular_file(path, ec), fmt::format("{}: no such file", path));
  Tokenizer tok;
  const auto status = tok.sp_->Load(path);
  KESTREL_CHECK(status.ok(), fmt::format("{}: not a readable SentencePiece model ({})", path,
                                         status.message()));
  tok.bos_id_ = tok.sp_->bos_id();
  // A model without a BOS piece cannot have one prepended.
  tok.add_bos_ = tok.bos_id_ >= 0;
  tok.tokenizer_eos_id_ = tok.sp_->eos_id();
  if (tok.tokenizer_eos_id_ >= 0) tok.eos_ids_ = {tok.tokenizer_eos_id_};
  // The surface of <unk> lives in the model's trainer spec, which the installed headers do
  // not expose; decoding <unk> alone yields it.
  if (tok.sp_->unk_id() >= 0) tok.unk_surface_ = tok.sp_->DecodeIds({tok.sp_->unk_id()});
  tok.probe_text_start();
  return tok;
}

// The leading-space rule of SentencePiece's decoder hangs on normalizer settings that the
// installed headers do not expose (add_dummy_prefix, remove_extra_whitespaces) and has
// changed between releases, so StreamDecoder asks the decoder itself.
void Tokenizer::probe_text_start() {
  const int n = vocab_size();
  auto normal = [&](int id) {
    return !sp_->IsControl(id) && !sp_->IsUnknown(id) && !sp_->IsByte(id);
  };
  int word = -1;  // a piece "▁..."
  for (int id = 0; id < n && word < 0; ++id)
    if (normal(id) && std::string_view(sp_->IdToPiece(id)).starts_with(kSpaceSymbol)) word = id;
  if (word < 0) return;  // no piece starts with a space: the rule never applies
  const std::string alone = sp_->DecodeIds({word});
  strips_leading_space_ = alone != spaces_for_symbols(sp_->IdToPiece(word));
  const int bare = piece_to_id(std::string(kSpaceSymbol));
  if (strips_leading_space_ && bare >= 0 && normal(bare))
    strips_after_bare_space_ = sp_->DecodeIds({bare, word}) == alone;
}

Tokenizer Tokenizer::load(const std::string& dir) {
  const fs::path root(dir);
  const fs::path model_path = root / "tokenizer.model";
  std::error_code ec;
  KESTREL_CHECK(fs::is_regular_file(model_path, ec),
                fmt::format("{}: no tokenizer.model (Kestrel reads SentencePiece tokenizers)",
                            dir));
  Tokenizer tok = from_model_file(model_path.string());

  // The tokenizer's own special tokens: the SentencePiece model's, unless tokenizer_config.json
  // names others.
  std::vector<int> tokenizer_eos = tok.eos_ids_;
  tok.add_bos_ = true;
  const fs::path tc_path = root / "tokenizer_config.json";
  if (auto tc = read_json(tc_path)) {
    KESTREL_CHECK(tc->is_object(), fmt::format("{}: expected a JSON object", tc_path.string()));
    tok.add_bos_ = bool_field(*tc, "add_bos_token", true, tc_path);
    tok.add_eos_ = bool_field(*tc, "add_eos_token", false, tc_path);
    auto to_id = [&](const char* key) -> std::optional<int> {
      auto text = token_field(*tc, key, tc_path);
      if (!text) return std::nullopt;
      int id = tok.piece_to_id(*text);
      // Tokens added on top of the SentencePiece model (ChatML's <|im_end|>, say) have their
      // ids in added_tokens_decoder.
      if (id < 0 && tc->contains("added_tokens_decoder") && (*tc)["added_tokens_decoder"].is_object()) {
        for (const auto& [key_id, t] : (*tc)["added_tokens_decoder"].items()) {
          if (t.is_object() && t.value("content", std::string()) == *text) {
            try {
              id = std::stoi(key_id);
            } catch (const std::exception&) {
              throw Error(fmt::format("{}: added_tokens_decoder key \"{}\" is not a token id",
                                      tc_path.string(), key_id));
            }
            break;
          }
        }
      }
      KESTREL_CHECK(id >= 0, fmt::format("{}: {} \"{}\" is neither a piece of {} nor in added_tokens_decoder",
                                         tc_path.string(), key, *text, model_path.string()));
      return id;
    };
    if (auto id = to_id("bos_token")) tok.bos_id_ = *id;
    if (auto id = to_id("eos_token")) tokenizer_eos = {*id};
  }

  // The model's stop tokens: generation_config.json first (its list is what generation is
  // meant to stop on), then config.json, then the tokenizer's. Any of them ends generation.
  std::vector<int> eos;
  std::vector<int> config_bos;
  for (const char* name : {"generation_config.json", "config.json"}) {
    const fs::path path = root / name;
    if (auto j = read_json(path)) {
      KESTREL_CHECK(j->is_object(), fmt::format("{}: expected a JSON object", path.string()));
      append_unique(eos, id_list_field(*j, "eos_token_id", path));
      if (config_bos.empty()) config_bos = id_list_field(*j, "bos_token_id", path);
    }
  }
  append_unique(eos, tokenizer_eos);
  tok.eos_ids_ = eos;
  // BOS is what the tokenizer prepends; the model's configs name it only for tokenizers that
  // do not.
  if (tok.bos_id_ < 0 && !config_bos.empty()) tok.bos_id_ = config_bos.front();

  KESTREL_CHECK(!tok.add_bos_ || tok.bos_id_ >= 0,
                fmt::format("{}: add_bos_token is set but neither the tokenizer nor the configs "
                            "define a BOS token", dir));
  KESTREL_CHECK(!tok.add_eos_ || !tokenizer_eos.empty(),
                fmt::format("{}: add_eos_token is set but the tokenizer defines no EOS token",
                            dir));
  tok.tokenizer_eos_id_ = tokenizer_eos.empty() ? -1 : tokenizer_eos.front();
  return tok;
}

std::vector<int> Tokenizer::encode(const std::string& text, bool with_specials) const {
  std::vector<int> pieces;
  const auto status = sp_->Encode(text, &pieces);
  KESTREL_CHECK(status.ok(), fmt::format("tokenizer: cannot encode text ({})", status.message()));
  std::vector<int> ids;
  ids.reserve(pieces.size() + 2);
  if (with_specials && add_bos_) ids.push_back(bos_id_);
  ids.insert(ids.end(), pieces.begin(), pieces.end());
  if (with_specials && add_eos_) ids.push_back(tokenizer_eos_id_);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  // SentencePiece rejects the whole sequence for one id it does not know (a model whose
  // embedding is padded past the vocabulary can sample one), so those ids are dropped.
  std::vector<int> known;
  known.reserve(ids.size());
  const int n = vocab_size();
  for (int id : ids)
    if (id >= 0 && id < n) known.push_back(id);
  return sp_->DecodeIds(known);
}

int Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }

bool Tokenizer::is_eos(int id) const {
  return std::find(eos_ids_.begin(), eos_ids_.end(), id) != eos_ids_.end();
}

std::string Tokenizer::piece(int id) const {
  if (id < 0 || id >= vocab_size()) return "";
  return sp_->IdToPiece(id);
}

bool Tokenizer::is_control(int id) const {
  return id >= 0 && id < vocab_size() && sp_->IsControl(id);
}

bool Tokenizer::is_byte(int id) const { return id >= 0 && id < vocab_size() && sp_->IsByte(id); }

bool Tokenizer::is_unknown(int id) const {
  return id >= 0 && id < vocab_size() && sp_->IsUnknown(id);
}

int Tokenizer::piece_to_id(const std::string& piece) const {
  // SentencePiece answers <unk>'s id for pieces it does not have.
  const int id = sp_->PieceToId(piece);
  return id >= 0 && sp_->IdToPiece(id) == piece ? id : -1;
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool at_text_start)
    : tok_(&tok), at_start_(at_text_start) {}

// Mirrors SentencePiece's Decode one piece at a time: a run of byte pieces is decoded as one
// byte string when a non-byte piece (control tokens included) or the end closes it, and the
// leading space of a piece is dropped while the decoded text is still empty (see
// probe_text_start for the variants).
std::string StreamDecoder::push(int id) {
  if (id < 0 || id >= tok_->vocab_size()) return "";
  std::string out;
  if (tok_->is_byte(id)) {
    pending_.push_back(static_cast<char>(piece_byte(tok_->piece(id))));
    out = drain_bytes(pending_, /*final=*/false);
  } else {
    out = drain_bytes(pending_, /*final=*/true);
    if (!out.empty()) at_start_ = false;
    if (tok_->is_unknown(id)) {
      out += tok_->unk_surface();
    } else if (!tok_->is_control(id)) {
      const std::string piece = tok_->piece(id);
      std::string_view p = piece;
      if (at_start_ && tok_->strips_leading_space_ && p.starts_with(kSpaceSymbol)) {
        p.remove_prefix(kSpaceSymbol.size());
        // A dropped space is the text's first character unless the decoder keeps dropping.
        if (!tok_->strips_after_bare_space_) at_start_ = false;
      }
      out += spaces_for_symbols(p);
    }
  }
  if (!out.empty()) at_start_ = false;
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = drain_bytes(pending_, /*final=*/true);
  if (!out.empty()) at_start_ = false;
  return out;
}

void Tokenizer::check_fits(int model_vocab, const std::string& dir) const {
  if (vocab_size() > model_vocab)
    throw Error(dir + ": tokenizer.model has " + std::to_string(vocab_size()) +
                " pieces but config.json vocab_size is " + std::to_string(model_vocab));
}

}  // namespace kestrel
