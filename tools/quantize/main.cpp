// kestrel-quantize: GPTQ (or round-to-nearest) quantization of an FP16 Hugging Face Llama
// model on calibration text, and perplexity evaluation of any model on the CPU engine.
// A thin command line over kestrel::quant.
#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "engine/error.h"
#include "engine/model_spec.h"
#include "models/llama.h"
#include "tokenizer/tokenizer.h"
#include "tools/quantize/quantize.h"

namespace {

int eval_ppl(const std::string& file, const std::string& model_dir, int context, bool quiet) {
  using namespace kestrel;
  if (model_dir.empty()) throw Error("--eval-ppl needs -m MODEL_DIR");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {}", file));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Tokenizer tok = Tokenizer::load(model_dir);
  const ModelSpec spec = load_model_spec(model_dir);
  for (const std::string& w : spec.warnings)
    if (!quiet) std::cerr << "kestrel-quantize: warning: " << w << "\n";
  if (context > spec.config.max_pos)
    throw Error(fmt::format("-c {} is longer than the model's max_position_embeddings {}", context,
                            spec.config.max_pos));
  // Tokenized once, BOS at the start only (the GPTQ paper's protocol).
  std::vector<int> ids = tok.encode(text, /*with_specials=*/false);
  if (tok.add_bos()) ids.insert(ids.begin(), tok.bos_id());
  LlamaCpu model(spec, context);
  const quant::PerplexityResult r = quant::perplexity(model, ids, context, !quiet);
  std::cout << fmt::format("perplexity {:.4f}  (mean NLL {:.6f} over {} windows of {} tokens, {} "
                           "predictions; {} tokens; {:.1f} s)\n",
                           r.ppl, r.mean_nll, r.windows, context, r.predictions, r.tokens,
                           r.seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kestrel::quant::QuantizeOptions o;
  std::string device = "cpu", eval_file;
  int context = 2048;
  bool quiet = false;
  CLI::App app{"kestrel-quantize: GPTQ quantization of an FP16 Hugging Face Llama model"};
  app.add_option("-m,--model", o.model_dir, "FP16 model directory (Hugging Face layout)");
  app.add_option("--calib", o.calib_file, "Calibration text file");
  app.add_option("--out", o.out_dir, "Output directory for the GPTQ model (created)");
  app.add_option("--bits", o.gptq.bits, "Bits per weight: 2, 3, 4 or 8")->capture_default_str();
  app.add_option("--group-size", o.gptq.group_size, "Columns per group; -1 = one group per row")
      ->capture_default_str();
  app.add_flag("--act-order", o.gptq.act_order, "Quantize columns in decreasing Hessian order (desc_act)");
  app.add_flag("--sym,!--asym", o.gptq.sym, "Symmetric (default) or asymmetric zero points");
  app.add_option("--damp", o.gptq.damp, "Damping, fraction of the mean Hessian diagonal")
      ->capture_default_str();
  app.add_flag("--static-groups", o.gptq.static_groups, "Fix group scales before quantizing");
  app.add_option("--nsamples", o.nsamples, "Calibration windows")->capture_default_str();
  app.add_option("--seqlen", o.seqlen, "Tokens per calibration window")->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of the calibration window draw")->capture_default_str();
  app.add_option("--method", o.method, "gptq or rtn (round to nearest)")->capture_default_str();
  app.add_option("--device", device, "cpu (cuda is not available in this build)")
      ->capture_default_str();
  app.add_option("--eval-ppl", eval_file,
                 "Instead of quantizing: perplexity of -m on this text file, windows of -c tokens");
  app.add_option("-c,--ctx-size", context, "Window of --eval-ppl in tokens")->capture_default_str();
  app.add_flag("-q,--quiet", quiet, "No progress or per-layer lines");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "kestrel-quantize: " << e.what() << "\n";
    return 1;
  }
  try {
    if (device == "cuda")
      throw kestrel::Error("--device cuda is not available in this build; use --device cpu");
    if (device != "cpu")
      throw kestrel::Error(fmt::format("--device must be cpu or cuda, got {}", device));
    if (!eval_file.empty()) return eval_ppl(eval_file, o.model_dir, context, quiet);
    if (o.model_dir.empty() || o.calib_file.empty() || o.out_dir.empty())
      throw kestrel::Error("-m MODEL_DIR, --calib FILE and --out DIR are required");
    o.progress = !quiet;
    const kestrel::quant::QuantizeReport r = kestrel::quant::quantize_model(o);
    if (!quiet) {
      double mean = 0;
      for (const auto& l : r.linears) mean += l.rel_error;
      mean /= r.linears.empty() ? 1 : (double)r.linears.size();
      std::cerr << fmt::format("kestrel-quantize: wrote {} ({} linears, mean rel. error {:.3e}) "
                               "in {:.1f} s\n",
                               o.out_dir, r.linears.size(), mean, r.seconds);
    }
  } catch (const std::exception& e) {
    std::cerr << "kestrel-quantize: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
