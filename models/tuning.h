// Choices of the CUDA decode path that a benchmark may want to flip, given to the model at
// load (kestrel bench --att-heads, --gemv-warps, --gemv-generic, --no-graph-ranges,
// --small-gemm, --no-verify-graphs). The defaults are the measured best on the H200
// (docs/tuning.md); each field is covered by a test that runs the model both ways (against the
// CPU reference, or against the other setting where both must agree bit for bit).
#pragma once

namespace kestrel {

struct DecodeTuning {
  // Query heads per block of decode attention under GQA: 0 = chosen by head_dim and the graph's
  // range of positions; else 1, 2 or 4.
  int attention_heads_per_block = 0;
  // Warps per block of the specialized quantized GEMVs: 0 = by the weight's shape; else 8 or 16.
  int gemv_block_warps = 0;
  // The quantized GEMVs' kernels specialized by the call's fusions; false runs the generic
  // kernel for every call (for comparing the two).
  bool gemv_specialized = true;
  // One decode graph per range of positions ([0, 512), [512, 1024), ... each twice the last),
  // attention's grid sized for the range; false captures one range, the whole context.
  bool graph_ranges = true;
  // Passes of 3 .. this many tokens (prompt chunks, speculative verification; at most 64) run
  // their quantized linears through the fused small-M GEMM (kernels/gemm/gemm_small.h), which
  // reads each weight once for all the tokens, instead of one GEMV per token or dequantize +
  // cuBLASLt. 0 = off. 64 (all it takes) by default: reading each weight once for all the
  // rows, a layer costs less than M GEMVs from M = 3 on and less than dequantize + cuBLASLt,
  // which writes and reads an FP16 copy of every weight (docs/gemm-small.md).
  int small_gemm_max_rows = 64;
  // Speculative verify passes (forward_argmax_rows of 2 .. 65 tokens) replayed from a CUDA
  // graph per session and token count, captured after that count's first pass; false launches
  // every pass's kernels from the host. Either way the same kernels run with the same
  // arguments: the ids are identical. On by default: a pass is hundreds of short kernels, whose
  // host launches would otherwise cost more than the kernels (docs/speculative.md).
  bool verify_graphs = true;
};

}  // namespace kestrel
