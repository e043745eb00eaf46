#include "engine/cli/common.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/device.h"
#include "engine/error.h"
#include "models/llama.h"
#include "models/llama_cuda.h"

namespace kestrel::cli {

namespace fs = std::filesystem;

void add_model_options(CLI::App* cmd, ModelOptions& o) {
  cmd->add_option("-m,--model", o.dir, "model directory (Hugging Face layout)")->required();
  cmd->add_option("--device", o.device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("-c,--ctx-size", o.context, "context length in tokens (0 = the model's)")
      ->check(CLI::NonNegativeNumber);
}

void note(bool quiet, const std::string& msg) {
  if (!quiet) std::cerr << msg << "\n";
}

LoadedModel load_model(const ModelOptions& o, bool quiet) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!fs::is_directory(o.dir)) throw Error(o.dir + ": no such model directory");

  LoadedModel m;
  m.device = o.device;
  if (m.device == "auto") m.device = cuda_status().usable ? "cuda" : "cpu";
  if (m.device == "cuda") {
    const CudaStatus s = cuda_status();
    if (!s.usable) throw DeviceError(s.problem + "; run with --device cpu");
  }

  m.tok = std::make_unique<Tokenizer>(Tokenizer::load(o.dir));
  m.spec = std::make_unique<ModelSpec>(load_model_spec(o.dir));
  for (const std::string& w : m.spec->warnings) note(quiet, "warning: " + w);
  const ModelConfig& c = m.spec->config;
  if (m.tok->vocab_size() > c.vocab)
    throw Error(o.dir + ": tokenizer.model has " + std::to_string(m.tok->vocab_size()) +
                " pieces but config.json vocab_size is " + std::to_string(c.vocab));
  if (o.context > c.max_pos)
    note(quiet, "warning: context " + std::to_string(o.context) +
                    " is longer than the model was trained for (" + std::to_string(c.max_pos) + ")");
  if (m.device == "cuda")
    m.backend = std::make_unique<LlamaCuda>(*m.spec, o.context, quiet);
  else
    m.backend = std::make_unique<LlamaCpu>(*m.spec, o.context);
  m.load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

SamplingParams default_sampling(const std::string& dir) {
  SamplingParams p;
  const fs::path path = fs::path(dir) / "generation_config.json";
  if (!fs::exists(path)) return p;
  nlohmann::json j;
  try {
    std::ifstream in(path);
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw Error(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  auto num = [&](const char* key, auto& dst) {
    if (j.contains(key) && j[key].is_number()) dst = j[key].get<std::decay_t<decltype(dst)>>();
  };
  num("temperature", p.temperature);
  num("top_k", p.top_k);
  num("top_p", p.top_p);
  num("min_p", p.min_p);
  num("repetition_penalty", p.repeat_penalty);
  if (j.contains("do_sample") && j["do_sample"].is_boolean() && !j["do_sample"].get<bool>())
    p.temperature = 0.0f;
  return p;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace kestrel::cli
