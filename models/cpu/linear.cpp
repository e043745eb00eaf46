// The CPU engine's linear layer: dense fp32 or GPTQ codes kept packed, one row at a time in the
// fixed order of dot_ref (forward), or many rows through one BLAS sgemm (forward_batch).
#include <cblas.h>

#include <vector>

#include "kernels/matmul/matmul.h"
#include "models/cpu/decoder.h"

namespace kestrel {

CpuLinear CpuLinear::load(const LinearSpec& spec) {
  CpuLinear l;
  l.N = spec.N;
  l.K = spec.K;
  l.quantized = spec.quantized;
  if (spec.quantized) {
    l.bits = spec.bits;
    l.group_size = spec.group_size;
    l.zero_offset = spec.zero_offset;
    l.qweight = spec.qweight->copy_as<uint32_t>();
    l.qzeros = spec.qzeros->copy_as<uint32_t>();
    l.scales = spec.scales->copy_as<uint16_t>();
    if (spec.g_idx) {
      l.g_idx = spec.g_idx->copy_as<int32_t>();
    } else {
      l.g_idx.resize(l.K);
      for (int64_t k = 0; k < l.K; ++k) l.g_idx[k] = spec.group_size > 0 ? k / spec.group_size : 0;
    }
  } else {
    l.w = to_float(*spec.weight);
  }
  if (spec.bias) l.bias = to_float(*spec.bias);
  return l;
}

gptq::GptqView CpuLinear::view() const {
  gptq::GptqView v;
  v.bits = bits;
  v.group_size = group_size;
  v.K = K;
  v.N = N;
  v.zero_offset = zero_offset;
  v.qweight = qweight.data();
  v.qzeros = qzeros.data();
  v.scales = scales.data();
  v.g_idx = g_idx.data();
  return v;
}

void CpuLinear::forward(const float* x, int64_t M, float* y) const {
  if (!quantized) {
    matmul_ref(x, w.data(), bias.empty() ? nullptr : bias.data(), M, N, K, y);
    return;
  }
  gptq::matmul_ref(view(), x, M, y);
  if (!bias.empty())
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

void CpuLinear::forward_batch(const float* x, int64_t M, float* y, int64_t ldy) const {
  std::vector<float> dequantized;
  const float* W = w.data();  // [N, K]
  if (quantized) {
    dequantized.resize((size_t)N * K);
    gptq::dequantize_ref(view(), dequantized.data());
    W = dequantized.data();
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, W, K, 0.0f, y, ldy);
  if (!bias.empty())
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * ldy + n] += bias[n];
}

}  // namespace kestrel
