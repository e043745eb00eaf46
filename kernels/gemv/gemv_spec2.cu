// The 2-bit GEMV kernels specialized per group size, act-order, fused ops and block size
// (gemv_kernel.cuh), in a translation unit of their own so that the build compiles each bit
// width's kernels in parallel: 96, and 48 half-warp ones for rows of at most 16 units (K <= 4096:
// at 2 bits a unit is 256 codes, so a 7B's rows of 4096 would leave lanes 16-31 of every warp
// idle in the whole-warp kernels). No warp-pair ones: rows of 33-64 units (K of 8193 .. 16384)
// that also leave the grid room for pairs are rare at this width.
#include "kernels/gemv/gemv_kernel.cuh"

namespace kestrel::cuda::gemv_detail {

QuantKernel spec_kernel_2bit(int gs, int spec, int warps, RowSplit split) {
  return spec_kernel_for_bits<2>(gs, spec, warps, split);
}

}  // namespace kestrel::cuda::gemv_detail
