// Top-k sampling in one block of 1024 threads (sample.h has the rule, sample_ref.cpp the oracle).
//
// The k largest logits, by a radix select on their 16-bit fp16 keys (no sort of the vocabulary):
//   1. a histogram of the keys' high bytes finds the byte of the k-th largest key;
//   2. a histogram of the low bytes of the keys with that high byte finds the key T itself,
//      and how many keys lie above it (fewer than k);
//   3. each warp takes a contiguous run of the vocabulary and counts its keys above T and
//      equal to T (ballots); a scan of the counts places every key above T and the first ties
//      at T (lowest ids first, as the host's top-k breaks ties), k in all.
// The logits are read once, into shared memory as keys (up to kStageMax of them; a larger
// vocabulary is read from L2 at each pass). The k candidates are then ranked by
// (logit descending, id ascending) and one warp applies top-p, min-p and the temperature over
// them (8 per lane, in order) and walks the draw.
#include "kernels/sampling/sample_cuda.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "engine/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/common/pdl.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kPerLane = kDeviceTopKMax / 32;
// Vocabularies up to this many logits are staged in shared memory as keys (160 KB; with the
// block's 37 KB of fixed arrays within the 227 KB a block may take); larger ones are read from
// L2 at each of the three passes.
constexpr int kStageMax = kDeviceSampleStagedMax;

// An order-preserving 16-bit key of an fp16 value: larger value, larger key; -0 as +0; NaN
// below everything (key 0, which -inf's 0x03FF stays above), never a candidate.
__device__ __forceinline__ uint32_t key_of(uint16_t h) {
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu)) return 0;
  if (h == 0x8000u) h = 0;
  return (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
}

// Over 256 bins (shared), the bin b where the count of keys in bins >= b first reaches `need`,
// and the count in bins above b. Warp 0 computes; every thread gets it after the barrier.
__device__ __forceinline__ void find_bin(const uint32_t* hist, uint32_t need, int* out_bin,
                                         uint32_t* out_above) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    uint32_t mine = 0;  // lane l holds bins 8l .. 8l+7
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += hist[8 * lane + j];
    // suffix: the keys in lanes >= l
    uint32_t suffix = mine;
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
        if (above + hist[b] >= need) break;
        above += hist[b];
      }
      *out_bin = b;
      *out_above = above;
    }
  }
  __syncthreads();
}

// The keys of the logits: staged once in shared memory (vocabularies up to kStageMax), or read
// from the logits (L2) at every pass. `keys` is padded with NaN keys (0) to a multiple of 8.
template <bool kStaged>
struct Keys {
  const uint16_t* x;
  const uint16_t* keys;
  __device__ __forceinline__ uint32_t operator[](int i) const {
    if constexpr (kStaged) return keys[i];
    else return key_of(x[i]);
  }
};

// The fp16 bits of a key (NaN's key never asked).
__device__ __forceinline__ uint16_t bits_of(uint32_t key) {
  return uint16_t((key & 0x8000u) ? (key ^ 0x8000u) : (~key & 0xFFFFu));
}

// hist[b] = the number of keys whose bin (see below) is b, b < 256, summed over per-warp
// histograms `sub` (zero on entry, left zero): shared-memory atomics contend only within a warp
// (logits crowd into a few high bytes). Pass 1 (hi < 0): bin = the key's high
// byte, of every key but NaN's. Pass 2: bin = the low byte of the keys whose high byte is hi.
// Ends with a block barrier.
template <bool kStaged>
__device__ __forceinline__ void histogram(const Keys<kStaged>& key_at, int n, int hi,
                                          uint32_t (*sub)[256], uint32_t* hist) {
  const int warp = threadIdx.x >> 5;
  const int rounds = (n + kThreads - 1) / kThreads;
#pragma unroll 4
  for (int r = 0; r < rounds; ++r) {
    const int i = r * kThreads + threadIdx.x;
    uint32_t bin = 256;  // none
    if (i < n) {
      const uint32_t key = key_at[i];
      if (hi < 0) {
        if (key) bin = key >> 8;
      } else if (key && int(key >> 8) == hi) {
        bin = key & 0xFFu;
      }
    }
    if (bin < 256) atomicAdd(&sub[warp][bin], 1u);
  }
  __syncthreads();
  if (threadIdx.x < 256) {
    uint32_t t = 0;
    for (int w = 0; w < kWarps; ++w) {
      t += sub[w][threadIdx.x];
      sub[w][threadIdx.x] = 0;
    }
    hist[threadIdx.x] = t;
  }
  __syncthreads();
}

template <bool kStaged>
__global__ void __launch_bounds__(kThreads)
    sample_top_k_kernel(const uint16_t* __restrict__ x, int n, TopKSampling* params,
                        int* __restrict__ out, int* feed, int* host_out) {
  extern __shared__ uint4 staged[];  // kStaged: the keys [round_up(n, 8)]
  __shared__ uint32_t sub[kWarps][256];
  __shared__ uint32_t hist[256];
  __shared__ int s_bin;
  __shared__ uint32_t s_above, s_total;
  __shared__ uint32_t warp_gt[kWarps], warp_eq[kWarps];
  __shared__ float cand_l[kDeviceTopKMax], sorted_l[kDeviceTopKMax];
  __shared__ int cand_id[kDeviceTopKMax], sorted_id[kDeviceTopKMax];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kWarps * 256; i += kThreads) (&sub[0][0])[i] = 0;
  pdl_wait_then_release();  // the logits come from the lm_head GEMV
  const TopKSampling sp = *params;
  uint16_t* keys = reinterpret_cast<uint16_t*>(staged);
  const int n8 = (n + 7) / 8;  // 8-key vectors, the last one padded
  if constexpr (kStaged) {
    // One pass over the logits: 16-byte loads where aligned, keys into shared memory.
    const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
    for (int v = tid; v < n8; v += kThreads) {
      uint16_t h[8];
      if (vec) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + 8 * v);
        memcpy(h, &raw, sizeof(raw));
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = 8 * v + j < n ? x[8 * v + j] : uint16_t(0x7E00);
      }
      uint16_t kk[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) kk[j] = uint16_t(key_of(h[j]));
      memcpy(&staged[v], kk, sizeof(kk));
    }
  }
  __syncthreads();
  const Keys<kStaged> key_at{x, keys};

  // 1. The high bytes; k = top_k, or every non-NaN logit when there are fewer.
  histogram(key_at, n, -1, sub, hist);
  if (warp == 0) {
    uint32_t t = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += hist[8 * lane + j];
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xFFFFFFFFu, t, o);
    if (lane == 0) s_total = t;
  }
  __syncthreads();
  const uint32_t k = min(uint32_t(max(sp.top_k, 1)), s_total);

  uint32_t T = 0, above = 0;  // the k-th largest key, and the number of keys above it
  if (k > 0) {
    find_bin(hist, k, &s_bin, &s_above);
    const int hi = s_bin;
    above = s_above;
    // 2. The low bytes under that high byte.
    histogram(key_at, n, hi, sub, hist);
    find_bin(hist, k - above, &s_bin, &s_above);
    T = (uint32_t(hi) << 8) | uint32_t(s_bin);
    above += s_above;
  }

  // 3. Every key above T, then the first k - above ties at T in index order. Warp w takes the
  // contiguous range [w R, (w + 1) R), lane l its keys w R + 32 j + l: in (j, l) order that is
  // index order, so ballots place each warp's keys, and a scan of the warps' counts places the
  // warps.
  const int R = (n + kThreads - 1) / kThreads * 32;
  const int w0 = min(n, warp * R), w1 = min(n, w0 + R);
  const uint32_t below = (1u << lane) - 1;  // lanes before this one
  uint32_t gt = 0, eq = 0;  // this warp's counts (every lane holds them)
  if (k > 0)
    for (int i = w0 + lane; i - lane < w1; i += 32) {
      const uint32_t key = i < w1 ? key_at[i] : 0;
      gt += __popc(__ballot_sync(0xFFFFFFFFu, key > T));
      eq += __popc(__ballot_sync(0xFFFFFFFFu, key == T));
    }
  if (lane == 0) warp_gt[warp] = gt, warp_eq[warp] = eq;
  __syncthreads();
  uint32_t off_gt = 0, off_eq = 0;  // the warps before this one
  for (int w = 0; w < warp; ++w) off_gt += warp_gt[w], off_eq += warp_eq[w];
  if (k > 0 && (gt || (eq && off_eq < k - above))) {
    for (int i = w0 + lane; i - lane < w1; i += 32) {
      const uint32_t key = i < w1 ? key_at[i] : 0;
      const uint32_t bg = __ballot_sync(0xFFFFFFFFu, key > T), be = __ballot_sync(0xFFFFFFFFu, key == T);
      int slot = -1;
      if (key > T) slot = off_gt + __popc(bg & below);
      const uint32_t e = off_eq + __popc(be & below);
      if (key == T && e < k - above) slot = above + e;
      if (slot >= 0) {
        cand_l[slot] = __half2float(__ushort_as_half(bits_of(key)));
        cand_id[slot] = i;
      }
      off_gt += __popc(bg);
      off_eq += __popc(be);
    }
  }
  __syncthreads();

  // Rank: larger logit first, lower id on ties (keys are distinct per value, ids unique).
  if (tid < int(k)) {
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

  if (warp != 0) return;
  int token = 0;
  if (k > 0) {
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
      const uint32_t cross = first_where(
          [&](int j) { return kPerLane * lane + j < int(k) && cum[j] >= need; }, k);
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
    token = sorted_id[pick];
  }
  if (lane == 0) {
    *out = token;
    params->draws = sp.draws + 1;
    if (feed) {  // the next step's input: this token, one position on
      feed[0] = token;
      feed[1] += 1;
    }
    if (host_out) *host_out = token;  // pinned host memory, seen once the step is done
  }
}

}  // namespace

void sample_top_k_f16(const __half* logits, int n, TopKSampling* params, int* d_out_token,
                      cudaStream_t stream, int* feed, int* host_out) {
  KESTREL_CHECK(n > 0 && n <= (1 << 24),
                "sample_top_k_f16: n must be in 1 .. 2^24, got " + std::to_string(n));
  const auto* x = reinterpret_cast<const uint16_t*>(logits);
  if (n <= kStageMax) {
    const size_t smem = size_t(n + 7) / 8 * 16;
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(sample_top_k_kernel<true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            int(size_t(kStageMax) * 2)));
    launch_pdl(sample_top_k_kernel<true>, dim3(1), dim3(kThreads), smem, stream, x, n, params,
               d_out_token, feed, host_out);
  } else {
    launch_pdl(sample_top_k_kernel<false>, dim3(1), dim3(kThreads), 0, stream, x, n, params,
               d_out_token, feed, host_out);
  }
}

}  // namespace kestrel::cuda
