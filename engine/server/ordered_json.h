// JSON read again with its objects' keys in the order given (nlohmann::ordered_json), within
// bounds. A request body passes the server's bounded parse first; what is parsed a second time
// in order (tool definitions and schemas, whose properties the model is shown in the client's
// order, and the JSON text of a tool call's arguments) needs bounds of its own: an ordered
// object inserts each key by a linear search, so many keys in one object cost time quadratic
// in their number, and a string's JSON text is one value to the first parse however deep it is.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::server {

struct OrderedJsonLimits {
  size_t max_values = 100000;  // values of any kind, objects and arrays included
  int max_depth = 64;          // objects and arrays open at once
  size_t max_keys = 1024;      // keys of one object
};

// Parses `text`; with `keep_top`, only those keys of the top-level object are stored (the rest
// are read, counted and dropped). `values`, where given, receives the values read, also when
// the parse fails (so that several parses can share one budget). Throws kestrel::Error naming the bound that was
// passed, and nlohmann::json::exception for text that is not JSON.
nlohmann::ordered_json parse_ordered_json(std::string_view text, const OrderedJsonLimits& limits = {},
                                          const std::vector<std::string>& keep_top = {},
                                          size_t* values = nullptr);

}  // namespace kestrel::server
