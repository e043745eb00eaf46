// Paged KV memory on the GPU engine (DecoderCuda::use_kv_pool; docs/server.md, "Paged KV memory
// with shared prefixes"): what the CPU engine's PagedKv tests (tests/models/test_batch.cpp)
// hold of its sessions, held of the CUDA engine's, on tiny kestrel-synth models.
//
//   - a paged session against a session with a cache of its own, on one model: a prompt in
//     prefill chunks (the second over a cache already written), teacher-forced decode steps
//     (the captured graphs), verify passes (captured, then replayed), a chained greedy run and
//     the NLL, across several block boundaries; f16 and 8-bit caches, both head dims, GQA,
//     Mistral's window;
//   - a prompt that maps another sequence's blocks against the same prompt run whole;
//   - a write into a shared block, which copies it first (on the device);
//   - forward_batch over paged sessions against the same rows over own-cache sessions;
//   - a full pool's refusal, from a write and from a chained run that reaches a new block.
//
// Tolerance. A paged and an own-cache session run the same kernels over the same values; only
// the rows they address differ (f16 prompts take attention_prefill_kv's f16 path, the same
// kernel as attention_prefill_f16's), so their logits agree to far better than 1e-3 relative,
// while a position read from the wrong row errs by order 1 on the rows that see it. A prefix
// mapped from another sequence's pass was computed in a pass of other rows (other GEMM
// shapes), so there the usual GPU tolerance (test_decoder_cuda.cpp) applies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"
#include "models/gpu/decoder.h"
#include "models/io/model_spec.h"
#include "models/registry.h"
#include "tests/support/compare.h"
#include "tests/support/gpu.h"
#include "tests/support/paged_scenarios.h"
#include "tests/support/synth_model.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

using Case = kestrel::test::ModelFormat;
using kestrel::test::rel_err;

constexpr double kSameKernels = 1e-3;  // paged vs own cache (see the top of the file)

int argmax_of(const std::vector<float>& v) {
  return (int)(std::max_element(v.begin(), v.end()) - v.begin());
}

std::vector<float> row_of(const std::vector<float>& all, int r, int vocab) {
  return std::vector<float>(all.begin() + (size_t)r * vocab, all.begin() + (size_t)(r + 1) * vocab);
}

std::vector<int> ids(int n, int vocab, int seed) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = (i * 37 + seed * 11 + 5) % vocab;
  return v;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const KvPoolFull& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not KvPoolFull: ") + e.what();
  }
  return "no error";
}

struct PagedCase {
  std::string name;
  int heads, kv_heads;  // tiny: hidden 256, so head_dim = 256 / heads
  std::string arch;     // "" (Llama) or "mistral" (window 32)
  KvCacheTypes kv;
};

class GpuKvPool : public ::testing::TestWithParam<PagedCase> {};

TEST_P(GpuKvPool, APagedSessionMatchesOneWithItsOwnCache) {
  KESTREL_REQUIRE_GPU();
  const PagedCase& p = GetParam();
  const Case f{"pool_" + p.name, "gptq", 4, 128, false, false, "gptq", p.heads, p.kv_heads};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/31, /*n_layers=*/2, p.arch);
  const ModelSpec spec = load_model_spec(dir.string());
  const ModelConfig& c = spec.config;
  const int ctx = 256, vocab = c.vocab, n_prompt = 75, steps = 40;

  DecoderCuda model(spec, /*quiet=*/true, {}, p.kv);
  model.set_prefill_chunk(64);  // the prompt as 64 + 11 rows
  auto own = model.new_cuda_session(ctx);  // before the pool: a cache of its own
  ASSERT_TRUE(model.use_kv_pool(40 * kKvBlock));
  auto paged = model.new_cuda_session(ctx);
  EXPECT_EQ(model.kv_pool_use().held, 0);
  // Another sequence holds the pool's first three blocks while the paged one writes its
  // prompt, and gives them back after: the paged session's table is no identity (its block 0 is
  // pool block 3 or later, and its later blocks reuse the freed ones), so a kernel that
  // ignored the table would read another row.
  auto filler = model.new_cuda_session(ctx);
  {
    const std::vector<int> other = ids(40, vocab, 9);
    std::vector<float> scratch(vocab);
    filler->forward(other.data(), 40, 0, scratch.data(), nullptr);
    ASSERT_EQ(model.kv_pool_use().held, 3);
  }

  // The prompt, every row's logits.
  const std::vector<int> prompt = ids(n_prompt, vocab, 1);
  std::vector<float> lo(vocab), lp(vocab), all_o((size_t)n_prompt * vocab),
      all_p((size_t)n_prompt * vocab);
  own->forward(prompt.data(), n_prompt, 0, lo.data(), all_o.data());
  paged->forward(prompt.data(), n_prompt, 0, lp.data(), all_p.data());
  filler.reset();  // blocks 0 and 1 cached, block 2 free: the next block the paged one takes
  for (int t = 0; t < n_prompt; ++t)
    ASSERT_LT(rel_err(row_of(all_p, t, vocab), row_of(all_o, t, vocab)), kSameKernels)
        << "prompt row " << t;

  // Teacher-forced decode steps over positions 75 .. 114 (blocks 4 to 7).
  std::vector<int> tokens = prompt;
  for (int i = 0; i < steps; ++i) {
    tokens.push_back(argmax_of(lo));
    const int pos = (int)tokens.size() - 1;
    own->forward(&tokens.back(), 1, pos, lo.data(), nullptr);
    paged->forward(&tokens.back(), 1, pos, lp.data(), nullptr);
    ASSERT_LT(rel_err(lp, lo), kSameKernels) << "decode step at " << pos;
  }

  // Verify passes of 12 rows: the first captures the session's graph, the second (3 positions
  // on, across a block boundary) replays it, reading the table the host uploaded. A decode
  // step after it attends over what the replay wrote.
  {
    const int pos = (int)tokens.size();
    std::vector<int> out_o(12), out_p(12);
    for (const int p0 : {pos, pos + 3}) {
      const std::vector<int> draft = ids(12, vocab, p0);
      own->forward_argmax_rows(draft.data(), 12, p0, out_o.data());
      paged->forward_argmax_rows(draft.data(), 12, p0, out_p.data());
      EXPECT_EQ(out_p, out_o) << "verify rows at " << p0;
    }
    const int next = out_o.back(), after = pos + 3 + 12;
    own->forward(&next, 1, after, lo.data(), nullptr);
    paged->forward(&next, 1, after, lp.data(), nullptr);
    EXPECT_LT(rel_err(lp, lo), kSameKernels) << "decode step after the replayed verify pass";
  }

  // Chained greedy runs from position 131 (right after the last written) over 40 steps
  // (blocks 8 to 10), `ahead` off every fifth token: each step's block taken before the step is
  // queued, the one ahead included.
  {
    const int pos0 = 131, first = tokens[10];
    std::vector<int> got_o, got_p;
    for (auto* s : {own.get(), paged.get()}) {
      std::vector<int>& got = s == own.get() ? got_o : got_p;
      std::unique_ptr<DecodeRun> run = s->greedy_run(first, pos0);
      for (int i = 0; i < steps; ++i) got.push_back(run->next(i % 5 != 4));
    }
    EXPECT_EQ(got_p, got_o) << "chained greedy run";
    // Then a step that reads every position the run wrote (the last handed-out token's step,
    // queued ahead, included).
    const int at = pos0 + steps;
    own->forward(&got_o.back(), 1, at, lo.data(), nullptr);
    paged->forward(&got_o.back(), 1, at, lp.data(), nullptr);
    EXPECT_LT(rel_err(lp, lo), kSameKernels) << "decode step after the chained run";
  }

  // NLL of a window rerun from position 0 (its rows rewrite the prompt's blocks).
  {
    const std::vector<int> window = ids(33, vocab, 2);
    std::vector<int> targets(window.begin() + 1, window.end());
    targets.push_back(-1);
    std::vector<double> no(33), np(33);
    own->forward_nll(window.data(), 33, 0, targets.data(), no.data());
    paged->forward_nll(window.data(), 33, 0, targets.data(), np.data());
    for (int i = 0; i < 33; ++i) EXPECT_NEAR(np[i], no[i], 1e-3 * (1 + no[i])) << "row " << i;
  }

  // The paged session holds the blocks up to the furthest position it wrote (172), and its
  // cache's bytes are theirs.
  const int held = (131 + steps + 1 + kKvBlock - 1) / kKvBlock;
  EXPECT_EQ(model.kv_pool_use().held, held);
  EXPECT_EQ(paged->cache_bytes(),
            (size_t)held * kKvBlock * cache_bytes_per_position(Device::Cuda, c, p.kv));
  paged.reset();
  EXPECT_EQ(model.kv_pool_use().held, 0);
  EXPECT_GT(model.kv_pool_use().cached, 0);  // its whole blocks stay for a later prompt
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Types, GpuKvPool,
    ::testing::Values(PagedCase{"hd64_gqa_f16", 4, 2, "", {}},
                      PagedCase{"hd64_gqa_q8_0", 4, 2, "", {KvType::Q8_0, KvType::Q8_0}},
                      PagedCase{"hd128_gqa_fp8", 2, 1, "", {KvType::Fp8, KvType::Fp8}},
                      PagedCase{"hd128_mha_f16", 2, 2, "", {}},
                      PagedCase{"hd64_window_f16", 4, 2, "mistral", {}},
                      PagedCase{"hd64_mha_q8k_fp8v", 4, 4, "", {KvType::Q8_0, KvType::Fp8}},
                      PagedCase{"hd128_window_q8_0", 2, 1, "mistral", {KvType::Q8_0, KvType::Q8_0}}),
    [](const auto& info) { return info.param.name; });

// A second sequence whose prompt begins as the first's maps the first's whole blocks instead of
// running them, and then generates what the same prompt run whole generates.
TEST(GpuKvPoolPrefix, APromptReusesAnotherSequencesBlocks) {
  KESTREL_REQUIRE_GPU();
  for (const KvCacheTypes kv : {KvCacheTypes{}, KvCacheTypes{KvType::Q8_0, KvType::Fp8}}) {
    SCOPED_TRACE(std::string("K ") + kv_type_name(kv.k) + ", V " + kv_type_name(kv.v));
    const Case f{"pool_prefix", "gptq", 4, 128, false, false, "gptq"};
    const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/32, /*n_layers=*/2);
    const ModelSpec spec = load_model_spec(dir.string());
    const int vocab = spec.config.vocab;
    DecoderCuda model(spec, /*quiet=*/true, {}, kv);
    auto alone = model.new_cuda_session(128);
    ASSERT_TRUE(model.use_kv_pool(64 * kKvBlock));
    const std::vector<int> header = ids(40, vocab, 3);  // a system prompt, say
    std::vector<int> prompt = header;
    for (int id : ids(9, vocab, 4)) prompt.push_back(id);

    const auto r = kestrel::test::prefix_reuse(model, *alone, header, prompt, 20);
    EXPECT_EQ(r.cached, std::vector<int>(header.begin(), header.begin() + 32));  // 2 whole blocks
    EXPECT_EQ(r.held, 3);  // first's 43 positions; second shares two blocks
    const double tol = kv.quantized() ? 3e-2 : 2e-2;
    for (size_t s = 0; s < r.want.size(); ++s) {
      EXPECT_LT(rel_err(r.got[s], r.want[s]), tol) << "step " << s;
      EXPECT_EQ(argmax_of(r.got[s]), argmax_of(r.want[s])) << "step " << s;
    }
    fs::remove_all(dir);
  }
}

// A sequence that writes into a block it shares (a rerun from inside the shared prefix) writes
// into a copy of all of it, made on the device: the other sequence's next step is what it was,
// bit for bit, and its own reads the block's other positions from the copy.
TEST(GpuKvPoolCopy, WritingASharedBlockWritesIntoAFullCopy) {
  KESTREL_REQUIRE_GPU();
  for (const KvCacheTypes kv : {KvCacheTypes{}, KvCacheTypes{KvType::Fp8, KvType::Q8_0}}) {
    SCOPED_TRACE(std::string("K ") + kv_type_name(kv.k) + ", V " + kv_type_name(kv.v));
    const Case f{"pool_cow", "fp16", 16, 0, false, false, "gptq"};
    const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/33, /*n_layers=*/2);
    const ModelSpec spec = load_model_spec(dir.string());
    const int vocab = spec.config.vocab;
    DecoderCuda model(spec, /*quiet=*/true, {}, kv);
    auto lone = model.new_session(128);
    ASSERT_TRUE(model.use_kv_pool(16 * kKvBlock));
    const auto r = kestrel::test::copy_on_write(model, *lone, ids(48, vocab, 5));
    EXPECT_EQ(r.cached, 48u);
    EXPECT_EQ(r.held_shared, 4);   // a's 49 positions; b shares its first three blocks
    EXPECT_EQ(r.held_written, 5);  // b's copy of block 1
    EXPECT_TRUE(r.a_unchanged);
    // b's copy holds the shared block's other positions (16 .. 19 before its write, 21 .. 31
    // after): a step at 21 attends over 16 .. 20 of it, as a lone session's does.
    EXPECT_LT(rel_err(r.b_step, r.lone_step), kv.quantized() ? 3e-2 : 2e-2);
    EXPECT_EQ(argmax_of(r.b_step), argmax_of(r.lone_step));
    fs::remove_all(dir);
  }
}

// Batched decode steps (forward_batch) over paged sessions, each at its own position across
// block boundaries, against the same rows over sessions with caches of their own: two rows (the
// GEMVs) and four (the fused small-M GEMM).
TEST(GpuKvPoolBatch, PagedRowsMatchOwnCacheRows) {
  KESTREL_REQUIRE_GPU();
  for (const KvCacheTypes kv : {KvCacheTypes{}, KvCacheTypes{KvType::Q8_0, KvType::Q8_0}}) {
    SCOPED_TRACE(std::string("K ") + kv_type_name(kv.k) + ", V " + kv_type_name(kv.v));
    const Case f{"pool_batch", "gptq", 4, 128, false, false, "gptq"};
    const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/34, /*n_layers=*/2);
    const ModelSpec spec = load_model_spec(dir.string());
    const int vocab = spec.config.vocab, n = 4;
    DecoderCuda model(spec, /*quiet=*/true, {}, kv);
    const int lengths[n] = {13, 30, 1, 47};
    std::vector<std::unique_ptr<DecoderCudaSession>> own, paged;
    for (int i = 0; i < n; ++i) own.push_back(model.new_cuda_session(128));
    ASSERT_TRUE(model.use_kv_pool(32 * kKvBlock));
    for (int i = 0; i < n; ++i) paged.push_back(model.new_cuda_session(128));
    std::vector<int> next(n), pos(n);
    std::vector<float> lo(vocab), lp(vocab);
    for (int i = 0; i < n; ++i) {
      const std::vector<int> prompt = ids(lengths[i], vocab, 10 + i);
      own[i]->forward(prompt.data(), lengths[i], 0, lo.data(), nullptr);
      paged[i]->forward(prompt.data(), lengths[i], 0, lp.data(), nullptr);
      ASSERT_LT(rel_err(lp, lo), kSameKernels) << "prompt of sequence " << i;
      next[i] = argmax_of(lo);
      pos[i] = lengths[i];
    }
    for (int step = 0; step < 20; ++step) {
      const int B = step < 10 ? 2 : n;  // sequences 0 and 1, then all four
      std::vector<BatchRow> ro, rp;
      for (int i = 0; i < B; ++i) {
        ro.push_back({own[i].get(), next[i], pos[i]});
        rp.push_back({paged[i].get(), next[i], pos[i]});
      }
      std::vector<float> bo((size_t)B * vocab), bp((size_t)B * vocab);
      model.forward_batch(ro, bo.data());
      model.forward_batch(rp, bp.data());
      for (int i = 0; i < B; ++i) {
        const std::vector<float> o = row_of(bo, i, vocab), pg = row_of(bp, i, vocab);
        EXPECT_LT(rel_err(pg, o), kSameKernels) << "step " << step << ", sequence " << i;
        next[i] = argmax_of(o);
        ++pos[i];
      }
    }
    int held = 0;
    for (int i = 0; i < n; ++i) held += (pos[i] + kKvBlock - 1) / kKvBlock;
    EXPECT_EQ(model.kv_pool_use().held, held);
    fs::remove_all(dir);
  }
}

// A pool with no block left refuses a write in the CPU engine's words, from a prompt and from a
// chained run whose next step starts a block (the run hands out every token it had a block for
// first); a finished sequence's blocks are taken back for the next.
TEST(GpuKvPoolFull, AFullPoolRefusesAWriteUntilASequenceEnds) {
  KESTREL_REQUIRE_GPU();
  const Case f{"pool_full", "fp16", 16, 0, false, false, "gptq"};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/35, /*n_layers=*/1);
  const ModelSpec spec = load_model_spec(dir.string());
  DecoderCuda model(spec, /*quiet=*/true);
  ASSERT_TRUE(model.use_kv_pool(4 * kKvBlock));
  const int vocab = spec.config.vocab;
  std::vector<float> logits(vocab);
  auto a = model.new_session(128);
  EXPECT_EQ(model.kv_pool_use().held, 0);  // the warm-up's blocks went back
  const std::vector<int> prompt = ids(60, vocab, 6);
  a->forward(prompt.data(), 60, 0, logits.data());
  auto b = model.new_session(128);
  const std::string full = "the KV cache pool is full: 4 blocks of 16 positions, all held";
  std::string why = error_of([&] { b->forward(prompt.data(), 1, 0, logits.data()); });
  EXPECT_NE(why.find(full), std::string::npos) << why;

  // a's run: positions 60 .. 63 fit its last block; the step at 64 finds none.
  {
    std::unique_ptr<DecodeRun> run = a->greedy_run(argmax_of(logits), 60);
    for (int i = 0; i < 4; ++i) EXPECT_GE(run->next(/*ahead=*/true), 0) << "step " << i;
    why = error_of([&] { run->next(true); });
    EXPECT_NE(why.find(full), std::string::npos) << why;
  }
  a.reset();
  EXPECT_EQ(model.kv_pool_use().cached, 4);  // a's four whole blocks stay for a later prompt
  b->forward(&prompt[59], 1, 0, logits.data());
  EXPECT_EQ(model.kv_pool_use().held, 1);
  EXPECT_EQ(model.kv_pool_use().cached, 3);  // the least recently used one taken back
  fs::remove_all(dir);
}

}  // namespace
