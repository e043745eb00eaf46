// A conversation as OpenAI's chat API sends it, [{"role": ..., "content": ...}, ...], read by
// one set of rules wherever Kestrel takes one: the `messages` of a /v1/chat/completions
// request and `kestrel tokenize --messages FILE`, so that a conversation the command line
// tokenizes is the one the server would run, and a mistake is reported in the same words.
//
// The rules: a non-empty list of objects; role system, user, assistant or tool, with OpenAI's
// newer `developer` read as system; content a string or a list of text parts ({"type": "text",
// "text": ...}, joined), anything else in it (images, audio) refused; content required but for
// an assistant message that carries tool_calls ([{"id", "type": "function", "function":
// {"name", "arguments"}}]); a tool message needs its tool_call_id. Messages are counted from
// 0, as the request's JSON indexes them (messages[2].role).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/server/api_error.h"
#include "tokenizer/chat_template.h"

namespace kestrel::server {

// The messages of `v` (nullptr: the field is absent). Throws ApiError (400) whose param names
// the field at fault ("messages[1].content") and whose message begins with it.
std::vector<ChatMessage> parse_chat_messages(const nlohmann::json* v);

// A JSON value as an error message shows it: short, so that a huge field is not echoed back.
std::string shown_json(const nlohmann::json& v);

}  // namespace kestrel::server
