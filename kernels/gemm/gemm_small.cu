// The launcher of the fused small-M GEMM (gemm_small.h): argument checks, the split-K plan,
// the workspace, the x gather of act-order (or unaligned) inputs, the launch. The kernels are in
// gemm_small_kernel.cuh, compiled per bit width in gemm_small_b{2,3,4,8}.cu; docs/gemm-small.md
// has the design.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/common/cuda_utils.h"
#include "kernels/common/dynamic_smem.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/gemm_small.h"
#include "kernels/gemm/gemm_small_kernel.cuh"
#include "kernels/gemm/gemm_stream_kernel.cuh"
#include "kernels/gemv/gemv_layout.h"

namespace kestrel::cuda {
namespace gemm_small_detail {
namespace {

// The most split-K ranges a row block is cut into: each adds a partial sum of the block's tile
// to the workspace and to the last block's reduction.
constexpr int kMaxSplits = 16;
// The split-K counters' region at the start of every workspace, the same place and size for
// every call: calls of any M, weight and plan share one workspace (the model's passes do), and
// each leaves its counters at zero, so no call's partial sums or gathered x may ever be laid
// over another call's counters. A plan with more blocks than this is not split.
constexpr int64_t kMaxCounters = 16384;
constexpr size_t kCountersBytes = kMaxCounters * sizeof(int);
// A block's fixed cost in stage-times (its first loads' round trip, the partial-sum store and
// the reduction), against which the split choice weighs shorter K ranges. A tuning constant.
constexpr int kBlockOverheadStages = 2;

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// x rows, when gathered: K rounded up to 8 (16-byte rows), zero past K.
int64_t packed_ldx(const GemvWeight& w) { return (w.K + 7) / 8 * 8; }

// The argument checks that need no device: every one gemm_small makes before its first CUDA
// call, in the order a caller would want them reported.
void check_args(const GemvWeight& w, const __half* x, int64_t M, const __half* y,
                const __half* residual, const GemvEpilogue& out) {
  if (!w.device) throw Error("gemm_small: the weight is empty (not prepared, or freed)");
  if (w.bits != 2 && w.bits != 3 && w.bits != 4 && w.bits != 8)
    throw Error("gemm_small: bits=" + std::to_string(w.bits) + " is not supported (2, 3, 4, 8)");
  if (w.group_size != 0 && w.group_size != 32 && w.group_size != 64 && w.group_size != 128)
    throw Error("gemm_small: effective group size " + std::to_string(w.group_size) +
                " is not supported (32, 64, 128, per row)");
  if (M < 1 || M > kGemmSmallMaxRows)
    throw Error("gemm_small: M=" + std::to_string(M) + " is outside 1.." +
                std::to_string(kGemmSmallMaxRows) + " (larger batches: quant_gemm)");
  if (w.N <= 0 || w.K <= 0 || w.N > (int64_t(1) << 30) || w.K > (int64_t(1) << 30))
    throw Error("gemm_small: weight shape [" + std::to_string(w.N) + ", " + std::to_string(w.K) +
                "] out of range");
  if (!x || !y) throw Error("gemm_small: x and y must be device pointers, got a null one");
  if (x == y) throw Error("gemm_small: y must not alias x");
  if (reinterpret_cast<uintptr_t>(x) & 15u) throw Error("gemm_small: x must be 16-byte aligned");
  if (out.out_index || out.residual_index)
    throw Error("gemm_small: GemvEpilogue::out_index and residual_index are not supported");
  if (out.silu_mul) {
    if (w.N % 2 != 0)
      throw Error("gemm_small: the SiLU epilogue needs an even N ([gate | up]), got N=" +
                  std::to_string(w.N));
    if (residual || out.bias || out.relu)
      throw Error("gemm_small: the SiLU epilogue goes without residual, bias and relu");
  }
}

struct Plan {
  Kernel kernel = nullptr;
  int nt = 0, token_groups = 1;  // n-tiles per block; blocks side by side per row block
  int warps = 0, threads = 0, rows_per_block = 0;
  int64_t row_blocks = 0;
  int n_stages = 0, splits = 1, stages = 0;
  bool x_once = false;
  bool stream = false;
  int k_slices = 1;  // warps per m-tile (streaming kernel); 1 for the ring kernel
  int x_slots = 0;
  size_t smem = 0;
  bool pack = false;  // x gathered into the workspace first
  int64_t ldx = 0;
  size_t counters_bytes = 0, partial_bytes = 0, x_bytes = 0;
  int64_t blocks() const { return row_blocks * token_groups; }  // gridDim.x
  size_t workspace() const { return counters_bytes + partial_bytes + x_bytes; }
};

Kernel stream_kernel_of(int bits, int gs, int nt) {
  switch (bits) {
    case 2: return stream_kernel_2bit(gs, nt);
    case 4: return stream_kernel_4bit(gs, nt);
    case 8: return stream_kernel_8bit(gs, nt);
    default: return nullptr;
  }
}

Kernel kernel_of(int bits, int gs, int nt) {
  switch (bits) {
    case 2: return kernel_2bit(gs, nt);
    case 3: return kernel_3bit(gs, nt);
    case 4: return kernel_4bit(gs, nt);
    case 8: return kernel_8bit(gs, nt);
    default: return nullptr;
  }
}

// Resident blocks per SM of kernel k in blocks of `threads` with `smem` bytes (cached: a
// query per call would cost microseconds of host time); 0 when a block does not fit. k's
// shared-memory limit is raised for such a block first, so that the query sees the kernel as
// it will launch.
int blocks_per_sm(Kernel k, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  const DeviceInfo& d = current_device_info();
  if (smem > max_dynamic_smem(k)) return 0;
  ensure_dynamic_smem(k, smem, "gemm_small");
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(d.id, reinterpret_cast<const void*>(k), threads, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int occ = 0;
  KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, threads, smem));
  cache.emplace(key, occ);
  return occ;
}

// The time of a grid of `blocks` blocks of `work` stage-times each, `occ` resident per SM, in
// stage-times: waves of resident blocks x (stages per block + a block's fixed cost). A wave
// counts each resident block as streaming at a whole SM's rate: true where a block's rate is
// bound by its own latency (bytes in flight, dependent mma chains), not where co-resident
// blocks share a bandwidth limit; the sweep (kestrel-bench-gemm --fused-sweep) measures which.
int64_t grid_cost(int64_t blocks, int64_t work, int occ, int64_t sms) {
  const int64_t waves = (blocks + sms * occ - 1) / (sms * occ);
  return waves * (work + kBlockOverheadStages);
}

// Split-K: the count with the least grid_cost, the fewest among equals. Where N alone gives
// too few blocks (the 7B's o and down: 32 row blocks) the K axis is cut; where it gives more
// than a wave (gate|up) cutting K evens the last wave. occ_of(s): resident blocks per SM at s
// splits (x staged once takes shared memory by the length of a split's range), 0 where a
// block does not fit.
template <class OccOf>
int choose_splits(int64_t blocks, int n_stages, int64_t sms, OccOf occ_of, int slices = 1) {
  int best = 0;
  int64_t best_cost = INT64_MAX;
  for (int s = 1; s <= std::min(n_stages, kMaxSplits); ++s) {
    const int occ = occ_of(s);
    if (occ < 1) continue;
    if (s > 1 && blocks > kMaxCounters) break;
    const int64_t cost = grid_cost(blocks * s, ((n_stages + s - 1) / s + slices - 1) / slices, occ, sms);
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

std::string plan_name(const Plan& p) {
  if (p.stream)
    return "stream warps=" + std::to_string(p.warps) + " k_slices=" + std::to_string(p.k_slices) +
           " token_tiles=" + std::to_string(p.nt);
  return "warps=" + std::to_string(p.warps) + " stages=" + std::to_string(p.stages) +
         " token_tiles=" + std::to_string(p.nt) + (p.x_once ? " x_once" : "");
}

Plan make_plan(const GemvWeight& w, int64_t M, GemmSmallLaunch launch,
               const GemvEpilogue& out) {
  Plan p;
  const GemmSmallLaunch& l = launch;
  if (l.warps != 0 && l.warps != 2 && l.warps != 4 && l.warps != 8)
    throw Error("gemm_small: warps=" + std::to_string(l.warps) + " is not 2, 4 or 8");
  if (l.stages != 0 && (l.stages < 2 || l.stages > kMaxStages))
    throw Error("gemm_small: stages=" + std::to_string(l.stages) + " is outside 2.." +
                std::to_string(kMaxStages));
  if (l.token_tiles != 0 && l.token_tiles != 1 && l.token_tiles != 2 && l.token_tiles != 4 &&
      l.token_tiles != 8)
    throw Error("gemm_small: token_tiles=" + std::to_string(l.token_tiles) +
                " is not 1, 2, 4 or 8");
  // n-tiles: M's, rounded up to a compiled count, or fewer per block in token groups.
  const int tiles = static_cast<int>((M + 7) / 8);
  const int need = tiles <= 1 ? 1 : tiles <= 2 ? 2 : tiles <= 4 ? 4 : 8;
  p.nt = l.token_tiles > 0 ? std::min(l.token_tiles, need) : need;
  p.token_groups = (tiles + p.nt - 1) / p.nt;
  p.stream = l.stream;
  p.kernel = p.stream ? stream_kernel_of(w.bits, w.group_size, p.nt)
                      : kernel_of(w.bits, w.group_size, p.nt);
  if (!p.kernel)
    throw Error(std::string("gemm_small: no ") + (p.stream ? "streaming " : "") +
                "kernel compiled for bits=" + std::to_string(w.bits) + ", group " +
                std::to_string(w.group_size) + ", " + std::to_string(p.nt) + " token tiles (M=" +
                std::to_string(M) + ")");
  p.warps = l.warps > 0 ? l.warps : p.stream ? kMaxWarps : block_warps(w.bits);
  p.threads = 32 * p.warps;
  p.stages = l.stages > 0 ? l.stages : pipeline_stages(p.nt);
  p.x_once = l.x_once || p.stream;
  if (l.k_slices < 0)
    throw Error("gemm_small: k_slices=" + std::to_string(l.k_slices) + " is negative");
  if (p.stream) {
    p.k_slices = l.k_slices > 0 ? l.k_slices : 2;
    if (p.k_slices > p.warps || p.warps % p.k_slices != 0 || p.k_slices > kMaxSlices)
      throw Error("gemm_small: k_slices=" + std::to_string(p.k_slices) +
                  " does not divide warps=" + std::to_string(p.warps));
  } else if (l.k_slices > 1) {
    throw Error("gemm_small: k_slices needs the streaming kernel (stream)");
  }
  const int64_t out_rows = out.silu_mul ? w.N / 2 : w.N;
  p.rows_per_block = (out.silu_mul ? 8 : 16) * (p.warps / p.k_slices);
  p.row_blocks = (out_rows + p.rows_per_block - 1) / p.rows_per_block;
  const int64_t units = w.chunks / gemv_detail::unit_chunks(w.bits);
  p.n_stages = static_cast<int>((units + stage_units(w.bits) - 1) / stage_units(w.bits));
  if (l.splits < 0 || l.splits > std::min(p.n_stages, kMaxSplits))
    throw Error("gemm_small: splits=" + std::to_string(l.splits) + " is outside 1.." +
                std::to_string(std::min(p.n_stages, kMaxSplits)) + " for K=" +
                std::to_string(w.K) + " (" + std::to_string(p.n_stages) + " stages)");
  p.pack = w.perm != nullptr || w.K % 8 != 0;
  p.ldx = p.pack ? packed_ldx(w) : w.K;
  if (p.blocks() > INT32_MAX) throw Error("gemm_small: too many rows");

  // Shared memory at s splits: the ring, and x of a ring's stages or of the longest range.
  auto x_slots_of = [&](int s) { return p.x_once ? (p.n_stages + s - 1) / s : p.stages; };
  auto smem_of = [&](int s) {
    return p.stream ? stream_smem_bytes(p.nt, p.warps, p.k_slices, x_slots_of(s))
                    : smem_bytes(w.bits, w.group_size, p.nt, p.warps, p.stages, x_slots_of(s));
  };
  auto occ_of = [&](int s) { return blocks_per_sm(p.kernel, p.threads, smem_of(s)); };
  const int64_t sms = current_device_info().sm_count;
  p.splits = l.splits > 0 ? l.splits
                          : choose_splits(p.blocks(), p.n_stages, sms, occ_of, p.k_slices);
  if (p.splits < 1 || occ_of(p.splits) < 1)
    throw Error("gemm_small: the plan " + plan_name(p) + " needs " +
                std::to_string(smem_of(p.splits > 0 ? p.splits : std::min(p.n_stages, kMaxSplits))) +
                " bytes of shared memory a block for M=" + std::to_string(M) + ", K=" +
                std::to_string(w.K) + "; device " + std::to_string(current_device_info().id) +
                " allows " + std::to_string(max_dynamic_smem(p.kernel)));
  if (p.splits > 1 && p.blocks() > kMaxCounters)
    throw Error("gemm_small: splits=" + std::to_string(p.splits) + " over " +
                std::to_string(p.blocks()) + " blocks; split-K takes at most " +
                std::to_string(kMaxCounters) + " blocks");
  p.x_slots = x_slots_of(p.splits);
  p.smem = smem_of(p.splits);
  if (p.splits > 1)
    p.partial_bytes =
        align256(size_t(p.splits) * p.blocks() * p.threads * p.nt * 4 * sizeof(float));
  if (p.pack) p.x_bytes = align256(size_t(M) * p.ldx * sizeof(__half));
  if (p.partial_bytes + p.x_bytes > 0) p.counters_bytes = kCountersBytes;
  return p;
}

// xp[m][j] = x[m][perm[j]] (x[m][j] without a permutation) for j < K, zero for K <= j < ldx.
__global__ void pack_x_kernel(const __half* x, const int32_t* perm, int64_t M, int64_t K,
                              int64_t ldx, __half* xp) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * ldx) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int64_t m = i / ldx, j = i % ldx;
  xp[i] = j < K ? x[m * K + (perm ? perm[j] : j)] : __float2half(0.f);
}

}  // namespace
}  // namespace gemm_small_detail

using namespace gemm_small_detail;

GemmSmallLaunch gemm_small_plan(const GemvWeight& w, int64_t M, GemmSmallLaunch launch,
                                GemvEpilogue out) {
  alignas(16) static const __half probe[16] = {};
  check_args(w, probe, M, probe + 8, nullptr, out);
  const Plan p = make_plan(w, M, launch, out);
  GemmSmallLaunch r = launch;
  r.splits = p.splits;
  r.warps = p.warps;
  r.stages = p.stages;
  r.token_tiles = p.nt;
  r.x_once = p.x_once;
  r.stream = p.stream;
  r.k_slices = p.stream ? p.k_slices : 0;
  return r;
}

size_t gemm_small_workspace_bytes(const GemvWeight& w, int64_t M, GemmSmallLaunch launch,
                                  GemvEpilogue out) {
  // Stand-in x and y (16-byte aligned, distinct) for the checks: the workspace does not depend
  // on them.
  alignas(16) static const __half probe[16] = {};
  check_args(w, probe, M, probe + 8, nullptr, out);
  return make_plan(w, M, launch, out).workspace();
}

void gemm_small(const GemvWeight& w, const __half* x, int64_t M, __half* y,
                const __half* residual, void* workspace, size_t workspace_bytes, cudaStream_t s,
                GemvEpilogue out, GemmSmallLaunch launch, int64_t ldy) {
  check_args(w, x, M, y, residual, out);
  const int64_t cols = out.silu_mul ? w.N / 2 : w.N;
  if (ldy != 0 && ldy < cols)
    throw Error("gemm_small: ldy=" + std::to_string(ldy) + " is less than the output's " +
                std::to_string(cols) + " columns");
  if (workspace && (reinterpret_cast<uintptr_t>(workspace) & 15u))
    throw Error("gemm_small: the workspace must be 16-byte aligned");
  const Plan plan = make_plan(w, M, launch, out);
  const size_t need = plan.workspace();
  if (need > 0 && (!workspace || workspace_bytes < need))
    throw Error("gemm_small: the workspace holds " + std::to_string(workspace ? workspace_bytes : 0) +
                " bytes, M=" + std::to_string(M) + " on [" + std::to_string(w.N) + ", " +
                std::to_string(w.K) + "] needs " + std::to_string(need) +
                " (gemm_small_workspace_bytes)");

  char* ws = static_cast<char*>(workspace);
  Params p{};
  p.codes = w.codes;
  p.row_stride = int64_t(w.planes) * w.chunks;
  p.scales = w.scales;
  p.zeros = w.zeros;
  p.G = static_cast<int>(w.groups);
  p.zero_const = w.zero_const;
  p.zero_offset = w.zero_offset;
  p.nch = static_cast<int>(w.chunks / gemv_detail::unit_chunks(w.bits));
  p.x = x;
  p.ldx = static_cast<int>(plan.ldx);
  p.kx = static_cast<int>(plan.pack ? plan.ldx : w.K);
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(w.N);
  p.silu_half = out.silu_mul ? static_cast<int>(w.N / 2) : 0;
  p.rows = static_cast<int>(out.silu_mul ? w.N / 2 : w.N);
  p.ldy = ldy ? ldy : p.rows;
  p.y = y;
  p.residual = residual;
  p.bias = out.bias;
  p.relu = out.relu;
  p.n_stages = plan.n_stages;
  p.stages = plan.stages;
  p.x_once = plan.x_once;
  p.x_slots = plan.x_slots;
  p.token_groups = plan.token_groups;
  p.k_slices = plan.k_slices;
  if (plan.splits > 1) {
    p.counters = reinterpret_cast<int*>(ws);
    p.partials = reinterpret_cast<float*>(ws + plan.counters_bytes);
  }
  if (plan.pack) {
    __half* xp = reinterpret_cast<__half*>(ws + plan.counters_bytes + plan.partial_bytes);
    const int64_t total = M * plan.ldx;
    const int64_t blocks = (total + 255) / 256;
    const __half* xin = x;
    const int32_t* perm = w.perm;
    launch_maybe_pdl(pack_x_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, s,
                     launch.pdl, xin, perm, M, w.K, plan.ldx, xp);
    p.x = xp;
  }
  ensure_dynamic_smem(plan.kernel, plan.smem, "gemm_small");
  launch_maybe_pdl(plan.kernel,
                   dim3(static_cast<unsigned>(plan.blocks()), static_cast<unsigned>(plan.splits)),
                   dim3(plan.threads), plan.smem, s, launch.pdl, p);
}

}  // namespace kestrel::cuda
