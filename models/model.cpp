#include "models/model.h"

#include <algorithm>
#include <cmath>

namespace kestrel {

namespace {

// One forward_argmax per next(): nothing runs ahead.
class StepwiseDecodeRun final : public DecodeRun {
 public:
  StepwiseDecodeRun(Session& b, int token, int pos) : b_(b), token_(token), pos_(pos) {}
  int next(bool) override {
    token_ = b_.forward_argmax(token_, pos_++);
    return token_;
  }

 private:
  Session& b_;
  int token_, pos_;
};

}  // namespace

std::unique_ptr<DecodeRun> Session::greedy_run(int token, int pos) {
  return std::make_unique<StepwiseDecodeRun>(*this, token, pos);
}

void Session::forward_argmax_rows(const int* tokens, int n, int pos, int* out) {
  const size_t vocab = config().vocab;
  std::vector<float> last(vocab), all((size_t)n * vocab);
  forward(tokens, n, pos, last.data(), all.data());
  for (int i = 0; i < n; ++i) {
    const float* row = all.data() + (size_t)i * vocab;
    out[i] = (int)(std::max_element(row, row + vocab) - row);
  }
}

void Session::forward_nll(const int* tokens, int n, int pos, const int* targets, double* nll) {
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
