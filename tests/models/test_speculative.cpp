// Speculative decoding on the CPU engine: greedy output token for token that of plain decoding
// (every weight format, lookup and draft-model drafters, the real docs-llama model), the
// interactions with end ids, stop strings, penalties, logprobs, -n and the context, the KV
// cache left consistent for the next prompt, and sampled output that follows the exact
// distribution computed from the model's logits (a chi-square test over fixed seeds).
#include <gtest/gtest.h>

#include <iostream>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "engine/speculative.h"
#include "models/io/model_spec.h"
#include "models/cpu/decoder.h"
#include "models/gpu/decoder.h"
#include "tests/support/gpu.h"
#include "tests/support/synth_model.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace kestrel;
using kestrel::test::ModelFormat;

namespace {

// A loaded model directory: spec, CPU model and tokenizer.
struct Loaded {
  explicit Loaded(const fs::path& dir)
      : spec(load_model_spec(dir.string())), model(spec), tok(Tokenizer::load(dir.string())) {}
  std::unique_ptr<DecoderCpuSession> session(int ctx = 256) { return model.new_cpu_session(ctx); }
  ModelSpec spec;
  DecoderCpu model;
  std::unique_ptr<Tokenizer> tok;
};

GenerateOptions greedy(int n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.sampling.temperature = 0;
  o.ignore_eos = true;
  return o;
}

// Text that repeats itself, so that lookup finds n-grams to draft from.
const char* kRepetitive =
    "the river runs under a stone bridge and the river runs under a stone bridge and the "
    "kernel module loads when the user asks for the river runs under a stone";

TEST(NgramDrafter, ProposesWhatFollowedTheLatestLongestMatch) {
  NgramDrafter d(1, 3);
  Draft out;
  // Suffix [1 2 3]: it occurred at 0 (followed by 4 5) and at 5 (followed by 9 1): the latest.
  d.propose({1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3}, 2, out);
  EXPECT_EQ(out.ids, (std::vector<int>{9, 1}));
  EXPECT_TRUE(out.q.empty());
  // k cuts the continuation; the continuation cannot run past the history.
  d.propose({7, 8, 7}, 5, out);
  EXPECT_EQ(out.ids, (std::vector<int>{8, 7}));
  // No earlier occurrence of the last id: nothing.
  d.propose({1, 2, 3}, 4, out);
  EXPECT_TRUE(out.ids.empty());
  NgramDrafter pairs(2, 2);
  pairs.propose({5, 6, 1, 6, 1}, 4, out);  // [6 1] at 1, then 6 1
  EXPECT_EQ(out.ids, (std::vector<int>{6, 1}));
}

TEST(DraftLength, GrowsOnFullAcceptanceAndHalvesOnAnEarlyRejection) {
  DraftLength l(8);
  EXPECT_EQ(l.next(), 8);
  l.update(8, 0);
  EXPECT_EQ(l.next(), 4);
  l.update(4, 2);  // part accepted: kept
  EXPECT_EQ(l.next(), 4);
  l.update(4, 4);
  EXPECT_EQ(l.next(), 6);
  l.update(6, 6);
  l.update(8, 8);
  EXPECT_EQ(l.next(), 8);  // capped
  for (int i = 0; i < 5; ++i) l.update(l.next(), 0);
  EXPECT_EQ(l.next(), 1);  // floored
  l.update(0, 0);          // nothing drafted: no evidence
  EXPECT_EQ(l.next(), 1);
}

TEST(AcceptOrResample, PointMassAcceptsWithPAndResamplesTheRest) {
  const std::vector<double> p = {0.5, 0.3, 0.2, 0.0};
  std::mt19937_64 rng(1);
  const int n = 200000;
  std::vector<int> count(4);
  int accepted = 0;
  for (int i = 0; i < n; ++i) {
    bool a;
    ++count[accept_or_resample(p, 1, nullptr, rng, &a)];
    accepted += a;
  }
  EXPECT_NEAR(accepted / (double)n, 0.3, 0.005);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(count[i] / (double)n, p[i], 0.005) << i;
  // A draft distribution q: the result is p whatever q is.
  const std::vector<double> q = {0.1, 0.1, 0.2, 0.6};
  std::fill(count.begin(), count.end(), 0);
  std::discrete_distribution<int> from_q(q.begin(), q.end());
  for (int i = 0; i < n; ++i) {
    bool a;
    ++count[accept_or_resample(p, from_q(rng), &q, rng, &a)];
  }
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(count[i] / (double)n, p[i], 0.005) << i;
}

class SpecFormats : public ::testing::TestWithParam<ModelFormat> {};

// Greedy: the same ids with either drafter as without speculation, in every weight format.
TEST_P(SpecFormats, GreedyOutputIsPlainDecodings) {
  const fs::path dir = kestrel::test::write_tiny_model(GetParam(), /*seed=*/11, /*n_layers=*/2);
  Loaded m(dir);
  ModelFormat other = GetParam();
  other.name += "_draft";
  Loaded d(kestrel::test::write_tiny_model(other, /*seed=*/12, /*n_layers=*/1));
  const std::vector<int> prompt = m.tok->encode(kRepetitive);
  const GenerateResult plain = generate(*m.session(), *m.tok, prompt, greedy(48));
  ASSERT_EQ(plain.ids.size(), 48u);

  NgramDrafter lookup;
  auto draft_session = d.session();
  ModelDrafter drafter(*draft_session, greedy(1).sampling);
  // The target itself as its draft model: every draft is accepted.
  auto self_session = m.session();
  ModelDrafter self(*self_session, greedy(1).sampling);
  for (Drafter* dr : {(Drafter*)&lookup, (Drafter*)&drafter, (Drafter*)&self}) {
    for (int draft_max : {1, 3, 8}) {
      GenerateOptions o = greedy(48);
      o.drafter = dr;
      o.draft_max = draft_max;
      const GenerateResult r = generate(*m.session(), *m.tok, prompt, o);
      EXPECT_EQ(r.ids, plain.ids) << dr->name() << " draft-max " << draft_max;
      EXPECT_EQ(r.text, plain.text);
      EXPECT_GT(r.n_drafted, 0) << dr->name();
      EXPECT_EQ(r.n_eval, 47);
      if (dr == &self) {
        EXPECT_EQ(r.n_accepted, r.n_drafted);
        EXPECT_LT(r.n_steps, 47);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, SpecFormats,
    ::testing::Values(ModelFormat{"fp16", "fp16", 16, 0, false, false, "gptq"},
                      ModelFormat{"q4_g128", "gptq", 4, 128, false, false, "gptq"},
                      ModelFormat{"q4_g128_act_v2_asym", "gptq", 4, 128, true, true, "gptq_v2"},
                      ModelFormat{"q3_g64_act", "gptq", 3, 64, true, false, "gptq"},
                      ModelFormat{"q2_g32_v2", "gptq", 2, 32, false, false, "gptq_v2"},
                      ModelFormat{"q8_perchannel_asym", "gptq", 8, -1, false, true, "gptq_v2"}),
    [](const auto& info) { return info.param.name; });

// The real 4-bit model committed to the repository: prompt lookup on text that repeats.
TEST(SpecRealModel, DocsLlamaGreedyLookupIsPlainDecoding) {
  Loaded m(fs::path(KESTREL_DATA_DIR) / "docs-llama-19m-gptq4");
  std::string text = "The install script sets up cmake, ninja and the compiler. ";
  text = text + text + "Then run the build script: it builds the programs into build. " + text;
  const std::vector<int> prompt = m.tok->encode(text);
  GenerateOptions o = greedy(96);
  o.ignore_eos = false;
  const GenerateResult plain = generate(*m.session(1024), *m.tok, prompt, o);
  NgramDrafter lookup;
  o.drafter = &lookup;
  const GenerateResult r = generate(*m.session(1024), *m.tok, prompt, o);
  EXPECT_EQ(r.ids, plain.ids);
  EXPECT_EQ(r.text, plain.text);
  EXPECT_EQ(r.finish_reason, plain.finish_reason);
  EXPECT_GT(r.n_accepted, 0);
}

// ---- The CUDA engine ----
//
// Its verify pass (forward_argmax_rows) takes each row's argmax on the device from the rows'
// fp32 logits: the same ids as an argmax of the logits forward() hands back for the same rows.
TEST(SpecCuda, GpuArgmaxRowsAreTheArgmaxOfTheRowsLogits) {
  KESTREL_REQUIRE_GPU();
  for (const ModelFormat& f : {ModelFormat{"spec_q4_act", "gptq", 4, 128, true, false, "gptq"},
                               ModelFormat{"spec_q3", "gptq", 3, 128, false, false, "gptq"},
                               ModelFormat{"spec_fp16", "fp16", 16, 0, false, false, "gptq"}}) {
    const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/7);
    const ModelSpec spec = load_model_spec(dir.string());
    for (const int small_gemm : {0, 64}) {
      DecodeTuning tuning;
      tuning.small_gemm_max_rows = small_gemm;
      DecoderCuda model(spec, true, tuning);
      auto s = model.new_cuda_session(256);
      const int vocab = spec.config.vocab;
      std::vector<int> tokens(40);
      for (int i = 0; i < 40; ++i) tokens[i] = 3 + (i * 37) % (vocab - 3);
      int pos = 0;
      for (const int n : {1, 2, 5, 9, 17}) {
        std::vector<float> all((size_t)n * vocab), last(vocab);
        s->forward(tokens.data(), n, pos, last.data(), all.data());
        std::vector<int> ids(n, -1);
        s->forward_argmax_rows(tokens.data(), n, pos, ids.data());
        for (int i = 0; i < n; ++i) {
          const float* row = all.data() + (size_t)i * vocab;
          EXPECT_EQ(ids[i], (int)(std::max_element(row, row + vocab) - row))
              << f.name << " small_gemm " << small_gemm << " n " << n << " row " << i;
        }
        pos += n;
      }
    }
    fs::remove_all(dir);
  }
}

// Greedy lookup decoding on the GPU gives plain greedy decoding's tokens on the real model,
// with the verify pass through the rows path without the fused small-M GEMM and with it.
// (The verify pass rounds differently from the decode step; only an exact near tie of the
// top two logits could tell them apart, which this text does not have.)
TEST(SpecCuda, GpuDocsLlamaGreedyLookupIsPlainDecoding) {
  KESTREL_REQUIRE_GPU();
  const fs::path dir = fs::path(KESTREL_DATA_DIR) / "docs-llama-19m-gptq4";
  const ModelSpec spec = load_model_spec(dir.string());
  const std::unique_ptr<Tokenizer> tok = Tokenizer::load(dir.string());
  std::string text = "The install script sets up cmake, ninja and the compiler. ";
  text = text + text + "Then run the build script: it builds the programs into build. " + text;
  const std::vector<int> prompt = tok->encode(text);
  for (const int small_gemm : {0, 64}) {
    DecodeTuning tuning;
    tuning.small_gemm_max_rows = small_gemm;
    DecoderCuda model(spec, true, tuning);
    GenerateOptions o = greedy(96);
    o.ignore_eos = false;
    const GenerateResult plain = generate(*model.new_cuda_session(1024), *tok, prompt, o);
    NgramDrafter lookup;
    o.drafter = &lookup;
    for (const int draft_max : {3, 8}) {
      o.draft_max = draft_max;
      const GenerateResult r = generate(*model.new_cuda_session(1024), *tok, prompt, o);
      EXPECT_EQ(r.ids, plain.ids) << "small_gemm " << small_gemm << " draft_max " << draft_max;
      EXPECT_GT(r.n_accepted, 0);
    }
  }
}

// ---- Verify passes as CUDA graphs (DecodeTuning::verify_graphs) ----
//
// A graph replays the kernels the uncaptured pass launches, with the same arguments but the
// position and the tokens read from device memory: the ids, and the KV cache the pass leaves,
// are bit for bit those of a model that launches every pass from the host. Both models of a
// comparison load the same weights with the same tuning but that one field, and every position
// any pass or decode step reads was written identically in both caches first.

// A tiny model of a family (tools/synth: llama, mistral with its window of 32, qwen2's biases,
// qwen3's head norms, opt's learned positions and LayerNorm) in one weight format.
struct VerifyCase {
  std::string arch;
  ModelFormat f;  // f.name names the case
};

fs::path write_verify_model(const VerifyCase& v, uint64_t seed) {
  return kestrel::test::write_tiny_model(v.f, seed, /*n_layers=*/2, v.arch);
}

// The pass counts of the verify path: 2 .. 5 rows run batch-1 GEMVs (or from 3 on the fused
// small-M GEMM), 9 .. 33 the dequantize + cuBLASLt GEMMs (or the fused GEMM), 65 cuBLASLt at
// any setting (past the fused GEMM's 64).
const std::vector<int> kVerifyRows = {2, 3, 5, 9, 17, 33, 65};

// Two sessions over the same weights, one replaying verify graphs and one launching every
// pass from the host, kept in step: each call runs on both and checks that they agree.
class VerifyPair {
 public:
  VerifyPair(DecoderCudaSession& graphs, DecoderCudaSession& plain, int vocab, uint32_t seed)
      : g_(graphs), p_(plain), vocab_(vocab), rng_(seed) {}

  // Random tokens for positions [filled, end) through forward() on both: every cache row a
  // later pass attends over holds the same K/V in both.
  void fill_to(int end) {
    if (end <= filled_) return;
    const std::vector<int> t = tokens(end - filled_);
    std::vector<float> a(vocab_), b(vocab_);
    g_.forward(t.data(), (int)t.size(), filled_, a.data(), nullptr);
    p_.forward(t.data(), (int)t.size(), filled_, b.data(), nullptr);
    ASSERT_EQ(a, b) << "prompt up to " << end;
    filled_ = end;
  }

  // A verify pass of n rows at pos (the cache filled up to pos first) on both: the same ids;
  // then, where the context has room, one decode step after it on both, whose logits read
  // the K/V the pass wrote: bitwise the same.
  void verify(int n, int pos, const std::string& what) {
    SCOPED_TRACE(what + ": n " + std::to_string(n) + " at position " + std::to_string(pos));
    fill_to(pos);
    const std::vector<int> t = tokens(n);
    std::vector<int> a(n, -1), b(n, -2);
    g_.forward_argmax_rows(t.data(), n, pos, a.data());
    p_.forward_argmax_rows(t.data(), n, pos, b.data());
    EXPECT_EQ(a, b);
    for (int id : a) ASSERT_TRUE(id >= 0 && id < vocab_) << id;
    filled_ = std::max(filled_, pos + n);
    ++passes_;
    if (pos + n >= g_.context_length()) return;
    std::vector<float> la(vocab_), lb(vocab_);
    g_.forward(&a[n - 1], 1, pos + n, la.data(), nullptr);
    p_.forward(&a[n - 1], 1, pos + n, lb.data(), nullptr);
    EXPECT_EQ(la, lb) << "the decode step after the pass";
    filled_ = std::max(filled_, pos + n + 1);
  }

  int passes() const { return passes_; }

 private:
  std::vector<int> tokens(int n) {
    std::uniform_int_distribution<int> d(3, vocab_ - 1);
    std::vector<int> t(n);
    for (int& x : t) x = d(rng_);
    return t;
  }
  DecoderCudaSession& g_;
  DecoderCudaSession& p_;
  int vocab_;
  std::mt19937 rng_;
  int filled_ = 0, passes_ = 0;
};

DecodeTuning verify_tuning(bool graphs, int small_gemm) {
  DecodeTuning t;
  t.verify_graphs = graphs;
  t.small_gemm_max_rows = small_gemm;
  return t;
}

// Every pass count, first used (the uncaptured pass, then the capture), then replayed at
// positions across 512 and 1024 (where the decode graphs change range) going back over rows
// already written (rejected drafts), and at the end of the context; in several formats and
// families, with the fused small-M GEMM off and on.
TEST(SpecCuda, GpuVerifyGraphsEqualUncapturedPasses) {
  KESTREL_REQUIRE_GPU();
  const std::vector<VerifyCase> cases = {
      {"llama", {"fp16", "fp16", 16, 0, false, false, "gptq"}},
      {"llama", {"q4_g128_act", "gptq", 4, 128, true, false, "gptq"}},
      {"llama", {"q4_act_unfused", "gptq", 4, 128, true, false, "gptq", 4, 2, true}},
      {"llama", {"q3_g64", "gptq", 3, 64, false, false, "gptq"}},
      {"llama", {"q2_g32_v2", "gptq", 2, 32, false, false, "gptq_v2"}},
      {"llama", {"q8_perchannel_asym", "gptq", 8, -1, false, true, "gptq_v2"}},
      // GPTQModel `dynamic`: formats per linear, unfused siblings (tests/support/synth_model.h)
      {"llama", kestrel::test::dynamic_mixed()},
      {"llama", kestrel::test::dynamic_v2_asym()},
      {"mistral", {"mistral_q4", "gptq", 4, 128, false, false, "gptq"}},
      {"qwen2", {"qwen2_q4_asym", "gptq", 4, 32, false, true, "gptq_v2"}},
      {"qwen3", {"qwen3_fp16", "fp16", 16, 0, false, false, "gptq"}},
      // (OPT has no grouped-query attention: as many K/V heads as query heads.)
      {"opt", {"opt_q4", "gptq", 4, 128, false, false, "gptq", 4, 4}},
      {"opt", {"opt_fp16", "fp16", 16, 0, false, false, "gptq", 4, 4}},
  };
  const int ctx = 1200;
  for (const VerifyCase& v : cases) {
    const fs::path dir = write_verify_model(v, /*seed=*/31);
    const ModelSpec spec = load_model_spec(dir.string());
    ASSERT_GE(spec.config.max_pos, ctx) << v.f.name;
    for (const int small_gemm : {0, 64}) {
      SCOPED_TRACE(v.f.name + " small_gemm " + std::to_string(small_gemm));
      DecoderCuda graph_model(spec, true, verify_tuning(true, small_gemm));
      DecoderCuda plain_model(spec, true, verify_tuning(false, small_gemm));
      auto gs = graph_model.new_cuda_session(ctx);
      auto ps = plain_model.new_cuda_session(ctx);
      ASSERT_EQ(gs->context_length(), ctx);
      VerifyPair pair(*gs, *ps, spec.config.vocab, 41 + small_gemm);
      pair.fill_to(40);
      int pos = 40;
      for (const int n : kVerifyRows) {  // first use of each n: uncaptured, then captured
        pair.verify(n, pos, "first use");
        pos += n / 2 + 1;  // about half the draft accepted
      }
      EXPECT_EQ(gs->verify_graphs_held(), (int)kVerifyRows.size());
      EXPECT_EQ(ps->verify_graphs_held(), 0);
      for (const int n : kVerifyRows) pair.verify(n, pos + 3 * n, "replay");
      for (auto it = kVerifyRows.rbegin(); it != kVerifyRows.rend(); ++it)
        pair.verify(*it, 512 - *it / 2, "across 512, backwards");
      for (const int n : kVerifyRows) pair.verify(n, 1024 - n + 1, "ending past 1024");
      for (const int n : kVerifyRows) pair.verify(n, 1024, "from 1024");
      for (const int n : kVerifyRows) pair.verify(n, ctx - n, "the end of the context");
      for (const int n : {65, 2, 33, 3, 17, 5, 9})
        pair.verify(n, 700 + n, "after every n was captured");
      EXPECT_EQ(gs->verify_graphs_held(), (int)kVerifyRows.size());
    }
    fs::remove_all(dir);
  }
}

// Two sessions of one model take turns with verify passes: their graphs share the model's
// prefill scratch and never its KV caches. Between them, prompts through the prefill (which
// uses the same scratch), a session destroyed and another opened, and the prefill's scratch
// made again (a new chunk length): the graphs over the old scratch are dropped and captured
// again, and a pass longer than a chunk runs uncaptured.
TEST(SpecCuda, GpuVerifyGraphsOfTwoSessionsAlternate) {
  KESTREL_REQUIRE_GPU();
  const VerifyCase v{"llama", {"two_q4_act", "gptq", 4, 128, true, false, "gptq"}};
  const fs::path dir = write_verify_model(v, /*seed=*/33);
  const ModelSpec spec = load_model_spec(dir.string());
  const int vocab = spec.config.vocab;
  for (const int small_gemm : {0, 64}) {
    SCOPED_TRACE("small_gemm " + std::to_string(small_gemm));
    DecoderCuda graph_model(spec, true, verify_tuning(true, small_gemm));
    DecoderCuda plain_model(spec, true, verify_tuning(false, small_gemm));
    auto g1 = graph_model.new_cuda_session(700), g2 = graph_model.new_cuda_session(1100);
    auto p1 = plain_model.new_cuda_session(700), p2 = plain_model.new_cuda_session(1100);
    auto one = std::make_unique<VerifyPair>(*g1, *p1, vocab, 51);
    auto two = std::make_unique<VerifyPair>(*g2, *p2, vocab, 52);
    one->fill_to(30);
    two->fill_to(90);
    for (int round = 0; round < 3; ++round) {
      const std::string r = "round " + std::to_string(round);
      for (size_t i = 0; i < kVerifyRows.size(); ++i) {
        const int n = kVerifyRows[i], m = kVerifyRows[kVerifyRows.size() - 1 - i];
        one->verify(n, 30 + 200 * round + 2 * n, "session 1, " + r);
        two->verify(m, 90 + 300 * round + m, "session 2, " + r);
      }
    }
    EXPECT_EQ(g1->verify_graphs_held(), (int)kVerifyRows.size());
    EXPECT_EQ(g2->verify_graphs_held(), (int)kVerifyRows.size());

    // A long prompt in session 2 (through the shared scratch), then session 1's graphs again.
    two->fill_to(1000);
    for (const int n : kVerifyRows) one->verify(n, 600 - n, "session 1 after session 2's prompt");

    // Session 2 ends; a third opens and captures its own graphs; session 1 goes on.
    two.reset();
    g2.reset();
    p2.reset();
    auto g3 = graph_model.new_cuda_session(900);
    auto p3 = plain_model.new_cuda_session(900);
    VerifyPair three(*g3, *p3, vocab, 53);
    for (const int n : kVerifyRows) {
      three.verify(n, 100 + n, "session 3");
      one->verify(n, 300 + n, "session 1 beside session 3");
    }
    for (const int n : kVerifyRows) three.verify(n, 800 - n, "session 3 replayed");
    EXPECT_EQ(g3->verify_graphs_held(), (int)kVerifyRows.size());

    // The scratch made again for chunks of 48 tokens (on both models, so that prompts run in
    // the same chunks): the graphs over the old scratch are dropped when next asked for, passes
    // of up to 48 rows captured again, 65 rows run in two chunks, uncaptured.
    graph_model.set_prefill_chunk(48);
    plain_model.set_prefill_chunk(48);
    for (const int n : kVerifyRows) one->verify(n, 200 + n, "session 1, chunks of 48");
    EXPECT_EQ(g1->verify_graphs_held(), (int)kVerifyRows.size() - 1);
    for (const int n : kVerifyRows) three.verify(n, 400 + n, "session 3, chunks of 48");
    for (const int n : kVerifyRows) one->verify(n, 500 - n, "session 1, chunks of 48, replayed");
    EXPECT_EQ(g3->verify_graphs_held(), (int)kVerifyRows.size() - 1);
  }
  fs::remove_all(dir);
}

class SpecTiny : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    m_ = new Loaded(kestrel::test::write_tiny_model(
        {"spec_fp16", "fp16", 16, 0, false, false, "gptq"}, /*seed=*/5, /*n_layers=*/2));
    d_ = new Loaded(kestrel::test::write_tiny_model(
        {"spec_fp16_draft", "fp16", 16, 0, false, false, "gptq"}, /*seed=*/6, /*n_layers=*/1));
  }
  static void TearDownTestSuite() {
    delete m_;
    delete d_;
  }
  static Loaded* m_;
  static Loaded* d_;
};
Loaded* SpecTiny::m_ = nullptr;
Loaded* SpecTiny::d_ = nullptr;

// An end id, a stop string and a reverse prompt inside a run of accepted drafts end generation
// there, as they do without speculation; -n is never exceeded.
TEST_F(SpecTiny, EndsInsideAnAcceptedRunAsPlainDecoding) {
  const std::vector<int> prompt = m_->tok->encode(kRepetitive);
  const GenerateResult ref = generate(*m_->session(), *m_->tok, prompt, greedy(40));
  auto self_session = m_->session();
  ModelDrafter self(*self_session, greedy(1).sampling);  // drafts = the target's own ids
  // The first id not seen before index 6 ends generation at its first occurrence.
  size_t at = 6;
  while (std::find(ref.ids.begin(), ref.ids.begin() + at, ref.ids[at]) != ref.ids.begin() + at) ++at;
  ASSERT_LT(at, ref.ids.size());
  std::vector<GenerateOptions> variants(4, greedy(40));
  variants[0].ignore_eos = false;
  variants[0].stop_ids = {ref.ids[at]};
  const std::string later = m_->tok->decode({ref.ids[at], ref.ids[at + 1]});
  variants[1].stop = {later};
  variants[2].reverse_prompts = {later};
  variants[3] = greedy(5);
  for (size_t v = 0; v < variants.size(); ++v) {
    const GenerateResult plain = generate(*m_->session(), *m_->tok, prompt, variants[v]);
    GenerateOptions o = variants[v];
    o.drafter = &self;
    std::string streamed;
    const GenerateResult r = generate(*m_->session(), *m_->tok, prompt, o,
                                      [&](std::string_view s) { streamed += s; });
    EXPECT_EQ(r.ids, plain.ids) << v;
    EXPECT_EQ(r.text, plain.text) << v;
    EXPECT_EQ(streamed, plain.text) << v;
    EXPECT_EQ(r.finish_reason, plain.finish_reason) << v;
    // Every draft compared was accepted (the target drafts for itself); the drafts past the
    // end were never compared, and count as neither.
    EXPECT_GT(r.n_drafted, 0) << v;
    EXPECT_EQ(r.n_accepted, r.n_drafted) << v;
  }
  EXPECT_EQ(generate(*m_->session(), *m_->tok, prompt, variants[0]).finish_reason, "eos");
}

// A cancel is seen before each id, as plain decoding sees it, not only between verify passes
// (a pass of 8 accepted drafts would otherwise stream 9 ids after Ctrl-C or a client's leaving).
TEST_F(SpecTiny, CancelIsPolledBeforeEachId) {
  const std::vector<int> prompt = m_->tok->encode(kRepetitive);
  auto self_session = m_->session();
  ModelDrafter self(*self_session, greedy(1).sampling);
  for (const int polls : {1, 2, 6, 11}) {
    GenerateOptions o = greedy(40);
    int calls = 0;
    o.cancelled = [&] { return ++calls >= polls; };
    const GenerateResult plain = generate(*m_->session(), *m_->tok, prompt, o);
    ASSERT_EQ(plain.ids.size(), size_t(polls - 1));
    calls = 0;
    o.drafter = &self;
    const GenerateResult r = generate(*m_->session(), *m_->tok, prompt, o);
    EXPECT_EQ(r.ids, plain.ids) << polls;
    EXPECT_EQ(r.finish_reason, "cancelled") << polls;
    EXPECT_EQ(calls, polls) << polls;
  }
}

// A drafter that proposes k copies of one id.
class RepeatDrafter final : public Drafter {
 public:
  explicit RepeatDrafter(int id) : id_(id) {}
  void propose(const std::vector<int>&, int k, Draft& out) override { out.ids.assign(k, id_); }
  std::string name() const override { return "repeat"; }

 private:
  int id_;
};

// A rejected draft takes the drafts after it down with it: all count as drafted and rejected,
// as llama.cpp, vLLM and OpenAI's rejected_prediction_tokens count them.
TEST_F(SpecTiny, DraftsAfterARejectionCountAsRejected) {
  const std::vector<int> prompt = m_->tok->encode(kRepetitive);
  const GenerateResult plain = generate(*m_->session(), *m_->tok, prompt, greedy(10));
  int never = 0;  // an id plain decoding does not produce
  while (std::find(plain.ids.begin(), plain.ids.end(), never) != plain.ids.end()) ++never;
  RepeatDrafter wrong(never);
  GenerateOptions o = greedy(10);
  o.drafter = &wrong;
  o.draft_max = 4;
  const GenerateResult r = generate(*m_->session(), *m_->tok, prompt, o);
  EXPECT_EQ(r.ids, plain.ids);
  EXPECT_EQ(r.n_accepted, 0);
  // Passes after the first id: drafts of 4, 2 (halved), then 1 until the last pass, which has
  // room for its own id only (-n 10).
  EXPECT_EQ(r.n_steps, 9);
  EXPECT_EQ(r.n_drafted, 4 + 2 + 6 * 1);
}

TEST_F(SpecTiny, DraftMaxOutsideItsRangeIsRefused) {
  const std::vector<int> prompt = m_->tok->encode(kRepetitive);
  NgramDrafter lookup;
  for (const int bad : {0, -1, kMaxDraftMax + 1}) {
    GenerateOptions o = greedy(8);
    o.drafter = &lookup;
    o.draft_max = bad;
    try {
      generate(*m_->session(), *m_->tok, prompt, o);
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "draft_max must be between 1 and 64, got " +
                                           std::to_string(bad));
    }
  }
}

// Penalties apply per verified row to the ids before it, and logprobs come from the verify
// pass's rows: both as plain decoding has them.
TEST_F(SpecTiny, PenaltiesAndLogprobsAsPlainDecoding) {
  const std::vector<int> prompt = m_->tok->encode(kRepetitive);
  NgramDrafter lookup;
  auto self_session = m_->session();
  for (int variant = 0; variant < 3; ++variant) {
    GenerateOptions o = greedy(40);
    if (variant == 0) o.sampling.repeat_penalty = 1.3f;
    if (variant == 1) {
      o.sampling.frequency_penalty = 0.4f;
      o.sampling.presence_penalty = 0.3f;
      o.sampling.repeat_last_n = 16;
    }
    o.logprobs = 3;
    const GenerateResult plain = generate(*m_->session(), *m_->tok, prompt, o);
    ModelDrafter self(*self_session, o.sampling);
    for (Drafter* dr : {(Drafter*)&lookup, (Drafter*)&self}) {
      GenerateOptions s = o;
      s.drafter = dr;
      const GenerateResult r = generate(*m_->session(), *m_->tok, prompt, s);
      EXPECT_EQ(r.ids, plain.ids) << variant << " " << dr->name();
      EXPECT_GT(r.n_drafted, 0);
      ASSERT_EQ(r.logprobs.size(), plain.logprobs.size());
      for (size_t i = 0; i < r.logprobs.size(); ++i) {
        EXPECT_EQ(r.logprobs[i].chosen.id, plain.logprobs[i].chosen.id);
        EXPECT_EQ(r.logprobs[i].chosen.logprob, plain.logprobs[i].chosen.logprob);
        ASSERT_EQ(r.logprobs[i].top.size(), 3u);
        EXPECT_EQ(r.logprobs[i].top[2].id, plain.logprobs[i].top[2].id);
      }
    }
  }
}

// The cache after a speculative generation holds the prompt and the ids kept (rejected
// drafts overwritten or never read): the next prompt continues from it as from plain
// decoding's, in a conversation that also drops its beginning (a chat's rollover).
TEST_F(SpecTiny, CacheAfterRejectedDraftsContinuesAsPlainDecoding) {
  const std::vector<int> p1 = m_->tok->encode(kRepetitive);
  auto plain = m_->session(), spec = m_->session(), draft = d_->session();
  ModelDrafter drafter(*draft, greedy(1).sampling);  // another model: drafts get rejected
  NgramDrafter lookup;
  GenerateOptions o = greedy(24);
  GenerateOptions s = o;
  s.drafter = &drafter;
  std::vector<int> prompt = p1;
  for (int turn = 0; turn < 4; ++turn) {
    s.drafter = turn % 2 ? (Drafter*)&lookup : (Drafter*)&drafter;
    const GenerateResult a = generate_cached(*plain, *m_->tok, prompt, o);
    const GenerateResult b = generate_cached(*spec, *m_->tok, prompt, s);
    ASSERT_EQ(b.ids, a.ids) << "turn " << turn;
    EXPECT_EQ(b.n_cached, a.n_cached);
    EXPECT_EQ(spec->cached, plain->cached);
    std::vector<int> want = prompt;
    want.insert(want.end(), b.ids.begin(), b.ids.end() - 1);
    EXPECT_EQ(spec->cached, want);
    if (turn == 0) {
      EXPECT_LT(b.n_accepted, b.n_drafted);
    }
    // The next prompt: the conversation so far and more, or (turn 2) its end only.
    prompt.insert(prompt.end(), b.ids.begin(), b.ids.end());
    const std::vector<int> more = m_->tok->encode(" and the stone", false);
    prompt.insert(prompt.end(), more.begin(), more.end());
    if (turn == 1) prompt.erase(prompt.begin() + 1, prompt.begin() + 12);
  }
}

// -n -1 fills the context exactly: the draft is clamped so that the verify pass stays inside.
TEST_F(SpecTiny, DraftsStayInsideTheContext) {
  const std::vector<int> prompt = m_->tok->encode(kRepetitive);
  const int ctx = (int)prompt.size() + 13;
  const GenerateResult plain = generate(*m_->session(ctx), *m_->tok, prompt, greedy(-1));
  ASSERT_EQ(plain.ids.size(), 13u);
  auto self_session = m_->session(ctx);
  ModelDrafter self(*self_session, greedy(1).sampling);
  GenerateOptions o = greedy(-1);
  o.drafter = &self;
  o.draft_max = 64;
  const GenerateResult r = generate(*m_->session(ctx), *m_->tok, prompt, o);
  EXPECT_EQ(r.ids, plain.ids);
}

// A drafter that proposes, after the first generated id t1, the ids given for t1.
class TableDrafter final : public Drafter {
 public:
  TableDrafter(size_t prompt_len, std::map<int, std::vector<int>> table)
      : n_(prompt_len), table_(std::move(table)) {}
  void propose(const std::vector<int>& history, int k, Draft& out) override {
    out.clear();
    if (history.size() != n_ + 1) return;
    const auto it = table_.find(history.back());
    if (it == table_.end()) return;
    out.ids.assign(it->second.begin(), it->second.begin() + std::min<size_t>(k, it->second.size()));
  }
  std::string name() const override { return "table"; }

 private:
  size_t n_;
  std::map<int, std::vector<int>> table_;
};

// The exact distribution of the first `depth` ids, by running every prefix the sampler can
// choose (top-k keeps it small): sequence -> probability.
void exact_joint(Loaded& m, const std::vector<int>& prompt, const SamplingParams& sp, int depth,
                 std::vector<int> seq, double prob, std::map<std::vector<int>, double>& out) {
  if ((int)seq.size() == depth) {
    out[seq] = prob;
    return;
  }
  auto s = m.session();
  std::vector<int> all = prompt;
  all.insert(all.end(), seq.begin(), seq.end());
  const int vocab = m.spec.config.vocab;
  std::vector<float> logits(vocab);
  s->forward(all.data(), (int)all.size(), 0, logits.data(), nullptr);
  Sampler sampler(sp);
  const std::vector<double> p = sampler.distribution(logits.data(), vocab);
  for (int id = 0; id < vocab; ++id) {
    if (p[id] <= 0) continue;
    std::vector<int> next = seq;
    next.push_back(id);
    exact_joint(m, prompt, sp, depth, next, prob * p[id], out);
  }
}

// Pearson's chi-square of the counts against the exact probabilities over n draws (cells
// expected below 5 pooled), against the 0.001 critical value (Wilson-Hilferty).
::testing::AssertionResult follows(const std::map<std::vector<int>, double>& exact,
                                   const std::map<std::vector<int>, int>& count, int n) {
  double chi2 = 0, pooled_e = 0, pooled_o = 0, tv = 0;
  int cells = 0, seen = 0;
  for (const auto& [seq, p] : exact) {
    const auto it = count.find(seq);
    const double o = it == count.end() ? 0 : it->second, e = p * n;
    seen += (int)o;
    tv += std::fabs(o / n - p) / 2;
    if (e < 5) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    chi2 += (o - e) * (o - e) / e;
    ++cells;
  }
  if (seen != n) return ::testing::AssertionFailure() << n - seen << " draws outside the support";
  if (pooled_e > 0) {
    chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++cells;
  }
  const double df = cells - 1, z = 3.0902;
  const double crit = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  if (chi2 < crit)
    return ::testing::AssertionSuccess() << "chi2 " << chi2 << " < " << crit << ", tv " << tv;
  return ::testing::AssertionFailure() << "chi2 " << chi2 << " >= " << crit << " (" << df
                                       << " degrees of freedom), total variation " << tv;
}

SamplingParams sampled(uint64_t seed) {
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 3;
  sp.top_p = 1.0f;
  sp.min_p = 0.0f;
  sp.seed = seed;
  return sp;
}

// Sampled with speculation, the first four ids over 2500 fixed seeds follow the distribution
// computed from the model's logits: drafts accepted with p(x) / q(x) and replaced from the
// residual, bonus ids after a fully accepted draft. With a point-mass drafter proposing a
// likely-but-not-certain pair, a replacement drawn from p instead of the residual shifts the
// joint distribution far past the test's threshold (it fails then); so does a draft model's.
TEST_F(SpecTiny, SampledOutputFollowsTheTargetDistribution) {
  const std::vector<int> prompt = m_->tok->encode("the river runs under a");
  constexpr int kDepth = 4, kDraws = 2500;
  std::map<std::vector<int>, double> exact;
  exact_joint(*m_, prompt, sampled(0), kDepth, {}, 1.0, exact);
  double total = 0;
  for (const auto& [seq, p] : exact) total += p;
  ASSERT_NEAR(total, 1.0, 1e-9);
  // After t1, draft the second most likely t2 and then t3's most likely: acceptance is
  // neither certain nor rare.
  std::map<int, std::vector<int>> table;
  {
    std::map<std::vector<int>, double> two, three;
    for (const auto& [seq, p] : exact) {
      two[{seq[0], seq[1]}] += p;
      three[{seq[0], seq[1], seq[2]}] += p;
    }
    std::map<int, std::vector<std::pair<double, int>>> by_t1;
    for (const auto& [seq, p] : two) by_t1[seq[0]].push_back({p, seq[1]});
    for (auto& [t1, c] : by_t1) {
      std::sort(c.rbegin(), c.rend());
      const int t2 = c[std::min<size_t>(1, c.size() - 1)].second;
      std::pair<double, int> best{-1, 0};
      for (const auto& [seq, p] : three)
        if (seq[0] == t1 && seq[1] == t2) best = std::max(best, {p, seq[2]});
      table[t1] = {t2, best.second};
    }
  }
  TableDrafter fixed(prompt.size(), table);
  // A draft model whose distribution overlaps the target's without equalling it: the target
  // itself, sampled colder, so that it over-proposes the likeliest id, which the residual
  // then leaves out.
  auto draft_session = m_->session();
  SamplingParams cold = sampled(99);
  cold.temperature = 0.4f;
  ModelDrafter model_drafter(*draft_session, cold);
  for (Drafter* dr : {(Drafter*)&fixed, (Drafter*)&model_drafter}) {
    auto s = m_->session();
    std::map<std::vector<int>, int> count;
    int drafted = 0, accepted = 0;
    for (int seed = 0; seed < kDraws; ++seed) {
      GenerateOptions o;
      o.max_new_tokens = kDepth;
      o.sampling = sampled(seed);
      o.ignore_eos = true;
      o.drafter = dr;
      o.draft_max = 2;
      const GenerateResult r = generate_cached(*s, *m_->tok, prompt, o);
      ASSERT_EQ(r.ids.size(), (size_t)kDepth);
      ++count[r.ids];
      drafted += r.n_drafted;
      accepted += r.n_accepted;
    }
    const ::testing::AssertionResult ok = follows(exact, count, kDraws);
    EXPECT_TRUE(ok) << dr->name();
    std::cerr << dr->name() << ": " << ok.message() << ", " << accepted << " of " << drafted
              << " drafts accepted\n";
    // Both outcomes of the test were exercised, often.
    EXPECT_GT(accepted, kDraws / 4) << dr->name();
    EXPECT_GT(drafted - accepted, kDraws / 4) << dr->name();
  }
}

}  // namespace
