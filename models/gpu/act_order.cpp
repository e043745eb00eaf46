#include "models/gpu/act_order.h"

#include <vector>

#include "kernels/common/cuda_utils.h"

namespace kestrel {

namespace {

// Copies v to device memory at `cursor` and moves the cursor past it; returns where it went.
const int32_t* upload_at(int32_t*& cursor, const std::vector<int32_t>& v) {
  KESTREL_CUDA_CHECK(
      cudaMemcpy(cursor, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  cursor += v.size();
  return cursor - v.size();
}

// Act-order down weights gather their x through the permutation in every block (K = 11008 on
// a 7B: 44 KB of indices per block); the gate|up GEMV before writes x in that order instead
// (GpuLayer::down_x_index).
void permute_down_inputs(GpuWeights& w, DeviceMemory& mem, cudaStream_t s) {
  auto wants = [&](const GpuLayer& g) {
    return g.gate_up.can_silu_epilogue() && g.down.quantized && g.down.q.has_perm;
  };
  size_t n = 0;
  for (const GpuLayer& g : w.layers)
    if (wants(g)) n += (size_t)g.down.K;
  if (n == 0) return;
  auto* d = mem.alloc_n<int32_t>(n);
  for (GpuLayer& g : w.layers) {
    if (!wants(g)) continue;
    g.down_x_index = upload_at(d, cuda::gemv_input_index(g.down.q, s));
    g.down_x_permuted = g.down;
    g.down_x_permuted.q = cuda::gemv_input_permuted(g.down.q);
  }
}

// Act-order models: the decode step keeps the residual stream in the permutation of the GEMV
// that reads it next (GpuLayer::StreamOrder), so that the qkv and gate|up GEMVs stage x as it
// is, without a gather; o and down read their residual through one index and store through
// another. All layers or none, as each down writes the next layer's order: every linear
// quantized and fused, qkv and gate|up act-order. Where o has act-order too, attention stores
// its output in o's permutation.
void permute_residual_stream(GpuWeights& w, const ModelConfig& c, DeviceMemory& mem,
                             cudaStream_t s) {
  if (w.layers.empty()) return;
  auto single = [](const GpuLinear& l) { return l.quantized && l.parts.empty(); };
  for (const GpuLayer& g : w.layers)
    if (!single(g.qkv) || !single(g.o) || !single(g.gate_up) || !single(g.down) ||
        !g.qkv.q.has_perm || !g.gate_up.q.has_perm)
      return;
  const int64_t H = c.hidden;
  const size_t n = w.layers.size();
  // Per layer where each element of x sits before qkv (a) and before gate|up (b): idx[i] is
  // the position of element i (gemv_input_index), so x'[idx[i]] = x[i].
  std::vector<std::vector<int32_t>> a(n), b(n);
  for (size_t l = 0; l < n; ++l) {
    a[l] = cuda::gemv_input_index(w.layers[l].qkv.q, s);
    b[l] = cuda::gemv_input_index(w.layers[l].gate_up.q, s);
  }
  std::vector<int32_t> natural(H), embed_perm(H);
  for (int64_t i = 0; i < H; ++i) {
    natural[i] = (int32_t)i;
    embed_perm[a[0][i]] = (int32_t)i;  // out[j] = row[embed_perm[j]]
  }
  auto* d = mem.alloc_n<int32_t>((2 * n + 2) * H);
  const int64_t Q = c.q_dim();
  size_t n_att = 0;  // layers whose o has act-order: attention stores in its permutation
  for (const GpuLayer& g : w.layers) n_att += g.o.q.has_perm;
  auto* d_att = n_att ? mem.alloc_n<int32_t>(n_att * Q) : nullptr;
  auto* dn = mem.alloc_n<__half>(2 * n * H);
  auto put_norm = [&](const __half* norm, const std::vector<int32_t>& idx) {
    std::vector<uint16_t> h(H), p(H);
    KESTREL_CUDA_CHECK(cudaMemcpy(h.data(), norm, H * sizeof(__half), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < H; ++i) p[idx[i]] = h[i];
    KESTREL_CUDA_CHECK(cudaMemcpy(dn, p.data(), H * sizeof(__half), cudaMemcpyHostToDevice));
    dn += H;
    return dn - H;
  };
  std::vector<const int32_t*> da(n), db(n);
  for (size_t l = 0; l < n; ++l) {
    da[l] = upload_at(d, a[l]);
    db[l] = upload_at(d, b[l]);
  }
  const int32_t* d_natural = upload_at(d, natural);
  w.embed_perm = upload_at(d, embed_perm);
  for (size_t l = 0; l < n; ++l) {
    GpuLayer& g = w.layers[l];
    GpuLayer::StreamOrder& o = g.order;
    o.on = true;
    o.input_norm = put_norm(g.input_norm, a[l]);
    o.post_norm = put_norm(g.post_norm, b[l]);
    o.qkv = cuda::gemv_input_permuted(g.qkv.q);
    o.gate_up = cuda::gemv_input_permuted(g.gate_up.q);
    o.o = g.o.q;
    if (g.o.q.has_perm) {
      o.att_out = upload_at(d_att, cuda::gemv_input_index(g.o.q, s));
      o.o = cuda::gemv_input_permuted(g.o.q);
    }
    o.o_residual = da[l];
    o.o_out = db[l];
    o.down_residual = db[l];
    o.down_out = l + 1 < n ? da[l + 1] : d_natural;
  }
}

}  // namespace

void plan_act_order(GpuWeights& w, const ModelConfig& c, DeviceMemory& mem, cudaStream_t s) {
  // Both plans hang on RMSNorm fused into the GEMVs' staging and on the SiLU epilogue; a
  // LayerNorm or ReLU family stages natural-order inputs.
  if (c.norm != NormKind::RMS || c.mlp != MlpKind::GatedSiLU) return;
  permute_down_inputs(w, mem, s);
  permute_residual_stream(w, c, mem, s);
}

}  // namespace kestrel
