// Device code of the fused small-M GEMM's streaming variant (GemmSmallLaunch::stream): the same
// product, fragments and epilogues as gemm_small_kernel.cuh, but each warp streams its own weight
// rows from global memory straight into registers, as the batch-1 GEMV does, instead of a block
// copying stages into a shared-memory ring.
//
// Why: at M = 1 the ring kernel reads the weights at about half the GEMV's rate, and no launch
// plan closes the gap (docs/gemm-small.md, "Open questions"). Of the differences from the GEMV,
// this variant removes three at once:
//   - weights go global -> registers (ld.global.nc, L1 no-allocate, L2 evict-first), not
//     global -> shared -> registers;
//   - no block-wide barrier per stage: after x is staged once, a warp never waits for another
//     until the end (the k-slice reduction);
//   - scales and zero points of the next stage are loaded with its codes, into registers.
//
// Block: W warps = R m-tiles x S k-slices (GemmSmallLaunch::k_slices). Warp w takes m-tile
// tile0 + w / S and k-slice w % S: the stages s0 + (w % S), + S, + 2S, ... of the block's split-K
// range [s0, s1). Each lane (g, t) holds, per stage, piece t of every unit for rows g and g + 8
// (2 x kS 16-byte loads: for one (row, t) the stage's kS units are kS consecutive 16-byte pieces
// of the GEMV layout, so a warp reads 16 rows x 4 runs of kS * 16 bytes), double-buffered: the
// next stage's loads are issued before the current one is multiplied.
//
// Shared memory: x of the block's whole K range (x_once, gemm_small_kernel's layout), reused for
// the k-slices' partial sums after the last stage:
//
//   | x stage s0 | x stage s0 + 1 | ... | x stage s1 - 1 |      then: | slice partials |
//     NT x 8 KB each                                               R x (S - 1) x 32 x NT float4
//
// 2- and 4-bit codes (one load slot per piece t). 8-bit's stage of 8 units does not fit two
// register buffers (gemm_small_b8.cu); 3-bit codes keep the ring kernel.
#pragma once

#include "kernels/gemm/gemm_small_kernel.cuh"

namespace kestrel::cuda::gemm_small_detail {

// The most k-slices a block of kMaxWarps takes.
constexpr int kMaxSlices = 8;

// Shared memory of a streaming block: x of `x_slots` stages, or the k-slices' partial sums if
// those take more.
constexpr size_t stream_smem_bytes(int nt, int warps, int slices, int x_slots) {
  const size_t x = x_stage_bytes(nt) * x_slots;
  const size_t red = size_t(warps / slices) * (slices - 1) * 32 * nt * 16;
  return x > red ? x : red;
}

template <int BITS, int GS, int NT>
__global__ void __launch_bounds__(32 * kMaxWarps, 2) gemm_stream_kernel(const Params p) {
  static_assert(BITS == 2 || BITS == 4, "3- and 8-bit codes take the ring kernel");
  using F = Piece<BITS>;
  constexpr int kS = stage_units(BITS), kE = F::kGroups, kQ = F::kSlots;
  constexpr int kUC = F::kUnitCodes, kPC = F::kPieceCodes;
  // Groups a piece spans (2-bit pieces of 64 codes at group 32: 2), and 8-code groups per group.
  constexpr int kGpp = (GS != 0 && kPC > GS) ? kPC / GS : 1;
  constexpr int kEpg = kE / kGpp;
  constexpr int kXVecs = NT * 8 * kStageCodes / 8;
  constexpr size_t kXStage = x_stage_bytes(NT);

  extern __shared__ uint4 smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int threads = blockDim.x, warps = threads >> 5;
  const int S = p.k_slices, R = warps / S;
  const int rb = blockIdx.x / p.token_groups, m0 = (blockIdx.x % p.token_groups) * NT * 8;
  const int mt = warp / S, slice = warp % S;
  const int tile = rb * R + mt;

  const int splits = gridDim.y;
  const int s0 = int(int64_t(p.n_stages) * blockIdx.y / splits);
  const int s1 = int(int64_t(p.n_stages) * (blockIdx.y + 1) / splits);
  const int n = s1 - s0;

  const uint64_t pol = evict_first_policy();
  const int row_of[2] = {weight_row(p, tile, g), weight_row(p, tile, g + 8)};

  // One stage's codes, scales and zero points of the lane's two rows, in registers.
  // sz: the scale's fp16 bits | (zero point + offset) << 16, one register for both.
  struct Stage {
    uint4 c[kS][2];
    uint32_t sz[kS][2][kGpp];
  };
  auto load_stage = [&](Stage& b, int st) {
#pragma unroll
    for (int us = 0; us < kS; ++us) {
      const int u = st * kS + us;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_of[h];
        const bool ok = row >= 0 && u < p.nch;
        if (ok) {
          const int grp = u >> 5, cnt = min(32, p.nch - 32 * grp);
          b.c[us][h] = ld_stream(p.codes + int64_t(row) * p.row_stride +
                                      int64_t(grp) * 32 * kQ + t * cnt + (u & 31), pol);
        } else {
          b.c[us][h] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int gp = 0; gp < kGpp; ++gp) {
          if constexpr (GS == 0) {
            b.sz[us][h][gp] = 0;  // the row's, held apart (row_s2, row_z)
          } else {
            const int gi = (u * kUC + t * kPC + gp * GS) / GS;
            const bool sok = ok && gi < p.G;
            const uint32_t sc = sok ? uint32_t(__ldg(reinterpret_cast<const unsigned short*>(p.scales) +
                                                    int64_t(row) * p.G + gi))
                                    : 0u;
            const uint32_t z = p.zeros ? (sok ? uint32_t(__ldg(p.zeros + int64_t(row) * p.G + gi)) : 0u) +
                                             p.zero_offset
                                       : uint32_t(p.zero_const);
            b.sz[us][h][gp] = sc | z << 16;
          }
        }
      }
    }
  };

  // Per-row scale and zero point (GS 0).
  uint32_t row_s2[2] = {0, 0}, row_z[2] = {0, 0};
  if constexpr (GS == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_of[h];
      if (row >= 0) {
        row_s2[h] = uint32_t(__ldg(reinterpret_cast<const unsigned short*>(p.scales) +
                                   int64_t(row) * p.G)) * 0x00010001u;
        row_z[h] = p.zeros ? uint32_t(__ldg(p.zeros + int64_t(row) * p.G)) + p.zero_offset
                           : uint32_t(p.zero_const);
      }
    }
  }

  // The first stage's weights before the wait on the previous kernel (they do not depend on
  // it), then x of the block's whole range.
  Stage b0, b1;
  if (slice < n) load_stage(b0, s0 + slice);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  for (int i = tid; i < n * kXVecs; i += threads) {
    const int sl = i / kXVecs, j = i % kXVecs;
    const int c = j % (kStageCodes / 8), m = j / (kStageCodes / 8);
    const int k = (s0 + sl) * kStageCodes + 8 * c;
    const int us = c / (kUC / 8), rem = c % (kUC / 8);
    const int tt = rem / kE, e = rem % kE;
    const bool ok = m0 + m < p.M && k < p.kx;
    const __half* src = ok ? p.x + int64_t(m0 + m) * p.ldx + k : p.x;
    uint4* xs = reinterpret_cast<uint4*>(reinterpret_cast<char*>(smem) + sl * kXStage);
    cp_async_zfill(smem_u32(xs + (((m >> 3) * kS + us) * kE + e) * 32 + (m & 7) * 4 + tt), src, ok);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  auto compute = [&](const Stage& b, int i) {
    const uint4* xs = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(smem) + i * kXStage);
#pragma unroll
    for (int us = 0; us < kS; ++us) {
      typename F::Codes c[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        c[h].w[0] = b.c[us][h].x, c[h].w[1] = b.c[us][h].y, c[h].w[2] = b.c[us][h].z,
        c[h].w[3] = b.c[us][h].w;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        uint32_t s2[2], z[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (GS == 0) {
            s2[h] = row_s2[h], z[h] = row_z[h];
          } else {
            const uint32_t sz = b.sz[us][h][e / kEpg];
            s2[h] = (sz & 0xffffu) * 0x00010001u, z[h] = sz >> 16;
          }
        }
        uint32_t a[2][4];
#pragma unroll
        for (int pi = 0; pi < 4; ++pi)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            a[h][pi] = as_u32(__hmul2(__hsub2(as_h2(F::pair(c[h], e, pi)),
                                              as_h2(F::magic_zero(z[h], pi))),
                                      as_h2(s2[h])));
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 xv = xs[((j * kS + us) * kE + e) * 32 + lane];
          mma16816(acc[j], a[0][0], a[1][0], a[0][1], a[1][1], xv.x, xv.y);
          mma16816(acc[j], a[0][2], a[1][2], a[0][3], a[1][3], xv.z, xv.w);
        }
      }
    }
  };

  // The slice's stages i = slice, slice + S, ...: two at a time, each buffer's next stage
  // loaded while the other is multiplied.
  for (int i = slice; i < n; i += 2 * S) {
    const int i1 = i + S;
    if (i1 < n) load_stage(b1, s0 + i1);
    compute(b0, i);
    if (i1 >= n) break;
    const int i2 = i1 + S;
    if (i2 < n) load_stage(b0, s0 + i2);
    compute(b1, i1);
  }

  // The k-slices of an m-tile summed by its slice-0 warp (in slice order: deterministic).
  if (S > 1) {
    __syncthreads();  // every warp is done with x; its space takes the partial sums
    float4* red = reinterpret_cast<float4*>(smem);
    if (slice > 0) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
        red[((mt * (S - 1) + slice - 1) * 32 + lane) * NT + j] =
            make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    }
    __syncthreads();
    if (slice == 0) {
      for (int sl = 1; sl < S; ++sl)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const float4 v = red[((mt * (S - 1) + sl - 1) * 32 + lane) * NT + j];
          acc[j][0] += v.x, acc[j][1] += v.y, acc[j][2] += v.z, acc[j][3] += v.w;
        }
    }
  }

  // Split-K across blocks and the epilogue, as gemm_small_kernel's (only the first k-slice's
  // warps hold sums).
  if (gridDim.y > 1 && !reduce_splits<NT>(p, acc, slice == 0)) return;
  if (slice == 0) store_outputs<NT>(p, tile, m0, g, t, acc);
}

template <int B, int GS>
Kernel stream_kernel_for_nt(int nt) {
  switch (nt) {
    case 1: return gemm_stream_kernel<B, GS, 1>;
    case 2: return gemm_stream_kernel<B, GS, 2>;
    default: return nullptr;
  }
}
template <int B>
Kernel stream_kernel_for(int gs, int nt) {
  switch (gs) {
    case 0: return stream_kernel_for_nt<B, 0>(nt);
    case 32: return stream_kernel_for_nt<B, 32>(nt);
    case 64: return stream_kernel_for_nt<B, 64>(nt);
    case 128: return stream_kernel_for_nt<B, 128>(nt);
    default: return nullptr;
  }
}

}  // namespace kestrel::cuda::gemm_small_detail
