// The 8-bit GEMV kernels specialized per group size, act-order, fused ops and block size
// (gemv_kernel.cuh), in a translation unit of their own so that the build compiles each bit
// width's 96 kernels in parallel.
#include "kernels/gemv/gemv_kernel.cuh"

namespace kestrel::cuda::gemv_detail {

QuantKernel spec_kernel_8bit(int gs, int spec, int warps, RowSplit split) {
  return spec_kernel_for_bits<8>(gs, spec, warps, split);
}

}  // namespace kestrel::cuda::gemv_detail
