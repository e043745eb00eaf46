// The values a template computes with, modelled on the Python objects Jinja2 handles: None,
// bool, int, float, str, list, tuple, dict, Jinja's Undefined and namespace, and callables
// (built-in functions, bound methods such as str.strip, macros). Lists and dicts are shared, not
// copied: transformers renders in an immutable sandbox, so nothing but a namespace changes after
// it is made.
//
// Internal to the interpreter (tokenizer/jinja*.cpp); the public API is jinja.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "tokenizer/jinja/jinja.h"

namespace kestrel::jinja {

// A failure inside an operation that does not know where in the template it is (a filter, a
// method, arithmetic). The evaluator adds the line:column of the expression being evaluated.
struct EvalError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// raise_exception(message): carried to the call's expression, which knows where it is.
struct RaisedError : EvalError {
  explicit RaisedError(std::string m) : EvalError(m), message(std::move(m)) {}
  std::string message;
};

class Value;
struct List;
struct Dict;
struct Namespace;
struct Callable;

// Jinja's default Undefined: prints as "", is false, iterates as empty, and fails with `hint`
// ("'foo' is undefined", "'dict object' has no attribute 'x'") when used any other way.
struct Undefined {
  std::string hint;
};
struct None {};

class Value {
 public:
  Value() : v_(Undefined{}) {}
  Value(Undefined u) : v_(std::move(u)) {}
  Value(None) : v_(None{}) {}
  Value(bool b) : v_(b) {}
  Value(int64_t i) : v_(i) {}
  Value(int i) : v_(int64_t{i}) {}
  Value(double d) : v_(d) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::shared_ptr<List> l) : v_(std::move(l)) {}
  Value(std::shared_ptr<Dict> d) : v_(std::move(d)) {}
  Value(std::shared_ptr<Namespace> n) : v_(std::move(n)) {}
  Value(std::shared_ptr<Callable> c) : v_(std::move(c)) {}

  static Value undefined(std::string hint) { return Value(Undefined{std::move(hint)}); }

  bool is_undefined() const { return std::holds_alternative<Undefined>(v_); }
  bool is_none() const { return std::holds_alternative<None>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }  // Python: bool is an int
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_list() const;  // list, tuple or iterator
  bool is_tuple() const;
  bool is_iterator() const;
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<Dict>>(v_); }
  bool is_namespace() const { return std::holds_alternative<std::shared_ptr<Namespace>>(v_); }
  bool is_callable() const { return std::holds_alternative<std::shared_ptr<Callable>>(v_); }

  // The value as one type; a value of another type is an EvalError naming both (a template
  // passing the wrong kind of value where a filter or method wants one).
  const std::string& undefined_hint() const { return held<Undefined>("undefined").hint; }
  bool as_bool() const { return held<bool>("a boolean"); }
  int64_t as_int() const;   // int or bool
  double as_float() const;  // int, float or bool
  const std::string& as_string() const { return held<std::string>("a string"); }
  const List& as_list() const { return *held<std::shared_ptr<List>>("a list"); }
  const Dict& as_dict() const { return *held<std::shared_ptr<Dict>>("a dict"); }
  Namespace& as_namespace() const { return *held<std::shared_ptr<Namespace>>("a namespace"); }
  const Callable& as_callable() const { return *held<std::shared_ptr<Callable>>("a callable"); }
  const void* identity() const;  // the shared object, for `is sameas` and namespace equality

 private:
  template <class T>
  const T& held(const char* what) const {
    if (const T* p = std::get_if<T>(&v_)) return *p;
    wrong_type(what);
  }
  [[noreturn]] void wrong_type(const char* what) const;

  std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<List>,
               std::shared_ptr<Dict>, std::shared_ptr<Namespace>, std::shared_ptr<Callable>>
      v_;
};

struct List {
  std::vector<Value> items;
  bool tuple = false;
  // A Python generator: what map, select, reject, selectattr, rejectattr, unique, items and
  // reverse return. It iterates like a list but is always true and has no length or index;
  // |list makes a list of it. (Unlike Python's, it can be iterated more than once.)
  bool iterator = false;
};

// A dict with string keys in insertion order (Python dicts keep it, and tojson shows it).
// Chat-template dicts are small: a linear search is the right size.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};

// namespace(): the one mutable object, for state that outlives a loop iteration.
struct Namespace {
  Dict attrs;
};

// Arguments of a call: positional, then keyword in the order written.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The parameter at position `index` or named `name` (Python accepts either), or nullptr.
  const Value* get(size_t index, std::string_view name) const;
  // Refuses more positional arguments than `max_positional` and keywords outside `names`.
  void check(std::string_view function, size_t max_positional,
             std::initializer_list<std::string_view> names) const;
};

struct Callable {
  std::string name;  // as errors show it: "range", "str.strip", "macro 'render_tool'"
  std::function<Value(Args&)> call;
};

Value make_list(std::vector<Value> items, bool tuple = false);
Value make_iterator(std::vector<Value> items);
Value make_dict(Dict d);
Value make_callable(std::string name, std::function<Value(Args&)> call);

// JSON in and out: template variables and the values passed to and from registered functions.
Value from_json(const Json& j);
Json to_json(const Value& v);

// Python's str() (what {{ }} prints; Undefined prints as ""), repr(), and type names as Python
// and Jinja's messages show them ("str", "'dict object'").
std::string to_str(const Value& v);
std::string repr(const Value& v);
std::string type_name(const Value& v);
std::string object_description(const Value& v);  // "'dict object'", "None"
std::string python_float(double d);              // 1.0 -> "1.0", 1e16 -> "1e+16"

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson calls it.
struct JsonStyle {
  bool ensure_ascii = false;
  bool pretty = false;  // indent given (even 0: newlines without indentation)
  std::string indent;
  std::string item_separator = ", ";  // ",", ": " once pretty, unless given
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string dump_json(const Value& v, const JsonStyle& style);

bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);
// <0, 0, >0 as Python orders them; EvalError for types Python refuses to order.
int compare(const Value& a, const Value& b);
// Throws EvalError with the undefined value's hint, for the uses Jinja's Undefined refuses.
void require_defined(const Value& v);

// Python's iteration: a list or tuple's items, a dict's keys, a string's characters, nothing for
// Undefined; EvalError for the rest.
std::vector<Value> iterate(const Value& v);

// UTF-8 strings as Python's sequences of code points.
std::u32string decode_utf8(std::string_view s);
std::string encode_utf8(std::u32string_view s);
void append_utf8(std::string& out, char32_t c);
bool is_python_space(char32_t c);          // str.isspace()
std::string to_upper(std::string_view s);  // ASCII and Latin-1 letters
std::string to_lower(std::string_view s);

}  // namespace kestrel::jinja
