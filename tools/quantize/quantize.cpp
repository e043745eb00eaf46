// The model-level quantizer: calibration windows, the layer-by-layer GPTQ loop and mixed
// precision's measuring pass over the CPU engine's layer forward (the GPU's are
// quantize_cuda.cpp), the plan, and the checkpoint writer.
#include "tools/quantize/quantize.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/device.h"
#include "base/error.h"
#include "models/io/model_spec.h"
#include "base/progress.h"
#include "base/staged_output.h"
#include "models/io/safetensors.h"
#include "models/cpu/decoder.h"
#include "tokenizer/tokenizer.h"
#include "tools/quantize/kl_probe.h"
#include "tools/quantize/pack.h"
#include "tools/quantize/quantize_loops.h"

namespace kestrel::quant {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

// A byte count from a budget in double, clamped to what uint64_t holds: --target-size 1e11 GB
// is a valid, if large, budget.
uint64_t to_bytes(double b) {
  constexpr double kMax = 18446744073709549568.0;  // the largest double below 2^64
  return b <= 0 ? 0 : b >= kMax ? UINT64_MAX : static_cast<uint64_t>(b);
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("cannot read {} {}", what, path));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  f.close();  // a full disk shows at the flush
  if (!f) throw Error(fmt::format("cannot write {}", path.string()));
}

// The linears of one true-sequential group: where the engine holds each and where the
// checkpoint names it.
struct Member {
  const char* short_name;
  CpuLinear CpuLayer::*linear;
  LinearSpec LayerSpec::*spec;
};
struct Group {
  LinearGroup id;
  std::vector<Member> members;
};

const std::array<Group, 4>& groups() {
  static const std::array<Group, 4> g = {{
      {LinearGroup::QKV,
       {{"q", &CpuLayer::q, &LayerSpec::q},
        {"k", &CpuLayer::k, &LayerSpec::k},
        {"v", &CpuLayer::v, &LayerSpec::v}}},
      {LinearGroup::O, {{"o", &CpuLayer::o, &LayerSpec::o}}},
      {LinearGroup::GateUp,
       {{"gate", &CpuLayer::gate, &LayerSpec::gate}, {"up", &CpuLayer::up, &LayerSpec::up}}},
      {LinearGroup::Down, {{"down", &CpuLayer::down, &LayerSpec::down}}},
  }};
  return g;
}

// Packed tensors wait here, one file per tensor, until the checkpoint is written: memory
// then holds one layer at a time whatever the model's size. Removed with its contents.
class Scratch {
 public:
  explicit Scratch(fs::path dir) : dir_(std::move(dir)) { fs::create_directories(dir_); }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void save(const std::string& tensor, const void* data, size_t nbytes) {
    std::ofstream f(dir_ / tensor, std::ios::binary);
    f.write((const char*)data, (std::streamsize)nbytes);
    f.close();
    if (!f) throw Error(fmt::format("cannot write {}", (dir_ / tensor).string()));
  }
  // Reads a saved tensor into dst (exactly nbytes).
  void load(const std::string& tensor, uint8_t* dst, size_t nbytes) const {
    std::ifstream f(dir_ / tensor, std::ios::binary);
    f.read((char*)dst, (std::streamsize)nbytes);
    if (!f || (size_t)f.gcount() != nbytes)
      throw Error(fmt::format("cannot read back {}", (dir_ / tensor).string()));
  }

 private:
  fs::path dir_;
};

// Shapes of a packed linear, for the writer's declarations.
struct PackedShape {
  int64_t N, K, G;
  int bits;
};

// The quantized linears' checkpoint tensors: each packed, saved to the scratch folder, and its
// shapes kept for the writer.
class PackedParts {
 public:
  PackedParts(Scratch& scratch, int zero_offset) : scratch_(scratch), zero_offset_(zero_offset) {}
  PackedLinear add(const LinearSpec& s, const QuantizedLinear& q) {
    PackedLinear p = pack(q, zero_offset_, s.name.c_str());
    scratch_.save(s.name + ".qweight", p.qweight.data(), p.qweight.size() * 4);
    scratch_.save(s.name + ".qzeros", p.qzeros.data(), p.qzeros.size() * 4);
    scratch_.save(s.name + ".scales", p.scales.data(), p.scales.size() * 2);
    scratch_.save(s.name + ".g_idx", p.g_idx.data(), p.g_idx.size() * 4);
    shapes_[s.name] = PackedShape{p.N, p.K, p.groups(), p.bits};
    return p;
  }
  const std::map<std::string, PackedShape>& shapes() const { return shapes_; }

 private:
  Scratch& scratch_;
  int zero_offset_;
  std::map<std::string, PackedShape> shapes_;
};

// The regex of a dynamic rule for one true-sequential group's linears: the escaped full
// name of a lone linear, or for siblings (q/k/v, gate/up) their common prefix and an
// alternation of their last components plus the name vLLM gives them fused (qkv_proj,
// gate_up_proj): vLLM looks a fused layer's format up by its fused name (recent versions try
// each shard's name too), GPTQModel and Kestrel by each linear's name, and one rule serves all.
std::string rule_key(const std::vector<std::string>& names) {
  auto escape = [](const std::string& t) {
    std::string e;
    for (char c : t) {
      if (std::string_view(".^$*+?{}[]()|\\").find(c) != std::string_view::npos) e += '\\';
      e += c;
    }
    return e;
  };
  if (names.size() == 1) return escape(names[0]);
  const size_t dot = names[0].rfind('.') + 1;
  const std::string prefix = names[0].substr(0, dot);
  std::vector<std::string> leaves;
  for (const std::string& n : names) {
    KESTREL_CHECK(n.starts_with(prefix), fmt::format("{} and {} are not siblings", names[0], n));
    leaves.push_back(n.substr(dot));
  }
  using L = std::vector<std::string>;
  if (leaves == L{"q_proj", "k_proj", "v_proj"}) leaves.push_back("qkv_proj");
  if (leaves == L{"gate_proj", "up_proj"}) leaves.push_back("gate_up_proj");
  std::string key = escape(prefix) + "(?:";
  for (size_t i = 0; i < leaves.size(); ++i) key += (i ? "|" : "") + escape(leaves[i]);
  return key + ")";
}

// The quantization config: o's format, or for a mixed plan its base format and a `dynamic`
// rule for each group of linears planned otherwise.
ojson quant_json(const QuantizeOptions& o, const MixedPlanReport* plan = nullptr) {
  ojson j{{"bits", plan ? plan->base.bits : o.gptq.bits},
          {"group_size", plan ? plan->base.group_size : o.gptq.group_size},
          {"damp_percent", std::stod(fmt::format("{:g}", o.gptq.damp))},  // 0.01, not 0.0099999998
          {"desc_act", o.method == "gptq" && o.gptq.act_order},
          {"static_groups", o.gptq.static_groups},
          {"sym", o.gptq.sym},
          {"true_sequential", true},
          {"quant_method", "gptq"},
          {"checkpoint_format", o.gptq.sym ? "gptq" : "gptq_v2"},
          {"model_file_base_name", "model"}};
  // GPTQModel's name for the range search's norm; informative, as damp_percent is.
  if (o.gptq.mse > 0) j["mse"] = std::stod(fmt::format("{:g}", o.gptq.mse));
  if (plan && !plan->rules.empty()) {
    ojson dyn = ojson::object();
    for (const auto& [key, q] : plan->rules)
      dyn[key] = ojson{{"bits", q.bits}, {"group_size", q.group_size}};
    j["dynamic"] = std::move(dyn);
  }
  return j;
}

void check_options(const QuantizeOptions& o) {
  validate(o.gptq);
  if (o.method != "gptq" && o.method != "rtn")
    throw Error(fmt::format("--method must be gptq or rtn, got {}", o.method));
  if (o.method == "rtn" && o.gptq.act_order)
    throw Error("--act-order applies to --method gptq only (rtn has no column order)");
  if (o.device != "cpu" && o.device != "cuda" && o.device != "auto")
    throw Error(fmt::format("--device must be cpu, cuda or auto, got {}", o.device));
  if (o.nsamples <= 0) throw Error(fmt::format("--nsamples must be positive, got {}", o.nsamples));
  if (o.seqlen <= 0) throw Error(fmt::format("--seqlen must be positive, got {}", o.seqlen));
  if (o.bits_avg != 0 && o.target_size_gb != 0)
    throw Error("--bits-avg and --target-size are exclusive: give one budget");
  if (o.bits_avg != 0 && !(o.bits_avg > 0 && o.bits_avg <= 32))
    throw Error(fmt::format("--bits-avg must be a number of bits per weight in (0, 32], got {}",
                            o.bits_avg));
  if (o.target_size_gb != 0 && !(o.target_size_gb > 0 && std::isfinite(o.target_size_gb)))
    throw Error(fmt::format("--target-size must be a positive number of GB, got {}",
                            o.target_size_gb));
  if (!o.mixed() && (o.dry_run || !o.candidates.empty()))
    throw Error("--candidates, --loss and --dry-run go with a budget: --bits-avg or --target-size");
  if (o.loss != "output" && o.loss != "relative" && o.loss != "residual" && o.loss != "kl")
    throw Error(fmt::format("--loss must be kl, output, relative or residual, got {}", o.loss));
  if (o.kl_windows <= 0)
    throw Error(fmt::format("--kl-windows must be positive, got {}", o.kl_windows));
  if (o.mixed() && o.loss == "kl" && o.device == "cuda")
    throw Error("--loss kl runs on the CPU only: --device cpu, or another --loss");
  for (const QuantSetting& c : o.candidates) {
    GptqOptions g = o.gptq;
    g.bits = c.bits;
    g.group_size = c.group_size;
    validate(g);
  }
  if (o.dry_run) return;  // nothing is written: --out is not needed
  if (o.out_dir.empty()) throw Error("--out is required");
  if (fs::exists(o.out_dir) && fs::exists(o.model_dir)) {
    const fs::path out = fs::canonical(o.out_dir), model = fs::canonical(o.model_dir);
    if (out == model) throw Error(fmt::format("--out {} is the input model directory", o.out_dir));
    // Replacing a directory that holds the input would delete it.
    if (std::mismatch(out.begin(), out.end(), model.begin(), model.end()).first == out.end())
      throw Error(
          fmt::format("--out {} holds the input model directory {}", o.out_dir, o.model_dir));
  }
  StagedDir::check(o.out_dir, o.force);
}

void check_model(const ModelSpec& spec, const QuantizeOptions& o) {
  if (spec.config.quant)
    throw Error(fmt::format("{}: the model is already GPTQ-quantized; give an FP16 model", spec.dir));
  if (o.seqlen > spec.config.max_pos)
    throw Error(fmt::format("--seqlen {} is longer than the model's max_position_embeddings {}",
                            o.seqlen, spec.config.max_pos));
  const int bits = o.gptq.bits;  // mixed: each candidate is checked as the plan is made
  for (const LayerSpec& ls : spec.layers)
    for (const Group& g : groups())
      for (const Member& m : g.members) {
        const LinearSpec& s = ls.*m.spec;
        if (s.name.empty()) continue;  // not in this family (OPT has no gate)
        if (s.quantized)
          throw Error(fmt::format("{}: {} is already quantized", spec.dir, s.name));
        if (!o.mixed() && ((s.K * bits) % 32 != 0 || (s.N * bits) % 32 != 0))
          throw Error(fmt::format("{}: [{}, {}] cannot be packed at {} bits (in and out features "
                                  "times bits must be multiples of 32)",
                                  s.name, s.N, s.K, bits));
      }
}

// config.json of the output: the input's, with the quantization config and fp16 dtype.
void write_config(const QuantizeOptions& o, const MixedPlanReport* plan, const fs::path& out_dir) {
  const fs::path in = fs::path(o.model_dir) / "config.json";
  ojson c;
  try {
    c = ojson::parse(read_file(in.string(), "model config"));
  } catch (const ojson::exception& e) {
    throw Error(fmt::format("{}: {}", in.string(), e.what()));
  }
  if (c.contains("dtype")) c["dtype"] = "float16";
  if (c.contains("torch_dtype") || !c.contains("dtype")) c["torch_dtype"] = "float16";
  c["quantization_config"] = quant_json(o, plan);
  write_file(out_dir / "config.json", c.dump(2) + "\n");
  write_file(out_dir / "quantize_config.json", quant_json(o, plan).dump(2) + "\n");
}

void copy_tokenizer_files(const QuantizeOptions& o, const fs::path& out_dir) {
  for (const char* name : {"tokenizer.model", "tokenizer.json", "vocab.json", "merges.txt",
                           "tokenizer_config.json", "special_tokens_map.json",
                           "added_tokens.json", "generation_config.json"}) {
    const fs::path src = fs::path(o.model_dir) / name, dst = out_dir / name;
    if (!fs::exists(src)) continue;
    // A read-only source (a shared model folder) must not give a file --force cannot replace.
    fs::copy_file(src, dst);
    fs::permissions(dst, fs::perms::owner_write, fs::perm_options::add);
  }
}

// Every tensor of the input, the quantized linears' weights replaced by their GPTQ tensors
// and every float tensor stored as fp16.
void write_weights(const ModelSpec& spec, const std::map<std::string, PackedShape>& packed,
                   const Scratch& scratch, const fs::path& out_dir) {
  SafetensorsWriter w;
  for (const std::string& name : spec.files.names()) {
    const std::string suffix = ".weight";
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      const std::string prefix = name.substr(0, name.size() - suffix.size());
      if (auto it = packed.find(prefix); it != packed.end()) {
        const PackedShape s = it->second;
        auto from_scratch = [&scratch](std::string t) {
          return [&scratch, t](uint8_t* dst, size_t n) { scratch.load(t, dst, n); };
        };
        w.add(prefix + ".qweight", DType::I32, {s.K * s.bits / 32, s.N},
              from_scratch(prefix + ".qweight"));
        w.add(prefix + ".qzeros", DType::I32, {s.G, s.N * s.bits / 32},
              from_scratch(prefix + ".qzeros"));
        w.add(prefix + ".scales", DType::F16, {s.G, s.N}, from_scratch(prefix + ".scales"));
        w.add(prefix + ".g_idx", DType::I32, {s.K}, from_scratch(prefix + ".g_idx"));
        continue;
      }
    }
    const TensorInfo& t = spec.files.get(name);
    if (t.dtype == DType::F16 || t.dtype == DType::I32) {
      w.add(name, t.dtype, t.shape, [&t](uint8_t* dst, size_t n) { std::memcpy(dst, t.data, n); });
    } else {
      w.add(name, DType::F16, t.shape, [&t](uint8_t* dst, size_t) {
        const std::vector<float> v = to_float(t);
        for (size_t i = 0; i < v.size(); ++i) {
          const uint16_t h = float_to_half(v[i]);
          std::memcpy(dst + 2 * i, &h, 2);
        }
      });
    }
  }
  w.write_model(out_dir.string());
}

std::string layer_line(int l, int n_layers, const std::vector<LinearReport>& lines,
                       const LayerTimes& t) {
  std::string s = fmt::format("layer {}/{}  rel. error", l + 1, n_layers);
  for (const LinearReport& r : lines) {
    const std::string base = r.name.substr(r.name.rfind('.') + 1);  // "q_proj"
    s += fmt::format("  {} {:.2e}", base.substr(0, base.find('_')), r.rel_error);
  }
  return s + fmt::format("  ({:.2f} s: forward {:.2f}, Hessians {:.2f}, quantize {:.2f})", t.total,
                         t.forward, t.hessian, t.quantize);
}

// The CPU layer loops' engine: one decoder layer's DecoderCpu (each layer is swapped into it in
// turn), its session, and the calibration windows' residual streams X [nsamples, seqlen,
// hidden], embedded.
struct OneLayerEngine {
  OneLayerEngine(const ModelSpec& spec, const QuantizeOptions& o,
                 const std::vector<std::vector<int>>& windows)
      : engine(first_layer(spec)),
        seq(engine.new_cpu_session(o.seqlen)),
        win((size_t)o.seqlen * spec.config.hidden),
        X(win * o.nsamples) {
    for (int s = 0; s < o.nsamples; ++s) engine.embed(windows[s].data(), o.seqlen, 0, &X[s * win]);
  }
  static ModelSpec first_layer(const ModelSpec& spec) {
    ModelSpec one = spec;
    one.config.n_layers = 1;
    one.layers = {spec.layers[0]};
    return one;
  }
  DecoderCpu engine;
  std::unique_ptr<DecoderCpuSession> seq;
  size_t win;
  std::vector<float> X;
};

// The layer loop on the CPU: a one-layer DecoderCpu engine takes each decoder layer in turn.
// `gptq_for` gives each linear's options (o.gptq, or its planned format).
void quantize_layers_cpu(const ModelSpec& spec, const QuantizeOptions& o,
                         const std::vector<std::vector<int>>& windows, PackedParts& parts,
                         const OptionsFor& gptq_for,
                         const LayerDone& done) {
  const ModelConfig& cfg = spec.config;
  OneLayerEngine one(spec, o, windows);
  DecoderCpu& engine = one.engine;
  const std::unique_ptr<DecoderCpuSession>& seq = one.seq;
  const size_t win = one.win;
  std::vector<float>& X = one.X;
  std::vector<float> x(win);  // one window, rerun from X for each group

  for (int l = 0; l < cfg.n_layers; ++l) {
    const auto t_layer = Clock::now();
    LayerTimes times;
    const LayerSpec& ls = spec.layers[l];
    engine.layer(0) = DecoderCpu::load_layer(ls);
    std::vector<LinearReport> lines;
    for (const Group& g : groups()) {
      const auto t_fwd = Clock::now();
      double hess = 0;
      Hessian hessian((ls.*(g.members.back().spec)).K);  // the last member is in every family
      LayerTaps taps;
      taps.input = [&](LinearGroup id, const float* in, int T, int) {
        if (id != g.id) return;
        const auto t_h = Clock::now();
        hessian.add(in, T);
        hess += seconds_since(t_h);
      };
      taps.stop_after = g.id;
      for (int s = 0; s < o.nsamples; ++s) {
        std::copy_n(&X[s * win], win, x.begin());
        seq->layer_forward(0, x.data(), o.seqlen, 0, &taps);
      }
      times.hessian += hess;
      times.forward += seconds_since(t_fwd) - hess;
      const auto t_q = Clock::now();
      const std::vector<float> H = hessian.matrix();
      for (const Member& m : g.members) {
        const auto t_lin = Clock::now();
        const LinearSpec& s = ls.*m.spec;
        if (s.name.empty()) continue;
        CpuLinear& lin = engine.layer(0).*m.linear;
        const GptqOptions go = gptq_for(s);
        const QuantizedLinear q =
            o.method == "gptq" ? gptq_quantize(lin.w.data(), s.N, s.K, H.data(), go, s.name.c_str())
                               : rtn_quantize(lin.w.data(), s.N, s.K, go);
        LinearReport r{s.name, s.N, s.K, relative_error(lin.w.data(), q.dequant.data(), s.N, s.K, H.data()), 0};
        std::vector<float> bias = std::move(lin.bias);  // kept as it is (not quantized)
        lin = to_cpu_linear(parts.add(s, q));  // later groups and layers see the quantized linear
        lin.bias = std::move(bias);
        r.seconds = seconds_since(t_lin);
        lines.push_back(r);
      }
      times.quantize += seconds_since(t_q);
    }
    // This layer's outputs, through its quantized linears, are the next layer's inputs.
    const auto t_out = Clock::now();
    for (int s = 0; s < o.nsamples; ++s) seq->layer_forward(0, &X[s * win], o.seqlen, 0);
    times.forward += seconds_since(t_out);
    times.total = seconds_since(t_layer);
    done(l, lines, times);
  }
}

// Pass 1 of mixed precision: every linear of every layer quantized at every candidate that can
// pack it, on the Hessian of its FP16 layer's inputs (one forward per window and layer, taps
// at all four groups), its loss kept: tr((W-Q) H (W-Q)^T) (scaled as o.loss says) or, with
// --loss kl, the KL divergence at the logits with its group alone quantized (KlProbe). The next
// layer gets the FP16 layer's outputs: which format each linear ends up with is not known until
// every layer is measured.
std::vector<PlannedLinear> measure_candidates_cpu(const ModelSpec& spec, const QuantizeOptions& o,
                                                  const std::vector<QuantSetting>& candidates,
                                                  const std::vector<std::vector<int>>& windows) {
  const ModelConfig& cfg = spec.config;
  OneLayerEngine one(spec, o, windows);
  DecoderCpu& engine = one.engine;
  const std::unique_ptr<DecoderCpuSession>& seq = one.seq;
  const size_t win = one.win;
  std::vector<float>& X = one.X;

  // --loss kl: the whole FP16 model and its distributions over the first --kl-windows windows.
  std::optional<KlProbe> probe;
  if (o.loss == "kl")
    probe.emplace(spec, std::vector<std::vector<int>>(
                            windows.begin(), windows.begin() + std::min(o.kl_windows, o.nsamples)));

  std::vector<PlannedLinear> out;
  Progress bar(fmt::format("measuring {} candidates", candidates.size()), cfg.n_layers, "layers",
               o.progress);
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerSpec& ls = spec.layers[l];
    engine.layer(0) = DecoderCpu::load_layer(ls);
    std::vector<Hessian> hessians;
    for (const Group& g : groups()) hessians.emplace_back((ls.*(g.members.back().spec)).K);
    LayerTaps taps;
    taps.input = [&](LinearGroup id, const float* in, int T, int) {
      for (size_t i = 0; i < groups().size(); ++i)
        if (groups()[i].id == id) hessians[i].add(in, T);
    };
    // Mean squared norm of the residual stream's rows, entering and leaving the layer.
    auto energy = [&] {
      double e = 0;
      for (float v : X) e += (double)v * v;
      return e / ((double)o.nsamples * o.seqlen);
    };
    const double e_in = o.loss == "residual" ? energy() : 0;
    for (int s = 0; s < o.nsamples; ++s) seq->layer_forward(0, &X[s * win], o.seqlen, 0, &taps);
    const double e_out = o.loss == "residual" ? energy() : 0;
    // --loss residual: each block's share of the residual stream, mean ||block output||^2 (half
    // of tr(W H W^T) for its last linear, o or down) over the residual's mean ||x||^2.
    std::vector<double> block_share(groups().size(), 1.0);
    if (o.loss == "residual") {
      auto share = [&](size_t last, double e_res) {
        const LinearSpec& s = ls.*(groups()[last].members.back().spec);
        const CpuLinear& lin = engine.layer(0).*(groups()[last].members.back().linear);
        const std::vector<float> H = hessians[last].matrix();
        const std::vector<float> zero((size_t)s.N * s.K, 0.0f);
        return 0.5 * output_error(lin.w.data(), zero.data(), s.N, s.K, H.data()) / e_res;
      };
      block_share[0] = block_share[1] = share(1, e_in);                      // q/k/v, o
      block_share[2] = block_share[3] = share(3, 0.5 * (e_in + e_out));      // gate/up, down
    }
    for (size_t gi = 0; gi < groups().size(); ++gi) {
      const std::vector<float> H = hessians[gi].matrix();
      std::vector<const Member*> members;  // the group's linears that the model has
      for (const Member& m : groups()[gi].members)
        if (!(ls.*m.spec).name.empty()) members.push_back(&m);
      std::vector<PlannedLinear> measured(members.size());
      std::vector<double> scale(members.size(), 1.0);
      for (size_t i = 0; i < members.size(); ++i) {
        const LinearSpec& s = ls.*members[i]->spec;
        measured[i].name = s.name;
        measured[i].N = s.N;
        measured[i].K = s.K;
        // --loss relative divides by tr(W H W^T), the energy of the linear's outputs.
        // --loss residual also weights it by the block's share of the residual stream.
        if (o.loss == "relative" || o.loss == "residual") {
          const CpuLinear& lin = engine.layer(0).*members[i]->linear;
          const std::vector<float> zero((size_t)s.N * s.K, 0.0f);
          const double e = output_error(lin.w.data(), zero.data(), s.N, s.K, H.data());
          scale[i] = (e > 0 ? 1.0 / e : 1.0) * block_share[gi];
        }
      }
      for (const QuantSetting& c : candidates) {
        auto packs = [&](const Member* m) {
          const LinearSpec& s = ls.*m->spec;
          return (s.K * c.bits) % 32 == 0 && (s.N * c.bits) % 32 == 0;
        };
        // --loss kl measures the group as one (the plan gives siblings one format): a candidate
        // that cannot pack all of them is left out for all.
        if (probe && !std::all_of(members.begin(), members.end(), packs)) continue;
        std::vector<std::pair<CpuLinear CpuLayer::*, std::vector<float>*>> replace;
        std::vector<std::vector<float>> dequant(members.size());
        for (size_t i = 0; i < members.size(); ++i) {
          if (!packs(members[i])) continue;
          const LinearSpec& s = ls.*members[i]->spec;
          const CpuLinear& lin = engine.layer(0).*members[i]->linear;
          GptqOptions g = o.gptq;
          g.bits = c.bits;
          g.group_size = c.group_size;
          QuantizedLinear q =
              o.method == "gptq" ? gptq_quantize(lin.w.data(), s.N, s.K, H.data(), g, s.name.c_str())
                                 : rtn_quantize(lin.w.data(), s.N, s.K, g);
          PlanCandidate pc;
          pc.bits = c.bits;
          pc.group_size = c.group_size;
          pc.bytes = gptq_linear_bytes(s.N, s.K, c.bits, c.group_size);
          if (!probe) pc.error = scale[i] * output_error(lin.w.data(), q.dequant.data(), s.N, s.K, H.data());
          measured[i].measured.emplace_back(c, pc);
          if (probe) {
            dequant[i] = std::move(q.dequant);
            replace.emplace_back(members[i]->linear, &dequant[i]);
          }
        }
        if (probe) {
          // The group's measured KL, shared equally by its linears: the plan adds them up.
          const double kl = probe->kl(l, replace) / (double)members.size();
          for (PlannedLinear& p : measured) p.measured.back().second.error = kl;
        }
      }
      for (PlannedLinear& p : measured) {
        if (p.measured.empty())
          throw Error(fmt::format("{}: [{}, {}] cannot be packed at any of the candidates' bit "
                                  "widths (in and out features times bits must be multiples of "
                                  "32{})", p.name, p.N, p.K,
                                  probe ? ", with --loss kl for all of its group" : ""));
        out.push_back(std::move(p));
      }
    }
    if (probe) probe->advance(l);
    bar.update(l + 1);
  }
  bar.finish();
  return out;
}

// The linears with every candidate's bytes, from their shapes alone (losses 0), in the order
// measure_candidates_cpu gives them: a plan of these refuses a budget below the smallest plan
// before the measuring pass, which on a large model takes hours.
std::vector<PlannedLinear> shape_candidates(const ModelSpec& spec,
                                            const std::vector<QuantSetting>& candidates) {
  std::vector<PlannedLinear> out;
  for (const LayerSpec& ls : spec.layers)
    for (const Group& g : groups())
      for (const Member& m : g.members) {
        const LinearSpec& s = ls.*m.spec;
        if (s.name.empty()) continue;
        PlannedLinear p;
        p.name = s.name;
        p.N = s.N;
        p.K = s.K;
        for (const QuantSetting& c : candidates) {
          if ((s.K * c.bits) % 32 != 0 || (s.N * c.bits) % 32 != 0) continue;  // cannot pack
          p.measured.emplace_back(
              c, PlanCandidate{c.bits, c.group_size, gptq_linear_bytes(s.N, s.K, c.bits, c.group_size), 0.0});
        }
        if (p.measured.empty())
          throw Error(fmt::format("{}: [{}, {}] cannot be packed at any of the candidates' bit "
                                  "widths (in and out features times bits must be multiples of "
                                  "32)", s.name, s.N, s.K));
        out.push_back(std::move(p));
      }
  return out;
}

// Bytes of the tensors written as they are (embeddings, norms, lm_head, biases: FP16, or I32
// as read), i.e. everything but the quantized linears' weights.
uint64_t fixed_bytes(const ModelSpec& spec, const std::vector<PlannedLinear>& linears) {
  std::set<std::string> quantized;
  for (const PlannedLinear& p : linears) quantized.insert(p.name + ".weight");
  uint64_t total = 0;
  for (const std::string& name : spec.files.names()) {
    if (quantized.count(name)) continue;
    const TensorInfo& t = spec.files.get(name);
    total += (uint64_t)t.numel() * (t.dtype == DType::I32 ? 4 : 2);
  }
  return total;
}

// The plan: q/k/v and gate/up each one choice (vLLM fuses them and needs one format for the
// fused layer; sharing one input, they also share one Hessian), every other linear its own.
MixedPlanReport make_plan(const ModelSpec& spec, const QuantizeOptions& o,
                          std::vector<PlannedLinear> linears) {
  const std::vector<QuantSetting> candidates =
      o.candidates.empty() ? default_candidates() : o.candidates;
  MixedPlanReport plan;
  for (const PlannedLinear& p : linears) plan.weights += (uint64_t)(p.N * p.K);
  plan.fixed_bytes = fixed_bytes(spec, linears);

  // Units of choice: runs of consecutive linears of one layer's group (measure order).
  std::vector<std::vector<size_t>> units;
  {
    std::map<std::string, std::pair<int, size_t>> where;  // name -> (layer, group)
    for (size_t l = 0; l < spec.layers.size(); ++l)
      for (size_t g = 0; g < groups().size(); ++g)
        for (const Member& m : groups()[g].members)
          if (!(spec.layers[l].*m.spec).name.empty())
            where[(spec.layers[l].*m.spec).name] = {(int)l, g};
    for (size_t i = 0; i < linears.size(); ++i) {
      if (i > 0 && where.at(linears[i].name) == where.at(linears[i - 1].name))
        units.back().push_back(i);
      else
        units.push_back({i});
    }
  }
  std::vector<PlanLinear> plan_units;
  std::vector<std::vector<QuantSetting>> unit_settings;
  for (const std::vector<size_t>& u : units) {
    PlanLinear pl;
    for (size_t i : u) pl.name += (pl.name.empty() ? "" : "+") + linears[i].name;
    std::vector<QuantSetting> settings;
    for (const QuantSetting& c : candidates) {
      PlanCandidate pc{c.bits, c.group_size, 0, 0.0};
      bool all = true;
      for (size_t i : u) {
        auto it = std::find_if(linears[i].measured.begin(), linears[i].measured.end(),
                               [&](const auto& m) { return m.first == c; });
        if (it == linears[i].measured.end()) {
          all = false;
          break;
        }
        pc.bytes += it->second.bytes;
        pc.error += it->second.error;
      }
      if (!all) continue;
      pl.candidates.push_back(pc);
      settings.push_back(c);
    }
    if (pl.candidates.empty())
      throw Error(fmt::format("{}: no candidate packs all of these linears (they share one "
                              "format)", pl.name));
    plan_units.push_back(std::move(pl));
    unit_settings.push_back(std::move(settings));
  }

  uint64_t smallest = 0;
  for (const PlanLinear& u : plan_units) {
    uint64_t lo = UINT64_MAX;
    for (const PlanCandidate& c : u.candidates) lo = std::min(lo, c.bytes);
    smallest += lo;
  }
  if (o.bits_avg > 0) {
    // Converted within uint64_t's range (a double past it converts to undefined values).
    plan.budget = to_bytes(std::floor(o.bits_avg * (double)plan.weights / 8.0));
    if (plan.budget < smallest)
      throw Error(fmt::format("--bits-avg {} is below the smallest plan: {:.3f} bits per weight "
                              "(every linear at its smallest candidate)",
                              o.bits_avg, 8.0 * (double)smallest / (double)plan.weights));
  } else {
    const double total = std::floor(o.target_size_gb * 1e9);
    if (total < (double)(plan.fixed_bytes + smallest))
      throw Error(fmt::format("--target-size {} GB is below the smallest plan: {:.6f} GB ({} "
                              "bytes unquantized, {} for the linears at their smallest "
                              "candidates)",
                              o.target_size_gb, (double)(plan.fixed_bytes + smallest) / 1e9,
                              plan.fixed_bytes, smallest));
    plan.budget = to_bytes(total) - plan.fixed_bytes;
  }
  const MixedPlan mp = plan_mixed_precision(plan_units, plan.budget);

  std::map<QuantSetting, int> count;
  for (size_t u = 0; u < units.size(); ++u) {
    const QuantSetting chosen = unit_settings[u][mp.choice[u]];
    for (size_t i : units[u]) {
      PlannedLinear& p = linears[i];
      p.setting = chosen;
      for (const auto& [c, pc] : p.measured)
        if (c == chosen) {
          p.bytes = pc.bytes;
          p.loss = pc.error;
        }
      plan.bytes += p.bytes;
      plan.loss += p.loss;
      ++count[chosen];
    }
  }
  // The base format: the most common choice (ties: the earlier candidate), so that the rules
  // name only the groups planned otherwise.
  int most = -1;
  for (const QuantSetting& c : candidates)
    if (count[c] > most) {
      most = count[c];
      plan.base = c;
    }
  for (size_t u = 0; u < units.size(); ++u) {
    const QuantSetting chosen = linears[units[u][0]].setting;
    if (chosen == plan.base) continue;
    std::vector<std::string> names;
    for (size_t i : units[u]) names.push_back(linears[i].name);
    plan.rules.emplace_back(rule_key(names), chosen);
  }
  plan.linears = std::move(linears);
  return plan;
}

std::string setting_name(const QuantSetting& q) {
  return fmt::format("{}g{}", q.bits, q.group_size);
}

ojson plan_json(const MixedPlanReport& plan, const QuantizeOptions& o) {
  ojson j = {{"budget_bytes", plan.budget},
             {"bytes", plan.bytes},
             {"unquantized_bytes", plan.fixed_bytes},
             {"weights", plan.weights},
             {"bits_per_weight", plan.bits_per_weight()},
             {"estimated_loss", plan.loss},
             {"loss", o.loss},
             {"measure_seconds", plan.measure_seconds}};
  if (o.bits_avg > 0) j["bits_avg"] = o.bits_avg;
  if (o.target_size_gb > 0) j["target_size_gb"] = o.target_size_gb;
  j["linears"] = ojson::array();
  for (const PlannedLinear& p : plan.linears) {
    ojson c = ojson::object();
    for (const auto& [q, pc] : p.measured)
      c[setting_name(q)] = {{"bytes", pc.bytes}, {"estimated_loss", pc.error}};
    j["linears"].push_back({{"name", p.name},
                            {"bits", p.setting.bits},
                            {"group_size", p.setting.group_size},
                            {"bytes", p.bytes},
                            {"estimated_loss", p.loss},
                            {"candidates", std::move(c)}});
  }
  return j;
}

}  // namespace

std::vector<std::vector<int>> calibration_windows(const std::vector<int>& ids, int nsamples,
                                                  int seqlen, uint64_t seed,
                                                  const std::string& where) {
  if ((int64_t)ids.size() < (int64_t)seqlen + 1)
    throw Error(fmt::format("{}: {} tokens are too few for calibration windows of {} tokens "
                            "(--seqlen); it needs at least {}",
                            where, ids.size(), seqlen, (int64_t)seqlen + 1));
  std::mt19937_64 rng(seed);
  const uint64_t starts = ids.size() - seqlen;  // start in [0, size - seqlen - 1]
  std::vector<std::vector<int>> out(nsamples);
  for (auto& w : out) {
    const uint64_t s = rng() % starts;  // modulo bias is below 2^-40 for any real text
    w.assign(ids.begin() + s, ids.begin() + s + seqlen);
  }
  return out;
}

MixedPlanReport plan_from_measurements(const ModelSpec& spec, const QuantizeOptions& o,
                                       std::vector<PlannedLinear> measured) {
  return make_plan(spec, o, std::move(measured));
}

namespace {

// The layer loop and the checkpoint, written into `dir` (the staged output directory).
QuantizeReport quantize_into(const ModelSpec& spec, const QuantizeOptions& o,
                             const std::vector<std::vector<int>>& windows, int64_t calib_tokens,
                             const std::optional<MixedPlanReport>& plan, const fs::path& dir,
                             Clock::time_point t_start) {
  const ModelConfig& cfg = spec.config;
  const int zero_offset = o.gptq.sym ? 1 : 0;  // asymmetric zeros may be 0: gptq_v2
  Scratch scratch(dir / ".kestrel-quantize-scratch");
  PackedParts parts(scratch, zero_offset);

  QuantizeReport report;
  report.device = o.device;
  report.calib_tokens = calib_tokens;
  report.plan = plan;
  std::map<std::string, QuantSetting> planned;
  if (plan)
    for (const PlannedLinear& p : plan->linears) planned[p.name] = p.setting;
  const OptionsFor gptq_for = [&](const LinearSpec& s) {
    GptqOptions g = o.gptq;
    if (plan) {
      const QuantSetting& q = planned.at(s.name);
      g.bits = q.bits;
      g.group_size = q.group_size;
    }
    return g;
  };
  const bool tty = isatty(fileno(stderr)) != 0;
  Progress bar(plan ? fmt::format("{} mixed {:.2f} bits ({})", o.method,
                                  plan->bits_per_weight(), o.device)
                    : fmt::format("{} {}-bit ({})", o.method, o.gptq.bits, o.device),
               cfg.n_layers, "layers", o.progress);
  const LayerDone done = [&](int l, const std::vector<LinearReport>& lines, const LayerTimes& t) {
    if (o.progress)
      std::fprintf(stderr, "%s%s\n", tty ? "\r\033[K" : "",
                   layer_line(l, cfg.n_layers, lines, t).c_str());
    report.linears.insert(report.linears.end(), lines.begin(), lines.end());
    report.forward_seconds += t.forward;
    report.hessian_seconds += t.hessian;
    report.quantize_seconds += t.quantize;
    bar.update(l + 1);
  };
  if (o.device == "cuda") {
    // One linear is packed and saved on a second thread while the GPU goes on (its result
    // or error is collected before the next one starts, and at the end).
    std::future<void> pending;
    const SaveLinear save = [&](const LinearSpec& s, QuantizedLinear q) {
      if (pending.valid()) pending.get();
      pending = std::async(std::launch::async,
                           [&parts, &s, q = std::move(q)] { parts.add(s, q); });
    };
    quantize_layers_cuda(spec, o, windows, gptq_for, save, done);
    if (pending.valid()) pending.get();
  } else {
    quantize_layers_cpu(spec, o, windows, parts, gptq_for, done);
  }
  bar.finish();

  const auto t_write = Clock::now();
  write_weights(spec, parts.shapes(), scratch, dir);
  write_config(o, plan ? &*plan : nullptr, dir);
  copy_tokenizer_files(o, dir);
  report.write_seconds = seconds_since(t_write);
  report.seconds = seconds_since(t_start);

  ojson j = {{"method", o.method},
             {"quantization_config", quant_json(o, plan ? &*plan : nullptr)},
             {"calibration", {{"file", o.calib_file},
                              {"tokens", report.calib_tokens},
                              {"nsamples", o.nsamples},
                              {"seqlen", o.seqlen},
                              {"seed", o.seed}}},
             {"device", o.device},
             {"seconds", report.seconds},
             {"seconds_by_step", {{"calibration_forward", report.forward_seconds},
                                  {"hessians", report.hessian_seconds},
                                  {"quantize", report.quantize_seconds},
                                  {"write", report.write_seconds}}}};
  j["linears"] = ojson::array();
  for (const LinearReport& r : report.linears) {
    ojson l = {{"name", r.name},
               {"out_features", r.N},
               {"in_features", r.K},
               {"relative_error", r.rel_error},
               {"seconds", r.seconds}};
    if (plan) {
      l["bits"] = planned.at(r.name).bits;
      l["group_size"] = planned.at(r.name).group_size;
    }
    j["linears"].push_back(std::move(l));
  }
  if (plan) j["mixed_precision"] = plan_json(*plan, o);
  write_file(dir / "quantize_report.json", j.dump(2) + "\n");
  return report;  // the scratch folder goes with `scratch`, before the directory is renamed
}

}  // namespace

QuantizeReport quantize_model(const QuantizeOptions& opts) {
  QuantizeOptions o = opts;
  const auto t_start = Clock::now();
  check_options(o);
  const ModelSpec spec = load_model_spec(o.model_dir);
  check_model(spec, o);
  // --loss kl's measure runs the whole model on the CPU (KlProbe): auto keeps the run there.
  if (o.device == "auto" && o.mixed() && o.loss == "kl") o.device = "cpu";
  if (o.device == "auto") {  // the GPU where it is usable and its loop runs the family
    const std::string why = cuda_status().usable ? cuda_quantize_unsupported(spec) : "no GPU";
    o.device = why.empty() ? "cuda" : "cpu";
    if (!why.empty() && why != "no GPU" && o.progress)
      std::fprintf(stderr, "kestrel-quantize: note: on the CPU: %s\n", why.c_str());
  }
  const std::unique_ptr<Tokenizer> tok = Tokenizer::load(o.model_dir);
  const std::vector<int> ids = tok->encode(read_file(o.calib_file, "calibration text"));
  const auto windows = calibration_windows(ids, o.nsamples, o.seqlen, o.seed, o.calib_file);

  std::optional<MixedPlanReport> plan;
  if (o.mixed()) {
    const std::vector<QuantSetting> cands =
        o.candidates.empty() ? default_candidates() : o.candidates;
    make_plan(spec, o, shape_candidates(spec, cands));  // the budget's refusals, at once
    const auto t_measure = Clock::now();
    plan = make_plan(spec, o, o.device == "cuda" ? measure_candidates_cuda(spec, o, cands, windows)
                                                 : measure_candidates_cpu(spec, o, cands, windows));
    plan->measure_seconds = seconds_since(t_measure);
    if (o.dry_run) {
      QuantizeReport r;
      r.device = o.device;
      r.calib_tokens = (int64_t)ids.size();
      r.plan = std::move(plan);
      r.seconds = seconds_since(t_start);
      return r;
    }
  }

  StagedDir out(o.out_dir, o.force);
  try {
    const QuantizeReport report =
        quantize_into(spec, o, windows, (int64_t)ids.size(), plan, out.path(), t_start);
    out.commit();
    return report;
  } catch (const DeviceError& e) {
    throw DeviceError(fmt::format("{}; nothing written to {}", e.what(), o.out_dir));
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}; nothing written to {}", e.what(), o.out_dir));
  }
}

std::vector<QuantSetting> default_candidates() {
  std::vector<QuantSetting> c;
  for (int bits : {2, 3, 4, 8})
    for (int group : {32, 64, 128}) c.push_back({bits, group});
  return c;
}

std::vector<QuantSetting> parse_candidates(const std::string& text) {
  std::vector<QuantSetting> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    QuantSetting q;
    const size_t g = item.find('g');
    size_t used_b = 0, used_g = 0;
    bool ok = g != std::string::npos && g > 0 && g + 1 < item.size();
    if (ok) {
      try {
        q.bits = std::stoi(item.substr(0, g), &used_b);
        q.group_size = std::stoi(item.substr(g + 1), &used_g);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok || used_b != g || used_g != item.size() - g - 1)
      throw Error(fmt::format("--candidates: \"{}\" is not BITSgGROUP (e.g. 4g128, 8g-1 for one "
                              "group per row)", item));
    if (q.bits != 2 && q.bits != 3 && q.bits != 4 && q.bits != 8)
      throw Error(fmt::format("--candidates: \"{}\": bits must be 2, 3, 4 or 8", item));
    if (q.group_size == 0 || q.group_size < -1)
      throw Error(fmt::format("--candidates: \"{}\": the group size must be positive or -1", item));
    if (std::find(out.begin(), out.end(), q) != out.end())
      throw Error(fmt::format("--candidates: \"{}\" is listed twice", item));
    out.push_back(q);
    at = comma + 1;
  }
  return out;
}

std::string format_plan(const MixedPlanReport& plan) {
  std::string s = fmt::format("{:<44} {:>4} {:>5} {:>10} {:>12}\n", "linear", "bits", "group",
                              "bytes", "est. loss");
  std::map<std::string, std::pair<int, uint64_t>> mix;  // setting -> (linears, weights)
  for (const PlannedLinear& p : plan.linears) {
    s += fmt::format("{:<44} {:>4} {:>5} {:>10} {:>12.4e}\n", p.name, p.setting.bits,
                     p.setting.group_size, p.bytes, p.loss);
    auto& m = mix[fmt::format("{}-bit g{}", p.setting.bits, p.setting.group_size)];
    ++m.first;
    m.second += (uint64_t)(p.N * p.K);
  }
  s += "mix:";
  for (const auto& [name, m] : mix)
    s += fmt::format(" {} {} linears ({:.1f}% of weights);", name, m.first,
                     100.0 * (double)m.second / (double)plan.weights);
  s.back() = '\n';
  s += fmt::format("total: {} bytes of quantized linears (budget {}), {:.4f} bits per weight over "
                   "{} weights; {} bytes with the unquantized tensors ({:.6f} GB); estimated "
                   "loss {:.6e}\n",
                   plan.bytes, plan.budget, plan.bits_per_weight(), plan.weights,
                   plan.bytes + plan.fixed_bytes, (double)(plan.bytes + plan.fixed_bytes) / 1e9,
                   plan.loss);
  return s;
}

}  // namespace kestrel::quant
