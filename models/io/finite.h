// The NaN/Inf check of a checkpoint's float tensors at load: one non-finite weight, norm or
// GPTQ scale turns every logit after it into NaN, so such a checkpoint is refused before any
// work starts, naming the tensor and the element.
#pragma once

#include <cstdint>
#include <vector>

#include "models/io/safetensors.h"

namespace kestrel {

// The flat index of the first NaN or Inf of an F16, BF16 or F32 tensor; -1 when all are finite
// (and for I32 tensors).
int64_t first_non_finite(const TensorInfo& t);

// Checks every tensor of `tensors` (I32 ones are skipped), split over threads; throws
// kestrel::Error naming the first non-finite element of the first tensor in list order that
// holds one: "<name> in <file>: element 37 ([0, 37]) is NaN; ...".
void check_finite(const std::vector<const TensorInfo*>& tensors);

}  // namespace kestrel
