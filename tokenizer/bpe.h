// Hugging Face's BPE tokenizers: tokenizer.json (Llama 3, Qwen, Mistral, SentencePiece-style
// conversions) and GPT-2's vocab.json + merges.txt, encoding as transformers does:
//
//   text --(invalid UTF-8 -> U+FFFD)--> added tokens matched in the raw text (special ones,
//   normalized: false) --> each text piece normalized --> added tokens matched in the normalized
//   text (normalized: true) --> each piece pre-tokenized into words --> BPE on each word -->
//   the post-processor's special tokens around it all (encode with specials)
//
// and decoding through the file's decoder (tokenizer/token_decoder.h), special tokens skipped.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/token_decoder.h"
#include "tokenizer/token_map.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

class BpeTokenizer final : public Tokenizer {
 public:
  // <dir>/tokenizer.json with the settings around it (Tokenizer::load). Kinds of normalizer,
  // pre-tokenizer, model, decoder or post-processor that Kestrel does not read are refused
  // with one line naming the file and the kind.
  static std::unique_ptr<BpeTokenizer> load_tokenizer_json(const std::string& dir);
  // <dir>/vocab.json and merges.txt, as transformers' GPT2Tokenizer reads them.
  static std::unique_ptr<BpeTokenizer> load_vocab_merges(const std::string& dir);

  std::string decode(const std::vector<int>& ids) const override;
  int vocab_size() const override { return static_cast<int>(tokens_.size()); }
  std::string piece(int id) const override;
  std::string token_bytes(int id) const override;
  bool is_control(int id) const override;
  bool is_byte(int id) const override;
  bool is_unknown(int id) const override { return id >= 0 && id == unk_id_; }
  int piece_to_id(const std::string& piece) const override;
  std::string kind() const override { return "bpe"; }
  std::unique_ptr<DecodeStream> decode_stream(bool at_text_start) const override;

 protected:
  std::vector<int> encode_text(const std::string& text) const override;

 private:
  friend class BpeStream;
  BpeTokenizer() = default;
  // load_tokenizer_json's work; nlohmann errors it lets through are turned into one line there.
  static std::unique_ptr<BpeTokenizer> read_tokenizer_json(const std::string& dir);

  // The common end of both loaders: the id tables, the added-token matchers and the decoder.
  void finish(std::vector<std::pair<std::string, int>> vocab, std::vector<AddedTokenSpec> added,
              const std::string& where);
  // Pre-tokenizes and runs the model over one normalized piece of text.
  void encode_piece(std::string_view text, bool at_text_start, std::vector<int>& ids) const;

  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  TokenDecoder decoder_;
  AddedTokenMatcher raw_tokens_;         // added tokens matched before normalization
  AddedTokenMatcher normalized_tokens_;  // and after it
  bool prefix_space_ = false;            // GPT2Tokenizer's add_prefix_space: one space first

  std::vector<std::string> tokens_;  // id -> token string ("" for ids nothing uses)
  std::vector<uint8_t> flags_;       // id -> kFlag*
  TokenMap ids_;                     // token string -> id, added tokens first
  int unk_id_ = -1;
  bool byte_fallback_ = false;
};

}  // namespace kestrel
