// Structured output through the CLI (--grammar, --json-schema, --json-object): tiny random
// models, whose unconstrained text is noise, must give text the grammar accepts, judged by
// checkers that share no code with engine/grammar: python3-jsonschema
// (tests/support/validate_json_schema.py) for schemas, nlohmann::json for JSON objects and
// Python's re for GBNF. Greedy and sampled with several seeds, over a SentencePiece vocabulary
// (kestrel-synth's trained one, with byte fallback) and Qwen3's byte-level BPE vocabulary
// (scripts/fetch-test-tokenizers.sh). And every refusal is one line before the model loads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
using kestrel::test::write_file;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;

fs::path test_tokenizers() {
  const char* env = std::getenv("KESTREL_TEST_TOKENIZERS");
  return env && *env ? fs::path(env) : fs::path(KESTREL_TEST_TOKENIZERS);
}

// Bounded everywhere (string lengths, array sizes, whitespace), so that a random model
// reaches the end within -n.
const std::string kSchema =
    R"({"type":"object","properties":{"name":{"type":"string","minLength":1,"maxLength":6},)"
    R"("age":{"type":"integer","minimum":0,"maximum":150},)"
    R"("tags":{"type":"array","items":{"enum":["red","green","blue"]},"maxItems":2},)"
    R"("ok":{"type":"boolean"}},"required":["name","age","ok"],"additionalProperties":false})";

// The sampling settings of the runs: greedy, and sampled at temperature 1 with several seeds,
// with and without top-k (top-k alone is what the device would otherwise sample).
std::vector<std::string> samplings() {
  std::vector<std::string> s = {"--temp 0"};
  for (int seed = 1; seed <= 4; ++seed)
    s.push_back("--temp 1 --top-k 0 --top-p 1 --min-p 0 -s " + std::to_string(seed));
  s.push_back("--temp 1.5 --top-k 40 -s 9");
  return s;
}

class GrammarCli : public ::testing::TestWithParam<std::string> {
 protected:
  static void TearDownTestSuite() {
    for (const auto& [name, dir] : models_) fs::remove_all(dir);
    models_.clear();
  }
  // The parameter's model, written on first use (ctest runs each test in its own process, so
  // only the one it needs).
  static const fs::path& model() {
    const std::string name = GetParam();
    auto it = models_.find(name);
    if (it != models_.end()) return it->second;
    const fs::path dir = scratch() / ("grammar_" + name);
    fs::remove_all(dir);
    std::string cmd = kSynth + " --shape tiny --quiet --out " + dir.string();
    if (name == "qwen3") {
      const fs::path qt = test_tokenizers() / "qwen3";
      EXPECT_TRUE(fs::exists(qt / "tokenizer.json"))
          << qt << " is missing: run scripts/fetch-test-tokenizers.sh " << test_tokenizers().string();
      cmd += " --layers 1 --seed 6 --tokenizer " + qt.string();
    } else {
      cmd += " --layers 2 --seed 5";
    }
    const Result r = run(cmd);
    EXPECT_EQ(r.code, 0) << r.err;
    return models_.emplace(name, dir).first->second;
  }

  // kestrel generate --json with `args`; the parsed result.
  static json generate(const std::string& args, const std::string& device = "cpu") {
    const Result r = run(kKestrel + " generate --device " + device + " -m " + model().string() +
                         " -p 'the river' --json -q " + args);
    EXPECT_EQ(r.code, 0) << args << "\n" << r.err;
    if (r.code != 0) return json::object();
    return json::parse(r.out);
  }

  static inline std::map<std::string, fs::path> models_;
};

// Lines of `checker` (a command reading one case per line on stdin) for the given input.
std::vector<std::string> check_lines(const std::string& checker, const std::string& input) {
  const fs::path in = scratch() / "grammar_check.jsonl";
  write_file(in, input);
  const Result r = run(checker + " < " + in.string());
  EXPECT_EQ(r.code, 0) << r.err;
  std::vector<std::string> out;
  size_t at = 0;
  while (at < r.out.size()) {
    const size_t nl = r.out.find('\n', at);
    out.push_back(r.out.substr(at, nl - at));
    at = nl == std::string::npos ? r.out.size() : nl + 1;
  }
  return out;
}

TEST_P(GrammarCli, JsonSchemaOutputValidates) {
  const fs::path schema_file = scratch() / "grammar_schema.json";
  write_file(schema_file, kSchema);
  std::string cases;
  std::vector<std::string> texts;
  int i = 0;
  for (const std::string& s : samplings()) {
    // Inline and from a file, alternately.
    const std::string opt = i++ % 2 ? "--json-schema '" + kSchema + "'" : "--json-schema " + schema_file.string();
    const json j = generate("-n 400 " + opt + " " + s);
    ASSERT_TRUE(j.contains("text")) << s;
    EXPECT_TRUE(j["grammar_complete"].get<bool>()) << s << ": " << j.dump();
    EXPECT_NE(j["finish_reason"], "length") << s;
    texts.push_back(j["text"].get<std::string>());
    cases += json{{"schema", json::parse(kSchema)}, {"instance", texts.back()}}.dump() + "\n";
  }
  const auto verdicts = check_lines("python3 " KESTREL_SOURCE_DIR "/tests/support/validate_json_schema.py", cases);
  ASSERT_EQ(verdicts.size(), texts.size());
  for (size_t k = 0; k < texts.size(); ++k) EXPECT_EQ(verdicts[k], "ok") << texts[k];
  // Sampling with different seeds gives different documents (the mask is not a fixed path).
  std::sort(texts.begin(), texts.end());
  EXPECT_GE(std::unique(texts.begin(), texts.end()) - texts.begin(), 3) << "too few distinct outputs";
}

TEST_P(GrammarCli, JsonObjectOutputIsAnObject) {
  int complete = 0;
  for (const std::string& s : samplings()) {
    const json j = generate("-n 120 --json-object " + s);
    ASSERT_TRUE(j.contains("text")) << s;
    const std::string text = j["text"];
    if (!j["grammar_complete"].get<bool>()) {
      // Cut by -n (a random model may keep writing a key): then it must say so.
      EXPECT_EQ(j["finish_reason"], "length");
      continue;
    }
    ++complete;
    json parsed;
    ASSERT_NO_THROW(parsed = json::parse(text)) << text;
    EXPECT_TRUE(parsed.is_object()) << text;
  }
  EXPECT_GE(complete, 1);
}

// A GBNF grammar with a choice, a bounded repetition, a non-ASCII class and a literal, checked
// with Python's re.
TEST_P(GrammarCli, GbnfOutputMatchesTheGrammar) {
  const fs::path g = scratch() / "greeting.gbnf";
  write_file(g,
             "# a greeting\n"
             "root ::= greeting \" \" name (\", \" word)? \"!\"\n"
             "greeting ::= \"hello\" | \"hi\" | \"good day\"\n"
             "name ::= [A-Z] [a-z]{1,5}\n"
             "word ::= [α-ω]{2,4} | \"日本\"\n");
  std::string texts;
  for (const std::string& s : samplings()) {
    const json j = generate("-n 60 --grammar " + g.string() + " " + s);
    ASSERT_TRUE(j.contains("text")) << s;
    EXPECT_TRUE(j["grammar_complete"].get<bool>()) << s << ": " << j.dump();
    EXPECT_EQ(j["finish_reason"], "stop") << s;
    texts += json(j["text"]).dump() + "\n";
  }
  const auto verdicts = check_lines(
      "python3 -c \"import json, re, sys\n"
      "for line in sys.stdin:\n"
      "    t = json.loads(line)\n"
      "    print('ok' if re.fullmatch(r'(hello|hi|good day) [A-Z][a-z]{1,5}(, ([α-ω]{2,4}|日本))?!', t) else 'no: ' + t)\"",
      texts);
  ASSERT_EQ(verdicts.size(), samplings().size());
  for (const std::string& v : verdicts) EXPECT_EQ(v, "ok");
}

TEST_P(GrammarCli, TokenLimitCutsTheTextWithANote) {
  const Result r = run(kKestrel + " generate --device cpu -m " + model().string() +
                       " -p 'the river' -n 2 --temp 0 --json-object --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_FALSE(j["grammar_complete"].get<bool>());
  EXPECT_NE(r.err.find("note: the token limit (-n) ended the text before the grammar was complete"),
            std::string::npos)
      << r.err;
}

// Every line takes the command line's grammar, unless it has its own ("grammar",
// "json_schema", "json_object"), which a line's error reports before the model runs.
TEST_P(GrammarCli, BatchLinesTakeTheGrammar) {
  const fs::path batch = scratch() / "grammar_batch.jsonl";
  write_file(batch,
             "{\"prompt\": \"a\", \"seed\": 1, \"temperature\": 1}\n"
             "{\"prompt\": \"b\", \"temperature\": 0}\n"
             "{\"prompt\": \"c\", \"grammar\": \"root ::= [0-9]{2} \\\"!\\\"\", \"seed\": 2, \"temperature\": 1}\n"
             "{\"prompt\": \"d\", \"json_schema\": {\"enum\": [\"up\", \"down\"]}, \"temperature\": 0}\n"
             "{\"prompt\": \"e\", \"json_schema\": {\"type\": \"string\", \"not\": {}}}\n"
             "{\"prompt\": \"f\", \"grammar\": \"root ::= (\"}\n");
  const fs::path g = scratch() / "yesno.gbnf";
  write_file(g, "root ::= (\"yes\" | \"no\") \".\"\n");
  const Result r = run(kKestrel + " generate --device cpu -q -m " + model().string() + " --batch-file " +
                       batch.string() + " -n 20 --grammar " + g.string());
  EXPECT_EQ(r.code, 1) << r.err;  // two lines fail
  EXPECT_NE(r.err.find(":5: \"json_schema\": json schema: /: unsupported keyword 'not'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(":6: \"grammar\": grammar:1:11: expected ')'"), std::string::npos) << r.err;
  std::vector<json> out;
  for (size_t at = 0; at < r.out.size();) {
    const size_t nl = r.out.find('\n', at);
    out.push_back(json::parse(r.out.substr(at, nl - at)));
    at = nl + 1;
  }
  ASSERT_EQ(out.size(), 6u) << r.out;
  for (int k : {0, 1}) {
    const std::string t = out[k]["text"];
    EXPECT_TRUE(t == "yes." || t == "no.") << t;
    EXPECT_TRUE(out[k]["grammar_complete"].get<bool>());
  }
  const std::string digits = out[2]["text"];
  EXPECT_TRUE(digits.size() == 3 && std::isdigit((unsigned char)digits[0]) && std::isdigit((unsigned char)digits[1]) &&
              digits[2] == '!')
      << digits;
  // A JSON string, then at most the grammar's bounded whitespace.
  const std::string dir = out[3]["text"];
  EXPECT_TRUE(json::parse(dir) == "up" || json::parse(dir) == "down") << dir;
  EXPECT_TRUE(out[4].contains("error"));
  EXPECT_TRUE(out[5].contains("error"));
}

TEST_P(GrammarCli, ChatRepliesMatchTheGrammar) {
  const fs::path g = scratch() / "chat.gbnf";
  write_file(g, "root ::= \"[\" [0-9]{1,3} (\",\" [0-9]{1,3}){0,3} \"]\"\n");
  const Result r = run("printf 'one\\ntwo\\n' | " + kKestrel + " chat --device cpu -q --template chatml -m " +
                       model().string() + " -n 40 --temp 1 -s 3 --grammar " + g.string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto verdicts = check_lines(
      "python3 -c \"import re, sys\n"
      "for line in sys.stdin:\n"
      "    t = line.rstrip('\\\\n')\n"
      "    print('ok' if re.fullmatch(r'\\\\[[0-9]{1,3}(,[0-9]{1,3}){0,3}\\\\]', t) else 'no: ' + t)\"",
      r.out);
  ASSERT_EQ(verdicts.size(), 2u) << r.out;
  for (const std::string& v : verdicts) EXPECT_EQ(v, "ok");
}

// On the GPU, where the token would otherwise be chosen on the device: greedy and top-k.
TEST_P(GrammarCli, GpuJsonSchemaOutputValidates) {
  KESTREL_REQUIRE_GPU();
  std::string cases;
  for (const std::string& s : {std::string("--temp 0"), std::string("--temp 1 --top-k 40 -s 2")}) {
    const json j = generate("-n 400 --json-schema '" + kSchema + "' " + s, "cuda");
    ASSERT_TRUE(j.contains("text")) << s;
    EXPECT_TRUE(j["grammar_complete"].get<bool>()) << s;
    cases += json{{"schema", json::parse(kSchema)}, {"instance", j["text"]}}.dump() + "\n";
  }
  for (const std::string& v : check_lines("python3 " KESTREL_SOURCE_DIR "/tests/support/validate_json_schema.py", cases))
    EXPECT_EQ(v, "ok");
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, GrammarCli, ::testing::Values("sentencepiece", "qwen3"));

// Refusals: one line, exit 1, before the model loads (the model directory does not exist, so
// any attempt to load it would be the error instead).
void expect_refused(const std::string& args, const std::string& what) {
  const Result r = run(kKestrel + " " + args);
  EXPECT_EQ(r.code, 1) << args << "\n" << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("/no/such/model"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

// kestrel bench --json-object: greedy generation under the grammar after a random prompt, a
// row beside tg's and its cost against a plain step, in every output format.
TEST_P(GrammarCli, BenchTimesConstrainedDecoding) {
  // The bench's code is the same over any vocabulary; Qwen3's would add half a minute.
  if (GetParam() != "sentencepiece") GTEST_SKIP() << "timed on the SentencePiece vocabulary";
  const std::string args = " bench --device cpu -m " + model().string() + " -p 4 -n 24 -r 2 --json-object";
  const Result jr = run(kKestrel + args + " -o json");
  ASSERT_EQ(jr.code, 0) << jr.err;
  const json j = json::parse(jr.out);
  ASSERT_TRUE(j.contains("grammar")) << j.dump();
  const json& g = j["grammar"];
  EXPECT_EQ(g["kind"], "json-object");
  const auto samples = g["gen_tokens_per_s"]["samples"].get<std::vector<double>>();
  ASSERT_EQ(samples.size(), 2u);
  for (double x : samples) EXPECT_GT(x, 0.0);
  EXPECT_GE(g["generated_tokens"].get<int64_t>(), 4);  // at least two of each repetition's ids
  EXPECT_LE(g["generated_tokens"].get<int64_t>(), 2 * 24);
  const double step = g["step_ms"], plain = g["plain_step_ms"];
  EXPECT_NEAR(step, 1000.0 / g["gen_tokens_per_s"]["mean"].get<double>(), 1e-9 * step);
  EXPECT_NEAR(plain, 1000.0 / j["gen_tokens_per_s"]["mean"].get<double>(), 1e-9 * plain);
  EXPECT_NEAR(g["overhead"].get<double>(), step / plain - 1, 1e-9);

  const Result md = run(kKestrel + args);
  ASSERT_EQ(md.code, 0) << md.err;
  EXPECT_NE(md.out.find("| tg24+json-object |"), std::string::npos) << md.out;
  EXPECT_NE(md.out.find("constrained decoding (json-object): "), std::string::npos) << md.out;
  const Result csv = run(kKestrel + args + " -o csv");
  ASSERT_EQ(csv.code, 0) << csv.err;
  EXPECT_NE(csv.out.find(",tg24+json-object,"), std::string::npos) << csv.out;
}

TEST(GrammarCliRefusals, OneLineBeforeTheModelLoads) {
  const fs::path bad = scratch() / "bad.gbnf";
  write_file(bad, "root ::= \"a\" item\nitem ::= \"x\" ) \"y\"\n");
  const fs::path undefined = scratch() / "undefined.gbnf";
  write_file(undefined, "root ::= thing\n");
  const std::string m = " -m /no/such/model -p hi ";
  for (const char* cmd : {"generate", "chat"}) {
    const std::string base = std::string(cmd) + " --device cpu" + (std::string(cmd) == "chat" ? " -m /no/such/model " : m);
    expect_refused(base + "--grammar " + bad.string(), bad.string() + ":2:");
    expect_refused(base + "--grammar " + undefined.string(), "thing");
    expect_refused(base + "--grammar /no/such.gbnf", "/no/such.gbnf");
    expect_refused(base + "--json-schema '{\"type\":\"object\",\"not\":{}}'",
                   "--json-schema: json schema: /: unsupported keyword 'not'");
    expect_refused(base + "--json-schema '{\"type\":\"string\",\"pattern\":\"(?=x)\"}'", "json schema: /pattern");
    expect_refused(base + "--json-schema '{\"type\":'", "json schema: not valid JSON");
    expect_refused(base + "--json-object --grammar " + bad.string(), "cannot be used together");
    expect_refused(base + "--json-object --json-schema '{}'", "cannot be used together");
    expect_refused(base + "--json-object --spec lookup", "--spec does not go with");
  }
  // bench: the same refusals, and a grammar needs steps to time.
  const std::string bench = "bench --device cpu -m /no/such/model ";
  expect_refused(bench + "--grammar " + bad.string(), bad.string() + ":2:");
  expect_refused(bench + "--json-object --spec lookup --prompt hi", "--spec does not go with");
  expect_refused(bench + "--json-object -n 1", "-n must be at least 2");
  // The error's line and column, exactly: the stray ')' of line 2.
  const Result r = run(kKestrel + " generate" + m + "--grammar " + bad.string());
  EXPECT_EQ(r.err, "kestrel: " + bad.string() + ":2:14: unexpected ')'\n");
}

}  // namespace
