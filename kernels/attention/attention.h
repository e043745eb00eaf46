// Causal attention with grouped-query heads over a KV cache.
#pragma once

#include <cstdint>

namespace kestrel {

// One query position attends over cached positions 0 .. n_ctx-1 (the query's own K/V
// already written at n_ctx-1).
//   q       [n_heads, head_dim]
//   k_cache [max_ctx, n_kv_heads, head_dim], v_cache likewise
//   out     [n_heads, head_dim]
// Query head h reads KV head h / (n_heads / n_kv_heads). Scale 1/sqrt(head_dim).
void attention_ref(const float* q, const float* k_cache, const float* v_cache, int n_heads,
                   int n_kv_heads, int head_dim, int64_t n_ctx, float* out);

}  // namespace kestrel
