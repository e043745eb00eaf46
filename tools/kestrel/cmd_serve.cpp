// kestrel serve: the model behind an OpenAI-compatible HTTP API (cpp-httplib), for the chat
// clients, editors and libraries that speak it. Requests are read into engine options by
// engine/server/request.h, answered in OpenAI's shapes by engine/server/response.h, and run on
// --parallel sessions of the one loaded model behind a bounded queue
// (engine/server/scheduler.h). Each connection is served on a thread of its own, which runs its
// generation itself, taking the model's turn for each step.
#include <arpa/inet.h>
#include <dirent.h>
#include <fmt/format.h>
#include <httplib.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "base/error.h"
#include "base/interrupt.h"
#include "engine/generate.h"
#include "engine/server/api_error.h"
#include "engine/server/request.h"
#include "engine/server/response.h"
#include "engine/server/scheduler.h"
#include "tokenizer/chat_template.h"
#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "tools/kestrel/server/access.h"

namespace kestrel::cli {

namespace {

using nlohmann::json;
using server::ApiError;
using server::Endpoint;
using clock = std::chrono::steady_clock;

struct ServeArgs {
  ModelOptions model;
  std::string host = "127.0.0.1";
  int port = 8080;
  server::ApiKeySources key_sources;  // --api-key, --api-key-file (KESTREL_API_KEY is read at start)
  std::string api_key;               // the key required, resolved from them; "" = none
  int parallel = 1;
  int queue = 16;
  int n_predict = -1;
  SamplingOptions sampling;
  std::string chat_template = "auto";
  std::string template_kwargs_text;  // --chat-template-kwargs
  nlohmann::json template_kwargs;    // ... read (null when not given): the requests' defaults
  std::string alias;
  int64_t max_body = 8 << 20;
  int64_t max_json_values = 0;  // 0: server::kDefaultMaxJsonValues or twice the context, the larger
  int max_json_depth = server::kDefaultMaxJsonDepth;
  int timeout = 60;
  bool log_prompts = false;
  bool quiet = false;
  SpecOptions spec;
};

// What the access log learns of the request a thread is serving: cpp-httplib calls the
// logger on the thread that ran the handler, once the answer is written.
struct RequestLog {
  clock::time_point start{};
  int prompt_tokens = -1, completion_tokens = -1;
  std::string finish;
  std::optional<std::string> prompt;
};
thread_local RequestLog t_log;

// A request body past this size has its memory given back to the system once its connection
// is done (TrimmingTaskQueue).
constexpr size_t kTrimAfterBodyBytes = 1 << 20;
// Set by the logger when this thread's request had such a body.
thread_local bool t_trim = false;

// Memory a large request used, given back to the system. glibc gives every thread that
// allocates an arena of its own and keeps what is freed there for reuse: a large body and the
// DOM parsed from it (many small chunks) leave their pages resident after they are freed, and
// with requests landing on different threads (arenas) the server's RSS grew by that much per
// arena and never came back. Three things undo it:
//  - malloc's thresholds are fixed (set_malloc_thresholds): by default a freed large block
//    raises them to its size (up to 32 MiB / 64 MiB), after which 8 MB bodies live inside
//    arenas and an arena keeps a top of up to twice that resident;
//  - after a connection whose request had a large body, malloc_trim(0), which hands the free
//    pages inside every arena back (madvise);
//  - before it, a free of a block of 256 KiB (arena-allocated, under the mmap threshold):
//    malloc_trim merges freed small chunks into the arena's top but (glibc 2.36) shrinks only
//    the main arena's top, while a free of 64 KiB or more makes glibc merge them and shrink
//    the top of the thread's own arena. (In the CLI test the DOM's own large frees already do
//    this: pinning the thresholds is what takes the RSS back there, from 25-34 MB kept per
//    batch of 8 with malloc_trim alone to 2 MB.)
// It runs once the connection's last request is done, when the Request (and its body) is
// gone; a kept-alive connection keeps its last body's memory for reuse until it closes.
void set_malloc_thresholds() {
  mallopt(M_MMAP_THRESHOLD, 1 << 20);  // blocks past 1 MiB (large bodies) are mapped, unmapped on free
  mallopt(M_TRIM_THRESHOLD, 1 << 20);  // an arena's top past 1 MiB is given back
}
void give_back_memory() {
  // volatile: a malloc whose block is never used may be optimised away with its free.
  if (void* volatile p = malloc(256 << 10)) free(p);
  malloc_trim(0);
}

// cpp-httplib's thread pool, each connection's task followed by give_back_memory() when one of
// its requests had a body past kTrimAfterBodyBytes.
class TrimmingTaskQueue : public httplib::TaskQueue {
 public:
  explicit TrimmingTaskQueue(size_t threads) : pool_(threads) {}
  void enqueue(std::function<void()> fn) override {
    pool_.enqueue([fn = std::move(fn)] {
      fn();
      if (t_trim) {
        t_trim = false;
        give_back_memory();
      }
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  httplib::ThreadPool pool_;
};

// The connection's socket: cpp-httplib 0.11 does not hand it to handlers, and a handler needs
// it to see that the client went away while it waits or generates without writing. It is the
// process's one socket whose two ends are the request's addresses.
int connection_socket(const httplib::Request& req) {
  auto address = [](const sockaddr_storage& a, std::string& host, int& port) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
      inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
      port = ntohs(in->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
      inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof(buf));
      port = ntohs(in->sin6_port);
    } else {
      return false;
    }
    host = buf;
    return true;
  };
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int found = -1;
  while (dirent* e = readdir(d)) {
    const int fd = std::atoi(e->d_name);
    if (e->d_name[0] < '0' || e->d_name[0] > '9' || fd == dirfd(d)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t ll = sizeof(local), pl = sizeof(peer);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0)
      continue;
    std::string lh, ph;
    int lp = 0, pp = 0;
    if (address(local, lh, lp) && address(peer, ph, pp) && lp == req.local_port &&
        pp == req.remote_port && ph == req.remote_addr && lh == req.local_addr) {
      found = fd;
      break;
    }
  }
  closedir(d);
  return found;
}

// Whether the client closed its end (or the connection broke).
bool peer_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

// The method a path of the API takes ("GET" or "POST"), or "" for a path it does not have: a
// request with the other method gets 405 naming it, not 404. (The routes of Server::run.)
std::string allowed_method(const std::string& path) {
  const std::string model = "/v1/models/";
  if (path == "/health" || path == "/v1/models" ||
      (path.size() > model.size() && path.rfind(model, 0) == 0))
    return "GET";
  if (path == "/v1/chat/completions" || path == "/v1/completions" || path == "/tokenize" ||
      path == "/detokenize")
    return "POST";
  return "";
}

// Seconds an idle keep-alive connection is kept open, and what the Keep-Alive header tells
// clients (Server::run says why they differ).
constexpr int kKeepAliveIdleSeconds = 10;
constexpr int kKeepAliveHintSeconds = 2;

// cpp-httplib's server with a listen backlog for many clients connecting at once (the library
// builds in 5, which makes a burst of connections wait for SYN retries).
class HttpServer : public httplib::Server {
 public:
  int bind(const std::string& host, int port) {
    const int bound = port == 0 ? bind_to_any_port(host) : (bind_to_port(host, port) ? port : -1);
    if (bound > 0) ::listen(svr_sock_, 512);
    return bound;
  }
};

// Why host:port cannot be bound, the library's bind having failed (it keeps no errno of its
// own): the address resolved and bound again as the library does, and the first failure's
// text ("Address already in use", "Cannot assign requested address", ...).
std::string bind_failure(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &list); rc != 0)
    return gai_strerror(rc);
  std::string why;
  for (addrinfo* ai = list; ai && why.empty(); ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 1) != 0) why = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(list);
  return why.empty() ? "the address could not be bound" : why;
}

std::string url_host(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

// The listening socket, bound before the model loads so that a port in use (or an address not
// of this host) is found in a moment, not after the weights. Connections made while the model
// loads wait in the backlog until the server runs.
int bind_listener(HttpServer& svr, const ServeArgs& a) {
  // SO_REUSEADDR (a restart may bind while old connections linger) but not the library's
  // SO_REUSEPORT, under which a second server on a taken port would bind too and be handed
  // half of its connections.
  svr.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int port = svr.bind(a.host, a.port);
  if (port < 0)
    throw Error(fmt::format("cannot listen on {}:{}: {}", url_host(a.host), a.port, bind_failure(a.host, a.port)));
  return port;
}

std::string model_id(const ServeArgs& a) {
  if (!a.alias.empty()) return a.alias;
  std::filesystem::path p = std::filesystem::path(a.model.dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

class Server {
 public:
  Server(const ServeArgs& a, LoadedModel& m, std::optional<ChatTemplate> tmpl,
         std::unique_ptr<LoadedModel> draft)
      : a_(a), m_(m), tmpl_(std::move(tmpl)), id_(model_id(a)), created_(std::time(nullptr)),
        draft_(std::move(draft)), rng_(std::random_device{}()) {
    defaults_.sampling = resolve_sampling(a.model.dir, a.sampling);
    defaults_.max_tokens = a.n_predict;
    defaults_.stop = a.sampling.stop;
    defaults_.chat_template_kwargs = a.template_kwargs;
    // One session is the command's already; --parallel adds the others. Sessions that share
    // the model take its turn for every step; a lone one runs unwrapped, device-chained runs
    // included.
    const int ctx = m_.session->context_length();
    std::vector<std::unique_ptr<Session>> raw;
    raw.push_back(std::move(m_.session));
    for (int i = 1; i < a.parallel; ++i) {
      raw.push_back(m_.model->new_session(ctx, a.quiet));
      // A GPU short of memory shortens a session's context; requests are checked against one
      // context for every slot, so all slots must have it.
      if (raw.back()->context_length() < ctx)
        throw Error(fmt::format("{}: the GPU holds only {} positions for session {} of {} "
                                "(the first has {}): lower --parallel or -c",
                                a.model.dir, raw.back()->context_length(), i + 1, a.parallel, ctx));
    }
    for (auto& s : raw)
      sessions_.push_back(a.parallel == 1 ? std::move(s)
                                          : std::make_unique<server::TurnTakingSession>(std::move(s), turn_));
    // --spec draft: a session of the draft model per slot, taking the draft model's turn. (A
    // GPU short of memory may give one less context: its drafter then proposes nothing past
    // it, and the slot decodes on alone.)
    if (draft_) {
      const int dctx = draft_->session->context_length();
      std::vector<std::unique_ptr<Session>> d;
      d.push_back(std::move(draft_->session));
      for (int i = 1; i < a.parallel; ++i) d.push_back(draft_->model->new_session(dctx, a.quiet));
      for (auto& s : d)
        draft_sessions_.push_back(
            a.parallel == 1 ? std::move(s)
                            : std::make_unique<server::TurnTakingSession>(std::move(s), draft_turn_));
    }
    // Every request's JSON is parsed within these (server/request.h says why); a prompt of
    // token ids is one value per token, so the values allowed are at least twice the context.
    limits_.max_values = a.max_json_values > 0
                             ? (size_t)a.max_json_values
                             : std::max(server::kDefaultMaxJsonValues, 2 * (size_t)ctx);
    limits_.max_depth = a.max_json_depth;
    slots_ = std::make_unique<server::Slots>(a.parallel, a.queue, [this](int i) -> const std::vector<int>& {
      return sessions_[i]->cached;
    });
    seed_base_ = rng_();
  }

  // Serves on `svr`, bound (bind_listener) to `port`, until SIGINT or SIGTERM.
  int run(HttpServer& svr, int port) {
    const int threads = a_.parallel + a_.queue + 64;  // the slots, the line, idle keep-alives
    set_malloc_thresholds();
    svr.new_task_queue = [threads] { return new TrimmingTaskQueue(threads); };
    // Keep-alive (docs/hardening.md). A server that closes an idle connection races the
    // client's next request on it: a client that wrote it before it read the close gets the
    // connection reset, the request unanswered. Clients that honour the Keep-Alive hint stop
    // reusing before it (Node's fetch at timeout - 2 s, so never for 2 s), but by a clock
    // that stops while their process stalls (an event loop blocked for seconds, as the serve
    // test's kestrel generate calls block it under ASan); others keep connections by their own
    // expiry (openai-python's httpx: 5 s). So the hint stays short, and the server waits much
    // longer than it says before it closes. An idle connection holds a thread meanwhile: past
    // the 64 spare ones a new connection waits in the library's queue, unseen by the slots'
    // 429, for at most that long.
    svr.set_keep_alive_timeout(kKeepAliveIdleSeconds);
    svr.set_post_routing_handler([](const httplib::Request&, httplib::Response& res) {
      // cpp-httplib 0.11 writes its own wait as the hint; the hint is the shorter one.
      if (!res.has_header("Keep-Alive")) return;  // "Connection: close" instead
      res.headers.erase("Keep-Alive");
      res.set_header("Keep-Alive", fmt::format("timeout={}, max={}", kKeepAliveHintSeconds,
                                               CPPHTTPLIB_KEEPALIVE_MAX_COUNT));
    });
    svr.set_payload_max_length((size_t)a_.max_body);
    svr.set_read_timeout(a_.timeout, 0);
    svr.set_write_timeout(a_.timeout, 0);
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      t_log = RequestLog{};
      t_log.start = clock::now();
      // A POST without its length: the library would read the body until the client closes
      // or --timeout passes, then answer 400. Refused before any of it is read.
      if (req.method == "POST" && !req.has_header("Content-Length") &&
          req.get_header_value("Transfer-Encoding").find("chunked") == std::string::npos) {
        error(res, ApiError(411, "a POST needs a Content-Length header (or chunked transfer encoding)",
                            "", "length_required"));
        return httplib::Server::HandlerResponse::Handled;
      }
      if (a_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      if (server::bearer_matches(req.get_header_value("Authorization"), a_.api_key))
        return httplib::Server::HandlerResponse::Unhandled;
      error(res, ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)", "", "invalid_api_key"));
      res.set_header("WWW-Authenticate", "Bearer");  // RFC 6750: the scheme the key goes in
      return httplib::Server::HandlerResponse::Handled;
    });
    svr.set_error_handler(httplib::Server::HandlerWithResponse(
        [](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      // The library's own refusals (unknown path, body too large, a request it could not
      // read) in OpenAI's shape; a known path asked with the other method is 405, with Allow.
      const int s = res.status;
      const std::string allow = s == 404 ? allowed_method(req.path) : std::string();
      if (!allow.empty() && allow != req.method) {
        res.set_header("Allow", allow == "GET" ? "GET, HEAD" : allow);  // the library answers HEAD
        error(res, ApiError(405, fmt::format("{} takes {}, not {}", req.path, allow, req.method), "",
                            "method_not_allowed"));
      } else {
        error(res, s == 404   ? ApiError(404, "no such endpoint", "", "not_found")
                   : s == 413 ? ApiError(413, "the request body is too large", "", "request_too_large")
                   : s == 414 ? ApiError(414, "the request's URI is too long", "", "uri_too_long")
                   : s == 400 ? ApiError(400, "the HTTP request could not be read", "", "bad_request")
                              : ApiError(s, fmt::format("the request could not be read (HTTP {})", s), "",
                                         s >= 500 ? "server_error" : "bad_request"));
      }
      return httplib::Server::HandlerResponse::Handled;
    }));
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      error(res, ApiError(500, what));
    });
    svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) { log(req, res); });

    svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      const server::Slots::Status s = slots_->status();
      res.set_content(server::dump({{"status", "ok"},
                                    {"slots_idle", s.idle},
                                    {"slots_processing", s.busy},
                                    {"queued", s.queued}}),
                      "application/json");
    });
    svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(server::dump({{"object", "list"}, {"data", json::array({model_json()})}}),
                      "application/json");
    });
    svr.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      if (req.matches[1] != id_)
        return error(res, ApiError(404, fmt::format("the model '{}' does not exist (this server has '{}')",
                                                    req.matches[1].str(), id_),
                                   "model", "model_not_found"));
      res.set_content(server::dump(model_json()), "application/json");
    });
    svr.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(Endpoint::Chat, req, res);
    });
    svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(Endpoint::Completion, req, res);
    });
    svr.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
      try {
        const server::TokenizeRequest t = server::parse_tokenize_request(req.body, limits_);
        const std::vector<int> ids = m_.tok->encode(t.content, t.add_special);
        json tokens = json::array();
        for (int id : ids)
          tokens.push_back(t.with_pieces ? json{{"id", id}, {"piece", server::token_piece(*m_.tok, id)}}
                                         : json(id));
        res.set_content(server::dump({{"tokens", tokens}}), "application/json");
      } catch (const ApiError& e) {
        error(res, e);
      }
    });
    svr.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
      try {
        const std::vector<int> ids = server::parse_detokenize_request(req.body, m_.spec->config.vocab, limits_);
        res.set_content(server::dump({{"content", m_.tok->decode(ids)}}), "application/json");
      } catch (const ApiError& e) {
        error(res, e);
      }
    });

    std::thread listener([&] {
      svr.listen_after_bind();
      // Ended otherwise than by a signal (accepting failed): wake the main thread.
      if (!stopping_) {
        listener_failed_ = true;
        kill(getpid(), SIGTERM);
      }
    });
    std::cerr << fmt::format("listening on http://{}:{} {}", url_host(a_.host), port,
                             a_.api_key.empty() ? "(no API key: anyone who can reach it may use it)"
                                                : "(API key required)")
              << std::endl;

    const int sig = wait_for_stop_signal();
    if (!listener_failed_)
      std::cerr << fmt::format("kestrel: {}: stopping (in-flight requests are cancelled)",
                               sig == SIGINT ? "SIGINT" : "SIGTERM")
                << std::endl;
    stopping_ = true;
    slots_->shut_down();
    svr.stop();
    listener.join();
    if (listener_failed_) throw Error("the server stopped accepting connections");
    std::cerr << "kestrel: stopped" << std::endl;
    return 0;
  }

 private:
  static void error(httplib::Response& res, const ApiError& e) {
    res.status = e.status();
    if (e.status() == 429) res.set_header("Retry-After", "1");
    res.set_content(server::dump(e.to_json()), "application/json");
  }

  json model_json() const {
    return {{"id", id_}, {"object", "model"}, {"created", created_}, {"owned_by", "kestrel"}};
  }

  uint64_t draw_seed() {
    std::lock_guard<std::mutex> lk(rng_mutex_);
    return rng_();
  }

  server::ResponseMeta meta(Endpoint e) {
    const uint64_t n = ++requests_;
    return {fmt::format("{}-{:016x}{:08x}", e == Endpoint::Chat ? "chatcmpl" : "cmpl", seed_base_, n),
            (int64_t)std::time(nullptr), id_};
  }

  void complete(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    try {
      server::CompletionRequest cr =
          server::parse_completion_request(endpoint, req.body, defaults_,
                                           a_.sampling.seed ? *a_.sampling.seed : draw_seed(), limits_);
      if (!cr.model.empty() && cr.model != id_)
        throw ApiError(404, fmt::format("the model '{}' does not exist (this server has '{}')", cr.model, id_),
                       "model", "model_not_found");
      const ChatTemplate* tmpl = endpoint == Endpoint::Chat ? &*tmpl_ : nullptr;
      auto p = std::make_shared<server::PreparedRequest>(server::prepare_request(
          cr, *m_.tok, tmpl, sessions_[0]->context_length(), m_.spec->config.vocab));
      p->options.reverse_prompts = a_.sampling.reverse;
      p->options.ignore_eos = p->options.ignore_eos || a_.sampling.ignore_eos;  // the request's or the server's
      t_log.prompt_tokens = (int)p->prompt_ids.size();
      if (a_.log_prompts)
        t_log.prompt = endpoint == Endpoint::Chat ? tmpl_->render(cr.messages, true, cr.chat_template_kwargs)
                                                  : m_.tok->decode(p->prompt_ids);

      const int fd = connection_socket(req);
      auto gone = [fd] { return peer_gone(fd); };
      server::Slots::Outcome why;
      std::shared_ptr<server::Slots::Lease> lease = slots_->acquire(p->prompt_ids, gone, why);
      if (!lease) {
        if (why == server::Slots::Outcome::QueueFull)
          throw ApiError(429, fmt::format("the server is busy ({} requests running, {} waiting); retry later",
                                          a_.parallel, a_.queue),
                         "", "rate_limit_exceeded");
        if (why == server::Slots::Outcome::Cancelled) {
          res.status = 499;  // nginx's "client closed request", for the log: nobody reads it
          t_log.finish = "cancelled";
          return;
        }
        throw ApiError(503, "the server is shutting down", "", "shutting_down");
      }
      Session& session = *sessions_[lease->slot()];
      const server::ResponseMeta rm = meta(endpoint);
      // The request's drafter, drafting with its own sampling (kept alive by the stream below).
      std::shared_ptr<Drafter> drafter;
      if (a_.spec.kind == "lookup") drafter = std::make_shared<NgramDrafter>();
      if (a_.spec.kind == "draft")
        drafter = std::make_shared<ModelDrafter>(*draft_sessions_[lease->slot()],
                                                 p->options.sampling, m_.spec->config.vocab);
      p->options.drafter = drafter.get();
      p->options.draft_max = a_.spec.draft_max;

      if (!cr.stream) {
        p->options.cancelled = [this, gone] { return stopping_.load() || gone(); };
        const GenerateResult r = generate_cached(session, *m_.tok, p->prompt_ids, p->options);
        note_result(r);
        if (r.finish_reason == "cancelled") {
          if (stopping_) throw ApiError(503, "the server is shutting down", "", "shutting_down");
          res.status = 499;
          return;
        }
        res.set_content(server::dump(server::completion_response(cr, rm, r, *m_.tok)), "application/json");
        return;
      }

      // Streamed: the generation runs as the body is written, the slot held until it ends.
      auto request = std::make_shared<server::CompletionRequest>(std::move(cr));
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, request, p, rm, lease, gone, drafter, &session](size_t, httplib::DataSink& sink) {
            bool ok = true;
            auto send = [&](const std::string& s) {
              if (ok && !sink.write(s.data(), s.size())) ok = false;
            };
            if (request->endpoint == Endpoint::Chat) send(server::sse_event(server::role_chunk(*request, rm)));
            // The provider runs after the handler returned, outside the library's own catch:
            // an engine failure here (out of memory, a CUDA error) must end this stream with
            // an error event, not the process. The options are this call's copy: `cancelled`
            // reads its locals.
            GenerateOptions options = p->options;
            options.cancelled = [&] { return !ok || stopping_.load() || gone(); };
            GenerateResult r;
            try {
              r = generate_cached(session, *m_.tok, p->prompt_ids, options, [&](std::string_view text) {
                send(server::sse_event(server::text_chunk(*request, rm, text)));
              });
            } catch (const std::exception& e) {
              std::cerr << fmt::format("kestrel serve: {}\n", e.what()) << std::flush;
              t_log.finish = "error";
              send(server::sse_event(ApiError(500, e.what(), "", "engine_error").to_json()));
              return false;
            }
            note_result(r);
            if (r.finish_reason == "cancelled") {
              // The client is gone, or the server is stopping. Stopping: an error event, no
              // [DONE] (the client knows the answer is cut), and the body ended properly, so
              // that the transfer itself is not an error as well.
              if (ok && stopping_) {
                send(server::sse_event(ApiError(503, "the server is shutting down", "", "shutting_down").to_json()));
                if (ok) sink.done();
                return ok;
              }
              return false;
            }
            send(server::sse_event(server::finish_chunk(*request, rm, r, *m_.tok)));
            if (request->include_usage) send(server::sse_event(server::usage_chunk(*request, rm, r)));
            send(server::kSseDone);
            if (ok) sink.done();
            return ok;
          },
          [lease](bool) mutable { lease.reset(); });
    } catch (const ApiError& e) {
      error(res, e);
    } catch (const Error& e) {  // the engine's own failure: the request was valid
      error(res, ApiError(500, e.what(), "", "engine_error"));
    }
  }

  void note_result(const GenerateResult& r) {
    t_log.completion_tokens = (int)r.ids.size();
    t_log.finish = server::finish_reason(r);
  }

  void log(const httplib::Request& req, const httplib::Response& res) {
    if (req.body.size() > kTrimAfterBodyBytes) t_trim = true;
    server::AccessEntry e;
    e.remote = fmt::format("{}:{}", req.remote_addr, req.remote_port);
    e.method = req.method;
    e.path = req.path;
    e.status = res.status;
    e.prompt_tokens = t_log.prompt_tokens;
    e.completion_tokens = t_log.completion_tokens;
    e.finish = t_log.finish;
    if (t_log.start != clock::time_point{})
      e.ms = std::chrono::duration<double, std::milli>(clock::now() - t_log.start).count();
    e.prompt = t_log.prompt;
    t_log = RequestLog{};
    char when[32];
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&now, &tm);
    std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    const std::string line = std::string(when) + " " + server::access_line(e) + "\n";
    std::lock_guard<std::mutex> lk(log_mutex_);
    std::cerr << line << std::flush;
  }

  const ServeArgs& a_;
  LoadedModel& m_;
  std::optional<ChatTemplate> tmpl_;
  std::string id_;
  int64_t created_;
  server::RequestDefaults defaults_;
  server::JsonLimits limits_;
  server::TurnLock turn_;
  std::vector<std::unique_ptr<Session>> sessions_;
  // --spec draft: the draft model (declared before its sessions, which it outlives), its
  // sessions by slot and their turn.
  std::unique_ptr<LoadedModel> draft_;
  server::TurnLock draft_turn_;
  std::vector<std::unique_ptr<Session>> draft_sessions_;
  std::unique_ptr<server::Slots> slots_;
  std::atomic<bool> stopping_{false}, listener_failed_{false};
  std::mutex rng_mutex_, log_mutex_;
  std::mt19937_64 rng_;
  uint64_t seed_base_ = 0;
  std::atomic<uint64_t> requests_{0};
};

int run_serve(ServeArgs& a) {
  // The key first: an empty or unreadable one is refused before anything else is done.
  server::ApiKeySources keys = a.key_sources;
  if (const char* env = std::getenv("KESTREL_API_KEY")) keys.env = env;
  a.api_key = server::resolve_api_key(keys);
  HttpServer svr;
  const int port = bind_listener(svr, a);
  // Not quieted by -q: a server open to the network without a key is worth a line.
  if (a.api_key.empty() && !server::is_loopback_host(a.host))
    std::cerr << fmt::format("kestrel serve: warning: {} is not a loopback address and no API key is "
                             "set: anyone who can reach it may use the server (--api-key-file FILE "
                             "or KESTREL_API_KEY sets one)",
                             a.host)
              << std::endl;

  const ModelLoadOptions lo = load_options(a.model, a.quiet);
  LoadedModel m = open_model(lo);
  std::string why;
  std::optional<ChatTemplate> tmpl(ChatTemplate::load(a.model.dir, a.chat_template, *m.tok, &why));
  if (!why.empty()) note(a.quiet, "note: " + why);
  check_template_kwargs_use(a.template_kwargs, *tmpl);
  load_weights(m, lo);
  // --spec draft loads the draft model now (its errors before the server listens); the
  // drafters themselves are made per request, with the request's sampling.
  std::unique_ptr<LoadedModel> draft =
      open_speculation(a.spec, m, a.model, SamplingParams{}, a.quiet).draft;

  // From here SIGINT and SIGTERM are taken by wait_for_stop_signal in Server::run, never
  // delivered to a thread (the server's threads inherit the mask); a write to a closed
  // connection is an error return, not a signal.
  block_stop_signals();
  signal(SIGPIPE, SIG_IGN);

  Server s(a, m, std::move(tmpl), std::move(draft));
  note(a.quiet, fmt::format("serving {} on {}: {} slot{} of {} tokens, queue {}{}", model_id(a),
                            m.device, a.parallel, a.parallel == 1 ? "" : "s",
                            context_length(m, lo), a.queue,
                            a.spec.kind.empty()
                                ? ""
                                : fmt::format(", speculative {} (draft-max {})", a.spec.kind,
                                              a.spec.draft_max)));
  return s.run(svr, port);
}

}  // namespace

void register_serve(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "serve the model over an OpenAI-compatible HTTP API");
  add_model_options(cmd, a->model);
  cmd->add_option("--host", a->host, "address to listen on (loopback unless told otherwise)")
      ->capture_default_str();
  cmd->add_option("--port", a->port, "port to listen on (0 = any free port, printed)")
      ->check(whole(0, 65535))
      ->capture_default_str();
  // Plain strings, their presence taken from the options' counts: CLI11 would read an empty
  // value into an std::optional as "not given", the very accident --api-key "" is refused for.
  auto key = std::make_shared<std::string>(), key_file = std::make_shared<std::string>();
  CLI::Option* key_opt =
      cmd->add_option("--api-key", *key,
                      "require \"Authorization: Bearer KEY\" on every request but /health "
                      "(visible in ps: prefer --api-key-file or KESTREL_API_KEY)")
          ->type_name("KEY");
  CLI::Option* key_file_opt =
      cmd->add_option("--api-key-file", *key_file,
                      "the API key is the first line of FILE (after --api-key; before KESTREL_API_KEY)")
          ->type_name("FILE");
  cmd->add_option("--parallel", a->parallel,
                  "requests generating at once, each in its own session (KV cache of -c tokens)")
      ->check(whole(1, 256))
      ->capture_default_str();
  cmd->add_option("--queue", a->queue, "requests waiting for a session before 429 answers")
      ->check(whole(0, 4096))
      ->capture_default_str();
  cmd->add_option("-n,--n-predict", a->n_predict,
                  "most new tokens when a request gives no max_tokens (-1 = up to the context)")
      ->check(token_count())
      ->capture_default_str();
  add_sampling_options(cmd, a->sampling);
  cmd->add_option("--template", a->chat_template,
                  "chat template: auto (the model's own), a .jinja file, or llama2, mistral, "
                  "zephyr, chatml, vicuna, raw")
      ->capture_default_str();
  auto* kwargs = add_template_kwargs_option(cmd, a->template_kwargs_text);
  cmd->add_option("--alias", a->alias, "the model's id in the API (default: the directory's name)");
  cmd->add_option("--max-body", a->max_body, "largest request body in bytes (larger: 413)")
      ->check(whole(1024, INT64_MAX))
      ->capture_default_str();
  cmd->add_option("--max-json-values", a->max_json_values,
                  fmt::format("most JSON values (objects, arrays, strings, numbers) a request body may "
                              "hold (more: 413); 0 = {} or twice the context, the larger",
                              server::kDefaultMaxJsonValues))
      ->check(whole(0, INT64_MAX))
      ->capture_default_str();
  cmd->add_option("--max-json-depth", a->max_json_depth,
                  "most objects and arrays a request body may nest (deeper: 400)")
      ->check(whole(1, 100000))
      ->capture_default_str();
  cmd->add_option("--timeout", a->timeout,
                  "seconds a client may take to send a request or to take the answer's next bytes")
      ->check(whole(1, 3600))
      ->capture_default_str();
  cmd->add_flag("--log-prompts", a->log_prompts, "also write each prompt's text to the access log");
  cmd->add_flag("-q,--quiet", a->quiet, "no notes on stderr (the listening line and the access log stay)");
  add_spec_options(cmd, a->spec);
  cmd->callback([a, &action, key, key_file, key_opt, key_file_opt, kwargs] {
    check_spec_options(a->spec);
    if (kwargs->count()) a->template_kwargs = parse_template_kwargs(a->template_kwargs_text);
    if (key_opt->count()) a->key_sources.flag = *key;
    if (key_file_opt->count()) a->key_sources.file = *key_file;
    action = [a] {
      if (!is_template_file(a->chat_template) && a->chat_template != "auto")
        parse_chat_format(a->chat_template);
      return run_serve(*a);
    };
  });
}

}  // namespace kestrel::cli
