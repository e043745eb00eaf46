// The 3-bit GEMV kernels specialized per group size, act-order, fused ops and block size
// (gemv_kernel.cuh), in a translation unit of their own so that the build compiles each bit
// width's 168 kernels (96; 48 half-warp ones for rows of at most 16 units; 24 warp-pair ones for
// rows of 33-64 units) in parallel.
#include "kernels/gemv/gemv_kernel.cuh"

namespace kestrel::cuda::gemv_detail {

QuantKernel spec_kernel_3bit(int gs, int spec, int warps, RowSplit split) {
  return spec_kernel_for_bits<3>(gs, spec, warps, split);
}

}  // namespace kestrel::cuda::gemv_detail
