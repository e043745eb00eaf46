// The tests' one answer to "is there a usable GPU": kestrel::cuda_status(), asked once.
// KESTREL_REQUIRE_GPU() skips the current test, with the reason, where there is none; every
// test that calls it carries the ctest label `gpu` (tests/CMakeLists.txt).
#pragma once

#include <gtest/gtest.h>

#include "base/device.h"

namespace kestrel::test {

inline const CudaStatus& gpu() {
  static const CudaStatus s = cuda_status();
  return s;
}

}  // namespace kestrel::test

#define KESTREL_REQUIRE_GPU()                                         \
  do {                                                                \
    if (!::kestrel::test::gpu().usable)                               \
      GTEST_SKIP() << "no usable CUDA GPU: " << ::kestrel::test::gpu().problem; \
  } while (0)
