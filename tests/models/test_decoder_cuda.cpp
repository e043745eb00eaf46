// The whole GPU forward against the CPU reference engine, on kestrel-synth models of every
// weight format: logits close at every step, and identical greedy continuations.
//
// Tolerance: the GPU keeps activations, the residual stream and the KV cache in FP16 (11-bit
// significand, relative rounding 2^-11 ~ 4.9e-4 per store), accumulating in FP32. A tiny
// model stores each activation a handful of times per layer, so errors of a few 1e-3
// relative on the logits are expected; 2e-2 leaves margin while still catching any wrong
// index, group or zero, which produce errors of order 1. Greedy tokens must match exactly:
// kestrel-synth separates the top logit from the second by far more than that error.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "base/device.h"
#include "base/dtype.h"
#include "base/error.h"
#include "models/io/model_spec.h"
#include "models/cpu/decoder.h"
#include "models/gpu/decoder.h"
#include "models/registry.h"
#include "kernels/sampling/sample.h"
#include "tests/support/compare.h"
#include "tests/support/sample_check.h"
#include "tests/support/synth_model.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

using Case = kestrel::test::ModelFormat;
// The format the decode-run and memory tests load: 4-bit, group 128, symmetric.
const Case kQ4G128{"q4_g128", "gptq", 4, 128, false, false, "gptq"};

using kestrel::test::rel_err;

class GpuVsCpu : public ::testing::TestWithParam<Case> {};

int argmax_of(const std::vector<float>& v) {
  return (int)(std::max_element(v.begin(), v.end()) - v.begin());
}

// Row r of logits [rows, vocab].
std::vector<float> row_of(const std::vector<float>& all, int r, int vocab) {
  return std::vector<float>(all.begin() + (size_t)r * vocab, all.begin() + (size_t)(r + 1) * vocab);
}

// Teacher-forced decode steps: both engines see the CPU's greedy tokens, appended to `tokens`;
// lc and lg hold the last step's logits. Returns the largest relative logit error of the steps.
double teacher_forced_steps(Session& cpu, Session& gpu, std::vector<int>& tokens, int steps,
                            std::vector<float>& lc, std::vector<float>& lg) {
  double worst = 0;
  for (int i = 0; i < steps; ++i) {
    tokens.push_back(argmax_of(lc));
    const int pos = (int)tokens.size() - 1;
    cpu.forward(&tokens.back(), 1, pos, lc.data(), nullptr);
    gpu.forward(&tokens.back(), 1, pos, lg.data(), nullptr);
    worst = std::max(worst, rel_err(lg, lc));
  }
  return worst;
}

TEST_P(GpuVsCpu, LogitsAndGreedyTokensMatch) {
  KESTREL_REQUIRE_GPU();
  const Case& c = GetParam();
  const fs::path dir = kestrel::test::write_tiny_model(c, /*seed=*/11);

  const ModelSpec spec = load_model_spec(dir.string());
  const int ctx = 128, steps = 64;
  DecoderCpu cpu_model(spec);
  auto cpu = cpu_model.new_cpu_session(ctx);
  DecoderCuda gpu_model(spec, /*quiet=*/true);
  auto gpu = gpu_model.new_cuda_session(ctx);
  const int vocab = spec.config.vocab;
  // GPTQ weights stay quantized on the GPU, fused or not: about their files' size (FP16 rows
  // would take 1.6-4 times that).
  EXPECT_LT(gpu_model.weight_bytes(), spec.files.total_bytes() * 5 / 4);

  // Teacher-forced: both engines see the CPU's greedy tokens; logits compared at each step.
  std::vector<int> tokens = {1, 5, 9, 200, 31};
  std::vector<float> lc(vocab), lg(vocab);
  cpu->forward(tokens.data(), (int)tokens.size(), 0, lc.data(), nullptr);
  gpu->forward(tokens.data(), (int)tokens.size(), 0, lg.data(), nullptr);
  double worst = rel_err(lg, lc);
  const int n_prompt = (int)tokens.size();
  worst = std::max(worst, teacher_forced_steps(*cpu, *gpu, tokens, steps, lc, lg));
  EXPECT_LT(worst, 2e-2) << "largest relative logit error over " << steps << " steps";

  // Free-running greedy on the GPU's argmax path (a fresh pass over the same positions).
  std::vector<int> greedy(tokens.begin(), tokens.begin() + n_prompt);
  gpu->forward(greedy.data(), n_prompt, 0, lg.data(), nullptr);
  greedy.push_back(argmax_of(lg));
  for (int i = 1; i < steps; ++i)
    greedy.push_back(gpu->forward_argmax(greedy.back(), (int)greedy.size() - 1));
  for (int i = 0; i < steps; ++i) EXPECT_EQ(greedy[n_prompt + i], tokens[n_prompt + i]) << "step " << i;

  // The same through the steps chained on the device (DecodeRun), again over the same
  // positions. `ahead` is false every fifth token, so the run also restarts from an empty queue.
  std::vector<int> chained(greedy.begin(), greedy.begin() + n_prompt + 1);
  {
    std::unique_ptr<DecodeRun> run = gpu->greedy_run(chained.back(), (int)chained.size() - 1);
    for (int i = 1; i < steps; ++i) chained.push_back(run->next(i % 5 != 0));
  }
  for (int i = 0; i < steps; ++i)
    EXPECT_EQ(chained[n_prompt + i], tokens[n_prompt + i]) << "chained step " << i;
  fs::remove_all(dir);
}

// The decode step is captured once per range of positions ([0, 512), [512, 1024), [1024, ctx)
// here), each graph's attention grid sized for its range's end and with its own query heads per
// block (a KV group of 4 at head_dim 64: 2 per block up to 1,024 positions, 4 beyond). Steps on
// both sides of each range's end match the CPU reference, through the logits head and through
// a chained greedy run, which switches graphs as it goes. The same under every setting of the
// decode path's tuning (models/tuning.h), each knob both ways.
struct TuningCase {
  std::string name;
  DecodeTuning tuning;
};

class GpuDecodeGraphs : public ::testing::TestWithParam<TuningCase> {};

TEST_P(GpuDecodeGraphs, EachRangeOfPositionsMatchesTheCpu) {
  KESTREL_REQUIRE_GPU();
  const Case kv1{"q4_g128_kv1", "gptq", 4, 128, false, false, "gptq", 4, 1};
  const fs::path dir = kestrel::test::write_tiny_model(kv1, /*seed=*/17, /*n_layers=*/2);
  const ModelSpec spec = load_model_spec(dir.string());
  const int ctx = 1100, vocab = spec.config.vocab;
  DecoderCpu cpu_model(spec);
  auto cpu = cpu_model.new_cpu_session(ctx);
  DecoderCuda gpu_model(spec, /*quiet=*/true, GetParam().tuning);
  auto gpu = gpu_model.new_cuda_session(ctx);
  std::vector<float> lc(vocab), lg(vocab);
  std::vector<int> tokens;
  double worst = 0;
  // n tokens drawn at random from position tokens.size() on, as one prompt on both sides.
  auto prompt = [&](int n, unsigned seed) {
    std::vector<int> t(n);
    for (int i = 0; i < n; ++i) t[i] = (int)((seed + 7919u * (unsigned)i) % (unsigned)vocab);
    const int pos = (int)tokens.size();
    cpu->forward(t.data(), n, pos, lc.data(), nullptr);
    gpu->forward(t.data(), n, pos, lg.data(), nullptr);
    worst = std::max(worst, rel_err(lg, lc));
    tokens.insert(tokens.end(), t.begin(), t.end());
  };
  // Teacher-forced steps with the CPU's greedy tokens up to position `end`.
  auto steps_to = [&](int end) {
    while ((int)tokens.size() < end) {
      tokens.push_back(argmax_of(lc));
      const int pos = (int)tokens.size() - 1;
      cpu->forward(&tokens.back(), 1, pos, lc.data(), nullptr);
      gpu->forward(&tokens.back(), 1, pos, lg.data(), nullptr);
      worst = std::max(worst, rel_err(lg, lc));
    }
  };
  prompt(505, 3);
  steps_to(520);  // positions 505-519, across 512
  prompt(496, 5);  // 520-1015
  steps_to(1035);  // 1016-1034, across 1,024
  EXPECT_LT(worst, 2e-2) << "largest relative logit error";
  // tokens[p + 1] is the CPU's greedy token after position p, for p = 1015 .. 1033.
  std::unique_ptr<DecodeRun> run = gpu->greedy_run(tokens[1016], 1016);
  for (int pos = 1016; pos + 1 < 1035; ++pos)
    EXPECT_EQ(run->next(true), tokens[pos + 1]) << "chained step at position " << pos;
  run.reset();
  fs::remove_all(dir);
}

DecodeTuning tuned(void (*set)(DecodeTuning&)) {
  DecodeTuning t;
  set(t);
  return t;
}

INSTANTIATE_TEST_SUITE_P(
    Tuning, GpuDecodeGraphs,
    ::testing::Values(
        TuningCase{"defaults", {}},
        TuningCase{"att_heads_1", tuned([](DecodeTuning& t) { t.attention_heads_per_block = 1; })},
        TuningCase{"att_heads_2", tuned([](DecodeTuning& t) { t.attention_heads_per_block = 2; })},
        TuningCase{"att_heads_4", tuned([](DecodeTuning& t) { t.attention_heads_per_block = 4; })},
        TuningCase{"gemv_warps_8", tuned([](DecodeTuning& t) { t.gemv_block_warps = 8; })},
        TuningCase{"gemv_warps_16", tuned([](DecodeTuning& t) { t.gemv_block_warps = 16; })},
        TuningCase{"gemv_generic", tuned([](DecodeTuning& t) { t.gemv_specialized = false; })},
        TuningCase{"one_graph_range", tuned([](DecodeTuning& t) { t.graph_ranges = false; })}),
    [](const ::testing::TestParamInfo<TuningCase>& i) { return i.param.name; });

// One loaded model serves several sequences: two sessions with their own KV caches, stepped in
// turns, each continue exactly as the CPU reference does for its own sequence; a session
// opened after others were closed decodes as well. (Device memory is not compared here: under
// ctest -j other processes allocate at the same time.)
TEST(GpuSessions, SessionsOfOneModelTakeTurns) {
  KESTREL_REQUIRE_GPU();
  const fs::path dir = kestrel::test::write_tiny_model(kQ4G128, /*seed=*/23);
  const ModelSpec spec = load_model_spec(dir.string());
  const int ctx = 96, vocab = spec.config.vocab, steps = 24;
  DecoderCpu cpu_model(spec);
  DecoderCuda gpu_model(spec, /*quiet=*/true);
  const std::vector<std::vector<int>> prompts = {{1, 5, 9, 200, 31}, {1, 77, 3, 41}};
  // The CPU's greedy continuation of each prompt, each in a session of its own.
  std::vector<std::vector<int>> want;
  for (const auto& p : prompts) {
    auto cpu = cpu_model.new_cpu_session(ctx);
    std::vector<float> l(vocab);
    cpu->forward(p.data(), (int)p.size(), 0, l.data(), nullptr);
    std::vector<int> t = p;
    for (int i = 0; i < steps; ++i) {
      t.push_back(argmax_of(l));
      cpu->forward(&t.back(), 1, (int)t.size() - 1, l.data(), nullptr);
    }
    want.push_back(t);
  }
  {
    auto a = gpu_model.new_cuda_session(ctx), b = gpu_model.new_cuda_session(ctx);
    EXPECT_EQ(a->cache_bytes(), b->cache_bytes());
    std::vector<Session*> s = {a.get(), b.get()};
    std::vector<std::vector<int>> got = prompts;
    std::vector<float> l(vocab);
    for (int k = 0; k < 2; ++k) {
      s[k]->forward(got[k].data(), (int)got[k].size(), 0, l.data(), nullptr);
      got[k].push_back(argmax_of(l));
    }
    for (int i = 1; i < steps; ++i)
      for (int k = 0; k < 2; ++k)  // alternate: each step of one between steps of the other
        got[k].push_back(s[k]->forward_argmax(got[k].back(), (int)got[k].size() - 1));
    for (int k = 0; k < 2; ++k)
      EXPECT_EQ(got[k], want[k]) << "session " << k;
  }
  {
    // A new session over the same model, with its decode run chained on the device.
    auto c = gpu_model.new_cuda_session(ctx);
    std::vector<float> l(vocab);
    const auto& p = prompts[1];
    c->forward(p.data(), (int)p.size(), 0, l.data(), nullptr);
    std::vector<int> got = p;
    got.push_back(argmax_of(l));
    std::unique_ptr<DecodeRun> run = c->greedy_run(got.back(), (int)got.size() - 1);
    for (int i = 1; i < steps; ++i) got.push_back(run->next(true));
    run.reset();
    EXPECT_EQ(got, want[1]);
  }
  fs::remove_all(dir);
}

// A chained run never queues a step past the context: asked to run ahead at the last position
// it does not, and asked for a token past the context it says so.
TEST(GpuDecodeRun, StopsAtTheContext) {
  KESTREL_REQUIRE_GPU();
  const fs::path dir = kestrel::test::write_tiny_model(kQ4G128, 5);
  const ModelSpec spec = load_model_spec(dir.string());
  const int ctx = 16;
  DecoderCuda gpu_model(spec, /*quiet=*/true);
  auto gpu = gpu_model.new_cuda_session(ctx);
  std::vector<int> ref = {3};
  for (int pos = 0; pos < ctx; ++pos) ref.push_back(gpu->forward_argmax(ref.back(), pos));
  {
    std::unique_ptr<DecodeRun> run = gpu->greedy_run(ref[10], 10);
    for (int pos = 10; pos < ctx; ++pos)
      EXPECT_EQ(run->next(true), ref[pos + 1]) << "position " << pos;
    try {
      run->next(true);
      ADD_FAILURE() << "a token past the context was handed out";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("past the context of 16"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(gpu->greedy_run(ref[0], ctx), Error);
  // The model is still usable after the refused step.
  EXPECT_EQ(gpu->forward_argmax(ref[4], 4), ref[5]);
  fs::remove_all(dir);
}

// A sampled run draws each token on the device from that step's logits: replaying the tokens
// through forward() (the same kernels, so the same logits) and drawing with the CPU oracle and
// the same random numbers gives the same tokens (a neighbour only where u falls within 1e-6 of
// a boundary of the cumulative distribution). One seed gives one sequence; another seed
// another.
TEST(GpuDecodeRun, SampledRunDrawsFromEachStepsLogits) {
  KESTREL_REQUIRE_GPU();
  const fs::path dir = kestrel::test::write_tiny_model(kQ4G128, 6);
  const ModelSpec spec = load_model_spec(dir.string());
  DecoderCuda gpu_model(spec, /*quiet=*/true);
  auto gpu = gpu_model.new_cuda_session(48);
  const int vocab = gpu->config().vocab;
  TopKSampling s;
  s.top_k = 12, s.top_p = 0.9f, s.min_p = 0.02f, s.temperature = 1.3f, s.seed = 42;
  auto draw = [&](uint64_t seed) {
    TopKSampling t = s;
    t.seed = seed;
    std::unique_ptr<DecodeRun> run = gpu->sampled_run(3, 0, t);
    EXPECT_NE(run, nullptr);
    std::vector<int> out;
    for (int i = 0; i < 40; ++i) out.push_back(run->next(i % 5 != 4));
    return out;
  };
  const std::vector<int> a = draw(42), b = draw(42), c = draw(43);
  EXPECT_EQ(a, b) << "one seed, one sequence";
  EXPECT_NE(a, c) << "another seed, another sequence";
  std::vector<float> logits(vocab);
  std::vector<uint16_t> h(vocab);
  int prev = 3;
  for (int i = 0; i < (int)a.size(); ++i) {
    gpu->forward(&prev, 1, i, logits.data(), nullptr);
    for (int v = 0; v < vocab; ++v) h[v] = float_to_half(logits[v]);
    const std::vector<TopKCandidate> cand = top_k_candidates_ref(h.data(), vocab, s);
    ASSERT_TRUE(test::drawn_by(cand, a[i], philox_uniform(42, i))) << "step " << i;
    prev = a[i];
  }
  // What the device's sampler does not cover is left to the host.
  TopKSampling wide = s;
  wide.top_k = kDeviceTopKMax + 1;
  EXPECT_EQ(gpu->sampled_run(3, 0, wide), nullptr);
  fs::remove_all(dir);
}

// Short GPU memory, made by this process holding all but `leave` bytes of what is free: the
// load refuses with one line (no crash) when the 256 MiB kept for scratch and a KV cache do not
// fit, and shortens the context when only the cache is short; then the model still decodes.
TEST(GpuMemory, ShortMemoryRefusesOrShortensTheContext) {
  KESTREL_REQUIRE_GPU();
  const fs::path dir = kestrel::test::write_tiny_model(kQ4G128, 7);
  const ModelSpec spec = load_model_spec(dir.string());
  {
    DecoderCuda probe_model(spec, /*quiet=*/true);
    auto probe = probe_model.new_cuda_session(16);  // the CUDA context and modules exist from here
  }
  const size_t per_pos = 2ull * spec.config.n_layers * spec.config.kv_dim() * 2;
  struct Hold {
    std::vector<void*> blocks;
    explicit Hold(size_t leave) {
      size_t free_b = 0, total = 0;
      cudaMemGetInfo(&free_b, &total);
      for (const size_t block : {64ull << 20, 2ull << 20})  // 64 MiB blocks, then 2 MiB ones
        while (free_b > leave + block) {
          void* p = nullptr;
          if (cudaMalloc(&p, block) != cudaSuccess) break;
          blocks.push_back(p);
          cudaMemGetInfo(&free_b, &total);
        }
      cudaGetLastError();
    }
    ~Hold() {
      for (void* p : blocks) cudaFree(p);
    }
  };
  {
    Hold hold(64ull << 20);  // less than the scratch kept free
    try {
      DecoderCuda gpu_model(spec, /*quiet=*/true);
      auto gpu = gpu_model.new_cuda_session(2048);
      ADD_FAILURE() << "loaded with 64 MiB free";
    } catch (const DeviceError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("out of GPU memory"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
    }
  }
  {
    // The weights (about their files' size), the scratch kept free and a few thousand positions.
    Hold hold(spec.files.total_bytes() * 5 / 4 + (256ull << 20) + 1024 * per_pos + (16ull << 20));
    DecoderCuda gpu_model(spec, /*quiet=*/true);
    auto gpu = gpu_model.new_cuda_session(1 << 20);  // asks for far more than fits
    EXPECT_GT(gpu->context_length(), 16);
    EXPECT_LT(gpu->context_length(), 1 << 20);
    std::vector<float> logits(spec.config.vocab);
    const int tok = 3;
    gpu->forward(&tok, 1, 0, logits.data(), nullptr);
    for (float v : logits) ASSERT_TRUE(std::isfinite(v));
  }
  fs::remove_all(dir);
}

// A GPTQModel `dynamic` model as the GPU loads it: siblings of one input (q, k, v; gate, up)
// fused where their formats agree and run as parts in their own formats where not, each
// linear quantized in its own bits and groups (or FP16 where a "-:" rule says so), the act-order
// plans taken per layer where the weights allow them, and every linear's device bytes about
// its checkpoint tensors' bytes (a linear placed in another format, or dequantized to FP16,
// would take a multiple or a fraction of them).
TEST(GpuDynamic, FusesLikeWithLikeAndPlacesEachLinearInItsOwnFormat) {
  KESTREL_REQUIRE_GPU();
  auto file_bytes = [](std::initializer_list<const LinearSpec*> ls) {
    double b = 0;
    for (const LinearSpec* l : ls)
      for (const TensorInfo* t : {l->weight, l->qweight, l->qzeros, l->scales, l->g_idx})
        if (t) b += (double)t->nbytes;
    return b;
  };
  // Every linear of every layer: its bytes against its checkpoint's (the GEMV layout pads
  // groups to 8 scales a row and drops uniform zero points: within 0.75 .. 1.35 of them).
  auto check_bytes = [&](const ModelSpec& spec, const GpuWeights& w, const std::string& name) {
    for (size_t l = 0; l < w.layers.size(); ++l) {
      const GpuLayer& g = w.layers[l];
      const LayerSpec& s = spec.layers[l];
      const std::pair<const GpuLinear*, double> lins[] = {
          {&g.qkv, file_bytes({&s.q, &s.k, &s.v})}, {&g.o, file_bytes({&s.o})},
          {&g.gate_up, file_bytes({&s.gate, &s.up})}, {&g.down, file_bytes({&s.down})}};
      for (const auto& [lin, want] : lins) {
        EXPECT_GT(lin->bytes, 0.75 * want) << name << " layer " << l << " N=" << lin->N;
        EXPECT_LT(lin->bytes, 1.35 * want) << name << " layer " << l << " N=" << lin->N;
      }
    }
  };
  auto load = [](const Case& c, std::unique_ptr<DecoderCuda>& m) {
    ModelSpec spec = load_model_spec(kestrel::test::write_tiny_model(c, 11).string());
    m = std::make_unique<DecoderCuda>(spec, /*quiet=*/true);
    EXPECT_LE(m->weight_bytes(), gpu_weights_bound(spec)) << c.name;
    return spec;
  };
  std::unique_ptr<DecoderCuda> m;
  {
    // q, k 8-bit per row beside v 4-bit g32 act-order (layer 0); layer 1's attention 3-bit g64;
    // every gate 2-bit g128 act-order beside its up; layer 1's down FP16.
    const ModelSpec spec = load(kestrel::test::dynamic_mixed(), m);
    const GpuWeights& w = m->weights();
    ASSERT_EQ(w.layers.size(), 4u);
    const GpuLinear& qkv0 = w.layers[0].qkv;
    ASSERT_EQ(qkv0.parts.size(), 3u);
    EXPECT_EQ(qkv0.parts[0].q.bits, 8);
    EXPECT_EQ(qkv0.parts[0].q.group_size, 0);
    EXPECT_EQ(qkv0.parts[1].q.bits, 8);
    EXPECT_EQ(qkv0.parts[2].q.bits, 4);
    EXPECT_EQ(qkv0.parts[2].q.group_size, 32);
    EXPECT_TRUE(qkv0.parts[2].q.has_perm);
    for (size_t l = 1; l < 4; ++l) {
      const GpuLinear& qkv = w.layers[l].qkv;
      EXPECT_TRUE(qkv.quantized && qkv.parts.empty()) << "layer " << l << ": q|k|v agree";
      EXPECT_EQ(qkv.q.bits, l == 1 ? 3 : 4) << "layer " << l;
      EXPECT_EQ(qkv.q.has_perm, l != 1) << "layer " << l;
    }
    for (size_t l = 0; l < 4; ++l) {
      const GpuLayer& g = w.layers[l];
      ASSERT_EQ(g.gate_up.parts.size(), 2u) << "layer " << l;
      EXPECT_EQ(g.gate_up.parts[0].q.bits, 2);
      EXPECT_EQ(g.gate_up.parts[0].q.group_size, 128);
      EXPECT_EQ(g.gate_up.parts[1].q.bits, 4);
      EXPECT_EQ(g.down.quantized, l != 1) << "layer " << l;
      EXPECT_EQ(g.down.dense != nullptr, l == 1) << "layer " << l;
      EXPECT_EQ(g.down_x_index, nullptr) << "an unfused gate|up has no SiLU epilogue to permute";
      EXPECT_FALSE(g.order.on) << "unfused layers keep the residual stream in natural order";
    }
    EXPECT_EQ(w.embed_perm, nullptr);
    check_bytes(spec, w, "dynamic_mixed");
  }
  {
    // 4-bit g128 act-order but layer 1 (8-bit g64, no act-order) and layer 3 (3-bit g32
    // act-order); layer 2's o FP16. Everything fuses; the stream plan is off (layer 1 has no
    // permutation), down's input order is each act-order layer's own.
    const ModelSpec spec = load(kestrel::test::dynamic_fused(), m);
    const GpuWeights& w = m->weights();
    const int bits[] = {4, 8, 4, 3}, group[] = {128, 64, 128, 32};
    for (size_t l = 0; l < 4; ++l) {
      const GpuLayer& g = w.layers[l];
      for (const GpuLinear* lin : {&g.qkv, &g.gate_up, &g.down}) {
        ASSERT_TRUE(lin->quantized && lin->parts.empty()) << "layer " << l << " N=" << lin->N;
        EXPECT_EQ(lin->q.bits, bits[l]) << "layer " << l;
        EXPECT_EQ(lin->q.group_size, group[l]) << "layer " << l;
        EXPECT_EQ(lin->q.has_perm, l != 1) << "layer " << l;
      }
      EXPECT_EQ(g.o.quantized, l != 2) << "layer " << l;
      EXPECT_EQ(g.down_x_index != nullptr, l != 1) << "layer " << l;
      EXPECT_FALSE(g.order.on) << "layer " << l;
    }
    check_bytes(spec, w, "dynamic_fused");
  }
  {
    // Every linear act-order and fused, in a format per layer (per block in layer 2): the
    // residual stream is kept in each next GEMV's permutation across the formats.
    const ModelSpec spec = load(kestrel::test::dynamic_act_stream(), m);
    const GpuWeights& w = m->weights();
    const int qkv_bits[] = {4, 3, 4, 3}, mlp_bits[] = {4, 3, 8, 3};
    for (size_t l = 0; l < 4; ++l) {
      const GpuLayer& g = w.layers[l];
      EXPECT_EQ(g.qkv.q.bits, qkv_bits[l]) << "layer " << l;
      EXPECT_EQ(g.gate_up.q.bits, mlp_bits[l]) << "layer " << l;
      EXPECT_EQ(g.down.q.bits, mlp_bits[l]) << "layer " << l;
      EXPECT_TRUE(g.order.on) << "layer " << l;
      EXPECT_NE(g.down_x_index, nullptr) << "layer " << l;
    }
    EXPECT_NE(w.embed_perm, nullptr);
    check_bytes(spec, w, "dynamic_act_stream");
  }
  m.reset();
}

INSTANTIATE_TEST_SUITE_P(
    Formats, GpuVsCpu,
    ::testing::Values(Case{"fp16", "fp16", 16, 0, false, false, "gptq"},
                      Case{"q4_g128", "gptq", 4, 128, false, false, "gptq"},
                      Case{"q4_g128_act", "gptq", 4, 128, true, false, "gptq"},
                      Case{"q4_g32_asym_v2", "gptq", 4, 32, false, true, "gptq_v2"},
                      Case{"q3_g128_act", "gptq", 3, 128, true, false, "gptq"},
                      // q, k, v and gate, up not fusable: run as quantized parts
                      Case{"q4_g128_act_unfused", "gptq", 4, 128, true, false, "gptq", 4, 2, true},
                      Case{"q2_g64", "gptq", 2, 64, false, false, "gptq"},
                      Case{"q8_perchannel", "gptq", 8, -1, false, false, "gptq"},
                      Case{"q4_g128_hd128", "gptq", 4, 128, false, false, "gptq", 2, 1},
                      // GPTQModel `dynamic` models: each linear in its own format
                      // (tests/support/synth_model.h says which)
                      kestrel::test::dynamic_mixed(), kestrel::test::dynamic_fused(),
                      kestrel::test::dynamic_act_stream(), kestrel::test::dynamic_v2_asym()),
    [](const auto& info) { return info.param.name; });

// ---- The 8-bit KV cache (-ctk / -ctv q8_0 | fp8) -------------------------------------------------
//
// The GPU engine with a cache type against the CPU engine with the same type (the reference:
// kernels/attention/kv_quant.h's rounding when a position is written, fp32 reads), on tiny
// models of both head dims, GQA and Mistral's window of 32, two layers: a prompt of 150 rows in
// prefill chunks of 64 (each chunk's attention over a cache already written), every row's
// logits; teacher-forced decode steps (the captured graphs, position on the device); verify
// passes of 12 rows, the first run as it is captured and the second replayed from its graph,
// then a decode step over what the replay wrote; a free-running greedy run, step by step and
// chained on the device; and the prompt token by token against the chunked prefill on the GPU
// itself. An act-order model also has attention store its output in o's permutation.
//
// Tolerance: as GpuVsCpu, plus the cache's rounding taken from fp16 K/V on the GPU and from
// fp32 on the CPU: a value within fp16's rounding of a code boundary can take the neighbouring
// code (1/127 of its block's amax in q8_0, 1/16 of itself in fp8) on one engine. Such values
// are rare and diluted over a head's 64-128 dims; 3e-2 on the logits leaves margin while a
// misread code, scale or row still errs by order 1. Greedy tokens must match exactly.
struct KvModelCase {
  std::string name;
  int heads, kv_heads;  // tiny: hidden 256, so head_dim = 256 / heads
  std::string arch;     // "" (Llama) or "mistral" (window 32)
  KvCacheTypes kv;
  // GPTQ act-order weights: the decode step keeps the residual stream in the GEMVs'
  // permutations, and the 8-bit attention kernel stores through o's (its out_index).
  bool act_order = false;
};

class GpuKvCache : public ::testing::TestWithParam<KvModelCase> {};

TEST_P(GpuKvCache, PromptStepsVerifyAndGreedyMatchTheCpuWithTheSameCache) {
  KESTREL_REQUIRE_GPU();
  const KvModelCase& p = GetParam();
  const Case f{"kv8_" + p.name, "gptq", 4, 128, p.act_order, false, "gptq", p.heads, p.kv_heads};
  const fs::path dir = kestrel::test::write_tiny_model(f, /*seed=*/23, /*n_layers=*/2, p.arch);
  const ModelSpec spec = load_model_spec(dir.string());
  const ModelConfig& c = spec.config;
  ASSERT_EQ(c.head_dim, 256 / p.heads);
  ASSERT_EQ(c.sliding_window, p.arch == "mistral" ? 32 : 0);
  const int ctx = 256, vocab = c.vocab, n_prompt = 150, steps = 32;
  constexpr double kTol = 3e-2;

  DecoderCpu cpu_model(spec, p.kv);
  DecoderCuda gpu_model(spec, /*quiet=*/true, {}, p.kv);
  gpu_model.set_prefill_chunk(64);
  EXPECT_EQ(gpu_model.cache_types(), p.kv);
  if (p.act_order) {  // else the case would not reach attention's permuted store
    for (const GpuLayer& L : gpu_model.weights().layers) ASSERT_NE(L.order.att_out, nullptr);
  }
  auto cpu = cpu_model.new_cpu_session(ctx);
  auto gpu = gpu_model.new_cuda_session(ctx);
  // The cache's bytes in its types: what `bench -o json` reports as gpu_cache_bytes.
  EXPECT_EQ(gpu->cache_bytes(), cache_bytes_per_position(Device::Cuda, c, p.kv) * ctx);

  std::vector<int> tokens(n_prompt);
  for (int i = 0; i < n_prompt; ++i) tokens[i] = (i * 37 + 5) % vocab;
  std::vector<float> lc(vocab), lg(vocab), all_c((size_t)n_prompt * vocab),
      all_g((size_t)n_prompt * vocab);
  cpu->forward(tokens.data(), n_prompt, 0, lc.data(), all_c.data());
  gpu->forward(tokens.data(), n_prompt, 0, lg.data(), all_g.data());
  double worst = 0;
  for (int t = 0; t < n_prompt; ++t) {
    worst = std::max(worst, rel_err(row_of(all_g, t, vocab), row_of(all_c, t, vocab)));
  }
  EXPECT_LT(worst, kTol) << "largest relative logit error over the prompt's rows";
  const std::vector<float> prompt_last = lg;

  // Teacher-forced decode steps: both engines see the CPU's greedy tokens.
  worst = teacher_forced_steps(*cpu, *gpu, tokens, steps, lc, lg);
  EXPECT_LT(worst, kTol) << "largest relative logit error over " << steps << " steps";

  // Verify passes of 12 rows after them: each row's greedy successor, CPU and GPU. The first
  // pass of a row count runs from the host and captures the session's verify graph; the
  // second, 3 positions on, replays it, which reads its position from device memory. The rows'
  // argmax alone may not move when the replay writes K/V at the wrong position, so a decode
  // step after the second pass, attending over what it wrote, is compared by its logits.
  {
    const int pos = (int)tokens.size();
    std::vector<int> out_c(12), out_g(12);
    for (const int p0 : {pos, pos + 3}) {
      std::vector<int> draft(12);
      for (int i = 0; i < 12; ++i) draft[i] = (i * 11 + 3 + 7 * (p0 - pos)) % vocab;
      cpu->forward_argmax_rows(draft.data(), 12, p0, out_c.data());
      gpu->forward_argmax_rows(draft.data(), 12, p0, out_g.data());
      EXPECT_EQ(out_g, out_c) << "verify rows at " << p0 << (p0 == pos ? " (captured)" : " (replayed)");
    }
    const int next = out_c.back(), after = pos + 3 + 12;
    cpu->forward(&next, 1, after, lc.data(), nullptr);
    gpu->forward(&next, 1, after, lg.data(), nullptr);
    EXPECT_LT(rel_err(lg, lc), kTol) << "decode step after the replayed verify pass";
  }

  // Free-running greedy on the GPU over the same positions (the prompt again, then argmax steps
  // through the decode graphs): the CPU's tokens.
  std::vector<int> greedy(tokens.begin(), tokens.begin() + n_prompt);
  gpu->forward(greedy.data(), n_prompt, 0, lg.data(), nullptr);
  greedy.push_back(argmax_of(lg));
  for (int i = 1; i < steps; ++i)
    greedy.push_back(gpu->forward_argmax(greedy.back(), (int)greedy.size() - 1));
  for (int i = 0; i < steps; ++i)
    EXPECT_EQ(greedy[n_prompt + i], tokens[n_prompt + i]) << "greedy step " << i;

  // The same steps chained on the device (greedy_run), again over the same positions from the
  // CPU's first token: the argmax kernel advances the position, which the next step's 8-bit
  // write and attention read. `ahead` is false every fifth token, so the run also restarts
  // from an empty queue.
  std::vector<int> chained(tokens.begin(), tokens.begin() + n_prompt + 1);
  {
    std::unique_ptr<DecodeRun> run = gpu->greedy_run(chained.back(), (int)chained.size() - 1);
    for (int i = 1; i < steps; ++i) chained.push_back(run->next(i % 5 != 0));
  }
  for (int i = 0; i < steps; ++i)
    EXPECT_EQ(chained[n_prompt + i], tokens[n_prompt + i]) << "chained step " << i;

  // The prompt token by token (decode steps, each writing and reading the 8-bit cache) against
  // the chunked prefill's last row, on a second GPU session.
  auto steps_session = gpu_model.new_cuda_session(ctx);
  for (int i = 0; i < n_prompt; ++i) steps_session->forward(&tokens[i], 1, i, lg.data(), nullptr);
  EXPECT_LT(rel_err(lg, prompt_last), kTol) << "token by token vs chunked prefill";
  EXPECT_EQ(argmax_of(lg), argmax_of(prompt_last));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Types, GpuKvCache,
    ::testing::Values(KvModelCase{"hd64_gqa_q8_0", 4, 2, "", {KvType::Q8_0, KvType::Q8_0}},
                      KvModelCase{"hd64_gqa_fp8", 4, 2, "", {KvType::Fp8, KvType::Fp8}},
                      KvModelCase{"hd128_gqa_q8_0", 2, 1, "", {KvType::Q8_0, KvType::Q8_0}},
                      KvModelCase{"hd128_gqa_fp8", 2, 1, "", {KvType::Fp8, KvType::Fp8}},
                      KvModelCase{"hd64_mha_q8k_fp8v", 4, 4, "", {KvType::Q8_0, KvType::Fp8}},
                      KvModelCase{"hd128_f16k_q8v", 2, 2, "", {KvType::F16, KvType::Q8_0}},
                      KvModelCase{"hd64_window_q8_0", 4, 2, "mistral", {KvType::Q8_0, KvType::Q8_0}},
                      KvModelCase{"hd128_window_fp8", 2, 1, "mistral", {KvType::Fp8, KvType::Fp8}},
                      KvModelCase{"hd64_gqa_act_q8_0", 4, 2, "", {KvType::Q8_0, KvType::Q8_0}, true},
                      KvModelCase{"hd128_act_fp8k_q8v", 2, 1, "", {KvType::Fp8, KvType::Q8_0}, true}),
    [](const auto& info) { return info.param.name; });

// ---- The batched decode step (Model::forward_batch) ---------------------------------------------
//
// Six sequences with prompts and contexts of their own lengths step together, joining and leaving so that
// the batch holds 1 to 6 rows (one row: the session's own decode step; two: the rows' GEMVs;
// three and more: the fused small-M GEMM), each at its own position over its own cache. Each
// row's logits against the CPU engine's forward_batch of the same rows (which test_batch holds
// bit for bit to the CPU's one-token steps), teacher-forced with the CPU's greedy tokens.
// Tolerance as GpuVsCpu (as GpuKvCache with an 8-bit cache).
//
// The batch runs in chunks of the prefill scratch's rows, which the first session's context
// (64) sizes to one chunk for every width here; a prefill chunk of 4 makes 6 rows run as 4 + 2
// and 5 as 4 + 1 (a chunk of one row through the batched layers). Without the small-M GEMM
// (small_gemm_max_rows 0) 3 to 5 rows run GEMVs and 6 rows dequantize for cuBLASLt.
struct BatchCase {
  Case format;            // its name is the case's
  std::string arch = "";  // "" (Llama), "mistral" (window 32), "opt", "qwen2" (q/k/v biases)
                          // or "qwen3" (q/k head norms)
  KvCacheTypes kv = {};
  DecodeTuning tuning = {};
  int prefill_chunk = 0;  // tokens per prefill chunk, set before the first session; 0: the default
  // Sequence 2 with a context of 1,100 and a prompt of 1,030 (else 200 and 40): a batched row's
  // grid covers its session's graph range of its position, here 1,024-1,100, past 1,024
  // positions, which gives the grid the long pass and twice the query heads per block (where
  // the KV group has them) over many of its chunks.
  bool long_context = false;
};

class GpuBatch : public ::testing::TestWithParam<BatchCase> {};

TEST_P(GpuBatch, RowsMatchTheCpuBatchAtTheirOwnPositions) {
  KESTREL_REQUIRE_GPU();
  const BatchCase& p = GetParam();
  const fs::path dir = kestrel::test::write_tiny_model(p.format, /*seed=*/29, /*n_layers=*/2, p.arch);
  const ModelSpec spec = load_model_spec(dir.string());
  const int vocab = spec.config.vocab, n = 6;
  int ctxs[n] = {64, 96, 200, 96, 64, 128};  // each session's own cache and workspace
  int lengths[n] = {5, 1, 40, 9, 2, 17};
  if (p.long_context) ctxs[2] = 1100, lengths[2] = 1030;
  const double tol = p.kv.quantized() ? 3e-2 : 2e-2;
  DecoderCpu cpu_model(spec, p.kv);
  DecoderCuda gpu_model(spec, /*quiet=*/true, p.tuning, p.kv);
  if (p.prefill_chunk > 0) gpu_model.set_prefill_chunk(p.prefill_chunk);
  const int joins[n] = {0, 0, 1, 2, 3, 3};
  // After this many steps of the batch: widths 2, 3, 4, 6, 5, 4, 3, then sequence 0 alone.
  const int leaves[n] = {16, 4, 12, 14, 8, 14};
  std::vector<std::unique_ptr<DecoderCpuSession>> cs;
  std::vector<std::unique_ptr<DecoderCudaSession>> gs;
  std::vector<int> next(n), pos(n);
  std::vector<float> lc(vocab), lg(vocab);
  double worst = 0;
  for (int i = 0; i < n; ++i) {
    std::vector<int> prompt(lengths[i]);
    for (int k = 0; k < lengths[i]; ++k) prompt[k] = (k * 31 + i * 7 + 3) % vocab;
    cs.push_back(cpu_model.new_cpu_session(ctxs[i]));
    gs.push_back(gpu_model.new_cuda_session(ctxs[i]));
    cs[i]->forward(prompt.data(), lengths[i], 0, lc.data(), nullptr);
    gs[i]->forward(prompt.data(), lengths[i], 0, lg.data(), nullptr);
    worst = std::max(worst, rel_err(lg, lc));
    next[i] = argmax_of(lc);
    pos[i] = lengths[i];
  }
  std::vector<int> widths_seen(n + 1, 0);
  for (int step = 0; step < 16; ++step) {
    std::vector<BatchRow> crow, grow;
    std::vector<int> who;
    for (int i = 0; i < n; ++i)
      if (step >= joins[i] && step < leaves[i]) {
        crow.push_back({cs[i].get(), next[i], pos[i]});
        grow.push_back({gs[i].get(), next[i], pos[i]});
        who.push_back(i);
      }
    const int B = (int)who.size();
    ASSERT_GT(B, 0);
    widths_seen[B] = 1;
    std::vector<float> bc((size_t)B * vocab), bg((size_t)B * vocab);
    cpu_model.forward_batch(crow, bc.data());
    gpu_model.forward_batch(grow, bg.data());
    for (int r = 0; r < B; ++r) {
      const std::vector<float> rc = row_of(bc, r, vocab), rg = row_of(bg, r, vocab);
      const double e = rel_err(rg, rc);
      EXPECT_LT(e, tol) << "step " << step << ", sequence " << who[r] << " at " << pos[who[r]];
      worst = std::max(worst, e);
      EXPECT_EQ(argmax_of(rg), argmax_of(rc)) << "step " << step << ", sequence " << who[r];
      next[who[r]] = argmax_of(rc);
      ++pos[who[r]];
    }
  }
  for (int B : {1, 2, 3, 5, 6}) EXPECT_TRUE(widths_seen[B]) << "no step of " << B << " rows";
  RecordProperty("worst_rel_err", std::to_string(worst));

  // A CPU session in a GPU batch is refused, naming the row.
  std::vector<BatchRow> mixed = {{gs[0].get(), 1, pos[0]}, {cs[1].get(), 1, pos[1]}};
  std::vector<float> out(2 * (size_t)vocab);
  try {
    gpu_model.forward_batch(mixed, out.data());
    ADD_FAILURE() << "a CPU session ran in a GPU batch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, GpuBatch,
    ::testing::Values(BatchCase{Case{"fp16", "fp16", 16, 0, false, false, "gptq"}, "", {}},
                      BatchCase{kQ4G128, "", {}},
                      BatchCase{Case{"q3_g128_act", "gptq", 3, 128, true, false, "gptq"}, "", {}},
                      BatchCase{Case{"q4_g128_act_unfused", "gptq", 4, 128, true, false, "gptq", 4, 2, true}, "", {}},
                      BatchCase{Case{"q4_g128_hd128", "gptq", 4, 128, false, false, "gptq", 2, 1}, "mistral", {}},
                      BatchCase{Case{"q4_g128_q8kv", "gptq", 4, 128, false, false, "gptq"}, "", {KvType::Q8_0, KvType::Q8_0}},
                      BatchCase{Case{"q4_g128_fp8kv_window", "gptq", 4, 128, false, false, "gptq"}, "mistral", {KvType::Fp8, KvType::Fp8}},
                      // OPT: each row's learned position added by its own embedding launch
                      BatchCase{Case{"q4_g128_opt", "gptq", 4, 128, false, false, "gptq", 4, 4}, "opt", {}},
                      BatchCase{.format = Case{"q4_g128_chunk4", "gptq", 4, 128, false, false, "gptq"},
                                .prefill_chunk = 4},
                      // chunks of 2 and 1 rows through the 8-bit cache's per-row write and attention
                      BatchCase{.format = Case{"q4_g128_q8kv_chunk4", "gptq", 4, 128, false, false, "gptq"},
                                .kv = {KvType::Q8_0, KvType::Q8_0},
                                .prefill_chunk = 4},
                      BatchCase{.format = Case{"q4_g128_no_small_gemm", "gptq", 4, 128, false, false, "gptq"},
                                .tuning = tuned([](DecodeTuning& t) { t.small_gemm_max_rows = 0; })},
                      // --att-heads: the batched attention takes the decode step's heads per block
                      BatchCase{.format = Case{"q4_g128_kv1_att_heads_1", "gptq", 4, 128, false, false, "gptq", 4, 1},
                                .tuning = tuned([](DecodeTuning& t) { t.attention_heads_per_block = 1; }),
                                .long_context = true},
                      BatchCase{Case{"q4_g128_qwen3", "gptq", 4, 128, false, false, "gptq"}, "qwen3", {}},
                      BatchCase{Case{"q4_g128_qwen2", "gptq", 4, 128, false, false, "gptq"}, "qwen2", {}},
                      BatchCase{Case{"q4_g128_hd128_q8k_fp8v", "gptq", 4, 128, false, false, "gptq", 2, 1},
                                "", {KvType::Q8_0, KvType::Fp8}},
                      // a KV group of 4 at head_dim 64: 4 query heads per block past 1,024
                      BatchCase{.format = Case{"q4_g128_kv1_long", "gptq", 4, 128, false, false, "gptq", 4, 1},
                                .long_context = true},
                      // head_dim 128, group 2: 2 query heads per block past 1,024 (else 1)
                      BatchCase{.format = Case{"q4_g128_hd128_fp8k_q8v_long", "gptq", 4, 128, false, false, "gptq", 2, 1},
                                .kv = {KvType::Fp8, KvType::Q8_0},
                                .long_context = true}),
    [](const auto& info) { return info.param.format.name; });

}  // namespace
