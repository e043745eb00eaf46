#include "tokenizer/sentencepiece.h"

#include <sentencepiece_processor.h>

#include <cstdint>
#include <filesystem>
#include <string_view>

#include <fmt/format.h>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/special_tokens.h"
#include "tokenizer/utf8.h"

namespace kestrel {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Decodes the leading bytes of `bytes` that are final and erases them, as SentencePiece's
// DecodeUTF8 does: every byte that does not start a complete valid character costs exactly
// one U+FFFD. When `final` is false, a trailing prefix that may still complete a character
// stays in `bytes`; anything else is already known to decode to U+FFFD whatever follows, so
// holding it would only delay the output.
std::string drain_bytes(std::string& bytes, bool final) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    std::string_view rest = std::string_view(bytes).substr(i);
    if (size_t n = utf8::char_len(rest)) {
      out.append(rest.substr(0, n));
      i += n;
    } else if (!final && utf8::incomplete_char(rest)) {
      break;
    } else {
      out.append(utf8::kReplacement);
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
  const int b = utf8::byte_token(piece);
  KESTREL_CHECK(b >= 0, fmt::format("byte piece \"{}\" is not of the form <0xNN>", piece));
  return static_cast<uint8_t>(b);
}

}  // namespace

// Mirrors SentencePiece's Decode one piece at a time: a run of byte pieces is decoded as one
// byte string when a non-byte piece (control tokens included) or the end closes it, and the
// leading space of a piece is dropped while the decoded text is still empty (see
// probe_text_start for the variants).
class SentencePieceStream final : public DecodeStream {
 public:
  SentencePieceStream(const SentencePieceTokenizer& tok, bool at_text_start)
      : tok_(&tok), at_start_(at_text_start) {}

  std::string push(int id) override {
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

  std::string flush() override {
    std::string out = drain_bytes(pending_, /*final=*/true);
    if (!out.empty()) at_start_ = false;
    return out;
  }

 private:
  const SentencePieceTokenizer* tok_;
  bool at_start_;
  std::string pending_;  // bytes of an incomplete UTF-8 sequence
};

SentencePieceTokenizer::SentencePieceTokenizer()
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::from_model_file(
    const std::string& path) {
  // Read here rather than by the library, which would block on a FIFO.
  const std::string bytes = read_regular_file(path);
  std::unique_ptr<SentencePieceTokenizer> tok(new SentencePieceTokenizer());
  const auto status = tok->sp_->LoadFromSerializedProto(bytes);
  KESTREL_CHECK(status.ok(), fmt::format("{} is not a SentencePiece model (it does not parse as "
                                         "one)", path));
  tok->bos_id_ = tok->sp_->bos_id();
  // A model without a BOS piece cannot have one prepended.
  if (tok->bos_id_ >= 0) tok->prefix_ = {tok->bos_id_};
  if (tok->sp_->eos_id() >= 0) tok->eos_ids_ = {tok->sp_->eos_id()};
  // The surface of <unk> lives in the model's trainer spec, which the installed headers do
  // not expose; decoding <unk> alone yields it.
  if (tok->sp_->unk_id() >= 0) tok->unk_surface_ = tok->sp_->DecodeIds({tok->sp_->unk_id()});
  tok->probe_text_start();
  return tok;
}

// The leading-space rule of SentencePiece's decoder hangs on normalizer settings that the
// installed headers do not expose (add_dummy_prefix, remove_extra_whitespaces) and has
// changed between releases, so the stream decoder asks the decoder itself.
void SentencePieceTokenizer::probe_text_start() {
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

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::load(const std::string& dir) {
  const fs::path root(dir);
  const fs::path model_path = root / "tokenizer.model";
  auto tok = from_model_file(model_path.string());
  const TokenizerSettings s = read_tokenizer_settings(root);

  // The tokenizer's own special tokens: the SentencePiece model's, unless tokenizer_config.json
  // names others.
  int bos = tok->bos_id_;
  std::vector<int> eos = tok->eos_ids_;
  if (s.bos_token) bos = tok->config_token_id(s, "bos_token", *s.bos_token, model_path.string());
  if (s.eos_token)
    eos = {tok->config_token_id(s, "eos_token", *s.eos_token, model_path.string())};
  tok->set_special_tokens(s, bos, eos, s.add_bos_token.value_or(true),
                          s.add_eos_token.value_or(false), dir);
  return tok;
}

std::vector<int> SentencePieceTokenizer::encode_text(const std::string& text) const {
  std::vector<int> pieces;
  const auto status = sp_->Encode(text, &pieces);
  KESTREL_CHECK(status.ok(), fmt::format("tokenizer: cannot encode text ({})", status.message()));
  return pieces;
}

std::string SentencePieceTokenizer::decode(const std::vector<int>& ids) const {
  // SentencePiece rejects the whole sequence for one id it does not know (a model whose
  // embedding is padded past the vocabulary can sample one), so those ids are dropped.
  std::vector<int> known;
  known.reserve(ids.size());
  const int n = vocab_size();
  for (int id : ids)
    if (id >= 0 && id < n) known.push_back(id);
  return sp_->DecodeIds(known);
}

int SentencePieceTokenizer::vocab_size() const { return sp_->GetPieceSize(); }

std::string SentencePieceTokenizer::piece(int id) const {
  if (id < 0 || id >= vocab_size()) return "";
  return sp_->IdToPiece(id);
}

std::string SentencePieceTokenizer::token_bytes(int id) const {
  if (id < 0 || id >= vocab_size() || sp_->IsControl(id) || sp_->IsUnknown(id) || sp_->IsUnused(id))
    return "";
  if (sp_->IsByte(id)) return std::string(1, static_cast<char>(piece_byte(sp_->IdToPiece(id))));
  // Mid-text, so the leading "▁" is a space (only a text's first piece may lose it).
  return spaces_for_symbols(sp_->IdToPiece(id));
}

bool SentencePieceTokenizer::is_control(int id) const {
  return id >= 0 && id < vocab_size() && sp_->IsControl(id);
}

bool SentencePieceTokenizer::is_byte(int id) const {
  return id >= 0 && id < vocab_size() && sp_->IsByte(id);
}

bool SentencePieceTokenizer::is_unknown(int id) const {
  return id >= 0 && id < vocab_size() && sp_->IsUnknown(id);
}

int SentencePieceTokenizer::piece_to_id(const std::string& piece) const {
  // SentencePiece answers <unk>'s id for pieces it does not have.
  const int id = sp_->PieceToId(piece);
  return id >= 0 && sp_->IdToPiece(id) == piece ? id : -1;
}

std::unique_ptr<DecodeStream> SentencePieceTokenizer::decode_stream(bool at_text_start) const {
  return std::make_unique<SentencePieceStream>(*this, at_text_start);
}

}  // namespace kestrel
