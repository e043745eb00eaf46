// Choosing the next token from logits, in the order llama.cpp applies its samplers:
// penalties (repetition over a window, frequency, presence), then top-k, top-p, min-p,
// temperature, and a draw from the seeded generator. temperature 0 means greedy (argmax).
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
  int repeat_last_n = 64;
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

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int>> cand_;  // reused candidate buffer
};

// Index of the largest value (the first one on ties).
int argmax(const float* x, int n);

}  // namespace kestrel
