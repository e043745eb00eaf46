// CPU oracle of the device's top-k sampling (sample.h): the same steps in the same order and
// precision as sample_top_k_f16 (weights exp in fp32, sums in fp64), written plainly.
#include "kernels/sampling/sample.h"

#include <algorithm>
#include <cmath>

#include "base/dtype.h"

namespace kestrel {

std::vector<TopKCandidate> top_k_candidates_ref(const uint16_t* logits, int n,
                                                const TopKSampling& s) {
  struct C {
    float l;
    int id;
  };
  std::vector<C> c;
  for (int i = 0; i < n; ++i) {
    const float l = half_to_float(logits[i]);
    if (!std::isnan(l)) c.push_back({l, i});
  }
  const size_t k = std::min<size_t>(std::max(s.top_k, 1), c.size());
  std::partial_sort(c.begin(), c.begin() + k, c.end(), [](const C& a, const C& b) {
    return a.l != b.l ? a.l > b.l : a.id < b.id;
  });
  c.resize(k);
  std::vector<TopKCandidate> out;
  if (c.empty()) return out;
  const float mx = c[0].l;
  size_t keep = k;
  if (s.top_p < 1.0f) {
    double total = 0;
    for (const C& x : c) total += std::exp(x.l - mx);
    const double need = double(s.top_p) * total;
    double acc = 0;
    for (size_t i = 0; i < k; ++i) {
      acc += std::exp(c[i].l - mx);
      if (acc >= need) {
        keep = i + 1;
        break;
      }
    }
  }
  if (s.min_p > 0.0f) {
    const float floor = mx + std::log(s.min_p);
    size_t above = 0;
    while (above < k && c[above].l >= floor) ++above;
    keep = std::min(keep, above);
  }
  keep = std::max<size_t>(keep, 1);
  const float inv_t = 1.0f / s.temperature;
  std::vector<double> w(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += w[i] = std::exp((c[i].l - mx) * inv_t);
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    out.push_back({c[i].id, w[i] / total, acc / total, (acc + w[i]) / total});
    acc += w[i];
  }
  out.back().cdf_hi = 1.0;
  return out;
}

int sample_top_k_ref(const uint16_t* logits, int n, const TopKSampling& s, double u) {
  const std::vector<TopKCandidate> c = top_k_candidates_ref(logits, n, s);
  if (c.empty()) return 0;
  for (const TopKCandidate& x : c)
    if (u < x.cdf_hi) return x.id;
  return c.back().id;
}

}  // namespace kestrel
