// The median of a benchmark's samples, shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <vector>

namespace kestrel::bench {

// The middle sample (the mean of the two middle ones for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

}  // namespace kestrel::bench
