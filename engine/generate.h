// The generation loop: prompt in, tokens out, text streamed as it becomes final.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/model.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/token_masker.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

struct GenerateOptions {
  int max_new_tokens = 128;       // -1 = up to the end of the context
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings: generation ends there, the string unprinted
  // Reverse prompts (llama-cli's -r): generation ends when the text ends with one, which is
  // kept in the text.
  std::vector<std::string> reverse_prompts;
  // Stop strings and reverse prompts count only after the first text that is not whitespace
  // (a chat reply's leading blank lines are not a blank line that ends it).
  bool stops_after_text = false;
  std::vector<int> stop_ids;      // more end-of-turn ids besides the tokenizer's EOS ids
  bool ignore_eos = false;        // also ignores stop_ids
  int logprobs = 0;               // > 0: record the top-n log-probabilities of every token
  // Polled before each new token; true ends generation (finish_reason "cancelled").
  std::function<bool()> cancelled;
  // Speculative decoding (engine/speculative.h) when set: each step drafts up to draft_max
  // tokens (adapted to the recent acceptance) and verifies them in one pass of the model. The
  // drafter belongs to the caller and may serve many generations.
  Drafter* drafter = nullptr;
  int draft_max = 8;
  // Structured output (docs/grammar.md): only ids the grammar allows are chosen, greedy or
  // sampled, and an end id only where the text so far is a complete match. Generation ends
  // when the text is a complete match that nothing can extend (finish_reason "stop"). The mask
  // needs the logits on the host, so with a grammar every token's logits come back from the
  // device (no device-side argmax or top-k). `masker` is the tokenizer's (grammar_masker()).
  // Not with a drafter: refused.
  std::shared_ptr<const grammar::Grammar> grammar;
  std::shared_ptr<const grammar::TokenMasker> masker;
  // With a grammar, each step's mask is computed on a second thread while the model runs the
  // step (it depends only on the ids taken so far), so that a device's forward pass hides it.
  // Auto: where the model does not compute on the host's cores (Model::computes_on_host).
  // The ids are the same either way.
  enum class MaskAhead { Auto, On, Off };
  MaskAhead mask_ahead = MaskAhead::Auto;
};

// The token masker of a tokenizer's vocabulary (Tokenizer::all_token_bytes), with its end ids
// and `end_ids` (a chat template's end-of-turn ids) as the ids allowed at a complete match.
// Building it walks the vocabulary once (about 0.2 s for 150k tokens): build once, share.
std::shared_ptr<const grammar::TokenMasker> grammar_masker(const Tokenizer& tok,
                                                           const std::vector<int>& end_ids = {});

// The draft length when --draft-max is not given, and the longest one allowed.
constexpr int kDefaultDraftMax = 8;
constexpr int kMaxDraftMax = 64;

struct GenerateResult {
  std::vector<int> prompt_ids;
  std::vector<int> ids;        // generated ids (an end id that ended generation included)
  std::string text;            // generated text, cut before a stop string
  std::string finish_reason;   // "length", "eos", "stop" (a stop string or reverse prompt)
                               // or "cancelled"
  int n_cached = 0;            // leading prompt ids whose K/V were already in the cache
  int n_eval = 0;              // generated ids run through the model (all but the last)
  int n_sampled = 0;           // ids chosen on the host
  int n_device = 0;            // ids chosen on the device (argmax or top-k), within gen_ms
  double prompt_ms = 0;        // time to run the prompt and produce the first logits
  double gen_ms = 0;           // time of the generated tokens after the first
  double sample_ms = 0;        // of which choosing tokens (sampler, logprobs)
  std::vector<Logprobs> logprobs;  // one per generated id when GenerateOptions::logprobs > 0
  // Speculative decoding: ids proposed by the drafter and verified, those of them kept, and
  // the passes of the model that produced the ids after the first (n_steps; a pass with no
  // draft counts too).
  int n_drafted = 0;
  int n_accepted = 0;
  int n_steps = 0;
  bool speculative = false;  // a drafter was given (its counts above may still be 0)
  // With a grammar: whether the text is a complete match of it (false when -n, a stop string
  // or a cancel ended it early).
  bool grammar_complete = false;
};

// Holds back text that might be the start of a stop string or a reverse prompt. push()
// returns what can be printed; once one is seen, stopped() is true and nothing further is
// returned. The text ends before the stop string, and after the reverse prompt. With
// `after_text`, leading whitespace passes through unsearched.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops, std::vector<std::string> reverse = {},
                       bool after_text = false)
      : stops_(std::move(stops)), reverse_(std::move(reverse)), searching_(!after_text) {}
  std::string push(std::string_view text);
  std::string flush();  // the held-back text at the end (no stop string followed)
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_, reverse_;
  std::string held_;
  bool searching_;  // false while only whitespace has come (after_text)
  bool stopped_ = false;
};

// Runs `prompt_ids` in `session` from position `start_pos` and generates. `on_text` receives
// the text as it becomes final (UTF-8 complete, not part of a stop string). Throws
// kestrel::Error when prompt plus generation do not fit the session's context. Leaves
// session.cached describing the cache.
GenerateResult generate(Session& session, const Tokenizer& tok, const std::vector<int>& prompt_ids,
                        const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text = {},
                        int start_pos = 0);

// Generates after `prompt_ids` (a whole sequence from position 0), running only the part
// after the longest prefix it shares with session.cached (the ids whose K/V the session holds
// from position 0), which it then updates. A session has no rewind; running from a position
// simply overwrites the cache from there. Penalties see the whole prompt.
GenerateResult generate_cached(Session& session, const Tokenizer& tok,
                               const std::vector<int>& prompt_ids, const GenerateOptions& opt,
                               const std::function<void(std::string_view)>& on_text = {});

}  // namespace kestrel
