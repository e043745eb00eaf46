// The batch-1 GEMV kernels (gemv.cu describes the design): the fp16 kernel gemv_kernel<F16Op>,
// the quantized kernel gemv_quant_kernel (run-time tests of its fused ops, kDynamic, or
// compiled per combination of them), and the tables of the specialized ones. Each is a loop
// around the parts in the headers below: weight_decode.cuh (load and dequantize a unit of
// weights), input_staging.cuh (x into shared memory with the fused input op) and epilogue.cuh
// (reduce a row step and store it with the fused output op). Shared by the translation units
// that compile the kernels: gemv.cu (the run-time quantized kernel, the fp16 GEMV, the
// dispatch) and gemv_spec2.cu, gemv_spec3.cu, gemv_spec4.cu, gemv_spec8.cu (the kernels
// specialized per bit width, compiled in parallel). Device code: include from .cu files only.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/cp_async.cuh"
#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/gemv_layout.h"
#include "kernels/gemv/gemv_params.cuh"
#include "kernels/gemv/input_staging.cuh"
#include "kernels/gemv/weight_decode.cuh"

namespace kestrel::cuda::gemv_detail {

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

// bar.sync on barrier `id` (1-15; 0 is __syncthreads') for `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
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
    p.pro.silu_mul = false;
    if constexpr (kSpec & kPerm) __builtin_assume(p.pro.perm != nullptr); else p.pro.perm = nullptr;
    if constexpr (kSpec & kNorm) {
      __builtin_assume(p.pro.norm_w != nullptr);
    } else {
      p.pro.norm_w = nullptr;
      p.pro.layer_norm = false;
      p.pro.norm_b = nullptr;
    }
    if constexpr (kSpec & kResidual) {
      __builtin_assume(p.epi.residual != nullptr);
    } else {
      p.epi.residual = nullptr;
      p.epi.bias = nullptr;
      p.epi.relu = false;
    }
    if constexpr (kSpec & kSiluPair) {
      __builtin_assume(p.epi.silu_pair != 0);
    } else {
      p.epi.silu_pair = 0;
      if constexpr (!(kSpec & kIndexed)) p.epi.y_index = nullptr;
    }
    if constexpr (kSpec & kIndexed) {
      __builtin_assume(p.epi.res_index != nullptr);
      __builtin_assume(p.epi.y_index != nullptr);
    } else {
      p.epi.res_index = nullptr;
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
// unit by unit (gemv.cu draws it).
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
  uint64_t* bar = reinterpret_cast<uint64_t*>(perm_s + (p.pro.perm ? codes : 0));
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
  const int rstep = p.epi.silu_pair ? p.epi.silu_pair : 1, per_half = p.epi.silu_pair ? 1 : R;
  const int per_step = kHalf ? 2 * per_half : per_half;
  const int64_t n_rows = p.epi.silu_pair ? p.epi.silu_pair : p.N;
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
    return p.epi.silu_pair ? R : min(R, re - row0);
  };
  auto hrow = [&](int row0) { return row0 + half * per_half; };
  auto load_rows = [&](int row0) {
    if constexpr (!kHalf) return rows_at(row0);
    const int h0 = hrow(row0);
    return p.epi.silu_pair ? (h0 < re ? R : 0) : max(0, min(R, re - h0));
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
  const bool y_index_early = p.epi.y_index != nullptr && re - rb <= 32;
  int y_index = 0, res_index = 0;
  if (y_index_early && lane < re - rb) {
    y_index = __ldg(p.epi.y_index + rb + lane);
    if (p.epi.res_index) res_index = __ldg(p.epi.res_index + rb + lane);
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
      if (p.pro.norm_w)
        bulk_copy_g2s_no_arrive(n_raw, p.pro.norm_w, static_cast<uint32_t>(p.K) * 2, bar);
      if (p.pro.layer_norm && p.pro.norm_b)
        bulk_copy_g2s_no_arrive(b_raw, p.pro.norm_b, static_cast<uint32_t>(p.K) * 2, bar);
      if (p.pro.perm)
        bulk_copy_g2s_no_arrive(perm_s, p.pro.perm, static_cast<uint32_t>(codes) * 4, bar);
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
  const bool res_early = p.epi.residual != nullptr && re - rb <= 32;
  float res = 0.f;
  if (res_early && lane < re - rb) {
    res = __half2float(__ldcg(p.epi.residual + (p.epi.res_index ? res_index : rb + lane)));
    if (p.epi.bias) res += __half2float(__ldg(p.epi.bias + rb + lane));
  }
  // (On sm_90 every shape the one-pass path fits takes the bulk path.)
  stage_x<Op::kUnitCodes, kT, !has_bulk_copy()>(
      p, x_s, x_nat, bulk ? reinterpret_cast<const uint4*>(x_nat) : nullptr,
      reinterpret_cast<const uint4*>(n_raw), bar, bulk && p.pro.perm ? perm_s : nullptr,
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
        if (p.epi.silu_pair) {
          // (The two forms of the indexed store compile to the registers each was measured
          // with: one form for both took the whole-warp kernel in 8-warp blocks from 128 to 94.)
          const int pr = row0 + half;  // this half's pair
          int dst = pr;
          if constexpr (kHalf) {
            if (p.epi.y_index) {
              const int e = __shfl_sync(0xFFFFFFFFu, y_index, (pr - rb) & 31);
              dst = y_index_early ? e : pr < re ? __ldg(p.epi.y_index + pr) : 0;
            }
          } else if (p.epi.y_index) {
            dst = y_index_early ? __shfl_sync(0xFFFFFFFFu, y_index, (row0 - rb) & 31)
                                : __ldg(p.epi.y_index + row0);
          }
          if (kHalf ? ulane == 0 && pr < re : lane == 0) p.y[dst] = silu_pair_out(acc[0], acc[1]);
        } else if (res_early) {
          const float r = __shfl_sync(0xFFFFFFFFu, res, (row0 - rb + lane) & 31);
          if (p.epi.res_index) {  // y_index too, and loaded early with it
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
