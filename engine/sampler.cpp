#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace kestrel {

int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}

int Sampler::sample(float* logits, int vocab, const std::vector<int>& history) {
  // Penalties. Repetition: divide positive logits, multiply negative ones (CTRL / llama.cpp).
  if (p_.repeat_penalty != 1.0f || p_.frequency_penalty != 0.0f || p_.presence_penalty != 0.0f) {
    const size_t window = p_.repeat_last_n < 0 ? history.size()
                                               : std::min(history.size(), (size_t)p_.repeat_last_n);
    std::unordered_map<int, int> counts;
    for (size_t i = history.size() - window; i < history.size(); ++i) ++counts[history[i]];
    for (const auto& [tok, count] : counts) {
      if (tok < 0 || tok >= vocab) continue;
      float& l = logits[tok];
      if (p_.repeat_penalty != 1.0f) l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
      l -= count * p_.frequency_penalty + p_.presence_penalty;
    }
  }
  if (p_.temperature <= 0.0f) return argmax(logits, vocab);

  // Candidates, largest first. top-k bounds the sort.
  cand_.resize(vocab);
  for (int i = 0; i < vocab; ++i) cand_[i] = {logits[i], i};
  size_t n = (p_.top_k > 0 && p_.top_k < vocab) ? (size_t)p_.top_k : (size_t)vocab;
  std::partial_sort(cand_.begin(), cand_.begin() + n, cand_.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  cand_.resize(n);

  // Probabilities at temperature 1 for top-p and min-p (as llama.cpp), then temperature.
  const float max_logit = cand_[0].first;
  std::vector<double> prob(n);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp((double)cand_[i].first - max_logit);
  if (p_.top_p < 1.0f) {
    double acc = 0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      acc += prob[i] / sum;
      if (acc >= p_.top_p) { keep = i + 1; break; }
    }
    n = keep;
  }
  if (p_.min_p > 0.0f) {
    size_t keep = 1;
    while (keep < n && prob[keep] >= p_.min_p * prob[0]) ++keep;
    n = keep;
  }
  double total = 0;
  for (size_t i = 0; i < n; ++i)
    total += prob[i] = std::exp(((double)cand_[i].first - max_logit) / p_.temperature);
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  for (size_t i = 0; i < n; ++i) {
    r -= prob[i];
    if (r <= 0) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace kestrel
