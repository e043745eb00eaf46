// How a decode step's token leaves the kernel that picks it (argmax_f16, sample_top_k_f16).
// Device code only: include from .cu files.
#pragma once

namespace kestrel::cuda {

// The token to *out and, when given, to feed ({token, pos}: the next step's input, this token
// one position on) and to host_out (pinned host memory, seen once the step is done).
__device__ __forceinline__ void hand_out_token(int token, int* out, int* feed, int* host_out) {
  *out = token;
  if (feed) {
    feed[0] = token;
    feed[1] += 1;
  }
  if (host_out) *host_out = token;
}

}  // namespace kestrel::cuda
