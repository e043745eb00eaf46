// SentencePiece tokenizer of a model directory, and a streaming detokenizer.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace sentencepiece { class SentencePieceProcessor; }

namespace kestrel {

class Tokenizer {
 public:
  // Loads <dir>/tokenizer.model and the special-token settings from tokenizer_config.json
  // (add_bos_token, add_eos_token, bos/eos tokens), config.json and generation_config.json
  // (bos_token_id, eos_token_id: int or list). Throws kestrel::Error naming the file.
  static Tokenizer load(const std::string& dir);
  // Loads a bare tokenizer.model (defaults: add BOS, eos from the model).
  static Tokenizer from_model_file(const std::string& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Encodes text; prepends BOS when add_bos() (and `with_specials`), appends EOS when
  // add_eos() (and `with_specials`).
  std::vector<int> encode(const std::string& text, bool with_specials = true) const;
  // Decodes ids to text (control tokens such as BOS/EOS produce nothing).
  std::string decode(const std::vector<int>& ids) const;

  int vocab_size() const;          // number of pieces
  // Throws kestrel::Error (naming `dir`) when the pieces do not fit a model's vocabulary of
  // `model_vocab` ids (config.json's vocab_size): some ids would index past its embedding.
  void check_fits(int model_vocab, const std::string& dir) const;
  int bos_id() const { return bos_id_; }
  const std::vector<int>& eos_ids() const { return eos_ids_; }
  bool is_eos(int id) const;
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  // The piece text of an id ("▁the", "<0x0A>", "<s>"); "" for ids past the vocabulary.
  std::string piece(int id) const;
  bool is_control(int id) const;   // <s>, </s>, other control pieces
  bool is_byte(int id) const;      // byte-fallback piece <0xNN>
  bool is_unknown(int id) const;   // <unk>
  // What <unk> decodes to (SentencePiece's unk_surface, " \u2047 " by default).
  const std::string& unk_surface() const { return unk_surface_; }
  int piece_to_id(const std::string& piece) const;  // -1 when absent

  const sentencepiece::SentencePieceProcessor& processor() const { return *sp_; }

 private:
  Tokenizer();
  void probe_text_start();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  int bos_id_ = 1;
  std::vector<int> eos_ids_;
  int tokenizer_eos_id_ = -1;  // the EOS that add_eos appends: the tokenizer's own
  // How the linked SentencePiece decodes the start of a text, probed at load (it depends on
  // the model's normalizer spec and on the library version): whether the leading "▁" of the
  // first piece is dropped, and whether dropping goes on after a bare "▁" piece decoded to
  // nothing.
  bool strips_leading_space_ = true;
  bool strips_after_bare_space_ = false;
  friend class StreamDecoder;
  bool add_bos_ = true;
  bool add_eos_ = false;
  std::string unk_surface_;
};

// Turns generated ids into text as they arrive. push() returns the text that is now final:
// never a partial UTF-8 sequence (bytes of byte-fallback pieces are held until the sequence
// completes), with SentencePiece's leading-space rule applied the way decode() of the whole
// sequence would (the space of the first piece of a text is dropped only at the start of a
// text, i.e. when `at_text_start`). Control tokens produce no text of their own but, as in
// decode(), end a run of byte pieces (held bytes become U+FFFD); ids past the vocabulary
// produce nothing and change nothing.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool at_text_start = false);
  std::string push(int id);
  // Whatever is held back (an incomplete UTF-8 sequence becomes U+FFFD).
  std::string flush();

 private:
  const Tokenizer* tok_;
  bool at_start_;
  std::string pending_;  // bytes of an incomplete UTF-8 sequence
};

}  // namespace kestrel
