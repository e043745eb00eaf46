#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/bpe.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/special_tokens.h"

namespace kestrel {

namespace fs = std::filesystem;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& dir) {
  const fs::path root(dir);
  // Present in any form: a tokenizer.json that is a directory is an error, not an absent file.
  auto has = [&](const char* name) { return path_exists((root / name).string()); };
  // transformers prefers the fast tokenizer's tokenizer.json over the slow tokenizer's files.
  if (has("tokenizer.json")) return BpeTokenizer::load_tokenizer_json(dir);
  if (has("tokenizer.model")) return SentencePieceTokenizer::load(dir);
  if (has("vocab.json") && has("merges.txt")) return BpeTokenizer::load_vocab_merges(dir);
  throw Error(fmt::format("{}: no tokenizer (Kestrel reads tokenizer.json, tokenizer.model, or "
                          "vocab.json with merges.txt)",
                          dir));
}

std::unique_ptr<Tokenizer> Tokenizer::from_model_file(const std::string& path) {
  return SentencePieceTokenizer::from_model_file(path);
}

std::vector<int> Tokenizer::encode(const std::string& text, bool with_specials) const {
  if (!with_specials) return encode_text(text);
  std::vector<int> ids = prefix_;
  const std::vector<int> body = encode_text(text);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  return ids;
}

std::vector<std::string> Tokenizer::all_token_bytes() const {
  std::vector<std::string> out(static_cast<size_t>(vocab_size()));
  for (int id = 0; id < vocab_size(); ++id) out[static_cast<size_t>(id)] = token_bytes(id);
  return out;
}

bool Tokenizer::is_eos(int id) const {
  return std::find(eos_ids_.begin(), eos_ids_.end(), id) != eos_ids_.end();
}

void Tokenizer::check_fits(int model_vocab, const std::string& dir) const {
  if (vocab_size() > model_vocab)
    throw Error(fmt::format("{}: the tokenizer has {} tokens but config.json vocab_size is {}", dir,
                            vocab_size(), model_vocab));
}

int Tokenizer::config_token_id(const TokenizerSettings& s, const char* key,
                               const std::string& text, const std::string& tokenizer_file) const {
  int id = piece_to_id(text);
  // Tokens added on top of the tokenizer's vocabulary (ChatML's <|im_end|>, say) have their
  // ids in added_tokens_decoder.
  if (id < 0)
    for (const AddedTokenSpec& t : s.added_tokens_decoder)
      if (t.content == text) {
        id = t.id;
        break;
      }
  KESTREL_CHECK(id >= 0, fmt::format("{}: {} \"{}\" is neither a token of {} nor in "
                                     "added_tokens_decoder",
                                     s.config_path, key, text, tokenizer_file));
  return id;
}

void Tokenizer::set_special_tokens(const TokenizerSettings& s, int bos,
                                   const std::vector<int>& eos, bool add_bos, bool add_eos,
                                   const std::string& dir) {
  eos_ids_ = s.config_eos;
  for (int id : eos)
    if (!is_eos(id)) eos_ids_.push_back(id);
  // BOS is what the tokenizer prepends; the model's configs name it only for tokenizers that
  // do not.
  bos_id_ = bos >= 0 ? bos : (s.config_bos.empty() ? -1 : s.config_bos.front());
  KESTREL_CHECK(!add_bos || bos_id_ >= 0,
                fmt::format("{}: add_bos_token is set but neither the tokenizer nor the configs "
                            "define a BOS token", dir));
  KESTREL_CHECK(!add_eos || !eos.empty(),
                fmt::format("{}: add_eos_token is set but the tokenizer defines no EOS token",
                            dir));
  prefix_.clear();
  suffix_.clear();
  if (add_bos) prefix_.push_back(bos_id_);
  if (add_eos) suffix_.push_back(eos.front());
}

}  // namespace kestrel
