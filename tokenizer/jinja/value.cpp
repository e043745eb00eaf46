#include "tokenizer/jinja/value.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace kestrel::jinja {

// ---- Value ----

bool Value::is_list() const { return std::holds_alternative<std::shared_ptr<List>>(v_); }
bool Value::is_tuple() const { return is_list() && as_list().tuple; }
bool Value::is_iterator() const { return is_list() && as_list().iterator; }

int64_t Value::as_int() const {
  if (is_bool()) return as_bool() ? 1 : 0;
  return held<int64_t>("an integer");
}

void Value::wrong_type(const char* what) const {
  if (is_undefined()) throw EvalError(std::get<Undefined>(v_).hint);
  throw EvalError(fmt::format("expected {}, got {}", what, type_name(*this)));
}

double Value::as_float() const {
  if (is_float()) return std::get<double>(v_);
  return static_cast<double>(as_int());
}

const void* Value::identity() const {
  if (is_list()) return std::get<std::shared_ptr<List>>(v_).get();
  if (is_dict()) return std::get<std::shared_ptr<Dict>>(v_).get();
  if (is_namespace()) return std::get<std::shared_ptr<Namespace>>(v_).get();
  if (is_callable()) return std::get<std::shared_ptr<Callable>>(v_).get();
  return nullptr;
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  for (auto& [k, old] : items) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  items.emplace_back(key, std::move(v));
}

const Value* Args::get(size_t index, std::string_view name) const {
  if (index < positional.size()) return &positional[index];
  for (const auto& [k, v] : keyword)
    if (k == name) return &v;
  return nullptr;
}

void Args::check(std::string_view function, size_t max_positional,
                 std::initializer_list<std::string_view> names) const {
  if (positional.size() > max_positional)
    throw EvalError(fmt::format("{}() takes at most {} positional argument{} ({} given)", function,
                                max_positional, max_positional == 1 ? "" : "s", positional.size()));
  for (const auto& [k, v] : keyword)
    if (std::find(names.begin(), names.end(), k) == names.end())
      throw EvalError(fmt::format("{}() got an unexpected keyword argument '{}'", function, k));
}

Value make_list(std::vector<Value> items, bool tuple) {
  auto l = std::make_shared<List>();
  l->items = std::move(items);
  l->tuple = tuple;
  return Value(std::move(l));
}

Value make_iterator(std::vector<Value> items) {
  auto l = std::make_shared<List>();
  l->items = std::move(items);
  l->iterator = true;
  return Value(std::move(l));
}

Value make_dict(Dict d) { return Value(std::make_shared<Dict>(std::move(d))); }

Value make_callable(std::string name, std::function<Value(Args&)> call) {
  return Value(std::make_shared<Callable>(Callable{std::move(name), std::move(call)}));
}

// ---- JSON ----

Value from_json(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return Value(None{});
    case Json::value_t::boolean:
      return Value(j.get<bool>());
    case Json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case Json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        throw EvalError(fmt::format("integer {} is too large", u));
      return Value(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float:
      return Value(j.get<double>());
    case Json::value_t::string:
      return Value(j.get<std::string>());
    case Json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return make_list(std::move(items));
    }
    case Json::value_t::object: {
      Dict d;
      d.items.reserve(j.size());
      for (const auto& [k, v] : j.items()) d.items.emplace_back(k, from_json(v));
      return make_dict(std::move(d));
    }
    default:
      throw EvalError("binary JSON values are not template values");
  }
}

Json to_json(const Value& v) {
  if (v.is_none() || v.is_undefined()) return nullptr;
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int();
  if (v.is_float()) return v.as_float();
  if (v.is_string()) return v.as_string();
  if (v.is_list() && !v.is_iterator()) {
    Json a = Json::array();
    for (const auto& e : v.as_list().items) a.push_back(to_json(e));
    return a;
  }
  const Dict* d = v.is_dict() ? &v.as_dict() : v.is_namespace() ? &v.as_namespace().attrs : nullptr;
  if (d) {
    Json o = Json::object();
    for (const auto& [k, e] : d->items) o[k] = to_json(e);
    return o;
  }
  throw EvalError(fmt::format("a {} cannot be passed as JSON", type_name(v)));
}

// ---- UTF-8 ----

std::u32string decode_utf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    int n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) {  // invalid byte: kept as the code point of its value
      out.push_back(b);
      ++i;
      continue;
    }
    char32_t c = n == 1 ? b : b & (0x7F >> n);
    for (int k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(c);
    i += n;
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

std::string encode_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

namespace {

// Case mapping of ASCII and Latin-1 letters; other scripts are left as they are (documented in
// docs/chat-templates.md). Python's full mapping needs Unicode tables this layer does not carry.
std::string map_case(std::string_view s, bool upper) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : decode_utf8(s)) {
    if (upper) {
      if ((c >= 'a' && c <= 'z') || (c >= 0xE0 && c <= 0xFE && c != 0xF7))
        c -= 0x20;
      else if (c == 0xFF)
        c = 0x178;
      else if (c == 0xDF) {  // ß
        out += "SS";
        continue;
      }
    } else if ((c >= 'A' && c <= 'Z') || (c >= 0xC0 && c <= 0xDE && c != 0xD7)) {
      c += 0x20;
    }
    append_utf8(out, c);
  }
  return out;
}

// Python's str.isprintable() for what repr() must escape, without Unicode tables: controls,
// the non-ASCII spaces, the usual format characters and private use.
bool printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F)) return false;
  if ((c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF) return false;
  if ((c >= 0xE000 && c <= 0xF8FF) || c >= 0xF0000 || c == 0xFFFE || c == 0xFFFF) return false;
  return true;
}

std::string repr_string(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : decode_utf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (!printable(c)) {
      out += c < 0x100     ? fmt::format("\\x{:02x}", static_cast<uint32_t>(c))
             : c < 0x10000 ? fmt::format("\\u{:04x}", static_cast<uint32_t>(c))
                           : fmt::format("\\U{:08x}", static_cast<uint32_t>(c));
    } else {
      append_utf8(out, c);
    }
  }
  out += quote;
  return out;
}

std::string repr_sequence(const List& l) {
  std::string out(1, l.tuple ? '(' : '[');
  for (size_t i = 0; i < l.items.size(); ++i) {
    if (i) out += ", ";
    out += repr(l.items[i]);
  }
  if (l.tuple && l.items.size() == 1) out += ',';
  out += l.tuple ? ')' : ']';
  return out;
}

std::string repr_dict(const Dict& d) {
  std::string out = "{";
  for (size_t i = 0; i < d.items.size(); ++i) {
    if (i) out += ", ";
    out += repr_string(d.items[i].first) + ": " + repr(d.items[i].second);
  }
  return out + "}";
}

}  // namespace

std::string to_upper(std::string_view s) { return map_case(s, true); }
std::string to_lower(std::string_view s) { return map_case(s, false); }

// ---- printing ----

// Python's repr(float): the shortest digits that read back to the same double, in positional
// notation when the exponent is in [-4, 16), else as 1e+16; always with a ".0" or an exponent.
std::string python_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, end - buf);  // "-1.2345e+02"
  std::string sign;
  if (sci.front() == '-') {
    sign = "-";
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c != '.') digits += c;
  int exponent = 0;
  std::from_chars(sci.data() + e + 1 + (sci[e + 1] == '+'), sci.data() + sci.size(), exponent);
  const int point = exponent + 1;  // digits before the decimal point
  const int n = static_cast<int>(digits.size());
  if (point > -4 && point <= 16) {
    if (point <= 0) return sign + "0." + std::string(-point, '0') + digits;
    if (point >= n) return sign + digits + std::string(point - n, '0') + ".0";
    return sign + digits.substr(0, point) + "." + digits.substr(point);
  }
  std::string mantissa = digits.substr(0, 1);
  if (n > 1) mantissa += "." + digits.substr(1);
  return fmt::format("{}{}e{}{:02}", sign, mantissa, exponent < 0 ? '-' : '+', std::abs(exponent));
}

std::string to_str(const Value& v) {
  if (v.is_undefined()) return "";
  if (v.is_string()) return v.as_string();
  return repr(v);
}

std::string repr(const Value& v) {
  if (v.is_undefined()) return "Undefined";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.as_bool() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.as_int());
  if (v.is_float()) return python_float(v.as_float());
  if (v.is_string()) return repr_string(v.as_string());
  if (v.is_iterator()) return "<generator object>";
  if (v.is_list()) return repr_sequence(v.as_list());
  if (v.is_dict()) return repr_dict(v.as_dict());
  if (v.is_namespace()) return "<Namespace " + repr_dict(v.as_namespace().attrs) + ">";
  return "<function " + v.as_callable().name + ">";
}

std::string type_name(const Value& v) {
  if (v.is_undefined()) return "Undefined";
  if (v.is_none()) return "NoneType";
  if (v.is_bool()) return "bool";
  if (v.is_int()) return "int";
  if (v.is_float()) return "float";
  if (v.is_string()) return "str";
  if (v.is_tuple()) return "tuple";
  if (v.is_iterator()) return "generator";
  if (v.is_list()) return "list";
  if (v.is_dict()) return "dict";
  if (v.is_namespace()) return "Namespace";
  return "function";
}

std::string object_description(const Value& v) {
  if (v.is_none()) return "None";
  return "'" + type_name(v) + " object'";
}

// ---- json.dumps ----

namespace {

void dump_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : decode_utf8(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c > 0x7E && c < 0x10000)) {
          out += fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
        } else if (ensure_ascii && c >= 0x10000) {  // a surrogate pair, as Python writes it
          const uint32_t u = c - 0x10000;
          out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (u >> 10), 0xDC00 + (u & 0x3FF));
        } else {
          append_utf8(out, c);
        }
    }
  }
  out += '"';
}

void dump(std::string& out, const Value& v, const JsonStyle& st, int depth) {
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    const double d = v.as_float();
    out += std::isnan(d)   ? "NaN"
           : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity")
                           : python_float(d);
  } else if (v.is_string()) {
    dump_string(out, v.as_string(), st.ensure_ascii);
  } else if ((v.is_list() && !v.is_iterator()) || v.is_dict()) {
    const bool list = v.is_list();
    const size_t n = list ? v.as_list().items.size() : v.as_dict().items.size();
    if (n == 0) {
      out += list ? "[]" : "{}";
      return;
    }
    std::string inner_indent, outer_indent;
    if (st.pretty) {
      outer_indent = "\n";
      for (int i = 0; i < depth; ++i) outer_indent += st.indent;
      inner_indent = outer_indent + st.indent;
    }
    out += list ? '[' : '{';
    out += inner_indent;
    if (list) {
      const auto& items = v.as_list().items;
      for (size_t i = 0; i < n; ++i) {
        if (i) out += st.item_separator + inner_indent;
        dump(out, items[i], st, depth + 1);
      }
    } else {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.as_dict().items) items.push_back(&kv);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      for (size_t i = 0; i < n; ++i) {
        if (i) out += st.item_separator + inner_indent;
        dump_string(out, items[i]->first, st.ensure_ascii);
        out += st.key_separator;
        dump(out, items[i]->second, st, depth + 1);
      }
    }
    out += outer_indent;
    out += list ? ']' : '}';
  } else {
    throw EvalError(fmt::format("Object of type {} is not JSON serializable", type_name(v)));
  }
}

}  // namespace

std::string dump_json(const Value& v, const JsonStyle& style) {
  std::string out;
  dump(out, v, style, 0);
  return out;
}

// ---- truth, equality, order ----

void require_defined(const Value& v) {
  if (v.is_undefined()) throw EvalError(v.undefined_hint());
}

bool truthy(const Value& v) {
  if (v.is_undefined() || v.is_none()) return false;
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int() != 0;
  if (v.is_float()) return v.as_float() != 0.0;
  if (v.is_string()) return !v.as_string().empty();
  if (v.is_list()) return v.is_iterator() || !v.as_list().items.empty();
  if (v.is_dict()) return !v.as_dict().items.empty();
  return true;
}

bool equals(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  if (a.is_none() || b.is_none()) return a.is_none() && b.is_none();
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.as_string() == b.as_string();
  if (a.is_list() && b.is_list() && !a.is_iterator() && !b.is_iterator()) {
    const auto& x = a.as_list();
    const auto& y = b.as_list();
    if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
    for (size_t i = 0; i < x.items.size(); ++i)
      if (!equals(x.items[i], y.items[i])) return false;
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const auto& x = a.as_dict();
    const auto& y = b.as_dict();
    if (x.items.size() != y.items.size()) return false;
    for (const auto& [k, v] : x.items) {
      const Value* other = y.find(k);
      if (!other || !equals(v, *other)) return false;
    }
    return true;
  }
  return a.identity() != nullptr && a.identity() == b.identity();
}

int compare(const Value& a, const Value& b) {
  require_defined(a);
  require_defined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {  // bytewise UTF-8 order is code point order, as Python's
    const int c = a.as_string().compare(b.as_string());
    return (c > 0) - (c < 0);
  }
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple() && !a.is_iterator() &&
      !b.is_iterator()) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i])) continue;
      return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  throw EvalError(fmt::format("cannot compare '{}' with '{}'", type_name(a), type_name(b)));
}

std::vector<Value> iterate(const Value& v) {
  if (v.is_undefined()) return {};
  if (v.is_list()) return v.as_list().items;
  if (v.is_dict()) {
    std::vector<Value> keys;
    for (const auto& kv : v.as_dict().items) keys.emplace_back(kv.first);
    return keys;
  }
  if (v.is_string()) {
    std::vector<Value> chars;
    for (char32_t c : decode_utf8(v.as_string())) chars.emplace_back(encode_utf8({&c, 1}));
    return chars;
  }
  throw EvalError(fmt::format("'{}' object is not iterable", type_name(v)));
}

}  // namespace kestrel::jinja
