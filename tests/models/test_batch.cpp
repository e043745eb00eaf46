// Batched decoding on the CPU engine (Model::forward_batch): a row's logits inside a batch are
// bit for bit those of the same session stepped alone with forward(), over weight formats
// (kestrel-synth's fp16, GPTQ 4-bit, 3-bit act-order) and families (transformers' tiny models
// in tests/data/families), with rows joining and leaving the batch, at positions of their own.
// The reference is the engine's one-token forward, which test_families and test_engine_cpu hold
// to transformers and to a plain implementation.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "models/cpu/decoder.h"
#include "models/io/model_spec.h"
#include "tests/support/paged_scenarios.h"
#include "tests/support/synth_model.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

int argmax_of(const float* x, int n) { return (int)(std::max_element(x, x + n) - x); }

// Sequence i: a prompt of its own length, joining the batch at step join[i] and leaving after
// steps[i] decode steps. Alone, each runs its prompt and steps greedily with forward(); in the
// batch, the prompt the same way, then its decode steps through forward_batch beside the others.
struct Plan {
  std::vector<int> prompt;
  int join = 0, steps = 0;
};

std::vector<Plan> plans(int vocab) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  const int lengths[] = {3, 7, 1, 5, 2};
  const int joins[] = {0, 0, 2, 5, 1};
  const int steps[] = {12, 6, 9, 7, 5};  // the second and fifth leave early, all in step 5
  std::vector<Plan> p(5);
  for (int i = 0; i < 5; ++i) {
    for (int k = 0; k < lengths[i]; ++k) p[i].prompt.push_back(tok(rng));
    p[i].join = joins[i];
    p[i].steps = steps[i];
  }
  return p;
}

// Every row of every step of the batch equals the lone run's logits bit for bit, and so the
// greedy tokens are the same.
void expect_batch_equals_alone(DecoderCpu& model) {
  const int vocab = model.config().vocab;
  const std::vector<Plan> ps = plans(vocab);
  const int n = (int)ps.size();

  // Alone: logits[i][s] after decode step s (s = 0: the prompt's).
  std::vector<std::vector<std::vector<float>>> alone(n);
  for (int i = 0; i < n; ++i) {
    auto s = model.new_cpu_session(64);
    std::vector<float> logits(vocab);
    s->forward(ps[i].prompt.data(), (int)ps[i].prompt.size(), 0, logits.data(), nullptr);
    alone[i].push_back(logits);
    int pos = (int)ps[i].prompt.size();
    for (int k = 0; k < ps[i].steps; ++k) {
      const int next = argmax_of(logits.data(), vocab);
      s->forward(&next, 1, pos++, logits.data(), nullptr);
      alone[i].push_back(logits);
    }
  }

  // Batched: the prompts alone, then one forward_batch per step over the rows in the batch.
  std::vector<std::unique_ptr<DecoderCpuSession>> sessions;
  std::vector<int> next(n), pos(n), done(n, 0);
  std::vector<float> logits(vocab);
  for (int i = 0; i < n; ++i) {
    sessions.push_back(model.new_cpu_session(64));
    sessions[i]->forward(ps[i].prompt.data(), (int)ps[i].prompt.size(), 0, logits.data(), nullptr);
    ASSERT_EQ(0, std::memcmp(logits.data(), alone[i][0].data(), vocab * sizeof(float)));
    next[i] = argmax_of(logits.data(), vocab);
    pos[i] = (int)ps[i].prompt.size();
  }
  int widest = 0;
  for (int step = 0;; ++step) {
    std::vector<BatchRow> rows;
    std::vector<int> who;
    for (int i = 0; i < n; ++i)
      if (step >= ps[i].join && done[i] < ps[i].steps) {
        rows.push_back({sessions[i].get(), next[i], pos[i]});
        who.push_back(i);
      }
    if (rows.empty()) break;
    widest = std::max(widest, (int)rows.size());
    std::vector<float> out(rows.size() * vocab);
    model.forward_batch(rows, out.data());
    for (size_t r = 0; r < rows.size(); ++r) {
      const int i = who[r];
      const float* row = out.data() + r * vocab;
      ++done[i];
      ASSERT_EQ(0, std::memcmp(row, alone[i][done[i]].data(), vocab * sizeof(float)))
          << "sequence " << i << ", decode step " << done[i] << " of a batch of " << rows.size();
      next[i] = argmax_of(row, vocab);
      ++pos[i];
    }
  }
  EXPECT_EQ(widest, 5);  // the plan does put every sequence in one step
}

using Format = kestrel::test::ModelFormat;

class BatchFormats : public ::testing::TestWithParam<Format> {};

TEST_P(BatchFormats, RowsEqualAloneBitForBit) {
  const fs::path dir = kestrel::test::write_tiny_model(GetParam(), /*seed=*/5, /*n_layers=*/2);
  DecoderCpu model(load_model_spec(dir.string()));
  expect_batch_equals_alone(model);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, BatchFormats,
    ::testing::Values(Format{"fp16", "fp16", 16, 0, false, false, "gptq"},
                      Format{"q4_g128", "gptq", 4, 128, false, false, "gptq"},
                      Format{"q3_g64_act", "gptq", 3, 64, true, false, "gptq"}),
    [](const auto& info) { return info.param.name; });

// transformers' tiny models: Llama 3 (GPTQ), Mistral (sliding window), Qwen3 (q/k norms),
// OPT (learned positions, LayerNorm, ReLU MLP, biases).
class BatchFamilies : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchFamilies, RowsEqualAloneBitForBit) {
  DecoderCpu model(load_model_spec(std::string(KESTREL_TEST_DATA) + "/families/" + GetParam()));
  expect_batch_equals_alone(model);
}

INSTANTIATE_TEST_SUITE_P(Cpu, BatchFamilies,
                         ::testing::Values("llama3-gptq", "mistral", "qwen3", "opt-gptq"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// A quantized KV cache too: rows write and read their own caches in its type.
TEST(BatchKvCache, Q8CacheRowsEqualAlone) {
  const Format f{"q4_kv8", "gptq", 4, 64, false, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/9, /*n_layers=*/2);
  KvCacheTypes kv;
  kv.k = kv.v = KvType::Q8_0;
  DecoderCpu model(load_model_spec(dir.string()), kv);
  expect_batch_equals_alone(model);
  fs::remove_all(dir);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Rows the batch cannot run are refused, naming the row: one session twice, a position past
// its context, a session of another model, a token past the vocabulary; and the empty batch
// does nothing.
TEST(BatchRows, BadRowsAreRefusedByName) {
  const Format f{"fp16_rows", "fp16", 16, 0, false, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/3, /*n_layers=*/1);
  const ModelSpec spec = load_model_spec(dir.string());
  DecoderCpu model(spec), other(spec);
  auto a = model.new_cpu_session(16), b = model.new_cpu_session(16);
  auto c = other.new_cpu_session(16);
  std::vector<float> logits(3 * spec.config.vocab);
  const BatchRow twice[] = {{a.get(), 1, 0}, {b.get(), 1, 0}, {a.get(), 2, 1}};
  EXPECT_NE(error_of([&] { model.forward_batch(twice, logits.data()); })
                .find("row 2 runs the session of row 0 again"),
            std::string::npos);
  const BatchRow past[] = {{a.get(), 1, 0}, {b.get(), 1, 16}};
  EXPECT_NE(error_of([&] { model.forward_batch(past, logits.data()); })
                .find("row 1: position 16 is outside its context of 16"),
            std::string::npos);
  const BatchRow foreign[] = {{c.get(), 1, 0}};
  EXPECT_NE(error_of([&] { model.forward_batch(foreign, logits.data()); })
                .find("row 0's session belongs to another model"),
            std::string::npos);
  const BatchRow bad_token[] = {{a.get(), spec.config.vocab, 0}};
  EXPECT_NE(error_of([&] { model.forward_batch(bad_token, logits.data()); })
                .find("row 0: token id " + std::to_string(spec.config.vocab) + " is outside the vocabulary"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { model.forward_batch({}, logits.data()); }), "");
  fs::remove_all(dir);
}

}  // namespace

// ---- Paged KV memory (Model::use_kv_pool) -------------------------------------------------

using kestrel::test::greedy_logits;

std::vector<int> random_ids(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int> v(n);
  for (int& id : v) id = (int)(rng() % vocab);
  return v;
}

class PagedKv : public ::testing::TestWithParam<KvType> {};

// A paged session computes what a session with a cache of its own computes, bit for bit: a
// prompt across blocks (the BLAS rows, gathering the pool's rows) and decode steps past
// several block boundaries (the decode step's arithmetic); and batched rows of paged sessions
// equal the same sessions alone.
TEST_P(PagedKv, SessionsEqualOwnCacheBitForBit) {
  const Format f{"q4_paged", "gptq", 4, 64, true, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/21, /*n_layers=*/2);
  const ModelSpec spec = load_model_spec(dir.string());
  KvCacheTypes kv;
  kv.k = kv.v = GetParam();
  DecoderCpu own(spec, kv), paged(spec, kv);
  ASSERT_TRUE(paged.use_kv_pool(40 * kKvBlock));
  const std::vector<int> prompt = random_ids(37, spec.config.vocab, 4);
  auto a = own.new_session(128);
  auto b = paged.new_cpu_session(128);
  // Another sequence holds the pool's first three blocks while b runs its prompt and gives
  // them back after, so that b's table is no identity: an engine that ignored it would read
  // other rows.
  auto filler = paged.new_cpu_session(128);
  {
    const std::vector<int> other = random_ids(40, spec.config.vocab, 9);
    std::vector<float> scratch(spec.config.vocab);
    filler->forward(other.data(), 40, 0, scratch.data(), nullptr);
  }
  const auto want = greedy_logits(*a, prompt, 30);
  std::vector<std::vector<float>> got = greedy_logits(*b, prompt, 0);
  filler.reset();
  for (int pos = (int)prompt.size(); pos < (int)prompt.size() + 30; ++pos) {  // greedy steps
    const int next = argmax_of(got.back().data(), (int)got.back().size());
    std::vector<float> logits(got.back().size());
    b->forward(&next, 1, pos, logits.data(), nullptr);
    got.push_back(std::move(logits));
  }
  const std::vector<int32_t>& table = b->state().table->blocks();
  ASSERT_EQ(table.size(), (37u + 30 + kKvBlock - 1) / kKvBlock);
  EXPECT_EQ(table[0], 3);  // after the three the other sequence held
  EXPECT_EQ(table[3], 2);  // the block it freed (its partial one)
  for (size_t s = 0; s < want.size(); ++s)
    ASSERT_EQ(0, std::memcmp(want[s].data(), got[s].data(), want[s].size() * sizeof(float)))
        << "step " << s;
  EXPECT_EQ(paged.kv_pool_use().held, (37 + 30 + kKvBlock - 1) / kKvBlock);
  b.reset();
  expect_batch_equals_alone(paged);
  fs::remove_all(dir);
}

// A second sequence whose prompt begins as the first's maps the first's whole blocks instead of
// running them, and then generates what it generates from the whole prompt run at once.
TEST_P(PagedKv, APromptReusesAnotherSequencesBlocks) {
  const Format f{"q4_shared", "gptq", 4, 128, false, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/22, /*n_layers=*/2);
  const ModelSpec spec = load_model_spec(dir.string());
  KvCacheTypes kv;
  kv.k = kv.v = GetParam();
  DecoderCpu own(spec, kv), paged(spec, kv);
  ASSERT_TRUE(paged.use_kv_pool(64 * kKvBlock));
  const int vocab = spec.config.vocab;
  const std::vector<int> header = random_ids(40, vocab, 5);  // a system prompt, say
  std::vector<int> prompt = header;
  for (int id : random_ids(9, vocab, 6)) prompt.push_back(id);

  auto alone = own.new_session(128);
  const auto r = kestrel::test::prefix_reuse(paged, *alone, header, prompt, 12);
  EXPECT_EQ(r.cached, std::vector<int>(header.begin(), header.begin() + 32));  // 2 whole blocks
  EXPECT_EQ(r.held, 3);  // first's 43 positions; second shares two blocks
  // The prefix's K/V came from a pass over 40 rows, the lone session's from one over 49: the
  // BLAS products may round differently, so the logits agree to fp32 rounding, the ids exactly.
  for (size_t s = 0; s < r.want.size(); ++s) {
    for (int i = 0; i < vocab; ++i) ASSERT_NEAR(r.got[s][i], r.want[s][i], 1e-4) << "step " << s;
    EXPECT_EQ(argmax_of(r.got[s].data(), vocab), argmax_of(r.want[s].data(), vocab))
        << "step " << s;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Cpu, PagedKv, ::testing::Values(KvType::F16, KvType::Q8_0, KvType::Fp8),
                         [](const auto& info) { return std::string(kv_type_name(info.param)); });

// A sequence that writes into a block it shares (here: a rerun from inside the shared prefix)
// writes into a copy of all of it: the other sequence's next step is what it was, and its own
// reads the block's other positions.
TEST(PagedKvCopy, WritingASharedBlockWritesIntoAFullCopy) {
  const Format f{"fp16_cow", "fp16", 16, 0, false, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/23, /*n_layers=*/2);
  const ModelSpec spec = load_model_spec(dir.string());
  DecoderCpu paged(spec);
  ASSERT_TRUE(paged.use_kv_pool(16 * kKvBlock));
  const int vocab = spec.config.vocab;
  DecoderCpu own(spec);
  auto lone = own.new_session(128);
  const auto r = kestrel::test::copy_on_write(paged, *lone, random_ids(48, vocab, 7));
  EXPECT_EQ(r.cached, 48u);
  EXPECT_EQ(r.held_shared, 4);   // a's 49 positions; b shares its first three blocks
  EXPECT_EQ(r.held_written, 5);  // b's copy of block 1
  EXPECT_TRUE(r.a_unchanged);
  // And b's copy holds the shared block's other positions (16 .. 19 before its write): its
  // next step is a lone session's over the same ids (to fp32 rounding: a's prompt ran as one
  // pass of 48 rows).
  for (int i = 0; i < vocab; ++i) ASSERT_NEAR(r.b_step[i], r.lone_step[i], 1e-4) << i;
  fs::remove_all(dir);
}

// A pool with no block left refuses a write in one line, and a finished sequence's blocks are
// taken back for the next.
TEST(PagedKvFull, AFullPoolRefusesAWriteUntilASequenceEnds) {
  const Format f{"fp16_full", "fp16", 16, 0, false, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/24, /*n_layers=*/1);
  const ModelSpec spec = load_model_spec(dir.string());
  DecoderCpu paged(spec);
  ASSERT_TRUE(paged.use_kv_pool(4 * kKvBlock));
  const int vocab = spec.config.vocab;
  std::vector<float> logits(vocab);
  auto a = paged.new_session(128);
  const std::vector<int> prompt = random_ids(60, vocab, 8);
  a->forward(prompt.data(), 60, 0, logits.data());
  auto b = paged.new_session(128);
  const std::string why = error_of([&] { b->forward(prompt.data(), 1, 0, logits.data()); });
  EXPECT_NE(why.find("the KV cache pool is full: 4 blocks of 16 positions, all held"),
            std::string::npos)
      << why;
  a.reset();
  EXPECT_EQ(paged.kv_pool_use().cached, 3);  // a's three whole blocks stay for a later prompt
  b->forward(&prompt[59], 1, 0, logits.data());
  EXPECT_EQ(paged.kv_pool_use().held, 1);
  fs::remove_all(dir);
}
