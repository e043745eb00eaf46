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
#include "models/gpu/decoder.h"
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

// The CUDA engine runs each linear in its own format: load_model no longer refuses mixed
// formats for --device cuda. It refuses, in one line naming the linear and before any device
// work (so this runs without a GPU), a format its kernels do not take. Whether the mixed model
// loads is left to the device: without a usable GPU, the one refusal is that there is none.
TEST(EngineDynamic, CudaTakesMixedFormatsAndRefusesWhatItCannotRun) {
  const kestrel::test::ModelFormat f = kestrel::test::dynamic_mixed();
  const fs::path dir = kestrel::test::write_tiny_model(f, 3, 2);
  const ModelSpec spec = load_model_spec(dir.string());
  ASSERT_NE(mixed_formats(spec), "");
  EXPECT_EQ(cuda_unsupported_formats(spec), "");
  LoadOptions o;
  o.device = Device::Cuda;
  try {
    EXPECT_NE(load_model(spec, o), nullptr);
  } catch (const DeviceError&) {  // no usable GPU here
  }

  // Groups of 16 columns run on the CPU engine only (the GEMVs take multiples of 32).
  kestrel::test::ModelFormat g16 = f;
  g16.name = "dyn_g16";
  g16.dynamic = R"({".*\\.0\\.mlp\\.down_proj": {"group_size": 16}})";
  const fs::path dir16 = kestrel::test::write_tiny_model(g16, 3, 2);
  const ModelSpec spec16 = load_model_spec(dir16.string());
  const std::string why = "the CUDA engine does not run model.layers.0.mlp.down_proj's groups of "
                          "16 columns (the kernels take multiples of 32, or one group per row); "
                          "use --device cpu";
  EXPECT_EQ(cuda_unsupported_formats(spec16), why);
  try {
    load_model(spec16, o);
    ADD_FAILURE() << "expected a refusal";
  } catch (const DeviceError& e) {
    ADD_FAILURE() << "refused for the device, not the format: " << e.what();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), spec16.dir + ": " + why);
  }
  // The CPU engine runs it.
  LoadOptions cpu;
  EXPECT_NE(load_model(spec16, cpu), nullptr);
  fs::remove_all(dir);
  fs::remove_all(dir16);
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
                      kestrel::test::dynamic_mixed(), kestrel::test::dynamic_v2_asym()),
    [](const auto& info) { return info.param.name; });

}  // namespace
