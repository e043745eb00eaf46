// Asynchronous 16-byte copies from global to shared memory (sm_80+), bypassing L1 (.cg).
// Device code only: include from .cu files.
#pragma once

#include <cstdint>

namespace kestrel::cuda {

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
// Starts copying 16 bytes from src (global, 16-byte aligned) to dst (shared, 16-byte aligned).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// Waits for every copy this thread started (a barrier must follow before others read them).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

}  // namespace kestrel::cuda
