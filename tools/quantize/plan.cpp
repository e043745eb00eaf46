#include "tools/quantize/plan.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "base/error.h"

namespace kestrel::quant {

uint64_t gptq_linear_bytes(int64_t N, int64_t K, int bits, int group_size, bool g_idx) {
  KESTREL_CHECK(N > 0 && K > 0 && K * bits % 32 == 0 && N * bits % 32 == 0,
                fmt::format("a [{}, {}] linear cannot be packed at {} bits", N, K, bits));
  const uint64_t G = group_size == -1 ? 1 : (uint64_t)((K + group_size - 1) / group_size);
  return (uint64_t)(K * bits / 32) * N * 4 + G * (uint64_t)(N * bits / 32) * 4 + G * N * 2 +
         (g_idx ? (uint64_t)K * 4 : 0);
}

MixedPlan plan_mixed_precision(const std::vector<PlanLinear>& linears, uint64_t budget,
                               int64_t resolution) {
  KESTREL_CHECK(resolution > 0, "plan_mixed_precision: resolution must be positive");
  uint64_t largest = 0, smallest = 0;
  for (const PlanLinear& l : linears) {
    KESTREL_CHECK(!l.candidates.empty(), fmt::format("{}: no candidate settings to plan with", l.name));
    uint64_t hi = 0, lo = std::numeric_limits<uint64_t>::max();
    for (const PlanCandidate& c : l.candidates) {
      hi = std::max(hi, c.bytes);
      lo = std::min(lo, c.bytes);
    }
    largest += hi;
    smallest += lo;
  }
  KESTREL_CHECK(smallest <= budget,
                fmt::format("a budget of {} bytes is below the smallest plan ({} bytes: every "
                            "linear at its smallest setting)", budget, smallest));
  const uint64_t unit = std::max<uint64_t>(1, (largest + resolution - 1) / resolution);
  // Capacities past the largest plan change nothing: every plan fits there.
  const uint64_t cap = std::min(budget / unit, (largest + unit - 1) / unit + (uint64_t)linears.size());
  auto units = [&](uint64_t bytes) { return (bytes + unit - 1) / unit; };

  // best[c]: the least error of the linears so far within c units; pick[i][c]: linear i's
  // candidate in that optimum. Ties keep the earlier candidate, so plans are deterministic.
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<double> best(cap + 1, 0.0), next(cap + 1);
  for (const PlanLinear& l : linears)
    KESTREL_CHECK(l.candidates.size() <= 32767, fmt::format("{}: too many candidate settings", l.name));
  std::vector<std::vector<int16_t>> pick(linears.size(), std::vector<int16_t>(cap + 1, -1));
  for (size_t i = 0; i < linears.size(); ++i) {
    const std::vector<PlanCandidate>& cands = linears[i].candidates;
    for (uint64_t c = 0; c <= cap; ++c) {
      double b = kNone;
      for (size_t j = 0; j < cands.size(); ++j) {
        const uint64_t w = units(cands[j].bytes);
        if (w > c || best[c - w] == kNone) continue;
        const double e = best[c - w] + cands[j].error;
        if (e < b) {
          b = e;
          pick[i][c] = (int16_t)j;
        }
      }
      next[c] = b;
    }
    best.swap(next);
  }
  KESTREL_CHECK(best[cap] != kNone,
                fmt::format("a budget of {} bytes fits no plan at the planner's resolution of {} "
                            "bytes (the smallest plan is {} bytes)", budget, unit, smallest));
  MixedPlan plan;
  plan.choice.assign(linears.size(), 0);
  uint64_t c = cap;
  for (size_t i = linears.size(); i-- > 0;) {
    const int j = pick[i][c];
    plan.choice[i] = j;
    c -= units(linears[i].candidates[j].bytes);
  }
  for (size_t i = 0; i < linears.size(); ++i) {
    const PlanCandidate& p = linears[i].candidates[plan.choice[i]];
    plan.bytes += p.bytes;
    plan.error += p.error;
  }
  return plan;
}

}  // namespace kestrel::quant
