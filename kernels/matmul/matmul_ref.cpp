// Plain C++ dense linears. Loop order: for each output n, one row of W is loaded (and
// converted from fp16 once) and dotted with every row of x, so W streams through the cache once.
#include "kernels/matmul/matmul.h"

#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "engine/base/dtype.h"

namespace kestrel {

namespace {

// y[m, n] = dot(x[m, :], w) + bias[n] for every m.
void dot_rows(const float* x, const float* w, const float* bias, int64_t M, int64_t N, int64_t K,
              int64_t n, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float acc = dot_ref(x + m * K, w, K);
    y[m * N + n] = bias ? acc + bias[n] : acc;
  }
}

}  // namespace

void set_linear_threads(int threads) {
#ifdef _OPENMP
  if (threads > 0) omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

int linear_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void matmul_ref(const float* x, const float* W, const float* bias, int64_t M, int64_t N,
                int64_t K, float* y) {
#pragma omp parallel for schedule(static) if (M * N * K >= kLinearParallelWork)
  for (int64_t n = 0; n < N; ++n) dot_rows(x, W + n * K, bias, M, N, K, n, y);
}

void matmul_f16w_ref(const float* x, const uint16_t* W, const float* bias, int64_t M, int64_t N,
                     int64_t K, float* y) {
#pragma omp parallel if (M * N * K >= kLinearParallelWork)
  {
    std::vector<float> w(K);  // one row of W in fp32, per thread
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* row = W + n * K;
      for (int64_t k = 0; k < K; ++k) w[k] = half_to_float(row[k]);
      dot_rows(x, w.data(), bias, M, N, K, n, y);
    }
  }
}

}  // namespace kestrel
