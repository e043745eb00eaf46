// The batch-1 GEMV kernels' device code (gemv.cu describes the design), shared by the
// translation units that compile its kernels: gemv.cu (the run-time quantized kernel, the fp16
// GEMV, the dispatch) and gemv_spec2.cu, gemv_spec3.cu, gemv_spec4.cu, gemv_spec8.cu (the
// kernels specialized per bit width, compiled in parallel). Device code: include from .cu files
// only.
#pragma once

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
#include <type_traits>
#include <utility>

#include "kernels/common/bits.cuh"
#include "kernels/common/cp_async.cuh"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda::gemv_detail {

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
  // The op before the GEMV, fused into the staging of x (GemvInput): RMSNorm or LayerNorm
  // with these weights, or SiLU(gate) * up over an x that holds [gate | up].
  const __half* norm_w;  // nullptr = no norm
  float eps;
  bool silu_mul;
  bool layer_norm;       // with norm_w: LayerNorm, x <- (x - mean) * rstd * norm_w + norm_b
  const __half* norm_b;  // LayerNorm's bias, or nullptr
  // The op after it (quantized kernel, GemvEpilogue): y[i] = SiLU(row i) * row i + pair, for
  // i < N / 2, over a weight whose rows are [gate | up] (pair = N / 2); 0 = none.
  int silu_pair;
  // With it, or with res_index, where output i is stored: y[y_index[i]] (the next GEMV's
  // act-order permutation, inverted, so that it stages its x without a gather); nullptr = y[i].
  const int32_t* y_index;
  // Where row i's residual is read: residual[res_index[i]] (the residual stream held in another
  // permutation, GemvEpilogue::residual_index); nullptr = residual[i]. Set with y_index.
  const int32_t* res_index;
  // Added after the residual (GemvEpilogue::bias, ::relu): y[i] = (W x)_i + residual + bias[i],
  // then max(., 0) with relu_out. Only with a residual (a bias alone is passed as the residual).
  const __half* bias;
  bool relu_out;
};

using Kernel = void (*)(KParams);

struct QuantKernel {
  Kernel k;
  int warps;
};

// What a call fixes at compile time. The quantized kernel tests its optional inputs (zero
// points, act-order permutation, RMSNorm weights, residual, SiLU epilogue) at run time; in the
// inner loop and the staging those tests cost registers (4-bit g128: 123, against 84-94 with
// them folded away; 8-bit: 104 against 79-95) and time. The symmetric 3-, 4- and 8-bit kernels
// are therefore also compiled once per combination a decode step uses: act-order or not, times
// the fused ops of its four GEMVs (qkv: RMSNorm; o and down: residual; gate|up: RMSNorm and the
// SiLU epilogue; and none, as the benchmarks and other callers run it), and the norm with a
// residual: the qkv of families with q/k/v biases (Qwen2, OPT: the biases are its residual) and
// OPT's fc1 (its bias, then ReLU). Within the kernels that fix a norm, LayerNorm (with its bias)
// is a run-time choice, as are a bias after the residual and ReLU within those that fix a
// residual: each costs a test in the staging or the epilogue only. kDynamic keeps every
// test at run time: asymmetric weights (their zero points take the registers back: 109-128
// compiled in) and any other combination (the SiLU-times-up input op). The
// specialized kernels decode faster at every bit width they cover (measured: docs/gemv-notes.md);
// GemvLaunch::specialized = false runs the kDynamic kernel for all weights instead.
// kIndexed: the residual read and the output stored through res_index and y_index (o and down
// when the decode step keeps the residual stream in act-order permutations).
enum SpecFlags : int { kPerm = 1, kNorm = 2, kResidual = 4, kSiluPair = 8, kIndexed = 16 };
constexpr int kDynamic = -1;

// How a row step meets the warps (2, 3 and 4 bits, blocks of 16 warps; kWhole otherwise):
//   kWhole     a warp takes a step of R rows (or one SiLU pair), every unit group of them;
//   kHalfWarp  each half-warp takes a step (kHalf: rows of at most 16 units);
//   kWarpPair  two warps take a step, one unit group each (kPair: rows of 33-64 units).
enum class RowSplit { kWhole, kHalfWarp, kWarpPair };

// The specialized kernel of one bit width for a call's flags (spec_of, not kDynamic) in blocks
// of `warps` (8 or 16) with row steps split as `split` says, or {nullptr, 0} where none is
// compiled: one per gemv_spec*.cu.
QuantKernel spec_kernel_2bit(int gs, int spec, int warps, RowSplit split);
QuantKernel spec_kernel_3bit(int gs, int spec, int warps, RowSplit split);
QuantKernel spec_kernel_4bit(int gs, int spec, int warps, RowSplit split);
QuantKernel spec_kernel_8bit(int gs, int spec, int warps, RowSplit split);

namespace {

// ---- PTX --------------------------------------------------------------------------------------

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

// ---- Staging x --------------------------------------------------------------------------------

// The fused input ops compute what the stand-alone kernels do (kernels/norm, kernels/activation):
// fp32 math on fp16 inputs, one rounding to fp16 of the staged value (LayerNorm's variance in
// one pass: layer_norm_stats).
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
// The same for two sums at once (one barrier).
template <int T>
__device__ float2 block_sum2(float2 v) {
  __shared__ float2 part2[T / 32];
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xFFFFFFFFu, v.x, o);
    v.y += __shfl_xor_sync(0xFFFFFFFFu, v.y, o);
  }
  if ((threadIdx.x & 31) == 0) part2[threadIdx.x >> 5] = v;
  __syncthreads();
  float2 total = make_float2(0.f, 0.f);
#pragma unroll
  for (int w = 0; w < T / 32; ++w) total.x += part2[w].x, total.y += part2[w].y;
  return total;
}

__device__ __forceinline__ float sum_squares8(uint4 raw) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(as_h2(word_of(raw, j)));
    ss += f.x * f.x + f.y * f.y;
  }
  return ss;
}

// sum(x - c) and sum((x - c)^2) over 8 values.
__device__ __forceinline__ float2 shifted_sums8(uint4 raw, float c) {
  float s = 0.f, ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(as_h2(word_of(raw, j)));
    const float a = f.x - c, b = f.y - c;
    s += a + b;
    ss += a * a + b * b;
  }
  return make_float2(s, ss);
}

// What the fused norm applies: RMSNorm x * inv * w (inv = 1 / rms(x)), LayerNorm
// (x - mean) * inv * w + b (inv = 1 / std(x)).
struct NormStats {
  float mean = 0.f, inv = 1.f;
};

// LayerNorm's statistics from the block's sums of x - c and (x - c)^2. One pass and one
// barrier, as RMSNorm's: the stand-alone kernel's two passes (the mean, then the centred
// squares) cost the GEMV a second barrier in its staging, 1.3 us a call at OPT-6.7B's shapes
// (docs/performance.md). Shifted by c, one of x's own values, E[(x-c)^2] - E[x-c]^2 cancels only
// as far as |mean - c| exceeds the spread, a few standard deviations for a hidden state.
__device__ __forceinline__ NormStats layer_norm_stats(float2 sums, float c, const KParams& p) {
  const float m = sums.x / (float)p.K;
  const float var = fmaxf(sums.y / (float)p.K - m * m, 0.f);
  return NormStats{c + m, rsqrtf(var + p.eps)};
}

// The fused norm's statistics over x, from the 8-value vectors get(v), v < nvec, that this
// thread holds (v = threadIdx.x + i * T for i < kN; kN 0: every v of this thread, read as the
// loop goes). `shift`: x[0] (LayerNorm's c).
template <int T, int kN = 0, class Get>
__device__ __forceinline__ NormStats norm_stats8(const KParams& p, int nvec, float shift, Get get) {
  auto sum_of = [&](auto f, auto zero) {
    auto s = zero;
    auto add = [](auto& acc, auto v) {
      if constexpr (std::is_same_v<decltype(v), float2>) acc.x += v.x, acc.y += v.y;
      else acc += v;
    };
    if constexpr (kN > 0) {
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (threadIdx.x + i * T < nvec) add(s, f(get(i)));
    } else {
      for (int v = threadIdx.x; v < nvec; v += T) add(s, f(get(v)));
    }
    return s;
  };
  NormStats st;
  if (!p.layer_norm) {
    st.inv = rsqrtf(block_sum<T>(sum_of([](uint4 r) { return sum_squares8(r); }, 0.f)) /
                        (float)p.K +
                    p.eps);
    return st;
  }
  const float2 sums = block_sum2<T>(
      sum_of([shift](uint4 r) { return shifted_sums8(r, shift); }, make_float2(0.f, 0.f)));
  return layer_norm_stats(sums, shift, p);
}

// The same read from global memory one value at a time (x not in 16-byte vectors).
template <int T>
__device__ NormStats norm_stats1(const KParams& p) {
  NormStats st;
  if (!p.layer_norm) {
    float ss = 0.f;
    for (int k = threadIdx.x; k < p.K; k += T) {
      const float f = __half2float(__ldcg(p.x + k));
      ss += f * f;
    }
    st.inv = rsqrtf(block_sum<T>(ss) / (float)p.K + p.eps);
    return st;
  }
  const float c = __half2float(__ldcg(p.x));
  float2 sums = make_float2(0.f, 0.f);
  for (int k = threadIdx.x; k < p.K; k += T) {
    const float d = __half2float(__ldcg(p.x + k)) - c;
    sums.x += d;
    sums.y += d * d;
  }
  return layer_norm_stats(block_sum2<T>(sums), c, p);
}

__device__ __forceinline__ float norm1(const KParams& p, float a, float w, float b, NormStats st) {
  return p.layer_norm ? (a - st.mean) * st.inv * w + b : a * st.inv * w;
}

// The fused input op on 8 values: raw = x, other = the norm weights or up (SiLU), bias =
// LayerNorm's bias (zeros without one).
__device__ __forceinline__ uint4 apply_input8(const KParams& p, uint4 raw, uint4 other,
                                              NormStats st, uint4 bias) {
  if (!p.norm_w && !p.silu_mul) return raw;
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = __half22float2(as_h2(word_of(raw, j))), b = __half22float2(as_h2(word_of(other, j)));
    const float2 c = __half22float2(as_h2(word_of(bias, j)));
    const __half2 r = p.norm_w ? __floats2half2_rn(norm1(p, a.x, b.x, c.x, st),
                                                   norm1(p, a.y, b.y, c.y, st))
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
// LayerNorm's bias for x values k .. k+7 (zeros otherwise).
__device__ __forceinline__ uint4 input_bias8(const KParams& p, int k) {
  if (p.layer_norm && p.norm_b) return __ldg(reinterpret_cast<const uint4*>(p.norm_b + k));
  return make_uint4(0, 0, 0, 0);
}

// x values k .. k+7 (natural order, k + 8 <= K, 16-byte aligned) after the fused input op.
__device__ __forceinline__ uint4 input8(const KParams& p, int k, NormStats st) {
  const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p.x + k));
  if (!p.norm_w && !p.silu_mul) return raw;
  return apply_input8(p, raw, input_other8(p, k), st, input_bias8(p, k));
}

__device__ __forceinline__ __half input1(const KParams& p, int k, NormStats st) {
  const float a = __half2float(__ldcg(p.x + k));
  if (p.norm_w)
    return __float2half_rn(norm1(p, a, __half2float(__ldg(p.norm_w + k)),
                                 p.layer_norm && p.norm_b ? __half2float(__ldg(p.norm_b + k)) : 0.f,
                                 st));
  if (p.silu_mul) return __float2half_rn(silu_times(a, __half2float(__ldcg(p.x + p.K + k))));
  return __float2half_rn(a);
}

// x vectors per thread held in registers by the one-pass staging: 4 in a block of 512 threads,
// 8 in one of 256, so that either stages K <= 16384 in one pass.
constexpr int max_v(int T) { return T >= 512 ? 4 : 8; }

// The most 8-value vectors of x a block of T threads stages in one pass: max_v per thread.
constexpr int one_pass_max_vecs(int T) { return T * max_v(T); }

// Whether x can be staged in one pass: 16-byte vectors, at most max_v(T) of them per thread.
template <int T>
__device__ __forceinline__ bool one_pass_shape(const KParams& p) {
  return (p.K % 8 == 0) && ((reinterpret_cast<uintptr_t>(p.x) & 15u) == 0) &&
         ((reinterpret_cast<uintptr_t>(p.norm_w) & 15u) == 0) &&
         ((reinterpret_cast<uintptr_t>(p.norm_b) & 15u) == 0) && p.K / 8 <= one_pass_max_vecs(T);
}
// Whether stage_x takes its one-pass path from global memory: natural order (no act-order), a
// one-pass shape. (With act-order it takes it only from the bulk copies: x_raw.)
template <int T>
__device__ __forceinline__ bool one_pass_staging(const KParams& p) {
  return p.perm == nullptr && one_pass_shape<T>(p);
}

// The part of the staging that does not depend on the previous kernel, started before the
// wait on it: on the one-pass path, the RMSNorm weights of each x vector a thread will stage,
// copied (cp.async) into the very x_s slot that vector goes to. The same thread reads them
// back after the wait and overwrites the slot, so no barrier is needed. This takes an HBM round
// trip off the staging's path (norm weights are read once per token and leave L2 between
// steps), but the copies still queue behind the first step's weight loads in the SM's load
// path; the quantized kernel on sm_90 brings the norm weights and x by bulk copy instead
// (measured: docs/gemv-notes.md), and uses this only below sm_90.
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
// x_raw (one-pass shapes only): when not null, x in its natural order in shared memory, landing
// from a bulk copy that completes on `bar` (and the norm weights in n_raw, LayerNorm's bias in
// b_raw); the values are
// read from there instead of L2. With act-order, x_raw must be x_nat: the staged (normalised) x
// is written back over it in natural order, and the gather reads the permutation from perm_s
// (bulk-copied with the norm weights).
// kRegs = false compiles out the one-pass path that holds x in registers (callers that always
// take the bulk path where the shape allows it: the quantized kernel on sm_90).
template <int C, int T, bool kRegs = true>
__device__ __forceinline__ void stage_x(const KParams& p, uint4* x_s, __half* x_nat,
                                        const uint4* x_raw = nullptr, const uint4* n_raw = nullptr,
                                        uint64_t* bar = nullptr, const int32_t* perm_s = nullptr,
                                        const uint4* b_raw = nullptr) {
  constexpr int V = C / 8;
  constexpr int kMaxV = max_v(T);
  const int nvec = p.nch * V;
  const bool vec = (p.K % 8 == 0) && ((reinterpret_cast<uintptr_t>(p.x) & 15u) == 0) &&
                   ((reinterpret_cast<uintptr_t>(p.norm_w) & 15u) == 0) &&
                   ((reinterpret_cast<uintptr_t>(p.norm_b) & 15u) == 0);
  auto slot = [&](int v) -> uint4& { return x_s[(v % V) * p.nch + v / V]; };
  // The gather of act-order x_s[k] = x_nat[perm[k]], perm from shared memory when given.
  auto gather = [&]() {
    for (int v = threadIdx.x; v < nvec; v += T) {
      const int k = v * 8;
      const int4 i0 = perm_s ? *reinterpret_cast<const int4*>(perm_s + k)
                             : __ldg(reinterpret_cast<const int4*>(p.perm + k));
      const int4 i1 = perm_s ? *reinterpret_cast<const int4*>(perm_s + k + 4)
                             : __ldg(reinterpret_cast<const int4*>(p.perm + k + 4));
      const int idx[8] = {i0.x, i0.y, i0.z, i0.w, i1.x, i1.y, i1.z, i1.w};
      __half e[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = k + i < p.K ? x_nat[idx[i]] : __half(0.f);
      uint4 val;
      memcpy(&val, e, sizeof(val));
      slot(v) = val;
    }
  };
  if (x_raw != nullptr) {
    // From the bulk copies: x (and the norm weights) already in shared memory, so two passes
    // over it (the sum of squares, then the staging) cost no round trip and hold no vectors
    // in registers, which the warps' first weight steps, loaded before the wait, occupy. (A
    // SiLU input's up half is read from L2 as it is staged.)
    const int nnat = p.K / 8;
    mbar_wait(bar, 0);
    NormStats st;
    if (p.norm_w)
      st = norm_stats8<T>(p, nnat, __low2float(as_h2(x_raw[0].x)), [&](int v) { return x_raw[v]; });
    auto other = [&](int v) { return p.norm_w ? n_raw[v] : input_other8(p, 8 * v); };
    auto bias = [&](int v) {
      return p.layer_norm && p.norm_b ? b_raw[v] : make_uint4(0, 0, 0, 0);
    };
    if (p.perm) {
      // Act-order (x_raw is x_nat): the staged x back over it in natural order (each thread
      // rewrites only the vectors it read), then the gather through the permutation.
      for (int v = threadIdx.x; v < nnat; v += T)
        reinterpret_cast<uint4*>(x_nat)[v] = apply_input8(p, x_raw[v], other(v), st, bias(v));
      __syncthreads();
      gather();
      return;
    }
    for (int v = threadIdx.x; v < nnat; v += T)
      slot(v) = apply_input8(p, x_raw[v], other(v), st, bias(v));
    for (int v = nnat + threadIdx.x; v < nvec; v += T) slot(v) = make_uint4(0, 0, 0, 0);
    return;
  }
  if (kRegs && one_pass_staging<T>(p)) {
    // One pass from L2: every load of x (and of up) in flight at once, then the RMSNorm
    // reduction over the registers. (The loop below reads x twice for RMSNorm, each pass a
    // round trip to L2, and waits on every vector of a SiLU input in turn.) The norm weights
    // are already in the slots (stage_x_early).
    const int nnat = p.K / 8;
    uint4 a[kMaxV], b[kMaxV];
#pragma unroll
    for (int i = 0; i < kMaxV; ++i) {
      const int v = threadIdx.x + i * T;
      if (v < nnat) {
        a[i] = __ldcg(reinterpret_cast<const uint4*>(p.x) + v);
        if (!p.norm_w) b[i] = input_other8(p, 8 * v);
      }
    }
    if (p.norm_w) {
      cp_async_wait_all();
#pragma unroll
      for (int i = 0; i < kMaxV; ++i) {
        const int v = threadIdx.x + i * T;
        if (v < nnat) b[i] = slot(v);
      }
    }
    NormStats st;
    if (p.norm_w)
      st = norm_stats8<T, kMaxV>(p, nnat, p.layer_norm ? __half2float(__ldcg(p.x)) : 0.f,
                                 [&](int i) { return a[i]; });
#pragma unroll
    for (int i = 0; i < kMaxV; ++i) {
      const int v = threadIdx.x + i * T;
      if (v < nnat) slot(v) = apply_input8(p, a[i], b[i], st, input_bias8(p, 8 * v));
    }
    for (int v = nnat + threadIdx.x; v < nvec; v += T) slot(v) = make_uint4(0, 0, 0, 0);
    return;
  }
  NormStats st;
  if (p.norm_w)
    st = vec ? norm_stats8<T>(p, p.K / 8, p.layer_norm ? __half2float(__ldcg(p.x)) : 0.f,
                              [&](int v) { return __ldcg(reinterpret_cast<const uint4*>(p.x) + v); })
             : norm_stats1<T>(p);
  if (p.perm == nullptr) {
    for (int v = threadIdx.x; v < nvec; v += T) {
      const int k = v * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (vec) {
        if (k < p.K) val = input8(p, k, st);
      } else {
        __half e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = k + i < p.K ? input1(p, k + i, st) : __half(0.f);
        memcpy(&val, e, sizeof(val));
      }
      slot(v) = val;
    }
  } else {
    if (vec) {
      for (int v = threadIdx.x; v < p.K / 8; v += T)
        reinterpret_cast<uint4*>(x_nat)[v] = input8(p, v * 8, st);
    } else {
      for (int k = threadIdx.x; k < p.K; k += T) x_nat[k] = input1(p, k, st);
    }
    __syncthreads();
    gather();
  }
}

// Sums a row pair's partials over each group of kWidth lanes (32: the warp; 16: each half-warp
// of the half-warp kernels, holding a pair of its own). The first exchange leaves row 0 on the
// group's low half and row 1 on its high half, which then sum as one: at kWidth 32, 7 shuffles
// and 5 adds instead of 10 and 10, a shorter epilogue at the end of every row pair (measured:
// docs/gemv-notes.md). acc becomes the group's two sums; lane l < 64 / kWidth gets row l of
// the warp's step (group l / 2, row l % 2).
template <int kWidth>
__device__ __forceinline__ float sum_row_pairs(float (&acc)[2], int lane) {
  constexpr int kHalfWidth = kWidth / 2;
  const bool hi = lane & kHalfWidth;
  float v = hi ? acc[1] : acc[0];
  v += __shfl_xor_sync(0xFFFFFFFFu, hi ? acc[0] : acc[1], kHalfWidth);
#pragma unroll
  for (int off = kHalfWidth / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  const int first = lane & ~(kWidth - 1) & 31;  // the group's first lane
  acc[0] = __shfl_sync(0xFFFFFFFFu, v, first);
  acc[1] = __shfl_sync(0xFFFFFFFFu, v, first | kHalfWidth);
  if constexpr (kWidth == 32) return lane == 1 ? acc[1] : acc[0];
  return __shfl_sync(0xFFFFFFFFu, v, (kHalfWidth * lane) & 31);
}

// Sums each of a warp's R row partials over its 32 lanes (every lane gets every sum, in acc)
// and returns row `lane`'s sum to lanes 0 .. R-1, which store the rows. R = 2 is the quantized
// kernel's (at K = 4096 every step ends a row pair): sum_row_pairs.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&acc)[R], int lane) {
  if constexpr (R == 2) {
    return sum_row_pairs<32>(acc, lane);
  } else {
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
}

// bar.sync on barrier `id` (1-15; 0 is __syncthreads') for `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The residual and bias of row i as the epilogue adds them (the bias from a weight: read with
// ld.global.nc; the residual, written by the kernel before, with ld.global.cg).
__device__ __forceinline__ float residual_of(const KParams& p, int row) {
  float r = __half2float(__ldcg(p.residual + (p.res_index ? __ldg(p.res_index + row) : row)));
  if (p.bias) r += __half2float(__ldg(p.bias + row));
  return r;
}
__device__ __forceinline__ __half finish(const KParams& p, float v) {
  return __float2half_rn(p.relu_out ? fmaxf(v, 0.f) : v);
}
__device__ __forceinline__ void store_row(const KParams& p, int row, float v) {
  if (row >= p.N) return;
  if (p.residual) v += residual_of(p, row);
  p.y[p.y_index ? __ldg(p.y_index + row) : row] = finish(p, v);
}
// The same with the residual (and bias) already loaded (r).
__device__ __forceinline__ void store_row_plus(const KParams& p, int row, float v, float r) {
  if (row < p.N) p.y[row] = finish(p, v + r);
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

// p with the optional inputs that kSpec rules out set to none (so that the compiler drops
// their code), and those it requires assumed present.
template <int kSpec>
__device__ __forceinline__ KParams specialize(const KParams& in) {
  KParams p = in;
  if constexpr (kSpec != kDynamic) {
    p.zeros = nullptr;
    p.silu_mul = false;
    if constexpr (kSpec & kPerm) __builtin_assume(p.perm != nullptr); else p.perm = nullptr;
    if constexpr (kSpec & kNorm) {
      __builtin_assume(p.norm_w != nullptr);
    } else {
      p.norm_w = nullptr;
      p.layer_norm = false;
      p.norm_b = nullptr;
    }
    if constexpr (kSpec & kResidual) {
      __builtin_assume(p.residual != nullptr);
    } else {
      p.residual = nullptr;
      p.bias = nullptr;
      p.relu_out = false;
    }
    if constexpr (kSpec & kSiluPair) {
      __builtin_assume(p.silu_pair != 0);
    } else {
      p.silu_pair = 0;
      if constexpr (!(kSpec & kIndexed)) p.y_index = nullptr;
    }
    if constexpr (kSpec & kIndexed) {
      __builtin_assume(p.res_index != nullptr);
      __builtin_assume(p.y_index != nullptr);
    } else {
      p.res_index = nullptr;
    }
  }
  return p;
}

// Registers per thread of the quantized kernel: what kQuantWarps / kW blocks per SM allow
// (128 at 16 warps per SM), except the RMSNorm-only role (qkv) in blocks of 8 warps: capped at
// 112 (121 uncapped; 12 bytes spill), so that beside its two blocks one 128-thread attention
// block (56 registers) stays resident on every SM, starts under PDL while the qkv GEMV runs and
// loads its chunk's K and V before the GEMV ends. The spill makes the GEMV alone slower, by
// less than the early K and V loads save attention in the decode step; a cap of 96 (room for
// two attention blocks) was slower (measured: docs/gemv-notes.md). Since the staging reads x
// from shared memory in two passes (stage_x) the role needs 84 registers, so the cap no longer
// binds and two attention blocks fit beside it.
constexpr int quant_reg_cap(int spec, int warps) {
  const int fit = 65536 / (32 * kQuantWarps) / 8 * 8;
  return spec != kDynamic && (spec & ~kPerm) == kNorm && warps == 8 ? 112 : fit;
}

// The quantized kernel: blocks of kW warps, kQuantWarps per SM (one block of 16, or two of 8);
// warp w of the grid owns a run of rows (dealt below) and streams them kQuantRows at a time,
// unit by unit (module comment).
template <int BITS, int GS, int kSpec, int kW = kQuantWarps, bool kHalf = false,
          bool kPair = false>
__global__ void __launch_bounds__(32 * kW) __maxnreg__(quant_reg_cap(kSpec, kW))
    gemv_quant_kernel(const KParams p_in) {
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
  // The act-order permutation (bulk path), then the mbarrier of the bulk copies.
  int32_t* perm_s = reinterpret_cast<int32_t*>(n_raw + codes);
  uint64_t* bar = reinterpret_cast<uint64_t*>(perm_s + (p.perm ? codes : 0));
  // LayerNorm's bias (bulk path), past the mbarrier's 16 bytes: launched with the bytes for it
  // only where there is one (gemv, layer_norm_smem).
  __half* b_raw = reinterpret_cast<__half*>(bar + 2);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t wg = int64_t(blockIdx.x) * kW + warp, W = int64_t(gridDim.x) * kW;
  float* xch = nullptr;  // kPair: [warp pair][step parity][row][lane], the second warp's sums
  if constexpr (kPair) {
    __shared__ float pair_sums[kW / 2 * 2 * 2 * 32];
    xch = pair_sums;
  }
  // With the SiLU epilogue a step takes the pair (gate row g, up row g + silu_pair) and the
  // warps share the N / 2 pairs; otherwise R consecutive rows of the warp's run.
  // kHalf (rows of at most 16 units: K <= 2048 at 3 and 4 bits, K <= 4096 at 2, where a
  // warp's lanes 16-31 would idle): the two half-warps take a row step each, lanes 16h ..
  // 16h + 15 the rows of half h, so a warp step is 2 R rows or two pairs (gemv.cu says why).
  const int half = kHalf ? lane >> 4 : 0, ulane = kHalf ? lane & 15 : lane;
  const int rstep = p.silu_pair ? p.silu_pair : 1, per_half = p.silu_pair ? 1 : R;
  const int per_step = kHalf ? 2 * per_half : per_half;
  const int64_t n_rows = p.silu_pair ? p.silu_pair : p.N;
  // kPair (rows of 33-64 units, blocks of 16 warps, at most one row step per pair of warps: the
  // 1.1B's down, 44 units): warps 2v and 2v + 1 take the same rows, unit groups 0 and 1 of
  // each, and meet in shared memory, so that a warp's step is one round trip, not two. The pairs
  // are dealt the rows as warps are otherwise (wu of Wu).
  static_assert(!(kHalf && kPair), "one split at a time");
  static_assert(!kPair || (R == 2 && kW == 16), "the exchange below: two rows, barriers 1-8");
  const int part = kPair ? warp & 1 : 0;
  const int64_t wu = kPair ? wg >> 1 : wg, Wu = kPair ? W >> 1 : W;
  // Rows dealt in whole steps: P steps of per_step rows, P / W to each warp and the P % W left
  // over one each to the first warps of the grid, whose blocks start first. In blocks of 8
  // warps (two per SM) the first blocks sit one per SM, so the extra steps load the SMs evenly,
  // and the blocks without them exit a step early, making room for the next kernel's. (Equal
  // runs of rows, n_rows * w / W, gave every block a few longer warps.) Where a warp has less
  // than a step, or in one block of 16 warps per SM, the equal runs stay: there whole steps
  // loaded some SMs with a step more than others, and the most loaded SM sets the GEMV's time
  // (measured, both ways: docs/gemv-notes.md).
  // The half-warp kernels deal whole (double) steps in equal runs of steps (step_runs): their
  // shapes give most warps one or two.
  const RowRun run = kHalf ? step_runs(n_rows, per_step, wu, Wu)
                           : warp_rows(n_rows, per_step, wu, Wu, kW < kQuantWarps);
  const int rb = run.begin, re = run.end;
  // Unit groups per row (p.nch = units here) that this warp takes, from group g0.
  const int iters = kPair ? 1 : (p.nch + 31) / 32, g0 = part;
  const int steps = (re - rb + per_step - 1) / per_step * iters;
  const uint64_t pol = evict_first_policy();
  // The step at row0: its rows (pairs) and, for this lane's half, the first row and the rows
  // loaded (past the run: none, computed as zeros, never stored).
  auto rows_at = [&](int row0) {
    if constexpr (kHalf) return min(per_step, re - row0);
    return p.silu_pair ? R : min(R, re - row0);
  };
  auto hrow = [&](int row0) { return row0 + half * per_half; };
  auto load_rows = [&](int row0) {
    if constexpr (!kHalf) return rows_at(row0);
    const int h0 = hrow(row0);
    return p.silu_pair ? (h0 < re ? R : 0) : max(0, min(R, re - h0));
  };

  // The weights do not depend on the previous kernel: load the first step into registers
  // before waiting for it. (A bulk L2 prefetch of the warp's whole run of rows here made every
  // shape slower: the prefetches queue ahead of the loads that need the data now.)
  typename Op::Frag f;
  int lrow = rb, li = 0;  // the row and unit group of the next step to load
  auto load_next = [&]() {
    if (32 * (li + g0) + ulane < p.nch)
      Op::load(f, p, hrow(lrow), rstep, load_rows(lrow), li + g0, ulane, pol);
    if (++li == iters) li = 0, lrow += per_step;
  };
  if (steps > 0) load_next();
  // Where the epilogue stores the warp's rows and reads their residual (GemvEpilogue's
  // out_index and residual_index, static like the weights): lane l holds row rb + l's, so that
  // no store waits on a load.
  const bool y_index_early = p.y_index != nullptr && re - rb <= 32;
  int y_index = 0, res_index = 0;
  if (y_index_early && lane < re - rb) {
    y_index = __ldg(p.y_index + rb + lane);
    if (p.res_index) res_index = __ldg(p.res_index + rb + lane);
  }
  // x comes from the previous kernel: one bulk copy into x_nat after the wait (and the RMSNorm
  // weights one into n_raw before it). Read with ld.global, x and the norm weights queued
  // behind this SM's weight loads issued above (~8 MB over the GPU), so the staging waited on
  // them (docs/gemv-notes.md, the timeline); the bulk copies take another path.
  // (smem_bytes sized x_nat and n_raw for kQuantThreads' one-pass staging.)
  // Act-order takes the bulk path too: its permutation comes by bulk copy before the wait
  // (it is a weight's), and the gather reads it from shared memory.
  const bool bulk = has_bulk_copy() &&
                    one_pass_shape<kQuantThreads>(p) &&
                    (kT == kQuantThreads || one_pass_shape<kT>(p));
  if (bulk) {
    if (threadIdx.x == 0) {
      mbar_init(bar, 1);
      fence_mbar_init();
      if (p.norm_w) bulk_copy_g2s_no_arrive(n_raw, p.norm_w, static_cast<uint32_t>(p.K) * 2, bar);
      if (p.layer_norm && p.norm_b)
        bulk_copy_g2s_no_arrive(b_raw, p.norm_b, static_cast<uint32_t>(p.K) * 2, bar);
      if (p.perm)
        bulk_copy_g2s_no_arrive(perm_s, p.perm, static_cast<uint32_t>(codes) * 4, bar);
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
  if (res_early && lane < re - rb) {
    res = __half2float(__ldcg(p.residual + (p.res_index ? res_index : rb + lane)));
    if (p.bias) res += __half2float(__ldg(p.bias + rb + lane));
  }
  // (On sm_90 every shape the one-pass path fits takes the bulk path.)
  stage_x<Op::kUnitCodes, kT, !has_bulk_copy()>(
      p, x_s, x_nat, bulk ? reinterpret_cast<const uint4*>(x_nat) : nullptr,
      reinterpret_cast<const uint4*>(n_raw), bar, bulk && p.perm ? perm_s : nullptr,
      reinterpret_cast<const uint4*>(b_raw));
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  int row0 = rb, i = 0;
  for (int s = 0; s < steps; ++s) {
    const int nrows = rows_at(row0);
    const int u = 32 * (i + g0) + ulane;
    if (u < p.nch) Op::compute(f, p, x_s + u, p.nch, acc);
    // The next step's loads go out before this step's epilogue (the warp's reduction of its
    // rows and their stores), so that the epilogue runs under their round trip.
    if (s + 1 < steps) load_next();
    bool own = true;  // this warp reduces and stores the step's rows
    if constexpr (kPair) {
      // Warp 2v + 1 hands its lanes' sums to warp 2v (slot by step parity: the writer reuses
      // a slot only after the barrier the reader passes once it has read it).
      float* slot = xch + ((warp >> 1) * 2 + (s & 1)) * 2 * 32;
      if (part) slot[lane] = acc[0], slot[32 + lane] = acc[1];
      named_barrier(1 + (warp >> 1), 64);
      if (part) {
        own = false;
      } else {
        acc[0] += slot[lane];
        acc[1] += slot[32 + lane];
      }
    }
    if (++i == iters) {  // the step's rows are summed: reduce and store them
      if (own) {
        const float mine = kHalf ? sum_row_pairs<16>(acc, lane) : warp_sum_rows(acc, lane);
        if (p.silu_pair) {
          // As the gate|up GEMV writing fp16 and silu_mul staging it: both rounded to fp16,
          // then fp32 math, one rounding.
          // (The two forms of the indexed store compile to the registers each was measured
          // with: one form for both took the whole-warp kernel in 8-warp blocks from 128 to 94.)
          const int pr = row0 + half;  // this half's pair
          int dst = pr;
          if constexpr (kHalf) {
            if (p.y_index) {
              const int e = __shfl_sync(0xFFFFFFFFu, y_index, (pr - rb) & 31);
              dst = y_index_early ? e : pr < re ? __ldg(p.y_index + pr) : 0;
            }
          } else if (p.y_index) {
            dst = y_index_early ? __shfl_sync(0xFFFFFFFFu, y_index, (row0 - rb) & 31)
                                : __ldg(p.y_index + row0);
          }
          if (kHalf ? ulane == 0 && pr < re : lane == 0)
            p.y[dst] = __float2half_rn(silu_times(__half2float(__float2half_rn(acc[0])),
                                                  __half2float(__float2half_rn(acc[1]))));
        } else if (res_early) {
          const float r = __shfl_sync(0xFFFFFFFFu, res, (row0 - rb + lane) & 31);
          if (p.res_index) {  // y_index too, and loaded early with it
            const int dst = __shfl_sync(0xFFFFFFFFu, y_index, (row0 - rb + lane) & 31);
            // (No ReLU here: gemv refuses it with an out_index, and this store's form is the
            // one its registers were measured with.)
            if (lane < nrows && row0 + lane < p.N) p.y[dst] = __float2half_rn(mine + r);
          } else if (lane < nrows) {
            store_row_plus(p, row0 + lane, mine, r);
          }
        } else if (lane < nrows) {
          store_row(p, row0 + lane, mine);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = 0.f;
      i = 0;
      row0 += per_step;
    }
  }
}

// ---- The specialized kernels of bit width B, by group size, flags and block size -------------

// The symmetric B-bit kernel of group size GS for a call's flags (spec_of, not kDynamic), in
// blocks of `warps`, its row steps split as `split` says. The split kernels are compiled in
// blocks of kQuantWarps: the half-warp ones for every op at 2, 3 and 4 bits (rows of at most 16
// units: K <= 4096 at 2 bits, whose units are 256 codes, so every linear of a 7B but down), the
// warp-pair ones for the down role's ops (none, residual, indexed residual) at 3 and 4 bits.
template <int B, int GS, int OPS>
QuantKernel spec_kernel_for_perm(bool perm, int warps, RowSplit split) {
  if (split == RowSplit::kWhole) {
    if (warps == 8)
      return {perm ? gemv_quant_kernel<B, GS, OPS | kPerm, 8> : gemv_quant_kernel<B, GS, OPS, 8>,
              8};
    return {perm ? gemv_quant_kernel<B, GS, OPS | kPerm> : gemv_quant_kernel<B, GS, OPS>,
            kQuantWarps};
  }
  if (warps != kQuantWarps) return {nullptr, 0};
  if constexpr (B == 2 || B == 3 || B == 4) {
    if (split == RowSplit::kHalfWarp)
      return {perm ? gemv_quant_kernel<B, GS, OPS | kPerm, kQuantWarps, true>
                   : gemv_quant_kernel<B, GS, OPS, kQuantWarps, true>,
              kQuantWarps};
  }
  if constexpr (B == 3 || B == 4) {
    if constexpr (OPS == 0 || OPS == kResidual || OPS == (kResidual | kIndexed))
      return {perm ? gemv_quant_kernel<B, GS, OPS | kPerm, kQuantWarps, false, true>
                   : gemv_quant_kernel<B, GS, OPS, kQuantWarps, false, true>,
              kQuantWarps};
  }
  return {nullptr, 0};
}

template <int B, int GS>
QuantKernel spec_kernel_for_group(int spec, int warps, RowSplit split) {
  const bool perm = spec & kPerm;
  switch (spec & ~kPerm) {
    case 0: return spec_kernel_for_perm<B, GS, 0>(perm, warps, split);
    case kNorm: return spec_kernel_for_perm<B, GS, kNorm>(perm, warps, split);
    case kResidual: return spec_kernel_for_perm<B, GS, kResidual>(perm, warps, split);
    case kNorm | kResidual:
      return spec_kernel_for_perm<B, GS, kNorm | kResidual>(perm, warps, split);
    case kNorm | kSiluPair:
      return spec_kernel_for_perm<B, GS, kNorm | kSiluPair>(perm, warps, split);
    case kResidual | kIndexed:
      return spec_kernel_for_perm<B, GS, kResidual | kIndexed>(perm, warps, split);
    default: return {nullptr, 0};
  }
}

template <int B>
QuantKernel spec_kernel_for_bits(int gs, int spec, int warps, RowSplit split) {
  switch (gs) {
    case 0: return spec_kernel_for_group<B, 0>(spec, warps, split);
    case 32: return spec_kernel_for_group<B, 32>(spec, warps, split);
    case 64: return spec_kernel_for_group<B, 64>(spec, warps, split);
    case 128: return spec_kernel_for_group<B, 128>(spec, warps, split);
    default: return {nullptr, 0};
  }
}

}  // namespace
}  // namespace kestrel::cuda::gemv_detail
