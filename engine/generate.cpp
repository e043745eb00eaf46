#include "engine/generate.h"

#include <algorithm>
#include <chrono>

#include "engine/error.h"

namespace kestrel {

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return {};
  held_ += text;
  // A complete stop string: emit what precedes the earliest one and stop.
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    cut = std::min(cut, held_.find(s));
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - (s.empty() ? 0 : 1), held_.size()); len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out = stopped_ ? std::string() : held_;
  held_.clear();
  return out;
}

GenerateResult generate(Backend& model, const Tokenizer& tok, const std::vector<int>& prompt_ids,
                        const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text, int start_pos) {
  using clock = std::chrono::steady_clock;
  const int ctx = model.context_length();
  const int vocab = model.config().vocab;
  const int n_prompt = (int)prompt_ids.size();
  KESTREL_CHECK(n_prompt > 0, "the prompt is empty (no tokens to start from)");
  if (start_pos + n_prompt + opt.max_new_tokens > ctx)
    throw Error("prompt (" + std::to_string(n_prompt) + " tokens) plus " +
                std::to_string(opt.max_new_tokens) + " new tokens" +
                (start_pos ? " after " + std::to_string(start_pos) + " cached" : std::string()) +
                " exceed the context of " + std::to_string(ctx) +
                " tokens; shorten the prompt, lower -n or raise -c");

  GenerateResult r;
  r.prompt_ids = prompt_ids;
  r.finish_reason = "length";
  Sampler sampler(opt.sampling);
  StreamDecoder detok(tok, /*at_text_start=*/false);
  StopMatcher stop(opt.stop);
  std::vector<int> history = prompt_ids;
  std::vector<float> logits(vocab);
  auto emit = [&](const std::string& s) {
    if (s.empty()) return;
    r.text += s;
    if (on_text) on_text(s);
  };

  const auto t0 = clock::now();
  model.forward(prompt_ids.data(), n_prompt, start_pos, logits.data());
  auto t1 = clock::now();
  r.prompt_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();

  // Greedy decoding without penalties needs only the argmax: the backend may pick it on its
  // device and hand back one id per token instead of the logits.
  const SamplingParams& sp = opt.sampling;
  const bool argmax_only = sp.temperature <= 0.0f && sp.repeat_penalty == 1.0f &&
                           sp.frequency_penalty == 0.0f && sp.presence_penalty == 0.0f;
  int pos = start_pos + n_prompt;
  for (int i = 0; i < opt.max_new_tokens; ++i) {
    int id;
    if (i == 0) {
      id = sampler.sample(logits.data(), vocab, history);
    } else if (argmax_only) {
      id = model.forward_argmax(r.ids.back(), pos - 1);
    } else {
      model.forward(&r.ids.back(), 1, pos - 1, logits.data());
      id = sampler.sample(logits.data(), vocab, history);
    }
    r.ids.push_back(id);
    history.push_back(id);
    ++pos;
    if (!opt.ignore_eos && tok.is_eos(id)) {
      r.finish_reason = "eos";
      break;
    }
    emit(stop.push(detok.push(id)));
    if (stop.stopped()) {
      r.finish_reason = "stop";
      break;
    }
  }
  if (!stop.stopped()) {
    emit(stop.push(detok.flush()));
    emit(stop.flush());
  }
  r.gen_ms = std::chrono::duration<double, std::milli>(clock::now() - t1).count();
  return r;
}

}  // namespace kestrel
