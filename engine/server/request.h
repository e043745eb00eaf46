// The bodies of `kestrel serve`'s requests read into engine options, with no socket in sight:
// OpenAI's /v1/chat/completions and /v1/completions, and llama-server's /tokenize and
// /detokenize. Every field is checked for its type and range here, and anything the engine
// cannot honour is refused (ApiError, 400) rather than silently ignored: n above 1, the
// legacy functions, logit_bias, a response_format other than text and json. Fields this server has no use for and that do
// not change the answer (user, metadata, store) are ignored, as OpenAI-compatible servers do.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "engine/sampler.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "engine/server/api_error.h"
#include "engine/server/tool_calls.h"

namespace kestrel::server {

enum class Endpoint { Chat, Completion };

// Bounds on a request body's JSON, enforced while it is parsed (parse_body), so that a body
// cannot spend more memory and CPU than these allow before it is refused: the parsed DOM costs
// far more than its text (7.8 MB of `[{},{},...]` is 2.6 million objects, about 250 MB), and the
// body limit (--max-body) alone does not bound it. Past max_values: 413, code
// "too_many_json_values"; past max_depth: 400, code "json_too_deep".
//
// The defaults are generous for real requests. A chat message is 3 to 5 values (its object,
// role, content, a few content parts), a tool definition's JSON schema some tens to a few
// hundred; a conversation of 2,000 messages with 100 tools is under 40,000. What comes near
// 100,000 is a prompt of token ids (one value per id), which is why `kestrel serve` raises the
// limit to twice its context where that is more. 100,000 empty objects parse in milliseconds
// into about 10 MB. Requests nest 4 deep (messages[i].content[j].text) and tool schemas rarely
// past 20; 64 leaves room for any schema a person writes.
constexpr size_t kDefaultMaxJsonValues = 100000;
constexpr int kDefaultMaxJsonDepth = 64;

struct JsonLimits {
  size_t max_values = kDefaultMaxJsonValues;  // values of any kind: objects, arrays, scalars
  int max_depth = kDefaultMaxJsonDepth;       // objects and arrays open at once
};

// What a request gets for what it leaves out: `kestrel serve`'s command line over the model's
// generation_config.json, as for `kestrel generate`.
struct RequestDefaults {
  SamplingParams sampling;
  int max_tokens = -1;  // -1 = up to the end of the context
  std::vector<std::string> stop;
  // --chat-template-kwargs: the chat template's extra variables (an object, or null for none);
  // a request's chat_template_kwargs replace them key by key.
  nlohmann::json chat_template_kwargs;
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::Chat;
  std::string model;                  // empty when the request names none
  std::vector<ChatMessage> messages;  // chat
  nlohmann::json chat_template_kwargs;  // chat: the template's extra variables (an object)
  std::string prompt;                 // completions: a text ...
  std::vector<int> prompt_ids;        // ... or token ids (prompt_is_ids)
  bool prompt_is_ids = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int max_tokens = -1;         // -1 = up to the end of the context
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool logprobs = false;  // record the chosen token's log-probability ...
  int top_logprobs = 0;   // ... and this many of the most likely ones
  bool ignore_eos = false;  // llama-server's: generate max_tokens whatever the model says
  // response_format json_object or json_schema: the grammar the answer must match
  // (docs/grammar.md); null for text.
  std::shared_ptr<const grammar::Grammar> grammar;
  // chat: the tools (tool_calls.h), null where none are given or tool_choice is "none" (the
  // prompt is then rendered without them and the reply is text).
  std::shared_ptr<const ToolsRequest> tools;
};

// Parses and checks a request body. `seed` is the seed used when the request gives none (the
// caller draws it). Throws ApiError (400) naming the field at fault, or parse_body's.
CompletionRequest parse_completion_request(Endpoint endpoint, const std::string& body,
                                           const RequestDefaults& defaults, uint64_t seed,
                                           const JsonLimits& limits = {});

// A request made ready to run: the prompt's ids (the chat template renders the messages) and
// the generation options.
struct PreparedRequest {
  std::vector<int> prompt_ids;
  GenerateOptions options;
  // With tools: the syntax of the model's calls, which the reply is parsed for; with
  // tool_choice required or a named function, options.grammar holds the calls to it.
  std::optional<ToolFormat> tool_format;
};

// Tokenizes the prompt and checks it against the context: a prompt that leaves no room for
// max_tokens (or for one token when it is -1) is refused (400, code
// "context_length_exceeded"), as are an empty prompt and ids outside the vocabulary. `tmpl` is
// the model's chat template (chat requests need it). Tools with a template that has no
// tool-call syntax Kestrel reads get 400 (code "tools_unsupported") naming that.
PreparedRequest prepare_request(const CompletionRequest& req, const Tokenizer& tok,
                                const ChatTemplate* tmpl, int context, int vocab);

// POST /tokenize as llama-server has it: {"content": TEXT, "add_special": false,
// "with_pieces": false}.
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
  bool with_pieces = false;
};
TokenizeRequest parse_tokenize_request(const std::string& body, const JsonLimits& limits = {});
// POST /detokenize: {"tokens": [ID, ...]}, every id within the vocabulary.
std::vector<int> parse_detokenize_request(const std::string& body, int vocab,
                                          const JsonLimits& limits = {});

// The JSON object of a body, or ApiError saying why it is not one: 400 (invalid_json) for
// malformed JSON or another value than an object, 400 (json_too_deep) past limits.max_depth,
// 413 (too_many_json_values) past limits.max_values. The limits stop the parser as they are
// passed, before the rest of the body is read into memory.
nlohmann::json parse_body(const std::string& body, const JsonLimits& limits = {});

}  // namespace kestrel::server
