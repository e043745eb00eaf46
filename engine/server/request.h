// The bodies of `kestrel serve`'s requests read into engine options, with no socket in sight:
// OpenAI's /v1/chat/completions and /v1/completions, and llama-server's /tokenize and
// /detokenize. Every field is checked for its type and range here, and anything the engine
// cannot honour is refused (ApiError, 400) rather than silently ignored: n above 1, tools,
// logit_bias, a response_format other than text. Fields this server has no use for and that do
// not change the answer (user, metadata, store) are ignored, as OpenAI-compatible servers do.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "engine/sampler.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "engine/server/api_error.h"

namespace kestrel::server {

enum class Endpoint { Chat, Completion };

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
};

// Parses and checks a request body. `seed` is the seed used when the request gives none (the
// caller draws it). Throws ApiError (400) naming the field at fault.
CompletionRequest parse_completion_request(Endpoint endpoint, const std::string& body,
                                           const RequestDefaults& defaults, uint64_t seed);

// A request made ready to run: the prompt's ids (the chat template renders the messages) and
// the generation options.
struct PreparedRequest {
  std::vector<int> prompt_ids;
  GenerateOptions options;
};

// Tokenizes the prompt and checks it against the context: a prompt that leaves no room for
// max_tokens (or for one token when it is -1) is refused (400, code
// "context_length_exceeded"), as are an empty prompt and ids outside the vocabulary. `tmpl` is
// the model's chat template (chat requests need it).
PreparedRequest prepare_request(const CompletionRequest& req, const Tokenizer& tok,
                                const ChatTemplate* tmpl, int context, int vocab);

// POST /tokenize as llama-server has it: {"content": TEXT, "add_special": false,
// "with_pieces": false}.
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
  bool with_pieces = false;
};
TokenizeRequest parse_tokenize_request(const std::string& body);
// POST /detokenize: {"tokens": [ID, ...]}, every id within the vocabulary.
std::vector<int> parse_detokenize_request(const std::string& body, int vocab);

// The JSON object of a body, or ApiError (400) saying why it is not one.
nlohmann::json parse_body(const std::string& body);

}  // namespace kestrel::server
