// Hyperparameters of a model, parsed and validated once from a Hugging Face model directory
// (config.json, quantize_config.json / quantization_config). The tokenizer reads its own
// special-token ids (tokenizer/tokenizer.h).
// Raw JSON never travels past the loader: everything downstream sees these structs.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "models/io/dynamic.h"
#include "kernels/rope/rope.h"

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
  // GPTQModel's per-module overrides, in the file's order (models/io/dynamic.h); empty = every
  // quantized linear has the format above.
  std::vector<DynamicRule> dynamic;
  // The format the fields above give a linear that no dynamic rule matches.
  LinearQuant base() const { return {bits, group_size, desc_act, sym}; }
  // Zero offset added to the stored zero: 1 for gptq (v1), 0 for gptq_v2.
  int zero_offset() const { return format == GptqFormat::V1 ? 1 : 0; }
};

// The blocks a family's decoder layer is made of (models/io/family.h names them per family).
enum class NormKind { RMS /* RMSNorm, weight */, Layer /* LayerNorm, weight and bias */ };
enum class MlpKind { GatedSiLU /* down(silu(gate x) * up x) */, ReLU /* fc2(relu(fc1 x)) */ };
enum class PositionKind { Rope /* rotary, on q and k */, Learned /* a table added to the embedding */ };

// Llama 3's rope_scaling (rope_type "llama3"): long wavelengths divided by factor, short ones
// kept, those between blended.
struct RopeLlama3 {
  float factor = 0;  // 0 = not used
  float low_freq_factor = 1, high_freq_factor = 4;
  int original_max_pos = 8192;
};

struct ModelConfig {
  std::string architecture;  // as written in config.json, e.g. "LlamaForCausalLM"
  std::string family;        // the family it chose: llama, mistral, qwen2, qwen3, opt
  NormKind norm = NormKind::RMS;
  MlpKind mlp = MlpKind::GatedSiLU;
  PositionKind positions = PositionKind::Rope;
  int position_offset = 0;   // Learned: row of position p is p + offset (OPT: 2)
  bool qk_norm = false;      // Qwen3: RMSNorm over each head of q and k before RoPE
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
  RopeLlama3 rope_llama3;
  bool tie_embeddings = false;
  bool qkv_bias = false;     // q, k, v carry a bias (Llama's attention_bias, Qwen2, OPT)
  bool o_bias = false;       // o carries one (Llama's attention_bias, OPT)
  bool mlp_bias = false;     // the MLP's linears do (Llama's mlp_bias, OPT)
  DType dtype = DType::F16;     // torch_dtype / dtype: F16 or BF16 (F32 accepted)
  std::optional<QuantConfig> quant;  // absent = unquantized model

  int q_dim() const { return n_heads * head_dim; }
  // Throws kestrel::Error when a context of `ctx` positions is past what the model can
  // represent: learned positions (OPT) have a table of max_pos rows and nothing beyond.
  void check_context(int ctx) const;
  RopeScaling rope_scaling() const {
    return {rope_theta, rope_linear_factor, rope_llama3.factor, rope_llama3.low_freq_factor,
            rope_llama3.high_freq_factor, rope_llama3.original_max_pos,
            positions == PositionKind::Rope};
  }
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
