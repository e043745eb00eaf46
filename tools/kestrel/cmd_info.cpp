// kestrel info: what a model directory holds, as Kestrel reads it: family, shapes, weight
// format, size, context and tokenizer. Only config.json (with its quantization config), the
// safetensors headers and the tokenizer files are read: no weights, no device.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tools/kestrel/commands.h"
#include "tools/kestrel/common.h"
#include "base/error.h"
#include "engine/loader.h"
#include "tokenizer/chat_template.h"

namespace kestrel::cli {

namespace {

namespace fs = std::filesystem;

struct InfoArgs {
  std::string dir;
  bool json = false;
  ModelOptions cache;  // -ctk / -ctv only
};

// The tokenizer file Tokenizer::load reads, in its order of preference.
std::string tokenizer_file(const std::string& dir) {
  for (const char* f : {"tokenizer.json", "tokenizer.model"})
    if (fs::exists(fs::path(dir) / f)) return f;
  return "vocab.json + merges.txt";
}

int run_info(const InfoArgs& a) {
  if (!fs::exists(a.dir)) throw Error(a.dir + ": no such model directory");
  if (!fs::is_directory(a.dir)) throw Error(a.dir + ": not a directory (-m takes a model directory)");
  const ModelInfo info = read_model_info(a.dir);
  const ModelConfig& c = info.config;
  const std::unique_ptr<Tokenizer> tok = Tokenizer::load(a.dir);
  std::string why;
  const ChatTemplate tmpl = ChatTemplate::load(a.dir, "auto", *tok, &why);

  // The KV cache a position takes in the cache types asked for (-ctk / -ctv), on each engine,
  // and the positions a GiB of free memory holds: what a context that fits scales with.
  const KvCacheTypes kv = cache_types(a.cache);
  {
    const std::string why = cache_types_unsupported(Device::Cpu, c, kv);
    if (!why.empty()) throw Error(why);
  }
  const size_t gpu_pos = cache_bytes_per_position(Device::Cuda, c, kv);
  const size_t cpu_pos = cache_bytes_per_position(Device::Cpu, c, kv);
  const double gib = 1073741824.0;
  const std::string kv_names = kv.k == kv.v ? std::string(kv_type_name(kv.k))
                                            : fmt::format("{} K, {} V", kv_type_name(kv.k), kv_type_name(kv.v));

  const uint64_t bytes = info.weight_bytes;
  const int64_t params = count_params(c);
  std::string context = fmt::format("{} positions (max_position_embeddings)", c.max_pos);
  if (c.positions == PositionKind::Rope) {
    context += fmt::format(", RoPE theta {}", c.rope_theta);
    if (c.rope_llama3.factor > 0)
      context += fmt::format(", llama3 scaling x{} from {}", c.rope_llama3.factor,
                             c.rope_llama3.original_max_pos);
    if (c.rope_linear_factor != 1.0f) context += fmt::format(", linear scaling x{}", c.rope_linear_factor);
  } else {
    context += ", learned positions";
  }
  if (c.sliding_window > 0) context += fmt::format(", sliding window {}", c.sliding_window);
  std::string eos;
  for (int id : tok->eos_ids()) eos += (eos.empty() ? "" : ", ") + std::to_string(id);
  const std::string tokenizer = fmt::format(
      "{} ({}), {} tokens, BOS {}{}, EOS {}", tok->kind() == "sentencepiece" ? "SentencePiece" : "BPE",
      tokenizer_file(a.dir), tok->vocab_size(), tok->bos_id(), tok->add_bos() ? " (added)" : "",
      eos.empty() ? "none" : eos);
  const std::string chat = why.empty() ? tmpl.describe() : "none (raw: plain text turns)";
  // Per-module formats (GPTQModel's dynamic rules), resolved from the config alone.
  const std::vector<LinearFormatGroup> groups = linear_format_groups(c, a.dir);
  auto layers_text = [](const LinearFormatGroup& g) {
    return g.first_layer == g.last_layer ? fmt::format("layer {}", g.first_layer)
                                         : fmt::format("layers {}-{}", g.first_layer, g.last_layer);
  };

  if (a.json) {
    nlohmann::json j;
    j["model"] = a.dir;
    j["architecture"] = c.architecture;
    j["family"] = c.family;
    j["layers"] = c.n_layers;
    j["hidden"] = c.hidden;
    j["intermediate"] = c.intermediate;
    j["heads"] = c.n_heads;
    j["kv_heads"] = c.n_kv_heads;
    j["head_dim"] = c.head_dim;
    j["vocab"] = c.vocab;
    j["format"] = format_text(c);
    j["bits"] = c.quant ? c.quant->bits : (int)dtype_size(c.dtype) * 8;
    j["group_size"] = c.quant ? c.quant->group_size : 0;
    j["act_order"] = c.quant && c.quant->desc_act;
    if (!groups.empty()) {
      nlohmann::json rows = nlohmann::json::array();
      for (const LinearFormatGroup& g : groups) {
        nlohmann::json r{{"layers", {g.first_layer, g.last_layer}}, {"modules", g.modules},
                         {"format", g.format}, {"quantized", g.quant.has_value()}};
        if (g.quant) {
          r["bits"] = g.quant->bits;
          r["group_size"] = g.quant->group_size;
          r["act_order"] = g.quant->desc_act;
          r["sym"] = g.quant->sym;
        }
        rows.push_back(r);
      }
      j["linear_formats"] = rows;
    }
    j["size_bytes"] = bytes;
    j["params"] = params;
    j["context"] = c.max_pos;
    j["kv_cache"] = {{"type_k", kv_type_name(kv.k)},
                     {"type_v", kv_type_name(kv.v)},
                     {"gpu_bytes_per_position", gpu_pos},
                     {"cpu_bytes_per_position", cpu_pos},
                     {"gpu_bytes_at_context", (uint64_t)gpu_pos * c.max_pos},
                     {"gpu_positions_per_gib", (int64_t)(gib / gpu_pos)}};
    j["tokenizer"] = tok->kind();
    j["tokenizer_file"] = tokenizer_file(a.dir);
    j["tokenizer_vocab"] = tok->vocab_size();
    j["bos_id"] = tok->bos_id();
    j["eos_ids"] = tok->eos_ids();
    j["chat_template"] = chat;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::string s;
  auto line = [&](const char* key, const std::string& value) {
    s += fmt::format("{:<11}{}\n", std::string(key) + ":", value);
  };
  line("model", a.dir);
  line("family", fmt::format("{} ({})", c.family, c.architecture));
  line("shapes", fmt::format("{} layers, hidden {}, intermediate {}, {} heads of {} ({} KV "
                             "heads), vocabulary {}{}",
                             c.n_layers, c.hidden, c.intermediate, c.n_heads, c.head_dim,
                             c.n_kv_heads, c.vocab, c.tie_embeddings ? ", tied embeddings" : ""));
  line("format", format_text(c) + (groups.empty() ? "" : ", per-module overrides (dynamic):"));
  size_t format_width = 0;
  for (const LinearFormatGroup& g : groups) format_width = std::max(format_width, g.format.size());
  const size_t per_layer = c.mlp == MlpKind::GatedSiLU ? 7 : 6;
  for (size_t i = 0; i < groups.size(); ++i) {
    const LinearFormatGroup& g = groups[i];
    const bool same_layers = i > 0 && groups[i - 1].first_layer == g.first_layer;  // one label a run
    s += fmt::format("{:<11}{:<14}{:<{}}  {}\n", "", same_layers ? "" : layers_text(g), g.format,
                     format_width,
                     g.modules.size() == per_layer ? std::string("all linears")
                                                   : fmt::format("{}", fmt::join(g.modules, " ")));
  }
  line("size", fmt::format("{} of weights, {} parameters", size_text(bytes), params_text(params)));
  line("context", context);
  line("kv cache", fmt::format("{}: {} KiB per position on the GPU ({} positions per GiB, {} "
                               "at the whole context), {} KiB on the CPU",
                               kv_names, gpu_pos / 1024.0, (int64_t)(gib / gpu_pos),
                               size_text((uint64_t)gpu_pos * c.max_pos), cpu_pos / 1024.0));
  line("tokenizer", tokenizer);
  line("chat", chat);
  std::cout << s;
  return 0;
}

}  // namespace

void register_info(CLI::App& app, std::function<int()>& action) {
  auto a = std::make_shared<InfoArgs>();
  CLI::App* cmd = app.add_subcommand(
      "info", "show a model's family, shapes, format, size, context and tokenizer (no weights read)");
  cmd->add_option("-m,--model", a->dir, "model directory (Hugging Face layout)")->required();
  cmd->add_flag("--json", a->json, "print one JSON object");
  add_cache_type_options(cmd, a->cache);
  cmd->callback([a, &action] { action = [a] { return run_info(*a); }; });
}

}  // namespace kestrel::cli
