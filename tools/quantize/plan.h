// The mixed-precision planner of kestrel-quantize (issue #46): given, for every linear, the
// quantization error measured at each candidate setting (bits, group size) and that setting's
// exact size in the checkpoint, choose one setting per linear minimising the total error within
// a byte budget. Pure functions, no I/O: the quantizer measures, this decides, and the choices
// become the checkpoint's `dynamic` rules.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kestrel::quant {

// The bytes one GPTQ linear [N out, K in] occupies in a checkpoint at `bits` and `group_size`
// (-1: one group per row): qweight [K*bits/32, N] int32, qzeros [G, N*bits/32] int32, scales
// [G, N] fp16 and, with `g_idx`, g_idx [K] int32 (models/io/model_spec.h). K*bits and N*bits
// must be multiples of 32.
uint64_t gptq_linear_bytes(int64_t N, int64_t K, int bits, int group_size, bool g_idx = true);

struct PlanCandidate {
  int bits = 4;
  int group_size = 128;
  uint64_t bytes = 0;  // exact size of the linear at this setting (gptq_linear_bytes)
  double error = 0;    // estimated loss of the linear at this setting (e.g. GPTQ's weighted error)
};

struct PlanLinear {
  std::string name;                       // e.g. "model.layers.3.mlp.up_proj"
  std::vector<PlanCandidate> candidates;  // at least one
};

struct MixedPlan {
  std::vector<int> choice;  // per linear, the index of its chosen candidate
  uint64_t bytes = 0;       // exact total of the chosen candidates, <= the budget
  double error = 0;         // total estimated loss of the chosen candidates
};

// The choice minimising the total error with total bytes <= budget: a multiple-choice knapsack,
// solved exactly by dynamic programming over sizes counted in units of u bytes, u = the sum of
// every linear's largest candidate / `resolution`, rounded up (u = 1, exact in bytes, for small
// models). Each candidate's size is rounded up to whole units and the budget down, so a plan
// never exceeds the budget; the rounding can cost at most one unit per linear of the budget
// (0.003% of the largest plan per linear at the default resolution). u does not depend on the
// budget, so a larger budget never gives a larger total error. Throws kestrel::Error in one line
// when no plan fits (the budget under every linear at its smallest candidate), or for a linear
// without candidates.
MixedPlan plan_mixed_precision(const std::vector<PlanLinear>& linears, uint64_t budget,
                               int64_t resolution = int64_t(1) << 16);

}  // namespace kestrel::quant
