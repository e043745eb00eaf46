// The fused small-M GEMM kernels of 8-bit weights (gemm_small_kernel.cuh), compiled apart from
// the other bit widths so that the four compile in parallel.
#include "kernels/gemm/gemm_small_kernel.cuh"

namespace kestrel::cuda::gemm_small_detail {

Kernel kernel_8bit(int gs, int nt) { return kernel_for<8>(gs, nt); }
// No streaming kernel at 8 bits yet: a stage of 512 codes is 8 units, 16 loads a lane, and two
// buffers of them do not fit the registers of two blocks an SM.
Kernel stream_kernel_8bit(int, int) { return nullptr; }

}  // namespace kestrel::cuda::gemm_small_detail
