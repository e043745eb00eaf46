// Speculative decoding: a drafter proposes the next few tokens cheaply, the target model runs
// them all in one pass (Session::forward over k + 1 tokens), and the standard accept/reject
// rule keeps a prefix of them so that the output follows the target's own distribution
// exactly (greedy: token for token the same as decoding one token at a time). The loop itself
// lives in generate.cpp's run, which shares its stop, end-of-sequence and streaming logic with
// plain decoding; docs/speculative.md has the algorithm and why it is exact.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "models/model.h"

namespace kestrel {

// A drafted continuation of a history: ids[i] is proposed to follow history + ids[0..i). q[i],
// where q is not empty, is the distribution [vocab] that ids[i] was drawn from (a draft model
// that samples); without q every proposal is deterministic (q a point mass at ids[i]).
struct Draft {
  std::vector<int> ids;
  std::vector<std::vector<double>> q;
  void clear() {
    ids.clear();
    q.clear();
  }
};

// Proposes tokens. A drafter affects only how many tokens a verify pass keeps, never which
// ones: any proposal, however bad, leaves the output distribution the target's.
class Drafter {
 public:
  virtual ~Drafter() = default;
  // Up to k ids to follow `history` (the sequence so far; its last id is the one the target
  // runs next), written to `out` (cleared first). Fewer or none when it knows nothing better.
  virtual void propose(const std::vector<int>& history, int k, Draft& out) = 0;
  virtual std::string name() const = 0;
  // Called as each generation starts, with its seed: a drafter that draws at random restarts
  // its stream there, so that a seed pins a generation's output whatever ran before it (a
  // batch's earlier lines, a chat's earlier turns), as it does without speculation.
  virtual void restart(uint64_t /*seed*/) {}
};

// Prompt lookup decoding (llama.cpp's lookup, vLLM's ngram proposer): finds the most recent
// earlier occurrence of the history's last n ids, longest n first (ngram_max down to
// ngram_min), and proposes the ids that followed it. No model: it pays off on text that
// repeats its context (code edits, summaries quoting the prompt, extraction).
class NgramDrafter final : public Drafter {
 public:
  explicit NgramDrafter(int ngram_min = 1, int ngram_max = 4)
      : min_(ngram_min), max_(ngram_max) {}
  void propose(const std::vector<int>& history, int k, Draft& out) override;
  std::string name() const override { return "lookup"; }

 private:
  int min_, max_;
};

// A smaller model with the same vocabulary drafts, through its own session. The session's
// cache is kept to the ids the history and the drafts ran: each propose() runs only what
// follows the longest prefix the history shares with session.cached (rejected drafts are
// simply overwritten, as the target's are), so it follows the target's sequence however the
// caller moved it (a new prompt, a chat dropping its oldest exchanges). Greedy sampling (a
// temperature of 0) drafts the argmax; otherwise the drafts are drawn by `sampling`'s
// transform of the draft logits, and their distributions are handed back for the test.
// The two models may have embedding tables of different sizes over one tokenizer (Qwen2.5's
// small models pad to 151,936 ids, the large to 152,064): drafts stay below target_vocab (0 =
// the draft's own), and each q is a distribution over the target's ids, zero past the draft's.
class ModelDrafter final : public Drafter {
 public:
  ModelDrafter(Session& draft, const SamplingParams& sampling, int target_vocab = 0);
  void propose(const std::vector<int>& history, int k, Draft& out) override;
  std::string name() const override { return "draft"; }
  void restart(uint64_t seed) override;

 private:
  int target_vocab_;
  Session& s_;
  Sampler sampler_;  // its distribution() only: the transform of the draft's logits
  std::mt19937_64 rng_;
  std::vector<float> logits_;
};

// The draft length, adapted to the recent acceptance: each pass asks for next() tokens; a
// pass that accepts every draft grows it by two (up to the maximum), one that rejects the
// first draft halves it (down to one), anything between keeps it. A long run of accepted
// drafts is cheap to verify (one pass), a draft rejected early wastes the rows after it.
class DraftLength {
 public:
  explicit DraftLength(int max) : max_(std::max(1, max)), cur_(max_) {}
  int next() const { return cur_; }
  void update(int drafted, int accepted);

 private:
  int max_, cur_;
};

// The accept/reject test for one drafted id x at a position where the target's distribution
// is p [vocab] and the draft's is q (nullptr: a point mass at x). Accepts with probability
// min(1, p(x) / q(x)) and returns x; otherwise returns an id drawn from the residual
// max(0, p - q) normalized (for a point mass: p without x). *accepted says which.
int accept_or_resample(const std::vector<double>& p, int x, const std::vector<double>* q,
                       std::mt19937_64& rng, bool* accepted);

// The length of the longest common prefix of a and b.
size_t shared_prefix(const std::vector<int>& a, const std::vector<int>& b);

// An id drawn from the distribution p [vocab] (summing to 1 up to rounding).
int draw_from(const std::vector<double>& p, std::mt19937_64& rng);

}  // namespace kestrel
