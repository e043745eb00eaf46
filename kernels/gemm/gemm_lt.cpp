// cuBLASLt GEMMs in the engine's row-major convention, and the many-row linear launchers.
//
// Row-major y [M, N] = x [M, K] W [N, K]^T, read column-major, is D = op(A) B: A = W seen as a
// K x N column-major matrix (ld K), transposed; B = x seen as K x M (ld K); D = y as N x M
// (ld N). The residual enters as C with beta = 1 (cuBLASLt allows C == D, in place).
#include <cublasLt.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm.h"

namespace kestrel::cuda {

namespace {

// The largest power of two (up to 256) dividing the address: cuBLASLt picks algorithms by it.
int alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 2 && a % al != 0) al /= 2;
  return al;
}

}  // namespace

struct GemmRunner::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

GemmRunner::GemmRunner(GemmMemory mem) : mem_(mem) {
  cublasLtHandle_t h = nullptr;
  KESTREL_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (mem_.workspace_bytes > 0) {
    const cudaError_t err = cudaMalloc(&workspace_, mem_.workspace_bytes);
    if (err != cudaSuccess) {
      cublasLtDestroy(h);
      throw_cuda_error(err, "cudaMalloc(cuBLASLt workspace)", __FILE__, __LINE__);
    }
  }
}

GemmRunner::~GemmRunner() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

void GemmRunner::run(const void* x, const void* W, int64_t M, int64_t N, int64_t K, void* y,
                     const void* residual, bool f32_out, cudaStream_t s, int64_t ldy) {
  if (M <= 0 || N <= 0 || K <= 0)
    throw Error("gemm: empty shape M=" + std::to_string(M) + " N=" + std::to_string(N) +
                " K=" + std::to_string(K));
  if (ldy == 0) ldy = N;
  if (ldy < N)
    throw Error("gemm: ldy=" + std::to_string(ldy) + " is less than N=" + std::to_string(N));
  const void* c_ptr = residual ? residual : y;
  const auto key = std::make_tuple(M, N, K, ldy, (int)f32_out, alignment_of(W), alignment_of(x),
                                   std::min(alignment_of(y), alignment_of(c_ptr)));
  std::shared_ptr<Plan> plan;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) plan = it->second;
  }
  if (!plan) {
    plan = std::make_shared<Plan>();
    const cudaDataType_t out_t = f32_out ? CUDA_R_32F : CUDA_R_16F;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16F, K, N, K));
    KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16F, K, M, K));
    KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, out_t, N, M, ldy));

    cublasLtMatmulPreference_t pref = nullptr;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = mem_.workspace_bytes;
    const uint32_t al_a = std::get<5>(key), al_b = std::get<6>(key), al_c = std::get<7>(key);
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->op, plan->a,
                                          plan->b, plan->c, plan->c, pref, 1, &result, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    KESTREL_CUBLAS_CHECK(st);
    if (returned == 0)
      throw DeviceError("gemm: cuBLASLt has no algorithm for M=" + std::to_string(M) + " N=" +
                        std::to_string(N) + " K=" + std::to_string(K));
    plan->algo = result.algo;
    std::lock_guard<std::mutex> lock(mu_);
    plans_[key] = plan;
  }
  const float alpha = 1.0f, beta = residual ? 1.0f : 0.0f;
  KESTREL_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan->op, &alpha, W,
                                      plan->a, x, plan->b, &beta, c_ptr, plan->c, y, plan->c,
                                      &plan->algo, workspace_, mem_.workspace_bytes, s));
}

void GemmRunner::gemm(const __half* x, const __half* W, int64_t M, int64_t N, int64_t K, __half* y,
                      const __half* residual, cudaStream_t s, int64_t ldy) {
  run(x, W, M, N, K, y, residual, false, s, ldy);
}

void GemmRunner::gemm_f32(const __half* x, const __half* W, int64_t M, int64_t N, int64_t K,
                          float* y, cudaStream_t s) {
  run(x, W, M, N, K, y, nullptr, true, s, 0);
}

int64_t dequant_slice_rows(const GemvWeight& w, size_t slice_halves) {
  const int64_t per_k = (int64_t)(slice_halves / std::max<int64_t>(w.K, 1));
  const int64_t rows = std::max<int64_t>(128, per_k / 128 * 128);
  return std::min(rows, w.N);
}

namespace {
// The dequantized slice, rounded up to 128 halves so that the gathered input after it stays
// aligned.
size_t slice_elems(const GemvWeight& w, size_t slice_halves) {
  return ((size_t)dequant_slice_rows(w, slice_halves) * w.K + 127) / 128 * 128;
}
}  // namespace

size_t quant_gemm_scratch_elems(const GemvWeight& w, int64_t max_rows, size_t slice_halves) {
  return slice_elems(w, slice_halves) + (w.has_perm ? (size_t)max_rows * w.K : 0);
}

void quant_gemm(GemmRunner& r, const GemvWeight& w, const __half* x, int64_t M, __half* y,
                const __half* residual, __half* scratch, cudaStream_t s, int64_t ldy) {
  if (ldy == 0) ldy = w.N;
  __half* Wd = scratch;
  const __half* xin = x;
  if (w.has_perm) {
    __half* xg = scratch + slice_elems(w, r.memory().slice_halves);
    gather_columns_f16(x, w.perm, M, w.K, xg, s);
    xin = xg;
  }
  // Output rows [n0, n0 + n) of W at a time: the slice's codes, scales and zero points are rows
  // n0.. of the weight's arrays, and its GEMM writes columns n0.. of y (row stride ldy).
  const int64_t step = dequant_slice_rows(w, r.memory().slice_halves);
  for (int64_t n0 = 0; n0 < w.N; n0 += step) {
    GemvWeight slice = w;
    slice.N = std::min(step, w.N - n0);
    slice.codes = w.codes + n0 * w.planes * w.chunks;
    slice.scales = w.scales + n0 * w.groups;
    if (w.zeros) slice.zeros = w.zeros + n0 * w.groups;
    dequantize_f16(slice, Wd, slice_elems(w, r.memory().slice_halves), s);
    r.gemm(xin, Wd, M, slice.N, w.K, y + n0, residual ? residual + n0 : nullptr, s, ldy);
  }
}

void quant_linear_rows(GemmRunner& r, const GemvWeight& w, const __half* x, int64_t M, __half* y,
                       const __half* residual, __half* scratch, cudaStream_t s, int64_t ldy,
                       int min_gemm_rows) {
  if (ldy == 0) ldy = w.N;
  if (M >= min_gemm_rows) {
    quant_gemm(r, w, x, M, y, residual, scratch, s, ldy);
    return;
  }
  for (int64_t m = 0; m < M; ++m)
    gemv(w, x + m * w.K, y + m * ldy, residual ? residual + m * ldy : nullptr, s);
}

void dense_linear_rows(GemmRunner& r, const __half* W, int64_t N, int64_t K, const __half* x,
                       int64_t M, __half* y, const __half* residual, cudaStream_t s, int64_t ldy,
                       int min_gemm_rows) {
  if (ldy == 0) ldy = N;
  if (M >= min_gemm_rows) {
    r.gemm(x, W, M, N, K, y, residual, s, ldy);
    return;
  }
  for (int64_t m = 0; m < M; ++m)
    gemv_f16(W, x + m * K, y + m * ldy, N, K, residual ? residual + m * ldy : nullptr, s);
}

}  // namespace kestrel::cuda
