// What quantize_model (quantize.cpp) shares with its GPU loops (quantize_cuda.cpp): the layer
// loop gets the model, the options (each linear's, with a mixed-precision plan) and the
// calibration windows, and hands back each quantized linear (to be packed into the checkpoint)
// and each finished layer (for the report and the progress line); mixed precision's measuring
// pass hands back every linear's measured candidates. Private to the quantizer library.
#pragma once

#include <functional>
#include <vector>

#include "models/io/model_spec.h"
#include "tools/quantize/gptq.h"
#include "tools/quantize/quantize.h"

namespace kestrel::quant {

// Receives one quantized linear (codes, scales, zeros, g_idx; dequant may be empty).
using SaveLinear = std::function<void(const LinearSpec& spec, QuantizedLinear q)>;

// Each linear's options: the model's (QuantizeOptions::gptq), or with a mixed-precision plan
// its planned bits and group size. The linears of one true-sequential group share the factor
// of their Hessian, which depends on act_order and damp alone, the same for every linear.
using OptionsFor = std::function<GptqOptions(const LinearSpec& spec)>;

// Wall time of one layer, by step.
struct LayerTimes {
  double forward = 0;   // calibration forward passes (group reruns and the final pass)
  double hessian = 0;   // Hessian accumulation
  double quantize = 0;  // GPTQ / RTN of the layer's linears, their errors and hand-over
  double total = 0;
};

// Called after each decoder layer with its linears' reports, in checkpoint order.
using LayerDone =
    std::function<void(int layer, const std::vector<LinearReport>& lines, const LayerTimes& t)>;

// The layer loop on the GPU: the calibration activations of every window stay on the GPU in
// fp16; one decoder layer's fp16 weights at a time run models/gpu/layer.h's forward,
// whose taps feed GPU Hessians; each true-sequential group is quantized (gptq_cuda.h), each
// linear with gptq_for's options, and its dequantized weights replace it before the next
// group's forward; the layer's outputs become the next layer's inputs. Throws kestrel::Error /
// DeviceError with one line.
void quantize_layers_cuda(const ModelSpec& spec, const QuantizeOptions& o,
                          const std::vector<std::vector<int>>& windows, const OptionsFor& gptq_for,
                          const SaveLinear& save, const LayerDone& done);
// Mixed precision's measuring pass on the GPU, as quantize.cpp's measure_candidates_cpu: per
// layer, one forward of the FP16 layer per window with taps at all four groups for their
// Hessians, each linear quantized at every candidate that packs it (one factor per group for
// all), its loss o.loss ("output", "relative" or "residual"; "kl" is refused) computed on the
// GPU; the next layer gets the FP16 layer's outputs. The linears in checkpoint order, each
// with its candidates in o's order.
std::vector<PlannedLinear> measure_candidates_cuda(const ModelSpec& spec, const QuantizeOptions& o,
                                                   const std::vector<QuantSetting>& candidates,
                                                   const std::vector<std::vector<int>>& windows);

// Why the GPU loop cannot quantize this model ("" when it can).
std::string cuda_quantize_unsupported(const ModelSpec& spec);

}  // namespace kestrel::quant
