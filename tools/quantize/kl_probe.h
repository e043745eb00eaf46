// The end-to-end damage of quantizing one part of a decoder layer, measured rather than
// estimated: how far the model's next-token distributions move when only that part is replaced
// by its quantized weights (kestrel-quantize --loss kl, issue #46).
//
// Why: the per-linear estimates (GPTQ's tr((W-Q) H (W-Q)^T), made relative or weighted by the
// block's share of the residual stream) are in each linear's own units, and a second-order proxy
// of the linear's output. Neither says what an error costs at the logits: a layer's errors pass
// through every later layer, attention softmaxes and the MLPs' gates, and 2-bit damage is no
// small perturbation. On docs-llama-19m these estimates ranked 2-bit plans far better than their
// perplexity (docs/performance.md). The KL divergence from the FP16 model's distributions is
// what the perplexity feels, in one unit for every layer, so the plan can add the parts' losses.
//
// The whole FP16 model is held (fp32, as the CPU engine runs it) beside the quantizer's one-layer
// engine, and the FP16 model's next-token distributions of `windows` ([n, T] tokens, a few
// calibration windows) are kept: n * T * vocab floats.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "models/cpu/decoder.h"
#include "models/io/model_spec.h"

namespace kestrel::quant {

class KlProbe {
 public:
  // Runs the FP16 model over the windows once (their distributions are the reference).
  KlProbe(const ModelSpec& spec, const std::vector<std::vector<int>>& windows);

  // Mean over the windows' tokens of KL(p_fp16 || p), p the model's distribution with the given
  // linears of decoder layer `layer` replaced by dense weights ([N, K], as CpuLinear::w; swapped
  // in for the call and back, so the vectors are left as they were). `layer` must be the layer
  // the probe stands at (advance()).
  double kl(int layer,
            const std::vector<std::pair<CpuLinear CpuLayer::*, std::vector<float>*>>& replace);

  // Moves the kept residual streams through FP16 layer `layer`: once per layer, in order, after
  // that layer's kl() calls.
  void advance(int layer);

 private:
  DecoderCpu model_;
  std::unique_ptr<DecoderCpuSession> seq_;
  int n_ = 0, T_ = 0;
  int at_ = 0;                 // the layer whose input X_ holds
  std::vector<float> X_;       // [n, T, hidden] residual streams entering layer at_
  std::vector<float> p_;       // [n * T, vocab] the FP16 model's next-token probabilities
  std::vector<double> plogp_;  // [n * T] sum over the vocabulary of p log p (p as stored)
  std::vector<double> psum_;   // [n * T] sum of p as stored (1 to float rounding)
};

}  // namespace kestrel::quant
