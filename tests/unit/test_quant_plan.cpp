// The mixed-precision planner against brute force on small instances, its budget and its
// monotonicity on larger ones, and the checkpoint sizes it counts against a hand count.
#include "tools/quantize/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <random>

#include "base/error.h"

namespace kestrel::quant {
namespace {

using ::testing::HasSubstr;

TEST(QuantPlan, LinearBytesCountEveryTensor) {
  // [64, 128] at 4 bits, groups of 32: qweight 16x64 words, qzeros 4x8 words, scales 4x64 fp16,
  // g_idx 128 int32.
  EXPECT_EQ(gptq_linear_bytes(64, 128, 4, 32), 16u * 64 * 4 + 4 * 8 * 4 + 4 * 64 * 2 + 128 * 4);
  EXPECT_EQ(gptq_linear_bytes(64, 128, 4, 32, /*g_idx=*/false), 16u * 64 * 4 + 4 * 8 * 4 + 4 * 64 * 2);
  // 3 bits, one group per row: 12 words per column, 6 words of zeros.
  EXPECT_EQ(gptq_linear_bytes(64, 128, 3, -1), 12u * 64 * 4 + 6 * 4 + 64 * 2 + 128 * 4);
  // A group size that does not divide K: ceil(96 / 64) = 2 groups.
  EXPECT_EQ(gptq_linear_bytes(32, 96, 8, 64), 24u * 32 * 4 + 2 * 8 * 4 + 2 * 32 * 2 + 96 * 4);
  EXPECT_THROW(gptq_linear_bytes(64, 100, 3, 32), Error);
}

std::vector<PlanLinear> random_instance(std::mt19937& rng, int n, int max_cands, uint64_t max_bytes) {
  std::vector<PlanLinear> ls(n);
  for (int i = 0; i < n; ++i) {
    ls[i].name = "l" + std::to_string(i);
    const int c = 1 + (int)(rng() % max_cands);
    for (int j = 0; j < c; ++j)
      ls[i].candidates.push_back({2 + j, 32, 1 + rng() % max_bytes,
                                  std::uniform_real_distribution<double>(0, 10)(rng)});
  }
  return ls;
}

// The least total error within the budget over every assignment.
double brute_force(const std::vector<PlanLinear>& ls, uint64_t budget) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<size_t> idx(ls.size(), 0);
  while (true) {
    uint64_t bytes = 0;
    double err = 0;
    for (size_t i = 0; i < ls.size(); ++i) {
      bytes += ls[i].candidates[idx[i]].bytes;
      err += ls[i].candidates[idx[i]].error;
    }
    if (bytes <= budget) best = std::min(best, err);
    size_t i = 0;
    while (i < ls.size() && ++idx[i] == ls[i].candidates.size()) idx[i++] = 0;
    if (i == ls.size()) return best;
  }
}

void expect_consistent(const std::vector<PlanLinear>& ls, const MixedPlan& p, uint64_t budget) {
  ASSERT_EQ(p.choice.size(), ls.size());
  uint64_t bytes = 0;
  double err = 0;
  for (size_t i = 0; i < ls.size(); ++i) {
    bytes += ls[i].candidates[p.choice[i]].bytes;
    err += ls[i].candidates[p.choice[i]].error;
  }
  EXPECT_EQ(p.bytes, bytes);
  EXPECT_DOUBLE_EQ(p.error, err);
  EXPECT_LE(p.bytes, budget);
}

TEST(QuantPlan, MatchesBruteForceOnSmallInstances) {
  std::mt19937 rng(46);
  for (int trial = 0; trial < 400; ++trial) {
    const auto ls = random_instance(rng, 1 + (int)(rng() % 6), 4, 50);
    uint64_t lo = 0, hi = 0;
    for (const PlanLinear& l : ls) {
      uint64_t a = UINT64_MAX, b = 0;
      for (const PlanCandidate& c : l.candidates) a = std::min(a, c.bytes), b = std::max(b, c.bytes);
      lo += a;
      hi += b;
    }
    const uint64_t budget = lo + rng() % (hi - lo + 1);
    const MixedPlan p = plan_mixed_precision(ls, budget);
    expect_consistent(ls, p, budget);
    EXPECT_NEAR(p.error, brute_force(ls, budget), 1e-9) << "trial " << trial << " budget " << budget;
  }
}

TEST(QuantPlan, LargerBudgetNeverWorseAndNeverOver) {
  // Coarse units (resolution 64 over sizes in the millions): rounding is in play, and the
  // plan must still fit each budget exactly and improve with it.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const auto ls = random_instance(rng, 12, 5, 3'000'000);
    uint64_t lo = 0, hi = 0;
    for (const PlanLinear& l : ls) {
      uint64_t a = UINT64_MAX, b = 0;
      for (const PlanCandidate& c : l.candidates) a = std::min(a, c.bytes), b = std::max(b, c.bytes);
      lo += a;
      hi += b;
    }
    double last = std::numeric_limits<double>::infinity();
    const uint64_t step = (hi - lo) / 50 + 1;
    for (uint64_t k = 0; hi + 1000 >= lo + k * step; ++k) {
      const uint64_t budget = hi + 1000 - k * step;
      MixedPlan p;
      try {
        p = plan_mixed_precision(ls, budget, 64);
      } catch (const Error& e) {  // near the smallest plan, rounding may leave nothing that fits
        EXPECT_THAT(e.what(), HasSubstr("fits no plan at the planner's resolution"));
        break;
      }
      expect_consistent(ls, p, budget);
      if (last != std::numeric_limits<double>::infinity()) {
        EXPECT_GE(p.error, last - 1e-12) << "budget " << budget;  // budgets go down
      }
      last = p.error;
    }
  }
}

TEST(QuantPlan, LlamaShapedPlanAtRealSizes) {
  // A 4-layer Llama (hidden 4096, intermediate 11008): candidates 2/3/4/8 bits at g128 and
  // 4 bits per-channel, errors halving per bit. At the largest plan every linear takes its
  // least error; at the size of 4 bits g128 everywhere, the plan fits and is no worse than that.
  std::vector<PlanLinear> ls;
  uint64_t four_bit = 0;
  double four_bit_error = 0;
  for (int l = 0; l < 4; ++l)
    for (auto [N, K] : std::initializer_list<std::pair<int64_t, int64_t>>{
             {4096, 4096}, {4096, 4096}, {4096, 4096}, {4096, 4096}, {11008, 4096}, {11008, 4096},
             {4096, 11008}}) {
      PlanLinear p;
      p.name = "l";
      const double scale = 1.0 + 0.1 * (double)ls.size();  // linears differ in sensitivity
      for (auto [b, g] : std::initializer_list<std::pair<int, int>>{{2, 128}, {3, 128}, {4, 128}, {4, -1}, {8, 128}})
        p.candidates.push_back({b, g, gptq_linear_bytes(N, K, b, g),
                                scale * std::ldexp(1.0, -b) * (g == -1 ? 1.5 : 1.0)});
      four_bit += p.candidates[2].bytes;
      four_bit_error += p.candidates[2].error;
      ls.push_back(p);
    }
  const MixedPlan all8 = plan_mixed_precision(ls, UINT64_MAX);
  for (int c : all8.choice) EXPECT_EQ(c, 4);
  // The rounding to units costs at most one unit per linear: with that much over the 4-bit
  // size, the all-4-bit plan is one the planner can choose, so it does at least as well.
  uint64_t largest = 0;
  for (const PlanLinear& l : ls) largest += l.candidates[4].bytes;
  const uint64_t unit = (largest + 65535) / 65536;
  const uint64_t budget = four_bit + ls.size() * unit;
  const MixedPlan p = plan_mixed_precision(ls, budget);
  expect_consistent(ls, p, budget);
  EXPECT_LE(p.error, four_bit_error);
}

TEST(QuantPlan, RefusalsInOneLine) {
  std::vector<PlanLinear> ls{{"a", {{4, 128, 100, 1.0}, {2, 128, 60, 3.0}}}, {"b", {{4, 128, 100, 1.0}}}};
  try {
    plan_mixed_precision(ls, 159);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "a budget of 159 bytes is below the smallest plan (160 bytes: every "
                           "linear at its smallest setting)");
  }
  EXPECT_EQ(plan_mixed_precision(ls, 160).choice, (std::vector<int>{1, 0}));
  EXPECT_EQ(plan_mixed_precision(ls, 200).choice, (std::vector<int>{0, 0}));
  ls[1].candidates.clear();
  EXPECT_THAT([&] {
    try {
      plan_mixed_precision(ls, 1000);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  }(), HasSubstr("b: no candidate settings to plan with"));
}

}  // namespace
}  // namespace kestrel::quant
