// The generation loop on a scripted backend: stop strings (never printed, partial matches
// held back while streaming), UTF-8 assembled from byte pieces, end-of-turn ids,
// cancellation, log-probabilities, and the reuse of a cached prefix.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>

#include "base/error.h"
#include "engine/generate.h"
#include "tests/support/tiny_tokenizer_suite.h"

#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

// A model without weights, whose only configuration is its vocabulary.
class ScriptModel final : public Model {
 public:
  explicit ScriptModel(int vocab) { cfg_.vocab = vocab; }
  const ModelConfig& config() const override { return cfg_; }
  std::string device_name() const override { return "script"; }
  std::unique_ptr<Session> new_session(int, bool) override { return nullptr; }

 private:
  ModelConfig cfg_;
};

// Holds the model a ScriptedBackend's Session base refers to, constructed before it.
struct HoldsScriptModel {
  explicit HoldsScriptModel(int vocab) : script_model(vocab) {}
  ScriptModel script_model;
};

// A session whose next token is whatever the script says: each forward writes logits with
// 1 for the scripted id and 0 elsewhere. It records the (n, pos) of every call.
class ScriptedBackend : private HoldsScriptModel, public Session {
 public:
  ScriptedBackend(int vocab, std::vector<int> script)
      : HoldsScriptModel(vocab), Session(script_model), script_(std::move(script)) {}
  int context_length() const override { return 256; }
  void forward(const int*, int n, int pos, float* logits, float*) override {
    const int vocab = config().vocab;
    calls.push_back({n, pos});
    std::fill(logits, logits + vocab, 0.0f);
    const int id = next < script_.size() ? script_[next] : 0;
    ++next;
    logits[id] = 1.0f;
  }
  std::vector<std::pair<int, int>> calls;
  size_t next = 0;

 private:
  std::vector<int> script_;
};

class Generate : public kestrel::test::TinyTokenizerSuite {
 protected:
  static GenerateOptions greedy(int n) {
    GenerateOptions o;
    o.max_new_tokens = n;
    o.sampling.temperature = 0;
    return o;
  }
  int byte(int b) const {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    return tok_->piece_to_id(name);
  }
};

TEST(StopMatcher, HoldsBackAPossibleStartAndCutsBeforeTheStop) {
  StopMatcher m({"</end>", "STOP"});
  EXPECT_EQ(m.push("hello </e"), "hello ");  // "</e" may begin "</end>"
  EXPECT_EQ(m.push("x and ST"), "</ex and ");
  EXPECT_EQ(m.push("OP more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("after"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, FlushReturnsAHeldTailThatNeverCompleted) {
  StopMatcher m({"world"});
  EXPECT_EQ(m.push("hello wor"), "hello ");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.flush(), "wor");
}

TEST(StopMatcher, EarliestStopWins) {
  StopMatcher m({"bc", "ab"});
  EXPECT_EQ(m.push("xabc"), "x");
  EXPECT_TRUE(m.stopped());
}

// A reverse prompt (llama-cli's -r) ends the text after itself; one split over pushes is held
// back until it completes, as a stop string is.
TEST(StopMatcher, ReversePromptIsKept) {
  StopMatcher m({}, {"User:"});
  EXPECT_EQ(m.push("fine.\nUs"), "fine.\n");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.push("er: and more"), "User:");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("later"), "");
  // The earliest of stop strings and reverse prompts decides.
  StopMatcher both({"\n\n"}, {"Q:"});
  EXPECT_EQ(both.push("a Q: b\n\n"), "a Q:");
  StopMatcher stop_first({"\n\n"}, {"Q:"});
  EXPECT_EQ(stop_first.push("a\n\nQ:"), "a");
}

// after_text: leading whitespace is passed on, never matched; the stops count after it.
TEST(StopMatcher, AfterTextSkipsLeadingWhitespace) {
  StopMatcher m({"\n\n"}, {}, /*after_text=*/true);
  EXPECT_EQ(m.push("\n"), "\n");
  EXPECT_EQ(m.push("\n Hello"), "\n Hello");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.push(" world.\n\nNext"), " world.");
  EXPECT_TRUE(m.stopped());
  StopMatcher plain({"\n\n"});
  EXPECT_EQ(plain.push("\n\n Hello"), "");
  EXPECT_TRUE(plain.stopped());
}

TEST_F(Generate, StopStringEndsGenerationUnprinted) {
  const std::vector<int> prompt = tok_->encode("one");
  const std::vector<int> script = tok_->encode("the river is long and wide", false);
  // The oracle: SentencePiece's decode of prompt plus continuation, minus the prompt's.
  std::vector<int> all = prompt;
  all.insert(all.end(), script.begin(), script.end());
  const std::string full = tok_->decode(all).substr(tok_->decode(prompt).size());
  ASSERT_NE(full.find(" long"), std::string::npos) << full;
  const std::string want = full.substr(0, full.find(" long"));

  ScriptedBackend b(tok_->vocab_size(), script);
  GenerateOptions o = greedy(40);
  o.stop = {" long"};
  std::string streamed;
  std::vector<std::string> chunks;
  const GenerateResult r = generate(b, *tok_, prompt, o, [&](std::string_view s) {
    streamed += s;
    chunks.emplace_back(s);
  });
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.text, want);
  EXPECT_EQ(streamed, want);
  for (const std::string& c : chunks) EXPECT_EQ(c.find("long"), std::string::npos);
}

TEST_F(Generate, MultiByteCharactersStreamWhole) {
  // "€" is E2 82 AC: three byte pieces, nothing printable until the third.
  const std::vector<int> euro = {byte(0xE2), byte(0x82), byte(0xAC)};
  for (int id : euro) ASSERT_GE(id, 0);
  std::vector<int> script = euro;
  script.push_back(euro[0]);  // an incomplete sequence at the end: U+FFFD when flushed
  ScriptedBackend b(tok_->vocab_size(), script);
  std::vector<std::pair<size_t, std::string>> chunks;  // (forward calls so far, text)
  const GenerateResult r = generate(b, *tok_, tok_->encode("x"), greedy(4), [&](std::string_view s) {
    chunks.emplace_back(b.next, std::string(s));
  });
  ASSERT_GE(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].second, "\xE2\x82\xAC");
  EXPECT_EQ(chunks[0].first, 3u);  // after the third byte's token was chosen
  EXPECT_EQ(r.text, "\xE2\x82\xAC\xEF\xBF\xBD");
}

TEST_F(Generate, EndIdsAndCancellation) {
  const std::vector<int> words = tok_->encode("a b c d e f g h", false);
  {
    std::vector<int> script = words;
    script.insert(script.begin() + 3, 77);  // an end-of-turn id after three words
    ScriptedBackend b(tok_->vocab_size(), script);
    GenerateOptions o = greedy(20);
    o.stop_ids = {77};
    const GenerateResult r = generate(b, *tok_, tok_->encode("x"), o);
    EXPECT_EQ(r.finish_reason, "eos");
    EXPECT_EQ(r.ids.size(), 4u);
    EXPECT_EQ(r.ids.back(), 77);
    o.ignore_eos = true;
    ScriptedBackend b2(tok_->vocab_size(), script);
    EXPECT_EQ(generate(b2, *tok_, tok_->encode("x"), o).ids.size(), 20u);
  }
  {
    ScriptedBackend b(tok_->vocab_size(), words);
    GenerateOptions o = greedy(20);
    int polls = 0;
    o.cancelled = [&] { return ++polls > 3; };
    const GenerateResult r = generate(b, *tok_, tok_->encode("x"), o);
    EXPECT_EQ(r.finish_reason, "cancelled");
    EXPECT_EQ(r.ids.size(), 3u);
  }
}

// A backend whose greedy runs record what generate asks of them: the run's start and, per
// token, whether generate let it run a step ahead.
class RecordingBackend : public ScriptedBackend {
 public:
  using ScriptedBackend::ScriptedBackend;
  struct Run : DecodeRun {
    Run(RecordingBackend& b, int token, int pos) : b(b), token(token), pos(pos) {}
    int next(bool ahead) override {
      b.aheads.push_back(ahead);
      token = b.forward_argmax(token, pos++);
      return token;
    }
    RecordingBackend& b;
    int token, pos;
  };
  std::unique_ptr<DecodeRun> greedy_run(int token, int pos) override {
    starts.push_back({token, pos});
    return std::make_unique<Run>(*this, token, pos);
  }
  std::vector<std::pair<int, int>> starts;
  std::vector<bool> aheads;
};

TEST_F(Generate, GreedyDecodingRunsAheadOnlyWhileAnotherTokenMayBeWanted) {
  const std::vector<int> words = tok_->encode("a b c d e f g h", false);
  ASSERT_GE(words.size(), 5u);
  const std::vector<int> prompt = tok_->encode("x");
  RecordingBackend b(tok_->vocab_size(), words);
  const GenerateResult r = generate(b, *tok_, prompt, greedy(5));
  ASSERT_EQ(r.ids.size(), 5u);
  EXPECT_EQ(r.n_device, 4);
  // The first token comes from the prompt's logits; one run then picks the other four, starting
  // from the first at the position after the prompt.
  ASSERT_EQ(b.starts.size(), 1u);
  EXPECT_EQ(b.starts[0], std::make_pair(r.ids[0], (int)prompt.size()));
  EXPECT_EQ(b.aheads, (std::vector<bool>{true, true, true, false}));
  for (size_t i = 0; i < r.ids.size(); ++i) EXPECT_EQ(r.ids[i], words[i]) << i;
}

// A backend that samples on its "device": its sampled runs record the parameters they were
// started with and hand out the script.
class SamplingBackend : public RecordingBackend {
 public:
  using RecordingBackend::RecordingBackend;
  std::unique_ptr<DecodeRun> sampled_run(int token, int pos, const TopKSampling& s) override {
    sampled.push_back(s);
    return greedy_run(token, pos);
  }
  std::vector<TopKSampling> sampled;
};

TEST_F(Generate, SamplesOnTheDeviceWhenItsSamplerCoversTheParameters) {
  const std::vector<int> words = tok_->encode("a b c d e f g h", false);
  const std::vector<int> prompt = tok_->encode("x");
  GenerateOptions o;
  o.max_new_tokens = 4;
  o.sampling.temperature = 0.7f;
  o.sampling.top_k = 40;
  o.sampling.top_p = 0.9f;
  o.sampling.min_p = 0.05f;
  o.sampling.seed = 1234;
  {
    SamplingBackend b(tok_->vocab_size(), words);
    const GenerateResult r = generate(b, *tok_, prompt, o);
    ASSERT_EQ(r.ids.size(), 4u);
    ASSERT_EQ(b.sampled.size(), 1u);
    const TopKSampling& s = b.sampled[0];
    EXPECT_EQ(s.top_k, 40);
    EXPECT_EQ(s.top_p, 0.9f);
    EXPECT_EQ(s.min_p, 0.05f);
    EXPECT_EQ(s.temperature, 0.7f);
    EXPECT_EQ(s.seed, 1234u);
    // The first token is the host's, from the prompt's logits; the run starts from it.
    EXPECT_EQ(r.n_sampled, 1);
    EXPECT_EQ(r.n_device, 3);
    EXPECT_EQ(b.starts[0], std::make_pair(r.ids[0], (int)prompt.size()));
    for (size_t i = 1; i < r.ids.size(); ++i) EXPECT_EQ(r.ids[i], words[i]) << i;
  }
  // What the device's sampler does not cover is sampled on the host: penalties, logprobs, no
  // top-k, a top-k past kDeviceTopKMax.
  for (int variant = 0; variant < 5; ++variant) {
    GenerateOptions v = o;
    if (variant == 0) v.sampling.repeat_penalty = 1.1f;
    if (variant == 1) v.sampling.presence_penalty = 0.5f;
    if (variant == 2) v.logprobs = 1;
    if (variant == 3) v.sampling.top_k = 0;
    if (variant == 4) v.sampling.top_k = kDeviceTopKMax + 1;
    SamplingBackend b(tok_->vocab_size(), words);
    const GenerateResult r = generate(b, *tok_, prompt, v);
    EXPECT_EQ(r.ids.size(), 4u) << "variant " << variant;
    EXPECT_TRUE(b.sampled.empty()) << "variant " << variant;
    EXPECT_EQ(r.n_sampled, 4) << "variant " << variant;
    EXPECT_EQ(r.n_device, 0) << "variant " << variant;
  }
  // A backend without a device sampler (sampled_run gives nullptr): the host samples.
  ScriptedBackend plain(tok_->vocab_size(), words);
  const GenerateResult r = generate(plain, *tok_, prompt, o);
  EXPECT_EQ(r.ids.size(), 4u);
  EXPECT_EQ(r.n_sampled, 4);
}

TEST_F(Generate, LogprobsOfTheScriptedDistribution) {
  const int vocab = tok_->vocab_size();
  const std::vector<int> script = tok_->encode("a b c", false);
  ScriptedBackend b(vocab, script);
  GenerateOptions o = greedy((int)script.size());
  o.logprobs = 2;
  const GenerateResult r = generate(b, *tok_, tok_->encode("x"), o);
  ASSERT_EQ(r.logprobs.size(), script.size());
  // One logit of 1 among zeros: log(e / (e + vocab - 1)).
  const double lp = 1.0 - std::log(std::exp(1.0) + vocab - 1);
  for (size_t i = 0; i < script.size(); ++i) {
    EXPECT_EQ(r.logprobs[i].chosen.id, script[i]);
    EXPECT_NEAR(r.logprobs[i].chosen.logprob, lp, 1e-5);
    ASSERT_EQ(r.logprobs[i].top.size(), 2u);
    EXPECT_EQ(r.logprobs[i].top[0].id, script[i]);
    EXPECT_NEAR(r.logprobs[i].top[1].logprob, -std::log(std::exp(1.0) + vocab - 1), 1e-5);
  }
}

TEST_F(Generate, CachedPrefixRunsOnlyTheNewSuffix) {
  const std::vector<int> script = tok_->encode("a b c d e f g h i j k l", false);
  ScriptedBackend b(tok_->vocab_size(), script);
  std::vector<int>& cache = b.cached;
  const std::vector<int> p1 = tok_->encode("one two");
  const GenerateResult r1 = generate_cached(b, *tok_, p1, greedy(3));
  ASSERT_EQ(r1.ids.size(), 3u);
  // The prompt at 0, then the first two generated ids (the third is never run).
  ASSERT_EQ(b.calls.size(), 3u);
  EXPECT_EQ(b.calls[0], std::make_pair((int)p1.size(), 0));
  EXPECT_EQ(b.calls[1], std::make_pair(1, (int)p1.size()));
  EXPECT_EQ(b.calls[2], std::make_pair(1, (int)p1.size() + 1));
  std::vector<int> want = p1;
  want.insert(want.end(), r1.ids.begin(), r1.ids.end() - 1);
  EXPECT_EQ(cache, want);

  // The next prompt continues the conversation: only what follows the cached ids runs.
  std::vector<int> p2 = p1;
  p2.insert(p2.end(), r1.ids.begin(), r1.ids.end());
  const std::vector<int> more = tok_->encode("three", false);
  p2.insert(p2.end(), more.begin(), more.end());
  b.calls.clear();
  const GenerateResult r2 = generate_cached(b, *tok_, p2, greedy(1));
  EXPECT_EQ(r2.n_cached, (int)want.size());
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0], std::make_pair((int)(p2.size() - want.size()), (int)want.size()));

  // The same prompt again: only its last id runs, for its logits.
  b.calls.clear();
  generate_cached(b, *tok_, p2, greedy(1));
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0], std::make_pair(1, (int)p2.size() - 1));

  // A prompt that differs early overwrites the cache from there.
  std::vector<int> p3 = p2;
  p3[1] = p3[1] == 5 ? 6 : 5;
  b.calls.clear();
  generate_cached(b, *tok_, p3, greedy(1));
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0], std::make_pair((int)p3.size() - 1, 1));
}

TEST_F(Generate, ReversePromptEndsGenerationPrinted) {
  const std::vector<int> prompt = tok_->encode("one");
  const std::vector<int> script = tok_->encode("the river is long and wide", false);
  ScriptedBackend b(tok_->vocab_size(), script);
  GenerateOptions o = greedy(40);
  o.reverse_prompts = {"long"};
  std::string streamed;
  const GenerateResult r =
      generate(b, *tok_, prompt, o, [&](std::string_view s) { streamed += s; });
  EXPECT_EQ(r.finish_reason, "stop");
  ASSERT_GE(r.text.size(), 4u);
  EXPECT_EQ(r.text.substr(r.text.size() - 4), "long") << r.text;
  EXPECT_EQ(r.text.find("wide"), std::string::npos) << r.text;
  EXPECT_EQ(streamed, r.text);
}

// max_new_tokens -1: up to the end of the context (256 positions here).
TEST_F(Generate, MinusOneGeneratesUpToTheContext) {
  ScriptedBackend b(tok_->vocab_size(), std::vector<int>(300, 5));
  const std::vector<int> prompt(56, 5);
  const GenerateResult r = generate(b, *tok_, prompt, greedy(-1));
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.ids.size(), 200u);
  // A prompt that fills the context leaves no room for one token.
  EXPECT_THROW(generate(b, *tok_, std::vector<int>(256, 5), greedy(-1)), Error);
}

TEST_F(Generate, ContextOverflowIsAnError) {
  ScriptedBackend b(tok_->vocab_size(), {});
  std::vector<int> prompt(200, 5);
  try {
    generate(b, *tok_, prompt, greedy(100));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context of 256"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace {

// A session whose logits are a fixed pseudo-random function of the call's position: a grammar
// always has ids to choose among. `fail_at`: the forward call that throws, as a device's
// failed pass would.
class NoiseBackend : private HoldsScriptModel, public Session {
 public:
  explicit NoiseBackend(int vocab, int fail_at = -1)
      : HoldsScriptModel(vocab), Session(script_model), fail_at_(fail_at) {}
  int context_length() const override { return 256; }
  void forward(const int*, int n, int pos, float* logits, float*) override {
    if (calls++ == fail_at_) throw Error("the pass failed at position " + std::to_string(pos));
    std::mt19937 g(static_cast<uint32_t>(pos + n) * 7919u);
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    for (int i = 0; i < config().vocab; ++i) logits[i] = u(g);
  }
  int calls = 0;

 private:
  int fail_at_;
};

}  // namespace

// The mask of the next step is computed on a second thread while the pass runs (by default
// where the model does not compute on the host's cores, as here): the same ids, greedy and
// sampled, as the mask computed after the pass.
TEST_F(Generate, GrammarMaskBesideThePassChangesNoId) {
  GenerateOptions o = greedy(48);
  o.grammar = grammar::Grammar::parse("root ::= \"{\" ( [a-z] | \" \" ){1,60} \"}\"\n");
  o.masker = grammar_masker(*tok_);
  const std::vector<int> prompt = tok_->encode("x");
  for (float temperature : {0.0f, 0.9f}) {
    o.sampling.temperature = temperature;
    o.sampling.seed = 77;
    std::vector<GenerateResult> r;
    for (auto ahead : {GenerateOptions::MaskAhead::Off, GenerateOptions::MaskAhead::On,
                       GenerateOptions::MaskAhead::Auto}) {
      o.mask_ahead = ahead;
      NoiseBackend b(tok_->vocab_size());
      r.push_back(generate(b, *tok_, prompt, o));
    }
    ASSERT_GT(r[0].ids.size(), 3u) << temperature;
    EXPECT_EQ(r[0].text.front(), '{') << r[0].text;
    for (size_t i = 1; i < r.size(); ++i) {
      EXPECT_EQ(r[i].ids, r[0].ids) << "temperature " << temperature << ", variant " << i;
      EXPECT_EQ(r[i].text, r[0].text);
      EXPECT_EQ(r[i].finish_reason, r[0].finish_reason);
      EXPECT_EQ(r[i].grammar_complete, r[0].grammar_complete);
    }
  }
}

// A pass that fails while the mask is computed beside it: its error reaches the caller, after
// the mask's thread is done (no hang, nothing left running).
TEST_F(Generate, AFailedPassBesideTheMaskIsThePassesError) {
  GenerateOptions o = greedy(16);
  o.grammar = grammar::Grammar::parse("root ::= [a-z ]+\n");
  o.masker = grammar_masker(*tok_);
  o.mask_ahead = GenerateOptions::MaskAhead::On;
  for (int fail_at : {0, 3}) {
    NoiseBackend b(tok_->vocab_size(), fail_at);
    try {
      generate(b, *tok_, tok_->encode("x"), o);
      ADD_FAILURE() << "no error at pass " << fail_at;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the pass failed at position"), std::string::npos)
          << e.what();
    }
  }
}
