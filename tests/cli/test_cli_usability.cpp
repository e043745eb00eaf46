// The command line as a new user (often a llama.cpp user) meets it (issue 32): messages in one
// plain style, llama.cpp's habits (-s, -t, -e, -r, --no-display-prompt, --verbose, -n -1,
// --seed -1), options that would do nothing refused, Ctrl-C during generate, kestrel info,
// --version everywhere, and defaults that follow a model shorter than 2048 positions.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/gpu.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using kestrel::test::make_text;
using kestrel::test::write_file;

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;
const std::string kQuantize = KESTREL_QUANTIZE_BIN;
const std::string kDocsModel = std::string(KESTREL_DATA_DIR) + "/docs-llama-19m-gptq4";

int lines(const std::string& s) { return (int)std::count(s.begin(), s.end(), '\n'); }

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}



class Usability : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(scratch() / "usability_model");
    fs::remove_all(*dir_);
    const Result r = run(kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 --group-size 64 "
                                  "--seed 5 --quiet --out " + dir_->string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static std::string gen(const std::string& args) {
    return kKestrel + " generate --device cpu -m " + dir_->string() + " " + args;
  }
  static fs::path* dir_;
};
fs::path* Usability::dir_ = nullptr;

// One line on stderr that is exactly `line` (after "kestrel: "), exit code 1, nothing on stdout.
void expect_error(const Result& r, const std::string& line) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err, "kestrel: " + line + "\n");
  EXPECT_TRUE(r.out.empty()) << r.out;
}

// One line on stderr holding `part`, exit code 1.
void expect_error_with(const Result& r, const std::string& part) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("kestrel: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(part), std::string::npos) << r.err;
}

// ---- Messages ----------------------------------------------------------------------------

TEST_F(Usability, CommandLineMistakesInPlainWords) {
  expect_error(run(kKestrel + " server"),
               "unknown command 'server' (generate, chat, serve, bench, perplexity, tokenize, "
               "info, devices)");
  // No command: the usage as --help prints it, then the one error line, exit 1 (as git does).
  const Result none = run(kKestrel);
  EXPECT_EQ(none.code, 1);
  EXPECT_TRUE(none.out.empty()) << none.out;
  EXPECT_EQ(none.err.rfind(run(kKestrel + " --help").out, 0), 0u) << none.err;
  for (const char* cmd :
       {"generate", "chat", "serve", "bench", "perplexity", "tokenize", "info", "devices"})
    EXPECT_NE(none.err.find(std::string("\n  ") + cmd + " "), std::string::npos) << cmd;
  const std::string last = none.err.substr(none.err.rfind('\n', none.err.size() - 2) + 1);
  EXPECT_EQ(last,
            "kestrel: a command is required (generate, chat, serve, bench, perplexity, "
            "tokenize, info, devices); kestrel --help\n");
  // llama.cpp's multi-letter short options are not read as -n gl.
  expect_error(run(gen("-p hi -ngl 99")),
               "unknown option -ngl (the whole model runs on one device: --device cpu|cuda)");
  expect_error(run(gen("-p hi -fa")), "unknown option -fa");
  expect_error(run(gen("-p hi --no-such-flag")), "unknown option --no-such-flag");
  expect_error(run(gen("-p hi extra")), "unexpected argument 'extra'");
  expect_error(run(gen("-p")), "--prompt needs a value");
  expect_error_with(run(gen("-p a -f b")), " cannot be used together");
  expect_error_with(run(gen("-p a -f b")), "--prompt");
  expect_error(run(gen("-p \"\"")), "the prompt is empty");
  expect_error(run(gen("-f " + scratch().string())), scratch().string() + " is a directory");
  // Integers: the range, never "Could not convert".
  expect_error(run(gen("-p hi --top-k 99999999999999")),
               "--top-k: must be at most 2147483647, got 99999999999999");
  expect_error(run(gen("-p hi --top-k -1")), "--top-k: must be at least 0, got -1");
  expect_error(run(gen("-p hi -n 2.5")), "--n-predict: must be a whole number, got 2.5");
  expect_error(run(gen("-p hi -n 0")),
               "--n-predict: must be -1 (up to the context) or between 1 and 1073741824, got 0");
  expect_error(run(gen("-p hi -c 99999999999")),
               "--ctx-size: must be at most 2147483647, got 99999999999");
  expect_error(run(gen("-p hi -s -2")),
               "--seed: must be -1 (random) or between 0 and 18446744073709551615, got -2");
  // A flag cluster of real flags still works.
  EXPECT_EQ(run(gen("-p hi -n 2 --temp 0 -qe")).code, 0);
}

// -c far past what memory holds: the bytes the KV cache would need and what to do, before
// anything is allocated (the CPU engine would otherwise try terabytes).
TEST_F(Usability, ContextTooLargeForMemoryNamesTheBytes) {
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = run(gen("-p hi -c 1000000000"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(lines(r.err), 2) << r.err;  // the "longer than trained for" warning, then the error
  const std::string last = r.err.substr(r.err.find("kestrel: "));
  EXPECT_EQ(last.rfind("kestrel: -c 1000000000: the KV cache would need ", 0), 0u) << last;
  EXPECT_NE(last.find("TiB of host memory and "), std::string::npos) << last;
  EXPECT_NE(last.find("; use -c N with N up to "), std::string::npos) << last;
}

TEST_F(Usability, BatchLineJsonErrorsSayWhere) {
  const fs::path f = scratch() / "usability_bad.jsonl";
  write_file(f, "{\"prompt\": x}\n");
  const Result r = run(gen("--batch-file " + f.string()));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find(f.string() + ":1: not valid JSON (error at column 12)"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("json.exception"), std::string::npos) << r.err;
}

TEST(Version, EveryProgramAnswers) {
  std::vector<std::string> bins = {KESTREL_BIN, KESTREL_SYNTH_BIN, KESTREL_QUANTIZE_BIN};
#ifdef KESTREL_BENCH_GEMM_BIN
  bins.insert(bins.end(), {KESTREL_BENCH_GEMM_BIN, KESTREL_BENCH_GEMV_BIN,
                           KESTREL_BENCH_SAMPLING_BIN, KESTREL_BENCH_TOKENIZER_BIN});
#endif
  for (const std::string& bin : bins) {
    const Result r = run(bin + " --version");
    EXPECT_EQ(r.code, 0) << bin << ": " << r.err;
    EXPECT_EQ(r.out, fs::path(bin).filename().string() + " " + KESTREL_VERSION + "\n") << bin;
  }
}

// kestrel devices lists the CPU engine always, with -t's default team, then the CUDA GPU or
// why none is usable; exit 0 either way (scripts/test.sh looks for the "cuda: " line).
TEST(Devices, ListsTheCpuAlwaysAndTheGpuOrWhyNot) {
  const Result r = run("OMP_NUM_THREADS=1 " + kKestrel + " devices");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(lines(r.out), 2) << r.out;
  EXPECT_EQ(r.out.rfind("cpu: the CPU engine (fp32 reference), 1 thread\n", 0), 0u) << r.out;
  const std::string gpu = r.out.substr(r.out.find('\n') + 1);
  if (kestrel::test::gpu().usable)
    EXPECT_EQ(gpu.rfind("cuda: ", 0), 0u) << gpu;
  else
    EXPECT_EQ(gpu.rfind("cuda unusable: ", 0), 0u) << gpu;
  const Result many = run("OMP_NUM_THREADS=2 " + kKestrel + " devices");
#ifdef KESTREL_CPU_TEAMS
  const bool team = std::thread::hardware_concurrency() >= 2;
#else
  const bool team = false;  // built without OpenMP (the sanitized build): one thread always
#endif
  EXPECT_EQ(many.out.rfind(team ? "cpu: the CPU engine (fp32 reference), 2 threads\n"
                                : "cpu: the CPU engine (fp32 reference), 1 thread\n", 0), 0u)
      << many.out;
}

// The GPU benchmarks without a GPU say why as `kestrel devices` does.
TEST(Version, GpuBenchmarksWithoutAGpuSayItAsKestrelDoes) {
#ifndef KESTREL_BENCH_GEMM_BIN
  GTEST_SKIP() << "the benchmarks are not built (KESTREL_TEST_BENCHMARKS off)";
#else
  if (kestrel::test::gpu().usable) GTEST_SKIP() << "a GPU is present";
  const Result devices = run(kKestrel + " devices");
  ASSERT_EQ(devices.code, 0);
  // The reason, on the "cuda unusable: " line: "no usable CUDA GPU (...)".
  const std::string key = "\ncuda unusable: ";
  const size_t at = devices.out.find(key);
  ASSERT_NE(at, std::string::npos) << devices.out;
  const std::string problem =
      devices.out.substr(at + key.size(), devices.out.find('\n', at + 1) - at - key.size());
  EXPECT_EQ(problem.rfind("no usable CUDA GPU (", 0), 0u) << problem;
  for (const std::string bin : {KESTREL_BENCH_GEMM_BIN, KESTREL_BENCH_GEMV_BIN}) {
    const Result r = run(bin);
    EXPECT_EQ(r.code, 1) << bin;
    EXPECT_EQ(r.err, fs::path(bin).filename().string() + ": " + problem +
                         "; this benchmark measures GPU kernels\n");
  }
#endif
}

// ---- llama.cpp's habits ------------------------------------------------------------------

TEST_F(Usability, SeedSpellings) {
  const std::string args = "-p 'the river' -n 8 --temp 0.9 --json ";
  const json a = json::parse(run(gen(args + "-s 7")).out);
  const json b = json::parse(run(gen(args + "--seed 7")).out);
  EXPECT_EQ(a["seed"], 7);
  EXPECT_EQ(a["ids"], b["ids"]);
  // -1 is llama.cpp's "random": a fresh seed each run, never 2^64 - 1.
  const json r1 = json::parse(run(gen(args + "--seed -1")).out);
  const json r2 = json::parse(run(gen(args + "-s -1")).out);
  EXPECT_NE(r1["seed"], r2["seed"]);
  EXPECT_NE(r1["seed"].get<uint64_t>(), UINT64_MAX);
}

TEST_F(Usability, EscapesNoDisplayPromptAndVerbose) {
  // -e: "\t" in -p is a tab, as a file holding one.
  const fs::path f = scratch() / "usability_tab.txt";
  write_file(f, "a\tb\nc");
  const json file = json::parse(run(gen("-f " + f.string() + " -n 2 --temp 0 --json")).out);
  const json esc = json::parse(run(gen("-e -p 'a\\tb\\nc' -n 2 --temp 0 --json")).out);
  const json raw = json::parse(run(gen("-p 'a\\tb\\nc' -n 2 --temp 0 --json")).out);
  EXPECT_EQ(esc["prompt_ids"], file["prompt_ids"]);
  EXPECT_NE(raw["prompt_ids"], file["prompt_ids"]);

  // --no-display-prompt: the generated text alone.
  const Result text = run(gen("-p 'the river' -n 6 --temp 0 -q --no-display-prompt"));
  ASSERT_EQ(text.code, 0) << text.err;
  const json j = json::parse(run(gen("-p 'the river' -n 6 --temp 0 --json")).out);
  EXPECT_EQ(text.out, j["text"].get<std::string>() + "\n");

  // --verbose: the device and its threads (-t), the prompt's ids, the sampling.
  const Result v = run(gen("-p 'the river' -n 2 --temp 0 -t 1 --verbose"));
  ASSERT_EQ(v.code, 0) << v.err;
  EXPECT_NE(v.err.find(", 1 thread\n"), std::string::npos) << v.err;
  EXPECT_NE(v.err.find("prompt: " + std::to_string(j["prompt_ids"].size()) + " tokens: 1 "),
            std::string::npos)
      << v.err;
  EXPECT_NE(v.err.find("sampling: greedy (temp 0)\n"), std::string::npos) << v.err;
  expect_error_with(run(gen("-p hi -q --verbose")), " cannot be used together");
}

// -n -1 runs to the end of the context.
TEST_F(Usability, MinusOneGeneratesUpToTheContext) {
  const json j =
      json::parse(run(gen("-p 'the river' -n -1 -c 40 --ignore-eos --temp 0 --json")).out);
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_EQ(j["prompt_ids"].size() + j["ids"].size(), 40u);
}

// -r: the text ends right after the reverse prompt, which is printed (unlike --stop).
TEST_F(Usability, ReversePromptEndsTheText) {
  const json full = json::parse(run(gen("-p 'the river' -n 24 --temp 0 --json")).out);
  const std::string text = full["text"];
  std::istringstream words(text);
  std::string word;
  for (int i = 0; i < 3 && words >> word;) ++i;
  ASSERT_FALSE(word.empty()) << text;
  const json r = json::parse(run(gen("-p 'the river' -n 24 --temp 0 --json -r '" + word + "'")).out);
  EXPECT_EQ(r["finish_reason"], "stop");
  EXPECT_EQ(r["text"], text.substr(0, text.find(word) + word.size()));
}

// Options that would do nothing are refused, naming what they go with.
TEST_F(Usability, OptionsThatDoNothingAreRefused) {
  expect_error(run(gen("-p hi --logprobs 3")),
               "--logprobs goes with --json or --batch-file (streamed text has no room for it)");
  expect_error(run(gen("-p hi --system 'be brief'")), "--system goes with --chat");
  expect_error(run(gen("-p hi --template chatml")), "--template goes with --chat");
  expect_error(run(gen("-p hi -o out.jsonl")), "-o FILE goes with --batch-file");
  expect_error(run(gen("-p hi --json --no-display-prompt")),
               "--no-display-prompt goes with streamed text, not --json or --batch-file");
}

// kestrel-synth's GPTQ options without --dtype gptq would write an fp16 model as if they were
// not given: refused in one line, nothing written.
TEST(Synth, GptqOptionsWithoutGptqAreRefused) {
  const fs::path out = scratch() / "usability_synth_fp16";
  fs::remove_all(out);
  const std::string synth = kSynth + " --shape tiny --layers 1 --quiet --out " + out.string();
  for (const std::string opt :
       {"--bits 4", "--group-size 128", "--act-order", "--asym", "--format gptq_v2"}) {
    for (const std::string dtype : {"", " --dtype fp16"}) {
      SCOPED_TRACE(opt + dtype);
      const Result r = run(synth + dtype + " " + opt);
      EXPECT_EQ(r.code, 1);
      EXPECT_EQ(r.err, "kestrel-synth: " + opt.substr(0, opt.find(' ')) +
                           " goes with --dtype gptq (the default, fp16, is not quantized)\n");
      EXPECT_FALSE(fs::exists(out));
    }
  }
  // With --dtype gptq they are taken.
  EXPECT_EQ(run(synth + " --dtype gptq --bits 4 --group-size 64 --act-order").code, 0);
  EXPECT_TRUE(fs::exists(out / "quantize_config.json"));
  fs::remove_all(out);
}

TEST_F(Usability, HelpShowsDefaults) {
  const Result h = run(kKestrel + " generate --help");
  ASSERT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("=128\n"), std::string::npos) << h.out;  // -n
  EXPECT_NE(h.out.find("else 0.8)"), std::string::npos) << h.out;  // --temp
  EXPECT_NE(h.out.find("default -1"), std::string::npos) << h.out;  // --seed
  EXPECT_NE(h.out.find("=auto\n"), std::string::npos) << h.out;  // --device
}

// ---- Ctrl-C ------------------------------------------------------------------------------

// Runs `cmd` in the background with stdout and stderr to files, waits until the shell test
// `ready` holds, lets it run a moment, sends SIGINT and returns its exit status. A time limit
// keeps a signal that went astray from hanging the test.
int interrupt(const std::string& cmd, const fs::path& out, const fs::path& err,
              const std::string& ready) {
  const Result r = run("(timeout -s KILL 300 " + cmd + " > " + out.string() + " 2> " +
                       err.string() + " & pid=$!; i=0; until " + ready +
                       " || [ $i -ge 1200 ]; do sleep 0.05; i=$((i+1)); done; sleep 0.3; "
                       "kill -INT $pid; wait $pid; echo $?)");
  return std::stoi(r.out);
}

// At least n lines in a file (or in the files a glob names).
std::string has_lines(const std::string& files, int n) {
  return "[ \"$(cat " + files + " 2>/dev/null | wc -l)\" -ge " + std::to_string(n) + " ]";
}

TEST_F(Usability, CtrlCInGenerateStillPrintsThePerformance) {
  const fs::path out = scratch() / "usability_int.out", err = scratch() / "usability_int.err";
  const int code = interrupt(gen("-p 'the river' -n -1 -c 100000 --ignore-eos --temp 0"), out,
                             err, "[ -s " + out.string() + " ]");
  const std::string e = read_file(err);
  EXPECT_EQ(code, 130) << e;
  EXPECT_NE(e.find("perf: prompt eval time"), std::string::npos) << e;
  EXPECT_NE(e.find("kestrel: interrupted after "), std::string::npos) << e;
  EXPECT_TRUE(e.ends_with(" generated tokens\n")) << e;
  EXPECT_TRUE(read_file(out).ends_with("\n"));
}

TEST_F(Usability, CtrlCInABatchSaysHowManyPromptsRan) {
  const fs::path batch = scratch() / "usability_int.jsonl";
  write_file(batch,
             "{\"prompt\": \"a b\", \"n_predict\": 2}\n"
             "{\"prompt\": \"the river\", \"n_predict\": 90000}\n"
             "{\"prompt\": \"c d\", \"n_predict\": 2}\n");
  const fs::path out = scratch() / "usability_bint.out", err = scratch() / "usability_bint.err";
  const std::string cmd = gen("--batch-file " + batch.string() + " -c 100000 --ignore-eos --temp 0");
  const int code = interrupt(cmd, out, err, has_lines(out.string(), 1));
  const std::string e = read_file(err);
  EXPECT_EQ(code, 130) << e;
  EXPECT_NE(e.find("perf: prompt eval time"), std::string::npos) << e;
  EXPECT_TRUE(e.ends_with("kestrel: interrupted after 1 of 3 prompts\n")) << e;
  std::istringstream lines_in(read_file(out));
  std::vector<json> results;
  for (std::string l; std::getline(lines_in, l);) results.push_back(json::parse(l));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0]["finish_reason"], "length");
  EXPECT_EQ(results[1]["finish_reason"], "cancelled");

  // With -o the results file is left as it was.
  const fs::path o = scratch() / "usability_bint.results";
  write_file(o, "old\n");
  const int code_o = interrupt(cmd + " -o " + o.string(), out, err,
                               has_lines(o.string() + ".kestrel-tmp-*", 1));
  const std::string eo = read_file(err);
  EXPECT_EQ(code_o, 130) << eo;
  EXPECT_TRUE(eo.ends_with("kestrel: interrupted after 1 of 3 prompts; nothing written to " +
                           o.string() + "\n"))
      << eo;
  EXPECT_EQ(read_file(o), "old\n");
}

// ---- kestrel info -------------------------------------------------------------------------

// Family, shapes, format, size, context and tokenizer, from config.json, the safetensors
// headers and the tokenizer: weights whose every byte is garbage do not matter.
TEST_F(Usability, InfoReadsNoWeights) {
  const fs::path d = scratch() / "usability_info";
  fs::remove_all(d);
  fs::copy(*dir_, d);
  {
    std::fstream f(d / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;
    f.read(reinterpret_cast<char*>(&header), 8);
    const size_t data = fs::file_size(d / "model.safetensors") - 8 - header;
    f.seekp(8 + header);
    const std::string nan(data, '\xff');
    f.write(nan.data(), nan.size());
  }
  const json cfg = json::parse(read_file(d / "config.json"));
  const Result t = run(kKestrel + " info -m " + d.string());
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("family:    llama (LlamaForCausalLM)\n"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("format:    GPTQ 4-bit g64\n"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("shapes:    " + std::to_string(cfg["num_hidden_layers"].get<int>()) +
                       " layers, hidden " + std::to_string(cfg["hidden_size"].get<int>()) + ","),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("context:   " + std::to_string(cfg["max_position_embeddings"].get<int>()) +
                       " positions"),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("tokenizer: SentencePiece (tokenizer.model)"), std::string::npos) << t.out;
  const json j = json::parse(run(kKestrel + " info --json -m " + d.string()).out);
  EXPECT_EQ(j["layers"], cfg["num_hidden_layers"]);
  EXPECT_EQ(j["hidden"], cfg["hidden_size"]);
  EXPECT_EQ(j["vocab"], cfg["vocab_size"]);
  EXPECT_EQ(j["bits"], 4);
  EXPECT_EQ(j["group_size"], 64);
  EXPECT_EQ(j["tokenizer"], "sentencepiece");
  EXPECT_GT(j["size_bytes"].get<uint64_t>(), 0u);
  fs::remove_all(d);

  expect_error(run(kKestrel + " info -m /nonexistent/model"), "/nonexistent/model: no such model directory");
}

// ---- Defaults for models shorter than 2048 positions -------------------------------------

// perplexity's window defaults to min(2048, max_position_embeddings): 1024 on the docs model,
// the same figure as -c 1024 (at -c 2048 the model is scored past what it was trained for).
TEST(ShortModel, PerplexityWindowDefaultsToTheModelsContext) {
  const fs::path text = scratch() / "usability_ppl.txt";
  write_file(text, make_text(1500, 9));
  const std::string base = kKestrel + " perplexity --device cpu --chunks 1 -m " + kDocsModel +
                           " -f " + text.string();
  const Result d = run(base + " --json");
  ASSERT_EQ(d.code, 0) << d.err;
  const json j = json::parse(d.out);
  EXPECT_EQ(j["ctx"], 1024);
  const json e = json::parse(run(base + " --json -c 1024").out);
  EXPECT_EQ(j["perplexity"], e["perplexity"]);
  EXPECT_GT(j["perplexity_error"].get<double>(), 0.0);
  // The line shows the figure's standard error as llama-perplexity does.
  const Result line = run(base);
  char want[64];
  std::snprintf(want, sizeof want, "perplexity: %.4f +/- %.5f (1 of ", j["perplexity"].get<double>(),
                j["perplexity_error"].get<double>());
  EXPECT_EQ(line.out.rfind(want, 0), 0u) << line.out;
}

// kestrel-quantize's --seqlen defaults to min(2048, max_position_embeddings).
TEST(ShortModel, QuantizeSeqlenDefaultsToTheModelsContext) {
  const fs::path fp16 = scratch() / "usability_fp16", out = scratch() / "usability_q";
  fs::remove_all(fp16);
  fs::remove_all(out);
  const Result s = run(kSynth + " --shape tiny --layers 1 --dtype fp16 --max-pos 128 --seed 2 "
                                "--quiet --out " + fp16.string());
  ASSERT_EQ(s.code, 0) << s.err;
  const fs::path calib = scratch() / "usability_calib.txt";
  write_file(calib, make_text(600, 4));
  const Result q = run(kQuantize + " -q --device cpu --nsamples 2 -m " + fp16.string() +
                       " --calib " + calib.string() + " --out " + out.string());
  ASSERT_EQ(q.code, 0) << q.err;
  const json report = json::parse(read_file(out / "quantize_report.json"));
  EXPECT_EQ(report["calibration"]["seqlen"], 128);
  fs::remove_all(fp16);
  fs::remove_all(out);
}

}  // namespace
