// The SentencePiece tokenizer (tokenizer.model), with tokenizer_config.json's special tokens.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace sentencepiece { class SentencePieceProcessor; }

namespace kestrel {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Loads <dir>/tokenizer.model and the special-token settings around it (Tokenizer::load).
  static std::unique_ptr<SentencePieceTokenizer> load(const std::string& dir);
  // Loads a bare tokenizer.model (defaults: add BOS, eos from the model).
  static std::unique_ptr<SentencePieceTokenizer> from_model_file(const std::string& path);
  ~SentencePieceTokenizer() override;

  std::string decode(const std::vector<int>& ids) const override;
  int vocab_size() const override;
  std::string piece(int id) const override;
  std::string token_bytes(int id) const override;
  bool is_control(int id) const override;
  bool is_byte(int id) const override;
  bool is_unknown(int id) const override;
  int piece_to_id(const std::string& piece) const override;
  std::string kind() const override { return "sentencepiece"; }
  std::unique_ptr<DecodeStream> decode_stream(bool at_text_start) const override;

  // What <unk> decodes to (SentencePiece's unk_surface, " \u2047 " by default).
  const std::string& unk_surface() const { return unk_surface_; }

 protected:
  std::vector<int> encode_text(const std::string& text) const override;

 private:
  SentencePieceTokenizer();
  void probe_text_start();
  friend class SentencePieceStream;

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  // How the linked SentencePiece decodes the start of a text, probed at load (it depends on
  // the model's normalizer spec and on the library version): whether the leading "▁" of the
  // first piece is dropped, and whether dropping goes on after a bare "▁" piece decoded to
  // nothing.
  bool strips_leading_space_ = true;
  bool strips_after_bare_space_ = false;
  std::string unk_surface_;
};

}  // namespace kestrel
