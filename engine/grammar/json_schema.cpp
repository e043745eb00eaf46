// The converter follows llama.cpp's json-schema-to-grammar in its choices, so that grammars
// behave as users of that server expect:
//   - whitespace: `space ::= | " " | "\n"{1,2} [ \t]{0,20}` after each token of JSON;
//   - numbers: at most 16 integral digits and 16 fraction digits;
//   - objects: properties in the order the schema lists them, each optional one may be left
//     out; additionalProperties absent or false allows no other key, true or a schema allows
//     further keys (not one of the listed ones) after the listed properties;
//   - oneOf is read as anyOf (the alternatives are not made exclusive).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "engine/grammar/json_schema.h"

namespace kestrel::grammar {

namespace {

using json = nlohmann::ordered_json;

const char* const kSpace = R"(| " " | "\n"{1,2} [ \t]{0,20})";
const char* const kChar = R"([^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))";
const std::map<std::string, std::string> kPrimitives = {
    {"space", kSpace},
    {"char", kChar},
    {"boolean", R"(("true" | "false") space)"},
    {"null", R"("null" space)"},
    {"integral-part", R"([0] | [1-9] [0-9]{0,15})"},
    {"decimal-part", R"([0-9]{1,16})"},
    {"integer", R"(("-"? integral-part) space)"},
    // The exponent has at most two digits (llama.cpp allows 16): 1e999 is valid JSON that
    // overflows a double, and parsers refuse it.
    {"number", R"(("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9]{1,2})? space)"},
    {"string", R"("\"" char* "\"" space)"},
    {"value", R"(object | array | string | number | boolean | null)"},
    {"object", R"("{" space ( string ":" space value ("," space string ":" space value)* )? "}" space)"},
    {"array", R"("[" space ( value ("," space value)* )? "]" space)"},
    // Formats (RFC 3339 as Python's and ajv's checkers read it): real calendar dates, with
    // February 29 only in leap years.
    {"date-year", R"([0-9]{4})"},
    {"date-leap-year", R"([0-9]{2} ([02468] [48] | [13579] [26] | [2468] [0]) | ([02468] [048] | [13579] [26]) "00")"},
    {"date-month-day", R"(("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | "02-" ("0" [1-9] | "1" [0-9] | "2" [0-8]))"},
    {"date-body", R"(date-year "-" date-month-day | date-leap-year "-02-29")"},
    {"time-body", R"(([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{1,6})? ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9]))"},
    {"uuid-body", R"([0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12})"},
};
const std::map<std::string, std::vector<std::string>> kDeps = {
    {"boolean", {"space"}}, {"null", {"space"}}, {"integer", {"integral-part", "space"}},
    {"number", {"integral-part", "decimal-part", "space"}}, {"string", {"char", "space"}},
    {"value", {"object", "array", "string", "number", "boolean", "null"}},
    {"object", {"string", "value", "space"}}, {"array", {"value", "space"}},
    {"date-body", {"date-year", "date-month-day", "date-leap-year"}},
};

const std::set<std::string> kAnnotations = {"title", "description", "$schema", "$id", "default",
                                            "examples", "$comment", "deprecated", "readOnly",
                                            "writeOnly", "$defs", "definitions"};
const std::set<std::string> kKeywords = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "$ref"};


std::string hexcp(uint32_t cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "\\U%08X", cp);
  return buf;
}

// JSON's text for one code point inside a string: escaped where JSON requires it.
std::string json_char(uint32_t cp) {
  std::string u;
  if (cp < 0x80) u = std::string(1, static_cast<char>(cp));
  else if (cp < 0x800) u = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
  else if (cp < 0x10000) u = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
  else u = {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
  std::string d = json(u).dump();
  return d.substr(1, d.size() - 2);
}

std::string digits(uint64_t v) { return std::to_string(v); }

// Decimal numerals of [lo, hi] (same number of digits), without leading zeros beyond that.
std::string same_len_range(const std::string& lo, const std::string& hi) {
  if (lo.size() == 1) return lo == hi ? "[" + lo + "]" : "[" + lo + "-" + hi + "]";
  const size_t rest = lo.size() - 1;
  const std::string rest_lo = lo.substr(1), rest_hi = hi.substr(1);
  if (lo[0] == hi[0]) return "\"" + std::string(1, lo[0]) + "\" (" + same_len_range(rest_lo, rest_hi) + ")";
  const std::string zeros(rest, '0'), nines(rest, '9');
  if (rest_lo == zeros && rest_hi == nines) {
    return "[" + std::string(1, lo[0]) + "-" + std::string(1, hi[0]) + "] [0-9]{" + std::to_string(rest) + "}";
  }
  std::vector<std::string> alts;
  alts.push_back("\"" + std::string(1, lo[0]) + "\" (" + same_len_range(rest_lo, nines) + ")");
  if (hi[0] - lo[0] > 1) {
    alts.push_back("[" + std::string(1, static_cast<char>(lo[0] + 1)) + "-" +
                   std::string(1, static_cast<char>(hi[0] - 1)) + "] [0-9]{" + std::to_string(rest) + "}");
  }
  alts.push_back("\"" + std::string(1, hi[0]) + "\" (" + same_len_range(zeros, rest_hi) + ")");
  std::string out;
  for (const auto& a : alts) out += (out.empty() ? "" : " | ") + a;
  return out;
}

// Decimal numerals of [lo, hi], 0 <= lo <= hi.
std::string uint_range(uint64_t lo, uint64_t hi) {
  std::vector<std::string> alts;
  std::string a = digits(lo), b = digits(hi);
  while (a.size() < b.size()) {
    alts.push_back("(" + same_len_range(a, std::string(a.size(), '9')) + ")");
    a = "1" + std::string(a.size(), '0');
  }
  alts.push_back("(" + same_len_range(a, b) + ")");
  std::string out;
  for (const auto& x : alts) out += (out.empty() ? "" : " | ") + x;
  return "(" + out + ")";
}

// Numerals >= lo (lo >= 0) with at most 16 digits, as integral-part allows.
std::string uint_from(uint64_t lo) {
  std::string a = digits(lo);
  std::string out = uint_range(lo, static_cast<uint64_t>(std::pow(10.0, static_cast<double>(a.size()))) - 1);
  if (a.size() < 16) out = "(" + out + " | [1-9] [0-9]{" + std::to_string(a.size()) + ",15})";
  return out;
}

class Converter {
 public:
  explicit Converter(const json& root) : root_(root) {}

  std::string run() {
    std::string body = visit(root_, "");
    std::string out = "root ::= " + body + "\n";
    for (const auto& [name, rule] : rules_) out += name + " ::= " + rule + "\n";
    return out;
  }

  std::string prim(const std::string& name) {
    if (rules_.count(name)) return name;
    rules_[name] = kPrimitives.at(name);
    auto d = kDeps.find(name);
    if (d != kDeps.end()) {
      for (const auto& dep : d->second) prim(dep);
    }
    return name;
  }

 private:
  [[noreturn]] static void refuse(const std::string& path, const std::string& what) {
    throw Error("json schema: " + (path.empty() ? std::string("/") : path) + ": " + what);
  }

  static std::string escape_pointer(const std::string& k) {
    std::string o;
    for (char c : k) o += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
    return o;
  }

  std::string fresh(const std::string& hint) {
    std::string n;
    for (char c : hint) n += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
    if (n.empty()) n = "r";
    std::string name = n;
    for (int i = 1; rules_.count(name) || reserved_.count(name); ++i) name = n + "-" + std::to_string(i);
    reserved_.insert(name);
    return name;
  }

  std::string literal_value(const json& v) { return "(" + gbnf_literal(v.dump()) + " " + prim("space") + ")"; }

  std::string visit(const json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) refuse(path, "the schema false accepts nothing");
      return prim("value");
    }
    if (!s.is_object()) refuse(path, "a schema must be an object or a boolean");
    for (const auto& [k, v] : s.items()) {
      if (!kKeywords.count(k) && !kAnnotations.count(k)) refuse(path, "unsupported keyword '" + k + "'");
    }
    if (s.contains("$ref")) return ref(s, path);
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      const json& alts = s[k];
      if (!alts.is_array() || alts.empty()) refuse(path + "/" + k, "expected a non-empty array");
      if (s.size() > 1 + count_annotations(s)) refuse(path, std::string("keywords beside '") + k + "' are not supported");
      std::string out;
      for (size_t i = 0; i < alts.size(); ++i) {
        out += (i ? " | " : "") + visit(alts[i], path + "/" + k + "/" + std::to_string(i));
      }
      return "(" + out + ")";
    }
    if (s.contains("const")) return literal_value(s["const"]);
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) refuse(path + "/enum", "expected a non-empty array");
      std::string out;
      for (const auto& v : e) out += (out.empty() ? "" : " | ") + literal_value(v);
      return "(" + out + ")";
    }
    if (s.contains("type") && s["type"].is_array()) {
      const json& ts = s["type"];
      if (ts.empty()) refuse(path + "/type", "expected a non-empty array");
      std::string out;
      for (size_t i = 0; i < ts.size(); ++i) {
        if (!ts[i].is_string()) refuse(path + "/type/" + std::to_string(i), "expected a type name");
        out += (i ? " | " : "") + typed(s, ts[i].get<std::string>(), path);
      }
      return "(" + out + ")";
    }
    std::string type;
    if (s.contains("type")) {
      if (!s["type"].is_string()) refuse(path + "/type", "expected a type name or an array of them");
      type = s["type"].get<std::string>();
    } else if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) {
      type = "object";
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      type = "array";
    } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern") || s.contains("format")) {
      type = "string";
    } else if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") || s.contains("exclusiveMaximum")) {
      type = "number";
    } else {
      return prim("value");
    }
    return typed(s, type, path);
  }

  static size_t count_annotations(const json& s) {
    size_t n = 0;
    for (const auto& [k, v] : s.items()) n += kAnnotations.count(k);
    return n;
  }

  std::string ref(const json& s, const std::string& path) {
    if (!s["$ref"].is_string()) refuse(path + "/$ref", "expected a string");
    const std::string r = s["$ref"].get<std::string>();
    auto known = refs_.find(r);
    if (known != refs_.end()) return known->second;
    const json* target = nullptr;
    std::string name;
    if (r == "#") {
      target = &root_;
      name = "root-ref";
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (r.rfind(p, 0) == 0) {
          const std::string key = r.substr(p.size());
          const std::string defs = p.substr(2, p.size() - 3);
          if (root_.contains(defs) && root_[defs].is_object() && root_[defs].contains(key)) {
            target = &root_[defs][key];
            name = "def-" + key;
          }
        }
      }
    }
    if (!target) refuse(path + "/$ref", "unsupported or unresolvable reference '" + r + "' (only #, #/$defs/NAME and #/definitions/NAME)");
    // Named before its body is built, so that a recursive reference finds the rule.
    name = fresh(name);
    refs_[r] = name;
    std::string body = visit(*target, r.substr(1));
    reserved_.erase(name);
    rules_[name] = body;
    return name;
  }

  std::string typed(const json& s, const std::string& type, const std::string& path) {
    if (type == "object") return object(s, path);
    if (type == "array") return array(s, path);
    if (type == "string") return string(s, path);
    if (type == "integer") return integer(s, path);
    if (type == "number") {
      for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
        if (s.contains(k)) refuse(path + "/" + k, std::string("'") + k + "' on a number is not supported (only on integers)");
      }
      return prim("number");
    }
    if (type == "boolean") return prim("boolean");
    if (type == "null") return prim("null");
    refuse(path + "/type", "unknown type '" + type + "'");
  }

  uint64_t count_of(const json& s, const char* key, const std::string& path, uint64_t max) {
    const json& v = s[key];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
      refuse(path + "/" + key, "expected a non-negative integer");
    }
    uint64_t n = v.get<uint64_t>();
    if (n > max) refuse(path + "/" + key, "more than " + std::to_string(max) + " is not supported");
    return n;
  }

  std::string bounds(uint64_t min, int64_t max) {
    if (max < 0) return "{" + std::to_string(min) + ",}";
    return "{" + std::to_string(min) + "," + std::to_string(max) + "}";
  }

  std::string string(const json& s, const std::string& path) {
    const bool lengths = s.contains("minLength") || s.contains("maxLength");
    if (s.contains("format")) {
      if (lengths || s.contains("pattern")) refuse(path + "/format", "'format' together with lengths or a pattern is not supported");
      if (!s["format"].is_string()) refuse(path + "/format", "expected a string");
      const std::string f = s["format"].get<std::string>();
      std::string body;
      if (f == "date") body = prim("date-body");
      else if (f == "time") body = prim("time-body");
      else if (f == "date-time") body = prim("date-body") + " \"T\" " + prim("time-body");
      else if (f == "uuid") body = prim("uuid-body");
      else refuse(path + "/format", "unsupported format '" + f + "' (date, time, date-time, uuid)");
      return "(\"\\\"\" " + body + " \"\\\"\" " + prim("space") + ")";
    }
    if (s.contains("pattern")) {
      if (lengths) refuse(path + "/pattern", "'pattern' together with minLength or maxLength is not supported");
      if (!s["pattern"].is_string()) refuse(path + "/pattern", "expected a string");
      return "(\"\\\"\" " + regex(s["pattern"].get<std::string>(), path + "/pattern") + " \"\\\"\" " + prim("space") + ")";
    }
    if (!lengths) return prim("string");
    const uint64_t min = s.contains("minLength") ? count_of(s, "minLength", path, 10000) : 0;
    const int64_t max = s.contains("maxLength") ? static_cast<int64_t>(count_of(s, "maxLength", path, 10000)) : -1;
    if (max >= 0 && static_cast<uint64_t>(max) < min) refuse(path + "/maxLength", "maxLength is below minLength");
    prim("char");
    return "(\"\\\"\" char" + bounds(min, max) + " \"\\\"\" " + prim("space") + ")";
  }

  std::string array(const json& s, const std::string& path) {
    std::string item = s.contains("items") ? visit(s["items"], path + "/items") : prim("value");
    const uint64_t min = s.contains("minItems") ? count_of(s, "minItems", path, 1000) : 0;
    const int64_t max = s.contains("maxItems") ? static_cast<int64_t>(count_of(s, "maxItems", path, 1000)) : -1;
    if (max >= 0 && static_cast<uint64_t>(max) < min) refuse(path + "/maxItems", "maxItems is below minItems");
    const std::string sp = prim("space");
    std::string list;
    if (max == 0) {
      list = "";
    } else {
      // item ("," item){min-1, max-1}, optional as a whole when min is 0.
      const uint64_t rmin = min > 0 ? min - 1 : 0;
      const int64_t rmax = max < 0 ? -1 : max - 1;
      std::string rest = rmax == 0 ? "" : " (\",\" " + sp + " " + item + ")" + bounds(rmin, rmax);
      list = "(" + item + rest + ")" + (min == 0 ? "?" : "");
    }
    return "(\"[\" " + sp + " " + list + " \"]\" " + sp + ")";
  }

  std::string integer(const json& s, const std::string& path) {
    bool has_lo = false, has_hi = false;
    int64_t lo = 0, hi = 0;
    auto num = [&](const char* k) {
      const json& v = s[k];
      if (!v.is_number()) refuse(path + "/" + k, "expected a number");
      double d = v.get<double>();
      if (std::fabs(d) > 1e15) refuse(path + "/" + k, "bounds beyond 1e15 are not supported");
      return d;
    };
    auto raise_lo = [&](int64_t v) { lo = has_lo ? std::max(lo, v) : v; has_lo = true; };
    auto lower_hi = [&](int64_t v) { hi = has_hi ? std::min(hi, v) : v; has_hi = true; };
    if (s.contains("minimum")) raise_lo(static_cast<int64_t>(std::ceil(num("minimum"))));
    if (s.contains("exclusiveMinimum")) raise_lo(static_cast<int64_t>(std::floor(num("exclusiveMinimum"))) + 1);
    if (s.contains("maximum")) lower_hi(static_cast<int64_t>(std::floor(num("maximum"))));
    if (s.contains("exclusiveMaximum")) lower_hi(static_cast<int64_t>(std::ceil(num("exclusiveMaximum"))) - 1);
    if (!has_lo && !has_hi) return prim("integer");
    if (has_lo && has_hi && lo > hi) refuse(path, "no integer lies between the bounds");
    const std::string any_neg = "\"-\" [1-9] [0-9]{0,15}";
    std::vector<std::string> alts;
    if (has_lo && has_hi) {
      if (lo < 0) alts.push_back("\"-\" " + uint_range(hi < 0 ? static_cast<uint64_t>(-hi) : 1, static_cast<uint64_t>(-lo)));
      if (hi >= 0) alts.push_back(uint_range(lo < 0 ? 0 : static_cast<uint64_t>(lo), static_cast<uint64_t>(hi)));
    } else if (has_lo) {
      if (lo < 0) alts.push_back("\"-\" " + uint_range(1, static_cast<uint64_t>(-lo)));
      alts.push_back(uint_from(lo < 0 ? 0 : static_cast<uint64_t>(lo)));
    } else {
      if (hi >= 0) {
        alts.push_back(any_neg);
        alts.push_back(uint_range(0, static_cast<uint64_t>(hi)));
      } else {
        alts.push_back("\"-\" " + uint_from(static_cast<uint64_t>(-hi)));
      }
    }
    std::string out;
    for (const auto& a : alts) out += (out.empty() ? "" : " | ") + a;
    return "((" + out + ") " + prim("space") + ")";
  }

  std::string object(const json& s, const std::string& path) {
    std::vector<std::pair<std::string, std::string>> props;  // key (JSON text), value rule
    std::vector<bool> required;
    std::set<std::string> req;
    if (s.contains("required")) {
      if (!s["required"].is_array()) refuse(path + "/required", "expected an array of names");
      for (const auto& r : s["required"]) {
        if (!r.is_string()) refuse(path + "/required", "expected an array of names");
        req.insert(r.get<std::string>());
      }
    }
    std::set<std::string> names;
    if (s.contains("properties")) {
      const json& p = s["properties"];
      if (!p.is_object()) refuse(path + "/properties", "expected an object");
      for (const auto& [k, v] : p.items()) {
        std::string rule = fresh("prop-" + k);
        std::string body = visit(v, path + "/properties/" + escape_pointer(k));
        reserved_.erase(rule);
        rules_[rule] = body;
        props.push_back({json(k).dump(), rule});
        required.push_back(req.count(k) > 0);
        names.insert(json(k).dump());
      }
    }
    for (const auto& r : req) {
      if (!names.count(json(r).dump())) refuse(path + "/required", "'" + r + "' is required but not among the properties");
    }
    std::string extra;  // one more key-value pair, or "" when none is allowed
    if (s.contains("additionalProperties")) {
      const json& a = s["additionalProperties"];
      if (!(a.is_boolean() && !a.get<bool>())) {
        std::string value = visit(a, path + "/additionalProperties");
        extra = "(" + other_key(names) + " \":\" " + prim("space") + " " + value + ")";
      }
    }
    const std::string sp = prim("space");
    // rest_k: properties k.. after something was written (each comes with its comma);
    // first_k: properties k.. when nothing was written yet.
    const size_t n = props.size();
    std::vector<std::string> rest(n + 1), first(n + 1);
    const std::string base = "obj" + std::to_string(++objects_);
    auto kv = [&](size_t i) { return "(" + gbnf_literal(props[i].first) + " " + sp + " \":\" " + sp + " " + props[i].second + ")"; };
    rest[n] = extra.empty() ? "" : "(\",\" " + sp + " " + extra + ")*";
    first[n] = extra.empty() ? "" : "(" + extra + " " + rest[n] + ")?";
    for (size_t k = n; k-- > 0;) {
      std::string rn = base + "-rest-" + std::to_string(k);
      std::string fn = base + "-first-" + std::to_string(k);
      std::string with = "\",\" " + sp + " " + kv(k) + " " + (rest[k + 1].empty() ? "" : rest[k + 1]);
      rules_[rn] = required[k] ? with : with + " | " + (rest[k + 1].empty() ? "\"\"" : rest[k + 1]);
      std::string fwith = kv(k) + " " + (rest[k + 1].empty() ? "" : rest[k + 1]);
      rules_[fn] = required[k] ? fwith : fwith + " | " + (first[k + 1].empty() ? "\"\"" : first[k + 1]);
      rest[k] = rn;
      first[k] = fn;
    }
    return "(\"{\" " + sp + " " + first[0] + " \"}\" " + sp + ")";
  }

  // A JSON string key that is none of `names` (JSON texts, quotes included): a trie of the
  // names, leaving it at the first character that differs (never at a backslash, so an
  // escape cannot spell a listed name another way).
  std::string other_key(const std::set<std::string>& names) {
    prim("char");
    std::vector<std::vector<uint32_t>> inner;
    for (const auto& n : names) {
      RegexConv r{n, "", 1};
      std::vector<uint32_t> cps;
      while (r.pos + 1 < n.size()) cps.push_back(r.utf8());
      inner.push_back(std::move(cps));
    }
    return "(\"\\\"\" (" + key_trie(inner, 0) + ") " + prim("space") + ")";
  }

  // Over code points: `words` hold each name's characters.
  std::string key_trie(const std::vector<std::vector<uint32_t>>& words, size_t depth) {
    std::map<uint32_t, std::vector<std::vector<uint32_t>>> next;
    bool ends_here = false;
    for (const auto& w : words) {
      if (w.size() == depth) ends_here = true;
      else next[w[depth]].push_back(w);
    }
    std::string cls = "[^\"\\\\\\x7F\\x00-\\x1F";
    std::vector<std::string> alts;
    for (const auto& [c, ws] : next) {
      cls += hexcp(c);
      alts.push_back("[" + hexcp(c) + "] (" + key_trie(ws, depth + 1) + ")");
    }
    alts.push_back(cls + "] char* \"\\\"\"");
    if (!ends_here) alts.push_back("\"\\\"\"");
    std::string out;
    for (const auto& a : alts) out += (out.empty() ? "" : " | ") + a;
    return out;
  }

  // A practical subset of regular expressions, read as a match of the whole string (a
  // string matching the whole pattern also matches the search that JSON Schema specifies).
  // Characters that JSON must escape come out escaped when written literally; classes and
  // '.' never produce '"', '\' or control characters.
  std::string regex(const std::string& re, const std::string& path) {
    RegexConv c{re, path, 0};
    if (!re.empty() && re[0] == '^') c.pos = 1;
    std::string out = c.alternation();
    if (c.pos < re.size() && re[c.pos] == '$' && c.pos + 1 == re.size()) ++c.pos;
    if (c.pos != re.size()) c.fail("unexpected '" + std::string(1, re[c.pos]) + "'");
    return "(" + out + ")";
  }

  struct RegexConv {
    const std::string& s;
    std::string path;
    size_t pos;

    [[noreturn]] void fail(const std::string& what) const {
      throw Error("json schema: " + path + ": " + what + " at offset " + std::to_string(pos) + " of the pattern");
    }
    bool more() const { return pos < s.size(); }
    char peek() const { return s[pos]; }

    std::string alternation() {
      std::string out = sequence();
      while (more() && peek() == '|') {
        ++pos;
        out += " | " + sequence();
      }
      return out;
    }

    std::string sequence() {
      std::string out;
      while (more() && peek() != '|' && peek() != ')') {
        if (peek() == '$' && pos + 1 == s.size()) break;
        std::string atom = this->atom();
        if (!out.empty()) out += ' ';
        out += quantified(atom);
      }
      return out.empty() ? "\"\"" : out;
    }

    std::string quantified(const std::string& atom) {
      if (!more()) return atom;
      std::string q;
      char c = peek();
      if (c == '*' || c == '+' || c == '?') {
        q = std::string(1, c);
        ++pos;
      } else if (c == '{') {
        size_t close = s.find('}', pos);
        if (close == std::string::npos) fail("unterminated '{'");
        std::string body = s.substr(pos + 1, close - pos - 1);
        // {m}, {m,} or {m,n} with m <= n <= 10000, checked here so that the generated GBNF
        // always compiles and a mistake names the pattern, not the GBNF.
        const size_t comma = body.find(',');
        const std::string lo = body.substr(0, comma);
        const std::string hi = comma == std::string::npos ? lo : body.substr(comma + 1);
        auto number = [&](const std::string& t) {
          if (t.empty() || t.size() > 5 || !std::all_of(t.begin(), t.end(), [](char d) { return std::isdigit(static_cast<unsigned char>(d)); }))
            fail("bad repetition '{" + body + "}'");
          const int v = std::stoi(t);
          if (v > 10000) fail("repetition '{" + body + "}' over 10000");
          return v;
        };
        const int m = number(lo);
        if (!(comma != std::string::npos && hi.empty()) && number(hi) < m)
          fail("repetition '{" + body + "}' with its maximum below its minimum");
        q = "{" + body + "}";
        pos = close + 1;
      } else {
        return atom;
      }
      if (more() && peek() == '?') ++pos;  // lazy: the same strings
      if (more() && peek() == '+') fail("possessive quantifiers are not supported");
      return "(" + atom + ")" + q;
    }

    uint32_t utf8() {
      unsigned char c = static_cast<unsigned char>(s[pos]);
      int n = c < 0x80 ? 0 : c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : 1;
      if (pos + n >= s.size() + (n == 0 ? 1 : 0) && n > 0) fail("invalid UTF-8");
      uint32_t cp = n == 0 ? c : c & (0x3F >> n);
      for (int i = 1; i <= n; ++i) cp = (cp << 6) | (static_cast<unsigned char>(s[pos + i]) & 0x3F);
      pos += n + 1;
      return cp;
    }

    // Ranges of a class escape (\d \w \s), or empty when `e` is none.
    static std::vector<std::pair<uint32_t, uint32_t>> class_escape(char e) {
      switch (e) {
        case 'd': return {{'0', '9'}};
        case 'w': return {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
        case 's': return {{' ', ' '}};
        default: return {};
      }
    }

    static std::vector<std::pair<uint32_t, uint32_t>> negate(std::vector<std::pair<uint32_t, uint32_t>> r) {
      std::sort(r.begin(), r.end());
      std::vector<std::pair<uint32_t, uint32_t>> out;
      uint32_t next = 0;
      for (const auto& [lo, hi] : r) {
        if (lo > next) out.push_back({next, lo - 1});
        next = std::max(next, hi + 1);
      }
      if (next <= 0x10FFFF) out.push_back({next, 0x10FFFF});
      return out;
    }

    // A GBNF class of these ranges less what JSON must escape (and surrogates).
    static std::string safe_class(const std::vector<std::pair<uint32_t, uint32_t>>& r) {
      std::string out = "[";
      bool any = false;
      auto add = [&](uint32_t lo, uint32_t hi) {
        if (lo > hi) return;
        out += hexcp(lo) + (lo == hi ? "" : "-" + hexcp(hi));
        any = true;
      };
      for (auto [lo, hi] : r) {
        lo = std::max<uint32_t>(lo, 0x20);
        // Cut out '"' (0x22), '\' (0x5C), DEL (0x7F) and the surrogates.
        const uint32_t cuts[][2] = {{0x22, 0x22}, {0x5C, 0x5C}, {0x7F, 0x7F}, {0xD800, 0xDFFF}};
        uint32_t cur = lo;
        for (const auto& cut : cuts) {
          if (cur > hi) break;
          if (cut[1] < cur) continue;
          if (cut[0] > hi) break;
          if (cut[0] > cur) add(cur, cut[0] - 1);
          cur = cut[1] + 1;
        }
        if (cur <= hi) add(cur, hi);
      }
      if (!any) return "";
      return out + "]";
    }

    std::string atom() {
      char c = peek();
      if (c == '(') {
        ++pos;
        if (more() && peek() == '?') {
          if (pos + 1 < s.size() && s[pos + 1] == ':') {
            pos += 2;
          } else {
            fail("group '(?" + std::string(1, pos + 1 < s.size() ? s[pos + 1] : ' ') + "' (lookaround, named groups, flags) is not supported");
          }
        }
        std::string inner = alternation();
        if (!more() || peek() != ')') fail("expected ')'");
        ++pos;
        return "(" + inner + ")";
      }
      if (c == '[') return char_class();
      if (c == '.') {
        ++pos;
        return safe_class({{0, '\n' - 1}, {'\n' + 1, 0x10FFFF}});
      }
      if (c == '^' || c == '$') fail("anchor '" + std::string(1, c) + "' inside the pattern is not supported");
      if (c == '*' || c == '+' || c == '?' || c == '{') fail("'" + std::string(1, c) + "' repeats nothing");
      if (c == '\\') {
        ++pos;
        if (!more()) fail("pattern ends in '\\'");
        char e = peek();
        auto r = class_escape(static_cast<char>(std::tolower(e)));
        if (!r.empty()) {
          ++pos;
          std::string cls = safe_class(std::isupper(static_cast<unsigned char>(e)) ? negate(r) : r);
          return cls;
        }
        if (std::isdigit(static_cast<unsigned char>(e))) fail("back-references are not supported");
        if (std::isalpha(static_cast<unsigned char>(e))) {
          ++pos;
          uint32_t cp = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'f' ? '\f' : e == 'v' ? '\v' : 0;
          if (!cp) fail("escape '\\" + std::string(1, e) + "' is not supported");
          return gbnf_literal(json_char(cp));
        }
        return gbnf_literal(json_char(utf8()));
      }
      return gbnf_literal(json_char(utf8()));
    }

    std::string char_class() {
      ++pos;  // '['
      bool negated = more() && peek() == '^';
      if (negated) ++pos;
      std::vector<std::pair<uint32_t, uint32_t>> r;
      bool first = true;
      while (more() && (peek() != ']' || first)) {
        first = false;
        uint32_t lo;
        if (peek() == '\\') {
          ++pos;
          if (!more()) fail("unterminated '['");
          char e = peek();
          auto esc = class_escape(static_cast<char>(std::tolower(e)));
          if (!esc.empty()) {
            ++pos;
            if (std::isupper(static_cast<unsigned char>(e))) esc = negate(esc);
            r.insert(r.end(), esc.begin(), esc.end());
            continue;
          }
          if (std::isalnum(static_cast<unsigned char>(e))) {
            ++pos;
            lo = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : 0;
            if (!lo) fail("escape '\\" + std::string(1, e) + "' in a class is not supported");
          } else {
            lo = utf8();
          }
        } else {
          lo = utf8();
        }
        uint32_t hi = lo;
        if (more() && peek() == '-' && pos + 1 < s.size() && s[pos + 1] != ']') {
          ++pos;
          if (peek() == '\\') {
            ++pos;
            if (!more()) fail("unterminated '['");
          }
          hi = utf8();
          if (hi < lo) fail("class range is backwards");
        }
        r.push_back({lo, hi});
      }
      if (!more()) fail("unterminated '['");
      ++pos;
      std::string cls = safe_class(negated ? negate(r) : r);
      if (cls.empty()) fail("the class allows no character a JSON string may hold unescaped");
      return cls;
    }
  };

  const json& root_;
  std::map<std::string, std::string> rules_;
  std::set<std::string> reserved_;
  std::map<std::string, std::string> refs_;
  int objects_ = 0;
};

}  // namespace

std::string gbnf_literal(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c < 0x20 || c == 0x7F) {
      static const char* hex = "0123456789ABCDEF";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else out += static_cast<char>(c);
  }
  return out + "\"";
}

std::string json_schema_to_gbnf(const std::string& schema_text) {
  json schema;
  try {
    schema = json::parse(schema_text);
  } catch (const json::parse_error& e) {
    throw Error(std::string("json schema: not valid JSON: ") + e.what());
  } catch (const json::out_of_range&) {  // a number past a double (found by fuzz_grammar)
    throw Error("json schema: not valid JSON: a number too large to represent");
  }
  return Converter(schema).run();
}

std::string json_object_gbnf() {
  json schema = {{"type", "object"}};
  Converter c(schema);
  c.prim("object");
  return "root ::= object\n" + [&] {
    std::string out;
    std::set<std::string> done;
    std::vector<std::string> todo = {"object"};
    while (!todo.empty()) {
      std::string n = todo.back();
      todo.pop_back();
      if (!done.insert(n).second) continue;
      out += n + " ::= " + kPrimitives.at(n) + "\n";
      auto d = kDeps.find(n);
      if (d != kDeps.end()) todo.insert(todo.end(), d->second.begin(), d->second.end());
    }
    return out;
  }();
}

}  // namespace kestrel::grammar
