// tokenizer.json's decoder (ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace and
// Sequence), compiled at load into the bytes of each token, so that decoding is a lookup per
// token and a UTF-8 repair at the end.
//
// tokenizers runs its decoders over the list of token strings. The chains real files use act
// on each token alone, except in three ways that this keeps: Metaspace treats the first token
// differently (its replacement characters are dropped rather than made spaces), so each token
// has a second, first-position spelling where that applies; a Strip after Fuse (or after
// ByteLevel, which also fuses) strips the start of the whole text, which the decode applies
// while nothing has been emitted; and with no decoder at all, tokens are joined with spaces.
// Invalid UTF-8 in the joined bytes becomes U+FFFD per maximal invalid subpart, as ByteLevel's
// from_utf8_lossy does. (ByteFallback alone differs on invalid byte runs: tokenizers replaces
// every byte of a run that is not valid as a whole, so a valid character in such a run is lost
// there and kept here; text encoded from valid UTF-8 never makes such a run.)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/regex.h"

namespace kestrel {

class TokenDecoder {
 public:
  // The decoder of tokenizer.json's "decoder" (null: tokens joined with spaces). Throws
  // kestrel::Error naming `where` for kinds and orders it does not support.
  static TokenDecoder from_json(const nlohmann::json& j, const std::string& where);
  // GPT-2's ByteLevel decoder, for vocab.json + merges.txt.
  static TokenDecoder byte_level();
  TokenDecoder();
  ~TokenDecoder();
  TokenDecoder(TokenDecoder&&) noexcept;
  TokenDecoder& operator=(TokenDecoder&&) noexcept;

  // Compiles the bytes of every token; `tokens[id]` is its string ("" for unused ids).
  void build(const std::vector<std::string>& tokens);
  // The bytes of token `id`, spelled for the first position of a decode or for any other.
  std::string_view bytes(int id, bool first) const;
  // The Strip after Fuse: `strip_count` leading `strip_content` characters of the whole text.
  const std::string& strip_content() const { return strip_content_; }
  int strip_count() const { return strip_count_; }

 private:
  struct Step {
    enum Kind { replace, byte_fallback, metaspace, strip, byte_level } kind;
    std::string pattern, content;  // replace (a literal pattern); strip's and metaspace's char
    std::unique_ptr<Regex> regex;  // replace with a Regex pattern
    int start = 0, stop = 0;       // strip
    bool drop_first = false;       // metaspace: prepend_scheme is not "never"
  };
  static void add(const nlohmann::json& j, const std::string& where, TokenDecoder& d);
  std::string run(const std::string& token, bool first) const;

  std::vector<Step> steps_;  // applied to each token
  bool fused_ = false;       // a Fuse or ByteLevel has joined the tokens
  bool join_with_spaces_ = false;
  bool first_differs_ = false;
  std::string strip_content_;
  int strip_count_ = 0;

  std::string blob_;                   // every token's bytes, then every first spelling
  std::vector<uint32_t> offsets_;      // token id -> its bytes in blob_ (n + 1 entries)
  std::vector<uint32_t> first_offsets_;  // the same for first spellings, when they differ
};

}  // namespace kestrel
