// The decoder layer on the GPU, written once for every mode and composed from named blocks, as
// llama.cpp's models build theirs from build_norm / build_attn / build_ffn. The blocks take the
// family's choices from ModelConfig (q/k head norms, the MLP's kind); how each op runs is the
// mode's (`Op`):
//   - DecodeOps (models/gpu/decode_step.cpp): one token per step, captured in CUDA graphs.
//     GEMVs stage x through the block's norm and finish with its residual, bias and activation
//     (kernels/gemv/gemv.h); RoPE and the KV write run inside decode attention; act-order layers
//     keep the residual stream in the permutation of the GEMV that reads it next.
//   - RowsOps (models/gpu/layer_rows.cpp): T tokens at once (a prompt chunk, a speculative
//     verify pass, the quantizer's calibration). Norms, GEMMs (the fused small-M GEMM, or
//     dequantize + cuBLASLt) and tensor-core attention over the rows, each a kernel of its own;
//     taps hand each linear group's input to the quantizer.
// An op returns false where the caller asked the layer to stop there (a tap's stop_after);
// the decode step's never do. A new block (a MoE MLP, say) is one function here and one op per
// mode.
#pragma once

#include "models/io/config.h"
#include "models/gpu/weights.h"

namespace kestrel {

// x += Wo attention(rope(Wqkv norm(x) + b)) (+ bo)
template <class Op>
bool attention_block(const ModelConfig& c, const GpuLayer& L, Op& op) {
  if (!op.norm_qkv(L)) return false;  // qkv = Wqkv norm(x) (+ the q|k|v biases)
  if (c.qk_norm) op.head_norms(L);    // Qwen3: RMSNorm over each head of q and k, before RoPE
  op.attention(L);                    // RoPE of q and the new k, the KV write, causal attention
  return op.o(L);                     // x += Wo att (+ bo)
}

// x += Wdown (silu(Wgate xb) * Wup xb), xb = norm(x); or (a ReLU MLP, OPT)
// x += Wfc2 relu(Wfc1 xb + b1) + b2
template <class Op>
bool mlp_block(const ModelConfig& c, const GpuLayer& L, Op& op) {
  if (c.mlp == MlpKind::ReLU) return op.norm_fc1_relu(L) && op.fc2(L);
  return op.norm_gate_up(L) && op.down(L);  // SiLU(gate) * up between them: the mode's choice
}

template <class Op>
bool decoder_layer(const ModelConfig& c, const GpuLayer& L, Op& op) {
  return attention_block(c, L, op) && mlp_block(c, L, op);
}

}  // namespace kestrel
