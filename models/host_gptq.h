// The GPTQ tensors of one linear copied out of the mapped checkpoint into aligned host memory,
// with the view the GPTQ kernels and references take. Header-only.
#pragma once

#include <cstdint>
#include <vector>

#include "models/io/model_spec.h"
#include "kernels/gptq/gptq_format.h"

namespace kestrel {

// A view with l's format fields and no tensors.
inline gptq::GptqView format_view(const LinearSpec& l) {
  gptq::GptqView v;
  v.bits = l.bits;
  v.group_size = l.group_size;
  v.K = l.K;
  v.N = l.N;
  v.zero_offset = l.zero_offset;
  return v;
}

struct HostGptq {
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  std::vector<int32_t> g_idx;  // empty when the checkpoint has none
  gptq::GptqView view;         // points into the vectors above

  explicit HostGptq(const LinearSpec& l)
      : qweight(l.qweight->copy_as<uint32_t>()),
        qzeros(l.qzeros->copy_as<uint32_t>()),
        scales(l.scales->copy_as<uint16_t>()) {
    if (l.g_idx) g_idx = l.g_idx->copy_as<int32_t>();
    view = format_view(l);
    view.qweight = qweight.data();
    view.qzeros = qzeros.data();
    view.scales = scales.data();
    view.g_idx = l.g_idx ? g_idx.data() : nullptr;
  }
  // The view points into the vectors' buffers: a move keeps them, a copy would not.
  HostGptq(HostGptq&&) = default;
  HostGptq(const HostGptq&) = delete;
  HostGptq& operator=(const HostGptq&) = delete;
};

}  // namespace kestrel
