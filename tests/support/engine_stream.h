// A CUDA stream as the engine uses one in the kernel tests: created and non-blocking, so that
// kernels launch there with programmatic dependent launch. Such a stream does not wait for the
// legacy stream, on which the tests' uploads copy and cudaMemset poisons (a pageable
// cudaMemcpy may return before its copy lands, and cudaMemset on device memory is
// asynchronous), so the device is synchronised before the stream is handed out.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/cuda_utils.h"

namespace kestrel::test {

struct EngineStream {
  cudaStream_t s = nullptr;
  EngineStream() {
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~EngineStream() { cudaStreamDestroy(s); }
  EngineStream(const EngineStream&) = delete;
  EngineStream& operator=(const EngineStream&) = delete;
};

}  // namespace kestrel::test
