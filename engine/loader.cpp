#include "engine/loader.h"

#include <cblas.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "base/error.h"
#include "engine/cpu_threads.h"
#include "kernels/matmul/matmul.h"
#include "models/io/config.h"
#include "models/io/generation_config.h"
#include "models/io/safetensors.h"

namespace kestrel {

namespace fs = std::filesystem;

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
}

double host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

namespace {

// The context the session gets, checked against the memory of its device: an explicit -c
// whose KV cache cannot fit is refused with the bytes it needs; the CPU engine's default (the
// model's max_position_embeddings) is shortened to what fits in half the memory left, with a
// note, as the GPU engine's is (the DecoderCudaSession constructor, models/gpu/session.cpp,
// which also makes the final check on the GPU).
int checked_context(const LoadedModel& m, const ModelLoadOptions& o) {
  const ModelConfig& c = m.spec->config;
  const int ctx = o.context > 0 ? o.context : c.max_pos;
  const bool cpu = m.device == "cpu";
  // K and V per layer and position in the cache types: the CPU engine keeps f16 as fp32, the
  // GPU engine as fp16; q8_0 and fp8 take about half of that fp16.
  const double per_pos =
      (double)cache_bytes_per_position(cpu ? Device::Cpu : Device::Cuda, c, o.cache);
  const double weights = (double)m.spec->files.total_bytes();
  double room = 0;  // bytes the cache may take
  std::string memory;
  if (cpu) {
    const double avail = host_available_bytes();
    if (avail == 0) return ctx;  // unknown: the allocation will tell
    room = avail - weights - 256.0 * 1048576;  // the weights, activations and the program
    memory = fmt::format("host memory and {} is available", bytes_text(avail));
  } else {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return ctx;
    // Only what cannot fit even beside no weights: the engine sizes the rest exactly.
    room = (double)free_b;
    memory = fmt::format("GPU memory and {} is free", bytes_text((double)free_b));
  }
  if (!cpu && o.context == 0) return ctx;  // the GPU engine shortens its own
  const ContextFit f = fit_context(o.context, c.max_pos, per_pos, room, cpu ? kCpuDefaultContextShare : 1.0);
  if (f.context == ctx) return ctx;
  const double need = per_pos * ctx;
  if (f.context == 0)
    throw Error(fmt::format("{}: the KV cache would need {} of {}; use -c N with N up to {}{}",
                            o.context > 0 ? fmt::format("-c {}", ctx)
                                          : fmt::format("the model's context of {}", ctx),
                            bytes_text(need), memory, f.fits,
                            f.fits > c.max_pos
                                ? fmt::format(" (the model was trained for {})", c.max_pos)
                                : ""));
  note(o.quiet, fmt::format("note: host memory is short: context reduced from {} to {} tokens "
                            "(the KV cache of {} would need {}; a default context takes at most "
                            "half of the {} left beside the weights; -c sets it)",
                            ctx, f.context, ctx, bytes_text(need), bytes_text(std::max(room, 0.0))));
  return f.context;
}

}  // namespace

int default_cpu_threads() {
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env && *env) return 0;  // set_linear_threads takes OpenMP's
  // 100 ms: /proc/stat counts in 10 ms ticks, so that a core's share is read to about a tenth.
  return default_cpu_threads(measure_cpu_load(100));
}

ContextFit fit_context(int asked, int max_pos, double per_pos, double room, double default_share) {
  ContextFit f;
  f.fits = room > 0 ? (int64_t)(room / per_pos) : 0;
  const int ctx = asked > 0 ? asked : max_pos;
  if (asked > 0) {  // -c: whole, or not at all
    f.context = ctx <= f.fits ? ctx : 0;
    return f;
  }
  const int64_t fits_default = room > 0 ? (int64_t)(room * default_share / per_pos) : 0;
  if (ctx <= fits_default) {
    f.context = ctx;
  } else if (fits_default >= 16) {
    // A round number under what fits.
    f.context = (int)(fits_default >= 512 ? fits_default / 256 * 256 : fits_default);
  }
  return f;
}

void note(bool quiet, const std::string& msg) {
  if (!quiet) std::cerr << msg << "\n";
}

void set_cpu_threads(int threads) {
  // OpenBLAS's pthreads busy-wait between calls as OpenMP's do: its team is the linears' team.
  if (threads > 0) openblas_set_num_threads(threads);
  set_linear_threads(threads);
}

int cpu_threads() { return linear_threads(); }

LoadedModel open_model(const ModelLoadOptions& o) {
  if (!fs::exists(o.dir)) throw Error(o.dir + ": no such model directory");
  if (!fs::is_directory(o.dir)) throw Error(o.dir + ": not a directory (-m takes a model directory)");
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel m;
  m.device = device_key(resolve_device(o.device));
  // A program's load sets its threads (0: a default fitted to the machine's idle cores, for the
  // CPU engine); a library's leaves the calling thread's as they are unless asked, so that
  // loading a model changes nothing the caller did not ask for.
  if (o.threads > 0) set_cpu_threads(o.threads);
  else if (o.open_session) set_cpu_threads(m.device == "cpu" ? default_cpu_threads() : 0);
  if (o.threads > 0 && m.device == "cuda")
    note(o.quiet, "note: -t sets the CPU engine's threads; this model runs on the GPU");

  m.tok = Tokenizer::load(o.dir);
  m.spec = std::make_unique<ModelSpec>(load_model_spec(o.dir));
  for (const std::string& w : m.spec->warnings) note(o.quiet, "warning: " + w);
  const ModelConfig& c = m.spec->config;
  m.tok->check_fits(c.vocab, o.dir);
  // Cache types the device or the model's heads cannot take: refused before the weights load.
  const std::string cache = cache_types_unsupported(m.device == "cuda" ? Device::Cuda : Device::Cpu, c, o.cache);
  if (!cache.empty()) throw Error(cache);
  if (o.context > c.max_pos)
    note(o.quiet, "warning: context " + std::to_string(o.context) +
                      " is longer than the model was trained for (" + std::to_string(c.max_pos) +
                      ")");
  // The program's session is checked against the device's memory here, before the weights
  // load; a library's sessions are opened later, each by new_session, which checks its own.
  if (o.open_session) m.context = checked_context(m, o);
  m.load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

std::string cache_types_text(KvCacheTypes kv, size_t bytes) {
  if (!kv.quantized()) return "";
  const std::string types = kv.k == kv.v ? std::string(kv_type_name(kv.k))
                                         : fmt::format("{} K, {} V", kv_type_name(kv.k), kv_type_name(kv.v));
  return bytes > 0 ? fmt::format(", {} KV cache of {}", types, bytes_text((double)bytes))
                   : fmt::format(", {} KV cache", types);
}

int context_length(const LoadedModel& m, const ModelLoadOptions& o) {
  if (m.context > 0) return m.context;
  return o.context > 0 ? o.context : m.spec->config.max_pos;
}

void load_weights(LoadedModel& m, const ModelLoadOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadOptions lo;
  lo.device = m.device == "cuda" ? Device::Cuda : Device::Cpu;
  lo.quiet = o.quiet;
  lo.tuning = o.tuning;
  lo.cache = o.cache;
  m.model = kestrel::load_model(*m.spec, lo);
  if (o.open_session) m.session = m.model->new_session(context_length(m, o), o.quiet);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  m.load_ms += ms;
  if (m.device != "cuda" && o.open_session)
    note(o.quiet, fmt::format("loaded {:.1f} MiB of weights from {} on {} in {:.0f} ms, context {}{}",
                              m.spec->files.total_bytes() / 1048576.0, o.dir,
                              m.model->device_name(), ms,
                              m.session ? m.session->context_length() : context_length(m, o),
                              cache_types_text(o.cache, m.session ? m.session->cache_bytes() : 0)));
}

LoadedModel load_model(const ModelLoadOptions& o) {
  LoadedModel m = open_model(o);
  load_weights(m, o);
  return m;
}

SamplingParams default_sampling(const std::string& dir) {
  SamplingParams p;
  const GenerationDefaults g = load_generation_defaults(dir);
  if (g.temperature) p.temperature = *g.temperature;
  if (g.top_k) p.top_k = *g.top_k;
  if (g.top_p) p.top_p = *g.top_p;
  if (g.min_p) p.min_p = *g.min_p;
  if (g.repetition_penalty) p.repeat_penalty = *g.repetition_penalty;
  if (g.do_sample && !*g.do_sample) p.temperature = 0.0f;
  return p;
}

std::string format_text(const ModelConfig& c) {
  if (!c.quant) return dtype_name(c.dtype);
  const QuantConfig& q = *c.quant;
  return fmt::format("GPTQ {}-bit {}{}{}", q.bits,
                     q.group_size > 0 ? fmt::format("g{}", q.group_size) : std::string("per-channel"),
                     q.desc_act ? " act-order" : "", q.sym ? "" : " asym");
}

namespace {

std::string quant_text(const LinearQuant& q) {
  return fmt::format("GPTQ {}-bit {}{}{}", q.bits,
                     q.group_size > 0 ? fmt::format("g{}", q.group_size) : std::string("per-channel"),
                     q.desc_act ? " act-order" : "", q.sym ? "" : " asym");
}

}  // namespace

std::vector<LinearFormatGroup> linear_format_groups(const ModelConfig& c, const std::string& where) {
  std::vector<LinearFormatGroup> out;
  if (!c.quant || c.quant->dynamic.empty()) return out;
  const std::vector<std::string> names = linear_modules(c);
  const std::vector<std::optional<LinearQuant>> formats = linear_formats(c, where);
  const size_t per_layer = (names.size() - 1) / std::max(c.n_layers, 1);  // lm_head last
  // One layer's groups: its linears by format, formats in order of first appearance.
  auto layer_groups = [&](int l) {
    std::vector<LinearFormatGroup> g;
    for (size_t i = l * per_layer; i < (l + 1) * per_layer; ++i) {
      const std::string shortname = names[i].substr(names[i].rfind('.') + 1);
      auto it = std::find_if(g.begin(), g.end(), [&](const auto& x) { return x.quant == formats[i]; });
      if (it == g.end()) {
        LinearFormatGroup n;
        n.first_layer = n.last_layer = l;
        n.quant = formats[i];
        n.format = formats[i] ? quant_text(*formats[i])
                              : fmt::format("{} (unquantized)", dtype_name(c.dtype));
        g.push_back(n);
        it = g.end() - 1;
      }
      it->modules.push_back(shortname);
    }
    return g;
  };
  auto same = [](const std::vector<LinearFormatGroup>& a, const std::vector<LinearFormatGroup>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].quant != b[i].quant || a[i].modules != b[i].modules) return false;
    return true;
  };
  std::vector<LinearFormatGroup> run;  // the groups of the current run of alike layers
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<LinearFormatGroup> g = layer_groups(l);
    if (!run.empty() && same(run, g)) {
      for (LinearFormatGroup& x : run) x.last_layer = l;
      continue;
    }
    out.insert(out.end(), run.begin(), run.end());
    run = std::move(g);
  }
  out.insert(out.end(), run.begin(), run.end());
  return out;
}

int64_t count_params(const ModelConfig& c) {
  const int64_t mlp = (c.mlp == MlpKind::GatedSiLU ? 3LL : 2LL) * c.hidden * c.intermediate;
  const int64_t per_layer = (int64_t)c.hidden * (c.q_dim() + 2 * c.kv_dim()) +
                            (int64_t)c.q_dim() * c.hidden + mlp + 2LL * c.hidden;
  int64_t p = per_layer * c.n_layers + (int64_t)c.vocab * c.hidden + c.hidden;
  if (!c.tie_embeddings) p += (int64_t)c.vocab * c.hidden;
  if (c.positions == PositionKind::Learned)
    p += (int64_t)(c.max_pos + c.position_offset) * c.hidden;
  return p;
}

ModelInfo read_model_info(const std::string& dir) {
  ModelInfo info;
  info.config = load_model_config(dir);
  const ModelFiles files =
      ModelFiles::open(dir, info.config.quant ? info.config.quant->model_file_base_name : "");
  info.weight_bytes = files.total_bytes();
  return info;
}

}  // namespace kestrel
