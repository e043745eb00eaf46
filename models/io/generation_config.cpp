#include "models/io/generation_config.h"

#include <cmath>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "base/error.h"
#include "base/files.h"
#include "models/io/json_fields.h"

namespace kestrel {

using namespace json_fields;

namespace {

// A finite number in the range `ok` accepts; `range` says that range in words.
template <typename Ok>
std::optional<float> number(const json& j, const char* key, const std::string& where, Ok ok,
                            const char* range) {
  const json* v = field(j, key);
  if (!v) return std::nullopt;
  KESTREL_CHECK(v->is_number(),
                fmt::format("{}: {} must be a number, found {}", where, key, v->dump()));
  const double x = v->get<double>();
  KESTREL_CHECK(std::isfinite(x) && std::fabs(x) <= std::numeric_limits<float>::max() && ok(x),
                fmt::format("{}: {} = {} is out of range ({})", where, key, v->dump(), range));
  return (float)x;
}

}  // namespace

GenerationDefaults load_generation_defaults(const std::string& dir) {
  GenerationDefaults g;
  const std::string where = (std::filesystem::path(dir) / "generation_config.json").string();
  if (!path_exists(where)) return g;
  const json j = read_json_object(where);

  if (field(j, "do_sample")) g.do_sample = opt_bool(j, "do_sample", where, true);
  g.temperature = number(j, "temperature", where, [](double x) { return x >= 0; }, "0 or more");
  if (field(j, "top_k")) {
    g.top_k = opt_int(j, "top_k", where, 0);
    KESTREL_CHECK(*g.top_k >= 0, fmt::format("{}: top_k = {} is out of range (0 or more)", where,
                                             *g.top_k));
  }
  g.top_p = number(j, "top_p", where, [](double x) { return x > 0 && x <= 1; }, "above 0, at most 1");
  g.min_p = number(j, "min_p", where, [](double x) { return x >= 0 && x <= 1; }, "0 to 1");
  g.repetition_penalty = number(j, "repetition_penalty", where, [](double x) { return x > 0; },
                                "above 0");
  return g;
}

}  // namespace kestrel
