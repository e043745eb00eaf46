// The GBNF parser and compiler: llama.cpp's grammar text (grammars/README.md there) into the
// flat rules of grammar.h. Groups and repetitions become generated rules, as llama.cpp does,
// so that the matcher only ever sees characters, rule references and alternative ends:
//   x*      R ::= x R |            (right recursion: the stack does not grow as x repeats)
//   x+      x R
//   x?      R ::= x |
//   x{m,n}  m copies of x, then R1 ::= x R2 | , ... nested so that each count has one parse
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/error.h"
#include "engine/grammar/grammar.h"

namespace kestrel::grammar {

namespace {

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

void normalize(CharClass& c) {
  auto& r = c.ranges;
  std::sort(r.begin(), r.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (const auto& x : r) {
    if (!merged.empty() && x.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, x.second);
    } else {
      merged.push_back(x);
    }
  }
  r = std::move(merged);
  c.ascii[0] = c.ascii[1] = 0;
  for (const auto& [lo, hi] : r) {
    for (uint32_t cp = lo; cp <= hi && cp < 128; ++cp) c.ascii[cp >> 6] |= uint64_t{1} << (cp & 63);
  }
}

CharClass complement(const CharClass& c) {
  CharClass out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : c.ranges) {
    if (lo > next) out.ranges.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= 0x10FFFF) out.ranges.push_back({next, 0x10FFFF});
  normalize(out);
  return out;
}

}  // namespace

class GbnfCompiler {
 public:
  explicit GbnfCompiler(std::string_view text) : s_(text) {}

  std::shared_ptr<const Grammar> run(std::string_view root) {
    skip_space(true);
    while (pos_ < s_.size()) {
      parse_rule();
      skip_space(true);
    }
    for (size_t r = 0; r < rules_.size(); ++r) {
      if (!rules_[r].defined) fail_at(rules_[r].first_use, "undefined rule '" + rules_[r].name + "'");
    }
    auto it = ids_.find(std::string(root));
    if (it == ids_.end()) throw Error("grammar: no rule '" + std::string(root) + "' (the start rule)");
    auto g = std::make_shared<Grammar>();
    flatten(*g);
    g->root_ = it->second;
    check_left_recursion(*g);
    return g;
  }

 private:
  struct RuleDraft {
    std::string name;
    std::string origin;  // the user's rule a generated rule came from
    bool defined = false;
    bool generated = false;
    size_t first_use = 0;
    std::vector<std::vector<Element>> alts;
  };

  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < at && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else if ((static_cast<unsigned char>(s_[i]) & 0xC0) != 0x80) {
        ++col;  // columns count characters, not bytes
      }
    }
    throw Error("grammar:" + std::to_string(line) + ":" + std::to_string(col) + ": " + what);
  }
  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }

  char peek(size_t ahead = 0) const { return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : '\0'; }
  bool at_end() const { return pos_ >= s_.size(); }

  // Spaces, tabs and comments; newlines too when `newlines` (inside groups, after "::=").
  void skip_space(bool newlines) {
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string parse_name() {
    size_t start = pos_;
    while (pos_ < s_.size() && is_name_char(s_[pos_])) ++pos_;
    if (pos_ == start) fail("expected a rule name");
    return std::string(s_.substr(start, pos_ - start));
  }

  uint32_t rule_id(const std::string& name, size_t at) {
    auto it = ids_.find(name);
    if (it != ids_.end()) return it->second;
    uint32_t id = static_cast<uint32_t>(rules_.size());
    RuleDraft d;
    d.name = name;
    d.origin = name;
    d.first_use = at;
    rules_.push_back(std::move(d));
    ids_.emplace(name, id);
    return id;
  }

  uint32_t new_rule(std::vector<std::vector<Element>> alts) {
    uint32_t id = static_cast<uint32_t>(rules_.size());
    RuleDraft d;
    d.name = current_ + "/" + std::to_string(++generated_);
    d.origin = current_;
    d.defined = d.generated = true;
    for (const auto& a : alts) count(a.size() + 1);
    d.alts = std::move(alts);
    rules_.push_back(std::move(d));
    return id;
  }

  void count(size_t n) {
    total_ += n;
    if (total_ > kMaxElements) {
      fail("the grammar compiles to more than " + std::to_string(kMaxElements) +
           " elements (repetition counts too large)");
    }
  }

  void parse_rule() {
    size_t at = pos_;
    std::string name = parse_name();
    uint32_t id = rule_id(name, at);
    if (rules_[id].defined) fail_at(at, "rule '" + name + "' is defined twice");
    rules_[id].defined = true;
    current_ = name;
    skip_space(false);
    if (s_.substr(pos_, 3) != "::=") fail("expected '::='");
    pos_ += 3;
    skip_space(true);
    auto alts = parse_alternates(false);
    for (const auto& a : alts) count(a.size() + 1);
    rules_[id].alts = std::move(alts);
    if (!at_end() && peek() != '\n') fail(std::string("unexpected '") + peek() + "'");
  }

  std::vector<std::vector<Element>> parse_alternates(bool nested) {
    std::vector<std::vector<Element>> alts;
    alts.push_back(parse_sequence(nested));
    for (;;) {
      if (!nested) {
        // At the top level a rule ends at its line's end, unless the next line goes on with "|".
        size_t save = pos_;
        skip_space(true);
        if (peek() != '|') {
          pos_ = save;
          break;
        }
      }
      if (peek() != '|') break;
      ++pos_;
      skip_space(true);
      alts.push_back(parse_sequence(nested));
    }
    return alts;
  }

  // One code point of the grammar text, decoding escapes.
  uint32_t parse_char() {
    size_t at = pos_;
    unsigned char c = static_cast<unsigned char>(s_[pos_]);
    if (c == '\\') {
      ++pos_;
      if (at_end()) fail("unfinished escape");
      char e = s_[pos_++];
      switch (e) {
        case 'n': return '\n';
        case 't': return '\t';
        case 'r': return '\r';
        case '\\': return '\\';
        case '"': return '"';
        case '[': return '[';
        case ']': return ']';
        case '-': return '-';
        case '^': return '^';
        case '/': return '/';
        case 'x': return parse_hex(2, at);
        case 'u': return parse_hex(4, at);
        case 'U': return parse_hex(8, at);
        default: fail_at(at, std::string("unknown escape '\\") + e + "'");
      }
    }
    if (c < 0x80) {
      ++pos_;
      return c;
    }
    int n = c >= 0xF0 && c <= 0xF4 ? 3 : c >= 0xE0 && c <= 0xEF ? 2 : c >= 0xC2 && c <= 0xDF ? 1 : -1;
    if (n < 0 || pos_ + static_cast<size_t>(n) >= s_.size()) fail("invalid UTF-8");
    uint32_t cp = c & (0x3F >> n);
    for (int i = 1; i <= n; ++i) {
      unsigned char d = static_cast<unsigned char>(s_[pos_ + i]);
      if ((d & 0xC0) != 0x80) fail("invalid UTF-8");
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("invalid UTF-8");
    pos_ += n + 1;
    return cp;
  }

  uint32_t parse_hex(int digits, size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      char h = peek();
      int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
              : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) fail("expected " + std::to_string(digits) + " hex digits in escape");
      v = v * 16 + static_cast<uint32_t>(d);
      ++pos_;
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) fail_at(at, "escape is not a Unicode scalar value");
    return v;
  }

  Element char_elem(CharClass c) {
    normalize(c);
    classes_.push_back(std::move(c));
    return {Element::kChar, static_cast<uint32_t>(classes_.size() - 1)};
  }

  Element single(uint32_t cp) {
    CharClass c;
    c.ranges.push_back({cp, cp});
    return char_elem(std::move(c));
  }

  uint64_t parse_count() {
    size_t start = pos_;
    uint64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      v = v * 10 + static_cast<uint64_t>(peek() - '0');
      if (v > kMaxRepetition) fail_at(start, "repetition count over " + std::to_string(kMaxRepetition));
      ++pos_;
    }
    if (pos_ == start) fail("expected a number");
    return v;
  }

  // Replaces seq[start..] by its repetition min..max times (max < 0: unbounded).
  void repeat(std::vector<Element>& seq, size_t start, uint64_t min, int64_t max) {
    std::vector<Element> unit(seq.begin() + static_cast<std::ptrdiff_t>(start), seq.end());
    seq.resize(start);
    if (unit.empty()) fail("nothing to repeat");
    Element one = unit.size() == 1 ? unit[0] : Element{Element::kRule, new_rule({unit})};
    count(min);
    for (uint64_t i = 0; i < min; ++i) seq.push_back(one);
    if (max < 0) {
      uint32_t r = new_rule({});
      Element self{Element::kRule, r};
      rules_[r].alts = {{one, self}, {}};
      count(3);
      seq.push_back(self);
      return;
    }
    uint64_t extra = static_cast<uint64_t>(max) - min;
    if (extra == 0) return;
    // Innermost first: R_extra ::= x | ; R_k ::= x R_{k+1} | .
    uint32_t inner = new_rule({{one}, {}});
    for (uint64_t k = 1; k < extra; ++k) inner = new_rule({{one, Element{Element::kRule, inner}}, {}});
    seq.push_back({Element::kRule, inner});
  }

  std::vector<Element> parse_sequence(bool nested) {
    std::vector<Element> seq;
    size_t last = seq.size();  // where the last repeatable unit starts
    bool have_unit = false;
    for (;;) {
      char c = peek();
      if (at_end() || c == '|' || c == ')' || c == '\n') break;
      size_t at = pos_;
      if (c == '"') {
        ++pos_;
        last = seq.size();
        while (peek() != '"') {
          if (at_end() || peek() == '\n') fail_at(at, "unterminated string");
          seq.push_back(single(parse_char()));
        }
        ++pos_;
        count(1);
        have_unit = true;
      } else if (c == '[') {
        ++pos_;
        CharClass cls;
        bool negated = peek() == '^';
        if (negated) ++pos_;
        while (peek() != ']') {
          if (at_end()) fail("expected ']'");
          uint32_t lo = parse_char();
          uint32_t hi = lo;
          if (peek() == '-' && peek(1) != ']' && pos_ + 1 < s_.size()) {
            ++pos_;
            hi = parse_char();
            if (hi < lo) fail_at(at, "character range is backwards");
          }
          cls.ranges.push_back({lo, hi});
        }
        ++pos_;
        normalize(cls);
        last = seq.size();
        seq.push_back(char_elem(negated ? complement(cls) : cls));
        count(1);
        have_unit = true;
      } else if (c == '.') {
        ++pos_;
        CharClass any;
        any.ranges.push_back({0, 0x10FFFF});
        last = seq.size();
        seq.push_back(char_elem(any));
        count(1);
        have_unit = true;
      } else if (c == '(') {
        ++pos_;
        skip_space(true);
        auto alts = parse_alternates(true);
        if (peek() != ')') fail("expected ')'");
        ++pos_;
        last = seq.size();
        seq.push_back({Element::kRule, new_rule(std::move(alts))});
        have_unit = true;
      } else if (is_name_char(c)) {
        std::string name = parse_name();
        // "name ::=" here means the previous rule ended without a newline.
        size_t save = pos_;
        skip_space(false);
        if (s_.substr(pos_, 3) == "::=") fail_at(at, "expected a newline before rule '" + name + "'");
        pos_ = save;
        last = seq.size();
        seq.push_back({Element::kRule, rule_id(name, at)});
        count(1);
        have_unit = true;
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (!have_unit) fail(std::string("'") + c + "' repeats nothing");
        ++pos_;
        if (c == '*') {
          repeat(seq, last, 0, -1);
        } else if (c == '+') {
          repeat(seq, last, 1, -1);
        } else if (c == '?') {
          repeat(seq, last, 0, 1);
        } else {
          skip_space(nested);
          uint64_t min = parse_count();
          int64_t max = static_cast<int64_t>(min);
          skip_space(nested);
          if (peek() == ',') {
            ++pos_;
            skip_space(nested);
            max = peek() == '}' ? -1 : static_cast<int64_t>(parse_count());
            skip_space(nested);
          }
          if (peek() != '}') fail("expected '}'");
          ++pos_;
          if (max >= 0 && static_cast<uint64_t>(max) < min) fail_at(at, "repetition {m,n} with n < m");
          repeat(seq, last, min, max);
        }
        have_unit = false;  // x** is refused, as in llama.cpp
      } else {
        fail(std::string("unexpected '") + c + "'");
      }
      skip_space(nested);
    }
    return seq;
  }

  void flatten(Grammar& g) {
    g.classes_ = std::move(classes_);
    g.rules_.resize(rules_.size());
    g.elements_.reserve(total_ + rules_.size());
    for (size_t r = 0; r < rules_.size(); ++r) {
      g.rules_[r].name = rules_[r].name;
      for (const auto& alt : rules_[r].alts) {
        g.rules_[r].alts.push_back(static_cast<uint32_t>(g.elements_.size()));
        g.elements_.insert(g.elements_.end(), alt.begin(), alt.end());
        g.elements_.push_back({Element::kEnd, 0});
      }
    }
  }

  // A rule that can reach itself before consuming a character would make the matcher's
  // expansion loop forever (llama.cpp refuses it the same way).
  void check_left_recursion(const Grammar& g) {
    const size_t n = rules_.size();
    std::vector<char> nullable(n, 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (const auto& alt : rules_[r].alts) {
          bool all = std::all_of(alt.begin(), alt.end(), [&](const Element& e) {
            return e.kind == Element::kRule && nullable[e.arg];
          });
          if (all) {
            nullable[r] = 1;
            changed = true;
            break;
          }
        }
      }
    }
    std::vector<std::vector<uint32_t>> edges(n);
    for (size_t r = 0; r < n; ++r) {
      for (const auto& alt : rules_[r].alts) {
        for (const Element& e : alt) {
          if (e.kind != Element::kRule) break;
          edges[r].push_back(e.arg);
          if (!nullable[e.arg]) break;
        }
      }
    }
    // Iterative DFS: 0 unseen, 1 on the path, 2 done.
    std::vector<char> color(n, 0);
    std::vector<std::pair<uint32_t, size_t>> path;
    for (uint32_t start = 0; start < n; ++start) {
      if (color[start]) continue;
      path.push_back({start, 0});
      color[start] = 1;
      while (!path.empty()) {
        auto& [r, i] = path.back();
        if (i < edges[r].size()) {
          uint32_t next = edges[r][i++];
          if (color[next] == 1) {
            const RuleDraft& d = rules_[next];
            throw Error("grammar: rule '" + d.origin + "' is left-recursive: it can reach itself" +
                        (d.generated ? " (through a group or repetition that can match nothing)" : "") +
                        " before matching a character");
          }
          if (color[next] == 0) {
            color[next] = 1;
            path.push_back({next, 0});
          }
        } else {
          color[r] = 2;
          path.pop_back();
        }
      }
    }
    (void)g;
  }

  std::string_view s_;
  size_t pos_ = 0;
  std::vector<RuleDraft> rules_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<CharClass> classes_;
  std::string current_;
  uint32_t generated_ = 0;
  size_t total_ = 0;
};

std::shared_ptr<const Grammar> Grammar::parse(std::string_view text, std::string_view root) {
  return GbnfCompiler(text).run(root);
}

}  // namespace kestrel::grammar
