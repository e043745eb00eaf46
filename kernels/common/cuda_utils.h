// CUDA helpers shared by the kernel families: the check macros, an owning device buffer and
// cached device properties. Includable from plain C++ (only cuda_runtime.h).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "base/error.h"

namespace kestrel::cuda {

// Builds the one-line message "CUDA error <name> (<text>) in `<stmt>` at <file>:<line>, device <d>"
// and throws it as a DeviceError: a failing CUDA call means the GPU is not usable as asked.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* stmt, const char* file,
                                          int line) {
  int dev = -1;
  cudaGetDevice(&dev);  // best effort: the message is still useful without it
  throw DeviceError(std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ") in `" + stmt + "` at " + file + ":" +
                    std::to_string(line) + ", device " + std::to_string(dev));
}

// cuBLAS status names by value, so that this header does not pull in cublas_v2.h (and every
// user of the macros below does not have to link cuBLAS).
inline const char* cublas_status_name(int status) {
  switch (status) {
    case 0: return "CUBLAS_STATUS_SUCCESS";
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 11: return "CUBLAS_STATUS_MAPPING_ERROR";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case 16: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

[[noreturn]] inline void throw_cublas_error(int status, const char* stmt, const char* file,
                                            int line) {
  int dev = -1;
  cudaGetDevice(&dev);
  throw DeviceError(std::string("cuBLAS error ") + cublas_status_name(status) + " (" +
                    std::to_string(status) + ") in `" + stmt + "` at " + file + ":" +
                    std::to_string(line) + ", device " + std::to_string(dev));
}

}  // namespace kestrel::cuda

// KESTREL_CUDA_CHECK(cudaMalloc(&p, n)): throws kestrel::DeviceError naming the statement,
// file, line and device when the call does not return cudaSuccess.
#define KESTREL_CUDA_CHECK(stmt)                                                     \
  do {                                                                               \
    const cudaError_t kestrel_err_ = (stmt);                                         \
    if (kestrel_err_ != cudaSuccess)                                                 \
      ::kestrel::cuda::throw_cuda_error(kestrel_err_, #stmt, __FILE__, __LINE__);    \
  } while (0)

// After a kernel launch: catches bad launch configurations (and sticky earlier faults).
#define KESTREL_CUDA_CHECK_LAUNCH() KESTREL_CUDA_CHECK(cudaGetLastError())

// KESTREL_CUBLAS_CHECK(cublasGemmEx(...)): the same for cuBLAS / cuBLASLt status codes.
#define KESTREL_CUBLAS_CHECK(stmt)                                                        \
  do {                                                                                    \
    const int kestrel_st_ = static_cast<int>(stmt);                                       \
    if (kestrel_st_ != 0)                                                                 \
      ::kestrel::cuda::throw_cublas_error(kestrel_st_, #stmt, __FILE__, __LINE__);        \
  } while (0)

namespace kestrel::cuda {

// One owning device allocation. Move-only; frees on destruction (errors there are ignored:
// a destructor must not throw, and a failed free at teardown changes nothing for the caller).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) KESTREL_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  // Gives up ownership (the caller frees with cudaFree).
  void* release() {
    bytes_ = 0;
    return std::exchange(ptr_, nullptr);
  }

  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Properties of a device that launchers size their grids by, read once per device.
struct DeviceInfo {
  int id = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  size_t l2_bytes = 0;
  size_t smem_per_block_optin = 0;  // dynamic shared memory a block may opt in to
  size_t global_mem = 0;
  std::string name;
};

// The current device's properties (cached per device; thread-safe). Throws DeviceError when
// there is no usable device.
inline const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static std::array<std::unique_ptr<DeviceInfo>, kMaxDevices> cache;
  int dev = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices)
    throw DeviceError("device " + std::to_string(dev) + " is beyond the " +
                      std::to_string(kMaxDevices) + " devices Kestrel tracks");
  std::lock_guard<std::mutex> lock(mu);
  if (!cache[dev]) {
    cudaDeviceProp p{};
    KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
    auto info = std::make_unique<DeviceInfo>();
    info->id = dev;
    info->sm_count = p.multiProcessorCount;
    info->cc_major = p.major;
    info->cc_minor = p.minor;
    info->l2_bytes = static_cast<size_t>(p.l2CacheSize);
    info->smem_per_block_optin = p.sharedMemPerBlockOptin;
    info->global_mem = p.totalGlobalMem;
    info->name = p.name;
    cache[dev] = std::move(info);
  }
  return *cache[dev];
}

}  // namespace kestrel::cuda
