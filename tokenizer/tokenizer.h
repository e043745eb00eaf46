// The tokenizer of a model directory, behind one interface: SentencePiece (tokenizer.model,
// tokenizer/sentencepiece.h) or Hugging Face's BPE (tokenizer.json, or GPT-2's vocab.json +
// merges.txt; tokenizer/bpe.h), and a streaming detokenizer over either.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace kestrel {

struct TokenizerSettings;

// One streaming decode in progress (StreamDecoder's engine, one per tokenizer kind).
class DecodeStream {
 public:
  virtual ~DecodeStream() = default;
  virtual std::string push(int id) = 0;
  virtual std::string flush() = 0;
};

class Tokenizer {
 public:
  // Loads the tokenizer of model directory `dir`, chosen by the files present as transformers
  // does: tokenizer.json first, then tokenizer.model, then vocab.json + merges.txt. Special
  // tokens and their settings come from tokenizer_config.json (add_bos_token, add_eos_token,
  // bos/eos tokens, added_tokens_decoder) and, for tokenizer.json, its post-processor; the
  // stop ids also from config.json and generation_config.json (eos_token_id: int or list).
  // Throws kestrel::Error naming the file.
  static std::unique_ptr<Tokenizer> load(const std::string& dir);
  // Loads a bare SentencePiece tokenizer.model (defaults: add BOS, eos from the model).
  static std::unique_ptr<Tokenizer> from_model_file(const std::string& path);

  virtual ~Tokenizer() = default;

  // Encodes text: with `with_specials`, the tokens the tokenizer adds around a text (BOS when
  // add_bos(), EOS when add_eos(), what a tokenizer.json post-processor adds), as transformers'
  // add_special_tokens=True does. Special-token strings in the text ("<|im_end|>") become their
  // ids for tokenizer.json and vocab.json tokenizers, as in transformers; SentencePiece encodes
  // them as text. Invalid UTF-8 in `text` is read as U+FFFD (one per maximal invalid subpart).
  std::vector<int> encode(const std::string& text, bool with_specials = true) const;
  // Decodes ids to text. Control (special) tokens such as BOS/EOS produce nothing; ids past the
  // vocabulary are skipped.
  virtual std::string decode(const std::vector<int>& ids) const = 0;

  // Number of ids: one past the largest id of the vocabulary and the added tokens.
  virtual int vocab_size() const = 0;
  // Throws kestrel::Error (naming `dir`) when the ids do not fit a model's vocabulary of
  // `model_vocab` ids (config.json's vocab_size): some would index past its embedding.
  void check_fits(int model_vocab, const std::string& dir) const;
  int bos_id() const { return bos_id_; }
  const std::vector<int>& eos_ids() const { return eos_ids_; }
  bool is_eos(int id) const;
  bool add_bos() const { return !prefix_.empty(); }
  bool add_eos() const { return !suffix_.empty(); }
  // The token string of an id as the tokenizer file spells it ("▁the", "<0x0A>", "Ġthe",
  // "<|eot_id|>"); "" for ids past the vocabulary.
  virtual std::string piece(int id) const = 0;
  // The bytes token `id` adds in the middle of a text, as a grammar matches them
  // (engine/grammar/token_masker.h): byte-level BPE's bytes as the byte decoder gives them,
  // SentencePiece's "▁" as a space and a byte-fallback piece "<0xNN>" as its byte. A token
  // may hold part of a UTF-8 character: the raw bytes, never U+FFFD. "" for tokens that add
  // no text of their own: control (special) tokens, <unk> (its surface is not text the
  // model wrote), unused pieces and ids past the vocabulary.
  virtual std::string token_bytes(int id) const = 0;
  // token_bytes of every id, indexed by id.
  std::vector<std::string> all_token_bytes() const;
  virtual bool is_control(int id) const = 0;  // <s>, </s>, special added tokens
  virtual bool is_byte(int id) const = 0;     // byte-fallback piece <0xNN>
  virtual bool is_unknown(int id) const = 0;  // <unk>
  virtual int piece_to_id(const std::string& piece) const = 0;  // -1 when absent
  // Which implementation: "sentencepiece" or "bpe".
  virtual std::string kind() const = 0;
  // A streaming decode; StreamDecoder wraps it.
  virtual std::unique_ptr<DecodeStream> decode_stream(bool at_text_start) const = 0;

 protected:
  // The ids of `text` without the added specials.
  virtual std::vector<int> encode_text(const std::string& text) const = 0;

  // The id of a token string of tokenizer_config.json (`key` names its field): the
  // tokenizer's own token, else an added_tokens_decoder entry. Throws kestrel::Error naming the
  // file when neither has it (`tokenizer_file` names where the tokenizer's tokens are).
  int config_token_id(const TokenizerSettings& s, const char* key, const std::string& text,
                      const std::string& tokenizer_file) const;
  // Sets bos_id_ (`bos`, or the configs' bos_token_id when -1), eos_ids_ (the configs' stop
  // ids, then the tokenizer's own `eos`) and prefix_/suffix_ ([BOS] when add_bos, [eos[0]]
  // when add_eos). Throws naming `dir` when a token to add does not exist.
  void set_special_tokens(const TokenizerSettings& s, int bos, const std::vector<int>& eos,
                          bool add_bos, bool add_eos, const std::string& dir);

  int bos_id_ = -1;
  std::vector<int> eos_ids_;
  std::vector<int> prefix_;  // what encode(with_specials) puts before the text's ids
  std::vector<int> suffix_;  // and after them
};

// Turns generated ids into text as they arrive. push() returns the text that is now final:
// never a partial UTF-8 sequence (the bytes of a character split over tokens are held until
// it completes), with the tokenizer's start-of-text rules (SentencePiece's leading space, a
// Metaspace or Strip decoder) applied the way decode() of the whole sequence would when
// `at_text_start`. Control tokens produce no text; ids past the vocabulary produce nothing
// and change nothing. The concatenated output equals decode() of the whole sequence.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool at_text_start = false)
      : impl_(tok.decode_stream(at_text_start)) {}
  std::string push(int id) { return impl_->push(id); }
  // Whatever is held back (an incomplete UTF-8 sequence becomes U+FFFD).
  std::string flush() { return impl_->flush(); }

 private:
  std::unique_ptr<DecodeStream> impl_;
};

}  // namespace kestrel
