// kestrel perplexity: the GPTQ paper's (and llama-perplexity's) protocol. The whole file is
// tokenized once with BOS at the start only, cut into windows of c tokens (the tail that does not
// fill a window is dropped), and each window runs from position 0 of an empty cache; within a
// window the c - 1 next tokens are predicted. perplexity = exp(mean NLL over all of them).
// The protocol is engine/perplexity.h; on the GPU the log-softmax runs on the device and only
// one float per token reaches the host.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "base/error.h"
#include "engine/perplexity.h"

namespace kestrel::cli {

namespace {

struct PerplexityArgs {
  ModelOptions model;
  std::string file;
  int chunks = 0;  // 0 = every window
  bool json = false;
};

int run_perplexity(const PerplexityArgs& a) {
  const ModelLoadOptions mo = load_options(a.model, a.json);
  if (mo.context == 1) throw Error("-c 1: a window needs at least 2 tokens");
  const std::string text = read_text_file(a.file);
  if (text.empty()) throw Error(a.file + ": the file is empty");
  LoadedModel m = open_model(mo);
  // The default window: 2048 tokens, or the model's context where that is shorter (a model
  // scored past its max_position_embeddings gives a meaningless figure).
  const int window = mo.context > 0 ? mo.context : std::min(2048, context_length(m, mo));
  m.context = window;
  // Tokenized before the weights load, so that a text too short says so at once.
  std::vector<int> tokens = m.tok->encode(text, /*with_specials=*/false);
  if (m.tok->add_bos()) tokens.insert(tokens.begin(), m.tok->bos_id());
  // The engine's errors about the text name the file.
  auto about_file = [&](auto&& f) {
    try {
      return f();
    } catch (const Error& e) {
      throw Error(a.file + ": " + e.what());
    }
  };
  about_file([&] {
    check_fills_a_window((int64_t)tokens.size(), window);
    return 0;
  });
  load_weights(m, mo);
  Session& b = *m.session;

  const PerplexityResult r =
      about_file([&] { return perplexity(b, tokens, window, a.chunks, !a.json); });
  const double tokens_per_s = r.seconds > 0 ? (double)(r.windows * window) / r.seconds : 0.0;

  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model.dir;
    j["file"] = a.file;
    j["device"] = b.device_name();
    j["ctx"] = window;
    j["windows"] = r.windows;
    j["windows_available"] = r.windows_available;
    j["file_tokens"] = r.tokens;
    j["tokens_scored"] = r.predictions;
    j["mean_nll"] = r.mean_nll;
    j["perplexity"] = r.ppl;
    j["perplexity_error"] = r.ppl_error;
    j["seconds"] = r.seconds;
    j["tokens_per_s"] = tokens_per_s;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << fmt::format(
        "perplexity: {:.4f} +/- {:.5f} ({} of {} windows of {} tokens, {} predicted; {:.1f} s, "
        "{:.0f} tokens/s)\n",
        r.ppl, r.ppl_error, r.windows, r.windows_available, window, r.predictions, r.seconds,
        tokens_per_s);
  }
  return 0;
}

}  // namespace

void register_perplexity(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<PerplexityArgs>();
  CLI::App* cmd = app.add_subcommand(
      "perplexity", "perplexity of a text file in windows of -c tokens");
  add_model_options(cmd, a->model);
  // Here -c is the window length (and the context the model is loaded with).
  cmd->get_option("--ctx-size")
      ->description("window length in tokens (0 = 2048, or the model's context when shorter)");
  cmd->add_option("-f,--file", a->file, "text file (tokenized once, BOS at the start)")->required();
  cmd->add_option("--chunks", a->chunks, "score only the first N windows (0 = all)")
      ->check(whole(0))
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "print one JSON object instead of a line");
  cmd->callback([a, &action] { action = [a] { return run_perplexity(*a); }; });
}

}  // namespace kestrel::cli
