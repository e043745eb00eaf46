// The executables as a user runs them: end to end through kestrel-synth and kestrel, and
// every bad input ending in one clear line on stderr and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/gpu.h"
#include "base/device.h"

#include "tests/support/test_util.h"

namespace fs = std::filesystem;

namespace {

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

using kestrel::test::lines;

// "2.57 MiB" and "3.66 M", as kestrel bench's table prints a model's size and parameters.
std::string fmt_mib(uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f MiB", bytes / 1048576.0);
  return b;
}
std::string fmt_millions(int64_t n) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f M", n / 1e6);
  return b;
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

// Host memory the kernel would give without swapping, in bytes (/proc/meminfo's MemAvailable).
double mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  double kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// A config whose max_position_embeddings is 2^31 - 1 (as some checkpoints write "no limit"):
// the CPU engine's default context is shortened to what half the host memory left holds, with
// a note, and the run starts at once rather than filling the machine with a KV cache first.
TEST_F(Cli, CpuDefaultContextIsBoundedByHostMemory) {
  const fs::path d = copy_model("huge_max_pos");
  nlohmann::json cfg = nlohmann::json::parse(kestrel::test::read_file(d / "config.json"));
  cfg["max_position_embeddings"] = 2147483647;
  kestrel::test::write_file(d / "config.json", cfg.dump(2));
  const int heads = cfg["num_attention_heads"], layers = cfg["num_hidden_layers"];
  const int kv_heads = cfg.value("num_key_value_heads", heads);
  const int head_dim = cfg.value("head_dim", cfg["hidden_size"].get<int>() / heads);
  const double per_pos = 2.0 * layers * kv_heads * head_dim * sizeof(float);  // fp32 K and V
  const double avail = mem_available();
  ASSERT_GT(avail, 0);

  const Result r = run(kKestrel + " generate --device cpu -m " + d.string() + " -n 2 -p hi --temp 0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("note: host memory is short: context reduced from 2147483647 to "),
            std::string::npos) << r.err;
  const size_t at = r.err.find(", context ");
  ASSERT_NE(at, std::string::npos) << r.err;
  const long long ctx = std::stoll(r.err.substr(at + 10));
  EXPECT_GE(ctx, 16);
  EXPECT_LT(ctx, 2147483647LL);
  // Half of what was available (less the weights), with room for MemAvailable to move a little
  // between this reading and the run's.
  EXPECT_LE(ctx * per_pos, 0.55 * avail) << ctx << " positions of " << per_pos << " bytes";

  // -c past all of the memory is one line naming the bytes, whatever the default would be.
  const Result big = run(kKestrel + " generate --device cpu -m " + d.string() + " -n 2 -p hi -c 2000000000");
  expect_one_line_error(big, "-c 2000000000: the KV cache would need ");
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

TEST_F(Cli, NoGpuMeansCudaDeviceIsRefusedWithVersions) {
  if (kestrel::test::gpu().usable) GTEST_SKIP() << "a GPU is present; this checks the no-GPU message";
  const Result r = run(kKestrel + " generate --device cuda -m " + dir_->string() + " -p hi");
  expect_one_line_error(r, "--device cpu");
  EXPECT_NE(r.err.find("runtime"), std::string::npos) << r.err;
}

// A bad command line: one line naming the option and the value, exit code 1, nothing on
// stdout; --help and --version still print as usual and exit 0.
TEST_F(Cli, BadCommandLinesGetOneLine) {
  const std::string m = " -m " + dir_->string();
  struct Case {
    std::string args, what;
  } cases[] = {
      {" generate --device cpu" + m + " -p hi -n 0",
       "--n-predict: must be -1 (up to the context) or between 1 and 1073741824, got 0"},
      {" generate --device cpu" + m + " -p hi -n many", "--n-predict: not a number: 'many'"},
      {" generate --device cpu" + m + " -p hi -n 0x10", "--n-predict: not a number: '0x10'"},
      {" generate --device cpu" + m + " -p hi --temp 0x1p-1", "--temp: not a number: '0x1p-1'"},
      {" generate --device cpu" + m + " -p hi --temp -0.5", "--temp: must be at least 0, got -0.5"},
      {" generate --device cpu" + m + " -p hi --repeat-penalty 0", "--repeat-penalty: must be above 0"},
      {" generate --device cpu" + m + " -p hi --top-p 2", "--top-p: must be between 0 and 1, got 2"},
      {" generate --device cpu" + m + " -p hi --json --logprobs 101", "--logprobs: must be between 0 and 100"},
      {" bench --device cpu" + m + " -r 0", "--repetitions: must be at least 1, got 0"},
      {" bench --device cpu" + m + " -n -3", "--n-gen: must be at least 0, got -3"},
      {" bench --device cpu" + m + " --att-heads 3", "--att-heads: 3 not in {0,1,2,4}"},
      {" bench --device cpu" + m + " --gemv-warps 12", "--gemv-warps: 12 not in {0,8,16}"},
      {" perplexity --device cpu" + m + " -f x.txt --chunks -1", "--chunks: must be at least 0"},
      {" generate --device cpu" + m + " -p hi --no-such-flag", "--no-such-flag"},
      {" generate -p hi", "--model"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const Result r = run(kKestrel + c.args);
    expect_one_line_error(r, c.what);
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  const Result help = run(kKestrel + " bench --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--repetitions"), std::string::npos) << help.out;
  const Result version = run(kKestrel + " --version");
  EXPECT_EQ(version.code, 0);
  EXPECT_NE(version.out.find("kestrel"), std::string::npos) << version.out;
}

// kestrel bench on the CPU engine, in its three formats: the repetitions' samples, their mean
// and standard deviation, the model's size and parameter count; the CSV quotes the device
// name, which holds a comma. Nothing to measure (-p 0 -n 0) is an error.
TEST_F(Cli, BenchReportsEveryFormat) {
  const std::string args = " bench --device cpu -m " + dir_->string() + " -p 16 -n 8 -r 3";
  const Result json = run(kKestrel + args + " -o json");
  ASSERT_EQ(json.code, 0) << json.err;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["n_prompt"], 16);
  EXPECT_EQ(j["n_gen"], 8);
  EXPECT_EQ(j["reps"], 3);
  EXPECT_EQ(j["backend"], "CPU");
  // The size is the tensors' bytes: the file less its 8-byte length and JSON header.
  const auto size = j["size_bytes"].get<uint64_t>();
  uint64_t header = 0;
  std::ifstream(*dir_ / "model.safetensors", std::ios::binary)
      .read(reinterpret_cast<char*>(&header), sizeof header);
  EXPECT_EQ(size, fs::file_size(*dir_ / "model.safetensors") - 8 - header);
  const auto params = j["params"].get<int64_t>();
  EXPECT_GT(params, 0);
  // A CPU run has no device memory to report; its KV cache is host memory.
  for (const auto& [key, value] : j.items()) EXPECT_EQ(key.rfind("gpu_", 0), std::string::npos);
  EXPECT_GT(j["cache_bytes"].get<uint64_t>(), 0u);
  for (const char* key : {"prompt_tokens_per_s", "gen_tokens_per_s"}) {
    SCOPED_TRACE(key);
    const std::vector<double> v = j[key]["samples"].get<std::vector<double>>();
    ASSERT_EQ(v.size(), 3u);
    double mean = 0;
    for (double x : v) {
      EXPECT_GT(x, 0.0);
      mean += x / 3;
    }
    double var = 0;
    for (double x : v) var += (x - mean) * (x - mean) / 2;
    EXPECT_NEAR(j[key]["mean"].get<double>(), mean, 1e-9 * mean);
    EXPECT_NEAR(j[key]["sd"].get<double>(), std::sqrt(var), 1e-9 * mean);
  }

  const Result md = run(kKestrel + args);
  ASSERT_EQ(md.code, 0) << md.err;
  EXPECT_EQ(md.err.find("tune"), std::string::npos) << md.err;
  // The CUDA engine's tuning options on the CPU: run, with a note that they do nothing.
  const Result tuned = run(kKestrel + args + " --gemv-warps 8 --small-gemm 8");
  ASSERT_EQ(tuned.code, 0) << tuned.err;
  EXPECT_NE(tuned.err.find("note: --gemv-warps, --small-gemm tune the CUDA engine; this model "
                           "runs on the CPU"),
            std::string::npos)
      << tuned.err;
  EXPECT_EQ(lines(md.out), 4) << md.out;  // header, rule, pp16, tg8
  // Each row names the model by its directory, then its format.
  const std::string row1 = md.out.substr(md.out.find('\n', md.out.find('\n') + 1) + 1);
  EXPECT_EQ(row1.rfind("| " + dir_->filename().string() + " | GPTQ 4-bit g64 act-order ", 0), 0u)
      << md.out;
  EXPECT_NE(md.out.find(" pp16 | "), std::string::npos) << md.out;
  EXPECT_NE(md.out.find(" tg8 | "), std::string::npos) << md.out;
  // Under a GiB and a billion: MiB and M, as llama-bench prints them.
  EXPECT_NE(md.out.find(fmt_mib(size)), std::string::npos) << md.out;
  EXPECT_NE(md.out.find(fmt_millions(params)), std::string::npos) << md.out;

  const Result csv = run(kKestrel + args + " -o csv");
  ASSERT_EQ(csv.code, 0) << csv.err;
  ASSERT_EQ(lines(csv.out), 3) << csv.out;
  EXPECT_EQ(csv.out.substr(0, csv.out.find('\n')),
            "model,type,size_bytes,params,backend,device,test,tokens_per_s_mean,tokens_per_s_sd");
  const std::string row = csv.out.substr(csv.out.find('\n') + 1);
  EXPECT_NE(row.find("," + std::to_string(size) + "," + std::to_string(params) + ",CPU,\"CPU ("),
            std::string::npos)
      << row;

  expect_one_line_error(run(kKestrel + " bench --device cpu -m " + dir_->string() + " -p 0 -n 0"),
                        "nothing to measure");
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
