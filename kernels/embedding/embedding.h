// Token embedding lookup.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace kestrel {

// out [hidden] = table[token] ; table [vocab, hidden] of fp16 bits.
void embedding_f16_ref(const uint16_t* table, int64_t hidden, int32_t token, float* out);

}  // namespace kestrel
