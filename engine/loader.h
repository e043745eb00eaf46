// From a model directory to what a program runs: the one loader of the library
// (engine/include/kestrel/kestrel.h) and of the `kestrel` command. It checks the directory,
// reads the tokenizer and the checkpoint's spec, fits the context to the device's memory, sets
// the CPU engine's threads, loads the weights and opens the program's session.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "models/io/model_spec.h"
#include "models/model.h"
#include "models/registry.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

struct ModelLoadOptions {
  std::string dir;
  std::string device = "auto";  // auto | cpu | cuda
  int context = 0;              // 0 = the model's max_position_embeddings
  int threads = 0;              // CPU engine: threads (0 = the idle cores; engine/cpu_threads.h)
  bool quiet = true;            // false: notes and the progress bar on stderr
  DecodeTuning tuning;          // the CUDA decode path's (kestrel bench sets it)
  KvCacheTypes cache;           // -ctk / -ctv: the K and V cache types (f16, q8_0, fp8)
  // load_weights opens a session of the context: a program's load. false: the library's, which
  // opens sessions later (new_session checks each one's memory) and keeps the CPU threads as
  // they are unless threads > 0.
  bool open_session = true;
};

struct LoadedModel {
  std::unique_ptr<ModelSpec> spec;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Model> model;
  std::unique_ptr<Session> session;  // the program's sequence over the model
  std::string device;  // "cpu" or "cuda"
  double load_ms = 0;
  int context = 0;     // the context the session will be opened with (0 = the model's)

  const ModelConfig& config() const { return spec->config; }
};

// Resolves the device ("auto": cuda when a usable GPU is present), checks the model directory
// and loads the tokenizer and the weights. Throws kestrel::Error.
LoadedModel load_model(const ModelLoadOptions& o);
// The same in two steps, so that a program can check its prompts against the tokenizer and
// the context before the weights load: open_model reads the tokenizer and the model spec and
// checks that the KV cache of the context fits the device's memory (-c too long for it is an
// error naming the bytes; the CPU engine's default context is shortened with a note, as the
// GPU engine does), load_weights loads the model and opens its session (CUDA draws its
// progress bar; the CPU, which cannot report progress, prints one line when done). Both unless
// quiet.
LoadedModel open_model(const ModelLoadOptions& o);
void load_weights(LoadedModel& m, const ModelLoadOptions& o);
// The context the session will have: -c, or the model's max_position_embeddings (shortened
// where the host's memory is short, see open_model).
int context_length(const LoadedModel& m, const ModelLoadOptions& o);

// ", q8_0 KV cache of 4.2 MiB" (", q8_0 K, fp8 V KV cache ..." where they differ) for a
// note, where the cache is quantized; "" for f16 (the default, whose notes stay as they were).
// bytes 0: no size.
std::string cache_types_text(KvCacheTypes kv, size_t bytes);

// The share of the host memory left beside the weights that the CPU engine's default context
// may take for its KV cache. Not all of it: host memory is shared with every other program, and
// a model whose max_position_embeddings is 2^31 - 1 would otherwise take the whole machine. An
// explicit -c may take all of it.
constexpr double kCpuDefaultContextShare = 0.5;

// How a context fits `room` bytes (<= 0: none) at `per_pos` bytes of KV cache a position: an
// asked one (-c, > 0) whole or not at all; the default (asked 0: max_pos) shortened to what
// `default_share` of room holds, rounded down to a multiple of 256 from 512 up. context is 0
// when nothing fits (the default's floor is 16 positions); fits is what all of room holds,
// the most -c may ask.
struct ContextFit {
  int context = 0;
  int64_t fits = 0;
};
ContextFit fit_context(int asked, int max_pos, double per_pos, double room, double default_share);

// The CPU engine's threads, for its one-to-few-row linears (OpenMP) and its batched ones
// (OpenBLAS) alike, for calls from the calling thread (0 = OMP_NUM_THREADS or one per core;
// kernels/matmul/matmul.h says why per thread). open_model sets o.threads so, or without it
// default_cpu_threads(), for a program (open_session), and for the library only where
// threads > 0.
void set_cpu_threads(int threads);
int cpu_threads();  // the team set for the calling thread
// "28.6 TiB", "512.0 MiB", "640 B".
std::string bytes_text(double bytes);
// Free host memory the kernel would give without swapping (MemAvailable), 0 when unknown.
double host_available_bytes();

// The threads without -t (engine/cpu_threads.h): 0 (OpenMP's) where OMP_NUM_THREADS is set,
// else the cores other programs leave idle over a 100 ms sample. No note: it would come and go
// with the machine's load (--verbose's device line shows the count).
int default_cpu_threads();

// Prints msg and a newline to stderr unless quiet: the loader's notes, and the CLI's.
void note(bool quiet, const std::string& msg);

// Sampling defaults from <dir>/generation_config.json (temperature, top_k, top_p, min_p,
// repetition_penalty; do_sample false means greedy), over Kestrel's own defaults.
SamplingParams default_sampling(const std::string& dir);

// A model's weight format: "GPTQ 4-bit g128 act-order", "F16".
std::string format_text(const ModelConfig& c);
// A model's linears grouped by format for display, where dynamic rules give them several:
// runs of consecutive layers whose linears have the same formats, and within a run the
// linears of each format, in layer order. Empty when the config has no dynamic rules.
struct LinearFormatGroup {
  int first_layer = 0, last_layer = 0;
  std::vector<std::string> modules;  // short names: q_proj, k_proj, ...
  std::optional<LinearQuant> quant;  // nullopt: unquantized
  std::string format;                // e.g. "GPTQ 8-bit g32", "float16 (unquantized)"
};
std::vector<LinearFormatGroup> linear_format_groups(const ModelConfig& c, const std::string& where);
// Its parameters, from the shapes of config.json (norms and biases left out).
int64_t count_params(const ModelConfig& c);

// What a model directory holds, read without its weights (kestrel info): config.json with its
// quantization config and the safetensors headers.
struct ModelInfo {
  ModelConfig config;
  uint64_t weight_bytes = 0;  // of every safetensors shard
};
ModelInfo read_model_info(const std::string& dir);

}  // namespace kestrel
