// OpenAI's tools API on the engine's side: the request's `tools` and `tool_choice` checked, the
// grammar that makes a required call parse, and the model's calls parsed back out of its text,
// whole or as it streams.
//
// A model writes its calls in its family's syntax, which its chat template teaches it (the
// template renders the `tools` variable and the calls of earlier turns). The syntax is read from
// the template's text, as llama-server chooses its parser:
//   hermes   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, one block per call,
//            text allowed around them (Qwen2.5, Qwen3, Hermes 2/3);
//   llama3   {"name": "f", "parameters": {...}} as the whole reply, optionally after
//            <|python_tag|>; several joined by ';' (Llama 3.1, 3.2, 3.3);
//   mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (Mistral v0.3, Nemo, Small).
// <|python_tag|> and [TOOL_CALLS] are control tokens, which decode to no text: a reply of
// those families whose first non-space character opens the JSON is read as calls too.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::server {

enum class ToolFormat { hermes, llama3, mistral };

std::string_view tool_format_name(ToolFormat f);

// The format a Jinja chat template writes calls in: nullopt where it has none that Kestrel
// knows (the server then refuses tools, naming that).
std::optional<ToolFormat> detect_tool_format(std::string_view template_source);

// The most tools one request may define (OpenAI's limit).
constexpr size_t kMaxTools = 128;

struct ToolChoice {
  enum Kind { Auto, None, Required, Named };
  Kind kind = Auto;
  std::string name;  // Named: the function
};

struct ToolDef {
  std::string name;
  std::string parameters;  // its JSON schema, keys in the request's order
};

// A request's tools read and checked. `tools` is the body's `tools` read with its keys in
// their order (they are rendered into the prompt as given, with tojson); `choice` its
// tool_choice (nullptr: absent). Throws ApiError (400) naming the field at fault, in one line:
// not a list, too many, a tool without a name or with a bad one, names given twice, a
// parameters schema that is not an object or that the JSON Schema converter refuses (its
// message: the keyword and where), a tool_choice that is not one of the four forms or names a
// function not in `tools`.
struct ToolsRequest {
  nlohmann::ordered_json tools;  // as given; an array
  std::vector<ToolDef> defs;
  ToolChoice choice;
  bool parallel = true;  // parallel_tool_calls
};
ToolsRequest parse_tools(const nlohmann::ordered_json* tools, const nlohmann::ordered_json* choice,
                         const nlohmann::ordered_json* parallel);

// The id of a response's i-th call, drawn from `seed` (the response's id): "call_" and 24
// letters and digits, as OpenAI's; for the mistral format 9 letters and digits, the only ids
// Mistral's templates accept back in the history.
std::string make_tool_call_id(ToolFormat f, const std::string& seed, int i);

// The GBNF that a reply under tool_choice required (one call or more; one where `parallel` is
// false) or a named function (exactly that call) must match: the family's call syntax, as its
// template writes calls, around each tool's parameters schema converted by
// json_schema_to_gbnf. Every reply it accepts parses into calls (ToolCallParser).
std::string tool_call_gbnf(ToolFormat f, const ToolsRequest& tools);

// A call's piece of a streamed answer, as OpenAI streams it: the first piece of a call carries
// its index, id, name and empty arguments; later ones a fragment of the arguments' text.
struct ToolCallDelta {
  int index = 0;
  bool first = false;
  std::string id, name;  // first only
  std::string arguments;
};

struct ToolCall {
  std::string id, name;
  std::string arguments;  // JSON text, as the model wrote it
};

// Splits a reply into its text and its calls as the text arrives. push() takes the next piece
// and returns what can be said of it already: text that cannot be the start of a call, and the
// calls' pieces (a call is announced once its name is read; its arguments follow as they are
// written). finish() ends the reply: held-back text that did not become a call is text after
// all. Fed a whole reply and finished, content() and calls() are the non-streamed answer; a
// stream's pieces join to the same.
//
// Text that starts like a call but does not go on like one (a `<tool_call>` followed by other
// than a JSON object, a reply of the llama3 family that opens with '{' but is not a call) is
// text. A call cut off (max_tokens) keeps what was written of its arguments.
class ToolCallParser {
 public:
  struct Out {
    std::string content;
    std::vector<ToolCallDelta> calls;
  };
  // `make_id(i)`: the id of the i-th call.
  ToolCallParser(ToolFormat f, std::function<std::string(int)> make_id);

  Out push(std::string_view text);
  Out finish();

  const std::string& content() const { return content_; }
  const std::vector<ToolCall>& calls() const { return calls_; }

 private:
  void step(Out& out, bool at_end);
  bool read_call(Out& out, bool at_end);  // false: needs more text
  void emit_content(Out& out, size_t end);

  ToolFormat format_;
  std::function<std::string(int)> make_id_;
  std::string buf_;       // the whole reply so far
  size_t pos_ = 0;        // what is decided up to here
  bool in_call_ = false;  // reading calls from pos_
  bool in_list_ = false;  // mistral: inside the [...] list
  bool started_ = false;  // some non-space text was decided (llama3/mistral: no bare call after)
  // the call at pos_: its index in calls_ once announced, and how much of its arguments was sent
  int current_ = -1;
  size_t args_sent_ = 0;
  size_t region_ = 0;  // where the calls being read began (their marker, or the bare '{' or '[')
  size_t body_ = 0;    // past the marker
  int region_calls_ = 0;  // calls announced since region_
  bool closing_ = false;  // hermes: a call read, its </tool_call> next
  bool after_call_ = false;  // space next is dropped
  bool broken_ = false;      // a call announced and broken off: the rest of it is dropped
  std::string content_;
  std::vector<ToolCall> calls_;
};

}  // namespace kestrel::server
