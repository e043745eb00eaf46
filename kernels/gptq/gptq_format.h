// The GPTQ checkpoint format (AutoGPTQ / GPTQModel / transformers), host side.
//
// One quantized linear y = x W^T, W is [N out, K in], b bits, G = ceil(K / group_size) groups:
//
//   qweight [K*b/32, N] int32   codes packed along K (the input axis): column n of qweight is
//                               a little-endian bit stream; code k sits at bits b*k .. b*k+b-1.
//   qzeros  [G, N*b/32] int32   zero points packed the same way along N, one row per group.
//   scales  [G, N]      fp16
//   g_idx   [K]         int32   group of input column k (k / group_size unless act-order)
//
//   W[n, k] = scales[g, n] * (q - z),  q = code k of column n,  g = g_idx[k],
//                                      z = (code n of qzeros row g) + zero_offset
//   zero_offset = 1 for checkpoint_format "gptq" (v1), 0 for "gptq_v2".
//
// Bit stream of one column for b = 3 (32 codes fill 3 words; codes 10 and 21 straddle):
//
//   word 0: |c10lo|c9 |c8 | ... |c1 |c0 |   bits 31..30 hold the low 2 bits of code 10
//   word 1: |c21lo|c20| ... |c11|c10hi  |   bit 0 holds the high bit of code 10
//   word 2: |c31|c30| ... |c22|c21hi    |   bits 0..1 hold the high 2 bits of code 21
//
// For b = 2, 4, 8 no code crosses a word. Words are treated as uint32 bit patterns.
#pragma once

#include <cstdint>
#include <vector>

namespace kestrel::gptq {

// A borrowed view of one quantized linear's tensors, as they sit in the checkpoint.
struct GptqView {
  int bits = 4;
  int group_size = 128;      // -1 = one group per row (G = 1)
  int64_t K = 0, N = 0;      // in_features, out_features
  int zero_offset = 1;       // 1 = gptq (v1), 0 = gptq_v2
  const uint32_t* qweight = nullptr;  // [K*bits/32, N]
  const uint32_t* qzeros = nullptr;   // [G, N*bits/32]
  const uint16_t* scales = nullptr;   // [G, N] fp16 bits
  const int32_t* g_idx = nullptr;     // [K]; nullptr = k / group_size

  int64_t groups() const { return group_size <= 0 ? 1 : (K + group_size - 1) / group_size; }
  int64_t group_of(int64_t k) const {
    return g_idx ? g_idx[k] : (group_size <= 0 ? 0 : k / group_size);
  }
};

// Number of 32-bit words that hold `count` codes of `bits` bits (count*bits must be a
// multiple of 32, which the loader checks).
inline int64_t packed_words(int64_t count, int bits) { return count * bits / 32; }

// Reads code i of a bit stream whose consecutive words are `stride` uint32 apart.
inline uint32_t read_code(const uint32_t* stream, int64_t stride, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t w = bit >> 5;
  const int s = (int)(bit & 31);
  uint64_t v = stream[w * stride];
  if (s + bits > 32) v |= (uint64_t)stream[(w + 1) * stride] << 32;
  return (uint32_t)(v >> s) & ((1u << bits) - 1u);
}

// Writes code i (ORs into a zero-initialised stream).
inline void write_code(uint32_t* stream, int64_t stride, int64_t i, int bits, uint32_t code) {
  const int64_t bit = i * bits;
  const int64_t w = bit >> 5;
  const int s = (int)(bit & 31);
  const uint64_t v = (uint64_t)(code & ((1u << bits) - 1u)) << s;
  stream[w * stride] |= (uint32_t)v;
  if (s + bits > 32) stream[(w + 1) * stride] |= (uint32_t)(v >> 32);
}

// Packs codes q[n*K + k] (row-major [N, K], values < 2^bits) into qweight [K*bits/32, N].
std::vector<uint32_t> pack_qweight(const std::vector<uint8_t>& q, int64_t N, int64_t K, int bits);
// Unpacks qweight to codes [N, K].
std::vector<uint8_t> unpack_qweight(const uint32_t* qweight, int64_t N, int64_t K, int bits);
// Packs stored zeros z_stored[g*N + n] into qzeros [G, N*bits/32].
std::vector<uint32_t> pack_qzeros(const std::vector<uint8_t>& z_stored, int64_t G, int64_t N, int bits);
std::vector<uint8_t> unpack_qzeros(const uint32_t* qzeros, int64_t G, int64_t N, int bits);

// g_idx for act-order: given perm (the order in which columns were quantized: perm[j] is
// the column quantized j-th), g_idx[perm[j]] = j / group_size.
std::vector<int32_t> act_order_g_idx(const std::vector<int32_t>& perm, int group_size);

// Reference dequantization: W [N, K] fp32, row-major, straight from the formula above.
void dequantize_ref(const GptqView& v, float* W);

// Reference matmul with on-the-fly dequantization: y[m, n] = sum_k x[m, k] * W[n, k],
// x [M, K], y [M, N], fp32 accumulation. The oracle for the GPU GEMV/GEMM kernels.
void matmul_ref(const GptqView& v, const float* x, int64_t M, float* y);

}  // namespace kestrel::gptq
