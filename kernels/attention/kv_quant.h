// The KV cache's storage types (--cache-type-k / --cache-type-v) and the plain C++ reference of
// their rounding: what a value becomes when it is written to the cache and what attention reads
// back. The CPU engine stores and reads its cache through these; the CUDA kernels are tested
// against them.
//
// One layer's K (or V) cache, per position (a row of kv_dim = n_kv_heads * head_dim values):
//
//   f16    values [ctx, kv_dim]: fp16 on the GPU; the CPU reference keeps fp32 (the cache it
//          always had: f16 on the CPU is today's fp32 arithmetic, unchanged)
//   q8_0   codes  int8 [ctx, kv_dim]            row: | h0: b0 b1 .. | h1: b0 b1 .. | ...
//          scales fp16 [ctx, kv_dim / 32]       one per block of 32 consecutive values of a
//                                               head's vector (llama.cpp's block_q8_0, split
//                                               into two arrays): value = code * scale,
//                                               scale = amax / 127, code = round(x / scale)
//                                               (halves away from zero, as llama.cpp)
//          8.5 bits a value
//   fp8    codes  E4M3 [ctx, kv_dim]            OCP FP8 E4M3: 1 sign, 4 exponent (bias 7),
//          scales fp32 [ctx, n_kv_heads]        3 mantissa bits, no infinities, max 448,
//                                               S.1111.111 NaN. One scale per head and
//                                               position, computed when the position is
//                                               written: scale = amax / 448, code =
//                                               e4m3(x / scale) rounded to nearest even and
//                                               saturated to +-448; value = e4m3 * scale.
//          8 + 32 / head_dim bits a value
//
// The scale of fp8 is fp32 rather than fp16: amax / 448 of a quiet head falls below fp16's
// normal range (6.1e-5) at amax 0.027, and 4 bytes per head of 64 or 128 values cost under 0.07
// bits a value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kestrel {

enum class KvType : uint8_t { F16, Q8_0, Fp8 };

struct KvCacheTypes {
  KvType k = KvType::F16;
  KvType v = KvType::F16;
  bool quantized() const { return k != KvType::F16 || v != KvType::F16; }
  // Spelled out, not defaulted: the CUDA files that include this header build as C++17.
  bool operator==(const KvCacheTypes& o) const { return k == o.k && v == o.v; }
  bool operator!=(const KvCacheTypes& o) const { return !(*this == o); }
};

// "f16", "q8_0", "fp8".
const char* kv_type_name(KvType t);
// A user's spelling to a type; anything else is a kestrel::Error naming `option` and the types
// ("--cache-type-k: unknown cache type 'q4_0' (f16, q8_0 or fp8)").
KvType parse_kv_type(const std::string& name, const std::string& option);
// "" where a cache of type t can hold heads of head_dim values, else why not (q8_0's blocks of
// 32 need head_dim a multiple of 32).
std::string kv_type_unsupported(KvType t, int head_dim);

constexpr int kQ8Block = 32;        // values per q8_0 scale
constexpr float kFp8Max = 448.0f;   // E4M3's largest finite value

// Scales per row of n_kv_heads heads of head_dim values: kv_dim / 32 (q8_0), n_kv_heads (fp8),
// 0 (f16); and the bytes of one scale.
int64_t kv_scales_per_row(KvType t, int n_kv_heads, int head_dim);
size_t kv_scale_bytes(KvType t);
// Bytes of one position's row of one layer's K or V cache: codes and scales, or for f16
// kv_dim * f16_value_bytes (2 on the GPU, 4 in the CPU reference's fp32).
size_t kv_row_bytes(KvType t, int n_kv_heads, int head_dim, size_t f16_value_bytes);

// ---- The rounding, value by value (the oracle of the CUDA kernels' quantize-on-write)

// float -> E4M3 bits: round to nearest, ties to even; |x| past 448 (infinities included)
// saturates to +-448; NaN -> 0x7F with x's sign.
uint8_t fp8_e4m3_from_float(float x);
// E4M3 bits -> float (exact; 0x7F and 0xFF are NaN).
float fp8_e4m3_to_float(uint8_t b);

// x [n] (n a multiple of 32) -> codes q [n], scales d [n / 32] (fp16 bits), as llama.cpp's
// quantize_row_q8_0_ref.
void quantize_q8_0_ref(const float* x, int64_t n, int8_t* q, uint16_t* d);
void dequantize_q8_0_ref(const int8_t* q, const uint16_t* d, int64_t n, float* y);
// One head's vector x [n] -> codes q [n] and its scale (amax / 448; 0 and all codes 0 when the
// vector is zero).
void quantize_fp8_ref(const float* x, int64_t n, uint8_t* q, float* scale);
void dequantize_fp8_ref(const uint8_t* q, float scale, int64_t n, float* y);

// ---- One layer's K or V cache in the CPU reference's storage

// Positions per block of a paged cache (models/kv_pool.h): a sequence's position p lives in row
// blocks[p / kKvBlock] * kKvBlock + p % kKvBlock of the pool's rows.
constexpr int kKvBlock = 16;

// A view of one layer's cache (it owns nothing). f16: `values` [rows, kv_dim] fp32. Quantized:
// `codes` [rows, kv_dim] bytes and `scales` [rows, kv_scales_per_row] (fp16 bits or fp32).
// Position p is row p, or with a block table (a paged cache) row(p).
struct KvLayerRef {
  KvType type = KvType::F16;
  int n_kv_heads = 0, head_dim = 0;
  float* values = nullptr;
  uint8_t* codes = nullptr;
  void* scales = nullptr;
  const int32_t* blocks = nullptr;  // paged: the block of each kKvBlock positions; else null

  int64_t kv_dim() const { return (int64_t)n_kv_heads * head_dim; }
  int64_t row(int64_t pos) const {
    return blocks ? (int64_t)blocks[pos / kKvBlock] * kKvBlock + pos % kKvBlock : pos;
  }
  // Stores row [kv_dim] at position pos, rounded to the type.
  void write(int64_t pos, const float* row) const;
  // out [p1 - p0, head_dim] = the values of KV head `head` at positions p0 .. p1 - 1 as
  // attention reads them (dequantized to fp32; f16 copies them).
  void read(int64_t p0, int64_t p1, int head, float* out) const;
};

// attention_ref (attention.h) over a cache in any type: the query at position `last` attends
// over positions [first, last], each key and value dequantized as it is read. With f16 the
// same arithmetic as attention_ref on the fp32 cache, bit for bit.
//   q [n_heads, head_dim], out [n_heads, head_dim]
void attention_ref_kv(const float* q, const KvLayerRef& k, const KvLayerRef& v, int n_heads,
                      int64_t first, int64_t last, float* out);

}  // namespace kestrel
