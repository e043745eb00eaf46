// kestrel-quantize's mixed precision (--bits-avg, --target-size; issue #46) on a kestrel-synth
// model:
// - the plan keeps to its budget (bytes, as bits per weight or as the whole checkpoint's
//   tensors), q/k/v and gate/up share one choice, and a larger budget never gives a larger
//   estimated loss;
// - the checkpoint written holds the plan: its `dynamic` rules give, through Kestrel's loader,
//   each linear the format the plan chose, its tensors take the planned bytes, it runs on the
//   CPU engine with a perplexity near the FP16 model's, and kestrel generate runs it;
// - a plan of one format is the ordinary quantizer's checkpoint, tensor for tensor (pass 2 is
//   the usual sequential pass);
// - the rule keys match vLLM's fused names (qkv_proj, gate_up_proj) as well as each linear's;
// - --dry-run prints the plan and writes nothing; bad options are refused in one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"
#include "models/cpu/decoder.h"
#include "models/io/dynamic.h"
#include "models/io/model_spec.h"
#include "tests/support/plan_check.h"
#include "tests/support/sampled_model.h"
#include "tests/support/test_util.h"
#include "tokenizer/tokenizer.h"
#include "tools/quantize/gptq.h"
#include "tools/quantize/kl_probe.h"
#include "tools/quantize/plan.h"
#include "tools/quantize/quantize.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::quant;

namespace {

using Result = kestrel::test::CommandResult;
Result run(const std::string& cmd) { return kestrel::test::run_command(cmd); }

using kestrel::test::lines;

fs::path temp_dir(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("kestrel_qmixed_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  return d;
}

constexpr auto& kLinears = kestrel::test::kPlanLinears;

double ppl(const fs::path& dir, const std::vector<int>& ids) {
  return kestrel::test::perplexity_of(dir, ids);
}

class Mixed : public ::testing::Test {
 protected:
  // The FP16 model and its sampled calibration text, made once for all of this binary's
  // processes (tests/support/shared_fixture.h) and never written to by a test.
  static void SetUpTestSuite() {
    const kestrel::test::SampledModel m = kestrel::test::sampled_model(KESTREL_TEST_FIXTURES, "mixed");
    fp16_ = new fs::path(m.fp16);
    calib_ = new fs::path(m.calib);
    sampled_ = new std::vector<int>(m.sampled);
  }
  static void TearDownTestSuite() {
    delete fp16_;
    delete calib_;
    delete sampled_;
  }
  static QuantizeOptions options(const std::string& out) {
    QuantizeOptions o;
    o.model_dir = fp16_->string();
    o.calib_file = calib_->string();
    o.out_dir = out;
    o.gptq.act_order = true;
    o.nsamples = 32;
    o.seqlen = 128;
    o.progress = false;
    o.device = "cpu";
    return o;
  }
  static QuantizeOptions dry(double bits_avg) {
    QuantizeOptions o = options("");
    o.bits_avg = bits_avg;
    o.dry_run = true;
    return o;
  }
  static uint64_t weights() {  // N * K summed over the decoder linears
    const ModelSpec spec = load_model_spec(fp16_->string());
    uint64_t n = 0;
    for (const LayerSpec& ls : spec.layers)
      for (auto lin : kLinears) n += (uint64_t)((ls.*lin).N * (ls.*lin).K);
    return n;
  }
  static fs::path* fp16_;
  static fs::path* calib_;
  static std::vector<int>* sampled_;
};
fs::path* Mixed::fp16_ = nullptr;
fs::path* Mixed::calib_ = nullptr;
std::vector<int>* Mixed::sampled_ = nullptr;

// Siblings (same layer, q/k/v or gate/up) have one setting.
void expect_siblings_share(const MixedPlanReport& p) {
  std::map<std::string, QuantSetting> by_group;
  for (const PlannedLinear& l : p.linears) {
    std::string group = l.name.substr(0, l.name.rfind('.') + 1);
    const std::string leaf = l.name.substr(group.size());
    if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") group += "qkv";
    else if (leaf == "gate_proj" || leaf == "up_proj") group += "gate_up";
    else continue;
    auto [it, fresh] = by_group.emplace(group, l.setting);
    if (!fresh) {
      EXPECT_EQ(it->second, l.setting) << l.name;
    }
  }
  EXPECT_EQ(by_group.size(), 4u);  // 2 layers x (qkv, gate_up)
}

// The oracle of KlProbe: KL(p_fp16 || p) averaged over every token of the windows, from two
// whole-model forwards (the model as given, and with one linear's weights replaced).
double kl_oracle(const ModelSpec& spec, const std::vector<std::vector<int>>& windows, int layer,
                 CpuLinear CpuLayer::*lin, const std::vector<float>& w) {
  DecoderCpu ref(spec), alt(spec);
  (alt.layer(layer).*lin).w = w;
  const int T = (int)windows[0].size(), V = spec.config.vocab;
  std::vector<float> zr((size_t)T * V), za((size_t)T * V), last(V);
  double total = 0;
  for (const std::vector<int>& win : windows) {
    ref.new_cpu_session(T)->forward(win.data(), T, 0, last.data(), zr.data());
    alt.new_cpu_session(T)->forward(win.data(), T, 0, last.data(), za.data());
    for (int t = 0; t < T; ++t) {
      auto log_softmax = [&](const float* z) {
        double mx = *std::max_element(z, z + V), s = 0;
        for (int v = 0; v < V; ++v) s += std::exp(z[v] - mx);
        std::vector<double> l(V);
        for (int v = 0; v < V; ++v) l[v] = z[v] - mx - std::log(s);
        return l;
      };
      const std::vector<double> lp = log_softmax(&zr[(size_t)t * V]), lq = log_softmax(&za[(size_t)t * V]);
      for (int v = 0; v < V; ++v) total += std::exp(lp[v]) * (lp[v] - lq[v]);
    }
  }
  return total / ((double)windows.size() * T);
}

// --loss kl's measure is the divergence of the whole model's distributions: zero for the FP16
// weights, and for a quantized linear the same as two whole-model forwards give, in the layer
// it stands at after advancing. The replaced weights are handed back as they were.
TEST_F(Mixed, KlProbeMeasuresTheWholeModelsDivergence) {
  const ModelSpec spec = load_model_spec(fp16_->string());
  const std::vector<std::vector<int>> windows = {
      std::vector<int>(sampled_->begin(), sampled_->begin() + 48),
      std::vector<int>(sampled_->begin() + 128, sampled_->begin() + 176)};
  KlProbe probe(spec, windows);
  EXPECT_NEAR(probe.kl(0, {}), 0.0, 1e-9);

  // 2-bit round-to-nearest of a layer's down_proj: a large, known change.
  auto rtn2 = [&](int layer) {
    const CpuLayer fp16 = DecoderCpu::load_layer(spec.layers[layer]);
    GptqOptions g;
    g.bits = 2;
    g.group_size = 64;
    return rtn_quantize(fp16.down.w.data(), fp16.down.N, fp16.down.K, g).dequant;
  };
  for (int layer : {0, 1}) {
    std::vector<float> w = rtn2(layer);
    const std::vector<float> copy = w;
    const double kl = probe.kl(layer, {{&CpuLayer::down, &w}});
    EXPECT_EQ(w, copy) << "the replacement is handed back";
    const double oracle = kl_oracle(spec, windows, layer, &CpuLayer::down, copy);
    EXPECT_GT(oracle, 1e-4) << layer;
    EXPECT_NEAR(kl, oracle, 1e-6 + 1e-3 * oracle) << layer;
    // The FP16 weights are back in place: no replacement, no divergence.
    EXPECT_NEAR(probe.kl(layer, {}), 0.0, 1e-9) << layer;
    probe.advance(layer);
  }
  EXPECT_THROW(probe.kl(0, {}), Error);  // it stands past layer 0 now
}

// Measured once (a dry run), planned at many budgets.
TEST_F(Mixed, PlanKeepsItsBudgetAndMoreBudgetNeverLosesMore) {
  const uint64_t W = weights();
  const ModelSpec spec = load_model_spec(fp16_->string());
  QuantizeOptions kl = dry(3.5);
  kl.loss = "kl";
  const QuantizeReport measured = quantize_model(kl);
  ASSERT_TRUE(measured.plan.has_value());
  for (const PlannedLinear& l : measured.plan->linears) EXPECT_EQ(l.measured.size(), 12u) << l.name;
  // --loss kl measures a sibling group as one and shares its KL equally: q, k and
  // v of a layer carry the same loss at each candidate, positive, and 2-bit g128 costs more than
  // 4-bit g128.
  for (size_t i = 0; i + 2 < measured.plan->linears.size(); ++i) {
    const PlannedLinear &q = measured.plan->linears[i], &k = measured.plan->linears[i + 1],
                        &v = measured.plan->linears[i + 2];
    if (!q.name.ends_with("q_proj")) continue;
    std::map<std::pair<int, int>, double> at;
    for (size_t c = 0; c < q.measured.size(); ++c) {
      EXPECT_EQ(q.measured[c].second.error, k.measured[c].second.error) << q.name;
      EXPECT_EQ(q.measured[c].second.error, v.measured[c].second.error) << q.name;
      EXPECT_GT(q.measured[c].second.error, 0.0) << q.name;
      at[{q.measured[c].first.bits, q.measured[c].first.group_size}] = q.measured[c].second.error;
    }
    EXPECT_GT(at.at({2, 128}), at.at({4, 128})) << q.name;
  }
  double last_loss = std::numeric_limits<double>::infinity();
  std::set<std::pair<int, int>> seen;  // settings chosen over all budgets
  for (double bits : {2.3, 2.45, 2.6, 2.8, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5, 5.0, 6.0, 7.0, 8.6}) {
    QuantizeOptions o = dry(bits);
    const MixedPlanReport p = plan_from_measurements(spec, o, measured.plan->linears);
    EXPECT_EQ(p.weights, W);
    EXPECT_EQ(p.budget, (uint64_t)std::floor(bits * (double)W / 8.0));
    EXPECT_LE(p.bytes, p.budget) << bits;
    EXPECT_LE(p.bits_per_weight(), bits);
    // The plan's totals are its linears' exact sizes and losses at their settings.
    uint64_t bytes = 0;
    double loss = 0;
    for (const PlannedLinear& l : p.linears) {
      EXPECT_EQ(l.bytes, gptq_linear_bytes(l.N, l.K, l.setting.bits, l.setting.group_size));
      bool measured_there = false;
      for (const auto& [c, pc] : l.measured)
        if (c == l.setting) measured_there = pc.error == l.loss;
      EXPECT_TRUE(measured_there) << l.name;
      bytes += l.bytes;
      loss += l.loss;
      seen.insert({l.setting.bits, l.setting.group_size});
    }
    EXPECT_EQ(bytes, p.bytes);
    EXPECT_NEAR(loss, p.loss, 1e-9 * loss);
    EXPECT_EQ(p.linears.size(), 14u);
    expect_siblings_share(p);
    // A larger budget never gives a larger estimated loss.
    EXPECT_LE(p.loss, last_loss * (1 + 1e-12)) << bits;
    last_loss = p.loss;
    // Budgets are spent: what is left could not move any linear group up a step. (Checked
    // loosely: within the largest single step between two candidates of one group.)
    if (bits >= 2.6 && bits <= 7.0) {
      EXPECT_GT(p.bits_per_weight(), bits - 0.25) << bits;
    }
  }
  // The budgets span the candidates: 2-bit plans at the low end, 8-bit g32 at the high end.
  EXPECT_TRUE(seen.count({2, 128}) || seen.count({2, 64}) || seen.count({2, 32}));
  EXPECT_TRUE(seen.count({8, 32}));
  // The dry run's own plan is the plan at its budget.
  const MixedPlanReport again = plan_from_measurements(spec, dry(3.5), measured.plan->linears);
  EXPECT_EQ(again.bytes, measured.plan->bytes);
  EXPECT_EQ(again.loss, measured.plan->loss);
}

TEST_F(Mixed, TargetSizeCountsEveryTensorWritten) {
  const fs::path out = temp_dir("target");
  QuantizeOptions o = options(out.string());
  o.loss = "residual";  // the budget does not depend on the loss; this one costs no forwards
  // The FP16 tensors (embeddings, norms, lm_head) plus ~3.5 bits per weight.
  const ModelSpec in = load_model_spec(fp16_->string());
  const uint64_t fixed = in.files.total_bytes() - 2 * weights();
  const double gb = (double)(fixed + weights() * 35 / 80) / 1e9;
  o.target_size_gb = gb;
  const QuantizeReport r = quantize_model(o);
  const MixedPlanReport& p = *r.plan;
  EXPECT_EQ(p.fixed_bytes, fixed);
  EXPECT_EQ(p.budget, (uint64_t)std::floor(gb * 1e9) - p.fixed_bytes);
  EXPECT_LE(p.bytes, p.budget);
  // What was written: every tensor's bytes, as counted.
  const ModelSpec spec = load_model_spec(out.string());
  EXPECT_EQ(spec.files.total_bytes(), p.bytes + p.fixed_bytes);
  EXPECT_LE((double)spec.files.total_bytes(), gb * 1e9);
  fs::remove_all(out);
}

TEST_F(Mixed, CheckpointHoldsThePlanAndRuns) {
  const fs::path out = temp_dir("ckpt");
  QuantizeOptions o = options(out.string());
  o.bits_avg = 3.5;
  const QuantizeReport r = quantize_model(o);
  ASSERT_TRUE(r.plan.has_value());
  const MixedPlanReport& p = *r.plan;
  std::set<std::pair<int, int>> settings;
  for (const PlannedLinear& l : p.linears) settings.insert({l.setting.bits, l.setting.group_size});
  ASSERT_GE(settings.size(), 2u) << "the plan should mix formats at 3.5 bits";
  ASSERT_FALSE(p.rules.empty());

  // The configs carry the base format and the rules, the same in both files.
  const nlohmann::ordered_json qc =
      nlohmann::ordered_json::parse(std::ifstream(out / "quantize_config.json"));
  const nlohmann::ordered_json cc = nlohmann::ordered_json::parse(std::ifstream(out / "config.json"));
  EXPECT_EQ(qc, cc["quantization_config"]);
  EXPECT_EQ(qc["bits"], p.base.bits);
  EXPECT_EQ(qc["group_size"], p.base.group_size);
  EXPECT_EQ(qc["desc_act"], true);
  ASSERT_EQ(qc["dynamic"].size(), p.rules.size());
  size_t i = 0;
  for (const auto& [key, value] : qc["dynamic"].items()) {
    EXPECT_EQ(key, p.rules[i].first);
    EXPECT_EQ(value, (nlohmann::ordered_json{{"bits", p.rules[i].second.bits},
                                             {"group_size", p.rules[i].second.group_size}}));
    ++i;
  }

  // Kestrel's loader gives every linear its planned format.
  kestrel::test::expect_checkpoint_holds(out, p);

  // The report records each linear's format and the plan.
  const nlohmann::json rep = nlohmann::json::parse(std::ifstream(out / "quantize_report.json"));
  EXPECT_EQ(rep["mixed_precision"]["bytes"], p.bytes);
  EXPECT_EQ(rep["linears"][0]["bits"], p.linears[0].setting.bits);

  // It runs on the CPU engine, between the FP16 model and uniform 3-bit g128 (smaller than the
  // plan) on text the FP16 model finds likely.
  const double p16 = ppl(*fp16_, *sampled_), pm = ppl(out, *sampled_);
  const fs::path three = temp_dir("three");
  QuantizeOptions o3 = options(three.string());
  o3.gptq.bits = 3;
  o3.gptq.group_size = 128;
  quantize_model(o3);
  const double p3 = ppl(three, *sampled_);
  std::fprintf(stderr, "perplexity: FP16 %.4f, mixed 3.5 bits %.4f, uniform 3-bit g128 %.4f\n",
               p16, pm, p3);
  EXPECT_GT(pm, p16);
  EXPECT_LT(pm, p3);
  const Result g = run(std::string(KESTREL_BIN) + " generate -m " + out.string() +
                       " --device cpu -p 'The river' -n 8 --temp 0 --ignore-eos --json -q");
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_EQ(nlohmann::json::parse(g.out)["ids"].size(), 8u);
  fs::remove_all(out);
  fs::remove_all(three);
}

// A plan with a single candidate is uniform: pass 2 must then be exactly the ordinary quantizer.
TEST_F(Mixed, OneCandidatePlanIsTheUniformCheckpoint) {
  const fs::path mixed = temp_dir("one_mixed"), uniform = temp_dir("one_uniform");
  QuantizeOptions om = options(mixed.string());
  om.bits_avg = 8;
  om.candidates = {{3, 64}};
  om.loss = "residual";  // one candidate: nothing to rank, so the cheapest loss
  const QuantizeReport r = quantize_model(om);
  EXPECT_TRUE(r.plan->rules.empty());
  QuantizeOptions ou = options(uniform.string());
  ou.gptq.bits = 3;
  ou.gptq.group_size = 64;
  quantize_model(ou);
  kestrel::test::expect_same_tensors(mixed, uniform);
  const nlohmann::json qc = nlohmann::json::parse(std::ifstream(mixed / "quantize_config.json"));
  EXPECT_FALSE(qc.contains("dynamic"));
  EXPECT_EQ(qc["bits"], 3);
  fs::remove_all(mixed);
  fs::remove_all(uniform);
}

// One rule per sibling group serves GPTQModel and Kestrel (each linear's name) and vLLM (which
// looks a fused layer up by its fused name), and matches nothing else.
TEST_F(Mixed, RuleKeysMatchSiblingsAndFusedNames) {
  QuantizeOptions o = dry(3.0);
  o.loss = "residual";  // any mixed plan has rules to check; this loss costs no forwards
  const MixedPlanReport p = *quantize_model(o).plan;
  ASSERT_FALSE(p.rules.empty());
  std::vector<std::string> modules;
  const ModelSpec spec = load_model_spec(fp16_->string());
  for (const LayerSpec& ls : spec.layers)
    for (auto lin : kLinears) modules.push_back((ls.*lin).name);
  for (const auto& [key, q] : p.rules) {
    const DynamicRule rule = dynamic_rule(key, "test");
    std::vector<std::string> hit;
    for (const std::string& m : modules)
      if (rule.matches(m)) hit.push_back(m);
    ASSERT_FALSE(hit.empty()) << key;
    // Every module it matches has the rule's setting in the plan.
    for (const PlannedLinear& l : p.linears)
      if (rule.matches(l.name)) {
        EXPECT_EQ(l.setting, q) << key << " " << l.name;
      }
    const std::string prefix = hit[0].substr(0, hit[0].rfind('.') + 1);
    if (hit.size() == 3) {
      EXPECT_TRUE(rule.matches(prefix + "qkv_proj")) << key;
    }
    if (hit.size() == 2) {
      EXPECT_TRUE(rule.matches(prefix + "gate_up_proj")) << key;
    }
    if (hit.size() == 1) {
      EXPECT_FALSE(rule.matches(prefix + "qkv_proj")) << key;
      EXPECT_FALSE(rule.matches(prefix + "gate_up_proj")) << key;
    }
  }
}

TEST_F(Mixed, DryRunPrintsThePlanAndWritesNothing) {
  const fs::path out = temp_dir("dry");
  const std::string cmd = std::string(KESTREL_QUANTIZE_BIN) + " -m " + fp16_->string() +
                          " --calib " + calib_->string() +
                          " --nsamples 16 --seqlen 128 --device cpu -q --act-order";
  // The estimated losses here (kl, the default, is measured by the other tests): cheaper, and
  // their paths stay covered.
  const Result r = run(cmd + " --bits-avg 3.5 --dry-run --loss residual --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(lines(r.out), 1 + 14 + 2) << r.out;  // header, 14 linears, mix, total
  EXPECT_NE(r.out.find("model.layers.1.mlp.down_proj"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bits per weight"), std::string::npos) << r.out;
  // Without --out too.
  const Result r2 = run(cmd + " --bits-avg 3.5 --dry-run --loss relative --candidates 3g128,4g128");
  ASSERT_EQ(r2.code, 0) << r2.err;
  EXPECT_EQ(r2.out.find("g64"), std::string::npos) << r2.out;
}

TEST_F(Mixed, BadOptionsAreRefusedInOneLine) {
  const fs::path out = temp_dir("bad");
  const std::string base = std::string(KESTREL_QUANTIZE_BIN) + " -m " + fp16_->string() +
                           " --calib " + calib_->string() + " --out " + out.string() +
                           " --nsamples 8 --seqlen 128 -q";
  auto expect_error = [](const std::string& cmd, const std::string& what) {
    const Result r = run(cmd);
    EXPECT_EQ(r.code, 1) << cmd << "\n" << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  };
  expect_error(base + " --bits-avg 3.5 --target-size 0.01", "are exclusive");
  expect_error(base + " --bits-avg 3.5 --bits 4", "--bits and --group-size fix one format");
  expect_error(base + " --target-size 0.01 --group-size 64", "--bits and --group-size fix one format");
  expect_error(base + " --candidates 4g128", "go with a budget");
  expect_error(base + " --dry-run", "go with a budget");
  expect_error(base + " --loss relative", "go with a budget");
  expect_error(base + " --kl-windows 2", "go with a budget");
  expect_error(base + " --bits-avg 0", "--bits-avg must be");
  expect_error(base + " --bits-avg -2", "--bits-avg must be");
  expect_error(base + " --target-size 0", "--target-size must be");
  expect_error(base + " --bits-avg 3 --candidates 5g128", "bits must be 2, 3, 4 or 8");
  expect_error(base + " --bits-avg 3 --candidates 4x128", "is not BITSgGROUP");
  expect_error(base + " --bits-avg 3 --candidates 4g128,", "is not BITSgGROUP");
  expect_error(base + " --bits-avg 3 --candidates 4g0", "group size must be positive or -1");
  expect_error(base + " --bits-avg 3 --candidates 4g64,4g64", "listed twice");
  expect_error(base + " --bits-avg 3 --loss kl --device cuda", "--loss kl runs on the CPU only");
  {  // the library refuses it too, before it looks for a GPU
    QuantizeOptions o = dry(3.5);
    o.loss = "kl";
    o.device = "cuda";
    EXPECT_THROW(quantize_model(o), Error);
  }
  expect_error(base + " --bits-avg 3 --loss logits", "--loss must be kl, output, relative or residual");
  expect_error(base + " --bits-avg 3 --kl-windows 0", "--kl-windows must be positive");
  // Budgets no plan fits, after measuring: in bits per weight and in GB.
  expect_error(base + " --bits-avg 1.5", "--bits-avg 1.5 is below the smallest plan");
  expect_error(base + " --target-size 0.0001", "--target-size 0.0001 GB is below the smallest plan");
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
