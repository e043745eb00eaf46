// The fused small-M GEMM kernels of 2-bit weights (gemm_small_kernel.cuh), compiled apart from
// the other bit widths so that the four compile in parallel.
#include "kernels/gemm/gemm_small_kernel.cuh"
#include "kernels/gemm/gemm_stream_kernel.cuh"

namespace kestrel::cuda::gemm_small_detail {

Kernel kernel_2bit(int gs, int nt) { return kernel_for<2>(gs, nt); }
Kernel stream_kernel_2bit(int gs, int nt) { return stream_kernel_for<2>(gs, nt); }

}  // namespace kestrel::cuda::gemm_small_detail
