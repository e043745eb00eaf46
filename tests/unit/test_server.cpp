// kestrel serve without sockets: request bodies read into engine options (and refused with
// OpenAI's error object), the response objects and stream chunks, the slots and their queue,
// the turn lock, the API key's sources and check, loopback hosts and the access log's line.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <unistd.h>

#include "base/error.h"
#include "engine/grammar/grammar.h"
#include "engine/server/ordered_json.h"
#include "engine/server/request.h"
#include "engine/server/response.h"
#include "engine/server/scheduler.h"
#include "tools/kestrel/inputs.h"
#include "tools/kestrel/server/access.h"
#include "tools/kestrel/server/http.h"

using nlohmann::json;
using namespace kestrel;
using namespace kestrel::server;

namespace {

RequestDefaults defaults() {
  RequestDefaults d;
  d.sampling.temperature = 0.5f;
  d.sampling.top_k = 7;
  d.max_tokens = 33;
  return d;
}

CompletionRequest chat(const json& body) {
  return parse_completion_request(Endpoint::Chat, body.dump(), defaults(), 42);
}
CompletionRequest completion(const json& body) {
  return parse_completion_request(Endpoint::Completion, body.dump(), defaults(), 42);
}

const json kMessages = json::array({{{"role", "user"}, {"content", "Hi"}}});

// The ApiError a call throws (its status 0 when it throws none).
template <class F>
ApiError refusal(F&& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "no error");
}

// The body refused with 400 naming `param`.
void expect_refused(Endpoint e, const std::string& body, const std::string& param) {
  const ApiError err = refusal([&] { parse_completion_request(e, body, defaults(), 1); });
  EXPECT_EQ(err.status(), 400) << body;
  EXPECT_EQ(err.param(), param) << body << ": " << err.what();
}

}  // namespace

TEST(ServerError, OpenAiShape) {
  const json j = ApiError(400, "bad temperature", "temperature", "invalid_value").to_json();
  EXPECT_EQ(j, json::parse(R"({"error": {"message": "bad temperature", "type": "invalid_request_error",
                                          "param": "temperature", "code": "invalid_value"}})"));
  const json k = ApiError(500, "engine failed").to_json();
  EXPECT_EQ(k["error"]["type"], "server_error");
  EXPECT_TRUE(k["error"]["param"].is_null());
  EXPECT_TRUE(k["error"]["code"].is_null());
  EXPECT_EQ(ApiError(401, "key").type(), "authentication_error");
  EXPECT_EQ(ApiError(429, "busy").type(), "rate_limit_error");
  EXPECT_EQ(ApiError(404, "model").type(), "invalid_request_error");
}

TEST(ServerRequest, ChatFieldsAndDefaults) {
  const CompletionRequest r = chat({{"model", "m"}, {"messages", kMessages}});
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "Hi");
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.max_tokens, 33);                 // the server's -n
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);  // the server's sampling
  EXPECT_EQ(r.sampling.top_k, 7);
  EXPECT_EQ(r.sampling.seed, 42u);             // the seed drawn for the request
  EXPECT_FALSE(r.logprobs);

  const CompletionRequest s = chat({{"messages", kMessages},
                                    {"stream", true},
                                    {"stream_options", {{"include_usage", true}}},
                                    {"max_tokens", 5},
                                    {"max_completion_tokens", 9},
                                    {"temperature", 1.5},
                                    {"top_p", 0.25},
                                    {"presence_penalty", -1},
                                    {"frequency_penalty", 0.5},
                                    {"seed", 7},
                                    {"stop", "END"},
                                    {"logprobs", true},
                                    {"top_logprobs", 3},
                                    {"top_k", 0},
                                    {"min_p", 0.1},
                                    {"repeat_penalty", 1.1},
                                    {"ignore_eos", true},
                                    {"user", "ignored"},
                                    {"n", 1}});
  EXPECT_TRUE(s.stream);
  EXPECT_TRUE(s.include_usage);
  EXPECT_EQ(s.max_tokens, 9);  // max_completion_tokens wins
  EXPECT_FLOAT_EQ(s.sampling.temperature, 1.5f);
  EXPECT_FLOAT_EQ(s.sampling.top_p, 0.25f);
  EXPECT_FLOAT_EQ(s.sampling.presence_penalty, -1.f);
  EXPECT_FLOAT_EQ(s.sampling.frequency_penalty, 0.5f);
  EXPECT_EQ(s.sampling.seed, 7u);
  EXPECT_EQ(s.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(s.logprobs);
  EXPECT_EQ(s.top_logprobs, 3);
  EXPECT_EQ(s.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(s.sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(s.sampling.repeat_penalty, 1.1f);
  EXPECT_TRUE(s.ignore_eos);

  // null is "not given"; a negative seed is its two's complement.
  const CompletionRequest t = chat({{"messages", kMessages}, {"temperature", nullptr}, {"seed", -1}});
  EXPECT_FLOAT_EQ(t.sampling.temperature, 0.5f);
  EXPECT_EQ(t.sampling.seed, UINT64_MAX);
}

TEST(ServerRequest, ChatMessages) {
  const CompletionRequest r = chat(
      {{"messages",
        {{{"role", "developer"}, {"content", "Be brief."}},
         {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}},
         {{"role", "assistant"}, {"content", "c"}}}}});
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");  // OpenAI's newer name for it
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.messages[2].role, "assistant");

  expect_refused(Endpoint::Chat, R"({})", "messages");
  expect_refused(Endpoint::Chat, R"({"messages": []})", "messages");
  expect_refused(Endpoint::Chat, R"({"messages": "Hi"})", "messages");
  expect_refused(Endpoint::Chat, R"({"messages": [{"content": "Hi"}]})", "messages[0].role");
  expect_refused(Endpoint::Chat, R"({"messages": [{"role": "function", "content": "x"}]})", "messages[0].role");
  // A tool's result names the call it answers (test_tool_calls has the rest).
  expect_refused(Endpoint::Chat, R"({"messages": [{"role": "tool", "content": "x"}]})", "messages[0].tool_call_id");
  expect_refused(Endpoint::Chat, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content");
  expect_refused(Endpoint::Chat, R"({"messages": [{"role": "user"}]})", "messages[0].content");
  expect_refused(Endpoint::Chat,
                 R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
                 "messages[0].content");
}

// `kestrel tokenize --messages` reads a conversation with the same parser (engine/server/
// messages.h): the same messages from what the server takes, and the server's message after
// the file's name for what it refuses, indexes counted from 0 as the request's JSON has them.
TEST(ServerRequest, TokenizeMessagesReadAsTheServerReadsThem) {
  const std::string taken =
      R"([{"role": "developer", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "a"}]},
          {"role": "assistant", "content": "b", "tool_calls": null},
          {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "d"}])";
  const std::vector<ChatMessage> cli_msgs = cli::parse_messages(taken, "m.json");
  const CompletionRequest r = chat({{"messages", json::parse(taken)}});
  ASSERT_EQ(cli_msgs.size(), r.messages.size());
  for (size_t i = 0; i < cli_msgs.size(); ++i) {
    EXPECT_EQ(cli_msgs[i].role, r.messages[i].role);
    EXPECT_EQ(cli_msgs[i].content, r.messages[i].content);
    EXPECT_EQ(cli_msgs[i].tool_calls, r.messages[i].tool_calls);
    EXPECT_EQ(cli_msgs[i].tool_call_id, r.messages[i].tool_call_id);
  }
  EXPECT_EQ(cli_msgs[0].role, "system");

  for (const std::string refused :
       {R"([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])",
        R"([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"id": "c"}]}])",
        R"([{"role": "user", "content": [{"type": "text"}]}])"}) {
    const ApiError server = refusal([&] { chat({{"messages", json::parse(refused)}}); });
    ASSERT_EQ(server.status(), 400) << refused;
    std::string cli_error;
    try {
      cli::parse_messages(refused, "m.json");
    } catch (const Error& e) {
      cli_error = e.what();
    }
    EXPECT_EQ(cli_error, std::string("m.json: ") + server.what());
  }
  const ApiError second = refusal([&] {
    chat({{"messages", json::parse(R"([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])")}});
  });
  EXPECT_EQ(second.param(), "messages[1].tool_call_id");  // a tool's result names its call
}

TEST(ServerRequest, MalformedBodies) {
  for (const std::string body : {"", "{", "{\"messages\": [}", "not json", "{\"a\": 1e999999}"}) {
    const ApiError e = refusal([&] { parse_completion_request(Endpoint::Chat, body, defaults(), 1); });
    EXPECT_EQ(e.status(), 400) << body;
    EXPECT_EQ(e.code(), "invalid_json") << body;
  }
  const ApiError e = refusal([&] { parse_completion_request(Endpoint::Chat, "[1, 2]", defaults(), 1); });
  EXPECT_EQ(e.code(), "invalid_json");
  EXPECT_NE(std::string(e.what()).find("object"), std::string::npos) << e.what();
}

TEST(ServerRequest, WrongTypesAndRanges) {
  const std::string m = R"("messages": [{"role": "user", "content": "Hi"}])";
  auto with = [&](const std::string& field) { return "{" + m + ", " + field + "}"; };
  expect_refused(Endpoint::Chat, with(R"("temperature": "hot")"), "temperature");
  expect_refused(Endpoint::Chat, with(R"("temperature": 2.5)"), "temperature");
  expect_refused(Endpoint::Chat, with(R"("top_p": -0.1)"), "top_p");
  expect_refused(Endpoint::Chat, with(R"("max_tokens": 0)"), "max_tokens");
  expect_refused(Endpoint::Chat, with(R"("max_tokens": 1.5)"), "max_tokens");
  expect_refused(Endpoint::Chat, with(R"("max_tokens": "10")"), "max_tokens");
  expect_refused(Endpoint::Chat, with(R"("max_completion_tokens": -3)"), "max_completion_tokens");
  expect_refused(Endpoint::Chat, with(R"("max_tokens": 18446744073709551615)"), "max_tokens");
  expect_refused(Endpoint::Chat, with(R"("stream": "yes")"), "stream");
  expect_refused(Endpoint::Chat, with(R"("stream_options": {"include_usage": true})"), "stream_options");
  expect_refused(Endpoint::Chat, with(R"("seed": "x")"), "seed");
  expect_refused(Endpoint::Chat, with(R"("seed": 1.5)"), "seed");
  expect_refused(Endpoint::Chat, with(R"("stop": 5)"), "stop");
  expect_refused(Endpoint::Chat, with(R"("stop": ["a", 1])"), "stop");
  expect_refused(Endpoint::Chat, with(R"("stop": [""])"), "stop");
  expect_refused(Endpoint::Chat, with(R"("presence_penalty": 3)"), "presence_penalty");
  expect_refused(Endpoint::Chat, with(R"("logprobs": 1)"), "logprobs");
  expect_refused(Endpoint::Chat, with(R"("top_logprobs": 2)"), "top_logprobs");  // needs logprobs
  expect_refused(Endpoint::Chat, with(R"("logprobs": true, "top_logprobs": 21)"), "top_logprobs");
  expect_refused(Endpoint::Chat, with(R"("top_k": -1)"), "top_k");
  expect_refused(Endpoint::Chat, with(R"("repeat_penalty": 0)"), "repeat_penalty");
  expect_refused(Endpoint::Chat, with(R"("model": 3)"), "model");
}

// An integer too large for the 64-bit seed (JSON reads it as a float) is out of range, not "not
// an integer"; a fraction still is not an integer.
TEST(ServerRequest, SeedOutOfRange) {
  const std::string m = R"({"messages": [{"role": "user", "content": "Hi"}], "seed": )";
  for (const std::string seed : {"1180591620717411303424", "-1180591620717411303424", "18446744073709551616",
                                 "1e30"}) {
    const ApiError e = refusal([&] { parse_completion_request(Endpoint::Chat, m + seed + "}", defaults(), 1); });
    EXPECT_EQ(e.status(), 400) << seed;
    EXPECT_EQ(e.param(), "seed") << seed;
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << seed << ": " << e.what();
    EXPECT_EQ(std::string(e.what()).find("must be an integer,"), std::string::npos) << e.what();
  }
  const ApiError f = refusal([&] { parse_completion_request(Endpoint::Chat, m + "2.5}", defaults(), 1); });
  EXPECT_NE(std::string(f.what()).find("must be an integer"), std::string::npos) << f.what();
  // The ends of the range are taken.
  EXPECT_EQ(chat({{"messages", kMessages}, {"seed", UINT64_MAX}}).sampling.seed, UINT64_MAX);
  EXPECT_EQ(chat({{"messages", kMessages}, {"seed", INT64_MIN}}).sampling.seed, (uint64_t)INT64_MIN);
}

// response_format: text is no grammar; json_object and json_schema compile one, which the
// answer's text must match; what the converter refuses, and malformed formats, are 400s on
// response_format with the converter's words.
TEST(ServerRequest, ResponseFormatCompilesAGrammar) {
  const std::string m = R"("messages": [{"role": "user", "content": "Hi"}])";
  auto with = [&](const std::string& field) { return "{" + m + ", " + field + "}"; };
  EXPECT_EQ(chat(json::parse(with(R"("response_format": {"type": "text"})"))).grammar, nullptr);
  auto matches = [](const std::shared_ptr<const grammar::Grammar>& g, const std::string& text) {
    grammar::GrammarState st(g);
    return st.accept_bytes(text) && st.is_accepting();
  };
  const CompletionRequest obj = chat(json::parse(with(R"("response_format": {"type": "json_object"})")));
  ASSERT_NE(obj.grammar, nullptr);
  EXPECT_TRUE(matches(obj.grammar, R"({"a": [1, 2.5, "x"], "b": null})"));
  EXPECT_FALSE(matches(obj.grammar, R"([1, 2])"));
  // The body as a client writes it (a parsed json would sort the schema's keys).
  const CompletionRequest sch = parse_completion_request(Endpoint::Chat, with(R"("response_format": {"type": "json_schema",
      "json_schema": {"name": "p", "strict": true, "schema": {"type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": false}}})"), defaults(), 1);
  ASSERT_NE(sch.grammar, nullptr);
  EXPECT_TRUE(matches(sch.grammar, R"({"name": "Ada", "age": 36})"));
  EXPECT_FALSE(matches(sch.grammar, R"({"name": "Ada"})"));
  EXPECT_FALSE(matches(sch.grammar, R"({"name": "Ada", "age": 36, "x": 1})"));
  // In the schema's order, not the alphabetical one a parsed object keeps.
  EXPECT_FALSE(matches(sch.grammar, R"({"age": 36, "name": "Ada"})"));

  expect_refused(Endpoint::Chat, with(R"("response_format": {"type": "xml"})"), "response_format");
  expect_refused(Endpoint::Chat, with(R"("response_format": "json")"), "response_format");
  expect_refused(Endpoint::Chat, with(R"("response_format": {"type": "json_schema"})"), "response_format");
  const ApiError e = refusal([&] {
    parse_completion_request(Endpoint::Chat, with(R"("response_format": {"type": "json_schema",
        "json_schema": {"name": "n", "schema": {"not": {"type": "string"}}}})"), defaults(), 1);
  });
  EXPECT_NE(std::string(e.what()).find("unsupported keyword 'not'"), std::string::npos) << e.what();
}

TEST(ServerRequest, WhatTheEngineCannotDoIsRefused) {
  const std::string m = R"("messages": [{"role": "user", "content": "Hi"}])";
  auto with = [&](const std::string& field) { return "{" + m + ", " + field + "}"; };
  expect_refused(Endpoint::Chat, with(R"("n": 2)"), "n");
  expect_refused(Endpoint::Chat, with(R"("logit_bias": {"50256": -100})"), "logit_bias");
  // Their harmless values pass.
  EXPECT_NO_THROW(chat(json::parse(with(R"("n": 1, "tools": [], "tool_choice": "none",
                                           "response_format": {"type": "text"}, "logit_bias": {})"))));
  // Tools the model is told not to call (tool_choice "none") pass, rendered without them;
  // tools themselves are test_tool_calls' (engine/server/tool_calls.h).
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f"}}])";
  const CompletionRequest none = chat(json::parse(with(tools + R"(, "tool_choice": "none")")));
  EXPECT_EQ(none.messages.size(), 1u);
  EXPECT_EQ(none.tools, nullptr);
  EXPECT_NE(chat(json::parse(with(tools + R"(, "tool_choice": "auto")"))).tools, nullptr);
  expect_refused(Endpoint::Chat, with(R"("tools": [], "tool_choice": "required")"), "tool_choice");
  expect_refused(Endpoint::Chat, with(R"("tools": {"type": "function"}, "tool_choice": "none")"), "tools");
  expect_refused(Endpoint::Completion, R"({"prompt": "a", "best_of": 2})", "best_of");
  expect_refused(Endpoint::Completion, R"({"prompt": "a", "echo": true})", "echo");
  expect_refused(Endpoint::Completion, R"({"prompt": "a", "suffix": "b"})", "suffix");
}

// chat_template_kwargs (vLLM's): the server's --chat-template-kwargs, each key replaced by the
// request's; anything but an object, or Kestrel's own variables, refused (400).
TEST(ServerRequest, ChatTemplateKwargs) {
  EXPECT_EQ(chat({{"messages", kMessages}}).chat_template_kwargs, json::object());
  EXPECT_EQ(chat({{"messages", kMessages}, {"chat_template_kwargs", nullptr}}).chat_template_kwargs,
            json::object());
  const json off = {{"enable_thinking", false}};
  EXPECT_EQ(chat({{"messages", kMessages}, {"chat_template_kwargs", off}}).chat_template_kwargs, off);
  RequestDefaults d = defaults();
  d.chat_template_kwargs = {{"enable_thinking", true}, {"lang", "en"}};
  const auto with = [&](const json& kwargs) {
    json body = {{"messages", kMessages}};
    if (!kwargs.is_null()) body["chat_template_kwargs"] = kwargs;
    return parse_completion_request(Endpoint::Chat, body.dump(), d, 1).chat_template_kwargs;
  };
  EXPECT_EQ(with(nullptr), d.chat_template_kwargs);
  EXPECT_EQ(with(off), (json{{"enable_thinking", false}, {"lang", "en"}}));
  const std::string m = R"({"messages": [{"role": "user", "content": "Hi"}], )";
  for (const std::string bad : {R"("chat_template_kwargs": "x")", R"("chat_template_kwargs": [1])",
                                R"("chat_template_kwargs": true)",
                                R"("chat_template_kwargs": {"messages": []})",
                                R"("chat_template_kwargs": {"add_generation_prompt": false})"}) {
    expect_refused(Endpoint::Chat, m + bad + "}", "chat_template_kwargs");
    const ApiError e = refusal([&] { chat(json::parse(m + bad + "}")); });
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

TEST(ServerRequest, CompletionPrompts) {
  EXPECT_EQ(completion({{"prompt", "once"}}).prompt, "once");
  EXPECT_EQ(completion({{"prompt", {"once"}}}).prompt, "once");
  const CompletionRequest ids = completion({{"prompt", {1, 5, 9}}});
  EXPECT_TRUE(ids.prompt_is_ids);
  EXPECT_EQ(ids.prompt_ids, (std::vector<int>{1, 5, 9}));
  expect_refused(Endpoint::Completion, R"({})", "prompt");
  expect_refused(Endpoint::Completion, R"({"prompt": ["a", "b"]})", "prompt");
  expect_refused(Endpoint::Completion, R"({"prompt": [1, -2]})", "prompt");
  expect_refused(Endpoint::Completion, R"({"prompt": {"text": "a"}})", "prompt");
  // completions' logprobs is the number of alternatives to list.
  const CompletionRequest lp = completion({{"prompt", "a"}, {"logprobs", 2}});
  EXPECT_TRUE(lp.logprobs);
  EXPECT_EQ(lp.top_logprobs, 2);
  expect_refused(Endpoint::Completion, R"({"prompt": "a", "logprobs": true})", "logprobs");
}

TEST(ServerRequest, TokenizeBodies) {
  const TokenizeRequest t = parse_tokenize_request(R"({"content": "hi", "add_special": true})");
  EXPECT_EQ(t.content, "hi");
  EXPECT_TRUE(t.add_special);
  EXPECT_FALSE(t.with_pieces);
  EXPECT_EQ(refusal([] { parse_tokenize_request("{}"); }).param(), "content");
  EXPECT_EQ(refusal([] { parse_tokenize_request(R"({"content": 1})"); }).param(), "content");
  EXPECT_EQ(parse_detokenize_request(R"({"tokens": [0, 3, 9]})", 10), (std::vector<int>{0, 3, 9}));
  EXPECT_EQ(refusal([] { parse_detokenize_request(R"({"tokens": [10]})", 10); }).param(), "tokens");
  EXPECT_EQ(refusal([] { parse_detokenize_request(R"({"tokens": "a"})", 10); }).param(), "tokens");
  EXPECT_EQ(refusal([] { parse_detokenize_request(R"({})", 10); }).param(), "tokens");
}

// A chat body whose ignored `metadata` holds `n` empty objects: 6 + n values in all (the body,
// messages, the message, its role and content, metadata).
std::string with_metadata(size_t n) {
  std::string body = R"({"messages": [{"role": "user", "content": "Hi"}], "metadata": [)";
  for (size_t i = 0; i < n; ++i) body += i ? ",{}" : "{}";
  return body + "]}";
}
// A chat body whose `metadata` nests `d` arrays: 1 + d deep.
std::string nested_metadata(int d) {
  return R"({"messages": [{"role": "user", "content": "Hi"}], "metadata": )" + std::string(d, '[') +
         std::string(d, ']') + "}";
}

// The values of a body are counted as it is parsed: up to the limit it is read, one past it is
// 413 naming the limit, on every endpoint.
TEST(ServerJsonLimits, Values) {
  const JsonLimits limits{100, 64};
  EXPECT_NO_THROW(parse_completion_request(Endpoint::Chat, with_metadata(94), defaults(), 1, limits));
  const ApiError e = refusal([&] { parse_completion_request(Endpoint::Chat, with_metadata(95), defaults(), 1, limits); });
  EXPECT_EQ(e.status(), 413) << e.what();
  EXPECT_EQ(e.code(), "too_many_json_values");
  EXPECT_EQ(e.type(), "invalid_request_error");
  EXPECT_NE(std::string(e.what()).find("more than 100 JSON values"), std::string::npos) << e.what();
  // Scalars count as objects do; keys do not (their values do).
  EXPECT_NO_THROW(parse_body(R"({"a": [1, "x", null, true, 2.5]})", JsonLimits{7, 64}));
  EXPECT_EQ(refusal([] { parse_body(R"({"a": [1, "x", null, true, 2.5]})", JsonLimits{6, 64}); }).status(), 413);
  EXPECT_EQ(refusal([] { parse_tokenize_request(R"({"content": "a", "x": [1, 2]})", JsonLimits{3, 64}); }).code(),
            "too_many_json_values");
  EXPECT_EQ(refusal([] { parse_detokenize_request(R"({"tokens": [1, 2, 3]})", 10, JsonLimits{4, 64}); }).code(),
            "too_many_json_values");
  EXPECT_EQ(parse_detokenize_request(R"({"tokens": [1, 2, 3]})", 10, JsonLimits{5, 64}).size(), 3u);
}

TEST(ServerJsonLimits, Depth) {
  const JsonLimits limits{100000, 10};
  EXPECT_NO_THROW(parse_completion_request(Endpoint::Chat, nested_metadata(9), defaults(), 1, limits));
  const ApiError e = refusal([&] { parse_completion_request(Endpoint::Chat, nested_metadata(10), defaults(), 1, limits); });
  EXPECT_EQ(e.status(), 400) << e.what();
  EXPECT_EQ(e.code(), "json_too_deep");
  EXPECT_NE(std::string(e.what()).find("deeper than 10"), std::string::npos) << e.what();
  // The defaults: 64 deep is read, 65 is not; a nesting far past it is refused as soon as it
  // is passed, never built.
  EXPECT_NO_THROW(parse_completion_request(Endpoint::Chat, nested_metadata(63), defaults(), 1));
  EXPECT_EQ(refusal([] { parse_completion_request(Endpoint::Chat, nested_metadata(64), defaults(), 1); }).code(),
            "json_too_deep");
  EXPECT_EQ(refusal([] { parse_body(std::string(1000000, '[')); }).code(), "json_too_deep");
  // Malformed JSON is still invalid_json, within the limits.
  EXPECT_EQ(refusal([] { parse_body("{\"a\": [[1]"); }).code(), "invalid_json");
}

// The finding: 7.8 MB of empty objects in the ignored `metadata` took seconds and 250 MB to
// parse. The default limit refuses it after its first 100,000 values.
TEST(ServerJsonLimits, DefaultsRefuseAHugeIgnoredFieldQuickly) {
  const std::string body = with_metadata(2600000);
  ASSERT_GT(body.size(), 7800000u);
  const auto start = std::chrono::steady_clock::now();
  const ApiError e = refusal([&] { parse_completion_request(Endpoint::Chat, body, defaults(), 1); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(e.status(), 413);
  EXPECT_NE(std::string(e.what()).find("more than 100000 JSON values"), std::string::npos) << e.what();
  EXPECT_LT(s, 2.0);  // milliseconds when the machine is idle; seconds before the limit
}

// The defaults are generous for real requests: a conversation of 2,000 messages, some with
// content parts, and 100 tool definitions with nested JSON schemas parse.
TEST(ServerJsonLimits, DefaultsPassALongConversationWithTools) {
  json messages = json::array({{{"role", "system"}, {"content", "You are helpful."}}});
  for (int i = 0; i < 2000; ++i)
    messages.push_back(i % 3 == 2 ? json{{"role", "user"},
                                         {"content", json::array({{{"type", "text"}, {"text", "part a"}},
                                                                  {{"type", "text"}, {"text", "part b"}}})}}
                                  : json{{"role", i % 2 ? "assistant" : "user"}, {"content", fmt::format("turn {}", i)}});
  EXPECT_EQ(chat({{"messages", messages}, {"metadata", {{"user", "u"}}}}).messages.size(), 2001u);
  json tools = json::array();
  for (int t = 0; t < 100; ++t) {
    json props = json::object();
    for (int p = 0; p < 20; ++p)
      props[fmt::format("p{}", p)] = {{"type", "object"},
                                        {"description", "a field"},
                                        {"properties", {{"x", {{"type", "array"}, {"items", {{"type", "string"}, {"enum", {"a", "b", "c"}}}}}}}}};
    tools.push_back({{"type", "function"},
                     {"function", {{"name", fmt::format("f{}", t)},
                                   {"parameters", {{"type", "object"}, {"properties", props}, {"required", {"p0", "p1"}}}}}}});
  }
  EXPECT_NO_THROW(parse_body(json{{"messages", messages}, {"tools", tools}}.dump()));
  EXPECT_EQ(chat({{"messages", messages}, {"tools", tools}}).tools->defs.size(), 100u);
}

// What is read a second time in order (ordered_json.h) has bounds of its own: a tool call's
// arguments are one string to the body's parse however deep their JSON text, and an ordered
// object's keys are found by a linear search.
TEST(ServerJsonLimits, OrderedReadsAreBounded) {
  // Arguments nested a million deep (a crash by stack overflow once copied) stay text.
  const std::string deep = "{\"a\":" + std::string(1000000, '[') + std::string(1000000, ']') + "}";
  json messages = kMessages;
  messages.push_back({{"role", "assistant"},
                      {"tool_calls", {{{"id", "c1"}, {"function", {{"name", "f"}, {"arguments", deep}}}}}}});
  messages.push_back({{"role", "assistant"},
                      {"tool_calls", {{{"id", "c2"}, {"function", {{"name", "f"}, {"arguments", "{\"x\": [1, 2]}"}}}}}}});
  const CompletionRequest r = chat({{"messages", messages}});
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_TRUE(r.messages[1].tool_calls[0]["function"]["arguments"].is_string());
  EXPECT_EQ(r.messages[1].tool_calls[0]["function"]["arguments"].get<std::string>(), deep);
  EXPECT_EQ(r.messages[2].tool_calls[0]["function"]["arguments"].dump(), "{\"x\":[1,2]}");  // in order, an object

  // Many keys: refused with a line naming the bound, at once, where the ordered read would
  // store them; read past, unstored, where it drops them (keep_top).
  std::string wide = "{";
  for (int i = 0; i < 90000; ++i) wide += fmt::format("{}\"k{}\": {}", i ? "," : "", i, i);
  wide += "}";
  const auto start = std::chrono::steady_clock::now();
  try {
    parse_ordered_json(wide);
    ADD_FAILURE() << "90000 keys read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1024 keys"), std::string::npos) << e.what();
  }
  const std::string body = "{\"metadata\": " + wide + ", \"tools\": [], \"keep\": {\"b\": 1, \"a\": 2}}";
  const nlohmann::ordered_json kept = parse_ordered_json(body, {}, {"keep", "tools"});
  EXPECT_EQ(kept.dump(), "{\"tools\":[],\"keep\":{\"b\":1,\"a\":2}}");
  // A chat body with tools and such an object: its own fields only are read again.
  json many = json::object();
  for (int i = 0; i < 50000; ++i) many[fmt::format("k{}", i)] = i;
  const CompletionRequest t = chat({{"messages", kMessages}, {"metadata", many}, {"tools", json::array()},
                                    {"tool_choice", "auto"}});
  EXPECT_EQ(t.tools, nullptr);  // no tools given
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 5.0);  // tens of milliseconds when the machine is idle; minutes unbounded

  OrderedJsonLimits small;
  small.max_depth = 3;
  EXPECT_THROW(parse_ordered_json("[[[[1]]]]", small), Error);
  EXPECT_NO_THROW(parse_ordered_json("[[[1]]]", small));
  small.max_values = 4;
  EXPECT_THROW(parse_ordered_json("[1, 2, 3, 4]", small), Error);
  size_t values = 0;
  EXPECT_EQ(parse_ordered_json("[1, 2, 3]", small, {}, &values).size(), 3u);
  EXPECT_EQ(values, 4u);
}

class ServerPrepare : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_ = Tokenizer::load(std::string(KESTREL_TOKENIZER_FIXTURES) + "/byte_level");
    tmpl_.emplace(ChatFormat::chatml, *tok_);
  }
  std::unique_ptr<Tokenizer> tok_;
  std::optional<ChatTemplate> tmpl_;
};

TEST_F(ServerPrepare, PromptIdsAndOptions) {
  const CompletionRequest c = completion({{"prompt", "the river"}, {"max_tokens", 4}, {"stop", {"x"}}, {"logprobs", 0}});
  const PreparedRequest p = prepare_request(c, *tok_, nullptr, 64, tok_->vocab_size());
  EXPECT_EQ(p.prompt_ids, tok_->encode("the river"));  // as kestrel generate -p tokenizes it
  EXPECT_EQ(p.options.max_new_tokens, 4);
  EXPECT_EQ(p.options.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(p.options.logprobs, 1);  // the chosen token's, with no alternatives listed
  EXPECT_FALSE(p.options.ignore_eos);
  const CompletionRequest e = completion({{"prompt", "the river"}, {"ignore_eos", true}});
  EXPECT_TRUE(prepare_request(e, *tok_, nullptr, 64, tok_->vocab_size()).options.ignore_eos);
  EXPECT_EQ(p.options.grammar, nullptr);
  const CompletionRequest j = completion({{"prompt", "the river"}, {"response_format", {{"type", "json_object"}}}});
  ASSERT_NE(j.grammar, nullptr);
  EXPECT_EQ(prepare_request(j, *tok_, nullptr, 64, tok_->vocab_size()).options.grammar, j.grammar);

  const CompletionRequest r = chat({{"messages", kMessages}, {"stop", "y"}});
  const PreparedRequest q = prepare_request(r, *tok_, &*tmpl_, 256, tok_->vocab_size());
  EXPECT_EQ(q.prompt_ids, tmpl_->tokenize({{"user", "Hi"}}, true));  // as kestrel generate --chat
  EXPECT_EQ(q.options.stop.front(), "y");
  EXPECT_EQ(q.options.stop_ids, tmpl_->stop_ids());
  EXPECT_EQ(q.options.logprobs, 0);
}

// /tokenize's pieces: a special token, which decodes to nothing, shows its own text.
TEST_F(ServerPrepare, TokenizePiecesOfSpecialTokens) {
  const std::vector<int> ids = tok_->encode("hi<|end|>");
  ASSERT_EQ(ids.back(), 258);
  EXPECT_EQ(token_text(*tok_, 258), "");  // as generated text: nothing
  EXPECT_EQ(token_piece(*tok_, 258), "<|end|>");
  std::string pieces;
  for (int id : ids) pieces += token_piece(*tok_, id);
  EXPECT_EQ(pieces, tok_->decode(ids) + "<|end|>");  // the text as decoded, then the token
  for (int id : {4, 5, 104}) EXPECT_EQ(token_piece(*tok_, id), token_text(*tok_, id)) << id;
}

// The request's chat_template_kwargs reach the model's template.
TEST_F(ServerPrepare, ChatTemplateKwargsReachTheTemplate) {
  const std::filesystem::path file = std::filesystem::temp_directory_path() /
                                     ("kestrel_test_server_" + std::to_string(getpid()) + ".jinja");
  std::ofstream(file) << "{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if enable_thinking is defined and enable_thinking is false %}"
                         " without thinking{% endif %}";
  const ChatTemplate t =
      ChatTemplate::load(std::string(KESTREL_TOKENIZER_FIXTURES) + "/byte_level", file.string(), *tok_);
  std::filesystem::remove(file);
  const std::vector<ChatMessage> hi = {{"user", "Hi"}};
  ASSERT_NE(t.tokenize(hi, true, {{"enable_thinking", false}}), t.tokenize(hi, true));
  const CompletionRequest off =
      chat({{"messages", kMessages}, {"chat_template_kwargs", {{"enable_thinking", false}}}});
  EXPECT_EQ(prepare_request(off, *tok_, &t, 64, tok_->vocab_size()).prompt_ids,
            t.tokenize(hi, true, {{"enable_thinking", false}}));
  EXPECT_EQ(prepare_request(chat({{"messages", kMessages}}), *tok_, &t, 64, tok_->vocab_size()).prompt_ids,
            t.tokenize(hi, true));
}

TEST_F(ServerPrepare, PromptLongerThanTheContextIsRefused) {
  const CompletionRequest c = completion({{"prompt", "the river runs under a stone bridge"}, {"max_tokens", 4}});
  const int n = (int)tok_->encode(c.prompt).size();
  EXPECT_NO_THROW(prepare_request(c, *tok_, nullptr, n + 4, tok_->vocab_size()));
  const ApiError e = refusal([&] { prepare_request(c, *tok_, nullptr, n + 3, tok_->vocab_size()); });
  EXPECT_EQ(e.status(), 400);
  EXPECT_EQ(e.code(), "context_length_exceeded");
  EXPECT_EQ(e.param(), "prompt");
  // Without max_tokens the prompt needs room for one token.
  const CompletionRequest open = parse_completion_request(Endpoint::Completion, json{{"prompt", c.prompt}}.dump(), {}, 1);
  EXPECT_NO_THROW(prepare_request(open, *tok_, nullptr, n + 1, tok_->vocab_size()));
  EXPECT_EQ(refusal([&] { prepare_request(open, *tok_, nullptr, n, tok_->vocab_size()); }).param(), "prompt");

  const CompletionRequest m = chat({{"messages", kMessages}, {"max_tokens", 1}});
  EXPECT_EQ(refusal([&] { prepare_request(m, *tok_, &*tmpl_, 3, tok_->vocab_size()); }).param(), "messages");
  // Ids past the vocabulary.
  const CompletionRequest ids = completion({{"prompt", {tok_->vocab_size()}}, {"max_tokens", 1}});
  EXPECT_EQ(refusal([&] { prepare_request(ids, *tok_, nullptr, 64, tok_->vocab_size()); }).param(), "prompt");
}

namespace {

GenerateResult result() {
  GenerateResult r;
  r.prompt_ids = {1, 2, 3};
  r.ids = {4, 5};
  r.text = "ab";
  r.finish_reason = "eos";
  r.n_cached = 2;
  r.logprobs = {Logprobs{{4, -0.5f}, {{4, -0.5f}, {6, -1.5f}}}, Logprobs{{5, -0.25f}, {{5, -0.25f}, {7, -2.f}}}};
  return r;
}

const ResponseMeta kMeta{"id-1", 1700000000, "tiny"};

}  // namespace

// A speculative generation (kestrel serve --spec): its drafted ids, kept and not, in OpenAI's
// predicted-output fields.
TEST_F(ServerPrepare, SpeculativeUsageCountsTheDrafts) {
  GenerateResult r = result();
  r.speculative = true;
  r.n_steps = 1;
  r.n_drafted = 5;
  r.n_accepted = 1;
  const json j = completion_response(chat({{"messages", kMessages}}), kMeta, r, *tok_);
  EXPECT_EQ(j["usage"]["completion_tokens_details"]["accepted_prediction_tokens"], 1);
  EXPECT_EQ(j["usage"]["completion_tokens_details"]["rejected_prediction_tokens"], 4);
}

TEST_F(ServerPrepare, ChatResponse) {
  CompletionRequest req = chat({{"messages", kMessages}, {"logprobs", true}, {"top_logprobs", 1}});
  const json j = completion_response(req, kMeta, result(), *tok_);
  EXPECT_EQ(j["id"], "id-1");
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "tiny");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");  // end-of-sequence
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(j["usage"]["completion_tokens"], 2);
  EXPECT_EQ(j["usage"]["total_tokens"], 5);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
  EXPECT_FALSE(j["usage"].contains("completion_tokens_details")) << "no speculation, no drafts";
  const json& lp = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[0]["token"], token_text(*tok_, 4));
  EXPECT_FLOAT_EQ(lp[0]["logprob"].get<float>(), -0.5f);
  ASSERT_EQ(lp[0]["top_logprobs"].size(), 1u);  // top_logprobs 1 of the 2 recorded
  EXPECT_EQ(lp[1]["top_logprobs"][0]["token"], token_text(*tok_, 5));
  EXPECT_TRUE(lp[0]["bytes"].is_array());

  req.logprobs = false;
  EXPECT_TRUE(completion_response(req, kMeta, result(), *tok_)["choices"][0]["logprobs"].is_null());
}

TEST_F(ServerPrepare, CompletionResponse) {
  const CompletionRequest req = completion({{"prompt", "a"}, {"logprobs", 2}});
  GenerateResult r = result();
  r.finish_reason = "length";
  const json j = completion_response(req, kMeta, r, *tok_);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "ab");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  const json& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"].size(), 2u);
  EXPECT_FLOAT_EQ(lp["token_logprobs"][1].get<float>(), -0.25f);
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][1], token_text(*tok_, 4).size());
}

TEST_F(ServerPrepare, StreamChunks) {
  CompletionRequest req = chat({{"messages", kMessages}, {"stream", true}, {"stream_options", {{"include_usage", true}}}});
  const json role = role_chunk(req, kMeta);
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(role.contains("usage") && role["usage"].is_null());
  const json text = text_chunk(req, kMeta, "ab");
  EXPECT_EQ(text["choices"][0]["delta"]["content"], "ab");
  EXPECT_TRUE(text["choices"][0]["finish_reason"].is_null());
  const json fin = finish_chunk(req, kMeta, result(), *tok_);
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(fin["choices"][0]["delta"], json::object());
  const json usage = usage_chunk(req, kMeta, result());
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);
  EXPECT_EQ(sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_STREQ(kSseDone, "data: [DONE]\n\n");

  // A stream's log-probabilities come whole in the chunk that finishes it.
  req.logprobs = true;
  req.top_logprobs = 2;
  EXPECT_TRUE(text_chunk(req, kMeta, "ab")["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(finish_chunk(req, kMeta, result(), *tok_)["choices"][0]["logprobs"]["content"].size(), 2u);

  req.include_usage = false;
  EXPECT_FALSE(text_chunk(req, kMeta, "x").contains("usage"));
  const CompletionRequest c = completion({{"prompt", "a"}, {"stream", true}});
  EXPECT_EQ(text_chunk(c, kMeta, "x")["object"], "text_completion");
  EXPECT_EQ(text_chunk(c, kMeta, "x")["choices"][0]["text"], "x");
}

TEST(ServerSlots, PicksTheSlotSharingTheLongestPrefix) {
  std::vector<std::vector<int>> cached = {{1, 2, 3}, {1, 7, 8, 9}, {}};
  Slots slots(3, 0, [&](int i) -> const std::vector<int>& { return cached[i]; });
  Slots::Outcome why;
  auto a = slots.acquire({1, 7, 8, 5}, {}, why);
  ASSERT_TRUE(a);
  EXPECT_EQ(why, Slots::Outcome::Granted);
  EXPECT_EQ(a->slot(), 1);
  auto b = slots.acquire({1, 2, 3, 4}, {}, why);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->slot(), 0);
  auto c = slots.acquire({1, 2, 3, 4}, {}, why);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->slot(), 2);
  EXPECT_EQ(slots.status().busy, 3);
  // No queue: a fourth is refused at once.
  EXPECT_FALSE(slots.acquire({1}, {}, why));
  EXPECT_EQ(why, Slots::Outcome::QueueFull);
  b.reset();
  EXPECT_EQ(slots.status().idle, 1);
  EXPECT_TRUE(slots.acquire({1}, {}, why));
}

TEST(ServerSlots, QueueWaitsInOrderAndIsBounded) {
  std::vector<int> none;
  Slots slots(1, 2, [&](int) -> const std::vector<int>& { return none; });
  Slots::Outcome why;
  auto held = slots.acquire({1}, {}, why);
  ASSERT_TRUE(held);
  std::vector<int> order;
  std::mutex m;
  auto waiter = [&](int who) {
    Slots::Outcome w;
    auto lease = slots.acquire({1}, {}, w);
    std::lock_guard<std::mutex> lk(m);
    order.push_back(lease ? who : -who);
  };
  std::thread first(waiter, 1);
  while (slots.status().queued < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread second(waiter, 2);
  while (slots.status().queued < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(slots.acquire({1}, {}, why));  // two wait already
  EXPECT_EQ(why, Slots::Outcome::QueueFull);
  held.reset();
  first.join();
  second.join();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_EQ(slots.status().idle, 1);
}

// With paged KV memory a request waits, with a slot free, until the requests running leave its
// blocks in the pool, first come first served: a small request behind a large one waits too.
TEST(ServerSlots, RequestsWaitForTheirKvBlocksInOrder) {
  std::vector<int> none;
  Slots slots(3, 4, [&](int) -> const std::vector<int>& { return none; }, /*kv_blocks=*/10);
  Slots::Outcome why;
  auto held = slots.acquire({1}, {}, why, 6);
  ASSERT_TRUE(held);
  EXPECT_EQ(slots.status().kv_reserved, 6);
  std::vector<int> order;
  std::mutex m;
  std::vector<std::unique_ptr<Slots::Lease>> leases(3);
  auto waiter = [&](int who, int64_t blocks) {
    Slots::Outcome w;
    leases[who] = slots.acquire({1}, {}, w, blocks);
    std::lock_guard<std::mutex> lk(m);
    order.push_back(leases[who] ? who : -who);
  };
  std::thread large(waiter, 1, 6);
  while (slots.status().queued < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread small(waiter, 2, 2);
  while (slots.status().queued < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(120));  // a few of the waiters' wake-ups
  EXPECT_TRUE(order.empty());  // two slots free, but 6 + 6 > 10, and the small one is behind
  held.reset();
  large.join();
  small.join();
  std::sort(order.begin(), order.end());  // both granted (in what order they record it, racy)
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_EQ(slots.status().kv_reserved, 8);
  leases.clear();
  EXPECT_EQ(slots.status().kv_reserved, 0);
  EXPECT_THROW(slots.acquire({1}, {}, why, 11), Error);  // more than the pool: a bug of the caller
}

TEST(ServerSlots, CancelledAndShutDownWaitersLeaveTheLine) {
  std::vector<int> none;
  Slots slots(1, 4, [&](int) -> const std::vector<int>& { return none; });
  Slots::Outcome why;
  auto held = slots.acquire({1}, {}, why);
  std::atomic<bool> gone{false};
  Slots::Outcome w1 = Slots::Outcome::Granted, w2 = Slots::Outcome::Granted;
  std::thread t1([&] { EXPECT_FALSE(slots.acquire({1}, [&] { return gone.load(); }, w1)); });
  while (slots.status().queued < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  gone = true;
  t1.join();
  EXPECT_EQ(w1, Slots::Outcome::Cancelled);
  EXPECT_EQ(slots.status().queued, 0);
  std::thread t2([&] { EXPECT_FALSE(slots.acquire({1}, {}, w2)); });
  while (slots.status().queued < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  slots.shut_down();
  t2.join();
  EXPECT_EQ(w2, Slots::Outcome::ShuttingDown);
  EXPECT_FALSE(slots.acquire({1}, {}, why));
  EXPECT_EQ(why, Slots::Outcome::ShuttingDown);
}

TEST(ServerTurnLock, TurnsGoInTheOrderAsked) {
  TurnLock turn;
  std::vector<int> order;
  turn.lock();
  std::thread b([&] {
    std::lock_guard<TurnLock> t(turn);
    order.push_back(2);
  });
  auto wait_for_tickets = [&](uint64_t n) {
    while (turn.tickets() < n) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  wait_for_tickets(2);  // b is waiting
  std::thread c([&] {
    std::lock_guard<TurnLock> t(turn);
    order.push_back(3);
  });
  wait_for_tickets(3);  // c waits behind b
  order.push_back(1);
  turn.unlock();
  b.join();
  c.join();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(ServerAccess, BearerKey) {
  EXPECT_TRUE(bearer_matches("Bearer s3cret", "s3cret"));
  EXPECT_TRUE(bearer_matches("bearer s3cret", "s3cret"));  // the scheme's case is free
  EXPECT_FALSE(bearer_matches("Bearer s3cre", "s3cret"));
  EXPECT_FALSE(bearer_matches("Bearer s3crett", "s3cret"));
  EXPECT_FALSE(bearer_matches("Bearer S3cret", "s3cret"));
  EXPECT_FALSE(bearer_matches("s3cret", "s3cret"));
  EXPECT_FALSE(bearer_matches("Basic s3cret", "s3cret"));
  EXPECT_FALSE(bearer_matches("", "s3cret"));
  EXPECT_FALSE(bearer_matches("Bearer ", ""));
}

TEST(ServerAccess, LogLine) {
  AccessEntry e;
  e.remote = "127.0.0.1:5000";
  e.method = "POST";
  e.path = "/v1/completions";
  e.status = 200;
  e.prompt_tokens = 12;
  e.completion_tokens = 30;
  e.finish = "length";
  e.ms = 45.06;
  EXPECT_EQ(access_line(e), "127.0.0.1:5000 POST /v1/completions 200 prompt=12 completion=30 finish=length 45.1 ms");
  e.prompt = "say \"hi\"";
  EXPECT_EQ(access_line(e), "127.0.0.1:5000 POST /v1/completions 200 prompt=12 completion=30 finish=length 45.1 ms "
                            "prompt_text=\"say \\\"hi\\\"\"");
  AccessEntry g;
  g.remote = "::1:9";
  g.method = "GET";
  g.path = "/health";
  g.status = 200;
  EXPECT_EQ(access_line(g), "::1:9 GET /health 200 0.0 ms");
}

// Where the key comes from: --api-key, then --api-key-file, then KESTREL_API_KEY; an empty one
// from any of them, or both options, is refused rather than serving without a key.
TEST(ServerAccess, ApiKeySources) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("kestrel_test_keys_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  using Key = std::optional<std::string>;
  auto keys = [](Key flag, Key file, Key env) {
    ApiKeySources s;
    s.flag = flag;
    s.file = file;
    s.env = env;
    return s;
  };
  auto refused = [](const ApiKeySources& s) -> std::string {
    try {
      resolve_api_key(s);
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();  // one line
      return e.what();
    }
    return "(not refused)";
  };
  EXPECT_EQ(resolve_api_key(keys({}, {}, {})), "");  // no key: serving without one is asked for
  EXPECT_EQ(resolve_api_key(keys("k1", {}, {})), "k1");
  EXPECT_EQ(resolve_api_key(keys("k1", {}, "k3")), "k1");
  const std::string file = write("key", "k2 \r\nsecond line\n");
  EXPECT_EQ(resolve_api_key(keys({}, file, "k3")), "k2");
  EXPECT_EQ(resolve_api_key(keys({}, write("bare", "k4"), {})), "k4");
  EXPECT_EQ(resolve_api_key(keys({}, {}, "k3")), "k3");

  EXPECT_NE(refused(keys("", {}, {})).find("--api-key is empty"), std::string::npos);
  EXPECT_NE(refused(keys("", {}, "k3")).find("--api-key is empty"), std::string::npos);
  EXPECT_NE(refused(keys("k1", file, {})).find("both"), std::string::npos);
  EXPECT_NE(refused(keys({}, {}, "")).find("KESTREL_API_KEY"), std::string::npos);
  for (const std::string text : {"", "\n", "  \nk5\n"}) {
    const std::string empty = write("empty", text);
    const std::string why = refused(keys({}, empty, {}));
    EXPECT_NE(why.find(empty), std::string::npos) << why;
    EXPECT_NE(why.find("empty"), std::string::npos) << why;
  }
  for (const std::string& bad : {(dir / "missing").string(), dir.string()}) {
    const std::string why = refused(keys({}, bad, {}));
    EXPECT_NE(why.find("cannot read the API key file " + bad + ": "), std::string::npos) << why;
  }
  std::filesystem::remove_all(dir);
}

TEST(ServerAccess, LoopbackHosts) {
  for (const char* h : {"127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LocalHost",
                        "::ffff:127.0.0.1", "0:0:0:0:0:0:0:1"})
    EXPECT_TRUE(is_loopback_host(h)) << h;
  for (const char* h : {"0.0.0.0", "::", "192.168.1.2", "10.0.0.1", "128.0.0.1", "example.com",
                        "localhost.example.com", "::ffff:10.0.0.1", ""})
    EXPECT_FALSE(is_loopback_host(h)) << h;
}

// ---- the HTTP transport without sockets (HttpServer::answer_bytes) -------------------------

namespace {

// A server with the routes' shapes of kestrel serve: GET on the I/O thread, POST on a worker
// (run inline here), one streamed.
std::unique_ptr<HttpServer> transport(HttpLimits l = {}) {
  auto s = std::make_unique<HttpServer>(l);
  s->route("GET", "/health", RunOn::IoThread,
           [](HttpRequest&, Exchange& ex) { ex.respond(HttpResponse::json(R"({"status":"ok"})")); });
  s->route("GET", "/v1/models/*", RunOn::IoThread,
           [](HttpRequest& r, Exchange& ex) { ex.respond(HttpResponse::json(json{{"id", r.rest}}.dump())); });
  s->route("POST", "/echo", RunOn::Worker, [](HttpRequest& r, Exchange& ex) { ex.respond(HttpResponse::json(r.body)); });
  s->route("POST", "/stream", RunOn::Worker, [](HttpRequest&, Exchange& ex) {
    HttpResponse head;
    head.content_type = "text/event-stream";
    ex.begin_stream(std::move(head));
    ex.write("data: 1\n\n");
    ex.end_stream();
  });
  s->route("POST", "/throws", RunOn::Worker, [](HttpRequest&, Exchange&) { throw std::runtime_error("boom"); });
  s->route("POST", "/silent", RunOn::Worker, [](HttpRequest&, Exchange&) {});
  return s;
}

std::vector<int> statuses(const std::string& out) {
  std::vector<int> st;
  // A status line starts the output or follows the end of an answer (a CRLF or a JSON body).
  for (size_t at = out.find("HTTP/1."); at != std::string::npos; at = out.find("HTTP/1.", at + 1))
    if (at == 0 || out[at - 1] == '\n' || out[at - 1] == '}') st.push_back(std::atoi(out.c_str() + at + 9));
  return st;
}

TEST(HttpTransport, PipelinedRequestsAnsweredInOrder) {
  auto s = transport();
  const std::string out = s->answer_bytes(
      "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
      "POST /echo HTTP/1.1\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
      "GET /v1/models/my%20model?q=1 HTTP/1.1\r\n\r\n"
      "POST /stream HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
      "GET /health HTTP/1.1\r\n\r\n");  // after the close: not answered
  EXPECT_EQ(statuses(out), (std::vector<int>{200, 200, 200, 200})) << out;
  EXPECT_NE(out.find("{\"a\":1}"), std::string::npos) << out;
  EXPECT_NE(out.find("{\"id\":\"my model\"}"), std::string::npos) << out;
  EXPECT_NE(out.find("Transfer-Encoding: chunked\r\n"), std::string::npos) << out;
  EXPECT_NE(out.find("9\r\ndata: 1\n\n\r\n0\r\n\r\n"), std::string::npos) << out;
  EXPECT_NE(out.find("Keep-Alive: timeout=2, max="), std::string::npos) << out;
  EXPECT_TRUE(out.ends_with("0\r\n\r\n")) << out;
}

TEST(HttpTransport, ChunkedBodiesAndHead) {
  auto s = transport();
  std::string out = s->answer_bytes(
      "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n5\r\n:\"b\"}\r\n0\r\n\r\n"
      "HEAD /health HTTP/1.1\r\n\r\n");
  EXPECT_EQ(statuses(out), (std::vector<int>{200, 200})) << out;
  EXPECT_NE(out.find("\r\n\r\n{\"a\":\"b\"}HTTP/1.1"), std::string::npos) << out;
  EXPECT_TRUE(out.ends_with("Content-Length: 15\r\nKeep-Alive: timeout=2, max=998\r\n\r\n")) << out;
}

TEST(HttpTransport, FramingRefusals) {
  struct Case {
    std::string input;
    int status;
    std::string code;
  };
  const std::vector<Case> cases = {
      {"POST /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400, "invalid_content_length"},
      {"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "invalid_content_length"},
      {"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
       "invalid_transfer_encoding"},
      {"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400, "invalid_transfer_encoding"},
      {"POST /echo HTTP/1.1\r\nContent-Length: 2000\r\n\r\n", 413, "request_too_large"},
      {"GET /" + std::string(2000, 'a') + " HTTP/1.1\r\n\r\n", 414, "uri_too_long"},
      {"GET / HTTP/1.1\r\nX: " + std::string(5000, 'a') + "\r\n\r\n", 431, "request_header_fields_too_large"},
      {"GET /health HTTP/2.0\r\n\r\n", 505, "http_version_not_supported"},
      {"GET health HTTP/1.1\r\n\r\n", 400, "bad_request"},
      {"GARBAGE\r\n\r\n", 400, "bad_request"},
      {"GET /health HTTP/1.1\r\nHost: x\r\n", 408, "request_timeout"},  // the input ends mid-request
  };
  HttpLimits l;
  l.max_body = 1000;
  l.max_header = 4096;
  l.max_request_line = 1024;
  auto s = transport(l);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.input.substr(0, 80));
    // A good request after the bad one is never reached: the connection closes. (Not after
    // the 408's: that input must end mid-request.)
    const std::string out = s->answer_bytes(c.status == 408 ? c.input : c.input + "GET /health HTTP/1.1\r\n\r\n");
    EXPECT_EQ(statuses(out), std::vector<int>{c.status}) << out;
    EXPECT_NE(out.find("Connection: close\r\n"), std::string::npos) << out;
    EXPECT_NE(out.find("\"code\":\"" + c.code + "\""), std::string::npos) << out;
  }
}

TEST(HttpTransport, RoutingRefusalsAndHandlerFailures) {
  auto s = transport();
  const std::string out = s->answer_bytes(
      "GET /echo HTTP/1.1\r\n\r\n"                          // 405, Allow: POST
      "POST /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n"  // 405, Allow: GET, HEAD
      "GET /nothing HTTP/1.1\r\n\r\n"                       // 404
      "POST /echo HTTP/1.1\r\n\r\n"                         // 411: no length
      "POST /throws HTTP/1.1\r\nContent-Length: 0\r\n\r\n"  // 500, the exception's text
      "POST /silent HTTP/1.1\r\nContent-Length: 0\r\n\r\n"  // 500: no answer given
      "OPTIONS /echo HTTP/1.1\r\n\r\n"                      // 204, Allow; no CORS without origins
      "GET /health HTTP/1.0\r\n\r\n");                      // 1.0 without keep-alive: the last
  EXPECT_EQ(statuses(out), (std::vector<int>{405, 405, 404, 411, 500, 500, 204, 200})) << out;
  EXPECT_NE(out.find("Allow: POST\r\n"), std::string::npos) << out;
  EXPECT_NE(out.find("Allow: GET, HEAD\r\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\"message\":\"boom\""), std::string::npos) << out;
  EXPECT_NE(out.find("the server gave no answer"), std::string::npos) << out;
  EXPECT_NE(out.find("Allow: POST, OPTIONS\r\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("Access-Control-"), std::string::npos) << out;
  EXPECT_TRUE(out.ends_with("Connection: close\r\n\r\n{\"status\":\"ok\"}")) << out;
}

}  // namespace
