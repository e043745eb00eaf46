// The KV cache's types on the command line (-ctk / -ctv, --cache-type-k / -v): every command
// that loads a model takes them, `info` and `bench -o json` report the cache's bytes in them,
// and unknown types or ones the engine does not run are refused in one line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/test_util.h"

namespace fs = std::filesystem;

namespace {

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;

using kestrel::test::lines;

void expect_one_line_error(const Result& r, const std::string& what) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
}

class KvCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(scratch() / "kv_model");
    fs::remove_all(*dir_);
    const Result r = run(kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 --group-size 64 "
                                  "--seed 4 --quiet --out " + dir_->string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static std::string model() { return " -m " + dir_->string(); }
  static fs::path* dir_;
};
fs::path* KvCli::dir_ = nullptr;

TEST_F(KvCli, GenerateAndPerplexityRunEveryType) {
  const fs::path text = scratch() / "kv_text.txt";
  {
    std::ofstream f(text);
    for (int i = 0; i < 40; ++i) f << "the cache holds keys and values of every position " << i << "\n";
  }
  for (const char* types : {"-ctk q8_0 -ctv q8_0", "-ctk fp8 -ctv fp8", "-ctk q8_0 -ctv fp8",
                            "--cache-type-k=fp8 --cache-type-v f16", "-ctk=q8_0"}) {
    SCOPED_TRACE(types);
    const Result g = run(kKestrel + " generate --device cpu" + model() + " " + types +
                         " -p hello -n 8 --temp 0 --json -c 64");
    ASSERT_EQ(g.code, 0) << g.err;
    EXPECT_EQ(nlohmann::json::parse(g.out)["ids"].size(), 8u) << g.out;
    const Result p = run(kKestrel + " perplexity --device cpu" + model() + " " + types + " -f " +
                         text.string() + " -c 64 --chunks 2 --json");
    ASSERT_EQ(p.code, 0) << p.err;
    EXPECT_GT(nlohmann::json::parse(p.out)["perplexity"].get<double>(), 1.0);
  }
  // The load note names a quantized cache and its size; the default's stays as it was.
  const Result v = run(kKestrel + " generate --device cpu" + model() + " -ctk q8_0 -ctv q8_0 -p hi -n 1 -c 64");
  ASSERT_EQ(v.code, 0) << v.err;
  EXPECT_NE(v.err.find("context 64, q8_0 KV cache of "), std::string::npos) << v.err;
  const Result d = run(kKestrel + " generate --device cpu" + model() + " -p hi -n 1 -c 64");
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_EQ(d.err.find("KV cache"), std::string::npos) << d.err;
}

TEST_F(KvCli, BenchAndInfoReportTheBytes) {
  auto bench = [&](const std::string& types) {
    const Result r = run(kKestrel + " bench --device cpu" + model() + " -p 16 -n 4 -r 1 -o json " + types);
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json f16 = bench(""), q8 = bench("-ctk q8_0 -ctv q8_0"), fp8 = bench("-ctk fp8 -ctv fp8");
  EXPECT_EQ(f16["type_k"], "f16");
  EXPECT_EQ(q8["type_v"], "q8_0");
  // tiny: 2 KV heads of 64 per layer, 2 layers, context 20 (-p + -n); f16 is fp32 on the CPU.
  const uint64_t rows = 2 * 20, kvd = 128;
  EXPECT_EQ(f16["cache_bytes"].get<uint64_t>(), rows * kvd * 4 * 2);
  EXPECT_EQ(q8["cache_bytes"].get<uint64_t>(), rows * (kvd + kvd / 32 * 2) * 2);
  EXPECT_EQ(fp8["cache_bytes"].get<uint64_t>(), rows * (kvd + 2 * 4) * 2);

  const Result info = run(kKestrel + " info --json" + model() + " -ctk q8_0 -ctv fp8");
  ASSERT_EQ(info.code, 0) << info.err;
  const nlohmann::json j = nlohmann::json::parse(info.out)["kv_cache"];
  EXPECT_EQ(j["type_k"], "q8_0");
  EXPECT_EQ(j["type_v"], "fp8");
  EXPECT_EQ(j["gpu_bytes_per_position"].get<uint64_t>(), 2 * ((kvd + kvd / 32 * 2) + (kvd + 2 * 4)));
  const Result plain = run(kKestrel + " info --json" + model());
  const nlohmann::json p = nlohmann::json::parse(plain.out)["kv_cache"];
  EXPECT_EQ(p["gpu_bytes_per_position"].get<uint64_t>(), 2 * kvd * 2 * 2);
  EXPECT_EQ(p["cpu_bytes_per_position"].get<uint64_t>(), 2 * kvd * 4 * 2);
  // About twice the positions fit in the same memory.
  EXPECT_GT(j["gpu_positions_per_gib"].get<double>(), 1.85 * p["gpu_positions_per_gib"].get<double>());
  const Result text = run(kKestrel + " info" + model() + " -ctk fp8 -ctv fp8");
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("kv cache:  fp8: "), std::string::npos) << text.out;
}

TEST_F(KvCli, BadTypesGetOneLine) {
  expect_one_line_error(run(kKestrel + " generate --device cpu" + model() + " -p hi -ctk q4_0"),
                        "--cache-type-k: unknown cache type 'q4_0' (f16, q8_0 or fp8)");
  expect_one_line_error(run(kKestrel + " perplexity --device cpu" + model() + " -f x -ctv bf16"),
                        "--cache-type-v: unknown cache type 'bf16'");
  expect_one_line_error(run(kKestrel + " bench --device cpu" + model() + " -ctk"),
                        "--cache-type-k needs a value");
  expect_one_line_error(run(kKestrel + " info" + model() + " -ctk q4"), "unknown cache type 'q4'");
  // A head size q8_0's blocks do not divide: refused before the weights load.
  const fs::path odd = scratch() / "kv_odd";
  fs::remove_all(odd);
  const Result s = run(kSynth + " --shape custom --hidden 96 --intermediate 128 --layers 1 --heads 2 "
                                "--kv-heads 1 --seed 1 --quiet --out " + odd.string());
  ASSERT_EQ(s.code, 0) << s.err;
  expect_one_line_error(run(kKestrel + " generate --device cpu -m " + odd.string() + " -p hi -ctv q8_0"),
                        "--cache-type-v q8_0: q8_0 stores blocks of 32 values of a head, and this "
                        "model's heads have 48");
  fs::remove_all(odd);
}

}  // namespace
