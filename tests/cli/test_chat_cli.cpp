// kestrel chat driven through a pipe, and kestrel generate's prompt files (JSONL batches,
// logprobs), on a small kestrel-synth model on the CPU. Greedy decoding makes every reply
// deterministic, so replies can be checked against kestrel generate on the same tokens.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

std::vector<json> json_lines(const std::string& s) {
  std::vector<json> out;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

std::string ltrim(std::string s) {
  s.erase(0, s.find_first_not_of(" \n"));
  return s;
}
std::string trim(std::string s) {
  s = ltrim(s);
  s.erase(s.find_last_not_of(" \n\t\r") + 1);
  return s;
}

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;

class ChatCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(scratch() / "chat_cli_model");
    fs::remove_all(*dir_);
    const Result r = run(kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 --group-size 64 "
                                  "--seed 11 --quiet --out " + dir_->string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  // kestrel chat with `input` on stdin.
  Result chat(const std::string& input, const std::string& args = "") {
    const fs::path in = scratch() / "chat_cli_input.txt";
    write_file(in, input);
    return run(kKestrel + " chat --device cpu -m " + dir_->string() + " --temp 0 " + args + " < " +
               in.string());
  }
  // kestrel generate --json on a prompt file: the greedy continuation's text.
  std::string generate_text(const std::string& prompt, int n) {
    const fs::path f = scratch() / "chat_cli_prompt.txt";
    write_file(f, prompt);
    const Result r = run(kKestrel + " generate --device cpu -m " + dir_->string() + " -f " +
                         f.string() + " -n " + std::to_string(n) + " --temp 0 --json");
    EXPECT_EQ(r.code, 0) << r.err;
    return json::parse(r.out)["text"].get<std::string>();
  }
  static fs::path* dir_;
};
fs::path* ChatCli::dir_ = nullptr;

TEST_F(ChatCli, RegenAndClearReproduceTheGreedyReply) {
  const Result one = chat("the river\n", "--template raw -n 10 -q");
  ASSERT_EQ(one.code, 0) << one.err;
  ASSERT_GT(one.out.size(), 1u);
  const std::string reply = one.out;  // the reply and its newline

  // The raw format renders "the river\n": the reply is generate's continuation of it, shown
  // without its leading whitespace.
  EXPECT_EQ(reply, ltrim(generate_text("the river\n", 10)) + "\n");

  const Result r = chat("the river\n/regen\n/stats\n/clear\nthe river\n/exit\nnot read\n",
                        "--template raw -n 10");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, reply + reply + reply);
  EXPECT_NE(r.err.find("turns 2"), std::string::npos) << r.err;  // /stats after the regen
  EXPECT_NE(r.err.find("conversation cleared"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("prompt eval time"), std::string::npos) << r.err;  // the perf block
}

TEST_F(ChatCli, SecondTurnContinuesTheCachedConversation) {
  const Result r = chat("the river\nis long\n", "--template raw -n 8 -q");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string first = ltrim(generate_text("the river\n", 8));
  ASSERT_EQ(r.out.substr(0, first.size() + 1), first + "\n");
  // Turn two is the raw rendering of the whole conversation, continued.
  const std::string conversation = "the river\n" + trim(first) + "\nis long\n";
  EXPECT_EQ(r.out.substr(first.size() + 1), ltrim(generate_text(conversation, 8)) + "\n");
}

TEST_F(ChatCli, MultiLineInput) {
  // A trailing backslash continues the message; """ blocks hold lines as they are.
  const Result a = chat("the\\\nriver\n", "--template raw -n 6 -q");
  const Result b = chat("\"\"\"\nthe\nriver\n\"\"\"\n", "--template raw -n 6 -q");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, ltrim(generate_text("the\nriver\n", 6)) + "\n");
  EXPECT_EQ(b.out, a.out);
}

TEST_F(ChatCli, OldestTurnsGoWhenTheContextFills) {
  const Result r = chat("the river is long\nthe mountain is high\nthe house is little\n"
                        "the water is deep\n",
                        "--template llama2 --system 'be brief' -c 64 -n 12");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("dropped"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("system prompt stays"), std::string::npos) << r.err;
}

TEST_F(ChatCli, EveryTemplateRuns) {
  for (const std::string t : {"llama2", "mistral", "zephyr", "chatml", "vicuna"}) {
    const Result r = chat("hello\n/system be brief\nhello again\n", "--template " + t + " -n 4 -q");
    EXPECT_EQ(r.code, 0) << t << ": " << r.err;
  }
}

TEST_F(ChatCli, UnknownTemplateIsOneLine) {
  const Result r = chat("hello\n", "--template alpaca");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("unknown chat template \"alpaca\""), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(ChatCli, BatchWithABadLine) {
  const fs::path f = scratch() / "chat_cli_batch.jsonl";
  write_file(f,
             "{\"prompt\": \"the river\", \"n_predict\": 6}\n"
             "{\"prompt\": \"the river\", oops}\n"
             "{\"prompt\": \"the mountain\", \"max_tokens\": 3, \"id\": \"m\"}\n"
             "\n"
             "{\"prompt\": \"the river\", \"temprature\": 0.5}\n"
             "{\"prompt\": \"the river\", \"n_predict\": 6, \"stop\": \"zzz\"}\n");
  const Result r = run(kKestrel + " generate --device cpu -m " + dir_->string() +
                       " --temp 0 --batch-file " + f.string());
  EXPECT_EQ(r.code, 1);
  const std::vector<json> out = json_lines(r.out);
  ASSERT_EQ(out.size(), 5u) << r.out;
  EXPECT_EQ(out[0]["line"], 1);
  EXPECT_EQ(out[1]["line"], 2);
  EXPECT_EQ(out[2]["line"], 3);
  EXPECT_EQ(out[3]["line"], 5);
  EXPECT_EQ(out[4]["line"], 6);
  EXPECT_TRUE(out[1].contains("error"));
  EXPECT_TRUE(out[3].contains("error"));
  EXPECT_NE(out[3]["error"].get<std::string>().find("temprature"), std::string::npos);
  EXPECT_NE(r.err.find(f.string() + ":2:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(f.string() + ":5:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("2 of 5"), std::string::npos) << r.err;
  // The good lines ran: their text equals a single greedy generate of the same prompt, also
  // when the whole prompt came from the cache of an earlier line.
  const std::string river = generate_text("the river", 6);
  EXPECT_EQ(out[0]["text"], river);
  EXPECT_EQ(out[4]["text"], river);
  EXPECT_EQ(out[0]["generated_tokens"], 6);
  EXPECT_EQ(out[2]["generated_tokens"], 3);
  EXPECT_EQ(out[2]["id"], "m");
  EXPECT_EQ(out[2]["finish_reason"], "length");
  EXPECT_GT(out[4]["timings"]["cached_tokens"].get<int>(), 0);
}

TEST_F(ChatCli, BatchToAFileAndEmptyBatch) {
  const fs::path f = scratch() / "chat_cli_batch2.jsonl";
  const fs::path o = scratch() / "chat_cli_batch2.out";
  write_file(f, "{\"prompt\": \"a b\", \"n_predict\": 2}\n");
  const Result r = run(kKestrel + " generate --device cpu -q -m " + dir_->string() +
                       " --batch-file " + f.string() + " -o " + o.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "");
  std::ifstream in(o);
  const std::vector<json> out = json_lines(std::string(std::istreambuf_iterator<char>(in), {}));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0]["generated_tokens"], 2);

  write_file(f, "\n  \n");
  const Result e = run(kKestrel + " generate --device cpu -m " + dir_->string() +
                       " --batch-file " + f.string());
  EXPECT_EQ(e.code, 1);
  EXPECT_NE(e.err.find("no prompts"), std::string::npos) << e.err;
  EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
}

TEST_F(ChatCli, LogprobsInJson) {
  const Result r = run(kKestrel + " generate --device cpu -m " + dir_->string() +
                       " -p 'the river' -n 5 --temp 0 --json --logprobs 3");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["logprobs"].size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const json& t = j["logprobs"][i];
    EXPECT_EQ(t["id"], j["ids"][i]);
    ASSERT_EQ(t["top"].size(), 3u);
    EXPECT_EQ(t["top"][0]["id"], t["id"]);  // greedy picks the most likely
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_GE(t["top"][0]["logprob"].get<double>(), t["top"][1]["logprob"].get<double>());
  }
}

TEST_F(ChatCli, QuietSilencesThePerfBlock) {
  const std::string args = " generate --device cpu -m " + dir_->string() + " -p hi -n 3 --temp 0";
  const Result loud = run(kKestrel + args);
  const Result quiet = run(kKestrel + args + " -q");
  EXPECT_NE(loud.err.find("perf:"), std::string::npos) << loud.err;
  EXPECT_NE(loud.err.find("loaded"), std::string::npos) << loud.err;
  EXPECT_EQ(quiet.err, "");
}

}  // namespace
