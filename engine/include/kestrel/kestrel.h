// Kestrel as a library: load a model once, open sessions (one sequence each) over it,
// tokenize, generate with a callback per piece of text, score perplexity.
//
//   #include <kestrel/kestrel.h>
//   kestrel::api::Model model = kestrel::api::Model::load("models/llama-gptq");  // cuda if usable
//   std::unique_ptr<kestrel::api::Session> chat = model.new_session();
//   kestrel::api::GenerateOptions o;
//   o.max_tokens = 64;
//   chat->generate("The capital of France is", o, [](std::string_view t) { std::cout << t; });
//
// Link with CMake: find_package(kestrel) and target_link_libraries(app PRIVATE kestrel::kestrel).
// Every function reports a failure (missing or unsupported model, prompt longer than the
// context, out of GPU memory) by throwing kestrel::api::Error with one line naming what and
// where. A Model is a shared handle: copies refer to one loaded model, which lives as long as
// any copy or session of it. Sessions of one model take turns (use them from one thread at a
// time); each holds its own KV cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#define KESTREL_API __attribute__((visibility("default")))

namespace kestrel::api {

class KESTREL_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// New fields go at the end, so that the ones before keep their offsets; the struct's size
// still changes, so a program built against an older header is rebuilt with the new one.
struct LoadOptions {
  std::string device = "auto";  // "cpu", "cuda", or "auto" (cuda when a GPU is usable)
  bool quiet = true;            // false: a progress bar and notes on stderr
  // The CPU engine's threads for the calls made from the thread that loads the model (0 =
  // leave that thread's setting: one thread unless set before); calls from other threads run
  // on one thread each. The setting belongs to one thread: loading another model with threads
  // from another thread moves it there.
  int threads = 0;
  // The KV cache's types for K and V: "f16" (the default), "q8_0" (int8, an fp16 scale per 32
  // values) or "fp8" (E4M3, a scale per head and position); anything else is an Error.
  std::string cache_type_k = "f16";
  std::string cache_type_v = "f16";
};

struct GenerateOptions {
  int max_tokens = 128;
  float temperature = 0.0f;     // 0 = greedy
  int top_k = 40;               // 0 = off
  float top_p = 0.95f;          // 1 = off
  float min_p = 0.05f;          // 0 = off
  float repeat_penalty = 1.0f;  // 1 = off
  uint64_t seed = 0;            // of the sampler's random numbers
  std::vector<std::string> stop;  // generation ends before any of these, which is not returned
  bool ignore_eos = false;
};

struct GenerateResult {
  std::string text;            // the generated text, cut before a stop string
  std::vector<int> ids;        // generated ids
  std::string finish_reason;   // "length", "eos" or "stop"
  int prompt_tokens = 0;       // ids of the prompt
  int cached_tokens = 0;       // of which the session's cache already held
  double prompt_ms = 0, generation_ms = 0;
};

struct PerplexityResult {
  double perplexity = 0;
  int64_t tokens = 0;     // of the text, BOS included
  int64_t windows = 0;    // scored
  double seconds = 0;
};

class Session;

class KESTREL_API Model {
 public:
  // Loads the Hugging Face model directory `dir` (config.json, safetensors, tokenizer).
  static Model load(const std::string& dir, const LoadOptions& options = {});

  std::string device() const;    // "CPU (reference, fp32)" or the GPU's name
  std::string architecture() const;  // config.json's, e.g. "LlamaForCausalLM"
  int max_context() const;       // max_position_embeddings
  int vocab_size() const;

  // Token ids of `text`, with the tokenizer's BOS unless add_special is false.
  std::vector<int> tokenize(std::string_view text, bool add_special = true) const;
  std::string detokenize(const std::vector<int>& ids) const;

  // A new sequence with a KV cache of `context` positions (0 = max_context()).
  std::unique_ptr<Session> new_session(int context = 0) const;

  // Perplexity of `text` (tokenized once with BOS) over windows of `window` tokens, each from
  // an empty cache, as llama-perplexity computes it; `max_windows` 0 scores all.
  PerplexityResult perplexity(std::string_view text, int window = 512,
                              int64_t max_windows = 0) const;

  struct Impl;

 private:
  explicit Model(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

class KESTREL_API Session {
 public:
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int context_length() const;

  // Generates after `prompt`, the whole text of the sequence so far (BOS added as the
  // tokenizer does). Only the part after the longest prefix the session's cache already holds
  // runs, so a conversation that grows turn by turn pays for its new turn only. `on_text`
  // receives the text as it becomes final (complete UTF-8, never part of a stop string).
  GenerateResult generate(std::string_view prompt, const GenerateOptions& options = {},
                          const std::function<void(std::string_view)>& on_text = {});
  // The same from token ids.
  GenerateResult generate(const std::vector<int>& prompt_ids, const GenerateOptions& options = {},
                          const std::function<void(std::string_view)>& on_text = {});

  struct Impl;

 private:
  friend class Model;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::api
