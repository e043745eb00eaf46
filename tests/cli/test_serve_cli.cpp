// kestrel serve as a user starts it, at its door: where the API key comes from and what is
// refused before the model loads (an empty key, a port in use), the lines it prints about auth,
// and the answers that carry auth's header or an error's code. The real binary on a
// kestrel-synth model, on the CPU engine, driven over a plain socket; the requests' bodies and
// the generations are tests/cli/serve_e2e.sh's.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/cli/serve_support.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;

namespace {

using kestrel::test::read_file;
using kestrel::test::scratch;
using kestrel::test::write_file;
using Result = kestrel::test::CommandResult;

const std::string kKestrel = KESTREL_BIN;
const std::string kSynth = KESTREL_SYNTH_BIN;

using kestrel::test::lines;

using kestrel::test::Server;
using kestrel::test::body_of;
using kestrel::test::has_header;
using kestrel::test::http;
using kestrel::test::rss_bytes;
using kestrel::test::status_of;

// A port that something else holds: a socket of the test's, bound and listening.
class TakenPort {
 public:
  TakenPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(fd_, 1);
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~TakenPort() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1, port_ = 0;
};

class ServeCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new fs::path(scratch() / "model");
    broken_ = new fs::path(scratch() / "broken");
    fs::remove_all(*model_);
    const Result r = kestrel::test::run_command(
        kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 --group-size 64 --seed 3 --quiet --out " +
        model_->string());
    ASSERT_EQ(r.code, 0) << r.err;
    // A model whose weights cannot be read: what is refused before the weights load is
    // refused the same with it, and the weights' error would show that they were read first.
    fs::remove_all(*broken_);
    fs::copy(*model_, *broken_);
    for (const auto& e : fs::directory_iterator(*broken_))
      if (e.path().extension() == ".safetensors") fs::resize_file(e.path(), 100);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*model_);
    fs::remove_all(*broken_);
    delete model_;
    delete broken_;
  }
  static Result serve(const std::string& args, const std::string& env = "") {
    return kestrel::test::run_command(env + " " + kKestrel + " serve --device cpu " + args + " < /dev/null");
  }
  static std::vector<std::string> args(std::vector<std::string> extra) {
    std::vector<std::string> a = {"-m", model_->string(), "--device", "cpu", "-c", "64", "--port", "0"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  static fs::path* model_;
  static fs::path* broken_;
};
fs::path* ServeCli::model_ = nullptr;
fs::path* ServeCli::broken_ = nullptr;

void expect_one_line_error(const Result& r, const std::string& what) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  EXPECT_EQ(r.err.rfind("kestrel", 0), 0u) << r.err;
}

// `--api-key "$KEY"` with KEY unset must not start a server without auth; nor an empty key
// file or KESTREL_API_KEY. Each is refused in one line before the model is read.
TEST_F(ServeCli, EmptyKeysAreRefusedBeforeTheModelLoads) {
  const std::string m = "-m " + broken_->string() + " --port 0 ";
  expect_one_line_error(serve(m + "--api-key ''"), "--api-key is empty");
  expect_one_line_error(serve(m + "--api-key ''", "KESTREL_API_KEY=k"), "--api-key is empty");
  const fs::path empty = scratch() / "empty.key";
  write_file(empty, "\n");
  expect_one_line_error(serve(m + "--api-key-file " + empty.string()), empty.string());
  expect_one_line_error(serve(m + "--api-key-file " + (scratch() / "missing.key").string()),
                        "cannot read the API key file " + (scratch() / "missing.key").string());
  expect_one_line_error(serve(m, "KESTREL_API_KEY="), "KESTREL_API_KEY is set but empty");
  const fs::path key = scratch() / "k.key";
  write_file(key, "k\n");
  expect_one_line_error(serve(m + "--api-key k --api-key-file " + key.string()),
                        "--api-key and --api-key-file both given");
}

// A port already taken is found before the weights load (the broken model's weights would
// fail otherwise), in one line naming host:port and the system's reason.
TEST_F(ServeCli, PortInUseIsFoundBeforeTheWeights) {
  TakenPort taken;
  const auto start = std::chrono::steady_clock::now();
  const Result r = serve("-m " + broken_->string() + " --port " + std::to_string(taken.port()));
  expect_one_line_error(r, "cannot listen on 127.0.0.1:" + std::to_string(taken.port()) + ": " +
                               std::strerror(EADDRINUSE));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// The key from a file (its first line) and from KESTREL_API_KEY: a request without it gets 401
// with WWW-Authenticate: Bearer, one with it is answered; the listening line says a key is
// required. --api-key wins over the environment.
TEST_F(ServeCli, KeyFromFileAndEnvironment) {
  const fs::path key = scratch() / "server.key";
  write_file(key, "from-file \n# not the key\n");
  struct Case {
    std::vector<std::string> extra;
    std::string env, accepted, refused;
  };
  const std::vector<Case> cases = {
      {{"--api-key-file", key.string()}, "", "from-file", "from-file-x"},
      {{}, "from-env", "from-env", "wrong"},
      {{"--api-key", "from-flag"}, "from-env", "from-flag", "from-env"},
      {{"--api-key-file", key.string()}, "from-env", "from-file", "from-env"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.accepted);
    if (c.env.empty()) unsetenv("KESTREL_API_KEY");
    else setenv("KESTREL_API_KEY", c.env.c_str(), 1);
    Server s(args(c.extra));
    unsetenv("KESTREL_API_KEY");
    std::string line;
    const int port = s.wait_listening(&line);
    ASSERT_GT(port, 0) << s.log();
    EXPECT_NE(line.find("(API key required)"), std::string::npos) << line;
    EXPECT_EQ(s.log().find("warning"), std::string::npos) << s.log();

    const std::string no_key = http(port, "GET /v1/models HTTP/1.1");
    EXPECT_EQ(status_of(no_key), 401) << no_key;
    EXPECT_TRUE(has_header(no_key, "WWW-Authenticate: Bearer")) << no_key;
    const nlohmann::json e = nlohmann::json::parse(body_of(no_key));
    EXPECT_EQ(e["error"]["code"], "invalid_api_key");
    const std::string wrong = http(port, "GET /v1/models HTTP/1.1", {"Authorization: Bearer " + c.refused});
    EXPECT_EQ(status_of(wrong), 401) << wrong;
    EXPECT_TRUE(has_header(wrong, "WWW-Authenticate: Bearer")) << wrong;
    const std::string ok = http(port, "GET /v1/models HTTP/1.1", {"Authorization: Bearer " + c.accepted});
    EXPECT_EQ(status_of(ok), 200) << ok;
    EXPECT_FALSE(has_header(ok, "WWW-Authenticate: Bearer")) << ok;
    EXPECT_EQ(status_of(http(port, "GET /health HTTP/1.1")), 200);  // needs no key
    EXPECT_EQ(s.stop(), 0) << s.log();
    EXPECT_EQ(s.log().find("from-"), std::string::npos) << "the key was written:\n" << s.log();
  }
}

// Without a key the listening line says so; on a loopback address that is all, on any other a
// warning line comes first.
TEST_F(ServeCli, NoKeyIsSaidAndWarnedOffLoopback) {
  unsetenv("KESTREL_API_KEY");
  {
    Server s(args({}), "loopback");
    std::string line;
    ASSERT_GT(s.wait_listening(&line), 0) << s.log();
    EXPECT_NE(line.find("(no API key: anyone who can reach it may use it)"), std::string::npos) << line;
    EXPECT_EQ(s.log().find("warning"), std::string::npos) << s.log();
  }
  {
    Server s(args({"--host", "0.0.0.0", "-q"}), "any");
    std::string line;
    ASSERT_GT(s.wait_listening(&line), 0) << s.log();
    EXPECT_NE(line.find("(no API key"), std::string::npos) << line;
    const std::string log = s.log();
    EXPECT_NE(log.find("kestrel serve: warning: 0.0.0.0 is not a loopback address and no API key is set"),
              std::string::npos)
        << log;
    EXPECT_EQ(lines(log.substr(0, log.find("listening on"))), 1) << log;  // -q keeps the warning alone
  }
  {
    Server s(args({"--host", "0.0.0.0", "--api-key", "k", "-q"}), "any-key");
    std::string line;
    ASSERT_GT(s.wait_listening(&line), 0) << s.log();
    EXPECT_NE(line.find("(API key required)"), std::string::npos) << line;
    EXPECT_EQ(s.log().find("warning"), std::string::npos) << s.log();
  }
}

// The library's 414 (a request line past 8 KiB) in OpenAI's error shape, with a code as every
// other refusal has.
TEST_F(ServeCli, UriTooLongHasACode) {
  unsetenv("KESTREL_API_KEY");
  Server s(args({"-q"}));
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  const std::string r = http(port, "GET /v1/models?x=" + std::string(10000, 'a') + " HTTP/1.1");
  ASSERT_EQ(status_of(r), 414) << r.substr(0, 200);
  const nlohmann::json e = nlohmann::json::parse(body_of(r));
  EXPECT_EQ(e["error"]["code"], "uri_too_long") << e;
  EXPECT_EQ(e["error"]["type"], "invalid_request_error") << e;
}

// The finding of "Bounded parsing": 7.8 MB of empty objects in `metadata` (a field the server
// ignores) took seconds of CPU and 250 MB each to parse, and 8 at once left the server's RSS
// gigabytes higher for good. Now each is refused with 413 once past the values' limit, the
// server's memory grows little while they are read, and what it grew by is given back after.
TEST_F(ServeCli, HugeJsonIsRefusedInBoundedMemory) {
  unsetenv("KESTREL_API_KEY");
  Server s(args({"-q"}));
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  ASSERT_EQ(status_of(http(port, "GET /health HTTP/1.1")), 200);
  std::string body = R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "metadata": [)";
  for (int i = 0; i < 2600000; ++i) body += i ? ",{}" : "{}";
  body += "]}";
  ASSERT_GT(body.size(), 7800000u);
  ASSERT_LT(body.size(), 8u << 20);  // within --max-body: the body is read, then parsed

  const int64_t start = rss_bytes(s.pid());
  ASSERT_GT(start, 0);
  std::atomic<bool> sending{true};
  std::atomic<int64_t> peak{start};
  std::thread sampler([&] {
    while (sending) {
      peak = std::max<int64_t>(peak, rss_bytes(s.pid()));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  constexpr int kClients = 8;
  std::vector<std::string> answers(kClients);
  std::vector<double> seconds(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      const auto t0 = std::chrono::steady_clock::now();
      answers[i] = http(port, "POST /v1/chat/completions HTTP/1.1", {"Content-Type: application/json"}, body);
      seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  for (std::thread& t : clients) t.join();
  sending = false;
  sampler.join();

  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(status_of(answers[i]), 413) << answers[i].substr(0, 300);
    if (status_of(answers[i]) == 413) {
      const nlohmann::json e = nlohmann::json::parse(body_of(answers[i]));
      EXPECT_EQ(e["error"]["code"], "too_many_json_values") << e;
      EXPECT_NE(e["error"]["message"].get<std::string>().find("100000"), std::string::npos) << e;
    }
    // Sent and refused in about a second on a busy 2-core machine, most of it the transfer;
    // parsing all of each took 3 to 8 s of CPU (the 8 took 20 s there).
    EXPECT_LT(seconds[i], 8.0);
  }
  // The freed memory goes back once the connections close: allow the server a moment (and
  // give it up to 3 s to settle near the start, for the figure printed).
  const int64_t allowed = std::max<int64_t>(start / 10, 30 << 20);
  int64_t after = rss_bytes(s.pid());
  for (int i = 0; i < 300 && after > start + (5 << 20); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    after = rss_bytes(s.pid());
  }
  const double mb = 1 << 20;
  std::printf("RSS: start %.1f MB, peak %.1f MB (+%.1f), after %.1f MB (%+.1f); slowest answer %.2f s\n",
              start / mb, peak / mb, (peak - start) / mb, after / mb, (after - start) / mb,
              *std::max_element(seconds.begin(), seconds.end()));
// gcc says __SANITIZE_ADDRESS__, clang (before 15) only __has_feature(address_sanitizer).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KESTREL_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(KESTREL_TEST_ASAN)
  // AddressSanitizer's allocator holds freed memory in its quarantine and pads every block, so
  // the server's RSS says nothing about glibc's; the bounds hold for the plain build.
  (void)allowed;
#else
  EXPECT_LT(peak - start, int64_t(200) << 20);
  EXPECT_LE(after, start + allowed);
#endif
  EXPECT_EQ(s.stop(), 0) << s.log();
}

// --max-json-values and --max-json-depth set the limits, named in the refusals.
TEST_F(ServeCli, JsonLimitsAreOptions) {
  unsetenv("KESTREL_API_KEY");
  Server s(args({"-q", "--max-json-values", "10", "--max-json-depth", "3"}));
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  auto post = [&](const std::string& body) {
    return http(port, "POST /tokenize HTTP/1.1", {"Content-Type: application/json"}, body);
  };
  EXPECT_EQ(status_of(post(R"({"content": "a", "x": [[1, 2, 3, 4, 5, 6]]})")), 200);  // 10 values, 3 deep
  const std::string many = post(R"({"content": "a", "x": [[1, 2, 3, 4, 5, 6, 7]]})");
  ASSERT_EQ(status_of(many), 413) << many;
  nlohmann::json e = nlohmann::json::parse(body_of(many));
  EXPECT_EQ(e["error"]["code"], "too_many_json_values") << e;
  EXPECT_NE(e["error"]["message"].get<std::string>().find("more than 10 JSON values"), std::string::npos) << e;
  const std::string deep = post(R"({"content": "a", "x": [[[1]]]})");
  ASSERT_EQ(status_of(deep), 400) << deep;
  e = nlohmann::json::parse(body_of(deep));
  EXPECT_EQ(e["error"]["code"], "json_too_deep") << e;
  EXPECT_NE(e["error"]["message"].get<std::string>().find("deeper than 3"), std::string::npos) << e;
}

}  // namespace
