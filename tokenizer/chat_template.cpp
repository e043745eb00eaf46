#include "tokenizer/chat_template.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/special_tokens.h"

namespace kestrel {

namespace fs = std::filesystem;

namespace {

constexpr std::pair<ChatFormat, std::string_view> kNames[] = {
    {ChatFormat::llama2, "llama2"}, {ChatFormat::mistral, "mistral"},
    {ChatFormat::zephyr, "zephyr"}, {ChatFormat::chatml, "chatml"},
    {ChatFormat::vicuna, "vicuna"}, {ChatFormat::raw, "raw"},
};

std::string known_names() {
  std::string s;
  for (const auto& [f, n] : kNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

std::string strip(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return std::string(s);
}

// Appends text, merging with a preceding text segment.
void text(std::vector<ChatSegment>& out, std::string_view t) {
  if (t.empty()) return;
  if (!out.empty() && !out.back().special) {
    out.back().text += t;
  } else {
    out.push_back({std::string(t), false});
  }
}
void special(std::vector<ChatSegment>& out, std::string_view t) {
  out.push_back({std::string(t), true});
}

}  // namespace

std::string_view chat_format_name(ChatFormat f) {
  for (const auto& [g, n] : kNames)
    if (g == f) return n;
  return "?";
}

ChatFormat parse_chat_format(std::string_view name) {
  for (const auto& [f, n] : kNames)
    if (n == name) return f;
  throw Error(fmt::format("unknown chat template \"{}\" (known: {}, or auto)", name, known_names()));
}

std::optional<ChatFormat> detect_chat_format(std::string_view t) {
  const auto has = [&](std::string_view s) { return t.find(s) != std::string_view::npos; };
  if (has("<|im_start|>")) {
    if (has("<|im_sep|>")) return std::nullopt;  // Phi-4
    return ChatFormat::chatml;
  }
  if (has("[INST]")) {
    // Mistral's later formats: a system-prompt token, tool calls, " [INST] " spacing.
    if (has("[SYSTEM_PROMPT]") || has("[AVAILABLE_TOOLS]") || has("' [INST] '"))
      return std::nullopt;
    return has("<<SYS>>") ? ChatFormat::llama2 : ChatFormat::mistral;
  }
  if (has("<|user|>") && has("<|assistant|>")) {
    if (has("<|end|>") || has("<|endoftext|>")) return std::nullopt;  // Phi-3, GLM
    return ChatFormat::zephyr;
  }
  if (has("USER: ") && has("ASSISTANT: ")) {
    if (has("SYSTEM: ")) return std::nullopt;  // Vicuna-Orca
    return ChatFormat::vicuna;
  }
  return std::nullopt;
}

std::vector<ChatSegment> render_chat(ChatFormat f, const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt) {
  std::optional<std::string> system;
  size_t first = 0;
  if (!messages.empty() && messages[0].role == "system") {
    system = messages[0].content;
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const char* want = (i - first) % 2 == 0 ? "user" : "assistant";
    if (messages[i].role != want)
      throw Error(fmt::format("chat message {} has role \"{}\"; after an optional system message "
                              "the roles must alternate user, assistant, user, ...",
                              i + 1, messages[i].role));
  }

  std::vector<ChatSegment> out;
  switch (f) {
    case ChatFormat::llama2:
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user") {
          std::string content = m.content;
          if (i == first && system) content = "<<SYS>>\n" + *system + "\n<</SYS>>\n\n" + content;
          special(out, "<s>");
          text(out, "[INST] " + strip(content) + " [/INST]");
        } else {
          text(out, " " + strip(m.content) + " ");
          special(out, "</s>");
        }
      }
      break;
    case ChatFormat::mistral:
      special(out, "<s>");
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user") {
          const std::string sys = (i == first && system) ? *system + "\n\n" : "";
          text(out, "[INST] " + sys + m.content + " [/INST]");
        } else {
          text(out, m.content);
          special(out, "</s>");
        }
      }
      break;
    case ChatFormat::zephyr:
      for (const ChatMessage& m : messages) {
        text(out, fmt::format("<|{}|>\n{}", m.role, m.content));
        special(out, "</s>");
        text(out, "\n");
      }
      if (add_generation_prompt) text(out, "<|assistant|>\n");
      break;
    case ChatFormat::chatml:
      for (const ChatMessage& m : messages) {
        special(out, "<|im_start|>");
        text(out, m.role + "\n" + m.content);
        special(out, "<|im_end|>");
        text(out, "\n");
      }
      if (add_generation_prompt) {
        special(out, "<|im_start|>");
        text(out, "assistant\n");
      }
      break;
    case ChatFormat::vicuna:
      if (system) text(out, *system + " ");
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user") {
          text(out, "USER: " + m.content + " ");
        } else {
          text(out, "ASSISTANT: " + m.content);
          special(out, "</s>");
        }
      }
      if (add_generation_prompt) text(out, "ASSISTANT:");
      break;
    case ChatFormat::raw:
      for (const ChatMessage& m : messages) text(out, m.content + "\n");
      break;
  }
  return out;
}

bool is_template_file(const std::string& name) {
  return name.find('/') != std::string::npos || name.ends_with(".jinja");
}

std::string segments_text(const std::vector<ChatSegment>& segments) {
  std::string s;
  for (const ChatSegment& g : segments) s += g.text;
  return s;
}

ChatTemplate::ChatTemplate(ChatFormat f, const Tokenizer& tok, std::map<std::string, int> added)
    : format_(f), tok_(&tok), added_(std::move(added)) {}

ChatTemplate ChatTemplate::load(const std::string& dir, const std::string& name,
                                const Tokenizer& tok, std::string* note) {
  const fs::path path = fs::path(dir) / "tokenizer_config.json";
  nlohmann::json cfg = nlohmann::json::object();
  if (auto j = read_json_file(path)) cfg = std::move(*j);
  // Added tokens (ChatML's <|im_start|> and the like live here, outside tokenizer.model).
  std::map<std::string, int> added;
  if (cfg.is_object() && cfg.contains("added_tokens_decoder") &&
      cfg["added_tokens_decoder"].is_object()) {
    for (const auto& [id, t] : cfg["added_tokens_decoder"].items()) {
      if (!t.is_object() || !t.contains("content") || !t["content"].is_string()) continue;
      int value = -1;
      const auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), value);
      if (ec != std::errc() || end != id.data() + id.size() || value < 0)
        throw Error(fmt::format("{}: added_tokens_decoder key \"{}\" is not a token id",
                                path.string(), id));
      added[t["content"].get<std::string>()] = value;
    }
  }
  // bos_token / eos_token: a string or an AddedToken object ({"content": ...}).
  auto token_text = [&](const char* key) -> std::string {
    if (!cfg.is_object() || !cfg.contains(key)) return "";
    const auto& t = cfg[key];
    if (t.is_string()) return t.get<std::string>();
    if (t.is_object() && t.contains("content") && t["content"].is_string())
      return t["content"].get<std::string>();
    return "";
  };
  auto from_jinja = [&](const std::string& source, const std::string& where) {
    ChatTemplate t(ChatFormat::raw, tok, added);
    try {
      t.jinja_ = std::make_shared<const jinja::Template>(jinja::Template::parse(source));
    } catch (const Error& e) {
      // Where the template is one of the built-in formats, say which; the user chooses.
      const auto f = detect_chat_format(source);
      throw Error(fmt::format(
          "{}: chat_template: {}; {}", where, e.what(),
          f ? fmt::format("it looks like the {0} format: pass --template {0}", chat_format_name(*f))
            : fmt::format("pass --template with a built-in format ({}) or a .jinja file",
                          known_names())));
    }
    t.jinja_source_ = source;
    t.bos_text_ = token_text("bos_token");
    t.eos_text_ = token_text("eos_token");
    return t;
  };
  if (name != "auto") {
    // A .jinja file, or a built-in format.
    if (is_template_file(name)) {
      KESTREL_CHECK(path_exists(name), fmt::format("--template {}: no such template file", name));
      return from_jinja(read_regular_file(name), name);
    }
    return ChatTemplate(parse_chat_format(name), tok, std::move(added));
  }

  // chat_template: a Jinja string, or a list of {name, template} where "default" is the chat one.
  std::string source;
  if (cfg.is_object() && cfg.contains("chat_template")) {
    const auto& t = cfg["chat_template"];
    if (t.is_string()) {
      source = t.get<std::string>();
    } else if (t.is_array()) {
      for (const auto& e : t)
        if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
            e["template"].is_string())
          source = e["template"].get<std::string>();
    }
  }
  if (source.empty()) {
    if (note)
      *note = fmt::format("{} has no chat_template: using --template raw (plain text turns, "
                          "for a base model); pass --template to choose a format",
                          path.string());
    return ChatTemplate(ChatFormat::raw, tok, std::move(added));
  }
  return from_jinja(source, path.string());
}

void check_template_kwargs(const jinja::Json& kwargs) {
  if (!kwargs.is_object()) {
    const std::string shown = kwargs.dump(-1, ' ', false, jinja::Json::error_handler_t::replace);
    throw Error(fmt::format("must be a JSON object of the template's variables, such as "
                            "{{\"enable_thinking\": false}}, got {}",
                            shown.size() > 40 ? shown.substr(0, 37) + "..." : shown));
  }
  for (const char* key : {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
    if (kwargs.contains(key))
      throw Error(fmt::format("'{}' cannot be set: Kestrel sets it", key));
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, const jinja::Json& kwargs,
                                 const jinja::Json& tools) const {
  if (!kwargs.is_null()) check_template_kwargs(kwargs);
  if (!jinja_) {
    // The built-in formats have no tool syntax: a tool's turn or call cannot be written.
    KESTREL_CHECK(tools.is_null() || tools.empty(), "the " + describe() + " has no tool-call syntax");
    for (const ChatMessage& m : messages)
      KESTREL_CHECK(m.role != "tool" && m.tool_calls.is_null(),
                    "the " + describe() + " cannot write tool calls or tool results");
    return segments_text(render_chat(format_, messages, add_generation_prompt));
  }
  jinja::Json msgs = jinja::Json::array();
  for (const ChatMessage& m : messages) {
    jinja::Json j = {{"role", m.role}, {"content", m.content}};
    // Only the keys a message has: templates ask `'tool_calls' in message` or `is defined`.
    if (!m.tool_calls.is_null()) j["tool_calls"] = m.tool_calls;
    if (!m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
    if (!m.name.empty()) j["name"] = m.name;
    msgs.push_back(std::move(j));
  }
  // What transformers passes: the messages, the generation prompt flag, the special tokens'
  // text; tools (none: their parts stay inert), thinking left to the template's default.
  // chat_template_kwargs follow, as transformers passes its **kwargs.
  jinja::Json context = {{"messages", msgs},
                         {"add_generation_prompt", add_generation_prompt},
                         {"bos_token", bos_text_},
                         {"eos_token", eos_text_},
                         {"tools", tools.is_array() && !tools.empty() ? tools : jinja::Json()}};
  if (kwargs.is_object())
    for (const auto& [key, value] : kwargs.items()) context[key] = value;
  try {
    return jinja_->render(context);
  } catch (const jinja::TemplateException& e) {
    throw Error("the model's chat template refuses this conversation: " + e.message());
  }
}

std::vector<ChatSegment> ChatTemplate::split_specials(const std::string& text) const {
  // The strings to find: every added token and the tokenizer's BOS/EOS text.
  std::vector<std::string> specials;
  for (const auto& [t, id] : added_)
    if (!t.empty()) specials.push_back(t);
  for (const std::string& t : {bos_text_, eos_text_})
    if (!t.empty() && special_id(t) >= 0) specials.push_back(t);
  std::sort(specials.begin(), specials.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  std::vector<ChatSegment> out;
  size_t i = 0, plain = 0;
  while (i < text.size()) {
    const std::string* hit = nullptr;
    for (const std::string& t : specials)
      if (text.compare(i, t.size(), t) == 0) {
        hit = &t;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    if (i > plain) out.push_back({text.substr(plain, i - plain), false});
    out.push_back({*hit, true});
    i += hit->size();
    plain = i;
  }
  if (plain < text.size()) out.push_back({text.substr(plain), false});
  return out;
}

int ChatTemplate::special_id(const std::string& text) const {
  const int id = tok_->piece_to_id(text);
  if (id >= 0 && (tok_->is_control(id) || id == tok_->bos_id() || tok_->is_eos(id))) return id;
  if (auto it = added_.find(text); it != added_.end()) return it->second;
  return -1;
}

std::vector<int> ChatTemplate::tokenize(const std::vector<ChatSegment>& segments) const {
  return encode(segments, /*add_bos=*/true);
}

std::vector<int> ChatTemplate::encode(const std::vector<ChatSegment>& segments, bool add_bos) const {
  std::vector<int> ids;
  if (tok_->kind() != "sentencepiece") {
    // The BPE tokenizer matches added tokens in text itself, as transformers does (with their
    // lstrip/rstrip and the pre-tokenizer's view of where a text starts): the whole text.
    ids = tok_->encode(segments_text(segments), /*with_specials=*/false);
    if (add_bos && tok_->add_bos() && tok_->bos_id() >= 0 && (ids.empty() || ids.front() != tok_->bos_id()))
      ids.insert(ids.begin(), tok_->bos_id());
    return ids;
  }
  std::string pending;  // text (and specials the tokenizer lacks) not yet encoded
  auto flush = [&] {
    if (pending.empty()) return;
    const std::vector<int> t = tok_->encode(pending, /*with_specials=*/false);
    ids.insert(ids.end(), t.begin(), t.end());
    pending.clear();
  };
  for (const ChatSegment& s : segments) {
    const int id = s.special ? special_id(s.text) : -1;
    if (id >= 0) {
      flush();
      ids.push_back(id);
    } else {
      pending += s.text;
    }
  }
  flush();
  if (add_bos && tok_->add_bos() && tok_->bos_id() >= 0 && (ids.empty() || ids.front() != tok_->bos_id()))
    ids.insert(ids.begin(), tok_->bos_id());
  return ids;
}

std::string ChatTemplate::describe() const {
  return jinja_ ? "the model's own template" : fmt::format("{} format", chat_format_name(format_));
}

std::vector<int> ChatTemplate::tokenize(const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt,
                                        const jinja::Json& kwargs, const jinja::Json& tools) const {
  // A model's own template writes its BOS itself where it has one: nothing is added, as
  // transformers' apply_chat_template(tokenize=True) adds nothing.
  if (jinja_)
    return encode(split_specials(render(messages, add_generation_prompt, kwargs, tools)), false);
  render(messages, add_generation_prompt, kwargs, tools);  // its refusals
  return tokenize(render_chat(format_, messages, add_generation_prompt));
}

std::vector<int> ChatTemplate::stop_ids() const {
  if (jinja_) {
    // The end-of-turn tokens of today's templates that this one writes and the tokenizer has
    // (EOS ends a reply anyway).
    std::vector<int> out;
    for (const char* t : {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                          "<|endoftext|>", "</s>"}) {
      const int id = special_id(t);
      if (id >= 0 && jinja_source_.find(t) != std::string::npos &&
          std::find(out.begin(), out.end(), id) == out.end())
        out.push_back(id);
    }
    return out;
  }
  if (format_ == ChatFormat::chatml) {
    const int id = special_id("<|im_end|>");
    if (id >= 0) return {id};
  }
  return {};
}

std::vector<std::string> ChatTemplate::stop_strings() const {
  if (jinja_) return {};
  if (format_ == ChatFormat::chatml && special_id("<|im_end|>") < 0) return {"<|im_end|>"};
  return {};
}

}  // namespace kestrel
