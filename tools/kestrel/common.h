// Pieces shared by the `kestrel` subcommands: model options, loading, messages.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/registry.h"
#include "engine/generate.h"
#include "models/io/model_spec.h"
#include "engine/sampler.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

// Number checks for CLI11 options, with one plain message ("--repetitions: must be at least
// 1, got 0"); CLI11's PositiveNumber and NonNegativeNumber print their range up to DBL_MAX in
// full, and Range its bounds with six decimals.
CLI::Validator at_least(double lo);
CLI::Validator above(double lo);
CLI::Validator between(double lo, double hi);  // lo <= value <= hi

struct ModelOptions {
  std::string dir;
  std::string device = "auto";  // auto | cpu | cuda
  int context = 0;              // 0 = the model's max_position_embeddings
};

void add_model_options(CLI::App* cmd, ModelOptions& o);

struct LoadedModel {
  std::unique_ptr<ModelSpec> spec;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Model> model;
  std::unique_ptr<Session> session;  // the command's sequence over the model
  std::string device;  // "cpu" or "cuda"
  double load_ms = 0;
};

// Resolves the device ("auto": cuda when a usable GPU is present), checks the model
// directory and loads the tokenizer and the weights. Throws kestrel::Error.
LoadedModel load_model(const ModelOptions& o, bool quiet);
// The same in two steps, so that a command can check its prompts against the tokenizer and
// the context before the weights load: open_model reads the tokenizer and the model spec,
// load_weights loads the model and opens its session (CUDA draws its progress bar; the CPU,
// which cannot report progress, prints one line when done). Both unless quiet. `tuning` is
// the CUDA decode path's (kestrel bench sets it).
LoadedModel open_model(const ModelOptions& o, bool quiet);
void load_weights(LoadedModel& m, const ModelOptions& o, bool quiet,
                  const DecodeTuning& tuning = {});
// The context the session will have: -c, or the model's max_position_embeddings.
int context_length(const LoadedModel& m, const ModelOptions& o);

// Sampling options as llama.cpp spells them; unset ones come from generation_config.json.
struct SamplingOptions {
  std::optional<float> temperature;
  std::optional<int> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repeat_penalty;
  int repeat_last_n = 64;
  float frequency_penalty = 0, presence_penalty = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};
void add_sampling_options(CLI::App* cmd, SamplingOptions& s);
// generation_config.json's defaults overridden by the options; a random seed when none is
// given (the caller prints it).
SamplingParams resolve_sampling(const std::string& dir, const SamplingOptions& s);

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
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};
void add_result(Perf& p, const GenerateResult& r);
// Prints the block to stderr.
void print_perf(const Perf& p, const std::string& device);

// Sampling defaults from <dir>/generation_config.json (temperature, top_k, top_p; do_sample
// false means greedy), over Kestrel's own defaults.
SamplingParams default_sampling(const std::string& dir);

// Reads a whole text file; throws kestrel::Error naming it when missing or unreadable.
std::string read_text_file(const std::string& path);

// Prints a one-line note to stderr unless quiet.
void note(bool quiet, const std::string& msg);

}  // namespace kestrel::cli
