// The incremental matcher: llama.cpp's stack-of-positions recognizer over a flat grammar.
// Each live parse is a stack of element positions whose top is a character element; taking a
// code point pops the stacks whose top matches it and expands what follows (rule references
// are replaced by their alternatives) until every stack again ends in a character element.
// Stacks are deduplicated so that ambiguous grammars do not multiply them, and capped.
#include <algorithm>
#include <cstring>
#include <string>

#include "base/error.h"
#include "engine/grammar/grammar.h"

namespace kestrel::grammar {

bool CharClass::matches(uint32_t cp) const {
  if (cp < 128) return (ascii[cp >> 6] >> (cp & 63)) & 1;
  for (const auto& [lo, hi] : ranges) {
    if (cp < lo) return false;
    if (cp <= hi) return true;
  }
  return false;
}

bool CharClass::intersects(uint32_t lo, uint32_t hi) const {
  for (const auto& r : ranges) {
    if (r.first <= hi && lo <= r.second) return true;
  }
  return false;
}

bool CharClass::all_non_ascii() const {
  for (const auto& [lo, hi] : ranges) {
    if (lo <= 0x80 && hi >= 0x10FFFF) return true;
  }
  return false;
}

bool CharClass::no_non_ascii() const { return ranges.empty() || ranges.back().second < 0x80; }

namespace {

uint64_t stack_hash(const uint32_t* s, uint32_t len) {
  uint64_t h = 1469598103934665603ull ^ len;
  for (uint32_t i = 0; i < len; ++i) h = (h ^ s[i]) * 1099511628211ull;
  return h;
}

// Expands stacks whose top may be a rule reference into stacks that end in a character
// element (or are empty), appending the new ones to `out`.
class Expander {
 public:
  Expander(const Grammar& g, StackSet& out) : g_(g), el_(g.elements()), out_(out) {}

  void expand(std::vector<uint32_t>& w) {
    if (w.empty() || el_[w.back()].kind == Element::kChar) {
      emit(w);
      return;
    }
    // The grammar has no left recursion, so this depth is bounded by the rules' nesting; a
    // grammar nesting this deep without consuming input is refused rather than overflowing.
    if (++depth_ > 20000) throw Error("grammar: rules nest more than 20000 deep before a character");
    const uint32_t p = w.back();
    w.pop_back();
    const bool cont = el_[p + 1].kind != Element::kEnd;
    if (cont) w.push_back(p + 1);
    for (uint32_t a : g_.alternatives(el_[p].arg)) {
      if (el_[a].kind == Element::kEnd) {
        expand(w);
      } else {
        w.push_back(a);
        expand(w);
        w.pop_back();
      }
    }
    if (cont) w.pop_back();
    w.push_back(p);
    --depth_;
  }

 private:
  void emit(const std::vector<uint32_t>& w) {
    const uint32_t len = static_cast<uint32_t>(w.size());
    if (find(w.data(), len)) return;
    if (out_.count + 1 > kMaxStacks || out_.words.size() + len + 1 > kMaxStackWords) {
      throw Error("grammar: more than " + std::to_string(kMaxStacks) +
                  " parses alive at once: the grammar is too ambiguous");
    }
    const uint32_t off = static_cast<uint32_t>(out_.words.size());
    out_.words.push_back(len);
    out_.words.insert(out_.words.end(), w.begin(), w.end());
    ++out_.count;
    if (out_.count == kLinear) {
      // From here on a hash table: stacks already in `out` go in first.
      table_ = &dedup_table();
      if (++table_->stamp == 0) {
        std::fill(table_->stamps.begin(), table_->stamps.end(), 0u);
        table_->stamp = 1;
      }
      size_t o = 0;
      for (uint32_t i = 0; i < out_.count; ++i) {
        insert(static_cast<uint32_t>(o));
        o += out_.words[o] + 1;
      }
    } else if (table_) {
      insert(off);
    }
  }

  // Whether `out` holds this stack: a linear scan while it holds few (JSON grammars keep a
  // handful), the table past that.
  bool find(const uint32_t* s, uint32_t len) const {
    const uint32_t* d = out_.words.data();
    if (!table_) {
      size_t off = 0;
      for (uint32_t i = 0; i < out_.count; ++i) {
        const uint32_t l = d[off];
        if (l == len && std::memcmp(d + off + 1, s, len * sizeof(uint32_t)) == 0) return true;
        off += l + 1;
      }
      return false;
    }
    for (size_t h = stack_hash(s, len) & kTableMask;; h = (h + 1) & kTableMask) {
      if (table_->stamps[h] != table_->stamp) return false;
      const uint32_t off = table_->offsets[h];
      if (d[off] == len && std::memcmp(d + off + 1, s, len * sizeof(uint32_t)) == 0) return true;
    }
  }

  void insert(uint32_t off) {
    size_t h = stack_hash(out_.words.data() + off + 1, out_.words[off]) & kTableMask;
    while (table_->stamps[h] == table_->stamp) h = (h + 1) & kTableMask;
    table_->stamps[h] = table_->stamp;
    table_->offsets[h] = off;
  }

  static constexpr uint32_t kLinear = 16;
  static constexpr size_t kTableMask = 4 * kMaxStacks - 1;
  struct Table {
    std::vector<uint32_t> stamps = std::vector<uint32_t>(kTableMask + 1, 0);
    std::vector<uint32_t> offsets = std::vector<uint32_t>(kTableMask + 1, 0);
    uint32_t stamp = 0;
  };
  static Table& dedup_table() {
    thread_local Table t;
    return t;
  }
  Table* table_ = nullptr;

  const Grammar& g_;
  const std::vector<Element>& el_;
  StackSet& out_;
  int depth_ = 0;
};

std::vector<uint32_t>& work_buffer() {
  thread_local std::vector<uint32_t> w;
  return w;
}

bool advance_cp(const Grammar& g, const StackSet& in, uint32_t cp, StackSet& out) {
  const auto& el = g.elements();
  const auto& cls = g.classes();
  std::vector<uint32_t>& w = work_buffer();
  Expander ex(g, out);
  const uint32_t* d = in.words.data();
  size_t off = 0;
  for (uint32_t i = 0; i < in.count; ++i) {
    const uint32_t len = d[off];
    const uint32_t* s = d + off + 1;
    off += len + 1;
    if (len == 0) continue;
    const uint32_t top = s[len - 1];
    if (!cls[el[top].arg].matches(cp)) continue;
    w.assign(s, s + len - 1);
    if (el[top + 1].kind != Element::kEnd) w.push_back(top + 1);
    ex.expand(w);
  }
  return out.count > 0;
}

}  // namespace

bool StackSet::same_as(const StackSet& o) const {
  if (count != o.count || words.size() != o.words.size() || partial.remaining != o.partial.remaining ||
      partial.value != o.partial.value || partial.lead != o.partial.lead || partial.seen != o.partial.seen) {
    return false;
  }
  if (words == o.words) return true;
  // Same stacks in another order: each of ours must be among theirs (no duplicates in either).
  size_t off = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t len = words[off];
    bool found = false;
    size_t oo = 0;
    for (uint32_t j = 0; j < o.count && !found; ++j) {
      const uint32_t ol = o.words[oo];
      found = ol == len && std::memcmp(words.data() + off + 1, o.words.data() + oo + 1, len * sizeof(uint32_t)) == 0;
      oo += ol + 1;
    }
    if (!found) return false;
    off += len + 1;
  }
  return true;
}

// (A stack's words are reached as data() + offset, not &words[offset]: an empty stack last in
// the set starts one past the end, which a pointer may name and operator[] may not.)
size_t StackSet::hash() const {
  uint64_t h = 0;  // a sum, so that the order of the stacks does not matter
  size_t off = 0;
  for (uint32_t i = 0; i < count; ++i) {
    h += stack_hash(words.data() + off + 1, words[off]);
    off += words[off] + 1;
  }
  return static_cast<size_t>(h ^ (uint64_t{partial.value} << 8) ^ partial.remaining);
}

bool advance(const Grammar& g, const StackSet& in, uint8_t b, StackSet& out) {
  out.words.clear();
  out.count = 0;
  out.partial = {};
  Utf8Partial p = in.partial;
  if (p.remaining == 0) {
    if (b < 0x80) return advance_cp(g, in, b, out);
    if (b >= 0xC2 && b <= 0xDF) {
      p = {static_cast<uint32_t>(b & 0x1F), 1, b, 0};
    } else if (b >= 0xE0 && b <= 0xEF) {
      p = {static_cast<uint32_t>(b & 0x0F), 2, b, 0};
    } else if (b >= 0xF0 && b <= 0xF4) {
      p = {static_cast<uint32_t>(b & 0x07), 3, b, 0};
    } else {
      return false;
    }
  } else {
    // Unicode's table of well-formed sequences: the second byte's range depends on the lead.
    uint8_t lo = 0x80, hi = 0xBF;
    if (p.seen == 0) {
      if (p.lead == 0xE0) lo = 0xA0;
      if (p.lead == 0xED) hi = 0x9F;
      if (p.lead == 0xF0) lo = 0x90;
      if (p.lead == 0xF4) hi = 0x8F;
    }
    if (b < lo || b > hi) return false;
    p.value = (p.value << 6) | (b & 0x3F);
    --p.remaining;
    ++p.seen;
    if (p.remaining == 0) return advance_cp(g, in, p.value, out);
  }
  // Still inside a code point: go on if some stack can take a code point starting so.
  const int bits = 6 * p.remaining;
  uint32_t lo = p.value << bits;
  uint32_t hi = lo | ((1u << bits) - 1);
  const int total = p.remaining + p.seen;  // continuation bytes in all
  static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  if (lo < kMin[total]) lo = kMin[total];
  if (hi > 0x10FFFF) hi = 0x10FFFF;
  if (p.lead == 0xED && hi > 0xD7FF) hi = 0xD7FF;
  const auto& el = g.elements();
  const auto& cls = g.classes();
  size_t off = 0;
  bool possible = false;
  for (uint32_t i = 0; i < in.count && !possible; ++i) {
    const uint32_t len = in.words[off];
    if (len > 0) possible = cls[el[in.words[off + len]].arg].intersects(lo, hi);
    off += len + 1;
  }
  if (!possible) return false;
  out.words = in.words;
  out.count = in.count;
  out.partial = p;
  return true;
}

GrammarState::GrammarState(std::shared_ptr<const Grammar> g) : g_(std::move(g)) {
  std::vector<uint32_t> w;
  Expander ex(*g_, set_);
  const auto& el = g_->elements();
  for (uint32_t a : g_->alternatives(g_->root())) {
    w.clear();
    if (el[a].kind != Element::kEnd) w.push_back(a);
    ex.expand(w);
  }
}

bool GrammarState::accept_byte(uint8_t b) {
  if (!advance(*g_, set_, b, tmp_)) return false;
  std::swap(set_, tmp_);
  return true;
}

bool GrammarState::accept_bytes(std::string_view s) {
  StackSet cur = set_;
  for (char c : s) {
    if (!advance(*g_, cur, static_cast<uint8_t>(c), tmp_)) return false;
    std::swap(cur, tmp_);
  }
  set_ = std::move(cur);
  return true;
}

bool GrammarState::is_accepting() const {
  if (set_.partial.remaining != 0) return false;
  size_t off = 0;
  for (uint32_t i = 0; i < set_.count; ++i) {
    if (set_.words[off] == 0) return true;
    off += set_.words[off] + 1;
  }
  return false;
}

bool GrammarState::is_finished() const {
  return set_.partial.remaining == 0 && set_.count == 1 && set_.words[0] == 0;
}

}  // namespace kestrel::grammar
