// FP16 embedding lookup: copies table rows chosen by token ids that live in device memory.
// One thread per 16 bytes when hidden % 8 == 0 and the pointers are 16-byte aligned, else one
// per element; grid.y runs over the tokens.
#include "kernels/embedding/embedding_cuda.h"

#include <cstdint>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;

template <bool kVec>
__global__ void embedding_kernel(const __half* __restrict__ table, const int* __restrict__ tokens,
                                 int hidden, __half* __restrict__ out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const __half* row = table + (size_t)tokens[blockIdx.y] * hidden;
  __half* o = out + (size_t)blockIdx.y * hidden;
  if constexpr (kVec) {
    if (i >= hidden / 8) return;
    reinterpret_cast<uint4*>(o)[i] = __ldg(reinterpret_cast<const uint4*>(row) + i);
  } else {
    if (i >= hidden) return;
    o[i] = row[i];
  }
}

// Row i of out = table row tokens[i] + positions row (*pos0 + i) (pos0 nullptr: row i): the
// fp32 sum of the two fp16 values, rounded once, as an fp16 addition gives it.
__global__ void embedding_positions_kernel(const __half* __restrict__ table,
                                           const __half* __restrict__ positions,
                                           const int* __restrict__ tokens,
                                           const int* __restrict__ pos0, int hidden,
                                           __half* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= hidden) return;
  const int row = blockIdx.y, p = (pos0 ? *pos0 : 0) + row;
  const float e = __half2float(table[(size_t)tokens[row] * hidden + j]);
  out[(size_t)row * hidden + j] = __float2half_rn(e + __half2float(positions[(size_t)p * hidden + j]));
}

// out[j] = table[token][perm[j]]: one thread per element (a decode step's one row).
__global__ void embedding_permuted_kernel(const __half* __restrict__ table,
                                          const int* __restrict__ token, int hidden,
                                          const int32_t* __restrict__ perm,
                                          __half* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < hidden) out[j] = table[(size_t)*token * hidden + __ldg(perm + j)];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void embedding_tokens_f16(const __half* table, const int* d_tokens, int n, int hidden,
                          __half* out, cudaStream_t stream) {
  KESTREL_CHECK(n >= 0 && n <= 65535 && hidden > 0,
                "embedding_tokens_f16: bad shape n " + std::to_string(n) + ", hidden " +
                    std::to_string(hidden));
  if (n == 0) return;
  const bool vec = hidden % 8 == 0 && aligned16(table) && aligned16(out);
  const int items = vec ? hidden / 8 : hidden;
  const dim3 grid((items + kThreads - 1) / kThreads, n);
  if (vec) {
    embedding_kernel<true><<<grid, kThreads, 0, stream>>>(table, d_tokens, hidden, out);
  } else {
    embedding_kernel<false><<<grid, kThreads, 0, stream>>>(table, d_tokens, hidden, out);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void embedding_f16(const __half* table, const int* d_token, int hidden, __half* out,
                   cudaStream_t stream) {
  embedding_tokens_f16(table, d_token, 1, hidden, out, stream);
}

void embedding_positions_f16(const __half* table, const __half* positions, const int* d_tokens,
                             const int* d_pos0, int n, int hidden, __half* out,
                             cudaStream_t stream) {
  KESTREL_CHECK(n >= 0 && n <= 65535 && hidden > 0 && positions,
                "embedding_positions_f16: bad shape n " + std::to_string(n) + ", hidden " +
                    std::to_string(hidden) + " or no position table");
  if (n == 0) return;
  const dim3 grid((hidden + kThreads - 1) / kThreads, n);
  embedding_positions_kernel<<<grid, kThreads, 0, stream>>>(table, positions, d_tokens, d_pos0,
                                                            hidden, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void embedding_permuted_f16(const __half* table, const int* d_token, int hidden,
                            const int32_t* perm, __half* out, cudaStream_t stream) {
  KESTREL_CHECK(hidden > 0 && perm, "embedding_permuted_f16: bad shape or no permutation");
  embedding_permuted_kernel<<<(hidden + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      table, d_token, hidden, perm, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
