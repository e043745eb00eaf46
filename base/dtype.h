// Element types of the tensors Kestrel reads from safetensors files, and host-side
// conversions of the 16-bit float formats (round to nearest even, as the hardware does).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kestrel {

enum class DType { F16, BF16, F32, I32 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F32: return "F32";
    case DType::I32: return "I32";
  }
  return "?";
}

inline size_t dtype_size(DType t) { return (t == DType::F16 || t == DType::BF16) ? 2 : 4; }

// A floating-point element type (weights, norms, scales), as opposed to packed integer codes.
inline bool dtype_is_float(DType t) { return t == DType::F16 || t == DType::BF16 || t == DType::F32; }

// fp16 bits -> float (handles subnormals, inf, nan).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { mant <<= 1; ++e; } while ((mant & 0x400u) == 0);
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (mant & 0x3FFu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float -> fp16 bits, round to nearest even; overflow goes to inf.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u);  // nan / inf
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504
  if (ax < 0x38800000u) {                        // subnormal or zero in fp16
    if (ax < 0x33000000u) return sign;           // below half the smallest subnormal
    const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    const int shift = 113 - (int)(ax >> 23) + 13;  // 126 - exp + 1
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | (uint16_t)r;
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return sign | (uint16_t)r;
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet nan
  x += 0x7FFFu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

// Rounds a float through fp16 and back (what storing an activation in fp16 does).
inline float round_to_half(float f) { return half_to_float(float_to_half(f)); }

}  // namespace kestrel
