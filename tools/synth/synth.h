// kestrel-synth: writes a complete Hugging Face model directory with random weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kestrel::synth {

struct SynthOptions {
  // tiny | 1b | 7b | 13b (Llama 2 era) | llama3-8b | llama3.2-1b | qwen2.5-7b | qwen3-8b |
  // opt-6.7b | custom (explicit dims below)
  std::string shape = "tiny";
  // The family (arch_names()): a family of the table in models/io/families.cpp, or a variant
  // of one (llama3: Llama with Llama 3's RoPE); empty = the shape's own (llama for tiny, 1b, 7b,
  // 13b, custom).
  std::string arch;
  int sliding_window = -1;     // Mistral's window; -1 = 32 at the tiny shape, else 4096
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
  // GPTQModel's per-module overrides as JSON text, e.g. {"-:.*down_proj": {}, ".*\\.1\\..*":
  // {"bits": 8}} (models/io/dynamic.h): written into the quantization config as is, and each
  // linear is written in the format its rule gives it, FP16 where a "-:" rule matches it.
  // Empty = every linear in the format above.
  std::string dynamic;
  bool tie_embeddings = false;
  uint64_t seed = 0;
  std::string out;             // output directory (created; written whole or not at all)
  bool force = false;          // replace a non-empty `out` (once the new model is complete)
  // A tokenizer to copy: a tokenizer.model, a tokenizer.json (with the tokenizer_config.json
  // beside it), or a folder holding either or GPT-2's vocab.json + merges.txt; the vocabulary
  // is sized from it where the shape does not fix one. Empty = train a small SentencePiece one.
  std::string tokenizer;
  bool quiet = false;          // no summary line, no warnings
  int threads = 0;             // worker threads; 0 = all hardware threads. Output does not depend on it.
};

// The --arch names: every family's (models/io/family.h), each followed by synth's variants of it.
std::vector<std::string> arch_names();

// Writes the model into a temporary directory beside `out`, renamed to `out` once complete;
// throws kestrel::Error on bad options or I/O failure, leaving `out` as it was.
void write_model(const SynthOptions& opt);

}  // namespace kestrel::synth
