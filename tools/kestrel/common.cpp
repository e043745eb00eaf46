#include "tools/kestrel/common.h"

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <filesystem>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>

#include "base/error.h"
#include "base/files.h"
#include "engine/grammar/json_schema.h"

namespace kestrel::cli {

namespace {

// A decimal number as strtod reads one, whole: not empty, nothing after it, and not strtod's
// hexadecimal form ("0x100" would read as 256).
bool is_number(const std::string& in, double& v) {
  char* end = nullptr;
  v = std::strtod(in.c_str(), &end);
  return !in.empty() && end == in.c_str() + in.size() &&
         in.find_first_of("xX") == std::string::npos;
}

// A CLI11 check that the value is a number and ok(value); otherwise "<what>, got <value>".
CLI::Validator number_check(std::function<bool(double)> ok, const std::string& what,
                            const std::string& desc, bool integer = false) {
  return CLI::Validator(
      [ok, what, integer](std::string& in) -> std::string {
        double v = 0;
        if (!is_number(in, v)) return "not a number: '" + in + "'";
        if (integer && v != std::floor(v)) return "must be a whole number, got " + in;
        return ok(v) ? std::string() : fmt::format("{}, got {}", what, in);
      },
      desc);
}

}  // namespace

std::string unknown_option_message(const std::string& opt) {
  // llama.cpp's options that Kestrel has no use for say why.
  if (opt == "-ngl" || opt == "--n-gpu-layers" || opt == "--gpu-layers")
    return "unknown option " + opt + " (the whole model runs on one device: --device cpu|cuda)";
  if (opt == "-md" || opt == "--model-draft")
    return "unknown option " + opt + " (the draft model is --draft-model DIR, with --spec draft)";
  if (opt == "--draft" || opt == "--draft-n" || opt == "--draft-min")
    return "unknown option " + opt + " (the most tokens drafted per step is --draft-max N)";
  return "unknown option " + opt;
}

CLI::Validator at_least(double lo) {
  return number_check([lo](double v) { return v >= lo; }, fmt::format("must be at least {}", lo),
                      fmt::format("NUMBER >= {}", lo));
}

CLI::Validator above(double lo) {
  return number_check([lo](double v) { return v > lo; }, fmt::format("must be above {}", lo),
                      fmt::format("NUMBER > {}", lo));
}

CLI::Validator between(double lo, double hi) {
  return number_check([lo, hi](double v) { return v >= lo && v <= hi; },
                      fmt::format("must be between {} and {}", lo, hi),
                      fmt::format("NUMBER in [{}, {}]", lo, hi));
}

CLI::Validator whole(int64_t lo, int64_t hi) {
  // Only a lower bound of the user's: the type's upper one is said only when it is passed.
  const bool open = hi == INT32_MAX;
  return CLI::Validator(
      [lo, hi, open](std::string& in) -> std::string {
        double v = 0;
        if (!is_number(in, v)) return "not a number: '" + in + "'";
        if (v != std::floor(v)) return "must be a whole number, got " + in;
        if (open && v < (double)lo) return fmt::format("must be at least {}, got {}", lo, in);
        if (open && v > (double)hi) return fmt::format("must be at most {}, got {}", hi, in);
        if (v < (double)lo || v > (double)hi)
          return fmt::format("must be between {} and {}, got {}", lo, hi, in);
        return "";
      },
      open ? fmt::format("INT >= {}", lo) : fmt::format("INT in [{}, {}]", lo, hi));
}

CLI::Validator token_count() {
  return number_check([](double v) { return v == -1 || (v >= 1 && v <= (1 << 30)); },
                      "must be -1 (up to the context) or between 1 and 1073741824",
                      "-1 or INT >= 1", /*integer=*/true);
}

std::string parse_error_message(const CLI::ParseError& e, const CLI::App& /*app*/) {
  const std::string what = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    // "The following argument(s) was/were not expected: a b": name an option first.
    std::istringstream words(what.substr(what.find(": ") + 2));
    std::string w, first, option;
    while (words >> w) {
      if (first.empty()) first = w;
      if (option.empty() && w.size() > 1 && w[0] == '-') option = w;
    }
    if (!option.empty()) return unknown_option_message(option);
    return "unexpected argument '" + first + "'";
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) && what.ends_with("missing")) {
    // "--prompt: 1 required TEXT missing"
    return what.substr(0, what.find(':')) + " needs a value";
  }
  if (dynamic_cast<const CLI::ExcludesError*>(&e)) {
    // "--prompt excludes --file"
    const size_t sp = what.find(" excludes ");
    if (sp != std::string::npos)
      return what.substr(0, sp) + " and " + what.substr(sp + 10) + " cannot be used together";
  }
  if (dynamic_cast<const CLI::ConversionError*>(&e)) {
    // "Could not convert: --top-k = 1e99"
    const size_t colon = what.find(": "), eq = what.find(" = ");
    if (colon != std::string::npos && eq != std::string::npos && eq > colon)
      return what.substr(colon + 2, eq - colon - 2) + ": not a valid value: '" +
             what.substr(eq + 3) + "'";
  }
  return what;
}

std::string unknown_short_option(const CLI::App& cmd, int argc, char** argv, int first) {
  auto takes_value = [](const CLI::Option* o) { return o && o->get_expected_max() > 0; };
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a.starts_with("--")) {
      if (a.find('=') == std::string::npos && takes_value(cmd.get_option_no_throw(a))) ++i;
      continue;
    }
    if (a.size() < 2 || a[0] != '-' || !std::isalpha((unsigned char)a[1])) continue;
    if (a.size() == 2) {
      if (takes_value(cmd.get_option_no_throw(a))) ++i;
      continue;
    }
    // Three or more letters: a cluster of flags (-qe) is fine, anything else is no option of
    // Kestrel's (a value glued on, -n128, has a digit).
    bool letters = true, flags = true;
    for (size_t k = 1; k < a.size(); ++k) {
      letters = letters && std::isalpha((unsigned char)a[k]);
      const CLI::Option* o = cmd.get_option_no_throw(std::string("-") + a[k]);
      flags = flags && o && !takes_value(o);
    }
    if (letters && !flags) return a;
  }
  return "";
}

std::string size_text(uint64_t bytes) {
  return bytes < (1ull << 30) ? fmt::format("{:.2f} MiB", bytes / 1048576.0)
                              : fmt::format("{:.2f} GiB", bytes / 1073741824.0);
}

std::string params_text(int64_t n) {
  return n < 1000000000 ? fmt::format("{:.2f} M", n / 1e6) : fmt::format("{:.2f} B", n / 1e9);
}

void add_model_options(CLI::App* cmd, ModelOptions& o) {
  cmd->add_option("-m,--model", o.dir, "model directory (Hugging Face layout)")->required();
  cmd->add_option("--device", o.device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("-c,--ctx-size", o.context,
                  "context length in tokens (0 = the model's max_position_embeddings)")
      ->check(whole(0))
      ->capture_default_str();
  cmd->add_option("-t,--threads", o.threads,
                  "CPU engine: threads (0 = the physical cores other programs leave idle, or "
                  "OMP_NUM_THREADS)")
      ->check(whole(0, 4096))
      ->capture_default_str();
  add_cache_type_options(cmd, o);
}

void add_cache_type_options(CLI::App* cmd, ModelOptions& o) {
  // The type's own message ("unknown cache type 'q4_0' (f16, q8_0 or fp8)"), which CLI11
  // prefixes with the option.
  const CLI::Validator type(
      [](std::string& v) -> std::string {
        try {
          parse_kv_type(v, "");
        } catch (const Error& e) {
          return std::string(e.what()).substr(2);  // past parse_kv_type's ": "
        }
        return "";
      },
      "f16|q8_0|fp8");
  cmd->add_option("--cache-type-k", o.cache_type_k,
                  "-ctk: the KV cache's type for K: f16, q8_0 (int8, a scale per 32 values) or "
                  "fp8 (E4M3, a scale per head and position)")
      ->check(type)
      ->capture_default_str();
  cmd->add_option("--cache-type-v", o.cache_type_v, "-ctv: the KV cache's type for V, as -ctk")
      ->check(type)
      ->capture_default_str();
}

KvCacheTypes cache_types(const ModelOptions& o) {
  return {parse_kv_type(o.cache_type_k, "--cache-type-k"), parse_kv_type(o.cache_type_v, "--cache-type-v")};
}

void rewrite_long_short_options(int argc, char** argv) {
  static std::string names[] = {"--cache-type-k", "--cache-type-v"};
  static std::vector<std::string> glued;  // "--cache-type-k=X": argv points into these
  glued.reserve(argc);
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") break;
    for (int n = 0; n < 2; ++n) {
      const std::string_view shrt = n == 0 ? "-ctk" : "-ctv";
      if (a == shrt) argv[i] = names[n].data();
      else if (a.starts_with(shrt) && a.size() > 4 && a[4] == '=')
        argv[i] = glued.emplace_back(names[n] + std::string(a.substr(4))).data();
    }
  }
}

ModelLoadOptions load_options(const ModelOptions& o, bool quiet, const DecodeTuning& tuning) {
  ModelLoadOptions lo;
  lo.dir = o.dir;
  lo.device = o.device;
  lo.context = o.context;
  lo.threads = o.threads;
  lo.quiet = quiet;
  lo.tuning = tuning;
  lo.cache = cache_types(o);
  return lo;
}

void add_sampling_options(CLI::App* cmd, SamplingOptions& s) {
  const SamplingParams d;  // Kestrel's defaults, under generation_config.json's
  cmd->add_option("--temp", s.temperature,
                  fmt::format("temperature (0 = greedy; default: generation_config.json's, else {})",
                              d.temperature))
      ->check(at_least(0));
  cmd->add_option("--top-k", s.top_k,
                  fmt::format("top-k sampling (0 = off; default: generation_config.json's, else {})",
                              d.top_k))
      ->check(whole(0));
  cmd->add_option("--top-p", s.top_p,
                  fmt::format("top-p sampling (1 = off; default: generation_config.json's, else {})",
                              d.top_p))
      ->check(between(0, 1));
  cmd->add_option("--min-p", s.min_p,
                  fmt::format("min-p sampling (0 = off; default: generation_config.json's, else {})",
                              d.min_p))
      ->check(between(0, 1));
  cmd->add_option("--repeat-penalty", s.repeat_penalty,
                  "repetition penalty (1 = off; default: generation_config.json's "
                  "repetition_penalty, else 1)")
      ->check(above(0));
  cmd->add_option("--repeat-last-n", s.repeat_last_n, "window of the penalties (-1 = all)")
      ->check(whole(-1, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", s.frequency_penalty, "frequency penalty")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", s.presence_penalty, "presence penalty")
      ->capture_default_str();
  // -1 (llama.cpp's default) or nothing: a random seed, printed.
  cmd->add_option_function<std::string>(
         "-s,--seed",
         [&s](const std::string& v) {
           if (v == "-1") s.seed.reset();
           else s.seed = std::stoull(v);
         },
         "random seed (-1 = random, printed; default -1)")
      ->type_name("INT")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            if (in == "-1") return "";
            char* end = nullptr;
            errno = 0;
            const unsigned long long v = std::strtoull(in.c_str(), &end, 10);
            (void)v;
            if (in.empty() || in[0] == '-' || end != in.c_str() + in.size() || errno == ERANGE)
              return "must be -1 (random) or between 0 and 18446744073709551615, got " + in;
            return "";
          },
          "-1 or INT >= 0"));
  cmd->add_option("--stop", s.stop, "stop string (repeatable); never printed");
  cmd->add_option("-r,--reverse-prompt", s.reverse,
                  "end the text when it ends with this (repeatable), shown, as llama-cli's -r");
  cmd->add_flag("--ignore-eos", s.ignore_eos, "keep generating past end-of-sequence");
}

SamplingParams resolve_sampling(const std::string& dir, const SamplingOptions& s) {
  SamplingParams p = default_sampling(dir);
  if (s.temperature) p.temperature = *s.temperature;
  if (s.top_k) p.top_k = *s.top_k;
  if (s.top_p) p.top_p = *s.top_p;
  if (s.min_p) p.min_p = *s.min_p;
  if (s.repeat_penalty) p.repeat_penalty = *s.repeat_penalty;
  p.repeat_last_n = s.repeat_last_n;
  p.frequency_penalty = s.frequency_penalty;
  p.presence_penalty = s.presence_penalty;
  p.seed = s.seed ? *s.seed : std::random_device{}();
  return p;
}

std::string describe_sampling(const SamplingParams& p) {
  if (p.temperature <= 0) return "greedy (temp 0)";
  std::string s = fmt::format("temp {}, top-k {}, top-p {}, min-p {}", p.temperature, p.top_k,
                              p.top_p, p.min_p);
  if (p.repeat_penalty != 1 || p.frequency_penalty != 0 || p.presence_penalty != 0)
    s += fmt::format(", repeat-penalty {}, frequency-penalty {}, presence-penalty {} over {}",
                     p.repeat_penalty, p.frequency_penalty, p.presence_penalty,
                     p.repeat_last_n < 0 ? std::string("all tokens")
                                         : fmt::format("the last {} tokens", p.repeat_last_n));
  return s + fmt::format(", seed {}", p.seed);
}

void add_spec_options(CLI::App* cmd, SpecOptions& s) {
  cmd->add_option("--spec", s.kind,
                  "speculative decoding: lookup (drafts from n-grams of the context) or draft "
                  "(a smaller model with the same vocabulary drafts, --draft-model); default off")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            if (in == "lookup" || in == "draft") return "";
            if (!in.empty() && in[0] == '-') return "needs a value, lookup or draft, before " + in;
            return "must be lookup or draft, got " + in;
          },
          "lookup|draft"));
  cmd->add_option("--draft-model", s.draft_model, "with --spec draft: the draft model's directory");
  cmd->add_option("--draft-max", s.draft_max,
                  "with --spec: most tokens drafted per step (adapted below it to the acceptance)")
      ->check(whole(1, kMaxDraftMax))
      ->each([&s](const std::string&) { s.draft_max_given = true; })
      ->capture_default_str();
}

void check_spec_options(const SpecOptions& s) {
  if (s.kind == "draft" && s.draft_model.empty())
    throw CLI::ValidationError("--spec draft needs --draft-model DIR (the drafting model)");
  if (!s.draft_model.empty() && s.kind != "draft")
    throw CLI::ValidationError("--draft-model goes with --spec draft");
  if (s.draft_max_given && s.kind.empty())
    throw CLI::ValidationError("--draft-max goes with --spec lookup or --spec draft");
  // A mistyped draft directory is found before the model loads, not after.
  if (!s.draft_model.empty()) {
    std::error_code ec;
    if (!std::filesystem::exists(s.draft_model, ec))
      throw CLI::ValidationError("--draft-model " + s.draft_model + ": no such directory");
    if (!std::filesystem::is_directory(s.draft_model, ec))
      throw CLI::ValidationError("--draft-model " + s.draft_model +
                                 ": not a directory (a model directory is expected)");
    if (!std::filesystem::exists(std::filesystem::path(s.draft_model) / "config.json", ec))
      throw CLI::ValidationError("--draft-model " + s.draft_model +
                                 ": no config.json (not a model directory)");
  }
}

namespace {

// "" when the draft's tokenizer and model agree with the target's on every id, else what
// differs first.
std::string vocabulary_difference(const LoadedModel& target, const LoadedModel& draft) {
  // The embedding tables may differ in size (padding rows past the tokenizer's ids, as
  // between Qwen2.5's small and large models); the tokenizers must not.
  const Tokenizer &t = *target.tok, &d = *draft.tok;
  if (t.vocab_size() != d.vocab_size())
    return fmt::format("{} tokens in its tokenizer against the model's {}", d.vocab_size(),
                       t.vocab_size());
  for (int id = 0; id < t.vocab_size(); ++id)
    if (t.piece(id) != d.piece(id))
      return fmt::format("token {} is '{}' there and '{}' in the model", id, d.piece(id),
                         t.piece(id));
  if (t.bos_id() != d.bos_id())
    return fmt::format("BOS id {} there and {} in the model", d.bos_id(), t.bos_id());
  if (t.eos_ids() != d.eos_ids())
    return fmt::format("EOS ids [{}] there and [{}] in the model", fmt::join(d.eos_ids(), ", "),
                       fmt::join(t.eos_ids(), ", "));
  return "";
}

}  // namespace

Speculation open_speculation(const SpecOptions& s, const LoadedModel& target,
                             const ModelOptions& target_opts, const SamplingParams& sampling,
                             bool quiet) {
  Speculation sp;
  if (s.kind == "lookup") {
    sp.drafter = std::make_unique<NgramDrafter>();
  } else if (s.kind == "draft") {
    ModelLoadOptions o = load_options(target_opts, /*quiet=*/true);
    o.dir = s.draft_model;
    o.device = target.device;
    // Errors of the draft's files say which model they are about.
    auto as_draft = [&](auto&& load) {
      try {
        return load();
      } catch (const Error& e) {
        // The loaders' messages mostly begin with the directory already.
        const std::string what = e.what();
        throw Error(what.rfind(s.draft_model, 0) == 0
                        ? "--draft-model " + what
                        : fmt::format("--draft-model {}: {}", s.draft_model, what));
      }
    };
    sp.draft = std::make_unique<LoadedModel>(as_draft([&] {
      // The target's context, or the draft's own limit where that is shorter: past it the
      // draft proposes nothing and the target decodes on alone.
      const int draft_max_pos = read_model_info(o.dir).config.max_pos;
      o.context = target.session->context_length();
      if (draft_max_pos > 0) o.context = std::min(o.context, draft_max_pos);
      return open_model(o);
    }));
    const std::string diff = vocabulary_difference(target, *sp.draft);
    if (!diff.empty())
      throw Error(fmt::format("--draft-model {}: its vocabulary differs from {}'s ({}); the "
                              "draft model must share the model's tokenizer",
                              s.draft_model, target_opts.dir, diff));
    as_draft([&] {
      load_weights(*sp.draft, o);
      return 0;
    });
    const int draft_ctx = sp.draft->session->context_length();
    note(quiet, fmt::format("draft model {} ({}) on {}, context {}{}", s.draft_model,
                            format_text(sp.draft->spec->config), sp.draft->model->device_name(),
                            draft_ctx,
                            draft_ctx < target.session->context_length()
                                ? fmt::format(" (its limit: past position {} it drafts nothing "
                                              "and the model decodes alone)", draft_ctx)
                                : std::string()));
    sp.drafter = std::make_unique<ModelDrafter>(*sp.draft->session, sampling,
                                                target.spec->config.vocab);
  }
  return sp;
}

void add_result(Perf& p, const GenerateResult& r) {
  p.prompt_ms += r.prompt_ms;
  p.prompt_tokens += (int64_t)r.prompt_ids.size() - r.n_cached;
  p.eval_ms += r.gen_ms - r.sample_ms;
  p.eval_runs += r.n_eval;
  p.sample_ms += r.sample_ms;
  p.sampled += r.n_sampled;
  p.device_chosen += r.n_device;
  p.generated += (int64_t)r.ids.size();
  p.drafted += r.n_drafted;
  p.accepted += r.n_accepted;
  p.steps += r.n_steps;
  // Every id but a generation's first came from a verify pass.
  if (r.n_steps > 0) p.step_ids += (int64_t)r.ids.size() - 1;
}

void print_perf(const Perf& p, const std::string& device) {
  const double total =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p.start).count();
  auto rate = [](double ms, int64_t n) {
    return fmt::format("({:8.2f} ms per token, {:8.2f} tokens per second)", n ? ms / n : 0.0,
                       ms > 0 ? n * 1000.0 / ms : 0.0);
  };
  std::string s;
  s += fmt::format("\nperf:        load time = {:10.2f} ms ({})\n", p.load_ms, device);
  s += fmt::format("perf: prompt eval time = {:10.2f} ms / {:5} tokens {}\n", p.prompt_ms,
                   p.prompt_tokens, rate(p.prompt_ms, p.prompt_tokens));
  s += fmt::format("perf:        eval time = {:10.2f} ms / {:5} runs   {}\n", p.eval_ms,
                   p.eval_runs, rate(p.eval_ms, p.eval_runs));
  s += fmt::format("perf:    sampling time = {:10.2f} ms / {:5} runs   {}\n", p.sample_ms,
                   p.sampled, rate(p.sample_ms, p.sampled));
  if (p.device_chosen > 0)
    s += fmt::format("perf: chosen by the model = {:5} tokens (its argmax or top-k sampler, timed in eval)\n",
                     p.device_chosen);
  if (p.speculative && p.steps == 0)
    s += "perf:      speculative = no verify pass (a single token each)\n";
  else if (p.speculative)
    s += fmt::format("perf:      speculative = {:5} drafted, {:5} accepted ({:.1f}%), {:.2f} "
                     "tokens per step ({} steps)\n",
                     p.drafted, p.accepted, p.drafted ? 100.0 * p.accepted / p.drafted : 0.0,
                     (double)p.step_ids / p.steps, p.steps);
  s += fmt::format("perf:       total time = {:10.2f} ms / {:5} tokens\n", total,
                   p.prompt_tokens + p.generated);
  std::cerr << s << std::flush;
}

std::string read_text_file(const std::string& path) { return read_regular_file(path); }

void add_grammar_options(CLI::App* cmd, GrammarOptions& g) {
  auto* gr = cmd->add_option("--grammar", g.grammar_file,
                             "constrain the output to a GBNF grammar (llama.cpp's format) in FILE")
                 ->type_name("FILE");
  auto* js = cmd->add_option("--json-schema", g.json_schema,
                             "constrain the output to JSON matching a JSON Schema: a FILE, or "
                             "inline JSON starting with '{'")
                 ->type_name("FILE|JSON");
  auto* jo = cmd->add_flag("--json-object", g.json_object, "constrain the output to a JSON object");
  gr->excludes(js)->excludes(jo);
  js->excludes(gr)->excludes(jo);
  jo->excludes(gr)->excludes(js);
}

void check_grammar_options(const GrammarOptions& g, const SpecOptions& spec) {
  if (g.given() && !spec.kind.empty())
    throw CLI::ValidationError(
        "--spec does not go with --grammar, --json-schema or --json-object (drafts are not "
        "checked against the grammar)");
}

std::shared_ptr<const grammar::Grammar> load_grammar(const GrammarOptions& g) {
  if (!g.given()) return nullptr;
  if (!g.grammar_file.empty()) {
    const std::string text = read_text_file(g.grammar_file);
    try {
      return grammar::Grammar::parse(text);
    } catch (const Error& e) {
      // "grammar:3:7: what" names the file instead; "grammar: no rule ..." keeps its word.
      const std::string what = e.what();
      if (what.starts_with("grammar:") && what.size() > 8 && std::isdigit((unsigned char)what[8]))
        throw Error(g.grammar_file + ":" + what.substr(8));
      throw Error(g.grammar_file + ": " + what);
    }
  }
  std::string gbnf;
  if (g.json_object) {
    gbnf = grammar::json_object_gbnf();
  } else {
    const size_t first = g.json_schema.find_first_not_of(" \t\r\n");
    const bool inline_json = first != std::string::npos && g.json_schema[first] == '{';
    const std::string where = inline_json ? "--json-schema" : g.json_schema;
    try {
      gbnf = grammar::json_schema_to_gbnf(inline_json ? g.json_schema : read_text_file(g.json_schema));
    } catch (const Error& e) {
      // read_text_file names the file itself.
      const std::string what = e.what();
      throw Error(what.starts_with("json schema:") ? where + ": " + what : what);
    }
  }
  return grammar::Grammar::parse(gbnf);
}

std::string grammar_note(const GrammarOptions& g, const GenerateResult& r) {
  if (!g.given() || r.grammar_complete || r.finish_reason == "cancelled") return "";
  const std::string why = r.finish_reason == "length" ? "the token limit (-n)" : "a stop string";
  return "note: " + why + " ended the text before the grammar was complete; the output is incomplete";
}

CLI::Option* add_template_kwargs_option(CLI::App* cmd, std::string& text) {
  return cmd->add_option("--chat-template-kwargs", text,
                         "extra variables of the model's chat template, a JSON object "
                         "(as vLLM's chat_template_kwargs): '{\"enable_thinking\": false}'")
      ->type_name("JSON");
}

nlohmann::json parse_template_kwargs(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    throw CLI::ValidationError("--chat-template-kwargs: not valid JSON: " + text);
  }
  try {
    check_template_kwargs(j);
  } catch (const Error& e) {
    throw CLI::ValidationError(std::string("--chat-template-kwargs: ") + e.what());
  }
  return j;
}

void check_template_kwargs_use(const nlohmann::json& kwargs, const ChatTemplate& tmpl) {
  if (!kwargs.is_null() && !tmpl.is_jinja())
    throw Error("--chat-template-kwargs goes with a Jinja chat template (the model's own or "
                "--template FILE.jinja), not the " + tmpl.describe());
}

std::string process_escapes(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    switch (c) {
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case 'x':
        if (i + 2 < s.size() && std::isxdigit((unsigned char)s[i + 1]) &&
            std::isxdigit((unsigned char)s[i + 2])) {
          out += (char)std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16);
          i += 2;
          break;
        }
        [[fallthrough]];
      default:
        out += '\\';
        out += c;
    }
  }
  return out;
}

}  // namespace kestrel::cli
