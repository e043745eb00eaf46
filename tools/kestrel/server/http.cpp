// kestrel serve's HTTP/1.1 transport (http.h says what it guarantees and why).
#include "tools/kestrel/server/http.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <deque>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "base/error.h"

namespace kestrel::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using clock = std::chrono::steady_clock;

namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower((unsigned char)a[i]) != std::tolower((unsigned char)b[i])) return false;
  return true;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The path of a request target: origin-form's path, or absolute-form's after its authority;
// percent-escapes decoded (a model id with a space arrives as %20), a malformed one kept.
std::string target_path(std::string_view target) {
  if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0) {
    const size_t slash = target.find('/', target.find("//") + 2);
    target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
  }
  target = target.substr(0, target.find_first_of("?#"));
  std::string out;
  out.reserve(target.size());
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] == '%' && i + 2 < target.size() && hex_digit(target[i + 1]) >= 0 && hex_digit(target[i + 2]) >= 0) {
      out += (char)(hex_digit(target[i + 1]) * 16 + hex_digit(target[i + 2]));
      i += 2;
    } else {
      out += target[i];
    }
  }
  return out;
}

std::string reason(int status) {
  if (status == 499) return "Client Closed Request";
  const beast::string_view r = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return r == "<unknown-status>" ? "Unknown" : std::string(r);
}

ApiError framing_error(const beast::error_code& ec, const HttpLimits& l) {
  if (ec == bhttp::error::header_limit)
    return ApiError(431, fmt::format("the request's headers are larger than {} bytes", l.max_header), "",
                    "request_header_fields_too_large");
  if (ec == bhttp::error::body_limit)
    return ApiError(413, "the request body is too large", "", "request_too_large");
  if (ec == bhttp::error::bad_content_length)
    return ApiError(400, "the request's Content-Length is not a length, or is given twice with different values",
                    "", "invalid_content_length");
  if (ec == bhttp::error::bad_transfer_encoding)
    return ApiError(400, "the request's Transfer-Encoding is given twice or with a Content-Length", "",
                    "invalid_transfer_encoding");
  if (ec == bhttp::error::bad_version)
    return ApiError(505, "only HTTP/1.0 and HTTP/1.1 are served", "", "http_version_not_supported");
  return ApiError(400, fmt::format("the HTTP request could not be read ({})", ec.message()), "", "bad_request");
}

}  // namespace

// ---- requests and responses ----------------------------------------------------------------

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (iequals(k, name)) return v;
  return "";
}

bool HttpRequest::has_header(std::string_view name) const {
  for (const auto& h : headers)
    if (iequals(h.first, name)) return true;
  return false;
}

void HttpResponse::set_header(std::string name, std::string value) {
  for (auto& h : headers)
    if (iequals(h.first, name)) {
      h.second = std::move(value);
      return;
    }
  headers.emplace_back(std::move(name), std::move(value));
}

HttpResponse HttpResponse::error(const ApiError& e) {
  // Replacing invalid UTF-8: a message may quote what the client sent.
  HttpResponse r = json(e.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), e.status());
  if (e.status() == 429) r.set_header("Retry-After", "1");
  return r;
}

HttpResponse HttpResponse::json(std::string body, int status) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

std::string url_host(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

// ---- reading requests ----------------------------------------------------------------------

// One connection's requests parsed from its bytes, one after the other, without I/O: what
// the socket path and answer_bytes share. Beast's parser does the framing (Content-Length,
// chunked bodies, the header and body limits); the checks it leaves to its user are here.
class RequestReader {
 public:
  explicit RequestReader(const HttpLimits& l) : l_(l) {}

  enum class Step { More, Done, Failed };

  // Parses what it can of `in`, consuming it from the front. Done: take() has the request;
  // Failed: error() says why (the connection is then closed after the answer).
  Step step(std::string& in) {
    if (!p_) {
      // An empty line before a request line is ignored (RFC 9112 2.2): clients that end a
      // body with an extra CRLF.
      size_t skip = 0;
      while (in.compare(skip, 2, "\r\n") == 0) skip += 2;
      in.erase(0, skip);
      if (in.empty()) return Step::More;
      p_.emplace();
      p_->header_limit((std::uint32_t)std::min<size_t>(l_.max_header, UINT32_MAX));
      p_->body_limit(l_.max_body);
      p_->eager(true);
      checked_ = false;
    }
    if (!p_->is_header_done()) {
      // The request line alone has a bound of its own (414), within the header's.
      const size_t eol = in.find("\r\n");
      if ((eol == std::string::npos && in.size() > l_.max_request_line) ||
          (eol != std::string::npos && eol > l_.max_request_line))
        return fail(ApiError(414, "the request's URI is too long", "", "uri_too_long"));
    }
    while (!in.empty() && !p_->is_done()) {
      beast::error_code ec;
      const size_t used = p_->put(asio::buffer(in.data(), in.size()), ec);
      in.erase(0, used);
      if (ec == bhttp::error::need_more) break;
      if (ec) return fail(framing_error(ec, l_));
      if (p_->is_header_done() && !checked_) {
        if (auto e = check_header()) return fail(*e);
      }
      if (used == 0) break;
    }
    if (p_->is_header_done() && !checked_) {
      if (auto e = check_header()) return fail(*e);
    }
    return p_->is_done() ? Step::Done : Step::More;
  }

  // Whether bytes of a request not yet complete have been read.
  bool started() const { return p_.has_value(); }
  // Whether the client waits for "100 Continue" before it sends the body (curl does for
  // large ones); cleared by the call.
  bool take_continue() { return std::exchange(continue_, false); }

  HttpRequest take() {
    bhttp::request<bhttp::string_body>& m = p_->get();
    HttpRequest r;
    r.method = std::string(m.method_string());
    r.target = std::string(m.target());
    r.path = target_path(r.target);
    r.version = m.version();
    for (const auto& f : m) r.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    r.keep_alive = m.keep_alive();
    r.body = std::move(m.body());
    p_.reset();
    return r;
  }

  const ApiError& error() const { return *error_; }
  // The method and path of the request refused ("-" where its header was not read), and of
  // one cut off mid-way.
  const std::string& failed_method() const { return failed_method_; }
  const std::string& failed_path() const { return failed_path_; }
  void abandon() { fail(ApiError(408, "")); }

 private:
  Step fail(ApiError e) {
    error_ = std::move(e);
    // What the access log can name of a request refused after its header.
    failed_method_ = failed_path_ = "-";
    // (Beast fills in the request line before it checks the header's limits.)
    if (p_ && !p_->get().method_string().empty()) {
      failed_method_ = std::string(p_->get().method_string());
      failed_path_ = target_path(std::string(p_->get().target()));
    }
    p_.reset();
    return Step::Failed;
  }

  // RFC 9112's rules Beast leaves to its user, once the header is read: a Transfer-Encoding
  // other than a final "chunked" (which Beast passes over, leaving the body's end unknown:
  // the smuggling behind a proxy that reads it otherwise) and one beside a Content-Length
  // are refused, as are versions other than 1.0 and 1.1 and targets of no known form.
  std::optional<ApiError> check_header() {
    checked_ = true;
    const auto& m = p_->get();
    if (m.version() != 10 && m.version() != 11)
      return ApiError(505, "only HTTP/1.0 and HTTP/1.1 are served", "", "http_version_not_supported");
    const auto te = m.find(bhttp::field::transfer_encoding);
    if (te != m.end() && (!p_->chunked() || m.find(bhttp::field::content_length) != m.end()))
      return ApiError(400, "the request's Transfer-Encoding is not chunked, or comes with a Content-Length", "",
                      "invalid_transfer_encoding");
    const beast::string_view t = m.target();
    const bool origin = !t.empty() && t[0] == '/';
    const bool absolute = t.starts_with("http://") || t.starts_with("https://");
    const bool asterisk = t == "*" && m.method() == bhttp::verb::options;
    if (!origin && !absolute && !asterisk)
      return ApiError(400, "the request target is not a path", "", "bad_request");
    const auto expect = m.find(bhttp::field::expect);
    continue_ = expect != m.end() && iequals(std::string_view(expect->value().data(), expect->value().size()), "100-continue") && m.version() == 11 &&
                !p_->is_done();
    return std::nullopt;
  }

  const HttpLimits& l_;
  std::optional<bhttp::request_parser<bhttp::string_body>> p_;
  bool checked_ = false, continue_ = false;
  std::optional<ApiError> error_;
  std::string failed_method_ = "-", failed_path_ = "-";
};

// ---- answers -------------------------------------------------------------------------------

// How an answer's head is written for its request.
struct AnswerContext {
  int version = 11;
  bool head_only = false;   // a HEAD request: the head of the GET's answer, no body
  bool keep_alive = false;  // the connection reads on after this answer
  int requests_left = 0;    // for Keep-Alive's max
  int hint = 2;
  std::string cors_origin;  // Access-Control-Allow-Origin's value, "" for none
  clock::time_point start = clock::now();
};

class ExchangeSink {
 public:
  explicit ExchangeSink(AnswerContext ctx) : ctx(std::move(ctx)) {}
  virtual ~ExchangeSink() = default;
  // Writes bytes of the answer in order. With `wait`, blocks until written (the stream's
  // back-pressure), false when they could not be.
  virtual bool send(std::string bytes, bool wait) = 0;
  // The answer is complete (or abandoned): the connection reads on, or closes.
  virtual void finish(bool keep_alive, AccessEntry entry) = 0;
  virtual bool gone() const = 0;
  AnswerContext ctx;
};

namespace {

std::string head_bytes(const HttpResponse& r, const AnswerContext& c, bool keep_alive, bool chunked) {
  std::string h = fmt::format("HTTP/1.{} {} {}\r\n", c.version == 10 ? 0 : 1, r.status, reason(r.status));
  const bool no_body = r.status == 204 || r.status == 304 || r.status < 200;
  if (!no_body && (!r.body.empty() || chunked)) h += "Content-Type: " + r.content_type + "\r\n";
  for (const auto& [k, v] : r.headers) h += k + ": " + v + "\r\n";
  if (chunked) {
    if (c.version == 11) h += "Transfer-Encoding: chunked\r\n";
  } else if (!no_body) {
    h += fmt::format("Content-Length: {}\r\n", r.body.size());
  }
  if (!keep_alive) {
    h += "Connection: close\r\n";
  } else {
    if (c.version == 10) h += "Connection: keep-alive\r\n";
    h += fmt::format("Keep-Alive: timeout={}, max={}\r\n", c.hint, c.requests_left);
  }
  if (!c.cors_origin.empty()) {
    h += "Access-Control-Allow-Origin: " + c.cors_origin + "\r\n";
    if (c.cors_origin != "*") h += "Vary: Origin\r\n";
  }
  return h + "\r\n";
}

bool says_close(const HttpResponse& r) {
  for (const auto& [k, v] : r.headers)
    if (iequals(k, "Connection") && iequals(v, "close")) return true;
  return false;
}

}  // namespace

Exchange::Exchange(std::unique_ptr<ExchangeSink> sink, AccessEntry entry)
    : sink_(std::move(sink)), entry_(std::move(entry)) {}

Exchange::~Exchange() {
  if (state_ == State::Fresh)
    respond(HttpResponse::error(ApiError(500, "the server gave no answer", "", "server_error")));
  else if (state_ == State::Streaming)
    drop(entry_.status);
}

void Exchange::respond(HttpResponse r) {
  if (state_ != State::Fresh) return;
  state_ = State::Done;
  entry_.status = r.status;
  const bool keep = sink_->ctx.keep_alive && !says_close(r);
  std::erase_if(r.headers, [](const auto& h) { return iequals(h.first, "Connection"); });
  std::string bytes = head_bytes(r, sink_->ctx, keep, false);
  if (!sink_->ctx.head_only) bytes += r.body;
  sink_->send(std::move(bytes), false);
  sink_->finish(keep, entry_);
}

bool Exchange::begin_stream(HttpResponse head) {
  if (state_ != State::Fresh) return false;
  state_ = State::Streaming;
  entry_.status = head.status;
  // HTTP/1.0 has no chunks: its body ends where the connection does.
  if (sink_->ctx.version == 10) sink_->ctx.keep_alive = false;
  stream_ok_ = sink_->send(head_bytes(head, sink_->ctx, sink_->ctx.keep_alive, true), true);
  return stream_ok_;
}

bool Exchange::write(std::string_view data) {
  if (state_ != State::Streaming || !stream_ok_) return false;
  if (data.empty()) return true;  // an empty chunk would end the body
  std::string chunk = sink_->ctx.version == 10 ? std::string(data)
                                               : fmt::format("{:x}\r\n{}\r\n", data.size(), data);
  stream_ok_ = sink_->send(std::move(chunk), true);
  return stream_ok_;
}

bool Exchange::end_stream() {
  if (state_ != State::Streaming) return false;
  state_ = State::Done;
  if (stream_ok_ && sink_->ctx.version == 11) stream_ok_ = sink_->send("0\r\n\r\n", true);
  sink_->finish(stream_ok_ && sink_->ctx.keep_alive, entry_);
  return stream_ok_;
}

void Exchange::drop(int status) {
  if (state_ == State::Done) return;
  state_ = State::Done;
  entry_.status = status;
  sink_->finish(false, entry_);
}

bool Exchange::client_gone() const { return !stream_ok_ || sink_->gone(); }

// ---- the server ----------------------------------------------------------------------------

namespace {

struct Route {
  std::string method, path;  // path without its "*" for a prefix route
  bool prefix = false;
  RunOn where = RunOn::IoThread;
  HttpHandler handler;
};

// Worker threads taking tasks in order; stop() lets them finish every task posted.
class WorkerPool {
 public:
  void start(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lk(m_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

}  // namespace

class Connection;

struct HttpServer::Impl {
  explicit Impl(HttpLimits l) : limits(l), acceptor(io), retry(io) {}

  // What a request gets before (or instead of) its handler: an answer, or the route to run.
  struct Plan {
    std::optional<HttpResponse> answer;
    const Route* route = nullptr;
    bool head_only = false;
  };
  Plan plan(HttpRequest& req) const;
  std::string cors_origin(const HttpRequest& req) const;
  AnswerContext context(const HttpRequest& req, int served) const;
  // Runs a handler, answering 500 for an exception that escapes it.
  void run_handler(const Route& route, HttpRequest& req, Exchange& ex) const;

  void accept();
  void admit(tcp::socket s);
  bool evict_idle(const std::string* address);
  void refuse(tcp::socket s);
  void unregister(Connection* c);

  HttpServer* owner = nullptr;
  HttpLimits limits;
  std::vector<Route> routes;
  std::vector<std::string> cors;
  asio::io_context io;
  tcp::acceptor acceptor;
  asio::steady_timer retry;  // accepting again after a failure (out of descriptors)
  WorkerPool pool;
  std::thread io_thread;
  std::atomic<bool> stopping{false};
  bool accept_failure_noted = false;
  // The open connections and their count per address: touched on the I/O thread only.
  std::unordered_set<Connection*> conns;
  std::unordered_map<std::string, int> per_address;
  int draining = 0;  // refused connections being closed gently
};

// A connection on the I/O thread. Reads and parses requests until one is complete, then
// answers it on the I/O thread or hands it to a worker and reads nothing more until the
// answer is written; then parses what is buffered already (pipelined requests) or reads on.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class State { Idle, Reading, Busy, Closed };

  Connection(HttpServer::Impl& srv, tcp::socket s, std::string address, int port)
      : srv_(srv), stream_(std::move(s)), reader_(srv.limits), address_(std::move(address)), port_(port) {}

  const std::string& address() const { return address_; }
  State state() const { return state_; }
  clock::time_point idle_since() const { return idle_since_; }
  bool writing() const { return writing_; }
  asio::io_context& io() { return srv_.io; }

  void start() {
    idle_since_ = clock::now();
    next();
  }

  // Closes the socket at once (eviction, stopping, a failed read or write).
  void close() {
    if (state_ == State::Closed) return;
    state_ = State::Closed;
    srv_.unregister(this);
    beast::error_code ec;
    timer_.cancel();
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
    for (Pending& p : out_)
      if (p.done) p.done(false);
    out_.clear();
    if (finish_) finish();
  }

  // Bytes of the current answer, written in order; `done` learns whether they were.
  void enqueue(std::string bytes, std::function<void(bool)> done) {
    if (state_ == State::Closed) {
      if (done) done(false);
      return;
    }
    out_.push_back({std::move(bytes), std::move(done)});
    if (!writing_) write_next();
  }

  // The answer is complete: once written, log it and read on (or close).
  void finish_after_writes(bool keep_alive, AccessEntry entry) {
    finish_ = Finish{keep_alive, std::move(entry)};
    if (!writing_) finish();
  }

  int fd() { return stream_.socket().native_handle(); }

 private:
  struct Pending {
    std::string bytes;
    std::function<void(bool)> done;
  };
  struct Finish {
    bool keep_alive;
    AccessEntry entry;
  };

  // The next request: from the bytes already read, else from the socket.
  void next() {
    if (state_ == State::Closed) return;
    if (srv_.stopping) return close();
    if (in_.empty()) {
      state_ = State::Idle;
      idle_since_ = clock::now();
    } else {
      begin_request();
    }
    parse();
  }

  void begin_request() {
    state_ = State::Reading;
    deadline_ = clock::now() + srv_.limits.timeout;
  }

  void parse() {
    if (in_.empty() && !reader_.started()) return read();
    switch (reader_.step(in_)) {
      case RequestReader::Step::More:
        if (reader_.take_continue()) enqueue("HTTP/1.1 100 Continue\r\n\r\n", nullptr);
        return read();
      case RequestReader::Step::Failed:
        return refuse_request(HttpResponse::error(reader_.error()));
      case RequestReader::Step::Done:
        return dispatch(reader_.take());
    }
  }

  void read() {
    if (state_ == State::Closed) return;
    // Idle: the keep-alive wait (or a new connection's) for a first byte; then the request's
    // deadline, which every later read shares, so that trickled bytes do not extend it. A
    // timer of our own rather than the stream's expiry, which would close the socket: a
    // request cut off by its deadline is answered 408.
    const clock::time_point when =
        state_ == State::Idle ? clock::now() + std::min(srv_.limits.idle, srv_.limits.timeout) : deadline_;
    const uint64_t gen = ++read_gen_;
    timed_out_ = false;
    timer_.expires_at(when);
    timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
      if (ec || gen != self->read_gen_ || !self->reading_) return;
      self->timed_out_ = true;
      beast::error_code ignored;
      self->stream_.socket().cancel(ignored);
    });
    reading_ = true;
    stream_.expires_never();
    buf_.resize(64 << 10);
    stream_.async_read_some(asio::buffer(buf_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->reading_ = false;
      self->timer_.cancel();
      self->on_read(ec, n);
    });
  }

  void on_read(beast::error_code ec, size_t n) {
    if (state_ == State::Closed) return;
    if (ec) {
      if (timed_out_ && state_ == State::Reading && reader_.started()) {
        reader_.abandon();
        return refuse_request(HttpResponse::error(
            ApiError(408, fmt::format("the request took longer than {} s to arrive", srv_.limits.timeout.count()),
                     "", "request_timeout")));
      }
      return close();
    }
    if (state_ == State::Idle) begin_request();
    in_.append(buf_.data(), n);
    parse();
  }

  // A request that cannot be read on (its framing, its size, its time): the error, then the
  // connection is closed.
  void refuse_request(HttpResponse r) {
    state_ = State::Reading;
    AnswerContext c;
    AccessEntry e;
    e.remote = address_ + ":" + std::to_string(port_);
    e.method = reader_.failed_method();
    e.path = reader_.failed_path();
    e.status = r.status;
    answer_start_ = clock::now();
    in_.clear();
    enqueue(head_bytes(r, c, false, false) + r.body, nullptr);
    finish_after_writes(false, std::move(e));
  }

  void dispatch(HttpRequest req);

  void write_next() {
    if (out_.empty()) {
      writing_ = false;
      if (finish_) finish();
      return;
    }
    writing_ = true;
    stream_.expires_after(srv_.limits.timeout);
    asio::async_write(stream_, asio::buffer(out_.front().bytes),
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        if (self->state_ == State::Closed) return;
                        Pending p = std::move(self->out_.front());
                        self->out_.pop_front();
                        if (ec) {
                          self->writing_ = false;
                          if (p.done) p.done(false);
                          return self->close();
                        }
                        if (p.done) p.done(true);
                        self->write_next();
                      });
  }

  void finish() {
    Finish f = std::move(*finish_);
    finish_.reset();
    f.entry.ms = std::chrono::duration<double, std::milli>(clock::now() - answer_start_).count();
    if (srv_.owner->on_done) srv_.owner->on_done(f.entry);
    if (state_ == State::Closed) return;
    if (f.keep_alive && !srv_.stopping) return next();
    linger();
  }

  // Closing after an answer the client may still be sending to (a refusal before its body,
  // pipelined requests past a "Connection: close"): our side is shut, and what the client
  // sends is read and dropped for a moment, so that its unread bytes do not make the kernel
  // reset the connection before the client has read the answer.
  void linger() {
    srv_.unregister(this);  // no longer counted: it gives way to new connections
    if (srv_.stopping) return close();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    state_ = State::Reading;
    lingering_ = true;
    stream_.expires_after(std::chrono::seconds(2));
    drain();
  }
  void drain() {
    buf_.resize(16 << 10);
    stream_.async_read_some(asio::buffer(buf_), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }

 public:
  bool lingering() const { return lingering_; }
  clock::time_point answer_start_ = clock::now();
  int served_ = 0;

 private:
  HttpServer::Impl& srv_;
  beast::tcp_stream stream_;
  RequestReader reader_;
  std::string address_;
  int port_;
  State state_ = State::Idle;
  bool lingering_ = false;
  clock::time_point idle_since_, deadline_;
  std::string in_;    // read, not yet parsed (the rest of a pipelined request)
  std::string buf_;   // each read's buffer
  asio::steady_timer timer_{srv_.io};  // the current read's deadline
  uint64_t read_gen_ = 0;
  bool reading_ = false, timed_out_ = false;
  std::deque<Pending> out_;
  bool writing_ = false;
  std::optional<Finish> finish_;
};

// An answer written to a connection from any thread, through the I/O thread. A worker's
// stream does not wait for each chunk to be written (a round trip between threads per token):
// it goes on while less than kInFlight bytes are queued, and waits past that, so that a client
// that stops reading holds the worker (and its generation) to the write timeout, and a failed
// write (the client gone) is seen at the next chunk.
class SocketSink final : public ExchangeSink {
 public:
  static constexpr size_t kInFlight = 64 << 10;

  SocketSink(AnswerContext ctx, std::shared_ptr<Connection> c, bool watch)
      : ExchangeSink(std::move(ctx)), c_(std::move(c)), flow_(std::make_shared<Flow>()) {
    // The socket's own descriptor may be closed by the I/O thread (a write timed out) and
    // its number reused; a duplicate keeps this one's socket while the worker polls it.
    if (watch) fd_ = fcntl(c_->fd(), F_DUPFD_CLOEXEC, 0);
  }
  ~SocketSink() override {
    if (fd_ >= 0) ::close(fd_);
  }

  bool send(std::string bytes, bool wait) override {
    std::shared_ptr<Flow> f = flow_;
    const size_t n = bytes.size();
    {
      std::lock_guard<std::mutex> lk(f->m);
      if (f->broken) return false;
      f->pending += n;
    }
    auto c = c_;
    asio::post(c->io(), [c, f, n, b = std::move(bytes)]() mutable {
      c->enqueue(std::move(b), [f, n](bool ok) {
        {
          std::lock_guard<std::mutex> lk(f->m);
          f->pending -= n;
          if (!ok) f->broken = true;
        }
        f->cv.notify_all();
      });
    });
    if (!wait || c->io().get_executor().running_in_this_thread()) return true;
    std::unique_lock<std::mutex> lk(f->m);
    f->cv.wait(lk, [&] { return f->broken || f->pending <= kInFlight; });
    return !f->broken;
  }

  void finish(bool keep_alive, AccessEntry entry) override {
    auto c = c_;
    asio::post(c->io(), [c, keep_alive, e = std::move(entry)]() mutable {
      c->finish_after_writes(keep_alive, std::move(e));
    });
  }

  bool gone() const override {
    {
      std::lock_guard<std::mutex> lk(flow_->m);
      if (flow_->broken) return true;
    }
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
  }

 private:
  // The bytes queued and not yet written, and whether a write failed: shared with the write
  // callbacks, which may run after the exchange is gone.
  struct Flow {
    std::mutex m;
    std::condition_variable cv;
    size_t pending = 0;
    bool broken = false;
  };
  std::shared_ptr<Connection> c_;
  std::shared_ptr<Flow> flow_;
  int fd_ = -1;
};

// answer_bytes' sink: everything appended to one string.
class BufferSink final : public ExchangeSink {
 public:
  BufferSink(AnswerContext ctx, std::string& out, bool& keep) : ExchangeSink(std::move(ctx)), out_(out), keep_(keep) {}
  bool send(std::string bytes, bool) override {
    out_ += bytes;
    return true;
  }
  void finish(bool keep_alive, AccessEntry) override { keep_ = keep_alive; }
  bool gone() const override { return false; }

 private:
  std::string& out_;
  bool& keep_;
};

AccessEntry entry_of(const HttpRequest& req) {
  AccessEntry e;
  e.remote = req.remote_addr + ":" + std::to_string(req.remote_port);
  e.method = req.method;
  e.path = req.path;
  return e;
}

void Connection::dispatch(HttpRequest req) {
  state_ = State::Busy;
  answer_start_ = clock::now();
  ++served_;
  req.remote_addr = address_;
  req.remote_port = port_;
  HttpServer::Impl::Plan plan = srv_.plan(req);
  AnswerContext ctx = srv_.context(req, served_);
  ctx.head_only = plan.head_only;
  const bool worker = plan.route && plan.route->where == RunOn::Worker;
  auto ex = std::make_shared<Exchange>(std::make_unique<SocketSink>(std::move(ctx), shared_from_this(), worker),
                                       entry_of(req));
  if (!plan.route) {
    ex->respond(std::move(*plan.answer));
    return;
  }
  if (!worker) {
    const size_t bytes = req.body.size();
    srv_.run_handler(*plan.route, req, *ex);
    ex.reset();
    req = HttpRequest{};
    if (srv_.owner->after_request) srv_.owner->after_request(bytes);
    return;
  }
  auto r = std::make_shared<HttpRequest>(std::move(req));
  srv_.pool.post([&srv = srv_, route = plan.route, r, ex]() mutable {
    const size_t bytes = r->body.size();
    srv.run_handler(*route, *r, *ex);
    ex.reset();
    r.reset();
    if (srv.owner->after_request) srv.owner->after_request(bytes);
  });
}

std::string HttpServer::Impl::cors_origin(const HttpRequest& req) const {
  if (cors.empty()) return "";
  const std::string origin = req.header("Origin");
  if (origin.empty()) return "";
  for (const std::string& o : cors) {
    if (o == "*") return "*";
    if (o == origin) return origin;
  }
  return "";
}

AnswerContext HttpServer::Impl::context(const HttpRequest& req, int served) const {
  AnswerContext c;
  c.version = req.version;
  c.keep_alive = req.keep_alive && !stopping && served < limits.max_requests_per_connection;
  c.requests_left = limits.max_requests_per_connection - served;
  c.hint = limits.keep_alive_hint;
  c.cors_origin = cors_origin(req);
  return c;
}

HttpServer::Impl::Plan HttpServer::Impl::plan(HttpRequest& req) const {
  Plan p;
  // The routes of the path, and the methods they take.
  std::vector<const Route*> here;
  for (const Route& r : routes) {
    const bool match = r.prefix ? req.path.size() > r.path.size() && req.path.rfind(r.path, 0) == 0
                                : req.path == r.path;
    if (match) here.push_back(&r);
  }
  std::string allow;
  for (const Route* r : here) {
    allow += (allow.empty() ? "" : ", ") + r->method;
    if (r->method == "GET") allow += ", HEAD";
  }
  if (req.method == "OPTIONS") {
    // Needs no API key: a browser's CORS preflight carries none.
    if (here.empty() && req.target != "*") {
      p.answer = HttpResponse::error(ApiError(404, "no such endpoint", "", "not_found"));
      return p;
    }
    HttpResponse r;
    r.status = 204;
    r.set_header("Allow", (allow.empty() ? "GET, HEAD, POST" : allow) + ", OPTIONS");
    if (!cors_origin(req).empty() && req.has_header("Access-Control-Request-Method")) {
      r.set_header("Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS");
      // The headers the page asks for (the openai library sends its own x-stainless-*
      // headers), Authorization and Content-Type named always: a "*" would not cover
      // Authorization.
      std::string asked = req.header("Access-Control-Request-Headers");
      const bool token_list = asked.find_first_not_of(
                                  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_, ") ==
                              std::string::npos;
      std::string headers = "Authorization, Content-Type";
      if (token_list && !asked.empty()) headers += ", " + asked;
      r.set_header("Access-Control-Allow-Headers", headers);
      r.set_header("Access-Control-Max-Age", "600");
    }
    p.answer = std::move(r);
    return p;
  }
  // A POST whose body's end is not known: answered before anything of it is read.
  if (req.method == "POST" && !req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
    p.answer = HttpResponse::error(
        ApiError(411, "a POST needs a Content-Length header (or chunked transfer encoding)", "", "length_required"));
    return p;
  }
  if (owner->before_route) {
    if (std::optional<HttpResponse> a = owner->before_route(req)) {
      p.answer = std::move(a);
      return p;
    }
  }
  for (const Route* r : here) {
    if (r->method == req.method || (req.method == "HEAD" && r->method == "GET")) {
      p.route = r;
      p.head_only = req.method == "HEAD";
      if (r->prefix) req.rest = req.path.substr(r->path.size());
      return p;
    }
  }
  if (here.empty()) {
    p.answer = HttpResponse::error(ApiError(404, "no such endpoint", "", "not_found"));
    return p;
  }
  HttpResponse r = HttpResponse::error(ApiError(
      405, fmt::format("{} takes {}, not {}", req.path, here.front()->method, req.method), "", "method_not_allowed"));
  r.set_header("Allow", allow);
  p.answer = std::move(r);
  return p;
}

void HttpServer::Impl::run_handler(const Route& route, HttpRequest& req, Exchange& ex) const {
  try {
    route.handler(req, ex);
  } catch (const ApiError& e) {
    ex.respond(HttpResponse::error(e));
  } catch (const std::exception& e) {
    if (ex.answered()) return;
    ex.respond(HttpResponse::error(ApiError(500, e.what(), "", "server_error")));
  }
}

void HttpServer::Impl::unregister(Connection* c) {
  if (conns.erase(c) == 0) return;
  auto it = per_address.find(c->address());
  if (it != per_address.end() && --it->second <= 0) per_address.erase(it);
}

// Closes the connection that has waited longest for a next request (of `address`, or any);
// false when none waits.
bool HttpServer::Impl::evict_idle(const std::string* address) {
  Connection* oldest = nullptr;
  for (Connection* c : conns)
    if (c->state() == Connection::State::Idle && !c->writing() && (!address || c->address() == *address) &&
        (!oldest || c->idle_since() < oldest->idle_since()))
      oldest = c;
  if (!oldest) return false;
  oldest->close();
  return true;
}

void HttpServer::Impl::refuse(tcp::socket s) {
  const std::string body =
      HttpResponse::error(
          ApiError(503, "the server has too many connections open; retry later", "", "too_many_connections"))
          .body;
  const std::string bytes = fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
      "Retry-After: 1\r\nConnection: close\r\n\r\n{}",
      body.size(), body);
  // A new socket's send buffer is empty: the answer fits without waiting.
  ::send(s.native_handle(), bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  beast::error_code ec;
  s.shutdown(tcp::socket::shutdown_send, ec);
  if (draining >= 64) return;  // closed at once: a flood is not worth a gentle close each
  // Read and dropped for a moment, so that a request already sent does not turn the close
  // into a reset that loses the answer.
  ++draining;
  auto stream = std::make_shared<beast::tcp_stream>(std::move(s));
  auto buf = std::make_shared<std::array<char, 4096>>();
  stream->expires_after(std::chrono::seconds(1));
  auto drain = std::make_shared<std::function<void()>>();
  *drain = [this, stream, buf, drain] {
    stream->async_read_some(asio::buffer(*buf), [this, stream, drain](beast::error_code ec, size_t) {
      if (!ec) return (*drain)();
      --draining;
      stream->close();
      *drain = nullptr;  // the cycle through the closure
    });
  };
  (*drain)();
}

void HttpServer::Impl::admit(tcp::socket s) {
  beast::error_code ec;
  const tcp::endpoint peer = s.remote_endpoint(ec);
  if (ec) return;
  std::string address = peer.address().to_string();
  if (peer.address().is_v6() && peer.address().to_v6().is_v4_mapped())
    address = asio::ip::make_address_v4(asio::ip::v4_mapped, peer.address().to_v6()).to_string();
  const int per = limits.max_connections_per_address;
  const auto from = per_address.find(address);
  if (per > 0 && from != per_address.end() && from->second >= per && !evict_idle(&address))
    return refuse(std::move(s));
  if ((int)conns.size() >= limits.max_connections && !evict_idle(nullptr)) return refuse(std::move(s));
  s.set_option(tcp::no_delay(true), ec);  // a stream's small chunks go out as they come
  auto c = std::make_shared<Connection>(*this, std::move(s), address, peer.port());
  conns.insert(c.get());
  ++per_address[address];
  c->start();
}

void HttpServer::Impl::accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket s) {
    if (!acceptor.is_open() || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of descriptors (or a connection aborted before it was taken): accept again in a
      // moment, as connections close.
      if (!accept_failure_noted && (ec == asio::error::no_descriptors || ec.value() == ENFILE)) {
        accept_failure_noted = true;
        std::cerr << fmt::format("kestrel serve: cannot accept connections ({}); raise the open files limit "
                                 "(ulimit -n) or lower --max-connections\n",
                                 ec.message())
                  << std::flush;
      }
      retry.expires_after(std::chrono::milliseconds(100));
      retry.async_wait([this](beast::error_code e) {
        if (!e) accept();
      });
      return;
    }
    admit(std::move(s));
    accept();
  });
}

// ---- HttpServer ----------------------------------------------------------------------------

HttpServer::HttpServer(HttpLimits limits) : impl_(std::make_unique<Impl>(limits)) { impl_->owner = this; }

HttpServer::~HttpServer() {
  if (impl_->io_thread.joinable()) stop();
}

void HttpServer::route(const std::string& method, const std::string& path, RunOn where, HttpHandler handler) {
  Route r;
  r.method = method;
  r.prefix = path.size() >= 2 && path.compare(path.size() - 2, 2, "/*") == 0;
  r.path = r.prefix ? path.substr(0, path.size() - 1) : path;
  r.where = where;
  r.handler = std::move(handler);
  impl_->routes.push_back(std::move(r));
}

void HttpServer::set_cors_origins(std::vector<std::string> origins) { impl_->cors = std::move(origins); }

int HttpServer::bind(const std::string& host, int port) {
  auto fail = [&](const std::string& why) {
    return Error(fmt::format("cannot listen on {}:{}: {}", url_host(host), port, why));
  };
  beast::error_code ec;
  tcp::resolver resolver(impl_->io);
  const auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
  if (ec) throw fail(ec.message());
  std::string why;
  for (const auto& r : results) {
    tcp::acceptor& a = impl_->acceptor;
    a.open(r.endpoint().protocol(), ec);
    // SO_REUSEADDR (a restart may bind while old connections linger) but not SO_REUSEPORT,
    // under which a second server on a taken port would bind too and be handed half of its
    // connections.
    if (!ec) a.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) a.bind(r.endpoint(), ec);
    // A backlog for many clients connecting at once (a small one makes a burst wait for SYN
    // retries); connections made while the model loads wait in it.
    if (!ec) a.listen(512, ec);
    if (!ec) return a.local_endpoint().port();
    if (why.empty()) why = ec.message();
    beast::error_code ignored;
    a.close(ignored);
  }
  throw fail(why.empty() ? "the address could not be bound" : why);
}

void HttpServer::start(int workers) {
  // Each connection is a descriptor: the soft limit (often 1024) raised toward the hard one,
  // so that --max-connections is what bounds them.
  rlimit rl{};
  const rlim_t want = (rlim_t)impl_->limits.max_connections + 256;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < want) {
    rl.rlim_cur = std::min(want, rl.rlim_max);
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  impl_->pool.start(workers);
  impl_->accept();
  impl_->io_thread = std::thread([this] {
    auto guard = asio::make_work_guard(impl_->io);
    // A handler that throws (out of memory) ends run(); the thread reports it and runs on,
    // so that the server can still be stopped in order.
    for (;;) {
      try {
        impl_->io.run();
        return;
      } catch (const std::exception& e) {
        if (on_fatal) on_fatal(e.what());
      }
    }
  });
}

void HttpServer::stop() {
  Impl& s = *impl_;
  s.stopping = true;
  auto on_io = [&](std::function<void()> fn) {
    std::promise<void> done;
    asio::post(s.io, [&] {
      fn();
      done.set_value();
    });
    done.get_future().wait();
  };
  // No new connections; those waiting for or reading a request close; those whose request
  // runs on a worker stay until its answer is written.
  on_io([&] {
    beast::error_code ec;
    s.acceptor.close(ec);
    s.retry.cancel();
    for (Connection* c : std::vector<Connection*>(s.conns.begin(), s.conns.end()))
      if (c->state() != Connection::State::Busy) c->close();
  });
  s.pool.stop();
  // The workers' last answers are queued or being written: each connection closes once its
  // writes end (Connection::finish sees `stopping`); any still open after 2 s is closed.
  const auto end = clock::now() + std::chrono::seconds(2);
  for (;;) {
    bool open = false;
    on_io([&] { open = !s.conns.empty() || s.draining > 0; });
    if (!open || clock::now() > end) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  s.io.stop();
  s.io_thread.join();
}

std::string HttpServer::answer_bytes(std::string_view input) {
  Impl& s = *impl_;
  std::string in(input), out;
  RequestReader reader(s.limits);
  for (int served = 1;; ++served) {
    const RequestReader::Step step = reader.step(in);
    if (step == RequestReader::Step::More) {
      // The input ended within a request: the connection's deadline would pass.
      if (reader.started()) {
        const HttpResponse r =
            HttpResponse::error(ApiError(408, "the request took too long to arrive", "", "request_timeout"));
        out += head_bytes(r, AnswerContext{}, false, false) + r.body;
      }
      return out;
    }
    if (step == RequestReader::Step::Failed) {
      const HttpResponse r = HttpResponse::error(reader.error());
      return out + head_bytes(r, AnswerContext{}, false, false) + r.body;
    }
    HttpRequest req = reader.take();
    req.remote_addr = "127.0.0.1";
    Impl::Plan plan = s.plan(req);
    AnswerContext ctx = s.context(req, served);
    ctx.head_only = plan.head_only;
    bool keep = false;
    {
      Exchange ex(std::make_unique<BufferSink>(std::move(ctx), out, keep), entry_of(req));
      if (plan.route)
        s.run_handler(*plan.route, req, ex);
      else
        ex.respond(std::move(*plan.answer));
    }
    if (!keep) return out;
  }
}

}  // namespace kestrel::server
