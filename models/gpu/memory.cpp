#include "models/gpu/memory.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>

#include "base/error.h"

namespace kestrel {

std::string mib(size_t bytes) { return fmt::format("{:.0f} MiB", bytes / 1048576.0); }

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

void* DeviceMemory::alloc(size_t bytes, const std::string& for_what, const std::string& hint) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 16));
  if (err != cudaSuccess) {
    cudaGetLastError();  // out of memory is not sticky: clear it, the device stays usable
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw DeviceError(fmt::format("out of GPU memory: {} more needed{}, {} free of {} ({}){}",
                                  mib(bytes), for_what, mib(free_b), mib(total_b),
                                  cudaGetErrorString(err), hint));
  }
  owned_.push_back(p);
  return p;
}

void DeviceMemory::free_all() {
  for (void* p : owned_) cudaFree(p);
  owned_.clear();
}

void DeviceArena::reserve(DeviceMemory& mem, size_t bytes) {
  base_ = static_cast<char*>(mem.alloc(bytes));
  size_ = bytes;
  used_ = 0;
}

void* DeviceArena::take(size_t bytes) {
  const size_t n = align256(bytes);
  if (used_ + n > size_)
    throw Error(fmt::format("internal: the weights need more than the {} sized for them", mib(size_)));
  void* p = base_ + used_;
  used_ += n;
  return p;
}

}  // namespace kestrel
