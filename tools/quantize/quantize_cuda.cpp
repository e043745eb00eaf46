// The layer-by-layer GPTQ loop on the GPU (--device cuda), the counterpart of quantize.cpp's
// CPU loop with the same order of work:
//
//   X [windows, T, hidden] fp16 on the GPU = the embeddings of the calibration windows
//   per decoder layer l (its fp16 weights uploaded into one reused set of buffers):
//     per true-sequential group (q/k/v, o, gate/up, down):
//       every window: x = X[w], layer_forward_rows(x) with a tap that adds the group's input
//       to the group's GPU Hessian and stops there
//       factor of the Hessian (shared by the group's linears), then each linear: GPTQ on the
//       GPU, relative error on the GPU, its dequantized fp16 weight written over the original
//       so that the following groups' inputs come from the quantized group
//     every window: X[w] = layer l (quantized) of X[w]: the next layer's inputs
//
// GPU memory: the activations, one layer's weights, one group's Hessian and one linear's
// GPTQ buffers, and a window's layer activations. Packing and writing each quantized linear
// to the scratch folder run on a second thread while the GPU goes on with the next linear.
#include <chrono>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "base/device.h"
#include "base/dtype.h"
#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "models/gpu/decoder.h"
#include "models/gpu/layer.h"
#include "tools/quantize/gptq_cuda.h"
#include "tools/quantize/gptq_kernels.h"
#include "tools/quantize/quantize_loops.h"

namespace kestrel::quant {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kAlign = 64;  // halves: the buffers below are carved at 128-byte boundaries

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A true-sequential group: its linears in checkpoint order, stacked along N in the layer's
// fused GPU linear (q|k|v, gate|up). A member the family lacks (a ReLU MLP's gate: its fc1 is
// `up`) has no name and no rows.
struct Group {
  LinearGroup id;
  std::vector<LinearSpec LayerSpec::*> members;
  GpuLinear GpuLayer::*fused;
};

const std::vector<Group>& groups() {
  static const std::vector<Group> g = {
      {LinearGroup::QKV, {&LayerSpec::q, &LayerSpec::k, &LayerSpec::v}, &GpuLayer::qkv},
      {LinearGroup::O, {&LayerSpec::o}, &GpuLayer::o},
      {LinearGroup::GateUp, {&LayerSpec::gate, &LayerSpec::up}, &GpuLayer::gate_up},
      {LinearGroup::Down, {&LayerSpec::down}, &GpuLayer::down},
  };
  return g;
}

// A tensor (F16, BF16 or F32) into device fp16 at dst, numel halves.
void upload_f16(const TensorInfo& t, __half* dst, cudaStream_t s) {
  if (t.dtype == DType::F16) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, t.data, t.nbytes, cudaMemcpyHostToDevice, s));
    return;
  }
  const std::vector<float> f = to_float(t);
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < f.size(); ++i) h[i] = float_to_half(f[i]);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));  // h goes out of scope
}

}  // namespace

std::string cuda_quantize_unsupported(const ModelSpec& spec) {
  // The calibration runs the CUDA prefill's layer (layer_forward_rows): what it runs.
  return cuda_unsupported(spec.config);
}

namespace {

// What the GPU forward cannot run, refused before any work starts.
void check_gpu_model(const ModelSpec& spec) {
  if (const std::string why = cuda_quantize_unsupported(spec); !why.empty())
    throw Error(fmt::format("{}: {}", spec.dir, why));
}

// Pairs of events around each Hessian update of a group's pass, summed once the pass is done.
class HessianTimer {
 public:
  explicit HessianTimer(int n) : ev_(2 * n) {
    for (cudaEvent_t& e : ev_) KESTREL_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~HessianTimer() {
    for (cudaEvent_t e : ev_) cudaEventDestroy(e);
  }
  void start(int i, cudaStream_t s) { KESTREL_CUDA_CHECK(cudaEventRecord(ev_[2 * i], s)); }
  void stop(int i, cudaStream_t s) { KESTREL_CUDA_CHECK(cudaEventRecord(ev_[2 * i + 1], s)); }
  // Seconds over the first n pairs (after the stream has finished them).
  double seconds(int n) const {
    double ms = 0;
    for (int i = 0; i < n; ++i) {
      float t = 0;
      KESTREL_CUDA_CHECK(cudaEventElapsedTime(&t, ev_[2 * i], ev_[2 * i + 1]));
      ms += t;
    }
    return ms / 1000.0;
  }

 private:
  std::vector<cudaEvent_t> ev_;
};

class Stream {
 public:
  Stream() { KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace

void quantize_layers_cuda(const ModelSpec& spec, const QuantizeOptions& o,
                          const std::vector<std::vector<int>>& windows, const OptionsFor& gptq_for,
                          const SaveLinear& save, const LayerDone& done) {
  const CudaStatus st = cuda_status();
  if (!st.usable) throw DeviceError(st.problem + "; run with --device cpu");
  check_gpu_model(spec);
  const ModelConfig& c = spec.config;
  const int T = o.seqlen, S = (int)windows.size();
  const int64_t hidden = c.hidden, q_dim = c.q_dim(), kv_dim = c.kv_dim(), inter = c.intermediate;
  const int64_t qkv_n = q_dim + 2 * kv_dim;
  const size_t win = (size_t)T * hidden;  // halves per window

  Stream stream;
  cudaStream_t s = stream.get();
  GpuContext ctx(s);
  cuda::GemmRunner gemm;

  // The calibration activations, [S, T, hidden] fp16: the windows' embeddings to begin with.
  cuda::DeviceBuffer X = gpu_alloc(
      S * win * sizeof(__half),
      fmt::format("the calibration activations ({} windows x {} tokens x {} fp16)", S, T, hidden));
  {
    const TensorInfo& E = *spec.embed;
    std::vector<uint16_t> converted;  // the table as fp16 when stored otherwise
    if (E.dtype != DType::F16) {
      const std::vector<float> f = to_float(E);
      converted.resize(f.size());
      for (size_t i = 0; i < f.size(); ++i) converted[i] = float_to_half(f[i]);
    }
    const uint8_t* table = E.dtype == DType::F16 ? E.data : (const uint8_t*)converted.data();
    // Learned positions (OPT): every window starts at position 0, so row i adds position
    // i + offset.
    std::vector<float> positions;
    if (spec.positions) positions = to_float(*spec.positions);
    std::vector<uint16_t> rows(win);
    for (int w = 0; w < S; ++w) {
      for (int i = 0; i < T; ++i) {
        const int tok = windows[w][i];
        KESTREL_CHECK(tok >= 0 && tok < c.vocab,
                      fmt::format("token id {} is outside the vocabulary ({})", tok, c.vocab));
        uint16_t* row = &rows[(size_t)i * hidden];
        std::memcpy(row, table + (size_t)tok * hidden * 2, hidden * 2);
        if (!positions.empty()) {  // the table's fp16 values, as the engine holds them
          const float* pe = &positions[(size_t)(i + c.position_offset) * hidden];
          for (int64_t j = 0; j < hidden; ++j)
            row[j] = float_to_half(half_to_float(row[j]) + half_to_float(float_to_half(pe[j])));
        }
      }
      KESTREL_CUDA_CHECK(cudaMemcpy(X.as<__half>() + w * win, rows.data(), win * 2,
                                    cudaMemcpyHostToDevice));
    }
  }

  // One layer's fp16 weights, reused layer after layer, with what the family adds: norm and
  // linear biases, q/k head norms. Layer 0 says which (every layer has the same tensors).
  const LayerSpec& l0 = spec.layers[0];
  const int64_t gate_up_n = (l0.gate.name.empty() ? 1 : 2) * inter;
  const int64_t weight_halves = 4 * hidden + qkv_n * hidden + hidden * q_dim +
                                gate_up_n * hidden + hidden * inter + qkv_n + hidden +
                                gate_up_n + hidden + 2 * c.head_dim;
  cuda::DeviceBuffer weights =
      gpu_alloc((weight_halves + 16 * kAlign) * sizeof(__half), "one decoder layer's fp16 weights");
  GpuLayer L;
  {
    __half* p = weights.as<__half>();
    auto take = [&](int64_t n) {  // kAlign-aligned pieces: the GEMMs and attention want 16 B
      __half* r = p;
      p += (n + kAlign - 1) / kAlign * kAlign;
      return r;
    };
    auto take_if = [&](const void* present, int64_t n) { return present ? take(n) : nullptr; };
    L.input_norm = take(hidden);
    L.post_norm = take(hidden);
    L.input_norm_bias = take_if(l0.input_norm_bias, hidden);
    L.post_norm_bias = take_if(l0.post_norm_bias, hidden);
    L.q_norm = take_if(l0.q_norm, c.head_dim);
    L.k_norm = take_if(l0.k_norm, c.head_dim);
    auto dense = [&](GpuLinear& lin, int64_t N, int64_t K, const void* bias) {
      lin.N = N;
      lin.K = K;
      lin.quantized = false;
      lin.dense = take(N * K);
      lin.bytes = N * K * sizeof(__half);
      lin.bias = take_if(bias, N);
    };
    dense(L.qkv, qkv_n, hidden, l0.q.bias);
    dense(L.o, hidden, q_dim, l0.o.bias);
    dense(L.gate_up, gate_up_n, hidden, l0.up.bias);
    dense(L.down, hidden, inter, l0.down.bias);
  }

  // One window's layer step: its activations, the working copy of its residual stream, and
  // this layer's K/V for its T positions.
  const size_t act_halves = (size_t)T * (hidden + qkv_n + q_dim + 3 * inter + hidden + 2 * kv_dim);
  cuda::DeviceBuffer act = gpu_alloc((act_halves + 8 * kAlign) * sizeof(__half),
                                     fmt::format("the layer activations of a {}-token window", T));
  LayerRowsScratch scratch;
  __half* x = nullptr;
  __half *k_cache = nullptr, *v_cache = nullptr;
  {
    __half* p = act.as<__half>();
    auto take = [&](int64_t n) {  // kAlign-aligned pieces: the GEMMs and attention want 16 B
      __half* r = p;
      p += (n + kAlign - 1) / kAlign * kAlign;
      return r;
    };
    scratch.xb = take((int64_t)T * hidden);
    scratch.qkv = take((int64_t)T * qkv_n);
    scratch.att = take((int64_t)T * q_dim);
    scratch.gate_up = take((int64_t)T * 2 * inter);
    scratch.act = take((int64_t)T * inter);
    x = take((int64_t)T * hidden);
    k_cache = take((int64_t)T * kv_dim);
    v_cache = take((int64_t)T * kv_dim);
  }

  // The fp32 copy of the linear being quantized (the largest of a layer).
  int64_t max_nk = 0;
  for (const Group& g : groups())
    for (auto m : g.members) max_nk = std::max(max_nk, (spec.layers[0].*m).N * (spec.layers[0].*m).K);
  cuda::DeviceBuffer W32 = gpu_alloc(max_nk * sizeof(float), "the fp32 copy of a linear");
  HessianTimer hessian_timer(S);

  for (int l = 0; l < c.n_layers; ++l) {
    const auto t_layer = Clock::now();
    LayerTimes times;
    const LayerSpec& ls = spec.layers[l];
    upload_f16(*ls.input_norm, L.input_norm, s);
    upload_f16(*ls.post_norm, L.post_norm, s);
    auto upload_if = [&](const TensorInfo* t, __half* dst) {
      if (dst) upload_f16(*t, dst, s);
    };
    upload_if(ls.input_norm_bias, L.input_norm_bias);
    upload_if(ls.post_norm_bias, L.post_norm_bias);
    upload_if(ls.q_norm, L.q_norm);
    upload_if(ls.k_norm, L.k_norm);
    for (const Group& g : groups()) {
      int64_t row = 0;
      for (auto m : g.members) {
        const LinearSpec& lin = ls.*m;
        if (lin.name.empty()) continue;
        upload_f16(*lin.weight, (L.*g.fused).dense + row * lin.K, s);
        // The fused linear has a bias where its first member has; the family gives all or none.
        KESTREL_CHECK((lin.bias != nullptr) == ((L.*g.fused).bias != nullptr),
                      fmt::format("{}: {} has {} bias where the other linears of its group {}",
                                  spec.dir, lin.name, lin.bias ? "a" : "no",
                                  lin.bias ? "have none" : "have one"));
        upload_if(lin.bias, (L.*g.fused).bias ? (L.*g.fused).bias + row : nullptr);
        row += lin.N;
      }
    }

    std::vector<LinearReport> lines;
    for (const Group& g : groups()) {
      const LinearSpec& last = ls.*g.members.back();  // the last member is in every family
      const int64_t K = last.K;
      // The group's name for its shared factor's errors, and the options the factor reads
      // (act_order, damp: every linear's): its first linear's.
      const LinearSpec* first = nullptr;
      for (auto m : g.members)
        if (!first && !(ls.*m).name.empty()) first = &(ls.*m);
      const std::string& group_name = first->name;
      // The group's inputs over every window, through the layer as quantized so far.
      const auto t_fwd = Clock::now();
      GpuHessian H(ctx, K);
      int pass = 0;
      GpuLayerTaps taps;
      taps.input = [&](LinearGroup id, const __half* in, int rows, int) {
        if (id != g.id) return;
        hessian_timer.start(pass, s);
        H.add(in, rows);
        hessian_timer.stop(pass, s);
        ++pass;
      };
      taps.stop_after = g.id;
      for (int w = 0; w < S; ++w) {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(x, X.as<__half>() + w * win, win * sizeof(__half),
                                           cudaMemcpyDeviceToDevice, s));
        layer_forward_rows(c, L, gemm, x, T, 0, k_cache, v_cache, scratch, s, &taps);
      }
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      const double hess = hessian_timer.seconds(pass);
      times.hessian += hess;
      times.forward += seconds_since(t_fwd) - hess;

      // The group's factor, then its linears one by one.
      const auto t_q = Clock::now();
      auto t_lin = Clock::now();
      std::optional<GpuGptqFactor> factor;
      if (o.method == "gptq") factor.emplace(ctx, H.data(), K, gptq_for(*first), group_name);
      int64_t row = 0;
      for (auto m : g.members) {
        const LinearSpec& spec_m = ls.*m;
        if (spec_m.name.empty()) continue;
        const int64_t N = spec_m.N;
        __half* w16 = (L.*g.fused).dense + row * K;
        row += N;
        kern::half_to_float(w16, N * K, W32.as<float>(), s);
        GpuQuantOutputs out;
        // Later groups and the final pass see the quantized linear, whatever its format: the
        // fp16 dense weight is its dequantized values.
        out.dequant_f16 = w16;
        out.error_hessian = H.data();
        const GptqOptions go = gptq_for(spec_m);
        QuantizedLinear q =
            factor ? gptq_quantize_cuda(ctx, *factor, W32.as<float>(), N, K, go, spec_m.name, out)
                   : rtn_quantize_cuda(ctx, W32.as<float>(), N, K, go, spec_m.name, out);
        save(spec_m, std::move(q));
        // The group's shared factor counts in its first linear's time.
        lines.push_back(LinearReport{spec_m.name, N, K, out.rel_error, seconds_since(t_lin)});
        t_lin = Clock::now();
      }
      times.quantize += seconds_since(t_q);
    }

    // This layer's outputs, through its quantized linears, are the next layer's inputs.
    const auto t_out = Clock::now();
    for (int w = 0; w < S; ++w)
      layer_forward_rows(c, L, gemm, X.as<__half>() + w * win, T, 0, k_cache, v_cache, scratch, s);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    times.forward += seconds_since(t_out);
    times.total = seconds_since(t_layer);
    done(l, lines, times);
  }
}

}  // namespace kestrel::quant
