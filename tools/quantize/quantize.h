// kestrel-quantize: an FP16 Hugging Face model plus calibration text in, a GPTQ
// checkpoint that Kestrel, AutoGPTQ and transformers load out.
//
// Layer by layer, as the reference implementation: the calibration windows' activations
// enter decoder layer l as the outputs of the already quantized layers 0 .. l-1, computed by
// the engine's own batched layer forward (DecoderCpu::layer_forward on the CPU,
// layer_forward_rows of models/gpu/layer.h on the GPU), never by a second model. Within a layer the linears go in true-sequential groups (q/k/v, o, gate/up, down):
// each group's Hessian comes from inputs that the layer's already quantized groups produced.
// Only one decoder layer's weights are held at a time (a one-layer engine takes each layer in
// turn), packed results go to a scratch folder until the checkpoint is written, so memory
// stays at one layer's weights, its Hessians and the activations.
//
// Everything, the scratch folder too, is written into a temporary directory beside the output
// (base/staged_output.h) that takes the output's name only once it is complete: a
// failure leaves an existing output as it was and nothing behind.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"
#include "tools/quantize/gptq.h"

namespace kestrel::quant {

struct QuantizeOptions {
  std::string model_dir;   // FP16 (or BF16/F32) Hugging Face model directory
  std::string calib_file;  // calibration text
  std::string out_dir;     // created; must differ from model_dir and not hold it
  bool force = false;      // replace a non-empty out_dir (once the new checkpoint is complete)
  GptqOptions gptq;
  std::string method = "gptq";  // gptq | rtn
  int nsamples = 128;           // calibration windows
  int seqlen = 2048;            // tokens per window
  uint64_t seed = 0;            // window draw
  bool progress = true;         // progress bar and per-layer lines on stderr
  // cpu | cuda | auto (where the forward, Hessians and GPTQ run; auto: the GPU where it is
  // usable and runs the family's calibration forward)
  std::string device = "cpu";
};

struct LinearReport {
  std::string name;       // "model.layers.3.self_attn.q_proj"
  int64_t N = 0, K = 0;
  double rel_error = 0;   // ||W X - Q X||^2 / ||W X||^2 on the calibration inputs
  double seconds = 0;     // quantization time (not the calibration forward)
};

struct QuantizeReport {
  std::vector<LinearReport> linears;
  int64_t calib_tokens = 0;  // tokens of the whole calibration text
  double seconds = 0;        // end to end
  // Summed over the layers: calibration forward passes, Hessian accumulation, quantization
  // of the linears (factor, GPTQ/RTN, errors); then the checkpoint writer.
  double forward_seconds = 0, hessian_seconds = 0, quantize_seconds = 0, write_seconds = 0;
  std::string device;        // where it ran: cpu or cuda (--device auto chooses)
};

// Draws `nsamples` windows of `seqlen` tokens from `ids` (start uniform in
// [0, size - seqlen - 1], as the reference draws them) with a seeded mt19937_64. Throws
// kestrel::Error naming `where` when the text is too short.
std::vector<std::vector<int>> calibration_windows(const std::vector<int>& ids, int nsamples,
                                                  int seqlen, uint64_t seed,
                                                  const std::string& where);

// Quantizes the model and writes the checkpoint (model.safetensors or shards, config.json
// with quantization_config, quantize_config.json, tokenizer files, quantize_report.json).
// Throws kestrel::Error with one line on bad options, models or files; one raised once the
// writing began ends "; nothing written to OUT".
QuantizeReport quantize_model(const QuantizeOptions& o);

}  // namespace kestrel::quant
