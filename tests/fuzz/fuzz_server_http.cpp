// kestrel serve's HTTP request path on arbitrary bytes, as a client may send them on one
// connection: the transport's parsing, framing and routing (HttpServer::answer_bytes, the code
// the sockets use), then the body parsers of the endpoint a request reaches. Every input must
// end in answers (an error status where it is bad), nothing else: no crash, no hang, no
// exception other than an ApiError out of a parser, and the bytes written must be HTTP answers.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/server/api_error.h"
#include "engine/server/request.h"
#include "tools/kestrel/server/access.h"
#include "tools/kestrel/server/http.h"

using namespace kestrel;
using namespace kestrel::server;

namespace {

// A body parser's outcome: a request or an ApiError; any other exception is a finding.
template <class Fn>
void parse(Exchange& ex, Fn&& fn) {
  try {
    fn();
    ex.respond(HttpResponse::json("{}"));
  } catch (const ApiError& e) {
    ex.respond(HttpResponse::error(e));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "escaped exception (not an ApiError): %s\n", e.what());
    std::abort();
  }
}

HttpServer& http_server() {
  static HttpServer* s = [] {
    HttpLimits l;
    l.max_body = 1 << 20;
    l.max_header = 4 << 10;
    l.max_request_line = 1 << 10;
    auto* srv = new HttpServer(l);
    srv->set_cors_origins({"http://a.example"});
    // The key check on a request that carries one, so that the others reach their routes.
    srv->before_route = [](const HttpRequest& r) -> std::optional<HttpResponse> {
      if (!r.has_header("Authorization") || bearer_matches(r.header("Authorization"), "k")) return std::nullopt;
      return HttpResponse::error(ApiError(401, "a valid API key is needed", "", "invalid_api_key"));
    };
    srv->route("GET", "/health", RunOn::IoThread,
               [](HttpRequest&, Exchange& ex) { ex.respond(HttpResponse::json(R"({"status":"ok"})")); });
    srv->route("GET", "/v1/models/*", RunOn::IoThread, [](HttpRequest& r, Exchange& ex) {
      if (r.rest != "m") throw ApiError(404, "no such model", "model", "model_not_found");
      ex.respond(HttpResponse::json("{}"));
    });
    srv->route("POST", "/v1/chat/completions", RunOn::Worker, [](HttpRequest& r, Exchange& ex) {
      parse(ex, [&] { parse_completion_request(Endpoint::Chat, r.body, {}, 1); });
    });
    // Streamed, as a completion with "stream" is: chunks, then the last one.
    srv->route("POST", "/v1/completions", RunOn::Worker, [](HttpRequest& r, Exchange& ex) {
      CompletionRequest cr;
      try {
        cr = parse_completion_request(Endpoint::Completion, r.body, {}, 1);
      } catch (const ApiError& e) {
        return ex.respond(HttpResponse::error(e));
      }
      if (!cr.stream) return ex.respond(HttpResponse::json("{}"));
      HttpResponse head;
      head.content_type = "text/event-stream";
      ex.begin_stream(std::move(head));
      ex.write("data: {}\n\n");
      ex.write("");
      ex.write("data: [DONE]\n\n");
      ex.end_stream();
    });
    srv->route("POST", "/tokenize", RunOn::Worker,
               [](HttpRequest& r, Exchange& ex) { parse(ex, [&] { parse_tokenize_request(r.body); }); });
    srv->route("POST", "/detokenize", RunOn::Worker,
               [](HttpRequest& r, Exchange& ex) { parse(ex, [&] { parse_detokenize_request(r.body, 32000); }); });
    return srv;
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string out = http_server().answer_bytes(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!out.empty() && out.rfind("HTTP/1.", 0) != 0) {
    std::fprintf(stderr, "the server wrote something other than an answer: %.80s\n", out.c_str());
    std::abort();
  }
  return 0;
}
