// Programmatic dependent launch (Hopper): a kernel launched with the attribute may be
// scheduled while the previous kernel in the stream is still draining, which hides its launch
// latency; it must execute griddepcontrol.wait before touching anything the previous kernel
// writes (the wait returns once that grid has completed and its writes are visible). In a
// batch-1 decode step of ~250 small kernels the launch gaps are a large part of the step.
// Device code only: include from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/common/cuda_utils.h"

namespace kestrel::cuda {

// Waits for the previous grid in the stream (no-op when not launched with the attribute or
// below sm_90), then lets the next grid be scheduled early.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization
// allowed when `pdl` (a caller that measures with and without passes its choice), and the
// launch checked.
template <typename... KArgs, typename... Args>
void launch_maybe_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  launch_maybe_pdl(kernel, grid, block, smem, stream, true, std::forward<Args>(args)...);
}

}  // namespace kestrel::cuda
