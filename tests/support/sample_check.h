// Checks a device draw against the top-k sampling oracle (kernels/sampling/sample.h), for the
// kernel's and the engine's tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/sampling/sample.h"

namespace kestrel::test {

// Success when `got` is the candidate whose interval [cdf_lo, cdf_hi) of the oracle's
// cumulative distribution holds the random number u, or a neighbour when u lies within 1e-6 of
// that interval's boundary (the kernel sums in another order).
inline ::testing::AssertionResult drawn_by(const std::vector<TopKCandidate>& cand, int got,
                                           double u) {
  auto it = std::find_if(cand.begin(), cand.end(), [&](const TopKCandidate& t) { return t.id == got; });
  if (it == cand.end()) return ::testing::AssertionFailure() << "token " << got << " is not a candidate";
  if ((it->cdf_lo <= u && u < it->cdf_hi) || std::fabs(u - it->cdf_lo) < 1e-6 ||
      std::fabs(u - it->cdf_hi) < 1e-6)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "u " << u << " drew " << got << " holding ["
                                       << it->cdf_lo << ", " << it->cdf_hi << ")";
}

}  // namespace kestrel::test
