// Chat formats rendered against strings written out by hand from each format's definition
// (the models' own Jinja templates), format detection on those templates, and tokenization
// that turns special tokens into their ids.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "tokenizer/chat_template.h"
#include "tests/support/tiny_tokenizer_suite.h"

#include "tests/support/fifo.h"
#include "tests/support/test_loader_util.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using namespace kestrel;

namespace {

const std::vector<ChatMessage> kConversation = {
    {"system", "You are terse."},
    {"user", "Hi"},
    {"assistant", "Hello!"},
    {"user", "How are you?"},
};

std::string render(ChatFormat f, const std::vector<ChatMessage>& m = kConversation,
                   bool gen = true) {
  return segments_text(render_chat(f, m, gen));
}

TEST(ChatTemplate, Llama2) {
  EXPECT_EQ(render(ChatFormat::llama2),
            "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
            "<s>[INST] How are you? [/INST]");
  EXPECT_EQ(render(ChatFormat::llama2, {{"user", "  Hi\n"}}), "<s>[INST] Hi [/INST]");
}

TEST(ChatTemplate, Mistral) {
  EXPECT_EQ(render(ChatFormat::mistral),
            "<s>[INST] You are terse.\n\nHi [/INST]Hello!</s>[INST] How are you? [/INST]");
  EXPECT_EQ(render(ChatFormat::mistral, {{"user", "Hi"}}), "<s>[INST] Hi [/INST]");
}

TEST(ChatTemplate, Zephyr) {
  EXPECT_EQ(render(ChatFormat::zephyr),
            "<|system|>\nYou are terse.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
            "<|user|>\nHow are you?</s>\n<|assistant|>\n");
  EXPECT_EQ(render(ChatFormat::zephyr, {{"user", "Hi"}}, false), "<|user|>\nHi</s>\n");
}

TEST(ChatTemplate, ChatML) {
  EXPECT_EQ(render(ChatFormat::chatml),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, Vicuna) {
  EXPECT_EQ(render(ChatFormat::vicuna),
            "You are terse. USER: Hi ASSISTANT: Hello!</s>USER: How are you? ASSISTANT:");
  EXPECT_EQ(render(ChatFormat::vicuna, {{"user", "Hi"}}), "USER: Hi ASSISTANT:");
}

TEST(ChatTemplate, Raw) {
  EXPECT_EQ(render(ChatFormat::raw), "You are terse.\nHi\nHello!\nHow are you?\n");
}

TEST(ChatTemplate, SpecialTokensAreSegmentsOfTheirOwn) {
  const auto seg = render_chat(ChatFormat::llama2, kConversation, true);
  const std::vector<ChatSegment> want = {
      {"<s>", true},
      {"[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! ", false},
      {"</s>", true},
      {"<s>", true},
      {"[INST] How are you? [/INST]", false}};
  EXPECT_EQ(seg, want);
  const auto chatml = render_chat(ChatFormat::chatml, {{"user", "Hi"}}, true);
  const std::vector<ChatSegment> want_chatml = {{"<|im_start|>", true}, {"user\nHi", false},
                                                {"<|im_end|>", true},   {"\n", false},
                                                {"<|im_start|>", true}, {"assistant\n", false}};
  EXPECT_EQ(chatml, want_chatml);
}

TEST(ChatTemplate, RolesMustAlternate) {
  EXPECT_THROW(render_chat(ChatFormat::chatml, {{"user", "a"}, {"user", "b"}}, true), Error);
  EXPECT_THROW(render_chat(ChatFormat::llama2, {{"assistant", "a"}}, true), Error);
}

TEST(ChatTemplate, NamesParse) {
  EXPECT_EQ(parse_chat_format("zephyr"), ChatFormat::zephyr);
  try {
    parse_chat_format("alpaca");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("alpaca"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("chatml"), std::string::npos);
  }
}

// The templates as the models ship them in tokenizer_config.json.
const char* kLlama2Jinja =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
    "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set "
    "system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] "
    "== 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != "
    "false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + "
    "message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif "
    "message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% "
    "endfor %}";
const char* kMistralJinja =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] "
    "' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ "
    "message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}";
const char* kZephyrJinja =
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + "
    "message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' "
    "+ message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ "
    "'<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and "
    "add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";
const char* kChatmlJinja =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}";
const char* kVicunaJinja =
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}{% endif %}{% for "
    "message in messages %}{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + "
    "' ' }}{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + "
    "eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}";
const char* kPhi3Jinja =
    "{% for message in messages %}{% if message['role'] == 'user' %}{{'<|user|>\n' + "
    "message['content'] + '<|end|>\n' + '<|assistant|>\n'}}{% elif message['role'] == 'assistant' "
    "%}{{message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}";
const char* kMistralV7Jinja =
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ "
    "'[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}{% elif message['role'] == "
    "'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}{% endif %}{% endfor %}";

TEST(ChatTemplate, DetectsTheShippedTemplates) {
  EXPECT_EQ(detect_chat_format(kLlama2Jinja), ChatFormat::llama2);
  EXPECT_EQ(detect_chat_format(kMistralJinja), ChatFormat::mistral);
  EXPECT_EQ(detect_chat_format(kZephyrJinja), ChatFormat::zephyr);
  EXPECT_EQ(detect_chat_format(kChatmlJinja), ChatFormat::chatml);
  EXPECT_EQ(detect_chat_format(kVicunaJinja), ChatFormat::vicuna);
  EXPECT_EQ(detect_chat_format(kPhi3Jinja), std::nullopt);
  EXPECT_EQ(detect_chat_format(kMistralV7Jinja), std::nullopt);
  EXPECT_EQ(detect_chat_format("{{ messages[0]['content'] }}"), std::nullopt);
}

// A tokenizer from kestrel-synth's small SentencePiece model (control pieces <s>, </s>).
class ChatTokenize : public kestrel::test::TinyTokenizerSuite {
 protected:
  void write_config(const nlohmann::json& extra) {
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(*dir_ / "tokenizer_config.json"));
    cfg.erase("chat_template");
    cfg.erase("added_tokens_decoder");
    for (const auto& [k, v] : extra.items()) cfg[k] = v;
    std::ofstream(*dir_ / "tokenizer_config.json") << cfg.dump(2);
  }
};

TEST_F(ChatTokenize, SpecialTokensBecomeIdsNotText) {
  const Tokenizer& tok = *tok_;
  ChatTemplate t(ChatFormat::llama2, tok);
  const std::vector<int> ids = t.tokenize(kConversation, true);
  // <s> [INST] ... </s> <s> [INST] ...: one BOS at the start (not doubled), EOS, BOS again.
  ASSERT_GE(ids.size(), 6u);
  EXPECT_EQ(ids[0], tok.bos_id());
  EXPECT_NE(ids[1], tok.bos_id());
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.bos_id()), 2);
  const int eos_id = tok.piece_to_id("</s>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), eos_id), 1);
  const auto eos = std::find(ids.begin(), ids.end(), eos_id);
  EXPECT_EQ(*(eos + 1), tok.bos_id());
  // The text segments are tokenized on their own, as SentencePiece does after a special token.
  const std::vector<int> first = tok.encode("[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! ", false);
  EXPECT_TRUE(std::equal(first.begin(), first.end(), ids.begin() + 1));
  EXPECT_EQ(tok.decode(ids).find("<s>"), std::string::npos);
}

TEST_F(ChatTokenize, FormatsWithoutBosInTheTemplateGetTheTokenizersBos) {
  ChatTemplate t(ChatFormat::zephyr, *tok_);
  const std::vector<int> ids = t.tokenize({{"user", "Hi"}}, true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], tok_->bos_id());
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok_->bos_id()), 1);
  // the </s> after the user message
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok_->piece_to_id("</s>")), 1);
}

TEST_F(ChatTokenize, ChatMLMarkersUseAddedTokensOrStayText) {
  // Without added tokens the markers are text, and <|im_end|> ends a reply as a stop string.
  ChatTemplate plain(ChatFormat::chatml, *tok_);
  EXPECT_EQ(plain.stop_strings(), std::vector<std::string>{"<|im_end|>"});
  EXPECT_TRUE(plain.stop_ids().empty());
  // With them (ids past the SentencePiece vocabulary, as ChatML models add them) they are ids.
  const int start = tok_->vocab_size(), end = start + 1;
  ChatTemplate added(ChatFormat::chatml, *tok_, {{"<|im_start|>", start}, {"<|im_end|>", end}});
  const std::vector<int> ids = added.tokenize({{"user", "Hi"}}, true);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), start), 2);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), end), 1);
  EXPECT_EQ(added.stop_ids(), std::vector<int>{end});
  EXPECT_TRUE(added.stop_strings().empty());
}

// The model's own template, rendered by the Jinja interpreter, gives the ids of the built-in
// format written by hand from it: two independent renderings of one format. The built-in
// formats without BOS in the template prepend the tokenizer's BOS (as llama.cpp does); the
// model's template adds nothing it does not write (as transformers' apply_chat_template).
TEST_F(ChatTokenize, LoadRendersTheModelsTemplate) {
  const std::vector<ChatMessage> no_system(kConversation.begin() + 1, kConversation.end());
  struct Case {
    const char* jinja;
    ChatFormat format;
    const std::vector<ChatMessage>* messages;
    bool builtin_adds_bos;
  };
  const std::map<std::string, int> im = {{"<|im_start|>", 9000}, {"<|im_end|>", 9001}};
  for (const Case& c : {Case{kLlama2Jinja, ChatFormat::llama2, &kConversation, false},
                        Case{kMistralJinja, ChatFormat::mistral, &no_system, false},
                        Case{kZephyrJinja, ChatFormat::zephyr, &kConversation, true},
                        Case{kChatmlJinja, ChatFormat::chatml, &kConversation, true},
                        Case{kVicunaJinja, ChatFormat::vicuna, &kConversation, true}}) {
    SCOPED_TRACE(std::string(chat_format_name(c.format)));
    nlohmann::json added = nlohmann::json::object();
    if (c.format == ChatFormat::chatml)
      for (const auto& [t, id] : im) added[std::to_string(id)] = {{"content", t}, {"special", true}};
    write_config({{"chat_template", c.jinja}, {"added_tokens_decoder", added}});
    const ChatTemplate t = ChatTemplate::load(dir_->string(), "auto", *tok_);
    EXPECT_TRUE(t.is_jinja());
    const ChatTemplate builtin(c.format, *tok_, c.format == ChatFormat::chatml ? im : std::map<std::string, int>{});
    for (bool gen : {true, false}) {
      if (!gen && (c.format == ChatFormat::llama2 || c.format == ChatFormat::mistral)) continue;  // no generation prompt in these
      std::vector<int> want = builtin.tokenize(*c.messages, gen);
      if (c.builtin_adds_bos) want.erase(want.begin());
      EXPECT_EQ(t.tokenize(*c.messages, gen), want) << t.render(*c.messages, gen);
    }
  }
  // ChatML's end of turn is a stop id.
  write_config({{"chat_template", kChatmlJinja},
                {"added_tokens_decoder", {{"9001", {{"content", "<|im_end|>"}, {"special", true}}}}}});
  EXPECT_EQ(ChatTemplate::load(dir_->string(), "auto", *tok_).stop_ids(), std::vector<int>{9001});
}

TEST_F(ChatTokenize, LoadChoosesTemplates) {
  write_config({{"chat_template", kZephyrJinja}});
  // An explicit name wins over the template.
  EXPECT_EQ(ChatTemplate::load(dir_->string(), "vicuna", *tok_).format(), ChatFormat::vicuna);
  EXPECT_FALSE(ChatTemplate::load(dir_->string(), "vicuna", *tok_).is_jinja());
  // The list form: the "default" entry.
  write_config({{"chat_template", nlohmann::json::array({{{"name", "tool_use"}, {"template", kPhi3Jinja}},
                                                         {{"name", "default"}, {"template", kChatmlJinja}}})}});
  EXPECT_NE(ChatTemplate::load(dir_->string(), "auto", *tok_).render({{"user", "Hi"}}, true)
                .find("<|im_start|>assistant\n"),
            std::string::npos);
  // A template file given with --template.
  const fs::path file = *dir_ / "phi3.jinja";
  std::ofstream(file) << kPhi3Jinja;
  EXPECT_EQ(ChatTemplate::load(dir_->string(), file.string(), *tok_).render({{"user", "Hi"}}, true),
            "<|user|>\nHi<|end|>\n<|assistant|>\n");
  // A template the interpreter refuses: an error naming the construct, the file and
  // --template, with the built-in format it looks like where it looks like one.
  for (const auto& [source, hint] :
       {std::pair<std::string, std::string>{std::string(kZephyrJinja) + "{% include 'x' %}", "--template zephyr"},
        {"{% include 'x' %}", "--template with a built-in format"}}) {
    write_config({{"chat_template", source}});
    try {
      ChatTemplate::load(dir_->string(), "auto", *tok_);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("include"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(hint), std::string::npos) << e.what();
    }
  }
  // A conversation the template refuses: its own message.
  write_config({{"chat_template", kMistralJinja}});
  try {
    ChatTemplate::load(dir_->string(), "auto", *tok_).tokenize(kConversation, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Conversation roles must alternate"), std::string::npos) << e.what();
  }
  // No template: raw, with a note.
  write_config(nlohmann::json::object());
  std::string note;
  EXPECT_EQ(ChatTemplate::load(dir_->string(), "auto", *tok_, &note).format(), ChatFormat::raw);
  EXPECT_NE(note.find("raw"), std::string::npos);
}

// chat_template_kwargs: extra variables of the model's template, as Qwen3's enable_thinking;
// a built-in format has none to set; what is not an object, or sets Kestrel's own variables,
// is refused in one line.
TEST_F(ChatTokenize, TemplateKwargsAreVariables) {
  write_config({{"chat_template",
                 "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}"
                 "<think>\n\n</think>\n\n{% endif %}{% endif %}{{ greeting }}"}});
  const ChatTemplate t = ChatTemplate::load(dir_->string(), "auto", *tok_);
  const std::vector<ChatMessage> hi = {{"user", "Hi"}};
  const std::string plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(t.render(hi, true), plain);
  EXPECT_EQ(t.render(hi, true, jinja::Json::object()), plain);
  EXPECT_EQ(t.render(hi, true, {{"enable_thinking", true}}), plain);
  EXPECT_EQ(t.render(hi, true, {{"enable_thinking", false}, {"greeting", "hello"}}),
            plain + "<think>\n\n</think>\n\nhello");
  EXPECT_NE(t.tokenize(hi, true, {{"enable_thinking", false}}), t.tokenize(hi, true));
  // A built-in format renders as it does without them.
  const ChatTemplate chatml(ChatFormat::chatml, *tok_);
  EXPECT_EQ(chatml.render(hi, true, {{"enable_thinking", false}}), chatml.render(hi, true));
  const auto refused = [&](const jinja::Json& kwargs, const std::string& part) {
    try {
      t.render(hi, true, kwargs);
      ADD_FAILURE() << "no error for " << kwargs.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
    EXPECT_THROW(chatml.tokenize(hi, true, kwargs), Error) << kwargs.dump();
  };
  refused(jinja::Json::array({1}), "must be a JSON object");
  refused("thinking", "must be a JSON object");
  refused({{"messages", jinja::Json::array()}}, "'messages' cannot be set");
  refused({{"add_generation_prompt", false}}, "'add_generation_prompt' cannot be set");
  refused({{"tools", jinja::Json::array()}}, "'tools' cannot be set");
}

// tokenizer_config.json and a --template file are read only when they are regular files: a
// FIFO blocked the load, a directory gave a C++ library message.
TEST_F(ChatTokenize, NonRegularFilesAreRefused) {
  const fs::path dir = *dir_ / "nonregular";
  fs::create_directories(dir);
  const std::string config = (dir / "tokenizer_config.json").string();
  kestrel::test::make_fifo(config);
  EXPECT_EQ(kestrel::test::error_without_blocking(
                config, [&] { ChatTemplate::load(dir.string(), "auto", *tok_); }),
            config + " is not a regular file (a FIFO)");
  fs::remove(config);
  const std::string jinja = (dir / "t.jinja").string();
  fs::create_directories(jinja);
  try {
    ChatTemplate::load(dir.string(), jinja, *tok_);
    ADD_FAILURE() << "a directory accepted as a template file";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), jinja + " is a directory");
  }
}

// A byte-level BPE model with Phi-3's template, whose markers strip the whitespace after them
// (rstrip): the chat ids are the ids of the rendered text as the tokenizer encodes it, which
// is how transformers' apply_chat_template tokenizes (added tokens matched in the text, with
// their lstrip/rstrip), and the newline after each marker is not a token of its own.
TEST(ChatTemplateBpe, RenderedTextIsTokenizedWhole) {
  kestrel::test::TempDir dir;
  nlohmann::json tj = nlohmann::json::parse(
      std::ifstream(std::string(KESTREL_TOKENIZER_FIXTURES) + "/byte_level/tokenizer.json"));
  int next = 0;
  for (const auto& [piece, id] : tj["model"]["vocab"].items()) next = std::max(next, id.get<int>() + 1);
  for (auto& t : tj["added_tokens"]) {
    next = std::max(next, t["id"].get<int>() + 1);
    if (t["content"] == "<|end|>") t["rstrip"] = true;
  }
  for (const char* marker : {"<|user|>", "<|assistant|>"})
    tj["added_tokens"].push_back({{"id", next++}, {"content", marker}, {"single_word", false},
                                  {"lstrip", false}, {"rstrip", true}, {"normalized", false},
                                  {"special", true}});
  std::ofstream(dir.file("tokenizer.json")) << tj.dump();
  std::ofstream(dir.file("tokenizer_config.json")) << nlohmann::json{{"chat_template", kPhi3Jinja}}.dump();
  const std::unique_ptr<Tokenizer> tok = Tokenizer::load(dir.str());
  const ChatTemplate t = ChatTemplate::load(dir.str(), "auto", *tok);
  const std::vector<ChatMessage> conv = {{"user", "Hi there"}, {"assistant", "Hello"}, {"user", "Bye"}};
  const std::string text = t.render(conv, true);
  EXPECT_EQ(text, "<|user|>\nHi there<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n");
  const std::vector<int> ids = t.tokenize(conv, true);
  EXPECT_EQ(ids, tok->encode(text, false));
  // rstrip: "\n" after a marker is swallowed by it, so the text between markers encodes alone.
  const std::vector<int> hi = tok->encode("Hi there", false);
  ASSERT_GE(ids.size(), hi.size() + 1);
  EXPECT_TRUE(std::equal(hi.begin(), hi.end(), ids.begin() + 1));
}

}  // namespace
