// Plain C++ GPTQ packing and dequantization, straight from the formula in gptq_format.h.
// These are the oracle of the CUDA kernels and the CPU engine's quantized linear.
#include "kernels/gptq/gptq_format.h"

#include <fmt/format.h>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/matmul/matmul.h"

namespace kestrel::gptq {

namespace {

void check_bits(int bits, const char* what) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8)
    throw Error(fmt::format("{}: bits must be 2, 3, 4 or 8, got {}", what, bits));
}

// A packed axis of `count` codes must fill whole words.
void check_packable(int64_t count, int bits, const char* what, const char* axis) {
  if (count <= 0 || (count * bits) % 32 != 0)
    throw Error(fmt::format("{}: {} = {} times {} bits is not a positive multiple of 32", what,
                            axis, count, bits));
}

void check_codes(const std::vector<uint8_t>& codes, int bits, const char* what) {
  const uint32_t limit = 1u << bits;
  for (size_t i = 0; i < codes.size(); ++i)
    if (codes[i] >= limit)
      throw Error(fmt::format("{}: code {} at index {} does not fit in {} bits", what,
                              (int)codes[i], i, bits));
}

// Validates a view once at the op boundary so the loops below can trust it.
void check_view(const GptqView& v, const char* what) {
  check_bits(v.bits, what);
  check_packable(v.K, v.bits, what, "K");
  check_packable(v.N, v.bits, what, "N");
  if (v.group_size == 0 || v.group_size < -1)
    throw Error(fmt::format("{}: group_size must be positive or -1, got {}", what, v.group_size));
  if (v.zero_offset != 0 && v.zero_offset != 1)
    throw Error(fmt::format("{}: zero_offset must be 0 (gptq_v2) or 1 (gptq), got {}", what,
                            v.zero_offset));
  if (!v.qweight || !v.qzeros || !v.scales)
    throw Error(fmt::format("{}: qweight, qzeros and scales must all be set", what));
  if (v.g_idx) {
    const int64_t G = v.groups();
    for (int64_t k = 0; k < v.K; ++k)
      if (v.g_idx[k] < 0 || v.g_idx[k] >= G)
        throw Error(fmt::format("{}: g_idx[{}] = {} is outside [0, {})", what, k, v.g_idx[k], G));
  }
}

// Per output column n: the scale and full zero point (stored zero + offset) of every group.
void column_scales_zeros(const GptqView& v, int64_t n, std::vector<float>& scale,
                         std::vector<float>& zero) {
  const int64_t G = v.groups();
  const int64_t zero_row_words = packed_words(v.N, v.bits);
  scale.resize(G);
  zero.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    scale[g] = half_to_float(v.scales[g * v.N + n]);
    const uint32_t f = read_code(v.qzeros + g * zero_row_words, 1, n, v.bits);
    zero[g] = (float)((int)f + v.zero_offset);
  }
}

// Dequantizes column n of qweight (row n of W) into w [K].
void dequantize_column(const GptqView& v, int64_t n, std::vector<float>& scale,
                       std::vector<float>& zero, float* w) {
  column_scales_zeros(v, n, scale, zero);
  const uint32_t* stream = v.qweight + n;  // consecutive words of the column are N apart
  for (int64_t k = 0; k < v.K; ++k) {
    const int64_t g = v.group_of(k);
    const float q = (float)read_code(stream, v.N, k, v.bits);
    w[k] = scale[g] * (q - zero[g]);
  }
}

}  // namespace

std::vector<uint32_t> pack_qweight(const std::vector<uint8_t>& q, int64_t N, int64_t K, int bits) {
  check_bits(bits, "pack_qweight");
  check_packable(K, bits, "pack_qweight", "K");
  if (N <= 0 || (int64_t)q.size() != N * K)
    throw Error(fmt::format("pack_qweight: expected {} x {} = {} codes, got {}", N, K, N * K,
                            q.size()));
  check_codes(q, bits, "pack_qweight");
  std::vector<uint32_t> out(packed_words(K, bits) * N, 0u);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) write_code(out.data() + n, N, k, bits, q[n * K + k]);
  return out;
}

std::vector<uint8_t> unpack_qweight(const uint32_t* qweight, int64_t N, int64_t K, int bits) {
  check_bits(bits, "unpack_qweight");
  check_packable(K, bits, "unpack_qweight", "K");
  std::vector<uint8_t> q(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) q[n * K + k] = (uint8_t)read_code(qweight + n, N, k, bits);
  return q;
}

std::vector<uint32_t> pack_qzeros(const std::vector<uint8_t>& z_stored, int64_t G, int64_t N,
                                  int bits) {
  check_bits(bits, "pack_qzeros");
  check_packable(N, bits, "pack_qzeros", "N");
  if (G <= 0 || (int64_t)z_stored.size() != G * N)
    throw Error(fmt::format("pack_qzeros: expected {} x {} = {} zeros, got {}", G, N, G * N,
                            z_stored.size()));
  check_codes(z_stored, bits, "pack_qzeros");
  const int64_t row_words = packed_words(N, bits);
  std::vector<uint32_t> out(G * row_words, 0u);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n)
      write_code(out.data() + g * row_words, 1, n, bits, z_stored[g * N + n]);
  return out;
}

std::vector<uint8_t> unpack_qzeros(const uint32_t* qzeros, int64_t G, int64_t N, int bits) {
  check_bits(bits, "unpack_qzeros");
  check_packable(N, bits, "unpack_qzeros", "N");
  const int64_t row_words = packed_words(N, bits);
  std::vector<uint8_t> z(G * N);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n)
      z[g * N + n] = (uint8_t)read_code(qzeros + g * row_words, 1, n, bits);
  return z;
}

std::vector<int32_t> act_order_g_idx(const std::vector<int32_t>& perm, int group_size) {
  const int64_t K = (int64_t)perm.size();
  std::vector<int32_t> g_idx(K, -1);
  for (int64_t j = 0; j < K; ++j) {
    const int32_t col = perm[j];
    if (col < 0 || col >= K || g_idx[col] != -1)
      throw Error(fmt::format("act_order_g_idx: perm[{}] = {} is not part of a permutation of {}",
                              j, col, K));
    g_idx[col] = group_size <= 0 ? 0 : (int32_t)(j / group_size);
  }
  return g_idx;
}

void dequantize_ref(const GptqView& v, float* W) {
  check_view(v, "dequantize_ref");
  std::vector<float> scale, zero;
  for (int64_t n = 0; n < v.N; ++n) dequantize_column(v, n, scale, zero, W + n * v.K);
}

void matmul_ref(const GptqView& v, const float* x, int64_t M, float* y) {
  check_view(v, "gptq matmul_ref");
  // One output column at a time: its codes are unpacked and dequantized once into w [K],
  // then reused by all M rows of x, so the packed stream is read once per call.
  // Threads take runs of columns (linear_team), each with its own column, scales and zeros,
  // allocated here: nothing inside the team may throw.
  const int team = linear_team(M * v.N * v.K);
  std::vector<float> cols((size_t)team * v.K);
  std::vector<std::vector<float>> scales(team, std::vector<float>(v.groups())),
      zeros(team, std::vector<float>(v.groups()));
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t n = 0; n < v.N; ++n) {
    const int t = linear_thread_index();
    float* w = cols.data() + (size_t)t * v.K;
    dequantize_column(v, n, scales[t], zeros[t], w);
    for (int64_t m = 0; m < M; ++m) y[m * v.N + n] = dot_ref(x + m * v.K, w, v.K);
  }
}

}  // namespace kestrel::gptq
