#include "models/io/config.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "engine/base/error.h"

namespace kestrel {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Reads a JSON file that must hold an object.
json read_json_object(const fs::path& path) {
  const std::string p = path.string();
  std::ifstream in(path);
  KESTREL_CHECK(in, fmt::format("{}: cannot open", p));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("{}: not valid JSON (error at byte {})", p, e.byte));
  }
  KESTREL_CHECK(j.is_object(), fmt::format("{}: holds a JSON {}, not an object", p, j.type_name()));
  return j;
}

// A field that is absent or null counts as absent: transformers writes null for unset options.
const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return (it == j.end() || it->is_null()) ? nullptr : &*it;
}

int to_int(const json& v, const char* key, const std::string& where) {
  KESTREL_CHECK(v.is_number_integer(),
                fmt::format("{}: {} must be an integer, found {}", where, key, v.dump()));
  const int64_t x = v.get<int64_t>();
  KESTREL_CHECK(x >= std::numeric_limits<int>::min() && x <= std::numeric_limits<int>::max(),
                fmt::format("{}: {} = {} is out of range", where, key, x));
  return (int)x;
}

int req_int(const json& j, const char* key, const std::string& where) {
  const json* v = field(j, key);
  KESTREL_CHECK(v, fmt::format("{}: missing {}", where, key));
  return to_int(*v, key, where);
}

int opt_int(const json& j, const char* key, const std::string& where, int def) {
  const json* v = field(j, key);
  return v ? to_int(*v, key, where) : def;
}

float opt_float(const json& j, const char* key, const std::string& where, float def) {
  const json* v = field(j, key);
  if (!v) return def;
  KESTREL_CHECK(v->is_number(), fmt::format("{}: {} must be a number, found {}", where, key, v->dump()));
  return v->get<float>();
}

bool opt_bool(const json& j, const char* key, const std::string& where, bool def) {
  const json* v = field(j, key);
  if (!v) return def;
  KESTREL_CHECK(v->is_boolean(), fmt::format("{}: {} must be true or false, found {}", where, key,
                                             v->dump()));
  return v->get<bool>();
}

std::string opt_string(const json& j, const char* key, const std::string& where,
                       const std::string& def) {
  const json* v = field(j, key);
  if (!v) return def;
  KESTREL_CHECK(v->is_string(), fmt::format("{}: {} must be a string, found {}", where, key, v->dump()));
  return v->get<std::string>();
}

QuantConfig parse_quant_json(const json& j, const std::string& where, QuantConfigSource source) {
  KESTREL_CHECK(j.is_object(), fmt::format("{}: not a JSON object", where));
  QuantConfig q;

  const char* method_key = field(j, "quant_method") ? "quant_method" : "method";
  const json* method = field(j, method_key);
  if (method) {
    KESTREL_CHECK(method->is_string(),
                  fmt::format("{}: {} must be a string, found {}", where, method_key, method->dump()));
    KESTREL_CHECK(method->get<std::string>() == "gptq",
                  fmt::format("{}: unsupported {} {} (supported: gptq)", where, method_key,
                              method->get<std::string>()));
  } else {
    KESTREL_CHECK(source == QuantConfigSource::QuantizeConfigJson,
                  fmt::format("{}: missing quant_method", where));
  }

  const char* format_key = field(j, "checkpoint_format") ? "checkpoint_format" : "format";
  const std::string format = opt_string(j, format_key, where, "gptq");
  if (format == "gptq") {
    q.format = GptqFormat::V1;
  } else if (format == "gptq_v2") {
    q.format = GptqFormat::V2;
  } else {
    throw Error(fmt::format("{}: unsupported {} {} (supported: gptq, gptq_v2)", where, format_key,
                            format));
  }

  q.bits = opt_int(j, "bits", where, 4);
  KESTREL_CHECK(q.bits == 2 || q.bits == 3 || q.bits == 4 || q.bits == 8,
                fmt::format("{}: unsupported bits {} (supported: 2, 3, 4, 8)", where, q.bits));
  q.group_size =
      opt_int(j, "group_size", where, source == QuantConfigSource::QuantizeConfigJson ? -1 : 128);
  KESTREL_CHECK(q.group_size == -1 || q.group_size > 0,
                fmt::format("{}: group_size {} must be -1 or positive", where, q.group_size));
  q.desc_act = opt_bool(j, "desc_act", where, false);
  q.sym = opt_bool(j, "sym", where, true);
  q.static_groups = opt_bool(j, "static_groups", where, false);
  q.damp_percent = opt_float(j, "damp_percent", where, 0.01f);
  q.model_file_base_name = opt_string(j, "model_file_base_name", where, "");

  if (const json* dyn = field(j, "dynamic")) {
    KESTREL_CHECK(dyn->empty(), fmt::format("{}: per-module overrides (dynamic, {} entries) are not "
                                            "supported", where, dyn->size()));
  }
  KESTREL_CHECK(!opt_bool(j, "lm_head", where, false),
                fmt::format("{}: a quantized lm_head (lm_head: true) is not supported", where));
  return q;
}

const char* format_name(GptqFormat f) { return f == GptqFormat::V1 ? "gptq" : "gptq_v2"; }

// Both files describe one checkpoint: a disagreement means one of them is stale.
void check_agree(const std::string& dir, const QuantConfig& a, const QuantConfig& b) {
  auto fail = [&](const char* what, const std::string& x, const std::string& y) {
    throw Error(fmt::format("{}: quantize_config.json and config.json quantization_config disagree "
                            "on {}: {} vs {}", dir, what, x, y));
  };
  auto str = [](bool v) { return std::string(v ? "true" : "false"); };
  if (a.bits != b.bits) fail("bits", std::to_string(a.bits), std::to_string(b.bits));
  if (a.group_size != b.group_size)
    fail("group_size", std::to_string(a.group_size), std::to_string(b.group_size));
  if (a.desc_act != b.desc_act) fail("desc_act", str(a.desc_act), str(b.desc_act));
  if (a.sym != b.sym) fail("sym", str(a.sym), str(b.sym));
  if (a.format != b.format) fail("checkpoint_format", format_name(a.format), format_name(b.format));
}

void parse_rope(const json& j, const std::string& where, ModelConfig& c) {
  c.rope_theta = opt_float(j, "rope_theta", where, 10000.0f);
  if (const json* rp = field(j, "rope_parameters")) {
    // transformers 5 moves rope_theta and the scaling into one object.
    const std::string w = where + " rope_parameters";
    KESTREL_CHECK(rp->is_object(), fmt::format("{}: not an object", w));
    c.rope_theta = opt_float(*rp, "rope_theta", w, c.rope_theta);
    const std::string type = opt_string(*rp, "rope_type", w, "default");
    if (type == "linear") {
      const json* f = field(*rp, "factor");
      KESTREL_CHECK(f, fmt::format("{}: linear rope_type without factor", w));
      c.rope_linear_factor = opt_float(*rp, "factor", w, 1.0f);
    } else if (type != "default") {
      throw Error(fmt::format("{}: unsupported rope_type {} (supported: default, linear)", w, type));
    }
  } else if (const json* rs = field(j, "rope_scaling")) {
    const std::string w = where + " rope_scaling";
    KESTREL_CHECK(rs->is_object(), fmt::format("{}: not an object", w));
    const char* type_key = field(*rs, "rope_type") ? "rope_type" : "type";
    const std::string type = opt_string(*rs, type_key, w, "");
    KESTREL_CHECK(!type.empty(), fmt::format("{}: missing type", w));
    if (type == "linear") {
      KESTREL_CHECK(field(*rs, "factor"), fmt::format("{}: linear {} without factor", w, type_key));
      c.rope_linear_factor = opt_float(*rs, "factor", w, 1.0f);
    } else if (type != "default") {
      throw Error(fmt::format("{}: unsupported {} {} (supported: linear)", w, type_key, type));
    }
  }
  KESTREL_CHECK(c.rope_theta > 0, fmt::format("{}: rope_theta {} must be positive", where, c.rope_theta));
  KESTREL_CHECK(c.rope_linear_factor > 0,
                fmt::format("{}: rope scaling factor {} must be positive", where, c.rope_linear_factor));
}

}  // namespace

QuantConfig parse_quant_config(const std::string& json_text, const std::string& where,
                               QuantConfigSource source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("{}: not valid JSON (error at byte {})", where, e.byte));
  }
  return parse_quant_json(j, where, source);
}

QuantConfig parse_quant_config(const std::string& json_text, const std::string& where) {
  const bool autogptq = fs::path(where).filename() == "quantize_config.json";
  return parse_quant_config(json_text, where,
                            autogptq ? QuantConfigSource::QuantizeConfigJson
                                     : QuantConfigSource::ConfigJson);
}

ModelConfig load_model_config(const std::string& dir) {
  std::error_code ec;
  KESTREL_CHECK(fs::is_directory(dir, ec), fmt::format("{}: no such directory", dir));
  const fs::path config_path = fs::path(dir) / "config.json";
  KESTREL_CHECK(fs::is_regular_file(config_path, ec),
                fmt::format("{}: no config.json", dir));
  const std::string where = config_path.string();
  const json j = read_json_object(config_path);
  ModelConfig c;

  const json* archs = field(j, "architectures");
  KESTREL_CHECK(archs, fmt::format("{}: missing architectures", where));
  KESTREL_CHECK(archs->is_array() && !archs->empty(),
                fmt::format("{}: architectures must be a non-empty list, found {}", where, archs->dump()));
  for (const json& a : *archs) {
    if (a != "LlamaForCausalLM" && a != "MistralForCausalLM") continue;
    c.architecture = a.get<std::string>();
    break;
  }
  KESTREL_CHECK(!c.architecture.empty(),
                fmt::format("{}: unsupported architectures {} (supported: LlamaForCausalLM, "
                            "MistralForCausalLM)", where, archs->dump()));

  c.hidden = req_int(j, "hidden_size", where);
  c.intermediate = req_int(j, "intermediate_size", where);
  c.n_layers = req_int(j, "num_hidden_layers", where);
  c.n_heads = req_int(j, "num_attention_heads", where);
  c.vocab = req_int(j, "vocab_size", where);
  c.max_pos = req_int(j, "max_position_embeddings", where);
  const auto positive = [&](const char* key, int v) {
    KESTREL_CHECK(v > 0, fmt::format("{}: {} = {} must be positive", where, key, v));
  };
  positive("hidden_size", c.hidden);
  positive("intermediate_size", c.intermediate);
  positive("num_hidden_layers", c.n_layers);
  positive("num_attention_heads", c.n_heads);
  positive("vocab_size", c.vocab);
  positive("max_position_embeddings", c.max_pos);

  c.n_kv_heads = opt_int(j, "num_key_value_heads", where, c.n_heads);
  positive("num_key_value_heads", c.n_kv_heads);
  KESTREL_CHECK(c.n_heads % c.n_kv_heads == 0,
                fmt::format("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                            where, c.n_heads, c.n_kv_heads));
  if (field(j, "head_dim")) {
    c.head_dim = req_int(j, "head_dim", where);
    positive("head_dim", c.head_dim);
  } else {
    KESTREL_CHECK(c.hidden % c.n_heads == 0,
                  fmt::format("{}: hidden_size {} is not a multiple of num_attention_heads {} (and "
                              "no head_dim is given)", where, c.hidden, c.n_heads));
    c.head_dim = c.hidden / c.n_heads;
  }
  // Rotary embeddings rotate pairs of dimensions.
  KESTREL_CHECK(c.head_dim % 2 == 0, fmt::format("{}: head_dim {} must be even", where, c.head_dim));

  c.rms_eps = opt_float(j, "rms_norm_eps", where, 1e-6f);
  KESTREL_CHECK(c.rms_eps > 0, fmt::format("{}: rms_norm_eps {} must be positive", where, c.rms_eps));
  parse_rope(j, where, c);

  c.sliding_window = opt_int(j, "sliding_window", where, 0);
  KESTREL_CHECK(c.sliding_window >= 0,
                fmt::format("{}: sliding_window {} must not be negative", where, c.sliding_window));
  c.tie_embeddings = opt_bool(j, "tie_word_embeddings", where, false);
  c.attention_bias = opt_bool(j, "attention_bias", where, false);
  c.mlp_bias = opt_bool(j, "mlp_bias", where, false);

  const char* dtype_key = field(j, "torch_dtype") ? "torch_dtype" : "dtype";
  const std::string dtype = opt_string(j, dtype_key, where, "float16");
  if (dtype == "float16") {
    c.dtype = DType::F16;
  } else if (dtype == "bfloat16") {
    c.dtype = DType::BF16;
  } else if (dtype == "float32") {
    c.dtype = DType::F32;
  } else {
    throw Error(fmt::format("{}: unsupported {} {} (supported: float16, bfloat16, float32)", where,
                            dtype_key, dtype));
  }

  // Quantization: AutoGPTQ's quantize_config.json and/or transformers' quantization_config.
  std::optional<QuantConfig> from_file, from_config;
  const fs::path qc_path = fs::path(dir) / "quantize_config.json";
  if (fs::is_regular_file(qc_path, ec)) {
    from_file = parse_quant_json(read_json_object(qc_path), qc_path.string(),
                                 QuantConfigSource::QuantizeConfigJson);
  }
  if (const json* qc = field(j, "quantization_config")) {
    from_config = parse_quant_json(*qc, where + " quantization_config", QuantConfigSource::ConfigJson);
  }
  if (from_file && from_config) {
    check_agree(dir, *from_file, *from_config);
    if (from_file->model_file_base_name.empty())
      from_file->model_file_base_name = from_config->model_file_base_name;
  }
  if (from_file) {
    c.quant = from_file;
  } else if (from_config) {
    c.quant = from_config;
  }
  return c;
}

}  // namespace kestrel
