// Plain C++ embedding lookup: one fp16 row widened to fp32.
#include "kernels/embedding/embedding.h"

#include <string>

#include "base/error.h"

namespace kestrel {

void embedding_f16_ref(const uint16_t* table, int64_t hidden, int32_t token, float* out) {
  // The vocabulary size is not known here; the caller bounds the token from above.
  KESTREL_CHECK(token >= 0, "embedding_f16_ref: negative token id " + std::to_string(token));
  const uint16_t* row = table + (int64_t)token * hidden;
  for (int64_t i = 0; i < hidden; ++i) out[i] = half_to_float(row[i]);
}

}  // namespace kestrel
