// kestrel-synth: writes a complete Hugging Face model directory with random weights.
#pragma once

#include <cstdint>
#include <string>

namespace kestrel::synth {

struct SynthOptions {
  std::string shape = "tiny";  // tiny | 1b | 7b | 13b | custom (explicit dims below)
  // Explicit dimensions override the shape's when > 0.
  int hidden = 0, intermediate = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab = 0,
      max_pos = 0, head_dim = 0;
  std::string dtype = "fp16";  // fp16 | gptq
  int bits = 4;
  int group_size = 128;        // -1 = per channel
  bool act_order = false;
  // Act-order: one permutation per linear, not one per input (q, k, v share theirs in a GPTQ
  // checkpoint, as do gate and up). Such linears cannot be fused.
  bool g_idx_per_linear = false;
  bool asym = false;
  std::string format = "gptq"; // gptq | gptq_v2
  bool tie_embeddings = false;
  uint64_t seed = 0;
  std::string out;             // output directory (created)
  std::string tokenizer;       // path of a tokenizer.model to copy; empty = train one
  bool quiet = false;          // no summary line, no warnings
  int threads = 0;             // worker threads; 0 = all hardware threads. Output does not depend on it.
};

// Writes the model; throws kestrel::Error on bad options or I/O failure.
void write_model(const SynthOptions& opt);

}  // namespace kestrel::synth
