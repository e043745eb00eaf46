// The model families: what config.json's `architectures` chooses. A family states how its
// config is spelt (models/io/families.cpp reads it into ModelConfig, refusing the variants it
// does not run), the blocks its decoder layer composes (ModelConfig's norm, mlp, positions,
// biases, qk_norm, which the forwards of every device read) and its tensor names. The table is
// the one description of a family: kestrel-synth writes checkpoints from it too. Adding a
// family with the layer of one of these is one entry in families.cpp.
#pragma once

#include <string>
#include <vector>

#include "models/io/config.h"

namespace kestrel {

// Checkpoint tensor names, without ".weight" / ".bias"; layer names follow `layer` + "{i}.".
// An empty name: the family has no such tensor.
struct TensorNames {
  std::string embed = "model.embed_tokens";
  std::string positions;  // learned position table
  std::string final_norm = "model.norm";
  std::string lm_head = "lm_head";
  std::string layer = "model.layers.";
  std::string input_norm = "input_layernorm", post_norm = "post_attention_layernorm";
  std::string q = "self_attn.q_proj", k = "self_attn.k_proj", v = "self_attn.v_proj";
  std::string o = "self_attn.o_proj";
  std::string q_norm, k_norm;  // per-head norms of q and k
  std::string gate = "mlp.gate_proj", up = "mlp.up_proj", down = "mlp.down_proj";
};

// How config.json states a family's shape: transformers' Llama keys (intermediate_size,
// num_key_value_heads, head_dim, hidden_act, rms_norm_eps, RoPE) or OPT's (ffn_dim, one KV head
// per head, activation_function, LayerNorm).
enum class ConfigKeys { Llama, Opt };

// The blocks of a family's decoder layer that are the same in all its checkpoints
// (ModelConfig's fields of these names); a Switch may add biases.
struct Blocks {
  NormKind norm = NormKind::RMS;
  MlpKind mlp = MlpKind::GatedSiLU;
  PositionKind positions = PositionKind::Rope;
  int position_offset = 0;  // Learned: row of position p is p + offset (OPT: 2)
  bool qk_norm = false;     // per-head norms of q and k (names.q_norm, names.k_norm)
  bool qkv_bias = false, o_bias = false, mlp_bias = false;
};

// The optional config.json switches a family reads beyond its shape; the others it never sees
// (transformers' class of that family ignores them too).
struct Switches {
  bool attention_bias = false;      // attention_bias: biases on q, k, v and o
  bool mlp_bias = false;            // mlp_bias: biases on the MLP's linears
  bool sliding_window = false;      // sliding_window: one attention window for every layer
  bool use_sliding_window = false;  // Qwen's use_sliding_window: per-layer windows, refused
};

struct Family {
  std::string name;          // "llama", "qwen3", ...: also config.json's model_type
  std::string architecture;  // "LlamaForCausalLM", ...
  ConfigKeys keys = ConfigKeys::Llama;
  Blocks blocks;
  Switches switches;
  TensorNames names;
};

// Every family, in the table's order.
const std::vector<Family>& all_families();
// The family of an architecture name; nullptr when none.
const Family* find_family(const std::string& architecture);
// The family a loaded config chose.
const Family& family_of(const ModelConfig& c);
// "LlamaForCausalLM, MistralForCausalLM, ...", for messages.
std::string supported_architectures();

}  // namespace kestrel
