// Where every weight of a model lives in its checkpoint, validated once.
//
// load_model_spec() opens a model directory, parses its config (engine/config.h), opens the
// weight files (engine/safetensors.h) and checks every tensor the architecture needs:
// presence, dtype and shape against the config, GPTQ tensor shapes against bits and group
// size, g_idx values in range; that the checkpoint holds no tensor the model does not use, and
// no NaN or Inf in any float tensor (models/io/finite.h). Anything wrong throws kestrel::Error
// with one line naming the file, the tensor and the numbers, e.g.
//   "model.layers.0.self_attn.q_proj.qweight in /m/model.safetensors: expected [512, 4096] I32, found [512, 4095] I32"
// After this, backends (the CPU reference, CUDA) read tensors without further checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/io/config.h"
#include "models/io/safetensors.h"

namespace kestrel {

// One linear layer y = x W^T (+ b), W is [N out, K in]: either a dense FP16/BF16/F32
// `.weight`, or GPTQ tensors.
struct LinearSpec {
  std::string name;  // e.g. "model.layers.3.self_attn.q_proj"
  int64_t N = 0, K = 0;
  bool quantized = false;
  const TensorInfo* weight = nullptr;   // dense: [N, K]
  const TensorInfo* qweight = nullptr;  // GPTQ: [K*bits/32, N] I32
  const TensorInfo* qzeros = nullptr;   // [G, N*bits/32] I32
  const TensorInfo* scales = nullptr;   // [G, N] F16
  const TensorInfo* g_idx = nullptr;    // [K] I32, or nullptr when absent (k / group_size)
  const TensorInfo* bias = nullptr;     // [N] or nullptr
  int bits = 0;
  int group_size = 0;   // as configured; -1 = one group
  int zero_offset = 1;  // 1 = gptq (v1), 0 = gptq_v2
  bool act_order = false;  // g_idx is not k / group_size
  bool sym = true;         // as configured for this linear (base config or its dynamic rule)
};

// The tensors a decoder layer of any family may have; those its family lacks stay null
// (or, for a linear, with no name).
struct LayerSpec {
  const TensorInfo* input_norm = nullptr;  // [hidden]
  const TensorInfo* post_norm = nullptr;   // [hidden]
  const TensorInfo* input_norm_bias = nullptr;  // [hidden] LayerNorm
  const TensorInfo* post_norm_bias = nullptr;   // [hidden] LayerNorm
  LinearSpec q, k, v, o;                   // q [q_dim, hidden], k/v [kv_dim, hidden], o [hidden, q_dim]
  const TensorInfo* q_norm = nullptr;      // [head_dim] Qwen3
  const TensorInfo* k_norm = nullptr;      // [head_dim]
  LinearSpec gate, up, down;               // gate/up [inter, hidden], down [hidden, inter]; no
                                           // gate in a ReLU MLP (up = fc1, down = fc2)
};

struct ModelSpec {
  std::string dir;
  ModelConfig config;
  ModelFiles files;
  const TensorInfo* embed = nullptr;       // [vocab, hidden]
  const TensorInfo* positions = nullptr;   // [max_pos + offset, hidden] learned positions
  const TensorInfo* final_norm = nullptr;  // [hidden]
  const TensorInfo* final_norm_bias = nullptr;  // [hidden] LayerNorm
  const TensorInfo* lm_head = nullptr;     // [vocab, hidden]; == embed when tied
  std::vector<LayerSpec> layers;
  // Non-fatal findings to show the user, e.g. a file labelled gptq that holds v2 zeros.
  std::vector<std::string> warnings;
};

ModelSpec load_model_spec(const std::string& dir);

// The names of a model's linears as a quantizer names them (the family's, "model." prefix
// included, whatever prefix the checkpoint's tensors have): layer by layer q, k, v, o, gate
// (gated MLPs), up, down, then lm_head. The names `dynamic` rules are matched against.
std::vector<std::string> linear_modules(const ModelConfig& c);
// The format of each of linear_modules(c) under c's quantization config and its dynamic rules
// (nullopt: unquantized, by a "-:" rule or with no quantization config); `deciding` as
// resolve_modules gives it. lm_head is unquantized whatever a rule says (a quantized lm_head is
// refused). Throws kestrel::Error naming `where` for a rule that matches no linear.
std::vector<std::optional<LinearQuant>> linear_formats(const ModelConfig& c, const std::string& where,
                                                       std::vector<int>* deciding = nullptr);

// The quantized linears of `s` in more than one format (bits, group size, zero convention),
// as GPTQModel's `dynamic` rules make them: "" when they share one, else a line naming two
// linears that differ. Unquantized (FP16) linears among quantized ones do not count.
std::string mixed_formats(const ModelSpec& s);

// Reads a 1-D or 2-D float tensor (F16, BF16 or F32) into fp32.
std::vector<float> to_float(const TensorInfo& t);

}  // namespace kestrel
