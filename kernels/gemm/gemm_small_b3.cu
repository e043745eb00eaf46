// The fused small-M GEMM kernels of 3-bit weights (gemm_small_kernel.cuh), compiled apart from
// the other bit widths so that the four compile in parallel.
#include "kernels/gemm/gemm_small_kernel.cuh"

namespace kestrel::cuda::gemm_small_detail {

Kernel kernel_3bit(int gs, int nt) { return kernel_for<3>(gs, nt); }

}  // namespace kestrel::cuda::gemm_small_detail
