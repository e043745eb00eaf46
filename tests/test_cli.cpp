// The executables as a user runs them: end to end through kestrel-synth and kestrel, and
// every bad input ending in one clear line on stderr and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/device.h"

#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(scratch() / "model");
    fs::remove_all(*dir_);
    const Result r = run(kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 --group-size 64 "
                                  "--act-order --seed 3 --quiet --out " + dir_->string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  // A copy of the model directory that a test may damage.
  fs::path copy_model(const std::string& name) {
    const fs::path d = scratch() / name;
    fs::remove_all(d);
    fs::copy(*dir_, d);
    return d;
  }
  static fs::path* dir_;
};
fs::path* Cli::dir_ = nullptr;

// One line on stderr, naming `what`, exit code 1, nothing on stdout.
void expect_one_line_error(const Result& r, const std::string& what) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  EXPECT_EQ(r.err.rfind("kestrel", 0), 0u) << r.err;
}

TEST_F(Cli, GenerateJsonOnCpu) {
  const Result r = run(kKestrel + " generate --device cpu -m " + dir_->string() +
                       " -p 'the river' -n 12 --temp 0 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ids"].size(), 12u);
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_GT(j["prompt_ids"].size(), 1u);
  EXPECT_EQ(j["prompt_ids"][0], 1);  // BOS
  EXPECT_TRUE(j["text"].is_string());
  EXPECT_GT(j["timings"]["gen_tokens_per_s"].get<double>(), 0.0);
  // Greedy is deterministic.
  const Result again = run(kKestrel + " generate --device cpu -m " + dir_->string() +
                           " -p 'the river' -n 12 --temp 0 --json");
  EXPECT_EQ(nlohmann::json::parse(again.out)["ids"], j["ids"]);
}

TEST_F(Cli, StreamsTextThatEqualsJsonText) {
  const std::string args = " generate --device cpu -m " + dir_->string() + " -p 'a b' -n 10 --temp 0";
  const Result text = run(kKestrel + args + " -q");
  const Result json = run(kKestrel + args + " --json");
  ASSERT_EQ(text.code, 0) << text.err;
  const std::string expected = "a b" + nlohmann::json::parse(json.out)["text"].get<std::string>() + "\n";
  EXPECT_EQ(text.out, expected);
}

TEST_F(Cli, MissingModelDirectory) {
  expect_one_line_error(run(kKestrel + " generate --device cpu -m /nonexistent/model -p hi"),
                        "/nonexistent/model");
}

TEST_F(Cli, MissingTokenizer) {
  const fs::path d = copy_model("no_tok");
  fs::remove(d / "tokenizer.model");
  expect_one_line_error(run(kKestrel + " generate --device cpu -m " + d.string() + " -p hi"),
                        "tokenizer.model");
  fs::remove_all(d);
}

TEST_F(Cli, TruncatedWeights) {
  const fs::path d = copy_model("truncated");
  fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") / 2);
  expect_one_line_error(run(kKestrel + " generate --device cpu -m " + d.string() + " -p hi"),
                        "model.safetensors");
  fs::remove_all(d);
}

TEST_F(Cli, UnsupportedQuantMethod) {
  const fs::path d = copy_model("awq");
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(d / "config.json"));
  cfg["quantization_config"]["quant_method"] = "awq";
  std::ofstream(d / "config.json") << cfg.dump(2);
  expect_one_line_error(run(kKestrel + " generate --device cpu -m " + d.string() + " -p hi"), "awq");
  fs::remove_all(d);
}

TEST_F(Cli, PromptLongerThanContext) {
  expect_one_line_error(run(kKestrel + " generate --device cpu -c 16 -m " + dir_->string() +
                            " -p 'one two three four five six seven eight nine ten eleven' -n 8"),
                        "context of 16");
}

TEST_F(Cli, EmptyPromptFile) {
  const fs::path f = scratch() / "empty_prompt.txt";
  std::ofstream(f).close();
  expect_one_line_error(
      run(kKestrel + " generate --device cpu -m " + dir_->string() + " -f " + f.string()),
      f.string());
  fs::remove(f);
}

TEST_F(Cli, CudaWithoutGpuSaysSoWithVersions) {
  if (kestrel::cuda_status().usable) GTEST_SKIP() << "a GPU is present; this checks the no-GPU message";
  const Result r = run(kKestrel + " generate --device cuda -m " + dir_->string() + " -p hi");
  expect_one_line_error(r, "--device cpu");
  EXPECT_NE(r.err.find("runtime"), std::string::npos) << r.err;
}

TEST_F(Cli, SynthRejectsBadBits) {
  const Result r = run(kSynth + " --shape tiny --dtype gptq --bits 5 --out " + (scratch() / "bad_bits").string());
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(lines(r.err), 1) << r.err;
}

}  // namespace

namespace {

// kestrel-synth --shape tiny then kestrel generate --device cpu --json, for every bit width
// and checkpoint format (act-order and asymmetric zeros alternate across the combinations).
TEST(CliFormats, SynthThenGenerateEveryBitsAndFormat) {
  int i = 0;
  for (int bits : {2, 3, 4, 8}) {
    for (const std::string format : {"gptq", "gptq_v2"}) {
      const bool act = i % 2 == 0, asym = format == "gptq_v2" && i % 4 == 1;
      ++i;
      const fs::path d = scratch() / ("fmt_" + std::to_string(i));
      fs::remove_all(d);
      const std::string synth = kSynth + " --shape tiny --layers 2 --dtype gptq --bits " +
                                std::to_string(bits) + " --group-size 64 --format " + format +
                                (act ? " --act-order" : "") + (asym ? " --asym" : "") +
                                " --quiet --out " + d.string();
      const Result s = run(synth);
      ASSERT_EQ(s.code, 0) << synth << "\n" << s.err;
      const Result g = run(kKestrel + " generate --device cpu -m " + d.string() +
                           " -p 'hello world' -n 8 --temp 0 --json");
      ASSERT_EQ(g.code, 0) << synth << "\n" << g.err;
      const nlohmann::json j = nlohmann::json::parse(g.out);
      EXPECT_EQ(j["ids"].size(), 8u) << synth;
      EXPECT_EQ(j["finish_reason"], "length") << synth;
      fs::remove_all(d);
    }
  }
}

}  // namespace
