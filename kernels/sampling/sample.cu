// Top-k sampling over many blocks, merged by the last (sample.h has the rule, sample_ref.cpp
// the oracle).
//
// One block on one SM is latency-bound at every pass over a vocabulary (a one-block version of
// this kernel cost far more per token than the argmax: docs/sampling-notes.md), so the work is
// split as the attention splits long contexts:
//   A. Each of G blocks takes a contiguous chunk of at most kChunkMax logits (G <= kMaxBlocks)
//      and selects its own top k by the rule's order (larger logit first, lower id on ties).
//      The global top k is a subset of the union of these: a logit with fewer than k logits
//      before it in the whole vocabulary has fewer than k before it in its chunk. The block
//      writes its k candidates (keys and ids) to the workspace and counts itself done.
//   B. The block that counts last selects the top k of the G k candidates, ranks them, and lets
//      one warp apply top-p, min-p and the temperature and walk the draw.
// Both selections are one block's radix select on 16-bit keys in shared memory (no sort):
//   1. a histogram of the keys' high bytes finds the byte of the k-th largest key;
//   2. a histogram of the low bytes of the keys with that high byte finds the key T itself,
//      and how many keys lie above it (fewer than k);
//   3. each warp takes a contiguous run of the keys and counts its keys above T and equal to T
//      (ballots); a scan of the counts places every key above T and the first ties at T.
// Ties go to the lower id in both: a chunk's candidates are written in index order among equal
// keys, and the chunks in index order, so B's first ties at T are the lowest ids.
#include "kernels/sampling/sample_cuda.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/dynamic_smem.h"
#include "kernels/common/pdl.cuh"
#include "kernels/sampling/hand_out.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kPerLane = kDeviceTopKMax / 32;
constexpr int kMaxBlocks = 64;
constexpr int kChunkMin = 2048;                             // logits per block, at least
constexpr int kChunkMax = kDeviceSampleMax / kMaxBlocks;    // and at most (8 KB of keys)
static_assert(kChunkMax % 8 == 0 && kChunkMin <= kChunkMax, "chunks hold whole 8-key vectors");

// The workspace: a done-counter (left zero by every call), then per block its count of
// candidates and their keys and ids (kDeviceTopKMax slots each).
struct Workspace {
  uint32_t done;
  uint32_t count[kMaxBlocks];
  uint16_t key[kMaxBlocks * kDeviceTopKMax];
  int id[kMaxBlocks * kDeviceTopKMax];
};

// An order-preserving 16-bit key of an fp16 value: larger value, larger key; -0 as +0; NaN
// below everything (key 0, which -inf's 0x03FF stays above), never a candidate.
__device__ __forceinline__ uint32_t key_of(uint16_t h) {
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu)) return 0;
  if (h == 0x8000u) h = 0;
  return (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
}

// The fp16 bits of a key (NaN's key never asked).
__device__ __forceinline__ uint16_t bits_of(uint32_t key) {
  return uint16_t((key & 0x8000u) ? (key ^ 0x8000u) : (~key & 0xFFFFu));
}

struct SelectSmem {
  uint32_t sub[kWarps][256];  // per-warp histograms, zero between uses
  uint32_t hist[256];
  int bin;
  uint32_t above, total;
  uint32_t warp_gt[kWarps], warp_eq[kWarps];
};

// Over 256 bins, the bin b where the count of keys in bins >= b first reaches `need`, and the
// count in bins above b. Warp 0 computes; every thread gets it after the barrier.
__device__ __forceinline__ void find_bin(SelectSmem& sm, uint32_t need, int* out_bin,
                                         uint32_t* out_above) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    uint32_t mine = 0;  // lane l holds bins 8l .. 8l+7
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += sm.hist[8 * lane + j];
    uint32_t suffix = mine;  // the keys in lanes >= l
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t v = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
      if (lane + o < 32) suffix += v;
    }
    const uint32_t above_lane = suffix - mine;  // keys in lanes > l
    if (above_lane < need && suffix >= need) {
      uint32_t above = above_lane;
      int b = 8 * lane + 7;
      for (; b > 8 * lane; --b) {
        if (above + sm.hist[b] >= need) break;
        above += sm.hist[b];
      }
      *out_bin = b;
      *out_above = above;
    }
  }
  __syncthreads();
}

// sm.hist[b] = the number of keys whose bin is b, summed over the per-warp histograms (shared
// atomics then contend only within a warp: logits crowd into a few high bytes). Pass 1 (hi <
// 0): bin = the key's high byte, of every key but NaN's. Pass 2: bin = the low byte of the keys
// whose high byte is hi. Ends with a block barrier.
__device__ __forceinline__ void histogram(const uint16_t* keys, int m, int hi, SelectSmem& sm) {
  const int warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < m; i += kThreads) {
    const uint32_t key = keys[i];
    uint32_t bin = 256;  // none
    if (hi < 0) {
      if (key) bin = key >> 8;
    } else if (key && int(key >> 8) == hi) {
      bin = key & 0xFFu;
    }
    if (bin < 256) atomicAdd(&sm.sub[warp][bin], 1u);
  }
  __syncthreads();
  if (threadIdx.x < 256) {
    uint32_t t = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      t += sm.sub[w][threadIdx.x];
      sm.sub[w][threadIdx.x] = 0;
    }
    sm.hist[threadIdx.x] = t;
  }
  __syncthreads();
}

// The top min(k_req, valid) of keys [m] (shared memory) by (key descending, index ascending):
// their indices go to sel, every key above the k-th first, then the ties at it, each in index
// order. Returns how many (the same in every thread). Ends with a block barrier.
__device__ uint32_t block_select(const uint16_t* keys, int m, uint32_t k_req, SelectSmem& sm,
                                 int* sel) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  histogram(keys, m, -1, sm);  // 1. the high bytes
  if (warp == 0) {
    uint32_t t = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += sm.hist[8 * lane + j];
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xFFFFFFFFu, t, o);
    if (lane == 0) sm.total = t;
  }
  __syncthreads();
  const uint32_t k = min(k_req, sm.total);
  if (k == 0) return 0;

  find_bin(sm, k, &sm.bin, &sm.above);
  const int hi = sm.bin;
  uint32_t above = sm.above;
  histogram(keys, m, hi, sm);  // 2. the low bytes under that high byte
  find_bin(sm, k - above, &sm.bin, &sm.above);
  const uint32_t T = (uint32_t(hi) << 8) | uint32_t(sm.bin);  // the k-th largest key
  above += sm.above;                                          // keys above T (< k)

  // 3. Warp w takes [w R, (w + 1) R), lane l its keys w R + 32 j + l: in (j, l) order that is
  // index order, so ballots place each warp's keys and a scan of the warps' counts the warps.
  const int R = (m + kThreads - 1) / kThreads * 32;
  const int w0 = min(m, warp * R), w1 = min(m, w0 + R);
  const uint32_t below = (1u << lane) - 1;  // lanes before this one
  uint32_t gt = 0, eq = 0;                  // this warp's counts (every lane holds them)
  for (int i = w0 + lane; i - lane < w1; i += 32) {
    const uint32_t key = i < w1 ? keys[i] : 0;
    gt += __popc(__ballot_sync(0xFFFFFFFFu, key > T));
    eq += __popc(__ballot_sync(0xFFFFFFFFu, key == T));
  }
  if (lane == 0) sm.warp_gt[warp] = gt, sm.warp_eq[warp] = eq;
  __syncthreads();
  uint32_t off_gt = 0, off_eq = 0;  // the warps before this one
  for (int w = 0; w < warp; ++w) off_gt += sm.warp_gt[w], off_eq += sm.warp_eq[w];
  if (gt || (eq && off_eq < k - above)) {
    for (int i = w0 + lane; i - lane < w1; i += 32) {
      const uint32_t key = i < w1 ? keys[i] : 0;
      const uint32_t bg = __ballot_sync(0xFFFFFFFFu, key > T);
      const uint32_t be = __ballot_sync(0xFFFFFFFFu, key == T);
      int slot = -1;
      if (key > T) slot = off_gt + __popc(bg & below);
      const uint32_t e = off_eq + __popc(be & below);
      if (key == T && e < k - above) slot = above + e;
      if (slot >= 0) sel[slot] = i;
      off_gt += __popc(bg);
      off_eq += __popc(be);
    }
  }
  __syncthreads();
  return k;
}

// The draw from k candidates (cand_l, cand_id, in any order): rank them by (logit descending,
// id ascending), then warp 0 applies top-p, min-p and the temperature and walks the draw.
// Returns the token in warp 0 (k >= 1).
__device__ int draw(const float* cand_l, const int* cand_id, uint32_t k, float* sorted_l,
                    int* sorted_id, const TopKSampling& sp) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid < int(k)) {  // keys are distinct per value and ids unique, so ranks are too
    const float l = cand_l[tid];
    const int id = cand_id[tid];
    int rank = 0;
    for (uint32_t j = 0; j < k; ++j) {
      const float lj = cand_l[j];
      rank += lj > l || (lj == l && cand_id[j] < id);
    }
    sorted_l[rank] = l;
    sorted_id[rank] = id;
  }
  __syncthreads();
  if (tid >= 32) return 0;

  // Lane l holds candidates 8l .. 8l+7 (in rank order); past k they weigh nothing.
  const float mx = sorted_l[0];
  float l[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const uint32_t i = kPerLane * lane + j;
    l[j] = i < k ? sorted_l[i] : -INFINITY;
  }
  // Inclusive prefix sums of w over the candidates, in rank order: lane sums, then a scan.
  auto scan = [&](const float (&w)[kPerLane], double (&cum)[kPerLane], double& total) {
    double acc = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) cum[j] = acc += w[j];
    double incl = acc;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += v;
    }
    const double before = incl - acc;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) cum[j] += before;
    total = __shfl_sync(0xFFFFFFFFu, incl, 31);
  };
  // The first candidate index whose predicate holds, or `none`.
  auto first_where = [&](auto pred, uint32_t none) {
    uint32_t f = none;
#pragma unroll
    for (int j = kPerLane - 1; j >= 0; --j)
      if (pred(j)) f = kPerLane * lane + j;
    for (int o = 16; o > 0; o >>= 1) f = min(f, __shfl_xor_sync(0xFFFFFFFFu, f, o));
    return f;
  };
  uint32_t keep = k;
  if (sp.top_p < 1.0f) {
    float w[kPerLane];
    double cum[kPerLane], total;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) w[j] = expf(l[j] - mx);
    scan(w, cum, total);
    const double need = double(sp.top_p) * total;
    const uint32_t cross =
        first_where([&](int j) { return kPerLane * lane + j < int(k) && cum[j] >= need; }, k);
    keep = min(keep, cross + 1);
  }
  if (sp.min_p > 0.0f) {
    const float floor = mx + logf(sp.min_p);
    keep = min(keep, first_where([&](int j) { return !(l[j] >= floor); }, k));
  }
  keep = max(keep, 1u);
  const float inv_t = 1.0f / sp.temperature;
  float w[kPerLane];
  double cum[kPerLane], total;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    w[j] = uint32_t(kPerLane * lane + j) < keep ? expf((l[j] - mx) * inv_t) : 0.f;
  scan(w, cum, total);
  const double r = philox_uniform(sp.seed, sp.draws) * total;
  const uint32_t pick = first_where(
      [&](int j) { return uint32_t(kPerLane * lane + j) < keep && cum[j] > r; }, keep - 1);
  return sorted_id[pick];
}

__global__ void __launch_bounds__(kThreads)
    sample_top_k_kernel(const uint16_t* __restrict__ x, int n, int chunk, TopKSampling* params,
                        Workspace* ws, int* __restrict__ out, int* feed, int* host_out) {
  extern __shared__ uint4 staged[];  // keys: A's chunk, then B's G k candidates
  __shared__ SelectSmem sm;
  __shared__ int sel[kDeviceTopKMax];
  __shared__ float cand_l[kDeviceTopKMax], sorted_l[kDeviceTopKMax];
  __shared__ int cand_id[kDeviceTopKMax], sorted_id[kDeviceTopKMax];
  __shared__ uint32_t count[kMaxBlocks];
  __shared__ bool last;
  const int tid = threadIdx.x, b = blockIdx.x, G = gridDim.x;
  for (int i = tid; i < kWarps * 256; i += kThreads) (&sm.sub[0][0])[i] = 0;
  pdl_wait_then_release();  // the logits come from the lm_head GEMV
  const TopKSampling sp = *params;
  const uint32_t k_req = uint32_t(min(max(sp.top_k, 1), kDeviceTopKMax));
  uint16_t* keys = reinterpret_cast<uint16_t*>(staged);

  // A. This block's chunk [c0, c0 + m) as keys, 16-byte loads where aligned.
  const int c0 = b * chunk, m = min(chunk, n - c0);
  const bool vec = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;  // chunk is a multiple of 8
  for (int v = tid; v < (m + 7) / 8; v += kThreads) {
    uint16_t h[8];
    if (vec && 8 * v + 8 <= m) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + c0 + 8 * v);
      memcpy(h, &raw, sizeof(raw));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = 8 * v + j < m ? x[c0 + 8 * v + j] : uint16_t(0x7E00);
    }
    uint16_t kk[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) kk[j] = uint16_t(key_of(h[j]));
    memcpy(&staged[v], kk, sizeof(kk));
  }
  __syncthreads();
  const uint32_t kb = block_select(keys, m, k_req, sm, sel);
  for (uint32_t j = tid; j < kb; j += kThreads) {
    ws->key[b * kDeviceTopKMax + j] = keys[sel[j]];
    ws->id[b * kDeviceTopKMax + j] = c0 + sel[j];
  }
  if (tid == 0) ws->count[b] = kb;
  __threadfence();  // the candidates are visible before this block counts itself done
  __syncthreads();
  if (tid == 0) last = atomicAdd(&ws->done, 1u) == uint32_t(G - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();  // and this block reads them after every block counted itself

  // B. The G k candidates, block by block (slot j of block c at c k + j; empty slots NaN).
  if (tid < G) count[tid] = __ldcg(&ws->count[tid]);
  __syncthreads();
  const int M = G * int(k_req);
  for (int p = tid; p < M; p += kThreads) {
    const int c = p / int(k_req), j = p - c * int(k_req);
    keys[p] = uint32_t(j) < count[c] ? __ldcg(&ws->key[c * kDeviceTopKMax + j]) : uint16_t(0);
  }
  __syncthreads();
  const uint32_t k = block_select(keys, M, k_req, sm, sel);
  for (uint32_t j = tid; j < k; j += kThreads) {
    const int p = sel[j], c = p / int(k_req);
    cand_l[j] = __half2float(__ushort_as_half(bits_of(keys[p])));
    cand_id[j] = __ldcg(&ws->id[c * kDeviceTopKMax + (p - c * int(k_req))]);
  }
  if (tid == 0) ws->done = 0;  // for the next call, which starts after this grid completes
  __syncthreads();
  const int token = k > 0 ? draw(cand_l, cand_id, k, sorted_l, sorted_id, sp) : 0;
  if (tid == 0) {
    params->draws = sp.draws + 1;
    hand_out_token(token, out, feed, host_out);
  }
}

}  // namespace

size_t sample_top_k_workspace_bytes() { return sizeof(Workspace); }

void sample_top_k_workspace_reset(void* workspace, cudaStream_t stream) {
  KESTREL_CUDA_CHECK(cudaMemsetAsync(workspace, 0, sizeof(Workspace), stream));
}

void sample_top_k_f16(const __half* logits, int n, TopKSampling* params, void* workspace,
                      int* d_out_token, cudaStream_t stream, int* feed, int* host_out) {
  KESTREL_CHECK(n > 0 && n <= kDeviceSampleMax,
                "sample_top_k_f16: n must be in 1 .. " + std::to_string(kDeviceSampleMax) +
                    ", got " + std::to_string(n));
  // Chunks of kChunkMin logits, longer where that would take more than kMaxBlocks blocks.
  const int per_block = (n + kMaxBlocks - 1) / kMaxBlocks;
  const int chunk = std::max(kChunkMin, (per_block + 7) / 8 * 8);
  const int G = (n + chunk - 1) / chunk;
  const size_t smem = std::max<size_t>(size_t(chunk), size_t(G) * kDeviceTopKMax) * 2;
  ensure_dynamic_smem(sample_top_k_kernel, smem, "sample_top_k_f16");
  launch_pdl(sample_top_k_kernel, dim3(G), dim3(kThreads), smem, stream,
             reinterpret_cast<const uint16_t*>(logits), n, chunk, params,
             static_cast<Workspace*>(workspace), d_out_token, feed, host_out);
}

}  // namespace kestrel::cuda
