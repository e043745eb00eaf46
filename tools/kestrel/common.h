// Pieces shared by the `kestrel` subcommands: model options, loading, messages.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "engine/loader.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

// Number checks for CLI11 options, with one plain message ("--repetitions: must be at least
// 1, got 0"); CLI11's PositiveNumber and NonNegativeNumber print their range up to DBL_MAX in
// full, and Range its bounds with six decimals.
CLI::Validator at_least(double lo);
CLI::Validator above(double lo);
CLI::Validator between(double lo, double hi);  // lo <= value <= hi
// For an integer option: a whole number in [lo, hi] ("--top-k: must be between 0 and
// 2147483647, got 99999999999999"), checked before CLI11 converts it, which would say only
// "Could not convert".
CLI::Validator whole(int64_t lo, int64_t hi = INT32_MAX);
// -n: -1 (up to the end of the context) or a count of at least 1.
CLI::Validator token_count();

// A command-line mistake as one plain line without the "kestrel: " ("unknown option -ngl",
// "--prompt needs a value"); `cmd` is the subcommand being parsed, or the app.
std::string parse_error_message(const CLI::ParseError& e, const CLI::App& app);
// "unknown option -ngl", with a word on why where it is one of llama.cpp's.
std::string unknown_option_message(const std::string& opt);
// The first argument of argv[first..] that CLI11 would read as a short option with its value
// glued on but that is a multi-letter option of llama.cpp's (-ngl 99 would read as -n gl):
// "-ngl". Empty when there is none.
std::string unknown_short_option(const CLI::App& cmd, int argc, char** argv, int first);

// The model options every command takes (-m, --device, -c, -t, -ctk, -ctv).
struct ModelOptions {
  std::string dir;
  std::string device = "auto";  // auto | cpu | cuda
  int context = 0;              // 0 = the model's max_position_embeddings
  int threads = 0;              // CPU engine: threads (0 = default_cpu_threads)
  std::string cache_type_k = "f16", cache_type_v = "f16";  // f16 | q8_0 | fp8
};

void add_model_options(CLI::App* cmd, ModelOptions& o);
// The cache-type options alone (kestrel info takes them without the rest).
void add_cache_type_options(CLI::App* cmd, ModelOptions& o);
KvCacheTypes cache_types(const ModelOptions& o);
// llama.cpp spells the cache types' options -ctk and -ctv, which CLI11 cannot name (one letter
// after a single dash): argv's -ctk / -ctv (and -ctk=X) become --cache-type-k / -v, up to a
// "--". The strings live as long as the program (argv's do).
void rewrite_long_short_options(int argc, char** argv);

// The loader's options (engine/loader.h) for the command's: its notes and progress bar unless
// quiet; `tuning` is the CUDA decode path's (kestrel bench sets it).
ModelLoadOptions load_options(const ModelOptions& o, bool quiet, const DecodeTuning& tuning = {});

// Sampling options as llama.cpp spells them; unset ones come from generation_config.json.
struct SamplingOptions {
  std::optional<float> temperature;
  std::optional<int> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repeat_penalty;
  int repeat_last_n = 64;
  float frequency_penalty = 0, presence_penalty = 0;
  std::optional<uint64_t> seed;  // unset (or -s -1): random
  std::vector<std::string> stop;
  std::vector<std::string> reverse;  // -r: generation ends after one, which is printed
  bool ignore_eos = false;
};
void add_sampling_options(CLI::App* cmd, SamplingOptions& s);
// generation_config.json's defaults overridden by the options; a random seed when none is
// given (the caller prints it).
SamplingParams resolve_sampling(const std::string& dir, const SamplingOptions& s);
// "temp 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat-penalty 1 (last 64), seed 42", for --verbose.
std::string describe_sampling(const SamplingParams& p);

// Speculative decoding (engine/speculative.h, docs/speculative.md): --spec lookup|draft,
// --draft-model DIR, --draft-max N.
struct SpecOptions {
  std::string kind;         // "" (off), "lookup" or "draft"
  std::string draft_model;  // --spec draft: the drafting model's directory
  int draft_max = kDefaultDraftMax;
  bool draft_max_given = false;  // --draft-max on the command line (it needs --spec)
};
// Adds the options; check_spec_options, from the command's callback, refuses the combinations
// that would do nothing or cannot work (--spec draft without --draft-model, and the reverse).
void add_spec_options(CLI::App* cmd, SpecOptions& s);
void check_spec_options(const SpecOptions& s);
struct Speculation {
  std::unique_ptr<LoadedModel> draft;  // --spec draft: the draft model and its session
  std::unique_ptr<Drafter> drafter;    // null without --spec
};
// The drafter --spec asks for. With --spec draft the draft model is opened on the target's
// device with a session of the target's context, after its vocabulary is checked against the
// target's (size, every token string, BOS and EOS ids): a difference is an error naming it.
Speculation open_speculation(const SpecOptions& s, const LoadedModel& target,
                             const ModelOptions& target_opts, const SamplingParams& sampling,
                             bool quiet);

// Structured output (docs/grammar.md): --grammar FILE (GBNF), --json-schema FILE|JSON (inline
// JSON when it starts with '{'), --json-object; at most one of them, and not with --spec.
struct GrammarOptions {
  std::string grammar_file;
  std::string json_schema;
  bool json_object = false;
  bool given() const { return !grammar_file.empty() || !json_schema.empty() || json_object; }
};
// Adds the options (mutually exclusive); check_grammar_options, from the command's callback,
// refuses them with --spec (speculative decoding's drafts are not checked against a grammar).
void add_grammar_options(CLI::App* cmd, GrammarOptions& g);
void check_grammar_options(const GrammarOptions& g, const SpecOptions& spec);
// The compiled grammar (null when none was asked for), read before the model loads so that a
// mistake costs no loading: throws kestrel::Error in one line, "FILE:LINE:COL: what" for GBNF
// that does not parse, "FILE: json schema: /POINTER: what" for a schema the converter refuses.
std::shared_ptr<const grammar::Grammar> load_grammar(const GrammarOptions& g);
// The note when a grammar's text was cut short ("" when it is complete or there is no grammar).
std::string grammar_note(const GrammarOptions& g, const GenerateResult& r);

// Totals of a run for the closing performance block (llama.cpp's llama_perf_context_print).
struct Perf {
  double load_ms = 0;
  double prompt_ms = 0;
  int64_t prompt_tokens = 0;  // tokens run through the model as prompt (cached ones excluded)
  double eval_ms = 0;
  int64_t eval_runs = 0;      // generated tokens run through the model one at a time
  double sample_ms = 0;
  int64_t sampled = 0;
  int64_t device_chosen = 0;  // tokens the model chose on its device (timed within eval)
  int64_t generated = 0;
  int64_t drafted = 0, accepted = 0, steps = 0;  // speculative decoding
  int64_t step_ids = 0;  // the ids those steps produced (tokens per step = step_ids / steps)
  bool speculative = false;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};
void add_result(Perf& p, const GenerateResult& r);
// Prints the block to stderr.
void print_perf(const Perf& p, const std::string& device);

// --chat-template-kwargs JSON (generate, chat, serve): extra variables of the chat template,
// as vLLM's chat_template_kwargs ({"enable_thinking": false} for Qwen3).
CLI::Option* add_template_kwargs_option(CLI::App* cmd, std::string& text);
// The option's object (null when not given); throws CLI::ValidationError in one line
// ("--chat-template-kwargs: ...") unless it is a JSON object check_template_kwargs takes.
nlohmann::json parse_template_kwargs(const std::string& text);
// A built-in format has no variables to set: kwargs with one is refused (kestrel::Error), as
// options that would do nothing are.
void check_template_kwargs_use(const nlohmann::json& kwargs, const ChatTemplate& tmpl);

// Reads a whole text file; throws kestrel::Error naming it when missing, not a regular file
// ("data is a directory") or unreadable (base/files.h).
std::string read_text_file(const std::string& path);

// llama.cpp's -e: \n, \r, \t, \', \", \\ and \xHH become the characters they name; any other
// backslash stays as written.
std::string process_escapes(std::string_view s);


// Size and parameter count as llama-bench prints them: MiB and M below a GiB and a billion.
std::string size_text(uint64_t bytes);
std::string params_text(int64_t n);

}  // namespace kestrel::cli
