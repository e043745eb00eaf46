#include "engine/server/request.h"

#include "engine/server/ordered_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "engine/grammar/json_schema.h"
#include "engine/server/messages.h"

namespace kestrel::server {

using nlohmann::json;

namespace {

// The most stop strings a request may give (OpenAI allows 4; more only cost time per token).
constexpr size_t kMaxStops = 16;
// The most top_logprobs a token may have (OpenAI's limit for chat).
constexpr int kMaxTopLogprobs = 20;
constexpr int64_t kMaxTokens = 1 << 30;

ApiError bad(const std::string& param, const std::string& message) {
  return ApiError(400, message, param, "invalid_value");
}

std::string shown(const json& v) { return shown_json(v); }

// The fields of a request object. null counts as absent, as OpenAI's clients send it for
// "not given".
class Fields {
 public:
  explicit Fields(const json& j) : j_(j) {}

  const json* get(const std::string& key) const {
    const auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

  std::optional<double> number(const std::string& key, double lo, double hi) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number() || v->get<double>() < lo || v->get<double>() > hi || !std::isfinite(v->get<double>()))
      throw bad(key, fmt::format("'{}' must be a number between {} and {}, got {}", key, lo, hi,
                                 shown(*v)));
    return v->get<double>();
  }

  std::optional<int64_t> integer(const std::string& key, int64_t lo, int64_t hi) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    // A count too large for int64_t is unsigned only: compared as such, never wrapped.
    const bool ok = v->is_number_integer() &&
                    (v->is_number_unsigned()
                         ? v->get<uint64_t>() <= (uint64_t)hi && (lo <= 0 || v->get<uint64_t>() >= (uint64_t)lo)
                         : v->get<int64_t>() >= lo && v->get<int64_t>() <= hi);
    if (!ok)
      throw bad(key, fmt::format("'{}' must be an integer between {} and {}, got {}", key, lo, hi,
                                 shown(*v)));
    return v->get<int64_t>();
  }

  std::optional<bool> boolean(const std::string& key) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) throw bad(key, fmt::format("'{}' must be true or false, got {}", key, shown(*v)));
    return v->get<bool>();
  }

  std::optional<std::string> string(const std::string& key) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) throw bad(key, fmt::format("'{}' must be a string, got {}", key, shown(*v)));
    return v->get<std::string>();
  }

  // A field this server cannot honour: refused unless absent or `harmless`.
  void refuse_unless(const std::string& key, bool harmless, const std::string& why) const {
    if (get(key) && !harmless) throw ApiError(400, fmt::format("'{}': {}", key, why), key, "unsupported_parameter");
  }

 private:
  const json& j_;
};

// completions' prompt: a text, a list of one text, or a list of token ids.
void parse_prompt(const json* v, CompletionRequest& r) {
  if (!v) throw ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter");
  if (v->is_string()) {
    r.prompt = v->get<std::string>();
    return;
  }
  const bool ids = v->is_array() && !v->empty() &&
                   std::all_of(v->begin(), v->end(), [](const json& x) { return x.is_number_integer(); });
  if (ids) {
    for (const json& x : *v) {
      const bool in_range = x.is_number_unsigned() ? x.get<uint64_t>() <= (uint64_t)INT32_MAX
                                                   : x.get<int64_t>() >= 0 && x.get<int64_t>() <= INT32_MAX;
      if (!in_range) throw bad("prompt", "'prompt': token ids must be between 0 and the vocabulary size, got " + shown(x));
      r.prompt_ids.push_back((int)x.get<int64_t>());
    }
    r.prompt_is_ids = true;
    return;
  }
  if (v->is_array() && v->size() == 1 && (*v)[0].is_string()) {
    r.prompt = (*v)[0].get<std::string>();
    return;
  }
  if (v->is_array() && v->size() > 1)
    throw ApiError(400, "'prompt': one prompt per request is supported", "prompt", "unsupported_value");
  throw bad("prompt", "'prompt' must be a string or a list of token ids, got " + shown(*v));
}

std::vector<std::string> parse_stop(const json* v) {
  if (!v) return {};
  std::vector<std::string> out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const json& s : *v) {
      if (!s.is_string()) throw bad("stop", "'stop' must be a string or a list of strings, got " + shown(*v));
      out.push_back(s.get<std::string>());
    }
  } else {
    throw bad("stop", "'stop' must be a string or a list of strings, got " + shown(*v));
  }
  if (out.size() > kMaxStops) throw bad("stop", fmt::format("'stop' holds at most {} strings", kMaxStops));
  for (const std::string& s : out)
    if (s.empty()) throw bad("stop", "'stop' strings must not be empty");
  return out;
}

// nlohmann's DOM builder behind a count of the values it has made and the depth it is at:
// json::parse would build the whole body's DOM before anything could look at its size. Each
// event is checked before the builder spends memory on it, and a limit passed ends the parse
// at once (the ApiError unwinds through the parser, which frees what it built).
class LimitedDomParser {
 public:
  LimitedDomParser(json& result, const JsonLimits& limits) : dom_(result, true), limits_(limits) {}

  bool null() { return value() && dom_.null(); }
  bool boolean(bool v) { return value() && dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return value() && dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return value() && dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) {
    return value() && dom_.number_float(v, s);
  }
  bool string(json::string_t& v) { return value() && dom_.string(v); }
  bool binary(json::binary_t& v) { return value() && dom_.binary(v); }
  bool start_object(std::size_t n) { return open() && dom_.start_object(n); }
  bool key(json::string_t& k) { return dom_.key(k); }
  bool end_object() {
    --depth_;
    return dom_.end_object();
  }
  bool start_array(std::size_t n) { return open() && dom_.start_array(n); }
  bool end_array() {
    --depth_;
    return dom_.end_array();
  }
  template <class Exception>
  bool parse_error(std::size_t pos, const std::string& token, const Exception& ex) {
    return dom_.parse_error(pos, token, ex);  // throws it, as json::parse does
  }

 private:
  bool value() {
    if (++values_ > limits_.max_values)
      throw ApiError(413,
                     fmt::format("the body holds more than {} JSON values (objects, arrays, strings, "
                                 "numbers, ...), the most this server parses",
                                 limits_.max_values),
                     "", "too_many_json_values");
    return true;
  }
  bool open() {
    value();
    if (++depth_ > limits_.max_depth)
      throw ApiError(400,
                     fmt::format("the body's JSON nests deeper than {} objects or arrays, the most "
                                 "this server parses",
                                 limits_.max_depth),
                     "", "json_too_deep");
    return true;
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  const JsonLimits& limits_;
  size_t values_ = 0;
  int depth_ = 0;
};

// chat_template_kwargs (vLLM's): extra variables of the chat template, such as Qwen3's
// {"enable_thinking": false}; the server's --chat-template-kwargs, each key replaced by the
// request's own.
json parse_template_kwargs(const json* v, const json& defaults) {
  json out = defaults.is_object() ? defaults : json::object();
  if (!v) return out;
  try {
    check_template_kwargs(*v);
  } catch (const Error& e) {
    throw bad("chat_template_kwargs", std::string("'chat_template_kwargs' ") + e.what());
  }
  for (const auto& [key, value] : v->items()) out[key] = value;
  return out;
}

// tools, tool_choice and parallel_tool_calls (tool_calls.h), read from the body again with
// their keys in order: the tools are rendered into the prompt with tojson as the client gave
// them, as transformers renders the dicts it is given (json sorts an object's keys). Null where
// no tools are given or tool_choice is "none": the model is not to call them, so they are left
// out of the prompt, as OpenAI's "none" promises no call.
std::shared_ptr<const ToolsRequest> parse_tools_fields(const std::string& body) {
  nlohmann::ordered_json j;
  try {
    // The body passed the bounded parse already; this one keeps only the three fields, in
    // order, within bounds of its own (ordered_json.h: keys per object).
    j = parse_ordered_json(body, {}, {"tools", "tool_choice", "parallel_tool_calls"});
  } catch (const nlohmann::json::exception&) {
    throw bad("tools", "'tools' could not be read again in its order");
  } catch (const Error& e) {
    throw ApiError(413, std::string("'tools': ") + e.what(), "tools", "request_too_large");
  }
  const auto field = [&](const char* key) -> const nlohmann::ordered_json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  auto t = std::make_shared<ToolsRequest>(
      parse_tools(field("tools"), field("tool_choice"), field("parallel_tool_calls")));
  if (t->defs.empty() || t->choice.kind == ToolChoice::None) return nullptr;
  return t;
}

// response_format: {"type": "text"}, {"type": "json_object"} (any JSON object), or
// {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}: the schema converted to
// a grammar (docs/grammar.md says which keywords are run and which refused). "strict" changes
// nothing: the answer always matches the schema, as OpenAI's strict mode promises.
// `body` is the request's text: the schema is read from it again in its own key order (json
// sorts an object's keys), since the converter keeps the properties in the order the schema
// gives them, as OpenAI's structured outputs write them.
std::shared_ptr<const grammar::Grammar> parse_response_format(const json* v, const std::string& body) {
  if (!v) return nullptr;
  if (!v->is_object() || !v->contains("type") || !(*v)["type"].is_string())
    throw bad("response_format", "'response_format' must be an object with a string \"type\"");
  const std::string type = (*v)["type"].get<std::string>();
  try {
    if (type == "text") return nullptr;
    if (type == "json_object")
      return grammar::Grammar::parse(grammar::json_object_gbnf());
    if (type == "json_schema") {
      const json* js = v->contains("json_schema") ? &(*v)["json_schema"] : nullptr;
      if (!js || !js->is_object() || !js->contains("schema") || !(*js)["schema"].is_object())
        throw bad("response_format",
                  "'response_format': json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {...}}");
      // The body passed the bounded parse already: this second one is of the same bytes.
      std::string schema;
      try {
        schema = parse_ordered_json(body, {}, {"response_format"})["response_format"]["json_schema"]["schema"].dump();
      } catch (const nlohmann::json::exception&) {
        throw bad("response_format", "'response_format': the schema could not be read again in its order");
      } catch (const Error& e) {
        throw ApiError(413, std::string("'response_format': ") + e.what(), "response_format",
                       "request_too_large");
      }
      return grammar::Grammar::parse(grammar::json_schema_to_gbnf(schema));
    }
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    throw bad("response_format", std::string("'response_format': ") + e.what());
  }
  throw bad("response_format", "'response_format': type '" + type +
                                   "' is not one of text, json_object, json_schema");
}

}  // namespace

json parse_body(const std::string& body, const JsonLimits& limits) {
  json j;
  try {
    LimitedDomParser sax(j, limits);
    json::sax_parse(body, &sax);
  } catch (const json::parse_error& e) {
    throw ApiError(400,
                   e.byte <= body.size()
                       ? fmt::format("the body is not valid JSON (error at byte {})", e.byte)
                       : std::string("the body is not valid JSON (it ends early)"),
                   "", "invalid_json");
  } catch (const json::exception&) {
    throw ApiError(400, "the body is not valid JSON (a number too large to represent)", "", "invalid_json");
  }
  if (!j.is_object())
    throw ApiError(400, std::string("the body must be a JSON object, got ") + j.type_name(), "",
                   "invalid_json");
  return j;
}

CompletionRequest parse_completion_request(Endpoint endpoint, const std::string& body,
                                           const RequestDefaults& defaults, uint64_t seed,
                                           const JsonLimits& limits) {
  const json j = parse_body(body, limits);
  const Fields f(j);
  CompletionRequest r;
  r.endpoint = endpoint;
  r.sampling = defaults.sampling;
  r.sampling.seed = seed;
  r.max_tokens = defaults.max_tokens;
  r.stop = defaults.stop;
  const bool chat = endpoint == Endpoint::Chat;

  if (auto m = f.string("model")) r.model = *m;
  if (chat) r.messages = parse_chat_messages(f.get("messages"));
  else parse_prompt(f.get("prompt"), r);
  if (chat)
    r.chat_template_kwargs =
        parse_template_kwargs(f.get("chat_template_kwargs"), defaults.chat_template_kwargs);

  if (auto n = f.integer("n", 1, 128); n && *n != 1)
    throw ApiError(400, "'n': only one choice per request is supported (n = 1)", "n", "unsupported_value");
  if (!chat) {
    if (auto b = f.integer("best_of", 1, 128); b && *b != 1)
      throw ApiError(400, "'best_of': only 1 is supported", "best_of", "unsupported_value");
    f.refuse_unless("echo", !f.boolean("echo").value_or(false), "echoing the prompt is not supported");
    f.refuse_unless("suffix", f.string("suffix").value_or("").empty(), "insertion (suffix) is not supported");
  }
  if (chat && (f.get("tools") || f.get("tool_choice") || f.get("parallel_tool_calls")))
    r.tools = parse_tools_fields(body);
  else if (!chat)
    for (const char* key : {"tools", "tool_choice", "parallel_tool_calls"})
      f.refuse_unless(key, false, "tools are a chat completions parameter (/v1/chat/completions)");
  // The legacy form of tools (OpenAI deprecated it for tools/tool_choice): refused by name.
  const json* functions = f.get("functions");
  f.refuse_unless("functions", functions && functions->is_array() && functions->empty(),
                  "the legacy 'functions' are not supported; use 'tools'");
  f.refuse_unless("function_call", false, "the legacy 'function_call' is not supported; use 'tool_choice'");
  r.grammar = parse_response_format(f.get("response_format"), body);
  // One grammar per request: a response_format's JSON and tool calls cannot both be required
  // of one reply.
  if (r.grammar && r.tools)
    throw ApiError(400, "'response_format' (json_object or json_schema) cannot be combined with 'tools'; "
                        "pass one, or tool_choice \"none\"",
                   "response_format", "unsupported_parameter");
  const json* bias = f.get("logit_bias");
  f.refuse_unless("logit_bias", bias && bias->is_object() && bias->empty(), "logit_bias is not supported");

  r.stream = f.boolean("stream").value_or(false);
  if (const json* so = f.get("stream_options")) {
    if (!r.stream)
      throw bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    if (!so->is_object()) throw bad("stream_options", "'stream_options' must be an object");
    r.include_usage = Fields(*so).boolean("include_usage").value_or(false);
  }

  // max_completion_tokens is the newer name; it wins where both are given.
  if (auto n = f.integer("max_tokens", 1, kMaxTokens)) r.max_tokens = (int)*n;
  if (auto n = f.integer("max_completion_tokens", 1, kMaxTokens)) r.max_tokens = (int)*n;

  if (auto v = f.number("temperature", 0, 2)) r.sampling.temperature = (float)*v;
  if (auto v = f.number("top_p", 0, 1)) r.sampling.top_p = (float)*v;
  if (auto v = f.number("presence_penalty", -2, 2)) r.sampling.presence_penalty = (float)*v;
  if (auto v = f.number("frequency_penalty", -2, 2)) r.sampling.frequency_penalty = (float)*v;
  if (const json* s = f.get("seed")) {
    // Any 64-bit integer, as OpenAI takes it; a negative one is its two's complement. An
    // integer past 64 bits is read by the JSON parser as a float: out of range, not "not an
    // integer".
    if (s->is_number_float() && std::isfinite(s->get<double>()) &&
        (s->get<double>() >= 0x1p64 || s->get<double>() < -0x1p63))
      throw bad("seed", fmt::format("'seed' is out of range: it must be a 64-bit integer (between {} and {}), got {}",
                                    INT64_MIN, UINT64_MAX, shown(*s)));
    if (!s->is_number_integer()) throw bad("seed", "'seed' must be an integer, got " + shown(*s));
    r.sampling.seed = s->is_number_unsigned() ? s->get<uint64_t>() : (uint64_t)s->get<int64_t>();
  }
  // Kestrel's own, as llama-server spells them.
  if (auto v = f.integer("top_k", 0, INT32_MAX)) r.sampling.top_k = (int)*v;
  if (auto v = f.number("min_p", 0, 1)) r.sampling.min_p = (float)*v;
  if (auto v = f.number("repeat_penalty", 0, 100)) {
    if (*v <= 0) throw bad("repeat_penalty", "'repeat_penalty' must be above 0");
    r.sampling.repeat_penalty = (float)*v;
  }
  if (auto v = f.integer("repeat_last_n", -1, kMaxTokens)) r.sampling.repeat_last_n = (int)*v;
  r.ignore_eos = f.boolean("ignore_eos").value_or(false);

  if (f.get("stop")) r.stop = parse_stop(f.get("stop"));

  if (chat) {
    r.logprobs = f.boolean("logprobs").value_or(false);
    if (auto t = f.integer("top_logprobs", 0, kMaxTopLogprobs)) {
      if (!r.logprobs)
        throw bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true");
      r.top_logprobs = (int)*t;
    }
  } else if (auto n = f.integer("logprobs", 0, kMaxTopLogprobs)) {
    // completions: the number of most likely tokens to list (0: the chosen token's only).
    r.logprobs = true;
    r.top_logprobs = (int)*n;
  }
  return r;
}

PreparedRequest prepare_request(const CompletionRequest& req, const Tokenizer& tok,
                                const ChatTemplate* tmpl, int context, int vocab) {
  PreparedRequest p;
  const bool chat = req.endpoint == Endpoint::Chat;
  const std::string what = chat ? "messages" : "prompt";
  if (chat) {
    KESTREL_CHECK(tmpl != nullptr, "a chat request needs the model's chat template");
    if (req.tools) {
      p.tool_format = detect_tool_format(tmpl->jinja_source());
      if (!p.tool_format)
        throw ApiError(400,
                       "'tools': " +
                           (tmpl->is_jinja() ? std::string("the model's chat template") : "the " + tmpl->describe()) +
                           " has no tool-call syntax Kestrel reads (Hermes <tool_call>, Llama 3.1's JSON "
                           "calls, Mistral's [TOOL_CALLS]); pass tool_choice \"none\" or no tools",
                       "tools", "tools_unsupported");
      if (req.tools->choice.kind == ToolChoice::Required || req.tools->choice.kind == ToolChoice::Named) {
        try {
          p.options.grammar = grammar::Grammar::parse(tool_call_gbnf(*p.tool_format, *req.tools));
        } catch (const Error& e) {  // the schemas were converted already: not expected
          throw bad("tools", std::string("'tools': the calls' grammar: ") + e.what());
        }
      }
    }
    try {
      p.prompt_ids = tmpl->tokenize(req.messages, /*add_generation_prompt=*/true, req.chat_template_kwargs,
                                    req.tools ? req.tools->tools : jinja::Json());
    } catch (const Error& e) {  // an order of roles the template refuses, its raise_exception
      throw ApiError(400, std::string("the chat template refused the messages: ") + e.what(),
                     "messages", "invalid_value");
    }
  } else if (req.prompt_is_ids) {
    p.prompt_ids = req.prompt_ids;
    for (int id : p.prompt_ids)
      if (id >= vocab)
        throw bad("prompt", fmt::format("'prompt': token id {} is outside the vocabulary of {}", id, vocab));
  } else {
    p.prompt_ids = tok.encode(req.prompt);
  }
  if (p.prompt_ids.empty())
    throw bad(what, "the prompt is empty (no tokens to start from)");
  const int n = (int)p.prompt_ids.size();
  const int need = req.max_tokens < 0 ? 1 : req.max_tokens;
  if ((int64_t)n + need > context)
    throw ApiError(400,
                   req.max_tokens < 0
                       ? fmt::format("the prompt ({} tokens) leaves no room in the context of {} "
                                     "tokens; shorten the {}",
                                     n, context, what)
                       : fmt::format("the prompt ({} tokens) plus max_tokens ({}) exceed the "
                                     "context of {} tokens; shorten the {} or lower max_tokens",
                                     n, req.max_tokens, context, what),
                   what, "context_length_exceeded");

  GenerateOptions& o = p.options;
  o.max_new_tokens = req.max_tokens;
  o.sampling = req.sampling;
  o.stop = req.stop;
  o.ignore_eos = req.ignore_eos;
  // The engine records the top-n with the chosen token; n >= 1 turns the recording on.
  o.logprobs = req.logprobs ? std::max(1, req.top_logprobs) : 0;
  if (!o.grammar) o.grammar = req.grammar;  // its masker is the server's, built once (grammar_masker)
  if (chat) {
    for (const std::string& s : tmpl->stop_strings()) o.stop.push_back(s);
    o.stop_ids = tmpl->stop_ids();
  }
  return p;
}

TokenizeRequest parse_tokenize_request(const std::string& body, const JsonLimits& limits) {
  const json j = parse_body(body, limits);
  const Fields f(j);
  TokenizeRequest r;
  const auto content = f.string("content");
  if (!content) throw ApiError(400, "'content' is required", "content", "missing_required_parameter");
  r.content = *content;
  r.add_special = f.boolean("add_special").value_or(false);
  r.with_pieces = f.boolean("with_pieces").value_or(false);
  return r;
}

std::vector<int> parse_detokenize_request(const std::string& body, int vocab,
                                          const JsonLimits& limits) {
  const json j = parse_body(body, limits);
  const json* v = Fields(j).get("tokens");
  if (!v) throw ApiError(400, "'tokens' is required", "tokens", "missing_required_parameter");
  if (!v->is_array()) throw bad("tokens", "'tokens' must be a list of token ids, got " + shown(*v));
  std::vector<int> ids;
  for (const json& x : *v) {
    const bool ok = x.is_number_integer() &&
                    (x.is_number_unsigned() ? x.get<uint64_t>() < (uint64_t)vocab
                                            : x.get<int64_t>() >= 0 && x.get<int64_t>() < vocab);
    if (!ok)
      throw bad("tokens", fmt::format("'tokens' must hold ids between 0 and {}, got {}", vocab - 1, shown(x)));
    ids.push_back((int)x.get<int64_t>());
  }
  return ids;
}

}  // namespace kestrel::server
