// A quantized weight that only looks prepared, for the argument checks of the CUDA entry points
// that run before any CUDA call (so those tests need no GPU).
#pragma once

#include "kernels/gemv/gemv.h"

namespace kestrel::test {

// A 4-bit g128 weight [256, 512] as gemv_prepare describes one (its 16 chunks of 32 codes a
// row, 8 groups); the device pointer is a static buffer no check dereferences.
inline cuda::GemvWeight fake_gemv_weight() {
  static char storage[16];
  cuda::GemvWeight w;
  w.bits = 4;
  w.group_size = 128;
  w.N = 256;
  w.K = 512;
  w.planes = 1;
  w.chunks = 16;
  w.groups = 8;
  w.device = storage;
  return w;
}

}  // namespace kestrel::test
