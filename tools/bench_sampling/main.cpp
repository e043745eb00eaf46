// kestrel-bench-sampling: host time of one Sampler::sample() call, the work done between two
// decode steps. Logits are i.i.d. normal with a chosen spread (a larger spread is a more
// peaked distribution, as a trained model's usually is); each call gets fresh logits and a
// history of the window's length, so the penalties and the selections do their full work.
// Prints the median and the 90th percentile per configuration.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"

namespace {

struct Config {
  std::string name;
  kestrel::SamplingParams p;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"median host time of one sample() call", "kestrel-bench-sampling"};
  int vocab = 32000, calls = 2000, pool = 64;
  std::vector<float> sigmas = {1.0f, 2.5f, 5.0f};
  app.add_option("--vocab", vocab, "vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--calls", calls, "timed calls per configuration")->check(CLI::PositiveNumber);
  app.add_option("--sigma", sigmas, "standard deviations of the logits (repeatable)");
  std::string only;
  app.add_option("--only", only, "run only the configurations whose name contains this");
  app.set_version_flag("--version", "kestrel-bench-sampling " KESTREL_VERSION);
  CLI11_PARSE(app, argc, argv);

  kestrel::SamplingParams def;  // Kestrel's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05
  std::vector<Config> configs;
  configs.push_back({"defaults (top-k 40, top-p 0.95, min-p 0.05)", def});
  {
    auto p = def;
    p.top_k = 0;
    configs.push_back({"top-k 0, top-p 0.95, min-p 0.05", p});
    p.min_p = 0;
    configs.push_back({"top-k 0, top-p 0.95, min-p 0", p});
    p.top_p = 1;
    configs.push_back({"no truncation (full vocabulary)", p});
    // Where draws at temperature 1 cannot stand in for draws at the temperature, and where
    // many draws land outside a small nucleus (which is then made explicit).
    p = def;
    p.top_k = 0;
    p.min_p = 0;
    p.temperature = 1.5f;
    configs.push_back({"top-k 0, top-p 0.95, min-p 0, temp 1.5", p});
    p.temperature = def.temperature;
    p.top_p = 0.5f;
    configs.push_back({"top-k 0, top-p 0.5, min-p 0", p});
  }
  {
    auto p = def;
    p.repeat_penalty = 1.1f;
    p.frequency_penalty = 0.1f;
    p.presence_penalty = 0.1f;
    configs.push_back({"defaults + penalties over 64", p});
    p = def;
    p.temperature = 0;
    configs.push_back({"greedy (temp 0)", p});
  }

  std::mt19937_64 rng(42);
  std::uniform_int_distribution<int> any_token(0, vocab - 1);
  std::vector<int> history(512);
  for (int& t : history) t = any_token(rng);

  fmt::print("vocab {}, {} calls each, median / p90 per sample() call\n\n", vocab, calls);
  fmt::print("| logits sigma | configuration | median us | p90 us |\n");
  fmt::print("|---|---|---|---|\n");
  for (float sigma : sigmas) {
    std::normal_distribution<float> normal(0.0f, sigma);
    std::vector<std::vector<float>> sets(pool, std::vector<float>(vocab));
    for (auto& s : sets)
      for (float& x : s) x = normal(rng);
    std::vector<float> logits(vocab);
    for (const Config& c : configs) {
      if (c.name.find(only) == std::string::npos) continue;
      auto p = c.p;
      p.seed = 7;
      kestrel::Sampler sampler(p);
      std::vector<double> us;
      us.reserve(calls);
      for (int i = -100; i < calls; ++i) {  // the first 100 warm caches and buffers
        std::memcpy(logits.data(), sets[(i + 100) % pool].data(), vocab * sizeof(float));
        const auto t0 = std::chrono::steady_clock::now();
        const int id = sampler.sample(logits.data(), vocab, history);
        const auto t1 = std::chrono::steady_clock::now();
        if (id < 0 || id >= vocab) return 1;
        if (i >= 0) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      std::sort(us.begin(), us.end());
      fmt::print("| {} | {} | {:.2f} | {:.2f} |\n", sigma, c.name, us[us.size() / 2],
                 us[us.size() * 9 / 10]);
    }
  }
  return 0;
}
