// Choosing the next token from logits, in the order llama.cpp applies its samplers:
// penalties (repetition over a window, frequency, presence), then top-k, top-p, min-p,
// temperature, and a draw from the seeded generator. temperature 0 means greedy (argmax).
//
// sample() runs once per generated token on the host, between two decode steps, so it is
// built to cost a small fraction of one (under 2% of a 7B decode step, whatever the
// cut-offs): no allocation after the first call and no sort of the vocabulary. Top-k is a
// threshold scan. Without top-k, min-p is a floor on the logit, the draw walks the weight
// sums of spans of 256 logits from one vectorised exp pass, and top-p tests only the drawn
// token: it belongs to the nucleus exactly when the mass ahead of it is below top_p of the
// total, one more pass over the stored weights (see sample_by_mass in sampler.cpp).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace kestrel {

struct SamplingParams {
  float temperature = 0.8f;    // 0 = greedy
  int top_k = 40;              // 0 = off
  float top_p = 0.95f;         // 1 = off
  float min_p = 0.05f;         // 0 = off
  float repeat_penalty = 1.0f; // 1 = off; applied to tokens in the last repeat_last_n
  int repeat_last_n = 64;      // -1 = the whole history
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks a token. `history` holds the tokens so far (prompt and generated) for penalties.
  // `logits` is modified in place by the penalties.
  int sample(float* logits, int vocab, const std::vector<int>& history);
  const SamplingParams& params() const { return p_; }
  // Whether any penalty changes the logits (repetition, frequency or presence).
  bool has_penalties() const {
    return p_.repeat_penalty != 1.0f || p_.frequency_penalty != 0.0f || p_.presence_penalty != 0.0f;
  }

  // The penalties alone, as sample() applies them (exposed for tests and logprobs).
  void apply_penalties(float* logits, int vocab, const std::vector<int>& history);

  // The probability sample() gives each token of these logits (after penalties), 0 outside
  // the kept set, through the same cut-offs and weights as sample() but without a draw. For
  // speculative decoding's accept/reject test, tests and diagnostics: it allocates, and
  // without top-k it sorts the tokens above the min-p floor to find the nucleus.
  std::vector<double> distribution(const float* logits, int vocab);

 private:
  struct Cand {
    float logit;
    int id;
    float w;  // exp(logit - max) at temperature 1
  };
  void select_top_k(const float* logits, int vocab, int k);
  void keep_nucleus(double need);
  double truncate_top_k(const float* logits, int vocab);
  int sample_top_k(const float* logits, int vocab);
  bool in_nucleus(const float* logits, int vocab, int x, double need, double total) const;
  int sample_by_mass(const float* logits, int vocab);
  int draw(const float* x, int n, const float* w, const double* span_sum, float shift,
           float scale, float floor, double total);
  int draw_from_nucleus(const float* logits, int vocab, float max_logit, float floor,
                        double need, float outside);

  // Draws tested against the nucleus before it is made explicit, and draws at temperature 1
  // refused for a temperature below 1 before the weights at the temperature are computed.
  static constexpr int kNucleusTests = 4;
  static constexpr int kTemperatureRefusals = 8;
  // The search for an explicit nucleus stops with this many logits or fewer at the cut.
  static constexpr int kFewAtTheCut = 64;

  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<int> counts_;     // [vocab], zero between calls
  std::vector<Cand> cand_;      // candidates of the current call
  std::vector<float> buf_;      // [vocab] scratch: block maxima, or weights at temperature 1
  // Weight sums per span of logits: at temperature 1 above the min-p floor, at the
  // temperature above the floor, and at temperature 1 over all logits.
  std::vector<double> spans_;
};

// Index of the largest value (the first one on ties).
int argmax(const float* x, int n);

// log-softmax of raw logits: the log-probability of `chosen` and the `n` most likely tokens,
// most likely first (ties by id).
struct TokenLogprob {
  int id;
  float logprob;
};
struct Logprobs {
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
};
Logprobs logprobs_of(const float* logits, int vocab, int chosen, int n);

}  // namespace kestrel
