// Batch-1 GEMV kernels: fused GPTQ dequantize + dot product, and plain fp16, streaming the
// weights once at the memory-bandwidth limit.
//
// ---------------------------------------------------------------------------------------------
// What a GEMV must move. y[N] = W[N,K] x[K]: every weight byte once, x and y once. Llama-2-7B
// gate/up fused, 4-bit g128: 22016 x 4096 codes = 45.1 MB + scales 1.4 MB; x 8 KB, y 44 KB:
// ~11 us at 4.26 TB/s. The arithmetic (2 flops per weight) is far below the FP16 units' rate, but
// the *instruction issue* is not: at 4-bit a GPU-wide 8.5 T weights/s leaves ~4 issue slots per
// weight, so dequantization must cost a handful of integer/half2 ops per pair of weights.
//
// Measured (kernels/gemv/NOTES.md): fp16 90-100% of the copy bandwidth on the large shapes; the
// quantized kernel 60-85% on the 7B shapes, within ~10% of a kernel that only loads the same
// bytes in the same pattern: what is left is the fixed cost of a launch (~1.5 us: grid start,
// the wait on the previous kernel, staging x), a quarter of a 25 MB GEMV.
//
// ---------------------------------------------------------------------------------------------
// Work decomposition, quantized. 16 warps per SM, as one block or (symmetric 4-bit, K and N >=
// 4096: spec_block_warps) two blocks of 8; each block stages x into shared memory once.
// Warp w of the W in the grid owns the rows [N*w/W, N*(w+1)/W) (equal runs, so no warp has a
// whole extra tile to finish) and streams them R = 2 at a time. Along K a row is cut into units
// (256, 128, 128, 64 codes at 2, 3, 4, 8 bits; four 16-byte loads, or three 3-bit planes), and
// lane l takes units l, l + 32, ...:
//
//                 K (units of 4 x 16 bytes per row)  --------------------------------->
//   warp w        | lane0 lane1 ... lane31 | lane0 ... lane31 | lane0 ...
//   rows r, r+1   | u=0   u=1       u=31   | u=32      u=63   | ...
//
// A step loads one unit of each of the R rows (4R 16-byte loads in flight per thread, plus the
// unit's scales as one vector load per row), then computes: each x uint4 is read from shared
// memory once for both rows. The first step is loaded before the kernel waits for the previous
// one (programmatic dependent launch). Loads are ld.global.nc.L1::no_allocate with an L2
// evict_first policy: weights are read once per token and must neither evict the KV cache or the
// activations from L2 nor occupy L1. Lanes sum with warp shuffles at the end of each row pair.
// With the SiLU epilogue (GemvEpilogue) a step's two rows are gate row g and up row g + N/2, the
// warps share the N/2 pairs, and lane 0 writes silu(gate) * up.
//
// fp16 (gemv_f16, weights as stored): blocks of 8 warps loop over tiles of 4 rows per warp;
// lane l reads 16-byte chunk c = l + 32i of each row; k_split warps may share a row.
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
// x in shared memory mirrors this: the 8 x values of word j of the unit (4-bit; two uint4 per
// 2-bit word, half a uint4 per 8-bit word) form uint4 number j of the unit, stored at
// x_s[j*units + u], so that the 32 lanes of a warp read 512 contiguous bytes (no bank
// conflicts). With act-order the block first copies x in its natural order to shared memory,
// then gathers it through perm.
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

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda {
namespace gemv_detail {
namespace {

struct KParams {
  const uint4* codes;      // row n starts at codes + n * row_stride
  int64_t row_stride;      // uint4 per row: planes * nch
  const __half* scales;    // [N][G]
  const uint8_t* zeros;    // [N][G] or nullptr
  const int32_t* perm;     // [nch * C] or nullptr
  const __half* x;
  __half* y;
  const __half* residual;  // may alias y
  int N, K, nch, G;
  int zero_const, zero_offset;
  int k_split, tiles;
  // The op before the GEMV, fused into the staging of x (GemvInput): RMSNorm with these
  // weights, or SiLU(gate) * up over an x that holds [gate | up].
  const __half* norm_w;  // nullptr = no norm
  float eps;
  bool silu_mul;
  // The op after it (quantized kernel, GemvEpilogue): y[i] = SiLU(row i) * row i + pair, for
  // i < N / 2, over a weight whose rows are [gate | up] (pair = N / 2); 0 = none.
  int silu_pair;
};

// ---- PTX --------------------------------------------------------------------------------------

// L2 policy for streamed weights: first to leave L2 (they are read once per token and must not
// evict the KV cache or the activations). Made once per thread, passed to every load.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// Streaming weight load: not kept in L1, evict-first in L2.
__device__ __forceinline__ uint4 ld_stream(const uint4* p, uint64_t pol) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "l"(pol));
  return r;
}

// Pull [p, p + bytes) into L2 without waiting (the copy engine does it; no registers held).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Programmatic dependent launch: wait until the previous kernel's writes are visible (a no-op
// when launched without the attribute), and let the next kernel start its prologue.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// (a & b) | c in one instruction: the mask-and-magic step of the dequantization.
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

__device__ __forceinline__ __half2 h2(uint32_t u) {
  __half2 h;
  static_assert(sizeof(h) == sizeof(u));
  memcpy(&h, &u, sizeof(u));
  return h;
}
__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
__device__ __forceinline__ float hsum(__half2 v) { return __low2float(v) + __high2float(v); }

// q - z for a pair of codes that lop3 put at mantissa bit p under magic M = 2^(10-p):
// t - (M + z), with M + z as bits: magic | z << p (z << p stays inside the mantissa).
__device__ __forceinline__ __half2 minus_zero(uint32_t t, uint32_t mz) {
  return __hsub2(h2(t), h2(mz));
}

// ---- One 4-bit (or 3-bit nibble) word: 8 codes against 8 x values -------------------------

// Integer dot: returns acc + sum (q - z) * x.
template <uint32_t kMask>
__device__ __forceinline__ __half2 nibble_word_int(uint32_t w, uint4 xv, uint32_t mz0,
                                                   uint32_t mz4, __half2 acc) {
  constexpr uint32_t lo = kMask * 0x00010001u, hi = kMask * 0x00100010u;
  const uint32_t w8 = w >> 8;
  acc = __hfma2(minus_zero(and_or(w, lo, 0x64006400u), mz0), h2(xv.x), acc);
  acc = __hfma2(minus_zero(and_or(w, hi, 0x54005400u), mz4), h2(xv.y), acc);
  acc = __hfma2(minus_zero(and_or(w8, lo, 0x64006400u), mz0), h2(xv.z), acc);
  acc = __hfma2(minus_zero(and_or(w8, hi, 0x54005400u), mz4), h2(xv.w), acc);
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
            h[r] = nibble_word_int<15>(word(f.q[r][j], w), xv, mz0[r][g], mz4[r][g], h[r]);
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
            const __half2 s = h2(scale_bits(f, r, g) * 0x00010001u);
            const uint32_t w0 = word(f.q[r][j], 2 * v), w1 = word(f.q[r][j], 2 * v + 1);
            // prmt: bytes (0,1) / (2,3) of the word each under a 0x64 byte = 1024 + q.
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w0, 0x64u, 0x4140u), mz), s),
                           h2(xv.x), h[r]);
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w0, 0x64u, 0x4342u), mz), s),
                           h2(xv.y), h[r]);
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w1, 0x64u, 0x4140u), mz), s),
                           h2(xv.z), h[r]);
            h[r] = __hfma2(__hmul2(minus_zero(__byte_perm(w1, 0x64u, 0x4342u), mz), s),
                           h2(xv.w), h[r]);
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
              const uint32_t w = word(f.q[r][j], 2 * pc + wi), w8 = w >> 8;
              const uint4 xa = xv[2 * wi], xb = xv[2 * wi + 1];
#pragma unroll
              for (int sl = 0; sl < 4; ++sl) {
                const uint32_t m = 0x00030003u << (2 * sl);
                h = __hfma2(minus_zero(and_or(w, m, magic[sl]), mz[sl]), h2(word(xa, sl)), h);
                h = __hfma2(minus_zero(and_or(w8, m, magic[sl]), mz[sl]), h2(word(xb, sl)), h);
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
          const uint32_t a = word(f.q[r][0], pc), b = word(f.q[r][1], pc), c = word(f.q[r][2], pc);
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
    for (int j = 0; j < 4; ++j) x[j] = __half22float2(h2(word(xv, j)));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float a = acc[r];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 w = __half22float2(h2(word(f.q[r], j)));
        a = fmaf(w.x, x[j].x, a);
        a = fmaf(w.y, x[j].y, a);
      }
      acc[r] = a;
    }
  }
};

// ---- Staging x --------------------------------------------------------------------------------

// The fused input ops compute exactly what the stand-alone kernels do (kernels/norm,
// kernels/activation): fp32 math on fp16 inputs, one rounding to fp16 of the staged value.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// The sum of v over a block of T threads (every thread gets it).
template <int T>
__device__ float block_sum(float v) {
  __shared__ float part[T / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < T / 32; ++w) total += part[w];
  return total;
}

__device__ __forceinline__ float sum_squares8(uint4 raw) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h2(word(raw, j)));
    ss += f.x * f.x + f.y * f.y;
  }
  return ss;
}

// RMSNorm's 1 / rms(x) over the block of T threads (every block stages the whole x anyway).
template <int T>
__device__ float input_inv_rms(const KParams& p, bool vec) {
  float ss = 0.f;
  if (vec) {
    for (int v = threadIdx.x; v < p.K / 8; v += T)
      ss += sum_squares8(__ldcg(reinterpret_cast<const uint4*>(p.x) + v));
  } else {
    for (int k = threadIdx.x; k < p.K; k += T) {
      const float f = __half2float(__ldcg(p.x + k));
      ss += f * f;
    }
  }
  return rsqrtf(block_sum<T>(ss) / (float)p.K + p.eps);
}

// The fused input op on 8 values: raw = x, other = the norm weights (RMSNorm) or up (SiLU).
__device__ __forceinline__ uint4 apply_input8(const KParams& p, uint4 raw, uint4 other,
                                              float inv_rms) {
  if (!p.norm_w && !p.silu_mul) return raw;
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = __half22float2(h2(word(raw, j))), b = __half22float2(h2(word(other, j)));
    const __half2 r = p.norm_w ? __floats2half2_rn(a.x * inv_rms * b.x, a.y * inv_rms * b.y)
                               : __floats2half2_rn(silu_times(a.x, b.x), silu_times(a.y, b.y));
    memcpy(&out[j], &r, 4);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The second operand of the fused input op for x values k .. k+7.
__device__ __forceinline__ uint4 input_other8(const KParams& p, int k) {
  if (p.norm_w) return __ldg(reinterpret_cast<const uint4*>(p.norm_w + k));
  if (p.silu_mul) return __ldcg(reinterpret_cast<const uint4*>(p.x + p.K + k));
  return make_uint4(0, 0, 0, 0);
}

// x values k .. k+7 (natural order, k + 8 <= K, 16-byte aligned) after the fused input op.
__device__ __forceinline__ uint4 input8(const KParams& p, int k, float inv_rms) {
  const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p.x + k));
  if (!p.norm_w && !p.silu_mul) return raw;
  return apply_input8(p, raw, input_other8(p, k), inv_rms);
}

__device__ __forceinline__ __half input1(const KParams& p, int k, float inv_rms) {
  const float a = __half2float(__ldcg(p.x + k));
  if (p.norm_w) return __float2half_rn(a * inv_rms * __half2float(__ldg(p.norm_w + k)));
  if (p.silu_mul) return __float2half_rn(silu_times(a, __half2float(__ldcg(p.x + p.K + k))));
  return __float2half_rn(a);
}

// x vectors per thread held in registers by the one-pass staging: 4 in a block of 512 threads,
// 8 in one of 256, so that either stages K <= 16384 in one pass.
constexpr int max_v(int T) { return T >= 512 ? 4 : 8; }

// The most 8-value vectors of x a block of T threads stages in one pass: max_v per thread.
constexpr int one_pass_max_vecs(int T) { return T * max_v(T); }

// Whether stage_x takes its one-pass path: natural order, 16-byte vectors, at most max_v(T) of
// them per thread.
template <int T>
__device__ __forceinline__ bool one_pass_staging(const KParams& p) {
  return p.perm == nullptr && (p.K % 8 == 0) &&
         ((reinterpret_cast<uintptr_t>(p.x) & 15u) == 0) &&
         ((reinterpret_cast<uintptr_t>(p.norm_w) & 15u) == 0) && p.K / 8 <= one_pass_max_vecs(T);
}

// The part of the staging that does not depend on the previous kernel, started before the
// wait on it: on the one-pass path, the RMSNorm weights of each x vector a thread will stage,
// copied (cp.async) into the very x_s slot that vector goes to. The same thread reads them
// back after the wait and overwrites the slot, so no barrier is needed. This takes an HBM round
// trip off the staging's path (norm weights are read once per token and leave L2 between
// steps), but the copies still queue behind the first step's weight loads in the SM's load
// path; the quantized kernel on sm_90 brings the norm weights and x by bulk copy instead
// (7B decode +3%, kernels/gemv/NOTES.md), and uses this only below sm_90.
template <int C, int T>
__device__ __forceinline__ void stage_x_early(const KParams& p, uint4* x_s) {
  if (!p.norm_w || !one_pass_staging<T>(p)) return;
  constexpr int V = C / 8;
  constexpr int kMaxV = max_v(T);
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    const int v = threadIdx.x + i * T;
    if (v < p.K / 8) cp_async16(smem_u32(&x_s[(v % V) * p.nch + v / V]), p.norm_w + 8 * v);
  }
}

// x_s[j * n + c] = x values k = c*C + 8j .. +7 of the permuted K axis (zero past K), for
// n = p.nch pieces of C codes (chunks of the fp16 kernel, units of the quantized one), staged by
// a block of T threads after stage_x_early<C, T>. x and residual are read with ld.global.cg:
// written by the previous kernel, which with programmatic dependent launch may still have been
// running when this one started.
//
// x_raw (one-pass path only): when not null, x in its natural order in shared memory, landing
// from a bulk copy that completes on `bar`; the values are read from there instead of L2.
template <int C, int T>
__device__ __forceinline__ void stage_x(const KParams& p, uint4* x_s, __half* x_nat,
                                        const uint4* x_raw = nullptr, const uint4* n_raw = nullptr,
                                        uint64_t* bar = nullptr) {
  constexpr int V = C / 8;
  constexpr int kMaxV = max_v(T);
  const int nvec = p.nch * V;
  const bool vec = (p.K % 8 == 0) && ((reinterpret_cast<uintptr_t>(p.x) & 15u) == 0) &&
                   ((reinterpret_cast<uintptr_t>(p.norm_w) & 15u) == 0);
  auto slot = [&](int v) -> uint4& { return x_s[(v % V) * p.nch + v / V]; };
  if (one_pass_staging<T>(p)) {
    // One pass: every load of x (and of up) in flight at once, then the RMSNorm reduction over
    // the registers. (The loop below reads x twice for RMSNorm, each pass a round trip to L2,
    // and waits on every vector of a SiLU input in turn.) The norm weights are already in the
    // slots (stage_x_early), or land in n_raw with x_raw (bulk copies).
    const int nnat = p.K / 8;
    uint4 a[kMaxV], b[kMaxV];
#pragma unroll
    for (int i = 0; i < kMaxV; ++i) {
      const int v = threadIdx.x + i * T;
      if (v < nnat) {
        if (!x_raw) a[i] = __ldcg(reinterpret_cast<const uint4*>(p.x) + v);
        if (!p.norm_w) b[i] = input_other8(p, 8 * v);
      }
    }
    if (x_raw) {
      mbar_wait(bar, 0);
#pragma unroll
      for (int i = 0; i < kMaxV; ++i) {
        const int v = threadIdx.x + i * T;
        if (v < nnat) {
          a[i] = x_raw[v];
          if (p.norm_w) b[i] = n_raw[v];
        }
      }
    } else if (p.norm_w) {
      cp_async_wait_all();
#pragma unroll
      for (int i = 0; i < kMaxV; ++i) {
        const int v = threadIdx.x + i * T;
        if (v < nnat) b[i] = slot(v);
      }
    }
    float inv_rms = 1.f;
    if (p.norm_w) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxV; ++i)
        if (threadIdx.x + i * T < nnat) ss += sum_squares8(a[i]);
      inv_rms = rsqrtf(block_sum<T>(ss) / (float)p.K + p.eps);
    }
#pragma unroll
    for (int i = 0; i < kMaxV; ++i) {
      const int v = threadIdx.x + i * T;
      if (v < nnat) slot(v) = apply_input8(p, a[i], b[i], inv_rms);
    }
    for (int v = nnat + threadIdx.x; v < nvec; v += T) slot(v) = make_uint4(0, 0, 0, 0);
    return;
  }
  const float inv_rms = p.norm_w ? input_inv_rms<T>(p, vec) : 1.f;
  if (p.perm == nullptr) {
    for (int v = threadIdx.x; v < nvec; v += T) {
      const int k = v * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (vec) {
        if (k < p.K) val = input8(p, k, inv_rms);
      } else {
        __half e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = k + i < p.K ? input1(p, k + i, inv_rms) : __half(0.f);
        memcpy(&val, e, sizeof(val));
      }
      slot(v) = val;
    }
  } else {
    if (vec) {
      for (int v = threadIdx.x; v < p.K / 8; v += T)
        reinterpret_cast<uint4*>(x_nat)[v] = input8(p, v * 8, inv_rms);
    } else {
      for (int k = threadIdx.x; k < p.K; k += T) x_nat[k] = input1(p, k, inv_rms);
    }
    __syncthreads();
    for (int v = threadIdx.x; v < nvec; v += T) {
      const int k = v * 8;
      const int4 i0 = __ldg(reinterpret_cast<const int4*>(p.perm + k));
      const int4 i1 = __ldg(reinterpret_cast<const int4*>(p.perm + k + 4));
      const int idx[8] = {i0.x, i0.y, i0.z, i0.w, i1.x, i1.y, i1.z, i1.w};
      __half e[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = k + i < p.K ? x_nat[idx[i]] : __half(0.f);
      uint4 val;
      memcpy(&val, e, sizeof(val));
      slot(v) = val;
    }
  }
}

// Sums each of a warp's R row partials over its 32 lanes (every lane gets every sum, in acc)
// and returns row `lane`'s sum to lanes 0 .. R-1, which store the rows.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&acc)[R], int lane) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
  float mine = acc[0];
#pragma unroll
  for (int r = 1; r < R; ++r)
    if (lane == r) mine = acc[r];
  return mine;
}

__device__ __forceinline__ void store_row(const KParams& p, int row, float v) {
  if (row >= p.N) return;
  if (p.residual) v += __half2float(__ldcg(p.residual + row));
  p.y[row] = __float2half_rn(v);
}
// The same with the residual already loaded (r).
__device__ __forceinline__ void store_row_plus(const KParams& p, int row, float v, float r) {
  if (row < p.N) p.y[row] = __float2half_rn(v + r);
}

// ---- The kernel --------------------------------------------------------------------------------

template <class Op>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(const KParams p) {
  constexpr int R = Op::kRows, U = Op::kUnroll, C = Op::kCodes;
  extern __shared__ uint4 smem[];
  uint4* x_s = smem;
  float* red = reinterpret_cast<float*>(x_s + static_cast<size_t>(Op::kVecs) * p.nch);
  __half* x_nat = reinterpret_cast<__half*>(red + kWarps * 4);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ks = p.k_split;
  const int kw = warp % ks, rg = warp / ks;
  const int rows_per_tile = R * (kWarps / ks);

  // The weights do not depend on the previous kernel: start this block's first tile towards L2
  // before waiting for it.
  if (blockIdx.x < p.tiles && threadIdx.x < rows_per_tile) {
    const int row = min(int(blockIdx.x) * rows_per_tile + int(threadIdx.x), p.N - 1);
    prefetch_l2(p.codes + static_cast<int64_t>(row) * p.row_stride,
                static_cast<uint32_t>(p.row_stride * 16));
  }
  stage_x_early<C, kThreads>(p, x_s);
  grid_dependency_wait();
  allow_dependents();
  stage_x<C, kThreads>(p, x_s, x_nat);
  __syncthreads();

  const uint64_t pol = evict_first_policy();
  const int step = 32 * ks;
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int row0 = tile * rows_per_tile + rg * R;
    const uint4* rowp[R];
    int64_t srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, p.N - 1);  // rows past N repeat the last one, unwritten
      rowp[r] = p.codes + static_cast<int64_t>(row) * p.row_stride;
      srow[r] = static_cast<int64_t>(row) * p.G;
    }

    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;

    for (int c = kw * 32 + lane; c < p.nch; c += U * step) {
      typename Op::Frag f[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int cu = c + u * step;
        if (u == 0 || cu < p.nch) Op::load(f[u], p, rowp, srow, cu, pol);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int cu = c + u * step;
        if (u == 0 || cu < p.nch) Op::compute(f[u], x_s + cu, p.nch, acc);
      }
    }

    const float mine = warp_sum_rows(acc, lane);

    if (ks == 1) {
      if (lane < R) store_row(p, row0 + lane, mine);
    } else {
      if (lane < R) red[warp * R + lane] = mine;
      __syncthreads();
      if (int(threadIdx.x) < rows_per_tile) {
        const int t = threadIdx.x, g = t / R, r = t % R;
        float v = 0.f;
        for (int k = 0; k < ks; ++k) v += red[(g * ks + k) * R + r];
        store_row(p, tile * rows_per_tile + t, v);
      }
      __syncthreads();
    }
  }
}

// What a call fixes at compile time. The quantized kernel tests its optional inputs (zero
// points, act-order permutation, RMSNorm weights, residual, SiLU epilogue) at run time; in the
// inner loop and the staging those tests cost registers (4-bit g128: 123, against 84-94 with
// them folded away) and time. The symmetric 4-bit kernels are therefore also compiled once per
// combination a decode step uses: act-order or not, times the fused ops of its four GEMVs (qkv:
// RMSNorm; o and down: residual; gate|up: RMSNorm and the SiLU epilogue; and none, as the
// benchmarks and other callers run it). kDynamic keeps every test at run time: the other bit
// widths, asymmetric weights (their zero points take the registers back: 109-128 compiled in)
// and any other combination (the SiLU-times-up input op). Measured on the H200 (kestrel bench
// -p 512 -n 128 -r 3, two rounds in one run): 7B 600 -> 622 tokens/s, 1.1B 1,580 -> 1,663.
enum SpecFlags : int { kPerm = 1, kNorm = 2, kResidual = 4, kSiluPair = 8 };
constexpr int kDynamic = -1;

// p with the optional inputs that kSpec rules out set to none (so that the compiler drops
// their code), and those it requires assumed present.
template <int kSpec>
__device__ __forceinline__ KParams specialize(const KParams& in) {
  KParams p = in;
  if constexpr (kSpec != kDynamic) {
    p.zeros = nullptr;
    p.silu_mul = false;
    if constexpr (kSpec & kPerm) __builtin_assume(p.perm != nullptr); else p.perm = nullptr;
    if constexpr (kSpec & kNorm) __builtin_assume(p.norm_w != nullptr); else p.norm_w = nullptr;
    if constexpr (kSpec & kResidual) __builtin_assume(p.residual != nullptr);
    else p.residual = nullptr;
    if constexpr (kSpec & kSiluPair) __builtin_assume(p.silu_pair != 0); else p.silu_pair = 0;
  }
  return p;
}

// The flags of a call, or kDynamic where no specialized kernel covers it.
int spec_of(const KParams& p) {
  if (p.zeros || p.silu_mul) return kDynamic;
  const int ops = (p.norm_w ? kNorm : 0) | (p.residual ? kResidual : 0) |
                  (p.silu_pair ? kSiluPair : 0);
  switch (ops) {
    case 0: case kNorm: case kResidual: case kNorm | kSiluPair: return (p.perm ? kPerm : 0) | ops;
    default: return kDynamic;
  }
}

// The quantized kernel: blocks of kW warps, kQuantWarps per SM (one block of 16, or two of 8);
// warp w of the grid owns the rows [N*w/W, N*(w+1)/W) and streams them kQuantRows at a time,
// unit by unit (module comment).
template <int BITS, int GS, int kSpec, int kW = kQuantWarps>
__global__ void __launch_bounds__(32 * kW, kQuantWarps / kW) gemv_quant_kernel(const KParams p_in) {
  static_assert(kQuantWarps % kW == 0, "whole blocks per SM");
  const KParams p = specialize<kSpec>(p_in);
  constexpr int kT = 32 * kW;
  using Op = QuantOp<BITS, GS>;
  constexpr int R = kQuantRows;
  static_assert(R == 2, "the SiLU epilogue takes a gate row and an up row per step");
  extern __shared__ uint4 smem[];
  const size_t codes = static_cast<size_t>(Op::kVecs) * 8 * p.nch;  // padded K
  uint4* x_s = smem;
  __half* x_nat = reinterpret_cast<__half*>(x_s + codes / 8);
  __half* n_raw = x_nat + codes;  // the RMSNorm weights (bulk path)
  uint64_t* bar = reinterpret_cast<uint64_t*>(n_raw + codes);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t wg = int64_t(blockIdx.x) * kW + warp, W = int64_t(gridDim.x) * kW;
  // With the SiLU epilogue a step takes the pair (gate row g, up row g + silu_pair) and the
  // warps share the N / 2 pairs; otherwise R consecutive rows of the warp's run.
  const int rstep = p.silu_pair ? p.silu_pair : 1, per_step = p.silu_pair ? 1 : R;
  const int64_t n_rows = p.silu_pair ? p.silu_pair : p.N;
  const int rb = static_cast<int>(n_rows * wg / W), re = static_cast<int>(n_rows * (wg + 1) / W);
  const int iters = (p.nch + 31) / 32;  // unit groups per row (p.nch = units here)
  const int steps = (re - rb + per_step - 1) / per_step * iters;
  const uint64_t pol = evict_first_policy();
  auto rows_at = [&](int row0) { return p.silu_pair ? R : min(R, re - row0); };

  // The weights do not depend on the previous kernel: load the first step into registers
  // before waiting for it. (A bulk L2 prefetch of the warp's whole run of rows here made every
  // shape 15-30% slower: the prefetches queue ahead of the loads that need the data now.)
  typename Op::Frag f;
  if (steps > 0 && lane < p.nch) Op::load(f, p, rb, rstep, rows_at(rb), 0, lane, pol);
  // x comes from the previous kernel: one bulk copy into x_nat after the wait (and the RMSNorm
  // weights one into n_raw before it). Read with ld.global, x and the norm weights queued
  // behind this SM's weight loads issued above (~8 MB over the GPU) and took 2.3-3.9 us to
  // stage (kernels/gemv/NOTES.md, the timeline); the bulk copies take another path.
  // (smem_bytes sized x_nat and n_raw for kQuantThreads' one-pass staging.)
  const bool bulk = has_bulk_copy() && one_pass_staging<kQuantThreads>(p) &&
                    (kT == kQuantThreads || one_pass_staging<kT>(p));
  if (bulk) {
    if (threadIdx.x == 0) {
      mbar_init(bar, 1);
      fence_mbar_init();
      if (p.norm_w) bulk_copy_g2s_no_arrive(n_raw, p.norm_w, static_cast<uint32_t>(p.K) * 2, bar);
    }
    __syncthreads();
  } else {
    stage_x_early<Op::kUnitCodes, kT>(p, x_s);
  }
  grid_dependency_wait();
  if (bulk && threadIdx.x == 0) bulk_copy_g2s(x_nat, p.x, static_cast<uint32_t>(p.K) * 2, bar);
  allow_dependents();
  // The residual of the warp's rows (written by the kernels before), loaded now so that the
  // store at the end of the run is not one more round trip: lane l holds row rb + l.
  const bool res_early = p.residual != nullptr && re - rb <= 32;
  float res = 0.f;
  if (res_early && lane < re - rb) res = __half2float(__ldcg(p.residual + rb + lane));
  stage_x<Op::kUnitCodes, kT>(p, x_s, x_nat,
                                          bulk ? reinterpret_cast<const uint4*>(x_nat) : nullptr,
                                          reinterpret_cast<const uint4*>(n_raw), bar);
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  int row0 = rb, i = 0;
  for (int s = 0; s < steps; ++s) {
    const int nrows = rows_at(row0);
    const int u = 32 * i + lane;
    if (u < p.nch) {
      if (s > 0) Op::load(f, p, row0, rstep, nrows, i, lane, pol);
      Op::compute(f, p, x_s + u, p.nch, acc);
    }
    if (++i == iters) {
      const float mine = warp_sum_rows(acc, lane);
      if (p.silu_pair) {
        // As the gate|up GEMV writing fp16 and silu_mul staging it: both rounded to fp16,
        // then fp32 math, one rounding.
        if (lane == 0)
          p.y[row0] = __float2half_rn(silu_times(__half2float(__float2half_rn(acc[0])),
                                                 __half2float(__float2half_rn(acc[1]))));
      } else if (res_early) {
        const float r = __shfl_sync(0xFFFFFFFFu, res, (row0 - rb + lane) & 31);
        if (lane < nrows) store_row_plus(p, row0 + lane, mine, r);
      } else if (lane < nrows) {
        store_row(p, row0 + lane, mine);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = 0.f;
      i = 0;
      row0 += per_step;
    }
  }
}

// ---- Dispatch ---------------------------------------------------------------------------------

using Kernel = void (*)(KParams);

// The compiled configurations: bits {2, 3, 4, 8} x effective group {32, 64, 128, per row}.
template <int B>
Kernel quant_kernel_for_group(int gs) {
  switch (gs) {
    case 0: return gemv_quant_kernel<B, 0, kDynamic>;
    case 32: return gemv_quant_kernel<B, 32, kDynamic>;
    case 64: return gemv_quant_kernel<B, 64, kDynamic>;
    case 128: return gemv_quant_kernel<B, 128, kDynamic>;
    default: return nullptr;
  }
}

// Warps per block of a specialized kernel: two blocks of 8 per SM where the weight is large
// (K and N >= 4096 at 4 bits: every lane of a warp has a unit of each row, and the grid has
// about two rows per warp), one block of 16 otherwise. With two blocks, the next kernel's block
// starts (and issues its first weight loads) on an SM as soon as half of it is done. Measured
// on the H200, kestrel bench -p 512 -n 128 -r 3, tokens/s: the 7B, whose four GEMVs all qualify,
// 623 -> 635 (o and down alone on 8 warps: 629; qkv or gate|up alone: 621); the 1.1B (K = 2048
// on three of its four) lost 1-4% with any of its GEMVs on 8 warps, 1,665 -> 1,600 with all.
// KESTREL_GEMV_BLOCK_WARPS=16 or 8 in the environment forces one size, for A/B runs.
int spec_block_warps(int64_t N, int units) {
  static const int forced = [] {
    const char* e = std::getenv("KESTREL_GEMV_BLOCK_WARPS");
    const int w = e ? std::atoi(e) : 0;
    return w == 8 || w == 16 ? w : 0;
  }();
  if (forced) return forced;
  return units >= 32 && N >= 4096 ? 8 : kQuantWarps;
}

struct QuantKernel {
  Kernel k;
  int warps;
};

// The symmetric 4-bit kernel of group size GS for a call's flags (spec_of, not kDynamic).
template <int GS, int OPS>
QuantKernel spec_kernel_for_perm(bool perm, int warps) {
  if (warps == 8)
    return {perm ? gemv_quant_kernel<4, GS, OPS | kPerm, 8> : gemv_quant_kernel<4, GS, OPS, 8>, 8};
  return {perm ? gemv_quant_kernel<4, GS, OPS | kPerm> : gemv_quant_kernel<4, GS, OPS>,
          kQuantWarps};
}

template <int GS>
QuantKernel spec_kernel_for_group(int spec, int warps) {
  const bool perm = spec & kPerm;
  switch (spec & ~kPerm) {
    case 0: return spec_kernel_for_perm<GS, 0>(perm, warps);
    case kNorm: return spec_kernel_for_perm<GS, kNorm>(perm, warps);
    case kResidual: return spec_kernel_for_perm<GS, kResidual>(perm, warps);
    case kNorm | kSiluPair: return spec_kernel_for_perm<GS, kNorm | kSiluPair>(perm, warps);
    default: return {nullptr, 0};
  }
}

// The specialized kernel for a call's flags in blocks of `warps` (8 or 16), or {nullptr, 0}
// (then the kDynamic one serves).
QuantKernel spec_kernel(int bits, int gs, int spec, int warps) {
  if (bits != 4 || spec == kDynamic) return {nullptr, 0};
  switch (gs) {
    case 0: return spec_kernel_for_group<0>(spec, warps);
    case 32: return spec_kernel_for_group<32>(spec, warps);
    case 64: return spec_kernel_for_group<64>(spec, warps);
    case 128: return spec_kernel_for_group<128>(spec, warps);
    default: return {nullptr, 0};
  }
}

// Whether gemv uses the specialized kernels (gemv_use_specialized): on unless
// KESTREL_GEMV_GENERIC=1 is set, for A/B runs.
std::atomic<bool>& use_specialized() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("KESTREL_GEMV_GENERIC");
    return !(e && std::string(e) == "1");
  }()};
  return on;
}

Kernel quant_kernel(int bits, int gs) {
  Kernel k = nullptr;
  switch (bits) {
    case 2: k = quant_kernel_for_group<2>(gs); break;
    case 3: k = quant_kernel_for_group<3>(gs); break;
    case 4: k = quant_kernel_for_group<4>(gs); break;
    case 8: k = quant_kernel_for_group<8>(gs); break;
    default: break;
  }
  if (!k)
    throw Error("gemv: no kernel compiled for bits=" + std::to_string(bits) +
                ", effective group size " + std::to_string(gs) +
                " (compiled: bits 2/3/4/8 x group 32/64/128/per-row)");
  return k;
}

// Raises a kernel's dynamic shared-memory limit when a block needs more than the default 48 KB,
// once per (device, kernel): to the device's opt-in limit less the kernel's static shared
// memory (asking for the whole opt-in limit is an invalid value when the kernel has any).
void ensure_smem(Kernel k, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> raised;
  const DeviceInfo& d = current_device_info();
  std::lock_guard<std::mutex> lock(mu);
  size_t& cur = raised[{d.id, reinterpret_cast<const void*>(k)}];
  if (cur >= bytes) return;
  cudaFuncAttributes attr{};
  KESTREL_CUDA_CHECK(cudaFuncGetAttributes(&attr, k));
  const size_t limit = d.smem_per_block_optin > attr.sharedSizeBytes
                           ? d.smem_per_block_optin - attr.sharedSizeBytes
                           : 0;
  if (bytes > limit)
    throw Error("gemv: a block needs " + std::to_string(bytes) + " bytes of shared memory for x, " +
                "device " + std::to_string(d.id) + " allows " + std::to_string(limit) +
                " (K too large)");
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(limit)));
  cur = limit;
}

// Resident blocks per SM of a kernel at a shared-memory size (cached: queried per call it would
// cost microseconds of host time per GEMV).
int blocks_per_sm(Kernel k, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> cache;
  const DeviceInfo& d = current_device_info();
  ensure_smem(k, smem);
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(d.id, reinterpret_cast<const void*>(k), smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int occ = 0;
  KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, threads, smem));
  if (occ < 1)
    throw Error("gemv: a block with " + std::to_string(smem) +
                " bytes of shared memory does not fit on device " + std::to_string(d.id));
  cache.emplace(key, occ);
  return occ;
}

int64_t tiles_for(int64_t N, int rows, int ks) {
  const int64_t per_tile = int64_t(rows) * (kWarps / ks);
  return (N + per_tile - 1) / per_tile;
}

// k_split: the largest (up to 8) that still gives every lane `unroll` chunks of each row, so
// that a warp keeps its full set of loads in flight. Larger k_split means smaller row tiles,
// hence more tiles per block and an even tail. grid: at most the resident blocks, so that x
// is staged into shared memory once per block and blocks loop over tiles.
GemvLaunch plan_f16(Kernel k, int rows, int unroll, int64_t N, int64_t nch, size_t smem,
                    GemvLaunch hint) {
  const DeviceInfo& d = current_device_info();
  GemvLaunch out = hint;
  if (out.k_split == 0) {
    out.k_split = 1;
    while (out.k_split < kWarps && int64_t(32) * unroll * out.k_split * 2 <= nch) out.k_split *= 2;
  }
  if (out.k_split != 1 && out.k_split != 2 && out.k_split != 4 && out.k_split != 8)
    throw Error("gemv: k_split must be 1, 2, 4 or 8, got " + std::to_string(out.k_split));
  const int64_t tiles = tiles_for(N, rows, out.k_split);
  const int64_t resident = int64_t(blocks_per_sm(k, kThreads, smem)) * d.sm_count;
  const int64_t cap = out.grid > 0 ? out.grid : resident;
  out.grid = static_cast<int>(std::max<int64_t>(1, std::min(tiles, cap)));
  return out;
}

// Quantized: the resident blocks (one or two per SM), fewer when N gives each warp less than
// kQuantRows rows; every warp then takes an equal run of rows, so the grid only sets how many
// warps share N. k_split does not apply (a lane owns whole units of K).
GemvLaunch plan_quant(Kernel k, int warps, int64_t N, size_t smem, GemvLaunch hint) {
  const DeviceInfo& d = current_device_info();
  GemvLaunch out = hint;
  out.k_split = 1;
  const int64_t resident = int64_t(blocks_per_sm(k, 32 * warps, smem)) * d.sm_count;
  const int64_t useful = (N + int64_t(kQuantRows) * warps - 1) / (int64_t(kQuantRows) * warps);
  const int64_t cap = out.grid > 0 ? out.grid : std::min(resident, useful);
  out.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cap, INT32_MAX / warps)));
  return out;
}

void launch(Kernel k, const KParams& p, int grid, int threads, bool pdl, size_t smem,
            cudaStream_t s) {
  ensure_smem(k, smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(std::max(grid, 1)));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, p));
}

}  // namespace

size_t smem_bytes(int bits, int64_t chunks, bool has_perm) {
  // x_s; x in its natural order (the act-order gather's source, or where the bulk copy of x
  // lands); the RMSNorm weights and the mbarrier of the bulk copies. The bulk path is taken
  // only without act-order and for K <= 8 * one_pass_max_vecs (one_pass_staging), so that
  // codes <= 16384 here (K rounds up to a unit, which divides 16384).
  const size_t codes = static_cast<size_t>(chunks) * chunk_codes(bits);
  const bool bulk = !has_perm && codes <= 8 * size_t(one_pass_max_vecs(kQuantThreads));
  return codes * 2 + (has_perm || bulk ? codes * 2 : 0) + (bulk ? codes * 2 + 16 : 0);
}

GemvLaunch plan_quant_launch(int bits, int group_size, GemvLaunch hint) {
  quant_kernel(bits, group_size);  // throws for a format no kernel is compiled for
  GemvLaunch out = hint;
  out.k_split = 1;
  return out;
}

}  // namespace gemv_detail

using namespace gemv_detail;

void set_input(KParams& p, const GemvInput& in) {
  if (in.norm_w && in.silu_mul) throw Error("gemv: one fused input op at a time (norm or silu_mul)");
  p.norm_w = in.norm_w;
  p.eps = in.eps;
  p.silu_mul = in.silu_mul;
}

void gemv(const GemvWeight& w, const __half* x, __half* y, const __half* residual,
          cudaStream_t s, GemvInput in, GemvEpilogue out) {
  if (!w.device) throw Error("gemv: the weight is empty (not prepared, or freed)");
  KParams p{};
  set_input(p, in);
  if (out.silu_mul) {
    if (w.N % 2 != 0 || residual)
      throw Error("gemv: the SiLU epilogue needs an even N ([gate | up]) and no residual, got N=" +
                  std::to_string(w.N) + (residual ? " with a residual" : ""));
    p.silu_pair = static_cast<int>(w.N / 2);
  }
  p.codes = w.codes;
  p.row_stride = int64_t(w.planes) * w.chunks;
  p.scales = w.scales;
  p.zeros = w.zeros;
  p.perm = w.perm;
  p.x = x;
  p.y = y;
  p.residual = residual;
  p.N = static_cast<int>(w.N);
  p.K = static_cast<int>(w.K);
  p.nch = static_cast<int>(w.chunks / unit_chunks(w.bits));  // units per row
  p.G = static_cast<int>(w.groups);
  p.zero_const = w.zero_const;
  p.zero_offset = w.zero_offset;
  QuantKernel qk{nullptr, 0};
  if (use_specialized()) {
    const int spec = spec_of(p);
    qk = spec_kernel(w.bits, w.group_size, spec, spec_block_warps(w.N, p.nch));
    // Blocks of 8 warps only where two fit on an SM (x's shared memory grows with K).
    if (qk.k && qk.warps < kQuantWarps &&
        blocks_per_sm(qk.k, 32 * qk.warps, w.smem_bytes) * qk.warps < kQuantWarps)
      qk = spec_kernel(w.bits, w.group_size, spec, kQuantWarps);
  }
  if (!qk.k) qk = {quant_kernel(w.bits, w.group_size), kQuantWarps};
  // The grid per call (w.launch.grid 0): it depends on the block size of the kernel taken.
  const GemvLaunch l = plan_quant(qk.k, qk.warps, w.N, w.smem_bytes, w.launch);
  launch(qk.k, p, l.grid, 32 * qk.warps, l.pdl, w.smem_bytes, s);
}

void gemv_use_specialized(bool on) { use_specialized() = on; }

void gemv_f16(const __half* W, const __half* x, __half* y, int64_t N, int64_t K,
              const __half* residual, cudaStream_t s, GemvLaunch launch_hint, GemvInput in) {
  if (N <= 0 || K <= 0 || K % 8 != 0)
    throw Error("gemv_f16: need N > 0 and K a positive multiple of 8, got N=" +
                std::to_string(N) + " K=" + std::to_string(K));
  if ((reinterpret_cast<uintptr_t>(W) & 15u) || (reinterpret_cast<uintptr_t>(x) & 15u))
    throw Error("gemv_f16: W and x must be 16-byte aligned");
  if (N > INT32_MAX || K > INT32_MAX) throw Error("gemv_f16: N and K must fit in 32 bits");
  const Kernel k = gemv_kernel<F16Op>;
  const int64_t nch = K / 8;
  const size_t smem = static_cast<size_t>(K) * 2 + kWarps * 4 * sizeof(float);
  const GemvLaunch l = plan_f16(k, F16Op::kRows, F16Op::kUnroll, N, nch, smem, launch_hint);
  KParams p{};
  set_input(p, in);
  p.codes = reinterpret_cast<const uint4*>(W);
  p.row_stride = nch;
  p.x = x;
  p.y = y;
  p.residual = residual;
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.nch = static_cast<int>(nch);
  p.G = 0;
  p.k_split = l.k_split;
  p.tiles = static_cast<int>(tiles_for(N, F16Op::kRows, l.k_split));  // k_split: plan_f16 checked
  launch(k, p, std::min(l.grid, p.tiles), kThreads, l.pdl, smem, s);
}

}  // namespace kestrel::cuda
