// OpenAI's response objects for a generation: the whole answer (chat.completion,
// text_completion), the chunks of a streamed one as server-sent events, usage and logprobs.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/generate.h"
#include "engine/sampler.h"
#include "tokenizer/tokenizer.h"
#include "engine/server/request.h"

namespace kestrel::server {

// What every object of one response repeats.
struct ResponseMeta {
  std::string id;       // "chatcmpl-..." or "cmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// OpenAI's finish_reason for the engine's: "stop" (end-of-sequence or a stop string),
// "length", or "cancelled" where the client went away (never sent to it).
std::string finish_reason(const GenerateResult& r);

// prompt_tokens counts the whole prompt; prompt_tokens_details.cached_tokens the part whose
// KV cache a slot already held (prefix reuse).
nlohmann::json usage_json(const GenerateResult& r);

// The text a token adds on its own (" the" for SentencePiece's "▁the") and its UTF-8 bytes;
// a byte-fallback token's byte is the one it stands for.
std::string token_text(const Tokenizer& tok, int id);
// A token as /tokenize's with_pieces shows it: its text as token_text decodes it, and a
// special token (which decodes to nothing) as its own text ("<|im_start|>", "<s>").
std::string token_piece(const Tokenizer& tok, int id);
std::vector<int> token_bytes(const Tokenizer& tok, int id);

// chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...], "refusal": null}
nlohmann::json chat_logprobs_json(const Tokenizer& tok, const std::vector<Logprobs>& lps, int top);
// completions: {"tokens", "token_logprobs", "top_logprobs": [{TOKEN: LOGPROB}], "text_offset"},
// text offsets counted in bytes from the start of the completion.
nlohmann::json completion_logprobs_json(const Tokenizer& tok, const std::vector<Logprobs>& lps,
                                        int top);

// finish_reason where the reply was parsed for tool calls: "tool_calls" where it holds one and
// ended as the model chose ("stop"); "length" stays "length", as OpenAI's does.
std::string finish_reason(const GenerateResult& r, bool has_tool_calls);

// The whole answer to a request that did not stream. `calls` (the reply fed whole and
// finished; null without tools) gives the message its tool_calls and its content: null where
// the reply was only calls, as OpenAI's.
nlohmann::json completion_response(const CompletionRequest& req, const ResponseMeta& meta,
                                   const GenerateResult& r, const Tokenizer& tok,
                                   const ToolCallParser* calls = nullptr);

// The chunks of a streamed answer. The first chat chunk carries the role; each text chunk a
// piece of the text; the last one the finish_reason (and the logprobs of every token, which
// clients join over the chunks). With include_usage every chunk has "usage": null and a final
// chunk with no choices carries the counts.
nlohmann::json role_chunk(const CompletionRequest& req, const ResponseMeta& meta);
nlohmann::json text_chunk(const CompletionRequest& req, const ResponseMeta& meta,
                          std::string_view text);
nlohmann::json finish_chunk(const CompletionRequest& req, const ResponseMeta& meta,
                            const GenerateResult& r, const Tokenizer& tok, bool has_tool_calls = false);
// A piece of a call: {"delta": {"tool_calls": [{"index", "id", "type": "function", "function":
// {"name", "arguments": ""}}]}} first, then {"index", "function": {"arguments": FRAGMENT}}, which
// OpenAI's clients join by index.
nlohmann::json tool_call_chunk(const CompletionRequest& req, const ResponseMeta& meta,
                               const ToolCallDelta& d);
nlohmann::json usage_chunk(const CompletionRequest& req, const ResponseMeta& meta,
                           const GenerateResult& r);

// One server-sent event: "data: JSON\n\n"; and the stream's end, "data: [DONE]\n\n".
std::string sse_event(const nlohmann::json& j);
extern const char* const kSseDone;

// JSON text with invalid UTF-8 (a token that ends mid-character) replaced, never thrown at.
std::string dump(const nlohmann::json& j);

}  // namespace kestrel::server
