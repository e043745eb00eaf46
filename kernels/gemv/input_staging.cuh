// Staging x into shared memory, the first thing every block of the GEMV kernels does after the
// wait on the previous kernel: x in the layout the weight decoding reads (below), with the op
// before the GEMV fused in (Prologue: RMSNorm, LayerNorm, or SiLU(gate) * up) and act-order's
// gather through the permutation. Each block reads all of x anyway, so the fused op saves a
// kernel launch and a round trip of x through memory. The fused input ops compute what the
// stand-alone kernels do (kernels/norm, kernels/activation): fp32 math on fp16 inputs, one
// rounding to fp16 of the staged value (LayerNorm's variance in one pass: layer_norm_stats).
// Three paths (stage_x): from bulk copies already in shared memory (the quantized kernel on
// sm_90), in one pass from L2 with x held in registers, and a loop for any other shape.
//
// x in shared memory mirrors the packed layout (weight_decode.cuh): the 8 x values of word j
// of the unit (4-bit; two uint4 per 2-bit word, half a uint4 per 8-bit word) form uint4 number
// j of the unit, stored at x_s[j*units + u], so that the 32 lanes of a warp read 512
// contiguous bytes (no bank conflicts). With act-order the block first copies x in its natural
// order to shared memory, then gathers it through perm.
//
// Device code: include from .cu files only.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/common/bits.cuh"
#include "kernels/common/cp_async.cuh"
#include "kernels/gemv/gemv_params.cuh"

namespace kestrel::cuda::gemv_detail {
namespace {

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
  return NormStats{c + m, rsqrtf(var + p.pro.eps)};
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
  if (!p.pro.layer_norm) {
    st.inv = rsqrtf(block_sum<T>(sum_of([](uint4 r) { return sum_squares8(r); }, 0.f)) /
                        (float)p.K +
                    p.pro.eps);
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
  if (!p.pro.layer_norm) {
    float ss = 0.f;
    for (int k = threadIdx.x; k < p.K; k += T) {
      const float f = __half2float(__ldcg(p.x + k));
      ss += f * f;
    }
    st.inv = rsqrtf(block_sum<T>(ss) / (float)p.K + p.pro.eps);
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
  return p.pro.layer_norm ? (a - st.mean) * st.inv * w + b : a * st.inv * w;
}

// The fused input op on 8 values: raw = x, other = the norm weights or up (SiLU), bias =
// LayerNorm's bias (zeros without one).
__device__ __forceinline__ uint4 apply_input8(const KParams& p, uint4 raw, uint4 other,
                                              NormStats st, uint4 bias) {
  if (!p.pro.norm_w && !p.pro.silu_mul) return raw;
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = __half22float2(as_h2(word_of(raw, j))), b = __half22float2(as_h2(word_of(other, j)));
    const float2 c = __half22float2(as_h2(word_of(bias, j)));
    const __half2 r = p.pro.norm_w ? __floats2half2_rn(norm1(p, a.x, b.x, c.x, st),
                                                   norm1(p, a.y, b.y, c.y, st))
                               : __floats2half2_rn(silu_times(a.x, b.x), silu_times(a.y, b.y));
    memcpy(&out[j], &r, 4);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The second operand of the fused input op for x values k .. k+7.
__device__ __forceinline__ uint4 input_other8(const KParams& p, int k) {
  if (p.pro.norm_w) return __ldg(reinterpret_cast<const uint4*>(p.pro.norm_w + k));
  if (p.pro.silu_mul) return __ldcg(reinterpret_cast<const uint4*>(p.x + p.K + k));
  return make_uint4(0, 0, 0, 0);
}
// LayerNorm's bias for x values k .. k+7 (zeros otherwise).
__device__ __forceinline__ uint4 input_bias8(const KParams& p, int k) {
  if (p.pro.layer_norm && p.pro.norm_b)
    return __ldg(reinterpret_cast<const uint4*>(p.pro.norm_b + k));
  return make_uint4(0, 0, 0, 0);
}

// x values k .. k+7 (natural order, k + 8 <= K, 16-byte aligned) after the fused input op.
__device__ __forceinline__ uint4 input8(const KParams& p, int k, NormStats st) {
  const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p.x + k));
  if (!p.pro.norm_w && !p.pro.silu_mul) return raw;
  return apply_input8(p, raw, input_other8(p, k), st, input_bias8(p, k));
}

__device__ __forceinline__ __half input1(const KParams& p, int k, NormStats st) {
  const float a = __half2float(__ldcg(p.x + k));
  if (p.pro.norm_w)
    return __float2half_rn(norm1(p, a, __half2float(__ldg(p.pro.norm_w + k)),
                                 p.pro.layer_norm && p.pro.norm_b
                                     ? __half2float(__ldg(p.pro.norm_b + k))
                                     : 0.f,
                                 st));
  if (p.pro.silu_mul) return __float2half_rn(silu_times(a, __half2float(__ldcg(p.x + p.K + k))));
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
         ((reinterpret_cast<uintptr_t>(p.pro.norm_w) & 15u) == 0) &&
         ((reinterpret_cast<uintptr_t>(p.pro.norm_b) & 15u) == 0) &&
         p.K / 8 <= one_pass_max_vecs(T);
}
// Whether stage_x takes its one-pass path from global memory: natural order (no act-order), a
// one-pass shape. (With act-order it takes it only from the bulk copies: x_raw.)
template <int T>
__device__ __forceinline__ bool one_pass_staging(const KParams& p) {
  return p.pro.perm == nullptr && one_pass_shape<T>(p);
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
  if (!p.pro.norm_w || !one_pass_staging<T>(p)) return;
  constexpr int V = C / 8;
  constexpr int kMaxV = max_v(T);
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    const int v = threadIdx.x + i * T;
    if (v < p.K / 8) cp_async16(smem_u32(&x_s[(v % V) * p.nch + v / V]), p.pro.norm_w + 8 * v);
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
                   ((reinterpret_cast<uintptr_t>(p.pro.norm_w) & 15u) == 0) &&
                   ((reinterpret_cast<uintptr_t>(p.pro.norm_b) & 15u) == 0);
  auto slot = [&](int v) -> uint4& { return x_s[(v % V) * p.nch + v / V]; };
  // The gather of act-order x_s[k] = x_nat[perm[k]], perm from shared memory when given.
  auto gather = [&]() {
    for (int v = threadIdx.x; v < nvec; v += T) {
      const int k = v * 8;
      const int4 i0 = perm_s ? *reinterpret_cast<const int4*>(perm_s + k)
                             : __ldg(reinterpret_cast<const int4*>(p.pro.perm + k));
      const int4 i1 = perm_s ? *reinterpret_cast<const int4*>(perm_s + k + 4)
                             : __ldg(reinterpret_cast<const int4*>(p.pro.perm + k + 4));
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
    if (p.pro.norm_w)
      st = norm_stats8<T>(p, nnat, __low2float(as_h2(x_raw[0].x)), [&](int v) { return x_raw[v]; });
    auto other = [&](int v) { return p.pro.norm_w ? n_raw[v] : input_other8(p, 8 * v); };
    auto bias = [&](int v) {
      return p.pro.layer_norm && p.pro.norm_b ? b_raw[v] : make_uint4(0, 0, 0, 0);
    };
    if (p.pro.perm) {
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
        if (!p.pro.norm_w) b[i] = input_other8(p, 8 * v);
      }
    }
    if (p.pro.norm_w) {
      cp_async_wait_all();
#pragma unroll
      for (int i = 0; i < kMaxV; ++i) {
        const int v = threadIdx.x + i * T;
        if (v < nnat) b[i] = slot(v);
      }
    }
    NormStats st;
    if (p.pro.norm_w)
      st = norm_stats8<T, kMaxV>(p, nnat, p.pro.layer_norm ? __half2float(__ldcg(p.x)) : 0.f,
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
  if (p.pro.norm_w)
    st = vec ? norm_stats8<T>(p, p.K / 8, p.pro.layer_norm ? __half2float(__ldcg(p.x)) : 0.f,
                              [&](int v) { return __ldcg(reinterpret_cast<const uint4*>(p.x) + v); })
             : norm_stats1<T>(p);
  if (p.pro.perm == nullptr) {
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

}  // namespace
}  // namespace kestrel::cuda::gemv_detail
