// Batch-1 GEMV kernels: fused GPTQ dequantize + dot product, and plain fp16, streaming the
// weights once at the memory-bandwidth limit. This file: the design, the run-time quantized
// kernel, the fp16 kernel and the dispatch. The device code: the kernels in gemv_kernel.cuh,
// around weight_decode.cuh (the packed layout and its decoding), input_staging.cuh (x and the
// fused input op) and epilogue.cuh (the row sums and the fused output op); the kernels
// specialized per bit width compile in gemv_spec2.cu, gemv_spec3.cu, gemv_spec4.cu,
// gemv_spec8.cu.
//
// ---------------------------------------------------------------------------------------------
// What a GEMV must move. y[N] = W[N,K] x[K]: every weight byte once, x and y once. Llama-2-7B
// gate/up fused, 4-bit g128: 22016 x 4096 codes = 45.1 MB + scales 1.4 MB; x 8 KB, y 44 KB:
// ~11 us at 4.26 TB/s. The arithmetic (2 flops per weight) is far below the FP16 units' rate, but
// the *instruction issue* is not: at 4-bit a GPU-wide 8.5 T weights/s leaves ~4 issue slots per
// weight, so dequantization must cost a handful of integer/half2 ops per pair of weights.
//
// What bounds it (measured: docs/gemv-notes.md): not the dequantization, since the quantized
// kernel comes close to a kernel that only loads the same bytes in the same pattern, but the
// fixed cost of each launch (grid start, the wait on the previous kernel, staging x), which is
// a large share of a GEMV that moves a few tens of MB.
//
// ---------------------------------------------------------------------------------------------
// Work decomposition, quantized. 16 warps per SM, as one block or (symmetric weights, K and N
// >= 4096, rows of more than 16 units: spec_block_warps) two blocks of 8; each block stages x
// into shared memory once.
// Warp w of the W in the grid owns a run of rows and streams them R = 2 at a time: in blocks of
// 8 warps, where every warp has a step, whole steps of R rows, one more to each of the grid's
// first warps where they do not divide evenly (their blocks start first; the others exit a step
// early); otherwise the rows [N*w/W, N*(w+1)/W), equal runs (gemv_kernel.cuh has the reasons).
// Along K a row is cut into units (256, 128, 128, 64 codes at 2, 3, 4, 8 bits; four 16-byte
// loads, or three 3-bit planes), and lane l takes units l, l + 32, ...:
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
// Rows of at most 16 units (3- and 4-bit weights with K <= 2048: every linear of a 1.1B but
// down; 2-bit with K <= 4096: every linear of a 7B but down) would leave lanes 16-31 of each
// warp without a unit, the warp issuing every instruction of a step for half its lanes' worth
// of weights. They run the half-warp kernels
// (gemv_kernel.cuh, kHalf): lanes 0-15 and 16-31 each take a row step (units 0-15 of their own R
// rows, or their own pair), so a warp step is 2R rows, and warps take equal runs of whole steps
// (measured: docs/gemv-notes.md). Rows of 33-64 units run the warp-pair kernels where the grid
// has room: warps 2v and 2v + 1 take the same step, unit groups 0 and 1 of it, and 2v adds
// 2v + 1's lane sums from shared memory before its reduction (warp_pair_rows below).
//
// fp16 (gemv_f16, weights as stored): blocks of 8 warps loop over tiles of 4 rows per warp;
// lane l reads 16-byte chunk c = l + 32i of each row; k_split warps may share a row.
//
// ---------------------------------------------------------------------------------------------
// The packed layout of the weights and the accuracy of their dequantization are drawn in
// weight_decode.cuh, beside the code that decodes them; x's layout in shared memory, which
// mirrors it, in input_staging.cuh.
// ---------------------------------------------------------------------------------------------

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/dynamic_smem.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/gemv_kernel.cuh"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda {
namespace gemv_detail {
namespace {

// The flags of a call, or kDynamic where no specialized kernel covers it.
int spec_of(const KParams& p) {
  if (p.zeros || p.pro.silu_mul || ((p.epi.bias || p.epi.relu) && !p.epi.residual)) return kDynamic;
  const int ops = (p.pro.norm_w ? kNorm : 0) | (p.epi.residual ? kResidual : 0) |
                  (p.epi.silu_pair ? kSiluPair : 0) | (p.epi.res_index ? kIndexed : 0);
  switch (ops) {
    case 0: case kNorm: case kResidual: case kNorm | kResidual: case kNorm | kSiluPair:
    case kResidual | kIndexed:
      return (p.pro.perm ? kPerm : 0) | ops;
    default: return kDynamic;
  }
}

// ---- Dispatch ---------------------------------------------------------------------------------

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
// starts (and issues its first weight loads) on an SM as soon as half of it is done; where K is
// small, 8 warps lost more than that gained (measured: docs/gemv-notes.md). Rows of at most 16
// units (2 bits at K = 4096) take one block of 16 too: the half-warp kernels that give lanes
// 16-31 a row step of their own come in blocks of 16 only. `forced` (GemvLaunch::block_warps) 8
// or 16 overrides the choice.
int spec_block_warps(int64_t N, int64_t K, int units, int forced) {
  if (forced == 8 || forced == 16) return forced;
  return K >= 4096 && N >= 4096 && units > 16 ? 8 : kQuantWarps;
}

// Rows of 33-64 units (3 and 4 bits, 4096 < K <= 8192: the 1.1B's down, K = 5632, 44 units)
// took two unit groups per row step, so each warp made two round trips to memory in turn, the
// second on 12 of its 32 lanes, while the grid (one warp per two rows: 64 blocks for the 1.1B's
// 2048 rows) left half the SMs idle. The warp-pair kernels (gemv_kernel.cuh, kPair) give the two
// groups of a step to two warps, which meet in shared memory: one round trip each, on twice the
// blocks. Taken where every warp then has at most one step (N / kQuantRows pairs fit the resident
// warps): with more, a pair's steps would be the same two round trips, apart.
bool warp_pair_rows(int64_t N) {
  return (N + kQuantRows - 1) / kQuantRows <=
         int64_t(current_device_info().sm_count) * kQuantWarps / 2;
}

// The specialized kernel for a call's flags in blocks of `warps` (8 or 16), its row steps split
// as `split` says, or {nullptr, 0} (then the kDynamic one serves).
QuantKernel spec_kernel(int bits, int gs, int spec, int warps,
                        RowSplit split = RowSplit::kWhole) {
  if (spec == kDynamic) return {nullptr, 0};
  switch (bits) {
    case 2: return spec_kernel_2bit(gs, spec, warps, split);
    case 3: return spec_kernel_3bit(gs, spec, warps, split);
    case 4: return spec_kernel_4bit(gs, spec, warps, split);
    case 8: return spec_kernel_8bit(gs, spec, warps, split);
    default: return {nullptr, 0};
  }
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

// Lets a block of k use `bytes` of dynamic shared memory (x and its staging buffers, which grow
// with K), or refuses the K by name.
void ensure_smem(Kernel k, size_t bytes) {
  ensure_dynamic_smem(k, bytes, "gemv (x in shared memory: K too large)");
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

// The dynamic shared memory a quantized kernel in blocks of `warps` is launched with: its own
// `need`, raised in 8 KB steps where that would let more than kQuantWarps / warps blocks share
// an SM, so that every SM runs the design's 16 warps. A kernel under ~80 registers (the 8-bit
// kernels, whose staging holds no x in registers: 71-80) fits three 8-warp blocks, and the
// occupancy-sized grid then runs 24 warps per SM, which made the 8-bit down GEMV and the 8-bit
// decode step slower. Capping the grid at two blocks per SM is not the same: the block scheduler
// may still put three blocks on some SMs and one on others (measured: docs/gemv-notes.md).
size_t pinned_smem(Kernel k, int warps, size_t need) {
  const DeviceInfo& d = current_device_info();
  const int want = kQuantWarps / warps;
  size_t smem = need;
  while (blocks_per_sm(k, 32 * warps, smem) > want && smem + 8192 <= d.smem_per_block_optin)
    smem = (smem / 8192 + 1) * 8192;
  return smem;
}

// Quantized: the resident blocks (one or two per SM), fewer when N gives each warp less than
// kQuantRows rows; every warp then takes a run of rows (the kernel deals them), so the grid only
// sets how many warps share N. k_split does not apply (a lane owns whole units of K).
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
  launch_maybe_pdl(k, dim3(static_cast<unsigned>(std::max(grid, 1))), dim3(threads), smem, s, pdl,
                   p);
}

}  // namespace

// Whether a row of `codes` (K padded to whole units) is staged from bulk copies: K <= 8 *
// one_pass_max_vecs (one_pass_shape), so that codes <= 16384 here (K rounds up to a unit, which
// divides 16384).
static bool bulk_staged(size_t codes) { return codes <= 8 * size_t(one_pass_max_vecs(kQuantThreads)); }

size_t smem_bytes(int bits, int64_t chunks, bool has_perm) {
  // x_s; x in its natural order (the act-order gather's source, or where the bulk copy of x
  // lands); the norm weights, the act-order permutation and the mbarrier of the bulk copies.
  const size_t codes = static_cast<size_t>(chunks) * chunk_codes(bits);
  const bool bulk = bulk_staged(codes);
  return codes * 2 + (has_perm || bulk ? codes * 2 : 0) +
         (bulk ? codes * 2 + (has_perm ? codes * 4 : 0) + 16 : 0);
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
  if ((in.layer_norm || in.norm_b) && !in.norm_w)
    throw Error("gemv: GemvInput::layer_norm and norm_b go with the norm's weights (norm_w)");
  p.pro.norm_w = in.norm_w;
  p.pro.eps = in.eps;
  p.pro.silu_mul = in.silu_mul;
  p.pro.layer_norm = in.layer_norm;
  p.pro.norm_b = in.layer_norm ? in.norm_b : nullptr;
}

// The bias and ReLU epilogues; a bias without a residual is the residual.
void set_bias_relu(KParams& p, const __half*& residual, const GemvEpilogue& out) {
  if (out.relu && (out.silu_mul || out.out_index))
    throw Error("gemv: GemvEpilogue::relu goes without silu_mul and out_index");
  if (out.bias && out.silu_mul) throw Error("gemv: GemvEpilogue::bias goes without silu_mul");
  if (out.bias && !residual && out.residual_index)
    throw Error("gemv: GemvEpilogue::bias with a residual_index needs the residual it indexes");
  if (out.bias && !residual)
    residual = out.bias;
  else
    p.epi.bias = out.bias;
  p.epi.relu = out.relu;
}

// Shared memory a quantized call needs beyond the weight's smem_bytes: LayerNorm's bias on the
// bulk path (gemv_kernel.cuh: b_raw, past the mbarrier).
size_t layer_norm_smem(const GemvWeight& w, const KParams& p) {
  const size_t codes = static_cast<size_t>(w.chunks) * chunk_codes(w.bits);
  return p.pro.layer_norm && p.pro.norm_b && bulk_staged(codes) ? codes * 2 : 0;
}

void gemv(const GemvWeight& w, const __half* x, __half* y, const __half* residual,
          cudaStream_t s, GemvInput in, GemvEpilogue out) {
  if (!w.device) throw Error("gemv: the weight is empty (not prepared, or freed)");
  KParams p{};
  set_input(p, in);
  set_bias_relu(p, residual, out);
  if (out.silu_mul) {
    if (w.N % 2 != 0 || residual)
      throw Error("gemv: the SiLU epilogue needs an even N ([gate | up]) and no residual, got N=" +
                  std::to_string(w.N) + (residual ? " with a residual" : ""));
    if (out.residual_index) throw Error("gemv: GemvEpilogue::residual_index needs a residual");
    p.epi.silu_pair = static_cast<int>(w.N / 2);
    p.epi.y_index = out.out_index;
  } else if (out.out_index || out.residual_index) {
    if (!out.out_index || !out.residual_index || !residual || residual == y)
      throw Error("gemv: GemvEpilogue's out_index without the SiLU epilogue goes with a "
                  "residual_index and a residual in another buffer than y");
    p.epi.y_index = out.out_index;
    p.epi.res_index = out.residual_index;
  }
  p.codes = w.codes;
  p.row_stride = int64_t(w.planes) * w.chunks;
  p.scales = w.scales;
  p.zeros = w.zeros;
  p.pro.perm = w.perm;
  p.x = x;
  p.y = y;
  p.epi.residual = residual;
  p.N = static_cast<int>(w.N);
  p.K = static_cast<int>(w.K);
  p.nch = static_cast<int>(w.chunks / unit_chunks(w.bits));  // units per row
  p.G = static_cast<int>(w.groups);
  p.zero_const = w.zero_const;
  p.zero_offset = w.zero_offset;
  const size_t need = w.smem_bytes + layer_norm_smem(w, p);
  QuantKernel qk{nullptr, 0};
  bool pair = false;
  if (w.launch.specialized) {
    const int spec = spec_of(p);
    qk = spec_kernel(w.bits, w.group_size, spec,
                     spec_block_warps(w.N, w.K, p.nch, w.launch.block_warps));
    // Blocks of 8 warps only where two fit on an SM (x's shared memory grows with K).
    if (qk.k && qk.warps < kQuantWarps &&
        blocks_per_sm(qk.k, 32 * qk.warps, need) * qk.warps < kQuantWarps)
      qk = spec_kernel(w.bits, w.group_size, spec, kQuantWarps);
    if (qk.k && qk.warps == kQuantWarps && p.nch <= 16) {
      const QuantKernel h =
          spec_kernel(w.bits, w.group_size, spec, kQuantWarps, RowSplit::kHalfWarp);
      if (h.k) qk = h;
    }
    if (qk.k && qk.warps == kQuantWarps && p.nch > 32 && p.nch <= 64 &&
        warp_pair_rows(w.N)) {
      const QuantKernel h =
          spec_kernel(w.bits, w.group_size, spec, kQuantWarps, RowSplit::kWarpPair);
      if (h.k) qk = h, pair = true;
    }
  }
  if (!qk.k) qk = {quant_kernel(w.bits, w.group_size), kQuantWarps};
  // The grid per call (w.launch.grid 0): it depends on the block size of the kernel taken.
  const size_t smem = pinned_smem(qk.k, qk.warps, need);
  // (A warp pair streams kQuantRows rows: the grid that gives each warp kQuantRows / 2.)
  const GemvLaunch l = plan_quant(qk.k, qk.warps, pair ? 2 * w.N : w.N, smem, w.launch);
  launch(qk.k, p, l.grid, 32 * qk.warps, l.pdl, smem, s);
}

void gemv_f16(const __half* W, const __half* x, __half* y, int64_t N, int64_t K,
              const __half* residual, cudaStream_t s, GemvLaunch launch_hint, GemvInput in,
              GemvEpilogue out) {
  if (out.silu_mul || out.out_index || out.residual_index)
    throw Error("gemv_f16: of the epilogues, only bias and relu apply");
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
  set_bias_relu(p, residual, out);
  p.codes = reinterpret_cast<const uint4*>(W);
  p.row_stride = nch;
  p.x = x;
  p.y = y;
  p.epi.residual = residual;
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.nch = static_cast<int>(nch);
  p.G = 0;
  p.k_split = l.k_split;
  p.tiles = static_cast<int>(tiles_for(N, F16Op::kRows, l.k_split));  // k_split: plan_f16 checked
  launch(k, p, std::min(l.grid, p.tiles), kThreads, l.pdl, smem, s);
}

}  // namespace kestrel::cuda
