// The model families: what config.json's `architectures` chooses. A family states its config
// fields (models/io/families.cpp reads them into ModelConfig, refusing the variants it does
// not run), its tensor names, and the blocks its decoder layer composes (ModelConfig's norm,
// mlp, positions, biases, qk_norm), which the forwards of every device read. Adding a family
// like these is one entry in families.cpp.
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

struct Family {
  std::string name;          // "llama", "qwen3", ...
  std::string architecture;  // "LlamaForCausalLM", ...
  TensorNames names;
};

// The family of an architecture name; nullptr when none.
const Family* find_family(const std::string& architecture);
// The family a loaded config chose.
const Family& family_of(const ModelConfig& c);
// "LlamaForCausalLM, MistralForCausalLM, ...", for messages.
std::string supported_architectures();

}  // namespace kestrel
