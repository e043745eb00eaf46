// A tiny kestrel-synth model in one weight format, for the tests that run whole models.
// Link kestrel_synth to use it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "tests/support/test_util.h"
#include "tools/synth/synth.h"

namespace kestrel::test {

struct ModelFormat {
  std::string name;   // also the test's parameter name
  std::string dtype;  // fp16 | gptq
  int bits, group_size;
  bool act_order, asym;
  std::string format;  // gptq | gptq_v2
  int heads = 4, kv_heads = 2;
  bool g_idx_per_linear = false;  // act-order: q, k, v (and gate, up) each their own order
  std::string dynamic = "";       // GPTQModel per-module rules (SynthOptions::dynamic)
};

// Writes the `tiny` shape in format f (n_layers 0 = the shape's; arch "" = the shape's family)
// under this process's scratch directory and returns its path.
inline std::filesystem::path write_tiny_model(const ModelFormat& f, uint64_t seed,
                                              int n_layers = 0, const std::string& arch = "") {
  const std::filesystem::path dir = scratch() / ("model_" + f.name);
  std::filesystem::remove_all(dir);
  synth::SynthOptions o;
  o.shape = "tiny";
  o.arch = arch;
  o.n_layers = n_layers;
  o.dtype = f.dtype;
  o.bits = f.bits;
  o.group_size = f.group_size;
  o.act_order = f.act_order;
  o.asym = f.asym;
  o.g_idx_per_linear = f.g_idx_per_linear;
  o.format = f.format;
  o.dynamic = f.dynamic;
  o.n_heads = f.heads;
  o.n_kv_heads = f.kv_heads;
  o.seed = seed;
  o.out = dir.string();
  o.quiet = true;
  synth::write_model(o);
  return dir;
}

}  // namespace kestrel::test
