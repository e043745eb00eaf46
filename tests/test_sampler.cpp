// The sampler against distributions built so that the right answer is known by hand: greedy
// and top-k 1 pick the argmax, penalties move exactly the logits they should, top-p and
// min-p cut where the probabilities say, and draws follow the distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "engine/sampler.h"

using kestrel::Sampler;
using kestrel::SamplingParams;

namespace {

std::vector<float> random_logits(int n, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

SamplingParams plain(float temp) {
  SamplingParams p;
  p.temperature = temp;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  return p;
}

// Counts of `draws` samples from fixed logits.
std::map<int, int> histogram(const SamplingParams& p, const std::vector<float>& logits, int draws) {
  Sampler s(p);
  std::map<int, int> h;
  std::vector<float> l;
  for (int i = 0; i < draws; ++i) {
    l = logits;
    ++h[s.sample(l.data(), (int)l.size(), {})];
  }
  return h;
}

// Logits of a vocabulary of `n` where the first probabilities are `head` and the rest share
// what is left equally.
std::vector<float> logits_of(const std::vector<double>& head, int n) {
  const double rest = (1.0 - std::accumulate(head.begin(), head.end(), 0.0)) / (n - head.size());
  std::vector<float> l(n, (float)std::log(rest));
  for (size_t i = 0; i < head.size(); ++i) l[i] = (float)std::log(head[i]);
  return l;
}

TEST(Sampler, GreedyIsArgmax) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    std::vector<float> l = random_logits(32000 + (int)seed, 2.0f, seed);
    const int expect = (int)(std::max_element(l.begin(), l.end()) - l.begin());
    Sampler s(plain(0.0f));
    EXPECT_EQ(s.sample(l.data(), (int)l.size(), {}), expect);
    EXPECT_EQ(kestrel::argmax(l.data(), (int)l.size()), expect);
  }
}

TEST(Sampler, ArgmaxTakesTheFirstOfEqualMaxima) {
  std::vector<float> l(100, 0.0f);
  l[37] = l[81] = 5.0f;
  EXPECT_EQ(kestrel::argmax(l.data(), 100), 37);
}

TEST(Sampler, TopKOneIsArgmax) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    std::vector<float> l = random_logits(32000, 1.0f, 100 + seed);
    const int expect = (int)(std::max_element(l.begin(), l.end()) - l.begin());
    SamplingParams p = plain(1.5f);
    p.top_k = 1;
    p.seed = seed;
    Sampler s(p);
    EXPECT_EQ(s.sample(l.data(), (int)l.size(), {}), expect);
  }
}

TEST(Sampler, SameSeedSameDraws) {
  const std::vector<float> logits = random_logits(1000, 1.0f, 5);
  SamplingParams p;  // defaults: top-k, top-p, min-p, temperature
  p.seed = 1234;
  auto draws = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int> out;
    std::vector<float> l;
    for (int i = 0; i < 64; ++i) {
      l = logits;
      out.push_back(s.sample(l.data(), (int)l.size(), {}));
    }
    return out;
  };
  EXPECT_EQ(draws(1234), draws(1234));
  EXPECT_NE(draws(1234), draws(4321));
}

TEST(Sampler, PenaltiesChangeOnlyTheTokensInTheWindow) {
  SamplingParams p = plain(0.0f);
  p.repeat_penalty = 2.0f;
  p.repeat_last_n = 3;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  Sampler s(p);
  std::vector<float> l = {4.0f, -1.0f, 3.0f, 2.0f, 1.0f, 0.5f};
  // Token 4 is outside the window of the last 3; token 0 appears twice in it, token 1 once.
  s.apply_penalties(l.data(), (int)l.size(), {4, 0, 1, 0});
  EXPECT_FLOAT_EQ(l[0], 4.0f / 2.0f - 2 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[1], -1.0f * 2.0f - 1 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[2], 3.0f);
  EXPECT_FLOAT_EQ(l[3], 2.0f);
  EXPECT_FLOAT_EQ(l[4], 1.0f);
  EXPECT_FLOAT_EQ(l[5], 0.5f);
  // Applied again from the same state: the counts did not leak from the first call.
  std::vector<float> again = {4.0f, -1.0f, 3.0f, 2.0f, 1.0f, 0.5f};
  s.apply_penalties(again.data(), (int)again.size(), {4, 0, 1, 0});
  EXPECT_EQ(again, l);
}

TEST(Sampler, RepeatPenaltyTurnsGreedyAway) {
  SamplingParams p = plain(0.0f);
  p.repeat_penalty = 1.5f;
  Sampler s(p);
  std::vector<float> l = {1.0f, 3.0f, 2.5f};
  EXPECT_EQ(s.sample(l.data(), 3, {1}), 2);  // 3 / 1.5 = 2 < 2.5
}

TEST(Sampler, MinPCutsBelowTheFractionOfTheTop) {
  // p = 0.4, 0.3, 0.12, 0.06, the rest share 0.12 over 996 tokens.
  const auto logits = logits_of({0.4, 0.3, 0.12, 0.06}, 1000);
  for (int top_k : {0, 40}) {
    SamplingParams p = plain(1.0f);
    p.min_p = 0.25f;  // keeps p >= 0.1: tokens 0, 1, 2
    p.top_k = top_k;
    const auto h = histogram(p, logits, 20000);
    EXPECT_EQ(h.size(), 3u) << "top_k " << top_k;
    for (int id : {0, 1, 2}) EXPECT_GT(h.count(id) ? h.at(id) : 0, 1000) << id;
  }
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  const auto logits = logits_of({0.4, 0.3, 0.12, 0.06}, 1000);
  for (int top_k : {0, 40}) {
    for (auto [top_p, kept] : {std::pair{0.65f, 2u}, std::pair{0.8f, 3u}, std::pair{0.1f, 1u}}) {
      SamplingParams p = plain(1.0f);
      p.top_p = top_p;
      p.top_k = top_k;
      // Over the 40 kept by top-k the head's shares grow (they are renormalised over
      // 0.88 + 36 * 0.12 / 996); the cut points hold either way.
      const auto h = histogram(p, logits, 20000);
      EXPECT_EQ(h.size(), kept) << "top_p " << top_p << " top_k " << top_k;
      for (const auto& [id, n] : h) EXPECT_LT(id, (int)kept);
    }
  }
}

// On a large random vocabulary the nucleus found by selection equals the one found by
// sorting: no draw falls outside it, and its likely members all show up.
TEST(Sampler, TopPOverALargeVocabularyMatchesASortedReference) {
  const int n = 32000;
  for (float sigma : {1.0f, 3.0f}) {
    const std::vector<float> logits = random_logits(n, sigma, 77);
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    double z = 0;
    for (float l : logits) z += std::exp((double)l - logits[order[0]]);
    std::set<int> nucleus;
    double acc = 0;
    for (int id : order) {
      nucleus.insert(id);
      acc += std::exp((double)logits[id] - logits[order[0]]) / z;
      if (acc >= 0.9) break;
    }
    SamplingParams p = plain(1.0f);
    p.top_p = 0.9f;
    const auto h = histogram(p, logits, 4000);
    for (const auto& [id, count] : h) EXPECT_TRUE(nucleus.count(id)) << "sigma " << sigma << " id " << id;
    EXPECT_TRUE(h.count(order[0])) << sigma;
  }
}

TEST(Sampler, FrequenciesFollowTheDistributionAtTemperatureOne) {
  const std::vector<double> probs = {0.1, 0.2, 0.3, 0.4};
  std::vector<float> logits;
  for (double q : probs) logits.push_back((float)std::log(q) + 3.0f);  // any shift
  const int draws = 100000;
  const auto h = histogram(plain(1.0f), logits, draws);
  for (int i = 0; i < 4; ++i) {
    const double f = (h.count(i) ? h.at(i) : 0) / (double)draws;
    const double sd = std::sqrt(probs[i] * (1 - probs[i]) / draws);
    EXPECT_NEAR(f, probs[i], 5 * sd) << "token " << i;
  }
}

TEST(Sampler, TemperatureSharpens) {
  // At temperature 0.5 the probabilities go as p^2: 1, 4, 9, 16 over 30.
  const std::vector<double> probs = {0.1, 0.2, 0.3, 0.4};
  std::vector<float> logits;
  for (double q : probs) logits.push_back((float)std::log(q));
  const int draws = 100000;
  const auto h = histogram(plain(0.5f), logits, draws);
  for (int i = 0; i < 4; ++i) {
    const double want = (i + 1) * (i + 1) / 30.0;
    const double f = (h.count(i) ? h.at(i) : 0) / (double)draws;
    EXPECT_NEAR(f, want, 5 * std::sqrt(want * (1 - want) / draws)) << "token " << i;
  }
}

TEST(Sampler, LogprobsAreTheLogSoftmax) {
  const std::vector<float> l = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f};
  double z = 0;
  for (float x : l) z += std::exp((double)x);
  const auto lp = kestrel::logprobs_of(l.data(), 5, 4, 3);
  EXPECT_EQ(lp.chosen.id, 4);
  EXPECT_NEAR(lp.chosen.logprob, 0.5 - std::log(z), 1e-5);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].id, 1);  // ties by id
  EXPECT_EQ(lp.top[1].id, 3);
  EXPECT_EQ(lp.top[2].id, 0);
  EXPECT_NEAR(lp.top[2].logprob, 1.0 - std::log(z), 1e-5);
}

}  // namespace
