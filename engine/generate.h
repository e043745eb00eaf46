// The generation loop: prompt in, tokens out, text streamed as it becomes final.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

struct GenerateOptions {
  int max_new_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings: generation ends there, the string unprinted
  bool ignore_eos = false;
};

struct GenerateResult {
  std::vector<int> prompt_ids;
  std::vector<int> ids;        // generated ids (an eos id that ended generation included)
  std::string text;            // generated text, cut before a stop string
  std::string finish_reason;   // "length", "eos" or "stop"
  double prompt_ms = 0;        // time to run the prompt and produce the first logits
  double gen_ms = 0;           // time of the generated tokens after the first
};

// Holds back text that might be the start of a stop string. push() returns what can be
// printed; once a stop string is seen, stopped() is true and nothing further is returned.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(std::string_view text);
  std::string flush();  // the held-back text at the end (no stop string followed)
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

// Runs `prompt_ids` from position `start_pos` and generates. `on_text` receives the text as
// it becomes final (UTF-8 complete, not part of a stop string). Throws kestrel::Error when
// prompt plus generation do not fit the backend's context.
GenerateResult generate(Backend& model, const Tokenizer& tok, const std::vector<int>& prompt_ids,
                        const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text = {},
                        int start_pos = 0);

}  // namespace kestrel
