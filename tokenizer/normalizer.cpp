#include "tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>

#include <fmt/format.h>

#include "base/error.h"
#include "tokenizer/tokenizer_json.h"

namespace kestrel {

using nlohmann::json;
using tokenizer_json::type_of;

namespace {

bool ascii(char c) { return static_cast<unsigned char>(c) < 0x80; }

// utf8proc's normalization of `s`, appended to `out`.
void map_unicode(std::string_view s, int options, std::string& out) {
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                   static_cast<utf8proc_ssize_t>(s.size()), &dst,
                   static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    std::free(dst);
    throw Error(fmt::format("tokenizer: Unicode normalization failed ({})", utf8proc_errmsg(n)));
  }
  out.append(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
}

// A Unicode normalization form of `text`. ASCII is left alone and only the runs around other
// characters go through utf8proc: no ASCII character is the second half of a composition or
// reorders with its neighbours, so the text can be cut before any ASCII character; the ASCII
// character before a run joins it (it may compose with a combining mark after it, e + U+0301).
std::string normalize_form(const std::string& text, int options) {
  std::string out;
  out.reserve(text.size() + text.size() / 8);
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    size_t j = i;
    while (j < n && ascii(text[j])) ++j;
    if (j == n) {
      out.append(text, i, n - i);
      break;
    }
    // text[j] starts a run of other characters; the ASCII character before it goes with it.
    const size_t chunk = j > i ? j - 1 : j;
    out.append(text, i, chunk - i);
    size_t k = j;
    while (k < n && !ascii(text[k])) ++k;
    map_unicode(std::string_view(text).substr(chunk, k - chunk), options, out);
    i = k;
  }
  return out;
}

std::string string_field(const json& j, const char* key, const std::string& where) {
  KESTREL_CHECK(j.contains(key) && j[key].is_string(),
                fmt::format("{}: {} needs a string \"{}\"", where, type_of(j), key));
  return j[key].get<std::string>();
}

}  // namespace

std::string replace_all(std::string_view text, std::string_view pattern, std::string_view with) {
  if (pattern.empty()) return std::string(text);
  std::string out;
  size_t i = 0;
  for (size_t p; (p = text.find(pattern, i)) != std::string_view::npos; i = p + pattern.size()) {
    out.append(text.substr(i, p - i));
    out.append(with);
  }
  out.append(text.substr(i));
  return out;
}

Normalizer::Normalizer() = default;
Normalizer::~Normalizer() = default;
Normalizer::Normalizer(Normalizer&&) noexcept = default;
Normalizer& Normalizer::operator=(Normalizer&&) noexcept = default;

void Normalizer::add(const json& j, const std::string& where, std::vector<Step>& steps) {
  const std::string type = type_of(j);
  const std::string ctx = where + ": normalizer " + type;
  Step s;
  if (type == "Sequence") {
    KESTREL_CHECK(j.contains("normalizers") && j["normalizers"].is_array(),
                  ctx + " needs a list \"normalizers\"");
    for (const json& n : j["normalizers"]) add(n, where, steps);
    return;
  } else if (type == "NFC") {
    s.kind = Step::unicode_form;
    s.utf8proc_options = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
  } else if (type == "NFD") {
    s.kind = Step::unicode_form;
    s.utf8proc_options = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
  } else if (type == "NFKC") {
    s.kind = Step::unicode_form;
    s.utf8proc_options = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  } else if (type == "NFKD") {
    s.kind = Step::unicode_form;
    s.utf8proc_options = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  } else if (type == "Prepend") {
    s.kind = Step::prepend;
    s.text = string_field(j, "prepend", ctx);
  } else if (type == "Replace") {
    s.kind = Step::replace;
    KESTREL_CHECK(j.contains("pattern"), ctx + " needs a \"pattern\"");
    const tokenizer_json::Pattern p = tokenizer_json::pattern(j["pattern"], ctx);
    s.content = string_field(j, "content", ctx);
    if (p.regex) {
      s.regex = std::make_unique<Regex>(p.text, ctx);
    } else {
      s.text = p.text;
    }
  } else {
    throw Error(fmt::format("{}: normalizer {} is not supported (Kestrel reads NFC, NFD, NFKC, "
                            "NFKD, Prepend, Replace and Sequence)",
                            where, type));
  }
  steps.push_back(std::move(s));
}

Normalizer Normalizer::from_json(const json& j, const std::string& where) {
  Normalizer n;
  if (!j.is_null()) add(j, where, n.steps_);
  return n;
}

std::string Normalizer::apply(std::string text) const {
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::unicode_form:
        text = normalize_form(text, s.utf8proc_options);
        break;
      case Step::prepend:
        if (!text.empty()) text = s.text + text;
        break;
      case Step::replace:
        text = s.regex ? s.regex->replace_all(text, s.content)
                       : replace_all(text, s.text, s.content);
        break;
    }
  }
  return text;
}

}  // namespace kestrel
