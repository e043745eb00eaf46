#include "models/model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "base/error.h"

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

void check_batch_rows(const Model& model, std::span<const BatchRow> rows) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const BatchRow& r = rows[i];
    const std::string row = "forward_batch: row " + std::to_string(i);
    KESTREL_CHECK(r.session != nullptr, row + " has no session");
    KESTREL_CHECK(&r.session->model() == &model, row + "'s session belongs to another model");
    KESTREL_CHECK(r.pos >= 0 && r.pos < r.session->context_length(),
                  row + ": position " + std::to_string(r.pos) + " is outside its context of " +
                      std::to_string(r.session->context_length()));
    KESTREL_CHECK(r.token >= 0 && r.token < model.config().vocab,
                  row + ": token id " + std::to_string(r.token) +
                      " is outside the vocabulary (" + std::to_string(model.config().vocab) + ")");
    // Two rows of one session would write one cache in an order the batch does not define.
    for (size_t j = 0; j < i; ++j)
      KESTREL_CHECK(rows[j].session != r.session,
                    row + " runs the session of row " + std::to_string(j) + " again");
  }
}

void Model::forward_batch(std::span<const BatchRow> rows, float* logits) {
  check_batch_rows(*this, rows);
  const size_t vocab = config().vocab;
  for (size_t i = 0; i < rows.size(); ++i)
    rows[i].session->forward(&rows[i].token, 1, rows[i].pos, logits + i * vocab);
}

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
