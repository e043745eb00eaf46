// Attribute and item access as Jinja2 does it (environment.getattr / getitem), Python's methods
// of str, dict and list that templates call, and the global functions.
//
// transformers renders in an ImmutableSandboxedEnvironment: the methods that change a list or
// a dict (append, pop, update...) are refused there, and so they are here.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>

#include "tokenizer/jinja/builtins.h"

namespace kestrel::jinja {

const Value& param(const Args& args, size_t index, std::string_view name, const Value& fallback) {
  const Value* v = args.get(index, name);
  return v ? *v : fallback;
}

int64_t int_param(const Args& args, size_t index, std::string_view name, int64_t fallback,
                  std::string_view function) {
  const Value* v = args.get(index, name);
  if (!v || v->is_none()) return fallback;
  if (!v->is_int() && !v->is_bool())
    throw EvalError(
        fmt::format("{}(): '{}' must be an integer, not {}", function, name, type_name(*v)));
  return v->as_int();
}

namespace {

std::string expect_string(const Value& v, std::string_view what) {
  if (!v.is_string())
    throw EvalError(fmt::format("{} must be a string, not {}", what, type_name(v)));
  return v.as_string();
}

// ---- str ----

bool in_set(char32_t c, const std::u32string& set) { return set.find(c) != std::u32string::npos; }

std::vector<Value> split(const std::string& s, const Value& sep, int64_t maxsplit,
                         bool from_right) {
  std::vector<std::string> parts;
  if (sep.is_none()) {
    // Runs of whitespace separate; no empty strings; the unsplit rest keeps its whitespace.
    std::u32string u = decode_utf8(s);
    if (from_right) std::reverse(u.begin(), u.end());
    size_t i = 0;
    while (true) {
      while (i < u.size() && is_python_space(u[i])) ++i;
      if (i >= u.size()) break;
      size_t j = i;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        j = u.size();
      } else {
        while (j < u.size() && !is_python_space(u[j])) ++j;
      }
      std::u32string part = u.substr(i, j - i);
      if (from_right) std::reverse(part.begin(), part.end());
      parts.push_back(encode_utf8(part));
      i = j;
    }
    if (from_right) std::reverse(parts.begin(), parts.end());
  } else {
    const std::string d = expect_string(sep, "the separator");
    if (d.empty()) throw EvalError("empty separator");
    if (!from_right) {
      size_t i = 0;
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t j = s.find(d, i);
        if (j == std::string::npos) break;
        parts.push_back(s.substr(i, j - i));
        i = j + d.size();
      }
      parts.push_back(s.substr(i));
    } else {
      size_t end = s.size();
      std::vector<std::string> rev;
      while (maxsplit < 0 || static_cast<int64_t>(rev.size()) < maxsplit) {
        if (end < d.size()) break;
        const size_t j = s.rfind(d, end - d.size());
        if (j == std::string::npos) break;
        rev.push_back(s.substr(j + d.size(), end - j - d.size()));
        end = j;
      }
      rev.push_back(s.substr(0, end));
      parts.assign(rev.rbegin(), rev.rend());
    }
  }
  std::vector<Value> out;
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::vector<Value> splitlines(const std::string& s, bool keepends) {
  const std::u32string u = decode_utf8(s);
  std::vector<Value> out;
  size_t start = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const char32_t c = u[i];
    const bool br = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) ||
                    c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) continue;
    size_t end = i + 1;
    if (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') end = i + 2;
    out.emplace_back(encode_utf8(u.substr(start, (keepends ? end : i) - start)));
    start = end;
    i = end - 1;
  }
  if (start < u.size()) out.emplace_back(encode_utf8(u.substr(start)));
  return out;
}

bool affix_match(const std::string& s, const Value& affix, bool prefix, std::string_view fn) {
  const auto one = [&](const Value& a) {
    const std::string x = expect_string(a, fmt::format("{}() argument", fn));
    return s.size() >= x.size() && s.compare(prefix ? 0 : s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_list()) {
    for (const auto& a : affix.as_list().items)
      if (one(a)) return true;
    return false;
  }
  return one(affix);
}

// The [start:end] of str.find(sub, start, end) and its kin, in code points, clamped as Python
// clamps slice bounds.
std::pair<size_t, size_t> search_range(size_t length, const Args& a, std::string_view fn) {
  const auto bound = [&](size_t i, int64_t fallback) {
    const int64_t n = static_cast<int64_t>(length);
    int64_t v = int_param(a, i, "", fallback, fn);
    if (v < 0) v = std::max<int64_t>(0, v + n);
    return static_cast<size_t>(std::min(v, n));
  };
  return {bound(1, 0), bound(2, static_cast<int64_t>(length))};
}

bool all_of_code_points(const std::string& s, bool (*pred)(char32_t)) {
  const std::u32string u = decode_utf8(s);
  return !u.empty() && std::all_of(u.begin(), u.end(), pred);
}

bool ascii_digit(char32_t c) { return c >= '0' && c <= '9'; }
bool ascii_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool cased_letter(char32_t c) {
  return ascii_alpha(c) || (c >= 0xC0 && c <= 0xFF && c != 0xD7 && c != 0xF7);
}

// Python's str.title(): a letter after a letter is lowered, any other letter raised.
std::string str_title(const std::string& s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : decode_utf8(s)) {
    std::string one;
    append_utf8(one, c);
    out += previous_cased ? to_lower(one) : to_upper(one);
    previous_cased = cased_letter(c);
  }
  return out;
}

// Python's str.format: {} {0} {name} and {{ }}, with !r and !s; format specs are refused.
std::string str_format(const std::string& f, const Args& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    const char c = f[i];
    if (c == '}') {
      if (i + 1 < f.size() && f[i + 1] == '}')
        ++i;
      else
        throw EvalError("str.format(): single '}' encountered");
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < f.size() && f[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const size_t close = f.find('}', i);
    if (close == std::string::npos) throw EvalError("str.format(): single '{' encountered");
    std::string field = f.substr(i + 1, close - i - 1);
    i = close;
    char conversion = 's';
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 's';
      field.resize(bang);
    }
    if (field.find(':') != std::string::npos)
      throw EvalError("unsupported: format specs in str.format()");
    const Value* v = nullptr;
    if (field.empty()) {
      v = auto_index < args.positional.size() ? &args.positional[auto_index] : nullptr;
      ++auto_index;
    } else if (std::all_of(field.begin(), field.end(),
                           [](char d) { return d >= '0' && d <= '9'; })) {
      const size_t k = std::stoul(field);
      v = k < args.positional.size() ? &args.positional[k] : nullptr;
    } else {
      for (const auto& [name, value] : args.keyword)
        if (name == field) v = &value;
    }
    if (!v) throw EvalError(fmt::format("str.format(): no argument for '{{{}}}'", field));
    out += conversion == 'r' ? repr(*v) : to_str(*v);
  }
  return out;
}

Value str_method(const std::string& s, const std::string& name) {
  const auto method = [&](auto fn) {
    return make_callable("str." + name, [s, fn](Args& a) -> Value { return fn(s, a); });
  };
  const Value none{None{}};
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return method(
        [left = name != "rstrip", right = name != "lstrip", name](const std::string& x, Args& a) {
          a.check("str." + name, 1, {"chars"});
          return Value(str_strip(x, a.get(0, "chars"), left, right));
        });
  if (name == "split" || name == "rsplit")
    return method([right = name == "rsplit", name, none](const std::string& x, Args& a) {
      a.check("str." + name, 2, {"sep", "maxsplit"});
      return make_list(
          split(x, param(a, 0, "sep", none), int_param(a, 1, "maxsplit", -1, name), right));
    });
  if (name == "splitlines")
    return method([](const std::string& x, Args& a) {
      a.check("str.splitlines", 1, {"keepends"});
      return make_list(splitlines(x, int_param(a, 0, "keepends", 0, "str.splitlines") != 0));
    });
  if (name == "startswith" || name == "endswith")
    return method([prefix = name == "startswith", name](const std::string& x, Args& a) {
      a.check("str." + name, 3, {});
      if (a.positional.empty()) throw EvalError(fmt::format("str.{}() takes an argument", name));
      if (a.positional.size() == 1) return Value(affix_match(x, a.positional[0], prefix, name));
      const std::u32string u = decode_utf8(x);
      const auto [b, e] = search_range(u.size(), a, "str." + name);
      return Value(b <= e &&
                   affix_match(encode_utf8(u.substr(b, e - b)), a.positional[0], prefix, name));
    });
  if (name == "upper" || name == "lower" || name == "casefold" || name == "title" ||
      name == "capitalize")
    return method([name](const std::string& x, Args& a) {
      a.check("str." + name, 0, {});
      if (name == "upper") return Value(to_upper(x));
      if (name == "title") return Value(str_title(x));
      if (name == "capitalize") return Value(str_capitalize(x));
      return Value(to_lower(x));
    });
  if (name == "replace")
    return method([](const std::string& x, Args& a) {
      a.check("str.replace", 3, {"count"});
      if (a.positional.size() < 2) throw EvalError("str.replace() takes at least 2 arguments");
      return Value(str_replace(x, expect_string(a.positional[0], "str.replace() argument 1"),
                               expect_string(a.positional[1], "str.replace() argument 2"),
                               int_param(a, 2, "count", -1, "str.replace")));
    });
  if (name == "join")
    return method([](const std::string& x, Args& a) {
      a.check("str.join", 1, {});
      if (a.positional.empty()) throw EvalError("str.join() takes an argument");
      std::string out;
      const auto items = iterate(a.positional[0]);
      for (size_t i = 0; i < items.size(); ++i) {
        if (!items[i].is_string())
          throw EvalError(fmt::format("sequence item {}: expected str instance, {} found", i,
                                      type_name(items[i])));
        if (i) out += x;
        out += items[i].as_string();
      }
      return Value(std::move(out));
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count")
    return method([name](const std::string& x, Args& a) {
      a.check("str." + name, 3, {});
      if (a.positional.empty()) throw EvalError(fmt::format("str.{}() takes an argument", name));
      const std::u32string sub =
          decode_utf8(expect_string(a.positional[0], fmt::format("str.{}() argument", name)));
      const std::u32string all = decode_utf8(x);
      const auto [b, e] = search_range(all.size(), a, "str." + name);
      const std::u32string u = b <= e ? all.substr(b, e - b) : std::u32string();
      if (name == "count") {
        if (b > e) return Value(int64_t{0});
        if (sub.empty()) return Value(static_cast<int64_t>(u.size()) + 1);
        int64_t n = 0;
        for (size_t i = u.find(sub); i != std::u32string::npos; i = u.find(sub, i + sub.size()))
          ++n;
        return Value(n);
      }
      const size_t at = b > e ? std::u32string::npos : name[0] == 'r' ? u.rfind(sub) : u.find(sub);
      if (at == std::u32string::npos) {
        if (name == "index" || name == "rindex") throw EvalError("substring not found");
        return Value(int64_t{-1});
      }
      return Value(static_cast<int64_t>(b + at));
    });
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric" || name == "isalpha" ||
      name == "isalnum" || name == "isspace" || name == "islower" || name == "isupper")
    return method([name](const std::string& x, Args& a) {
      a.check("str." + name, 0, {});
      if (name == "isalpha") return Value(all_of_code_points(x, cased_letter));
      if (name == "isalnum")
        return Value(
            all_of_code_points(x, [](char32_t c) { return cased_letter(c) || ascii_digit(c); }));
      if (name == "isspace") return Value(all_of_code_points(x, is_python_space));
      if (name == "islower" || name == "isupper") {
        const bool has_cased =
            std::any_of(x.begin(), x.end(), [](char c) { return ascii_alpha(c); });
        return Value(has_cased && (name == "islower" ? to_lower(x) == x : to_upper(x) == x));
      }
      return Value(all_of_code_points(x, ascii_digit));
    });
  if (name == "format")
    return method([](const std::string& x, Args& a) { return Value(str_format(x, a)); });
  if (name == "removeprefix" || name == "removesuffix")
    return method([prefix = name == "removeprefix", name](const std::string& x, Args& a) {
      a.check("str." + name, 1, {});
      if (a.positional.empty()) throw EvalError(fmt::format("str.{}() takes an argument", name));
      const std::string affix =
          expect_string(a.positional[0], fmt::format("str.{}() argument", name));
      if (!affix_match(x, Value(affix), prefix, name)) return Value(x);
      return Value(prefix ? x.substr(affix.size()) : x.substr(0, x.size() - affix.size()));
    });
  if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill")
    return method([name](const std::string& x, Args& a) {
      a.check("str." + name, name == "zfill" ? 1 : 2, {});
      if (a.positional.empty() || (!a.positional[0].is_int() && !a.positional[0].is_bool()))
        throw EvalError(fmt::format("str.{}() takes an integer width", name));
      const int64_t width = a.positional[0].as_int();
      char32_t fill = ' ';
      if (a.positional.size() > 1) {
        const std::u32string f = decode_utf8(expect_string(a.positional[1], "the fill character"));
        if (f.size() != 1) throw EvalError("The fill character must be exactly one character long");
        fill = f[0];
      }
      if (name == "center") return Value(str_center(x, width, fill));
      const int64_t pad = width - static_cast<int64_t>(decode_utf8(x).size());
      if (pad <= 0) return Value(x);
      std::string padding;
      for (int64_t i = 0; i < pad; ++i) append_utf8(padding, name == "zfill" ? U'0' : fill);
      if (name == "zfill") {
        const bool sign = !x.empty() && (x[0] == '-' || x[0] == '+');
        return Value((sign ? x.substr(0, 1) : "") + padding + x.substr(sign ? 1 : 0));
      }
      return Value(name == "ljust" ? x + padding : padding + x);
    });
  return Value::undefined(fmt::format("'str object' has no attribute '{}'", name));
}

// ---- dict and list ----

constexpr std::string_view kUnsafeDict[] = {"clear", "pop", "popitem", "setdefault", "update"};
constexpr std::string_view kUnsafeList[] = {"append", "clear", "pop",    "reverse",
                                            "insert", "sort",  "extend", "remove"};

// As Jinja's sandbox: an Undefined (so `x.append is defined` is false) that fails when called.
Value unsafe(const std::string& name, std::string_view type) {
  return Value::undefined(
      fmt::format("access to attribute '{}' of '{}' object is unsafe (templates "
                  "cannot change a {}; transformers renders them in an immutable "
                  "sandbox)",
                  name, type, type));
}

// The bound method `name` of a dict or list, or nullopt when there is no such method.
std::optional<Value> dict_method(const Value& object, const std::string& name) {
  if (std::find(std::begin(kUnsafeDict), std::end(kUnsafeDict), name) != std::end(kUnsafeDict))
    return unsafe(name, "dict");
  // Each method holds the dict through its Value.
  if (name == "items")
    return make_callable("dict.items", [object](Args& a) {
      a.check("dict.items", 0, {});
      std::vector<Value> out;
      for (const auto& [k, v] : object.as_dict().items)
        out.push_back(make_list({Value(k), v}, true));
      return make_list(std::move(out));
    });
  if (name == "keys" || name == "values")
    return make_callable("dict." + name, [object, keys = name == "keys"](Args& a) {
      a.check(keys ? "dict.keys" : "dict.values", 0, {});
      std::vector<Value> out;
      for (const auto& [k, v] : object.as_dict().items) out.push_back(keys ? Value(k) : v);
      return make_list(std::move(out));
    });
  if (name == "get")
    return make_callable("dict.get", [object](Args& a) {
      a.check("dict.get", 2, {});
      if (a.positional.empty()) throw EvalError("dict.get() takes at least 1 argument");
      const Value& key = a.positional[0];
      const Value* v = key.is_string() ? object.as_dict().find(key.as_string()) : nullptr;
      if (v) return *v;
      return a.positional.size() > 1 ? a.positional[1] : Value(None{});
    });
  if (name == "copy")
    return make_callable("dict.copy", [object](Args&) { return make_dict(object.as_dict()); });
  return std::nullopt;
}

std::optional<Value> list_method(const Value& object, const std::string& name) {
  if (std::find(std::begin(kUnsafeList), std::end(kUnsafeList), name) != std::end(kUnsafeList))
    return unsafe(name, type_name(object));
  if (name == "index" || name == "count")
    return make_callable(type_name(object) + "." + name, [object, name](Args& a) {
      a.check(name, 1, {});
      if (a.positional.empty()) throw EvalError(fmt::format("{}() takes an argument", name));
      const auto& items = object.as_list().items;
      int64_t n = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        if (!equals(items[i], a.positional[0])) continue;
        if (name == "index") return Value(static_cast<int64_t>(i));
        ++n;
      }
      if (name == "index") throw EvalError(fmt::format("{} is not in list", repr(a.positional[0])));
      return Value(n);
    });
  if (name == "copy")
    return make_callable("list.copy",
                         [object](Args&) { return make_list(object.as_list().items); });
  return std::nullopt;
}

int64_t normalize_index(int64_t i, size_t size) {
  return i < 0 ? i + static_cast<int64_t>(size) : i;
}

}  // namespace

// ---- str helpers shared with the filters ----

std::string str_strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::u32string u = decode_utf8(s);
  const bool whitespace = !chars || chars->is_none();
  const std::u32string set =
      whitespace ? U"" : decode_utf8(expect_string(*chars, "strip() argument"));
  const auto strip = [&](char32_t c) { return whitespace ? is_python_space(c) : in_set(c, set); };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip(u[b])) ++b;
  if (right)
    while (e > b && strip(u[e - 1])) --e;
  return encode_utf8(u.substr(b, e - b));
}

std::string str_replace(const std::string& s, const std::string& old, const std::string& with,
                        int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {  // Python inserts between every character and at both ends
    const std::u32string u = decode_utf8(s);
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < u.size()) append_utf8(out, u[i]);
    }
    return out;
  }
  size_t i = 0;
  while (count < 0 || done < count) {
    const size_t j = s.find(old, i);
    if (j == std::string::npos) break;
    out.append(s, i, j - i);
    out += with;
    i = j + old.size();
    ++done;
  }
  out.append(s, i, std::string::npos);
  return out;
}

std::string str_capitalize(const std::string& s) {
  const std::u32string u = decode_utf8(s);
  if (u.empty()) return s;
  return to_upper(encode_utf8(u.substr(0, 1))) + to_lower(encode_utf8(u.substr(1)));
}

std::string str_center(const std::string& s, int64_t width, char32_t fill) {
  const int64_t len = static_cast<int64_t>(decode_utf8(s).size());
  if (width <= len) return s;
  const int64_t margin = width - len;
  const int64_t left = margin / 2 + (margin & width & 1);  // CPython's rounding
  std::string f;
  append_utf8(f, fill);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += f;
  out += s;
  for (int64_t i = 0; i < margin - left; ++i) out += f;
  return out;
}

// ---- access ----

Value get_attribute(const Value& object, const std::string& name) {
  require_defined(object);
  if (object.is_dict()) {
    if (auto method = dict_method(object, name)) return *method;
    if (const Value* v = object.as_dict().find(name)) return *v;
  } else if (object.is_string()) {
    return str_method(object.as_string(), name);
  } else if (object.is_list() && !object.is_iterator()) {
    if (auto method = list_method(object, name)) return *method;
  } else if (object.is_namespace()) {
    if (const Value* v = object.as_namespace().attrs.find(name)) return *v;
  }
  return Value::undefined(
      fmt::format("{} has no attribute '{}'", object_description(object), name));
}

Value get_item(const Value& object, const Value& key) {
  require_defined(object);
  require_defined(key);
  if (object.is_iterator()) throw EvalError("'generator' object is not subscriptable");
  if (object.is_dict() && key.is_string()) {
    if (const Value* v = object.as_dict().find(key.as_string())) return *v;
  } else if (object.is_namespace() && key.is_string()) {
    if (const Value* v = object.as_namespace().attrs.find(key.as_string())) return *v;
  } else if ((object.is_list() || object.is_string()) && (key.is_int() || key.is_bool())) {
    if (object.is_list()) {
      const auto& items = object.as_list().items;
      const int64_t i = normalize_index(key.as_int(), items.size());
      if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[i];
    } else {
      const std::u32string u = decode_utf8(object.as_string());
      const int64_t i = normalize_index(key.as_int(), u.size());
      if (i >= 0 && i < static_cast<int64_t>(u.size())) return Value(encode_utf8(u.substr(i, 1)));
    }
  }
  if (key.is_string()) {
    // Jinja tries the attribute when there is no such item: d['items'] is the method.
    if (object.is_dict() || object.is_list() || object.is_string()) {
      Value attr = get_attribute(object, key.as_string());
      if (!attr.is_undefined()) return attr;
    }
    return Value::undefined(
        fmt::format("{} has no attribute '{}'", object_description(object), key.as_string()));
  }
  return Value::undefined(
      fmt::format("{} has no element {}", object_description(object), repr(key)));
}

Value get_slice(const Value& object, const Value& start_v, const Value& stop_v,
                const Value& step_v) {
  require_defined(object);
  const auto bound = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (v.is_int() || v.is_bool()) return v.as_int();
    throw EvalError(fmt::format("slice {} must be an integer or None, not {}", what, type_name(v)));
  };
  const int64_t step = bound(step_v, "step").value_or(1);
  if (step == 0) throw EvalError("slice step cannot be zero");
  std::u32string text;
  size_t n;
  if (object.is_string()) {
    text = decode_utf8(object.as_string());
    n = text.size();
  } else if (object.is_list() && !object.is_iterator()) {
    n = object.as_list().items.size();
  } else {
    throw EvalError(fmt::format("'{}' object is not subscriptable", type_name(object)));
  }
  // Python's PySlice_AdjustIndices.
  const int64_t len = static_cast<int64_t>(n);
  const auto adjust = [&](std::optional<int64_t> v, int64_t if_none) {
    if (!v) return if_none;
    int64_t i = *v;
    if (i < 0) {
      i += len;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= len) {
      i = step < 0 ? len - 1 : len;
    }
    return i;
  };
  const int64_t start = adjust(bound(start_v, "start"), step < 0 ? len - 1 : 0);
  const int64_t stop = adjust(bound(stop_v, "stop"), step < 0 ? -1 : len);
  std::vector<int64_t> picked;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picked.push_back(i);
  if (object.is_string()) {
    std::u32string out;
    for (int64_t i : picked) out += text[i];
    return Value(encode_utf8(out));
  }
  std::vector<Value> out;
  for (int64_t i : picked) out.push_back(object.as_list().items[i]);
  return make_list(std::move(out), object.is_tuple());
}

bool contains(const Value& container, const Value& item) {
  if (container.is_undefined()) return false;  // Jinja's Undefined iterates as empty
  if (container.is_string()) {
    if (!item.is_string())
      throw EvalError(
          fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const auto& v : container.as_list().items)
      if (equals(v, item)) return true;
    return false;
  }
  if (container.is_dict()) {
    if ((item.is_list() && !item.is_tuple()) || item.is_dict() || item.is_namespace())
      throw EvalError(fmt::format("unhashable type: '{}'", type_name(item)));
    return item.is_string() && container.as_dict().find(item.as_string());
  }
  throw EvalError(fmt::format("argument of type '{}' is not iterable", type_name(container)));
}

// ---- printf-style formatting ----

// A width or precision of a % format: digits, at most a million (a template cannot ask for
// gigabytes of padding).
size_t format_count(const std::string& digits) {
  if (digits.size() > 7 || std::stoul(digits) > 1'000'000)
    throw EvalError("format width or precision " + digits + " is too large");
  return std::stoul(digits);
}

std::string percent_format(const std::string& f, const Value& args) {
  std::vector<Value> values;
  if (args.is_tuple())
    values = args.as_list().items;
  else
    values.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out += f[i];
      continue;
    }
    size_t j = i + 1;
    std::string flags, width, precision;
    while (j < f.size() && std::string_view("-+ #0").find(f[j]) != std::string_view::npos)
      flags += f[j++];
    while (j < f.size() && f[j] >= '0' && f[j] <= '9') width += f[j++];
    if (j < f.size() && f[j] == '.') {
      precision = ".";
      ++j;
      while (j < f.size() && f[j] >= '0' && f[j] <= '9') precision += f[j++];
    }
    if (j >= f.size()) throw EvalError("incomplete format");
    if (!width.empty()) format_count(width);
    if (precision.size() > 1) format_count(precision.substr(1));
    const char conv = f[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= values.size()) throw EvalError("not enough arguments for format string");
    const Value& v = values[next++];
    const std::string spec = "%" + flags + width + precision;
    char buf[512];
    if (conv == 's' || conv == 'r') {
      std::u32string s = decode_utf8(conv == 's' ? to_str(v) : repr(v));
      if (precision.size() > 1) s = s.substr(0, format_count(precision.substr(1)));
      const size_t w = width.empty() ? 0 : format_count(width);
      const std::u32string pad(w > s.size() ? w - s.size() : 0, U' ');
      out += encode_utf8(flags.find('-') != std::string::npos ? s + pad : pad + s);
    } else if (conv == 'd' || conv == 'i' || conv == 'x' || conv == 'X' || conv == 'o') {
      if (!v.is_number())
        throw EvalError(
            fmt::format("%{} format: a number is required, not {}", conv, type_name(v)));
      const long long n = v.is_float() ? static_cast<long long>(v.as_float()) : v.as_int();
      std::snprintf(buf, sizeof buf, (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), n);
      out += buf;
    } else if (std::string_view("fFeEgG").find(conv) != std::string_view::npos) {
      if (!v.is_number())
        throw EvalError(
            fmt::format("%{} format: a number is required, not {}", conv, type_name(v)));
      std::snprintf(buf, sizeof buf, (spec + conv).c_str(), v.as_float());
      out += buf;
    } else {
      throw EvalError(fmt::format("unsupported format character '{}'", conv));
    }
  }
  // Python lets an unused argument pass when it is a mapping, a list or Jinja's Undefined (it
  // treats anything subscriptable as a mapping), not otherwise.
  if (next < values.size() && !args.is_dict() && !args.is_undefined() &&
      !(args.is_list() && !args.is_tuple()))
    throw EvalError("not all arguments converted during string formatting");
  return out;
}

// ---- globals ----

Dict builtin_globals() {
  Dict g;
  g.set("range", make_callable("range", [](Args& a) {
          a.check("range", 3, {});
          if (a.positional.empty()) throw EvalError("range expected at least 1 argument, got 0");
          for (const auto& v : a.positional)
            if (!v.is_int() && !v.is_bool())
              throw EvalError(
                  fmt::format("'{}' object cannot be interpreted as an integer", type_name(v)));
          int64_t start = 0, stop, step = 1;
          if (a.positional.size() == 1) {
            stop = a.positional[0].as_int();
          } else {
            start = a.positional[0].as_int();
            stop = a.positional[1].as_int();
            if (a.positional.size() == 3) step = a.positional[2].as_int();
          }
          if (step == 0) throw EvalError("range() arg 3 must not be zero");
          std::vector<Value> out;
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (out.size() >= 100000)  // Jinja's sandbox MAX_RANGE
              throw EvalError(
                  "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            out.emplace_back(i);
          }
          return make_list(std::move(out));
        }));
  g.set("namespace", make_callable("namespace", [](Args& a) {
          auto ns = std::make_shared<Namespace>();
          if (a.positional.size() > 1)
            throw EvalError("namespace() takes at most 1 positional argument");
          if (!a.positional.empty()) {
            const Value& init = a.positional[0];
            if (init.is_dict()) {
              ns->attrs = init.as_dict();
            } else {
              for (const auto& pair : iterate(init)) {
                const auto kv = iterate(pair);
                if (kv.size() != 2 || !kv[0].is_string())
                  throw EvalError("namespace() takes a mapping or (name, value) pairs");
                ns->attrs.set(kv[0].as_string(), kv[1]);
              }
            }
          }
          for (const auto& [k, v] : a.keyword) ns->attrs.set(k, v);
          return Value(std::move(ns));
        }));
  g.set("dict", make_callable("dict", [](Args& a) {
          Dict d;
          if (a.positional.size() > 1)
            throw EvalError("dict() takes at most 1 positional argument");
          if (!a.positional.empty()) {
            if (!a.positional[0].is_dict()) throw EvalError("dict() takes a mapping");
            d = a.positional[0].as_dict();
          }
          for (const auto& [k, v] : a.keyword) d.set(k, v);
          return make_dict(std::move(d));
        }));
  g.set("raise_exception", make_callable("raise_exception", [](Args& a) -> Value {
          throw RaisedError(a.positional.empty() ? std::string() : to_str(a.positional[0]));
        }));
  g.set("strftime_now", make_callable("strftime_now", [](Args& a) {
          a.check("strftime_now", 1, {});
          if (a.positional.empty() || !a.positional[0].is_string())
            throw EvalError("strftime_now() takes a format string");
          const std::time_t now = std::time(nullptr);
          std::tm local{};
          localtime_r(&now, &local);
          char buf[256];
          const size_t n =
              std::strftime(buf, sizeof buf, a.positional[0].as_string().c_str(), &local);
          return Value(std::string(buf, n));
        }));
  return g;
}

}  // namespace kestrel::jinja
