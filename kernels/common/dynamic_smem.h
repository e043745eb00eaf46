// Opting a kernel in to more dynamic shared memory than a block may use by default (48 KB less
// the kernel's static shared memory). The limit is an attribute of the function on each device
// (cudaFuncAttributeMaxDynamicSharedMemorySize): a launcher must raise it on every device it
// launches on, and launchers run on several host threads at once (one per device, or requests
// side by side). One helper does it for every kernel family, with one record per (device,
// kernel) behind a mutex, so that after the first launch a call is a lookup.
// Host code; includable from plain C++ (only the CUDA runtime header).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace kestrel::cuda {

// The most dynamic shared memory a block of `kernel` may use on the current device: the
// device's opt-in limit less the kernel's static shared memory (asking for the whole opt-in
// limit is an invalid value when the kernel has any). Cached per (device, kernel).
size_t max_dynamic_smem(const void* kernel);

// Lets blocks of `kernel` launch with `bytes` of dynamic shared memory on the current device.
// Where that is more than the default, raises the kernel's limit once per (device, kernel) to
// max_dynamic_smem, so that any later size up to it is a lookup. Thread-safe; CUDA errors throw
// DeviceError (KESTREL_CUDA_CHECK). Throws kestrel::Error when bytes exceed max_dynamic_smem:
// "<who>: a block needs <bytes> bytes of dynamic shared memory, device <d> allows <max>".
void ensure_dynamic_smem(const void* kernel, size_t bytes, const char* who = "a kernel");

// The same for a kernel named by its function pointer.
template <typename... Args>
size_t max_dynamic_smem(void (*kernel)(Args...)) {
  return max_dynamic_smem(reinterpret_cast<const void*>(kernel));
}
template <typename... Args>
void ensure_dynamic_smem(void (*kernel)(Args...), size_t bytes, const char* who = "a kernel") {
  ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes, who);
}

}  // namespace kestrel::cuda
