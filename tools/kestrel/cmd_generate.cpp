// kestrel generate: one prompt in, text streamed out (or one JSON object with --json); or a
// JSONL file of prompts in, one JSON result per line out (--batch-file).
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "tools/kestrel/inputs.h"
#include "base/error.h"
#include "base/interrupt.h"
#include "engine/generate.h"
#include "base/progress.h"
#include "base/staged_output.h"
#include "tokenizer/chat_template.h"

namespace kestrel::cli {

namespace {

using nlohmann::json;

struct GenerateArgs {
  ModelOptions model;
  std::string prompt;
  std::string prompt_file;
  std::string batch_file;
  std::string output;
  int n_predict = 128;  // -1 = up to the end of the context
  SamplingOptions sampling;
  SpecOptions spec;
  GrammarOptions grammar_opts;
  std::shared_ptr<const grammar::Grammar> grammar;  // read before the model loads
  bool chat = false;
  std::string chat_template = "auto";
  std::optional<std::string> system;
  std::string template_kwargs_text;  // --chat-template-kwargs
  nlohmann::json template_kwargs;    // ... read (null when not given)
  int logprobs = 0;
  bool json = false;
  bool quiet = false;
  bool verbose = false;
  bool escape = false;             // -e: \n and the like in the prompt and the strings
  bool no_display_prompt = false;  // the streamed text leaves the prompt out
  bool prompt_given = false;       // -p, even empty
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The prompt's ids: the text as it is, or (--chat) a user message in the chat template.
std::vector<int> prompt_ids(const GenerateArgs& a, const LoadedModel& m,
                            const std::optional<ChatTemplate>& tmpl, const std::string& prompt) {
  if (!tmpl) return m.tok->encode(prompt);
  std::vector<ChatMessage> msgs;
  if (a.system) msgs.push_back({"system", *a.system});
  msgs.push_back({"user", prompt});
  return tmpl->tokenize(msgs, /*add_generation_prompt=*/true, a.template_kwargs);
}

std::optional<ChatTemplate> chat_template(const GenerateArgs& a, const LoadedModel& m) {
  if (!a.chat) return std::nullopt;
  std::string why;
  ChatTemplate t = ChatTemplate::load(a.model.dir, a.chat_template, *m.tok, &why);
  if (!why.empty()) note(a.quiet, "note: " + why);
  check_template_kwargs_use(a.template_kwargs, t);
  return t;
}

// -n -1 (up to the end of the context) needs room for one token.
void check_fits(int n_prompt, int n_predict, int ctx) {
  const int need = n_predict < 0 ? 1 : n_predict;
  if (n_prompt + need > ctx)
    throw Error("prompt (" + std::to_string(n_prompt) + " tokens) plus " +
                std::to_string(need) + " new tokens exceed the context of " +
                std::to_string(ctx) + " tokens; shorten the prompt, lower -n or raise -c");
}

json logprobs_json(const Tokenizer& tok, const std::vector<Logprobs>& lps) {
  json out = json::array();
  for (const Logprobs& lp : lps) {
    json top = json::array();
    for (const TokenLogprob& t : lp.top)
      top.push_back({{"id", t.id}, {"piece", tok.piece(t.id)}, {"logprob", t.logprob}});
    out.push_back({{"id", lp.chosen.id},
                   {"piece", tok.piece(lp.chosen.id)},
                   {"logprob", lp.chosen.logprob},
                   {"top", top}});
  }
  return out;
}

json timings_json(const GenerateResult& r, bool speculative) {
  const int n_run = (int)r.prompt_ids.size() - r.n_cached;
  json j = {{"prompt_tokens", n_run},
          {"cached_tokens", r.n_cached},
          {"prompt_ms", r.prompt_ms},
          {"prompt_tokens_per_s", r.prompt_ms > 0 ? n_run * 1000.0 / r.prompt_ms : 0.0},
          {"generated_tokens", r.ids.size()},
          {"gen_ms", r.gen_ms},
          {"gen_tokens_per_s", r.n_eval > 0 && r.gen_ms > 0 ? r.n_eval * 1000.0 / r.gen_ms : 0.0},
          {"sample_ms", r.sample_ms}};
  if (speculative) {
    j["drafted_tokens"] = r.n_drafted;
    j["accepted_tokens"] = r.n_accepted;
    // No drafts (-n 1, or nothing matched), no passes (-n 1): no rate rather than a rate of 0.
    j["acceptance_rate"] =
        r.n_drafted > 0 ? nlohmann::json((double)r.n_accepted / r.n_drafted) : nlohmann::json();
    j["steps"] = r.n_steps;  // passes of the model after the first generated token
    j["tokens_per_step"] = r.n_steps > 0
                               ? nlohmann::json((double)((int)r.ids.size() - 1) / r.n_steps)
                               : nlohmann::json();
  }
  return j;
}

GenerateOptions base_options(const GenerateArgs& a, const std::optional<ChatTemplate>& tmpl) {
  GenerateOptions opt;
  opt.max_new_tokens = a.n_predict;
  opt.sampling = resolve_sampling(a.model.dir, a.sampling);
  opt.stop = a.sampling.stop;
  opt.reverse_prompts = a.sampling.reverse;
  opt.ignore_eos = a.sampling.ignore_eos;
  opt.logprobs = a.logprobs;
  opt.cancelled = [] { return interrupted(); };
  if (tmpl) {
    for (const std::string& s : tmpl->stop_strings()) opt.stop.push_back(s);
    opt.stop_ids = tmpl->stop_ids();
  }
  opt.grammar = a.grammar;
  return opt;
}

// With a grammar: the tokenizer's masker, its end ids and the chat template's allowed at a
// complete match.
void add_masker(const GenerateArgs& a, const LoadedModel& m, GenerateOptions& opt, bool lines_have_grammars = false) {
  if (a.grammar || lines_have_grammars) opt.masker = grammar_masker(*m.tok, opt.stop_ids);
}

// --verbose: what the run is made of, on stderr.
void print_verbose(const LoadedModel& m, const GenerateOptions& opt, const std::vector<int>& ids) {
  std::string s = fmt::format("device: {}, context {}", m.session->device_name(),
                              m.session->context_length());
  if (m.device == "cpu") {
    const int t = cpu_threads();  // -t
    s += fmt::format(", {} thread{}", t, t == 1 ? "" : "s");
  }
  s += fmt::format("\nprompt: {} tokens:", ids.size());
  for (int id : ids) s += fmt::format(" {}", id);
  s += fmt::format("\nsampling: {}\nnew tokens: {}", describe_sampling(opt.sampling),
                   opt.max_new_tokens < 0 ? std::string("up to the end of the context")
                                          : fmt::format("at most {}", opt.max_new_tokens));
  const nlohmann::json stops = opt.stop, reverse = opt.reverse_prompts;
  if (!opt.stop.empty()) s += "\nstop strings: " + dump(stops);
  if (!opt.reverse_prompts.empty()) s += "\nreverse prompts: " + dump(reverse);
  if (opt.ignore_eos) s += "\nend-of-sequence ignored";
  if (opt.drafter)
    s += fmt::format("\nspeculative: {}, up to {} drafted tokens per step", opt.drafter->name(),
                     opt.draft_max);
  std::cerr << s << "\n" << std::flush;
}

int run_single(const GenerateArgs& a) {
  std::string prompt = a.prompt;
  if (!a.prompt_file.empty()) {
    prompt = read_text_file(a.prompt_file);
    if (prompt.empty()) throw Error(a.prompt_file + ": the prompt file is empty");
    if (a.escape) prompt = process_escapes(prompt);
  } else if (a.prompt_given && prompt.empty()) {
    throw Error("the prompt is empty");
  }
  if (prompt.empty()) throw Error("no prompt: give -p TEXT, -f FILE or --batch-file FILE");

  Perf perf;
  const ModelLoadOptions lo = load_options(a.model, a.quiet);
  LoadedModel m = open_model(lo);
  const std::optional<ChatTemplate> tmpl = chat_template(a, m);
  const std::vector<int> ids = prompt_ids(a, m, tmpl, prompt);
  check_fits((int)ids.size(), a.n_predict, context_length(m, lo));
  load_weights(m, lo);
  perf.load_ms = m.load_ms;

  GenerateOptions opt = base_options(a, tmpl);
  add_masker(a, m, opt);
  const Speculation spec = open_speculation(a.spec, m, a.model, opt.sampling, a.quiet);
  opt.drafter = spec.drafter.get();
  opt.draft_max = a.spec.draft_max;
  perf.speculative = opt.drafter != nullptr;
  if (a.verbose) print_verbose(m, opt, ids);
  if (!a.json && !a.quiet && opt.sampling.temperature > 0)
    std::cerr << "seed: " << opt.sampling.seed << "\n";

  std::function<void(std::string_view)> stream;
  if (!a.json) {
    if (!tmpl && !a.no_display_prompt) std::cout << prompt;
    std::cout << std::flush;
    stream = [](std::string_view s) { std::cout << s << std::flush; };
  }
  catch_interrupts();  // Ctrl-C ends the text, not the program: the block below still prints
  const GenerateResult r = generate(*m.session, *m.tok, ids, opt, stream);
  add_result(perf, r);
  const bool stopped = take_interrupt();

  if (a.json) {
    json j;
    j["model"] = a.model.dir;
    j["device"] = m.session->device_name();
    j["prompt_ids"] = r.prompt_ids;
    j["ids"] = r.ids;
    j["text"] = r.text;
    j["finish_reason"] = r.finish_reason;
    j["seed"] = opt.sampling.seed;
    j["temperature"] = opt.sampling.temperature;
    j["timings"] = timings_json(r, opt.drafter != nullptr);
    j["timings"]["load_ms"] = m.load_ms;
    if (a.grammar) j["grammar_complete"] = r.grammar_complete;
    if (a.logprobs > 0) j["logprobs"] = logprobs_json(*m.tok, r.logprobs);
    std::cout << dump(j) << "\n";
  } else {
    std::cout << "\n" << std::flush;
  }
  if (const std::string n = grammar_note(a.grammar_opts, r); !n.empty()) std::cerr << n << "\n";
  if (!a.quiet || stopped) print_perf(perf, m.session->device_name());
  if (stopped) {
    std::cerr << fmt::format("kestrel: interrupted after {} generated token{}\n", r.ids.size(),
                             r.ids.size() == 1 ? "" : "s");
    return 130;
  }
  return 0;
}

int run_batch(const GenerateArgs& a) {
  std::error_code ec;
  if (!a.output.empty() && std::filesystem::equivalent(a.output, a.batch_file, ec))
    throw Error(fmt::format("-o {} is the batch file {}; write the results to another file",
                            a.output, a.batch_file));
  std::ifstream in(a.batch_file, std::ios::binary);
  if (!in) throw Error(a.batch_file + ": cannot open file");
  std::vector<BatchItem> items;
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    items.push_back(parse_batch_line(text, line));
  }
  if (items.empty()) throw Error(a.batch_file + ": the batch file has no prompts");

  // -o: the results go to a temporary file beside it, renamed over it once every line ran;
  // a failure or Ctrl-C leaves it as it was.
  std::optional<StagedFile> file;
  if (!a.output.empty()) {
    remove_staged_outputs_on_signals("kestrel");
    file.emplace(a.output);
  }
  auto out = [&file](const std::string& line) {
    if (file) file->write(line);
    else std::cout << line << std::flush;
  };
  std::vector<std::string> failures;
  auto fail = [&](BatchItem& it, const std::string& why) {
    it.error = why;
    failures.push_back(fmt::format("{}:{}: {}", a.batch_file, it.line, why));
  };
  for (BatchItem& it : items)
    if (!it.error.empty()) {
      std::cerr << "kestrel: " << a.batch_file << ":" << it.line << ": " << it.error << "\n";
    }

  Perf perf;
  const ModelLoadOptions lo = load_options(a.model, a.quiet);
  LoadedModel m = open_model(lo);
  const std::optional<ChatTemplate> tmpl = chat_template(a, m);
  const int ctx = context_length(m, lo);
  int runnable = 0;
  bool line_grammars = false;
  for (BatchItem& it : items) {
    if (!it.error.empty()) continue;
    try {
      if (it.grammar && !a.spec.kind.empty())
        throw Error("--spec does not go with a line's grammar (drafts are not checked against it)");
      line_grammars |= it.grammar != nullptr;
      it.ids = prompt_ids(a, m, tmpl, it.prompt);
      check_fits((int)it.ids.size(), it.settings.value("n_predict", a.n_predict), ctx);
      ++runnable;
    } catch (const Error& e) {
      fail(it, e.what());
      std::cerr << "kestrel: " << failures.back() << "\n";
    }
  }
  if (runnable > 0) {
    load_weights(m, lo);
    perf.load_ms = m.load_ms;
  }
  GenerateOptions base = base_options(a, tmpl);
  if (runnable > 0) add_masker(a, m, base, line_grammars);
  Speculation spec;
  if (runnable > 0) spec = open_speculation(a.spec, m, a.model, base.sampling, a.quiet);
  base.drafter = spec.drafter.get();
  base.draft_max = a.spec.draft_max;
  perf.speculative = base.drafter != nullptr;
  if (runnable > 0 && !a.quiet && !a.sampling.seed && base.sampling.temperature > 0)
    std::cerr << "seed: " << base.sampling.seed << "\n";

  Progress bar("prompts", runnable, "prompts", !a.quiet && runnable > 0);
  int done = 0;
  const size_t reported = failures.size();
  // Ctrl-C stops the prompt being generated (its line says "cancelled") and the rest.
  catch_interrupts();
  bool stopped = false;
  for (BatchItem& it : items) {
    if (stopped) break;
    json j;
    j["line"] = it.line;
    if (!it.id.is_null()) j["id"] = it.id;
    if (it.error.empty()) {
      GenerateOptions opt = base;
      apply_batch_settings(it.settings, opt);
      if (it.grammar) opt.grammar = it.grammar;
      if (it.settings.contains("stop")) {
        if (tmpl)
          for (const std::string& t : tmpl->stop_strings()) opt.stop.push_back(t);
      }
      try {
        const GenerateResult r = generate_cached(*m.session, *m.tok, it.ids, opt);  // prompts sharing a prefix reuse it
        add_result(perf, r);
        j["text"] = r.text;
        j["finish_reason"] = r.finish_reason;
        j["prompt_tokens"] = r.prompt_ids.size();
        j["generated_tokens"] = r.ids.size();
        j["seed"] = opt.sampling.seed;
        if (opt.grammar) j["grammar_complete"] = r.grammar_complete;
        j["timings"] = timings_json(r, opt.drafter != nullptr);
        if (a.logprobs > 0) j["logprobs"] = logprobs_json(*m.tok, r.logprobs);
        stopped = take_interrupt();
      } catch (const Error& e) {
        m.session->cached.clear();
        fail(it, e.what());
      }
      if (!stopped) bar.update(++done);
    }
    if (!it.error.empty()) j["error"] = it.error;
    out(dump(j) + "\n");
  }
  bar.finish();
  // Interrupted, -o keeps what it held (the lines written so far are in its temporary).
  if (file && !stopped) file->commit();
  for (size_t i = reported; i < failures.size(); ++i) std::cerr << "kestrel: " << failures[i] << "\n";
  if ((!a.quiet || stopped) && runnable > 0) print_perf(perf, m.session->device_name());
  if (stopped) {
    std::cerr << fmt::format("kestrel: interrupted after {} of {} prompts{}\n", done, runnable,
                             file ? "; nothing written to " + a.output : std::string());
    return 130;
  }

  int n_failed = 0;
  for (const BatchItem& it : items) n_failed += !it.error.empty();
  if (n_failed > 0) {
    std::cerr << fmt::format("kestrel: {} of {} prompts in {} failed\n", n_failed, items.size(),
                             a.batch_file);
    return 1;
  }
  return 0;
}

}  // namespace

void register_generate(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "continue a prompt and stream the text");
  add_model_options(cmd, a->model);
  auto* p = cmd->add_option("-p,--prompt", a->prompt, "prompt text");
  auto* f = cmd->add_option("-f,--file", a->prompt_file, "read the prompt from a file")->excludes(p);
  auto* batch =
      cmd->add_option("--batch-file", a->batch_file,
                      "JSONL file: one {\"prompt\": ...} per line, one JSON result per line out")
          ->excludes(p)
          ->excludes(f);
  auto* o = cmd->add_option("-o,--output", a->output, "with --batch-file: write the results to a file");
  cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate (-1 = up to the context)")
      ->check(token_count())
      ->capture_default_str();
  add_sampling_options(cmd, a->sampling);
  add_spec_options(cmd, a->spec);
  add_grammar_options(cmd, a->grammar_opts);
  auto* chat =
      cmd->add_flag("--chat", a->chat, "wrap the prompt as a user message in the chat template");
  auto* tmpl = cmd->add_option("--template", a->chat_template,
                               "chat template for --chat: auto (the model's own), a .jinja file, "
                               "llama2, mistral, zephyr, chatml, vicuna, raw")
                   ->capture_default_str();
  auto* system = cmd->add_option("--system", a->system, "system prompt for --chat");
  auto* kwargs = add_template_kwargs_option(cmd, a->template_kwargs_text);
  auto* logprobs =
      cmd->add_option("--logprobs", a->logprobs,
                      "with --json or --batch-file: top-N log-probabilities of each generated token")
          ->check(whole(0, 100));
  auto* json = cmd->add_flag("--json", a->json, "print one JSON object instead of streaming text");
  cmd->add_flag("-e,--escape", a->escape,
                "process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xHH) in the prompt, "
                "--system, --stop and -r");
  auto* no_display = cmd->add_flag("--no-display-prompt", a->no_display_prompt,
                                   "print only the generated text, not the prompt before it");
  auto* quiet = cmd->add_flag("-q,--quiet", a->quiet, "no notes, progress or statistics on stderr");
  cmd->add_flag("--verbose", a->verbose,
                "also print the device, the prompt's ids, the sampling and the stops on stderr")
      ->excludes(quiet);
  cmd->callback([a, p, o, batch, chat, tmpl, system, kwargs, logprobs, json, no_display, &action] {
    a->prompt_given = p->count() > 0;
    // Options that would do nothing here are refused, not ignored.
    auto refuse = [](const std::string& what) { throw CLI::ValidationError(what); };
    if (o->count() && !batch->count()) refuse("-o FILE goes with --batch-file");
    if (system->count() && !chat->count()) refuse("--system goes with --chat");
    if (tmpl->count() && !chat->count()) refuse("--template goes with --chat");
    if (kwargs->count() && !chat->count()) refuse("--chat-template-kwargs goes with --chat");
    if (kwargs->count()) a->template_kwargs = parse_template_kwargs(a->template_kwargs_text);
    if (logprobs->count() && !json->count() && !batch->count())
      refuse("--logprobs goes with --json or --batch-file (streamed text has no room for it)");
    if (no_display->count() && (json->count() || batch->count()))
      refuse("--no-display-prompt goes with streamed text, not --json or --batch-file");
    check_spec_options(a->spec);
    check_grammar_options(a->grammar_opts, a->spec);
    action = [a] {
      a->grammar = load_grammar(a->grammar_opts);
      if (!is_template_file(a->chat_template) && a->chat_template != "auto")
        parse_chat_format(a->chat_template);
      if (a->escape) {
        a->prompt = process_escapes(a->prompt);
        if (a->system) a->system = process_escapes(*a->system);
        for (std::string& s : a->sampling.stop) s = process_escapes(s);
        for (std::string& s : a->sampling.reverse) s = process_escapes(s);
      }
      return a->batch_file.empty() ? run_single(*a) : run_batch(*a);
    };
  });
}

}  // namespace kestrel::cli
