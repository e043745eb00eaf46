// kestrel tokenize: a text (or a conversation rendered by the chat template) as the model's
// tokenizer sees it, as llama.cpp's llama-tokenize and transformers' apply_chat_template show
// it: one "id  token" line per token, {"ids", "pieces"} with --json, or the count alone. Only
// the tokenizer is loaded.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "tools/kestrel/inputs.h"
#include "base/error.h"
#include "tokenizer/chat_template.h"

namespace kestrel::cli {

namespace {

using nlohmann::json;

struct TokenizeArgs {
  std::string dir;
  std::string prompt;
  std::string file;
  std::string messages;
  std::string chat_template = "auto";
  bool json = false;
  bool no_bos = false;
  bool count = false;
};

std::vector<ChatMessage> read_messages(const std::string& path) {
  return parse_messages(read_text_file(path), path);
}

// The conversation's ids with the generation prompt, as `kestrel chat` and `kestrel serve` run
// them: a model's own template gives its ids as transformers' apply_chat_template does; a
// built-in format without a BOS in its text gets the tokenizer's in front (as llama.cpp adds
// it when generating), so that --count is the prompt_tokens of an answer.
std::vector<int> conversation_ids(const TokenizeArgs& a, const Tokenizer& tok) {
  const std::vector<ChatMessage> messages = read_messages(a.messages);
  std::string why;
  const ChatTemplate tmpl = ChatTemplate::load(a.dir, a.chat_template, tok, &why);
  if (!why.empty()) std::cerr << "note: " << why << "\n";
  return tmpl.tokenize(messages, /*add_generation_prompt=*/true);
}

int run_tokenize(const TokenizeArgs& a) {
  if (!std::filesystem::is_directory(a.dir)) throw Error(a.dir + ": no such model directory");
  const std::unique_ptr<Tokenizer> tok = Tokenizer::load(a.dir);
  std::vector<int> ids;
  // --no-bos: the BOS the tokenizer adds to a text; a conversation's first, the template's own
  // or the one added in front of a built-in format.
  const bool bos_added = !a.messages.empty() || tok->add_bos();
  ids = a.messages.empty()
            ? tok->encode(a.file.empty() ? a.prompt : read_text_file(a.file), /*with_specials=*/true)
            : conversation_ids(a, *tok);
  if (a.no_bos && bos_added && !ids.empty() && ids.front() == tok->bos_id())
    ids.erase(ids.begin());

  if (a.count) {
    std::cout << ids.size() << "\n";
  } else if (a.json) {
    json pieces = json::array();
    for (int id : ids) pieces.push_back(tok->piece(id));
    const json j = {{"ids", ids}, {"pieces", pieces}};
    std::cout << j.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  } else {
    std::string out;
    for (int id : ids) out += fmt::format("{:>6}  {}\n", id, tok->piece(id));
    std::cout << out;
  }
  return 0;
}

}  // namespace

void register_tokenize(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "show the ids and tokens of a text or a chat conversation (tokenizer only)");
  cmd->add_option("-m,--model", a->dir, "model directory (only its tokenizer is read)")
      ->required();
  auto* p = cmd->add_option("-p,--prompt", a->prompt, "the text");
  auto* f = cmd->add_option("-f,--file", a->file, "a file holding the text");
  auto* m = cmd->add_option("--messages", a->messages,
                            "a JSON file holding a list of {\"role\", \"content\"} messages, "
                            "rendered with the chat template and its generation prompt");
  p->excludes(f)->excludes(m);
  f->excludes(m);
  auto* t = cmd->add_option("--template", a->chat_template,
                  "chat template for --messages: auto (the model's, from tokenizer_config.json), "
                  "a built-in format (llama2, mistral, zephyr, chatml, vicuna, raw) or a .jinja "
                  "file");
  cmd->add_flag("--json", a->json, "print {\"ids\": [...], \"pieces\": [...]}");
  cmd->add_flag("--no-bos", a->no_bos, "leave out the BOS in front (the tokenizer's or the template's)");
  cmd->add_flag("--count", a->count, "print only the number of tokens");
  cmd->callback([a, p, f, m, t, &action] {
    if (p->count() + f->count() + m->count() != 1)
      throw CLI::ValidationError("tokenize", "give one of -p, -f or --messages");
    if (t->count() && !m->count())
      throw CLI::ValidationError("tokenize", "--template goes with --messages");
    action = [a] { return run_tokenize(*a); };
  });
}

}  // namespace kestrel::cli
