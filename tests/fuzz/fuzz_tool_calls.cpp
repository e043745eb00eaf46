// The tool-call parser (engine/server/tool_calls.h) on arbitrary replies, as a model may write
// them: a reply read whole and the same reply streamed in pieces give the same text and the
// same calls, the streamed pieces join to them, and nothing crashes or hangs. The first byte
// picks the call format and the piece sizes, the rest is the reply.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "engine/server/tool_calls.h"

using namespace kestrel::server;

namespace {

struct Parsed {
  std::string content;
  std::vector<ToolCall> calls;
  std::vector<ToolCall> joined;  // the streamed deltas put together
};

void take(Parsed& p, const ToolCallParser::Out& out) {
  p.content += out.content;
  for (const ToolCallDelta& d : out.calls) {
    if (d.first) {
      if (d.index != (int)p.joined.size()) {
        std::fprintf(stderr, "call %d announced as the %zu-th\n", d.index, p.joined.size());
        std::abort();
      }
      p.joined.push_back({d.id, d.name, ""});
    }
    if (d.index < 0 || d.index >= (int)p.joined.size()) {
      std::fprintf(stderr, "a delta of call %d before it was announced\n", d.index);
      std::abort();
    }
    p.joined[d.index].arguments += d.arguments;
  }
}

Parsed parse(ToolFormat f, std::string_view text, size_t piece) {
  ToolCallParser parser(f, [](int i) { return "call_" + std::to_string(i); });
  Parsed p;
  for (size_t at = 0; at < text.size(); at += piece) take(p, parser.push(text.substr(at, piece)));
  take(p, parser.finish());
  p.calls = parser.calls();
  return p;
}

bool same(const std::vector<ToolCall>& a, const std::vector<ToolCall>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].id != b[i].id || a[i].name != b[i].name || a[i].arguments != b[i].arguments) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const ToolFormat f = data[0] % 3 == 0 ? ToolFormat::hermes : data[0] % 3 == 1 ? ToolFormat::llama3
                                                                               : ToolFormat::mistral;
  const size_t piece = 1 + (data[0] / 3) % 7;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const Parsed whole = parse(f, text, text.size() + 1), streamed = parse(f, text, piece);
  if (whole.content != streamed.content || !same(whole.calls, streamed.calls)) {
    std::fprintf(stderr, "read whole and in pieces of %zu, the reply parses differently\n", piece);
    std::abort();
  }
  for (const Parsed* p : {&whole, &streamed})
    if (!same(p->calls, p->joined)) {
      std::fprintf(stderr, "the streamed deltas do not join to the calls\n");
      std::abort();
    }
  return 0;
}
