// The /metrics registry (engine/server/metrics.h). Its text is read back by a checker written
// here from Prometheus's description of the text exposition format 0.0.4, not from the
// renderer: every line is a comment (# HELP name text, # TYPE name type), blank, or a sample
// `name{label="value",...} value [timestamp]`, and the counts the tests assert are the values
// that checker parses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/server/metrics.h"

using namespace kestrel::server;

namespace {

using Labels = std::map<std::string, std::string>;

struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

struct Exposition {
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;  // family -> counter, gauge, histogram, ...
  std::string error;                         // the first rule broken, empty when none

  // The value of the sample with this name and exactly these labels; NaN when absent.
  double value(const std::string& name, const Labels& labels = {}) const {
    for (const Sample& s : samples)
      if (s.name == name && s.labels == labels) return s.value;
    return std::nan("");
  }
};

bool name_start(char c, bool colon) { return std::isalpha((unsigned char)c) || c == '_' || (colon && c == ':'); }
bool name_char(char c, bool colon) { return name_start(c, colon) || std::isdigit((unsigned char)c); }

// [a-zA-Z_:][a-zA-Z0-9_:]* for metric names, without the colon for label names.
bool valid_name(const std::string& s, bool colon) {
  if (s.empty() || !name_start(s[0], colon)) return false;
  for (char c : s)
    if (!name_char(c, colon)) return false;
  return true;
}

// A float as Go's ParseFloat reads it, and the format's NaN, +Inf, -Inf.
bool parse_value(const std::string& s, double& out) {
  if (s == "+Inf" || s == "Inf") return out = INFINITY, true;
  if (s == "-Inf") return out = -INFINITY, true;
  if (s == "NaN") return out = NAN, true;
  if (s.empty() || s.find_first_not_of("0123456789+-.eE") != std::string::npos) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

// The family a sample belongs to: a histogram's _bucket, _sum and _count samples are its own.
std::string family_of(const std::string& name, const std::map<std::string, std::string>& types) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string sfx = suffix;
    if (name.size() > sfx.size() && name.compare(name.size() - sfx.size(), sfx.size(), sfx) == 0) {
      const std::string base = name.substr(0, name.size() - sfx.size());
      auto it = types.find(base);
      if (it != types.end() && (it->second == "histogram" || it->second == "summary")) return base;
    }
  }
  return name;
}

Exposition parse(const std::string& text) {
  Exposition e;
  auto fail = [&](size_t line, const std::string& why) {
    if (e.error.empty()) e.error = "line " + std::to_string(line) + ": " + why;
  };
  if (!text.empty() && text.back() != '\n') fail(0, "the text does not end with a newline");
  std::set<std::string> seen_samples;  // families whose samples have started
  std::set<std::string> helped;
  size_t pos = 0, n = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    const std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? text.size() : nl + 1;
    ++n;
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (line[0] == '#') {
      // "# HELP name text" / "# TYPE name type"; any other comment is ignored.
      std::vector<std::string> tok;
      size_t p = 1;
      for (int k = 0; k < 3 && p < line.size(); ++k) {
        p = line.find_first_not_of(" \t", p);
        if (p == std::string::npos) break;
        size_t q = k == 2 ? line.size() : line.find_first_of(" \t", p);
        if (q == std::string::npos) q = line.size();
        tok.push_back(line.substr(p, q - p));
        p = q;
      }
      if (tok.empty() || (tok[0] != "HELP" && tok[0] != "TYPE")) continue;
      if (tok.size() < 2 || !valid_name(tok[1], true)) fail(n, "bad metric name in " + tok[0]);
      else if (tok[0] == "HELP") {
        if (!helped.insert(tok[1]).second) fail(n, "a second HELP for " + tok[1]);
        const std::string doc = tok.size() > 2 ? tok[2] : "";
        for (size_t i = 0; i < doc.size(); ++i)
          if (doc[i] == '\\' && (i + 1 == doc.size() || (doc[i + 1] != '\\' && doc[i + 1] != 'n')))
            fail(n, "bad escape in HELP");
          else if (doc[i] == '\\') ++i;
      } else {
        static const std::set<std::string> kinds = {"counter", "gauge", "histogram", "summary", "untyped"};
        if (tok.size() < 3 || !kinds.count(tok[2])) fail(n, "bad TYPE");
        else if (e.types.count(tok[1])) fail(n, "a second TYPE for " + tok[1]);
        else if (seen_samples.count(tok[1])) fail(n, "TYPE after the samples of " + tok[1]);
        else e.types[tok[1]] = tok[2];
      }
      continue;
    }
    Sample s;
    size_t p = 0;
    while (p < line.size() && name_char(line[p], true)) ++p;
    s.name = line.substr(0, p);
    if (!valid_name(s.name, true)) {
      fail(n, "bad metric name");
      continue;
    }
    if (p < line.size() && line[p] == '{') {
      ++p;
      while (true) {
        if (p < line.size() && line[p] == '}') {
          ++p;
          break;
        }
        size_t q = p;
        while (q < line.size() && name_char(line[q], false)) ++q;
        const std::string label = line.substr(p, q - p);
        if (!valid_name(label, false) || q + 1 >= line.size() || line[q] != '=' || line[q + 1] != '"') {
          fail(n, "bad label");
          break;
        }
        p = q + 2;
        std::string v;
        bool closed = false;
        while (p < line.size()) {
          const char c = line[p++];
          if (c == '"') {
            closed = true;
            break;
          }
          if (c == '\\') {
            if (p >= line.size()) break;
            const char d = line[p++];
            if (d == '\\') v += '\\';
            else if (d == '"') v += '"';
            else if (d == 'n') v += '\n';
            else {
              fail(n, "bad escape in a label value");
              break;
            }
          } else {
            v += c;
          }
        }
        if (!closed) {
          fail(n, "unterminated label value");
          break;
        }
        if (!s.labels.emplace(label, v).second) fail(n, "label " + label + " twice");
        if (p < line.size() && line[p] == ',') ++p;
        else if (p >= line.size() || line[p] != '}') {
          fail(n, "expected , or } after a label");
          break;
        }
      }
    }
    if (p >= line.size() || (line[p] != ' ' && line[p] != '\t')) {
      fail(n, "no value");
      continue;
    }
    const size_t vs = line.find_first_not_of(" \t", p);
    const size_t ve = vs == std::string::npos ? line.size() : line.find_first_of(" \t", vs);
    const std::string value = vs == std::string::npos ? "" : line.substr(vs, ve - vs);
    if (!parse_value(value, s.value)) fail(n, "bad value '" + value + "'");
    if (ve != std::string::npos && ve < line.size()) {
      const std::string ts = line.substr(line.find_first_not_of(" \t", ve));
      if (ts.find_first_not_of("-0123456789") != std::string::npos) fail(n, "bad timestamp");
    }
    const std::string fam = family_of(s.name, e.types);
    seen_samples.insert(fam);
    if (s.name.size() > 7 && s.name.compare(s.name.size() - 7, 7, "_bucket") == 0 && !s.labels.count("le"))
      fail(n, "a bucket without le");
    e.samples.push_back(std::move(s));
  }

  // Histograms: per label set, buckets in increasing le, counts never falling, the last +Inf
  // and equal to _count.
  for (const auto& [fam, type] : e.types) {
    if (type != "histogram") continue;
    std::map<Labels, std::vector<std::pair<double, double>>> buckets;
    for (const Sample& s : e.samples)
      if (s.name == fam + "_bucket") {
        Labels rest = s.labels;
        double le = 0;
        if (!parse_value(rest["le"], le)) fail(0, fam + ": bad le");
        rest.erase("le");
        buckets[rest].push_back({le, s.value});
      }
    for (const auto& [labels, b] : buckets) {
      for (size_t i = 1; i < b.size(); ++i)
        if (!(b[i].first > b[i - 1].first) || b[i].second < b[i - 1].second)
          fail(0, fam + ": buckets not in increasing le with cumulative counts");
      if (b.empty() || !std::isinf(b.back().first)) fail(0, fam + ": no +Inf bucket");
      else if (b.back().second != e.value(fam + "_count", labels)) fail(0, fam + ": +Inf != _count");
      if (std::isnan(e.value(fam + "_sum", labels))) fail(0, fam + ": no _sum");
    }
  }
  return e;
}

Exposition rendered(const Metrics& m, MetricsGauges g = {}) {
  const Exposition e = parse(m.render(g));
  EXPECT_EQ(e.error, "") << m.render(g);
  return e;
}

const std::string kChat = "/v1/chat/completions";

}  // namespace

// The checker must reject what breaks the grammar, or its passes mean nothing.
TEST(MetricsChecker, RejectsMalformedText) {
  EXPECT_EQ(parse("a 1\n").error, "");
  EXPECT_NE(parse("a 1").error, "");                        // no final newline
  EXPECT_NE(parse("1a 1\n").error, "");                     // name
  EXPECT_NE(parse("a{l=\"x} 1\n").error, "");               // unterminated value
  EXPECT_NE(parse("a{l=\"\\t\"} 1\n").error, "");           // escape
  EXPECT_NE(parse("a{l=\"x\"}\n").error, "");               // no value
  EXPECT_NE(parse("a one\n").error, "");                    // value
  EXPECT_NE(parse("a 1\n# TYPE a counter\n").error, "");    // TYPE after samples
  EXPECT_NE(parse("# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
                  "h_sum 0\nh_count 1\n").error, "");       // not cumulative
  EXPECT_NE(parse("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 0\nh_count 1\n").error, "");
}

TEST(Metrics, EmptyRegistryRendersEveryFamily) {
  Metrics m;
  const Exposition e = rendered(m, {1, 2, 4});
  EXPECT_EQ(e.types.at("kestrel:http_requests_total"), "counter");
  EXPECT_EQ(e.types.at("kestrel:prompt_tokens_total"), "counter");
  EXPECT_EQ(e.types.at("kestrel:generation_tokens_total"), "counter");
  EXPECT_EQ(e.types.at("kestrel:num_requests_running"), "gauge");
  EXPECT_EQ(e.types.at("kestrel:time_to_first_token_seconds"), "histogram");
  EXPECT_EQ(e.types.at("kestrel:time_per_output_token_seconds"), "histogram");
  EXPECT_EQ(e.types.at("kestrel:e2e_request_latency_seconds"), "histogram");
  EXPECT_EQ(e.value("kestrel:num_requests_running"), 1);
  EXPECT_EQ(e.value("kestrel:num_requests_waiting"), 2);
  EXPECT_EQ(e.value("kestrel:num_slots"), 4);
  EXPECT_EQ(e.value("kestrel:prompt_tokens_total"), 0);
  EXPECT_EQ(e.value("kestrel:time_to_first_token_seconds_count"), 0);
  EXPECT_EQ(e.value("kestrel:time_to_first_token_seconds_bucket", {{"le", "+Inf"}}), 0);
}

TEST(Metrics, BucketsAreCumulativeAndInclusive) {
  Metrics m;
  // 0.005 and 0.1 are bounds: a value equal to a bound counts in its bucket (le, "less or equal").
  for (double v : {0.003, 0.005, 0.05, 0.1, 0.1, 7.0, 1000.0}) m.observe_ttft(v);
  const Exposition e = rendered(m);
  const std::string b = "kestrel:time_to_first_token_seconds_bucket";
  EXPECT_EQ(e.value(b, {{"le", "0.001"}}), 0);
  EXPECT_EQ(e.value(b, {{"le", "0.005"}}), 2);
  EXPECT_EQ(e.value(b, {{"le", "0.06"}}), 3);
  EXPECT_EQ(e.value(b, {{"le", "0.1"}}), 5);
  EXPECT_EQ(e.value(b, {{"le", "5"}}), 5);
  EXPECT_EQ(e.value(b, {{"le", "7.5"}}), 6);
  EXPECT_EQ(e.value(b, {{"le", "80"}}), 6);
  EXPECT_EQ(e.value(b, {{"le", "+Inf"}}), 7);
  EXPECT_EQ(e.value("kestrel:time_to_first_token_seconds_count"), 7);
  EXPECT_NEAR(e.value("kestrel:time_to_first_token_seconds_sum"), 1007.258, 1e-9);
  // Every bound the registry declares appears once, in order.
  size_t buckets = 0;
  for (const Sample& s : e.samples) buckets += s.name == b;
  EXPECT_EQ(buckets, Metrics::ttft_buckets().size() + 1);
}

TEST(Metrics, RequestsByEndpointAndStatus) {
  Metrics m;
  m.observe_request(kChat, 200, 0.5);
  m.observe_request(kChat, 200, 1.5);
  m.observe_request(kChat, 429, 0.001);
  m.observe_request("/health", 200, 0.0001);
  m.add_tokens(12, 30);
  m.add_tokens(3, 1);
  const Exposition e = rendered(m);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", kChat}, {"status", "200"}}), 2);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", kChat}, {"status", "429"}}), 1);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", "/health"}, {"status", "200"}}), 1);
  EXPECT_EQ(e.value("kestrel:e2e_request_latency_seconds_count", {{"endpoint", kChat}}), 3);
  EXPECT_EQ(e.value("kestrel:e2e_request_latency_seconds_bucket", {{"endpoint", kChat}, {"le", "1"}}), 2);
  EXPECT_DOUBLE_EQ(e.value("kestrel:e2e_request_latency_seconds_sum", {{"endpoint", kChat}}), 2.001);
  EXPECT_EQ(e.value("kestrel:prompt_tokens_total"), 15);
  EXPECT_EQ(e.value("kestrel:generation_tokens_total"), 31);
}

// A label value holding the format's special characters reads back as it was given.
TEST(Metrics, LabelValuesAreEscaped) {
  EXPECT_EQ(escape_label_value("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  Metrics m;
  const std::string odd = "/x\"} 1\nfake_metric 99\n\\";
  m.observe_request(odd, 404, 0.01);
  const Exposition e = rendered(m);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", odd}, {"status", "404"}}), 1);
  EXPECT_TRUE(std::isnan(e.value("fake_metric")));
}

// Paths a client makes up are counted, but only kMaxEndpoints distinct ones keep a label.
TEST(Metrics, EndpointLabelsAreBounded) {
  Metrics m;
  for (size_t i = 0; i < Metrics::kMaxEndpoints + 10; ++i) m.observe_request("/p" + std::to_string(i), 404, 0.001);
  const Exposition e = rendered(m);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", "other"}, {"status", "404"}}), 10);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", "/p0"}, {"status", "404"}}), 1);
  EXPECT_TRUE(std::isnan(e.value("kestrel:http_requests_total",
                                 {{"endpoint", "/p" + std::to_string(Metrics::kMaxEndpoints)}, {"status", "404"}})));
}

// Several threads observing at once: no count is lost. The values are binary fractions, so the
// sums are exact whatever the order of the additions.
TEST(Metrics, ConcurrentObservationsAreExact) {
  Metrics m;
  constexpr int kThreads = 8, kEach = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&m, t] {
      for (int i = 0; i < kEach; ++i) {
        m.observe_token_latency(0.03125);
        m.observe_ttft(t % 2 ? 0.5 : 0.0078125);
        m.observe_request(t % 2 ? "/a" : "/b", 200, 0.25);
        m.add_tokens(1, 2);
        if (i % 1000 == 0) m.render(MetricsGauges{});  // scrapes while they run
      }
    });
  for (std::thread& t : threads) t.join();
  const Exposition e = rendered(m);
  const double n = kThreads * kEach;
  EXPECT_EQ(e.value("kestrel:time_per_output_token_seconds_count"), n);
  EXPECT_EQ(e.value("kestrel:time_per_output_token_seconds_sum"), n * 0.03125);
  EXPECT_EQ(e.value("kestrel:time_per_output_token_seconds_bucket", {{"le", "0.025"}}), 0);
  EXPECT_EQ(e.value("kestrel:time_per_output_token_seconds_bucket", {{"le", "0.05"}}), n);
  EXPECT_EQ(e.value("kestrel:time_to_first_token_seconds_bucket", {{"le", "0.01"}}), n / 2);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", "/a"}, {"status", "200"}}), n / 2);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", "/b"}, {"status", "200"}}), n / 2);
  EXPECT_EQ(e.value("kestrel:e2e_request_latency_seconds_sum", {{"endpoint", "/a"}}), n / 2 * 0.25);
  EXPECT_EQ(e.value("kestrel:prompt_tokens_total"), n);
  EXPECT_EQ(e.value("kestrel:generation_tokens_total"), 2 * n);
}

// The gauges as the slots and their queue have them at the scrape.
TEST(Metrics, GaugesFromTheSlots) {
  const std::vector<int> none;
  Slots slots(2, 4, [&](int) -> const std::vector<int>& { return none; });
  Slots::Outcome outcome;
  auto lease = slots.acquire({1, 2}, [] { return false; }, outcome);
  ASSERT_EQ(outcome, Slots::Outcome::Granted);
  Metrics m;
  const Exposition e = parse(m.render(slots));
  EXPECT_EQ(e.error, "");
  EXPECT_EQ(e.value("kestrel:num_requests_running"), 1);
  EXPECT_EQ(e.value("kestrel:num_requests_waiting"), 0);
  EXPECT_EQ(e.value("kestrel:num_slots"), 2);
}

// Durations that cannot be real (NaN, negative, infinite) are left out, not summed.
TEST(Metrics, ImpossibleDurationsAreLeftOut) {
  Metrics m;
  m.observe_ttft(NAN);
  m.observe_ttft(-1);
  m.observe_token_latency(INFINITY);
  m.observe_request(kChat, 200, NAN);
  const Exposition e = rendered(m);
  EXPECT_EQ(e.value("kestrel:time_to_first_token_seconds_count"), 0);
  EXPECT_EQ(e.value("kestrel:time_per_output_token_seconds_count"), 0);
  EXPECT_EQ(e.value("kestrel:http_requests_total", {{"endpoint", kChat}, {"status", "200"}}), 1);
  EXPECT_EQ(e.value("kestrel:e2e_request_latency_seconds_count", {{"endpoint", kChat}}), 0);
}
