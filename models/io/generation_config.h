// The sampling defaults of generation_config.json, validated once: a value outside its range
// (a negative temperature, top_p outside (0, 1], ...) is refused in one line naming the file,
// the field and the value, instead of reaching the sampler. Raw JSON stops here.
#pragma once

#include <optional>
#include <string>

namespace kestrel {

// Each field as the file states it; absent (or null) fields stay empty.
struct GenerationDefaults {
  std::optional<bool> do_sample;             // false: greedy
  std::optional<float> temperature;          // >= 0
  std::optional<int> top_k;                  // >= 0 (0 = off)
  std::optional<float> top_p;                // (0, 1]
  std::optional<float> min_p;                // [0, 1]
  std::optional<float> repetition_penalty;   // > 0 (1 = off)
};

// Reads <dir>/generation_config.json; all fields empty when there is none.
GenerationDefaults load_generation_defaults(const std::string& dir);

}  // namespace kestrel
