// Plain C++ dense linears. Loop order: for each output n, one row of W is loaded (and
// converted from fp16 once) and dotted with every row of x, so W streams through the cache once.
#include "kernels/matmul/matmul.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "base/dtype.h"

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

std::atomic<int> g_team{1};
std::atomic<std::thread::id> g_owner{};  // the thread whose calls fan out

}  // namespace

void set_linear_threads(int threads) {
#ifdef _OPENMP
  const int cores = std::max(1, (int)std::thread::hardware_concurrency());
  g_team = std::clamp(threads > 0 ? threads : omp_get_max_threads(), 1, cores);
#else
  (void)threads;
#endif
  g_owner = std::this_thread::get_id();
}

int linear_threads() { return g_team; }

int linear_team(int64_t work) {
  return work >= kLinearParallelWork && std::this_thread::get_id() == g_owner.load() ? g_team.load()
                                                                                     : 1;
}

int linear_thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

void matmul_ref(const float* x, const float* W, const float* bias, int64_t M, int64_t N,
                int64_t K, float* y) {
  const int team = linear_team(M * N * K);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t n = 0; n < N; ++n) dot_rows(x, W + n * K, bias, M, N, K, n, y);
}

void matmul_f16w_ref(const float* x, const uint16_t* W, const float* bias, int64_t M, int64_t N,
                     int64_t K, float* y) {
  const int team = linear_team(M * N * K);
  // One row of W in fp32 per thread, allocated here: nothing inside the team may throw.
  std::vector<float> rows((size_t)team * K);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t n = 0; n < N; ++n) {
    float* w = rows.data() + (size_t)linear_thread_index() * K;
    const uint16_t* row = W + n * K;
    for (int64_t k = 0; k < K; ++k) w[k] = half_to_float(row[k]);
    dot_rows(x, w, bias, M, N, K, n, y);
  }
}

}  // namespace kestrel
