// The sampler against distributions built so that the right answer is known by hand: greedy
// and top-k 1 pick the argmax, penalties move exactly the logits they should, top-p and
// min-p cut where the probabilities say, and draws follow the distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "base/dtype.h"
#include "engine/sampler.h"
#include "kernels/sampling/sample.h"

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

// llama.cpp's chain written the plain way, in double: order by logit (ties by id), top-k,
// softmax, the top-p prefix (a token stays while the mass ahead of it is below p), min-p
// against the top token, the temperature, normalise. Tokens whose mass ahead lies within
// fp32 rounding of the top-p cut could fall either way in the sampler's float arithmetic;
// `borderline` says whether there were any.
std::vector<double> reference(const std::vector<float>& l, const SamplingParams& p,
                              bool* borderline) {
  const int n = (int)l.size();
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return l[a] != l[b] ? l[a] > l[b] : a < b; });
  if (p.top_k > 0 && p.top_k < n) order.resize(p.top_k);
  const double m = l[order[0]];
  double z = 0;
  for (int id : order) z += std::exp(l[id] - m);
  *borderline = false;
  if (p.top_p < 1.0f) {
    const double need = (double)p.top_p * z;
    double ahead = 0;
    size_t keep = order.size();
    for (size_t j = 0; j < order.size(); ++j) {
      if (std::abs(ahead - need) <= 1e-5 * z) *borderline = true;
      if (j > 0 && !(ahead < need)) {
        keep = j;
        break;
      }
      ahead += std::exp(l[order[j]] - m);
    }
    order.resize(keep);
  }
  if (p.min_p > 0.0f) {
    const float floor = (float)m + std::log(p.min_p);  // as llama.cpp, in float
    std::erase_if(order, [&](int id) { return l[id] < floor; });
  }
  std::vector<double> prob(n, 0.0);
  double total = 0;
  for (int id : order) total += prob[id] = std::exp((l[id] - m) / p.temperature);
  for (double& q : prob) q /= total;
  return prob;
}

SamplingParams params(int top_k, float top_p, float min_p, float temp) {
  SamplingParams p;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.temperature = temp;
  return p;
}

// Cut-offs across the paths: top-k, top-p with and without min-p at temperatures below,
// at and above 1, min-p alone, no truncation, and top-p small enough that draws often land
// outside the nucleus (the explicit nucleus).
const std::vector<SamplingParams> kConfigs = {
    params(0, 0.95f, 0.05f, 0.8f), params(0, 0.95f, 0.0f, 0.8f), params(0, 1.0f, 0.0f, 0.8f),
    params(0, 1.0f, 0.05f, 1.3f),  params(0, 0.5f, 0.0f, 1.0f),  params(0, 0.9f, 0.1f, 2.0f),
    params(0, 0.1f, 0.0f, 0.7f),   params(40, 0.95f, 0.05f, 0.8f), params(200, 0.9f, 0.0f, 1.5f),
};

// Logits of several shapes: flat, peaked, a few spikes over a flat floor, coarse steps (many
// ties), and flat with a tenth masked to -inf.
std::vector<float> shaped_logits(int shape, int n, uint64_t seed) {
  std::vector<float> l = random_logits(n, shape == 1 ? 5.0f : 1.0f, seed);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_int_distribution<int> any(0, n - 1);
  if (shape == 2)
    for (int i = 0; i < 3; ++i) l[any(rng)] += 8.0f + i;
  if (shape == 3)
    for (float& x : l) x = std::round(x * 2.0f) / 2.0f;
  if (shape == 4)
    for (int i = 0; i < n / 10; ++i) l[any(rng)] = -std::numeric_limits<float>::infinity();
  return l;
}

// The kept set and the probabilities of every token equal the sorted reference's, for many
// logit vectors and every configuration.
TEST(Sampler, DistributionEqualsASortedReference) {
  int compared = 0, skipped = 0;
  for (int shape = 0; shape < 5; ++shape) {
    for (int n : {1000, 3001}) {
      for (uint64_t seed = 0; seed < 4; ++seed) {
        const std::vector<float> logits = shaped_logits(shape, n, 1000 * shape + 10 * n + seed);
        for (size_t c = 0; c < kConfigs.size(); ++c) {
          bool borderline;
          const std::vector<double> want = reference(logits, kConfigs[c], &borderline);
          if (borderline) {
            ++skipped;
            continue;
          }
          Sampler s(kConfigs[c]);
          const std::vector<double> got = s.distribution(logits.data(), n);
          ASSERT_EQ(got.size(), (size_t)n);
          for (int i = 0; i < n; ++i) {
            ASSERT_EQ(got[i] > 0, want[i] > 0) << "shape " << shape << " n " << n << " seed "
                                               << seed << " config " << c << " token " << i;
            ASSERT_NEAR(got[i], want[i], 1e-5 * want[i] + 1e-12)
                << "shape " << shape << " config " << c << " token " << i;
          }
          ++compared;
        }
      }
    }
  }
  EXPECT_LE(skipped, compared / 20);  // the borderline cases are rare, or the test says little
}

// The same at the full vocabulary size, the shapes the benchmark measures.
TEST(Sampler, DistributionOverAFullVocabularyEqualsTheReference) {
  for (float sigma : {1.0f, 2.5f, 5.0f}) {
    const std::vector<float> logits = random_logits(32000, sigma, 4242);
    for (size_t c = 0; c < 3; ++c) {
      bool borderline;
      const std::vector<double> want = reference(logits, kConfigs[c], &borderline);
      if (borderline) continue;
      Sampler s(kConfigs[c]);
      const std::vector<double> got = s.distribution(logits.data(), 32000);
      int kept = 0;
      for (int i = 0; i < 32000; ++i) {
        ASSERT_EQ(got[i] > 0, want[i] > 0) << "sigma " << sigma << " config " << c << " " << i;
        ASSERT_NEAR(got[i], want[i], 1e-5 * want[i] + 1e-12);
        kept += want[i] > 0;
      }
      EXPECT_GT(kept, 1) << "sigma " << sigma << " config " << c;
    }
  }
}

// Pearson's statistic of the counts against the probabilities, cells with an expectation below
// 5 pooled; and the number of degrees of freedom. Any draw of a token with probability 0 fails.
std::pair<double, int> chi_square(const std::vector<int>& counts, const std::vector<double>& prob,
                                  int draws) {
  double stat = 0, pooled_e = 0;
  int pooled_o = 0, cells = 0;
  for (size_t i = 0; i < prob.size(); ++i) {
    if (prob[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = prob[i] * draws;
    if (e < 5) {
      pooled_e += e;
      pooled_o += counts[i];
      continue;
    }
    stat += (counts[i] - e) * (counts[i] - e) / e;
    ++cells;
  }
  if (pooled_e > 0) {
    stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++cells;
  }
  return {stat, cells - 1};
}

// The draws follow the reference probabilities: a chi-square bound six standard deviations
// above its mean, and no draw outside the kept set.
TEST(Sampler, DrawFrequenciesMatchTheReference) {
  const int n = 300, draws = 60000;
  for (int shape : {0, 3, 4}) {
    const std::vector<float> logits = shaped_logits(shape, n, 77 + shape);
    for (size_t c = 0; c < kConfigs.size(); ++c) {
      bool borderline;
      const std::vector<double> want = reference(logits, kConfigs[c], &borderline);
      if (borderline) continue;
      SamplingParams p = kConfigs[c];
      p.seed = 1000 + c;
      Sampler s(p);
      std::vector<int> counts(n, 0);
      std::vector<float> l;
      for (int i = 0; i < draws; ++i) {
        l = logits;
        ++counts[s.sample(l.data(), n, {})];
      }
      const auto [stat, dof] = chi_square(counts, want, draws);
      if (dof == 0) continue;
      EXPECT_LT(stat, dof + 6 * std::sqrt(2.0 * dof)) << "shape " << shape << " config " << c;
    }
  }
}

// Equal logits order by id: top-p 0.5 over 100 of them keeps exactly the first 50 (the mass
// ahead of token 50 is 50/100, not below 0.5), and half of the draws land outside, so the
// explicit nucleus is used too.
TEST(Sampler, TopPOverEqualLogitsKeepsTheLowestIds) {
  const std::vector<float> logits(100, 0.25f);
  SamplingParams p = params(0, 0.5f, 0.0f, 0.9f);
  Sampler s(p);
  const std::vector<double> prob = s.distribution(logits.data(), 100);
  for (int i = 0; i < 100; ++i) EXPECT_DOUBLE_EQ(prob[i], i < 50 ? 1.0 / 50 : 0.0) << i;
  std::vector<int> counts(100, 0);
  std::vector<float> l;
  for (int i = 0; i < 20000; ++i) {
    l = logits;
    ++counts[s.sample(l.data(), 100, {})];
  }
  for (int i = 0; i < 100; ++i) {
    if (i < 50) {
      EXPECT_NEAR(counts[i], 400, 5 * std::sqrt(400.0)) << i;
    } else {
      EXPECT_EQ(counts[i], 0) << i;
    }
  }
}

// A token masked with -inf is never drawn, whatever the cut-offs.
TEST(Sampler, MaskedTokensAreNeverDrawn) {
  std::vector<float> logits = random_logits(2000, 1.0f, 9);
  for (int i = 0; i < 2000; i += 2) logits[i] = -std::numeric_limits<float>::infinity();
  for (const SamplingParams& c : kConfigs) {
    Sampler s(c);
    std::vector<float> l;
    for (int i = 0; i < 2000; ++i) {
      l = logits;
      const int id = s.sample(l.data(), 2000, {});
      ASSERT_EQ(id % 2, 1) << "top_k " << c.top_k << " top_p " << c.top_p << " min_p " << c.min_p;
    }
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

// ---- The device's top-k sampling (kernels/sampling/sample.h) ---------------------------------

// Random123's published known-answer vectors for Philox4x32-10.
TEST(DeviceSampling, PhiloxKnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    kestrel::philox4x32_10(k.ctr, k.key, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], k.out[i]) << "word " << i;
  }
}

// Uniform on [0, 1): the mean and the deciles of many draws, and different seeds differ.
TEST(DeviceSampling, UniformDraws) {
  const int n = 200000;
  std::vector<int> decile(10, 0);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    const double u = kestrel::philox_uniform(7, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    ++decile[(int)(u * 10)];
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  for (int d : decile) EXPECT_NEAR(d, n / 10, n / 100);
  int same = 0;
  for (int i = 0; i < 100; ++i) same += kestrel::philox_uniform(7, i) == kestrel::philox_uniform(8, i);
  EXPECT_EQ(same, 0);
}

// The device's rule is the host Sampler's top-k path: over fp16 logits of every shape and the
// top-k configurations, the oracle of the device kernel keeps the same tokens with the same
// probabilities as Sampler::distribution (fp32 exp there against a fast polynomial here: 1e-4).
TEST(DeviceSampling, RuleIsTheSamplersTopKPath) {
  std::vector<SamplingParams> configs;
  for (const SamplingParams& p : kConfigs)
    if (p.top_k > 0) configs.push_back(p);
  configs.push_back(params(1, 1.0f, 0.0f, 0.8f));
  configs.push_back(params(256, 0.95f, 0.05f, 0.8f));
  configs.push_back(params(7, 0.5f, 0.2f, 1.7f));
  int compared = 0;
  for (int shape = 0; shape < 5; ++shape)
    for (int n : {300, 32000}) {
      std::vector<float> logits = shaped_logits(shape, n, 77 * shape + n);
      std::vector<uint16_t> h(n);
      for (int i = 0; i < n; ++i) {
        h[i] = kestrel::float_to_half(logits[i]);
        logits[i] = kestrel::half_to_float(h[i]);
      }
      for (const SamplingParams& p : configs) {
        kestrel::TopKSampling t;
        t.top_k = p.top_k;
        t.top_p = p.top_p;
        t.min_p = p.min_p;
        t.temperature = p.temperature;
        const std::vector<kestrel::TopKCandidate> c = kestrel::top_k_candidates_ref(h.data(), n, t);
        Sampler s(p);
        const std::vector<double> want = s.distribution(logits.data(), n);
        std::vector<double> got(n, 0.0);
        double cdf = 0;
        for (const kestrel::TopKCandidate& x : c) {
          got[x.id] = x.p;
          EXPECT_NEAR(x.cdf_lo, cdf, 1e-12);
          cdf = x.cdf_hi;
        }
        EXPECT_EQ(cdf, 1.0);
        for (int i = 0; i < n; ++i) {
          ASSERT_EQ(got[i] > 0, want[i] > 0)
              << "shape " << shape << " n " << n << " top_k " << p.top_k << " token " << i;
          ASSERT_NEAR(got[i], want[i], 1e-4 * want[i] + 1e-9) << "token " << i;
        }
        // The draw picks the candidate whose interval holds u.
        for (double u : {0.0, 0.3, 0.999999}) {
          const int id = kestrel::sample_top_k_ref(h.data(), n, t, u);
          auto it = std::find_if(c.begin(), c.end(), [&](auto& x) { return x.id == id; });
          ASSERT_NE(it, c.end());
          EXPECT_LE(it->cdf_lo, u);
          EXPECT_LT(u, it->cdf_hi);
        }
        ++compared;
      }
    }
  EXPECT_EQ(compared, 5 * 2 * (int)configs.size());
}
