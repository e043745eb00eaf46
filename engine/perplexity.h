// Perplexity by the GPTQ paper's (WikiText-2) protocol, as llama-perplexity runs it: the text
// tokenized once with BOS at the start only, cut into windows of `window` tokens (the tail
// that does not fill one is dropped), each window run from position 0 of an empty cache; within
// a window its window - 1 next tokens are predicted. perplexity = exp(mean NLL over all).
#pragma once

#include <cstdint>
#include <vector>

#include "models/model.h"

namespace kestrel {

struct PerplexityResult {
  double ppl = 0, mean_nll = 0;
  // The standard error of ppl as llama-perplexity estimates it: ppl * sqrt(var(nll) / (n - 1))
  // over the n predictions' NLLs (the delta method on exp of their mean).
  double ppl_error = 0;
  int64_t tokens = 0;             // tokens of the text, BOS included
  int64_t windows_available = 0;  // whole windows in the text
  int64_t windows = 0;            // windows scored
  int64_t predictions = 0;        // windows * (window - 1)
  double seconds = 0;
};

// Throws kestrel::Error unless `tokens` fill at least one window of `window` (perplexity's own
// check, for a caller that would rather refuse before loading the weights).
void check_fills_a_window(int64_t tokens, int window);

// Scores the first `max_windows` windows of `ids` (0 = all). Throws kestrel::Error when the
// text does not fill one window or the window does not fit the model's context.
PerplexityResult perplexity(Session& model, const std::vector<int>& ids, int window,
                            int64_t max_windows, bool progress);

}  // namespace kestrel
