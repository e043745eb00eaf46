// kestrel chat driven through a pipe, and kestrel generate's prompt files (JSONL batches,
// logprobs), on a small kestrel-synth model on the CPU. Greedy decoding makes every reply
// deterministic, so replies can be checked against kestrel generate on the same tokens.
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/support/child.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using kestrel::test::write_file;

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }


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

// The reply lengths of the "[prompt ... | reply N tokens ..." lines.
std::vector<int> reply_tokens(const std::string& err) {
  std::vector<int> n;
  for (size_t at = err.find("| reply "); at != std::string::npos; at = err.find("| reply ", at + 1))
    n.push_back(std::stoi(err.substr(at + 8)));
  return n;
}

// The raw template has no end-of-turn token: a reply ends at a blank line or after 256 tokens
// (a base model once ran 1,013 tokens to the end of the context), said once.
TEST_F(ChatCli, RawTemplateRepliesEnd) {
  const Result r = chat("the river\nthe mountain\n", "--template raw --ignore-eos");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string note = "note: the raw template has no end of turn: a reply ends at a blank "
                           "line or after 256 tokens";
  ASSERT_NE(r.err.find(note), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(note), r.err.rfind(note)) << r.err;
  const std::vector<int> n = reply_tokens(r.err);
  ASSERT_EQ(n.size(), 2u) << r.err;
  for (int x : n) EXPECT_LE(x, 256);
  // Shown replies hold no blank line (it ended them).
  EXPECT_EQ(r.out.find("\n\n"), std::string::npos) << r.out;
  // -n says otherwise; -q says nothing.
  const Result q = chat("the river\n", "--template raw --ignore-eos -n 7 -q");
  ASSERT_EQ(q.code, 0) << q.err;
  EXPECT_EQ(q.err, "");
}

// -r ends a reply right after the reverse prompt, shown, as llama-cli's -r.
TEST_F(ChatCli, ReversePromptEndsAReply) {
  const Result full = chat("the river\n", "--template raw -n 30 -q");
  ASSERT_EQ(full.code, 0) << full.err;
  std::istringstream words(full.out);
  std::string word;
  for (int i = 0; i < 3 && words >> word;) ++i;
  ASSERT_FALSE(word.empty()) << full.out;
  const Result r = chat("the river\n", "--template raw -n 30 -q -r '" + word + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, full.out.substr(0, full.out.find(word) + word.size()) + "\n");
}

// -n -1: a reply may run to the end of the context, as in generate.
TEST_F(ChatCli, MinusOneRepliesUpToTheContext) {
  const Result r = chat("the river\n", "--template llama2 --ignore-eos -n -1 -c 48");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("| context 48/48]"), std::string::npos) << r.err;
}

// Runs `argv` on a pseudo-terminal (stdin, stdout and stderr a terminal, NO_COLOR set), typing
// each input once the terminal shows a fresh "> " prompt and has been quiet for 100 ms (the
// editor waits for keys); returns all the terminal showed.
std::string on_terminal(const std::vector<std::string>& argv, const std::vector<std::string>& inputs) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, nullptr);
  if (pid == 0) {
    setenv("NO_COLOR", "1", 1);
    execv(args[0], args.data());
    _exit(127);
  }
  std::string shown;
  size_t sent = 0, answered = 0;  // the length of `shown` when the last input went
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{master, POLLIN, 0};
    if (poll(&p, 1, 100) > 0) {
      char buf[4096];
      const ssize_t n = read(master, buf, sizeof buf);
      if (n <= 0) break;  // the child closed the terminal: it ended
      shown.append(buf, n);
      continue;
    }
    if (sent < inputs.size() && shown.size() > answered && shown.ends_with("> ")) {
      const std::string& in = inputs[sent++];
      EXPECT_EQ(write(master, in.data(), in.size()), (ssize_t)in.size());
      answered = shown.size();
    }
  }
  close(master);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << shown;
  return shown;
}

// On a terminal the prompt edits lines and recalls them with libedit: the up arrow brings back
// the last message, where a plain read would take "^[[A" as the text.
TEST_F(ChatCli, TerminalPromptRecallsHistory) {
#ifndef KESTREL_HAVE_LIBEDIT
  GTEST_SKIP() << "built without libedit: the chat reads plain lines";
#endif
  const std::string shown = on_terminal(
      {kKestrel, "chat", "--device", "cpu", "-m", dir_->string(), "--temp", "0", "--template",
       "raw", "-n", "4", "-q"},
      {"the river\r", "\033[A\r", "\x04"});
  size_t times = 0;
  for (size_t at = shown.find("> the river"); at != std::string::npos;
       at = shown.find("> the river", at + 1))
    ++times;
  EXPECT_EQ(times, 2u) << shown;
  EXPECT_EQ(shown.find("^[[A"), std::string::npos) << shown;
}

TEST_F(ChatCli, OldestTurnsGoWhenTheContextFills) {
  const std::string turns =
      "the river is long\nthe mountain is high\nthe house is little\nthe water is deep\n";
  const Result r = chat(turns, "--template llama2 --system 'be brief' -c 64 -n 12");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("dropped"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("system prompt stays"), std::string::npos) << r.err;
  // Without a system prompt the note does not speak of one.
  const Result bare = chat(turns, "--template llama2 -c 64 -n 12");
  ASSERT_EQ(bare.code, 0) << bare.err;
  EXPECT_NE(bare.err.find("dropped"), std::string::npos) << bare.err;
  EXPECT_EQ(bare.err.find("system prompt"), std::string::npos) << bare.err;
}

TEST_F(ChatCli, EveryTemplateRuns) {
  for (const std::string t : {"llama2", "mistral", "zephyr", "chatml", "vicuna"}) {
    const Result r = chat("hello\n/system be brief\nhello again\n", "--template " + t + " -n 4 -q");
    EXPECT_EQ(r.code, 0) << t << ": " << r.err;
  }
}

// --chat-template-kwargs: extra variables of a Jinja template (generate --chat, chat, serve),
// as vLLM's chat_template_kwargs; what would do nothing or is not an object is one line.
TEST_F(ChatCli, TemplateKwargsReachTheTemplate) {
  const fs::path tmpl = scratch() / "chat_cli_kwargs.jinja", fixed = scratch() / "chat_cli_fixed.jinja";
  write_file(tmpl, "{% for m in messages %}{{ m.content }}\n{% endfor %}"
                   "{% if enable_thinking is defined and enable_thinking is false %}no thinking\n"
                   "{% endif %}{{ extra }}");
  write_file(fixed, "{% for m in messages %}{{ m.content }}\n{% endfor %}no thinking\nmore");
  const std::string gen = kKestrel + " generate --device cpu -m " + dir_->string() +
                          " -p hello -n 1 --temp 0 --json --chat --template ";
  const auto ids = [](const Result& r) {
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? json::parse(r.out)["prompt_ids"] : json();
  };
  const json plain = ids(run(gen + tmpl.string()));
  const json off = ids(run(gen + tmpl.string() +
                           " --chat-template-kwargs '{\"enable_thinking\": false, \"extra\": \"more\"}'"));
  EXPECT_NE(off, plain);
  EXPECT_EQ(off, ids(run(gen + fixed.string())));
  EXPECT_EQ(ids(run(gen + tmpl.string() + " --chat-template-kwargs '{\"enable_thinking\": true}'")),
            plain);
  // kestrel chat renders each turn with them.
  const Result c = chat("hello\n", "--template " + tmpl.string() +
                                      " --chat-template-kwargs '{\"enable_thinking\": false}' -n 2 -q");
  EXPECT_EQ(c.code, 0) << c.err;

  const auto one_line = [](const Result& r, const std::string& line) {
    EXPECT_EQ(r.code, 1);
    EXPECT_EQ(r.err, "kestrel: " + line + "\n");
    EXPECT_TRUE(r.out.empty()) << r.out;
  };
  const std::string m = " --device cpu -m " + dir_->string();
  one_line(run(gen + tmpl.string() + " --chat-template-kwargs '[1]'"),
           "--chat-template-kwargs: must be a JSON object of the template's variables, such as "
           "{\"enable_thinking\": false}, got [1]");
  one_line(run(kKestrel + " chat" + m + " --chat-template-kwargs '{oops' < /dev/null"),
           "--chat-template-kwargs: not valid JSON: {oops");
  one_line(run(kKestrel + " serve" + m + " --chat-template-kwargs '{\"messages\": []}'"),
           "--chat-template-kwargs: 'messages' cannot be set: Kestrel sets it");
  one_line(run(kKestrel + " generate" + m + " -p hi --chat-template-kwargs '{}'"),
           "--chat-template-kwargs goes with --chat");
  one_line(run(gen + "chatml --chat-template-kwargs '{}'"),
           "--chat-template-kwargs goes with a Jinja chat template (the model's own or "
           "--template FILE.jinja), not the chatml format");
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

// -o is written whole or not at all, and never over the batch file it reads (under any path).
TEST_F(ChatCli, BatchOutputIsNeverTheBatchFile) {
  const fs::path f = scratch() / "chat_cli_same.jsonl";
  const std::string prompts = "{\"prompt\": \"a b\", \"n_predict\": 2}\n";
  write_file(f, prompts);
  const fs::path link = scratch() / "chat_cli_same_link.jsonl";
  fs::create_hard_link(f, link);
  for (const fs::path& o : {f, scratch() / "." / f.filename(), link}) {
    const Result r = run(kKestrel + " generate --device cpu -q -m " + dir_->string() +
                         " --batch-file " + f.string() + " -o " + o.string());
    EXPECT_EQ(r.code, 1);
    EXPECT_EQ(r.err, "kestrel: -o " + o.string() + " is the batch file " + f.string() +
                         "; write the results to another file\n");
  }
  std::ifstream in(f);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), prompts);
}

TEST_F(ChatCli, FailingBatchWriteLeavesTheOldResults) {
  const fs::path f = scratch() / "chat_cli_fsize.jsonl";
  const fs::path o = scratch() / "chat_cli_fsize.out";
  write_file(f, "{\"prompt\": \"a b\", \"n_predict\": 2}\n");
  write_file(o, "old results\n");
  // Every file limited to 64 bytes, less than one result line: as a full disk.
  kestrel::test::Child c({kKestrel, "generate", "--device", "cpu", "-q", "-m", dir_->string(),
                          "--batch-file", f.string(), "-o", o.string()},
                         64);
  EXPECT_EQ(c.wait(), 1) << c.err;
  EXPECT_NE(c.err.find(o.string() + ": write failed: File too large"), std::string::npos) << c.err;
  std::ifstream in(o);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "old results\n");
  EXPECT_EQ(kestrel::test::staging_leftovers(scratch()), std::vector<std::string>{});
}

// The results replace a private file privately, and the temporary is created, never opened
// through a link: a symlink planted at its name (pid-derived, so predictable) is refused.
TEST_F(ChatCli, BatchOutputKeepsTheModeAndFollowsNoPlantedLink) {
  const fs::path f = scratch() / "chat_cli_mode.jsonl";
  const fs::path o = scratch() / "chat_cli_mode.out";
  write_file(f, "{\"prompt\": \"a b\", \"n_predict\": 2}\n");
  write_file(o, "old results\n");
  fs::permissions(o, fs::perms::owner_read | fs::perms::owner_write);
  kestrel::test::Child ok({kKestrel, "generate", "--device", "cpu", "-q", "-m", dir_->string(),
                           "--batch-file", f.string(), "-o", o.string()});
  EXPECT_EQ(ok.wait(), 0) << ok.err;
  EXPECT_EQ(fs::status(o).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);

  const fs::path victim = scratch() / "chat_cli_victim";
  write_file(victim, "untouched\n");
  kestrel::test::Child c({kKestrel, "generate", "--device", "cpu", "-q", "-m", dir_->string(),
                          "--batch-file", f.string(), "-o", o.string()},
                         -1, /*start_stopped=*/true);
  const fs::path tmp = kestrel::test::staged_temp(o, c.pid());
  fs::create_symlink(victim, tmp);
  c.signal_it(SIGCONT);
  EXPECT_EQ(c.wait(), 1) << c.err;
  EXPECT_NE(c.err.find(o.string() + ": cannot write"), std::string::npos) << c.err;
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "untouched\n");
  fs::remove(tmp);
}

// Ctrl-C in a batch: the old results stay as they were and the temporary is gone.
TEST_F(ChatCli, InterruptedBatchLeavesTheOldResults) {
  const fs::path f = scratch() / "chat_cli_interrupt.jsonl";
  const fs::path o = scratch() / "chat_cli_interrupt.out";
  std::string prompts;
  for (int i = 0; i < 200; ++i) prompts += "{\"prompt\": \"the river\", \"n_predict\": 64}\n";
  write_file(f, prompts);
  write_file(o, "old results\n");
  kestrel::test::Child c({kKestrel, "generate", "--device", "cpu", "-q", "--temp", "0",
                          "--ignore-eos", "-m", dir_->string(), "--batch-file", f.string(), "-o",
                          o.string()});
  const fs::path tmp = kestrel::test::staged_temp(o, c.pid());
  ASSERT_TRUE(c.wait_until([&] {
    std::error_code ec;
    return fs::file_size(tmp, ec) > 0 && !ec;  // a result line was written
  })) << "no results appeared";
  c.signal_it(SIGINT);
  EXPECT_EQ(c.wait(), 130);
  EXPECT_NE(c.err.find("interrupted"), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("nothing written to " + o.string()), std::string::npos) << c.err;
  std::ifstream in(o);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "old results\n");
  EXPECT_EQ(kestrel::test::staging_leftovers(scratch()), std::vector<std::string>{});
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
