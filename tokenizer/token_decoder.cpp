#include "tokenizer/token_decoder.h"

#include <fmt/format.h>

#include "base/error.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/tokenizer_json.h"
#include "tokenizer/utf8.h"

namespace kestrel {

using nlohmann::json;
using tokenizer_json::type_of;

namespace {

// The one character of a decoder's "content" or "replacement".
std::string one_char(const json& j, const char* key, const std::string& fallback,
                     const std::string& ctx) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  KESTREL_CHECK(j[key].is_string(), fmt::format("{}: {} must be a string", ctx, key));
  const std::string s = j[key].get<std::string>();
  KESTREL_CHECK(!s.empty() && utf8::char_len(s) == s.size(),
                fmt::format("{}: {} must be one character, found \"{}\"", ctx, key, s));
  return s;
}

int count_field(const json& j, const char* key, const std::string& ctx) {
  if (!j.contains(key) || j[key].is_null()) return 0;
  KESTREL_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() >= 0,
                fmt::format("{}: {} must be a non-negative integer", ctx, key));
  return static_cast<int>(j[key].get<int64_t>());
}

}  // namespace

TokenDecoder::TokenDecoder() = default;
TokenDecoder::~TokenDecoder() = default;
TokenDecoder::TokenDecoder(TokenDecoder&&) noexcept = default;
TokenDecoder& TokenDecoder::operator=(TokenDecoder&&) noexcept = default;

void TokenDecoder::add(const json& j, const std::string& where, TokenDecoder& d) {
  const std::string type = type_of(j);
  const std::string ctx = where + ": decoder " + type;
  if (type == "Sequence") {
    KESTREL_CHECK(j.contains("decoders") && j["decoders"].is_array(),
                  ctx + " needs a list \"decoders\"");
    for (const json& s : j["decoders"]) add(s, where, d);
    return;
  }
  if (type == "Fuse") {
    d.fused_ = true;
    return;
  }
  if (d.fused_) {
    // After the tokens are joined only a Strip of the text's start is per-token-free.
    KESTREL_CHECK(type == "Strip" && count_field(j, "stop", ctx) == 0 && d.strip_count_ == 0,
                  fmt::format("{}: decoder {} after Fuse or ByteLevel is not supported (only a "
                              "Strip of the start is)",
                              where, type));
    d.strip_content_ = one_char(j, "content", " ", ctx);
    d.strip_count_ = count_field(j, "start", ctx);
    return;
  }
  Step s;
  if (type == "ByteLevel") {
    s.kind = Step::byte_level;
    d.fused_ = true;
  } else if (type == "ByteFallback") {
    s.kind = Step::byte_fallback;
  } else if (type == "Replace") {
    s.kind = Step::replace;
    const tokenizer_json::Pattern p = tokenizer_json::pattern(j.value("pattern", json()), ctx);
    if (p.regex) {
      s.regex = std::make_unique<Regex>(p.text, ctx);
    } else {
      s.pattern = p.text;
    }
    KESTREL_CHECK(j.contains("content") && j["content"].is_string(),
                  ctx + " needs a string \"content\"");
    s.content = j["content"].get<std::string>();
  } else if (type == "Metaspace") {
    s.kind = Step::metaspace;
    s.content = one_char(j, "replacement", "\xE2\x96\x81", ctx);
    if (const auto p = j.find("prepend_scheme"); p != j.end() && !p->is_null()) {
      s.drop_first = tokenizer_json::string_or(j, "prepend_scheme", "", ctx) != "never";
    } else {
      // Files from before prepend_scheme existed say add_prefix_space instead.
      s.drop_first = tokenizer_json::flag(j, "add_prefix_space", ctx).value_or(true);
    }
    d.first_differs_ |= s.drop_first;
  } else if (type == "Strip") {
    s.kind = Step::strip;
    s.content = one_char(j, "content", " ", ctx);
    s.start = count_field(j, "start", ctx);
    s.stop = count_field(j, "stop", ctx);
  } else {
    throw Error(fmt::format("{}: decoder {} is not supported (Kestrel reads ByteLevel, Metaspace, "
                            "ByteFallback, Fuse, Strip, Replace and Sequence)",
                            where, type));
  }
  d.steps_.push_back(std::move(s));
}

TokenDecoder TokenDecoder::from_json(const json& j, const std::string& where) {
  TokenDecoder d;
  if (j.is_null()) {
    d.join_with_spaces_ = true;
    d.first_differs_ = true;
  } else {
    add(j, where, d);
  }
  return d;
}

TokenDecoder TokenDecoder::byte_level() {
  TokenDecoder d;
  Step s;
  s.kind = Step::byte_level;
  d.steps_.push_back(std::move(s));
  d.fused_ = true;
  return d;
}

std::string TokenDecoder::run(const std::string& token, bool first) const {
  std::string t = token;
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::replace:
        t = s.regex ? s.regex->replace_all(t, s.content) : replace_all(t, s.pattern, s.content);
        break;
      case Step::byte_fallback:
        if (const int b = utf8::byte_token(t); b >= 0) t = std::string(1, static_cast<char>(b));
        break;
      case Step::metaspace: {
        std::string out;
        for (size_t i = 0; i < t.size();) {
          if (std::string_view(t).substr(i).starts_with(s.content)) {
            if (!(first && s.drop_first)) out += ' ';
            i += s.content.size();
          } else {
            out += t[i++];
          }
        }
        t = std::move(out);
        break;
      }
      case Step::strip: {
        std::string_view v = t;
        for (int k = 0; k < s.start && v.starts_with(s.content); ++k)
          v.remove_prefix(s.content.size());
        for (int k = 0; k < s.stop && v.ends_with(s.content); ++k)
          v.remove_suffix(s.content.size());
        t = std::string(v);
        break;
      }
      case Step::byte_level: {
        // tokenizers' ByteLevel decoding of one token: its characters as the bytes they stand
        // for, or, when one of them is outside the byte alphabet, the token's own UTF-8.
        std::string bytes;
        if (utf8::byte_level_to_bytes(t, bytes)) t = std::move(bytes);
        break;
      }
    }
  }
  if (join_with_spaces_ && !first) t = " " + t;
  return t;
}

void TokenDecoder::build(const std::vector<std::string>& tokens) {
  blob_.clear();
  offsets_.assign(1, 0);
  first_offsets_.clear();
  for (const std::string& t : tokens) {
    blob_ += run(t, false);
    offsets_.push_back(static_cast<uint32_t>(blob_.size()));
  }
  if (!first_differs_) return;
  first_offsets_.assign(1, static_cast<uint32_t>(blob_.size()));
  for (const std::string& t : tokens) {
    blob_ += run(t, true);
    first_offsets_.push_back(static_cast<uint32_t>(blob_.size()));
  }
}

std::string_view TokenDecoder::bytes(int id, bool first) const {
  const std::vector<uint32_t>& off = first && first_differs_ ? first_offsets_ : offsets_;
  return std::string_view(blob_).substr(off[id], off[id + 1] - off[id]);
}

}  // namespace kestrel
