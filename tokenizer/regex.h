// The regular expressions of tokenizer.json (Split pre-tokenizers, Replace normalizers and
// decoders), run by PCRE2 with its JIT compiler in UTF mode with Unicode properties (\p{L},
// \p{N}, caseless matching by Unicode case folding), as Hugging Face's tokenizers runs them with
// Oniguruma. One difference is removed when compiling: \s is rewritten to Unicode's
// White_Space set, which Oniguruma uses and PCRE2 does not quite (PCRE2 adds U+180E).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct pcre2_real_code_8;

namespace kestrel {

class Regex {
 public:
  // Compiles `pattern`; throws kestrel::Error naming `where` (the file and field) and PCRE2's
  // message when it does not compile.
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [start, end) byte ranges of the non-overlapping matches of the regex in
  // `subject` (valid UTF-8), leftmost first, as tokenizers' find_matches reports them through
  // the onig crate's find_iter: after an empty match the search goes on one character later,
  // the first empty match found after a non-empty one is skipped (wherever it is), and an
  // empty subject has no matches.
  void find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>& out) const;
  // `subject` with every match of find_all replaced by `with` (tokenizers' Replace).
  std::string replace_all(std::string_view subject, std::string_view with) const;

 private:
  pcre2_real_code_8* code_ = nullptr;
  std::string where_;
};

}  // namespace kestrel
