// The 4-bit GEMV kernels specialized per group size, act-order, fused ops and block size
// (gemv_kernel.cuh), in a translation unit of their own so that the build compiles each bit
// width's 120 kernels (80 and, for rows of at most 16 units, 40 half-warp ones) in parallel.
#include "kernels/gemv/gemv_kernel.cuh"

namespace kestrel::cuda::gemv_detail {

QuantKernel spec_kernel_4bit(int gs, int spec, int warps, bool half) {
  return spec_kernel_for_bits<4>(gs, spec, warps, half);
}

}  // namespace kestrel::cuda::gemv_detail
