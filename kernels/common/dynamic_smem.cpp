// The dynamic shared-memory opt-in of every kernel (dynamic_smem.h). Plain C++: the function
// attributes are set through the runtime API, by the kernel's host-side address.
#include "kernels/common/dynamic_smem.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"

namespace kestrel::cuda {
namespace {

// What one kernel may use on one device.
struct SmemLimits {
  size_t by_default = 0;  // without raising its limit: 48 KB less its static shared memory
  size_t max = 0;         // once raised: the opt-in limit less its static shared memory
  size_t allowed = 0;     // what a block may use now (by_default, or max once raised)
};

// Every (device, kernel) seen, behind one mutex (a function's statics: built on first use).
struct Registry {
  std::mutex mu;
  std::map<std::pair<int, const void*>, SmemLimits> limits;
};
Registry& registry() {
  static Registry r;
  return r;
}

// The record of `kernel` on device d, read from its attributes the first time; r.mu held.
SmemLimits& limits_of(Registry& r, const DeviceInfo& d, const void* kernel) {
  const auto key = std::make_pair(d.id, kernel);
  auto it = r.limits.find(key);
  if (it != r.limits.end()) return it->second;
  cudaFuncAttributes attr{};
  KESTREL_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  SmemLimits l;
  l.by_default = attr.sharedSizeBytes < 48 * 1024 ? 48 * 1024 - attr.sharedSizeBytes : 0;
  l.max = d.smem_per_block_optin > attr.sharedSizeBytes
              ? d.smem_per_block_optin - attr.sharedSizeBytes
              : 0;
  l.allowed = l.by_default;
  return r.limits.emplace(key, l).first->second;
}

}  // namespace

size_t max_dynamic_smem(const void* kernel) {
  const DeviceInfo& d = current_device_info();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return limits_of(r, d, kernel).max;
}

void ensure_dynamic_smem(const void* kernel, size_t bytes, const char* who) {
  const DeviceInfo& d = current_device_info();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  SmemLimits& l = limits_of(r, d, kernel);
  if (bytes <= l.allowed) return;
  if (bytes > l.max)
    throw Error(std::string(who) + ": a block needs " + std::to_string(bytes) +
                " bytes of dynamic shared memory, device " + std::to_string(d.id) + " allows " +
                std::to_string(l.max));
  KESTREL_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(l.max)));
  l.allowed = l.max;
}

}  // namespace kestrel::cuda
