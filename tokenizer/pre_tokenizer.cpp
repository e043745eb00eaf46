#include "tokenizer/pre_tokenizer.h"

#include <fmt/format.h>

#include "base/error.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/tokenizer_json.h"

namespace kestrel {

using nlohmann::json;
using tokenizer_json::flag;
using tokenizer_json::string_or;
using tokenizer_json::type_of;

namespace {

// GPT-2's pre-tokenizer regex (ByteLevel's use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

PreTokenizer::PreTokenizer() = default;
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

void PreTokenizer::add(const json& j, const std::string& where, std::vector<Step>& steps) {
  const std::string type = type_of(j);
  const std::string ctx = where + ": pre_tokenizer " + type;
  Step s;
  if (type == "Sequence") {
    KESTREL_CHECK(j.contains("pretokenizers") && j["pretokenizers"].is_array(),
                  ctx + " needs a list \"pretokenizers\"");
    for (const json& p : j["pretokenizers"]) add(p, where, steps);
    return;
  } else if (type == "Split") {
    s.kind = Step::split;
    const tokenizer_json::Pattern p = tokenizer_json::pattern(j.value("pattern", json()), ctx);
    if (p.regex) {
      s.regex = std::make_unique<Regex>(p.text, ctx);
    } else {
      s.literal = p.text;
    }
    const std::string b = string_or(j, "behavior", "Isolated", ctx);
    if (b == "Removed") s.behavior = Behavior::removed;
    else if (b == "Isolated") s.behavior = Behavior::isolated;
    else if (b == "MergedWithPrevious") s.behavior = Behavior::merged_with_previous;
    else if (b == "MergedWithNext") s.behavior = Behavior::merged_with_next;
    else if (b == "Contiguous") s.behavior = Behavior::contiguous;
    else throw Error(fmt::format("{}: unknown behavior \"{}\"", ctx, b));
    s.invert = flag(j, "invert", ctx).value_or(false);
  } else if (type == "ByteLevel") {
    s.kind = Step::byte_level;
    s.add_prefix_space = flag(j, "add_prefix_space", ctx).value_or(true);
    if (flag(j, "use_regex", ctx).value_or(true))
      s.regex = std::make_unique<Regex>(kGpt2Pattern, ctx);
  } else if (type == "Metaspace") {
    s.kind = Step::metaspace;
    s.replacement = string_or(j, "replacement", "\xE2\x96\x81", ctx);
    KESTREL_CHECK(!s.replacement.empty(), ctx + ": replacement must not be empty");
    if (const auto p = j.find("prepend_scheme"); p != j.end() && !p->is_null()) {
      const std::string scheme = string_or(j, "prepend_scheme", "", ctx);
      if (scheme == "always") s.prepend = Step::always;
      else if (scheme == "first") s.prepend = Step::first;
      else if (scheme == "never") s.prepend = Step::never;
      else throw Error(fmt::format("{}: unknown prepend_scheme \"{}\"", ctx, scheme));
    } else {
      // Files from before prepend_scheme existed say add_prefix_space instead.
      s.prepend = flag(j, "add_prefix_space", ctx).value_or(true) ? Step::always : Step::never;
    }
    s.metaspace_split = flag(j, "split", ctx).value_or(true);
  } else {
    throw Error(fmt::format("{}: pre_tokenizer {} is not supported (Kestrel reads Split, "
                            "ByteLevel, Metaspace and Sequence)",
                            where, type));
  }
  steps.push_back(std::move(s));
}

PreTokenizer PreTokenizer::from_json(const json& j, const std::string& where) {
  PreTokenizer p;
  if (!j.is_null()) add(j, where, p.steps_);
  for (const Step& s : p.steps_) p.byte_level_ |= s.kind == Step::byte_level;
  return p;
}

PreTokenizer PreTokenizer::gpt2(bool add_prefix_space) {
  PreTokenizer p;
  Step s;
  s.kind = Step::byte_level;
  s.add_prefix_space = add_prefix_space;
  s.regex = std::make_unique<Regex>(kGpt2Pattern, "GPT-2's pre-tokenizer");
  p.steps_.push_back(std::move(s));
  p.byte_level_ = true;
  return p;
}

// Cuts every word at the step's matches, as tokenizers' NormalizedString::split does for each
// delimiter behaviour; empty pieces are dropped.
void PreTokenizer::split_words(const Step& s, Words& w) {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  out.reserve(w.spans.size() * 2);
  std::vector<std::pair<size_t, size_t>> m;
  struct Part {
    uint32_t a, b;
    bool match;
  };
  std::vector<Part> parts;
  const uint32_t first_start = w.spans.empty() ? 0 : w.spans[0].first;
  for (auto [a, b] : w.spans) {
    const std::string_view piece = std::string_view(w.text).substr(a, b - a);
    m.clear();
    if (s.regex) {
      s.regex->find_all(piece, m);
    } else if (!s.literal.empty()) {
      for (size_t p = 0; (p = piece.find(s.literal, p)) != std::string_view::npos;
           p += s.literal.size())
        m.emplace_back(p, p + s.literal.size());
    }
    // The piece as alternating parts that are and are not matches.
    parts.clear();
    size_t prev = 0;
    for (auto [ms, me] : m) {
      if (prev != ms) parts.push_back({uint32_t(a + prev), uint32_t(a + ms), false});
      parts.push_back({uint32_t(a + ms), uint32_t(a + me), true});
      prev = me;
    }
    if (prev != piece.size()) parts.push_back({uint32_t(a + prev), b, false});
    if (s.invert)
      for (Part& p : parts) p.match = !p.match;

    const size_t base = out.size();
    bool previous_match = false;
    switch (s.behavior) {
      case Behavior::isolated:
        for (const Part& p : parts) out.emplace_back(p.a, p.b);
        break;
      case Behavior::removed:
        for (const Part& p : parts)
          if (!p.match) out.emplace_back(p.a, p.b);
        break;
      case Behavior::contiguous:
        for (size_t i = 0; i < parts.size(); ++i) {
          if (i > 0 && parts[i].match == previous_match) {
            out.back().second = parts[i].b;
          } else {
            out.emplace_back(parts[i].a, parts[i].b);
          }
          previous_match = parts[i].match;
        }
        break;
      case Behavior::merged_with_previous:
        for (size_t i = 0; i < parts.size(); ++i) {
          if (parts[i].match && !previous_match && out.size() > base) {
            out.back().second = parts[i].b;
          } else {
            out.emplace_back(parts[i].a, parts[i].b);
          }
          previous_match = parts[i].match;
        }
        break;
      case Behavior::merged_with_next: {
        // Walked from the end: a match joins the piece after it.
        std::vector<std::pair<uint32_t, uint32_t>> rev;
        for (size_t i = parts.size(); i-- > 0;) {
          if (parts[i].match && !previous_match && !rev.empty()) {
            rev.back().first = parts[i].a;
          } else {
            rev.emplace_back(parts[i].a, parts[i].b);
          }
          previous_match = parts[i].match;
        }
        out.insert(out.end(), rev.rbegin(), rev.rend());
        break;
      }
    }
  }
  // Empty pieces go, as PreTokenizedString::split drops them.
  size_t k = 0;
  for (auto& sp : out)
    if (sp.second > sp.first) out[k++] = sp;
  out.resize(k);
  w.lead = w.lead && !out.empty() && out[0].first == first_start;
  w.spans = std::move(out);
}

// The steps that change the text of each word (ByteLevel's prefix space, Metaspace's
// replacement and prefix), writing a new text.
void PreTokenizer::rewrite(const Step& s, Words& w) {
  Words n;
  n.lead = w.lead;
  n.text.reserve(w.text.size() + w.spans.size() * 3);
  n.spans.reserve(w.spans.size());
  for (size_t i = 0; i < w.spans.size(); ++i) {
    const auto [a, b] = w.spans[i];
    const std::string_view piece = std::string_view(w.text).substr(a, b - a);
    const uint32_t start = static_cast<uint32_t>(n.text.size());
    if (s.kind == Step::byte_level) {
      if (!piece.starts_with(' ')) n.text += ' ';
      n.text += piece;
    } else {
      const std::string replaced = replace_all(piece, " ", s.replacement);
      const bool prepend =
          s.prepend == Step::always || (s.prepend == Step::first && i == 0 && w.lead);
      if (prepend && !std::string_view(replaced).starts_with(s.replacement))
        n.text += s.replacement;
      n.text += replaced;
    }
    n.spans.emplace_back(start, static_cast<uint32_t>(n.text.size()));
  }
  w = std::move(n);
}

void PreTokenizer::split(std::string_view text, bool at_text_start, Words& out) const {
  out.text.assign(text);
  out.spans.clear();
  if (!text.empty()) out.spans.emplace_back(0, static_cast<uint32_t>(text.size()));
  out.lead = at_text_start;
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::split:
        split_words(s, out);
        break;
      case Step::byte_level:
        if (s.add_prefix_space) rewrite(s, out);
        if (s.regex) split_words(s, out);
        break;
      case Step::metaspace:
        rewrite(s, out);
        if (s.metaspace_split) {
          Step cut;
          cut.kind = Step::split;
          cut.literal = s.replacement;
          cut.behavior = Behavior::merged_with_next;
          split_words(cut, out);
        }
        break;
    }
  }
}

}  // namespace kestrel
