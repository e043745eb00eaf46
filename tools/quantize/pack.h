// A quantized linear in the checkpoint's tensors (docs/gptq-format.md), and as the CPU
// engine's CpuLinear, so that the calibration forward runs exactly what a loader will read.
#pragma once

#include <cstdint>
#include <vector>

#include "models/cpu/decoder.h"
#include "tools/quantize/gptq.h"

namespace kestrel::quant {

struct PackedLinear {
  int64_t N = 0, K = 0;
  int bits = 4, group_size = 128;
  int zero_offset = 1;             // 1 = checkpoint_format gptq, 0 = gptq_v2
  std::vector<uint32_t> qweight;   // [K*bits/32, N]
  std::vector<uint32_t> qzeros;    // [G, N*bits/32]
  std::vector<uint16_t> scales;    // [G, N] fp16 bits
  std::vector<int32_t> g_idx;      // [K]
  int64_t groups() const { return (int64_t)scales.size() / N; }
};

// Packs codes, zeros (stored minus zero_offset) and scales. Throws kestrel::Error naming
// `what` when K or N times bits is not a multiple of 32, or a zero cannot be stored (0 in
// checkpoint_format gptq).
PackedLinear pack(const QuantizedLinear& q, int zero_offset, const char* what);

// The engine's linear over the packed tensors (a copy).
CpuLinear to_cpu_linear(const PackedLinear& p);

}  // namespace kestrel::quant
