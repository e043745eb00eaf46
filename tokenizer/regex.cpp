#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include <fmt/format.h>

#include "base/error.h"
#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

// Unicode's White_Space characters, as the inside of a character class.
constexpr std::string_view kWhiteSpace =
    "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

// `pattern` with \s spelled as White_Space (and \S, outside classes, as its complement).
std::string white_space_as_unicode(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      if (e == 'Q') {  // \Q...\E is literal text
        const size_t end = pattern.find("\\E", i + 2);
        const size_t stop = end == std::string::npos ? pattern.size() : end + 2;
        out.append(pattern, i, stop - i);
        i = stop - 1;
      } else if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
        ++i;
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpace) + "]";
        ++i;
      } else {
        out += c;
        out += e;
        ++i;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t end = pattern.find(":]", i + 2);  // a POSIX class [:alpha:]
      if (end != std::string::npos) {
        out.append(pattern, i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

// A thread's match state: match data for the whole match, and a JIT stack larger than the
// default 32 KiB so that long runs of one class (a megabyte of spaces) cannot exhaust it.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  MatchScratch() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where) : where_(where) {
  const std::string p = white_space_as_unicode(pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP,
                        &err, &offset, nullptr);
  if (!code_)
    throw Error(fmt::format("{}: regex \"{}\" does not compile at offset {} ({})", where, pattern,
                            offset, pcre2_message(err)));
  // Without a JIT (an unsupported CPU) PCRE2 interprets the pattern: slower, same matches.
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() { pcre2_code_free(code_); }

void Regex::find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>& out) const {
  if (subject.empty()) return;  // tokenizers' find_matches: no match in an empty text
  thread_local MatchScratch scratch;
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  // The onig crate's FindMatches: set by a non-empty match, cleared by the next empty match,
  // which it drops. (Empty matches cannot loop: each moves the search one character on.)
  bool skip_next_empty = false;
  while (start <= subject.size()) {
    const int rc = pcre2_match(code_, s, subject.size(), start, PCRE2_NO_UTF_CHECK, scratch.data,
                               scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0)
      throw Error(fmt::format("{}: regex match failed ({})", where_, pcre2_message(rc)));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.data);
    const size_t a = ov[0], b = ov[1];
    if (b > a) {
      out.emplace_back(a, b);
      start = b;
      skip_next_empty = true;
      continue;
    }
    if (!skip_next_empty) out.emplace_back(a, b);
    skip_next_empty = false;
    if (b >= subject.size()) break;
    size_t len = 0;
    utf8::decode_char(subject.substr(b), &len);
    start = b + len;
  }
}

std::string Regex::replace_all(std::string_view subject, std::string_view with) const {
  std::vector<std::pair<size_t, size_t>> m;
  find_all(subject, m);
  std::string out;
  size_t i = 0;
  for (auto [a, b] : m) {
    out.append(subject.substr(i, a - i));
    out.append(with);
    i = b;
  }
  out.append(subject.substr(i));
  return out;
}

}  // namespace kestrel
