// Internal to kernels/gemv: the constants of the repacked layout that the host repack
// (gemv_prepare.cpp) and the kernels (gemv.cu) must agree on, and the launcher hooks the
// repack needs. The layout itself is drawn in weight_decode.cuh.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/gemv/gemv.h"

namespace kestrel::cuda::gemv_detail {

// Codes held by one thread's chunk (16 bytes per plane): 2-bit 64, 3-bit 128 (3 planes),
// 4-bit 32, 8-bit 16; fp16 weights: 8.
constexpr int chunk_codes(int bits) {
  return bits == 2 ? 64 : bits == 3 ? 128 : bits == 4 ? 32 : bits == 8 ? 16 : bits == 16 ? 8 : 0;
}
constexpr int chunk_planes(int bits) { return bits == 3 ? 3 : 1; }

// A lane's unit of work in one row: 4 chunks (2-, 4-, 8-bit: 256, 128, 64 codes) or one 3-bit
// chunk of 3 planes (128 codes): 4 or 3 16-byte loads. Rows hold a whole number of units.
constexpr int unit_chunks(int bits) { return bits == 3 ? 1 : 4; }
constexpr int unit_loads(int bits) { return unit_chunks(bits) * chunk_planes(bits); }

// Where plane p of chunk c sits in its row, in uint4 from the row's start (weight_decode.cuh
// draws it):
// the 32 units u = 32i .. 32i+31 of a row (fewer in the last group) store load slot
// t = (c % unit_chunks) * planes + p of every unit together, so that the lanes of a warp, one
// unit each, read 512 contiguous bytes per load.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t chunk_index(int bits, int64_t chunks, int64_t c, int p) {
  const int uc = unit_chunks(bits), nq = unit_loads(bits);
  const int64_t units = chunks / uc, u = c / uc, i = u / 32;
  const int64_t cnt = units - 32 * i < 32 ? units - 32 * i : 32;
  const int64_t t = (c % uc) * chunk_planes(bits) + p;
  return i * 32 * nq + t * cnt + (u % 32);
}

// The fp16 kernel (row-major weights as stored): rows per warp, threads per block.
constexpr int kF16Rows = 4;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// The quantized kernel: rows a warp streams at once, threads per SM (one block of kQuantThreads,
// or two of half as many: gemv.cu, spec_block_warps).
constexpr int kQuantRows = 2;
constexpr int kQuantThreads = 512;
constexpr int kQuantWarps = kQuantThreads / 32;

// The rows [begin, end) that warp w of the grid's W streams, `per_step` (kQuantRows, or one
// SiLU pair) at a time, out of n_rows. `whole_steps` (the kernel's blocks of 8 warps) and at
// least one step for every warp: P = ceil(n_rows / per_step) steps, P / W to each warp and the
// P % W left over one each to the first warps. Otherwise equal runs, [n_rows w / W,
// n_rows (w + 1) / W). Consecutive warps' runs tile [0, n_rows) in order either way.
struct RowRun {
  int begin, end;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
inline RowRun warp_rows(int64_t n_rows, int per_step, int64_t w, int64_t W, bool whole_steps) {
  const int P = static_cast<int>((n_rows + per_step - 1) / per_step), nw = static_cast<int>(W);
  RowRun r;
  if (whole_steps && P >= nw) {
    const int wi = static_cast<int>(w), base = P / nw, extra = P % nw;
    const int first = wi * base + std::min(wi, extra), cnt = base + (wi < extra);
    r.begin = std::min(static_cast<int>(n_rows), first * per_step);
    r.end = std::min(static_cast<int>(n_rows), (first + cnt) * per_step);
  } else {
    r.begin = static_cast<int>(n_rows * w / W), r.end = static_cast<int>(n_rows * (w + 1) / W);
  }
  return r;
}

// The rows of warp w in the half-warp kernels (rows of at most 16 units: each half-warp takes
// a row step, so a warp step is two, `per_step` rows or pairs in all): equal runs of whole
// steps, [P w / W, P (w + 1) / W) of the P = ceil(n_rows / per_step), in rows. Consecutive
// warps' runs tile [0, n_rows) in order.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline RowRun step_runs(int64_t n_rows, int per_step, int64_t w, int64_t W) {
  const int64_t P = (n_rows + per_step - 1) / per_step;
  RowRun r;
  r.begin = static_cast<int>(std::min(n_rows, P * w / W * per_step));
  r.end = static_cast<int>(std::min(n_rows, P * (w + 1) / W * per_step));
  return r;
}

// Bit position of code i (0 <= i < 8) inside a 32-bit word for 4-bit codes (and for the
// 3-bit "nibble words"): pairs (2p, 2p+1) sit in nibble p of the low and high half.
constexpr int nibble_pos(int i) { return 16 * (i & 1) + 4 * (i >> 1); }
// For 2-bit codes (0 <= i < 16): pairs (2p, 2p+1) sit at bits 2p of the low and high half.
constexpr int crumb_pos(int i) { return 16 * (i & 1) + 2 * (i >> 1); }

// The repacked weight on the host, before upload: what gemv_prepare sends to the device.
struct HostRepack {
  GemvWeight meta;               // every field but the device pointers, smem and launch
  std::vector<uint32_t> codes;   // [N][planes * chunks][4] words, placed by chunk_index
  std::vector<uint16_t> scales;  // [N][groups] fp16 bits
  std::vector<uint8_t> zeros;    // [N][groups] stored zero points; empty when all are equal
  std::vector<int32_t> perm;     // [chunks * chunk_codes]: x index of permuted k (0 past K);
                                 // empty without act-order
};

// Validates and repacks (the host half of gemv_prepare; throws kestrel::Error likewise).
HostRepack repack(const std::vector<gptq::GptqView>& parts);

// Dynamic shared memory of one quantized block: x in the kernel's layout, x in its natural
// order (the act-order gather's source, or where the bulk copy of x lands) and an mbarrier.
size_t smem_bytes(int bits, int64_t chunks, bool has_perm);

// The launch a quantized weight keeps: `hint` with k_split 1; a zero grid stays zero, and each
// gemv call then chooses it, for the block size of the kernel that call takes (gemv.cu,
// spec_block_warps). Throws kestrel::Error for an unsupported (bits, group size).
GemvLaunch plan_quant_launch(int bits, int group_size, GemvLaunch hint);

}  // namespace kestrel::cuda::gemv_detail
