// End to end on the CPU: a kestrel-synth model's greedy continuation through the reference
// engine equals the one computed here by a deliberately plain implementation that shares
// nothing with the engine but the file reader: it parses config.json itself, dequantizes
// every weight to fp32 up front with its own bit arithmetic, and runs the model as loops.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/io/model_spec.h"
#include "models/io/safetensors.h"
#include "models/cpu/decoder.h"
#include "base/error.h"
#include "models/registry.h"
#include "tests/support/plain_model.h"
#include "tests/support/synth_model.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

using kestrel::test::Plain;

int argmax_of(const std::vector<float>& v) {
  return (int)(std::max_element(v.begin(), v.end()) - v.begin());
}

using Case = kestrel::test::ModelFormat;

class EngineVsPlain : public ::testing::TestWithParam<Case> {};

TEST_P(EngineVsPlain, GreedyContinuationMatches) {
  const Case& c = GetParam();
  const fs::path dir = kestrel::test::write_tiny_model(c, /*seed=*/7, /*n_layers=*/2);  // 2: quick plain loops

  const ModelSpec spec = load_model_spec(dir.string());
  if (!c.dynamic.empty()) {  // the rules did make the linears differ, FP16 ones included
    EXPECT_NE(mixed_formats(spec), "");
    EXPECT_TRUE(!spec.layers[1].down.quantized || !spec.layers[0].o.quantized);
  }
  DecoderCpu engine_model(spec);
  auto engine = engine_model.new_cpu_session(64);
  Plain plain(dir.string());
  const int vocab = spec.config.vocab;

  // Greedy: prompt of 4 tokens, then 16 generated tokens, both implementations.
  std::vector<int> tokens = {1, 17, 42, 99};
  std::vector<float> logits(vocab);
  engine->forward(tokens.data(), (int)tokens.size(), 0, logits.data(), nullptr);
  const int n_prompt = (int)tokens.size();
  for (int step = 0; step < 16; ++step) {
    tokens.push_back(argmax_of(logits));
    engine->forward(&tokens.back(), 1, (int)tokens.size() - 1, logits.data(), nullptr);
  }
  const std::vector<std::vector<float>> ref = plain.run(tokens);
  for (size_t i = n_prompt - 1; i + 1 < tokens.size(); ++i) {
    EXPECT_EQ(argmax_of(ref[i]), tokens[i + 1]) << "step " << i;
  }
  // The last logits agree closely (fp32 vs double-accumulated fp32 weights).
  double num = 0, den = 0;
  for (int v = 0; v < vocab; ++v) {
    ASSERT_TRUE(std::isfinite(logits[v]));
    num += std::pow(logits[v] - ref.back()[v], 2);
    den += std::pow(ref.back()[v], 2);
  }
  EXPECT_LT(std::sqrt(num / den), 1e-4);
  fs::remove_all(dir);
}

// The CUDA engine does not run mixed quantized formats yet: refused in one line, before any
// device work (so this runs without a GPU).
TEST(EngineDynamic, CudaRefusesMixedFormats) {
  kestrel::test::ModelFormat f{"dyn_refused", "gptq", 4, 32, false, false, "gptq"};
  f.dynamic = R"({"-:.*o_proj": {}, ".*\\.0\\.mlp\\..*": {"bits": 8}})";
  const fs::path dir = kestrel::test::write_tiny_model(f, 3, 2);
  const ModelSpec spec = load_model_spec(dir.string());
  LoadOptions o;
  o.device = Device::Cuda;
  try {
    load_model(spec, o);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("mixed per-module formats (dynamic) run on the CPU engine "
                                         "only so far: --device cpu (model.layers.0.self_attn.q_proj "
                                         "is 4-bit group 32, model.layers.0.mlp.gate_proj is 8-bit "
                                         "group 32)"), 0u) << e.what();
  }
  // FP16 linears alone among one quantized format are what the CUDA engine has always run.
  f.dynamic = R"({"-:.*o_proj": {}})";
  EXPECT_EQ(mixed_formats(load_model_spec(kestrel::test::write_tiny_model(f, 3, 2).string())), "");
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, EngineVsPlain,
    ::testing::Values(Case{"fp16", "fp16", 16, 0, false, false, "gptq"},
                      Case{"q4_g128", "gptq", 4, 128, false, false, "gptq"},
                      Case{"q4_g128_act_v2_asym", "gptq", 4, 128, true, true, "gptq_v2"},
                      Case{"q3_g64_act", "gptq", 3, 64, true, false, "gptq"},
                      Case{"q2_g32_v2", "gptq", 2, 32, false, false, "gptq_v2"},
                      Case{"q8_perchannel_asym", "gptq", 8, -1, false, true, "gptq_v2"},
                      // GPTQModel's dynamic rules: every bit width, group sizes, act-order on
                      // and off, FP16 linears, and q/k/v, gate/up of one layer in different
                      // formats. The plain reader takes each linear's format from its tensors.
                      Case{"dynamic_mixed", "gptq", 4, 32, true, false, "gptq", 4, 2, false,
                           R"({"-:.*\\.1\\.mlp\\.down_proj": {},
                               "model\\.layers\\.0\\.self_attn\\.[qk]_proj": {"bits": 8, "group_size": -1},
                               ".*\\.1\\.self_attn\\..*": {"bits": 3, "group_size": 64, "desc_act": false},
                               ".*gate_proj": {"bits": 2, "group_size": 128}})"},
                      Case{"dynamic_v2_asym", "gptq", 4, 128, false, false, "gptq_v2", 4, 2, false,
                           R"({"-:.*o_proj": {}, "+:.*mlp\\.(up|down)_proj": {"bits": 8, "sym": false}})"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
