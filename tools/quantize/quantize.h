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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/io/model_spec.h"
#include "models/model.h"
#include "tools/quantize/gptq.h"
#include "tools/quantize/plan.h"

namespace kestrel::quant {

// One candidate format of a linear in a mixed-precision plan: "4g128" is bits 4, group 128.
struct QuantSetting {
  int bits = 4;
  int group_size = 128;  // -1 = one group per row
  bool operator==(const QuantSetting&) const = default;
  auto operator<=>(const QuantSetting&) const = default;
};

// "3g128,4g128,4g32,8g128" (the --candidates syntax; "4g-1" is one group per row). Throws
// kestrel::Error in one line naming --candidates for a malformed, unsupported or repeated entry.
std::vector<QuantSetting> parse_candidates(const std::string& text);
// bits {2, 3, 4, 8} x group size {32, 64, 128}: the default candidates.
std::vector<QuantSetting> default_candidates();

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
  // usable and runs the family's calibration forward, but the CPU for --loss kl's measure,
  // which runs there only)
  std::string device = "cpu";

  // Mixed precision (issue #46): a budget turns it on, one of the two. Every linear is then
  // measured at each candidate and the plan (plan.h) chooses each one's format; gptq.bits and
  // gptq.group_size are unused (act_order, sym, damp, static_groups apply to every candidate).
  double bits_avg = 0;        // > 0: average bits per weight of the quantized linears, their
                              // qweight, qzeros, scales and g_idx all counted
  double target_size_gb = 0;  // > 0: bytes of every tensor written (FP16 ones too), 1e9 a GB
  std::vector<QuantSetting> candidates;  // empty: default_candidates()
  bool dry_run = false;       // measure and plan, write nothing (out_dir may be empty)
  // The estimated loss of a linear at a candidate: "kl", measured end to end: the mean KL
  // divergence of the next-token distributions, FP16 model vs. the FP16 model with the
  // linear's true-sequential group (q/k/v, o, gate/up, down of one layer) alone quantized at
  // that candidate, over the first `kl_windows` calibration windows, shared equally by the
  // group's linears (tools/quantize/kl_probe.h; it holds the whole model in fp32 and
  // kl_windows * seqlen * vocab floats, and costs a forward of the layers after the group's per
  // group and candidate). "output", tr((W-Q) H (W-Q)^T); "relative",
  // that divided by tr(W H W^T) (the share of the output's energy lost); "residual", the
  // relative loss times the linear's block's share of the residual stream (mean ||attention or
  // MLP output||^2 over mean ||residual||^2): what a block adds is read downstream through
  // RMSNorm, relative to the stream, so the same relative damage costs more where a block's
  // output is a larger part of the stream.
  // residual by default: it costs no forward pass and runs at any size. kl measured the best
  // plans on docs-llama-19m (docs/performance.md), but it holds the model in fp32 and runs the
  // later layers per group and candidate: hours past a few hundred million parameters.
  std::string loss = "residual";
  int kl_windows = 2;       // calibration windows of --loss kl's measure (the first ones)
  bool mixed() const { return bits_avg > 0 || target_size_gb > 0; }
};

struct LinearReport {
  std::string name;       // "model.layers.3.self_attn.q_proj"
  int64_t N = 0, K = 0;
  double rel_error = 0;   // ||W X - Q X||^2 / ||W X||^2 on the calibration inputs
  double seconds = 0;     // quantization time (not the calibration forward)
};

// One linear in a mixed-precision plan.
struct PlannedLinear {
  std::string name;
  int64_t N = 0, K = 0;
  QuantSetting setting;
  uint64_t bytes = 0;  // qweight + qzeros + scales + g_idx at that setting
  double loss = 0;     // estimated: tr((W-Q) H (W-Q)^T) measured at that setting
  // Every candidate measured (in the order of the candidate list; those that cannot pack this
  // linear are absent): the setting, its bytes and estimated loss.
  std::vector<std::pair<QuantSetting, PlanCandidate>> measured;
};

struct MixedPlanReport {
  std::vector<PlannedLinear> linears;  // checkpoint order
  uint64_t budget = 0;        // bytes the quantized linears may take
  uint64_t bytes = 0;         // bytes they take (<= budget)
  uint64_t fixed_bytes = 0;   // the tensors written unquantized (embeddings, norms, lm_head)
  uint64_t weights = 0;       // quantized weights (sum of N * K)
  double loss = 0;            // summed estimated loss
  double measure_seconds = 0; // the measuring pass
  QuantSetting base;          // the checkpoint's base format (the most common choice)
  // The `dynamic` rules written, in order: a regex naming one group of linears (a lone linear,
  // or siblings that share one choice: q/k/v, gate/up) and its format, for each group planned
  // otherwise than `base`.
  std::vector<std::pair<std::string, QuantSetting>> rules;
  double bits_per_weight() const { return weights ? 8.0 * (double)bytes / (double)weights : 0; }
};

struct QuantizeReport {
  std::vector<LinearReport> linears;
  int64_t calib_tokens = 0;  // tokens of the whole calibration text
  double seconds = 0;        // end to end
  // Summed over the layers: calibration forward passes, Hessian accumulation, quantization
  // of the linears (factor, GPTQ/RTN, errors); then the checkpoint writer.
  double forward_seconds = 0, hessian_seconds = 0, quantize_seconds = 0, write_seconds = 0;
  std::string device;        // where it ran: cpu or cuda (--device auto chooses)
  std::optional<MixedPlanReport> plan;  // mixed precision: the plan written (or, dry run, not)
};

// The plan for o's budget (o.bits_avg or o.target_size_gb, o.candidates) over linears measured
// as a mixed run measures them (a dry run's report.plan->linears, their `measured` filled in):
// re-planning at other budgets without measuring again.
MixedPlanReport plan_from_measurements(const ModelSpec& spec, const QuantizeOptions& o,
                                       std::vector<PlannedLinear> measured);

// The plan as a table (per linear: bits, group, bytes, estimated loss; then the totals), for
// --dry-run and the log.
std::string format_plan(const MixedPlanReport& plan);

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
//
// Mixed precision (o.mixed()), in two passes over the layers, both on o.device (--loss kl on
// the CPU only):
//  1. measure: each layer's FP16 forward gives one Hessian per true-sequential group; every
//     linear is quantized at every candidate on it and its loss recorded (o.loss: the KL
//     divergence at the logits with its group alone quantized, or GPTQ's own objective
//     tr((W-Q) H (W-Q)^T), or that made relative). The next layer gets the FP16 layer's outputs.
//  2. after the plan (plan_mixed_precision over the measurements, q/k/v and gate/up as one
//     choice each), the ordinary sequential pass with each linear at its planned setting: each
//     group's Hessian from inputs that the already quantized linears produced, each layer's
//     quantized outputs feeding the next. Pass 1's results are not reused: their Hessians came
//     from FP16 inputs, and only a pass that follows the plan can give pass 2's.
// With o.dry_run the plan is returned (report.plan) after pass 1 and nothing is written.
QuantizeReport quantize_model(const QuantizeOptions& o);

}  // namespace kestrel::quant
