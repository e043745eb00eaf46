// Planning the prefill's scratch within the GPU memory target, and making it: chunk rows,
// cuBLASLt's workspace, the dequantization scratch and the fused small-M GEMM's workspace.
#include <algorithm>
#include <fmt/format.h>

#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_small.h"
#include "models/gpu/decoder.h"
#include "models/gpu/layer.h"
#include "models/gpu/prefill_state.h"
#include "models/registry.h"

namespace kestrel {

void DecoderCuda::PrefillDeleter::operator()(PrefillState* p) const { delete p; }

void DecoderCuda::set_prefill_chunk(int tokens) {
  KESTREL_CHECK(tokens >= 1, fmt::format("prefill chunk must be at least 1 token, got {}", tokens));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  prefill_.reset();
  prefill_chunk_ = tokens;
}

namespace {

// Columns of the two shared activation buffers (PrefillState): qkv | gate_up, and xb | att | act.
size_t qkv_gate_up_cols(const ModelConfig& c) {
  return std::max<size_t>(c.q_dim() + 2 * c.kv_dim(), 2 * (size_t)c.intermediate);
}
size_t xb_att_act_cols(const ModelConfig& c) {
  return std::max({(size_t)c.hidden, (size_t)c.q_dim(), (size_t)c.intermediate});
}

// Bytes of the prefill's activations per token of a chunk (PrefillState's buffers).
size_t prefill_row_bytes(const ModelConfig& c) {
  const size_t halves = c.hidden + qkv_gate_up_cols(c) + xb_att_act_cols(c);
  return halves * sizeof(__half) + 3 * sizeof(int);
}

// Halves of dequantization scratch for chunks of `rows` tokens: the largest any linear needs.
size_t dequant_scratch_elems(const std::vector<GpuLayer>& layers, int rows) {
  size_t e = 0;
  for (const GpuLayer& l : layers)
    for (const GpuLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down})
      for (const GpuLinear* leaf : lin->leaves())
        if (leaf->quantized) e = std::max(e, cuda::quant_gemm_scratch_elems(leaf->q, rows));
  return e;
}

// What is left of the memory target's 5% over `base` (weights + KV cache) once `taken` is.
size_t room_in_target(size_t base, size_t taken) {
  const size_t target = base / 20;
  return target > taken ? target - taken : 0;
}

}  // namespace

int prefill_chunk_rows(size_t base, size_t taken, size_t row_bytes, int max_rows) {
  const size_t room = room_in_target(base, taken);
  const int64_t fit = (int64_t)(room / std::max<size_t>(row_bytes, 1)) / 64 * 64;
  return (int)std::min<int64_t>(max_rows, std::max<int64_t>(fit, 512));
}

size_t prefill_workspace_bytes(size_t base, size_t taken, size_t most) {
  return std::min(most, room_in_target(base, taken)) >> 20 << 20;
}

// The prefill's scratch within the GPU memory target (weights + KV cache + 5%) where that costs
// the prompt little. The decode path took its part at load (device memory in use then, beyond
// the weights); the prefill gets the rest of the 5%, in this order: one dequantized weight
// slice (fixed, 32 MiB), the chunk's activations (prefill_chunk_rows), then cuBLASLt's
// workspace, up to 32 MiB, from what is left (prefill_workspace_bytes; small linears run as
// fast without one). Chunks are never cut below 512 tokens (one 512-token prompt in one pass),
// and the slice never below 32 MiB: each chunk dequantizes every weight again, and smaller
// slices leave SMs idle in their GEMMs. A model too small for that to fit in 5% goes over it
// rather than lose most of its prompt speed (the figures: docs/performance.md).
DecoderCuda::PrefillPlan DecoderCuda::prefill_plan(const GpuSequence& q, int max_rows) const {
  // A paged session's storage is the whole pool: the target follows its own context's cache.
  const size_t kv =
      q.blocks ? (size_t)q.ctx * cache_bytes_per_position(Device::Cuda, cfg_, q.kv.types)
               : q.kv.bytes;
  const size_t base = weight_bytes_ + kv;
  const size_t decode = scratch_bytes_;
  // 16 MiB for what the runtime takes as the prefill first runs (cuBLASLt's handle, the
  // modules of its kernels and of the prefill's), which would otherwise push a long prompt's
  // footprint over the target.
  const size_t runtime = size_t(16) << 20;
  const size_t taken = decode + runtime +
                       dequant_scratch_elems(w_.layers, max_rows) * sizeof(__half) +
                       (size_t)cfg_.vocab * sizeof(float);
  PrefillPlan plan;
  plan.rows = prefill_chunk_rows(base, taken, prefill_row_bytes(cfg_), max_rows);
  plan.workspace_bytes = prefill_workspace_bytes(
      base, taken + (size_t)plan.rows * prefill_row_bytes(cfg_), cuda::kGemmWorkspaceBytes);
  return plan;
}

size_t DecoderCuda::prefill_bytes_to_come(int context) const {
  const size_t vocab = cfg_.vocab;
  const int rows = std::min(prefill_chunk_, context > 0 ? context : cfg_.max_pos);
  return (size_t)rows * (prefill_row_bytes(cfg_) + vocab * sizeof(float)) +
         dequant_scratch_elems(w_.layers, rows) * sizeof(__half) + cuda::kGemmWorkspaceBytes;
}

DecoderCuda::PrefillState& DecoderCuda::prefill_state(const GpuSequence& q, bool want_rows) {
  const ModelConfig& c = cfg_;
  const size_t vocab = c.vocab;
  // Scratch for the largest chunk that fits: halve on out-of-memory (the KV cache may have
  // taken most of the GPU), down to 16 tokens.
  if (!prefill_) {
    int rows = std::min(prefill_chunk_, q.ctx);
    for (;;) {
      try {
        const PrefillPlan plan = prefill_plan(q, rows);
        rows = plan.rows;
        const size_t scratch = dequant_scratch_elems(w_.layers, rows);
        cuda::GemmMemory mem;
        mem.workspace_bytes = plan.workspace_bytes;
        auto st = std::unique_ptr<PrefillState, PrefillDeleter>(new PrefillState(mem));
        st->rows = rows;
        auto halves = [&](size_t k) { return static_cast<__half*>(st->take(k * sizeof(__half))); };
        st->tokens = static_cast<int*>(st->take(rows * sizeof(int)));
        st->targets = static_cast<int*>(st->take(rows * sizeof(int)));
        st->nll = static_cast<float*>(st->take(rows * sizeof(float)));
        st->x = halves((size_t)rows * c.hidden);
        st->xb = st->att = st->act = halves((size_t)rows * xb_att_act_cols(c));
        st->qkv = st->gate_up = halves((size_t)rows * qkv_gate_up_cols(c));
        st->scratch = halves(scratch);
        st->logits = static_cast<float*>(st->take(vocab * sizeof(float)));
        st->logits_rows = 1;
        st->rows_in = static_cast<int*>(st->take((1 + kVerifyMaxRows) * sizeof(int)));
        st->batch_seqs =
            static_cast<cuda::KvBatchSeq*>(st->take((size_t)rows * sizeof(cuda::KvBatchSeq)));
        st->batch_order = static_cast<int*>(st->take((size_t)rows * sizeof(int)));
        if (tuning_.small_gemm_max_rows >= kSmallGemmMinRows) {
          // Outside the memory plan: the split-K partials and gathered x of the largest call
          // (gemm_small_workspace_bytes; under 20 MiB on a 7B), which the halving of the rows
          // below also covers when the device is short.
          st->small_max_rows = std::min({tuning_.small_gemm_max_rows, cuda::kGemmSmallMaxRows, rows});
          size_t ws = 0;
          for (const GpuLayer& L : w_.layers)
            for (const GpuLinear* lin : {&L.qkv, &L.o, &L.gate_up, &L.down})
              for (const GpuLinear* leaf : lin->leaves())  // unfused parts run it one by one
                if (leaf->quantized)
                  for (int m = kSmallGemmMinRows; m <= st->small_max_rows; ++m)
                    ws = std::max(ws, cuda::gemm_small_workspace_bytes(leaf->q, m));
          if (ws > 0) {
            st->small_ws = st->take(ws);
            KESTREL_CUDA_CHECK(cudaMemsetAsync(st->small_ws, 0, ws, stream_));
          }
          st->small_ws_bytes = ws;
        }
        st->generation = ++prefill_generations_;
        prefill_ = std::move(st);
        break;
      } catch (const DeviceError&) {
        if (rows <= 16) throw;
        rows /= 2;
      }
    }
  }
  PrefillState& S = *prefill_;
  // The head's logits grow once, to every row of a chunk: the buffer a verify graph binds is
  // never replaced after that (the one-row buffer before it stays allocated with the state).
  if (want_rows) grow_row_logits(S);
  return S;
}

void DecoderCuda::grow_row_logits(PrefillState& S) {
  if (S.logits_rows >= S.rows) return;
  S.logits = static_cast<float*>(S.take((size_t)S.rows * cfg_.vocab * sizeof(float)));
  S.logits_rows = S.rows;
}

}  // namespace kestrel
