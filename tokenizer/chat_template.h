// Chat formats: a conversation rendered the way a chat model was trained to read it, and
// tokenized with the format's special tokens as their ids (never as literal text).
//
// By default the model's own Jinja chat_template (tokenizer_config.json) is rendered by the
// interpreter in jinja.h, exactly as transformers' apply_chat_template renders it. The
// built-in formats below are for models without one (--template NAME) and the fallback where a
// template uses what the interpreter does not support:
//
// Each format reproduces the Jinja chat_template its models ship in tokenizer_config.json
// (rendered by transformers' apply_chat_template), spelled out here for a conversation of an
// optional system message and then user and assistant turns alternating:
//
//   llama2   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST]
//            (Llama-2-chat; contents stripped of surrounding whitespace)
//   mistral  <s>[INST] {system}\n\n{user} [/INST]{assistant}</s>[INST] {user} [/INST]
//            (Mistral-7B-Instruct v0.1/v0.2, which has no system role: it is prepended to the
//            first user message)
//   zephyr   <|system|>\n{system}</s>\n<|user|>\n{user}</s>\n<|assistant|>\n{assistant}</s>\n ... <|assistant|>\n
//   chatml   <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n
//   vicuna   {system} USER: {user} ASSISTANT: {assistant}</s>USER: {user} ASSISTANT:
//            (FastChat's vicuna_v1.1)
//   raw      {system}\n{user}\n{assistant}\n ... : no markup, for base models
//
// The trailing part after the last message is the generation prompt (what opens the
// assistant's reply). BOS: llama2 and mistral write <s> themselves; for the others the
// tokenizer's add_bos_token prepends it, as llama.cpp does.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja/jinja.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

enum class ChatFormat { llama2, mistral, zephyr, chatml, vicuna, raw };

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", or "tool" (a tool's result)
  std::string content;
  // OpenAI's tool-call fields, passed to a Jinja template only where set, since templates test
  // for the keys themselves (Llama 3.1's `'tool_calls' in message`): an assistant message's
  // tool_calls ([{"id", "type": "function", "function": {"name", "arguments"}}], null when
  // none), a tool message's tool_call_id and name.
  // (Initialized here so that {role, content} stays a complete initializer under -Wextra.)
  nlohmann::ordered_json tool_calls = nullptr;
  std::string tool_call_id = {};
  std::string name = {};
};

// A piece of a rendered conversation: text, or a special token named by its text ("<s>",
// "</s>", "<|im_start|>"), which tokenizes to the token's id when the tokenizer has it.
struct ChatSegment {
  std::string text;
  bool special = false;
  bool operator==(const ChatSegment&) const = default;
};

std::string_view chat_format_name(ChatFormat f);
// Whether --template names a Jinja file (a path, or a name ending in .jinja) rather than a
// built-in format.
bool is_template_file(const std::string& name);
// "llama2", "mistral", "zephyr", "chatml", "vicuna", "raw"; throws kestrel::Error naming the
// known formats otherwise.
ChatFormat parse_chat_format(std::string_view name);

// Recognises the format of a Jinja chat_template by substrings characteristic of each (as
// llama.cpp's llm_chat_detect_template does). Templates of related but different formats
// (Mistral's later [SYSTEM_PROMPT]/[AVAILABLE_TOOLS] ones, Phi-3, ChatML-with-<|im_sep|>,
// Vicuna-Orca) are not matched: nullopt rather than a near miss.
std::optional<ChatFormat> detect_chat_format(std::string_view jinja);

// Renders a conversation: an optional leading system message, then user and assistant
// messages alternating, starting with user. Throws kestrel::Error on any other order.
std::vector<ChatSegment> render_chat(ChatFormat f, const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt);
// The rendered text (special tokens written as their text).
std::string segments_text(const std::vector<ChatSegment>& segments);

// chat_template_kwargs, as transformers' apply_chat_template takes them and vLLM's requests
// give them: extra variables for a Jinja template, such as {"enable_thinking": false} for
// Qwen3. Throws kestrel::Error (one line) unless `kwargs` is an object that sets none of the
// variables the renderer sets itself (messages, add_generation_prompt, bos_token, eos_token,
// tools).
void check_template_kwargs(const jinja::Json& kwargs);

// A model's chat format bound to its tokenizer's special tokens.
class ChatTemplate {
 public:
  // `name` is "auto" (the model's chat_template from <dir>/tokenizer_config.json, rendered by
  // the Jinja interpreter), a built-in format name, or a path to a .jinja file. With no
  // chat_template at all, "auto" is raw and `note` says so (a base model). A template the
  // interpreter refuses is an error naming the construct and line, and suggesting --template
  // (with the built-in format the template looks like, where it looks like one).
  static ChatTemplate load(const std::string& dir, const std::string& name, const Tokenizer& tok,
                           std::string* note = nullptr);
  ChatTemplate(ChatFormat f, const Tokenizer& tok, std::map<std::string, int> added_tokens = {});

  // A built-in format, or raw while a Jinja template is in use (is_jinja).
  ChatFormat format() const { return format_; }
  bool is_jinja() const { return jinja_ != nullptr; }
  // The rendered prompt, special tokens as their text. Throws kestrel::Error where the
  // template refuses the conversation (its raise_exception message). `kwargs` (an object, or
  // null for none; check_template_kwargs) are extra variables of a Jinja template; a built-in
  // format has none to set.
  // `tools` (an array, or null for none) is the template's `tools` variable: OpenAI's tool
  // definitions as the request gave them.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                     const jinja::Json& kwargs = jinja::Json(),
                     const jinja::Json& tools = jinja::Json()) const;
  std::vector<int> tokenize(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                            const jinja::Json& kwargs = jinja::Json(),
                            const jinja::Json& tools = jinja::Json()) const;
  // The Jinja template's text (empty for a built-in format): the server reads its tool-call
  // format from it (engine/server/tool_calls.h).
  const std::string& jinja_source() const { return jinja_source_; }
  // "the model's own template" or "<name> format", for messages.
  std::string describe() const;
  std::vector<int> tokenize(const std::vector<ChatSegment>& segments) const;
  // What ends a reply besides EOS: end-of-turn tokens as ids when the tokenizer has them,
  // as stop strings when it does not.
  std::vector<int> stop_ids() const;
  std::vector<std::string> stop_strings() const;

 private:
  int special_id(const std::string& text) const;  // -1 when the tokenizer has no such token
  // Rendered text cut into text and the special tokens it spells (longest match first).
  std::vector<ChatSegment> split_specials(const std::string& text) const;
  std::vector<int> encode(const std::vector<ChatSegment>& segments, bool add_bos) const;
  ChatFormat format_;
  const Tokenizer* tok_;
  std::map<std::string, int> added_;  // tokenizer_config.json's added_tokens_decoder
  std::shared_ptr<const jinja::Template> jinja_;  // the model's own template, when used
  std::string jinja_source_;
  std::string bos_text_, eos_text_;  // bos_token / eos_token as the template sees them
};

}  // namespace kestrel
