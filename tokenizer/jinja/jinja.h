// A Jinja2 interpreter for the chat templates Hugging Face models ship in tokenizer_config.json,
// rendering them as transformers' apply_chat_template does: Python Jinja2 in an immutable
// sandbox with trim_blocks and lstrip_blocks, the loop controls break/continue, the
// {% generation %} tag, transformers' own tojson (json.dumps with ensure_ascii=False) and the
// globals raise_exception and strftime_now.
//
//   auto tmpl = jinja::Template::parse(chat_template);  // kestrel::Error naming line:column
//   std::string prompt = tmpl.render({{"messages", messages},
//                                     {"add_generation_prompt", true},
//                                     {"bos_token", "<s>"}, {"eos_token", "</s>"}});
//
// Values print as Python prints them (1.0, True, None, ['a', 'b']); an undefined variable prints
// as nothing and fails when used otherwise, like Jinja's default Undefined. Whatever a template
// uses that this interpreter does not implement (include, recursive loops, an unknown filter) is
// refused when parsing, naming the construct and where it is. docs/chat-templates.md lists what
// is supported.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"

namespace kestrel::jinja {

// Template variables. Objects keep their key order: tojson prints keys in the order given, as
// Python's json.dumps does with the dicts transformers passes. A nlohmann::json converts
// implicitly (its keys arrive sorted).
using Json = nlohmann::ordered_json;

// A function a template may call by name, such as strftime_now("%d %b %Y"): positional
// arguments in order, keyword arguments as an object.
using Function = std::function<Json(const std::vector<Json>& args, const Json& kwargs)>;

// raise_exception(message) called by a template (a chat template refusing a conversation):
// what() says where, message() is the template's own text.
class TemplateException : public Error {
 public:
  TemplateException(std::string message, const std::string& what)
      : Error(what), message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

struct Program;  // the parsed template (jinja/ast.h)

class Template {
 public:
  // Throws kestrel::Error ("template line 3:12: unknown filter 'foo'") for malformed input and
  // for anything unsupported.
  static Template parse(std::string_view source);

  // Renders with the members of `context` (an object) as variables. Throws kestrel::Error for
  // what fails at run time (an undefined variable used in arithmetic, a type error), naming
  // line:column, and TemplateException for raise_exception.
  std::string render(const Json& context) const;

  // Makes `name` callable from the template, replacing a built-in function of that name.
  // Built in: raise_exception(message), strftime_now(format) (the local time, as transformers).
  void set_function(const std::string& name, Function f);

 private:
  std::shared_ptr<const Program> program_;
  std::map<std::string, Function> functions_;
};

}  // namespace kestrel::jinja
