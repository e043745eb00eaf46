// Device code of the fused dequantize + tensor-core GEMM for 1..64 tokens (gemm_small.h; the
// design, with drawings, in docs/gemm-small.md). Included by gemm_small.cu (the launcher, which
// uses only the parameter block and the tile constants) and by gemm_small_b{2,3,4,8}.cu, which
// compile the kernels of one bit width each, in parallel.
//
// out^T [N, M] = W [N, K] . x^T [K, M]: the weight is the A operand of mma.sync.m16n8k16
// (16 weight rows x 16 k), the tokens the n = 8 columns of B, so M <= 8 costs one n-tile.
//
// mma.m16n8k16 (row.col, f16 in, f32 accumulate), lane = 4 g + t (g = lane / 4, t = lane % 4):
//
//            virtual k -> 0 1 | 2 3 | 4 5 | 6 7 | 8 9 |10 11|12 13|14 15
//   A row g       a0: t=0  t=0 | t=1 ... t=3 (2t, 2t+1)     a2: (2t+8, 2t+9)
//   A row g + 8   a1: (2t, 2t+1)                             a3: (2t+8, 2t+9)
//   B col g       b0: k (2t, 2t+1)                           b1: k (2t+8, 2t+9)
//   C             c0, c1: row g, cols 2t, 2t+1      c2, c3: row g + 8, cols 2t, 2t+1
//
// The k order inside one mma does not matter as long as A and B agree, and the lanes that feed
// B's k (2t, 2t+1, 2t+8, 2t+9) are the lanes t that feed A's same virtual k. So lane (g, t) feeds
// its A registers from codes it dequantized out of the GEMV layout, in whatever k order they sit
// there, provided every lane with the same t uses the same real k: lane t takes piece t of each
// unit (below) for all 16 rows, and B (x, from shared memory) is laid out so that lane (g, t)
// reads x of token g at exactly those real k.
//
// Piece t of a unit (the GEMV layout, weight_decode.cuh): the unit's codes u*UC .. u*UC+UC-1
// split in four runs of PC = UC / 4 codes; piece t is codes u*UC + t*PC .. + PC - 1:
//    4-bit: chunk t of the unit (load slot t), 4 words of 8 codes       PC = 32
//    2-bit: chunk t (load slot t), 4 words of 16 codes                   PC = 64
//    8-bit: chunk t (load slot t), 4 words of 4 codes                    PC = 16
//    3-bit: word t of the unit's three planes (a, b, c) + the rebuilt d  PC = 32
// Each piece decodes as PC / 8 "8-code groups" e; group e is codes 8e .. 8e+7 of the piece and
// gives two mmas (h = 0: codes 0-3, h = 1: codes 4-7 of the group):
//
//   lane (g, t), group e, half h:  a0 = W[row g    ][k0+4h, k0+4h+1]   a2 = [k0+4h+2, k0+4h+3]
//                                  a1 = W[row g + 8][k0+4h, k0+4h+1]   a3 = [k0+4h+2, k0+4h+3]
//                                  b0 = x[tok g][k0+4h, +1]            b1 = x[tok g][k0+4h+2, +3]
//   with k0 = u*UC + t*PC + 8e: x's 16 bytes of the group (8 consecutive codes) are one uint4,
//   .x .y for h = 0 and .z .w for h = 1.
//
// Device code only: include from .cu files.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/bits.cuh"
#include "kernels/common/cp_async.cuh"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda::gemm_small_detail {

// ---- Tile constants (host and device) ------------------------------------------------------------

// Codes per stage along K: every format's stage is 512 codes, so that a stage holds 4, 8 or 16
// groups of 128, 64 or 32 (scales and zero points then copy as whole 4-byte pieces).
constexpr int kStageCodes = 512;
constexpr int unit_codes(int bits) {
  return gemv_detail::chunk_codes(bits) * gemv_detail::unit_chunks(bits);
}
constexpr int stage_units(int bits) { return kStageCodes / unit_codes(bits); }
// The most warps a block may have (GemmSmallLaunch::warps: 2, 4 or 8), each owning one 16-row
// m-tile; the kernels are compiled for blocks of up to this many threads.
constexpr int kMaxWarps = 8;
constexpr int kMaxStages = 8;  // the deepest cp.async ring (cp_async_wait_upto's cases)
// The default warps per block: 8 (128 rows), but 4 at 8 bits, whose stage of 512 codes is twice
// the bytes per row, so that a stage is 32 KB of weights either way.
constexpr int block_warps(int bits) { return bits == 8 ? 4 : 8; }
// The default pipeline depth: 2 stages at every n-tile count. A deeper ring holds more bytes in
// flight per block but leaves room for fewer blocks per SM, and the blocks' independent streams
// hide the load latency better than one block's deeper ring (docs/gemm-small.md, the sweep).
constexpr int pipeline_stages(int /*nt*/) { return 2; }
constexpr int groups_per_stage(int gs) { return gs == 0 ? 0 : kStageCodes / gs; }

// Shared memory of a block (drawn at gemm_small_kernel): an x area of `x_slots` stages of x
// (one per ring stage, or every stage of the block's K range when x is staged once), then the
// ring of `stages` weight stages, each weights | scales | zero points.
constexpr size_t weight_stage_bytes(int bits, int gs, int warps) {
  const int rows = 16 * warps;
  return size_t(rows) * stage_units(bits) * gemv_detail::unit_loads(bits) * 16 +
         size_t(rows) * groups_per_stage(gs) * 3;
}
constexpr size_t x_stage_bytes(int nt) { return size_t(nt) * 8 * kStageCodes * 2; }
constexpr size_t smem_bytes(int bits, int gs, int nt, int warps, int stages, int x_slots) {
  return weight_stage_bytes(bits, gs, warps) * stages + x_stage_bytes(nt) * x_slots;
}

struct Params {
  const uint4* codes;     // row n at codes + n * row_stride (GemvWeight)
  int64_t row_stride;     // uint4 per row: planes * chunks
  const __half* scales;   // [N][G]
  const uint8_t* zeros;   // [N][G], or nullptr: zero_const
  int G;
  int zero_const, zero_offset;
  int nch;                // units per row
  const __half* x;        // [M][ldx], 16-byte aligned rows, zero or absent past kx
  int ldx, kx;            // kx: x columns to read (a multiple of 8); beyond: zeros
  int M, N;
  int silu_half;          // N / 2 with the SiLU epilogue ([gate | up] rows), else 0
  int rows;               // output columns: N, or N / 2 with SiLU
  __half* y;              // [M][rows], rows ldy apart
  const __half* residual; // [M][rows] or nullptr, rows ldy apart; may alias y
  int64_t ldy;            // elements between rows of y and residual: rows, or more (a slice)
  const __half* bias;     // [rows] or nullptr
  bool relu;
  int n_stages;           // stages of kStageCodes along the padded K
  int stages;             // depth of the weight ring, 2 .. kMaxStages
  bool x_once;            // x of the block's whole K range staged up front (x_slots of it)
  int x_slots;            // stages of x in shared memory: `stages`, or the longest K range
  int token_groups;       // blocks side by side on one row block, NT n-tiles of tokens each
  float* partials;        // split-K: [splits][gridDim.x][threads][NT * 4]
  int* counters;          // split-K: [gridDim.x], zero between calls
  int k_slices;           // the streaming kernel: warps per m-tile (gemm_stream_kernel.cuh)
};

using Kernel = void (*)(Params);

// The kernel of one bit width for an effective group size and n-tile count, or nullptr where
// none is compiled: one per gemm_small_b*.cu.
Kernel kernel_2bit(int gs, int nt);
Kernel kernel_3bit(int gs, int nt);
Kernel kernel_4bit(int gs, int nt);
Kernel kernel_8bit(int gs, int nt);
// The streaming kernels (gemm_stream_kernel.cuh) of 2-, 4- and 8-bit weights at 1 or 2 n-tiles,
// or nullptr.
Kernel stream_kernel_2bit(int gs, int nt);
Kernel stream_kernel_4bit(int gs, int nt);
Kernel stream_kernel_8bit(int gs, int nt);

// ---- PTX ------------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, bool valid,
                                               uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst),
               "l"(src), "r"(valid ? 16 : 0), "l"(pol)
               : "memory");
}
__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 4- or 8-byte copies (scales and zero points of a stage): cp.async.ca, the only form below 16.
template <int kBytes>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async sizes");
  if constexpr (kBytes == 16) {
    cp_async_zfill(dst, src, valid);
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src),
                 "n"(kBytes), "r"(valid ? kBytes : 0)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// wait_group takes an immediate: the ring depth is a run-time choice, so one case per depth.
__device__ __forceinline__ void cp_async_wait_upto(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    default: cp_async_wait<kMaxStages - 2>(); break;
  }
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ---- Formats ----------------------------------------------------------------------------------------

// One bit width: what a lane holds of a piece for one row, and how 8-code group e of it becomes
// four fp16 pairs (pair i = codes 2i, 2i+1 of the group) as `magic + q` with the pair's magic,
// so that minus (magic + z) is q - z exactly (weight_decode.cuh's dequantization).
template <int BITS>
struct Piece {
  static constexpr int kUnitCodes = unit_codes(BITS);
  static constexpr int kPieceCodes = kUnitCodes / 4;
  static constexpr int kGroups = kPieceCodes / 8;  // 8-code groups per piece
  static constexpr int kSlots = gemv_detail::unit_loads(BITS);

  struct Codes {
    uint32_t w[4];  // the piece's 4 words (3-bit: a, b, c of word t, then the rebuilt d)
  };

  // The piece of row r (0..15) of a warp tile from the stage's weights in shared memory.
  //   2/4/8-bit: Ws[(us * 16 + r) * 4 + slot] (uint4), piece t = slot t: lanes (g, t) of a
  //              warp read 512 contiguous bytes (no bank conflicts).
  //   3-bit:     Ws[(us * 3 + plane) * 16 + r], word t of each plane: lanes read 128
  //              contiguous bytes per plane.
  __device__ static __forceinline__ Codes load(const uint4* ws_unit, int r, int t) {
    Codes c;
    if constexpr (BITS == 3) {
      const uint32_t* base = reinterpret_cast<const uint32_t*>(ws_unit);
      const uint32_t a = base[(0 * 16 + r) * 4 + t], b = base[(1 * 16 + r) * 4 + t],
                     cc = base[(2 * 16 + r) * 4 + t];
      c.w[0] = a, c.w[1] = b, c.w[2] = cc;
      // Codes 24..31: bit 3 of each nibble of a, b, c (weight_decode.cuh's 3-bit drawing).
      c.w[3] = select_bits(a >> 3, select_bits(b >> 2, cc >> 1, 0x22222222u), 0x11111111u);
    } else {
      const uint4 v = ws_unit[r * 4 + t];
      c.w[0] = v.x, c.w[1] = v.y, c.w[2] = v.z, c.w[3] = v.w;
    }
    return c;
  }

  // Pair i (0..3) of group e as magic + q, and its magic (whose z-shifted OR is the subtrahend).
  __device__ static __forceinline__ uint32_t pair(const Codes& c, int e, int i) {
    if constexpr (BITS == 4 || BITS == 3) {
      constexpr uint32_t m = BITS == 4 ? 15u : 7u;
      const uint32_t w = (i >= 2) ? c.w[e] >> 8 : c.w[e];
      return (i & 1) ? and_or(w, (m << 4) * 0x00010001u, 0x54005400u)
                     : and_or(w, m * 0x00010001u, 0x64006400u);
    } else if constexpr (BITS == 2) {
      constexpr uint32_t magic[4] = {0x64006400u, 0x5C005C00u, 0x54005400u, 0x4C004C00u};
      const uint32_t w = c.w[e >> 1] >> (8 * (e & 1));
      return and_or(w, 0x00030003u << (2 * i), magic[i]);
    } else {  // 8-bit: words 2e (codes 0-3 of the group), 2e + 1 (codes 4-7)
      const uint32_t w = c.w[2 * e + (i >> 1)];
      return __byte_perm(w, 0x64u, (i & 1) ? 0x4342u : 0x4140u);
    }
  }
  // magic + z for pair i, both halves (z < 1024 >> shift: inside the mantissa).
  __device__ static __forceinline__ uint32_t magic_zero(uint32_t z, int i) {
    const uint32_t z2 = z * 0x00010001u;
    if constexpr (BITS == 4 || BITS == 3) {
      return (i & 1) ? (0x54005400u | (z2 << 4)) : (0x64006400u | z2);
    } else if constexpr (BITS == 2) {
      constexpr uint32_t magic[4] = {0x64006400u, 0x5C005C00u, 0x54005400u, 0x4C004C00u};
      return magic[i] | (z2 << (2 * i));
    } else {
      return 0x64006400u | z2;
    }
  }
};

// ---- The kernel -------------------------------------------------------------------------------------

// Weight row of tile row r (0..15) of m-tile `tile`, or -1 past the weight: rows tile*16 + r,
// or with SiLU the gate rows tile*8 + r (r < 8) and their up rows N/2 + tile*8 + r - 8, so that
// c0/c1 (gate) and c2/c3 (up) of a lane are the same output and token.
__device__ __forceinline__ int weight_row(const Params& p, int tile, int r) {
  if (p.silu_half) {
    const int pr = tile * 8 + (r & 7);
    return pr < p.silu_half ? pr + (r >= 8 ? p.silu_half : 0) : -1;
  }
  const int row = tile * 16 + r;
  return row < p.N ? row : -1;
}

// Split-K: every block stores its partial sums (fragment order, one float4 per n-tile per
// thread); the last block of a (row block, token group) to arrive sums them in split order
// (deterministic) and runs the epilogue, then resets the counter for the next call. Returns
// false in the blocks that are not the last. `holds`: whether this thread's acc is part of the
// block's tile (the streaming kernel's warps past the first k-slice hold none, and neither store
// nor read partial sums).
template <int NT>
__device__ __forceinline__ bool reduce_splits(const Params& p, float (&acc)[NT][4], bool holds) {
  __shared__ int last;
  const int tid = threadIdx.x, threads = blockDim.x, splits = gridDim.y;
  float4* part = reinterpret_cast<float4*>(p.partials);
  const int64_t stride = int64_t(gridDim.x) * threads * NT;  // float4 per split
  const int64_t mine = (int64_t(blockIdx.x) * threads + tid) * NT;
  if (holds) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
      __stcg(part + int64_t(blockIdx.y) * stride + mine + j,
             make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(p.counters + blockIdx.x, 1) == splits - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (holds) {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int sp = 0; sp < splits; ++sp) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float4 v = __ldcg(part + int64_t(sp) * stride + mine + j);
        acc[j][0] += v.x, acc[j][1] += v.y, acc[j][2] += v.z, acc[j][3] += v.w;
      }
    }
  }
  if (tid == 0) p.counters[blockIdx.x] = 0;
  return true;
}

// Epilogue of one warp's m-tile `tile`: c[2h + j] is row g + 8h, token m0 + 8 nt + 2t + j.
template <int NT>
__device__ __forceinline__ void store_outputs(const Params& p, int tile, int m0, int g, int t,
                                              const float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = m0 + nt * 8 + 2 * t + j;
      if (m >= p.M) continue;
      if (p.silu_half) {
        // As the GEMV's SiLU epilogue: gate and up rounded to fp16, fp32 math, one rounding.
        const int pr = tile * 8 + g;
        if (pr < p.silu_half)
          p.y[int64_t(m) * p.ldy + pr] = __float2half_rn(
              silu_times(__half2float(__float2half_rn(acc[nt][j])),
                         __half2float(__float2half_rn(acc[nt][2 + j]))));
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = tile * 16 + g + 8 * h;
          if (row >= p.N) continue;
          const int64_t o = int64_t(m) * p.ldy + row;
          float v = acc[nt][2 * h + j];
          float r = 0.f;
          if (p.residual) r = __half2float(__ldcg(p.residual + o));
          if (p.bias) r += __half2float(__ldg(p.bias + row));
          v += r;
          p.y[o] = __float2half_rn(p.relu ? fmaxf(v, 0.f) : v);
        }
      }
    }
}

// Blocks of kMaxWarps that must fit on an SM by registers: 2 (at most 128 registers a thread)
// where the kernel needs no more without spilling, so that two blocks of 8 warps (four of 4)
// may share an SM when their shared memory fits; 1 for 8 n-tiles (32 accumulators a thread)
// and 8 bits at 4 n-tiles.
constexpr int min_blocks(int bits, int nt) { return nt >= 8 || (bits == 8 && nt >= 4) ? 1 : 2; }

// BITS 2/3/4/8; GS the effective group size (32, 64, 128, 0 = one per row); NT n-tiles of 8
// tokens per block (1, 2, 4, 8). The rest of the plan is read at run time (GemmSmallLaunch):
// warps per block (blockDim.x / 32), the ring depth, how x is staged, token groups; so that
// trying a plan costs no template instantiation.
//
// Block (blockIdx.x = row block * token_groups + token group, blockIdx.y = split): m-tiles
// rb * W .. + W - 1 (one per warp), tokens tg * 8 NT .. + 8 NT - 1, stages [s0, s1) of K, the
// y-th of gridDim.y split-K ranges. The token groups of one row block are consecutive blocks,
// so that they run side by side and all but the first find the weights in L2.
//
// Shared memory, `stages` = P ring slots of weights and x_slots of x:
//
//   | x slot 0 | x slot 1 | ... | x_slots - 1 | ring 0: W | S | Z | ring 1: W | S | Z | ... P - 1 |
//     x of all NT*8 tokens at a stage's 512 k    W weights [warp][unit][row][slot] (3-bit: [plane])
//     (8 KB per n-tile)                          S scales [row][group]  Z zero points [row][group]
//
// x staged per stage (x_once false): x slot = ring slot, copied with the stage's weights.
// x staged once (x_once): x slot i = stage s0 + i, all copied before the first stage is used
// (the block's x then costs no copies per stage, and the ring holds weights only).
// Each stage: the block's rows x kStageCodes of weights (their scales and zero points) by
// cp.async into the ring, P - 1 stages in flight while one is computed.
template <int BITS, int GS, int NT>
__global__ void __launch_bounds__(32 * kMaxWarps, min_blocks(BITS, NT)) gemm_small_kernel(const Params p) {
  using F = Piece<BITS>;
  constexpr int kS = stage_units(BITS), kQ = F::kSlots, kE = F::kGroups;
  constexpr int kGps = groups_per_stage(GS);
  constexpr int kXVecs = NT * 8 * kStageCodes / 8;    // uint4 of x per stage
  constexpr size_t kXStage = x_stage_bytes(NT);
  // Weight copies per thread and stage: 16 rows x kS units x kQ slots per warp, 32 lanes.
  constexpr int kWIters = 16 * kS * kQ / 32;
  static_assert(kWIters * 32 == 16 * kS * kQ, "a warp's weight copies divide among its lanes");

  extern __shared__ uint4 smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int threads = blockDim.x, block_rows = threads / 2;  // 16 rows per warp of 32 threads
  const int ws_vecs = block_rows * kS * kQ;        // uint4 of weights per stage
  const size_t ring_stage = weight_stage_bytes(BITS, GS, threads / 32);
  const int rb = blockIdx.x / p.token_groups, m0 = (blockIdx.x % p.token_groups) * NT * 8;
  const int tile0 = rb * (threads / 32);
  const int ring_stages = p.stages;

  // Split-K range of this block.
  const int splits = gridDim.y;
  const int s0 = int(int64_t(p.n_stages) * blockIdx.y / splits);
  const int s1 = int(int64_t(p.n_stages) * (blockIdx.y + 1) / splits);
  const int n = s1 - s0;

  char* const ring = reinterpret_cast<char*>(smem) + p.x_slots * kXStage;
  auto ws_of = [&](int buf) { return reinterpret_cast<uint4*>(ring + buf * ring_stage); };
  auto sc_of = [&](int buf) { return reinterpret_cast<__half*>(ws_of(buf) + ws_vecs); };
  auto zs_of = [&](int buf) { return reinterpret_cast<uint8_t*>(sc_of(buf) + block_rows * kGps); };
  auto xs_of = [&](int slot) {
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(smem) + slot * kXStage);
  };

  const uint64_t pol = evict_first_policy();

  // Weights, scales and zero points of stage st into ring slot buf.
  //   Shared layout per warp tile (2/4/8-bit): [unit us][row r][slot] uint4; 3-bit: [us][plane]
  //   [row] (Piece::load). Threads take consecutive units of one (row, slot), which are
  //   consecutive 16-byte pieces of the GEMV layout (slot q of units 32i .. 32i+31 lies together),
  //   so each warp reads runs of kS * 16 bytes (a stage never crosses a 32-unit group: kS
  //   divides 32 and stages start at multiples of kS).
  auto issue_weights = [&](int st, int buf) {
    uint4* ws = ws_of(buf);
#pragma unroll
    for (int it = 0; it < kWIters; ++it) {
      const int i = tid + it * threads;
      const int us = i % kS, rest = i / kS, q = rest % kQ, rbk = rest / kQ;
      const int wt = rbk >> 4, r = rbk & 15;
      const int row = weight_row(p, tile0 + wt, r);
      const int u = st * kS + us;
      const bool ok = row >= 0 && u < p.nch;
      const uint4* src = p.codes;
      if (ok) {
        const int grp = u >> 5, cnt = min(32, p.nch - 32 * grp);
        src = p.codes + int64_t(row) * p.row_stride + int64_t(grp) * 32 * kQ + q * cnt + (u & 31);
      }
      const int dst = BITS == 3 ? ((wt * kS + us) * 3 + q) * 16 + r : ((wt * kS + us) * 16 + r) * 4 + q;
      cp_async_zfill(smem_u32(ws + dst), src, ok, pol);
    }
    if constexpr (GS != 0) {
      // Scales: kGps halves per row (8 .. 32 bytes) in pieces of up to 16 bytes; G is a
      // multiple of 8, so a piece lies wholly inside or past the row's groups.
      constexpr int kSB = kGps * 2 < 16 ? kGps * 2 : 16, kSPer = kGps * 2 / kSB;
      __half* sc = sc_of(buf);
      for (int i = tid; i < block_rows * kSPer; i += threads) {
        const int rr = i / kSPer, pc = i % kSPer;
        const int row = weight_row(p, tile0 + (rr >> 4), rr & 15);
        const int gi = st * kGps + pc * (kSB / 2);
        const bool ok = row >= 0 && gi < p.G;
        const __half* src = ok ? p.scales + int64_t(row) * p.G + gi : p.scales;
        cp_async_small<kSB>(smem_u32(sc + rr * kGps + pc * (kSB / 2)), src, ok);
      }
      if (p.zeros) {
        constexpr int kZB = kGps < 8 ? kGps : 8, kZPer = kGps / kZB;
        uint8_t* zs = zs_of(buf);
        for (int i = tid; i < block_rows * kZPer; i += threads) {
          const int rr = i / kZPer, pc = i % kZPer;
          const int row = weight_row(p, tile0 + (rr >> 4), rr & 15);
          const int gi = st * kGps + pc * kZB;
          const bool ok = row >= 0 && gi < p.G;
          const uint8_t* src = ok ? p.zeros + int64_t(row) * p.G + gi : p.zeros;
          cp_async_small<kZB>(smem_u32(zs + rr * kGps + pc * kZB), src, ok);
        }
      }
    }
  };
  // x of stage st into x slot `slot`: token m0 + m's 8 codes at stage offset 8c land where lane
  // (g = m % 8, t) of n-tile m / 8 reads them: xs[((nt * kS + us) * kE + e) * 32 + g * 4 + t]
  // (8c = us*UC + t*PC + 8e), so that a warp's read of one (n-tile, unit, group) is 512
  // contiguous bytes.
  auto issue_x = [&](int st, int slot) {
    uint4* xs = xs_of(slot);
    for (int i = tid; i < kXVecs; i += threads) {
      const int c = i % (kStageCodes / 8), m = i / (kStageCodes / 8);
      const int k = st * kStageCodes + 8 * c;
      const int us = c / (F::kUnitCodes / 8), rem = c % (F::kUnitCodes / 8);
      const int tt = rem / kE, e = rem % kE;
      const bool ok = m0 + m < p.M && k < p.kx;
      const __half* src = ok ? p.x + int64_t(m0 + m) * p.ldx + k : p.x;
      const int dst = (((m >> 3) * kS + us) * kE + e) * 32 + (m & 7) * 4 + tt;
      cp_async_zfill(smem_u32(xs + dst), src, ok);
    }
  };

  // Per-row scale and zero point (GS 0): the lane's two rows, read once.
  uint32_t row_s2[2] = {0, 0}, row_z[2] = {0, 0};
  if constexpr (GS == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = weight_row(p, tile0 + warp, g + 8 * h);
      if (row >= 0) {
        const uint32_t sb = __ldg(reinterpret_cast<const unsigned short*>(p.scales) + int64_t(row) * p.G);
        row_s2[h] = sb * 0x00010001u;
        row_z[h] = p.zeros ? uint32_t(__ldg(p.zeros + int64_t(row) * p.G)) + p.zero_offset
                           : uint32_t(p.zero_const);
      }
    }
  }

  // Prologue: the weights of the first P - 1 stages before the wait on the previous kernel
  // (they do not depend on it), then x (all of the block's, or the first P - 1 stages'), one
  // commit group per stage; every copy before the first commit lands in group 0.
  for (int i = 0; i < ring_stages - 1; ++i)
    if (i < n) issue_weights(s0 + i, i);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (p.x_once)
    for (int i = 0; i < n; ++i) issue_x(s0 + i, i);
  for (int i = 0; i < ring_stages - 1; ++i) {
    if (!p.x_once && i < n) issue_x(s0 + i, i);
    cp_async_commit();
  }

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // buf: the ring slot of stage i; nbuf: that of stage i + P - 1 (the slot stage i - 1 freed).
  int buf = 0, nbuf = ring_stages - 1;
  for (int i = 0; i < n; ++i) {
    cp_async_wait_upto(ring_stages - 2);
    __syncthreads();  // stage i landed for every thread; slot (i - 1) % P is free again
    {
      const int nx = i + ring_stages - 1;
      if (nx < n) {
        issue_weights(s0 + nx, nbuf);
        if (!p.x_once) issue_x(s0 + nx, nbuf);
      }
      cp_async_commit();
    }
    const uint4* ws = ws_of(buf) + warp * kS * 16 * kQ;
    const uint4* xs = xs_of(p.x_once ? i : buf);
    const __half* sc = sc_of(buf) + warp * 16 * kGps;
    const uint8_t* zs = zs_of(buf) + warp * 16 * kGps;
    buf = buf + 1 == ring_stages ? 0 : buf + 1;
    nbuf = nbuf + 1 == ring_stages ? 0 : nbuf + 1;
#pragma unroll
    for (int us = 0; us < kS; ++us) {
      const typename F::Codes c0 = F::load(ws + us * 16 * kQ, g, t);
      const typename F::Codes c1 = F::load(ws + us * 16 * kQ, g + 8, t);
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        // Scale and zero point of rows g and g + 8 for this group of codes.
        uint32_t s2[2], z[2];
        if constexpr (GS == 0) {
          s2[0] = row_s2[0], s2[1] = row_s2[1], z[0] = row_z[0], z[1] = row_z[1];
        } else {
          const int gi = (us * F::kUnitCodes + t * F::kPieceCodes + 8 * e) / GS;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int rr = g + 8 * h;
            s2[h] = uint32_t(reinterpret_cast<const unsigned short*>(sc)[rr * kGps + gi]) * 0x00010001u;
            z[h] = p.zeros ? uint32_t(zs[rr * kGps + gi]) + p.zero_offset : uint32_t(p.zero_const);
          }
        }
        // The four dequantized pairs of each row: (q - z) exact, times s rounded once.
        uint32_t a[2][4];
#pragma unroll
        for (int pi = 0; pi < 4; ++pi) {
          a[0][pi] = as_u32(__hmul2(__hsub2(as_h2(F::pair(c0, e, pi)), as_h2(F::magic_zero(z[0], pi))),
                                    as_h2(s2[0])));
          a[1][pi] = as_u32(__hmul2(__hsub2(as_h2(F::pair(c1, e, pi)), as_h2(F::magic_zero(z[1], pi))),
                                    as_h2(s2[1])));
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 xv = xs[((j * kS + us) * kE + e) * 32 + lane];
          mma16816(acc[j], a[0][0], a[1][0], a[0][1], a[1][1], xv.x, xv.y);
          mma16816(acc[j], a[0][2], a[1][2], a[0][3], a[1][3], xv.z, xv.w);
        }
      }
    }
  }
  cp_async_wait<0>();

  if (gridDim.y > 1 && !reduce_splits<NT>(p, acc, true)) return;
  store_outputs<NT>(p, tile0 + warp, m0, g, t, acc);
}

// The kernels of bit width B compiled: group 0/32/64/128 x n-tiles 1/2/4/8.
template <int B, int GS>
Kernel kernel_for_nt(int nt) {
  switch (nt) {
    case 1: return gemm_small_kernel<B, GS, 1>;
    case 2: return gemm_small_kernel<B, GS, 2>;
    case 4: return gemm_small_kernel<B, GS, 4>;
    case 8: return gemm_small_kernel<B, GS, 8>;
    default: return nullptr;
  }
}
template <int B>
Kernel kernel_for(int gs, int nt) {
  switch (gs) {
    case 0: return kernel_for_nt<B, 0>(nt);
    case 32: return kernel_for_nt<B, 32>(nt);
    case 64: return kernel_for_nt<B, 64>(nt);
    case 128: return kernel_for_nt<B, 128>(nt);
    default: return nullptr;
  }
}

}  // namespace kestrel::cuda::gemm_small_detail
