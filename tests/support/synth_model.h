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

// GPTQModel `dynamic` models of the tiny shape (4 layers) for the GPU-vs-CPU tests: per-linear
// formats that the CUDA engine must run each in its own format.
//   dynamic_mixed: every bit width, groups 32/64/128/per row, act-order on and off, an FP16
//     down_proj (layer 1), and siblings of one input in different formats: layer 0's q, k
//     (8-bit per row) beside v (4-bit g32 act-order), every gate (2-bit g128) beside its up.
//     Only layers 0 and 1 are named, so it also serves 2-layer models.
//   dynamic_fused: siblings that agree fuse within a mixed model: layer 1 all 8-bit g64 without
//     act-order, layer 3 3-bit g32 act-order, the rest 4-bit g128 act-order, layer 2's o FP16
//     (so the act-order residual-stream plan is off and down's input order is per layer).
//   dynamic_act_stream: every linear act-order and fused, in a different format per layer (and
//     per block in layer 2): the residual stream kept in each next GEMV's permutation across
//     formats.
//   dynamic_v2_asym: gptq_v2 zeros, FP16 o_proj, up and down 8-bit asymmetric beside a 4-bit
//     symmetric gate (names no layer: any depth).
inline ModelFormat dynamic_mixed() {
  return {"dynamic_mixed", "gptq", 4, 32, true, false, "gptq", 4, 2, false,
          R"({"-:.*\\.1\\.mlp\\.down_proj": {},
              "model\\.layers\\.0\\.self_attn\\.[qk]_proj": {"bits": 8, "group_size": -1},
              ".*\\.1\\.self_attn\\..*": {"bits": 3, "group_size": 64, "desc_act": false},
              ".*gate_proj": {"bits": 2, "group_size": 128}})"};
}
inline ModelFormat dynamic_fused() {
  return {"dynamic_fused", "gptq", 4, 128, true, false, "gptq", 4, 2, false,
          R"({".*\\.1\\..*": {"bits": 8, "group_size": 64, "desc_act": false},
              "-:.*\\.2\\.self_attn\\.o_proj": {},
              ".*\\.3\\..*": {"bits": 3, "group_size": 32}})"};
}
inline ModelFormat dynamic_act_stream() {
  return {"dynamic_act_stream", "gptq", 4, 128, true, false, "gptq", 4, 2, false,
          R"({".*\\.[13]\\..*": {"bits": 3, "group_size": 64},
              ".*\\.2\\.mlp\\..*": {"bits": 8, "group_size": 32}})"};
}
inline ModelFormat dynamic_v2_asym() {
  return {"dynamic_v2_asym", "gptq", 4, 128, false, false, "gptq_v2", 4, 2, false,
          R"({"-:.*o_proj": {}, "+:.*mlp\\.(up|down)_proj": {"bits": 8, "sym": false}})"};
}

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
