// Top-k sampling on the GPU: the decode step's token drawn on the device, so that sampled
// decoding, like greedy, hands the host one id per token and can chain its steps. The rule and
// its CPU oracle are in sample.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/sampling/sample.h"

namespace kestrel::cuda {

// The workspace sample_top_k_f16 needs (bytes, any 16-byte aligned device memory), and its
// reset: once after allocating it, before the first call; every call leaves it reset.
size_t sample_top_k_workspace_bytes();
void sample_top_k_workspace_reset(void* workspace, cudaStream_t stream);

// Draws a token from logits [n] (fp16, device) by the parameters at `params` (device memory,
// TopKSampling; 1 <= top_k <= kDeviceTopKMax, temperature > 0) with the random number
// philox_uniform(params->seed, params->draws), then advances params->draws. The token goes to
// *d_out_token and, as argmax_f16 does, to feed ({token, pos}: token written, pos advanced) and
// to host_out (pinned host memory) when given. Up to 64 blocks, each selecting the top k of a
// chunk, the last one the top k of theirs and the draw; n up to kDeviceSampleMax. Calls that
// share a workspace must run one after another (one stream).
void sample_top_k_f16(const __half* logits, int n, TopKSampling* params, void* workspace,
                      int* d_out_token, cudaStream_t stream, int* feed = nullptr,
                      int* host_out = nullptr);

}  // namespace kestrel::cuda
