// kestrel serve's HTTP/1.1 transport, over Boost.Beast's parser and Boost.Asio's sockets: a small
// server with routes, a request, and an answer given whole or streamed chunk by chunk.
//
// Why it is built this way (docs/server.md, "Limits"): a slow client must hold no thread and no
// more than its own connection. One I/O thread reads and parses every connection
// asynchronously; a request is bounded as a whole from its first byte (--timeout), not per
// byte; the cheap routes (health, models, refusals, CORS preflights) are answered on the I/O
// thread at once, and the routes that compute (completions, tokenize) run on a pool of worker
// threads, which write their answers back through the connection. The number of connections,
// in all and per client address, is bounded; when full, the oldest idle keep-alive connection
// gives way. A connection's bytes are parsed in order, so pipelined requests are answered in
// order. Framing is strict (RFC 9112): conflicting lengths are refused, not guessed at.
//
// The parsing, framing and routing work without sockets too (HttpServer::answer_bytes), which
// the fuzz target and the unit tests drive.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/server/api_error.h"
#include "tools/kestrel/server/access.h"

namespace kestrel::server {

struct HttpLimits {
  size_t max_body = 8 << 20;          // a body's bytes (413 as soon as its length says more)
  size_t max_header = 16 << 10;       // the request line and headers together (431)
  size_t max_request_line = 8 << 10;  // the request line (414)
  // A whole request, headers and body, from its first byte (408 past it); and each write of
  // an answer to the client.
  std::chrono::seconds timeout{60};
  // How long a kept-alive connection may wait for its next request's first byte, and how long
  // clients are told (Keep-Alive: timeout=): the server waits much longer than it says, so
  // that a client reusing a connection late does not race its close (docs/hardening.md).
  std::chrono::seconds idle{10};
  int keep_alive_hint = 2;
  int max_requests_per_connection = 1000;  // nginx's keepalive_requests
  int max_connections = 1024;              // open connections in all
  int max_connections_per_address = 64;    // from one client address; 0: no bound
};

struct HttpRequest {
  std::string method;  // as sent ("GET", "POST", ...)
  std::string target;  // the request target as sent
  std::string path;    // the target's path, percent-decoded, without its query
  std::string rest;    // what a prefix route ("/v1/models/*") matched after its prefix
  int version = 11;    // 10 or 11
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string remote_addr;
  int remote_port = 0;
  bool keep_alive = true;  // what the client asked (its version and Connection header)

  // The first header of that name (case-insensitive), or "" / nullopt.
  std::string header(std::string_view name) const;
  bool has_header(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;

  void set_header(std::string name, std::string value);
  // OpenAI's error object with its status (Retry-After: 1 on 429).
  static HttpResponse error(const ApiError& e);
  static HttpResponse json(std::string body, int status = 200);
};

// Where an exchange's bytes go: a connection's socket, or a buffer (answer_bytes). Internal to
// the transport; declared here because an Exchange holds one.
class ExchangeSink;

// One request's answer, given once: whole (respond), or streamed (begin_stream, write...,
// end_stream), or not at all (drop: the connection is closed). The handler may also record
// what the access log says of a generation in log(). An exchange that ends unanswered is
// answered 500 (or its stream cut), so that no client waits for an answer that will not come.
class Exchange {
 public:
  Exchange(std::unique_ptr<ExchangeSink> sink, AccessEntry entry);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  void respond(HttpResponse r);
  // A chunked answer: the head now, then each write one chunk. Each returns false once the
  // client is gone (a write failed, or took longer than the timeout); the stream is then dead
  // and the caller should stop. Writes are queued, not waited for, up to 64 KiB not yet
  // taken by the client; past that, write waits for the client.
  bool begin_stream(HttpResponse head);
  bool write(std::string_view data);
  // The last chunk: the connection then reads its next request.
  bool end_stream();
  // Closes the connection without (the rest of) an answer; `status` is what the log records
  // (499: the client went away).
  void drop(int status);
  // Whether the client has closed its end: polled while a request waits or generates.
  bool client_gone() const;
  bool answered() const { return state_ == State::Done; }

  AccessEntry& log() { return entry_; }

 private:
  enum class State { Fresh, Streaming, Done };
  std::unique_ptr<ExchangeSink> sink_;
  AccessEntry entry_;
  State state_ = State::Fresh;
  bool stream_ok_ = true;
};

using HttpHandler = std::function<void(HttpRequest&, Exchange&)>;

// Where a route's handler runs: on the I/O thread, at once (it must not block or compute
// much), or on a worker thread (it may wait for a slot and generate).
enum class RunOn { IoThread, Worker };

class HttpServer {
 public:
  explicit HttpServer(HttpLimits limits);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // A route for `method` ("GET" or "POST"; GET routes answer HEAD too) at `path`, or at every
  // path under a prefix when `path` ends in "/*" (the part after it in HttpRequest::rest, never
  // empty). A path's other methods get 405 with Allow.
  void route(const std::string& method, const std::string& path, RunOn where, HttpHandler handler);

  // Origins whose browser pages may call the API (Access-Control-Allow-Origin), "*" for any;
  // none: no CORS headers at all.
  void set_cors_origins(std::vector<std::string> origins);

  // Runs on every routed request before its handler (OPTIONS preflights excepted): an answer
  // returned ends the request there (the API key check).
  std::function<std::optional<HttpResponse>(const HttpRequest&)> before_route;
  // Called once per request when its answer has been written (or its connection dropped),
  // with what the access log records: the status, the time from the request read to the answer
  // written, and what the handler noted. On the I/O thread: it must be quick (a log line, a
  // metrics counter).
  std::function<void(const AccessEntry&)> on_done;
  // Called on the thread that served a request once the request (and its body) is freed, with
  // the body's size: where memory a large body used can be given back.
  std::function<void(size_t body_bytes)> after_request;

  // Binds host:port (0: any free port) and listens, before anything else is done: throws
  // kestrel::Error "cannot listen on HOST:PORT: REASON" (the system's reason). The bound port.
  int bind(const std::string& host, int port);
  // Serves on the bound socket with `workers` worker threads, in the background.
  void start(int workers);
  // Stops accepting, lets the workers finish what they run (their answers are written), then
  // closes every connection. Blocks until done; from any thread but the server's.
  void stop();
  // Called on the I/O thread when one of its handlers failed with an exception (out of
  // memory): a connection was lost mid-way, and whoever runs the server may stop it.
  std::function<void(const std::string& why)> on_fatal;

  // The answers to `input` read as one connection's bytes, everything on this thread (worker
  // routes too): the bytes the server would write, up to where it would close the connection
  // or the input ends. For the fuzz target and the tests; needs no bind.
  std::string answer_bytes(std::string_view input);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// "HOST:PORT" with an IPv6 address in brackets, as URLs write it.
std::string url_host(const std::string& host);

}  // namespace kestrel::server
