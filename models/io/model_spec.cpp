#include "models/io/model_spec.h"

#include <algorithm>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/error.h"
#include "kernels/gptq/gptq_format.h"
#include "models/io/family.h"
#include "models/io/finite.h"

namespace kestrel {

namespace {

std::string shape_text(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

// Checks a tensor's shape and dtype; `dtype_text` names what is accepted, e.g. "F16/BF16/F32".
void expect(const TensorInfo& t, const std::vector<int64_t>& shape, bool dtype_ok,
            const char* dtype_text) {
  if (t.shape == shape && dtype_ok) return;
  throw Error(fmt::format("{} in {}: expected {} {}, found {} {}", t.name, t.file, shape_text(shape),
                          dtype_text, t.shape_str(), dtype_name(t.dtype)));
}

const TensorInfo* float_tensor(const TensorInfo& t, const std::vector<int64_t>& shape) {
  expect(t, shape, dtype_is_float(t.dtype), "F16/BF16/F32");
  return &t;
}

// Reads a model's tensors against its config, collecting non-fatal findings.
struct SpecReader {
  const ModelConfig& c;
  const ModelFiles& files;
  std::vector<std::string>& warnings;
  std::vector<const TensorInfo*> ignored{};  // present, known, and left unused (with a warning)
  int quantized_linears = 0;
  std::vector<std::string> v2_zero_linears{};  // labelled gptq but holding gptq_v2 zeros
  int v2_zero_bits = 0;                        // the first of those linears' bits
  // Each linear's format under the config's dynamic rules, nullopt where a "-:" rule leaves it
  // unquantized, and the key of the rule that decided it ("" = none, the base format).
  std::map<std::string, std::optional<LinearQuant>> formats{};
  std::map<std::string, std::string> deciding_rule{};

  // Symmetric gptq (v1) files store zero 2^(bits-1) - 1 in every field; files that hold
  // 2^(bits-1) everywhere were written with v2 zeros and would dequantize off by one step.
  bool holds_v2_zeros(const TensorInfo& qzeros, int64_t G, int64_t N, int bits) const {
    const std::vector<uint32_t> words = qzeros.copy_as<uint32_t>();
    const int64_t row_words = gptq::packed_words(N, bits);
    const uint32_t v2_zero = 1u << (bits - 1);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n)
        if (gptq::read_code(words.data() + g * row_words, 1, n, bits) != v2_zero) return false;
    return true;
  }

  void read_gptq(LinearSpec& l, const std::string& prefix) {
    KESTREL_CHECK(c.quant, fmt::format("{} in {}: GPTQ tensors, but {} has no quantization config "
                                       "(quantize_config.json or config.json quantization_config)",
                                       l.qweight->name, l.qweight->file, files.dir()));
    auto it = formats.find(prefix);
    const std::optional<LinearQuant> f = it == formats.end() ? c.quant->base() : it->second;
    KESTREL_CHECK(f, fmt::format("{}: holds {}.qweight, but the dynamic rule \"{}\" leaves {} "
                                 "unquantized (a \"-:\" rule: its weight is a plain .weight)",
                                 files.dir(), prefix, deciding_rule[prefix], prefix));
    const LinearQuant& q = *f;
    const int b = q.bits;
    KESTREL_CHECK(l.K * b % 32 == 0,
                  fmt::format("{}: K = {} input features cannot be packed at {} bits (K*{} must be a "
                              "multiple of 32)", prefix, l.K, b, b));
    KESTREL_CHECK(l.N * b % 32 == 0,
                  fmt::format("{}: N = {} output features cannot be packed at {} bits (N*{} must be a "
                              "multiple of 32)", prefix, l.N, b, b));
    const int64_t G = q.group_size == -1 ? 1 : (l.K + q.group_size - 1) / q.group_size;
    l.quantized = true;
    l.bits = b;
    l.group_size = q.group_size;
    l.zero_offset = c.quant->zero_offset();
    l.sym = q.sym;

    expect(*l.qweight, {l.K * b / 32, l.N}, l.qweight->dtype == DType::I32, "I32");
    l.qzeros = &files.get(prefix + ".qzeros");
    expect(*l.qzeros, {G, l.N * b / 32}, l.qzeros->dtype == DType::I32, "I32");
    l.scales = &files.get(prefix + ".scales");
    expect(*l.scales, {G, l.N}, l.scales->dtype == DType::F16, "F16");

    l.g_idx = files.find(prefix + ".g_idx");
    // Act-order permutes the columns before grouping them; without g_idx the groups are unknown.
    KESTREL_CHECK(l.g_idx || !q.desc_act,
                  fmt::format("{}: missing tensor {}.g_idx (desc_act is true: act-order needs each "
                              "column's group)", files.dir(), prefix));
    if (l.g_idx) {
      expect(*l.g_idx, {l.K}, l.g_idx->dtype == DType::I32, "I32");
      const std::vector<int32_t> g_idx = l.g_idx->copy_as<int32_t>();
      for (int64_t k = 0; k < l.K; ++k) {
        KESTREL_CHECK(g_idx[k] >= 0 && g_idx[k] < G,
                      fmt::format("{} in {}: g_idx[{}] = {} is outside [0, {})", l.g_idx->name,
                                  l.g_idx->file, k, g_idx[k], G));
        const int64_t plain = q.group_size == -1 ? 0 : k / q.group_size;
        if (g_idx[k] != plain) l.act_order = true;
      }
    }

    ++quantized_linears;
    if (q.sym && c.quant->format == GptqFormat::V1 && holds_v2_zeros(*l.qzeros, G, l.N, b)) {
      l.zero_offset = 0;
      if (v2_zero_linears.empty()) v2_zero_bits = b;
      v2_zero_linears.push_back(prefix);
    }
  }

  LinearSpec linear(const std::string& prefix, int64_t N, int64_t K, bool has_bias) {
    LinearSpec l;
    l.name = prefix;
    l.N = N;
    l.K = K;
    l.qweight = files.find(prefix + ".qweight");
    const TensorInfo* weight = files.find(prefix + ".weight");
    if (l.qweight) {
      KESTREL_CHECK(!weight, fmt::format("{}: holds both {}.weight and {}.qweight", files.dir(),
                                         prefix, prefix));
      read_gptq(l, prefix);
    } else {
      KESTREL_CHECK(weight, fmt::format("{}: missing tensor {}.weight (or GPTQ {}.qweight)",
                                        files.dir(), prefix, prefix));
      l.weight = float_tensor(*weight, {N, K});
    }

    const TensorInfo* bias = files.find(prefix + ".bias");
    if (has_bias) {
      KESTREL_CHECK(bias, fmt::format("{}: missing tensor {}.bias (config.json asks for biases)",
                                      files.dir(), prefix));
      l.bias = float_tensor(*bias, {N});
    } else if (bias) {
      // transformers builds the layer without a bias and drops the tensor; do the same, loudly.
      ignored.push_back(bias);
      warnings.push_back(fmt::format("{}: {} is ignored: config.json declares no bias for this "
                                     "layer", files.dir(), bias->name));
    }
    return l;
  }

  void finish() {
    if (v2_zero_linears.empty()) return;
    const int b = v2_zero_bits;
    warnings.push_back(fmt::format(
        "{}: checkpoint_format is gptq, but {} of {} quantized linears (first {}) hold gptq_v2 "
        "zeros ({}-bit zero fields all {}, where symmetric gptq stores {}); reading them as gptq_v2",
        files.dir(), v2_zero_linears.size(), quantized_linears, v2_zero_linears.front(), b,
        1 << (b - 1), (1 << (b - 1)) - 1));
  }
};

// Every tensor a spec points at, in model order, each once (a tied lm_head is the embedding).
std::vector<const TensorInfo*> spec_tensors(const ModelSpec& s) {
  std::vector<const TensorInfo*> out;
  auto add = [&](const TensorInfo* t) {
    if (t) out.push_back(t);
  };
  auto linear = [&](const LinearSpec& l) {
    for (const TensorInfo* t : {l.weight, l.qweight, l.qzeros, l.scales, l.g_idx, l.bias}) add(t);
  };
  add(s.embed);
  add(s.positions);
  for (const LayerSpec& L : s.layers) {
    for (const TensorInfo* t : {L.input_norm, L.input_norm_bias, L.post_norm, L.post_norm_bias,
                                L.q_norm, L.k_norm})
      add(t);
    for (const LinearSpec* l : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) linear(*l);
  }
  add(s.final_norm);
  add(s.final_norm_bias);
  if (s.lm_head != s.embed) add(s.lm_head);
  return out;
}

// Buffers that transformers recomputes from config.json and drops on load.
bool known_harmless(const std::string& name) {
  for (const char* end : {".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached"})
    if (name.ends_with(end)) return true;
  return false;
}

// A tensor that the model as config.json describes it does not use means the config and the
// weights disagree (another variant, more layers than num_hidden_layers, a quantized lm_head):
// refused, naming the first few.
void refuse_unused(const ModelSpec& s, std::vector<const TensorInfo*> accounted) {
  std::sort(accounted.begin(), accounted.end());
  std::vector<std::string> unused;
  for (const std::string& name : s.files.names()) {
    const TensorInfo* t = s.files.find(name);
    if (!std::binary_search(accounted.begin(), accounted.end(), t) && !known_harmless(name))
      unused.push_back(name);
  }
  if (unused.empty()) return;
  const size_t shown = std::min<size_t>(unused.size(), 3);
  std::string list = fmt::format("{}", fmt::join(unused.begin(), unused.begin() + shown, ", "));
  if (unused.size() > shown) list += fmt::format(" and {} more", unused.size() - shown);
  throw Error(fmt::format("{}: the checkpoint holds {} tensor{} that {} as config.json describes "
                          "it does not use: {}", s.dir, unused.size(), unused.size() == 1 ? "" : "s",
                          s.config.architecture, list));
}

}  // namespace

ModelSpec load_model_spec(const std::string& dir) {
  ModelSpec spec;
  spec.dir = dir;
  spec.config = load_model_config(dir);
  const ModelConfig& c = spec.config;

  // AutoGPTQ names its weights <model_file_base_name>.safetensors, but files re-saved by
  // transformers keep that field while the weights become model.safetensors.
  std::string base = c.quant ? c.quant->model_file_base_name : "";
  if (!base.empty() && base != "model" && !ModelFiles::has_weights(dir, base)) {
    KESTREL_CHECK(ModelFiles::has_weights(dir, "model"),
                  fmt::format("{}: no {}.safetensors, {}.safetensors.index.json, model.safetensors "
                              "or model.safetensors.index.json", dir, base, base));
    base = "model";
  }
  spec.files = ModelFiles::open(dir, base);
  const ModelFiles& f = spec.files;

  // The family's names, or the same without the "model." prefix: checkpoints saved from the
  // bare decoder (facebook's original OPT files, some conversions) store them so, and
  // transformers loads either.
  TensorNames n = family_of(c).names;
  if (!f.find(n.embed + ".weight") && n.embed.starts_with("model.") &&
      f.find(n.embed.substr(6) + ".weight")) {
    for (std::string* name : {&n.embed, &n.positions, &n.final_norm, &n.layer})
      if (name->starts_with("model.")) *name = name->substr(6);
  }
  const int64_t hidden = c.hidden, vocab = c.vocab, inter = c.intermediate;
  const bool layer_norm = c.norm == NormKind::Layer;
  // A norm's weight [hidden] (and, for LayerNorm, its bias).
  auto norm = [&](const std::string& name, int64_t width, const TensorInfo*& weight,
                  const TensorInfo*& bias) {
    weight = float_tensor(f.get(name + ".weight"), {width});
    if (layer_norm) bias = float_tensor(f.get(name + ".bias"), {width});
  };
  spec.embed = float_tensor(f.get(n.embed + ".weight"), {vocab, hidden});
  if (c.positions == PositionKind::Learned)
    spec.positions = float_tensor(f.get(n.positions + ".weight"), {c.max_pos + c.position_offset, hidden});
  norm(n.final_norm, hidden, spec.final_norm, spec.final_norm_bias);
  const TensorInfo* head = f.find(n.lm_head + ".weight");
  if (c.tie_embeddings) {
    spec.lm_head = spec.embed;  // a saved copy of the tied weight, if any, is the same
  } else {
    KESTREL_CHECK(head, fmt::format("{}: missing tensor {}.weight (tie_word_embeddings is false)",
                                    dir, n.lm_head));
    spec.lm_head = float_tensor(*head, {vocab, hidden});
  }

  SpecReader r{c, f, spec.warnings};
  if (c.quant && !c.quant->dynamic.empty()) {
    // Keyed by the checkpoint's names, which may lack the "model." prefix the rules were
    // written against.
    const bool bare = n.layer != family_of(c).names.layer;
    const std::vector<std::string> modules = linear_modules(c);
    std::vector<int> deciding;
    const std::vector<std::optional<LinearQuant>> formats = linear_formats(c, dir, &deciding);
    for (size_t i = 0; i < modules.size(); ++i) {
      const std::string name = bare && modules[i].starts_with("model.") ? modules[i].substr(6) : modules[i];
      r.formats[name] = formats[i];
      if (deciding[i] >= 0) r.deciding_rule[name] = c.quant->dynamic[deciding[i]].key;
    }
  }
  spec.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("{}{}.", n.layer, i);
    LayerSpec& L = spec.layers[i];
    norm(p + n.input_norm, hidden, L.input_norm, L.input_norm_bias);
    norm(p + n.post_norm, hidden, L.post_norm, L.post_norm_bias);
    L.q = r.linear(p + n.q, c.q_dim(), hidden, c.qkv_bias);
    L.k = r.linear(p + n.k, c.kv_dim(), hidden, c.qkv_bias);
    L.v = r.linear(p + n.v, c.kv_dim(), hidden, c.qkv_bias);
    L.o = r.linear(p + n.o, hidden, c.q_dim(), c.o_bias);
    if (c.qk_norm) {
      L.q_norm = float_tensor(f.get(p + n.q_norm + ".weight"), {c.head_dim});
      L.k_norm = float_tensor(f.get(p + n.k_norm + ".weight"), {c.head_dim});
    }
    if (c.mlp == MlpKind::GatedSiLU) L.gate = r.linear(p + n.gate, inter, hidden, c.mlp_bias);
    L.up = r.linear(p + n.up, inter, hidden, c.mlp_bias);
    L.down = r.linear(p + n.down, hidden, inter, c.mlp_bias);
  }
  r.finish();

  std::vector<const TensorInfo*> used = spec_tensors(spec);
  std::vector<const TensorInfo*> accounted = used;
  accounted.insert(accounted.end(), r.ignored.begin(), r.ignored.end());
  if (c.tie_embeddings && head) accounted.push_back(head);  // a saved copy of the tied weight
  refuse_unused(spec, std::move(accounted));
  check_finite(used);
  return spec;
}

std::vector<std::string> linear_modules(const ModelConfig& c) {
  const TensorNames& n = family_of(c).names;
  std::vector<std::string> modules;
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("{}{}.", n.layer, i);
    for (const std::string* s : {&n.q, &n.k, &n.v, &n.o, &n.gate, &n.up, &n.down})
      if (s != &n.gate || c.mlp == MlpKind::GatedSiLU) modules.push_back(p + *s);
  }
  modules.push_back(n.lm_head);
  return modules;
}

std::vector<std::optional<LinearQuant>> linear_formats(const ModelConfig& c, const std::string& where,
                                                       std::vector<int>* deciding) {
  const std::vector<std::string> modules = linear_modules(c);
  std::vector<std::optional<LinearQuant>> out(modules.size());
  if (!c.quant) {
    if (deciding) deciding->assign(modules.size(), -1);
    return out;
  }
  out = resolve_modules(c.quant->base(), c.quant->dynamic, modules, where, deciding);
  out.back() = std::nullopt;  // lm_head
  return out;
}

std::string mixed_formats(const ModelSpec& s) {
  const LinearSpec* first = nullptr;
  for (const LayerSpec& L : s.layers)
    for (const LinearSpec* l : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) {
      if (!l->quantized) continue;
      if (!first) {
        first = l;
      } else if (l->bits != first->bits || l->group_size != first->group_size ||
                 l->zero_offset != first->zero_offset || l->sym != first->sym) {
        auto text = [](const LinearSpec& x) {
          return fmt::format("{}-bit group {}{}", x.bits, x.group_size, x.sym ? "" : " asym");
        };
        return fmt::format("{} is {}, {} is {}", first->name, text(*first), l->name, text(*l));
      }
    }
  return "";
}

std::vector<float> to_float(const TensorInfo& t) {
  switch (t.dtype) {
    case DType::F32:
      return t.copy_as<float>();
    case DType::F16:
    case DType::BF16: {
      const std::vector<uint16_t> h = t.copy_as<uint16_t>();
      std::vector<float> out(h.size());
      for (size_t i = 0; i < h.size(); ++i)
        out[i] = t.dtype == DType::F16 ? half_to_float(h[i]) : bf16_to_float(h[i]);
      return out;
    }
    case DType::I32:
      break;
  }
  throw Error(fmt::format("{} in {}: expected a F16/BF16/F32 tensor, found {}", t.name, t.file,
                          dtype_name(t.dtype)));
}

}  // namespace kestrel
