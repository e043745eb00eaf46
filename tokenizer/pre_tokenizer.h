// tokenizer.json's pre-tokenizer: what cuts a normalized text into the words BPE runs on.
// Split (the file's regex or a literal, every delimiter behaviour, invert), ByteLevel (with and
// without GPT-2's regex, add_prefix_space), Metaspace (replacement, prepend_scheme, split) and
// Sequence; anything else is refused when the file is read.
//
// ByteLevel's byte-to-character mapping is not applied to the text: the BPE model of a
// byte-level tokenizer holds its vocabulary as raw bytes instead (tokenizer/bpe_model.h), so
// words stay UTF-8 slices of the input.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/regex.h"

namespace kestrel {

// The words of a piece of text, as byte ranges of `text`.
struct Words {
  std::string text;
  std::vector<std::pair<uint32_t, uint32_t>> spans;
  bool lead = false;  // spans[0] starts where the input text starts
};

class PreTokenizer {
 public:
  // The pre-tokenizer of tokenizer.json's "pre_tokenizer" (null: the whole text is one word).
  static PreTokenizer from_json(const nlohmann::json& j, const std::string& where);
  // GPT-2's: ByteLevel with its own regex, for vocab.json + merges.txt.
  static PreTokenizer gpt2(bool add_prefix_space);
  PreTokenizer();
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // Whether a ByteLevel step is present: the model then works on bytes.
  bool byte_level() const { return byte_level_; }
  // Splits `text` into words. `at_text_start`: `text` begins the input (no added token before
  // it), which Metaspace's prepend_scheme "first" asks.
  void split(std::string_view text, bool at_text_start, Words& out) const;

 private:
  enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
  struct Step {
    enum Kind { split, byte_level, metaspace } kind;
    std::unique_ptr<Regex> regex;  // split (a Regex pattern), byte_level with use_regex
    std::string literal;           // split with a String pattern
    Behavior behavior = Behavior::isolated;
    bool invert = false;
    bool add_prefix_space = false;  // byte_level
    std::string replacement;        // metaspace
    enum Prepend { always, first, never } prepend = always;
    bool metaspace_split = true;
  };
  static void add(const nlohmann::json& j, const std::string& where, std::vector<Step>& steps);
  static void split_words(const Step& s, Words& w);
  static void rewrite(const Step& s, Words& w);

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace kestrel
