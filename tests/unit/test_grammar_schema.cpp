// JSON Schema to GBNF (engine/grammar/json_schema.h): random schemas, random walks through
// their grammars, and every text produced must parse (nlohmann) and validate against the
// schema with an independent validator, Debian's python3-jsonschema
// (tests/support/validate_json_schema.py).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/json_schema.h"

using namespace kestrel;
using namespace kestrel::grammar;
using json = nlohmann::ordered_json;

namespace {

std::string refusal(const std::string& schema) {
  try {
    json_schema_to_gbnf(schema);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Random schemas over the supported keywords. oneOf branches have distinct types so that a
// value matches exactly one, as the validator requires.
json random_schema(std::mt19937& rng, int depth) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const int kind = depth <= 0 ? pick(6) : pick(11);
  switch (kind) {
    case 0: {
      json s = {{"type", "string"}};
      int v = pick(4);
      if (v == 1) s["maxLength"] = pick(6);
      if (v == 2) {
        s["minLength"] = 1 + pick(3);
        s["maxLength"] = 4 + pick(4);
      }
      if (v == 3) {
        const char* pats[] = {"^[a-z]{2,4}-\\d+$", "^(ab|cd)*x?$", "[A-Z][a-z]+", "^\\w+\\.\\w{2,3}$",
                              "^\"q\\\\[^x]{1,3}$", "^(?:+?\\d{3}) \\d{3}$"};
        const char* p = pats[pick(5)];
        s["pattern"] = p;
      }
      return s;
    }
    case 1: {
      json s = {{"type", "integer"}};
      int v = pick(5);
      if (v == 1) s["minimum"] = pick(2000) - 1000;
      if (v == 2) s["maximum"] = pick(2000) - 1000;
      if (v == 3) {
        int lo = pick(400) - 200;
        s["minimum"] = lo;
        s["maximum"] = lo + pick(300);
      }
      if (v == 4) s["exclusiveMinimum"] = pick(100);
      return s;
    }
    case 2: return {{"type", pick(2) ? "number" : "boolean"}};
    case 3: return {{"enum", json::array({"red", 3, nullptr, "gr\"een", json::array({1, 2})})}};
    case 4: {
      const char* f[] = {"date", "date-time", "uuid", "time"};
      return {{"type", "string"}, {"format", f[pick(4)]}};
    }
    case 5: return {{"const", json{{"a", 1}, {"b", "x"}}}};
    case 6:
    case 7: {
      json s = {{"type", "object"}, {"properties", json::object()}};
      json req = json::array();
      const int n = pick(4);
      for (int i = 0; i < n; ++i) {
        std::string k = std::string(1, static_cast<char>('a' + i)) + (pick(3) == 0 ? "é" : "");
        s["properties"][k] = random_schema(rng, depth - 1);
        if (pick(2)) req.push_back(k);
      }
      if (!req.empty()) s["required"] = req;
      int ap = pick(4);
      if (ap == 1) s["additionalProperties"] = false;
      if (ap == 2) s["additionalProperties"] = true;
      if (ap == 3) s["additionalProperties"] = {{"type", "integer"}};
      return s;
    }
    case 8: {
      json s = {{"type", "array"}, {"items", random_schema(rng, depth - 1)}};
      if (pick(2)) s["minItems"] = pick(3);
      if (pick(2)) s["maxItems"] = 2 + pick(3);
      return s;
    }
    case 9: {
      json s = {{"oneOf", json::array({{{"type", "null"}}, random_schema(rng, depth - 1)})}};
      if (s["oneOf"][1].contains("type") && s["oneOf"][1]["type"] == "null") s["oneOf"][1] = {{"type", "boolean"}};
      // Branches that may hold null too (enum, a nested oneOf, a type list) would make null
      // match twice.
      const json& b = s["oneOf"][1];
      if (b.contains("enum") || b.contains("const") || b.contains("oneOf") || (b.contains("type") && b["type"].is_array())) {
        s["oneOf"][1] = {{"type", "integer"}};
      }
      return s;
    }
    default: return {{"type", json::array({"string", "integer", "null"})}};
  }
}

struct StateHash {
  size_t operator()(const GrammarState& s) const { return s.hash(); }
};

// The shortest bytes from `st` to a complete match, by breadth-first search over distinct
// states (most bytes inside a string lead to the same state, so there are few).
std::string shortest_completion(const GrammarState& st) {
  std::vector<std::pair<GrammarState, std::string>> frontier = {{st, ""}};
  std::unordered_map<GrammarState, int, StateHash> seen;
  seen.emplace(st, 0);
  while (!frontier.empty()) {
    std::vector<std::pair<GrammarState, std::string>> next;
    for (auto& [s, path] : frontier) {
      if (s.is_accepting()) return path;
      for (int b = 0x20; b < 0x80; ++b) {
        GrammarState c = s;
        if (!c.accept_byte(static_cast<uint8_t>(b))) continue;
        if (seen.emplace(c, 0).second) next.push_back({c, path + static_cast<char>(b)});
      }
    }
    if (seen.size() > 200000) break;
    frontier = std::move(next);
  }
  return "<no completion>";
}

// A random text of the grammar: random allowed characters, stopping at a complete match with
// some chance, then the shortest way to a complete match.
std::string random_walk(const std::shared_ptr<const Grammar>& g, std::mt19937& rng) {
  static const std::vector<std::string> units = [] {
    std::vector<std::string> u;
    for (int c = 0x20; c < 0x7F; ++c) u.push_back(std::string(1, static_cast<char>(c)));
    for (const char* s : {"\n", "\t", "é", "中", "😀", "\\n", "\\u00e9", "true", "null", "false"}) u.push_back(s);
    return u;
  }();
  GrammarState st(g);
  std::string out;
  const int budget = static_cast<int>(rng() % 120);
  for (int step = 0; step < budget; ++step) {
    if (st.is_accepting() && rng() % 8 == 0) return out;
    std::vector<const std::string*> ok;
    for (const auto& u : units) {
      GrammarState c = st;
      if (c.accept_bytes(u)) ok.push_back(&u);
    }
    if (ok.empty()) break;
    const std::string& u = *ok[rng() % ok.size()];
    st.accept_bytes(u);
    out += u;
  }
  return out + shortest_completion(st);
}

}  // namespace

TEST(JsonSchema, RandomWalksProduceValidJson) {
  std::mt19937 rng(2026);
  const std::string cases_path = testing::TempDir() + "grammar_schema_cases.jsonl";
  std::ofstream cases(cases_path);
  std::vector<std::pair<std::string, std::string>> produced;  // schema, text
  int walks = 0;
  for (int i = 0; i < 150; ++i) {
    json schema = random_schema(rng, 3);
    if (i % 10 == 0) {
      // A recursive definition through $defs.
      schema = {{"$defs", {{"node", {{"type", "object"},
                                      {"properties", {{"v", random_schema(rng, 1)},
                                                      {"kids", {{"type", "array"}, {"items", {{"$ref", "#/$defs/node"}}}, {"maxItems", 2}}}}},
                                      {"required", json::array({"v"})}}}}},
                {"$ref", "#/$defs/node"}};
    }
    const std::string gbnf = json_schema_to_gbnf(schema.dump());
    auto g = Grammar::parse(gbnf);
    for (int w = 0; w < 4; ++w) {
      std::string text = random_walk(g, rng);
      ++walks;
      // The breadth-first completion gives up past its bound on some wide grammars; those
      // walks are left out, and most must complete.
      if (text.ends_with("<no completion>")) continue;
      ASSERT_NO_THROW((void)json::parse(text)) << schema.dump() << "\n" << text << "\n" << gbnf;
      cases << json{{"schema", schema}, {"instance", text}}.dump() << "\n";
      produced.push_back({schema.dump(), text});
    }
  }
  cases.close();
  const std::string cmd = "python3 " KESTREL_SOURCE_DIR "/tests/support/validate_json_schema.py < " + cases_path;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[1024];
  size_t i = 0;
  while (fgets(line, sizeof line, p)) {
    ASSERT_LT(i, produced.size());
    EXPECT_EQ(std::string(line), "ok\n") << "schema " << produced[i].first << "\ntext " << produced[i].second;
    ++i;
  }
  ASSERT_EQ(pclose(p), 0) << "the validator needs python3-jsonschema (scripts/install-deps.sh)";
  EXPECT_EQ(i, produced.size());
  EXPECT_GE(produced.size() * 10, static_cast<size_t>(walks) * 8) << produced.size() << " of " << walks;
}

TEST(JsonSchema, GrammarRefusesWhatTheSchemaRefuses) {
  auto g = Grammar::parse(json_schema_to_gbnf(R"({"type":"object","properties":{"n":{"type":"integer","minimum":-5,"maximum":120},"s":{"type":"string","maxLength":2}},"required":["n"],"additionalProperties":false})"));
  auto full = [&](const std::string& t) {
    GrammarState st(g);
    return st.accept_bytes(t) && st.is_accepting();
  };
  EXPECT_TRUE(full(R"({"n": -5, "s": "ab"})"));
  EXPECT_TRUE(full(R"({"n":120})"));
  EXPECT_FALSE(full(R"({"n":121})"));
  EXPECT_FALSE(full(R"({"n":-6})"));
  EXPECT_FALSE(full(R"({"s":"ab"})"));           // n is required
  EXPECT_FALSE(full(R"({"s":"ab","n":1})"));     // the schema's order
  EXPECT_FALSE(full(R"({"n":1,"s":"abc"})"));    // maxLength
  EXPECT_FALSE(full(R"({"n":1,"x":1})"));        // no other key
  EXPECT_FALSE(full("{\"n\":1" + std::string(30, ' ') + "}"));  // bounded whitespace
}

TEST(JsonSchema, RefusalsNameKeywordAndPath) {
  EXPECT_EQ(refusal(R"({"type":"object","properties":{"a":{"not":{"type":"string"}}}})"),
            "json schema: /properties/a: unsupported keyword 'not'");
  EXPECT_EQ(refusal(R"({"type":"array","items":{"type":"number","minimum":1}})"),
            "json schema: /items/minimum: 'minimum' on a number is not supported (only on integers)");
  EXPECT_EQ(refusal(R"({"type":"string","format":"email"})"),
            "json schema: /format: unsupported format 'email' (date, time, date-time, uuid)");
  EXPECT_EQ(refusal(R"({"type":"string","pattern":"^(?=a)b$"})"),
            "json schema: /pattern: group '(?=' (lookaround, named groups, flags) is not supported at offset 2 of the pattern");
  EXPECT_EQ(refusal(R"({"type":"string","pattern":"(a)\\1"})"),
            "json schema: /pattern: back-references are not supported at offset 4 of the pattern");
  // Counts the GBNF would refuse are refused here, naming the pattern (found by fuzz_grammar).
  EXPECT_EQ(refusal(R"({"type":"string","pattern":"^[a-z]{5,4}$"})"),
            "json schema: /pattern: repetition '{5,4}' with its maximum below its minimum at offset 6 of the pattern");
  EXPECT_EQ(refusal(R"({"type":"string","pattern":"^a{1,2,3}$"})").rfind("json schema: /pattern: bad repetition '{1,2,3}'", 0), 0u);
  EXPECT_EQ(refusal(R"({"type":"string","pattern":"^a{20000}$"})").rfind("json schema: /pattern: repetition '{20000}' over 10000", 0), 0u);
  EXPECT_NO_THROW((void)json_schema_to_gbnf(R"({"type":"string","pattern":"^a{2,}b{3}c{0,4}$"})"));
  EXPECT_EQ(refusal(R"({"$ref":"https://example.com/s.json"})"),
            "json schema: /$ref: unsupported or unresolvable reference 'https://example.com/s.json' (only #, #/$defs/NAME and #/definitions/NAME)");
  EXPECT_EQ(refusal(R"({"type":"object","properties":{"a":{"type":"x"}}})"),
            "json schema: /properties/a/type: unknown type 'x'");
  EXPECT_EQ(refusal("{\"type\": "), refusal("{\"type\": "));
  EXPECT_EQ(refusal("{\"type\": ").rfind("json schema: not valid JSON: ", 0), 0u);
  EXPECT_EQ(refusal(R"({"type":"integer","maximum":1e800})"), "json schema: not valid JSON: a number too large to represent");
  // A reference to itself with nothing consumed first is left recursion, refused by name.
  try {
    Grammar::parse(json_schema_to_gbnf(R"({"$ref":"#"})"));
    ADD_FAILURE() << "a schema that is only a reference to itself was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "grammar: rule 'root-ref' is left-recursive: it can reach itself before matching a character");
  }
}

TEST(JsonSchema, AnyObjectGrammar) {
  auto g = Grammar::parse(json_object_gbnf());
  GrammarState st(g);
  EXPECT_TRUE(st.accept_bytes(R"({"a": [1, 2.5e3, {"b": null}], "c": "d\u00e9"})"));
  EXPECT_TRUE(st.is_accepting());
  GrammarState arr(g);
  EXPECT_FALSE(arr.accept_bytes("[1]"));  // an object, not any value
}
