// kestrel perplexity: the GPTQ paper's (and llama-perplexity's) protocol. The whole file is
// tokenized once with BOS at the start only, cut into windows of c tokens (the tail that does not
// fill a window is dropped), and each window runs from position 0 of an empty cache; within a
// window the c - 1 next tokens are predicted. perplexity = exp(mean NLL over all of them).
// On the GPU the log-softmax runs on the device and only one float per token reaches the host;
// elsewhere the logits come back and the log-softmax is taken here in double.
#include <chrono>
#include <cmath>
#include <fmt/format.h>
#include <iostream>
#include <nlohmann/json.hpp>

#include "engine/cli/commands.h"
#include "engine/cli/common.h"
#include "engine/error.h"
#include "engine/progress.h"
#include "models/llama_cuda.h"

namespace kestrel::cli {

namespace {

struct PerplexityArgs {
  ModelOptions model;
  std::string file;
  int chunks = 0;  // 0 = every window
  bool json = false;
};

// -log softmax(row)[target], in double.
double nll_of(const float* row, int vocab, int target) {
  double mx = row[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, (double)row[i]);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp((double)row[i] - mx);
  return std::log(sum) + mx - row[target];
}

int run_perplexity(const PerplexityArgs& a) {
  ModelOptions mo = a.model;
  const int window = mo.context > 0 ? mo.context : 2048;
  if (window < 2) throw Error(fmt::format("-c {}: a window needs at least 2 tokens", window));
  mo.context = window;
  const std::string text = read_text_file(a.file);
  LoadedModel m = load_model(mo, a.json);
  Backend& b = *m.backend;
  const int vocab = b.config().vocab;

  std::vector<int> tokens = m.tok->encode(text, /*with_specials=*/false);
  if (m.tok->add_bos()) tokens.insert(tokens.begin(), m.tok->bos_id());
  const int64_t available = (int64_t)tokens.size() / window;
  if (available == 0)
    throw Error(fmt::format("{}: {} tokens do not fill one window of {} (-c)", a.file,
                            tokens.size(), window));
  const int64_t n_windows = a.chunks > 0 ? std::min<int64_t>(a.chunks, available) : available;

  auto* gpu = dynamic_cast<LlamaCuda*>(&b);
  std::vector<float> nll(window), logits(vocab), all_logits;
  std::vector<int> targets(window);
  if (!gpu) all_logits.resize((size_t)window * vocab);

  Progress bar("perplexity", (double)n_windows, "windows", !a.json);
  const auto t0 = std::chrono::steady_clock::now();
  double sum = 0;
  int64_t scored = 0;
  for (int64_t w = 0; w < n_windows; ++w) {
    const int* t = tokens.data() + w * window;
    if (gpu) {
      for (int i = 0; i + 1 < window; ++i) targets[i] = t[i + 1];
      targets[window - 1] = -1;
      gpu->forward_nll(t, window, 0, targets.data(), nll.data());
      for (int i = 0; i + 1 < window; ++i) sum += nll[i];
    } else {
      b.forward(t, window, 0, logits.data(), all_logits.data());
      for (int i = 0; i + 1 < window; ++i) sum += nll_of(&all_logits[(size_t)i * vocab], vocab, t[i + 1]);
    }
    scored += window - 1;
    bar.update((double)(w + 1));
  }
  bar.finish();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double mean = sum / (double)scored;
  const double ppl = std::exp(mean);

  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model.dir;
    j["file"] = a.file;
    j["device"] = b.device_name();
    j["ctx"] = window;
    j["windows"] = n_windows;
    j["windows_available"] = available;
    j["file_tokens"] = tokens.size();
    j["tokens_scored"] = scored;
    j["mean_nll"] = mean;
    j["perplexity"] = ppl;
    j["seconds"] = seconds;
    j["tokens_per_s"] = seconds > 0 ? (double)(n_windows * window) / seconds : 0.0;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << fmt::format(
        "perplexity: {:.4f} ({} of {} windows of {} tokens, {} predicted; {:.1f} s, {:.0f} tokens/s)\n",
        ppl, n_windows, available, window, scored, seconds,
        seconds > 0 ? (double)(n_windows * window) / seconds : 0.0);
  }
  return 0;
}

}  // namespace

void register_perplexity(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<PerplexityArgs>();
  CLI::App* cmd = app.add_subcommand(
      "perplexity", "perplexity of a text file in windows of -c tokens (default 2048)");
  add_model_options(cmd, a->model);
  // Here -c is the window length (and the context the model is loaded with).
  cmd->get_option("--ctx-size")->description("window length in tokens (0 = 2048)");
  cmd->add_option("-f,--file", a->file, "text file (tokenized once, BOS at the start)")->required();
  cmd->add_option("--chunks", a->chunks, "score only the first N windows (0 = all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", a->json, "print one JSON object instead of a line");
  cmd->callback([a, &action] { action = [a] { return run_perplexity(*a); }; });
}

}  // namespace kestrel::cli
