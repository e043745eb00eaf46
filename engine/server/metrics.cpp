#include "engine/server/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "base/error.h"

namespace kestrel::server {

namespace {

// A sample value or bound as the format reads it (Go's ParseFloat): the shortest text that
// reads back as the same double ("0.005", "2.5", "1e-05"); the format's own spelling for the
// infinities.
std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  return fmt::format("{}", v);
}

void family(std::string& out, const char* name, const char* type, const char* help) {
  // HELP text escapes only \ and newline; these are fixed strings with neither.
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

// A histogram's samples: `labels` is empty or `key="value",` pairs ending in a comma, to
// which le is added.
void histogram_samples(std::string& out, const char* name, const std::string& labels,
                       const Histogram& h) {
  const std::vector<uint64_t> cum = h.cumulative();
  for (size_t i = 0; i < h.bounds().size(); ++i)
    out += fmt::format("{}_bucket{{{}le=\"{}\"}} {}\n", name, labels, number(h.bounds()[i]), cum[i]);
  out += fmt::format("{}_bucket{{{}le=\"+Inf\"}} {}\n", name, labels, cum.back());
  const std::string braces = labels.empty() ? "" : "{" + labels.substr(0, labels.size() - 1) + "}";
  out += fmt::format("{}_sum{} {}\n", name, braces, number(h.sum()));
  out += fmt::format("{}_count{} {}\n", name, braces, h.count());
}

}  // namespace

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {
  for (size_t i = 0; i < bounds_.size(); ++i)
    KESTREL_CHECK(std::isfinite(bounds_[i]) && (i == 0 || bounds_[i] > bounds_[i - 1]),
                  "histogram bounds must be finite and increasing");
}

void Histogram::observe(double v) {
  // `le` is inclusive: a value equal to a bound counts in that bound's bucket.
  const size_t b = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  ++counts_[b];
  sum_ += v;
  ++count_;
}

std::vector<uint64_t> Histogram::cumulative() const {
  std::vector<uint64_t> out(counts_.size());
  uint64_t run = 0;
  for (size_t i = 0; i < counts_.size(); ++i) out[i] = run += counts_[i];
  return out;
}

const std::vector<double>& Metrics::ttft_buckets() {
  static const std::vector<double> b = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                        0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
  return b;
}

const std::vector<double>& Metrics::token_latency_buckets() {
  static const std::vector<double> b = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075,
                                        0.1,   0.15,   0.2,   0.3,  0.4,   0.5,  0.75,
                                        1.0,   2.5,    5.0,   10.0};
  return b;
}

const std::vector<double>& Metrics::request_buckets() {
  static const std::vector<double> b = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25,  0.5,  1.0,
                                        2.5,   5.0,  10.0,  20.0, 30.0, 60.0, 120.0, 300.0, 600.0};
  return b;
}

Metrics::Metrics() : ttft_(ttft_buckets()), token_latency_(token_latency_buckets()) {}

void Metrics::observe_request(std::string_view endpoint, int status, double seconds) {
  std::lock_guard<std::mutex> g(m_);
  std::string key(endpoint);
  if (std::find(endpoints_.begin(), endpoints_.end(), key) == endpoints_.end()) {
    if (endpoints_.size() < kMaxEndpoints) endpoints_.push_back(key);
    else key = "other";
  }
  ++requests_[{key, status}];
  auto it = request_seconds_.find(key);
  if (it == request_seconds_.end()) it = request_seconds_.emplace(key, Histogram(request_buckets())).first;
  // A duration is measured on a steady clock and is never negative or NaN; were one so, it
  // would poison the sum for good, so it is left out rather than kept.
  if (seconds >= 0 && std::isfinite(seconds)) it->second.observe(seconds);
}

void Metrics::observe_ttft(double seconds) {
  if (!(seconds >= 0 && std::isfinite(seconds))) return;
  std::lock_guard<std::mutex> g(m_);
  ttft_.observe(seconds);
}

void Metrics::observe_token_latency(double seconds) {
  if (!(seconds >= 0 && std::isfinite(seconds))) return;
  std::lock_guard<std::mutex> g(m_);
  token_latency_.observe(seconds);
}

void Metrics::add_tokens(int64_t prompt, int64_t completion) {
  std::lock_guard<std::mutex> g(m_);
  prompt_tokens_ += (uint64_t)std::max<int64_t>(prompt, 0);
  completion_tokens_ += (uint64_t)std::max<int64_t>(completion, 0);
}

std::string Metrics::render(const Slots& slots, const KvPoolUse& kv) const {
  const Slots::Status s = slots.status();
  return render(MetricsGauges{s.busy, s.queued, s.idle + s.busy, kv.blocks, kv.held, kv.cached,
                              s.kv_reserved});
}

std::string Metrics::render(const MetricsGauges& gauges) const {
  std::lock_guard<std::mutex> g(m_);
  std::string out;
  family(out, "kestrel:http_requests_total", "counter",
         "HTTP requests answered, by endpoint (the path) and status.");
  for (const auto& [key, n] : requests_)
    out += fmt::format("kestrel:http_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n",
                       escape_label_value(key.first), key.second, n);
  family(out, "kestrel:prompt_tokens_total", "counter", "Prompt tokens of finished generation requests.");
  out += fmt::format("kestrel:prompt_tokens_total {}\n", prompt_tokens_);
  family(out, "kestrel:generation_tokens_total", "counter", "Tokens generated by finished requests.");
  out += fmt::format("kestrel:generation_tokens_total {}\n", completion_tokens_);

  family(out, "kestrel:num_requests_running", "gauge", "Requests holding a slot (generating).");
  out += fmt::format("kestrel:num_requests_running {}\n", gauges.running);
  family(out, "kestrel:num_requests_waiting", "gauge", "Requests waiting in the queue for a slot.");
  out += fmt::format("kestrel:num_requests_waiting {}\n", gauges.waiting);
  family(out, "kestrel:num_slots", "gauge", "Slots (--parallel): requests that may generate at once.");
  out += fmt::format("kestrel:num_slots {}\n", gauges.slots);
  family(out, "kestrel:kv_cache_usage_perc", "gauge",
         "Fraction of the paged KV pool's blocks held by running requests (0 without a pool).");
  out += fmt::format("kestrel:kv_cache_usage_perc {}\n",
                     gauges.kv_blocks ? (double)gauges.kv_held / gauges.kv_blocks : 0.0);
  family(out, "kestrel:kv_cache_blocks", "gauge",
         "The paged KV pool's blocks: held by running requests, cached (kept for a later prompt "
         "with the same prefix) and free.");
  for (auto [state, n] : {std::pair<const char*, int64_t>{"held", gauges.kv_held},
                          {"cached", gauges.kv_cached},
                          {"free", gauges.kv_blocks - gauges.kv_held - gauges.kv_cached}})
    out += fmt::format("kestrel:kv_cache_blocks{{state=\"{}\"}} {}\n", state, n);
  family(out, "kestrel:kv_cache_reserved_blocks", "gauge",
         "Blocks of the paged KV pool reserved by the requests admitted (their prompt and most "
         "new tokens).");
  out += fmt::format("kestrel:kv_cache_reserved_blocks {}\n", gauges.kv_reserved);

  family(out, "kestrel:time_to_first_token_seconds", "histogram",
         "Seconds from a generation request's arrival to its first token.");
  histogram_samples(out, "kestrel:time_to_first_token_seconds", "", ttft_);
  family(out, "kestrel:time_per_output_token_seconds", "histogram",
         "Seconds between consecutive generated tokens of a request.");
  histogram_samples(out, "kestrel:time_per_output_token_seconds", "", token_latency_);
  family(out, "kestrel:e2e_request_latency_seconds", "histogram",
         "Seconds from a request's arrival to its answer's end, by endpoint.");
  for (const auto& [endpoint, h] : request_seconds_)
    histogram_samples(out, "kestrel:e2e_request_latency_seconds",
                      "endpoint=\"" + escape_label_value(endpoint) + "\",", h);
  return out;
}

}  // namespace kestrel::server
