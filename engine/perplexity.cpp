#include "engine/perplexity.h"

#include <chrono>
#include <cmath>
#include <fmt/format.h>

#include "base/error.h"
#include "base/progress.h"

namespace kestrel {

void check_fills_a_window(int64_t tokens, int window) {
  if (tokens < window)
    throw Error(fmt::format("{} token{}, fewer than one window of {} (-c)", tokens,
                            tokens == 1 ? "" : "s", window));
}

PerplexityResult perplexity(Session& model, const std::vector<int>& ids, int window,
                            int64_t max_windows, bool progress) {
  const auto t0 = std::chrono::steady_clock::now();
  if (window < 2) throw Error(fmt::format("-c {}: a window needs at least 2 tokens", window));
  if (window > model.context_length())
    throw Error(fmt::format("a window of {} tokens is longer than the context of {}", window,
                            model.context_length()));
  PerplexityResult r;
  r.tokens = (int64_t)ids.size();
  r.windows_available = r.tokens / window;
  check_fills_a_window(r.tokens, window);
  r.windows = max_windows > 0 ? std::min(max_windows, r.windows_available) : r.windows_available;

  std::vector<int> targets(window);
  std::vector<double> nll(window);
  double sum = 0, sum2 = 0;
  Progress bar("perplexity", (double)r.windows, "windows", progress);
  for (int64_t w = 0; w < r.windows; ++w) {
    const int* t = ids.data() + w * window;
    for (int i = 0; i + 1 < window; ++i) targets[i] = t[i + 1];
    targets[window - 1] = -1;  // the last token predicts nothing inside the window
    model.forward_nll(t, window, 0, targets.data(), nll.data());
    for (int i = 0; i + 1 < window; ++i) {
      sum += nll[i];
      sum2 += nll[i] * nll[i];
    }
    bar.update((double)(w + 1));
  }
  bar.finish();
  r.predictions = r.windows * (window - 1);
  r.mean_nll = sum / (double)r.predictions;
  r.ppl = std::exp(r.mean_nll);
  const double n = (double)r.predictions;
  const double var = sum2 / n - r.mean_nll * r.mean_nll;
  r.ppl_error = var > 0 && n > 1 ? r.ppl * std::sqrt(var / (n - 1)) : 0.0;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace kestrel
