#include "tools/kestrel/common.h"

#include <chrono>
#include <cstdlib>
#include <fmt/format.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "engine/base/device.h"
#include "engine/base/error.h"

namespace kestrel::cli {

namespace fs = std::filesystem;

namespace {

// A CLI11 check that the value is a number and ok(value); otherwise "<what>, got <value>".
CLI::Validator number_check(std::function<bool(double)> ok, const std::string& what,
                            const std::string& desc) {
  return CLI::Validator(
      [ok, what](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size()) return "not a number: '" + in + "'";
        return ok(v) ? std::string() : fmt::format("{}, got {}", what, in);
      },
      desc);
}

}  // namespace

CLI::Validator at_least(double lo) {
  return number_check([lo](double v) { return v >= lo; }, fmt::format("must be at least {}", lo),
                      fmt::format("NUMBER >= {}", lo));
}

CLI::Validator above(double lo) {
  return number_check([lo](double v) { return v > lo; }, fmt::format("must be above {}", lo),
                      fmt::format("NUMBER > {}", lo));
}

CLI::Validator between(double lo, double hi) {
  return number_check([lo, hi](double v) { return v >= lo && v <= hi; },
                      fmt::format("must be between {} and {}", lo, hi),
                      fmt::format("NUMBER in [{}, {}]", lo, hi));
}

void add_model_options(CLI::App* cmd, ModelOptions& o) {
  cmd->add_option("-m,--model", o.dir, "model directory (Hugging Face layout)")->required();
  cmd->add_option("--device", o.device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("-c,--ctx-size", o.context, "context length in tokens (0 = the model's)")
      ->check(at_least(0));
}

void note(bool quiet, const std::string& msg) {
  if (!quiet) std::cerr << msg << "\n";
}

LoadedModel open_model(const ModelOptions& o, bool quiet) {
  if (!fs::is_directory(o.dir)) throw Error(o.dir + ": no such model directory");
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel m;
  m.device = device_key(resolve_device(o.device));

  m.tok = Tokenizer::load(o.dir);
  m.spec = std::make_unique<ModelSpec>(load_model_spec(o.dir));
  for (const std::string& w : m.spec->warnings) note(quiet, "warning: " + w);
  const ModelConfig& c = m.spec->config;
  m.tok->check_fits(c.vocab, o.dir);
  if (o.context > c.max_pos)
    note(quiet, "warning: context " + std::to_string(o.context) +
                    " is longer than the model was trained for (" + std::to_string(c.max_pos) + ")");
  m.load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

int context_length(const LoadedModel& m, const ModelOptions& o) {
  return o.context > 0 ? o.context : m.spec->config.max_pos;
}

void load_weights(LoadedModel& m, const ModelOptions& o, bool quiet, const DecodeTuning& tuning) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadOptions lo;
  lo.device = m.device == "cuda" ? Device::Cuda : Device::Cpu;
  lo.quiet = quiet;
  lo.tuning = tuning;
  m.model = kestrel::load_model(*m.spec, lo);
  m.session = m.model->new_session(o.context, quiet);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  m.load_ms += ms;
  if (m.device != "cuda")
    note(quiet, fmt::format("loaded {:.1f} MiB of weights from {} on {} in {:.0f} ms, context {}",
                            m.spec->files.total_bytes() / 1048576.0, o.dir,
                            m.model->device_name(), ms, m.session->context_length()));
}

LoadedModel load_model(const ModelOptions& o, bool quiet) {
  LoadedModel m = open_model(o, quiet);
  load_weights(m, o, quiet);
  return m;
}

void add_sampling_options(CLI::App* cmd, SamplingOptions& s) {
  cmd->add_option("--temp", s.temperature, "temperature (0 = greedy)")->check(at_least(0));
  cmd->add_option("--top-k", s.top_k, "top-k sampling (0 = off)")->check(at_least(0));
  cmd->add_option("--top-p", s.top_p, "top-p sampling (1 = off)")->check(between(0, 1));
  cmd->add_option("--min-p", s.min_p, "min-p sampling (0 = off)")->check(between(0, 1));
  cmd->add_option("--repeat-penalty", s.repeat_penalty, "repetition penalty (1 = off)")
      ->check(above(0));
  cmd->add_option("--repeat-last-n", s.repeat_last_n, "window of the penalties (-1 = all)")
      ->check(between(-1, 1 << 30));
  cmd->add_option("--frequency-penalty", s.frequency_penalty, "frequency penalty");
  cmd->add_option("--presence-penalty", s.presence_penalty, "presence penalty");
  cmd->add_option("--seed", s.seed, "random seed (default: random, printed)");
  cmd->add_option("--stop", s.stop, "stop string (repeatable); never printed");
  cmd->add_flag("--ignore-eos", s.ignore_eos, "keep generating past end-of-sequence");
}

SamplingParams resolve_sampling(const std::string& dir, const SamplingOptions& s) {
  SamplingParams p = default_sampling(dir);
  if (s.temperature) p.temperature = *s.temperature;
  if (s.top_k) p.top_k = *s.top_k;
  if (s.top_p) p.top_p = *s.top_p;
  if (s.min_p) p.min_p = *s.min_p;
  if (s.repeat_penalty) p.repeat_penalty = *s.repeat_penalty;
  p.repeat_last_n = s.repeat_last_n;
  p.frequency_penalty = s.frequency_penalty;
  p.presence_penalty = s.presence_penalty;
  p.seed = s.seed ? *s.seed : std::random_device{}();
  return p;
}

void add_result(Perf& p, const GenerateResult& r) {
  p.prompt_ms += r.prompt_ms;
  p.prompt_tokens += (int64_t)r.prompt_ids.size() - r.n_cached;
  p.eval_ms += r.gen_ms - r.sample_ms;
  p.eval_runs += r.n_eval;
  p.sample_ms += r.sample_ms;
  p.sampled += r.n_sampled;
  p.device_chosen += r.n_device;
  p.generated += (int64_t)r.ids.size();
}

void print_perf(const Perf& p, const std::string& device) {
  const double total =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p.start).count();
  auto rate = [](double ms, int64_t n) {
    return fmt::format("({:8.2f} ms per token, {:8.2f} tokens per second)", n ? ms / n : 0.0,
                       ms > 0 ? n * 1000.0 / ms : 0.0);
  };
  std::string s;
  s += fmt::format("\nperf:        load time = {:10.2f} ms ({})\n", p.load_ms, device);
  s += fmt::format("perf: prompt eval time = {:10.2f} ms / {:5} tokens {}\n", p.prompt_ms,
                   p.prompt_tokens, rate(p.prompt_ms, p.prompt_tokens));
  s += fmt::format("perf:        eval time = {:10.2f} ms / {:5} runs   {}\n", p.eval_ms,
                   p.eval_runs, rate(p.eval_ms, p.eval_runs));
  s += fmt::format("perf:    sampling time = {:10.2f} ms / {:5} runs   {}\n", p.sample_ms,
                   p.sampled, rate(p.sample_ms, p.sampled));
  if (p.device_chosen > 0)
    s += fmt::format("perf: chosen by the model = {:5} tokens (its argmax or top-k sampler, timed in eval)\n",
                     p.device_chosen);
  s += fmt::format("perf:       total time = {:10.2f} ms / {:5} tokens\n", total,
                   p.prompt_tokens + p.generated);
  std::cerr << s << std::flush;
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
