// GPTQModel's per-module overrides: the `dynamic` map of a quantization config, from
// module-name regexes to the format of the linears they name.
//
//   "dynamic": { "-:model\\.layers\\.([2-9]\\d*|[1-9]\\d+)\\..*": {},
//                ".*\\.1\\..*": { "bits": 8, "group_size": 32, "desc_act": false } }
//
// A key with the prefix "-:" leaves the modules it matches unquantized (a plain `.weight`);
// "+:" or no prefix overrides bits, group_size, desc_act and/or sym of the base config. As in
// GPTQModel and vLLM, the rules are tried in the file's order against a module's name (e.g.
// "model.layers.3.mlp.up_proj") with Python's re.match, anchored at the start and not at the
// end, and the first rule that matches decides; a module no rule matches has the base format.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kestrel {

// The fields of a quantization config that a rule may override: one linear's format.
struct LinearQuant {
  int bits = 4;
  int group_size = 128;  // -1 = one group per row
  bool desc_act = false;
  bool sym = true;
  bool operator==(const LinearQuant&) const = default;
};

class ModuleRegex;

struct DynamicRule {
  std::string key;    // as written in the file, prefix included
  bool skip = false;  // "-:": the modules it matches stay unquantized
  std::optional<int> bits, group_size;
  std::optional<bool> desc_act, sym;
  std::shared_ptr<const ModuleRegex> regex;  // the key without its prefix, compiled

  // Whether the rule's regex matches `module` as Python's re.match does.
  bool matches(const std::string& module) const;
  // `base` with this rule's overrides applied.
  LinearQuant apply(const LinearQuant& base) const;
  bool operator==(const DynamicRule& o) const;  // same key and overrides
};

// A rule for `key` with no overrides yet: its prefix read, its regex compiled. Throws
// kestrel::Error with one line naming `where` and the key for a malformed regex, with PCRE2's
// message and the offset in the key. (The config reader fills in and checks the overrides.)
DynamicRule dynamic_rule(const std::string& key, const std::string& where);

// The format of each module in `modules` under `base` and `rules`, nullopt where a "-:" rule
// leaves it unquantized; `deciding`, when given, receives the index of the rule that decided
// each module (-1: none matched, the base format). Throws kestrel::Error naming the first rule that matches none of
// `modules` (a rule with no effect is a rule written for another model, or a typo).
std::vector<std::optional<LinearQuant>> resolve_modules(const LinearQuant& base,
                                                        const std::vector<DynamicRule>& rules,
                                                        const std::vector<std::string>& modules,
                                                        const std::string& where,
                                                        std::vector<int>* deciding = nullptr);

// The Python regex `pattern` in PCRE2's syntax, where the two read the same text differently:
// \Z (end of string in Python, before a final newline in PCRE2) becomes \z, and a repeat
// {,n} (Python: {0,n}; PCRE2 10.42: literal text) becomes {0,n}. `offsets[i]` is the offset in
// `pattern` of output character i, to report PCRE2's errors where the user wrote them.
std::string python_regex_to_pcre2(const std::string& pattern, std::vector<size_t>* offsets = nullptr);

}  // namespace kestrel
