#include "engine/speculative.h"

#include <algorithm>

namespace kestrel {

size_t shared_prefix(const std::vector<int>& a, const std::vector<int>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

void NgramDrafter::propose(const std::vector<int>& history, int k, Draft& out) {
  out.clear();
  const int n = (int)history.size();
  if (k <= 0) return;
  for (int len = std::min(max_, n - 1); len >= min_; --len) {
    const int* suffix = history.data() + n - len;
    // The most recent earlier occurrence: its continuation is the likeliest to repeat.
    for (int start = n - len - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + len, history.data() + start)) continue;
      const int from = start + len, to = std::min(n, from + k);
      out.ids.assign(history.begin() + from, history.begin() + to);
      return;
    }
  }
}

ModelDrafter::ModelDrafter(Session& draft, const SamplingParams& sampling, int target_vocab)
    : target_vocab_(target_vocab > 0 ? target_vocab : draft.config().vocab),
      s_(draft),
      sampler_(sampling),
      rng_(sampling.seed ^ 0x5DEECE66DULL),
      logits_(draft.config().vocab) {}

void ModelDrafter::restart(uint64_t seed) { rng_.seed(seed ^ 0x5DEECE66DULL); }

void ModelDrafter::propose(const std::vector<int>& history, int k, Draft& out) {
  out.clear();
  const int n = (int)history.size();
  // The draft runs positions n-1 .. n+k-2: its last id is proposed, never run.
  k = std::min(k, s_.context_length() - n + 1);
  if (k <= 0 || n == 0) return;
  std::vector<int>& cache = s_.cached;
  size_t keep = shared_prefix(cache, history);
  keep = std::min(keep, history.size() - 1);  // the last id runs: its logits draft the first
  // An id past the draft's table (the target's padding rows) cannot run in it: no draft.
  for (size_t i = keep; i < history.size(); ++i)
    if (history[i] < 0 || history[i] >= (int)logits_.size()) return;
  cache.resize(keep);
  const SamplingParams& sp = sampler_.params();
  const bool greedy = sp.temperature <= 0.0f;
  // The device's argmax sees raw logits: with penalties, or ids the target lacks, the host
  // takes the argmax of the transformed logits instead.
  const bool raw_argmax = greedy && !sampler_.has_penalties() &&
                          (int)logits_.size() <= target_vocab_;
  // Ids past the target's vocabulary (a larger draft table's padding) are never proposed.
  const int vocab = std::min((int)logits_.size(), target_vocab_);
  std::vector<int> seq = history;  // for the penalties of the draft's transform
  int id = -1;
  if (raw_argmax && n - (int)keep == 1) {
    id = s_.forward_argmax(history.back(), n - 1);
  } else {
    s_.forward(history.data() + keep, n - (int)keep, (int)keep, logits_.data());
  }
  cache.insert(cache.end(), history.begin() + keep, history.end());
  for (int i = 0; i < k; ++i) {
    if (i > 0) {
      if (raw_argmax) {
        id = s_.forward_argmax(out.ids.back(), n + i - 1);
      } else {
        s_.forward(&out.ids.back(), 1, n + i - 1, logits_.data());
      }
      cache.push_back(out.ids.back());
    }
    if (greedy) {
      if (id < 0) {  // from the catch-up pass's logits
        sampler_.apply_penalties(logits_.data(), vocab, seq);
        id = argmax(logits_.data(), vocab);
      }
    } else {
      sampler_.apply_penalties(logits_.data(), vocab, seq);
      out.q.push_back(sampler_.distribution(logits_.data(), vocab));
      out.q.back().resize(target_vocab_, 0.0);  // over the target's ids
      id = draw_from(out.q.back(), rng_);
    }
    out.ids.push_back(id);
    seq.push_back(id);
    id = -1;
  }
}

void DraftLength::update(int drafted, int accepted) {
  if (drafted <= 0) return;
  if (accepted >= drafted) cur_ = std::min(max_, cur_ + 2);
  else if (accepted == 0) cur_ = std::max(1, cur_ / 2);
}

int draw_from(const std::vector<double>& p, std::mt19937_64& rng) {
  double total = 0;
  for (double v : p) total += v;
  double r = std::uniform_real_distribution<double>(0.0, total)(rng);
  int last = 0;
  for (int i = 0; i < (int)p.size(); ++i) {
    if (!(p[i] > 0)) continue;
    last = i;
    r -= p[i];
    if (r < 0) return i;
  }
  return last;  // rounding left r past the end: the last id with mass
}

int accept_or_resample(const std::vector<double>& p, int x, const std::vector<double>* q,
                       std::mt19937_64& rng, bool* accepted) {
  const double qx = q ? (*q)[x] : 1.0;
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  // u < p/q with u in [0, 1): probability min(1, p(x)/q(x)).
  if (qx > 0 && u * qx < p[x]) {
    *accepted = true;
    return x;
  }
  *accepted = false;
  std::vector<double> residual(p.size());
  double mass = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double qi = q ? (*q)[i] : (i == (size_t)x ? 1.0 : 0.0);
    mass += residual[i] = std::max(0.0, p[i] - qi);
  }
  // No residual mass means p <= q everywhere, p = q: a rejection then has probability 0 and
  // only rounding got here; p itself is the right law.
  return mass > 0 ? draw_from(residual, rng) : draw_from(p, rng);
}

}  // namespace kestrel
