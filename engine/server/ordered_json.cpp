#include "engine/server/ordered_json.h"

#include <algorithm>
#include <utility>

#include "base/error.h"

namespace kestrel::server {

nlohmann::ordered_json parse_ordered_json(std::string_view text, const OrderedJsonLimits& limits,
                                          const std::vector<std::string>& keep_top,
                                          size_t* values_read) {
  using Event = nlohmann::ordered_json::parse_event_t;
  // Counted into the caller's `values_read` where given, so that it holds the count also when
  // a bound or a syntax error ends the parse.
  size_t local = 0;
  size_t& values = values_read ? *values_read : local;
  values = 0;
  // Per open object or array: its keys so far (arrays keep 0), and whether it is stored (a
  // top-level key's value that keep_top drops is read unstored, so its keys cost no search).
  std::vector<std::pair<size_t, bool>> open;
  bool top_key_kept = true;
  auto count_value = [&] {
    if (++values > limits.max_values)
      throw Error("more than " + std::to_string(limits.max_values) + " JSON values");
  };
  // `depth` is the parser's: 0 for the top-level value's own start, 1 for its keys.
  auto callback = [&](int depth, Event event, nlohmann::ordered_json& parsed) -> bool {
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        count_value();
        if (depth >= limits.max_depth)
          throw Error("JSON nested deeper than " + std::to_string(limits.max_depth) + " levels");
        open.emplace_back(0, open.empty() ? true : depth == 1 ? top_key_kept : open.back().second);
        return true;
      case Event::object_end:
      case Event::array_end:
        if (!open.empty()) open.pop_back();
        return true;
      case Event::key:
        if (!open.empty() && open.back().second && ++open.back().first > limits.max_keys)
          throw Error("a JSON object of more than " + std::to_string(limits.max_keys) + " keys");
        if (depth == 1 && !keep_top.empty() && parsed.is_string()) {
          top_key_kept = std::find(keep_top.begin(), keep_top.end(),
                                   parsed.get_ref<const std::string&>()) != keep_top.end();
          return top_key_kept;  // false: read, not stored
        }
        return true;
      case Event::value:
        count_value();
        return true;
    }
    return true;
  };
  return nlohmann::ordered_json::parse(text.begin(), text.end(), callback);
}

}  // namespace kestrel::server
