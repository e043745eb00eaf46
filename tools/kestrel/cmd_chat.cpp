// kestrel chat: a conversation in the terminal, in the model's chat format. Replies stream;
// the K/V of the conversation so far stay in the session's cache, so each turn runs only
// the tokens after the longest prefix it shares with what the cache holds. With stdin not
// a terminal it reads messages line by line until EOF and writes only the replies to stdout;
// on one, lines are edited and recalled with libedit (line_editor.h).
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "tools/kestrel/line_editor.h"
#include "base/error.h"
#include "base/interrupt.h"
#include "engine/generate.h"
#include "tokenizer/chat_template.h"

namespace kestrel::cli {

namespace {

// A reply in the raw template (a base model, or --template raw) has no end-of-turn token to
// end it: unless -r says where it ends, it ends at a blank line, and unless -n says otherwise
// after this many tokens.
constexpr int kRawReplyTokens = 256;
const char* const kRawReplyEnd = "\n\n";

struct ChatArgs {
  ModelOptions model;
  int n_predict = -1;    // -1 = up to the context
  bool n_given = false;  // -n on the command line
  SamplingOptions sampling;
  SpecOptions spec;
  GrammarOptions grammar_opts;
  std::shared_ptr<const grammar::Grammar> grammar;  // read before the model loads
  std::string chat_template = "auto";
  std::optional<std::string> system;
  std::string template_kwargs_text;  // --chat-template-kwargs
  nlohmann::json template_kwargs;    // ... read (null when not given)
  bool escape = false;
  bool quiet = false;
  bool verbose = false;
};

const char* kHelp =
    "  /help          this list\n"
    "  /exit          end the session (also Ctrl-D, or Ctrl-C at the prompt)\n"
    "  /clear         forget the conversation (the system prompt stays)\n"
    "  /regen         generate the last reply again\n"
    "  /stats         token counts and speeds of the session\n"
    "  /system TEXT   set the system prompt (empty: none)\n"
    "  a line ending in \\ continues on the next line; \"\"\" opens and closes a block\n"
    "  Ctrl-C during a reply stops it and keeps the conversation\n";

std::string trim(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return std::string(s);
}

class ChatSession {
 public:
  ChatSession(const ChatArgs& a) : a_(a), editor_(isatty(STDIN_FILENO) != 0) {
    interactive_ = isatty(STDIN_FILENO) != 0;
    const char* no_color = std::getenv("NO_COLOR");
    color_ = interactive_ && isatty(STDOUT_FILENO) && !(no_color && *no_color);
  }

  int run() {
    m_ = open_model(load_options(a_.model, a_.quiet));
    std::string why;
    tmpl_.emplace(ChatTemplate::load(a_.model.dir, a_.chat_template, *m_.tok, &why));
    if (!why.empty()) info("note: " + why);
    check_template_kwargs_use(a_.template_kwargs, *tmpl_);
    load_weights(m_, load_options(a_.model, a_.quiet));
    perf_.load_ms = m_.load_ms;
    ctx_ = m_.session->context_length();
    base_ = resolve_sampling(a_.model.dir, a_.sampling);
    // One drafter for the whole conversation: a draft model's session follows each turn's
    // prompt by its longest shared prefix, as the model's own does.
    spec_ = open_speculation(a_.spec, m_, a_.model, base_, a_.quiet);
    if (a_.grammar) masker_ = grammar_masker(*m_.tok, tmpl_->stop_ids());
    perf_.speculative = spec_.drafter != nullptr;
    if (a_.system) msgs_.push_back({"system", *a_.system});
    n_predict_ = a_.n_predict;
    stops_ = a_.sampling.stop;
    if (tmpl_->format() == ChatFormat::raw && !tmpl_->is_jinja()) {
      // No end-of-turn token: a blank line ends a reply unless -r says otherwise, and a reply
      // has a cap unless -n says otherwise. Said once.
      std::vector<std::string> ends;
      if (a_.sampling.reverse.empty()) {
        stops_.push_back(kRawReplyEnd);
        ends.push_back("at a blank line");
      }
      if (!a_.n_given) {
        n_predict_ = kRawReplyTokens;
        ends.push_back(fmt::format("after {} tokens", kRawReplyTokens));
      }
      if (!ends.empty())
        info(fmt::format("note: the raw template has no end of turn: a reply ends {}{} (-r STR "
                         "ends it after STR, -n N after N tokens, -n -1 at the context)",
                         ends[0], ends.size() > 1 ? " or " + ends[1] : ""));
    }
    if (base_.temperature > 0) info(fmt::format("seed: {}", base_.seed));
    if (a_.verbose)
      info(fmt::format("device: {}, context {}\ntemplate: {}\nsampling: {}\nreply: {}",
                       m_.session->device_name(), ctx_, tmpl_->describe(),
                       describe_sampling(base_),
                       n_predict_ > 0 ? fmt::format("at most {} tokens", n_predict_)
                                      : std::string("up to the context")));
    if (interactive_)
      info(fmt::format("chatting with {} ({}, context {}). /help lists the commands, "
                       "Ctrl-C stops a reply, /exit or Ctrl-D ends.",
                       a_.model.dir, tmpl_->describe(), ctx_));
    catch_interrupts();

    std::string msg;
    while (read_message(msg)) {
      if (msg.starts_with("/")) {
        if (!command(msg)) break;
        continue;
      }
      if (trim(msg).empty()) continue;
      msgs_.push_back({"user", msg});
      reply();
    }
    if (interactive_) std::cout << "\n";
    if (!a_.quiet) print_perf(perf_, m_.session->device_name());
    return 0;
  }

 private:
  // A note for the user on stderr (dim on a terminal) unless quiet.
  void info(const std::string& s) {
    if (a_.quiet) return;
    std::cerr << (color_ ? "\033[2m" : "") << s << (color_ ? "\033[0m" : "") << "\n" << std::flush;
  }

  bool read_line(std::string& line, const char* prompt) {
    std::string shown;
    if (interactive_)
      shown = std::string(color_ ? "\033[1m" : "") + prompt + (color_ ? "\033[0m\033[32m" : "");
    const bool ok = editor_.read(line, shown);
    if (color_) std::cout << "\033[0m" << std::flush;
    return ok && !interrupted();
  }

  // One message: a line, lines joined by a trailing backslash, or a """ block. False at the
  // end of input or on Ctrl-C.
  bool read_message(std::string& msg) {
    msg.clear();
    std::string line;
    if (!read_line(line, "> ")) return false;
    if (line == "\"\"\"") {
      std::vector<std::string> lines;
      while (read_line(line, "")) {
        if (line == "\"\"\"") break;
        lines.push_back(line);
      }
      for (size_t i = 0; i < lines.size(); ++i) msg += (i ? "\n" : "") + lines[i];
      return !interrupted();
    }
    while (!line.empty() && line.back() == '\\') {
      line.pop_back();
      msg += line + "\n";
      if (!read_line(line, "... ")) return !interrupted() && (msg.pop_back(), true);
    }
    msg += line;
    return true;
  }

  // Handles a /command; false ends the session.
  bool command(const std::string& line) {
    const size_t sp = line.find(' ');
    const std::string cmd = line.substr(0, sp);
    const std::string arg = sp == std::string::npos ? "" : trim(line.substr(sp + 1));
    if (cmd == "/exit" || cmd == "/quit") return false;
    if (cmd == "/help") {
      std::cerr << kHelp;
    } else if (cmd == "/clear") {
      const bool has_system = !msgs_.empty() && msgs_[0].role == "system";
      msgs_.resize(has_system ? 1 : 0);
      info("(conversation cleared)");
    } else if (cmd == "/regen") {
      if (msgs_.empty() || msgs_.back().role != "assistant") {
        info("(no reply to regenerate)");
      } else {
        msgs_.pop_back();
        reply();
      }
    } else if (cmd == "/stats") {
      stats();
    } else if (cmd == "/system") {
      const bool has_system = !msgs_.empty() && msgs_[0].role == "system";
      if (arg.empty()) {
        if (has_system) msgs_.erase(msgs_.begin());
        info("(no system prompt)");
      } else {
        if (has_system) msgs_[0].content = arg;
        else msgs_.insert(msgs_.begin(), {"system", arg});
        info("(system prompt set)");
      }
    } else {
      info("unknown command " + cmd + "; /help lists the commands");
    }
    return true;
  }

  // Drops the oldest exchanges (the system prompt stays) until the conversation and room for
  // a reply fit the context; false when even the last message alone does not.
  bool fit(std::vector<int>& ids) {
    const int room = n_predict_ > 0 ? std::min(n_predict_, ctx_ / 2) : std::max(ctx_ / 4, 1);
    const size_t first = (!msgs_.empty() && msgs_[0].role == "system") ? 1 : 0;
    int dropped = 0;
    ids = tmpl_->tokenize(msgs_, true, a_.template_kwargs);
    while ((int)ids.size() + room > ctx_ && msgs_.size() >= first + 3) {
      msgs_.erase(msgs_.begin() + first, msgs_.begin() + first + 2);
      ++dropped;
      ids = tmpl_->tokenize(msgs_, true, a_.template_kwargs);
    }
    if (dropped)
      info(fmt::format("(the conversation outgrew the context of {} tokens: dropped the {} oldest "
                       "exchange{}{})",
                       ctx_, dropped, dropped == 1 ? "" : "s",
                       first ? "; the system prompt stays" : ""));
    return (int)ids.size() < ctx_;
  }

  void reply() {
    std::vector<int> ids;
    if (!fit(ids)) {
      msgs_.pop_back();
      std::cerr << fmt::format("kestrel: the message does not fit the context ({} tokens with "
                               "the system prompt, context {}); shorten it, /system to shorten "
                               "the system prompt, or raise -c\n",
                               ids.size(), ctx_);
      return;
    }
    GenerateOptions opt;
    opt.sampling = base_;
    opt.sampling.seed = base_.seed + turns_;  // /regen at a temperature draws a new reply
    opt.max_new_tokens = ctx_ - (int)ids.size();
    if (n_predict_ > 0) opt.max_new_tokens = std::min(opt.max_new_tokens, n_predict_);
    opt.stop = stops_;
    for (const std::string& s : tmpl_->stop_strings()) opt.stop.push_back(s);
    opt.reverse_prompts = a_.sampling.reverse;
    opt.stops_after_text = true;  // the reply's leading whitespace is not shown either
    opt.stop_ids = tmpl_->stop_ids();
    opt.ignore_eos = a_.sampling.ignore_eos;
    opt.cancelled = [] { return interrupted(); };
    opt.drafter = spec_.drafter.get();
    opt.draft_max = a_.spec.draft_max;
    opt.grammar = a_.grammar;  // each reply matches the grammar from its start
    opt.masker = masker_;

    bool started = false;  // leading whitespace of a reply is not shown
    auto stream = [&](std::string_view s) {
      if (!started) {
        while (!s.empty() && (s.front() == ' ' || s.front() == '\n')) s.remove_prefix(1);
        if (s.empty()) return;
        started = true;
      }
      std::cout << s << std::flush;
    };
    take_interrupt();
    const GenerateResult r = generate_cached(*m_.session, *m_.tok, ids, opt, stream);
    const bool stopped = take_interrupt();
    std::cout << "\n" << std::flush;
    ++turns_;
    add_result(perf_, r);
    last_ = r;
    msgs_.push_back({"assistant", trim(r.text)});
    if (stopped) info("(reply stopped)");
    if (const std::string n = grammar_note(a_.grammar_opts, r); !n.empty()) info(n);
    const int n_run = (int)r.prompt_ids.size() - r.n_cached;
    info(fmt::format("[prompt {} tokens, {:.1f} tok/s | reply {} tokens, {:.1f} tok/s | "
                     "context {}/{}]",
                     n_run, r.prompt_ms > 0 ? n_run * 1000.0 / r.prompt_ms : 0.0, r.ids.size(),
                     r.n_eval > 0 && r.gen_ms > 0 ? r.n_eval * 1000.0 / r.gen_ms : 0.0,
                     m_.session->cached.size() + 1, ctx_));
  }

  void stats() {
    std::string s = fmt::format(
        "turns {}, messages {}, context {}/{} tokens, {}, {}\n", turns_, msgs_.size(),
        m_.session->cached.size(), ctx_, tmpl_->describe(), m_.session->device_name());
    s += fmt::format("prompt: {} tokens in {:.1f} ms ({:.1f} tok/s)\n", perf_.prompt_tokens,
                     perf_.prompt_ms,
                     perf_.prompt_ms > 0 ? perf_.prompt_tokens * 1000.0 / perf_.prompt_ms : 0.0);
    s += fmt::format("generation: {} tokens, {} runs in {:.1f} ms ({:.1f} tok/s)\n",
                     perf_.generated, perf_.eval_runs, perf_.eval_ms,
                     perf_.eval_ms > 0 ? perf_.eval_runs * 1000.0 / perf_.eval_ms : 0.0);
    if (last_)
      s += fmt::format("last reply: {} tokens, finish {}\n", last_->ids.size(),
                       last_->finish_reason);
    std::cerr << s << std::flush;
  }

  const ChatArgs& a_;
  LineEditor editor_;  // line editing and history on a terminal (libedit)
  bool interactive_ = false, color_ = false;
  LoadedModel m_;
  Speculation spec_;
  std::shared_ptr<const grammar::TokenMasker> masker_;  // with a grammar
  std::optional<ChatTemplate> tmpl_;
  int ctx_ = 0;
  SamplingParams base_;
  std::vector<ChatMessage> msgs_;
  int n_predict_ = -1;             // a reply's most tokens (-1 = up to the context)
  std::vector<std::string> stops_;  // -r and --stop, and a blank line in the raw template
  int turns_ = 0;
  Perf perf_;
  std::optional<GenerateResult> last_;
};

}  // namespace

void register_chat(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<ChatArgs>();
  CLI::App* cmd = app.add_subcommand("chat", "talk with a chat model in the terminal");
  add_model_options(cmd, a->model);
  cmd->add_option("--template", a->chat_template,
                  "chat template: auto (the model's own, from tokenizer_config.json), a .jinja "
                  "file, or a built-in format: llama2, mistral, zephyr, chatml, vicuna, raw")
      ->capture_default_str();
  cmd->add_option("--system", a->system, "system prompt");
  auto* kwargs = add_template_kwargs_option(cmd, a->template_kwargs_text);
  auto* n = cmd->add_option("-n,--n-predict", a->n_predict,
                            fmt::format("most tokens per reply (-1 = up to the context; default "
                                        "-1, {} with the raw template)",
                                        kRawReplyTokens))
                ->check(token_count());
  add_sampling_options(cmd, a->sampling);
  add_spec_options(cmd, a->spec);
  add_grammar_options(cmd, a->grammar_opts);
  cmd->add_flag("-e,--escape", a->escape,
                "process escapes (\\n, \\t, \\xHH, ...) in --system, --stop and -r");
  auto* quiet =
      cmd->add_flag("-q,--quiet", a->quiet, "no notes, statistics or performance block on stderr");
  cmd->add_flag("--verbose", a->verbose, "also print the device, the template and the sampling")
      ->excludes(quiet);
  cmd->callback([a, n, kwargs, &action] {
    a->n_given = n->count() > 0;
    if (kwargs->count()) a->template_kwargs = parse_template_kwargs(a->template_kwargs_text);
    check_spec_options(a->spec);
    check_grammar_options(a->grammar_opts, a->spec);
    action = [a] {
      a->grammar = load_grammar(a->grammar_opts);
      if (!is_template_file(a->chat_template) && a->chat_template != "auto")
        parse_chat_format(a->chat_template);
      if (a->escape) {
        if (a->system) a->system = process_escapes(*a->system);
        for (std::string& s : a->sampling.stop) s = process_escapes(s);
        for (std::string& s : a->sampling.reverse) s = process_escapes(s);
      }
      return ChatSession(*a).run();
    };
  });
}

}  // namespace kestrel::cli
