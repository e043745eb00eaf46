#include "engine/server/tool_calls.h"

#include <fmt/format.h>

#include <set>

#include "base/error.h"
#include "engine/grammar/json_schema.h"
#include "engine/server/api_error.h"
#include "engine/server/messages.h"

namespace kestrel::server {

using ojson = nlohmann::ordered_json;

namespace {

using grammar::gbnf_literal;

ApiError bad(const std::string& param, const std::string& message) {
  return ApiError(400, message, param, "invalid_value");
}

bool space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// OpenAI's rule for a function's name: it is written into the prompt, the grammar and the
// answer, so nothing else is let in.
bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum((unsigned char)c) || c == '_' || c == '-')) return false;
  return true;
}

// The rules of a GBNF text renamed `prefix` + name, so that the grammars of several tools'
// schemas live in one grammar without their rules (root, space, each property's) clashing.
// Names are the identifiers outside string literals, character classes, {m,n} counts and
// comments.
std::string prefix_rules(const std::string& g, const std::string& prefix) {
  std::string out;
  size_t i = 0;
  const auto ident = [](char c) { return std::isalnum((unsigned char)c) || c == '_' || c == '-'; };
  while (i < g.size()) {
    const char c = g[i];
    if (c == '"' || c == '[') {
      const char close = c == '"' ? '"' : ']';
      size_t j = i + 1;
      while (j < g.size() && g[j] != close) j += g[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, g.size());
      out.append(g, i, j - i);
      i = j;
    } else if (c == '{' || c == '#') {
      const size_t j = std::min(g.find(c == '{' ? '}' : '\n', i), g.size());
      out.append(g, i, j - i);
      i = j;
    } else if (ident(c)) {
      size_t j = i;
      while (j < g.size() && ident(g[j])) ++j;
      out += prefix;
      out.append(g, i, j - i);
      i = j;
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

// ---- an incremental reader of JSON text: where a value ends, or that it has not yet ----

enum class Scan { More, Bad, Done };

// A string at s[i] == '"': its end (past the closing quote).
Scan scan_string(const std::string& s, size_t i, size_t& end) {
  for (size_t j = i + 1; j < s.size();) {
    const unsigned char c = s[j];
    if (c == '\\') {
      j += 2;
    } else if (c == '"') {
      end = j + 1;
      return Scan::Done;
    } else if (c < 0x20) {
      end = j;  // where it breaks
      return Scan::Bad;
    } else {
      ++j;
    }
  }
  return Scan::More;
}

// A value at s[i] (not space): its end, or (Bad) where it breaks. Objects and arrays are matched
// bracket for bracket; numbers and literals run to the next delimiter. nlohmann's parser checks
// the whole at the end.
Scan scan_value(const std::string& s, size_t i, size_t& end) {
  const char c = s[i];
  if (c == '"') return scan_string(s, i, end);
  if (c == '{' || c == '[') {
    std::string open;
    for (size_t j = i; j < s.size();) {
      const char d = s[j];
      if (d == '"') {
        size_t e = 0;
        const Scan r = scan_string(s, j, e);
        if (r == Scan::Bad) end = e;
        if (r != Scan::Done) return r;
        j = e;
        continue;
      }
      if (d == '{' || d == '[') open += d;
      if (d == '}' || d == ']') {
        if (open.empty() || open.back() != (d == '}' ? '{' : '[')) {
          end = j;
          return Scan::Bad;
        }
        open.pop_back();
        if (open.empty()) {
          end = j + 1;
          return Scan::Done;
        }
      }
      ++j;
    }
    return Scan::More;
  }
  size_t j = i;
  while (j < s.size() && (std::isalnum((unsigned char)s[j]) || s[j] == '-' || s[j] == '+' || s[j] == '.')) ++j;
  if (j == i) {
    end = i;
    return Scan::Bad;
  }
  if (j == s.size()) return Scan::More;
  end = j;
  return Scan::Done;
}

size_t skip_space(const std::string& s, size_t i) {
  while (i < s.size() && space(s[i])) ++i;
  return i;
}

// A call's object at s[i] == '{': {"name": "f", "arguments": {...}} (llama3: "parameters"), in
// either order, other keys ignored. What is known of it so far: its name once its string is
// whole, where its arguments begin, and where they end once they have.
struct CallScan {
  Scan state = Scan::More;
  size_t end = 0;  // Done: past the '}'
  std::optional<std::string> name;
  size_t args_begin = std::string::npos, args_end = std::string::npos;
  size_t bad_at = std::string::npos;  // Bad inside the arguments: where they break
};

CallScan scan_call(const std::string& s, size_t i, ToolFormat f) {
  CallScan r;
  const auto args_key = [&](const std::string& k) {
    return k == "arguments" || (f == ToolFormat::llama3 && k == "parameters");
  };
  size_t j = i + 1;
  for (bool first = true;; first = false) {
    j = skip_space(s, j);
    if (j >= s.size()) return r;
    if (first && s[j] == '}') {
      r.state = Scan::Bad;  // {}: no name
      return r;
    }
    if (s[j] != '"') return r.state = Scan::Bad, r;
    size_t key_end = 0;
    Scan st = scan_string(s, j, key_end);
    if (st != Scan::Done) return r.state = st, r;
    const ojson key = ojson::parse(s.begin() + j, s.begin() + key_end, nullptr, false);
    if (key.is_discarded()) return r.state = Scan::Bad, r;
    j = skip_space(s, key_end);
    if (j >= s.size()) return r;
    if (s[j] != ':') return r.state = Scan::Bad, r;
    j = skip_space(s, j + 1);
    if (j >= s.size()) return r;
    const bool is_args = args_key(key.get<std::string>());
    // A name or arguments given twice: which one is meant is not known, and a stream has
    // announced the first.
    if ((is_args && r.args_begin != std::string::npos) || (key == "name" && r.name)) return r.state = Scan::Bad, r;
    if (is_args) {
      if (s[j] != '{') return r.state = Scan::Bad, r;  // arguments are an object
      r.args_begin = j;
    }
    size_t value_end = 0;
    st = scan_value(s, j, value_end);
    if (st == Scan::Bad && is_args) r.bad_at = value_end;
    if (st != Scan::Done) return r.state = st, r;
    if (key == "name") {
      const ojson name = ojson::parse(s.begin() + j, s.begin() + value_end, nullptr, false);
      if (name.is_discarded() || !name.is_string() || name.get<std::string>().empty())
        return r.state = Scan::Bad, r;
      r.name = name.get<std::string>();
    }
    if (is_args) {
      r.args_end = value_end;  // as written, even where it is not JSON
      if (!nlohmann::json::accept(s.begin() + j, s.begin() + value_end)) return r.state = Scan::Bad, r;
    }
    j = skip_space(s, value_end);
    if (j >= s.size()) return r;
    if (s[j] == ',') {
      ++j;
      continue;
    }
    if (s[j] != '}') return r.state = Scan::Bad, r;
    if (!r.name) return r.state = Scan::Bad, r;
    r.state = Scan::Done;
    r.end = j + 1;
    return r;
  }
}

const char* marker(ToolFormat f) {
  switch (f) {
    case ToolFormat::hermes: return "<tool_call>";
    case ToolFormat::llama3: return "<|python_tag|>";
    case ToolFormat::mistral: return "[TOOL_CALLS]";
  }
  return "";
}

// The length of the longest end of `s` (from `from`) that is a proper prefix of `m`: text that
// may still become the marker.
size_t held_back(const std::string& s, size_t from, std::string_view m) {
  for (size_t n = std::min(m.size() - 1, s.size() - from); n > 0; --n)
    if (std::string_view(s).substr(s.size() - n) == m.substr(0, n)) return n;
  return 0;
}

}  // namespace

std::string_view tool_format_name(ToolFormat f) {
  switch (f) {
    case ToolFormat::hermes: return "hermes";
    case ToolFormat::llama3: return "llama3";
    case ToolFormat::mistral: return "mistral";
  }
  return "?";
}

std::optional<ToolFormat> detect_tool_format(std::string_view t) {
  const auto has = [&](std::string_view s) { return t.find(s) != std::string_view::npos; };
  // As llama-server's common_chat_templates_apply tells them apart: by the markers the
  // templates write around calls.
  if (has("<tool_call>")) return ToolFormat::hermes;
  if (has("[TOOL_CALLS]")) return ToolFormat::mistral;
  // Llama 3.1 writes <|python_tag|> for its built-in tools; 3.2 only describes the JSON
  // ({"name": ..., "parameters": ...}) in the system or user turn.
  if (has("<|start_header_id|>") && (has("<|python_tag|>") || has("\"parameters\"")))
    return ToolFormat::llama3;
  return std::nullopt;
}

std::string make_tool_call_id(ToolFormat f, const std::string& seed, int i) {
  static const char kDigits[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  // FNV-1a over the seed and the index, stirred again for each character (splitmix64).
  uint64_t h = 1469598103934665603ull;
  for (char c : seed + ":" + std::to_string(i)) h = (h ^ (unsigned char)c) * 1099511628211ull;
  std::string out = f == ToolFormat::mistral ? "" : "call_";
  const int n = f == ToolFormat::mistral ? 9 : 24;
  for (int k = 0; k < n; ++k) {
    h += 0x9e3779b97f4a7c15ull;
    uint64_t z = h;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    out += kDigits[(z ^ (z >> 31)) % 62];
  }
  return out;
}

ToolsRequest parse_tools(const ojson* tools, const ojson* choice, const ojson* parallel) {
  ToolsRequest r;
  r.tools = ojson::array();
  if (tools) {
    if (!tools->is_array())
      throw bad("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects, got " +
                             shown_json(*tools));
    if (tools->size() > kMaxTools)
      throw bad("tools", fmt::format("'tools' holds {} tools; at most {} are supported", tools->size(), kMaxTools));
    std::set<std::string> names;
    for (size_t k = 0; k < tools->size(); ++k) {
      const ojson& t = (*tools)[k];
      const std::string at = fmt::format("tools[{}]", k);
      if (!t.is_object()) throw bad(at, at + " must be an object, got " + shown_json(t));
      if (t.contains("type") && t["type"] != "function")
        throw ApiError(400, at + ".type: only \"function\" tools are supported, got " + shown_json(t["type"]),
                       at + ".type", "unsupported_value");
      const auto fn = t.find("function");
      if (fn == t.end() || !fn->is_object())
        throw bad(at + ".function", at + ".function must be an object with a \"name\"");
      const auto name = fn->find("name");
      if (name == fn->end() || !name->is_string())
        throw bad(at + ".function.name", at + ".function.name is required (a string)");
      ToolDef d;
      d.name = name->get<std::string>();
      if (!valid_name(d.name))
        throw bad(at + ".function.name",
                  at + ".function.name must be 1 to 64 letters, digits, '_' or '-', got " + shown_json(*name));
      if (!names.insert(d.name).second)
        throw bad(at + ".function.name", fmt::format("{}.function.name: '{}' is defined twice", at, d.name));
      if (fn->contains("description") && !(*fn)["description"].is_string() && !(*fn)["description"].is_null())
        throw bad(at + ".function.description", at + ".function.description must be a string");
      // The arguments are an object: a schema without a type gets "object", one with another
      // type is refused (no call could satisfy it).
      ojson params = ojson{{"type", "object"}, {"properties", ojson::object()}};
      if (fn->contains("parameters") && !(*fn)["parameters"].is_null()) {
        params = (*fn)["parameters"];
        if (!params.is_object())
          throw bad(at + ".function.parameters", at + ".function.parameters must be a JSON schema object, got " +
                                                     shown_json(params));
        if (!params.contains("type")) params["type"] = "object";
        if (params["type"] != "object")
          throw bad(at + ".function.parameters",
                    at + ".function.parameters must describe an object (\"type\": \"object\"), got type " +
                        shown_json(params["type"]));
      }
      d.parameters = params.dump();
      // Converted now, whatever tool_choice is, so that a schema the converter refuses is one
      // 400 naming the keyword rather than a call that cannot be constrained later.
      try {
        grammar::json_schema_to_gbnf(d.parameters);
      } catch (const Error& e) {
        throw ApiError(400, at + ".function.parameters: " + e.what(), at + ".function.parameters",
                       "invalid_value");
      }
      r.defs.push_back(std::move(d));
    }
    r.tools = *tools;
  }
  if (choice) {
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "auto") r.choice.kind = ToolChoice::Auto;
      else if (c == "none") r.choice.kind = ToolChoice::None;
      else if (c == "required") r.choice.kind = ToolChoice::Required;
      else
        throw bad("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " + shown_json(*choice));
    } else if (choice->is_object() && choice->value("type", ojson()) == "function" &&
               choice->contains("function") && (*choice)["function"].is_object() &&
               (*choice)["function"].contains("name") && (*choice)["function"]["name"].is_string()) {
      r.choice.kind = ToolChoice::Named;
      r.choice.name = (*choice)["function"]["name"].get<std::string>();
      bool found = false;
      for (const ToolDef& d : r.defs) found = found || d.name == r.choice.name;
      if (!found)
        throw bad("tool_choice", fmt::format("'tool_choice' names the function '{}', which 'tools' does not define",
                                             r.choice.name.size() > 64 ? r.choice.name.substr(0, 61) + "..." : r.choice.name));
    } else {
      throw bad("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " + shown_json(*choice));
    }
    if (r.defs.empty() && (r.choice.kind == ToolChoice::Required || r.choice.kind == ToolChoice::Named))
      throw bad("tool_choice", "'tool_choice' requires a call, but 'tools' defines none");
  }
  if (parallel) {
    if (!parallel->is_boolean())
      throw bad("parallel_tool_calls", "'parallel_tool_calls' must be true or false, got " + shown_json(*parallel));
    r.parallel = parallel->get<bool>();
  }
  return r;
}

std::string tool_call_gbnf(ToolFormat f, const ToolsRequest& tools) {
  std::string rules, alts;
  for (size_t k = 0; k < tools.defs.size(); ++k) {
    const ToolDef& d = tools.defs[k];
    if (tools.choice.kind == ToolChoice::Named && d.name != tools.choice.name) continue;
    const std::string p = fmt::format("t{}-", k);
    rules += prefix_rules(grammar::json_schema_to_gbnf(d.parameters), p);
    // Spaced as the family's template writes calls into the history, so that a constrained
    // call reads like the ones the model was trained on.
    const std::string key = f == ToolFormat::llama3 ? "parameters" : "arguments";
    const std::string head = "{\"name\": \"" + d.name + "\", \"" + key + "\": ";
    std::string call = gbnf_literal(head) + " " + p + "root " + gbnf_literal("}");
    if (f == ToolFormat::hermes) call = gbnf_literal("<tool_call>\n") + " " + call + " " + gbnf_literal("\n</tool_call>");
    alts += (alts.empty() ? "" : " | ") + call;
  }
  KESTREL_CHECK(!alts.empty(), "tool_call_gbnf: no tool to call");
  const bool more = tools.parallel && tools.choice.kind != ToolChoice::Named;
  std::string root;
  switch (f) {
    case ToolFormat::hermes: root = more ? "call (\"\\n\" call)*" : "call"; break;
    // Llama 3.1's template has no way to write several calls in one turn: one.
    case ToolFormat::llama3: root = "call"; break;
    case ToolFormat::mistral: root = more ? "\"[\" call (\", \" call)* \"]\"" : "\"[\" call \"]\""; break;
  }
  return "root ::= " + root + "\ncall ::= " + alts + "\n" + rules;
}

// ---- the parser ----

ToolCallParser::ToolCallParser(ToolFormat f, std::function<std::string(int)> make_id)
    : format_(f), make_id_(std::move(make_id)) {}

ToolCallParser::Out ToolCallParser::push(std::string_view text) {
  Out out;
  buf_ += text;
  step(out, false);
  return out;
}

ToolCallParser::Out ToolCallParser::finish() {
  Out out;
  step(out, true);
  return out;
}

void ToolCallParser::emit_content(Out& out, size_t end) {
  if (end <= pos_) return;
  out.content.append(buf_, pos_, end - pos_);
  content_.append(buf_, pos_, end - pos_);
  pos_ = end;
}

void ToolCallParser::step(Out& out, bool at_end) {
  const std::string m = marker(format_);
  while (pos_ < buf_.size() || (in_call_ && at_end)) {
    if (in_call_) {
      if (!read_call(out, at_end)) return;
      continue;
    }
    // A call broken off after it was announced: the rest of it is dropped, up to the end of
    // its block (hermes) or of the reply (the others, whose calls are the whole reply).
    if (broken_) {
      if (format_ != ToolFormat::hermes) {
        pos_ = buf_.size();
        return;
      }
      static const std::string close = "</tool_call>";
      const size_t end = buf_.find(close, pos_);
      if (end == std::string::npos) {
        pos_ = at_end ? buf_.size() : buf_.size() - held_back(buf_, pos_, close);
        return;
      }
      pos_ = end + close.size();
      broken_ = false;
      after_call_ = true;
      continue;
    }
    // Space after a call is no one's text: it separates calls, or a call from the text after
    // (llama3 joins its calls with ';').
    if (after_call_) {
      size_t j = pos_;
      while (j < buf_.size() && (space(buf_[j]) || (format_ == ToolFormat::llama3 && buf_[j] == ';'))) ++j;
      if (j >= buf_.size()) {
        if (at_end) pos_ = buf_.size();
        return;
      }
      pos_ = j;
      after_call_ = false;
      continue;
    }
    // A reply of the llama3 or mistral family that opens with its JSON: the control token
    // before it, when the model wrote one, decoded to nothing.
    if (!started_ && format_ != ToolFormat::hermes) {
      const size_t j = skip_space(buf_, pos_);
      if (j >= buf_.size()) {
        if (at_end) emit_content(out, buf_.size());
        return;  // only space yet
      }
      // Mistral's marker opens with the '[' of a bare list: which one it is, is known later.
      const size_t have = std::min(buf_.size() - j, m.size());
      if (!at_end && have < m.size() && m.compare(0, have, buf_, j, have) == 0) return;
      started_ = true;
      const char bare = format_ == ToolFormat::llama3 ? '{' : '[';
      if (buf_[j] == bare && buf_.compare(j, m.size(), m) != 0) {
        in_call_ = true;
        region_ = body_ = j;
        region_calls_ = 0;
        pos_ = j;  // the space before a call is no one's text
        continue;
      }
    }
    const size_t hit = buf_.find(m, pos_);
    if (hit == std::string::npos) {
      emit_content(out, at_end ? buf_.size() : buf_.size() - held_back(buf_, pos_, m));
      return;
    }
    emit_content(out, hit);
    started_ = true;
    in_call_ = true;
    region_ = hit;
    region_calls_ = 0;
    body_ = pos_ = hit + m.size();
  }
}

// Reads calls at pos_. Returns false when it needs more text than there is (never at_end).
bool ToolCallParser::read_call(Out& out, bool at_end) {
  // What is not a call after all is text: from the region's start where no call of it was
  // announced (the marker too, so that it is not found again). A call announced and then
  // broken off (or cut short at the end) stays as it was written, and the rest of it is
  // dropped: what comes after is text.
  size_t j = skip_space(buf_, pos_);
  const auto give_up = [&] {
    if (current_ >= 0) {
      broken_ = true;
    } else if (region_calls_ == 0) {
      pos_ = region_;
      emit_content(out, body_ > region_ ? body_ : region_ + 1);
    } else {
      // Calls were read and text follows: the space before it is no one's text, whether it
      // arrived with the last call or after it.
      pos_ = std::max(pos_, std::min(j, buf_.size()));
    }
    in_call_ = in_list_ = closing_ = false;
    current_ = -1;
    args_sent_ = 0;
    return true;
  };
  if (closing_) {  // hermes: a call read, its </tool_call> expected
    static const std::string close = "</tool_call>";
    const size_t have = buf_.size() - j;
    if (have < close.size() && close.compare(0, have, buf_, j, have) == 0 && !at_end) return false;
    if (buf_.compare(j, close.size(), close) == 0) pos_ = j + close.size();
    closing_ = in_call_ = false;
    after_call_ = true;
    return true;
  }
  if (format_ == ToolFormat::mistral && !in_list_) {
    if (j >= buf_.size()) return at_end ? give_up() : false;
    if (buf_[j] != '[') return give_up();
    in_list_ = true;
    j = skip_space(buf_, j + 1);
    pos_ = j;
    body_ = std::max(body_, j);
  }
  if (format_ == ToolFormat::mistral && j < buf_.size() && buf_[j] == ',') j = skip_space(buf_, j + 1);
  if (format_ == ToolFormat::mistral && j < buf_.size() && buf_[j] == ']') {
    pos_ = j + 1;
    in_call_ = in_list_ = false;
    after_call_ = true;
    return true;
  }
  if (j >= buf_.size()) return at_end ? give_up() : false;
  if (buf_[j] != '{') return give_up();
  const CallScan c = scan_call(buf_, j, format_);
  // A call is announced once its name is read and its arguments have begun (or it ended
  // without them). Whatever breaks after that, at whatever piece of text it shows, leaves the
  // same call: its arguments as written up to where they broke.
  if (c.name && current_ < 0 && (c.args_begin != std::string::npos || c.state == Scan::Done)) {
    current_ = (int)calls_.size();
    ++region_calls_;
    calls_.push_back({make_id_(current_), *c.name, ""});
    out.calls.push_back({current_, true, calls_.back().id, *c.name, ""});
  }
  if (current_ >= 0 && c.args_begin != std::string::npos) {
    size_t end = c.args_end != std::string::npos ? c.args_end : buf_.size();
    if (c.bad_at != std::string::npos) end = std::min(end, c.bad_at);
    const size_t from = c.args_begin + args_sent_;
    if (end > from) {
      const std::string piece = buf_.substr(from, end - from);
      calls_[current_].arguments += piece;
      out.calls.push_back({current_, false, "", "", piece});
      args_sent_ += piece.size();
    }
  }
  if (c.state == Scan::Bad) return give_up();
  if (c.state == Scan::More) return at_end ? give_up() : false;
  // Done: a call without arguments has none.
  if (c.args_begin == std::string::npos) {
    calls_[current_].arguments = "{}";
    out.calls.push_back({current_, false, "", "", "{}"});
  }
  current_ = -1;
  args_sent_ = 0;
  size_t k = skip_space(buf_, c.end);
  switch (format_) {
    case ToolFormat::hermes:
      pos_ = c.end;
      closing_ = true;
      break;
    case ToolFormat::llama3:
      // Several calls joined by ';' (after_call_ skips it); what follows the last is text.
      pos_ = c.end;
      in_call_ = false;
      started_ = false;  // a '{' next is the next call
      after_call_ = true;
      break;
    case ToolFormat::mistral:
      pos_ = body_ = k;  // a ',' next is skipped by the next read
      break;
  }
  return true;
}

}  // namespace kestrel::server
