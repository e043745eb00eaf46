#include "tokenizer/added_tokens.h"

#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

// Rust's regex \w, which tokenizers' single_word test uses: letters, marks, decimal digits,
// letter numbers, connector punctuation and the joiners.
bool is_word_char(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// The last character of valid UTF-8 `s` (non-empty), and where it starts.
char32_t last_char(std::string_view s, size_t* start) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t len;
  *start = i;
  return utf8::decode_char(s.substr(i), &len);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedTokenSpec>& tokens,
                                     const std::vector<std::string>& patterns)
    : tokens_(tokens) {
  nodes_.emplace_back();
  for (size_t t = 0; t < patterns.size(); ++t) {
    const std::string& p = patterns[t];
    if (p.empty()) continue;
    first_byte_[static_cast<unsigned char>(p[0])] = true;
    int node = 0;
    for (unsigned char c : p) {
      auto& next = nodes_[node].next;
      auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, 0),
                                 [](const auto& a, const auto& b) { return a.first < b.first; });
      if (it == next.end() || it->first != c) {
        const int fresh = static_cast<int>(nodes_.size());
        it = next.insert(it, {c, fresh});
        nodes_.emplace_back();  // invalidates `next`, not the value read below
        node = fresh;
      } else {
        node = it->second;
      }
    }
    // Two tokens with one content: the first keeps it.
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int>(t);
  }
}

int AddedTokenMatcher::longest_at(std::string_view text, size_t pos, size_t* end) const {
  int node = 0, best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& next = nodes_[node].next;
    const unsigned char c = static_cast<unsigned char>(text[i]);
    auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, 0),
                               [](const auto& a, const auto& b) { return a.first < b.first; });
    if (it == next.end() || it->first != c) break;
    node = it->second;
    if (nodes_[node].token >= 0) {
      best = nodes_[node].token;
      *end = i + 1;
    }
  }
  return best;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  size_t done = 0;  // text before this is emitted
  size_t pos = 0;   // where the search goes on
  while (pos < text.size()) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    size_t stop = 0;
    const int t = longest_at(text, pos, &stop);
    if (t < 0) {
      ++pos;
      continue;
    }
    const AddedTokenSpec& tok = tokens_[t];
    size_t start = pos;
    pos = stop;  // matches never overlap, kept or not
    if (tok.single_word) {
      size_t at;
      const bool word_before = start > 0 && is_word_char(last_char(text.substr(0, start), &at));
      size_t len;
      const bool word_after =
          stop < text.size() && is_word_char(utf8::decode_char(text.substr(stop), &len));
      if (word_before || word_after) continue;
    }
    if (tok.lstrip) {
      size_t s = start, at;
      while (s > done && utf8::is_whitespace(last_char(text.substr(0, s), &at))) s = at;
      start = s;
    }
    if (tok.rstrip) {
      size_t len;
      while (stop < text.size() && utf8::is_whitespace(utf8::decode_char(text.substr(stop), &len)))
        stop += len;
    }
    if (start > done) out.push_back({done, start, -1});
    out.push_back({start, stop, tok.id});
    done = stop;
    pos = std::max(pos, stop);
  }
  if (done < text.size()) out.push_back({done, text.size(), -1});
}

}  // namespace kestrel
