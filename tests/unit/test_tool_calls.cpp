// OpenAI's tools API on the engine's side (engine/server/tool_calls.h): the call formats read
// from the real templates, the parser on whole and streamed replies of each family, the
// grammar of tool_choice required and named (random walks through it all parse, and their
// arguments validate against the tools' schemas with python3-jsonschema), the refusals of
// malformed tools, and the prompt the server renders for an OpenAI request against
// @huggingface/jinja's rendering of the same conversation (goldens.json's "request" cases,
// written by scripts/make-jinja-goldens.mjs).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "engine/grammar/grammar.h"
#include "engine/server/request.h"
#include "engine/server/response.h"
#include "engine/server/tool_calls.h"
#include "tokenizer/chat_template.h"

namespace fs = std::filesystem;
using nlohmann::json;
using ojson = nlohmann::ordered_json;
using namespace kestrel;
using namespace kestrel::server;

namespace {

const fs::path kTemplates = KESTREL_CHAT_TEMPLATES_DIR;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- formats ----

TEST(ToolFormat, ReadFromTheRealTemplates) {
  const std::map<std::string, std::optional<ToolFormat>> expected = {
      {"qwen2.5.jinja", ToolFormat::hermes},       {"qwen3.jinja", ToolFormat::hermes},
      {"llama3.1.jinja", ToolFormat::llama3},      {"llama3.2.jinja", ToolFormat::llama3},
      {"mistral-v0.3.jinja", ToolFormat::mistral}, {"mistral-nemo.jinja", ToolFormat::mistral},
      {"mistral-small-3.1.jinja", ToolFormat::mistral},
      // no tool syntax
      {"llama3.jinja", std::nullopt},  {"llama2.jinja", std::nullopt}, {"mistral-v0.1.jinja", std::nullopt},
      {"chatml.jinja", std::nullopt},  {"zephyr.jinja", std::nullopt}, {"gemma2.jinja", std::nullopt},
      {"gemma3.jinja", std::nullopt},  {"phi3.jinja", std::nullopt},
  };
  for (const auto& [file, f] : expected) EXPECT_TRUE(detect_tool_format(read_file(kTemplates / file)) == f) << file;
  EXPECT_FALSE(detect_tool_format("").has_value());  // a built-in format has no template text
}

TEST(ToolFormat, CallIds) {
  const std::string a = make_tool_call_id(ToolFormat::hermes, "chatcmpl-1", 0);
  EXPECT_EQ(a.size(), 29u);
  EXPECT_EQ(a.substr(0, 5), "call_");
  EXPECT_NE(a, make_tool_call_id(ToolFormat::hermes, "chatcmpl-1", 1));
  EXPECT_NE(a, make_tool_call_id(ToolFormat::hermes, "chatcmpl-2", 0));
  EXPECT_EQ(a, make_tool_call_id(ToolFormat::hermes, "chatcmpl-1", 0));
  // Mistral's templates take back only 9 letters and digits.
  const std::string m = make_tool_call_id(ToolFormat::mistral, "chatcmpl-1", 0);
  EXPECT_EQ(m.size(), 9u);
  for (char c : m + a.substr(5)) EXPECT_TRUE(std::isalnum((unsigned char)c)) << m;
}

// ---- the parser ----

struct Parsed {
  std::string content;
  std::vector<ToolCall> calls;
};

ToolCallParser make_parser(ToolFormat f) {
  return ToolCallParser(f, [](int i) { return "id" + std::to_string(i); });
}

Parsed whole(ToolFormat f, const std::string& text) {
  ToolCallParser p = make_parser(f);
  p.push(text);
  p.finish();
  return {p.content(), p.calls()};
}

// The same reply fed in pieces of `sizes` (cycled), joined as OpenAI's client joins a stream:
// a call's first piece opens it (index, id, name, empty arguments), later ones add arguments.
Parsed streamed(ToolFormat f, const std::string& text, const std::vector<size_t>& sizes) {
  ToolCallParser p = make_parser(f);
  Parsed out;
  auto take = [&](const ToolCallParser::Out& o) {
    out.content += o.content;
    for (const ToolCallDelta& d : o.calls) {
      if (d.first) {
        EXPECT_EQ(d.index, (int)out.calls.size());
        EXPECT_TRUE(d.arguments.empty());
        EXPECT_FALSE(d.name.empty());
        out.calls.push_back({d.id, d.name, ""});
      } else {
        ASSERT_LT(d.index, (int)out.calls.size());
        EXPECT_TRUE(d.id.empty() && d.name.empty());
        out.calls[d.index].arguments += d.arguments;
      }
    }
  };
  for (size_t i = 0, k = 0; i < text.size(); ++k) {
    const size_t n = sizes[k % sizes.size()];
    take(p.push(text.substr(i, n)));
    i += n;
  }
  take(p.finish());
  return out;
}

struct Call {
  std::string name, arguments;
};

// The reply parses into `content` and `calls`, whole and streamed in pieces of 1, 2, 3, 7
// and random sizes.
void expect_parse(ToolFormat f, const std::string& text, const std::string& content,
                  const std::vector<Call>& calls) {
  SCOPED_TRACE(std::string(tool_format_name(f)) + ": " + text);
  std::mt19937 rng(7);
  std::vector<size_t> random(16);
  for (size_t& n : random) n = 1 + rng() % 9;
  std::vector<std::pair<std::string, Parsed>> results = {{"whole", whole(f, text)}};
  for (const auto& sizes : std::vector<std::vector<size_t>>{{1}, {2}, {3}, {7}, random})
    results.push_back({"pieces of " + std::to_string(sizes[0]), streamed(f, text, sizes)});
  for (const auto& [how, r] : results) {
    SCOPED_TRACE(how);
    EXPECT_EQ(r.content, content);
    ASSERT_EQ(r.calls.size(), calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(r.calls[i].name, calls[i].name);
      EXPECT_EQ(r.calls[i].arguments, calls[i].arguments);
      EXPECT_EQ(r.calls[i].id, "id" + std::to_string(i));
    }
  }
}

TEST(ToolCallParser, Hermes) {
  const ToolFormat h = ToolFormat::hermes;
  expect_parse(h, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", "",
               {{"get_weather", R"({"city": "Paris"})"}});
  // Text before, two calls, the second with its arguments first.
  expect_parse(h,
               "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": null}]}}\n</tool_call>\n"
               "<tool_call>\n{\"arguments\": {\"city\": \"Oslo\"}, \"name\": \"b\"}\n</tool_call>",
               "Let me check.\n", {{"a", R"({"x": [1, {"y": null}]})"}, {"b", R"({"city": "Oslo"})"}});
  // Braces, quotes and the closing tag inside strings; no space at all.
  expect_parse(h, R"(<tool_call>{"name":"f","arguments":{"s":"}\"{ </tool_call> ]"}}</tool_call>)", "",
               {{"f", R"({"s":"}\"{ </tool_call> ]"})"}});
  // A call without arguments has none; text after the calls is text.
  expect_parse(h, "<tool_call>{\"name\": \"ping\"}</tool_call>\n\nDone.", "Done.", {{"ping", "{}"}});
  // Not calls: text.
  expect_parse(h, "a < b, <tool but no call", "a < b, <tool but no call", {});
  expect_parse(h, "<tool_call> hello", "<tool_call> hello", {});
  expect_parse(h, "<tool_call>{\"x\": 1}</tool_call>", "<tool_call>{\"x\": 1}</tool_call>", {});
  expect_parse(h, "<tool_call>{\"name\": 5, \"arguments\": {}}", "<tool_call>{\"name\": 5, \"arguments\": {}}", {});
  expect_parse(h, "<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}",
               "<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}", {});  // arguments are an object
  expect_parse(h, "", "", {});
  // Cut short (max_tokens): the call as far as it was written.
  expect_parse(h, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2", "", {{"f", "{\"a\": [1, 2"}});
  expect_parse(h, "ok <tool_call>\n{\"na", "ok <tool_call>\n{\"na", {});
  // A call broken off after its name: it stays as written; the rest of its block is dropped.
  expect_parse(h, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}, ]}</tool_call> after", "after",
               {{"f", "{\"a\": 1}"}});
}

TEST(ToolCallParser, Llama3) {
  const ToolFormat l = ToolFormat::llama3;
  expect_parse(l, R"({"name": "get_weather", "parameters": {"city": "Paris"}})", "",
               {{"get_weather", R"({"city": "Paris"})"}});
  expect_parse(l, "\n  {\"name\": \"f\", \"arguments\": {}}", "", {{"f", "{}"}});
  // <|python_tag|> where it was decoded as text; calls joined by ';'.
  expect_parse(l, R"(<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}})", "",
               {{"a", "{}"}, {"b", R"({"x": 1})"}});
  expect_parse(l, "The answer is {x}.", "The answer is {x}.", {});
  expect_parse(l, R"({"answer": 42})", R"({"answer": 42})", {});
  expect_parse(l, R"(  {"name": "f"} trailing)", "trailing", {{"f", "{}"}});
  expect_parse(l, "Use {\"name\": \"f\", \"parameters\": {}}", "Use {\"name\": \"f\", \"parameters\": {}}", {});
}

TEST(ToolCallParser, Mistral) {
  const ToolFormat m = ToolFormat::mistral;
  expect_parse(m, R"([{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}])", "",
               {{"f", R"({"a": 1})"}, {"g", "{}"}});
  expect_parse(m, R"([TOOL_CALLS][{"name": "f", "arguments": {}}])", "", {{"f", "{}"}});
  expect_parse(m, R"(Sure. [TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "abc123def"}])", "Sure. ",
               {{"f", "{}"}});
  expect_parse(m, "Sure.", "Sure.", {});
  expect_parse(m, "[1, 2]", "[1, 2]", {});
  expect_parse(m, "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", {});
}

// Random replies: well-formed ones of each format (text, one call or several, keys in either
// order), then most of them broken at random (bytes deleted, pieces inserted, cut short). Each
// parses the same whole and in random pieces: a stream's chunks join to the non-streamed answer.
TEST(ToolCallParser, RandomRepliesParseAlikeWholeAndStreamed) {
  const std::vector<std::string> parts = {
      "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", "\"name\": ",
      "\"arguments\": ", "\"parameters\": ", "\"f\"", ",", " ", "\n", "x", ":", ";", "\\", "\"", "1", "null"};
  const std::vector<std::string> args = {"{}", R"({"a": 1})", R"({"s": "}]\" <tool_call>"})",
                                         R"({"x": [1, {"y": null}], "z": true})"};
  std::mt19937 rng(45);
  const auto pick = [&](const std::vector<std::string>& v) { return v[rng() % v.size()]; };
  for (ToolFormat f : {ToolFormat::hermes, ToolFormat::llama3, ToolFormat::mistral}) {
    size_t calls = 0;
    for (int i = 0; i < 3000; ++i) {
      const std::string key = f == ToolFormat::llama3 && rng() % 2 ? "parameters" : "arguments";
      std::vector<std::string> objects;
      for (int n = 1 + rng() % 3; n > 0; --n) {
        const std::string name = rng() % 2 ? "\"name\": \"f\"" : "\"name\": \"g\"";
        const std::string a = "\"" + key + "\": " + pick(args);
        objects.push_back("{" + (rng() % 3 ? name + ", " + a : a + ", " + name) + (rng() % 4 ? "" : ", \"id\": \"x\"") + "}");
      }
      std::string text = rng() % 3 ? "" : "Sure. ";
      if (f == ToolFormat::hermes) {
        for (const std::string& o : objects) text += "<tool_call>\n" + o + "\n</tool_call>\n";
      } else {
        if (rng() % 2) text += f == ToolFormat::llama3 ? "<|python_tag|>" : "[TOOL_CALLS]";
        std::string joined;
        for (const std::string& o : objects) joined += (joined.empty() ? "" : f == ToolFormat::llama3 ? "; " : ", ") + o;
        text += f == ToolFormat::mistral ? "[" + joined + "]" : joined;
      }
      if (rng() % 4) text += " done";
      for (int m = rng() % 4; m > 0 && !text.empty(); --m) {
        const size_t at = rng() % text.size();
        switch (rng() % 3) {
          case 0: text.erase(at, 1 + rng() % 5); break;
          case 1: text.insert(at, pick(parts)); break;
          default: text.resize(at); break;
        }
      }
      std::vector<size_t> sizes(8);
      for (size_t& n : sizes) n = 1 + rng() % 6;
      const Parsed a = whole(f, text), b = streamed(f, text, sizes);
      ASSERT_EQ(a.content, b.content) << tool_format_name(f) << ": " << text;
      ASSERT_EQ(a.calls.size(), b.calls.size()) << tool_format_name(f) << ": " << text;
      for (size_t k = 0; k < a.calls.size(); ++k) {
        ASSERT_EQ(a.calls[k].name, b.calls[k].name) << text;
        ASSERT_EQ(a.calls[k].arguments, b.calls[k].arguments) << text;
      }
      calls += a.calls.size();
    }
    EXPECT_GT(calls, 1500u) << tool_format_name(f) << ": too few replies held calls to test much";
  }
}

// ---- tools read from a request ----

RequestDefaults defaults() { return {}; }

CompletionRequest chat(const std::string& body) {
  return parse_completion_request(Endpoint::Chat, body, defaults(), 1);
}

const std::string kWeather =
    R"({"type": "function", "function": {"name": "get_weather", "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}})";
const std::string kTime =
    R"({"type": "function", "function": {"name": "get_time",
        "parameters": {"properties": {"zone": {"enum": ["UTC", "CET"]}, "precise": {"type": "boolean"}}}}})";
const std::string kPing = R"({"type": "function", "function": {"name": "ping"}})";
const std::string kUser = R"("messages": [{"role": "user", "content": "Hi"}])";

std::string body(const std::string& fields) { return "{" + kUser + ", " + fields + "}"; }

// The one-line 400 a body gets, naming `param`; its message holds `words`.
void expect_refused(const std::string& b, const std::string& param, const std::string& words = "",
                    Endpoint e = Endpoint::Chat) {
  SCOPED_TRACE(b.substr(0, 300));
  try {
    parse_completion_request(e, b, defaults(), 1);
    ADD_FAILURE() << "not refused";
  } catch (const ApiError& err) {
    EXPECT_EQ(err.status(), 400);
    EXPECT_EQ(err.param(), param) << err.what();
    EXPECT_NE(std::string(err.what()).find(words), std::string::npos) << err.what();
    EXPECT_EQ(std::string(err.what()).find('\n'), std::string::npos) << err.what();
  }
}

TEST(ToolsRequest, Read) {
  const CompletionRequest r = chat(body(R"("tools": [)" + kWeather + ", " + kTime + "]"));
  ASSERT_NE(r.tools, nullptr);
  EXPECT_EQ(r.tools->choice.kind, ToolChoice::Auto);
  ASSERT_EQ(r.tools->defs.size(), 2u);
  EXPECT_EQ(r.tools->defs[1].name, "get_time");
  // As given, keys in their order (rendered so); the schema of parameters without a type is
  // an object's.
  EXPECT_EQ(r.tools->tools[0]["function"].begin().key(), "name");
  EXPECT_EQ(r.tools->tools[0]["function"]["parameters"]["properties"].begin().key(), "city");
  EXPECT_EQ(ojson::parse(r.tools->defs[1].parameters)["type"], "object");
  EXPECT_TRUE(r.tools->parallel);

  const CompletionRequest named = chat(body(R"("tools": [)" + kWeather + ", " + kPing +
                                            R"(], "tool_choice": {"type": "function", "function": {"name": "ping"}},
                                            "parallel_tool_calls": false)"));
  EXPECT_EQ(named.tools->choice.kind, ToolChoice::Named);
  EXPECT_EQ(named.tools->choice.name, "ping");
  EXPECT_FALSE(named.tools->parallel);
  EXPECT_EQ(chat(body(R"("tools": [)" + kPing + R"(], "tool_choice": "required")")).tools->choice.kind,
            ToolChoice::Required);
  // "none", or no tools: nothing to call, the prompt rendered without them.
  EXPECT_EQ(chat(body(R"("tools": [)" + kPing + R"(], "tool_choice": "none")")).tools, nullptr);
  EXPECT_EQ(chat(body(R"("tools": [], "tool_choice": "auto")")).tools, nullptr);
  EXPECT_EQ(chat(body(R"("tools": null)")).tools, nullptr);
}

TEST(ToolsRequest, MalformedToolsAreRefusedInOneLine) {
  expect_refused(body(R"("tools": {"type": "function"})"), "tools", "must be a list");
  expect_refused(body(R"("tools": ["f"])"), "tools[0]", "must be an object");
  expect_refused(body(R"("tools": [{"type": "function"}])"), "tools[0].function", "must be an object");
  expect_refused(body(R"("tools": [{"type": "retrieval", "function": {"name": "f"}}])"), "tools[0].type",
                 "only \"function\"");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"description": "x"}}])"),
                 "tools[0].function.name", "required");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": "a b"}}])"),
                 "tools[0].function.name", "letters, digits");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": ""}}])"), "tools[0].function.name");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": ")" + std::string(65, 'a') + R"("}}])"),
                 "tools[0].function.name");
  expect_refused(body(R"("tools": [)" + kPing + ", " + kPing + "]"), "tools[1].function.name", "defined twice");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}])"),
                 "tools[0].function.parameters", "JSON schema object");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])"),
                 "tools[0].function.parameters", "must describe an object");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": "f", "parameters":
                      {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}])"),
                 "tools[0].function.parameters", "unsupported keyword 'not'");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": "f", "parameters":
                      {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}])"),
                 "tools[0].function.parameters");
  expect_refused(body(R"("tools": [{"type": "function", "function": {"name": "f", "description": 3}}])"),
                 "tools[0].function.description");
  std::string many;
  for (int i = 0; i <= (int)kMaxTools; ++i)
    many += (i ? ", " : "") + std::string(R"({"type": "function", "function": {"name": "f)") + std::to_string(i) + "\"}}";
  expect_refused(body(R"("tools": [)" + many + "]"), "tools", "at most 128");

  expect_refused(body(R"("tools": [)" + kPing + R"(], "tool_choice": "sometimes")"), "tool_choice");
  expect_refused(body(R"("tools": [)" + kPing + R"(], "tool_choice": 1)"), "tool_choice");
  expect_refused(body(R"("tools": [)" + kPing + R"(], "tool_choice": {"type": "function"})"), "tool_choice");
  expect_refused(body(R"("tools": [)" + kPing + R"(], "tool_choice": {"type": "function", "function": {"name": "pong"}})"),
                 "tool_choice", "'pong'");
  expect_refused(body(R"("tool_choice": "required")"), "tool_choice", "defines none");
  expect_refused(body(R"("tools": [)" + kPing + R"(], "parallel_tool_calls": "yes")"), "parallel_tool_calls");
  expect_refused(body(R"("tools": [)" + kPing + R"(], "response_format": {"type": "json_object"})"), "response_format");
  expect_refused(body(R"("functions": [{"name": "f"}])"), "functions", "use 'tools'");
  expect_refused(body(R"("function_call": "auto")"), "function_call");
  expect_refused(R"({"prompt": "a", "tools": [)" + kPing + "]}", "tools", "chat completions", Endpoint::Completion);
}

// Random JSON in every place of tools and tool_choice: each body is read or refused with
// ApiError 400, never anything else.
TEST(ToolsRequest, RandomToolsNeverCrash) {
  std::mt19937 rng(45);
  const std::vector<std::string> names = {"type", "function", "name", "parameters", "properties", "required",
                                          "items", "enum", "anyOf", "$ref", "description", "arguments"};
  std::function<ojson(int)> value = [&](int depth) -> ojson {
    switch (rng() % (depth > 4 ? 5 : 8)) {
      case 0: return nullptr;
      case 1: return (int)(rng() % 5) - 1;
      case 2: return names[rng() % names.size()];
      case 3: return rng() % 2 == 0;
      case 4: return "object";
      case 5: case 6: {
        ojson o = ojson::object();
        for (int i = rng() % 4; i > 0; --i) o[names[rng() % names.size()]] = value(depth + 1);
        return o;
      }
      default: {
        ojson a = ojson::array();
        for (int i = rng() % 4; i > 0; --i) a.push_back(value(depth + 1));
        return a;
      }
    }
  };
  int read = 0;
  for (int i = 0; i < 3000; ++i) {
    ojson b = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
    ojson tools = ojson::array();
    for (int t = rng() % 3; t >= 0; --t) {
      ojson fn = {{"name", rng() % 4 ? ojson("f" + std::to_string(t)) : value(0)}};
      if (rng() % 2) fn["parameters"] = rng() % 3 ? ojson{{"type", "object"}, {"properties", value(1)}} : value(0);
      tools.push_back(rng() % 6 ? ojson{{"type", "function"}, {"function", fn}} : value(0));
    }
    b["tools"] = rng() % 8 ? tools : value(0);
    if (rng() % 2) b["tool_choice"] = rng() % 2 ? ojson("required") : value(0);
    try {
      parse_completion_request(Endpoint::Chat, b.dump(), defaults(), 1);
      ++read;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400) << b.dump();
    }
  }
  EXPECT_GT(read, 100);
}

TEST(ToolsRequest, MessagesWithCallsAndResults) {
  const CompletionRequest r = chat(R"({"messages": [
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"a\": 1}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"t\": 21}"},
      {"role": "assistant", "content": "21", "tool_calls": []}]})");
  ASSERT_EQ(r.messages.size(), 4u);
  const ChatMessage& call = r.messages[1];
  EXPECT_EQ(call.content, "");
  ASSERT_TRUE(call.tool_calls.is_array());
  // The arguments' JSON text read into an object, keys in their order, as templates take them.
  EXPECT_EQ(call.tool_calls[0]["function"]["arguments"].dump(), R"({"city":"Paris","a":1})");
  EXPECT_EQ(call.tool_calls[0]["id"], "call_1");
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "call_1");
  EXPECT_TRUE(r.messages[3].tool_calls.is_null());  // [] is no call
  // Arguments that are not a JSON object stay the text they are.
  const CompletionRequest odd = chat(R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
      "function": {"name": "f", "arguments": "not json"}}]}]})");
  EXPECT_EQ(odd.messages[0].tool_calls[0]["function"]["arguments"], "not json");

  const auto refused = [](const std::string& messages, const std::string& param) {
    expect_refused(R"({"messages": )" + messages + "}", param);
  };
  refused(R"([{"role": "tool", "content": "x"}])", "messages[0].tool_call_id");
  refused(R"([{"role": "assistant"}])", "messages[0].content");
  refused(R"([{"role": "assistant", "tool_calls": {"id": "x"}}])", "messages[0].tool_calls");
  refused(R"([{"role": "assistant", "tool_calls": ["x"]}])", "messages[0].tool_calls[0]");
  refused(R"([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])",
          "messages[0].tool_calls[0].function");
  refused(R"([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}])",
          "messages[0].tool_calls[0].type");
  refused(R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}])",
          "messages[0].tool_calls[0].function.arguments");
  refused(R"([{"role": "function", "content": "x"}])", "messages[0].role");
}

// ---- the grammar of required and named calls ----

// A random text the grammar accepts: printable ASCII and newlines, a byte at a time, ending
// where the match is complete (at once where nothing may follow). Empty where it ran past
// `limit` bytes.
std::string random_walk(const std::shared_ptr<const grammar::Grammar>& g, std::mt19937& rng, size_t limit) {
  grammar::GrammarState st(g);
  std::string out;
  while (out.size() < limit) {
    if (st.is_finished() || (st.is_accepting() && rng() % 4 == 0)) return out;
    std::vector<uint8_t> ok;
    for (int b = 0x20; b < 0x7f; ++b) {
      grammar::GrammarState t = st;
      if (t.accept_byte((uint8_t)b)) ok.push_back((uint8_t)b);
    }
    grammar::GrammarState t = st;
    if (t.accept_byte('\n')) ok.push_back('\n');
    if (ok.empty()) return st.is_accepting() ? out : "";
    // Closing quotes and brackets more often than their share, so that strings end.
    std::vector<uint8_t> close;
    for (uint8_t b : ok)
      if (b == '"' || b == '}' || b == ']') close.push_back(b);
    const uint8_t b = !close.empty() && rng() % 3 == 0 ? close[rng() % close.size()] : ok[rng() % ok.size()];
    st.accept_byte(b);
    out += (char)b;
  }
  return "";
}

TEST(ToolCallGrammar, EveryWalkParsesIntoValidCalls) {
  const std::vector<std::string> tools = {kWeather, kTime, kPing};
  const std::map<std::string, std::string> schemas = {
      {"get_weather", ojson::parse(kWeather)["function"]["parameters"].dump()},
      {"get_time", R"({"properties": {"zone": {"enum": ["UTC", "CET"]}, "precise": {"type": "boolean"}}, "type": "object"})"},
      {"ping", R"({"type": "object", "properties": {}})"}};
  const std::string cases_path = fs::temp_directory_path() / ("kestrel_tool_calls_" + std::to_string(getpid()) + ".jsonl");
  std::ofstream cases(cases_path);
  std::vector<std::string> produced;
  std::mt19937 rng(2024);
  for (ToolFormat f : {ToolFormat::hermes, ToolFormat::llama3, ToolFormat::mistral}) {
    for (const std::string choice : {R"("required")", R"("required", "parallel_tool_calls": false)",
                                     R"({"type": "function", "function": {"name": "get_weather"}})"}) {
      SCOPED_TRACE(std::string(tool_format_name(f)) + " " + choice);
      const CompletionRequest r = chat(body(R"("tools": [)" + tools[0] + ", " + tools[1] + ", " + tools[2] +
                                            R"(], "tool_choice": )" + choice));
      const std::string gbnf = tool_call_gbnf(f, *r.tools);
      std::shared_ptr<const grammar::Grammar> g;
      ASSERT_NO_THROW(g = grammar::Grammar::parse(gbnf)) << gbnf;
      int walks = 0, multi = 0;
      for (int i = 0; i < 60; ++i) {
        const std::string text = random_walk(g, rng, 3000);
        if (text.empty()) continue;
        ++walks;
        const Parsed p = whole(f, text);
        EXPECT_EQ(p.content, "") << text;
        ASSERT_FALSE(p.calls.empty()) << text;
        if (r.tools->choice.kind == ToolChoice::Named) {
          EXPECT_EQ(p.calls.size(), 1u);
          EXPECT_EQ(p.calls[0].name, "get_weather");
        }
        if (!r.tools->parallel || f == ToolFormat::llama3) {
          EXPECT_EQ(p.calls.size(), 1u) << text;
        }
        multi += p.calls.size() > 1;
        for (const ToolCall& c : p.calls) {
          ASSERT_TRUE(schemas.count(c.name)) << c.name;
          const ojson args = ojson::parse(c.arguments, nullptr, false);
          ASSERT_TRUE(args.is_object()) << c.arguments;
          cases << json{{"schema", json::parse(schemas.at(c.name))}, {"instance", c.arguments}}.dump() << "\n";
          produced.push_back(c.name + ": " + c.arguments);
        }
      }
      EXPECT_GE(walks, 40);
      if (r.tools->choice.kind == ToolChoice::Required && r.tools->parallel && f != ToolFormat::llama3) {
        EXPECT_GT(multi, 0) << "no walk made parallel calls";
      }
    }
  }
  cases.close();
  const std::string cmd = "python3 " KESTREL_SOURCE_DIR "/tests/support/validate_json_schema.py < " + cases_path;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[1024];
  size_t i = 0;
  while (fgets(line, sizeof line, p)) {
    ASSERT_LT(i, produced.size());
    EXPECT_EQ(std::string(line), "ok\n") << produced[i];
    ++i;
  }
  ASSERT_EQ(pclose(p), 0) << "the validator needs python3-jsonschema (scripts/install-deps.sh)";
  EXPECT_EQ(i, produced.size());
  fs::remove(cases_path);
}

// The constrained call reads as the family's template writes calls into the history.
TEST(ToolCallGrammar, SpelledAsTheTemplatesWriteCalls) {
  const CompletionRequest r = chat(body(R"("tools": [)" + kWeather + R"(], "tool_choice": "required")"));
  const auto accepts = [&](ToolFormat f, const std::string& text) {
    grammar::GrammarState st(grammar::Grammar::parse(tool_call_gbnf(f, *r.tools)));
    return st.accept_bytes(text) && st.is_accepting();
  };
  EXPECT_TRUE(accepts(ToolFormat::hermes,
                      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
  EXPECT_TRUE(accepts(ToolFormat::llama3, R"({"name": "get_weather", "parameters": {"city": "Paris"}})"));
  EXPECT_TRUE(accepts(ToolFormat::mistral, R"([{"name": "get_weather", "arguments": {"city": "Paris"}}])"));
  EXPECT_FALSE(accepts(ToolFormat::hermes, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"));
  EXPECT_FALSE(accepts(ToolFormat::hermes, "Sure. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"P\"}}\n</tool_call>"));
  EXPECT_FALSE(accepts(ToolFormat::mistral, R"([{"name": "get_weather", "arguments": {"unit": "celsius"}}])"));
}

// ---- prompts and responses ----

class ToolsPrepare : public ::testing::Test {
 protected:
  void SetUp() override { tok_ = Tokenizer::load(std::string(KESTREL_TOKENIZER_FIXTURES) + "/byte_level"); }

  // The model's template `file` as `kestrel serve` loads it from a model directory, with the
  // special tokens' text of `config` (bos_token, eos_token).
  ChatTemplate load(const std::string& source, ojson config = ojson::object()) {
    const fs::path dir = fs::temp_directory_path() / ("kestrel_test_tools_" + std::to_string(getpid()));
    fs::create_directories(dir);
    config["chat_template"] = source;
    std::ofstream(dir / "tokenizer_config.json") << config.dump();
    ChatTemplate t = ChatTemplate::load(dir.string(), "auto", *tok_);
    fs::remove_all(dir);
    return t;
  }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(ToolsPrepare, TemplatesWithoutToolSyntaxAreRefused) {
  const CompletionRequest r = chat(body(R"("tools": [)" + kPing + "]"));
  for (const ChatTemplate& t : {ChatTemplate(ChatFormat::chatml, *tok_), load(read_file(kTemplates / "llama3.jinja"))}) {
    try {
      prepare_request(r, *tok_, &t, 4096, tok_->vocab_size());
      ADD_FAILURE() << "not refused";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400);
      EXPECT_EQ(e.param(), "tools");
      EXPECT_NE(std::string(e.what()).find("no tool-call syntax"), std::string::npos) << e.what();
    }
  }
  // Without tools (or with tool_choice "none") such a template serves as before.
  const ChatTemplate chatml(ChatFormat::chatml, *tok_);
  EXPECT_NO_THROW(prepare_request(chat(body(R"("tools": [)" + kPing + R"(], "tool_choice": "none")")), *tok_,
                                  &chatml, 4096, tok_->vocab_size()));
  // A built-in format cannot write a tool's turn.
  const CompletionRequest tool_turn = chat(R"({"messages": [{"role": "user", "content": "a"},
      {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "1", "content": "b"}]})");
  try {
    prepare_request(tool_turn, *tok_, &chatml, 4096, tok_->vocab_size());
    ADD_FAILURE() << "not refused";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.param(), "messages");
  }
}

TEST_F(ToolsPrepare, ToolsReachTheTemplateAndRequiredCallsAreConstrained) {
  const ChatTemplate qwen = load(read_file(kTemplates / "qwen3.jinja"), {{"eos_token", "<|im_end|>"}});
  const std::string tools = R"("tools": [)" + kWeather + "]";
  const PreparedRequest a = prepare_request(chat(body(tools)), *tok_, &qwen, 8192, tok_->vocab_size());
  EXPECT_TRUE(a.tool_format == ToolFormat::hermes);
  EXPECT_EQ(a.options.grammar, nullptr);  // auto: the model chooses
  const std::string prompt = tok_->decode(a.prompt_ids);
  EXPECT_NE(prompt.find("<tools>"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find(R"("name": "get_weather")"), std::string::npos) << prompt;
  const PreparedRequest none = prepare_request(chat(body(tools + R"(, "tool_choice": "none")")), *tok_, &qwen, 8192,
                                               tok_->vocab_size());
  EXPECT_FALSE(none.tool_format.has_value());
  EXPECT_EQ(tok_->decode(none.prompt_ids).find("<tools>"), std::string::npos);
  const PreparedRequest req = prepare_request(chat(body(tools + R"(, "tool_choice": "required")")), *tok_, &qwen,
                                              8192, tok_->vocab_size());
  ASSERT_NE(req.options.grammar, nullptr);
  grammar::GrammarState st(req.options.grammar);
  EXPECT_TRUE(st.accept_bytes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"));
  EXPECT_TRUE(st.is_accepting());
}

TEST_F(ToolsPrepare, ResponsesCarryTheCalls) {
  const CompletionRequest r = chat(body(R"("tools": [)" + kWeather + "]"));
  GenerateResult g;
  g.text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  g.finish_reason = "eos";
  g.ids = {1, 2, 3};
  ToolCallParser p(ToolFormat::hermes, [](int i) { return make_tool_call_id(ToolFormat::hermes, "chatcmpl-x", i); });
  p.push(g.text);
  p.finish();
  const json j = completion_response(r, {"chatcmpl-x", 1, "m"}, g, *tok_, &p);
  const json& choice = j["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u);
  const json& c = choice["message"]["tool_calls"][0];
  EXPECT_EQ(c["id"], make_tool_call_id(ToolFormat::hermes, "chatcmpl-x", 0));
  EXPECT_EQ(c["type"], "function");
  EXPECT_EQ(c["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(c["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  // Cut by max_tokens: "length", as OpenAI says it.
  g.finish_reason = "length";
  EXPECT_EQ(completion_response(r, {"chatcmpl-x", 1, "m"}, g, *tok_, &p)["choices"][0]["finish_reason"], "length");
  // A reply with no call is text.
  ToolCallParser q(ToolFormat::hermes, [](int) { return "x"; });
  q.push("Hello");
  q.finish();
  g.finish_reason = "eos";
  const json t = completion_response(r, {"chatcmpl-x", 1, "m"}, g, *tok_, &q)["choices"][0];
  EXPECT_EQ(t["finish_reason"], "stop");
  EXPECT_EQ(t["message"]["content"], "Hello");
  EXPECT_FALSE(t["message"].contains("tool_calls"));
  // Stream chunks: a call opened with its id, type and name, then its arguments.
  const json first = tool_call_chunk(r, {"chatcmpl-x", 1, "m"}, {0, true, "call_1", "get_weather", ""});
  EXPECT_EQ(first["choices"][0]["delta"]["tool_calls"][0],
            json({{"index", 0}, {"id", "call_1"}, {"type", "function"},
                  {"function", {{"name", "get_weather"}, {"arguments", ""}}}}));
  const json more = tool_call_chunk(r, {"chatcmpl-x", 1, "m"}, {0, false, "", "", "{\"ci"});
  EXPECT_EQ(more["choices"][0]["delta"]["tool_calls"][0], json({{"index", 0}, {"function", {{"arguments", "{\"ci"}}}}));
  EXPECT_EQ(finish_chunk(r, {"chatcmpl-x", 1, "m"}, g, *tok_, true)["choices"][0]["finish_reason"], "tool_calls");
}

// An OpenAI request (arguments as JSON text, content null beside tool_calls, tool results with
// their tool_call_id) read by the server and rendered by the model's template gives the prompt
// @huggingface/jinja renders for the conversation transformers' users pass (goldens.json's
// cases with a "request", scripts/make-jinja-goldens.mjs).
TEST_F(ToolsPrepare, RequestsRenderAsHuggingFaceJinja) {
  const ojson goldens = ojson::parse(read_file(kTemplates / "goldens.json"));
  int n = 0;
  std::set<std::string> templates;
  for (const ojson& c : goldens.at("cases")) {
    if (!c.contains("request")) continue;
    SCOPED_TRACE(c.at("template").get<std::string>() + " / " + c.at("name").get<std::string>());
    ++n;
    templates.insert(c.at("template").get<std::string>());
    ojson config = ojson::object();
    for (const char* k : {"bos_token", "eos_token"})
      if (c.at("context").contains(k)) config[k] = c.at("context")[k];
    std::string source = read_file(kTemplates / c.at("template").get<std::string>());
    const ChatTemplate t = load(source, config);
    const CompletionRequest r = chat(c.at("request").dump());
    ASSERT_TRUE(c.contains("expected"));
    std::string expected = c.at("expected").get<std::string>();
    // Mistral Small 3.1 writes today's date (strftime_now, which has no variable to set it by):
    // the goldens' fixed day is today's here, as the server renders it.
    if (source.find(R"(strftime_now("%Y-%m-%d"))") != std::string::npos) {
      const ojson& d = goldens.at("strftime_now");
      const std::string fixed = fmt::format("{:04}-{:02}-{:02}", d.at("year").get<int>(), d.at("month").get<int>(),
                                            d.at("day").get<int>());
      char today[16];
      const std::time_t now = std::time(nullptr);
      std::strftime(today, sizeof today, "%Y-%m-%d", std::localtime(&now));
      for (size_t at = expected.find(fixed); at != std::string::npos; at = expected.find(fixed, at + 1))
        expected.replace(at, fixed.size(), today);
    }
    EXPECT_EQ(t.render(r.messages, true, r.chat_template_kwargs, r.tools ? r.tools->tools : jinja::Json()), expected);
  }
  EXPECT_GE(n, 14);
  for (const char* t : {"qwen2.5.jinja", "qwen3.jinja", "llama3.1.jinja", "llama3.2.jinja", "mistral-v0.3.jinja",
                        "mistral-nemo.jinja"})
    EXPECT_TRUE(templates.count(t)) << t;
}

}  // namespace
