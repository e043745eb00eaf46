#include "tools/quantize/pack.h"

#include <fmt/format.h>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/gptq/gptq_format.h"

namespace kestrel::quant {

PackedLinear pack(const QuantizedLinear& q, int zero_offset, const char* what) {
  if ((q.K * q.bits) % 32 != 0 || (q.N * q.bits) % 32 != 0)
    throw Error(fmt::format("{}: [{}, {}] cannot be packed at {} bits (in and out features times "
                            "bits must be multiples of 32)",
                            what, q.N, q.K, q.bits));
  PackedLinear p;
  p.N = q.N;
  p.K = q.K;
  p.bits = q.bits;
  p.group_size = q.group_size;
  p.zero_offset = zero_offset;
  p.qweight = gptq::pack_qweight(q.codes, q.N, q.K, q.bits);
  std::vector<uint8_t> stored(q.zeros.size());
  for (size_t i = 0; i < stored.size(); ++i) {
    if (q.zeros[i] < zero_offset)
      throw Error(fmt::format("{}: zero point 0 cannot be stored in checkpoint_format gptq; "
                              "asymmetric models are written as gptq_v2",
                              what));
    stored[i] = (uint8_t)(q.zeros[i] - zero_offset);
  }
  p.qzeros = gptq::pack_qzeros(stored, q.groups(), q.N, q.bits);
  p.scales.resize(q.scales.size());
  for (size_t i = 0; i < p.scales.size(); ++i) p.scales[i] = float_to_half(q.scales[i]);
  p.g_idx = q.g_idx;
  return p;
}

CpuLinear to_cpu_linear(const PackedLinear& p) {
  CpuLinear l;
  l.N = p.N;
  l.K = p.K;
  l.quantized = true;
  l.bits = p.bits;
  l.group_size = p.group_size;
  l.zero_offset = p.zero_offset;
  l.qweight = p.qweight;
  l.qzeros = p.qzeros;
  l.scales = p.scales;
  l.g_idx = p.g_idx;
  return l;
}

}  // namespace kestrel::quant
