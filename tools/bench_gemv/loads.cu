// Loads-only kernels in the quantized GEMV's access pattern, for kestrel-bench-gemv --loads:
// what the weight stream alone achieves as a function of how many row steps each warp keeps in
// flight (DEPTH) and of which rows each warp reads (equal runs, as the GEMV, or row pairs dealt
// round-robin so that at each step the whole grid reads one contiguous region).
//
// Layout: a row is `units` units of four 16-byte pieces, piece j of unit u at uint4 offset
// j * units + u of the row, so that lane l's piece j is contiguous with lane l + 1's (512 bytes
// per warp load), as in the GEMV's layout. (gemv_prepare also groups the pieces per 32 units,
// gemv_layout.h chunk_index; the two agree for rows of up to 32 units, and both read 512
// contiguous bytes per warp load.) Each warp step loads one unit group (32 units) of two rows;
// lanes past the row's units idle, as in the GEMV.
#include "tools/bench_gemv/loads.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemv/weight_decode.cuh"

namespace kestrel::bench {
namespace {

constexpr int kWarps = 16;

using cuda::ld_stream;  // the GEMV's own weight load (kernels/common/cp_async.cuh)

template <int DEPTH, bool ROUND_ROBIN>
__global__ void __launch_bounds__(32 * kWarps, 1)
    loads_kernel(const uint4* __restrict__ w, int64_t rows, int units,
                 uint32_t* __restrict__ sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t W = int64_t(gridDim.x) * kWarps, wg = int64_t(blockIdx.x) * kWarps + warp;
  const int64_t pairs = (rows + 1) / 2;
  const int iters = (units + 31) / 32;
  // The warp's row pairs: [p0, p1) (equal runs) or wg, wg + W, ... (round-robin).
  const int64_t p0 = ROUND_ROBIN ? wg : pairs * wg / W;
  const int64_t np = ROUND_ROBIN ? (pairs > wg ? (pairs - wg + W - 1) / W : 0)
                                 : pairs * (wg + 1) / W - p0;
  const int64_t steps = np * iters;
  const uint64_t pol = cuda::evict_first_policy();
  auto load = [&](uint4 (&q)[2][4], int64_t s) {
    const int64_t p = ROUND_ROBIN ? p0 + (s / iters) * W : p0 + s / iters;
    const int u = int(s % iters) * 32 + lane;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = 2 * p + r;
      if (u < units && row < rows) {
        const uint4* base = w + row * 4 * units + u;
#pragma unroll
        for (int j = 0; j < 4; ++j) q[r][j] = ld_stream(base + j * units, pol);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) q[r][j] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  uint4 ring[DEPTH][2][4];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (d < steps) load(ring[d], d);
  // As the GEMV: the first loads before the wait on the previous kernel.
  cuda::pdl_wait_then_release();
  uint32_t acc = 0;
  for (int64_t s0 = 0; s0 < steps; s0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int64_t s = s0 + d;
      if (s < steps) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint4 v = ring[d][r][j];
            acc ^= v.x + v.y * 3u + v.z * 5u + v.w * 7u;
          }
        if (s + DEPTH < steps) load(ring[d], s + DEPTH);
      }
    }
  }
  // One word per warp, so that nothing above is dead code.
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xFFFFFFFFu, acc, o);
  if (lane == 0) sink[wg] = acc;
}

template <int DEPTH>
void launch_depth(const void* w, int64_t rows, int units, bool round_robin, uint32_t* sink,
                  int grid, cudaStream_t s) {
  const uint4* q = static_cast<const uint4*>(w);
  if (round_robin)
    cuda::launch_pdl(loads_kernel<DEPTH, true>, grid, 32 * kWarps, 0, s, q, rows, units, sink);
  else
    cuda::launch_pdl(loads_kernel<DEPTH, false>, grid, 32 * kWarps, 0, s, q, rows, units, sink);
}

}  // namespace

int loads_grid() { return cuda::current_device_info().sm_count; }

size_t loads_sink_words() { return size_t(loads_grid()) * kWarps; }

void launch_loads(const void* w, int64_t rows, int row_bytes, int depth, bool round_robin,
                  uint32_t* sink, cudaStream_t s) {
  if (row_bytes <= 0 || row_bytes % 64 != 0)
    throw std::invalid_argument("launch_loads: row_bytes must be a positive multiple of 64, got " +
                                std::to_string(row_bytes));
  const int units = row_bytes / 64, grid = loads_grid();
  switch (depth) {
    case 1: return launch_depth<1>(w, rows, units, round_robin, sink, grid, s);
    case 2: return launch_depth<2>(w, rows, units, round_robin, sink, grid, s);
    case 3: return launch_depth<3>(w, rows, units, round_robin, sink, grid, s);
    default:
      throw std::invalid_argument("launch_loads: depth must be 1 to 3 (4 spills), got " +
                                  std::to_string(depth));
  }
}

}  // namespace kestrel::bench
