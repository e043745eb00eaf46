#include "engine/backend.h"

#include <algorithm>
#include <cmath>

namespace kestrel {

void Backend::forward_nll(const int* tokens, int n, int pos, const int* targets, double* nll) {
  const size_t vocab = config().vocab;
  std::vector<float> last(vocab), all((size_t)n * vocab);
  forward(tokens, n, pos, last.data(), all.data());
  for (int i = 0; i < n; ++i) {
    if (targets[i] < 0) {
      nll[i] = 0.0;
      continue;
    }
    const float* row = all.data() + (size_t)i * vocab;
    const double mx = *std::max_element(row, row + vocab);
    double sum = 0;
    for (size_t v = 0; v < vocab; ++v) sum += std::exp((double)row[v] - mx);
    nll[i] = std::log(sum) + mx - row[targets[i]];
  }
}

}  // namespace kestrel
