// The quantizer suites' model: a two-layer kestrel-synth model and text sampled from it,
// made once per test binary (shared_fixture.h). The CPU's mixed-precision tests and the GPU's
// compare against each other on it, so both must build it alike: one recipe, here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "engine/perplexity.h"
#include "models/cpu/decoder.h"
#include "models/io/model_spec.h"
#include "tests/support/shared_fixture.h"
#include "tokenizer/tokenizer.h"
#include "tools/synth/synth.h"

namespace kestrel::test {

// Text the FP16 model itself finds likely: windows of 128 tokens sampled from it at
// temperature 1, each from BOS at position 0. On such text any damage to the model raises the
// perplexity, even for random weights.
inline std::vector<int> sample_windows(const std::filesystem::path& dir, int windows,
                                       uint32_t seed) {
  const ModelSpec spec = load_model_spec(dir.string());
  DecoderCpu model(spec);
  auto m = model.new_cpu_session(128);
  const int vocab = spec.config.vocab;
  std::mt19937 rng(seed);
  std::vector<int> ids;
  std::vector<float> logits(vocab);
  std::vector<double> p(vocab);
  for (int w = 0; w < windows; ++w) {
    int token = 1;  // synth models' BOS
    for (int pos = 0; pos < 128; ++pos) {
      ids.push_back(token);
      m->forward_token(token, pos, logits.data());
      const float mx = *std::max_element(logits.begin(), logits.end());
      for (int v = 0; v < vocab; ++v) p[v] = std::exp((double)logits[v] - mx);
      token = std::discrete_distribution<int>(p.begin(), p.end())(rng);
    }
  }
  return ids;
}

// Perplexity of a model directory on the CPU engine over windows of 128 tokens of `ids`.
inline double perplexity_of(const std::filesystem::path& dir, const std::vector<int>& ids) {
  DecoderCpu model(load_model_spec(dir.string()));
  auto m = model.new_cpu_session(128);
  return kestrel::perplexity(*m, ids, 128, 0, false).ppl;
}

struct SampledModel {
  std::filesystem::path fp16;   // the FP16 model
  std::filesystem::path calib;  // the sampled text, detokenized: the calibration file
  std::vector<int> sampled;     // the sampled text's ids (24 windows of 128)
};

// The tiny two-layer llama of seed 5 and 24 windows sampled from it (seed 1), under `root`'s
// folder `name`. Each binary names its own folder: a binary rebuilt removes its stale copies.
inline SampledModel sampled_model(const std::filesystem::path& root, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path dir = shared_fixture(root, name, [](const fs::path& d) {
    synth::SynthOptions o;
    o.shape = "tiny";
    o.n_layers = 2;
    o.dtype = "fp16";
    o.seed = 5;
    o.out = (d / "fp16").string();
    o.quiet = true;
    synth::write_model(o);
    const std::vector<int> ids = sample_windows(d / "fp16", 24, 1);
    write_ids(d / "sampled.txt", ids);
    std::ofstream calib(d / "calib.txt");
    calib << Tokenizer::load((d / "fp16").string())->decode(ids);
    calib.close();
    KESTREL_CHECK(calib.good(), "cannot write " + (d / "calib.txt").string());
  });
  return {dir / "fp16", dir / "calib.txt", read_ids(dir / "sampled.txt")};
}

}  // namespace kestrel::test
