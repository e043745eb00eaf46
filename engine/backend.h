// What the generation loop, the benchmark and perplexity need from a model running on some
// device: run tokens at positions and hand back logits. The KV cache lives in the backend
// and is indexed by position, so a new conversation simply starts again at position 0.
#pragma once

#include <string>
#include <vector>

#include "engine/config.h"

namespace kestrel {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const ModelConfig& config() const = 0;
  // Positions the KV cache holds; pos + n must stay within it.
  virtual int context_length() const = 0;
  // A human-readable device description for messages and tables ("CPU (reference, fp32)").
  virtual std::string device_name() const = 0;

  // Runs tokens[0..n) at positions pos .. pos+n-1, writing their K/V into the cache, and
  // writes the logits of the last token to `logits` [vocab] (fp32, host). When `all_logits`
  // is non-null it receives the logits of every token [n, vocab].
  virtual void forward(const int* tokens, int n, int pos, float* logits,
                       float* all_logits = nullptr) = 0;
};

}  // namespace kestrel
