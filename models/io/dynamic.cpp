#define PCRE2_CODE_UNIT_WIDTH 8
#include "models/io/dynamic.h"

#include <pcre2.h>

#include <cctype>

#include <fmt/format.h>

#include "base/error.h"

namespace kestrel {

// A compiled module-name regex. Module names are short and few (seven linears a layer), so
// matching runs the interpreter: no JIT, no per-thread scratch.
class ModuleRegex {
 public:
  ModuleRegex(const std::string& key, size_t prefix, const std::string& where) {
    std::vector<size_t> offsets;
    const std::string pattern = python_regex_to_pcre2(key.substr(prefix), &offsets);
    int code = 0;
    PCRE2_SIZE at = 0;
    // UTF: Python patterns are Unicode text; names are ASCII, where the two agree on \d, \w.
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF,
                          &code, &at, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(code, message, sizeof message);
      const size_t in_key = prefix + (at < offsets.size() ? offsets[at] : key.size() - prefix);
      throw Error(fmt::format("{}: dynamic rule \"{}\": malformed regex: {} at offset {}", where,
                              key, reinterpret_cast<const char*>(message), in_key));
    }
  }
  ~ModuleRegex() { pcre2_code_free(code_); }
  ModuleRegex(const ModuleRegex&) = delete;
  ModuleRegex& operator=(const ModuleRegex&) = delete;

  // Python's re.match: a match that starts at the name's first character, wherever it ends.
  bool match(const std::string& subject) const {
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(),
                               0, PCRE2_ANCHORED, data, nullptr);
    pcre2_match_data_free(data);
    return rc >= 0;
  }

 private:
  pcre2_code* code_ = nullptr;
};

std::string python_regex_to_pcre2(const std::string& p, std::vector<size_t>* offsets) {
  std::string out;
  std::vector<size_t> at;
  auto put = [&](char c, size_t from) {
    out += c;
    at.push_back(from);
  };
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      put(c, i);
      put(!in_class && p[i + 1] == 'Z' ? 'z' : p[i + 1], i + 1);
      ++i;
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
      put(c, i);
      continue;
    }
    if (c == '[') {
      in_class = true;
      put(c, i);
      // A ']' right after '[' or '[^' is a member, not the end of the class.
      for (char member : {'^', ']'})
        if (i + 1 < p.size() && p[i + 1] == member) {
          ++i;
          put(member, i);
        }
      continue;
    }
    if (c == '{' && i + 2 < p.size() && p[i + 1] == ',') {
      size_t j = i + 2;
      while (j < p.size() && std::isdigit((unsigned char)p[j])) ++j;
      if (j > i + 2 && j < p.size() && p[j] == '}') {  // {,n}: Python's {0,n}
        put('{', i);
        put('0', i + 1);
        continue;  // the ",n}" follows as written
      }
    }
    put(c, i);
  }
  if (offsets) *offsets = std::move(at);
  return out;
}

DynamicRule dynamic_rule(const std::string& key, const std::string& where) {
  DynamicRule r;
  r.key = key;
  size_t prefix = 0;
  if (key.starts_with("-:")) {
    r.skip = true;
    prefix = 2;
  } else if (key.starts_with("+:")) {
    prefix = 2;
  }
  r.regex = std::make_shared<const ModuleRegex>(key, prefix, where);
  return r;
}

bool DynamicRule::matches(const std::string& module) const { return regex->match(module); }

LinearQuant DynamicRule::apply(const LinearQuant& base) const {
  LinearQuant q = base;
  if (bits) q.bits = *bits;
  if (group_size) q.group_size = *group_size;
  if (desc_act) q.desc_act = *desc_act;
  if (sym) q.sym = *sym;
  return q;
}

bool DynamicRule::operator==(const DynamicRule& o) const {
  return key == o.key && skip == o.skip && bits == o.bits && group_size == o.group_size &&
         desc_act == o.desc_act && sym == o.sym;
}

std::vector<std::optional<LinearQuant>> resolve_modules(const LinearQuant& base,
                                                        const std::vector<DynamicRule>& rules,
                                                        const std::vector<std::string>& modules,
                                                        const std::string& where,
                                                        std::vector<int>* deciding) {
  std::vector<std::optional<LinearQuant>> out;
  out.reserve(modules.size());
  std::vector<bool> matched(rules.size(), false);
  if (deciding) deciding->assign(modules.size(), -1);
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string& m = modules[i];
    std::optional<LinearQuant> q = base;
    bool decided = false;
    for (size_t r = 0; r < rules.size(); ++r) {
      if (!rules[r].matches(m)) continue;
      matched[r] = true;
      if (!decided) {
        q = rules[r].skip ? std::nullopt : std::optional<LinearQuant>(rules[r].apply(base));
        decided = true;
        if (deciding) (*deciding)[i] = (int)r;
      }
    }
    out.push_back(q);
  }
  for (size_t r = 0; r < rules.size(); ++r)
    KESTREL_CHECK(matched[r],
                  fmt::format("{}: dynamic rule \"{}\" matches no module of this model (first "
                              "module: {})", where, rules[r].key,
                              modules.empty() ? std::string("none") : modules.front()));
  return out;
}

}  // namespace kestrel
