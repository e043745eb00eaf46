// Bit-level helpers of the kernels that unpack GPTQ codes (the GEMVs, the fused small-M GEMM,
// the dequantization): one lop3 for the mask-and-magic step that drops codes into the
// mantissas of an fp16 pair, and the reinterpretations around it. Device code only.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace kestrel::cuda {

// (a & b) | c in one lop3: a pair of codes masked out of a word, dropped into the mantissas of
// an fp16 pair whose exponent bits c supplies (the "magic number").
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// (a & m) | (b & ~m): bit select, one lop3.
__device__ __forceinline__ uint32_t select_bits(uint32_t a, uint32_t b, uint32_t m) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(m));
  return r;
}

__device__ __forceinline__ __half2 as_h2(uint32_t u) {
  __half2 h;
  static_assert(sizeof(h) == sizeof(u));
  memcpy(&h, &u, sizeof(u));
  return h;
}

__device__ __forceinline__ uint32_t as_u32(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

// Word j (0..3) of a 16-byte vector, j known at compile time after unrolling.
__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

}  // namespace kestrel::cuda
