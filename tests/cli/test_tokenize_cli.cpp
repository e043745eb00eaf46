// kestrel tokenize as a user runs it, on the hand-made SentencePiece-style tokenizer.json of
// tests/data/tokenizers/ (its ids are worked out in tests/unit/test_bpe_fixtures.cpp) and on
// the real Qwen3 and Llama 3 files that scripts/fetch-test-tokenizers.sh fetches; and kestrel
// generate and chat on model directories whose only tokenizer is a tokenizer.json.
#include <gtest/gtest.h>

#include <algorithm>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/server/request.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Result = kestrel::test::CommandResult;
using kestrel::test::scratch;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;
const fs::path kSpStyle = fs::path(KESTREL_TOKENIZER_FIXTURES) / "sentencepiece_style";

// The real tokenizers (scripts/fetch-test-tokenizers.sh); a test that needs them fails
// without them.
fs::path real_tokenizer(const std::string& name) {
  const char* env = std::getenv("KESTREL_TEST_TOKENIZERS");
  const fs::path dir = (env && *env ? fs::path(env) : fs::path(KESTREL_TEST_TOKENIZERS)) / name;
  if (!fs::exists(dir / "tokenizer.json"))
    ADD_FAILURE() << dir << " has no tokenizer.json: run scripts/fetch-test-tokenizers.sh "
                  << dir.parent_path() << " (scripts/test.sh does)";
  return dir;
}

fs::path write_file(const std::string& name, const std::string& text) {
  const fs::path p = scratch() / name;
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

std::vector<int> ids_of(const Result& r) {
  EXPECT_EQ(r.code, 0) << r.err;
  return r.code == 0 ? json::parse(r.out)["ids"].get<std::vector<int>>() : std::vector<int>{};
}

void expect_one_line_error(const Result& r, const std::string& what) {
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  EXPECT_EQ(r.err.rfind("kestrel", 0), 0u) << r.err;
}

TEST(TokenizeCli, LinesJsonCountAndNoBos) {
  const std::string cmd = kKestrel + " tokenize -m " + kSpStyle.string();
  Result r = run(cmd + " -p 'hello world'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "     1  <s>\n   271  \xE2\x96\x81hello\n   276  \xE2\x96\x81world\n");
  r = run(cmd + " -p 'hello world' --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["ids"], json({1, 271, 276}));
  EXPECT_EQ(j["pieces"], json({"<s>", "\xE2\x96\x81hello", "\xE2\x96\x81world"}));
  EXPECT_EQ(ids_of(run(cmd + " -p 'hello world' --json --no-bos")), (std::vector<int>{271, 276}));
  r = run(cmd + " -p 'hello world' --count");
  EXPECT_EQ(r.out, "3\n");
  const fs::path f = write_file("tokenize.txt", "hello world");
  EXPECT_EQ(ids_of(run(cmd + " -f " + f.string() + " --json")), (std::vector<int>{1, 271, 276}));
}

// --messages renders the chat template with the generation prompt and tokenizes the result as
// `kestrel chat` runs it: a model's own template as transformers' apply_chat_template does
// (special-token strings as their ids, no BOS but the template's own), a built-in format with
// the tokenizer's BOS in front, as llama.cpp generates from its built-in templates.
TEST(TokenizeCli, MessagesRenderTheChatTemplate) {
  const fs::path messages = write_file(
      "messages.json",
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])");
  const fs::path qwen = real_tokenizer("qwen3");  // a ChatML template
  const std::vector<int> rendered =
      ids_of(run(kKestrel + " tokenize -m " + qwen.string() + " --messages " + messages.string() +
                 " --json"));
  const fs::path text = write_file(
      "rendered.txt",
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
      "<|im_start|>assistant\n");
  EXPECT_EQ(rendered,
            ids_of(run(kKestrel + " tokenize -m " + qwen.string() + " -f " + text.string() +
                       " --json")));
  ASSERT_FALSE(rendered.empty());
  EXPECT_EQ(rendered.front(), 151644);  // <|im_start|>

  // The raw format writes no BOS: the tokenizer's goes in front, as chat runs it (--no-bos
  // leaves it out); the Llama 2 format writes its own, and gets no second.
  const fs::path hello = write_file("hello.json", R"([{"role": "user", "content": "hello"}])");
  const std::string cmd = kKestrel + " tokenize -m " + kSpStyle.string() + " --json --messages " +
                          hello.string();
  EXPECT_EQ(ids_of(run(cmd + " --template raw")), (std::vector<int>{1, 271, 3 + '\n'}));
  EXPECT_EQ(ids_of(run(cmd + " --template raw --no-bos")), (std::vector<int>{271, 3 + '\n'}));
  const std::vector<int> llama2 = ids_of(run(cmd + " --template llama2"));
  ASSERT_FALSE(llama2.empty());
  EXPECT_EQ(llama2.front(), 1);
  EXPECT_EQ(std::count(llama2.begin(), llama2.end(), 1), 1);
}

TEST(TokenizeCli, BadInputsAreOneLine) {
  const std::string cmd = kKestrel + " tokenize -m " + kSpStyle.string();
  expect_one_line_error(run(kKestrel + " tokenize -m /nonexistent/model -p hi"),
                        "/nonexistent/model");
  expect_one_line_error(run(cmd), "one of -p, -f or --messages");
  expect_one_line_error(run(cmd + " -p hi -f x.txt"), "cannot be used together");
  expect_one_line_error(run(cmd + " -p hi --template chatml"), "--template goes with --messages");
  const fs::path bad = write_file("bad.json", R"({"role": "user"})");
  expect_one_line_error(run(cmd + " --messages " + bad.string()), bad.string());
  const fs::path bad2 = write_file("bad2.json", R"([{"role": "user", "content": 3}])");
  expect_one_line_error(run(cmd + " --messages " + bad2.string()), "messages[0].content");
  const fs::path no_tok = scratch() / "no_tokenizer";
  fs::create_directories(no_tok);
  expect_one_line_error(run(kKestrel + " tokenize -m " + no_tok.string() + " -p hi"),
                        "no tokenizer");
}

// --messages reads a conversation by the server's rules (engine/server/messages.h): OpenAI's
// `developer` role is the system role and text content parts are joined, so a conversation
// written either way tokenizes to the same ids (the ChatML format writes the role's name, so a
// developer role kept as such would give other ids).
TEST(TokenizeCli, MessagesTakeDeveloperAndContentParts) {
  const std::string cmd =
      kKestrel + " tokenize -m " + kSpStyle.string() + " --template chatml --json --messages ";
  const fs::path plain = write_file(
      "plain.json",
      R"([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}])");
  const fs::path openai = write_file(
      "openai.json",
      R"([{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
          {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}])");
  const std::vector<int> want = ids_of(run(cmd + plain.string()));
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(ids_of(run(cmd + openai.string())), want);
}

// A conversation the server refuses is refused by tokenize --messages in the server's words,
// after the file's name, with the server's indexes (messages[0] is the first).
TEST(TokenizeCli, MessagesErrorsAreTheServers) {
  const std::string cmd = kKestrel + " tokenize -m " + kSpStyle.string() + " --messages ";
  const std::vector<std::string> conversations = {
      R"([])",
      R"({"role": "user", "content": "hi"})",
      R"([{"role": "user", "content": "hi"}, "text"])",
      R"([{"role": "user", "content": "hi"}, {"content": "x"}])",
      R"([{"role": "tool", "content": "42"}])",
      R"([{"role": "user", "content": 3}])",
      R"([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])",
      R"([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}])",
  };
  for (size_t i = 0; i < conversations.size(); ++i) {
    std::string server_says;
    try {
      kestrel::server::parse_completion_request(
          kestrel::server::Endpoint::Chat,
          R"({"messages": )" + conversations[i] + "}", kestrel::server::RequestDefaults{}, 1);
    } catch (const kestrel::server::ApiError& e) {
      server_says = e.what();
    }
    ASSERT_NE(server_says, "") << conversations[i] << ": the server took it";
    const fs::path f = write_file("refused" + std::to_string(i) + ".json", conversations[i]);
    const Result r = run(cmd + f.string());
    EXPECT_EQ(r.code, 1) << conversations[i];
    EXPECT_EQ(r.err, "kestrel: " + f.string() + ": " + server_says + "\n") << conversations[i];
  }
}

// A kestrel-synth model whose tokenizer.model is replaced by a tokenizer.json.
fs::path model_with_tokenizer_json(const std::string& name, const fs::path& tokenizer_dir,
                                   int vocab) {
  const fs::path dir = scratch() / name;
  fs::remove_all(dir);
  const Result r = run(kSynth + " --shape custom --hidden 64 --intermediate 128 --layers 1 "
                                "--heads 2 --kv-heads 1 --max-pos 256 --vocab " +
                       std::to_string(vocab) + " --seed 5 --quiet --out " + dir.string());
  EXPECT_EQ(r.code, 0) << r.err;
  fs::remove(dir / "tokenizer.model");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(tokenizer_dir / f))
      fs::copy_file(tokenizer_dir / f, dir / f, fs::copy_options::overwrite_existing);
  return dir;
}

TEST(TokenizerJsonModel, GeneratesAndChats) {
  const fs::path dir = model_with_tokenizer_json("tokjson_model", kSpStyle, 1024);
  Result r = run(kKestrel + " generate --device cpu -m " + dir.string() +
                 " -p 'hello world' -n 6 --temp 0 --ignore-eos --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["prompt_ids"], json({1, 271, 276}));
  EXPECT_EQ(j["ids"].size(), 6u);
  // The streamed text is the decoding of the ids, whatever they are.
  const Result text = run(kKestrel + " generate --device cpu -m " + dir.string() +
                          " -p 'hello world' -n 6 --temp 0 --ignore-eos -q");
  EXPECT_EQ(text.out, "hello world" + j["text"].get<std::string>() + "\n");
  const fs::path in = write_file("chat_in.txt", "hello\nworld\n");
  r = run(kKestrel + " chat --device cpu -m " + dir.string() +
          " --template chatml --temp 0 -n 4 < " + in.string());
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST(TokenizerJsonModel, Llama3Tokenizer) {
  const fs::path dir = model_with_tokenizer_json("llama3_model", real_tokenizer("llama3"), 128256);
  const Result r = run(kKestrel + " generate --device cpu -m " + dir.string() +
                       " -p 'Hello world' -n 4 --temp 0 --ignore-eos --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["prompt_ids"], json({128000, 9906, 1917}));
  // Its own chat template (Llama 3.1's, from tokenizer_config.json): generate --chat prompts
  // with the ids tokenize --messages prints, which begin with <|begin_of_text|> and
  // <|start_header_id|> and close the user's turn with <|eot_id|>; chat runs on it.
  const fs::path msgs = write_file("llama3_msgs.json", R"([{"role": "user", "content": "hi"}])");
  const Result chat = run(kKestrel + " generate --device cpu -m " + dir.string() +
                          " --chat -p hi -n 2 --temp 0 --ignore-eos --json");
  ASSERT_EQ(chat.code, 0) << chat.err;
  const Result tokens = run(kKestrel + " tokenize -m " + dir.string() + " --messages " +
                            msgs.string() + " --json");
  ASSERT_EQ(tokens.code, 0) << tokens.err;
  const json ids = json::parse(chat.out)["prompt_ids"];
  EXPECT_EQ(ids, json::parse(tokens.out)["ids"]);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], 128000);
  EXPECT_EQ(ids[1], 128006);
  EXPECT_NE(std::find(ids.begin(), ids.end(), json(128009)), ids.end());
  const fs::path in = write_file("llama3_chat_in.txt", "hello\n");
  const Result talk = run(kKestrel + " chat --device cpu -m " + dir.string() + " --temp 0 -n 2 < " +
                          in.string());
  EXPECT_EQ(talk.code, 0) << talk.err;
  // A vocabulary larger than the model's is refused before the weights load.
  const fs::path small = model_with_tokenizer_json("llama3_small", real_tokenizer("llama3"), 1024);
  expect_one_line_error(run(kKestrel + " generate --device cpu -m " + small.string() + " -p hi"),
                        "128256 tokens");
}

}  // namespace
