// kestrel-synth: writes a Hugging Face model directory with random weights, for tests,
// demos and benchmarks at real shapes. A thin command line over kestrel::synth::write_model.
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "base/staged_output.h"
#include "tools/synth/synth.h"

int main(int argc, char** argv) {
  kestrel::synth::SynthOptions o;
  CLI::App app{"kestrel-synth: writes a Hugging Face model directory with random weights"};
  app.set_version_flag("--version", "kestrel-synth " KESTREL_VERSION);
  app.add_option("--out", o.out, "Output directory (created)")->required();
  app.add_flag("--force", o.force,
               "Replace a non-empty --out (only once the new model is complete)");
  app.add_option("--shape", o.shape,
                 "tiny | 1b | 7b | 13b | llama3-8b | llama3.2-1b | qwen2.5-7b | qwen3-8b | "
                 "opt-6.7b | custom")->capture_default_str();
  std::string archs;
  for (const std::string& a : kestrel::synth::arch_names()) archs += (archs.empty() ? "" : " | ") + a;
  app.add_option("--arch", o.arch, archs + " (default: the shape's family)");
  app.add_option("--sliding-window", o.sliding_window,
                 "Mistral's attention window (default 32 at the tiny shape, else 4096)");
  app.add_option("--hidden", o.hidden, "hidden_size (overrides the shape)");
  app.add_option("--intermediate", o.intermediate, "intermediate_size");
  app.add_option("--layers", o.n_layers, "num_hidden_layers");
  app.add_option("--heads", o.n_heads, "num_attention_heads");
  app.add_option("--kv-heads", o.n_kv_heads, "num_key_value_heads");
  app.add_option("--head-dim", o.head_dim, "head_dim (default hidden / heads)");
  app.add_option("--vocab", o.vocab, "vocab_size (default: the shape's, or the tokenizer's size)");
  app.add_option("--max-pos", o.max_pos, "max_position_embeddings");
  app.add_option("--dtype", o.dtype, "fp16 | gptq")->capture_default_str();
  app.add_option("--bits", o.bits, "GPTQ bits: 2, 3, 4 or 8")->capture_default_str();
  app.add_option("--group-size", o.group_size, "GPTQ group size; -1 = one group per row")
      ->capture_default_str();
  app.add_flag("--act-order", o.act_order, "GPTQ act-order (desc_act): random g_idx permutation");
  app.add_flag("--g-idx-per-linear", o.g_idx_per_linear,
               "With --act-order: a permutation per linear, not one shared by q/k/v and by "
               "gate/up as GPTQ writes them (such linears cannot be fused)");
  app.add_flag("--asym", o.asym, "Asymmetric GPTQ zero points");
  app.add_option("--format", o.format, "GPTQ checkpoint format: gptq | gptq_v2")->capture_default_str();
  app.add_option("--dynamic", o.dynamic,
                 "GPTQModel per-module overrides: a JSON object from module-name regexes to "
                 "{bits, group_size, desc_act, sym} (key prefix -: = FP16); each linear is written "
                 "in the format of the first rule matching its name");
  app.add_flag("--tie-embeddings", o.tie_embeddings, "Share embed_tokens with the output head");
  app.add_option("--seed", o.seed, "Random seed")->capture_default_str();
  app.add_option("--tokenizer", o.tokenizer,
                 "tokenizer.model, tokenizer.json (with its tokenizer_config.json) or a folder "
                 "holding either or vocab.json + merges.txt, copied; default: train a small one");
  app.add_option("--threads", o.threads, "Worker threads (0 = all); the output does not depend on it");
  app.add_flag("--quiet", o.quiet, "No summary line");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "kestrel-synth: " << e.what() << "\n";
    return 1;
  }
  // GPTQ's options without --dtype gptq would do nothing (an fp16 model would be written as if
  // they were not given): refused in one line, naming what they go with, before anything is
  // written.
  if (o.dtype == "fp16")
    for (const char* name : {"--bits", "--group-size", "--act-order", "--asym", "--format", "--dynamic"})
      if (app.count(name) > 0) {
        std::cerr << "kestrel-synth: " << name << " goes with --dtype gptq (the default, fp16, "
                  << "is not quantized)\n";
        return 1;
      }
  // Ctrl-C removes the half-written output and says so.
  kestrel::remove_staged_outputs_on_signals("kestrel-synth");
  try {
    kestrel::synth::write_model(o);
  } catch (const std::exception& e) {
    std::cerr << "kestrel-synth: " << e.what() << "\n";
    return 1;
  } catch (...) {
    std::cerr << "kestrel-synth: unknown error\n";
    return 1;
  }
  return 0;
}
