#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "base/error.h"
#include "engine/speculative.h"

namespace kestrel {

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return {};
  std::string out;
  if (!searching_) {  // leading whitespace goes through as it is
    const size_t first = text.find_first_not_of(" \t\r\n");
    out = std::string(text.substr(0, std::min(first, text.size())));
    if (first == std::string_view::npos) return out;
    text.remove_prefix(first);
    searching_ = true;
  }
  held_ += text;
  // A complete stop string or reverse prompt: emit what precedes the earliest one (and the
  // reverse prompt itself) and stop.
  size_t at = std::string::npos, cut = 0;
  auto find = [&](const std::vector<std::string>& strings, bool keep) {
    for (const std::string& s : strings) {
      if (s.empty()) continue;
      const size_t p = held_.find(s);
      if (p < at) {
        at = p;
        cut = keep ? p + s.size() : p;
      }
    }
  };
  find(stops_, false);
  find(reverse_, true);
  if (at != std::string::npos) {
    stopped_ = true;
    out += held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of one of them.
  size_t keep = 0;
  for (const auto* strings : {&stops_, &reverse_}) {
    for (const std::string& s : *strings) {
      for (size_t len = std::min(s.size() - (s.empty() ? 0 : 1), held_.size()); len > keep;
           --len) {
        if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
          keep = len;
          break;
        }
      }
    }
  }
  out += held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out = stopped_ ? std::string() : held_;
  held_.clear();
  return out;
}

namespace {

using clock = std::chrono::steady_clock;
double ms_since(clock::time_point t) {
  return std::chrono::duration<double, std::milli>(clock::now() - t).count();
}

// Speculative steps after the first generated id, until max_new ids, an end or a stop. Each
// step asks the drafter for up to k ids, runs the last id and the drafts in one pass at
// positions pos-1 .. pos-1+k, and walks the rows: row j is the target's distribution after
// the drafts before it, where draft j is accepted or replaced (and the step ends), and the
// row after the last draft gives a bonus id. Every id goes through `take` as plain decoding's
// do, so an end id or a stop inside an accepted run ends there and nothing after it is
// emitted. Rejected drafts leave K/V past the new position, which the next pass overwrites
// before anything attends to it; only taken ids reach the result (and session.cached).
template <class Take>
void speculate(Session& model, const GenerateOptions& opt, std::vector<int>& history, int& pos,
               int max_new, Sampler& sampler, GenerateResult& r, Take& take) {
  const int ctx = model.context_length();
  const int vocab = model.config().vocab;
  const SamplingParams& sp = sampler.params();
  const bool greedy = sp.temperature <= 0.0f;
  const bool penalties = sampler.has_penalties();
  // Greedy without penalties or logprobs needs only each row's argmax, which a GPU model takes
  // on the device (Session::forward_argmax_rows).
  const bool argmax_rows = greedy && !penalties && opt.logprobs <= 0;
  std::mt19937_64 rng(sp.seed ^ 0x9E3779B97F4A7C15ULL);  // the accept/reject test's own stream
  opt.drafter->restart(sp.seed);
  DraftLength length(opt.draft_max);
  Draft draft;
  std::vector<int> tokens, best;
  std::vector<float> last(vocab), all, row(vocab);
  while ((int)r.ids.size() < max_new) {
    if (opt.cancelled && opt.cancelled()) {
      r.finish_reason = "cancelled";
      return;
    }
    // At most the ids still wanted after this step's own one, and within the context: the
    // pass writes positions pos-1 .. pos-1+k.
    const int k_max = std::min({length.next(), max_new - (int)r.ids.size() - 1, ctx - pos});
    draft.clear();
    if (k_max > 0) opt.drafter->propose(history, k_max, draft);
    const int k = std::min((int)draft.ids.size(), std::max(k_max, 0));
    tokens.assign(1, r.ids.back());
    tokens.insert(tokens.end(), draft.ids.begin(), draft.ids.begin() + k);
    ++r.n_steps;
    const int at = pos - 1;
    // Every draft counts as drafted, and as rejected unless accepted (those after a rejected
    // one too, as llama.cpp, vLLM and OpenAI's rejected_prediction_tokens count them), except
    // the drafts past the row where generation ended (an end id, a stop, a cancel): those were
    // never judged.
    const int accepted_before = r.n_accepted;
    r.n_drafted += k;
    bool go_on = true;
    // Polled before each id after the step's first, as plain decoding polls before each id.
    auto cancel = [&](int j) {
      if (j == 0 || !opt.cancelled || !opt.cancelled()) return false;
      r.finish_reason = "cancelled";
      r.n_drafted -= k - j;  // drafts j.. were not judged
      return true;
    };
    // take() ended generation at row j, which judged draft j: the drafts after it were not.
    auto ended_at = [&](int j) { r.n_drafted -= std::max(0, k - 1 - j); };
    if (argmax_rows) {
      best.resize(k + 1);
      model.forward_argmax_rows(tokens.data(), k + 1, at, best.data());
      for (int j = 0; j <= k && go_on; ++j) {
        if (cancel(j)) return;
        const bool hit = j < k && best[j] == tokens[j + 1];
        r.n_accepted += hit;
        r.n_device += 1;
        go_on = take(best[j]);
        if (!go_on) ended_at(j);
        if (!hit) break;
      }
    } else {
      all.resize((size_t)(k + 1) * vocab);
      model.forward(tokens.data(), k + 1, at, last.data(), all.data());
      for (int j = 0; j <= k && go_on; ++j) {
        if (cancel(j)) return;
        const auto ts = std::chrono::steady_clock::now();
        const float* raw = all.data() + (size_t)j * vocab;
        row.assign(raw, raw + vocab);
        // `history` holds exactly the ids before this row's position: the taken drafts before it.
        sampler.apply_penalties(row.data(), vocab, history);
        int id;
        bool hit = false;
        if (greedy) {
          id = argmax(row.data(), vocab);
          hit = j < k && id == tokens[j + 1];
        } else {
          const std::vector<double> p = sampler.distribution(row.data(), vocab);
          if (j < k) {
            const std::vector<double>* q = draft.q.empty() ? nullptr : &draft.q[j];
            id = accept_or_resample(p, tokens[j + 1], q, rng, &hit);
          } else {
            id = draw_from(p, rng);
          }
        }
        if (opt.logprobs > 0) r.logprobs.push_back(logprobs_of(raw, vocab, id, opt.logprobs));
        r.sample_ms += ms_since(ts);
        ++r.n_sampled;
        r.n_accepted += hit;
        go_on = take(id);
        if (!go_on) ended_at(j);
        if (!hit) break;
      }
    }
    if (!go_on) return;
    length.update(k, r.n_accepted - accepted_before);
  }
}

// One background thread that runs one job at a time: start() hands it a job, wait() blocks
// until the job is done and rethrows what it threw. The destructor waits for a running job.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> l(m_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  void start(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> l(m_);
      job_ = std::move(job);
      busy_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return !busy_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
      cv_.wait(l, [&] { return quit_ || job_ != nullptr; });
      if (job_ == nullptr) return;  // quit, with no job left to run
      std::function<void()> job = std::exchange(job_, nullptr);
      l.unlock();
      std::exception_ptr e;
      try {
        job();
      } catch (...) {
        e = std::current_exception();
      }
      l.lock();
      error_ = e;
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool busy_ = false, quit_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: it starts with the members above constructed
};

// Runs prompt_ids[first..] at positions first.. and generates.
GenerateResult run(Session& model, const Tokenizer& tok, const std::vector<int>& prompt_ids,
                   int first, int pos0, const GenerateOptions& opt,
                   const std::function<void(std::string_view)>& on_text) {
  const int ctx = model.context_length();
  const int vocab = model.config().vocab;
  const int n_prompt = (int)prompt_ids.size();
  const int n_run = n_prompt - first;
  KESTREL_CHECK(n_prompt > 0, "the prompt is empty (no tokens to start from)");
  KESTREL_CHECK(n_run > 0, "nothing to run: the whole prompt is cached");
  // Longer drafts than the CLI allows would make verify passes past what the CPU engine runs
  // row by row (the ids of a BLAS batch may differ from decode steps') and past the GPU's graphs.
  KESTREL_CHECK(!opt.drafter || (opt.draft_max >= 1 && opt.draft_max <= kMaxDraftMax),
                "draft_max must be between 1 and " + std::to_string(kMaxDraftMax) + ", got " +
                    std::to_string(opt.draft_max));
  // -1: every position the context has left.
  const int max_new = opt.max_new_tokens < 0 ? ctx - (pos0 + n_run) : opt.max_new_tokens;
  const int need = opt.max_new_tokens < 0 ? 1 : opt.max_new_tokens;
  if (pos0 + n_run + need > ctx)
    throw Error("prompt (" + std::to_string(pos0 + n_run) + " tokens) plus " +
                std::to_string(need) + " new tokens exceed the context of " +
                std::to_string(ctx) + " tokens; shorten the prompt, lower -n or raise -c");

  GenerateResult r;
  r.prompt_ids = prompt_ids;
  r.n_cached = first;
  r.finish_reason = "length";
  Sampler sampler(opt.sampling);
  StreamDecoder detok(tok, /*at_text_start=*/false);
  StopMatcher stop(opt.stop, opt.reverse_prompts, opt.stops_after_text);
  std::vector<int> history = prompt_ids;
  history.reserve(history.size() + max_new);
  std::vector<float> logits(vocab), raw;
  auto emit = [&](const std::string& s) {
    if (s.empty()) return;
    r.text += s;
    if (on_text) on_text(s);
  };
  auto is_end = [&](int id) {
    return !opt.ignore_eos && (tok.is_eos(id) || std::find(opt.stop_ids.begin(),
                                                            opt.stop_ids.end(), id) !=
                                                      opt.stop_ids.end());
  };


  // Without penalties and logprobs the token can be picked on the backend's device, which then
  // hands back one id per token instead of the logits: greedy decoding (the argmax), and
  // top-k sampling with k up to kDeviceTopKMax (sampled_run; where the backend cannot, the host
  // samples). Each device draw is a function of the seed and its index (philox_uniform), so a
  // seed still fixes the output; the first token, from the prompt's logits, is the host's.
  const SamplingParams& sp = opt.sampling;
  // Structured output: the grammar's state follows the taken ids, and choose() masks the
  // logits with the ids it allows.
  std::optional<grammar::GrammarState> gstate;
  grammar::MaskCache mask_cache;
  std::vector<uint32_t> mask;
  if (opt.grammar) {
    KESTREL_CHECK(opt.masker && opt.masker->vocab_size() == tok.vocab_size(),
                  "a grammar needs the token masker of the model's tokenizer");
    KESTREL_CHECK(!opt.drafter, "speculative decoding does not take a grammar");
    gstate.emplace(opt.grammar);
    mask.resize(opt.masker->mask_words());
  }
  // The ids the grammar allows after the text so far, end ids cleared where they may not end it.
  auto compute_mask = [&] {
    opt.masker->allowed_tokens(*gstate, mask.data(), mask_cache);
    if (opt.ignore_eos)
      for (int id : opt.masker->eos_ids()) mask[id >> 5] &= ~(1u << (id & 31));
  };
  // The mask computed beside the model's pass (GenerateOptions::mask_ahead). Declared after
  // what its jobs use, so that its destructor, which waits for a running job, comes first.
  const bool ahead_on = gstate && (opt.mask_ahead == GenerateOptions::MaskAhead::On ||
                                   (opt.mask_ahead == GenerateOptions::MaskAhead::Auto &&
                                    !model.model().computes_on_host()));
  std::optional<Worker> ahead;
  if (ahead_on) ahead.emplace();
  bool mask_ready = false;
  // Runs a pass of the model, with the next step's mask computed beside it where asked.
  auto forward = [&](const int* tokens, int n, int pos) {
    if (!ahead) {
      model.forward(tokens, n, pos, logits.data());
      return;
    }
    ahead->start(compute_mask);
    try {
      model.forward(tokens, n, pos, logits.data());
    } catch (...) {
      try {
        ahead->wait();
      } catch (...) {  // the pass's error is the one to report
      }
      throw;
    }
    ahead->wait();
    mask_ready = true;
  };

  const auto t0 = clock::now();
  forward(prompt_ids.data() + first, n_run, pos0);
  const auto t1 = clock::now();
  r.prompt_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  const bool no_penalties = sp.repeat_penalty == 1.0f && sp.frequency_penalty == 0.0f &&
                            sp.presence_penalty == 0.0f && opt.logprobs <= 0;
  const bool argmax_only = no_penalties && sp.temperature <= 0.0f;
  bool on_device = !opt.grammar && (argmax_only || (no_penalties && sp.top_k > 0 && sp.top_k < vocab &&
                                   sp.top_k <= kDeviceTopKMax));
  TopKSampling device_sampling;
  device_sampling.top_k = sp.top_k;
  device_sampling.top_p = sp.top_p;
  device_sampling.min_p = sp.min_p;
  device_sampling.temperature = sp.temperature;
  device_sampling.seed = sp.seed;
  // -1: the grammar allows no id (its match is complete and nothing may follow, or with
  // ignore_eos only an end id could come).
  auto choose = [&] {
    const auto ts = clock::now();
    if (opt.logprobs > 0) raw.assign(logits.begin(), logits.end());
    if (gstate) {
      if (!mask_ready) compute_mask();
      mask_ready = false;
      bool any = false;
      // Ids past the tokenizer's vocabulary (a model's padded embedding) are never text. A
      // word at a time: inside a string most words allow all 32 ids, elsewhere most none.
      const int known = std::min(vocab, opt.masker->vocab_size());
      for (int w = 0; w * 32 < vocab; ++w) {
        const int lo = w * 32, hi = std::min(lo + 32, vocab);
        uint32_t bits = lo < known ? mask[w] : 0;
        if (hi > known) bits &= known > lo ? (1u << (known - lo)) - 1 : 0;
        any |= bits != 0;
        if (bits == ~0u) continue;
        for (int id = lo; id < hi; ++id)
          if (!((bits >> (id - lo)) & 1)) logits[id] = -INFINITY;
      }
      if (!any) {
        KESTREL_CHECK(gstate->is_accepting(),
                      "the grammar allows no token of the vocabulary after the text generated "
                      "so far (" + std::to_string(r.ids.size()) + " tokens): it needs bytes no token has");
        r.sample_ms += ms_since(ts);
        return -1;
      }
    }
    const int id = sampler.sample(logits.data(), vocab, history);
    if (opt.logprobs > 0) r.logprobs.push_back(logprobs_of(raw.data(), vocab, id, opt.logprobs));
    r.sample_ms += ms_since(ts);
    ++r.n_sampled;
    return id;
  };
  int pos = pos0 + n_run;
  // Takes a chosen id into the result: false when it ends generation (an end id, a stop
  // string or reverse prompt in the text).
  auto take = [&](int id) {
    if (id < 0) {  // the grammar is complete (choose)
      r.finish_reason = "stop";
      return false;
    }
    if (gstate) KESTREL_CHECK(opt.masker->accept_token(*gstate, id), "a sampled token the grammar refuses");
    r.ids.push_back(id);
    history.push_back(id);
    ++pos;
    if (is_end(id)) {
      r.finish_reason = "eos";
      return false;
    }
    emit(stop.push(detok.push(id)));
    if (stop.stopped()) {
      r.finish_reason = "stop";
      return false;
    }
    // A complete match nothing can extend: no id but an end id could follow, so end here
    // rather than spend a step of the model on it.
    if (gstate && gstate->is_finished()) {
      r.finish_reason = "stop";
      return false;
    }
    return true;
  };
  r.speculative = opt.drafter != nullptr;
  if (opt.drafter && max_new > 0) {
    if (opt.cancelled && opt.cancelled()) {
      r.finish_reason = "cancelled";
    } else if (take(choose())) {
      speculate(model, opt, history, pos, max_new, sampler, r, take);
    }
    // Every id but the last ran, as the id a pass started from or as an accepted draft.
    r.n_eval = std::max(0, (int)r.ids.size() - 1);
  } else {
    std::unique_ptr<DecodeRun> run;  // on_device: the device may run a step ahead
    for (int i = 0; i < max_new; ++i) {
      if (opt.cancelled && opt.cancelled()) {
        r.finish_reason = "cancelled";
        break;
      }
      if (i > 0 && on_device && !run) {
        run = argmax_only ? model.greedy_run(r.ids.back(), pos - 1)
                          : model.sampled_run(r.ids.back(), pos - 1, device_sampling);
        on_device = run != nullptr;
      }
      int id;
      if (i == 0) {
        id = choose();
      } else if (on_device) {
        id = run->next(i + 1 < max_new);
        ++r.n_eval;
        ++r.n_device;
      } else {
        forward(&r.ids.back(), 1, pos - 1);
        ++r.n_eval;
        id = choose();
      }
      if (!take(id)) break;
    }
  }
  if (!stop.stopped()) {
    emit(stop.push(detok.flush()));
    emit(stop.flush());
  }
  r.gen_ms = ms_since(t1);
  r.grammar_complete = gstate && gstate->is_accepting() && r.finish_reason != "cancelled";
  return r;
}

}  // namespace

namespace {

// After ids [first, ...) ran from position pos0: the cache holds what was there before pos0,
// then the prompt's ids from `first` and every generated id but the last (never run).
void note_cached(std::vector<int>& cache, const std::vector<int>& prompt_ids, int first, int pos0,
                 const GenerateResult& r) {
  if ((size_t)pos0 > cache.size()) {  // a gap of unknown ids: nothing reusable is known
    cache.clear();
    return;
  }
  cache.resize(pos0);
  cache.insert(cache.end(), prompt_ids.begin() + first, prompt_ids.end());
  if (!r.ids.empty()) cache.insert(cache.end(), r.ids.begin(), r.ids.end() - 1);
}

}  // namespace

std::shared_ptr<const grammar::TokenMasker> grammar_masker(const Tokenizer& tok,
                                                           const std::vector<int>& end_ids) {
  std::vector<int> ends = tok.eos_ids();
  for (int id : end_ids)
    if (id >= 0 && id < tok.vocab_size() && std::find(ends.begin(), ends.end(), id) == ends.end())
      ends.push_back(id);
  std::erase_if(ends, [&](int id) { return id < 0 || id >= tok.vocab_size(); });
  return std::make_shared<const grammar::TokenMasker>(tok.all_token_bytes(), std::move(ends));
}

GenerateResult generate(Session& session, const Tokenizer& tok, const std::vector<int>& prompt_ids,
                        const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text, int start_pos) {
  // Whatever happens below, the cache is known only before start_pos.
  if (session.cached.size() > (size_t)start_pos) session.cached.resize(start_pos);
  GenerateResult r = run(session, tok, prompt_ids, 0, start_pos, opt, on_text);
  note_cached(session.cached, prompt_ids, 0, start_pos, r);
  return r;
}

GenerateResult generate_cached(Session& session, const Tokenizer& tok,
                               const std::vector<int>& prompt_ids, const GenerateOptions& opt,
                               const std::function<void(std::string_view)>& on_text) {
  KESTREL_CHECK(!prompt_ids.empty(), "the prompt is empty (no tokens to start from)");
  std::vector<int>& cache = session.cached;
  session.adopt_prefix(prompt_ids);  // paged KV memory: any earlier sequence's blocks
  size_t keep = shared_prefix(cache, prompt_ids);
  // The last prompt id always runs: its logits start the generation.
  keep = std::min(keep, prompt_ids.size() - 1);
  // Whatever happens below, the cache is only known up to the shared prefix.
  cache.resize(keep);
  GenerateResult r = run(session, tok, prompt_ids, (int)keep, (int)keep, opt, on_text);
  note_cached(cache, prompt_ids, (int)keep, (int)keep, r);
  return r;
}

}  // namespace kestrel
