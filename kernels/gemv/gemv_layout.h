// Internal to kernels/gemv: the constants of the repacked layout that the host repack
// (gemv_prepare.cpp) and the kernels (gemv.cu) must agree on, and the launcher hooks the
// repack needs. The layout itself is drawn in gemv.cu.
#pragma once

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

// Rows one warp streams at a time (they share each x chunk read from shared memory).
constexpr int rows_per_warp(int bits) { return bits == 3 ? 2 : 4; }

constexpr int kThreads = 256;  // threads of every GEMV block
constexpr int kWarps = kThreads / 32;

// Bit position of code i (0 <= i < 8) inside a 32-bit word for 4-bit codes (and for the
// 3-bit "nibble words"): pairs (2p, 2p+1) sit in nibble p of the low and high half.
constexpr int nibble_pos(int i) { return 16 * (i & 1) + 4 * (i >> 1); }
// For 2-bit codes (0 <= i < 16): pairs (2p, 2p+1) sit at bits 2p of the low and high half.
constexpr int crumb_pos(int i) { return 16 * (i & 1) + 2 * (i >> 1); }

// The repacked weight on the host, before upload: what gemv_prepare sends to the device.
struct HostRepack {
  GemvWeight meta;               // every field but the device pointers, smem and launch
  std::vector<uint32_t> codes;   // [N][planes][chunks][4] words
  std::vector<uint16_t> scales;  // [N][groups] fp16 bits
  std::vector<uint8_t> zeros;    // [N][groups] stored zero points; empty when all are equal
  std::vector<int32_t> perm;     // [chunks * chunk_codes]: x index of permuted k (0 past K);
                                 // empty without act-order
};

// Validates and repacks (the host half of gemv_prepare; throws kestrel::Error likewise).
HostRepack repack(const std::vector<gptq::GptqView>& parts);

// Dynamic shared memory of one block: x in the kernel's layout, the cross-warp reduction
// buffer and, with act-order, x in its natural order for the gather.
size_t smem_bytes(int bits, int64_t chunks, bool has_perm);

// Chooses k_split and grid for a quantized GEMV on the current device (fills the zero
// fields of `hint`). Throws kestrel::Error for an unsupported (bits, group size).
GemvLaunch plan_quant_launch(int bits, int group_size, int64_t N, int64_t chunks,
                             size_t smem, GemvLaunch hint);

}  // namespace kestrel::cuda::gemv_detail
