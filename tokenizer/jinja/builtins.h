// What templates get for free, as Jinja2 and transformers provide it: the filters (x | trim),
// the tests (x is defined), attribute and item access with Python's methods of str, dict and
// list, and the global functions (range, namespace, dict, raise_exception, strftime_now).
//
// Internal to the interpreter; the evaluator (jinja/eval.cpp) calls these.
#pragma once

#include <string>
#include <string_view>

#include "tokenizer/jinja/value.h"

namespace kestrel::jinja {

// value | name(args). The name is known (the parser checked it with is_filter()).
Value apply_filter(std::string_view name, const Value& value, const Args& args);
// value is name(args)
bool apply_test(std::string_view name, const Value& value, const Args& args);

// object.name: Python's attribute first (a method such as str.strip or dict.items, a namespace
// attribute), then the item object["name"], else an Undefined saying what is missing.
Value get_attribute(const Value& object, const std::string& name);
// object[key]: the item first, then for a string key the attribute; else Undefined.
Value get_item(const Value& object, const Value& key);
// object[start:stop:step] for strings, lists and tuples; each bound may be None.
Value get_slice(const Value& object, const Value& start, const Value& stop, const Value& step);

// `item in container` as Python answers it.
bool contains(const Value& container, const Value& item);
// Python's `format % args` for strings (also the format filter): %s %r %d %i %f %x %%, with
// flags, width and precision.
std::string percent_format(const std::string& format, const Value& args);

// range, namespace, dict, raise_exception and strftime_now (local time).
Dict builtin_globals();

// Python's str methods that filters share (trim is strip, center is str.center...). `chars` is
// the optional set of characters to strip; whitespace when null or None.
std::string str_strip(const std::string& s, const Value* chars, bool left, bool right);
std::string str_replace(const std::string& s, const std::string& old, const std::string& with,
                        int64_t count);
std::string str_capitalize(const std::string& s);
std::string str_center(const std::string& s, int64_t width, char32_t fill = ' ');

// A parameter of a filter or function: positional `index` or keyword `name`, else `fallback`.
const Value& param(const Args& args, size_t index, std::string_view name, const Value& fallback);
int64_t int_param(const Args& args, size_t index, std::string_view name, int64_t fallback,
                  std::string_view function);

}  // namespace kestrel::jinja
