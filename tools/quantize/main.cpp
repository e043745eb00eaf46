// kestrel-quantize: GPTQ (or round-to-nearest) quantization of an FP16 Hugging Face model
// on calibration text (`kestrel perplexity` measures the result).
// A thin command line over kestrel::quant.
#include <algorithm>
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "base/device.h"
#include "base/error.h"
#include "base/staged_output.h"
#include "models/io/config.h"
#include "tools/quantize/quantize.h"

int main(int argc, char** argv) {
  kestrel::quant::QuantizeOptions o;
  std::string device = "auto";
  std::string candidates;
  bool quiet = false;
  CLI::App app{"kestrel-quantize: GPTQ quantization of an FP16 Hugging Face model of any "
                "supported family (Llama, Mistral, Qwen2, Qwen3, OPT)"};
  app.set_version_flag("--version", "kestrel-quantize " KESTREL_VERSION);
  app.add_option("-m,--model", o.model_dir, "FP16 model directory (Hugging Face layout)");
  app.add_option("--calib", o.calib_file, "Calibration text file");
  app.add_option("--out", o.out_dir, "Output directory for the GPTQ model (created)");
  app.add_flag("--force", o.force,
               "Replace a non-empty --out (only once the new checkpoint is complete)");
  auto* bits = app.add_option("--bits", o.gptq.bits, "Bits per weight: 2, 3, 4 or 8")
                   ->capture_default_str();
  auto* group = app.add_option("--group-size", o.gptq.group_size,
                               "Columns per group; -1 = one group per row")
                    ->capture_default_str();
  auto* bits_avg = app.add_option(
      "--bits-avg", o.bits_avg,
      "Mixed precision: choose each linear's bits and group size from --candidates, by its "
      "measured error, for this average of bits per weight (qweight, qzeros, scales and g_idx "
      "of the quantized linears counted), e.g. 3.5");
  auto* target = app.add_option(
      "--target-size", o.target_size_gb,
      "Mixed precision as --bits-avg, to this size in GB (1e9 bytes) of all tensors written, "
      "the FP16 embeddings, norms and lm_head included");
  auto* cands = app.add_option("--candidates", candidates,
                               "Mixed precision: the formats to choose from, BITSgGROUP "
                               "comma-separated (default: 2, 3, 4, 8 bits x groups 32, 64, 128)");
  auto* loss = app.add_option("--loss", o.loss,
                              "Mixed precision: a linear's estimated loss: kl (the KL divergence "
                              "of the model's next-token distributions with its group alone "
                              "quantized, measured; holds the whole model in fp32 and runs the "
                              "later layers per group and format: small models), output "
                              "(tr((W-Q) H (W-Q)^T)), relative (over tr(W H W^T)) or residual "
                              "(relative, times its block's share of the residual stream)")
                   ->capture_default_str();
  auto* kl_windows = app.add_option("--kl-windows", o.kl_windows,
                                    "Mixed precision, --loss kl: calibration windows measured")
                         ->capture_default_str();
  app.add_flag("--dry-run", o.dry_run,
               "Mixed precision: measure and print the plan (per linear and totals), write nothing");
  app.add_flag("--act-order", o.gptq.act_order, "Quantize columns in decreasing Hessian order (desc_act)");
  app.add_flag("--sym,!--asym", o.gptq.sym, "Symmetric (default) or asymmetric zero points");
  app.add_option("--damp", o.gptq.damp, "Damping, fraction of the mean Hessian diagonal")
      ->capture_default_str();
  app.add_flag("--static-groups", o.gptq.static_groups, "Fix group scales before quantizing");
  app.add_option("--mse", o.gptq.mse,
                 "Shrink each group's range to the scale of least sum |w - q(w)|^NORM (GPTQ's "
                 "mse search: grid 100, shrunk to 0.21 at most; 2.4 as the reference uses); 0 = the full "
                 "range")
      ->capture_default_str();
  app.add_option("--nsamples", o.nsamples, "Calibration windows")->capture_default_str();
  auto* seqlen = app.add_option("--seqlen", o.seqlen,
                                "Tokens per calibration window (or the model's "
                                "max_position_embeddings when shorter)")
                     ->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of the calibration window draw")->capture_default_str();
  app.add_option("--method", o.method, "gptq or rtn (round to nearest)")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->capture_default_str();
  app.add_flag("-q,--quiet", quiet, "No progress or per-layer lines");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "kestrel-quantize: " << e.what() << "\n";
    return 1;
  }
  // Ctrl-C removes the half-written output and says so.
  kestrel::remove_staged_outputs_on_signals("kestrel-quantize");
  try {
    if (device != "cpu" && device != "cuda" && device != "auto")
      throw kestrel::Error(fmt::format("--device must be cpu, cuda or auto, got {}", device));
    const bool mixed = bits_avg->count() > 0 || target->count() > 0;
    if (bits_avg->count() > 0 && target->count() > 0)
      throw kestrel::Error("--bits-avg and --target-size are exclusive: give one budget");
    if (mixed && (bits->count() > 0 || group->count() > 0))
      throw kestrel::Error("--bits and --group-size fix one format; with --bits-avg or "
                           "--target-size the formats come from --candidates");
    if (!mixed && (cands->count() > 0 || loss->count() > 0 || kl_windows->count() > 0 ||
                   o.dry_run))
      throw kestrel::Error("--candidates, --loss, --kl-windows and --dry-run go with a budget: "
                           "--bits-avg or --target-size");
    if (bits_avg->count() > 0 && !(o.bits_avg > 0))
      throw kestrel::Error(fmt::format("--bits-avg must be a number of bits per weight in (0, "
                                       "32], got {}", o.bits_avg));
    if (target->count() > 0 && !(o.target_size_gb > 0))
      throw kestrel::Error(fmt::format("--target-size must be a positive number of GB, got {}",
                                       o.target_size_gb));
    if (mixed && o.loss == "kl" && device == "cuda")
      throw kestrel::Error("--loss kl runs on the CPU only: --device cpu, or another --loss");
    if (cands->count() > 0) o.candidates = kestrel::quant::parse_candidates(candidates);
    if (o.model_dir.empty() || o.calib_file.empty() || (o.out_dir.empty() && !o.dry_run))
      throw kestrel::Error("-m MODEL_DIR, --calib FILE and --out DIR are required (--out not "
                           "with --dry-run)");
    // The default window is no longer than the model's context.
    if (seqlen->count() == 0)
      o.seqlen = std::min(o.seqlen, kestrel::load_model_config(o.model_dir).max_pos);
    if (device == "cuda") {
      const kestrel::CudaStatus st = kestrel::cuda_status();
      if (!st.usable) throw kestrel::DeviceError(st.problem + "; run with --device cpu");
    }
    o.device = device;  // auto: chosen once the model is read (quantize_model)
    o.progress = !quiet;
    const kestrel::quant::QuantizeReport r = kestrel::quant::quantize_model(o);
    if (o.dry_run) {  // the plan is the output
      std::cout << kestrel::quant::format_plan(*r.plan);
      return 0;
    }
    if (!quiet && r.plan) std::cerr << kestrel::quant::format_plan(*r.plan);
    if (!quiet) {
      double mean = 0;
      for (const auto& l : r.linears) mean += l.rel_error;
      mean /= r.linears.empty() ? 1 : (double)r.linears.size();
      std::cerr << fmt::format("kestrel-quantize: wrote {} ({} linears, mean rel. error {:.3e}) "
                               "in {:.1f} s on {} (calibration forward {:.1f} s, Hessians {:.1f} s, "
                               "quantize {:.1f} s, write {:.1f} s)\n",
                               o.out_dir, r.linears.size(), mean, r.seconds, r.device,
                               r.forward_seconds, r.hessian_seconds, r.quantize_seconds,
                               r.write_seconds);
    }
  } catch (const std::exception& e) {
    std::cerr << "kestrel-quantize: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
