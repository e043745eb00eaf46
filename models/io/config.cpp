#include "models/io/config.h"

#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "base/error.h"
#include "base/files.h"
#include "models/io/family.h"
#include "models/io/json_fields.h"

namespace kestrel {

namespace fs = std::filesystem;

namespace {

using namespace json_fields;

// The override values a dynamic rule may hold, each checked as the base config's field is.
void read_override(DynamicRule& r, const std::string& key, const json& v, const std::string& where) {
  const std::string at = fmt::format("{}: dynamic rule \"{}\"", where, r.key);
  if (key == "bits") {
    const int b = to_int(v, "bits", at);
    KESTREL_CHECK(b == 2 || b == 3 || b == 4 || b == 8,
                  fmt::format("{}: unsupported bits {} (supported: 2, 3, 4, 8)", at, b));
    r.bits = b;
  } else if (key == "group_size") {
    const int g = to_int(v, "group_size", at);
    KESTREL_CHECK(g == -1 || g > 0, fmt::format("{}: group_size {} must be -1 or positive", at, g));
    r.group_size = g;
  } else if (key == "desc_act" || key == "sym" || key == "static_groups") {
    KESTREL_CHECK(v.is_boolean(), fmt::format("{}: {} must be true or false, found {}", at, key,
                                              v.dump()));
    if (key == "desc_act") r.desc_act = v.get<bool>();
    if (key == "sym") r.sym = v.get<bool>();
  } else if (key == "damp_percent" || key == "mse") {
    // The quantizer's settings: informative, as at the top level.
    KESTREL_CHECK(v.is_number(), fmt::format("{}: {} must be a number, found {}", at, key,
                                             v.dump()));
  } else {
    throw Error(fmt::format("{}: unknown override {} (supported: bits, group_size, desc_act, sym)",
                            at, key));
  }
}

// GPTQModel's `dynamic`: an object from rule keys to override objects, in the file's order.
std::vector<DynamicRule> parse_dynamic(const json& dyn, const std::string& where) {
  KESTREL_CHECK(dyn.is_object(), fmt::format("{}: dynamic must be an object of module regexes, "
                                             "found {}", where, dyn.type_name()));
  std::vector<DynamicRule> rules;
  for (const auto& [key, overrides] : dyn.items()) {
    DynamicRule r = dynamic_rule(key, where);
    KESTREL_CHECK(overrides.is_object(),
                  fmt::format("{}: dynamic rule \"{}\": overrides must be an object, found {}",
                              where, key, overrides.dump()));
    for (const auto& [name, v] : overrides.items())
      if (!v.is_null()) read_override(r, name, v, where);
    rules.push_back(std::move(r));
  }
  return rules;
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

  if (const json* dyn = field(j, "dynamic")) q.dynamic = parse_dynamic(*dyn, where);
  KESTREL_CHECK(!opt_bool(j, "lm_head", where, false),
                fmt::format("{}: a quantized lm_head (lm_head: true) is not supported", where));
  return q;
}

const char* format_name(GptqFormat f) { return f == GptqFormat::V1 ? "gptq" : "gptq_v2"; }

// Both files describe one checkpoint: a disagreement means one of them is stale.
void check_agree(const std::string& dir, const QuantConfig& a, const QuantConfig& b) {
  auto fail = [&](const std::string& what, const std::string& x, const std::string& y) {
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
  if (a.dynamic != b.dynamic) {
    size_t i = 0;  // the first rule that differs
    while (i < a.dynamic.size() && i < b.dynamic.size() && a.dynamic[i] == b.dynamic[i]) ++i;
    auto rule = [&](const std::vector<DynamicRule>& d) {
      return i < d.size() ? fmt::format("\"{}\"", d[i].key) : std::string("none");
    };
    fail(fmt::format("dynamic rule {}", i + 1), rule(a.dynamic), rule(b.dynamic));
  }
}

}  // namespace

QuantConfig parse_quant_config(const std::string& json_text, const std::string& where,
                               QuantConfigSource source) {
  return parse_quant_json(parse_json(json_text, where), where, source);
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
  KESTREL_CHECK(path_exists(config_path.string()), fmt::format("{}: no config.json", dir));
  const std::string where = config_path.string();
  const json j = read_json_object(config_path);
  ModelConfig c;

  read_family_config(j, where, c);  // architectures, shape, blocks (families.cpp)

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
  if (path_exists(qc_path.string())) {
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

void ModelConfig::check_context(int ctx) const {
  KESTREL_CHECK(positions != PositionKind::Learned || ctx <= max_pos,
                fmt::format("a context of {} positions is past the {} this model has learned "
                            "position embeddings for; use -c {} or less", ctx, max_pos, max_pos));
}

}  // namespace kestrel
