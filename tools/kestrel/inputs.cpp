// The batch-line and --messages parsers (inputs.h).
#include "tools/kestrel/inputs.h"

#include <fmt/format.h>

#include "base/error.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/json_schema.h"
#include "engine/server/messages.h"

namespace kestrel::cli {

using nlohmann::json;

BatchItem parse_batch_line(const std::string& text, int line) {
  BatchItem it;
  it.line = line;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    it.error = e.byte <= text.size() ? fmt::format("not valid JSON (error at column {})", e.byte)
                                     : std::string("not valid JSON (it ends early)");
    return it;
  } catch (const json::out_of_range&) {
    it.error = "not valid JSON (a number too large to represent)";
    return it;
  }
  if (!j.is_object()) {
    it.error = "expected a JSON object with \"prompt\", found " + std::string(j.type_name());
    return it;
  }
  if (j.contains("id")) it.id = j["id"];
  auto bad = [&](const std::string& key, const std::string& want) {
    it.error = fmt::format("\"{}\" must be {}, found {}", key, want, j[key].dump());
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "id") continue;
    if (key == "prompt") {
      if (!v.is_string()) {
        bad(key, "a string");
        return it;
      }
      it.prompt = v.get<std::string>();
    } else if (key == "n_predict" || key == "max_tokens") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (1 << 30)) {
        bad(key, "a positive integer");
        return it;
      }
      it.settings["n_predict"] = v;
    } else if (key == "temperature") {
      if (!v.is_number() || v.get<double>() < 0) {
        bad(key, "a number >= 0");
        return it;
      }
      it.settings[key] = v;
    } else if (key == "top_k") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 30)) {
        bad(key, "an integer >= 0");
        return it;
      }
      it.settings[key] = v;
    } else if (key == "top_p" || key == "min_p") {
      if (!v.is_number() || v.get<double>() < 0 || v.get<double>() > 1) {
        bad(key, "a number in [0, 1]");
        return it;
      }
      it.settings[key] = v;
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) {
        bad(key, "a non-negative integer");
        return it;
      }
      it.settings[key] = v;
    } else if (key == "stop") {
      json stops = v.is_string() ? json::array({v}) : v;
      bool ok = stops.is_array();
      for (const json& s : stops) ok = ok && s.is_string();
      if (!ok) {
        bad(key, "a string or a list of strings");
        return it;
      }
      it.settings[key] = stops;
    } else if (key == "grammar" || key == "json_schema" || key == "json_object") {
      if (it.grammar) {
        it.error = "at most one of \"grammar\", \"json_schema\" and \"json_object\"";
        return it;
      }
      try {
        if (key == "grammar") {
          if (!v.is_string()) {
            bad(key, "a string (GBNF)");
            return it;
          }
          it.grammar = grammar::Grammar::parse(v.get<std::string>());
        } else if (key == "json_schema") {
          // A schema object, or its text.
          if (!v.is_object() && !v.is_string() && !v.is_boolean()) {
            bad(key, "a JSON Schema");
            return it;
          }
          it.grammar = grammar::Grammar::parse(grammar::json_schema_to_gbnf(v.is_string() ? v.get<std::string>() : v.dump()));
        } else {
          if (v != true) {
            bad(key, "true");
            return it;
          }
          it.grammar = grammar::Grammar::parse(grammar::json_object_gbnf());
        }
      } catch (const Error& e) {
        it.error = fmt::format("\"{}\": {}", key, e.what());
        return it;
      }
    } else {
      it.error = fmt::format("unknown key \"{}\" (known: prompt, n_predict, max_tokens, "
                             "temperature, top_k, top_p, min_p, seed, stop, grammar, json_schema, "
                             "json_object, id)", key);
      return it;
    }
  }
  if (!j.contains("prompt")) it.error = "no \"prompt\"";
  else if (it.prompt.empty()) it.error = "the prompt is empty";
  return it;
}

void apply_batch_settings(const json& s, GenerateOptions& opt) {
  opt.max_new_tokens = s.value("n_predict", opt.max_new_tokens);
  opt.sampling.temperature = s.value("temperature", opt.sampling.temperature);
  opt.sampling.top_k = s.value("top_k", opt.sampling.top_k);
  opt.sampling.top_p = s.value("top_p", opt.sampling.top_p);
  opt.sampling.min_p = s.value("min_p", opt.sampling.min_p);
  opt.sampling.seed = s.value("seed", opt.sampling.seed);
  if (s.contains("stop")) opt.stop = s["stop"].get<std::vector<std::string>>();
}

std::vector<ChatMessage> parse_messages(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(e.byte <= text.size()
                    ? fmt::format("{}: not valid JSON (error at byte {})", path, e.byte)
                    : fmt::format("{}: not valid JSON (it ends early)", path));
  } catch (const json::out_of_range&) {
    throw Error(path + ": not valid JSON (a number too large to represent)");
  }
  // The server's rules and words (engine/server/messages.h), after the file's name.
  try {
    return server::parse_chat_messages(&j);
  } catch (const server::ApiError& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace kestrel::cli
