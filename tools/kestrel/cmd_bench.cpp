// kestrel bench: prompt and generation throughput in the manner of llama-bench. Random
// prompt tokens, one warm-up run, then r repetitions; every generated token is synchronised
// and read back by the host, as in real generation. Reports mean and standard deviation.
// --batch B1,B2,..: also decode B sequences at once (Model::forward_batch, as `kestrel serve
// --parallel` runs its streams), aggregate and per-stream tokens/s at each B.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "base/error.h"
#include "engine/generate.h"
#include "tools/median.h"

namespace kestrel::cli {

namespace {

struct BenchArgs {
  ModelOptions model;
  int n_prompt = 512;
  int n_gen = 128;
  int reps = 5;
  std::string output = "md";
  uint64_t seed = 1234;
  bool profile = false;
  DecodeTuning tuning;  // the CUDA decode path's choices (docs/tuning.md)
  std::vector<std::string> tuning_given;  // those options given, named for a note on the CPU
  bool gemv_generic = false, no_graph_ranges = false, no_verify_graphs = false;
  int verify_rows = 0;  // --verify N: also time verify passes of N tokens
  SpecOptions spec;
  std::string prompt_file, prompt_text;  // a text prompt instead of random tokens (--spec)
  GrammarOptions grammar_opts;  // --grammar, --json-schema, --json-object
  std::vector<int> batch;       // --batch: batch sizes of the batched decode rows
};

// --batch: B sessions, each after a random prompt of its own (-p tokens, untimed), decode -n
// steps together through Model::forward_batch, each row's argmax read back by the host and fed
// to its next step, as the server's batched steps run.
struct BatchBench {
  int batch = 0;
  std::vector<double> total, each;  // tokens/s over all B streams, and of one stream
};

BatchBench run_batch_bench(const BenchArgs& a, LoadedModel& m, int B, std::mt19937_64& rng) {
  Model& model = *m.model;
  // Each sequence holds its prompt and its steps, whatever -c gave the main session.
  const int vocab = model.config().vocab, ctx = std::max(1, a.n_prompt + a.n_gen);
  std::uniform_int_distribution<int> tok(0, std::min(vocab, m.tok->vocab_size()) - 1);
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < B; ++i) {
    sessions.push_back(model.new_session(ctx, /*quiet=*/true));
    if (sessions.back()->context_length() < ctx)
      throw Error(fmt::format("--batch {}: the device holds only {} positions for session {} "
                              "(-p + -n needs {}): lower the batch size, -p or -n",
                              B, sessions.back()->context_length(), i + 1, ctx));
  }
  BatchBench b;
  b.batch = B;
  std::vector<float> logits((size_t)B * vocab);
  std::vector<BatchRow> rows(B);
  std::vector<int> prompt(std::max(a.n_prompt, 1));
  using clock = std::chrono::steady_clock;
  for (int rep = -1; rep < a.reps; ++rep) {  // rep -1 is the warm-up
    for (int i = 0; i < B; ++i) {
      for (int& t : prompt) t = tok(rng);
      int next = prompt.back();
      if (a.n_prompt > 0) {
        sessions[i]->forward(prompt.data(), a.n_prompt, 0, logits.data());
        next = argmax(logits.data(), vocab);
      }
      rows[i] = {sessions[i].get(), next, a.n_prompt};
    }
    const auto t0 = clock::now();
    for (int step = 0; step < a.n_gen; ++step) {
      model.forward_batch(rows, logits.data());
      for (int i = 0; i < B; ++i) {
        rows[i].token = argmax(logits.data() + (size_t)i * vocab, vocab);
        ++rows[i].pos;
      }
    }
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (rep >= 0) {
      b.total.push_back((double)B * a.n_gen / s);
      b.each.push_back(a.n_gen / s);
    }
  }
  return b;
}

// --grammar, --json-schema or --json-object: greedy generation through the engine's generate()
// under the grammar, after the same kind of random prompt as the tg row, whose steps it is
// compared with. Each token's logits come to the host to be masked (docs/grammar.md).
struct GrammarBench {
  std::string kind;  // "json-object", "json-schema" or "grammar"
  std::vector<double> tg;
  int64_t tokens = 0;    // generated over the repetitions (a complete match may end one early)
  int64_t complete = 0;  // repetitions whose text is a complete match of the grammar
};

GrammarBench run_grammar_bench(const BenchArgs& a, LoadedModel& m,
                               std::shared_ptr<const grammar::Grammar> g, std::mt19937_64& rng) {
  GrammarBench b;
  b.kind = a.grammar_opts.json_object ? "json-object"
           : !a.grammar_opts.json_schema.empty() ? "json-schema"
                                                  : "grammar";
  GenerateOptions o;
  o.max_new_tokens = a.n_gen;
  o.sampling.temperature = 0.0f;
  o.ignore_eos = true;
  o.grammar = std::move(g);
  o.masker = grammar_masker(*m.tok);
  std::uniform_int_distribution<int> tok(0, std::min(m.session->config().vocab, m.tok->vocab_size()) - 1);
  for (int rep = -1; rep < a.reps; ++rep) {  // rep -1 is the warm-up
    std::vector<int> prompt(std::max(a.n_prompt, 1));
    for (int& t : prompt) t = tok(rng);
    const GenerateResult r = generate(*m.session, *m.tok, prompt, o);
    if (rep < 0) continue;
    if (r.n_eval > 0) b.tg.push_back(r.n_eval * 1000.0 / r.gen_ms);
    b.tokens += (int64_t)r.ids.size();
    b.complete += r.grammar_complete ? 1 : 0;
  }
  return b;
}

// --spec: plain and speculative greedy generation through the engine's generate(), the way
// `kestrel generate --temp 0 --ignore-eos` runs, on the same text prompt.
struct SpecBench {
  std::vector<double> pp, tg, tg_spec;
  int64_t drafted = 0, accepted = 0, steps = 0, step_tokens = 0;
  bool same = true;  // the speculative ids equal the plain ones in every repetition
};

SpecBench run_spec_bench(const BenchArgs& a, LoadedModel& m, const std::vector<int>& prompt) {
  GenerateOptions plain;
  plain.max_new_tokens = a.n_gen;
  plain.sampling.temperature = 0.0f;
  plain.ignore_eos = true;
  Speculation spec = open_speculation(a.spec, m, a.model, plain.sampling, a.output != "md");
  GenerateOptions fast = plain;
  fast.drafter = spec.drafter.get();
  fast.draft_max = a.spec.draft_max;
  SpecBench b;
  for (int rep = -1; rep < a.reps; ++rep) {  // rep -1 is the warm-up
    const GenerateResult r = generate(*m.session, *m.tok, prompt, plain);
    const GenerateResult s = generate(*m.session, *m.tok, prompt, fast);
    if (rep < 0) continue;
    b.pp.push_back(prompt.size() * 1000.0 / r.prompt_ms);
    b.tg.push_back(r.n_eval * 1000.0 / r.gen_ms);
    b.tg_spec.push_back(s.n_eval * 1000.0 / s.gen_ms);
    b.drafted += s.n_drafted;
    b.accepted += s.n_accepted;
    b.steps += s.n_steps;
    b.step_tokens += (int64_t)s.ids.size() - 1;
    b.same = b.same && r.ids == s.ids;
  }
  return b;
}

struct Stat {
  double mean = 0, sd = 0;
};

// Timed verify passes per repetition (--verify).
constexpr int kVerifyPasses = 20;

Stat stats(const std::vector<double>& v) {
  Stat s;
  if (v.empty()) return s;
  for (double x : v) s.mean += x;
  s.mean /= v.size();
  if (v.size() > 1) {
    for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
    s.sd = std::sqrt(s.sd / (v.size() - 1));
  }
  return s;
}

// One decode step, op by op: time, share and achieved bandwidth.
void print_profile(const std::vector<OpTime>& ops) {
  if (ops.empty()) {
    std::cout << "\n(--profile: this device has no per-op timing)\n";
    return;
  }
  double total = 0;
  for (const OpTime& t : ops) total += t.us;
  std::cout << fmt::format("\n| {:<22} | {:>8} | {:>9} | {:>6} | {:>9} | {:>8} |\n", "op (one decode step)",
                           "launches", "us", "share", "MB", "GB/s");
  std::cout << fmt::format("| {:-<22} | {:->8} | {:->9} | {:->6} | {:->9} | {:->8} |\n", "", "", "", "", "", "");
  for (const OpTime& t : ops)
    std::cout << fmt::format("| {:<22} | {:>8} | {:>9.1f} | {:>5.1f}% | {:>9.2f} | {:>8.0f} |\n", t.op,
                             t.launches, t.us, 100 * t.us / total, t.bytes / 1e6,
                             t.us > 0 ? t.bytes / (t.us * 1e3) : 0.0);
  std::cout << fmt::format("| {:<22} | {:>8} | {:>9.1f} | {:>5.1f}% | {:>9} | {:>8} |\n", "total", "", total, 100.0,
                           "", "");
}

// "docs-llama-19m-gptq4" from "data/docs-llama-19m-gptq4/".
std::string model_name(const std::string& dir) {
  std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() || name == "." ? dir : name;
}

int run_bench(BenchArgs a) {
  const bool text = !a.prompt_file.empty() || !a.prompt_text.empty();
  std::string prompt_text = a.prompt_text;
  if (!a.prompt_file.empty()) {
    prompt_text = read_text_file(a.prompt_file);
    if (prompt_text.empty()) throw Error(a.prompt_file + ": the prompt file is empty");
  }
  if (text && prompt_text.empty()) throw Error("the prompt is empty");
  if (a.n_gen < 2 && !a.spec.kind.empty())
    throw Error("--spec measures generation: -n must be at least 2");
  std::vector<int> text_ids;
  if (text) {
    text_ids = Tokenizer::load(a.model.dir)->encode(prompt_text);
    a.n_prompt = (int)text_ids.size();
  }
  if (a.n_prompt == 0 && a.n_gen == 0 && a.verify_rows == 0)
    throw Error("nothing to measure: -p and -n are both 0");
  if (a.grammar_opts.given() && a.n_gen < 2)
    throw Error("--grammar, --json-schema and --json-object measure generation: -n must be at "
                "least 2");
  // Read before the model loads: a grammar that does not parse costs no loading.
  std::shared_ptr<const grammar::Grammar> grammar = load_grammar(a.grammar_opts);
  // (generate() starts from at least one prompt token, where -p 0 times the steps alone.)
  if (a.model.context == 0)
    a.model.context = std::max(a.n_prompt, grammar ? 1 : 0) + std::max(a.n_gen, a.verify_rows);
  a.tuning.gemv_specialized = !a.gemv_generic;
  a.tuning.graph_ranges = !a.no_graph_ranges;
  a.tuning.verify_graphs = !a.no_verify_graphs;
  const bool quiet = a.output != "md";
  const ModelLoadOptions lo = load_options(a.model, quiet, a.tuning);
  LoadedModel m = open_model(lo);
  if (m.device != "cuda" && !a.tuning_given.empty())
    note(quiet, fmt::format("note: {} tune{} the CUDA engine; this model runs on the CPU",
                            fmt::join(a.tuning_given, ", "), a.tuning_given.size() == 1 ? "s" : ""));
  load_weights(m, lo);
  Session& b = *m.session;
  const Model& model = *m.model;
  const int vocab = b.config().vocab;
  if (a.n_prompt + std::max(a.n_gen, a.verify_rows) > b.context_length()) {
    const std::string prompt =
        !a.prompt_file.empty() ? fmt::format("the prompt of {} ({} tokens)", a.prompt_file, a.n_prompt)
        : !a.prompt_text.empty() ? fmt::format("the prompt ({} tokens)", a.n_prompt)
                                 : fmt::format("-p {}", a.n_prompt);
    throw Error(fmt::format("{} plus {} exceed the context of {}", prompt,
                            a.verify_rows > a.n_gen ? fmt::format("--verify {}", a.verify_rows)
                                                    : fmt::format("-n {}", a.n_gen),
                            b.context_length()));
  }

  std::mt19937_64 rng(a.seed);
  std::uniform_int_distribution<int> tok(0, std::min(vocab, m.tok->vocab_size()) - 1);
  std::vector<float> logits(vocab);
  std::vector<double> pp, tg, verify_ms;
  std::optional<SpecBench> sb;
  if (!a.spec.kind.empty()) {
    sb = run_spec_bench(a, m, text_ids);
    pp = sb->pp;
    tg = sb->tg;
  }
  using clock = std::chrono::steady_clock;
  for (int rep = -1; rep < (sb ? -1 : a.reps); ++rep) {  // rep -1 is the warm-up
    std::vector<int> prompt(std::max(a.n_prompt, 1));
    for (int& t : prompt) t = tok(rng);
    auto t0 = clock::now();
    int next = prompt.back();
    if (a.n_prompt > 0) {
      b.forward(prompt.data(), a.n_prompt, 0, logits.data());
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      if (rep >= 0) pp.push_back(a.n_prompt / s);
      next = (int)(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
    if (a.n_gen > 0) {
      t0 = clock::now();
      // As `kestrel generate` decodes greedily: each token is read back by the host, and the
      // device may already run the step it feeds (DecodeRun).
      std::unique_ptr<DecodeRun> run = b.greedy_run(next, a.n_prompt);
      for (int i = 0; i < a.n_gen; ++i) next = run->next(i + 1 < a.n_gen);
      run.reset();
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      if (rep >= 0) tg.push_back(a.n_gen / s);
    }
    if (a.verify_rows > 0) {
      // Speculative verification's pass: N tokens at the position after the prompt, each row's
      // argmax back on the host, as a verify step of generate() runs it. The first pass of the
      // warm-up captures its graph where verify graphs are on.
      std::vector<int> rows(a.verify_rows), ids(a.verify_rows);
      for (int i = 0; i < kVerifyPasses; ++i) {
        for (int& t : rows) t = tok(rng);
        t0 = clock::now();
        b.forward_argmax_rows(rows.data(), a.verify_rows, a.n_prompt, ids.data());
        const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
        if (rep >= 0) verify_ms.push_back(ms);
      }
    }
  }

  std::optional<GrammarBench> gb;
  if (grammar) gb = run_grammar_bench(a, m, grammar, rng);
  std::vector<BatchBench> bb;
  for (int B : a.batch) bb.push_back(run_batch_bench(a, m, B, rng));
  // The table's and the CSV's test names of a batch size's rows.
  auto batch_test = [&](int B, bool each) {
    return fmt::format("tg{} b{} {}", a.n_gen, B, each ? "each" : "total");
  };

  const ModelConfig& c = b.config();
  const uint64_t size_bytes = m.spec->files.total_bytes();
  const int64_t params = count_params(c);
  const Stat p = stats(pp), g = stats(tg);
  const Stat gs = sb ? stats(sb->tg_spec) : Stat{};
  const double verify_median = bench::median(verify_ms);
  const double step_ms = g.mean > 0 ? 1000.0 / g.mean : 0.0;
  const std::string spec_test = fmt::format("tg{}+{}", a.n_gen, a.spec.kind);
  const Stat gg = gb ? stats(gb->tg) : Stat{};
  const std::string grammar_test = gb ? fmt::format("tg{}+{}", a.n_gen, gb->kind) : "";
  // A constrained step against a plain one (tg): what the grammar costs a token.
  const double grammar_step_ms = gg.mean > 0 ? 1000.0 / gg.mean : 0.0;
  const double acceptance = sb && sb->drafted ? (double)sb->accepted / sb->drafted : 0.0;
  const double per_step = sb && sb->steps ? (double)sb->step_tokens / sb->steps : 0.0;
  const std::string backend = m.device == "cuda" ? "CUDA" : "CPU";
  if (a.output == "json") {
    nlohmann::json j;
    j["model"] = a.model.dir;
    j["type"] = format_text(c);
    j["size_bytes"] = size_bytes;
    j["params"] = params;
    j["backend"] = backend;
    j["device"] = b.device_name();
    j["type_k"] = a.model.cache_type_k;  // llama-bench's names for the KV cache's types
    j["type_v"] = a.model.cache_type_v;
    j["n_prompt"] = a.n_prompt;
    j["n_gen"] = a.n_gen;
    j["reps"] = a.reps;
    j["prompt_tokens_per_s"] = {{"mean", p.mean}, {"sd", p.sd}, {"samples", pp}};
    j["gen_tokens_per_s"] = {{"mean", g.mean}, {"sd", g.sd}, {"samples", tg}};
    if (sb)
      j["speculative"] = {{"spec", a.spec.kind},
                          {"draft_max", a.spec.draft_max},
                          {"gen_tokens_per_s",
                           {{"mean", gs.mean}, {"sd", gs.sd}, {"samples", sb->tg_spec}}},
                          // Totals over the -r repetitions (the warm-up left out).
                          {"drafted_tokens", sb->drafted},
                          {"accepted_tokens", sb->accepted},
                          {"steps", sb->steps},
                          {"acceptance_rate", acceptance},
                          {"tokens_per_step", per_step},
                          {"same_tokens_as_plain", sb->same}};
    if (gb) {
      j["grammar"] = {{"kind", gb->kind},
                      {"gen_tokens_per_s", {{"mean", gg.mean}, {"sd", gg.sd}, {"samples", gb->tg}}},
                      // Totals over the -r repetitions (the warm-up left out).
                      {"generated_tokens", gb->tokens},
                      {"complete_matches", gb->complete},
                      {"step_ms", grammar_step_ms},
                      {"plain_step_ms", step_ms},
                      {"overhead", step_ms > 0 ? grammar_step_ms / step_ms - 1 : 0.0}};
    }
    if (!bb.empty()) {
      j["batch"] = nlohmann::json::array();
      for (const BatchBench& x : bb) {
        const Stat t = stats(x.total), e = stats(x.each);
        j["batch"].push_back(
            {{"batch", x.batch},
             {"gen_tokens_per_s", {{"mean", t.mean}, {"sd", t.sd}, {"samples", x.total}}},
             {"per_stream_tokens_per_s", {{"mean", e.mean}, {"sd", e.sd}, {"samples", x.each}}}});
      }
    }
    if (a.verify_rows > 0) {
      j["verify"] = {{"tokens", a.verify_rows},
                     {"position", a.n_prompt},
                     {"ms_median", verify_median},
                     {"passes", verify_ms.size()}};
      // Against a decode step only where one was timed (-n > 0).
      if (step_ms > 0) {
        j["verify"]["decode_step_ms"] = step_ms;
        j["verify"]["ratio_to_decode_step"] = verify_median / step_ms;
      }
    }
    // Device memory only where there is a device; the CPU's KV cache is host memory.
    if (m.device == "cuda") {
      j["gpu_weight_bytes"] = model.weight_bytes();
      j["gpu_cache_bytes"] = b.cache_bytes();
      j["gpu_bytes_after_load"] = model.device_bytes_after_load();
      j["gpu_bytes_in_use"] = model.device_bytes_in_use();
    } else {
      j["cache_bytes"] = b.cache_bytes();
    }
    std::cout << j.dump(2) << "\n";
  } else if (a.output == "csv") {
    std::cout << "model,type,size_bytes,params,backend,device,test,tokens_per_s_mean,tokens_per_s_sd\n";
    // Fields with a comma or a quote are quoted (the device name "CPU (reference, fp32)").
    auto field = [](const std::string& v) {
      if (v.find_first_of(",\"\n") == std::string::npos) return v;
      std::string q = "\"";
      for (char ch : v) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
      return q + "\"";
    };
    auto row = [&](const std::string& test, Stat s) {
      std::cout << fmt::format("{},{},{},{},{},{},{},{:.2f},{:.2f}\n", field(a.model.dir),
                               field(format_text(c)), size_bytes, params, backend,
                               field(b.device_name()), test, s.mean, s.sd);
    };
    if (a.n_prompt > 0) row(fmt::format("pp{}", a.n_prompt), p);
    if (a.n_gen > 0) row(fmt::format("tg{}", a.n_gen), g);
    if (sb) row(spec_test, gs);
    if (gb) row(grammar_test, gg);
    for (const BatchBench& x : bb) {
      row(batch_test(x.batch, false), stats(x.total));
      row(batch_test(x.batch, true), stats(x.each));
    }
    // A verify pass as tokens/s through it: N tokens over the median pass (sd 0: a median,
    // where the other rows are means).
    if (a.verify_rows > 0 && verify_median > 0)
      row(fmt::format("verify{}-median", a.verify_rows),
          Stat{a.verify_rows * 1000.0 / verify_median, 0});
  } else {
    // The model by its directory's name, as llama-bench names it by its file.
    const std::string name = model_name(a.model.dir), type = format_text(c);
    const size_t w = std::max<size_t>(name.size(), 5), wt = std::max<size_t>(type.size(), 4);
    size_t wtest =  // "tg128+lookup", "tg128+json-object"
        std::max({sb ? spec_test.size() : 0, grammar_test.size(), size_t(7)});
    for (const BatchBench& x : bb) wtest = std::max(wtest, batch_test(x.batch, false).size());
    if (a.n_prompt > 0 || a.n_gen > 0 || sb) {  // (--verify alone has no row)
      std::cout << fmt::format("| {:<{}} | {:<{}} | {:>10} | {:>9} | {:<21} | {:>{}} | {:>18} |\n",
                               "model", w, "type", wt, "size", "params", "device", "test", wtest,
                               "t/s");
      std::cout << fmt::format("| {:-<{}} | {:-<{}} | {:->10} | {:->9} | {:-<21} | {:->{}} | {:->18} |\n",
                               "", w, "", wt, "", "", "", "", wtest, "");
    }
    auto row = [&](const std::string& test, Stat s) {
      std::cout << fmt::format(
          "| {:<{}} | {:<{}} | {:>10} | {:>9} | {:<21} | {:>{}} | {:>9.2f} ± {:>6.2f} |\n", name, w,
          type, wt, size_text(size_bytes), params_text(params), b.device_name(), test, wtest,
          s.mean, s.sd);
    };
    if (a.n_prompt > 0) row(fmt::format("pp{}", a.n_prompt), p);
    if (a.n_gen > 0) row(fmt::format("tg{}", a.n_gen), g);
    for (const BatchBench& x : bb) {
      row(batch_test(x.batch, false), stats(x.total));
      row(batch_test(x.batch, true), stats(x.each));
    }
    if (sb) {
      row(spec_test, gs);
      std::cout << fmt::format(
          "\nspeculative ({}, draft-max {}): {} drafted, {} accepted ({:.1f}%), {:.2f} tokens per "
          "step; the same tokens as plain greedy decoding: {}\n",
          a.spec.kind, a.spec.draft_max, sb->drafted, sb->accepted, 100 * acceptance, per_step,
          sb->same ? "yes" : "NO");
    }
    if (gb) {
      row(grammar_test, gg);
      std::cout << fmt::format(
          "\nconstrained decoding ({}): {:.4f} ms a step against {:.4f} ms plain ({:+.1f}%); {} "
          "tokens, {} of {} texts a complete match\n",
          gb->kind, grammar_step_ms, step_ms, step_ms > 0 ? 100 * (grammar_step_ms / step_ms - 1) : 0.0,
          gb->tokens, gb->complete, a.reps);
    }
    if (a.verify_rows > 0) {
      std::cout << fmt::format("\nverify pass of {} tokens at position {}: {:.4f} ms (median of {})",
                               a.verify_rows, a.n_prompt, verify_median, verify_ms.size());
      if (step_ms > 0)
        std::cout << fmt::format(", {:.2f}x a decode step ({:.4f} ms = 1 / tg{} mean)",
                                 verify_median / step_ms, step_ms, a.n_gen);
      else
        std::cout << " (no decode step to compare with: -n 0)";
      std::cout << "\n";
    }
    if (a.profile) print_profile(b.profile_step(1, a.n_prompt + a.n_gen - 1));
    if (m.device == "cuda") {
      const double wk = double(model.weight_bytes() + b.cache_bytes());
      auto over = [&](size_t used) {
        return fmt::format("{:.2f} GiB ({:+.1f}% over weights + KV cache)", used / 1073741824.0,
                           100.0 * (double(used) - wk) / wk);
      };
      std::cout << fmt::format("\nGPU memory: weights {:.2f} GiB + KV cache {:.2f} GiB ({} positions)\n",
                               model.weight_bytes() / 1073741824.0, b.cache_bytes() / 1073741824.0,
                               b.context_length());
      std::cout << fmt::format("Device memory taken by the engine: after loading {}, after the "
                               "prompt runs (prefill scratch) {}\n",
                               over(model.device_bytes_after_load()), over(model.device_bytes_in_use()));
    }
  }
  return 0;
}

}  // namespace

void register_bench(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "measure prompt and generation tokens/s");
  add_model_options(cmd, a->model);
  cmd->get_option("--ctx-size")->description("context length in tokens (0 = -p + -n)");
  cmd->add_option("-p,--n-prompt", a->n_prompt, "prompt tokens (0 = skip)")
      ->check(whole(0))
      ->capture_default_str();
  cmd->add_option("-n,--n-gen", a->n_gen, "generated tokens (0 = skip)")
      ->check(whole(0))
      ->capture_default_str();
  cmd->add_option("-r,--repetitions", a->reps, "repetitions after the warm-up")
      ->check(whole(1))
      ->capture_default_str();
  cmd->add_option("-o,--output", a->output, "md, json or csv")
      ->check(CLI::IsMember({"md", "json", "csv"}))
      ->capture_default_str();
  cmd->add_option("-s,--seed", a->seed, "seed of the random prompt tokens")->capture_default_str();
  cmd->add_flag("--profile", a->profile,
                "also time each op of one decode step (at the last position) against its bytes");
  // The CUDA decode path's tuning (models/tuning.h, docs/tuning.md), for comparing choices;
  // kept in `tuning` to be named in a note when given on the CPU.
  std::vector<CLI::Option*> tuning;
  tuning.push_back(cmd->add_option("--att-heads", a->tuning.attention_heads_per_block,
                  "query heads per decode-attention block under GQA (0 = chosen, 1, 2, 4)")
      ->check(CLI::IsMember({0, 1, 2, 4})));
  tuning.push_back(cmd->add_option("--gemv-warps", a->tuning.gemv_block_warps,
                  "warps per block of the quantized GEMVs (0 = by shape, 8, 16)")
      ->check(CLI::IsMember({0, 8, 16})));
  tuning.push_back(cmd->add_flag("--gemv-generic", a->gemv_generic,
                "run the generic quantized GEMV kernel instead of the specialized ones"));
  tuning.push_back(cmd->add_flag("--no-graph-ranges", a->no_graph_ranges,
                "capture one decode graph for the whole context instead of one per range"));
  tuning.push_back(cmd->add_flag("--no-verify-graphs", a->no_verify_graphs,
                "launch each speculative verify pass's kernels from the host instead of replaying "
                "a CUDA graph"));
  tuning.push_back(cmd->add_option("--small-gemm", a->tuning.small_gemm_max_rows,
                  "prompt chunks and verify passes of 3 .. N tokens run their quantized linears "
                  "through the fused small-M GEMM (0 = off, up to 64)")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            // 1 and 2 would do nothing: two rows or fewer always run as GEMVs.
            const int v = std::atoi(in.c_str());
            return in == std::to_string(v) && (v == 0 || (v >= 3 && v <= 64))
                       ? ""
                       : "must be 0 (off) or 3 to 64, got " + in;
          },
          "0|3..64"))
      ->capture_default_str());
  cmd->add_option("--verify", a->verify_rows,
                  "also time speculative verify passes of N tokens (2..65) after the prompt, "
                  "against a decode step")
      ->check(whole(2, 65));
  cmd->add_option("--batch", a->batch,
                  "also decode B sequences at once for each B given (1,4,8,16): aggregate and "
                  "per-stream tokens/s of the batched step")
      ->delimiter(',')
      ->check(whole(1, 256))
      ->type_name("B,..");
  add_spec_options(cmd, a->spec);
  add_grammar_options(cmd, a->grammar_opts);
  auto* file = cmd->add_option("-f,--file", a->prompt_file,
                               "with --spec: the prompt, from a file (instead of random tokens)");
  auto* text = cmd->add_option("--prompt", a->prompt_text, "with --spec: the prompt text")
                   ->excludes(file);
  cmd->callback([a, file, text, cmd, tuning, &action] {
    check_spec_options(a->spec);
    check_grammar_options(a->grammar_opts, a->spec);
    // The modes that exclude --spec first: their conflict is the mistake, not a missing prompt.
    if (a->profile && !a->spec.kind.empty())
      throw CLI::ValidationError("--profile goes without --spec");
    if (!a->batch.empty() && !a->spec.kind.empty())
      throw CLI::ValidationError("--batch goes without --spec");
    if (!a->batch.empty() && a->n_gen < 1)
      throw CLI::ValidationError("--batch measures generation: -n must be at least 1");
    if (a->verify_rows > 0 && !a->spec.kind.empty())
      throw CLI::ValidationError("--verify goes without --spec (it times the pass alone)");
    const bool has_text = file->count() || text->count();
    if (!a->spec.kind.empty() && !has_text)
      throw CLI::ValidationError(
          "--spec needs a text prompt, -f FILE or --prompt TEXT (random tokens give a drafter "
          "nothing to predict)");
    if (has_text && a->spec.kind.empty())
      throw CLI::ValidationError("-f and --prompt go with --spec");
    if (text->count() && a->prompt_text.empty())
      throw CLI::ValidationError("the prompt is empty");
    if (has_text && cmd->get_option("--n-prompt")->count())
      throw CLI::ValidationError("-p sets the length of a random prompt; with -f or --prompt the "
                                 "prompt is the text");
    for (const CLI::Option* o : tuning)
      if (o->count()) a->tuning_given.push_back(o->get_name());
    action = [a] { return run_bench(*a); };
  });
}

}  // namespace kestrel::cli
