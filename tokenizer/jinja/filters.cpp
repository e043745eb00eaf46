// Jinja2's built-in filters and tests (jinja2/filters.py, jinja2/tests.py) with their
// parameters and defaults, and transformers' tojson, which replaces Jinja's: json.dumps with
// ensure_ascii=False and the keys in their order. Filters Jinja returns generators from (map,
// select, unique...) return iterators (jinja/value.h).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>

#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/builtins.h"

namespace kestrel::jinja {
namespace {

const Value kNone{None{}};
const Value kFalse{false};

// ---- helpers ----

// A keyword-only parameter.
const Value& keyword(const Args& a, std::string_view name, const Value& fallback) {
  return param(a, SIZE_MAX, name, fallback);
}

bool bool_param(const Args& a, size_t i, std::string_view name, bool fallback) {
  const Value* v = a.get(i, name);
  return v ? truthy(*v) : fallback;
}

std::string string_param(const Args& a, size_t i, std::string_view name, std::string fallback) {
  const Value* v = a.get(i, name);
  if (!v || v->is_none()) return fallback;
  return to_str(*v);
}

// Jinja's make_attrgetter: "a.b.0" looks up a, then b, then item 0.
Value attribute_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool index = !part.empty() && std::all_of(part.begin(), part.end(),
                                                    [](char c) { return c >= '0' && c <= '9'; });
    v = index ? get_item(v, Value(static_cast<int64_t>(std::stoll(part))))
              : get_item(v, Value(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

// The sort key of filters with case_sensitive=False: strings compare lowercased.
Value sort_key(const Value& item, const Value& attribute, bool case_sensitive) {
  Value key = attribute.is_none() || attribute.is_undefined() ? item
              : attribute.is_int()                            ? get_item(item, attribute)
                                   : attribute_path(item, to_str(attribute));
  if (!case_sensitive && key.is_string()) key = Value(to_lower(key.as_string()));
  return key;
}

size_t length(const Value& v) {
  if (v.is_undefined()) return 0;
  if (v.is_string()) return decode_utf8(v.as_string()).size();
  if (v.is_list() && !v.is_iterator()) return v.as_list().items.size();
  if (v.is_dict()) return v.as_dict().items.size();
  throw EvalError(fmt::format("object of type '{}' has no len()", type_name(v)));
}

// Python's int() and float() of a string: surrounding whitespace and _ between digits allowed.
std::optional<std::string> number_text(const std::string& s) {
  std::string t = str_strip(s, nullptr, true, true);
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '_') {
      if (i == 0 || i + 1 == t.size() || !std::isxdigit(static_cast<unsigned char>(t[i - 1])) ||
          !std::isxdigit(static_cast<unsigned char>(t[i + 1])))
        return std::nullopt;
      continue;
    }
    out += t[i];
  }
  if (out.empty()) return std::nullopt;
  return out;
}

std::optional<double> parse_float(const std::string& s) {
  auto t = number_text(s);
  if (!t) return std::nullopt;
  std::string x = *t;
  const bool neg = x[0] == '-';
  if (x[0] == '+' || x[0] == '-') x.erase(0, 1);
  const std::string lower = to_lower(x);
  if (lower == "inf" || lower == "infinity") return neg ? -HUGE_VAL : HUGE_VAL;
  if (lower == "nan") return std::nan("");
  double d;
  auto [end, ec] = std::from_chars(x.data(), x.data() + x.size(), d);
  if (ec != std::errc() || end != x.data() + x.size()) return std::nullopt;
  return neg ? -d : d;
}

std::optional<int64_t> parse_int(const std::string& s, int base) {
  auto t = number_text(s);
  if (!t) return std::nullopt;
  std::string x = *t;
  const bool neg = x[0] == '-';
  if (x[0] == '+' || x[0] == '-') x.erase(0, 1);
  if (base == 16 && x.size() > 2 && (x[1] == 'x' || x[1] == 'X') && x[0] == '0') x.erase(0, 2);
  int64_t v;
  auto [end, ec] = std::from_chars(x.data(), x.data() + x.size(), v, base);
  if (ec != std::errc() || end != x.data() + x.size()) return std::nullopt;
  return neg ? -v : v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// select/reject (by test) and selectattr/rejectattr (by an attribute's test).
Value select(const Value& seq, const Args& a, bool by_attribute, bool keep) {
  size_t first_arg = 0;
  std::string attribute;
  if (by_attribute) {
    if (a.positional.empty()) throw EvalError("selectattr/rejectattr need an attribute name");
    attribute = to_str(a.positional[0]);
    first_arg = 1;
  }
  std::string test;
  Args test_args;
  if (a.positional.size() > first_arg) {
    test = to_str(a.positional[first_arg]);
    if (!is_test(test)) throw EvalError(fmt::format("no test named '{}'", test));
    test_args.positional.assign(a.positional.begin() + first_arg + 1, a.positional.end());
    test_args.keyword = a.keyword;
  }
  std::vector<Value> out;
  if (!truthy(seq)) return make_iterator({});  // Jinja: `if value:` before iterating
  for (const auto& item : iterate(seq)) {
    const Value v = by_attribute ? attribute_path(item, attribute) : item;
    const bool pass = test.empty() ? truthy(v) : apply_test(test, v, test_args);
    if (pass == keep) out.push_back(item);
  }
  return make_iterator(std::move(out));
}

Value min_max(const Value& seq, const Args& a, bool max) {
  a.check(max ? "max" : "min", 2, {"case_sensitive", "attribute"});
  const auto items = iterate(seq);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const bool cs = bool_param(a, 0, "case_sensitive", false);
  const Value& attribute = param(a, 1, "attribute", kNone);
  size_t best = 0;
  Value best_key = sort_key(items[0], attribute, cs);
  for (size_t i = 1; i < items.size(); ++i) {
    Value key = sort_key(items[i], attribute, cs);
    const int c = compare(key, best_key);
    if (max ? c > 0 : c < 0) {
      best = i;
      best_key = std::move(key);
    }
  }
  return items[best];
}

// Python's round(x, n) for floats: the correctly rounded decimal (glibc's printf rounds the
// exact binary value half to even, as CPython does).
double round_float(double x, int64_t digits) {
  if (!std::isfinite(x)) return x;
  if (digits < 0) {
    const double p = std::pow(10.0, static_cast<double>(-digits));
    return std::nearbyint(x / p) * p;
  }
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::min<int64_t>(digits, 300)), x);
  return std::strtod(buf, nullptr);
}

// ---- the filters ----

using FilterFn = Value (*)(const Value&, const Args&);

const std::map<std::string_view, FilterFn>& filters() {
  static const std::map<std::string_view, FilterFn> table = {
      {"abs",
       [](const Value& v, const Args&) -> Value {
         require_defined(v);
         if (v.is_float()) return Value(std::fabs(v.as_float()));
         if (v.is_number()) return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
         throw EvalError(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
       }},
      {"attr",
       [](const Value& v, const Args& a) {
         a.check("attr", 1, {});
         if (a.positional.empty()) throw EvalError("attr() takes an attribute name");
         return get_attribute(v, to_str(a.positional[0]));
       }},
      {"batch",
       [](const Value& v, const Args& a) {
         a.check("batch", 2, {"linecount", "fill_with"});
         const int64_t n = int_param(a, 0, "linecount", 0, "batch");
         if (n <= 0) throw EvalError("batch(): linecount must be positive");
         const Value* fill = a.get(1, "fill_with");
         std::vector<Value> out, row;
         for (const auto& item : iterate(v)) {
           row.push_back(item);
           if (static_cast<int64_t>(row.size()) == n) {
             out.push_back(make_list(std::move(row)));
             row.clear();
           }
         }
         if (!row.empty()) {
           if (fill && !fill->is_none())
             while (static_cast<int64_t>(row.size()) < n) row.push_back(*fill);
           out.push_back(make_list(std::move(row)));
         }
         return make_iterator(std::move(out));
       }},
      {"capitalize", [](const Value& v, const Args&) { return Value(str_capitalize(to_str(v))); }},
      {"center",
       [](const Value& v, const Args& a) {
         a.check("center", 1, {"width"});
         return Value(str_center(to_str(v), int_param(a, 0, "width", 80, "center")));
       }},
      {"count", [](const Value& v, const Args&) { return Value(static_cast<int64_t>(length(v))); }},
      {"default",
       [](const Value& v, const Args& a) {
         a.check("default", 2, {"default_value", "boolean"});
         const bool boolean = bool_param(a, 1, "boolean", false);
         if (v.is_undefined() || (boolean && !truthy(v)))
           return param(a, 0, "default_value", Value(""));
         return v;
       }},
      {"dictsort",
       [](const Value& v, const Args& a) {
         a.check("dictsort", 3, {"case_sensitive", "by", "reverse"});
         if (!v.is_dict()) throw EvalError("dictsort(): can only sort a mapping");
         const bool cs = bool_param(a, 0, "case_sensitive", false);
         const std::string by = string_param(a, 1, "by", "key");
         if (by != "key" && by != "value")
           throw EvalError("dictsort(): 'by' must be 'key' or 'value'");
         const bool reverse = bool_param(a, 2, "reverse", false);
         std::vector<Value> items;
         for (const auto& [k, x] : v.as_dict().items)
           items.push_back(make_list({Value(k), x}, true));
         const size_t pos = by == "key" ? 0 : 1;
         std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
           const int c = compare(sort_key(x.as_list().items[pos], kNone, cs),
                                 sort_key(y.as_list().items[pos], kNone, cs));
           return reverse ? c > 0 : c < 0;
         });
         return make_list(std::move(items));
       }},
      {"escape", [](const Value& v, const Args&) { return Value(html_escape(to_str(v))); }},
      {"first",
       [](const Value& v, const Args&) {
         const auto items = iterate(v);
         if (items.empty()) return Value::undefined("No first item, sequence was empty.");
         return items.front();
       }},
      {"float",
       [](const Value& v, const Args& a) {
         a.check("float", 1, {"default"});
         const Value fallback = param(a, 0, "default", Value(0.0));
         require_defined(v);  // Jinja's Undefined refuses float()
         if (v.is_number()) return Value(v.as_float());
         if (v.is_string())
           if (auto d = parse_float(v.as_string())) return Value(*d);
         return fallback;
       }},
      {"format",
       [](const Value& v, const Args& a) {
         if (!a.keyword.empty()) throw EvalError("unsupported: format() with keyword arguments");
         return Value(percent_format(to_str(v), make_list(a.positional, true)));
       }},
      {"indent",
       [](const Value& v, const Args& a) {
         a.check("indent", 3, {"width", "first", "blank"});
         const Value& w = param(a, 0, "width", Value(4));
         const std::string indent = w.is_string()
                                        ? w.as_string()
                                        : std::string(int_param(a, 0, "width", 4, "indent"), ' ');
         const bool first = bool_param(a, 1, "first", false);
         const bool blank = bool_param(a, 2, "blank", false);
         require_defined(v);
         if (!v.is_string())
           throw EvalError(
               fmt::format("unsupported operand type(s) for +=: '{}' and 'str'", type_name(v)));
         // Jinja appends a newline, then splits into lines (Python's splitlines).
         std::vector<std::string> lines;
         const std::string s = v.as_string() + "\n";
         size_t start = 0;
         for (size_t i = 0; i < s.size(); ++i) {
           if (s[i] != '\n' && s[i] != '\r') continue;
           lines.push_back(s.substr(start, i - start));
           if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
           start = i + 1;
         }
         std::string out;
         for (size_t i = 0; i < lines.size(); ++i) {
           if (i) out += '\n';
           const bool skip = i == 0 ? !first : lines[i].empty() && !blank;
           out += (skip ? "" : indent) + lines[i];
         }
         return Value(std::move(out));
       }},
      {"int",
       [](const Value& v, const Args& a) {
         a.check("int", 2, {"default", "base"});
         const Value fallback = param(a, 0, "default", Value(0));
         const int64_t base = int_param(a, 1, "base", 10, "int");
         require_defined(v);  // Jinja's Undefined refuses int()
         if (v.is_float()) return Value(static_cast<int64_t>(std::trunc(v.as_float())));
         if (v.is_number()) return Value(v.as_int());
         if (v.is_string()) {
           if (auto i = parse_int(v.as_string(), static_cast<int>(base))) return Value(*i);
           if (auto d = parse_float(v.as_string()); d && std::isfinite(*d))
             return Value(static_cast<int64_t>(std::trunc(*d)));  // "42.23"|int is 42
         }
         return fallback;
       }},
      {"items",
       [](const Value& v, const Args&) {
         if (v.is_undefined()) return make_iterator({});
         if (!v.is_dict()) throw EvalError("Can only get item pairs from a mapping.");
         std::vector<Value> out;
         for (const auto& [k, x] : v.as_dict().items) out.push_back(make_list({Value(k), x}, true));
         return make_iterator(std::move(out));
       }},
      {"join",
       [](const Value& v, const Args& a) {
         a.check("join", 2, {"d", "attribute"});
         const std::string sep = string_param(a, 0, "d", "");
         const Value& attribute = param(a, 1, "attribute", kNone);
         std::string out;
         bool first = true;
         for (const auto& item : iterate(v)) {
           if (!first) out += sep;
           first = false;
           out += to_str(attribute.is_none() ? item : attribute_path(item, to_str(attribute)));
         }
         return Value(std::move(out));
       }},
      {"last",
       [](const Value& v, const Args&) {
         if (v.is_iterator()) throw EvalError("'generator' object is not reversible");
         const auto items = iterate(v);
         if (items.empty()) return Value::undefined("No last item, sequence was empty.");
         return items.back();
       }},
      {"length",
       [](const Value& v, const Args&) { return Value(static_cast<int64_t>(length(v))); }},
      {"list", [](const Value& v, const Args&) { return make_list(iterate(v)); }},
      {"lower", [](const Value& v, const Args&) { return Value(to_lower(to_str(v))); }},
      {"map",
       [](const Value& v, const Args& a) {
         std::vector<Value> out;
         if (!truthy(v)) return make_iterator({});  // Jinja: `if value:` before iterating
         const Value* attribute = nullptr;
         for (const auto& [k, x] : a.keyword)
           if (k == "attribute") attribute = &x;
         if (attribute) {
           a.check("map", 0, {"attribute", "default"});
           const Value* fallback = nullptr;
           for (const auto& [k, x] : a.keyword)
             if (k == "default") fallback = &x;
           for (const auto& item : iterate(v)) {
             Value x = attribute_path(item, to_str(*attribute));
             out.push_back(x.is_undefined() && fallback ? *fallback : x);
           }
           return make_iterator(std::move(out));
         }
         if (a.positional.empty()) throw EvalError("map() needs a filter name or attribute=");
         const std::string name = to_str(a.positional[0]);
         if (!is_filter(name)) throw EvalError(fmt::format("no filter named '{}'", name));
         Args rest;
         rest.positional.assign(a.positional.begin() + 1, a.positional.end());
         rest.keyword = a.keyword;
         for (const auto& item : iterate(v)) out.push_back(apply_filter(name, item, rest));
         return make_iterator(std::move(out));
       }},
      {"max", [](const Value& v, const Args& a) { return min_max(v, a, true); }},
      {"min", [](const Value& v, const Args& a) { return min_max(v, a, false); }},
      {"reject", [](const Value& v, const Args& a) { return select(v, a, false, false); }},
      {"rejectattr", [](const Value& v, const Args& a) { return select(v, a, true, false); }},
      {"replace",
       [](const Value& v, const Args& a) {
         a.check("replace", 3, {"old", "new", "count"});
         const Value* old = a.get(0, "old");
         const Value* with = a.get(1, "new");
         if (!old || !with) throw EvalError("replace() needs the old and the new string");
         return Value(str_replace(to_str(v), to_str(*old), to_str(*with),
                                  int_param(a, 2, "count", -1, "replace")));
       }},
      {"reverse",
       [](const Value& v, const Args&) {
         if (v.is_string()) {
           std::u32string u = decode_utf8(v.as_string());
           std::reverse(u.begin(), u.end());
           return Value(encode_utf8(u));
         }
         auto items = iterate(v);
         std::reverse(items.begin(), items.end());
         return make_iterator(std::move(items));
       }},
      {"round",
       [](const Value& v, const Args& a) {
         a.check("round", 2, {"precision", "method"});
         const int64_t precision = int_param(a, 0, "precision", 0, "round");
         const std::string method = string_param(a, 1, "method", "common");
         if (method != "common" && method != "ceil" && method != "floor")
           throw EvalError("round(): method must be 'common', 'ceil' or 'floor'");
         if (!v.is_number())
           throw EvalError(fmt::format("round(): a number is required, not {}", type_name(v)));
         if (method == "common") {
           if (!v.is_float()) return Value(v.as_int());  // round(int, n) stays an int
           return Value(round_float(v.as_float(), precision));
         }
         const double p = std::pow(10.0, static_cast<double>(precision));
         const double x = v.as_float() * p;
         return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / p);
       }},
      {"safe", [](const Value& v, const Args&) { return Value(to_str(v)); }},
      {"select", [](const Value& v, const Args& a) { return select(v, a, false, true); }},
      {"selectattr", [](const Value& v, const Args& a) { return select(v, a, true, true); }},
      {"sort",
       [](const Value& v, const Args& a) {
         a.check("sort", 3, {"reverse", "case_sensitive", "attribute"});
         const bool reverse = bool_param(a, 0, "reverse", false);
         const bool cs = bool_param(a, 1, "case_sensitive", false);
         const Value& attribute = param(a, 2, "attribute", kNone);
         auto items = iterate(v);
         std::vector<Value> keys;
         for (const auto& item : items) keys.push_back(sort_key(item, attribute, cs));
         std::vector<size_t> order(items.size());
         for (size_t i = 0; i < order.size(); ++i) order[i] = i;
         std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
           const int c = compare(keys[x], keys[y]);
           return reverse ? c > 0 : c < 0;
         });
         std::vector<Value> out;
         for (size_t i : order) out.push_back(items[i]);
         return make_list(std::move(out));
       }},
      {"string", [](const Value& v, const Args&) { return Value(to_str(v)); }},
      {"sum",
       [](const Value& v, const Args& a) {
         a.check("sum", 2, {"attribute", "start"});
         const Value& attribute = param(a, 0, "attribute", kNone);
         Value total = param(a, 1, "start", Value(0));
         for (const auto& item : iterate(v)) {
           const Value x = attribute.is_none() ? item : attribute_path(item, to_str(attribute));
           if (!x.is_number() || !total.is_number())
             throw EvalError(fmt::format("unsupported operand type(s) for +: '{}' and '{}'",
                                         type_name(total), type_name(x)));
           total = total.is_float() || x.is_float() ? Value(total.as_float() + x.as_float())
                                                    : Value(total.as_int() + x.as_int());
         }
         return total;
       }},
      {"title",
       [](const Value& v, const Args&) {
         // Jinja's title: words start after -, whitespace, (, {, [ or <; each word is
         // capitalised (first letter raised, the rest lowered).
         std::string out, word;
         bool in_separators = false;
         const auto flush = [&] {
           if (!word.empty()) out += str_capitalize(word);
           word.clear();
         };
         for (char32_t c : decode_utf8(to_str(v))) {
           const bool sep =
               c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_python_space(c);
           if (sep != in_separators) flush();
           in_separators = sep;
           append_utf8(word, c);
         }
         flush();
         return Value(std::move(out));
       }},
      {"tojson",
       [](const Value& v, const Args& a) {
         a.check("tojson", 0, {"ensure_ascii", "indent", "separators", "sort_keys"});
         JsonStyle style;
         style.ensure_ascii = truthy(keyword(a, "ensure_ascii", kFalse));
         style.sort_keys = truthy(keyword(a, "sort_keys", kFalse));
         if (const Value& indent = keyword(a, "indent", kNone); !indent.is_none()) {
           // json.dumps: with an indent, items end in "," before the newline.
           style.pretty = true;
           style.item_separator.pop_back();  // ", " -> ","
           style.indent = indent.is_string()
                              ? indent.as_string()
                              : std::string(std::max<int64_t>(0, indent.as_int()), ' ');
         }
         if (const Value& separators = keyword(a, "separators", kNone); !separators.is_none()) {
           const auto parts = iterate(separators);
           if (parts.size() != 2 || !parts[0].is_string() || !parts[1].is_string())
             throw EvalError("tojson(): separators must be two strings");
           style.item_separator = parts[0].as_string();
           style.key_separator = parts[1].as_string();
         }
         return Value(dump_json(v, style));
       }},
      {"trim",
       [](const Value& v, const Args& a) {
         a.check("trim", 1, {"chars"});
         return Value(str_strip(to_str(v), a.get(0, "chars"), true, true));
       }},
      {"unique",
       [](const Value& v, const Args& a) {
         a.check("unique", 2, {"case_sensitive", "attribute"});
         const bool cs = bool_param(a, 0, "case_sensitive", false);
         const Value& attribute = param(a, 1, "attribute", kNone);
         std::vector<Value> out, seen;
         for (const auto& item : iterate(v)) {
           Value key = sort_key(item, attribute, cs);
           if (std::any_of(seen.begin(), seen.end(),
                           [&](const Value& s) { return equals(s, key); }))
             continue;
           seen.push_back(std::move(key));
           out.push_back(item);
         }
         return make_iterator(std::move(out));
       }},
      {"upper", [](const Value& v, const Args&) { return Value(to_upper(to_str(v))); }},
      {"wordcount",
       [](const Value& v, const Args&) {
         // \w+ runs: letters, digits and _ (every non-ASCII code point that is not a space
         // counts as a letter here).
         int64_t n = 0;
         bool in_word = false;
         for (char32_t c : decode_utf8(to_str(v))) {
           const bool w = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
                          (c >= 'A' && c <= 'Z') || c == '_' || (c > 0x7F && !is_python_space(c));
           if (w && !in_word) ++n;
           in_word = w;
         }
         return Value(n);
       }},
  };
  return table;
}

// Aliases Jinja registers under a second name.
std::string_view canonical_filter(std::string_view name) {
  if (name == "d") return "default";
  if (name == "e" || name == "forceescape") return "escape";
  return name;
}

// ---- the tests ----

using TestFn = bool (*)(const Value&, const Args&);

const Value& test_arg(const Args& a, std::string_view test) {
  if (a.positional.empty()) throw EvalError(fmt::format("test '{}' takes an argument", test));
  return a.positional[0];
}

// value % divisor == expected, with Python's modulo (the sign of the divisor; 2.5 % 2 == 0.5).
bool remainder_is(const Value& v, const Value& d, int64_t expected, std::string_view test) {
  require_defined(v);
  if (!v.is_number() || !d.is_number())
    throw EvalError(fmt::format("test '{}' needs numbers, not {}", test, type_name(v)));
  if (v.is_float() || d.is_float()) {
    if (d.as_float() == 0) throw EvalError("float modulo");
    double r = std::fmod(v.as_float(), d.as_float());
    if (r != 0 && ((r < 0) != (d.as_float() < 0))) r += d.as_float();
    return r == static_cast<double>(expected);
  }
  if (d.as_int() == 0) throw EvalError("integer division or modulo by zero");
  int64_t r = v.as_int() % d.as_int();
  if (r != 0 && ((r < 0) != (d.as_int() < 0))) r += d.as_int();
  return r == expected;
}

const std::map<std::string_view, TestFn>& tests() {
  static const std::map<std::string_view, TestFn> table = {
      {"boolean", [](const Value& v, const Args&) { return v.is_bool(); }},
      {"callable", [](const Value& v, const Args&) { return v.is_callable() || v.is_undefined(); }},
      {"defined", [](const Value& v, const Args&) { return !v.is_undefined(); }},
      {"divisibleby",
       [](const Value& v, const Args& a) {
         return remainder_is(v, test_arg(a, "divisibleby"), 0, "divisibleby");
       }},
      {"eq", [](const Value& v, const Args& a) { return equals(v, test_arg(a, "eq")); }},
      {"escaped", [](const Value&, const Args&) { return false; }},
      {"even", [](const Value& v, const Args&) { return remainder_is(v, Value(2), 0, "even"); }},
      {"false", [](const Value& v, const Args&) { return v.is_bool() && !v.as_bool(); }},
      {"filter",
       [](const Value& v, const Args&) { return v.is_string() && is_filter(v.as_string()); }},
      {"float", [](const Value& v, const Args&) { return v.is_float(); }},
      {"ge", [](const Value& v, const Args& a) { return compare(v, test_arg(a, "ge")) >= 0; }},
      {"gt", [](const Value& v, const Args& a) { return compare(v, test_arg(a, "gt")) > 0; }},
      {"in", [](const Value& v, const Args& a) { return contains(test_arg(a, "in"), v); }},
      {"integer", [](const Value& v, const Args&) { return v.is_int(); }},
      {"iterable",
       [](const Value& v, const Args&) {
         return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
       }},
      {"le", [](const Value& v, const Args& a) { return compare(v, test_arg(a, "le")) <= 0; }},
      {"lower",
       [](const Value& v, const Args&) {
         const std::string s = to_str(v);
         return std::any_of(
                    s.begin(), s.end(),
                    [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }) &&
                to_lower(s) == s;
       }},
      {"lt", [](const Value& v, const Args& a) { return compare(v, test_arg(a, "lt")) < 0; }},
      {"mapping", [](const Value& v, const Args&) { return v.is_dict(); }},
      {"ne", [](const Value& v, const Args& a) { return !equals(v, test_arg(a, "ne")); }},
      {"none", [](const Value& v, const Args&) { return v.is_none(); }},
      {"number", [](const Value& v, const Args&) { return v.is_number(); }},
      {"odd", [](const Value& v, const Args&) { return remainder_is(v, Value(2), 1, "odd"); }},
      {"sameas",
       [](const Value& v, const Args& a) {
         const Value& o = test_arg(a, "sameas");
         if (v.identity() || o.identity()) return v.identity() == o.identity();
         return v.is_none() == o.is_none() && v.is_bool() == o.is_bool() && equals(v, o);
       }},
      {"sequence",
       [](const Value& v, const Args&) {
         return v.is_undefined() || v.is_string() || (v.is_list() && !v.is_iterator()) ||
                v.is_dict();
       }},
      {"string", [](const Value& v, const Args&) { return v.is_string(); }},
      {"test", [](const Value& v, const Args&) { return v.is_string() && is_test(v.as_string()); }},
      {"true", [](const Value& v, const Args&) { return v.is_bool() && v.as_bool(); }},
      {"undefined", [](const Value& v, const Args&) { return v.is_undefined(); }},
      {"upper",
       [](const Value& v, const Args&) {
         const std::string s = to_str(v);
         return std::any_of(
                    s.begin(), s.end(),
                    [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }) &&
                to_upper(s) == s;
       }},
  };
  return table;
}

std::string_view canonical_test(std::string_view name) {
  if (name == "==" || name == "equalto") return "eq";
  if (name == "!=") return "ne";
  if (name == "<" || name == "lessthan") return "lt";
  if (name == "<=") return "le";
  if (name == ">" || name == "greaterthan") return "gt";
  if (name == ">=") return "ge";
  return name;
}

}  // namespace

bool is_filter(std::string_view name) { return filters().count(canonical_filter(name)) > 0; }
bool is_test(std::string_view name) { return tests().count(canonical_test(name)) > 0; }

Value apply_filter(std::string_view name, const Value& value, const Args& args) {
  const auto it = filters().find(canonical_filter(name));
  if (it == filters().end()) throw EvalError(fmt::format("no filter named '{}'", name));
  return it->second(value, args);
}

bool apply_test(std::string_view name, const Value& value, const Args& args) {
  const auto it = tests().find(canonical_test(name));
  if (it == tests().end()) throw EvalError(fmt::format("no test named '{}'", name));
  return it->second(value, args);
}

}  // namespace kestrel::jinja
