// GPTQ of one linear on the GPU, step by step as gptq.cpp (docs/gptq-format.md, "The
// quantizer"), with cuBLAS for the Hessian, the lazy updates and the error traces, cuSOLVER
// for the Cholesky factorizations, and gptq_kernels.cu for the rest.
#include "tools/quantize/gptq_cuda.h"

#include <cublas_v2.h>
#include <cusolverDn.h>

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "base/error.h"
#include "tools/quantize/gptq_kernels.h"

namespace kestrel::quant {

namespace {

cublasHandle_t blas(const GpuContext& c) { return static_cast<cublasHandle_t>(c.cublas()); }
cusolverDnHandle_t solver(const GpuContext& c) {
  return static_cast<cusolverDnHandle_t>(c.cusolver());
}

void check_solver(cusolverStatus_t st, const char* stmt) {
  if (st != CUSOLVER_STATUS_SUCCESS)
    throw DeviceError(fmt::format("cuSOLVER error {} in `{}`", (int)st, stmt));
}
#define KESTREL_CUSOLVER_CHECK(stmt) check_solver((stmt), #stmt)

int64_t group_count(int64_t K, int group_size) {
  return group_size <= 0 ? 1 : (K + group_size - 1) / group_size;
}

template <class T>
cuda::DeviceBuffer upload(const std::vector<T>& v, const std::string& what, cudaStream_t s) {
  cuda::DeviceBuffer b = gpu_alloc(v.size() * sizeof(T), what);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(b.get(), v.data(), v.size() * sizeof(T),
                                     cudaMemcpyHostToDevice, s));
  return b;
}

// Upper Cholesky factor of A^-1 in place, A [K, K] symmetric positive definite on the device.
// cuSOLVER is column-major: the row-major upper factor U (U^T U = A^-1) is, read
// column-major, the lower factor L = U^T of A^-1 (L L^T = A^-1). So: A = L1 L1^T (potrf,
// lower), A^-1 from L1 (potri, lower triangle), A^-1 = L L^T (potrf, lower); then the
// stale other triangle (row-major below the diagonal) is zeroed.
void inverse_cholesky_upper_cuda(GpuContext& ctx, float* A, int64_t K, const std::string& what) {
  const int n = (int)K;
  int lwork_f = 0, lwork_i = 0;
  KESTREL_CUSOLVER_CHECK(cusolverDnSpotrf_bufferSize(solver(ctx), CUBLAS_FILL_MODE_LOWER, n, A, n, &lwork_f));
  KESTREL_CUSOLVER_CHECK(cusolverDnSpotri_bufferSize(solver(ctx), CUBLAS_FILL_MODE_LOWER, n, A, n, &lwork_i));
  const int lwork = std::max(lwork_f, lwork_i);
  cuda::DeviceBuffer work = gpu_alloc((size_t)lwork * sizeof(float) + sizeof(int),
                                      fmt::format("the Cholesky workspace of {}", what));
  int* info_d = reinterpret_cast<int*>(work.as<float>() + lwork);
  auto check_info = [&](const char* step) {
    int info = 0;
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(&info, info_d, sizeof(int), cudaMemcpyDeviceToHost, ctx.stream()));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    if (info > 0)
      throw Error(fmt::format("{}: the damped Hessian is not positive definite (leading minor {} "
                              "of {}); raise --damp",
                              what, info, K));
    if (info < 0) throw DeviceError(fmt::format("{}: {} failed with {}", what, step, info));
  };
  KESTREL_CUSOLVER_CHECK(cusolverDnSpotrf(solver(ctx), CUBLAS_FILL_MODE_LOWER, n, A, n, work.as<float>(), lwork, info_d));
  check_info("cusolverDnSpotrf");
  KESTREL_CUSOLVER_CHECK(cusolverDnSpotri(solver(ctx), CUBLAS_FILL_MODE_LOWER, n, A, n, work.as<float>(), lwork, info_d));
  check_info("cusolverDnSpotri");
  KESTREL_CUSOLVER_CHECK(cusolverDnSpotrf(solver(ctx), CUBLAS_FILL_MODE_LOWER, n, A, n, work.as<float>(), lwork, info_d));
  check_info("cusolverDnSpotrf");
  kern::zero_lower(A, K, ctx.stream());
}

// tr(A H A^T) for A [N, K], H [K, K] symmetric, on the device: sum of (A H) .* A in double.
// AH is a caller's [N, K] scratch.
double quadratic_trace(GpuContext& ctx, const float* A, int64_t N, int64_t K, const float* H,
                       float* AH, double* acc) {
  // Row-major AH [N, K] = A H is, column-major, AH^T = H A^T: (K x K) times (K x N).
  const float one = 1.0f, zero = 0.0f;
  KESTREL_CUBLAS_CHECK(cublasSgemm(blas(ctx), CUBLAS_OP_N, CUBLAS_OP_N, (int)K, (int)N, (int)K,
                                   &one, H, (int)K, A, (int)K, &zero, AH, (int)K));
  KESTREL_CUDA_CHECK(cudaMemsetAsync(acc, 0, sizeof(double), ctx.stream()));
  kern::dot_add(AH, A, N * K, acc, ctx.stream());
  double r = 0;
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(&r, acc, sizeof(double), cudaMemcpyDeviceToHost, ctx.stream()));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  return r;
}

// The common end of GPTQ and RTN: codes [N, K] in W's column order on the device, the groups'
// scales and zeros [G, N] on the device, g_idx on the host. Downloads the results and writes
// what `out` asks for.
QuantizedLinear finish(GpuContext& ctx, const float* W, int64_t N, int64_t K, const uint8_t* codes,
                       const float* scale, const float* zero, std::vector<int32_t> g_idx,
                       const GptqOptions& o, const std::string& what, GpuQuantOutputs& out) {
  cudaStream_t s = ctx.stream();
  const int64_t G = group_count(K, o.group_size);
  cuda::DeviceBuffer d_gidx = upload(g_idx, "g_idx", s);
  QuantizedLinear r;
  r.N = N;
  r.K = K;
  r.bits = o.bits;
  r.group_size = o.group_size;
  r.g_idx = std::move(g_idx);
  const bool want_error = out.error_hessian != nullptr;
  cuda::DeviceBuffer Q, D;
  if (out.dequant_host) Q = gpu_alloc((size_t)N * K * sizeof(float), fmt::format("the dequantized {}", what));
  if (want_error) D = gpu_alloc((size_t)N * K * sizeof(float), fmt::format("the quantization error of {}", what));
  if (Q.get() || D.get() || out.dequant_f16)
    kern::dequantize(codes, N, K, d_gidx.as<int32_t>(), scale, zero, W, Q.as<float>(),
                     D.as<float>(), out.dequant_f16, s);

  std::vector<float> zf;
  if (out.codes_host) {
    r.codes.resize((size_t)N * K);
    r.scales.resize((size_t)G * N);
    zf.resize((size_t)G * N);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(r.codes.data(), codes, r.codes.size(), cudaMemcpyDeviceToHost, s));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(r.scales.data(), scale, r.scales.size() * 4, cudaMemcpyDeviceToHost, s));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(zf.data(), zero, zf.size() * 4, cudaMemcpyDeviceToHost, s));
  }
  if (out.dequant_host) {
    r.dequant.resize((size_t)N * K);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(r.dequant.data(), Q.get(), r.dequant.size() * 4,
                                       cudaMemcpyDeviceToHost, s));
  }
  if (want_error) {
    cuda::DeviceBuffer AH = gpu_alloc((size_t)N * K * sizeof(float),
                                      fmt::format("the error trace scratch of {}", what));
    cuda::DeviceBuffer acc = gpu_alloc(sizeof(double), "the error trace sum");
    const double num = quadratic_trace(ctx, D.as<float>(), N, K, out.error_hessian, AH.as<float>(), acc.as<double>());
    const double den = quadratic_trace(ctx, W, N, K, out.error_hessian, AH.as<float>(), acc.as<double>());
    out.output_error = num;
    out.rel_error = den > 0.0 ? num / den : 0.0;
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  r.zeros.resize(zf.size());
  for (size_t i = 0; i < zf.size(); ++i) r.zeros[i] = (uint8_t)zf[i];
  return r;
}

// The scales and zero points [G, N] of one linear and the flag find_params raises when a
// group's range does not fit an fp16 scale, in one device allocation (the flag cleared).
struct GroupParams {
  cuda::DeviceBuffer buf;
  float* scale;
  float* zero;
  int* bad;

  GroupParams(int64_t G, int64_t N, cudaStream_t s, const std::string& what)
      : buf(gpu_alloc((size_t)2 * G * N * sizeof(float) + 16,
                      fmt::format("the scales and zeros of {}", what))),
        scale(buf.as<float>()),
        zero(scale + G * N),
        bad(reinterpret_cast<int*>(zero + G * N)) {
    KESTREL_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(int), s));
  }
  // Throws kestrel::Error naming `what` when the flag is raised (synchronises s).
  void check_bad(cudaStream_t s, const std::string& what) const {
    int b = 0;
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(&b, bad, sizeof(int), cudaMemcpyDeviceToHost, s));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    if (b)
      throw Error(fmt::format("{}: a group's weight range does not fit an fp16 scale (weights too "
                              "large, or not finite)",
                              what));
  }
};

}  // namespace

cuda::DeviceBuffer gpu_alloc(size_t bytes, const std::string& what) {
  try {
    return cuda::DeviceBuffer(std::max<size_t>(bytes, 16));
  } catch (const DeviceError& e) {
    cudaGetLastError();  // an allocation failure is not sticky: clear it and carry on
    // Only an allocation failure becomes the memory message; any other fault stays as it was.
    if (std::string(e.what()).find("cudaErrorMemoryAllocation") == std::string::npos) throw;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw DeviceError(fmt::format("out of GPU memory for {} ({:.0f} MiB; {:.0f} MiB free of {:.0f} MiB)",
                                  what, bytes / 1048576.0, free_b / 1048576.0,
                                  total_b / 1048576.0));
  }
}

GpuContext::GpuContext(cudaStream_t stream) : stream_(stream) {
  cublasHandle_t b = nullptr;
  KESTREL_CUBLAS_CHECK(cublasCreate(&b));
  cublas_ = b;
  KESTREL_CUBLAS_CHECK(cublasSetStream(b, stream));
  // fp32 products stay fp32: no TF32 shortcuts in the lazy updates or the traces.
  KESTREL_CUBLAS_CHECK(cublasSetMathMode(b, CUBLAS_DEFAULT_MATH));
  cusolverDnHandle_t sv = nullptr;
  KESTREL_CUSOLVER_CHECK(cusolverDnCreate(&sv));
  cusolver_ = sv;
  KESTREL_CUSOLVER_CHECK(cusolverDnSetStream(sv, stream));
}

GpuContext::~GpuContext() {
  if (cusolver_) cusolverDnDestroy(static_cast<cusolverDnHandle_t>(cusolver_));
  if (cublas_) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
}

// --- Hessian --------------------------------------------------------------------------------

GpuHessian::GpuHessian(GpuContext& ctx, int64_t K)
    : ctx_(ctx), K_(K), h_(gpu_alloc((size_t)K * K * sizeof(float), fmt::format("a Hessian [{0}, {0}] fp32", K))) {
  KESTREL_CUDA_CHECK(cudaMemsetAsync(h_.get(), 0, (size_t)K * K * sizeof(float), ctx.stream()));
}

void GpuHessian::add(const __half* x, int64_t rows) {
  if (rows <= 0) return;
  // H <- H * n/(n+rows) + (2/(n+rows)) x^T x, the running average of quant::Hessian. The
  // inputs are the forward's fp16 activations themselves; their products are exact in fp32 and
  // the tensor cores accumulate them in fp32 (CUBLAS_COMPUTE_32F). Row-major x [rows, K] is
  // column-major x^T [K, rows], so x^T x is (x^T)(x^T)^T: op N times op T.
  const int64_t total = n_ + rows;
  const float beta = (float)((double)n_ / (double)total);
  const float alpha = (float)(2.0 / (double)total);
  KESTREL_CUBLAS_CHECK(cublasGemmEx(blas(ctx_), CUBLAS_OP_N, CUBLAS_OP_T, (int)K_, (int)K_,
                                    (int)rows, &alpha, x, CUDA_R_16F, (int)K_, x, CUDA_R_16F,
                                    (int)K_, &beta, h_.get(), CUDA_R_32F, (int)K_,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  n_ = total;
}

std::vector<float> GpuHessian::matrix() const {
  std::vector<float> H((size_t)K_ * K_);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(H.data(), h_.get(), H.size() * 4, cudaMemcpyDeviceToHost, ctx_.stream()));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));
  return H;
}

// --- the factor -----------------------------------------------------------------------------

GpuGptqFactor::GpuGptqFactor(GpuContext& ctx, const float* H, int64_t K, const GptqOptions& o,
                             const std::string& what)
    : K_(K) {
  validate(o);
  cudaStream_t s = ctx.stream();
  // The diagonal decides dead inputs, the order and the damping: read it to the host.
  std::vector<float> diag(K);
  KESTREL_CUDA_CHECK(cudaMemcpy2DAsync(diag.data(), sizeof(float), H, (K + 1) * sizeof(float),
                                       sizeof(float), K, cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<uint8_t> dead(K, 0);
  for (int64_t i = 0; i < K; ++i)
    if (diag[i] == 0.0f) {
      dead[i] = 1;
      diag[i] = 1.0f;
    }
  perm_.resize(K);
  std::iota(perm_.begin(), perm_.end(), 0);
  if (o.act_order)
    std::stable_sort(perm_.begin(), perm_.end(),
                     [&](int32_t a, int32_t b) { return diag[a] > diag[b]; });
  double diag_sum = 0.0;  // in processing order, as gptq_quantize sums it
  for (int64_t i = 0; i < K; ++i) diag_sum += diag[perm_[i]];
  const float damp = o.damp * (float)(diag_sum / (double)K);

  d_perm_ = upload(perm_, "the act-order permutation", s);
  d_dead_ = upload(dead, "the dead-input mask", s);
  U_ = gpu_alloc((size_t)K * K * sizeof(float), fmt::format("the inverse Hessian factor of {}", what));
  kern::permute_damp_hessian(H, K, d_perm_.as<int32_t>(), damp, U_.as<float>(), s);
  inverse_cholesky_upper_cuda(ctx, U_.as<float>(), K, what);
}

std::vector<float> GpuGptqFactor::U_host() const {
  std::vector<float> U((size_t)K_ * K_);
  KESTREL_CUDA_CHECK(cudaMemcpy(U.data(), U_.get(), U.size() * 4, cudaMemcpyDeviceToHost));
  return U;
}

// --- GPTQ -----------------------------------------------------------------------------------

QuantizedLinear gptq_quantize_cuda(GpuContext& ctx, const GpuGptqFactor& f, const float* W,
                                   int64_t N, int64_t K, const GptqOptions& o,
                                   const std::string& what, GpuQuantOutputs& out) {
  validate(o);
  if (f.K() != K)
    throw Error(fmt::format("{}: {} input features, but the Hessian's factor is for {}", what, K, f.K()));
  if (o.block_size > kern::kMaxBlock)
    throw Error(fmt::format("block size {} is above the GPU column loop's {}", o.block_size, kern::kMaxBlock));
  cudaStream_t s = ctx.stream();
  const int gs = o.group_size;
  const int64_t G = group_count(K, gs);
  const size_t nk = (size_t)N * K;
  const GroupParams params(G, N, s, what);
  float* scale = params.scale;
  float* zero = params.zero;
  int* bad = params.bad;

  // Per-row parameters are read from W as given, before dead inputs are zeroed.
  if (gs == -1)
    kern::find_params(W, K, N, K, 0, K, 1, 0, o.bits, o.sym, o.mse, scale, zero, bad, s);
  // The working copy: dead inputs zeroed (their weights cannot matter), in W's column order.
  cuda::DeviceBuffer Wd = gpu_alloc(nk * sizeof(float), fmt::format("the working copy of {}", what));
  kern::gather_columns(W, N, K, nullptr, f.dead_device(), Wd.as<float>(), s);
  // Static groups: fixed up front from W by original column.
  if (gs != -1 && o.static_groups)
    kern::find_params(Wd.as<float>(), K, N, K, 0, gs, G, 0, o.bits, o.sym, o.mse, scale, zero,
                      bad, s);
  // Act-order: the columns in processing order.
  float* Wp = Wd.as<float>();
  cuda::DeviceBuffer Wperm;
  if (o.act_order) {
    Wperm = gpu_alloc(nk * sizeof(float), fmt::format("the permuted copy of {}", what));
    kern::gather_columns(Wd.as<float>(), N, K, f.perm_device(), nullptr, Wperm.as<float>(), s);
    Wp = Wperm.as<float>();
    Wd.reset();
  }

  // The group of each processing position, and g_idx (the group of each original column).
  const std::vector<int32_t>& perm = f.perm();
  std::vector<int32_t> gcol(K), g_idx(K);
  for (int64_t j = 0; j < K; ++j) {
    const int64_t k = perm[j];
    if (gs == -1)
      gcol[j] = 0;
    else if (o.static_groups)
      gcol[j] = (int32_t)(k / gs);
    else
      gcol[j] = (int32_t)(j / gs);  // groups formed in processing order
    g_idx[k] = gcol[j];
  }
  cuda::DeviceBuffer d_gcol = upload(gcol, "the column groups", s);

  const int64_t B = o.block_size;
  cuda::DeviceBuffer codes_p = gpu_alloc(nk, fmt::format("the codes of {}", what));
  cuda::DeviceBuffer E = gpu_alloc((size_t)N * B * sizeof(float), fmt::format("the block errors of {}", what));
  const bool dynamic = gs != -1 && !o.static_groups;
  for (int64_t i1 = 0; i1 < K; i1 += B) {
    const int64_t i2 = std::min(i1 + B, K), cnt = i2 - i1;
    if (dynamic) {
      // Groups that start in this block, fitted on W as it stands when the block begins:
      // updates made inside the block are not seen, exactly as in the reference.
      const int64_t g_first = (i1 + gs - 1) / gs, g_last = (i2 - 1) / gs;
      if (g_first <= g_last)
        kern::find_params(Wp, K, N, K, g_first * gs, gs, g_last - g_first + 1, g_first, o.bits,
                          o.sym, o.mse, scale, zero, bad, s);
    }
    kern::gptq_block(Wp, K, N, i1, (int)cnt, f.U(), K, d_gcol.as<int32_t>(), scale, zero, o.bits,
                     codes_p.as<uint8_t>(), E.as<float>(), s);
    // The block's errors reach every later column at once: W[:, i2:] -= E U[i1:i2, i2:].
    // Column-major, W[:, i2:] is (K - i2) x N (ld K), U[i1:i2, i2:] is its transpose
    // (K - i2) x cnt (ld K), E is cnt x N (ld cnt).
    if (i2 < K) {
      const float minus_one = -1.0f, one = 1.0f;
      KESTREL_CUBLAS_CHECK(cublasSgemm(blas(ctx), CUBLAS_OP_N, CUBLAS_OP_N, (int)(K - i2), (int)N,
                                       (int)cnt, &minus_one, f.U() + i1 * K + i2, (int)K,
                                       E.as<float>(), (int)cnt, &one, Wp + i2, (int)K));
    }
  }
  params.check_bad(s, what);
  Wperm.reset();
  Wd.reset();
  E.reset();

  cuda::DeviceBuffer codes_o;
  const uint8_t* codes = codes_p.as<uint8_t>();
  if (o.act_order) {
    codes_o = gpu_alloc(nk, fmt::format("the codes of {}", what));
    kern::scatter_codes(codes_p.as<uint8_t>(), N, K, f.perm_device(), codes_o.as<uint8_t>(), s);
    codes = codes_o.as<uint8_t>();
  }
  return finish(ctx, W, N, K, codes, scale, zero, std::move(g_idx), o, what, out);
}

QuantizedLinear rtn_quantize_cuda(GpuContext& ctx, const float* W, int64_t N, int64_t K,
                                  const GptqOptions& o, const std::string& what,
                                  GpuQuantOutputs& out) {
  validate(o);
  cudaStream_t s = ctx.stream();
  const int gs = o.group_size;
  const int64_t G = group_count(K, gs), width = gs == -1 ? K : gs;
  const GroupParams params(G, N, s, what);
  float* scale = params.scale;
  float* zero = params.zero;
  int* bad = params.bad;
  kern::find_params(W, K, N, K, 0, width, G, 0, o.bits, o.sym, o.mse, scale, zero, bad, s);
  params.check_bad(s, what);
  std::vector<int32_t> g_idx(K);
  for (int64_t k = 0; k < K; ++k) g_idx[k] = (int32_t)(k / width);
  cuda::DeviceBuffer d_gidx = upload(g_idx, "g_idx", s);
  cuda::DeviceBuffer codes = gpu_alloc((size_t)N * K, fmt::format("the codes of {}", what));
  kern::rtn_codes(W, N, K, d_gidx.as<int32_t>(), scale, zero, o.bits, codes.as<uint8_t>(), s);
  return finish(ctx, W, N, K, codes.as<uint8_t>(), scale, zero, std::move(g_idx), o, what, out);
}

double output_energy_cuda(GpuContext& ctx, const float* W, int64_t N, int64_t K, const float* H) {
  cuda::DeviceBuffer AH = gpu_alloc((size_t)N * K * sizeof(float), "the output energy scratch");
  cuda::DeviceBuffer acc = gpu_alloc(sizeof(double), "the output energy sum");
  return quadratic_trace(ctx, W, N, K, H, AH.as<float>(), acc.as<double>());
}

double relative_error_cuda(GpuContext& ctx, const float* W, const float* Q, int64_t N, int64_t K,
                           const float* H) {
  const size_t nk = (size_t)N * K;
  cuda::DeviceBuffer D = gpu_alloc(nk * sizeof(float), "the quantization error");
  cuda::DeviceBuffer AH = gpu_alloc(nk * sizeof(float), "the error trace scratch");
  cuda::DeviceBuffer acc = gpu_alloc(sizeof(double), "the error trace sum");
  // D = W - Q (cublasSgeam: alpha W + beta Q, one rounding per element).
  const float one = 1.0f, minus_one = -1.0f;
  KESTREL_CUBLAS_CHECK(cublasSgeam(blas(ctx), CUBLAS_OP_N, CUBLAS_OP_N, (int)K, (int)N, &one, W,
                                   (int)K, &minus_one, Q, (int)K, D.as<float>(), (int)K));
  const double num = quadratic_trace(ctx, D.as<float>(), N, K, H, AH.as<float>(), acc.as<double>());
  const double den = quadratic_trace(ctx, W, N, K, H, AH.as<float>(), acc.as<double>());
  return den > 0.0 ? num / den : 0.0;
}

}  // namespace kestrel::quant
