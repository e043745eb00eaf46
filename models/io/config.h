// Hyperparameters of a model, parsed and validated once from a Hugging Face model directory
// (config.json, quantize_config.json / quantization_config). The tokenizer reads its own
// special-token ids (tokenizer/tokenizer.h).
// Raw JSON never travels past the loader: everything downstream sees these structs.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/base/dtype.h"

namespace kestrel {

// GPTQ checkpoint zero-point convention (../docs: `checkpoint_format`).
enum class GptqFormat { V1 /* "gptq": zeros stored minus one */, V2 /* "gptq_v2": as is */ };

struct QuantConfig {
  int bits = 4;             // 2, 3, 4 or 8
  int group_size = 128;     // input columns per group; -1 = one group per row
  bool desc_act = false;    // act-order: g_idx not monotone
  bool sym = true;
  GptqFormat format = GptqFormat::V1;
  bool static_groups = false;  // informative
  float damp_percent = 0.01f;  // informative
  std::string model_file_base_name;  // AutoGPTQ: weights in <base>.safetensors; empty = model
  // Zero offset added to the stored zero: 1 for gptq (v1), 0 for gptq_v2.
  int zero_offset() const { return format == GptqFormat::V1 ? 1 : 0; }
};

struct ModelConfig {
  std::string architecture;  // as written in config.json, e.g. "LlamaForCausalLM"
  int hidden = 0;            // hidden_size
  int intermediate = 0;      // intermediate_size
  int n_layers = 0;          // num_hidden_layers
  int n_heads = 0;           // num_attention_heads
  int n_kv_heads = 0;        // num_key_value_heads (absent = n_heads)
  int head_dim = 0;          // head_dim (absent = hidden / n_heads)
  int vocab = 0;             // vocab_size
  int max_pos = 0;           // max_position_embeddings
  int sliding_window = 0;    // Mistral: attention window; 0 = none (whole context)
  float rms_eps = 1e-6f;     // rms_norm_eps
  float rope_theta = 10000.0f;
  float rope_linear_factor = 1.0f;  // linear rope_scaling: positions are divided by this
  bool tie_embeddings = false;
  bool attention_bias = false;  // q/k/v(/o) carry a bias
  bool mlp_bias = false;
  DType dtype = DType::F16;     // torch_dtype / dtype: F16 or BF16 (F32 accepted)
  std::optional<QuantConfig> quant;  // absent = unquantized model

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// Parses config.json and the quantization config of `dir`; throws kestrel::Error with one
// line naming the file, the field and the value for anything missing, unsupported or
// inconsistent.
ModelConfig load_model_config(const std::string& dir);

// Where a quantization config comes from; the two writers default group_size differently.
enum class QuantConfigSource {
  QuantizeConfigJson,  // AutoGPTQ's quantize_config.json: group_size -1, quant_method optional
  ConfigJson,          // transformers' config.json quantization_config: group_size 128,
                       // quant_method required
};

// Parses one quantization config object given as JSON text; `where` names its file for errors.
QuantConfig parse_quant_config(const std::string& json_text, const std::string& where,
                               QuantConfigSource source);
// As above, the source taken from `where`: a path ending in quantize_config.json is
// QuantizeConfigJson, anything else ConfigJson.
QuantConfig parse_quant_config(const std::string& json_text, const std::string& where);

}  // namespace kestrel
