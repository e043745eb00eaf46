// kestrel serve's HTTP transport as hostile and ordinary clients meet it (issue #47): slow
// clients that trickle their requests, connection bounds per address and in all, strict
// framing (conflicting or oversized lengths answered at once), pipelined requests, CORS, and a
// kept-alive connection reused after a streamed answer. The real binary on a kestrel-synth
// model, on the CPU engine, over plain sockets; timings are printed as well as bounded.
#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/cli/serve_support.h"
#include "tests/support/test_util.h"

namespace fs = std::filesystem;

namespace {

using kestrel::test::body_of;
using kestrel::test::has_header;
using kestrel::test::http;
using kestrel::test::scratch;
using kestrel::test::Server;
using kestrel::test::status_of;
using Result = kestrel::test::CommandResult;
using steady = std::chrono::steady_clock;

const std::string kSynth = KESTREL_SYNTH_BIN;

double ms_since(steady::time_point t) {
  return std::chrono::duration<double, std::milli>(steady::now() - t).count();
}

// A connection to the server from `source` (any 127.x address is this machine's): -1 if refused.
int connect_from(int port, const char* source = "127.0.0.1") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, source, &src.sin_addr);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  for (size_t off = 0; off < s.size();) {
    const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += (size_t)n;
  }
  return true;
}

// Where the first whole answer in `buf` ends (by its Content-Length, or a chunked body's last
// chunk; a HEAD's answer has no body), or npos.
size_t answer_end(const std::string& buf, bool head_only = false) {
  const size_t head = buf.find("\r\n\r\n");
  if (head == std::string::npos) return std::string::npos;
  if (head_only) return head + 4;
  const std::string h = buf.substr(0, head);
  std::smatch m;
  static const std::regex length(R"(\r\nContent-Length: (\d+))", std::regex::icase);
  if (std::regex_search(h, m, length)) {
    const size_t end = head + 4 + std::stoul(m[1]);
    return buf.size() >= end ? end : std::string::npos;
  }
  if (h.find("chunked") != std::string::npos) {
    const size_t last = buf.find("\r\n0\r\n\r\n", head);
    return last == std::string::npos ? std::string::npos : last + 7;
  }
  return head + 4;  // no body (204)
}

// A connection's reader, keeping what it read past one answer for the next.
class Conn {
 public:
  explicit Conn(int port, const char* source = "127.0.0.1") : fd_(connect_from(port, source)) {}
  ~Conn() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  bool send(const std::string& s) { return send_all(fd_, s); }

  // The next whole answer, "" when the connection closed or `ms` passed first.
  std::string answer(int ms = 10000, bool head_only = false) {
    const auto end = steady::now() + std::chrono::milliseconds(ms);
    for (;;) {
      if (size_t e = answer_end(buf_, head_only); e != std::string::npos) {
        std::string a = buf_.substr(0, e);
        buf_.erase(0, e);
        return a;
      }
      const int left = (int)std::chrono::duration_cast<std::chrono::milliseconds>(end - steady::now()).count();
      if (left <= 0 || !fill(left)) return "";
    }
  }

  // Whether the server closed the connection within `ms` (whatever it wrote before is kept).
  bool closed_within(int ms) {
    const auto end = steady::now() + std::chrono::milliseconds(ms);
    for (;;) {
      const int left = (int)std::chrono::duration_cast<std::chrono::milliseconds>(end - steady::now()).count();
      if (left <= 0) return false;
      if (!fill(left)) return eof_;
    }
  }
  const std::string& buffered() const { return buf_; }

 private:
  // Reads what comes within `ms`; false at end of stream, an error or the time passing.
  bool fill(int ms) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, ms) <= 0) return false;
    char b[16384];
    const ssize_t n = recv(fd_, b, sizeof b, 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buf_.append(b, (size_t)n);
    return true;
  }
  int fd_;
  std::string buf_;
  bool eof_ = false;
};

std::string header_value(const std::string& answer, const std::string& name) {
  std::smatch m;
  const std::regex re("\r\n" + name + ": ([^\r]*)\r\n", std::regex::icase);
  const std::string head = answer.substr(0, answer.find("\r\n\r\n") + 2);
  return std::regex_search(head, m, re) ? std::string(m[1]) : "";
}

std::string error_code(const std::string& answer) {
  const nlohmann::json e = nlohmann::json::parse(body_of(answer), nullptr, false);
  return e.is_object() && e.contains("error") && e["error"]["code"].is_string() ? e["error"]["code"].get<std::string>()
                                                                                : "";
}

const std::string kCompletion = R"({"prompt": "the river", "max_tokens": 4, "temperature": 0})";

std::string post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

class ServeHttp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new fs::path(scratch() / "http-model");
    fs::remove_all(*model_);
    const Result r = kestrel::test::run_command(
        kSynth + " --shape tiny --layers 2 --dtype gptq --bits 4 --group-size 64 --seed 3 --quiet --out " +
        model_->string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*model_);
    delete model_;
  }
  static std::vector<std::string> args(std::vector<std::string> extra) {
    std::vector<std::string> a = {"-m", model_->string(), "--device", "cpu", "-c", "64", "--port", "0", "-q"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  void SetUp() override { unsetenv("KESTREL_API_KEY"); }
  static fs::path* model_;
};
fs::path* ServeHttp::model_ = nullptr;

// Slowloris: 200 connections each sending a header line now and then held every one of
// cpp-httplib's threads, locking /health and every real client out for as long as they
// trickled. Now they hold no thread: /health answers within 100 ms and a completion is served
// while all 200 stay open.
TEST_F(ServeHttp, SlowClientsLockNobodyOut) {
  Server s(args({"--max-connections-per-ip", "0"}), "slowloris");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  constexpr int kSlow = 200;
  std::vector<std::unique_ptr<Conn>> slow;
  for (int i = 0; i < kSlow; ++i) {
    slow.push_back(std::make_unique<Conn>(port));
    ASSERT_TRUE(slow.back()->ok()) << i;
    ASSERT_TRUE(slow.back()->send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n")) << i;
  }
  std::atomic<bool> trickling{true};
  std::thread trickle([&] {
    for (int line = 0; trickling; ++line) {
      for (auto& c : slow) c->send("X-Slow-" + std::to_string(line) + ": 1\r\n");
      for (int i = 0; i < 10 && trickling; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });

  std::vector<double> health_ms;
  const auto t0 = steady::now();
  while (ms_since(t0) < 3000) {
    const auto t = steady::now();
    const std::string r = http(port, "GET /health HTTP/1.1");
    health_ms.push_back(ms_since(t));
    EXPECT_EQ(status_of(r), 200) << r;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto tc = steady::now();
  const std::string done = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"}, kCompletion);
  const double completion_ms = ms_since(tc);
  EXPECT_EQ(status_of(done), 200) << done;

  // Every slow connection is still open (none refused to make room): each is answered 408
  // only at its deadline.
  int open = 0;
  for (auto& c : slow) open += !c->closed_within(0);
  trickling = false;
  trickle.join();
  std::sort(health_ms.begin(), health_ms.end());
  std::printf("%d slow connections: /health x%zu median %.1f ms, max %.1f ms; a completion %.1f ms; %d still open\n",
              kSlow, health_ms.size(), health_ms[health_ms.size() / 2], health_ms.back(), completion_ms, open);
  // Within 100 ms: nine of ten at least, and every one within a second. (A 2-core machine
  // shared with compilers stalls any process now and then: single answers there took up to
  // 170 ms, the median 0.3 to 6 ms. cpp-httplib answered none while the slow clients held its
  // threads.)
  const size_t slow_answers =
      std::count_if(health_ms.begin(), health_ms.end(), [](double ms) { return ms >= 100.0; });
  EXPECT_LE(slow_answers * 10, health_ms.size());
  EXPECT_LT(health_ms.back(), 1000.0);
  EXPECT_EQ(open, kSlow);
  EXPECT_EQ(s.stop(), 0) << s.log();
}

// --timeout bounds a whole request from its first byte: a client sending a byte a second is
// answered 408 and cut off at the timeout (cpp-httplib's timeout began again with every byte).
TEST_F(ServeHttp, TimeoutBoundsTheWholeRequest) {
  Server s(args({"--timeout", "3"}), "timeout");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  Conn c(port);
  ASSERT_TRUE(c.ok());
  const std::string request = "GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + std::string(64, 'a') + "\r\n\r\n";
  const auto t0 = steady::now();
  double closed_ms = -1;
  for (char ch : request) {
    if (!c.send(std::string(1, ch)) || c.closed_within(1000)) {
      closed_ms = ms_since(t0);
      break;
    }
  }
  std::printf("a request trickled at one byte a second: cut off after %.0f ms (--timeout 3)\n", closed_ms);
  ASSERT_GT(closed_ms, 0) << "the whole request was accepted byte by byte";
  EXPECT_GT(closed_ms, 2500);
  EXPECT_LT(closed_ms, 4500);
  const std::string answer = c.buffered();
  EXPECT_EQ(status_of(answer), 408) << answer;
  EXPECT_EQ(error_code(answer), "request_timeout") << answer;
  // An idle connection (no byte sent) is closed at the keep-alive wait without an answer.
  EXPECT_EQ(status_of(http(port, "GET /health HTTP/1.1")), 200);
}

// Bounds per client address and in all: past them a new connection gets 503 at once, after
// the oldest idle keep-alive connection has been closed to make room where there was one.
TEST_F(ServeHttp, ConnectionBoundsEvictIdleThenRefuse) {
  Server s(args({"--max-connections", "6", "--max-connections-per-ip", "3"}), "bounds");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  const std::string partial = "GET /health HTTP/1.1\r\n";  // a request begun: not idle

  // Per address: three busy connections from 127.0.0.1; a fourth is refused at once, while
  // 127.0.0.2 is served.
  {
    std::vector<std::unique_ptr<Conn>> busy;
    for (int i = 0; i < 3; ++i) {
      busy.push_back(std::make_unique<Conn>(port));
      ASSERT_TRUE(busy.back()->send(partial));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t = steady::now();
    Conn extra(port);
    ASSERT_TRUE(extra.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string refused = extra.answer(2000);
    std::printf("a 4th connection from one address (bound 3): %d in %.1f ms\n", status_of(refused), ms_since(t));
    EXPECT_EQ(status_of(refused), 503) << refused;
    EXPECT_EQ(error_code(refused), "too_many_connections") << refused;
    EXPECT_LT(ms_since(t), 1000);
    Conn other(port, "127.0.0.2");
    ASSERT_TRUE(other.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_EQ(status_of(other.answer()), 200);
    // The busy ones finish their requests and are served.
    for (auto& b : busy) {
      ASSERT_TRUE(b->send("Host: x\r\n\r\n"));
      EXPECT_EQ(status_of(b->answer()), 200);
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));

  // Idle eviction: three kept-alive connections from 127.0.0.1, idle after an answer; a
  // fourth is served and the one idle longest is closed to make room.
  {
    std::vector<std::unique_ptr<Conn>> idle;
    for (int i = 0; i < 3; ++i) {
      idle.push_back(std::make_unique<Conn>(port));
      ASSERT_TRUE(idle.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
      ASSERT_EQ(status_of(idle.back()->answer()), 200);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    Conn extra(port);
    ASSERT_TRUE(extra.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_EQ(status_of(extra.answer()), 200);
    EXPECT_TRUE(idle[0]->closed_within(2000)) << "the oldest idle connection was not closed";
    EXPECT_FALSE(idle[1]->closed_within(100));
    EXPECT_FALSE(idle[2]->closed_within(100));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));

  // In all: six busy connections from three addresses; a seventh, from a fourth, is refused.
  {
    std::vector<std::unique_ptr<Conn>> busy;
    for (const char* from : {"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"}) {
      busy.push_back(std::make_unique<Conn>(port, from));
      ASSERT_TRUE(busy.back()->send(partial));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    Conn extra(port, "127.0.0.4");
    ASSERT_TRUE(extra.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string refused = extra.answer(2000);
    EXPECT_EQ(status_of(refused), 503) << refused;
  }
  EXPECT_EQ(s.stop(), 0) << s.log();
}

// Framing (RFC 9112): a length that is not one, two different lengths, or a length with a
// transfer coding are refused with 400 at once and the connection closed (a proxy in front
// might frame the body otherwise: request smuggling); a length over --max-body is 413 before
// any of the body is sent.
TEST_F(ServeHttp, ConflictingOrOversizedLengthsAreRefusedAtOnce) {
  Server s(args({}), "framing");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  struct Case {
    std::string headers;
    int status;
    std::string code;
  };
  const std::vector<Case> cases = {
      {"Content-Length: 5\r\nContent-Length: 6\r\n", 400, "invalid_content_length"},
      {"Content-Length: -5\r\n", 400, "invalid_content_length"},
      {"Content-Length: 5x\r\n", 400, "invalid_content_length"},
      {"Content-Length: 99999999999999999999999\r\n", 400, "invalid_content_length"},
      {"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, "invalid_transfer_encoding"},
      {"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400, "invalid_content_length"},
      {"Transfer-Encoding: gzip\r\n", 400, "invalid_transfer_encoding"},
      {"Content-Length: 100000000\r\n", 413, "request_too_large"},
      {"Content-Length: 9223372036854775807\r\n", 413, "request_too_large"},
      {"X-Big: " + std::string(20000, 'a') + "\r\n", 431, "request_header_fields_too_large"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.headers.substr(0, 60));
    Conn conn(port);
    const auto t = steady::now();
    // The head only: the body the lengths promise never comes.
    ASSERT_TRUE(conn.send("POST /tokenize HTTP/1.1\r\nHost: x\r\n" + c.headers + "\r\n"));
    const std::string a = conn.answer(3000);
    const double ms = ms_since(t);
    EXPECT_EQ(status_of(a), c.status) << a;
    EXPECT_EQ(error_code(a), c.code) << a;
    EXPECT_TRUE(has_header(a, "Connection: close")) << a;
    EXPECT_LT(ms, 1000);
    EXPECT_TRUE(conn.closed_within(3000));
  }
  // Two equal lengths are one length.
  Conn same(port);
  ASSERT_TRUE(same.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\nContent-Length: 15\r\n\r\n"
                        R"({"content":"a"})"));
  EXPECT_EQ(status_of(same.answer()), 200);
}

// Requests written back to back on one connection are each answered, in order; the last,
// "Connection: close", closes it. (cpp-httplib answered the first only.)
TEST_F(ServeHttp, PipelinedRequestsAreAnsweredInOrder) {
  Server s(args({}), "pipeline");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  {
    Conn c(port);
    ASSERT_TRUE(c.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string a = c.answer(), b = c.answer();
    EXPECT_EQ(status_of(a), 200) << a;
    EXPECT_NE(body_of(a).find("slots_idle"), std::string::npos) << a;
    EXPECT_EQ(status_of(b), 200) << b;
    EXPECT_NE(body_of(b).find("\"list\""), std::string::npos) << b;
  }
  {
    Conn c(port);
    ASSERT_TRUE(c.send(post("/tokenize", R"({"content": "the river"})") + "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n" +
                       post("/v1/completions", kCompletion, "Connection: close\r\n")));
    const std::string a = c.answer();
    EXPECT_EQ(status_of(a), 200) << a;
    EXPECT_NE(body_of(a).find("\"tokens\""), std::string::npos) << a;
    // HEAD: the GET's head, its length, no body.
    const std::string head = c.answer(2000, true);
    EXPECT_EQ(status_of(head), 200) << head;
    const std::string length = header_value(head, "Content-Length");
    EXPECT_GT(std::atoi(length.c_str()), 0) << head;
    // No body follows the HEAD's head: the next bytes are the third answer's.
    const std::string third = c.answer();
    EXPECT_EQ(status_of(third), 200) << third;
    EXPECT_NE(third.find("text_completion"), std::string::npos) << third;
    EXPECT_TRUE(has_header(third, "Connection: close")) << third;
    EXPECT_TRUE(c.closed_within(3000));
  }
}

// --cors: a browser page's preflight is answered without the API key, with the methods and
// headers (Authorization among them) it may use; answers to an allowed origin carry it, with
// Vary: Origin; other origins, and servers without --cors, get no CORS headers.
TEST_F(ServeHttp, CorsPreflightAndHeaders) {
  {
    Server s(args({"--api-key", "k", "--cors", "http://a.example,http://b.example"}), "cors");
    const int port = s.wait_listening();
    ASSERT_GT(port, 0) << s.log();
    const std::string pre = http(port, "OPTIONS /v1/chat/completions HTTP/1.1",
                                 {"Origin: http://b.example", "Access-Control-Request-Method: POST",
                                  "Access-Control-Request-Headers: authorization, content-type, x-stainless-os"});
    EXPECT_EQ(status_of(pre), 204) << pre;
    EXPECT_EQ(header_value(pre, "Access-Control-Allow-Origin"), "http://b.example") << pre;
    EXPECT_TRUE(has_header(pre, "Vary: Origin")) << pre;
    EXPECT_NE(header_value(pre, "Access-Control-Allow-Methods").find("POST"), std::string::npos) << pre;
    const std::string allowed = header_value(pre, "Access-Control-Allow-Headers");
    EXPECT_NE(allowed.find("Authorization"), std::string::npos) << pre;
    EXPECT_NE(allowed.find("Content-Type"), std::string::npos) << pre;
    EXPECT_NE(allowed.find("x-stainless-os"), std::string::npos) << pre;
    EXPECT_EQ(header_value(pre, "Access-Control-Max-Age"), "600") << pre;

    const std::string ok = http(port, "GET /v1/models HTTP/1.1", {"Origin: http://a.example", "Authorization: Bearer k"});
    EXPECT_EQ(status_of(ok), 200) << ok;
    EXPECT_EQ(header_value(ok, "Access-Control-Allow-Origin"), "http://a.example") << ok;
    EXPECT_TRUE(has_header(ok, "Vary: Origin")) << ok;
    // A refusal carries it too, so that the page can read the error.
    const std::string no_key = http(port, "GET /v1/models HTTP/1.1", {"Origin: http://a.example"});
    EXPECT_EQ(status_of(no_key), 401) << no_key;
    EXPECT_EQ(header_value(no_key, "Access-Control-Allow-Origin"), "http://a.example") << no_key;
    const std::string other = http(port, "GET /v1/models HTTP/1.1", {"Origin: http://c.example", "Authorization: Bearer k"});
    EXPECT_EQ(status_of(other), 200) << other;
    EXPECT_EQ(header_value(other, "Access-Control-Allow-Origin"), "") << other;
    const std::string other_pre = http(port, "OPTIONS /v1/completions HTTP/1.1",
                                       {"Origin: http://c.example", "Access-Control-Request-Method: POST"});
    EXPECT_EQ(header_value(other_pre, "Access-Control-Allow-Origin"), "") << other_pre;
    EXPECT_EQ(header_value(other_pre, "Access-Control-Allow-Methods"), "") << other_pre;
  }
  {
    Server s(args({"--cors", "*"}), "cors-any");
    const int port = s.wait_listening();
    ASSERT_GT(port, 0) << s.log();
    const std::string any = http(port, "GET /health HTTP/1.1", {"Origin: http://z.example"});
    EXPECT_EQ(header_value(any, "Access-Control-Allow-Origin"), "*") << any;
    EXPECT_FALSE(has_header(any, "Vary: Origin")) << any;
  }
  {
    Server s(args({}), "no-cors");
    const int port = s.wait_listening();
    ASSERT_GT(port, 0) << s.log();
    const std::string none = http(port, "GET /health HTTP/1.1", {"Origin: http://a.example"});
    EXPECT_EQ(status_of(none), 200) << none;
    EXPECT_EQ(none.find("Access-Control-"), std::string::npos) << none;
    const std::string pre = http(port, "OPTIONS /v1/completions HTTP/1.1",
                                 {"Origin: http://a.example", "Access-Control-Request-Method: POST"});
    EXPECT_EQ(pre.find("Access-Control-"), std::string::npos) << pre;
  }
}

// A kept-alive connection answers its next request after a streamed answer (docs/hardening.md:
// the connection reused after a stream), and after the Keep-Alive hint's seconds idle.
TEST_F(ServeHttp, KeepAliveAfterAStreamedAnswer) {
  Server s(args({}), "keepalive");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  Conn c(port);
  ASSERT_TRUE(c.send(post("/v1/completions", R"({"prompt": "the river", "max_tokens": 4, "stream": true})")));
  const std::string stream = c.answer();
  EXPECT_EQ(status_of(stream), 200) << stream;
  EXPECT_TRUE(has_header(stream, "Transfer-Encoding: chunked")) << stream;
  EXPECT_NE(stream.find("data: [DONE]"), std::string::npos) << stream;
  const std::string hint = header_value(stream, "Keep-Alive");
  EXPECT_EQ(hint.rfind("timeout=2", 0), 0u) << stream;
  ASSERT_TRUE(c.send(post("/v1/completions", kCompletion)));
  const std::string next = c.answer();
  EXPECT_EQ(status_of(next), 200) << next;
  EXPECT_NE(next.find("text_completion"), std::string::npos) << next;
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // past the hint
  ASSERT_TRUE(c.send(post("/v1/completions", R"({"prompt": "the river", "max_tokens": 2, "stream": true})")));
  const std::string third = c.answer();
  EXPECT_EQ(status_of(third), 200) << third;
  EXPECT_NE(third.find("data: [DONE]"), std::string::npos) << third;
  EXPECT_EQ(s.stop(), 0) << s.log();
}

}  // namespace

// GET /metrics after real traffic: the requests by endpoint and status, the tokens, a time to
// first token per completion and a per-token latency per token after the first, the slots'
// gauges, in Prometheus's text format; behind the API key like the API.
TEST_F(ServeHttp, MetricsCountWhatWasServed) {
  Server s(args({"--api-key", "k"}), "metrics");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  const std::string key = "Authorization: Bearer k";
  for (int i = 0; i < 2; ++i) {
    const std::string c = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json", key},
                               R"({"prompt": "the river", "max_tokens": 4, "temperature": 0, "ignore_eos": true})");
    ASSERT_EQ(status_of(c), 200) << c;
  }
  EXPECT_EQ(status_of(http(port, "GET /nowhere HTTP/1.1", {key})), 404);
  EXPECT_EQ(status_of(http(port, "GET /metrics HTTP/1.1")), 401);  // no key

  // A request is counted once its answer is written, and a completion's tokens and latencies
  // once its slot is free, which the client may see a moment before (under load, after its next
  // requests were answered): scraped until every request of the test is in (at most 10 s).
  std::string m, body;
  auto value = [&](const std::string& series) -> double {
    const size_t at = body.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::stod(body.substr(at + series.size() + 2));
  };
  for (int i = 0; i < 200; ++i) {
    m = http(port, "GET /metrics HTTP/1.1", {key});
    body = body_of(m);
    if (value(R"(kestrel:http_requests_total{endpoint="/metrics",status="401"})") == 1 &&
        value(R"(kestrel:http_requests_total{endpoint="/v1/completions",status="200"})") == 2 &&
        value("kestrel:time_per_output_token_seconds_count") == 6 &&
        value("kestrel:num_requests_running") == 0)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(status_of(m), 200) << m;
  EXPECT_EQ(header_value(m, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8") << m;
  EXPECT_EQ(value(R"(kestrel:http_requests_total{endpoint="/v1/completions",status="200"})"), 2) << body;
  // A path the server does not serve is "other": made-up paths cannot take the labels.
  EXPECT_EQ(value(R"(kestrel:http_requests_total{endpoint="other",status="404"})"), 1) << body;
  EXPECT_EQ(body.find("/nowhere"), std::string::npos) << body;
  // The 401 of the scrape without a key.
  EXPECT_EQ(value(R"(kestrel:http_requests_total{endpoint="/metrics",status="401"})"), 1) << body;
  EXPECT_EQ(value("kestrel:generation_tokens_total"), 8) << body;
  EXPECT_GT(value("kestrel:prompt_tokens_total"), 0) << body;
  EXPECT_EQ(value("kestrel:time_to_first_token_seconds_count"), 2) << body;
  EXPECT_EQ(value("kestrel:time_per_output_token_seconds_count"), 6) << body;  // 3 after the first, twice
  EXPECT_EQ(value("kestrel:num_requests_running"), 0) << body;
  EXPECT_EQ(value("kestrel:num_requests_waiting"), 0) << body;
  EXPECT_EQ(value("kestrel:num_slots"), 1) << body;
}

// response_format json_schema over the socket, whole and streamed, greedy and sampled: the
// answer's text is JSON with the schema's keys in its order and values inside its enum and
// range, whatever the random model would have written.
TEST_F(ServeHttp, ResponseFormatConstrainsTheAnswer) {
  Server s(args({}), "response-format");
  const int port = s.wait_listening();
  ASSERT_GT(port, 0) << s.log();
  const std::string format = R"("response_format": {"type": "json_schema", "json_schema": {"name": "pick",
      "schema": {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                 "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["color", "n"], "additionalProperties": false}}})";
  auto check = [](const std::string& text, const std::string& what) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object()) << what << ": " << text;
    EXPECT_EQ(text.find("\"color\""), text.find_first_of('"')) << what << ": " << text;  // first key
    ASSERT_TRUE(j.contains("color") && j.contains("n") && j.size() == 2) << what << ": " << text;
    EXPECT_TRUE(j["color"] == "red" || j["color"] == "green") << what << ": " << text;
    ASSERT_TRUE(j["n"].is_number_integer()) << what << ": " << text;
    EXPECT_GE(j["n"].get<int>(), 0) << what;
    EXPECT_LE(j["n"].get<int>(), 9) << what;
  };
  for (const std::string sampling : {R"("temperature": 0)", R"("temperature": 1.0, "seed": 3)",
                                     R"("temperature": 1.0, "seed": 4)"}) {
    const std::string whole = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"},
                                   R"({"prompt": "the river", "max_tokens": 40, )" + sampling + ", " + format + "}");
    ASSERT_EQ(status_of(whole), 200) << whole;
    const nlohmann::json w = nlohmann::json::parse(body_of(whole));
    check(w["choices"][0]["text"].get<std::string>(), "whole, " + sampling);

    const std::string streamed = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"},
                                      R"({"prompt": "the river", "max_tokens": 40, "stream": true, )" + sampling +
                                          ", " + format + "}");
    ASSERT_EQ(status_of(streamed), 200) << streamed;
    std::string text;
    for (size_t at = streamed.find("data: {"); at != std::string::npos; at = streamed.find("data: {", at + 1)) {
      const size_t end = streamed.find('\n', at);
      const nlohmann::json ev = nlohmann::json::parse(streamed.substr(at + 6, end - at - 6), nullptr, false);
      if (ev.is_object() && ev.contains("choices") && !ev["choices"].empty())
        text += ev["choices"][0].value("text", "");
    }
    check(text, "streamed, " + sampling);
  }
  // What the converter refuses is the client's 400, naming response_format.
  const std::string bad = http(port, "POST /v1/completions HTTP/1.1", {"Content-Type: application/json"},
                               R"({"prompt": "x", "response_format": {"type": "json_schema", "json_schema":
                                   {"name": "n", "schema": {"not": {}}}}})");
  EXPECT_EQ(status_of(bad), 400) << bad;
  EXPECT_NE(body_of(bad).find("response_format"), std::string::npos) << bad;
}
