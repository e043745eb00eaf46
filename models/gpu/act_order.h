// Act-order (desc_act) GPTQ weights permute their K axis so that each group's rows are
// contiguous; a GEMV then stages its x gathered through that permutation in every block. The
// planner removes the gathers from the decode step where it can, at load:
//   - the gate|up GEMV stores SiLU * up already in down's permutation (GpuLayer::down_x_index);
//   - the residual stream is kept in the permutation of the GEMV that reads it next
//     (GpuLayer::StreamOrder): o and down read their residual through one index and store
//     through another, attention stores in o's permutation, the embedding row is gathered
//     into layer 0's qkv order, the norm weights are permuted alike.
#pragma once

#include <cuda_runtime.h>

#include "models/gpu/memory.h"
#include "models/gpu/weights.h"
#include "models/io/config.h"

namespace kestrel {

// Fills GpuLayer::down_x_index/down_x_permuted, GpuLayer::order and GpuWeights::embed_perm
// where the weights allow it; the indices and permuted norms go into `mem`.
void plan_act_order(GpuWeights& w, const ModelConfig& c, DeviceMemory& mem, cudaStream_t s);

}  // namespace kestrel
