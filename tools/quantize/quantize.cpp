// The model-level quantizer: calibration windows, the layer-by-layer GPTQ loop over the CPU
// engine's layer forward (the GPU loop is quantize_cuda.cpp), and the checkpoint writer.
#include "tools/quantize/quantize.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <set>
#include <sstream>

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
#include "tools/quantize/pack.h"
#include "tools/quantize/quantize_loops.h"

namespace kestrel::quant {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

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

ojson quant_json(const QuantizeOptions& o) {
  return ojson{{"bits", o.gptq.bits},
               {"group_size", o.gptq.group_size},
               {"damp_percent", std::stod(fmt::format("{:g}", o.gptq.damp))},  // 0.01, not 0.0099999998
               {"desc_act", o.method == "gptq" && o.gptq.act_order},
               {"static_groups", o.gptq.static_groups},
               {"sym", o.gptq.sym},
               {"true_sequential", true},
               {"quant_method", "gptq"},
               {"checkpoint_format", o.gptq.sym ? "gptq" : "gptq_v2"},
               {"model_file_base_name", "model"}};
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
  const int bits = o.gptq.bits;
  for (const LayerSpec& ls : spec.layers)
    for (const Group& g : groups())
      for (const Member& m : g.members) {
        const LinearSpec& s = ls.*m.spec;
        if (s.name.empty()) continue;  // not in this family (OPT has no gate)
        if (s.quantized)
          throw Error(fmt::format("{}: {} is already quantized", spec.dir, s.name));
        if ((s.K * bits) % 32 != 0 || (s.N * bits) % 32 != 0)
          throw Error(fmt::format("{}: [{}, {}] cannot be packed at {} bits (in and out features "
                                  "times bits must be multiples of 32)",
                                  s.name, s.N, s.K, bits));
      }
}

// config.json of the output: the input's, with the quantization config and fp16 dtype.
void write_config(const QuantizeOptions& o, const fs::path& out_dir) {
  const fs::path in = fs::path(o.model_dir) / "config.json";
  ojson c;
  try {
    c = ojson::parse(read_file(in.string(), "model config"));
  } catch (const ojson::exception& e) {
    throw Error(fmt::format("{}: {}", in.string(), e.what()));
  }
  if (c.contains("dtype")) c["dtype"] = "float16";
  if (c.contains("torch_dtype") || !c.contains("dtype")) c["torch_dtype"] = "float16";
  c["quantization_config"] = quant_json(o);
  write_file(out_dir / "config.json", c.dump(2) + "\n");
  write_file(out_dir / "quantize_config.json", quant_json(o).dump(2) + "\n");
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

// The layer loop on the CPU: a one-layer DecoderCpu engine takes each decoder layer in turn.
void quantize_layers_cpu(const ModelSpec& spec, const QuantizeOptions& o,
                         const std::vector<std::vector<int>>& windows, PackedParts& parts,
                         const LayerDone& done) {
  const ModelConfig& cfg = spec.config;
  ModelSpec one = spec;
  one.config.n_layers = 1;
  one.layers = {spec.layers[0]};
  DecoderCpu engine(one);
  const std::unique_ptr<DecoderCpuSession> seq = engine.new_cpu_session(o.seqlen);

  const size_t win = (size_t)o.seqlen * cfg.hidden;
  std::vector<float> X(win * o.nsamples);  // [nsamples, seqlen, hidden] residual streams
  for (int s = 0; s < o.nsamples; ++s) engine.embed(windows[s].data(), o.seqlen, 0, &X[s * win]);
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
        const QuantizedLinear q =
            o.method == "gptq" ? gptq_quantize(lin.w.data(), s.N, s.K, H.data(), o.gptq, s.name.c_str())
                               : rtn_quantize(lin.w.data(), s.N, s.K, o.gptq);
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

namespace {

// The layer loop and the checkpoint, written into `dir` (the staged output directory).
QuantizeReport quantize_into(const ModelSpec& spec, const QuantizeOptions& o,
                             const std::vector<std::vector<int>>& windows, int64_t calib_tokens,
                             const fs::path& dir, Clock::time_point t_start) {
  const ModelConfig& cfg = spec.config;
  const int zero_offset = o.gptq.sym ? 1 : 0;  // asymmetric zeros may be 0: gptq_v2
  Scratch scratch(dir / ".kestrel-quantize-scratch");
  PackedParts parts(scratch, zero_offset);

  QuantizeReport report;
  report.device = o.device;
  report.calib_tokens = calib_tokens;
  const bool tty = isatty(fileno(stderr)) != 0;
  Progress bar(fmt::format("{} {}-bit ({})", o.method, o.gptq.bits, o.device), cfg.n_layers,
               "layers", o.progress);
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
    quantize_layers_cuda(spec, o, windows, save, done);
    if (pending.valid()) pending.get();
  } else {
    quantize_layers_cpu(spec, o, windows, parts, done);
  }
  bar.finish();

  const auto t_write = Clock::now();
  write_weights(spec, parts.shapes(), scratch, dir);
  write_config(o, dir);
  copy_tokenizer_files(o, dir);
  report.write_seconds = seconds_since(t_write);
  report.seconds = seconds_since(t_start);

  ojson j = {{"method", o.method},
             {"quantization_config", quant_json(o)},
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
  for (const LinearReport& r : report.linears)
    j["linears"].push_back({{"name", r.name},
                            {"out_features", r.N},
                            {"in_features", r.K},
                            {"relative_error", r.rel_error},
                            {"seconds", r.seconds}});
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
  if (o.device == "auto") {  // the GPU where it is usable and its loop runs the family
    const std::string why = cuda_status().usable ? cuda_quantize_unsupported(spec) : "no GPU";
    o.device = why.empty() ? "cuda" : "cpu";
    if (!why.empty() && why != "no GPU" && o.progress)
      std::fprintf(stderr, "kestrel-quantize: note: on the CPU: %s\n", why.c_str());
  }
  const std::unique_ptr<Tokenizer> tok = Tokenizer::load(o.model_dir);
  const std::vector<int> ids = tok->encode(read_file(o.calib_file, "calibration text"));
  const auto windows = calibration_windows(ids, o.nsamples, o.seqlen, o.seed, o.calib_file);

  StagedDir out(o.out_dir, o.force);
  try {
    const QuantizeReport report =
        quantize_into(spec, o, windows, (int64_t)ids.size(), out.path(), t_start);
    out.commit();
    return report;
  } catch (const DeviceError& e) {
    throw DeviceError(fmt::format("{}; nothing written to {}", e.what(), o.out_dir));
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}; nothing written to {}", e.what(), o.out_dir));
  }
}

}  // namespace kestrel::quant
