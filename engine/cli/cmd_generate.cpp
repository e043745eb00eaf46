// kestrel generate: one prompt in, text streamed out (or one JSON object with --json).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/cli/commands.h"
#include "engine/cli/common.h"
#include "engine/error.h"
#include "engine/generate.h"

namespace kestrel::cli {

namespace {

struct GenerateArgs {
  ModelOptions model;
  std::string prompt;
  std::string prompt_file;
  int n_predict = 128;
  std::optional<float> temperature;
  std::optional<int> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repeat_penalty;
  int repeat_last_n = 64;
  float frequency_penalty = 0, presence_penalty = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool json = false;
  bool quiet = false;
};

int run_generate(const GenerateArgs& a) {
  std::string prompt = a.prompt;
  if (!a.prompt_file.empty()) {
    prompt = read_text_file(a.prompt_file);
    if (prompt.empty()) throw Error(a.prompt_file + ": the prompt file is empty");
  }
  if (prompt.empty()) throw Error("no prompt: give -p TEXT or -f FILE");

  LoadedModel m = load_model(a.model, a.quiet || a.json);

  GenerateOptions opt;
  opt.max_new_tokens = a.n_predict;
  opt.sampling = default_sampling(a.model.dir);
  if (a.temperature) opt.sampling.temperature = *a.temperature;
  if (a.top_k) opt.sampling.top_k = *a.top_k;
  if (a.top_p) opt.sampling.top_p = *a.top_p;
  if (a.min_p) opt.sampling.min_p = *a.min_p;
  if (a.repeat_penalty) opt.sampling.repeat_penalty = *a.repeat_penalty;
  opt.sampling.repeat_last_n = a.repeat_last_n;
  opt.sampling.frequency_penalty = a.frequency_penalty;
  opt.sampling.presence_penalty = a.presence_penalty;
  opt.sampling.seed = a.seed ? *a.seed : std::random_device{}();
  opt.stop = a.stop;
  opt.ignore_eos = a.ignore_eos;

  const std::vector<int> prompt_ids = m.tok->encode(prompt);
  if (!a.json && !a.quiet && opt.sampling.temperature > 0)
    std::cerr << "seed: " << opt.sampling.seed << "\n";

  std::function<void(std::string_view)> stream;
  if (!a.json) {
    std::cout << prompt << std::flush;
    stream = [](std::string_view s) { std::cout << s << std::flush; };
  }
  const GenerateResult r = generate(*m.backend, *m.tok, prompt_ids, opt, stream);

  const int n_gen = (int)r.ids.size();
  const double prompt_tps = r.prompt_ms > 0 ? prompt_ids.size() * 1000.0 / r.prompt_ms : 0;
  const double gen_tps = (n_gen > 1 && r.gen_ms > 0) ? (n_gen - 1) * 1000.0 / r.gen_ms : 0;
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model.dir;
    j["device"] = m.backend->device_name();
    j["prompt_ids"] = r.prompt_ids;
    j["ids"] = r.ids;
    j["text"] = r.text;
    j["finish_reason"] = r.finish_reason;
    j["seed"] = opt.sampling.seed;
    j["temperature"] = opt.sampling.temperature;
    j["timings"] = {{"load_ms", m.load_ms},
                    {"prompt_tokens", prompt_ids.size()},
                    {"prompt_ms", r.prompt_ms},
                    {"prompt_tokens_per_s", prompt_tps},
                    {"generated_tokens", n_gen},
                    {"gen_ms", r.gen_ms},
                    {"gen_tokens_per_s", gen_tps}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << "\n" << std::flush;
    if (!a.quiet) {
      std::fprintf(stderr,
                   "\nload %.0f ms | prompt %zu tokens, %.1f ms (%.1f tok/s) | generated %d tokens,"
                   " %.1f tok/s | finish: %s | %s\n",
                   m.load_ms, prompt_ids.size(), r.prompt_ms, prompt_tps, n_gen, gen_tps,
                   r.finish_reason.c_str(), m.backend->device_name().c_str());
    }
  }
  return 0;
}

}  // namespace

void register_generate(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "continue a prompt and stream the text");
  add_model_options(cmd, a->model);
  auto* p = cmd->add_option("-p,--prompt", a->prompt, "prompt text");
  cmd->add_option("-f,--file", a->prompt_file, "read the prompt from a file")->excludes(p);
  cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate")->check(CLI::PositiveNumber);
  cmd->add_option("--temp", a->temperature, "temperature (0 = greedy)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", a->top_k, "top-k sampling (0 = off)");
  cmd->add_option("--top-p", a->top_p, "top-p sampling (1 = off)");
  cmd->add_option("--min-p", a->min_p, "min-p sampling (0 = off)");
  cmd->add_option("--repeat-penalty", a->repeat_penalty, "repetition penalty (1 = off)");
  cmd->add_option("--repeat-last-n", a->repeat_last_n, "window of the repetition penalty");
  cmd->add_option("--frequency-penalty", a->frequency_penalty, "frequency penalty");
  cmd->add_option("--presence-penalty", a->presence_penalty, "presence penalty");
  cmd->add_option("--seed", a->seed, "random seed (default: random, printed)");
  cmd->add_option("--stop", a->stop, "stop string (repeatable)");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "keep generating past end-of-sequence");
  cmd->add_flag("--json", a->json, "print one JSON object instead of streaming text");
  cmd->add_flag("-q,--quiet", a->quiet, "no notes or statistics on stderr");
  cmd->callback([a, &action] { action = [a] { return run_generate(*a); }; });
}

}  // namespace kestrel::cli
