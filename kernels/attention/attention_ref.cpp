// Plain C++ single-query attention over a KV cache, grouped-query heads.
// Scores and outputs accumulate in fp32; the softmax is the stable one of softmax_ref.
#include "kernels/attention/attention.h"

#include <cmath>
#include <string>
#include <vector>

#include "base/error.h"
#include "kernels/activation/activation.h"

namespace kestrel {

void attention_ref(const float* q, const float* k_cache, const float* v_cache, int n_heads,
                   int n_kv_heads, int head_dim, int64_t n_ctx, float* out) {
  KESTREL_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                "attention_ref: n_heads " + std::to_string(n_heads) +
                    " is not a multiple of n_kv_heads " + std::to_string(n_kv_heads));
  KESTREL_CHECK(n_ctx > 0, "attention_ref: n_ctx must be positive, got " + std::to_string(n_ctx));
  const int group = n_heads / n_kv_heads;  // query heads sharing one KV head
  const int64_t pos_stride = (int64_t)n_kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt((float)head_dim);
  std::vector<float> p(n_ctx);
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + (int64_t)h * head_dim;
    const int64_t kv_off = (int64_t)(h / group) * head_dim;
    for (int64_t t = 0; t < n_ctx; ++t) {
      const float* kt = k_cache + t * pos_stride + kv_off;
      float dot = 0.0f;
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * kt[d];
      p[t] = dot * scale;
    }
    softmax_ref(p.data(), n_ctx);
    float* oh = out + (int64_t)h * head_dim;
    for (int d = 0; d < head_dim; ++d) oh[d] = 0.0f;
    for (int64_t t = 0; t < n_ctx; ++t) {
      const float* vt = v_cache + t * pos_stride + kv_off;
      for (int d = 0; d < head_dim; ++d) oh[d] += p[t] * vt[d];
    }
  }
}

}  // namespace kestrel
