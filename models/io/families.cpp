// The model families Kestrel runs: for each, how config.json describes it (read into
// ModelConfig, with the variants it does not run refused in one line), its blocks and its
// tensor names.
#include <fmt/format.h>

#include "base/error.h"
#include "models/io/family.h"
#include "models/io/json_fields.h"

namespace kestrel {

using namespace json_fields;

namespace {

void positive(const std::string& where, const char* key, int v) {
  KESTREL_CHECK(v > 0, fmt::format("{}: {} = {} must be positive", where, key, v));
}

// The sizes every family states, each required and positive (the MLP's width under the
// family's own name).
void read_sizes(const json& j, const std::string& where, const char* intermediate_key,
                ModelConfig& c) {
  const std::pair<const char*, int*> sizes[] = {
      {"hidden_size", &c.hidden},       {intermediate_key, &c.intermediate},
      {"num_hidden_layers", &c.n_layers}, {"num_attention_heads", &c.n_heads},
      {"vocab_size", &c.vocab},         {"max_position_embeddings", &c.max_pos}};
  for (const auto& [key, field] : sizes) {
    *field = req_int(j, key, where);
    positive(where, key, *field);
  }
}

// rope_scaling (transformers 4) or rope_parameters (transformers 5): default, linear, llama3.
void read_rope(const json& j, const std::string& where, ModelConfig& c) {
  c.rope_theta = opt_float(j, "rope_theta", where, 10000.0f);
  const json* rp = field(j, "rope_parameters");
  const json* rs = rp ? rp : field(j, "rope_scaling");
  if (rs) {
    const std::string w = where + (rp ? " rope_parameters" : " rope_scaling");
    KESTREL_CHECK(rs->is_object(), fmt::format("{}: not an object", w));
    if (rp) c.rope_theta = opt_float(*rp, "rope_theta", w, c.rope_theta);
    const char* type_key = field(*rs, "rope_type") ? "rope_type" : "type";
    const std::string type = opt_string(*rs, type_key, w, rp ? "default" : "");
    KESTREL_CHECK(!type.empty(), fmt::format("{}: missing type", w));
    auto factor = [&] {
      KESTREL_CHECK(field(*rs, "factor"), fmt::format("{}: {} {} without factor", w, type_key, type));
      const float f = opt_float(*rs, "factor", w, 1.0f);
      KESTREL_CHECK(f > 0, fmt::format("{}: rope scaling factor {} must be positive", w, f));
      return f;
    };
    if (type == "linear") {
      c.rope_linear_factor = factor();
    } else if (type == "llama3") {
      RopeLlama3& r = c.rope_llama3;
      r.factor = factor();
      r.low_freq_factor = opt_float(*rs, "low_freq_factor", w, 1.0f);
      r.high_freq_factor = opt_float(*rs, "high_freq_factor", w, 4.0f);
      r.original_max_pos = opt_int(*rs, "original_max_position_embeddings", w, 8192);
      KESTREL_CHECK(r.high_freq_factor > r.low_freq_factor && r.low_freq_factor > 0 &&
                        r.original_max_pos > 0,
                    fmt::format("{}: llama3 needs 0 < low_freq_factor < high_freq_factor and a "
                                "positive original_max_position_embeddings", w));
    } else if (type != "default") {
      throw Error(fmt::format("{}: unsupported {} {} (supported: default, linear, llama3)", w,
                              type_key, type));
    }
  }
  KESTREL_CHECK(c.rope_theta > 0, fmt::format("{}: rope_theta {} must be positive", where, c.rope_theta));
}

// The shape shared by the Llama-like families: hidden, heads (GQA), head_dim, RMSNorm, RoPE.
void read_llama_shape(const json& j, const std::string& where, ModelConfig& c) {
  read_sizes(j, where, "intermediate_size", c);

  c.n_kv_heads = opt_int(j, "num_key_value_heads", where, c.n_heads);
  positive(where, "num_key_value_heads", c.n_kv_heads);
  KESTREL_CHECK(c.n_heads % c.n_kv_heads == 0,
                fmt::format("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                            where, c.n_heads, c.n_kv_heads));
  if (field(j, "head_dim")) {
    c.head_dim = req_int(j, "head_dim", where);
    positive(where, "head_dim", c.head_dim);
  } else {
    KESTREL_CHECK(c.hidden % c.n_heads == 0,
                  fmt::format("{}: hidden_size {} is not a multiple of num_attention_heads {} (and "
                              "no head_dim is given)", where, c.hidden, c.n_heads));
    c.head_dim = c.hidden / c.n_heads;
  }
  // Rotary embeddings rotate pairs of dimensions.
  KESTREL_CHECK(c.head_dim % 2 == 0, fmt::format("{}: head_dim {} must be even", where, c.head_dim));

  // The gated MLP applies SiLU (transformers spells it silu or swish).
  const std::string act = opt_string(j, "hidden_act", where, "silu");
  KESTREL_CHECK(act == "silu" || act == "swish",
                fmt::format("{}: hidden_act {} is not supported (this family's MLP uses silu)",
                            where, act));

  c.rms_eps = opt_float(j, "rms_norm_eps", where, 1e-6f);
  KESTREL_CHECK(c.rms_eps > 0, fmt::format("{}: rms_norm_eps {} must be positive", where, c.rms_eps));
  read_rope(j, where, c);
  c.tie_embeddings = opt_bool(j, "tie_word_embeddings", where, false);
}

void read_window(const json& j, const std::string& where, ModelConfig& c) {
  c.sliding_window = opt_int(j, "sliding_window", where, 0);
  KESTREL_CHECK(c.sliding_window >= 0,
                fmt::format("{}: sliding_window {} must not be negative", where, c.sliding_window));
}

// Qwen's configs carry sliding_window with use_sliding_window false: the window is off.
void refuse_qwen_window(const json& j, const std::string& where) {
  KESTREL_CHECK(!opt_bool(j, "use_sliding_window", where, false),
                fmt::format("{}: use_sliding_window true (Qwen's per-layer window) is not supported", where));
}

// OPT's keys (pre-LayerNorm variants, biases on every linear, lm_head tied to the embedding by
// default), refusing those that would change its blocks.
void read_opt(const json& j, const std::string& where, ModelConfig& c) {
  read_sizes(j, where, "ffn_dim", c);
  KESTREL_CHECK(c.hidden % c.n_heads == 0,
                fmt::format("{}: hidden_size {} is not a multiple of num_attention_heads {}", where,
                            c.hidden, c.n_heads));
  c.n_kv_heads = c.n_heads;
  c.head_dim = c.hidden / c.n_heads;
  KESTREL_CHECK(opt_bool(j, "do_layer_norm_before", where, true),
                fmt::format("{}: do_layer_norm_before false (OPT-350m's post-LayerNorm) is not supported", where));
  const int proj = opt_int(j, "word_embed_proj_dim", where, c.hidden);
  KESTREL_CHECK(proj == c.hidden,
                fmt::format("{}: word_embed_proj_dim {} differs from hidden_size {} (a projected "
                            "embedding) and is not supported", where, proj, c.hidden));
  const std::string act = opt_string(j, "activation_function", where, "relu");
  KESTREL_CHECK(act == "relu", fmt::format("{}: activation_function {} is not supported (relu)", where, act));
  KESTREL_CHECK(opt_bool(j, "layer_norm_elementwise_affine", where, true),
                fmt::format("{}: layer_norm_elementwise_affine false is not supported", where));
  KESTREL_CHECK(opt_bool(j, "enable_bias", where, true),
                fmt::format("{}: enable_bias false (OPT without biases) is not supported", where));
  c.rms_eps = 1e-5f;  // OPT's LayerNorm epsilon (torch's default)
  c.tie_embeddings = opt_bool(j, "tie_word_embeddings", where, true);
}

TensorNames opt_names() {
  TensorNames n;
  n.embed = "model.decoder.embed_tokens";
  n.positions = "model.decoder.embed_positions";
  n.final_norm = "model.decoder.final_layer_norm";
  n.layer = "model.decoder.layers.";
  n.input_norm = "self_attn_layer_norm";
  n.post_norm = "final_layer_norm";
  n.o = "self_attn.out_proj";
  n.gate = "";
  n.up = "fc1";
  n.down = "fc2";
  return n;
}

TensorNames qwen3_names() {
  TensorNames n;
  n.q_norm = "self_attn.q_norm";
  n.k_norm = "self_attn.k_norm";
  return n;
}

}  // namespace

const std::vector<Family>& all_families() {
  // Each entry gives its blocks, switches and names, {} for the defaults: GCC 12 warns
  // (-Wmissing-field-initializers) about any left out.
  static const std::vector<Family> all = {
      // transformers' Llama: optional biases and no window (a sliding_window in its config is
      // ignored there, so here too).
      {.name = "llama",
       .architecture = "LlamaForCausalLM",
       .blocks = {},
       .switches = {.attention_bias = true, .mlp_bias = true},
       .names = {}},
      {.name = "mistral",
       .architecture = "MistralForCausalLM",
       .blocks = {},
       .switches = {.sliding_window = true},
       .names = {}},
      // Qwen2's q, k, v always carry biases, o none.
      {.name = "qwen2",
       .architecture = "Qwen2ForCausalLM",
       .blocks = {.qkv_bias = true},
       .switches = {.use_sliding_window = true},
       .names = {}},
      {.name = "qwen3",
       .architecture = "Qwen3ForCausalLM",
       .blocks = {.qk_norm = true},
       .switches = {.attention_bias = true, .use_sliding_window = true},
       .names = qwen3_names()},
      // OPT: LayerNorm with bias, biases on every linear, learned positions offset by 2, a ReLU
      // MLP.
      {.name = "opt",
       .architecture = "OPTForCausalLM",
       .keys = ConfigKeys::Opt,
       .blocks = {.norm = NormKind::Layer,
                  .mlp = MlpKind::ReLU,
                  .positions = PositionKind::Learned,
                  .position_offset = 2,
                  .qkv_bias = true,
                  .o_bias = true,
                  .mlp_bias = true},
       .switches = {},
       .names = opt_names()},
  };
  return all;
}

const Family* find_family(const std::string& architecture) {
  for (const Family& f : all_families())
    if (f.architecture == architecture) return &f;
  return nullptr;
}

const Family& family_of(const ModelConfig& c) {
  const Family* f = find_family(c.architecture);
  KESTREL_CHECK(f, fmt::format("internal: no family for {}", c.architecture));
  return *f;
}

std::string supported_architectures() {
  std::string out;
  for (const Family& f : all_families()) out += (out.empty() ? "" : ", ") + f.architecture;
  return out;
}

void read_family_config(const json& j, const std::string& where, ModelConfig& c) {
  const json* archs = field(j, "architectures");
  KESTREL_CHECK(archs, fmt::format("{}: missing architectures", where));
  KESTREL_CHECK(archs->is_array() && !archs->empty(),
                fmt::format("{}: architectures must be a non-empty list, found {}", where, archs->dump()));
  // A checkpoint holds the weights of one model class; two classes would leave it to chance
  // which one's layout the tensors follow.
  KESTREL_CHECK(archs->size() == 1,
                fmt::format("{}: architectures lists {} classes ({}); a checkpoint must name one",
                            where, archs->size(), archs->dump()));
  const json& arch = archs->front();
  const Family* f = arch.is_string() ? find_family(arch.get<std::string>()) : nullptr;
  KESTREL_CHECK(f, fmt::format("{}: unsupported architectures {} (supported: {})", where,
                               archs->dump(), supported_architectures()));
  c.architecture = f->architecture;
  c.family = f->name;
  if (f->keys == ConfigKeys::Opt)
    read_opt(j, where, c);
  else
    read_llama_shape(j, where, c);

  const Blocks& b = f->blocks;
  c.norm = b.norm;
  c.mlp = b.mlp;
  c.positions = b.positions;
  c.position_offset = b.position_offset;
  c.qk_norm = b.qk_norm;
  c.qkv_bias = b.qkv_bias;
  c.o_bias = b.o_bias;
  c.mlp_bias = b.mlp_bias;

  const Switches& s = f->switches;
  if (s.sliding_window) read_window(j, where, c);
  if (s.use_sliding_window) refuse_qwen_window(j, where);
  if (s.attention_bias && opt_bool(j, "attention_bias", where, false)) c.qkv_bias = c.o_bias = true;
  if (s.mlp_bias && opt_bool(j, "mlp_bias", where, false)) c.mlp_bias = true;
}

}  // namespace kestrel
