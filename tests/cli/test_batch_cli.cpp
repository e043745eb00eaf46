// Continuous batching as a user meets it: `kestrel serve --parallel 4 --batch-tokens 4` on a
// kestrel-synth model (CPU engine), several clients at once each getting the text it gets
// alone, clients joining and leaving mid-batch, a client that disconnects mid-stream; and
// `kestrel bench --batch`, its rows and JSON. Over plain sockets (tests/cli/serve_support.h).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/cli/serve_support.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;
using kestrel::test::body_of;
using kestrel::test::http;
using kestrel::test::scratch;
using kestrel::test::Server;
using kestrel::test::status_of;

namespace {

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;

class BatchCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new fs::path(scratch() / "batch_model");
    fs::remove_all(*model_);
    const auto r = kestrel::test::run_command(kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 "
                                              "--group-size 64 --seed 8 --quiet --out " + model_->string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*model_);
    delete model_;
  }
  static std::vector<std::string> args(std::vector<std::string> extra) {
    std::vector<std::string> a = {"-m", model_->string(), "--device", "cpu", "-c", "256", "--port", "0",
                                  "-t", "1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  static fs::path* model_;
};
fs::path* BatchCli::model_ = nullptr;

// Prompts of token ids with distinct first ids (no slot's cache shares a prefix with another's,
// so every prompt runs whole, in the same chunks, in both rounds), greedy and seeded sampled,
// of different lengths so that requests join and leave the batch at different steps.
std::vector<json> request_bodies() {
  std::vector<json> out;
  const int lengths[] = {9, 3, 6, 1, 11};
  const int max_tokens[] = {20, 7, 14, 25, 10};
  for (int i = 0; i < 5; ++i) {
    json ids = json::array();
    for (int k = 0; k < lengths[i]; ++k) ids.push_back(10 + 17 * i + 5 * k);
    json b = {{"prompt", ids}, {"max_tokens", max_tokens[i]}, {"ignore_eos", true}};
    if (i % 2 == 0) {
      b["temperature"] = 0;
    } else {
      b["temperature"] = 0.9;
      b["top_k"] = 30;
      b["seed"] = 100 + i;
      b["repeat_penalty"] = 1.2;
    }
    out.push_back(b);
  }
  return out;
}

std::string complete(int port, const json& body) {
  const std::string r = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"},
                             body.dump());
  if (status_of(r) != 200) return "HTTP " + std::to_string(status_of(r)) + ": " + body_of(r);
  return json::parse(body_of(r)).at("choices").at(0).at("text").get<std::string>();
}

TEST_F(BatchCli, ConcurrentClientsGetWhatTheyGetAlone) {
  const std::vector<json> bodies = request_bodies();
  std::vector<std::string> alone;
  {
    Server s(args({"--parallel", "4", "--batch-tokens", "4"}), "serve_alone");
    const int port = s.wait_listening();
    ASSERT_GT(port, 0) << s.log();
    for (const json& b : bodies) alone.push_back(complete(port, b));
  }
  for (const std::string& t : alone) {
    ASSERT_EQ(t.rfind("HTTP ", 0), std::string::npos) << t;
    EXPECT_FALSE(t.empty());  // a comparison of empty answers would prove nothing
  }
  Server s(args({"--parallel", "4", "--batch-tokens", "4"}), "serve_together");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  // Five clients on four slots, starting 15 ms apart: later ones join while earlier ones decode,
  // short ones leave while long ones go on, and the fifth waits in line for a slot.
  std::vector<std::string> together(bodies.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < bodies.size(); ++i)
    clients.emplace_back([&, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(15 * i));
      together[i] = complete(port, bodies[i]);
    });
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "client " << i;
}

// Connects, sends a streamed completion, reads until its first token's event, and closes.
void stream_and_hang_up(int port, const json& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  const std::string b = body.dump();
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
  ASSERT_EQ(write(fd, req.data(), req.size()), (ssize_t)req.size());
  std::string got;
  char buf[1024];
  ssize_t n;
  while (got.find("\"text\"") == std::string::npos && (n = read(fd, buf, sizeof buf)) > 0) got.append(buf, n);
  close(fd);
}

// A client that hangs up mid-stream is cancelled and leaves the batch; a request decoding
// beside it finishes whole, and every slot is free afterwards.
TEST_F(BatchCli, DisconnectedStreamLeavesTheBatch) {
  Server s(args({"--parallel", "2", "--batch-tokens", "4"}), "serve_cancel");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  json longer = {{"prompt", json::array({5, 6, 7})}, {"max_tokens", 240}, {"ignore_eos", true},
                 {"temperature", 0}, {"stream", true}};
  json other = {{"prompt", json::array({50, 60})}, {"max_tokens", 30}, {"ignore_eos", true},
                {"temperature", 0}};
  std::string text;
  std::thread t([&] { text = complete(port, other); });
  stream_and_hang_up(port, longer);
  t.join();
  EXPECT_EQ(text.rfind("HTTP ", 0), std::string::npos) << text;
  // The cancelled request's line in the access log, and both slots idle again.
  bool cancelled = false, idle = false;
  for (int i = 0; i < 200 && !(cancelled && idle); ++i) {
    cancelled = s.log().find("finish=cancelled") != std::string::npos;
    const std::string h = body_of(http(port, "GET /health HTTP/1.1"));
    idle = h.find("\"slots_idle\":2") != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_TRUE(cancelled) << s.log();
  EXPECT_TRUE(idle);
}

json usage_of(const std::string& response) { return json::parse(body_of(response)).at("usage"); }

// The value of a sample line `name value` of /metrics' text, -1 where there is none.
double metric(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
}

// Paged KV memory (--kv-pool, on by default at --parallel > 1): a prompt that begins as another
// request's maps that request's whole blocks, whichever slot ran it, and answers what it
// answers with a cache of its own per slot (--kv-pool 0); /metrics shows the pool.
TEST_F(BatchCli, APromptReusesAnotherRequestsBlocks) {
  json header = json::array();
  for (int k = 0; k < 40; ++k) header.push_back(20 + 3 * k);  // a system prompt, say
  auto prompt = [&](std::vector<int> tail) {
    json p = header;
    for (int id : tail) p.push_back(id);
    return p;
  };
  const json b_body = {{"prompt", prompt({7, 8, 9})}, {"max_tokens", 6}, {"temperature", 0},
                       {"ignore_eos", true}};
  std::string own_text;
  {
    Server s(args({"--parallel", "2", "--batch-tokens", "4", "--kv-pool", "0"}), "serve_kv_own");
    const int port = s.wait_listening();
    ASSERT_GT(port, 0) << s.log();
    EXPECT_EQ(s.log().find("KV pool"), std::string::npos) << s.log();
    const std::string r = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"},
                               b_body.dump());
    ASSERT_EQ(status_of(r), 200) << r;
    own_text = json::parse(body_of(r)).at("choices").at(0).at("text").get<std::string>();
    EXPECT_EQ(usage_of(r).at("prompt_tokens_details").at("cached_tokens"), 0);
  }
  Server s(args({"--parallel", "2", "--batch-tokens", "4"}), "serve_kv_pool");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  EXPECT_NE(s.log().find("2 slots of 256 tokens in a KV pool of 512 positions"), std::string::npos)
      << s.log();
  // A long request with the header holds one slot while the other request arrives.
  std::thread a([&] {
    complete(port, {{"prompt", prompt({4, 5})}, {"max_tokens", 200}, {"temperature", 0}, {"ignore_eos", true}});
  });
  // It runs, its prompt written: its 42 positions hold three blocks (more as it decodes).
  bool running = false;
  for (int i = 0; i < 2000 && !running; ++i) {
    const std::string m = body_of(http(port, "GET /metrics HTTP/1.1"));
    running = metric(m, "kestrel:num_requests_running") == 1 &&
              metric(m, "kestrel:kv_cache_blocks{state=\"held\"}") >= 3;
    if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(running);
  const std::string r = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"},
                             b_body.dump());
  a.join();
  ASSERT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(usage_of(r).at("prompt_tokens_details").at("cached_tokens"), 32);  // two whole blocks
  EXPECT_EQ(json::parse(body_of(r)).at("choices").at(0).at("text").get<std::string>(), own_text);
  const std::string m = body_of(http(port, "GET /metrics HTTP/1.1"));
  EXPECT_NE(m.find("kestrel:kv_cache_blocks{state=\"held\"} 0"), std::string::npos) << m;
  EXPECT_EQ(m.find("kestrel:kv_cache_blocks{state=\"cached\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("kestrel:kv_cache_reserved_blocks 0"), std::string::npos) << m;
}

// Requests that together need more than the pool wait for each other, and all are answered.
TEST_F(BatchCli, RequestsBeyondThePoolWaitTheirTurn) {
  Server s(args({"--parallel", "3", "--batch-tokens", "8", "--kv-pool", "256"}), "serve_kv_small");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  std::vector<std::string> texts(3);
  std::vector<std::thread> clients;
  std::atomic<int> done{0};
  for (int i = 0; i < 3; ++i)  // no max_tokens: each reserves a whole context, the whole pool
    clients.emplace_back([&, i] {
      texts[i] = complete(port, {{"prompt", json::array({30 + i, 40 + i})}, {"temperature", 0},
                                 {"max_tokens", nullptr}, {"ignore_eos", true}});
      ++done;
    });
  // While they run, one at a time: never two running, and the others waiting in line.
  int most_running = 0, most_waiting = 0;
  while (done < 3) {
    const std::string m = body_of(http(port, "GET /metrics HTTP/1.1"));
    most_running = std::max(most_running, (int)metric(m, "kestrel:num_requests_running"));
    most_waiting = std::max(most_waiting, (int)metric(m, "kestrel:num_requests_waiting"));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (std::thread& t : clients) t.join();
  for (const std::string& t : texts) EXPECT_EQ(t.rfind("HTTP ", 0), std::string::npos) << t;
  EXPECT_EQ(most_running, 1);
  EXPECT_GE(most_waiting, 1);
  auto r = kestrel::test::run_command(kKestrel + " serve -m " + model_->string() +
                                      " --device cpu -c 256 --parallel 2 --kv-pool 100 < /dev/null");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--kv-pool 100: fewer positions than one request may hold (-c 256)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(kestrel::test::lines(r.err), 1) << r.err;
}

// A launcher that always passes --kv-pool 0 (a cache per slot) or the default -1 works with one
// slot too: only a positive pool asks for what one slot does not do.
TEST_F(BatchCli, OneSlotTakesTheKvPoolsNoneAndDefault) {
  for (const char* v : {"0", "-1"}) {
    Server s(args({"--parallel", "1", "--kv-pool", v}), std::string("serve_one_slot_") + v);
    const int port = s.wait_listening();
    EXPECT_GT(port, 0) << v << ": " << s.log();
  }
}

TEST_F(BatchCli, BadBatchOptionsAreOneLine) {
  auto r = kestrel::test::run_command(kKestrel + " serve -m " + model_->string() +
                                      " --device cpu --parallel 2 --batch-tokens 0 < /dev/null");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--batch-tokens"), std::string::npos) << r.err;
  EXPECT_EQ(kestrel::test::lines(r.err), 1) << r.err;
  r = kestrel::test::run_command(kKestrel + " serve -m " + model_->string() +
                                 " --device cpu --kv-pool 4096 < /dev/null");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--kv-pool goes with --parallel > 1"), std::string::npos) << r.err;
  EXPECT_EQ(kestrel::test::lines(r.err), 1) << r.err;
  // Not a number, past what a pool holds, more than the host's memory: one line each, before
  // anything is allocated (a pool of 2e9 positions once took 30 s and 8 GB to fail).
  for (const auto& [arg, says] :
       {std::pair<std::string, std::string>{"abc", "not a number: 'abc'"},
        {"3000000000", "must be between -1 and 2147483632"},
        {"2147483632", "--kv-pool 2147483632: its KV cache would need"}}) {
    r = kestrel::test::run_command(kKestrel + " serve -m " + model_->string() +
                                   " --device cpu -q -t 1 --port 0 --parallel 2 --kv-pool " +
                                   arg + " < /dev/null");
    EXPECT_NE(r.code, 0) << arg;
    EXPECT_NE(r.err.find(says), std::string::npos) << arg << ": " << r.err;
    EXPECT_EQ(kestrel::test::lines(r.err), 1) << r.err;
  }
  r = kestrel::test::run_command(kKestrel + " bench -m " + model_->string() +
                                 " --device cpu --batch 0,4 < /dev/null");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--batch"), std::string::npos) << r.err;
  EXPECT_EQ(kestrel::test::lines(r.err), 1) << r.err;
}

TEST_F(BatchCli, BenchBatchPrintsRowsAndJson) {
  const std::string cmd = kKestrel + " bench -m " + model_->string() +
                          " --device cpu -t 1 -p 8 -n 6 -r 2 --batch 1,3";
  auto r = kestrel::test::run_command(cmd);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* test : {" tg6 b1 total |", " tg6 b1 each |", " tg6 b3 total |", " tg6 b3 each |"})
    EXPECT_NE(r.out.find(test), std::string::npos) << test << "\n" << r.out;
  r = kestrel::test::run_command(cmd + " -o json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j.at("batch").size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const json& b = j["batch"][i];
    EXPECT_EQ(b.at("batch").get<int>(), i == 0 ? 1 : 3);
    const double total = b.at("gen_tokens_per_s").at("mean").get<double>();
    const double each = b.at("per_stream_tokens_per_s").at("mean").get<double>();
    EXPECT_GT(each, 0);
    EXPECT_EQ(b.at("gen_tokens_per_s").at("samples").size(), 2u);
    // The aggregate is the batch's streams together: B times each stream's rate.
    EXPECT_NEAR(total, each * b["batch"].get<int>(), 1e-6 * total);
  }
}

}  // namespace
