#include "tools/kestrel/common.h"

#include <cblas.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>

#include "base/device.h"
#include "base/error.h"
#include "base/files.h"
#include "kernels/matmul/matmul.h"
#include "models/io/generation_config.h"

namespace kestrel::cli {

namespace fs = std::filesystem;

namespace {

// A CLI11 check that the value is a number and ok(value); otherwise "<what>, got <value>".
CLI::Validator number_check(std::function<bool(double)> ok, const std::string& what,
                            const std::string& desc, bool integer = false) {
  return CLI::Validator(
      [ok, what, integer](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size()) return "not a number: '" + in + "'";
        if (integer && v != std::floor(v)) return "must be a whole number, got " + in;
        return ok(v) ? std::string() : fmt::format("{}, got {}", what, in);
      },
      desc);
}

// Free host memory the kernel would give without swapping (MemAvailable), 0 when unknown.
double host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

}  // namespace

std::string unknown_option_message(const std::string& opt) {
  // llama.cpp's options that Kestrel has no use for say why.
  if (opt == "-ngl" || opt == "--n-gpu-layers" || opt == "--gpu-layers")
    return "unknown option " + opt + " (the whole model runs on one device: --device cpu|cuda)";
  if (opt == "-md" || opt == "--model-draft")
    return "unknown option " + opt + " (the draft model is --draft-model DIR, with --spec draft)";
  if (opt == "--draft" || opt == "--draft-n" || opt == "--draft-min")
    return "unknown option " + opt + " (the most tokens drafted per step is --draft-max N)";
  return "unknown option " + opt;
}

CLI::Validator at_least(double lo) {
  return number_check([lo](double v) { return v >= lo; }, fmt::format("must be at least {}", lo),
                      fmt::format("NUMBER >= {}", lo));
}

CLI::Validator above(double lo) {
  return number_check([lo](double v) { return v > lo; }, fmt::format("must be above {}", lo),
                      fmt::format("NUMBER > {}", lo));
}

CLI::Validator between(double lo, double hi) {
  return number_check([lo, hi](double v) { return v >= lo && v <= hi; },
                      fmt::format("must be between {} and {}", lo, hi),
                      fmt::format("NUMBER in [{}, {}]", lo, hi));
}

CLI::Validator whole(int64_t lo, int64_t hi) {
  // Only a lower bound of the user's: the type's upper one is said only when it is passed.
  const bool open = hi == INT32_MAX;
  return CLI::Validator(
      [lo, hi, open](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size()) return "not a number: '" + in + "'";
        if (v != std::floor(v)) return "must be a whole number, got " + in;
        if (open && v < (double)lo) return fmt::format("must be at least {}, got {}", lo, in);
        if (open && v > (double)hi) return fmt::format("must be at most {}, got {}", hi, in);
        if (v < (double)lo || v > (double)hi)
          return fmt::format("must be between {} and {}, got {}", lo, hi, in);
        return "";
      },
      open ? fmt::format("INT >= {}", lo) : fmt::format("INT in [{}, {}]", lo, hi));
}

CLI::Validator token_count() {
  return number_check([](double v) { return v == -1 || (v >= 1 && v <= (1 << 30)); },
                      "must be -1 (up to the context) or between 1 and 1073741824",
                      "-1 or INT >= 1", /*integer=*/true);
}

std::string parse_error_message(const CLI::ParseError& e, const CLI::App& /*app*/) {
  const std::string what = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    // "The following argument(s) was/were not expected: a b": name an option first.
    std::istringstream words(what.substr(what.find(": ") + 2));
    std::string w, first, option;
    while (words >> w) {
      if (first.empty()) first = w;
      if (option.empty() && w.size() > 1 && w[0] == '-') option = w;
    }
    if (!option.empty()) return unknown_option_message(option);
    return "unexpected argument '" + first + "'";
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) && what.ends_with("missing")) {
    // "--prompt: 1 required TEXT missing"
    return what.substr(0, what.find(':')) + " needs a value";
  }
  if (dynamic_cast<const CLI::ExcludesError*>(&e)) {
    // "--prompt excludes --file"
    const size_t sp = what.find(" excludes ");
    if (sp != std::string::npos)
      return what.substr(0, sp) + " and " + what.substr(sp + 10) + " cannot be used together";
  }
  if (dynamic_cast<const CLI::ConversionError*>(&e)) {
    // "Could not convert: --top-k = 1e99"
    const size_t colon = what.find(": "), eq = what.find(" = ");
    if (colon != std::string::npos && eq != std::string::npos && eq > colon)
      return what.substr(colon + 2, eq - colon - 2) + ": not a valid value: '" +
             what.substr(eq + 3) + "'";
  }
  return what;
}

std::string unknown_short_option(const CLI::App& cmd, int argc, char** argv, int first) {
  auto takes_value = [](const CLI::Option* o) { return o && o->get_expected_max() > 0; };
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a.starts_with("--")) {
      if (a.find('=') == std::string::npos && takes_value(cmd.get_option_no_throw(a))) ++i;
      continue;
    }
    if (a.size() < 2 || a[0] != '-' || !std::isalpha((unsigned char)a[1])) continue;
    if (a.size() == 2) {
      if (takes_value(cmd.get_option_no_throw(a))) ++i;
      continue;
    }
    // Three or more letters: a cluster of flags (-qe) is fine, anything else is no option of
    // Kestrel's (a value glued on, -n128, has a digit).
    bool letters = true, flags = true;
    for (size_t k = 1; k < a.size(); ++k) {
      letters = letters && std::isalpha((unsigned char)a[k]);
      const CLI::Option* o = cmd.get_option_no_throw(std::string("-") + a[k]);
      flags = flags && o && !takes_value(o);
    }
    if (letters && !flags) return a;
  }
  return "";
}

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
}

std::string format_text(const ModelConfig& c) {
  if (!c.quant) return dtype_name(c.dtype);
  const QuantConfig& q = *c.quant;
  return fmt::format("GPTQ {}-bit {}{}{}", q.bits,
                     q.group_size > 0 ? "g" + std::to_string(q.group_size) : "per-channel",
                     q.desc_act ? " act-order" : "", q.sym ? "" : " asym");
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

std::string size_text(uint64_t bytes) {
  return bytes < (1ull << 30) ? fmt::format("{:.2f} MiB", bytes / 1048576.0)
                              : fmt::format("{:.2f} GiB", bytes / 1073741824.0);
}

std::string params_text(int64_t n) {
  return n < 1000000000 ? fmt::format("{:.2f} M", n / 1e6) : fmt::format("{:.2f} B", n / 1e9);
}

void add_model_options(CLI::App* cmd, ModelOptions& o) {
  cmd->add_option("-m,--model", o.dir, "model directory (Hugging Face layout)")->required();
  cmd->add_option("--device", o.device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("-c,--ctx-size", o.context,
                  "context length in tokens (0 = the model's max_position_embeddings)")
      ->check(whole(0))
      ->capture_default_str();
  cmd->add_option("-t,--threads", o.threads,
                  "CPU engine: threads (0 = one per core, or OMP_NUM_THREADS)")
      ->check(whole(0, 4096))
      ->capture_default_str();
}

void note(bool quiet, const std::string& msg) {
  if (!quiet) std::cerr << msg << "\n";
}

namespace {

// The context the session gets, checked against the memory of its device: an explicit -c
// whose KV cache cannot fit is refused with the bytes it needs; the CPU engine's default (the
// model's max_position_embeddings) is shortened to what fits, with a note, as the GPU
// engine's is (models/gpu/decoder.cpp, which also makes the final check on the GPU).
int checked_context(const LoadedModel& m, const ModelOptions& o, bool quiet) {
  const ModelConfig& c = m.spec->config;
  const int ctx = o.context > 0 ? o.context : c.max_pos;
  const bool cpu = m.device == "cpu";
  // The CPU engine's cache is fp32, the GPU engine's fp16: K and V per layer and position.
  const double per_pos = 2.0 * c.n_layers * c.kv_dim() * (cpu ? 4 : 2);
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
  const double need = per_pos * ctx;
  if (need <= room || (!cpu && o.context == 0)) return ctx;  // the GPU engine shortens its own
  const int64_t fits = room > 0 ? (int64_t)(room / per_pos) : 0;
  if (o.context > 0 || fits < 16)
    throw Error(fmt::format("{}: the KV cache would need {} of {}; use -c N with N up to {}{}",
                            o.context > 0 ? fmt::format("-c {}", ctx)
                                          : fmt::format("the model's context of {}", ctx),
                            bytes_text(need), memory, fits,
                            fits > c.max_pos
                                ? fmt::format(" (the model was trained for {})", c.max_pos)
                                : ""));
  // A round number under what fits.
  const int ctx_fit = (int)(fits >= 512 ? fits / 256 * 256 : fits);
  note(quiet, fmt::format("note: host memory is short: context reduced from {} to {} tokens "
                          "(the KV cache of {} would need {})",
                          ctx, ctx_fit, ctx, bytes_text(need)));
  return ctx_fit;
}

// -t: the CPU engine's threads, for its one-to-few-row linears (OpenMP) and its batched ones
// (OpenBLAS) alike.
void set_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
  set_linear_threads(threads);
}

}  // namespace

LoadedModel open_model(const ModelOptions& o, bool quiet) {
  if (!fs::exists(o.dir)) throw Error(o.dir + ": no such model directory");
  if (!fs::is_directory(o.dir)) throw Error(o.dir + ": not a directory (-m takes a model directory)");
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel m;
  m.device = device_key(resolve_device(o.device));
  set_threads(o.threads);
  if (o.threads > 0 && m.device == "cuda")
    note(quiet, "note: -t sets the CPU engine's threads; this model runs on the GPU");

  m.tok = Tokenizer::load(o.dir);
  m.spec = std::make_unique<ModelSpec>(load_model_spec(o.dir));
  for (const std::string& w : m.spec->warnings) note(quiet, "warning: " + w);
  const ModelConfig& c = m.spec->config;
  m.tok->check_fits(c.vocab, o.dir);
  if (o.context > c.max_pos)
    note(quiet, "warning: context " + std::to_string(o.context) +
                    " is longer than the model was trained for (" + std::to_string(c.max_pos) + ")");
  m.context = checked_context(m, o, quiet);
  m.load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

int context_length(const LoadedModel& m, const ModelOptions& o) {
  if (m.context > 0) return m.context;
  return o.context > 0 ? o.context : m.spec->config.max_pos;
}

void load_weights(LoadedModel& m, const ModelOptions& o, bool quiet, const DecodeTuning& tuning) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadOptions lo;
  lo.device = m.device == "cuda" ? Device::Cuda : Device::Cpu;
  lo.quiet = quiet;
  lo.tuning = tuning;
  m.model = kestrel::load_model(*m.spec, lo);
  m.session = m.model->new_session(context_length(m, o), quiet);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  m.load_ms += ms;
  if (m.device != "cuda")
    note(quiet, fmt::format("loaded {:.1f} MiB of weights from {} on {} in {:.0f} ms, context {}",
                            m.spec->files.total_bytes() / 1048576.0, o.dir,
                            m.model->device_name(), ms, m.session->context_length()));
}

LoadedModel load_model(const ModelOptions& o, bool quiet) {
  LoadedModel m = open_model(o, quiet);
  load_weights(m, o, quiet);
  return m;
}

void add_sampling_options(CLI::App* cmd, SamplingOptions& s) {
  const SamplingParams d;  // Kestrel's defaults, under generation_config.json's
  cmd->add_option("--temp", s.temperature,
                  fmt::format("temperature (0 = greedy; default: generation_config.json's, else {})",
                              d.temperature))
      ->check(at_least(0));
  cmd->add_option("--top-k", s.top_k,
                  fmt::format("top-k sampling (0 = off; default: generation_config.json's, else {})",
                              d.top_k))
      ->check(whole(0));
  cmd->add_option("--top-p", s.top_p,
                  fmt::format("top-p sampling (1 = off; default: generation_config.json's, else {})",
                              d.top_p))
      ->check(between(0, 1));
  cmd->add_option("--min-p", s.min_p,
                  fmt::format("min-p sampling (0 = off; default: generation_config.json's, else {})",
                              d.min_p))
      ->check(between(0, 1));
  cmd->add_option("--repeat-penalty", s.repeat_penalty,
                  "repetition penalty (1 = off; default: generation_config.json's "
                  "repetition_penalty, else 1)")
      ->check(above(0));
  cmd->add_option("--repeat-last-n", s.repeat_last_n, "window of the penalties (-1 = all)")
      ->check(whole(-1, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", s.frequency_penalty, "frequency penalty")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", s.presence_penalty, "presence penalty")
      ->capture_default_str();
  // -1 (llama.cpp's default) or nothing: a random seed, printed.
  cmd->add_option_function<std::string>(
         "-s,--seed",
         [&s](const std::string& v) {
           if (v == "-1") s.seed.reset();
           else s.seed = std::stoull(v);
         },
         "random seed (-1 = random, printed; default -1)")
      ->type_name("INT")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            if (in == "-1") return "";
            char* end = nullptr;
            errno = 0;
            const unsigned long long v = std::strtoull(in.c_str(), &end, 10);
            (void)v;
            if (in.empty() || in[0] == '-' || end != in.c_str() + in.size() || errno == ERANGE)
              return "must be -1 (random) or between 0 and 18446744073709551615, got " + in;
            return "";
          },
          "-1 or INT >= 0"));
  cmd->add_option("--stop", s.stop, "stop string (repeatable); never printed");
  cmd->add_option("-r,--reverse-prompt", s.reverse,
                  "end the text when it ends with this (repeatable), shown, as llama-cli's -r");
  cmd->add_flag("--ignore-eos", s.ignore_eos, "keep generating past end-of-sequence");
}

SamplingParams resolve_sampling(const std::string& dir, const SamplingOptions& s) {
  SamplingParams p = default_sampling(dir);
  if (s.temperature) p.temperature = *s.temperature;
  if (s.top_k) p.top_k = *s.top_k;
  if (s.top_p) p.top_p = *s.top_p;
  if (s.min_p) p.min_p = *s.min_p;
  if (s.repeat_penalty) p.repeat_penalty = *s.repeat_penalty;
  p.repeat_last_n = s.repeat_last_n;
  p.frequency_penalty = s.frequency_penalty;
  p.presence_penalty = s.presence_penalty;
  p.seed = s.seed ? *s.seed : std::random_device{}();
  return p;
}

std::string describe_sampling(const SamplingParams& p) {
  if (p.temperature <= 0) return "greedy (temp 0)";
  std::string s = fmt::format("temp {}, top-k {}, top-p {}, min-p {}", p.temperature, p.top_k,
                              p.top_p, p.min_p);
  if (p.repeat_penalty != 1 || p.frequency_penalty != 0 || p.presence_penalty != 0)
    s += fmt::format(", repeat-penalty {}, frequency-penalty {}, presence-penalty {} over {}",
                     p.repeat_penalty, p.frequency_penalty, p.presence_penalty,
                     p.repeat_last_n < 0 ? std::string("all tokens")
                                         : fmt::format("the last {} tokens", p.repeat_last_n));
  return s + fmt::format(", seed {}", p.seed);
}

void add_spec_options(CLI::App* cmd, SpecOptions& s) {
  cmd->add_option("--spec", s.kind,
                  "speculative decoding: lookup (drafts from n-grams of the context) or draft "
                  "(a smaller model with the same vocabulary drafts, --draft-model); default off")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            if (in == "lookup" || in == "draft") return "";
            if (!in.empty() && in[0] == '-') return "needs a value, lookup or draft, before " + in;
            return "must be lookup or draft, got " + in;
          },
          "lookup|draft"));
  cmd->add_option("--draft-model", s.draft_model, "with --spec draft: the draft model's directory");
  cmd->add_option("--draft-max", s.draft_max,
                  "with --spec: most tokens drafted per step (adapted below it to the acceptance)")
      ->check(whole(1, kMaxDraftMax))
      ->each([&s](const std::string&) { s.draft_max_given = true; })
      ->capture_default_str();
}

void check_spec_options(const SpecOptions& s) {
  if (s.kind == "draft" && s.draft_model.empty())
    throw CLI::ValidationError("--spec draft needs --draft-model DIR (the drafting model)");
  if (!s.draft_model.empty() && s.kind != "draft")
    throw CLI::ValidationError("--draft-model goes with --spec draft");
  if (s.draft_max_given && s.kind.empty())
    throw CLI::ValidationError("--draft-max goes with --spec lookup or --spec draft");
  // A mistyped draft directory is found before the model loads, not after.
  if (!s.draft_model.empty()) {
    std::error_code ec;
    if (!std::filesystem::exists(s.draft_model, ec))
      throw CLI::ValidationError("--draft-model " + s.draft_model + ": no such directory");
    if (!std::filesystem::is_directory(s.draft_model, ec))
      throw CLI::ValidationError("--draft-model " + s.draft_model +
                                 ": not a directory (a model directory is expected)");
    if (!std::filesystem::exists(std::filesystem::path(s.draft_model) / "config.json", ec))
      throw CLI::ValidationError("--draft-model " + s.draft_model +
                                 ": no config.json (not a model directory)");
  }
}

namespace {

// "" when the draft's tokenizer and model agree with the target's on every id, else what
// differs first.
std::string vocabulary_difference(const LoadedModel& target, const LoadedModel& draft) {
  // The embedding tables may differ in size (padding rows past the tokenizer's ids, as
  // between Qwen2.5's small and large models); the tokenizers must not.
  const Tokenizer &t = *target.tok, &d = *draft.tok;
  if (t.vocab_size() != d.vocab_size())
    return fmt::format("{} tokens in its tokenizer against the model's {}", d.vocab_size(),
                       t.vocab_size());
  for (int id = 0; id < t.vocab_size(); ++id)
    if (t.piece(id) != d.piece(id))
      return fmt::format("token {} is '{}' there and '{}' in the model", id, d.piece(id),
                         t.piece(id));
  if (t.bos_id() != d.bos_id())
    return fmt::format("BOS id {} there and {} in the model", d.bos_id(), t.bos_id());
  if (t.eos_ids() != d.eos_ids())
    return fmt::format("EOS ids [{}] there and [{}] in the model", fmt::join(d.eos_ids(), ", "),
                       fmt::join(t.eos_ids(), ", "));
  return "";
}

}  // namespace

Speculation open_speculation(const SpecOptions& s, const LoadedModel& target,
                             const ModelOptions& target_opts, const SamplingParams& sampling,
                             bool quiet) {
  Speculation sp;
  if (s.kind == "lookup") {
    sp.drafter = std::make_unique<NgramDrafter>();
  } else if (s.kind == "draft") {
    ModelOptions o = target_opts;
    o.dir = s.draft_model;
    o.device = target.device;
    // Errors of the draft's files say which model they are about.
    auto as_draft = [&](auto&& load) {
      try {
        return load();
      } catch (const Error& e) {
        // The loaders' messages mostly begin with the directory already.
        const std::string what = e.what();
        throw Error(what.rfind(s.draft_model, 0) == 0
                        ? "--draft-model " + what
                        : fmt::format("--draft-model {}: {}", s.draft_model, what));
      }
    };
    sp.draft = std::make_unique<LoadedModel>(as_draft([&] {
      // The target's context, or the draft's own limit where that is shorter: past it the
      // draft proposes nothing and the target decodes on alone.
      const ModelSpec probe = load_model_spec(o.dir);
      o.context = target.session->context_length();
      if (probe.config.max_pos > 0) o.context = std::min(o.context, probe.config.max_pos);
      return open_model(o, /*quiet=*/true);
    }));
    const std::string diff = vocabulary_difference(target, *sp.draft);
    if (!diff.empty())
      throw Error(fmt::format("--draft-model {}: its vocabulary differs from {}'s ({}); the "
                              "draft model must share the model's tokenizer",
                              s.draft_model, target_opts.dir, diff));
    as_draft([&] {
      load_weights(*sp.draft, o, /*quiet=*/true);
      return 0;
    });
    const int draft_ctx = sp.draft->session->context_length();
    note(quiet, fmt::format("draft model {} ({}) on {}, context {}{}", s.draft_model,
                            format_text(sp.draft->spec->config), sp.draft->model->device_name(),
                            draft_ctx,
                            draft_ctx < target.session->context_length()
                                ? fmt::format(" (its limit: past position {} it drafts nothing "
                                              "and the model decodes alone)", draft_ctx)
                                : std::string()));
    sp.drafter = std::make_unique<ModelDrafter>(*sp.draft->session, sampling,
                                                target.spec->config.vocab);
  }
  return sp;
}

void add_result(Perf& p, const GenerateResult& r) {
  p.prompt_ms += r.prompt_ms;
  p.prompt_tokens += (int64_t)r.prompt_ids.size() - r.n_cached;
  p.eval_ms += r.gen_ms - r.sample_ms;
  p.eval_runs += r.n_eval;
  p.sample_ms += r.sample_ms;
  p.sampled += r.n_sampled;
  p.device_chosen += r.n_device;
  p.generated += (int64_t)r.ids.size();
  p.drafted += r.n_drafted;
  p.accepted += r.n_accepted;
  p.steps += r.n_steps;
  // Every id but a generation's first came from a verify pass.
  if (r.n_steps > 0) p.step_ids += (int64_t)r.ids.size() - 1;
}

void print_perf(const Perf& p, const std::string& device) {
  const double total =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p.start).count();
  auto rate = [](double ms, int64_t n) {
    return fmt::format("({:8.2f} ms per token, {:8.2f} tokens per second)", n ? ms / n : 0.0,
                       ms > 0 ? n * 1000.0 / ms : 0.0);
  };
  std::string s;
  s += fmt::format("\nperf:        load time = {:10.2f} ms ({})\n", p.load_ms, device);
  s += fmt::format("perf: prompt eval time = {:10.2f} ms / {:5} tokens {}\n", p.prompt_ms,
                   p.prompt_tokens, rate(p.prompt_ms, p.prompt_tokens));
  s += fmt::format("perf:        eval time = {:10.2f} ms / {:5} runs   {}\n", p.eval_ms,
                   p.eval_runs, rate(p.eval_ms, p.eval_runs));
  s += fmt::format("perf:    sampling time = {:10.2f} ms / {:5} runs   {}\n", p.sample_ms,
                   p.sampled, rate(p.sample_ms, p.sampled));
  if (p.device_chosen > 0)
    s += fmt::format("perf: chosen by the model = {:5} tokens (its argmax or top-k sampler, timed in eval)\n",
                     p.device_chosen);
  if (p.speculative && p.steps == 0)
    s += "perf:      speculative = no verify pass (a single token each)\n";
  else if (p.speculative)
    s += fmt::format("perf:      speculative = {:5} drafted, {:5} accepted ({:.1f}%), {:.2f} "
                     "tokens per step ({} steps)\n",
                     p.drafted, p.accepted, p.drafted ? 100.0 * p.accepted / p.drafted : 0.0,
                     (double)p.step_ids / p.steps, p.steps);
  s += fmt::format("perf:       total time = {:10.2f} ms / {:5} tokens\n", total,
                   p.prompt_tokens + p.generated);
  std::cerr << s << std::flush;
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

std::string read_text_file(const std::string& path) { return read_regular_file(path); }

std::string process_escapes(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    switch (c) {
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case 'x':
        if (i + 2 < s.size() && std::isxdigit((unsigned char)s[i + 1]) &&
            std::isxdigit((unsigned char)s[i + 2])) {
          out += (char)std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16);
          i += 2;
          break;
        }
        [[fallthrough]];
      default:
        out += '\\';
        out += c;
    }
  }
  return out;
}

}  // namespace kestrel::cli
