// tokenizer.json's normalizer: Unicode normalization forms (NFC, NFD, NFKC, NFKD, by
// libutf8proc), Prepend and Replace as SentencePiece-style files use them, and Sequence.
// Anything else is refused when the file is read.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/regex.h"

namespace kestrel {

class Normalizer {
 public:
  // The normalizer of tokenizer.json's "normalizer" (null: none). `where` names the file.
  static Normalizer from_json(const nlohmann::json& j, const std::string& where);
  Normalizer();
  ~Normalizer();
  Normalizer(Normalizer&&) noexcept;
  Normalizer& operator=(Normalizer&&) noexcept;

  bool empty() const { return steps_.empty(); }
  // `text` (valid UTF-8) normalized.
  std::string apply(std::string text) const;

 private:
  struct Step {
    enum Kind { unicode_form, prepend, replace } kind;
    int utf8proc_options = 0;       // unicode_form
    std::string text;               // prepend: what; replace: the literal pattern
    std::string content;            // replace: the replacement
    std::unique_ptr<Regex> regex;   // replace with a Regex pattern
  };
  static void add(const nlohmann::json& j, const std::string& where, std::vector<Step>& steps);
  std::vector<Step> steps_;
};

// Replaces every non-overlapping occurrence of `pattern` (leftmost first) in `text`.
std::string replace_all(std::string_view text, std::string_view pattern, std::string_view with);

}  // namespace kestrel
