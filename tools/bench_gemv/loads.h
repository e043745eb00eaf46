// Loads-only kernels in the quantized GEMV's access pattern (loads.cu), for kestrel-bench-gemv
// --loads.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::bench {

// Blocks the loads kernels run (one of 16 warps per SM), and the words of their sink (one per
// warp).
int loads_grid();
size_t loads_sink_words();

// Streams rows x row_bytes of weights at w (row_bytes a multiple of 64: four 16-byte pieces per
// unit), each warp keeping `depth` row steps in flight (1-3; at 3 the loads hold 96 registers),
// its rows in equal runs or dealt round-robin by pairs; launched with programmatic dependent
// launch on s.
void launch_loads(const void* w, int64_t rows, int row_bytes, int depth, bool round_robin,
                  uint32_t* sink, cudaStream_t s);

}  // namespace kestrel::bench
