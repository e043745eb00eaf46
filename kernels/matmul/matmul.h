// Dense linear layers, y = x W^T (+ b).
#pragma once

#include <cstdint>

namespace kestrel {

// The dot product of every CPU linear: 16 running sums (sum j takes k = j mod 16, in order),
// then the tail into sum 0, then added in a fixed tree. One running sum is a chain of
// dependent adds, which bound the CPU engine at a few ns per weight; 16 independent ones the
// compiler keeps in vector registers. The order is fixed and the same for every row, so a
// linear over many rows gives each row exactly what it gives that row alone (a speculative
// verify pass equals decode steps bit for bit).
inline float dot_ref(const float* a, const float* b, int64_t K) {
  constexpr int kSums = 16;
  float s[kSums] = {};
  int64_t k = 0;
  for (; k + kSums <= K; k += kSums)
    for (int j = 0; j < kSums; ++j) s[j] += a[k + j] * b[k + j];
  for (; k < K; ++k) s[0] += a[k] * b[k];
  for (int w = kSums / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) s[j] += s[j + w];
  return s[0];
}

// The CPU linears (these and gptq::matmul_ref) give each thread of a team a share of the output
// columns, each computed as on one thread, so the result does not depend on the thread count.
// set_linear_threads sets the team (kestrel's -t; 0: OMP_NUM_THREADS or one per core; at most
// one per core) for calls from the thread that calls it. Calls from other threads, and all calls
// before it, run on one thread: OpenMP (libgomp) keeps a pool for each thread that starts a
// team, so a server's many request threads would each keep one alive, and the count would be
// theirs, not -t's.
void set_linear_threads(int threads);
int linear_threads();  // the team set (1 where OpenMP is not built in)
// Below this many multiply-adds a call stays on one thread: a team's start costs microseconds.
constexpr int64_t kLinearParallelWork = int64_t(1) << 16;
// The team for a call of `work` multiply-adds from this thread.
int linear_team(int64_t work);
// This thread's index in the current team (0 outside one).
int linear_thread_index();

// x [M, K] fp32, W [N, K] fp32 row-major, bias [N] or nullptr, y [M, N].
void matmul_ref(const float* x, const float* W, const float* bias, int64_t M, int64_t N,
                int64_t K, float* y);

// Same with W stored as fp16 bits (what an unquantized checkpoint linear or lm_head holds).
void matmul_f16w_ref(const float* x, const uint16_t* W, const float* bias, int64_t M, int64_t N,
                     int64_t K, float* y);

}  // namespace kestrel
