// Decoding the repacked GPTQ weights inside the GEMV kernels: the packed layout (drawn below,
// with the dequantization's accuracy argument), the streaming load of a unit of codes and its
// scales, and the dot product of a unit with x that dequantizes on the way (lop3 into fp16
// mantissas, one subtraction of the zero point). QuantOp<BITS, GS> for GPTQ codes, F16Op for
// fp16 rows: the kernels (gemv_kernel.cuh) are loops around their load and compute. The layout
// lives here, beside the only code that reads it bit by bit; gemv_prepare.cpp writes it, and
// gemv_layout.h holds the constants both agree on. Device code: include from .cu files only.
//
// ---------------------------------------------------------------------------------------------
// Packed layout (built by gemv_prepare.cpp). Row n is planes * chunks 16-byte chunks. Chunk c
// holds the C consecutive codes k = c*C .. c*C+C-1 of the (act-order permuted) K axis,
// zero-padded past K; unit u is chunks 4u .. 4u+3 (3-bit: chunk u, planes 0-2). Inside a row,
// the units u = 32i .. 32i+31 (fewer in the last group, cnt of them) store their load slot t
// together: slot t of unit u at uint4 32i*loads + t*cnt + u%32 (gemv_layout.h chunk_index), so
// the 32 lanes of a warp read 512 contiguous bytes per load. Inside a 32-bit word, the two codes
// that meet the same half2 of x sit in the low and the high 16-bit half at the same bit
// position, so one lop3 with a mask drops both into the mantissas of an fp16 pair:
//
//  4-bit, C = 32, word j of the chunk holds k = 8j .. 8j+7 (i = k - 8j):
//     bit 31           16 15             0
//        | 7 | 5 | 3 | 1 | 6 | 4 | 2 | 0 |      code i at bit 16*(i&1) + 4*(i>>1)
//     mask 0x000F000F -> pair (0,1) at mantissa bit 0 : with 0x6400 (1024.0) = 1024 + q
//     mask 0x00F000F0 -> pair (2,3) at mantissa bit 4 : with 0x5400 (  64.0) =   64 + q
//     the same on word >> 8 -> pairs (4,5), (6,7).
//  2-bit, C = 64, word j holds k = 16j .. 16j+15: code i at bit 16*(i&1) + 2*(i>>1); masks
//     0x00030003 << 2s with magics 1024, 256, 64, 16 (mantissa bit 2s), on word and word >> 8.
//  8-bit, C = 16, word j holds k = 4j .. 4j+3 at byte i; prmt puts bytes (0,1) and (2,3)
//     under a 0x64 high byte: 1024 + q.
//  3-bit, C = 128, 3 planes (48 bytes per chunk, three fully coalesced 16-byte loads):
//     32-code piece u of the chunk = word u of plane 0, 1, 2 (a, b, c):
//        a: codes 0..7 , b: codes 8..15, c: codes 16..23 as 3-bit values in the 4-bit layout
//           above (bits 0-2 of each nibble);
//        bit 3 of nibble slot i of a, b, c = bit 0, 1, 2 of code 24+i.
//           plane 0 word u:  | x7 c7 | x5 c5 | ... | x6 c6 | x4 c4 | x2 c2 | x0 c0 |
//           (xi = one bit of code 24+i, ci = 3-bit code i)
//     d = (a>>3 & 0x11111111) | (b>>2 & 0x22222222) | (c>>1 & 0x44444444) rebuilds codes
//     24..31 as a fourth nibble word (3 shifts + 2 lop3 per 32 codes); all four words then
//     decode as 4-bit words with mask 7.
//  fp16 weights: the row as stored, C = 8.
//
// Scales [N][groups] fp16 and, unless every zero point is equal, zeros [N][groups] uint8,
// at the effective group size (a divisor of the checkpoint's, repeated; 0 = one per row); rows
// padded to 8 groups, so the 1-8 scales of a unit are one aligned vector load.
//
// ---------------------------------------------------------------------------------------------
// Dequantization and accuracy. lop3 yields t = M + q exactly (M = 2^(10-p) for a code at
// mantissa bit p); t - (M + z) = q - z is exact (M + z is built with integer ops, no convert).
// The single-hfma2 form t*s + (-(M+z)*s) is avoided: rounding -(1024+z)*s to fp16 costs up to
// half a quantization step.
//   8-bit: w = (q - z) * s in fp16 (one rounding, as the fp16 model's weight), then hfma2 with
//     x into a half2 partial sum over the unit (64 codes), added in fp32.
//   2-, 3-, 4-bit: the partial sum over 32 codes is sum (q - z) x in half2 (exact factors,
//     |q - z| <= 15), then scaled by s in fp32: lop3, hsub2, hfma2 per pair of weights, one op
//     less than scaling each weight. Each half of the half2 sums 16 products, so it overflows
//     only if sum |q - z| |x| over those 16 inputs exceeds 65504 (|x| > 273 on all 16 at the
//     extreme 4-bit code), far beyond the activations of a normalised decoder.
// ---------------------------------------------------------------------------------------------
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/bits.cuh"
#include "kernels/common/cp_async.cuh"
#include "kernels/gemv/gemv_layout.h"
#include "kernels/gemv/gemv_params.cuh"

namespace kestrel::cuda::gemv_detail {
namespace {

// ---- PTX --------------------------------------------------------------------------------------

__device__ __forceinline__ float hsum(__half2 v) { return __low2float(v) + __high2float(v); }

// q - z for a pair of codes that lop3 put at mantissa bit p under magic M = 2^(10-p):
// t - (M + z), with M + z as bits: magic | z << p (z << p stays inside the mantissa).
__device__ __forceinline__ __half2 minus_zero(uint32_t t, uint32_t mz) {
  return __hsub2(as_h2(t), as_h2(mz));
}

// ---- One 4-bit (or 3-bit nibble) word: 8 codes against 8 x values -------------------------

// Integer dot: returns acc + sum (q - z) * x.
template <uint32_t kMask>
__device__ __forceinline__ __half2 nibble_word_int(uint32_t w, uint4 xv, uint32_t mz0,
                                                   uint32_t mz4, __half2 acc) {
  constexpr uint32_t lo = kMask * 0x00010001u, hi = kMask * 0x00100010u;
  const uint32_t w8 = w >> 8;
  acc = __hfma2(minus_zero(and_or(w, lo, 0x64006400u), mz0), as_h2(xv.x), acc);
  acc = __hfma2(minus_zero(and_or(w, hi, 0x54005400u), mz4), as_h2(xv.y), acc);
  acc = __hfma2(minus_zero(and_or(w8, lo, 0x64006400u), mz0), as_h2(xv.z), acc);
  acc = __hfma2(minus_zero(and_or(w8, hi, 0x54005400u), mz4), as_h2(xv.w), acc);
  return acc;
}

// ---- Formats ------------------------------------------------------------------------------------

// The quantized formats: what one unit of a row holds, how its scales are fetched, and its dot
// product with x. BITS: 2, 3, 4, 8. GS: effective group size, 32/64/128, or 0 for one per row.
template <int BITS, int GS>
struct QuantOp {
  static constexpr int kCodes = chunk_codes(BITS);        // codes per chunk
  static constexpr int kChunks = unit_chunks(BITS);       // chunks per unit
  static constexpr int kLoads = unit_loads(BITS);         // 16-byte loads per unit and row
  static constexpr int kUnitCodes = kCodes * kChunks;     // 256, 128, 128, 64 for 2, 3, 4, 8
  static constexpr int kVecs = kUnitCodes / 8;            // x uint4 per unit
  // Scales a unit meets: several when groups are smaller than the unit, else one (a group of
  // 128 spans two 8-bit units).
  static constexpr int kScales = (GS == 0 || GS >= kUnitCodes) ? 1 : kUnitCodes / GS;
  static_assert(GS == 0 || GS % 32 == 0, "groups are whole 32-code pieces");
  static_assert(kScales == 1 || kScales == 2 || kScales == 4 || kScales == 8, "scale vector");
  static constexpr int R = kQuantRows;

  struct Frag {
    uint4 q[R][kLoads];
    uint32_t s[R][(kScales + 1) / 2];  // fp16 scale bits, two per word
    uint32_t z[R][(kScales + 3) / 4];  // stored zero points, four per word (asymmetric only)
  };

  // Scale slot of the group holding code `off` of the unit (compile-time in every caller).
  static constexpr int group_in_unit(int off) { return kScales == 1 ? 0 : off / GS; }
  __device__ static __forceinline__ int64_t scale_index(int u) {
    return GS == 0 ? 0 : GS >= kUnitCodes ? int64_t(u) * kUnitCodes / GS : int64_t(u) * kScales;
  }

  // Loads unit u (iteration i = u / 32, lane = u % 32) of rows row0 .. row0 + nrows - 1; rows
  // past nrows get zero codes and scales (computed, never stored).
  // Row r of the step is row0 + r * rstep (rstep = 1, or the gate/up pair distance).
  __device__ static __forceinline__ void load(Frag& f, const KParams& p, int row0, int rstep,
                                              int nrows, int i, int lane, uint64_t pol) {
    const int cnt = min(32, p.nch - 32 * i);
    const int64_t si = scale_index(32 * i + lane);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < nrows) {
        const int row = row0 + r * rstep;
        const uint4* base = p.codes + int64_t(row) * p.row_stride + 32 * i * kLoads + lane;
#pragma unroll
        for (int t = 0; t < kLoads; ++t) f.q[r][t] = ld_stream(base + t * cnt, pol);
        const int64_t idx = int64_t(row) * p.G + si;
        if constexpr (kScales == 1) {
          f.s[r][0] = __ldg(reinterpret_cast<const unsigned short*>(p.scales) + idx);
        } else if constexpr (kScales == 2) {
          f.s[r][0] = __ldg(reinterpret_cast<const uint32_t*>(p.scales + idx));
        } else if constexpr (kScales == 4) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(p.scales + idx));
          f.s[r][0] = v.x, f.s[r][1] = v.y;
        } else {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(p.scales + idx));
          f.s[r][0] = v.x, f.s[r][1] = v.y, f.s[r][2] = v.z, f.s[r][3] = v.w;
        }
        if (p.zeros) {
          if constexpr (kScales == 1) {
            f.z[r][0] = __ldg(p.zeros + idx);
          } else if constexpr (kScales == 2) {
            f.z[r][0] = __ldg(reinterpret_cast<const unsigned short*>(p.zeros + idx));
          } else if constexpr (kScales == 4) {
            f.z[r][0] = __ldg(reinterpret_cast<const uint32_t*>(p.zeros + idx));
          } else {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(p.zeros + idx));
            f.z[r][0] = v.x, f.z[r][1] = v.y;
          }
        }
      } else {
#pragma unroll
        for (int t = 0; t < kLoads; ++t) f.q[r][t] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int g = 0; g < (kScales + 1) / 2; ++g) f.s[r][g] = 0;
#pragma unroll
        for (int g = 0; g < (kScales + 3) / 4; ++g) f.z[r][g] = 0;
      }
    }
  }

  __device__ static __forceinline__ uint32_t scale_bits(const Frag& f, int r, int g) {
    return (f.s[r][g / 2] >> (16 * (g % 2))) & 0xFFFFu;
  }
  __device__ static __forceinline__ float scale(const Frag& f, int r, int g) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(scale_bits(f, r, g))));
  }
  __device__ static __forceinline__ uint32_t zero(const Frag& f, const KParams& p, int r, int g) {
    return p.zeros ? ((f.z[r][g / 4] >> (8 * (g % 4))) & 0xFFu) + uint32_t(p.zero_offset)
                   : uint32_t(p.zero_const);
  }

  // acc[r] += dot(unit of row r, x). xs = &x_s[u]: the unit's x uint4 v at xs[v * stride].
  __device__ static __forceinline__ void compute(const Frag& f, const KParams& p, const uint4* xs,
                                                 int stride, float (&acc)[R]) {
    if constexpr (BITS == 4) {
      // Chunk j = codes 32j .. 32j+31 of the unit; word w of it meets x uint4 4j + w.
      uint32_t mz0[R][kScales], mz4[R][kScales];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int g = 0; g < kScales; ++g) {
          const uint32_t z2 = zero(f, p, r, g) * 0x00010001u;
          mz0[r][g] = 0x64006400u | z2;
          mz4[r][g] = 0x54005400u | (z2 << 4);
        }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int g = group_in_unit(32 * j);
        __half2 h[R];
#pragma unroll
        for (int r = 0; r < R; ++r) h[r] = __float2half2_rn(0.f);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const uint4 xv = xs[(4 * j + w) * stride];
#pragma unroll
          for (int r = 0; r < R; ++r)
            h[r] = nibble_word_int<15>(word_of(f.q[r][j], w), xv, mz0[r][g], mz4[r][g], h[r]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(scale(f, r, g), hsum(h[r]), acc[r]);
      }
    } else if constexpr (BITS == 8) {
      // Chunk j = codes 16j .. 16j+15; words (2v, 2v+1) meet x uint4 2j + v. w = (q - z) * s
      // in fp16, summed over the unit in half2.
      __half2 h[R];
#pragma unroll
      for (int r = 0; r < R; ++r) h[r] = __float2half2_rn(0.f);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int g = group_in_unit(16 * j);
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const uint4 xv = xs[(2 * j + v) * stride];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t mz = 0x64006400u | (zero(f, p, r, g) * 0x00010001u);
            const __half2 s = as_h2(scale_bits(f, r, g) * 0x00010001u);
            const uint32_t w0 = word_of(f.q[r][j], 2 * v), w1 = word_of(f.q[r][j], 2 * v + 1);
            // prmt: bytes (0,1) / (2,3) of the word each under a 0x64 byte = 1024 + q.
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w0, 0x64u, 0x4140u), mz), s),
                           as_h2(xv.x), h[r]);
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w0, 0x64u, 0x4342u), mz), s),
                           as_h2(xv.y), h[r]);
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w1, 0x64u, 0x4140u), mz), s),
                           as_h2(xv.z), h[r]);
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w1, 0x64u, 0x4342u), mz), s),
                           as_h2(xv.w), h[r]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += hsum(h[r]);
    } else if constexpr (BITS == 2) {
      // Chunk j = codes 64j .. 64j+63 = pieces 2j, 2j+1; piece pc of the chunk is words 2pc,
      // 2pc+1 against x uint4 8j + 4pc .. +3.
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int pc = 0; pc < 2; ++pc) {
          const int g = group_in_unit(64 * j + 32 * pc);
          uint4 xv[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) xv[i] = xs[(8 * j + 4 * pc + i) * stride];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t z2 = zero(f, p, r, g) * 0x00010001u;
            const uint32_t mz[4] = {0x64006400u | z2, 0x5C005C00u | (z2 << 2),
                                    0x54005400u | (z2 << 4), 0x4C004C00u | (z2 << 6)};
            constexpr uint32_t magic[4] = {0x64006400u, 0x5C005C00u, 0x54005400u, 0x4C004C00u};
            __half2 h = __float2half2_rn(0.f);
#pragma unroll
            for (int wi = 0; wi < 2; ++wi) {
              const uint32_t w = word_of(f.q[r][j], 2 * pc + wi), w8 = w >> 8;
              const uint4 xa = xv[2 * wi], xb = xv[2 * wi + 1];
#pragma unroll
              for (int sl = 0; sl < 4; ++sl) {
                const uint32_t m = 0x00030003u << (2 * sl);
                h = __hfma2(minus_zero(and_or(w, m, magic[sl]), mz[sl]), as_h2(word_of(xa, sl)), h);
                h = __hfma2(minus_zero(and_or(w8, m, magic[sl]), mz[sl]), as_h2(word_of(xb, sl)), h);
              }
            }
            acc[r] = fmaf(scale(f, r, g), hsum(h), acc[r]);
          }
        }
    } else {  // BITS == 3: one chunk of 3 planes; piece pc = word pc of planes a, b, c
#pragma unroll
      for (int pc = 0; pc < 4; ++pc) {
        const int g = group_in_unit(32 * pc);
        uint4 xv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i] = xs[(4 * pc + i) * stride];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t z2 = zero(f, p, r, g) * 0x00010001u;
          const uint32_t mz0 = 0x64006400u | z2, mz4 = 0x54005400u | (z2 << 4);
          const uint32_t a = word_of(f.q[r][0], pc), b = word_of(f.q[r][1], pc), c = word_of(f.q[r][2], pc);
          const uint32_t d = select_bits(a >> 3, select_bits(b >> 2, c >> 1, 0x22222222u),
                                         0x11111111u);
          __half2 h = __float2half2_rn(0.f);
          h = nibble_word_int<7>(a, xv[0], mz0, mz4, h);
          h = nibble_word_int<7>(b, xv[1], mz0, mz4, h);
          h = nibble_word_int<7>(c, xv[2], mz0, mz4, h);
          h = nibble_word_int<7>(d, xv[3], mz0, mz4, h);
          acc[r] = fmaf(scale(f, r, g), hsum(h), acc[r]);
        }
      }
    }
  }
};

// fp16 weights: the row as stored, 8 values per chunk, fp32 products and sums.
struct F16Op {
  static constexpr int kCodes = 8;
  static constexpr int kRows = kF16Rows;
  static constexpr int kUnroll = 4;  // 16 loads in flight: a chunk is only 8 weights
  static constexpr int kVecs = 1;

  struct Frag {
    uint4 q[kRows];
  };

  __device__ static __forceinline__ void load(Frag& f, const KParams&,
                                              const uint4* const (&rowp)[kRows],
                                              const int64_t (&)[kRows], int c, uint64_t pol) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) f.q[r] = ld_stream(rowp[r] + c, pol);
  }

  __device__ static __forceinline__ void compute(const Frag& f, const uint4* xs, int,
                                                 float (&acc)[kRows]) {
    const uint4 xv = xs[0];
    float2 x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = __half22float2(as_h2(word_of(xv, j)));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float a = acc[r];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 w = __half22float2(as_h2(word_of(f.q[r], j)));
        a = fmaf(w.x, x[j].x, a);
        a = fmaf(w.y, x[j].y, a);
      }
      acc[r] = a;
    }
  }
};

}  // namespace
}  // namespace kestrel::cuda::gemv_detail
