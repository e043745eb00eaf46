// Device memory with one owner: the allocations of a model or a session, freed together, and
// the bump arena the weights are placed in.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kestrel {

// "<n> MiB", for messages about device memory.
std::string mib(size_t bytes);

// Allocations freed together, when their owner ends (or free_all). Where cudaMalloc fails:
// one DeviceError, "out of GPU memory: <bytes> more needed<for_what>, <free> free of <total>
// (<CUDA's reason>)<hint>", and nothing is leaked.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { free_all(); }

  void* alloc(size_t bytes, const std::string& for_what = "", const std::string& hint = "");
  template <class T>
  T* alloc_n(size_t n, const std::string& for_what = "", const std::string& hint = "") {
    return static_cast<T*>(alloc(n * sizeof(T), for_what, hint));
  }
  bool empty() const { return owned_.empty(); }
  // The caller has made sure no work in flight still uses them.
  void free_all();

 private:
  std::vector<void*> owned_;
};

// One allocation sized before the weights are loaded (cudaMalloc rounds every allocation up to
// 2 MiB pages, which thousands of small tensors would waste), handed out in 256-byte aligned
// pieces.
class DeviceArena {
 public:
  void reserve(DeviceMemory& mem, size_t bytes);
  // The next piece. Running past the size is a bug of the bound it was sized by, not the
  // user's: an internal Error.
  void* take(size_t bytes);
  // Where the next piece starts and how much is left (for writers that place their own
  // pieces, such as cuda::gemv_prepare, followed by take() of what they used).
  char* next() const { return base_ + used_; }
  size_t left() const { return size_ - used_; }

 private:
  char* base_ = nullptr;
  size_t size_ = 0, used_ = 0;
};

size_t align256(size_t n);

}  // namespace kestrel
