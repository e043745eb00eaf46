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
//
// Mixed precision's measuring pass (measure_candidates_cuda) is the counterpart of
// quantize.cpp's measure_candidates_cpu, on the same state (GpuCalibration):
//
//   per decoder layer l (FP16 weights): every window: X[w] = layer l of X[w], with taps that
//   add each group's input to its Hessian (the four Hessians at once; nothing is quantized, so
//   the next layer gets the FP16 outputs)
//   per group: one factor; per linear and candidate: GPTQ on the GPU and its output error,
//   scaled as --loss says (relative: over tr(W H W^T); residual: also times the block's
//   share of the residual stream, from the stream's energy before and after the layer)
//
// It holds the four Hessians of one layer at once instead of one group's.
#include <chrono>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "base/device.h"
#include "base/dtype.h"
#include "base/error.h"
#include "base/progress.h"
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

// No usable GPU, or a model the GPU forward cannot run: refused before any work starts.
void check_gpu_model(const ModelSpec& spec) {
  const CudaStatus st = cuda_status();
  if (!st.usable) throw DeviceError(st.problem + "; run with --device cpu");
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

// What both GPU loops hold: the stream and its cuBLAS/cuSOLVER context, the calibration
// windows' residual streams X [S, T, hidden] fp16 (their embeddings to begin with), one decoder
// layer's fp16 weights in buffers reused layer after layer (L), one window's layer step
// scratch, and the fp32 copy of the linear being quantized.
class GpuCalibration {
 public:
  GpuCalibration(const ModelSpec& spec, const QuantizeOptions& o,
                 const std::vector<std::vector<int>>& windows);

  // Layer ls's fp16 weights (and what its family adds: biases, norms) into L.
  void load_layer(const LayerSpec& ls);
  // Window w through L in place (its residual stream becomes the layer's output).
  void forward(int w, const GpuLayerTaps* taps = nullptr) {
    layer_forward_rows(c_, L, gemm_, X_.as<__half>() + w * win_, T_, 0, k_cache_, v_cache_,
                       scratch_, s_, taps);
  }
  // Window w through L from a copy, X left as it was (a group's rerun that stops at its tap).
  void forward_copy(int w, const GpuLayerTaps* taps) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(x_, X_.as<__half>() + w * win_, win_ * sizeof(__half),
                                       cudaMemcpyDeviceToDevice, s_));
    layer_forward_rows(c_, L, gemm_, x_, T_, 0, k_cache_, v_cache_, scratch_, s_, taps);
  }
  // Mean squared norm of the residual stream's rows, over every window and position.
  double energy();
  // W32 = the fp16 weight w16 [N, K] in fp32; returns W32.
  float* to_fp32(const __half* w16, int64_t N, int64_t K) {
    kern::half_to_float(w16, N * K, W32_.as<float>(), s_);
    return W32_.as<float>();
  }

  int windows() const { return S_; }
  cudaStream_t stream() const { return s_; }
  GpuContext& ctx() { return ctx_; }

  GpuLayer L;

 private:
  const ModelSpec& spec_;
  const ModelConfig& c_;
  int T_, S_;
  size_t win_;  // halves per window
  Stream stream_;
  cudaStream_t s_;
  GpuContext ctx_;
  cuda::GemmRunner gemm_;
  cuda::DeviceBuffer X_, weights_, act_, W32_, energy_acc_;
  LayerRowsScratch scratch_;
  __half* x_ = nullptr;
  __half *k_cache_ = nullptr, *v_cache_ = nullptr;
};

GpuCalibration::GpuCalibration(const ModelSpec& spec, const QuantizeOptions& o,
                               const std::vector<std::vector<int>>& windows)
    : spec_(spec),
      c_(spec.config),
      T_(o.seqlen),
      S_((int)windows.size()),
      win_((size_t)o.seqlen * spec.config.hidden),
      s_(stream_.get()),
      ctx_(s_) {
  const ModelConfig& c = c_;
  const int T = T_, S = S_;
  const int64_t hidden = c.hidden, q_dim = c.q_dim(), kv_dim = c.kv_dim(), inter = c.intermediate;
  const int64_t qkv_n = q_dim + 2 * kv_dim;
  const size_t win = win_;

  // The calibration activations, [S, T, hidden] fp16: the windows' embeddings to begin with.
  X_ = gpu_alloc(
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
      KESTREL_CUDA_CHECK(cudaMemcpy(X_.as<__half>() + w * win, rows.data(), win * 2,
                                    cudaMemcpyHostToDevice));
    }
    // The copies ran on the legacy stream, which the non-blocking s_ does not wait for, and a
    // pageable copy may return before it lands: the first kernel on s_ reads every window.
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // One layer's fp16 weights, reused layer after layer, with what the family adds: norm and
  // linear biases, q/k head norms. Layer 0 says which (every layer has the same tensors).
  const LayerSpec& l0 = spec.layers[0];
  const int64_t gate_up_n = (l0.gate.name.empty() ? 1 : 2) * inter;
  const int64_t weight_halves = 4 * hidden + qkv_n * hidden + hidden * q_dim +
                                gate_up_n * hidden + hidden * inter + qkv_n + hidden +
                                gate_up_n + hidden + 2 * c.head_dim;
  weights_ =
      gpu_alloc((weight_halves + 16 * kAlign) * sizeof(__half), "one decoder layer's fp16 weights");
  {
    __half* p = weights_.as<__half>();
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
  act_ = gpu_alloc((act_halves + 8 * kAlign) * sizeof(__half),
                   fmt::format("the layer activations of a {}-token window", T));
  {
    __half* p = act_.as<__half>();
    auto take = [&](int64_t n) {  // kAlign-aligned pieces: the GEMMs and attention want 16 B
      __half* r = p;
      p += (n + kAlign - 1) / kAlign * kAlign;
      return r;
    };
    scratch_.xb = take((int64_t)T * hidden);
    scratch_.qkv = take((int64_t)T * qkv_n);
    scratch_.att = take((int64_t)T * q_dim);
    scratch_.gate_up = take((int64_t)T * 2 * inter);
    scratch_.act = take((int64_t)T * inter);
    x_ = take((int64_t)T * hidden);
    k_cache_ = take((int64_t)T * kv_dim);
    v_cache_ = take((int64_t)T * kv_dim);
  }

  // The fp32 copy of the linear being quantized (the largest of a layer).
  int64_t max_nk = 0;
  for (const Group& g : groups())
    for (auto m : g.members) max_nk = std::max(max_nk, (l0.*m).N * (l0.*m).K);
  W32_ = gpu_alloc(max_nk * sizeof(float), "the fp32 copy of a linear");
}

void GpuCalibration::load_layer(const LayerSpec& ls) {
  upload_f16(*ls.input_norm, L.input_norm, s_);
  upload_f16(*ls.post_norm, L.post_norm, s_);
  auto upload_if = [&](const TensorInfo* t, __half* dst) {
    if (dst) upload_f16(*t, dst, s_);
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
      upload_f16(*lin.weight, (L.*g.fused).dense + row * lin.K, s_);
      // The fused linear has a bias where its first member has; the family gives all or none.
      KESTREL_CHECK((lin.bias != nullptr) == ((L.*g.fused).bias != nullptr),
                    fmt::format("{}: {} has {} bias where the other linears of its group {}",
                                spec_.dir, lin.name, lin.bias ? "a" : "no",
                                lin.bias ? "have none" : "have one"));
      upload_if(lin.bias, (L.*g.fused).bias ? (L.*g.fused).bias + row : nullptr);
      row += lin.N;
    }
  }
}

double GpuCalibration::energy() {
  if (!energy_acc_.get()) energy_acc_ = gpu_alloc(sizeof(double), "the residual stream's energy");
  KESTREL_CUDA_CHECK(cudaMemsetAsync(energy_acc_.get(), 0, sizeof(double), s_));
  kern::sum_squares(X_.as<__half>(), (int64_t)S_ * win_, energy_acc_.as<double>(), s_);
  double e = 0;
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(&e, energy_acc_.get(), sizeof(double), cudaMemcpyDeviceToHost, s_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s_));
  return e / ((double)S_ * T_);
}

// The first linear of a group that the family has (the last member is in every family), and
// with it the group's input width K.
const LinearSpec& first_member(const LayerSpec& ls, const Group& g) {
  for (auto m : g.members)
    if (!(ls.*m).name.empty()) return ls.*m;
  return ls.*g.members.back();
}

}  // namespace

void quantize_layers_cuda(const ModelSpec& spec, const QuantizeOptions& o,
                          const std::vector<std::vector<int>>& windows, const OptionsFor& gptq_for,
                          const SaveLinear& save, const LayerDone& done) {
  check_gpu_model(spec);
  const ModelConfig& c = spec.config;
  GpuCalibration cal(spec, o, windows);
  const int S = cal.windows();
  cudaStream_t s = cal.stream();
  GpuContext& ctx = cal.ctx();
  GpuLayer& L = cal.L;
  HessianTimer hessian_timer(S);

  for (int l = 0; l < c.n_layers; ++l) {
    const auto t_layer = Clock::now();
    LayerTimes times;
    const LayerSpec& ls = spec.layers[l];
    cal.load_layer(ls);

    std::vector<LinearReport> lines;
    for (const Group& g : groups()) {
      // The group's name for its shared factor's errors, and the options the factor reads
      // (act_order, damp: every linear's): its first linear's.
      const LinearSpec& first = first_member(ls, g);
      const int64_t K = first.K;
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
      for (int w = 0; w < S; ++w) cal.forward_copy(w, &taps);
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      const double hess = hessian_timer.seconds(pass);
      times.hessian += hess;
      times.forward += seconds_since(t_fwd) - hess;

      // The group's factor, then its linears one by one.
      const auto t_q = Clock::now();
      auto t_lin = Clock::now();
      std::optional<GpuGptqFactor> factor;
      if (o.method == "gptq") factor.emplace(ctx, H.data(), K, gptq_for(first), first.name);
      int64_t row = 0;
      for (auto m : g.members) {
        const LinearSpec& spec_m = ls.*m;
        if (spec_m.name.empty()) continue;
        const int64_t N = spec_m.N;
        __half* w16 = (L.*g.fused).dense + row * K;
        row += N;
        float* W32 = cal.to_fp32(w16, N, K);
        GpuQuantOutputs out;
        // Later groups and the final pass see the quantized linear, whatever its format: the
        // fp16 dense weight is its dequantized values.
        out.dequant_f16 = w16;
        out.error_hessian = H.data();
        const GptqOptions go = gptq_for(spec_m);
        QuantizedLinear q = factor ? gptq_quantize_cuda(ctx, *factor, W32, N, K, go, spec_m.name, out)
                                   : rtn_quantize_cuda(ctx, W32, N, K, go, spec_m.name, out);
        save(spec_m, std::move(q));
        // The group's shared factor counts in its first linear's time.
        lines.push_back(LinearReport{spec_m.name, N, K, out.rel_error, seconds_since(t_lin)});
        t_lin = Clock::now();
      }
      times.quantize += seconds_since(t_q);
    }

    // This layer's outputs, through its quantized linears, are the next layer's inputs.
    const auto t_out = Clock::now();
    for (int w = 0; w < S; ++w) cal.forward(w);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    times.forward += seconds_since(t_out);
    times.total = seconds_since(t_layer);
    done(l, lines, times);
  }
}

std::vector<PlannedLinear> measure_candidates_cuda(const ModelSpec& spec, const QuantizeOptions& o,
                                                   const std::vector<QuantSetting>& candidates,
                                                   const std::vector<std::vector<int>>& windows) {
  check_gpu_model(spec);
  if (o.loss != "output" && o.loss != "relative" && o.loss != "residual")
    throw Error(fmt::format("--loss {} runs on the CPU only: --device cpu, or another --loss",
                            o.loss));
  const ModelConfig& c = spec.config;
  GpuCalibration cal(spec, o, windows);
  const int S = cal.windows();
  cudaStream_t s = cal.stream();
  GpuContext& ctx = cal.ctx();
  GpuLayer& L = cal.L;
  const bool residual = o.loss == "residual";

  std::vector<PlannedLinear> out;
  Progress bar(fmt::format("measuring {} candidates", candidates.size()), c.n_layers, "layers",
               o.progress);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerSpec& ls = spec.layers[l];
    cal.load_layer(ls);
    // One forward of the FP16 layer per window, with taps at all four groups: their Hessians.
    std::vector<GpuHessian> hessians;
    hessians.reserve(groups().size());
    for (const Group& g : groups()) hessians.emplace_back(ctx, first_member(ls, g).K);
    GpuLayerTaps taps;
    taps.input = [&](LinearGroup id, const __half* in, int rows, int) {
      for (size_t i = 0; i < groups().size(); ++i)
        if (groups()[i].id == id) hessians[i].add(in, rows);
    };
    const double e_in = residual ? cal.energy() : 0;
    for (int w = 0; w < S; ++w) cal.forward(w, &taps);  // the next layer gets the FP16 outputs
    const double e_out = residual ? cal.energy() : 0;

    // The row offset of each member in its group's fused GPU linear.
    auto weight_of = [&](const Group& g, LinearSpec LayerSpec::*member) {
      int64_t row = 0;
      for (auto m : g.members) {
        if (m == member) break;
        row += (ls.*m).name.empty() ? 0 : (ls.*m).N;
      }
      return (L.*g.fused).dense + row * (ls.*member).K;
    };
    // tr(W H W^T) of a member on its group's Hessian: the energy of its outputs (twice their
    // mean squared norm).
    auto energy_of = [&](size_t gi, LinearSpec LayerSpec::*member) {
      const LinearSpec& m = ls.*member;
      const float* W32 = cal.to_fp32(weight_of(groups()[gi], member), m.N, m.K);
      return output_energy_cuda(ctx, W32, m.N, m.K, hessians[gi].data());
    };
    // --loss residual: each block's share of the residual stream, mean ||block output||^2 (half
    // of tr(W H W^T) for its last linear, o or down) over the residual's mean ||x||^2.
    std::vector<double> block_share(groups().size(), 1.0);
    if (residual) {
      auto share = [&](size_t last, double e_res) {
        return 0.5 * energy_of(last, groups()[last].members.back()) / e_res;
      };
      block_share[0] = block_share[1] = share(1, e_in);                  // q/k/v, o
      block_share[2] = block_share[3] = share(3, 0.5 * (e_in + e_out));  // gate/up, down
    }

    for (size_t gi = 0; gi < groups().size(); ++gi) {
      const Group& g = groups()[gi];
      const LinearSpec& first = first_member(ls, g);
      const int64_t K = first.K;
      // The factor depends on the Hessian, act_order and damp alone: one for every linear of
      // the group and every candidate.
      std::optional<GpuGptqFactor> factor;
      if (o.method == "gptq") factor.emplace(ctx, hessians[gi].data(), K, o.gptq, first.name);
      for (auto m : g.members) {
        const LinearSpec& sm = ls.*m;
        if (sm.name.empty()) continue;
        PlannedLinear p;
        p.name = sm.name;
        p.N = sm.N;
        p.K = sm.K;
        // --loss relative divides by tr(W H W^T), the energy of the linear's outputs.
        // --loss residual also weights it by the block's share of the residual stream.
        double scale = 1.0;
        if (o.loss == "relative" || residual) {
          const double e = energy_of(gi, m);
          scale = (e > 0 ? 1.0 / e : 1.0) * block_share[gi];
        }
        const float* W32 = cal.to_fp32(weight_of(g, m), sm.N, sm.K);
        for (const QuantSetting& cand : candidates) {
          if ((sm.K * cand.bits) % 32 != 0 || (sm.N * cand.bits) % 32 != 0) continue;
          GptqOptions go = o.gptq;
          go.bits = cand.bits;
          go.group_size = cand.group_size;
          GpuQuantOutputs qo;
          qo.codes_host = false;  // the loss is all that is kept
          qo.error_hessian = hessians[gi].data();
          if (factor)
            gptq_quantize_cuda(ctx, *factor, W32, sm.N, sm.K, go, sm.name, qo);
          else
            rtn_quantize_cuda(ctx, W32, sm.N, sm.K, go, sm.name, qo);
          PlanCandidate pc;
          pc.bits = cand.bits;
          pc.group_size = cand.group_size;
          pc.bytes = gptq_linear_bytes(sm.N, sm.K, cand.bits, cand.group_size);
          pc.error = scale * qo.output_error;
          p.measured.emplace_back(cand, pc);
        }
        if (p.measured.empty())
          throw Error(fmt::format("{}: [{}, {}] cannot be packed at any of the candidates' bit "
                                  "widths (in and out features times bits must be multiples of "
                                  "32)", p.name, p.N, p.K));
        out.push_back(std::move(p));
      }
    }
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    bar.update(l + 1);
  }
  bar.finish();
  return out;
}

}  // namespace kestrel::quant
