// Asynchronous copies from global to shared memory: 16 bytes per thread (cp.async, sm_80+,
// bypassing L1), and bulk copies on an mbarrier (sm_90).
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

// Whether this device code has the bulk copies (sm_90 on); below it the helpers are empty and
// callers take their plain-load path.
__device__ __forceinline__ constexpr bool has_bulk_copy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return true;
#else
  return false;
#endif
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KESTREL_BULK(...) __VA_ARGS__
#else
#define KESTREL_BULK(...)
#endif

// One bulk copy (the TMA unit, sm_90) of `bytes` (a multiple of 16; both addresses 16-byte
// aligned) from global to shared memory, completing on an mbarrier. Unlike ld.global or
// cp.async it does not take the SM's load/store path, so it does not queue behind the loads of
// the threads already in flight there (docs/gemv-notes.md: staging x after the wait on the
// previous kernel).
//   thread 0: mbar_init(bar, 1); fence_mbar_init();   then a barrier, then
//   thread 0: bulk_copy_g2s(dst, src, bytes, bar);     every reader: mbar_wait(bar, 0)
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  KESTREL_BULK(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)),
                            "r"(arrivals)
                            : "memory"));
}
// Makes an initialised mbarrier visible to the bulk-copy unit (a thread barrier must follow).
__device__ __forceinline__ void fence_mbar_init() {
  KESTREL_BULK(asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"));
}
// The copy alone: its bytes count against the mbarrier's expected transaction count.
__device__ __forceinline__ void bulk_copy_issue(void* dst, const void* src, uint32_t bytes,
                                                uint64_t* bar) {
  KESTREL_BULK(asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory"));
}
// Arrives on the mbarrier expecting `bytes`, then copies them.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
  KESTREL_BULK(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                                smem_u32(bar)),
                            "r"(bytes)
                            : "memory"));
  bulk_copy_issue(dst, src, bytes, bar);
}
// The same without arriving: the phase also waits for these bytes (a copy issued before the
// one whose bulk_copy_g2s arrives).
__device__ __forceinline__ void bulk_copy_g2s_no_arrive(void* dst, const void* src,
                                                        uint32_t bytes, uint64_t* bar) {
  KESTREL_BULK(asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)),
                            "r"(bytes)
                            : "memory"));
  bulk_copy_issue(dst, src, bytes, bar);
}
// L2 policy for what a decode step reads once (the GEMVs' weights, the KV cache): first to
// leave L2, so that it does not evict the activations and small tensors the next kernels read
// again. sm_80 on, as the cache hints below. Made once per thread, passed to every load.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// cp_async16 and a 16-byte read-only load with an L2 policy.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst),
               "l"(src), "l"(policy)
               : "memory");
}
__device__ __forceinline__ uint4 ldg16(const void* p, uint64_t policy) {
  uint4 r;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(policy));
  return r;
}
// Streaming weight load: not kept in L1, evict-first in L2. Not volatile, so that the compiler
// may issue a buffer's loads as early as their addresses allow.
__device__ __forceinline__ uint4 ld_stream(const uint4* p, uint64_t pol) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "l"(pol));
  return r;
}
// Waits until the mbarrier's phase `parity` has completed (the bulk copy landed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  KESTREL_BULK(asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory"));
}

}  // namespace kestrel::cuda
