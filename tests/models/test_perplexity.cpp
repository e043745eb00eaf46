// kestrel perplexity end to end: the CLI's figure against an independent computation of the
// protocol written here (tokenize once with BOS at the start, windows of c tokens from position
// 0, tail dropped, c - 1 predictions per window, log-softmax in double, exp of the mean), on a
// kestrel-synth model. The logits come from the CPU engine; the windowing, BOS handling and
// log-softmax are this file's own.
//
// Tolerances: on the CPU both sides sum the same double NLLs in the same order, so they agree to
// 1e-9 relative. The GPU keeps activations in FP16 (test_decoder_cuda: a few 1e-3 relative on
// the logits); per-token NLL errors of that size average out over thousands of predictions, and
// 1e-2 relative on the perplexity still fails for a wrong window, offset or target.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "base/device.h"
#include "models/io/model_spec.h"
#include "models/cpu/decoder.h"
#include "tokenizer/tokenizer.h"
#include "tools/synth/synth.h"

#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

using kestrel::test::make_text;

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

const std::string kKestrel = KESTREL_BIN;


class Perplexity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(scratch() / "ppl_model");
    text_ = new fs::path(scratch() / "ppl_text.txt");
    fs::remove_all(*dir_);
    synth::SynthOptions o;
    o.shape = "tiny";
    o.n_layers = 2;
    o.dtype = "gptq";
    o.bits = 4;
    o.group_size = 64;
    o.seed = 5;
    o.out = dir_->string();
    o.quiet = true;
    synth::write_model(o);
    std::ofstream(*text_) << make_text(900, 3);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    fs::remove(*text_);
    delete dir_;
    delete text_;
  }

  // The protocol, independently: returns {perplexity, windows}, and in `error` the standard
  // error llama-perplexity gives it: ppl * sqrt((mean(nll^2) - mean(nll)^2) / (n - 1)).
  static std::pair<double, int> expected(int window, int max_windows, double* error = nullptr) {
    const ModelSpec spec = load_model_spec(dir_->string());
    const std::unique_ptr<Tokenizer> owned = Tokenizer::load(dir_->string());
    const Tokenizer& tok = *owned;
    std::ifstream in(*text_);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    std::vector<int> ids = tok.encode(text, false);
    ids.insert(ids.begin(), tok.bos_id());
    int windows = (int)(ids.size() / window);
    if (max_windows > 0) windows = std::min(windows, max_windows);
    DecoderCpu cpu_model(spec);
    auto cpu = cpu_model.new_cpu_session(window);
    const int vocab = spec.config.vocab;
    std::vector<float> all((size_t)window * vocab), last(vocab);
    double nll = 0, nll2 = 0;
    long count = 0;
    for (int w = 0; w < windows; ++w) {
      cpu->forward(ids.data() + (size_t)w * window, window, 0, last.data(), all.data());
      for (int i = 0; i + 1 < window; ++i) {
        const float* l = &all[(size_t)i * vocab];
        double mx = l[0];
        for (int j = 1; j < vocab; ++j) mx = std::max(mx, (double)l[j]);
        double s = 0;
        for (int j = 0; j < vocab; ++j) s += std::exp((double)l[j] - mx);
        const double x = std::log(s) + mx - l[ids[(size_t)w * window + i + 1]];
        nll += x;
        nll2 += x * x;
        ++count;
      }
    }
    const double mean = nll / count;
    if (error) *error = std::exp(mean) * std::sqrt((nll2 / count - mean * mean) / (count - 1));
    return {std::exp(mean), windows};
  }

  static nlohmann::json cli(const std::string& args) {
    const Result r = run(kKestrel + " perplexity -m " + dir_->string() + " -f " + text_->string() +
                         " --json " + args);
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  }

  static fs::path* dir_;
  static fs::path* text_;
};
fs::path* Perplexity::dir_ = nullptr;
fs::path* Perplexity::text_ = nullptr;

TEST_F(Perplexity, CpuEqualsIndependentComputation) {
  double error = 0;
  const auto [ppl, windows] = expected(64, 0, &error);
  ASSERT_GE(windows, 3) << "the test text should fill several windows";
  const nlohmann::json j = cli("--device cpu -c 64");
  EXPECT_EQ(j["windows"], windows);
  EXPECT_EQ(j["tokens_scored"], windows * 63);
  EXPECT_NEAR(j["perplexity"].get<double>() / ppl, 1.0, 1e-9) << j.dump();
  EXPECT_GT(ppl, 1.0);
  // The +/- of the figure, as llama-perplexity estimates it.
  EXPECT_GT(error, 0.0);
  EXPECT_NEAR(j["perplexity_error"].get<double>() / error, 1.0, 1e-6) << j.dump();
}

TEST_F(Perplexity, ChunksLimitsTheWindows) {
  const auto [ppl, windows] = expected(48, 2);
  ASSERT_EQ(windows, 2);
  const nlohmann::json j = cli("--device cpu -c 48 --chunks 2");
  EXPECT_EQ(j["windows"], 2);
  EXPECT_EQ(j["ctx"], 48);
  EXPECT_NEAR(j["perplexity"].get<double>() / ppl, 1.0, 1e-9) << j.dump();
  // A different window length is a different figure (the windows really are c tokens).
  EXPECT_NE(j["perplexity"].get<double>(), cli("--device cpu -c 64 --chunks 2")["perplexity"].get<double>());
}

TEST_F(Perplexity, GpuAgreesWithCpu) {
  KESTREL_REQUIRE_GPU();
  const auto [ppl, windows] = expected(128, 0);
  const nlohmann::json j = cli("--device cuda -c 128");
  EXPECT_EQ(j["windows"], windows);
  EXPECT_NEAR(j["perplexity"].get<double>() / ppl, 1.0, 1e-2) << j.dump();
}

TEST_F(Perplexity, TextShorterThanOneWindowIsAnError) {
  const Result r = run(kKestrel + " perplexity --device cpu -c 4000 -m " + dir_->string() +
                       " -f " + text_->string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find(text_->string() + ": "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" tokens, fewer than one window of 4000 (-c)"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  // An empty file says so.
  const fs::path empty = fs::path(text_->string() + ".empty");
  std::ofstream(empty).close();
  const Result e = run(kKestrel + " perplexity --device cpu -c 64 -m " + dir_->string() + " -f " +
                       empty.string());
  EXPECT_EQ(e.code, 1);
  EXPECT_EQ(e.err, "kestrel: " + empty.string() + ": the file is empty\n");
  fs::remove(empty);
}

TEST_F(Perplexity, MissingFileIsAnError) {
  const Result r = run(kKestrel + " perplexity --device cpu -m " + dir_->string() +
                       " -f /nonexistent/text.txt");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("/nonexistent/text.txt"), std::string::npos) << r.err;
}

}  // namespace
