#include "engine/server/response.h"

#include <cstdio>

namespace kestrel::server {

using nlohmann::json;

const char* const kSseDone = "data: [DONE]\n\n";

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) { return "data: " + dump(j) + "\n\n"; }

std::string finish_reason(const GenerateResult& r) {
  if (r.finish_reason == "eos" || r.finish_reason == "stop") return "stop";
  return r.finish_reason;  // "length", "cancelled"
}

std::string finish_reason(const GenerateResult& r, bool has_tool_calls) {
  const std::string f = finish_reason(r);
  return has_tool_calls && f == "stop" ? "tool_calls" : f;
}

json usage_json(const GenerateResult& r) {
  const int prompt = (int)r.prompt_ids.size(), completion = (int)r.ids.size();
  json u = {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion},
            {"prompt_tokens_details", {{"cached_tokens", r.n_cached}}}};
  // Speculative decoding (kestrel serve --spec): the drafted ids the model kept and those it
  // did not, in the fields OpenAI gives its predicted outputs.
  if (r.speculative)
    u["completion_tokens_details"] = {{"accepted_prediction_tokens", r.n_accepted},
                                      {"rejected_prediction_tokens", r.n_drafted - r.n_accepted}};
  return u;
}

std::string token_text(const Tokenizer& tok, int id) {
  // Decoded mid-text, so that SentencePiece's word-start marker is the space it stands for.
  StreamDecoder d(tok, /*at_text_start=*/false);
  std::string s = d.push(id);
  return s + d.flush();
}

std::string token_piece(const Tokenizer& tok, int id) {
  return tok.is_control(id) ? tok.piece(id) : token_text(tok, id);
}

std::vector<int> token_bytes(const Tokenizer& tok, int id) {
  if (tok.is_byte(id)) {  // "<0xNN>": one byte that may be part of a character
    unsigned v = 0;
    if (std::sscanf(tok.piece(id).c_str(), "<0x%2X>", &v) == 1) return {(int)v};
  }
  std::vector<int> out;
  for (unsigned char c : token_text(tok, id)) out.push_back(c);
  return out;
}

json chat_logprobs_json(const Tokenizer& tok, const std::vector<Logprobs>& lps, int top) {
  json content = json::array();
  for (const Logprobs& lp : lps) {
    json tops = json::array();
    for (int i = 0; i < top && i < (int)lp.top.size(); ++i)
      tops.push_back({{"token", token_text(tok, lp.top[i].id)},
                      {"logprob", lp.top[i].logprob},
                      {"bytes", token_bytes(tok, lp.top[i].id)}});
    content.push_back({{"token", token_text(tok, lp.chosen.id)},
                       {"logprob", lp.chosen.logprob},
                       {"bytes", token_bytes(tok, lp.chosen.id)},
                       {"top_logprobs", tops}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json completion_logprobs_json(const Tokenizer& tok, const std::vector<Logprobs>& lps, int top) {
  json tokens = json::array(), logprobs = json::array(), tops = json::array(),
       offsets = json::array();
  size_t offset = 0;
  for (const Logprobs& lp : lps) {
    const std::string text = token_text(tok, lp.chosen.id);
    tokens.push_back(text);
    logprobs.push_back(lp.chosen.logprob);
    json t = json::object();
    for (int i = 0; i < top && i < (int)lp.top.size(); ++i)
      t[token_text(tok, lp.top[i].id)] = lp.top[i].logprob;
    tops.push_back(t);
    offsets.push_back(offset);
    offset += text.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", logprobs}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

namespace {

bool chat(const CompletionRequest& req) { return req.endpoint == Endpoint::Chat; }

json head(const CompletionRequest& req, const ResponseMeta& meta, bool chunk) {
  const char* object = chat(req) ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                 : "text_completion";
  json j = {{"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
  j["system_fingerprint"] = nullptr;
  return j;
}

json logprobs_of(const CompletionRequest& req, const GenerateResult& r, const Tokenizer& tok) {
  if (!req.logprobs) return nullptr;
  return chat(req) ? chat_logprobs_json(tok, r.logprobs, req.top_logprobs)
                   : completion_logprobs_json(tok, r.logprobs, req.top_logprobs);
}

// A chunk of a stream with one choice.
json chunk(const CompletionRequest& req, const ResponseMeta& meta, json choice) {
  json j = head(req, meta, true);
  choice["index"] = 0;
  if (!choice.contains("logprobs")) choice["logprobs"] = nullptr;
  if (!choice.contains("finish_reason")) choice["finish_reason"] = nullptr;
  j["choices"] = json::array({choice});
  if (req.include_usage) j["usage"] = nullptr;
  return j;
}

}  // namespace

json completion_response(const CompletionRequest& req, const ResponseMeta& meta,
                         const GenerateResult& r, const Tokenizer& tok, const ToolCallParser* calls) {
  json j = head(req, meta, false);
  const bool has_calls = calls && !calls->calls().empty();
  json choice = {{"index", 0}, {"logprobs", logprobs_of(req, r, tok)},
                 {"finish_reason", finish_reason(r, has_calls)}};
  if (chat(req) && calls) {
    const std::string& text = calls->content();
    const bool blank = text.find_first_not_of(" \t\r\n") == std::string::npos;
    choice["message"] = {{"role", "assistant"},
                         {"content", has_calls && blank ? json(nullptr) : json(text)},
                         {"refusal", nullptr}};
    if (has_calls) {
      json list = json::array();
      for (const ToolCall& c : calls->calls())
        list.push_back({{"id", c.id}, {"type", "function"},
                        {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
      choice["message"]["tool_calls"] = list;
    }
  } else if (chat(req))
    choice["message"] = {{"role", "assistant"}, {"content", r.text}, {"refusal", nullptr}};
  else
    choice["text"] = r.text;
  j["choices"] = json::array({choice});
  j["usage"] = usage_json(r);
  return j;
}

json role_chunk(const CompletionRequest& req, const ResponseMeta& meta) {
  return chunk(req, meta, {{"delta", {{"role", "assistant"}, {"content", ""}}}});
}

json text_chunk(const CompletionRequest& req, const ResponseMeta& meta, std::string_view text) {
  if (chat(req)) return chunk(req, meta, {{"delta", {{"content", text}}}});
  return chunk(req, meta, {{"text", text}});
}

json tool_call_chunk(const CompletionRequest& req, const ResponseMeta& meta, const ToolCallDelta& d) {
  json call = {{"index", d.index}};
  if (d.first) {
    call["id"] = d.id;
    call["type"] = "function";
    call["function"] = {{"name", d.name}, {"arguments", ""}};
  } else {
    call["function"] = {{"arguments", d.arguments}};
  }
  return chunk(req, meta, {{"delta", {{"tool_calls", json::array({call})}}}});
}

json finish_chunk(const CompletionRequest& req, const ResponseMeta& meta, const GenerateResult& r,
                  const Tokenizer& tok, bool has_tool_calls) {
  json choice = {{"logprobs", logprobs_of(req, r, tok)}, {"finish_reason", finish_reason(r, has_tool_calls)}};
  if (chat(req)) choice["delta"] = json::object();
  else choice["text"] = "";
  return chunk(req, meta, choice);
}

json usage_chunk(const CompletionRequest& req, const ResponseMeta& meta, const GenerateResult& r) {
  json j = head(req, meta, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(r);
  return j;
}

}  // namespace kestrel::server
