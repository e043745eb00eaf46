// What `kestrel serve` counts for GET /metrics, rendered in Prometheus's text exposition format
// 0.0.4: the requests by endpoint and HTTP status, the prompt and generated tokens, the slots'
// and queue's occupancy, and histograms of the time to first token, the time per output token
// and the requests' duration. No socket here: the server's HTTP layer calls the observe_*
// functions as requests end and serves render()'s text with kContentType.
//
// The names take vLLM's (vllm:time_to_first_token_seconds, vllm:num_requests_running, ...)
// with the prefix `kestrel:` in place of `vllm:`, the separator vLLM and llama-server
// (llamacpp:prompt_tokens_total) both use, so that a dashboard or alert written for either
// needs only its prefix changed. Prometheus reserves colons for recording rules by convention,
// not by grammar: its text format and every scraper accept them.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/server/scheduler.h"

namespace kestrel::server {

// The Content-Type of render()'s text, as Prometheus asks for the 0.0.4 format.
inline constexpr const char* kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";

// A histogram of fixed upper bounds: counts per bucket (each observation in the first bucket
// whose bound it does not exceed, or in +Inf), its sum and count. Not locked: Metrics locks.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);  // increasing, finite
  void observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative counts, one per bound and a last one for +Inf (== count()).
  std::vector<uint64_t> cumulative() const;
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf's
  double sum_ = 0;
  uint64_t count_ = 0;
};

// The server's gauges at the moment of a scrape.
struct MetricsGauges {
  int running = 0;  // requests holding a slot (generating)
  int waiting = 0;  // requests in the queue for one
  int slots = 0;    // --parallel
  // Paged KV memory (Model::kv_pool_use, Slots::Status), in blocks; all 0 without a pool.
  int64_t kv_blocks = 0, kv_held = 0, kv_cached = 0, kv_reserved = 0;
};

// The registry. Every member may be called from any thread at once; counts are exact.
class Metrics {
 public:
  // The most distinct endpoint labels kept: an endpoint is whatever path a client asked for
  // (404s included), so a client could otherwise grow the registry, and every scrape, without
  // bound. Past this many, a new endpoint is counted as endpoint="other".
  static constexpr size_t kMaxEndpoints = 32;

  // Bucket bounds in seconds: vLLM's, with finer steps at the low end, where a small model on
  // a GPU answers (a token every few milliseconds) and short endpoints (/tokenize) finish.
  static const std::vector<double>& ttft_buckets();
  static const std::vector<double>& token_latency_buckets();
  static const std::vector<double>& request_buckets();

  Metrics();

  // A request answered: its endpoint (the path, "/v1/chat/completions"), the HTTP status sent
  // and the seconds from its arrival to its last byte. Every request, refused ones included.
  void observe_request(std::string_view endpoint, int status, double seconds);
  // Seconds from a generation request's arrival to its first generated token.
  void observe_ttft(double seconds);
  // Seconds between two consecutive generated tokens of one request.
  void observe_token_latency(double seconds);
  // Tokens of a finished generation request: its prompt's and those it generated.
  void add_tokens(int64_t prompt, int64_t completion);

  // The exposition text, the gauges as given.
  std::string render(const MetricsGauges& g) const;
  // The same with the gauges read from the server's slots and its model's KV pool.
  std::string render(const Slots& slots, const KvPoolUse& kv = {}) const;

 private:
  mutable std::mutex m_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // (endpoint, status) -> count
  std::vector<std::string> endpoints_;                        // distinct endpoints kept
  std::map<std::string, Histogram> request_seconds_;          // by endpoint
  Histogram ttft_, token_latency_;
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0;
};

// A label value as the text format writes it between quotes: \ " and newline escaped.
std::string escape_label_value(std::string_view v);

}  // namespace kestrel::server
