// GPTQ and round-to-nearest of one linear layer on the GPU: the same algorithm, options and
// results as gptq.h (the CPU implementation is the oracle of everything here), with the
// dense steps on cuBLAS and cuSOLVER and the column loop as a CUDA kernel (gptq_kernels.cu).
//
//   Hessian      H = (2/n) sum x x^T: cublasGemmEx, fp16 inputs (the calibration forward's
//                activations, exactly), fp32 products and fp32 accumulation.
//   factor       dead inputs, act-order permutation, damping, then U, the upper Cholesky
//                factor of H^-1: cusolverDnSpotrf, cusolverDnSpotri, cusolverDnSpotrf (fp32).
//                Shared by the linears of one true-sequential group (they share H).
//   column loop  per lazy block of 128 columns: the group parameters that start in the block
//                (fitted on W as the block begins, as the reference), then one kernel that
//                runs the block's columns for every row (rows are independent: a warp per
//                row), then W[:, rest] -= Err U[block, rest] as one cuBLAS SGEMM.
//
// Results match gptq_quantize bit for bit wherever the inputs of a step match: the kernels do
// the CPU's float operations in the CPU's order (no contraction into FMAs). What differs is
// U (cuSOLVER's factorizations round differently from LAPACK's) and the lazy update's sum
// order, so a weight lying within rounding distance of a quantization boundary may land on
// the other side; GPTQ's rows are independent, so such a flip changes its own row only.
// With --mse, the range search sums the CPU's terms in the CPU's order, but a term's float
// power is the correctly rounded one where glibc's powf is at times one ulp off: a group whose
// shrunk ranges' sums tie to that precision may get the neighbouring shrink (RTN included).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/cuda_utils.h"
#include "tools/quantize/gptq.h"

namespace kestrel::quant {

// cuBLAS and cuSOLVER handles bound to one stream; every step below runs on it.
class GpuContext {
 public:
  explicit GpuContext(cudaStream_t stream);
  ~GpuContext();
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

  cudaStream_t stream() const { return stream_; }
  void* cublas() const { return cublas_; }      // cublasHandle_t
  void* cusolver() const { return cusolver_; }  // cusolverDnHandle_t

 private:
  cudaStream_t stream_;
  void* cublas_ = nullptr;
  void* cusolver_ = nullptr;
};

// cudaMalloc of `bytes`, or a DeviceError of one line: "out of GPU memory for <what>
// (<n> MiB; <free> MiB free of <total> MiB)".
cuda::DeviceBuffer gpu_alloc(size_t bytes, const std::string& what);

// The Hessian of one group of linears on the GPU, as quant::Hessian: fp32 [K, K] (both
// triangles), a running average so that it stays (2/n) sum x x^T as rows arrive.
class GpuHessian {
 public:
  GpuHessian(GpuContext& ctx, int64_t K);
  // x: device, fp16 [rows, K], ready in the context's stream order.
  void add(const __half* x, int64_t rows);
  const float* data() const { return h_.as<float>(); }  // device [K, K]
  int64_t K() const { return K_; }
  int64_t samples() const { return n_; }
  std::vector<float> matrix() const;  // host copy (synchronizes)

 private:
  GpuContext& ctx_;
  int64_t K_;
  int64_t n_ = 0;
  cuda::DeviceBuffer h_;
};

// The steps of GPTQ that depend on the Hessian alone: dead inputs (zero diagonal), the
// act-order permutation, damping, and U. `what` names the linear in errors (a Hessian that
// is not positive definite after damping is a kestrel::Error asking for more --damp).
class GpuGptqFactor {
 public:
  GpuGptqFactor(GpuContext& ctx, const float* H, int64_t K, const GptqOptions& o,
                const std::string& what);
  int64_t K() const { return K_; }
  const std::vector<int32_t>& perm() const { return perm_; }  // processing order -> column
  const int32_t* perm_device() const { return d_perm_.as<int32_t>(); }
  const uint8_t* dead_device() const { return d_dead_.as<uint8_t>(); }
  const float* U() const { return U_.as<float>(); }  // device [K, K], zero below the diagonal
  std::vector<float> U_host() const;                // host copy (synchronizes)

 private:
  int64_t K_;
  std::vector<int32_t> perm_;
  cuda::DeviceBuffer d_perm_, d_dead_, U_;
};

// What a quantization leaves besides the codes, scales, zeros and g_idx it returns.
struct GpuQuantOutputs {
  __half* dequant_f16 = nullptr;     // device [N, K]: the dequantized weight rounded to fp16
                                     // (may be the fp16 weight W was converted from)
  bool dequant_host = false;         // fill QuantizedLinear::dequant on the host
  bool codes_host = true;            // fill codes, scales and zeros (false: g_idx alone, for a
                                     // caller that keeps only the errors)
  const float* error_hessian = nullptr;  // device [K, K]: compute the errors below on it
  double rel_error = 0;              // out: relative_error(W, Q, H) when error_hessian is set
  double output_error = 0;           // out: output_error(W, Q, H) when error_hessian is set
};

// GPTQ of W (device, fp32 [N, K], left unchanged) with the factor of its group's Hessian.
QuantizedLinear gptq_quantize_cuda(GpuContext& ctx, const GpuGptqFactor& f, const float* W,
                                   int64_t N, int64_t K, const GptqOptions& o,
                                   const std::string& what, GpuQuantOutputs& out);

// Round-to-nearest of W (device, fp32 [N, K]) with rtn_quantize's groups and parameters.
QuantizedLinear rtn_quantize_cuda(GpuContext& ctx, const float* W, int64_t N, int64_t K,
                                  const GptqOptions& o, const std::string& what,
                                  GpuQuantOutputs& out);

// relative_error on the device: tr((W-Q) H (W-Q)^T) / tr(W H W^T), W, Q [N, K], H [K, K]
// all fp32 on the device; the traces summed in double.
double relative_error_cuda(GpuContext& ctx, const float* W, const float* Q, int64_t N,
                           int64_t K, const float* H);

// tr(W H W^T) on the device (output_error of W against zero): the energy of the linear's
// outputs on the inputs behind H. W [N, K], H [K, K] fp32 on the device.
double output_energy_cuda(GpuContext& ctx, const float* W, int64_t N, int64_t K, const float* H);

}  // namespace kestrel::quant
