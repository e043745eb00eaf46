// Eight consecutive halves, moved as one 16-byte load or store and read as four half2.
// Device code only: include from .cu files.
#pragma once

#include <cuda_fp16.h>
#include <cstdint>

namespace kestrel::cuda {

union Half8 {
  uint4 raw;
  __half2 h2[4];
};

}  // namespace kestrel::cuda
