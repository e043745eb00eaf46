// Every model family against transformers: tiny random models that transformers built and
// saved (tests/data/families/, made by scripts/make-family-goldens.py), FP16 and GPTQ-packed by
// that script from the format's definition, with the logits of every prompt position and 24
// greedy tokens as transformers computed them in float32 (for GPTQ, over the dequantized
// weights). The CPU
// engine must reproduce them, through its batched forward and token by token; the CUDA engine
// must match the CPU engine where it runs the family, and refuse it in one line where not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.h"
#include "models/io/model_spec.h"
#include "models/cpu/decoder.h"
#include "models/gpu/decoder.h"
#include "tests/support/gpu.h"

using namespace kestrel;

namespace {

struct Golden {
  std::vector<int> prompt, greedy;
  std::vector<std::vector<float>> logits;  // [prompt position][vocab]
};

std::string family_dir(const std::string& name) {
  return std::string(KESTREL_TEST_DATA) + "/families/" + name;
}

Golden read_golden(const std::string& dir) {
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  return {j.at("prompt").get<std::vector<int>>(), j.at("greedy").get<std::vector<int>>(),
          j.at("logits").get<std::vector<std::vector<float>>>()};
}

int argmax(const float* x, int n) { return (int)(std::max_element(x, x + n) - x); }

// Logits agree within 1e-4 of the row's largest magnitude: both sides compute in float32 from
// the same float16 weights, differing only in the order of sums (observed: about 1e-5).
void expect_logits_near(const float* got, const std::vector<float>& want, const std::string& what) {
  float scale = 1;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  float worst = 0;
  for (size_t v = 0; v < want.size(); ++v) worst = std::max(worst, std::fabs(got[v] - want[v]));
  EXPECT_LE(worst, 1e-4f * scale) << what;
}

class Families : public ::testing::TestWithParam<std::string> {};

TEST_P(Families, CpuEqualsTransformers) {
  const std::string dir = family_dir(GetParam());
  const Golden g = read_golden(dir);
  const ModelSpec spec = load_model_spec(dir);
  std::string family = GetParam().substr(0, GetParam().find('-'));
  if (family == "llama3") family = "llama";
  EXPECT_EQ(spec.config.family, family);
  EXPECT_EQ(spec.config.quant.has_value(), GetParam().ends_with("-gptq"));
  DecoderCpu model(spec);
  const int n = (int)g.prompt.size(), vocab = spec.config.vocab;

  // The whole prompt at once (the batched forward), every position's logits.
  auto batch = model.new_cpu_session(64);
  std::vector<float> all((size_t)n * vocab), last(vocab);
  batch->forward(g.prompt.data(), n, 0, last.data(), all.data());
  for (int i = 0; i < n; ++i)
    expect_logits_near(&all[(size_t)i * vocab], g.logits[i], "batched, position " + std::to_string(i));

  // Token by token (the readable forward).
  auto stepped = model.new_cpu_session(64);
  std::vector<float> logits(vocab);
  for (int i = 0; i < n; ++i) {
    stepped->forward_token(g.prompt[i], i, logits.data());
    expect_logits_near(logits.data(), g.logits[i], "stepped, position " + std::to_string(i));
  }

  // Greedy continuation after the prompt, crossing Mistral's window of 8.
  std::vector<int> greedy;
  int token = argmax(logits.data(), vocab);
  for (size_t t = 0; t < g.greedy.size(); ++t) {
    greedy.push_back(token);
    stepped->forward_token(token, n + (int)t, logits.data());
    token = argmax(logits.data(), vocab);
  }
  EXPECT_EQ(greedy, g.greedy);
}

// The CUDA engine runs the family and agrees with transformers (FP16 against float32: logits
// within 2% of the row's largest magnitude, the same greedy tokens), through its prefill and
// its decode graphs, or refuses it in one line that names what it lacks.
TEST_P(Families, GpuEqualsTransformersOrRefuses) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = family_dir(GetParam());
  const Golden g = read_golden(dir);
  const ModelSpec spec = load_model_spec(dir);
  const std::string why = cuda_unsupported(spec.config);
  if (!why.empty()) {
    try {
      DecoderCuda m(spec, true);
      FAIL() << "the CUDA engine accepted " << GetParam();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    return;
  }
  DecoderCuda m(spec, true);
  const int n = (int)g.prompt.size(), vocab = spec.config.vocab;
  auto near = [&](const float* got, const std::vector<float>& want, const std::string& what) {
    float scale = 1, worst = 0;
    for (float w : want) scale = std::max(scale, std::fabs(w));
    for (size_t v = 0; v < want.size(); ++v) worst = std::max(worst, std::fabs(got[v] - want[v]));
    EXPECT_LE(worst, 2e-2f * scale) << what;
  };

  // Prefill: the whole prompt, every position's logits.
  auto batch = m.new_session(64);
  std::vector<float> all((size_t)n * vocab), logits(vocab);
  batch->forward(g.prompt.data(), n, 0, logits.data(), all.data());
  for (int i = 0; i < n; ++i) near(&all[(size_t)i * vocab], g.logits[i], "prefill, position " + std::to_string(i));

  // Decode graphs: token by token, then greedy.
  auto s = m.new_session(64);
  for (int i = 0; i < n; ++i) {
    s->forward(&g.prompt[i], 1, i, logits.data(), nullptr);
    near(logits.data(), g.logits[i], "decode, position " + std::to_string(i));
  }
  std::vector<int> greedy;
  int token = argmax(logits.data(), vocab);
  for (size_t t = 0; t < g.greedy.size(); ++t) {
    greedy.push_back(token);
    token = s->forward_argmax(token, n + (int)t);
  }
  EXPECT_EQ(greedy, g.greedy);
}

// Each family in FP16 and GPTQ-packed (4-bit, groups of 32; act-order on llama and qwen3),
// the GPTQ goldens from transformers running the dequantized weights.
INSTANTIATE_TEST_SUITE_P(All, Families,
                         ::testing::Values("llama", "llama3", "mistral", "qwen2", "qwen3", "opt",
                                           "llama-gptq", "llama3-gptq", "mistral-gptq",
                                           "qwen2-gptq", "qwen3-gptq", "opt-gptq"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
