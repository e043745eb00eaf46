// What `kestrel` reads from files a user hands it, apart from models: a line of a
// --batch-file (generate) and a --messages conversation (tokenize). Plain functions of text,
// so that tests and the fuzz targets (tests/fuzz) run them without a model.
#pragma once

#include <nlohmann/json.hpp>
#include <memory>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "tokenizer/chat_template.h"

namespace kestrel::cli {

// One line of a batch file: a prompt and its own settings, or why it cannot run.
struct BatchItem {
  int line = 0;
  nlohmann::json id;  // echoed back when given
  std::string prompt;
  nlohmann::json settings = nlohmann::json::object();  // checked: n_predict, temperature, top_k,
                                                       // top_p, min_p, seed, stop (a list)
  // The line's own grammar ("grammar": GBNF text, "json_schema": a schema, "json_object":
  // true), compiled as the line is read; in place of the command line's.
  std::shared_ptr<const grammar::Grammar> grammar;
  std::string error;
  std::vector<int> ids;
};

// Parses one non-blank line (`line` is its number, for messages); sets item.error instead of
// throwing.
BatchItem parse_batch_line(const std::string& text, int line);

// The line's own settings over opt: max_new_tokens, the sampling fields it names, and its stop
// strings in place of opt's (the caller adds the chat template's).
void apply_batch_settings(const nlohmann::json& settings, GenerateOptions& opt);

// An OpenAI-style conversation, [{"role": ..., "content": ...}, ...], from the text of the
// file `path`, read by the server's rules (engine/server/messages.h: developer is system, text
// content parts are joined). Throws kestrel::Error: the path, then the server's message
// ("messages.json: messages[0].role: 'tool' is not supported ...").
std::vector<ChatMessage> parse_messages(const std::string& text, const std::string& path);

}  // namespace kestrel::cli
