// Continuous batching (engine/server/batcher.h): generations on threads of their own, each with
// its own sampling, run their passes through one StepBatcher, as `kestrel serve --parallel`
// runs them. Each must give exactly what it gives alone (greedy or seeded sampling, penalties,
// logprobs), whatever runs beside it, while requests join and leave the batch; a cancelled one
// leaves without disturbing the rest; a failing pass fails only its own request.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "engine/generate.h"
#include "engine/server/batcher.h"
#include "models/cpu/decoder.h"
#include "models/io/model_spec.h"
#include "tests/support/synth_model.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace kestrel;
using server::StepBatcher;

namespace {

struct Request {
  std::vector<int> prompt;
  GenerateOptions opt;
};

// Greedy, seeded top-k with logprobs, seeded top-p/min-p with penalties, greedy with a
// frequency penalty: different prompt lengths and lengths of answer, so that requests join
// (their prompts run while others decode) and leave (their answers end) at different steps.
std::vector<Request> requests(int vocab) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> tok(3, vocab - 1);
  const int lengths[] = {9, 4, 2, 6};
  std::vector<Request> r(4);
  for (int i = 0; i < 4; ++i) {
    for (int k = 0; k < lengths[i]; ++k) r[i].prompt.push_back(tok(rng));
    r[i].opt.ignore_eos = true;  // every answer its full length, whatever the random model says
  }
  r[0].opt.sampling.temperature = 0;
  r[0].opt.max_new_tokens = 12;
  r[1].opt.sampling.temperature = 0.9f;
  r[1].opt.sampling.top_k = 20;
  r[1].opt.sampling.seed = 7;
  r[1].opt.logprobs = 3;
  r[1].opt.max_new_tokens = 8;
  r[2].opt.sampling.temperature = 1.0f;
  r[2].opt.sampling.top_k = 0;
  r[2].opt.sampling.top_p = 0.9f;
  r[2].opt.sampling.min_p = 0.02f;
  r[2].opt.sampling.repeat_penalty = 1.3f;
  r[2].opt.sampling.presence_penalty = 0.5f;
  r[2].opt.sampling.seed = 99;
  r[2].opt.max_new_tokens = 14;
  r[3].opt.sampling.temperature = 0;
  r[3].opt.sampling.frequency_penalty = 0.4f;
  r[3].opt.max_new_tokens = 5;
  return r;
}

class StepBatcherTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const kestrel::test::ModelFormat f{"batcher_q4", "gptq", 4, 64, false, false, "gptq"};
    dir_ = new fs::path(kestrel::test::write_tiny_model(f, /*seed=*/4, /*n_layers=*/2));
    spec_ = new ModelSpec(load_model_spec(dir_->string()));
    tok_ = Tokenizer::load(dir_->string()).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete spec_;
    fs::remove_all(*dir_);
    delete dir_;
  }

  // Each request alone on a session of its own, through `batcher` when given.
  std::vector<GenerateResult> alone(DecoderCpu& model, const std::vector<Request>& rs,
                                    StepBatcher* batcher) {
    std::vector<GenerateResult> out;
    for (const Request& r : rs) {
      std::unique_ptr<Session> s = model.new_session(64);
      if (batcher) s = batcher->wrap(std::move(s));
      out.push_back(generate(*s, *tok_, r.prompt, r.opt));
    }
    return out;
  }

  // Every request at once, each on its own thread and session through `b`. Every thread's
  // generation is counted in progress before any starts, so that each step waits for all of
  // them (the gather is long): the batch is as wide as it can be, deterministically.
  std::vector<GenerateResult> together(DecoderCpu& model, const std::vector<Request>& rs,
                                       StepBatcher& b) {
    const size_t n = rs.size();
    std::vector<std::unique_ptr<Session>> sessions;
    std::vector<std::optional<StepBatcher::Generation>> in_batch(n);
    for (size_t i = 0; i < n; ++i) {
      sessions.push_back(b.wrap(model.new_session(64)));
      in_batch[i].emplace(b);
    }
    std::vector<GenerateResult> out(n);
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        try {
          out[i] = generate(*sessions[i], *tok_, rs[i].prompt, rs[i].opt);
        } catch (const std::exception& e) {
          errors[i] = e.what();
        }
        in_batch[i].reset();
      });
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(errors[i], "") << "request " << i;
    return out;
  }

  static void expect_same(const GenerateResult& got, const GenerateResult& want, size_t i) {
    EXPECT_EQ(got.ids, want.ids) << "request " << i;
    EXPECT_EQ(got.text, want.text) << "request " << i;
    EXPECT_EQ(got.finish_reason, want.finish_reason) << "request " << i;
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << "request " << i;
    for (size_t k = 0; k < got.logprobs.size(); ++k) {
      EXPECT_EQ(got.logprobs[k].chosen.id, want.logprobs[k].chosen.id);
      EXPECT_EQ(got.logprobs[k].chosen.logprob, want.logprobs[k].chosen.logprob);
    }
  }

  static server::BatcherOptions options(int batch_tokens) {
    server::BatcherOptions o;
    o.batch_tokens = batch_tokens;
    o.gather = std::chrono::seconds(10);  // never reached: every step waits for every request
    return o;
  }

  static fs::path* dir_;
  static ModelSpec* spec_;
  static Tokenizer* tok_;
};
fs::path* StepBatcherTest::dir_ = nullptr;
ModelSpec* StepBatcherTest::spec_ = nullptr;
Tokenizer* StepBatcherTest::tok_ = nullptr;

// Prompts within one chunk: a request in the batch gives what plain generate() gives alone.
TEST_F(StepBatcherTest, BatchedRequestsEqualPlainGenerationAlone) {
  DecoderCpu model(*spec_);
  const std::vector<Request> rs = requests(spec_->config.vocab);
  const std::vector<GenerateResult> want = alone(model, rs, nullptr);
  StepBatcher b(model, options(16));
  const std::vector<GenerateResult> got = together(model, rs, b);
  for (size_t i = 0; i < rs.size(); ++i) expect_same(got[i], want[i], i);
  const StepBatcher::Stats st = b.stats();
  EXPECT_EQ(st.widest, 4);    // every request decoded in one step at some point
  EXPECT_EQ(st.chunks, 4u);   // each prompt in one chunk
  // Every generated id but the last ran as a decode row.
  uint64_t rows = 0;
  for (const GenerateResult& r : got) rows += r.ids.size() - 1;
  EXPECT_EQ(st.decode_rows, rows);
  EXPECT_LT(st.steps, st.decode_rows);  // steps were shared
}

// Prompts in chunks of 3 beside the decode rows: each request gives what it gives alone
// through the same batcher (a chunk's cut depends on the prompt alone).
TEST_F(StepBatcherTest, ChunkedPromptsBesideDecodingEqualAlone) {
  DecoderCpu model(*spec_);
  const std::vector<Request> rs = requests(spec_->config.vocab);
  StepBatcher solo(model, options(3));
  const std::vector<GenerateResult> want = alone(model, rs, &solo);
  StepBatcher b(model, options(3));
  const std::vector<GenerateResult> got = together(model, rs, b);
  for (size_t i = 0; i < rs.size(); ++i) expect_same(got[i], want[i], i);
  // Prompts of 9, 4, 2, 6 tokens: chunks of 3, 3, 3 | 3 + a one-token row | 2 | 3, 3.
  EXPECT_EQ(b.stats().chunks, 7u);
}

// A request cancelled after three tokens leaves the batch with what it had; the others go on
// and give what they give alone.
TEST_F(StepBatcherTest, CancelledRequestLeavesTheOthersUndisturbed) {
  DecoderCpu model(*spec_);
  std::vector<Request> rs = requests(spec_->config.vocab);
  const std::vector<GenerateResult> want = alone(model, rs, nullptr);
  auto polls = std::make_shared<std::atomic<int>>(0);
  rs[0].opt.cancelled = [polls] { return ++*polls > 3; };  // polled before each new token
  StepBatcher b(model, options(16));
  const std::vector<GenerateResult> got = together(model, rs, b);
  EXPECT_EQ(got[0].finish_reason, "cancelled");
  ASSERT_EQ(got[0].ids.size(), 3u);
  EXPECT_TRUE(std::equal(got[0].ids.begin(), got[0].ids.end(), want[0].ids.begin()));
  for (size_t i = 1; i < rs.size(); ++i) expect_same(got[i], want[i], i);
}

// A pass the model refuses (a position past the session's context) fails its own caller only:
// the row beside it in the same step gets its logits as alone.
TEST_F(StepBatcherTest, AFailingRowFailsOnlyItsCaller) {
  DecoderCpu model(*spec_);
  const int vocab = spec_->config.vocab;
  std::vector<float> want(vocab), good(vocab), bad(vocab);
  const int token = 5;
  model.new_session(64)->forward(&token, 1, 0, want.data(), nullptr);
  StepBatcher b(model, options(16));
  std::unique_ptr<Session> s1 = b.wrap(model.new_session(64)), s2 = b.wrap(model.new_session(64));
  std::optional<StepBatcher::Generation> g1(std::in_place, b), g2(std::in_place, b);
  std::string error;
  std::thread t1([&] {
    s1->forward(&token, 1, 0, good.data(), nullptr);
    g1.reset();
  });
  std::thread t2([&] {
    try {
      s2->forward(&token, 1, 64, bad.data(), nullptr);
    } catch (const Error& e) {
      error = e.what();
    }
    g2.reset();
  });
  t1.join();
  t2.join();
  EXPECT_EQ(want, good);
  EXPECT_NE(error.find("context of 64"), std::string::npos) << error;
  EXPECT_EQ(b.stats().widest, 2);  // they did share the step
}

TEST_F(StepBatcherTest, RefusesNoTokensPerChunk) {
  DecoderCpu model(*spec_);
  try {
    StepBatcher b(model, options(0));
    FAIL() << "a batch of 0 tokens was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--batch-tokens must be at least 1"), std::string::npos);
  }
}

}  // namespace
