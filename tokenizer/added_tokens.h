// Added tokens (special or not) found in a text before the model sees it, as tokenizers'
// AddedVocabulary does: leftmost-longest matches of the tokens' contents, a match whose
// single_word condition fails skipped, lstrip/rstrip taking the whitespace beside a match into
// it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/special_tokens.h"

namespace kestrel {

class AddedTokenMatcher {
 public:
  // One piece of a split text: [start, end) of it, an added token's id or -1 for text.
  struct Segment {
    size_t start, end;
    int id;
  };

  // `patterns[i]` is what finds `tokens[i]` (its content, or its normalized content).
  AddedTokenMatcher(const std::vector<AddedTokenSpec>& tokens,
                    const std::vector<std::string>& patterns);
  AddedTokenMatcher() = default;

  bool empty() const { return tokens_.empty(); }
  // Appends `text` cut into text segments and added tokens, in order. Empty text segments are
  // left out.
  void split(std::string_view text, std::vector<Segment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> next;  // sorted by byte
    int token = -1;                                   // index into tokens_ ending here
  };
  // The longest pattern starting at `pos`: its token index and end, or -1.
  int longest_at(std::string_view text, size_t pos, size_t* end) const;

  std::vector<AddedTokenSpec> tokens_;
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

}  // namespace kestrel
