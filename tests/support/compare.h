// How close two float vectors are, for the tests that compare a GPU or batched result with a
// reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kestrel::test {

// ||a - ref|| / ||ref|| (L2, in double); infinite when a holds a NaN or an infinity.
inline double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - (double)ref[i]) * (a[i] - (double)ref[i]);
    den += (double)ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// max |a - ref| / max |ref|, failing the test on any non-finite value of a.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(std::isfinite(a[i]));
    worst = std::max(worst, (double)std::abs(a[i] - ref[i]));
    scale = std::max(scale, (double)std::abs(ref[i]));
  }
  return worst / scale;
}

}  // namespace kestrel::test
