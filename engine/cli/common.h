// Pieces shared by the `kestrel` subcommands: model options, loading, messages.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/model_spec.h"
#include "engine/sampler.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

struct ModelOptions {
  std::string dir;
  std::string device = "auto";  // auto | cpu | cuda
  int context = 0;              // 0 = the model's max_position_embeddings
};

void add_model_options(CLI::App* cmd, ModelOptions& o);

struct LoadedModel {
  std::unique_ptr<ModelSpec> spec;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Backend> backend;
  std::string device;  // "cpu" or "cuda"
  double load_ms = 0;
};

// Resolves the device ("auto": cuda when a usable GPU is present), checks the model
// directory and loads the tokenizer and the weights. Throws kestrel::Error.
LoadedModel load_model(const ModelOptions& o, bool quiet);

// Sampling defaults from <dir>/generation_config.json (temperature, top_k, top_p; do_sample
// false means greedy), over Kestrel's own defaults.
SamplingParams default_sampling(const std::string& dir);

// Reads a whole text file; throws kestrel::Error naming it when missing or unreadable.
std::string read_text_file(const std::string& path);

// Prints a one-line note to stderr unless quiet.
void note(bool quiet, const std::string& msg);

}  // namespace kestrel::cli
