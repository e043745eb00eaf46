// FP16 token embedding lookup on the GPU. The CPU oracle is embedding_f16_ref in embedding.h.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kestrel::cuda {

// out [hidden] = table [vocab, hidden] row *d_token. The token is read on the device (the
// previous step's argmax) so that a captured CUDA graph replays unchanged; the caller
// guarantees 0 <= *d_token < vocab.
void embedding_f16(const __half* table, const int* d_token, int hidden, __half* out,
                   cudaStream_t stream);

// out[j] = table[*d_token][perm[j]] (perm [hidden], device): the row in a permutation, for a
// decode step that keeps its residual stream in its first GEMV's act-order order.
void embedding_permuted_f16(const __half* table, const int* d_token, int hidden,
                            const int32_t* perm, __half* out, cudaStream_t stream);

// Learned positions (OPT): out [n, hidden], row i = table row d_tokens[i] + positions row
// (*d_pos0 + i), or row i where d_pos0 is nullptr (a caller with the first position on the
// host passes the table from that row). d_pos0 on the device lets a decode graph replay.
void embedding_positions_f16(const __half* table, const __half* positions, const int* d_tokens,
                             const int* d_pos0, int n, int hidden, __half* out,
                             cudaStream_t stream);

// out [n, hidden], row i = table row d_tokens[i] (prefill).
void embedding_tokens_f16(const __half* table, const int* d_tokens, int n, int hidden,
                          __half* out, cudaStream_t stream);

}  // namespace kestrel::cuda
