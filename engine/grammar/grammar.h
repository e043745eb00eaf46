// Grammars for structured output: llama.cpp's GBNF text compiled into flat rules, and the
// incremental matcher that follows a generation byte by byte (docs/grammar.md).
//
// A Grammar is immutable once compiled and shared by every sequence that uses it. A
// GrammarState is one sequence's position in it: the set of parse stacks that are still alive
// (llama.cpp's stack-of-positions recognizer), plus the bytes of a code point not yet complete.
// Copying a state copies a few small vectors, so a token can be tried on a copy without
// committing it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kestrel::grammar {

// A set of Unicode code points: sorted, disjoint, inclusive ranges, with the ASCII part also as
// a bitmap because nearly every byte a JSON grammar tests is ASCII.
struct CharClass {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  uint64_t ascii[2] = {0, 0};

  bool matches(uint32_t cp) const;
  bool intersects(uint32_t lo, uint32_t hi) const;
  // Whether the class holds every non-ASCII code point (true) or none of them (false);
  // anything else is neither.
  bool all_non_ascii() const;
  bool no_non_ascii() const;
};

// One element of a rule's alternative. An alternative is a run of elements ending in kEnd.
struct Element {
  enum Kind : uint8_t { kEnd, kChar, kRule } kind;
  uint32_t arg;  // kChar: index into Grammar::classes(); kRule: the rule's index
};

// Bounds on what a grammar may cost: a compiled grammar is refused past kMaxElements, and a
// single step of the matcher past kMaxStacks live parse stacks (an ambiguity that would
// otherwise grow without bound, e.g. ("a" | "a")* nested).
inline constexpr size_t kMaxElements = 1u << 22;
inline constexpr size_t kMaxStacks = 4096;
inline constexpr size_t kMaxStackWords = 1u << 20;
inline constexpr uint32_t kMaxRepetition = 100000;

class Grammar {
 public:
  // Parses and compiles GBNF text. `root` names the start rule. Throws kestrel::Error with one
  // line "grammar:LINE:COL: what" for syntax errors, and naming the rule for undefined rules,
  // left recursion and sizes past the bounds above.
  static std::shared_ptr<const Grammar> parse(std::string_view text, std::string_view root = "root");

  const std::vector<Element>& elements() const { return elements_; }
  const std::vector<CharClass>& classes() const { return classes_; }
  // The first element of each alternative of rule r.
  const std::vector<uint32_t>& alternatives(uint32_t r) const { return rules_[r].alts; }
  const std::string& rule_name(uint32_t r) const { return rules_[r].name; }
  size_t num_rules() const { return rules_.size(); }
  uint32_t root() const { return root_; }

 private:
  friend class GbnfCompiler;
  struct Rule {
    std::string name;
    std::vector<uint32_t> alts;
  };
  std::vector<Element> elements_;
  std::vector<CharClass> classes_;
  std::vector<Rule> rules_;
  uint32_t root_ = 0;
};

// The bytes of a code point still to come: how many, the value so far, and the range of code
// points the bytes read so far can still become.
struct Utf8Partial {
  uint32_t value = 0;
  uint8_t remaining = 0;  // 0: at a code point boundary
  uint8_t lead = 0;       // the lead byte, which narrows the second byte's range
  uint8_t seen = 0;       // continuation bytes read
};

// A set of parse stacks, flattened: [len, pos0 .. pos(len-1)] per stack, the top last. Each
// position is an element index; a stack's top is always a kChar element, and an empty stack
// means the input so far is a complete match.
struct StackSet {
  std::vector<uint32_t> words;
  uint32_t count = 0;
  Utf8Partial partial;

  void clear() {
    words.clear();
    count = 0;
    partial = {};
  }
  // The same stacks, in any order, and the same partial code point.
  bool same_as(const StackSet& o) const;
  size_t hash() const;
};

// Advances `in` by one byte into `out` (out is overwritten; in and out must differ). Returns
// false when the byte cannot continue any stack; `out` is then unspecified. Strict UTF-8: an
// invalid byte, an overlong form or a surrogate is refused like any byte the grammar refuses.
// A byte that starts or continues a code point is accepted when some stack can still take a
// code point beginning with those bytes. Throws kestrel::Error past kMaxStacks.
bool advance(const Grammar& g, const StackSet& in, uint8_t byte, StackSet& out);

class GrammarState {
 public:
  explicit GrammarState(std::shared_ptr<const Grammar> g);

  // Takes one byte; false (and no change) when the grammar refuses it.
  bool accept_byte(uint8_t b);
  // Takes every byte of s, or none: false (and no change) when some byte is refused.
  bool accept_bytes(std::string_view s);
  // Whether the bytes so far form a complete match of the root rule.
  bool is_accepting() const;
  // Whether no further byte can be taken (the match is complete and nothing may follow).
  bool is_finished() const;

  const Grammar& grammar() const { return *g_; }
  const std::shared_ptr<const Grammar>& grammar_ptr() const { return g_; }
  const StackSet& stacks() const { return set_; }
  bool operator==(const GrammarState& o) const { return g_ == o.g_ && set_.same_as(o.set_); }
  size_t hash() const { return set_.hash(); }

 private:
  std::shared_ptr<const Grammar> g_;
  StackSet set_;
  StackSet tmp_;
};

}  // namespace kestrel::grammar
