// kestrel generate, chat and bench with --spec: the same greedy text as without it, the
// speculative counts in --json and the bench report, and every bad combination answered with
// one line and exit code 1.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/test_util.h"

namespace fs = std::filesystem;

namespace {

using kestrel::test::run_command;
using kestrel::test::scratch;
const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;
const std::string kPrompt =
    "'the river runs under a stone bridge and the river runs under a stone bridge and the'";

class SpecCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (const auto& [name, extra] : {std::pair<std::string, std::string>{"target", "--seed 3 --layers 2"},
                                      {"draft", "--seed 4 --layers 1"}}) {
      const auto r = run_command(kSynth + " --shape tiny --dtype gptq --bits 4 "
                                          "--group-size 64 --quiet " + extra + " --out " +
                                 (scratch() / name).string());
      ASSERT_EQ(r.code, 0) << r.err;
    }
  }
  static std::string dir(const std::string& name) { return (scratch() / name).string(); }
  static std::string gen(const std::string& args) {
    return kKestrel + " generate --device cpu -m " + dir("target") + " " + args;
  }
};

void expect_one_line_error(const kestrel::test::CommandResult& r, const std::string& what) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  EXPECT_EQ(r.err.rfind("kestrel: ", 0), 0u) << r.err;
}

TEST_F(SpecCli, MistakesAreOneLine) {
  expect_one_line_error(run_command(gen("-p hi --spec draft")), "--spec draft needs --draft-model");
  expect_one_line_error(run_command(gen("-p hi --draft-model " + dir("draft"))),
                        "--draft-model goes with --spec draft");
  expect_one_line_error(run_command(gen("-p hi --spec ngram")), "must be lookup or draft, got ngram");
  expect_one_line_error(run_command(gen("-p hi --spec lookup --draft-max 0")),
                        "--draft-max: must be between 1 and 64, got 0");
  expect_one_line_error(run_command(gen("-p hi --spec lookup --draft-max 65")),
                        "--draft-max: must be between 1 and 64, got 65");
  // Another tokenizer (the docs model's SentencePiece against the tiny models' BPE).
  const std::string docs = std::string(KESTREL_DATA_DIR) + "/docs-llama-19m-gptq4";
  expect_one_line_error(run_command(gen("-p hi -q --spec draft --draft-model " + docs)),
                        "its vocabulary differs");
  expect_one_line_error(
      run_command(kKestrel + " chat --device cpu -m " + dir("target") + " --spec draft </dev/null"),
      "--spec draft needs --draft-model");
  expect_one_line_error(run_command(gen("-p hi --draft-max 4")), "--draft-max goes with --spec");
  // A mistyped draft directory is named before the model loads.
  expect_one_line_error(run_command(gen("-p hi --spec draft --draft-model " + dir("missing"))),
                        "--draft-model " + dir("missing") + ": no such directory");
  // A directory that is not a model's, also before the model loads, and named once.
  std::filesystem::create_directories(scratch() / "not_a_model");
  expect_one_line_error(run_command(gen("-p hi --spec draft --draft-model " + dir("not_a_model"))),
                        "--draft-model " + dir("not_a_model") + ": no config.json (not a model directory)");
  expect_one_line_error(run_command(gen("-p hi -md " + dir("draft"))), "--draft-model DIR");
  const std::string bench = kKestrel + " bench --device cpu -m " + dir("target");
  expect_one_line_error(run_command(bench + " --spec lookup -n 8 -r 1"), "--spec needs a text prompt");
  // --verify times the pass alone: with --spec that is the mistake named, prompt or not.
  expect_one_line_error(run_command(bench + " --spec lookup -n 8 -r 1 --verify 4"),
                        "--verify goes without --spec");
  expect_one_line_error(run_command(bench + " --prompt hi -n 8 -r 1"), "-f and --prompt go with --spec");
}

TEST_F(SpecCli, GenerateGreedyTextIsPlainDecodings) {
  const auto plain = run_command(gen("-p " + kPrompt + " -n 40 --temp 0 --ignore-eos --json -q"));
  ASSERT_EQ(plain.code, 0) << plain.err;
  const auto want = nlohmann::json::parse(plain.out);
  for (const std::string& spec :
       std::vector<std::string>{"--spec lookup", "--spec lookup --draft-max 2",
                                "--spec draft --draft-model " + dir("draft")}) {
    const auto r =
        run_command(gen("-p " + kPrompt + " -n 40 --temp 0 --ignore-eos --json -q " + spec));
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["ids"], want["ids"]) << spec;
    EXPECT_EQ(j["text"], want["text"]) << spec;
    const auto& t = j["timings"];
    EXPECT_GT(t["drafted_tokens"].get<int>(), 0) << spec;
    EXPECT_LE(t["accepted_tokens"].get<int>(), t["drafted_tokens"].get<int>());
    EXPECT_GE(t["tokens_per_step"].get<double>(), 1.0);
    EXPECT_FALSE(want["timings"].contains("drafted_tokens"));
  }
  // The perf block says what speculation did.
  const auto r = run_command(gen("-p " + kPrompt + " -n 16 --temp 0 --spec lookup"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("speculative ="), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tokens per step"), std::string::npos) << r.err;
  // -n 1: the prompt's pass alone, no verify pass; no rates rather than rates of 0.
  const auto one = run_command(gen("-p " + kPrompt + " -n 1 --temp 0 --spec lookup --json"));
  ASSERT_EQ(one.code, 0) << one.err;
  const auto t1 = nlohmann::json::parse(one.out)["timings"];
  EXPECT_EQ(t1["steps"], 0);
  EXPECT_TRUE(t1["tokens_per_step"].is_null());
  EXPECT_TRUE(t1["acceptance_rate"].is_null());
  EXPECT_NE(one.err.find("speculative = no verify pass"), std::string::npos) << one.err;
}

// A draft model over the same tokenizer with a larger embedding table (padding rows, as
// between Qwen2.5's small and large models) drafts, and the text is still plain decoding's. An
// option given twice takes its last value, as llama.cpp's do.
TEST_F(SpecCli, DraftWithAPaddedTableAndRepeatedOptions) {
  const auto cfg = nlohmann::json::parse(kestrel::test::read_file(scratch() / "target" / "config.json"));
  const int vocab = cfg["vocab_size"].get<int>();
  const auto synth = run_command(kSynth + " --shape tiny --dtype gptq --bits 4 --group-size 64 "
                                          "--quiet --seed 4 --layers 1 --tokenizer " + dir("target") +
                                 " --vocab " + std::to_string(vocab + 64) + " --out " + dir("padded"));
  ASSERT_EQ(synth.code, 0) << synth.err;
  const auto plain = run_command(gen("-p " + kPrompt + " -n 32 --temp 0 --ignore-eos --json -q"));
  ASSERT_EQ(plain.code, 0) << plain.err;
  const auto r = run_command(gen("-p " + kPrompt + " -n 32 --temp 0 --ignore-eos --json -q "
                                 "--spec lookup --spec draft --draft-model " + dir("padded")));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out), want = nlohmann::json::parse(plain.out);
  EXPECT_EQ(j["ids"], want["ids"]);
  EXPECT_GT(j["timings"]["drafted_tokens"].get<int>(), 0);
  EXPECT_EQ(j["timings"]["steps"].get<int>() > 0, true);
}

// A conversation whose context is so short that the oldest exchanges are dropped: the
// replies are the same with speculation, turn after turn.
TEST_F(SpecCli, ChatRepliesArePlainDecodings) {
  const fs::path in = scratch() / "chat.txt";
  kestrel::test::write_file(in, "the river runs under a stone bridge\nand the river runs\n"
                                "under a stone bridge and the river\nthe river runs again\n");
  const std::string chat = kKestrel + " chat --device cpu -q -m " + dir("target") +
                           " --template chatml --temp 0 -n 24 -c 96 ";
  const auto plain = run_command(chat + "< " + in.string());
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_FALSE(plain.out.empty());
  for (const std::string& spec :
       std::vector<std::string>{"--spec lookup", "--spec draft --draft-model " + dir("draft")}) {
    const auto r = run_command(chat + spec + " < " + in.string());
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, plain.out) << spec;
  }
}

TEST_F(SpecCli, BenchReportsBothSpeedsAndTheAcceptance) {
  const auto r = run_command(kKestrel + " bench --device cpu -m " + dir("target") +
                             " --spec lookup --prompt " + kPrompt + " -n 24 -r 1 -o json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["gen_tokens_per_s"]["mean"].get<double>(), 0);
  const auto& s = j["speculative"];
  EXPECT_EQ(s["spec"], "lookup");
  EXPECT_GT(s["gen_tokens_per_s"]["mean"].get<double>(), 0);
  EXPECT_GT(s["drafted_tokens"].get<int>(), 0);
  EXPECT_TRUE(s["same_tokens_as_plain"].get<bool>());
  const auto md = run_command(kKestrel + " bench --device cpu -m " + dir("target") +
                              " --spec lookup --prompt " + kPrompt + " -n 24 -r 1");
  ASSERT_EQ(md.code, 0) << md.err;
  EXPECT_NE(md.out.find("tg24+lookup"), std::string::npos) << md.out;
  EXPECT_NE(md.out.find("the same tokens as plain greedy decoding: yes"), std::string::npos)
      << md.out;
}

}  // namespace
