// Host data to and from the kernel tests' device buffers: fp16 bits widened to float, and a
// vector uploaded into a DeviceBuffer of its own (at least 16 bytes, so an empty vector still
// gets a valid, aligned pointer).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "kernels/common/cuda_utils.h"

namespace kestrel::test {

inline std::vector<float> to_floats(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = half_to_float(h[i]);
  return f;
}

template <class T>
cuda::DeviceBuffer upload(const std::vector<T>& v) {
  cuda::DeviceBuffer b(std::max<size_t>(v.size() * sizeof(T), 16));
  KESTREL_CUDA_CHECK(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

}  // namespace kestrel::test
