// Jinja2's lexer (jinja2/lexer.py) with the settings transformers renders chat templates with:
// trim_blocks (the newline after %} or #} is dropped), lstrip_blocks (spaces and tabs before a
// {% or {# that starts a line are dropped), keep_trailing_newline=False. {%- and -%} strip all
// whitespace on their side; {%+ and +%} turn lstrip and trim off for one tag.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include "tokenizer/jinja/ast.h"

namespace kestrel::jinja {

std::string located(Pos pos, std::string_view message) {
  return fmt::format("template line {}:{}: {}", pos.line, pos.column, message);
}

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Decodes the code point at s[i] and its length in bytes.
std::pair<char32_t, size_t> code_point_at(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80           ? 1
                   : (b >> 5) == 0x6  ? 2
                   : (b >> 4) == 0xE  ? 3
                   : (b >> 3) == 0x1E ? 4
                                      : 1;
  if (n == 1 || i + n > s.size()) return {b, 1};
  const std::u32string c = decode_utf8(s.substr(i, n));
  return {c.empty() ? b : c[0], n};
}

// Python's str.rstrip(): what {%- and {{- remove before them.
void rstrip_python(std::string& s) {
  std::u32string u = decode_utf8(s);
  while (!u.empty() && is_python_space(u.back())) u.pop_back();
  s = encode_utf8(u);
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Jinja splits the source on \r\n, \r and \n and joins the lines with \n, leaving out the
    // last line break (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t i = 0;
    bool line_starting = true;  // the previous tag ended a line (Jinja's line_starting)
    while (i < src_.size()) {
      const size_t tag = find_tag(i);
      std::string text = src_.substr(i, tag - i);
      const size_t text_start = i;
      if (tag == src_.size()) {
        push_text(std::move(text), text_start);
        break;
      }
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+')
                            ? src_[tag + 2]
                            : 0;
      if (sign == '-') {
        rstrip_python(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: only spaces and tabs between the line's start and the tag.
        const size_t nl = text.rfind('\n');
        const size_t l = nl == std::string::npos ? 0 : nl + 1;
        if ((l > 0 || line_starting) && text.find_first_not_of(" \t", l) == std::string::npos)
          text.erase(l);
      }
      push_text(std::move(text), text_start);
      const size_t body = tag + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        i = lex_comment(tag, body);
      } else if (kind == '%' && is_raw(body)) {
        i = lex_raw(tag);
      } else {
        i = lex_tag(tag, body, kind == '%');
      }
      line_starting = i > 0 && src_[i - 1] == '\n';
    }
    tokens_.push_back({Tok::eof, "", pos_at(src_.size())});
    return std::move(tokens_);
  }

 private:
  Pos pos_at(size_t i) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), i) - 1;
    return {static_cast<int>(it - line_starts_.begin()) + 1, static_cast<int>(i - *it) + 1};
  }

  [[noreturn]] void fail(size_t i, std::string_view message) const {
    throw Error(located(pos_at(i), message));
  }

  size_t find_tag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
        return i;
    }
    return src_.size();
  }

  void push_text(std::string text, size_t at) {
    if (!text.empty()) tokens_.push_back({Tok::text, std::move(text), pos_at(at)});
  }

  // After a tag's closing delimiter: '-' strips all whitespace, '+' keeps everything, and
  // otherwise trim_blocks drops one newline (for %} and #}, not }}).
  size_t after_tag(size_t i, char sign, bool trim) const {
    if (sign == '-') {
      while (i < src_.size()) {
        const auto [c, n] = code_point_at(src_, i);
        if (!is_python_space(c)) break;
        i += n;
      }
    } else if (sign != '+' && trim && i < src_.size() && src_[i] == '\n') {
      ++i;
    }
    return i;
  }

  size_t lex_comment(size_t tag, size_t body) {
    const size_t end = src_.find("#}", body);
    if (end == std::string::npos) fail(tag, "comment '{#' is never closed with '#}'");
    const char sign =
        end > body && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    return after_tag(end + 2, sign, true);
  }

  // {% raw %}...{% endraw %}: the text between is output as written.
  bool is_raw(size_t body) const {
    size_t i = body;
    while (i < src_.size() && (src_[i] == ' ' || src_[i] == '\t' || src_[i] == '\n')) ++i;
    return src_.compare(i, 3, "raw") == 0 && (i + 3 >= src_.size() || !is_name_char(src_[i + 3]));
  }

  // Finds "{% name ... %}" (the sign-aware form of an end tag) from `from`; returns the tag's
  // start, its closing sign and the index after it, or npos.
  struct Found {
    size_t start = std::string::npos, end = 0;
    char open_sign = 0, close_sign = 0;
  };
  Found find_block(size_t from, std::string_view name) const {
    for (size_t t = src_.find("{%", from); t != std::string::npos; t = src_.find("{%", t + 2)) {
      size_t i = t + 2;
      Found f;
      if (i < src_.size() && (src_[i] == '-' || src_[i] == '+')) f.open_sign = src_[i++];
      while (i < src_.size() && (src_[i] == ' ' || src_[i] == '\t' || src_[i] == '\n')) ++i;
      if (src_.compare(i, name.size(), name) != 0) continue;
      i += name.size();
      while (i < src_.size() && (src_[i] == ' ' || src_[i] == '\t' || src_[i] == '\n')) ++i;
      if (i < src_.size() && (src_[i] == '-' || src_[i] == '+')) f.close_sign = src_[i++];
      if (src_.compare(i, 2, "%}") != 0) continue;
      f.start = t;
      f.end = i + 2;
      return f;
    }
    return {};
  }

  size_t lex_raw(size_t tag) {
    const Found open = find_block(tag, "raw");
    if (open.start != tag) fail(tag, "malformed '{% raw %}' tag");
    const Found close = find_block(open.end, "endraw");
    if (close.start == std::string::npos)
      fail(tag, "'{% raw %}' is never closed with '{% endraw %}'");
    size_t begin = open.end;
    if (open.close_sign == '-') begin = after_tag(begin, '-', false);
    std::string text = src_.substr(begin, close.start - begin);
    if (close.open_sign == '-') rstrip_python(text);
    push_text(std::move(text), begin);
    return after_tag(close.end, close.close_sign, true);
  }

  // The tokens of a {% ... %} or {{ ... }} tag, with its delimiters.
  size_t lex_tag(size_t tag, size_t body, bool block) {
    tokens_.push_back(
        {block ? Tok::block_begin : Tok::expr_begin, block ? "{%" : "{{", pos_at(tag)});
    const std::string_view close = block ? "%}" : "}}";
    std::vector<char> brackets;  // an end delimiter inside {...} closes a dict, not the tag
    size_t i = body;
    while (true) {
      while (i < src_.size()) {
        const auto [c, n] = code_point_at(src_, i);
        if (!is_python_space(c)) break;
        i += n;
      }
      if (i >= src_.size())
        fail(tag, fmt::format("'{}' is never closed with '{}'", block ? "{%" : "{{", close));
      if (brackets.empty()) {
        for (char sign : {'-', '+'}) {
          if (src_[i] == sign && src_.compare(i + 1, 2, close) == 0) {
            tokens_.push_back(
                {block ? Tok::block_end : Tok::expr_end, std::string(close), pos_at(i)});
            return after_tag(i + 3, sign, block);
          }
        }
        if (src_.compare(i, 2, close) == 0) {
          tokens_.push_back(
              {block ? Tok::block_end : Tok::expr_end, std::string(close), pos_at(i)});
          return after_tag(i + 2, 0, block);
        }
      }
      i = lex_token(i, brackets);
    }
  }

  size_t lex_token(size_t i, std::vector<char>& brackets) {
    const char c = src_[i];
    const Pos pos = pos_at(i);
    if (is_digit(c)) return lex_number(i);
    if (is_name_start(c)) {
      size_t j = i;
      while (j < src_.size() && is_name_char(src_[j])) ++j;
      tokens_.push_back({Tok::name, src_.substr(i, j - i), pos});
      return j;
    }
    if (c == '\'' || c == '"') return lex_string(i);
    static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
    for (std::string_view op : kTwo) {
      if (src_.compare(i, 2, op) == 0) {
        tokens_.push_back({Tok::op, std::string(op), pos});
        return i + 2;
      }
    }
    if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) == std::string_view::npos)
      fail(i, fmt::format("unexpected character '{}'", c));
    if (c == '(' || c == '[' || c == '{') brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (brackets.empty() || brackets.back() != c) fail(i, fmt::format("unexpected '{}'", c));
      brackets.pop_back();
    }
    tokens_.push_back({Tok::op, std::string(1, c), pos});
    return i + 1;
  }

  // Integers (with _ separators and 0x/0o/0b prefixes) and floats (1.5, 1e3, 1.5e-3). A number
  // right after a dot is an integer: x.0.1 is x[0][1].
  size_t lex_number(size_t i) {
    const Pos pos = pos_at(i);
    const auto digits = [&](size_t j, auto pred) {
      std::string d;
      while (j < src_.size() &&
             (pred(src_[j]) || (src_[j] == '_' && j + 1 < src_.size() && pred(src_[j + 1])))) {
        if (src_[j] != '_') d += src_[j];
        ++j;
      }
      return std::pair{d, j};
    };
    if (src_[i] == '0' && i + 1 < src_.size() &&
        std::string_view("xXoObB").find(src_[i + 1]) != std::string_view::npos) {
      const char p = static_cast<char>(src_[i + 1] | 0x20);
      const int base = p == 'x' ? 16 : p == 'o' ? 8 : 2;
      auto [d, j] = digits(i + 2, [&](char ch) {
        return base == 16 ? std::isxdigit(static_cast<unsigned char>(ch)) != 0
                          : ch >= '0' && ch < '0' + base;
      });
      int64_t v = 0;
      if (d.empty() || std::from_chars(d.data(), d.data() + d.size(), v, base).ec != std::errc())
        fail(i, "malformed number");
      tokens_.push_back({Tok::integer, src_.substr(i, j - i), pos, v});
      return j;
    }
    auto [whole, j] = digits(i, is_digit);
    std::string text = whole;
    bool is_float = false;
    const bool after_dot =
        !tokens_.empty() && tokens_.back().kind == Tok::op && tokens_.back().text == ".";
    if (!after_dot && j + 1 < src_.size() && src_[j] == '.' && is_digit(src_[j + 1])) {
      auto [frac, k] = digits(j + 1, is_digit);
      text += "." + frac;
      j = k;
      is_float = true;
    }
    if (!after_dot && j < src_.size() && (src_[j] == 'e' || src_[j] == 'E')) {
      size_t k = j + 1;
      std::string exp = "e";
      if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) exp += src_[k++];
      if (k < src_.size() && is_digit(src_[k])) {
        auto [e, m] = digits(k, is_digit);
        text += exp + e;
        j = m;
        is_float = true;
      }
    }
    Token t{is_float ? Tok::floating : Tok::integer, src_.substr(i, j - i), pos};
    if (is_float) {
      std::from_chars(text.data(), text.data() + text.size(), t.floating);
    } else if (std::from_chars(text.data(), text.data() + text.size(), t.integer).ec !=
               std::errc()) {
      fail(i, "integer literal too large");
    }
    tokens_.push_back(std::move(t));
    return j;
  }

  // A string literal, decoded as Python decodes Jinja's (unicode-escape): \n \t \r \\ \' \"
  // \a \b \f \v, octal \ooo, \xhh, \uhhhh, \Uhhhhhhhh; a backslash before a newline joins the
  // lines; any other backslash stays as written.
  size_t lex_string(size_t i) {
    const char quote = src_[i];
    const Pos pos = pos_at(i);
    std::string out;
    size_t j = i + 1;
    while (true) {
      if (j >= src_.size()) fail(i, "string literal is never closed");
      const char c = src_[j];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++j;
        continue;
      }
      if (j + 1 >= src_.size()) fail(i, "string literal is never closed");
      const char e = src_[j + 1];
      j += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t v = 0;
          if (j + n > src_.size() ||
              std::from_chars(src_.data() + j, src_.data() + j + n, v, 16).ptr !=
                  src_.data() + j + n)
            fail(j - 2, fmt::format("truncated \\{} escape in string literal", e));
          append_utf8(out, v);
          j += n;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = e - '0';
            for (int k = 0; k < 2 && j < src_.size() && src_[j] >= '0' && src_[j] <= '7'; ++k)
              v = v * 8 + (src_[j++] - '0');
            append_utf8(out, v);
          } else if (e == 'N') {
            fail(j - 2, "\\N{...} escapes are not supported");
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    tokens_.push_back({Tok::string, std::move(out), pos});
    return j + 1;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(source).run(); }

}  // namespace kestrel::jinja
