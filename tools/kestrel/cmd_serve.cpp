// kestrel serve: the model behind an OpenAI-compatible HTTP API, for the chat clients, editors
// and libraries that speak it. Requests are read into engine options by
// engine/server/request.h, answered in OpenAI's shapes by engine/server/response.h, and run on
// --parallel sessions of the one loaded model behind a bounded queue
// (engine/server/scheduler.h). The HTTP transport is server/http.h: connections are read on
// one I/O thread; a completion or tokenize request runs on a worker thread, which runs its
// generation itself and writes its answer back. With --parallel > 1 the generations' passes
// run on one step thread (engine/server/batcher.h): the decode steps waiting at a time as one
// batched step, prompts in chunks of --batch-tokens between them (continuous batching).
#include <fmt/format.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>

#include "base/error.h"
#include "base/interrupt.h"
#include "engine/loader.h"
#include "engine/generate.h"
#include "engine/server/api_error.h"
#include "engine/server/batcher.h"
#include "engine/server/metrics.h"
#include "engine/server/request.h"
#include "engine/server/response.h"
#include "engine/server/scheduler.h"
#include "tokenizer/chat_template.h"
#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "tools/kestrel/server/access.h"
#include "tools/kestrel/server/http.h"

namespace kestrel::cli {

namespace {

using nlohmann::json;
using server::ApiError;
using server::Endpoint;

struct ServeArgs {
  ModelOptions model;
  std::string host = "127.0.0.1";
  int port = 8080;
  server::ApiKeySources key_sources;  // --api-key, --api-key-file (KESTREL_API_KEY is read at start)
  std::string api_key;               // the key required, resolved from them; "" = none
  int parallel = 1;
  int64_t kv_pool = -1;  // --kv-pool positions; -1: --parallel x -c at --parallel > 1; 0: none
  int batch_tokens = 512;
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
  int max_connections = 1024;
  int max_connections_per_ip = 64;
  std::vector<std::string> cors;  // --cors: origins allowed to call the API from a browser page
  bool log_prompts = false;
  bool quiet = false;
  SpecOptions spec;
};

// A request body past this size has its memory given back to the system once the request is
// done (HttpServer::after_request).
constexpr size_t kTrimAfterBodyBytes = 1 << 20;

// Memory a large request used, given back to the system. glibc gives every thread that
// allocates an arena of its own and keeps what is freed there for reuse: a large body and the
// DOM parsed from it (many small chunks) leave their pages resident after they are freed, and
// with requests landing on different threads (arenas) the server's RSS grew by that much per
// arena and never came back. Three things undo it:
//  - malloc's thresholds are fixed (set_malloc_thresholds): by default a freed large block
//    raises them to its size (up to 32 MiB / 64 MiB), after which 8 MB bodies live inside
//    arenas and an arena keeps a top of up to twice that resident;
//  - after a request with a large body, malloc_trim(0), which hands the free pages inside
//    every arena back (madvise);
//  - before it, a free of a block of 256 KiB (arena-allocated, under the mmap threshold):
//    malloc_trim merges freed small chunks into the arena's top but (glibc 2.36) shrinks only
//    the main arena's top, while a free of 64 KiB or more makes glibc merge them and shrink
//    the top of the thread's own arena. (In the CLI test the DOM's own large frees already do
//    this: pinning the thresholds is what takes the RSS back there, from 25-34 MB kept per
//    batch of 8 with malloc_trim alone to 2 MB.)
// It runs once the request (and its body) is gone (HttpServer::after_request), on the thread
// that served it.
void set_malloc_thresholds() {
  mallopt(M_MMAP_THRESHOLD, 1 << 20);  // blocks past 1 MiB (large bodies) are mapped, unmapped on free
  mallopt(M_TRIM_THRESHOLD, 1 << 20);  // an arena's top past 1 MiB is given back
}
void give_back_memory() {
  // volatile: a malloc whose block is never used may be optimised away with its free.
  if (void* volatile p = malloc(256 << 10)) free(p);
  malloc_trim(0);
}

// Seconds an idle keep-alive connection is kept open, and what the Keep-Alive header tells
// clients. A server that closes an idle connection races the client's next request on it: a
// client that wrote it before it read the close gets the connection reset, the request
// unanswered. Clients that honour the Keep-Alive hint stop reusing before it (Node's fetch at
// timeout - 2 s, so never for 2 s), but by a clock that stops while their process stalls (an
// event loop blocked for seconds, as the serve test's kestrel generate calls block it under
// ASan); others keep connections by their own expiry (openai-python's httpx: 5 s). So the hint
// stays short, and the server waits much longer than it says before it closes
// (docs/hardening.md). An idle connection holds no thread, and gives way to a new one when the
// connections are at their bound.
constexpr int kKeepAliveIdleSeconds = 10;
constexpr int kKeepAliveHintSeconds = 2;

// Worker threads beyond the slots and the queue: a completion past them gets its 429 from the
// scheduler at once, and /tokenize and /detokenize run beside the generations.
constexpr int kSpareWorkers = 8;

std::string kv_pool_too_small(int64_t positions, int ctx) {
  return fmt::format("--kv-pool {}: fewer positions than one request may hold (-c {}): raise "
                     "--kv-pool or lower -c",
                     positions, ctx);
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
    // the model run their passes through the batcher's step thread (continuous batching); a
    // lone one runs unwrapped, device-chained runs included.
    const int ctx = m_.session->context_length();
    std::vector<std::unique_ptr<Session>> raw;
    // --kv-pool: paged KV memory (docs/server.md). The command's session had a cache of its own;
    // it goes first, so that its memory is free for the pool, and every slot's comes from the
    // pool.
    if (a.parallel > 1 && a.kv_pool != 0) {
      kv_positions_ = a.kv_pool > 0 ? a.kv_pool : (int64_t)a.parallel * ctx;
      if (kv_positions_ < ctx) throw Error(kv_pool_too_small(kv_positions_, ctx));
      // The CPU engine's pool is host memory (paged in as it is written): one that could never
      // be written whole is refused before its bookkeeping is made. (A GPU's takes what fits.)
      if (m_.device == "cpu") {
        const double need = (double)kv_positions_ *
                            cache_bytes_per_position(Device::Cpu, m_.spec->config,
                                                     m_.model->cache_types());
        const double avail = host_available_bytes();
        if (avail > 0 && need > avail)
          throw Error(fmt::format("--kv-pool {}: its KV cache would need {} of host memory and "
                                  "{} is available: lower --kv-pool (or --parallel x -c)",
                                  kv_positions_, bytes_text(need), bytes_text(avail)));
      }
      m_.session.reset();
      if (!m_.model->use_kv_pool(kv_positions_, a.parallel, ctx, a.quiet)) {
        note(a.quiet, fmt::format("note: paged KV memory (--kv-pool) is not run by {} yet: each "
                                  "slot has a cache of {} positions", m_.model->device_name(), ctx));
        kv_positions_ = 0;
      } else {
        kv_positions_ = m_.model->kv_pool_use().blocks * kKvBlock;  // a GPU may take fewer
      }
      m_.session = m_.model->new_session(ctx, a.quiet);
    }
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
    if (a.parallel > 1) {
      server::BatcherOptions bo;
      bo.batch_tokens = a.batch_tokens;
      // The step thread runs the CPU engine's linears: it takes the team -t set for this one.
      bo.on_start = [threads = cpu_threads()] { set_cpu_threads(threads); };
      batcher_ = std::make_unique<server::StepBatcher>(*m_.model, std::move(bo));
    }
    for (auto& s : raw) sessions_.push_back(batcher_ ? batcher_->wrap(std::move(s)) : std::move(s));
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
    slots_ = std::make_unique<server::Slots>(
        a.parallel, a.queue, [this](int i) -> const std::vector<int>& { return sessions_[i]->cached; },
        m_.model->kv_pool_use().blocks);
    seed_base_ = rng_();
  }

  // Serves on `svr`, bound to `port`, until SIGINT or SIGTERM.
  int run(server::HttpServer& svr, int port) {
    set_malloc_thresholds();
    if (!a_.cors.empty()) svr.set_cors_origins(a_.cors);
    svr.before_route = [this](const server::HttpRequest& req) -> std::optional<server::HttpResponse> {
      if (a_.api_key.empty() || req.path == "/health") return std::nullopt;
      if (server::bearer_matches(req.header("Authorization"), a_.api_key)) return std::nullopt;
      server::HttpResponse r =
          server::HttpResponse::error(ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)", "",
                                               "invalid_api_key"));
      r.set_header("WWW-Authenticate", "Bearer");  // RFC 6750: the scheme the key goes in
      return r;
    };
    svr.on_done = [this](const server::AccessEntry& e) {
      log(e);
      metrics_.observe_request(metrics_endpoint(e.path), e.status, e.ms / 1000.0);
      if (e.prompt_tokens >= 0 && e.completion_tokens >= 0) metrics_.add_tokens(e.prompt_tokens, e.completion_tokens);
    };
    svr.after_request = [](size_t body_bytes) {
      if (body_bytes > kTrimAfterBodyBytes) give_back_memory();
    };
    svr.on_fatal = [](const std::string& why) {
      std::cerr << fmt::format("kestrel serve: the HTTP I/O thread failed ({}): stopping", why) << std::endl;
      kill(getpid(), SIGTERM);
    };

    // The cheap routes answer on the I/O thread (a slow generation never delays them); those
    // that parse a body and compute run on the workers.
    using server::RunOn;
    // Prometheus's scrape (docs/server.md, "/metrics"): behind the API key like the API, since
    // it tells who uses the server how much.
    svr.route("GET", "/metrics", RunOn::IoThread, [this](server::HttpRequest&, server::Exchange& ex) {
      server::HttpResponse r;
      r.content_type = server::kMetricsContentType;
      r.body = metrics_.render(*slots_, m_.model->kv_pool_use());
      ex.respond(std::move(r));
    });
    svr.route("GET", "/health", RunOn::IoThread, [this](server::HttpRequest&, server::Exchange& ex) {
      const server::Slots::Status s = slots_->status();
      ex.respond(server::HttpResponse::json(server::dump(
          {{"status", "ok"}, {"slots_idle", s.idle}, {"slots_processing", s.busy}, {"queued", s.queued}})));
    });
    svr.route("GET", "/v1/models", RunOn::IoThread, [this](server::HttpRequest&, server::Exchange& ex) {
      ex.respond(server::HttpResponse::json(
          server::dump({{"object", "list"}, {"data", json::array({model_json()})}})));
    });
    svr.route("GET", "/v1/models/*", RunOn::IoThread, [this](server::HttpRequest& req, server::Exchange& ex) {
      if (req.rest != id_)
        throw ApiError(404, fmt::format("the model '{}' does not exist (this server has '{}')", req.rest, id_),
                       "model", "model_not_found");
      ex.respond(server::HttpResponse::json(server::dump(model_json())));
    });
    svr.route("POST", "/v1/chat/completions", RunOn::Worker,
              [this](server::HttpRequest& req, server::Exchange& ex) { complete(Endpoint::Chat, req, ex); });
    svr.route("POST", "/v1/completions", RunOn::Worker,
              [this](server::HttpRequest& req, server::Exchange& ex) { complete(Endpoint::Completion, req, ex); });
    svr.route("POST", "/tokenize", RunOn::Worker, [this](server::HttpRequest& req, server::Exchange& ex) {
      const server::TokenizeRequest t = server::parse_tokenize_request(req.body, limits_);
      const std::vector<int> ids = m_.tok->encode(t.content, t.add_special);
      json tokens = json::array();
      for (int id : ids)
        tokens.push_back(t.with_pieces ? json{{"id", id}, {"piece", server::token_piece(*m_.tok, id)}} : json(id));
      ex.respond(server::HttpResponse::json(server::dump({{"tokens", tokens}})));
    });
    svr.route("POST", "/detokenize", RunOn::Worker, [this](server::HttpRequest& req, server::Exchange& ex) {
      const std::vector<int> ids = server::parse_detokenize_request(req.body, m_.spec->config.vocab, limits_);
      ex.respond(server::HttpResponse::json(server::dump({{"content", m_.tok->decode(ids)}})));
    });

    svr.start(a_.parallel + a_.queue + kSpareWorkers);
    std::cerr << fmt::format("listening on http://{}:{} {}", server::url_host(a_.host), port,
                             a_.api_key.empty() ? "(no API key: anyone who can reach it may use it)"
                                                : "(API key required)")
              << std::endl;

    const int sig = wait_for_stop_signal();
    std::cerr << fmt::format("kestrel: {}: stopping (in-flight requests are cancelled)",
                             sig == SIGINT ? "SIGINT" : "SIGTERM")
              << std::endl;
    stopping_ = true;
    slots_->shut_down();
    svr.stop();
    std::cerr << "kestrel: stopped" << std::endl;
    return 0;
  }

 private:

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

  // A completion on its worker thread: the request read, a slot waited for, the generation run,
  // the answer written whole or streamed as it comes. A refusal is thrown as an ApiError
  // (answered by the transport); the client going away cancels the wait or the generation.
  void complete(Endpoint endpoint, server::HttpRequest& req, server::Exchange& ex) {
    server::AccessEntry& log = ex.log();
    const auto arrived = std::chrono::steady_clock::now();
    try {
      server::CompletionRequest cr =
          server::parse_completion_request(endpoint, req.body, defaults_,
                                           a_.sampling.seed ? *a_.sampling.seed : draw_seed(), limits_);
      req.body = std::string();  // read: its memory is not held while the request generates
      if (!cr.model.empty() && cr.model != id_)
        throw ApiError(404, fmt::format("the model '{}' does not exist (this server has '{}')", cr.model, id_),
                       "model", "model_not_found");
      const ChatTemplate* tmpl = endpoint == Endpoint::Chat ? &*tmpl_ : nullptr;
      auto p = std::make_shared<server::PreparedRequest>(server::prepare_request(
          cr, *m_.tok, tmpl, sessions_[0]->context_length(), m_.spec->config.vocab));
      p->options.reverse_prompts = a_.sampling.reverse;
      p->options.ignore_eos = p->options.ignore_eos || a_.sampling.ignore_eos;  // the request's or the server's
      log.prompt_tokens = (int)p->prompt_ids.size();
      if (a_.log_prompts)
        log.prompt = endpoint == Endpoint::Chat
                         ? tmpl_->render(cr.messages, true, cr.chat_template_kwargs,
                                         cr.tools ? cr.tools->tools : jinja::Json())
                         : m_.tok->decode(p->prompt_ids);

      // Paged KV memory: the blocks the prompt and the most new tokens (and a verify pass's
      // drafts past them) can take, reserved before the request runs. Never more than one
      // context's, which the pool holds (checked at start): a request waits for them, it is
      // never refused for them.
      int64_t kv_blocks = 0;
      if (kv_positions_ > 0) {
        const int64_t ctx = sessions_[0]->context_length(), n = (int64_t)p->prompt_ids.size();
        const int64_t most = p->options.max_new_tokens < 0 ? ctx : n + p->options.max_new_tokens;
        const int64_t positions = std::min(ctx, most + (a_.spec.kind.empty() ? 0 : a_.spec.draft_max));
        kv_blocks = (positions + kKvBlock - 1) / kKvBlock;
      }
      auto gone = [&ex] { return ex.client_gone(); };
      server::Slots::Outcome why;
      std::shared_ptr<server::Slots::Lease> lease = slots_->acquire(p->prompt_ids, gone, why, kv_blocks);
      if (!lease) {
        if (why == server::Slots::Outcome::QueueFull)
          throw ApiError(429, fmt::format("the server is busy ({} requests running, {} waiting); retry later",
                                          a_.parallel, a_.queue),
                         "", "rate_limit_exceeded");
        if (why == server::Slots::Outcome::Cancelled) {
          log.finish = "cancelled";
          return ex.drop(499);  // nginx's "client closed request", for the log: nobody reads it
        }
        throw ApiError(503, "the server is shutting down", "", "shutting_down");
      }
      Session& session = *sessions_[lease->slot()];
      // Paged KV memory: the request's blocks go back to the pool when it ends, before its
      // reservation does (its whole blocks stay cached for a prompt that begins alike, on any
      // slot).
      struct GiveBackKv {
        Session& s;
        ~GiveBackKv() { s.release_kv(); }
      } give_back{session};
      const server::ResponseMeta rm = meta(endpoint);
      // response_format's grammar: the token masker of this endpoint's end ids, built once.
      // Drafts are not checked against a grammar, so such a request decodes without them.
      const bool constrained = p->options.grammar != nullptr;
      if (constrained) p->options.masker = masker(endpoint, p->options.stop_ids);
      // The request's drafter, drafting with its own sampling.
      std::unique_ptr<Drafter> drafter;
      if (a_.spec.kind == "lookup" && !constrained) drafter = std::make_unique<NgramDrafter>();
      if (a_.spec.kind == "draft" && !constrained)
        drafter = std::make_unique<ModelDrafter>(*draft_sessions_[lease->slot()], p->options.sampling,
                                                 m_.spec->config.vocab);
      p->options.drafter = drafter.get();
      p->options.draft_max = a_.spec.draft_max;
      // With tools, the reply is read for the model's calls as it comes (tool_calls.h); the
      // calls' ids are drawn from the response's.
      std::optional<server::ToolCallParser> calls;
      if (p->tool_format)
        calls.emplace(*p->tool_format, [fmt_ = *p->tool_format, id = rm.id](int i) {
          return server::make_tool_call_id(fmt_, id, i);
        });

      if (!cr.stream) {
        p->options.cancelled = [this, gone] { return stopping_.load() || gone(); };
        const auto started = std::chrono::steady_clock::now();
        const GenerateResult r = run_generation(session, p->prompt_ids, p->options, {});
        if (calls) {
          calls->push(r.text);
          calls->finish();
        }
        note_result(log, r, calls && !calls->calls().empty());
        observe_timing(arrived, started, r);
        if (r.finish_reason == "cancelled") {
          if (stopping_) throw ApiError(503, "the server is shutting down", "", "shutting_down");
          return ex.drop(499);
        }
        return ex.respond(server::HttpResponse::json(
            server::dump(server::completion_response(cr, rm, r, *m_.tok, calls ? &*calls : nullptr))));
      }

      // Streamed: the generation runs as the body is written, the slot held until it ends.
      server::HttpResponse head;
      head.content_type = "text/event-stream";
      head.set_header("Cache-Control", "no-cache");
      bool ok = ex.begin_stream(std::move(head));
      auto send = [&](const std::string& s) { ok = ok && ex.write(s); };
      if (endpoint == Endpoint::Chat) send(server::sse_event(server::role_chunk(cr, rm)));
      GenerateOptions& options = p->options;
      options.cancelled = [&] { return !ok || stopping_.load() || gone(); };
      GenerateResult r;
      const auto started = std::chrono::steady_clock::now();
      // A piece of the reply as text, or as the calls' pieces where the reply is read for them.
      auto send_parsed = [&](const server::ToolCallParser::Out& out) {
        if (!out.content.empty()) send(server::sse_event(server::text_chunk(cr, rm, out.content)));
        for (const server::ToolCallDelta& d : out.calls) send(server::sse_event(server::tool_call_chunk(cr, rm, d)));
      };
      try {
        r = run_generation(session, p->prompt_ids, options, [&](std::string_view text) {
          if (calls) send_parsed(calls->push(text));
          else send(server::sse_event(server::text_chunk(cr, rm, text)));
        });
      } catch (const std::exception& e) {
        // An engine failure (out of memory, a CUDA error) once the answer has begun: an error
        // event, and the stream cut (no [DONE]: the client knows the answer is incomplete).
        std::cerr << fmt::format("kestrel serve: {}\n", e.what()) << std::flush;
        log.finish = "error";
        send(server::sse_event(ApiError(500, e.what(), "", "engine_error").to_json()));
        return ex.drop(200);
      }
      if (calls && r.finish_reason != "cancelled") send_parsed(calls->finish());
      const bool has_calls = calls && !calls->calls().empty();
      note_result(log, r, has_calls);
      observe_timing(arrived, started, r);
      if (r.finish_reason == "cancelled") {
        // The client is gone, or the server is stopping. Stopping: an error event, no [DONE]
        // (the client knows the answer is cut), and the body ended properly, so that the
        // transfer itself is not an error as well.
        if (ok && stopping_) {
          send(server::sse_event(ApiError(503, "the server is shutting down", "", "shutting_down").to_json()));
          if (ok) ex.end_stream();
        }
        return ex.drop(200);
      }
      send(server::sse_event(server::finish_chunk(cr, rm, r, *m_.tok, has_calls)));
      if (cr.include_usage) send(server::sse_event(server::usage_chunk(cr, rm, r)));
      send(server::kSseDone);
      if (ok) ex.end_stream();
      ex.drop(200);  // a stream cut short: the connection is closed
    } catch (const Error& e) {  // the engine's own failure: the request was valid
      if (ex.answered()) return;
      throw ApiError(500, e.what(), "", "engine_error");
    }
  }

  // generate_cached on a slot's session, counted by the batcher as a generation in progress
  // while it runs (its steps wait for this one's rows), and no longer once it returns.
  GenerateResult run_generation(Session& session, const std::vector<int>& ids, const GenerateOptions& o,
                          const std::function<void(std::string_view)>& on_text) {
    std::optional<server::StepBatcher::Generation> in_batch;
    if (batcher_) in_batch.emplace(*batcher_);
    return generate_cached(session, *m_.tok, ids, o, on_text);
  }

  // A generation's time to first token (from the worker taking the request, the wait for a
  // slot included, to the prompt's first logits) and its time per output token after the
  // first: the request's mean, observed once per such token, so that the histogram's count is
  // the tokens', as vLLM's is.
  void observe_timing(std::chrono::steady_clock::time_point arrived,
                      std::chrono::steady_clock::time_point started, const GenerateResult& r) {
    if (r.ids.empty()) return;
    metrics_.observe_ttft(std::chrono::duration<double>(started - arrived).count() + r.prompt_ms / 1000.0);
    const size_t after_first = r.ids.size() - 1;
    if (after_first == 0) return;
    const double per = r.gen_ms / 1000.0 / (double)after_first;
    for (size_t i = 0; i < after_first; ++i) metrics_.observe_token_latency(per);
  }

  // The endpoint label of a request's path: the server's routes, "/v1/models/{model}" for any
  // model, and "other" for every path it does not serve, so that requests for made-up paths
  // (with or without a key) cannot take up the registry's labels before the real ones are used.
  static std::string metrics_endpoint(const std::string& path) {
    static const char* const kRoutes[] = {"/health", "/metrics", "/v1/models", "/v1/chat/completions",
                                          "/v1/completions", "/tokenize", "/detokenize"};
    for (const char* r : kRoutes)
      if (path == r) return path;
    if (path.rfind("/v1/models/", 0) == 0 && path.size() > 11) return "/v1/models/{model}";
    return "other";
  }

  // The token masker of an endpoint's end ids (the chat template's for chat), built on first
  // use: it walks the whole vocabulary (about 0.2 s at 150k tokens), so never per request.
  std::shared_ptr<const grammar::TokenMasker> masker(Endpoint endpoint, const std::vector<int>& end_ids) {
    std::lock_guard<std::mutex> lk(masker_mutex_);
    auto& m = maskers_[endpoint == Endpoint::Chat ? 1 : 0];
    if (!m) m = grammar_masker(*m_.tok, end_ids);
    return m;
  }

  static void note_result(server::AccessEntry& log, const GenerateResult& r, bool has_tool_calls) {
    log.completion_tokens = (int)r.ids.size();
    log.finish = server::finish_reason(r, has_tool_calls);
  }

  void log(const server::AccessEntry& e) {
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
  // --parallel > 1: the step thread every slot's passes run on (declared before the sessions
  // that refer to it, which go first).
  std::unique_ptr<server::StepBatcher> batcher_;
  std::vector<std::unique_ptr<Session>> sessions_;
  // --spec draft: the draft model (declared before its sessions, which it outlives), its
  // sessions by slot and their turn.
  std::unique_ptr<LoadedModel> draft_;
  server::TurnLock draft_turn_;
  std::vector<std::unique_ptr<Session>> draft_sessions_;
  std::unique_ptr<server::Slots> slots_;
  int64_t kv_positions_ = 0;  // the paged KV pool's positions; 0: a cache per slot
  server::Metrics metrics_;
  std::mutex masker_mutex_;
  std::shared_ptr<const grammar::TokenMasker> maskers_[2];  // completions, chat
  std::atomic<bool> stopping_{false};
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
  if (a.kv_pool > 0 && a.parallel == 1)
    throw Error("--kv-pool goes with --parallel > 1 (one slot keeps a cache of its own)");
  // A pool that cannot hold one request's context (-c as given; a context the GPU shortens or
  // the model's own is checked once loaded).
  if (a.parallel > 1 && a.kv_pool > 0 && a.model.context > 0 && a.kv_pool < a.model.context)
    throw Error(kv_pool_too_small(a.kv_pool, a.model.context));
  server::HttpLimits limits;
  limits.max_body = (size_t)a.max_body;
  limits.timeout = std::chrono::seconds(a.timeout);
  limits.idle = std::chrono::seconds(kKeepAliveIdleSeconds);
  limits.keep_alive_hint = kKeepAliveHintSeconds;
  limits.max_connections = a.max_connections;
  limits.max_connections_per_address = a.max_connections_per_ip;
  server::HttpServer svr(limits);
  // Bound before the model loads, so that a port in use (or an address not of this host) is
  // found in a moment, not after the weights. Connections made while the model loads wait in
  // the backlog until the server runs.
  const int port = svr.bind(a.host, a.port);
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
  const int64_t kv_blocks = m.model->kv_pool_use().blocks;
  note(a.quiet, fmt::format("serving {} on {}: {} slot{} of {} tokens{}, queue {}{}", model_id(a),
                            m.device, a.parallel, a.parallel == 1 ? "" : "s",
                            context_length(m, lo),
                            kv_blocks ? fmt::format(" in a KV pool of {} positions", kv_blocks * kKvBlock) : "",
                            a.queue,
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
                  "requests generating at once, each in its own session of up to -c tokens")
      ->check(whole(1, 256))
      ->capture_default_str();
  cmd->add_option("--kv-pool", a->kv_pool,
                  "with --parallel > 1, every request's KV cache in one pool of this many positions, "
                  "in blocks of 16 taken as tokens are written, shared by prompts that begin alike "
                  "and kept for the next one (-1 = --parallel x -c; 0 = a cache of -c per slot)")
      ->type_name("POSITIONS")
      ->check(whole(-1, KvBlockPool::kMaxPositions))
      ->capture_default_str();
  cmd->add_option("--batch-tokens", a->batch_tokens,
                  "with --parallel > 1, most prompt tokens run in one step: longer prompts run in "
                  "chunks between the running requests' decode steps")
      ->check(whole(1, 1 << 20))
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
                  "seconds a client may take to send a whole request (from its first byte; 408 past "
                  "it), or to take each write of the answer")
      ->check(whole(1, 3600))
      ->capture_default_str();
  cmd->add_option("--max-connections", a->max_connections,
                  "open connections in all; past it the oldest idle keep-alive one is closed, else a "
                  "new one gets 503")
      ->check(whole(1, 1000000))
      ->capture_default_str();
  cmd->add_option("--max-connections-per-ip", a->max_connections_per_ip,
                  "open connections from one client address (0 = no bound; raise it behind a proxy)")
      ->check(whole(0, 1000000))
      ->capture_default_str();
  cmd->add_option("--cors", a->cors,
                  "an origin whose browser pages may call the API (repeatable or comma-separated; * = any)")
      ->delimiter(',')
      ->type_name("ORIGIN");
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
