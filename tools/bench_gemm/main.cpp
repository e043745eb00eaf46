// kestrel-bench-gemm: the prefill linears on the Llama-2-7B (or, --shape 1b, Llama 1.1B) shapes
// at 1 .. 2048 tokens.
// Per shape and token count M, in one run:
//   gemv     M batch-1 GEMVs over the packed codes (the decode kernel; up to --gemv-max rows)
//   fused    the fused dequantize + tensor-core GEMM over the packed codes (gemm_small.h; M <= 64)
//   quant    the quantized GEMM path: dequantize to FP16 scratch + cuBLASLt (+ gather, act-order)
//   f16      cuBLASLt alone on the already dequantized FP16 weight (the ceiling of quant)
//   deq      the dequantization alone
// With --slice-mib / --workspace-mib lists, a memory sweep: one layer's quantized path per
// dequantized slice size and cuBLASLt workspace, the prefill scratch each costs, at each M;
// then the causal prefill attention of one 7B layer (32 heads of 128) for a chunk of M tokens
// from position 0, both kernels, and a device-to-device copy for the bandwidth ceiling.
// quant / f16 is the fraction of the plain FP16 GEMM the quantized path reaches; the crossover
// is the smallest M at which quant beats the GEMVs (kernels/gemm/gemm.h's kGemmMinRows).
// fused / gemv1 is the fused GEMM's time over one batch-1 GEMV's (its targets on the 7B shapes at
// 4-bit g128: within 1.3x up to M = 16, 2x at M = 64, and below quant at every M <= 64).
// With --fused-sweep, only the fused GEMM's launch plans instead: per shape and M in
// --sweep-m, every candidate GemmSmallLaunch (warps per block, ring depth, token tiles, x staged
// once or per stage, split-K) that fits, the default plan's time next to the best one's, the
// best few listed, and one layer's total under each (which plan to make the default).
//
// Method: CUDA events around each call after warm-up, median of --reps. GEMV and fused timings
// rotate over enough weight copies (> 4 x L2) that the codes come from HBM; the GEMMs at the sizes where they
// matter are compute-bound and their FP16 weights (34-180 MB) exceed L2 anyway.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "base/device.h"
#include "base/dtype.h"
#include "base/error.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_small.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gptq/gptq_format.h"
#include "tools/llama7b_shapes.h"

namespace kestrel {
namespace {

using cuda::DeviceBuffer;
using cuda::GemvWeight;

using bench::Shape;

struct Options {
  int bits = 4, group = 128, reps = 9, gemv_max = 64, max_rows = 2048;
  bool act_order = false;
  std::string shape = "7b";
  // The memory sweep: the quantized path of one layer with each dequantized slice size and
  // cuBLASLt workspace (MiB), at each token count; run when either list is not just 32.
  std::vector<int> slice_mib{32}, workspace_mib{32};
  std::vector<int> sweep_rows{128, 256, 512, 1024, 2048};
  // The fused GEMM's plan sweep (--fused-sweep) and its token counts.
  bool fused_sweep = false;
  std::string sweep_kernels = "both";  // ring, stream or both
  std::vector<int> fused_sweep_m{1, 4, 8, 16, 32, 64};
  int fused_top = 5;  // plans listed per (shape, M)
};

// A random GPTQ linear: any word of random bits is a valid stream of codes.
GemvWeight random_weight(const Shape& s, const Options& o, std::mt19937& rng) {
  const int64_t G = o.group > 0 ? s.K / o.group : 1;
  std::vector<uint32_t> qweight((size_t)(s.K * o.bits / 32) * s.N);
  for (auto& w : qweight) w = rng();
  std::vector<uint8_t> z((size_t)G * s.N, (uint8_t)((1 << (o.bits - 1)) - 1));
  const std::vector<uint32_t> qzeros = gptq::pack_qzeros(z, G, s.N, o.bits);
  std::vector<uint16_t> scales((size_t)G * s.N);
  std::uniform_real_distribution<float> sd(0.004f, 0.02f);
  for (auto& v : scales) v = float_to_half(sd(rng));
  std::vector<int32_t> g_idx;
  if (o.act_order) {
    std::vector<int32_t> order(s.K);
    for (int64_t k = 0; k < s.K; ++k) order[k] = (int32_t)k;
    std::shuffle(order.begin(), order.end(), rng);
    g_idx = gptq::act_order_g_idx(order, o.group);
  }
  gptq::GptqView v;
  v.bits = o.bits;
  v.group_size = o.group;
  v.K = s.K;
  v.N = s.N;
  v.qweight = qweight.data();
  v.qzeros = qzeros.data();
  v.scales = scales.data();
  v.g_idx = g_idx.empty() ? nullptr : g_idx.data();
  return cuda::gemv_prepare({v}, nullptr);
}

// Median milliseconds of fn() over reps timed calls, after two warm-up calls.
template <class Fn>
double time_ms(int reps, Fn fn) {
  cudaEvent_t a, b;
  KESTREL_CUDA_CHECK(cudaEventCreate(&a));
  KESTREL_CUDA_CHECK(cudaEventCreate(&b));
  fn();
  fn();
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) {
    KESTREL_CUDA_CHECK(cudaEventRecord(a));
    fn();
    KESTREL_CUDA_CHECK(cudaEventRecord(b));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(b));
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms[r], a, b));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

std::string plan_label(const cuda::GemmSmallLaunch& l) {
  if (l.stream) return fmt::format("stream w{} ks{} sp{}", l.warps, l.k_slices, l.splits);
  return fmt::format("w{} st{} tt{} {} sp{}", l.warps, l.stages, l.token_tiles,
                     l.x_once ? "x-once " : "x-stage", l.splits);
}

// The candidate plans of the sweep for M tokens: warps 2/4/8 x ring 2/3/4/6 x token tiles (all
// of M's n-tiles, half, a quarter) x x once or per stage x split-K (the planner's, then forced).
// The streaming kernel's (M <= 16): warps 4/8 x k-slices 1/2/4/8 x split-K.
std::vector<cuda::GemmSmallLaunch> fused_candidates(int M, const std::string& kernels) {
  const int tiles = (M + 7) / 8;
  const int need = tiles <= 1 ? 1 : tiles <= 2 ? 2 : tiles <= 4 ? 4 : 8;
  std::vector<cuda::GemmSmallLaunch> out;
  if (kernels != "ring" && M <= 16)
    for (int warps : {4, 8})
      for (int ks : {1, 2, 4, 8})
        for (int splits : {0, 1, 2, 3, 4, 6, 8, 12, 16}) {
          if (ks > warps) continue;
          cuda::GemmSmallLaunch l;
          l.stream = true;
          l.warps = warps;
          l.k_slices = ks;
          l.splits = splits;
          out.push_back(l);
        }
  if (kernels == "stream") return out;
  for (int warps : {2, 4, 8})
    for (int stages : {2, 3, 4, 6})
      for (int tt = need; tt >= std::max(1, need / 4); tt /= 2)
        for (bool once : {false, true})
          for (int splits : {0, 1, 2, 3, 4, 6, 8, 12, 16}) {
            cuda::GemmSmallLaunch l;
            l.warps = warps;
            l.stages = stages;
            l.token_tiles = tt;
            l.x_once = once;
            l.splits = splits;
            out.push_back(l);
          }
  return out;
}

// --fused-sweep: every candidate plan of the fused GEMM per (shape, M), timed as the main table
// times it (weights rotated past L2).
int run_fused_sweep(const Options& o, const std::vector<Shape>& shapes, const DeviceBuffer& x,
                    DeviceBuffer& y, std::mt19937& rng) {
  const cuda::DeviceInfo& dev = cuda::current_device_info();
  struct Timed {
    cuda::GemmSmallLaunch plan;
    double ms;
  };
  // [shape][M]: the default plan and the best found.
  std::vector<std::vector<Timed>> defaults(shapes.size()), bests(shapes.size());
  std::vector<double> gemv1(shapes.size());
  std::vector<int> ms;  // x holds --max-rows tokens
  for (int M : o.fused_sweep_m)
    if (M <= o.max_rows) ms.push_back(M);
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape& s = shapes[si];
    GemvWeight w = random_weight(s, o, rng);
    const int copies = (int)std::max<size_t>(2, 4 * dev.l2_bytes / w.device_bytes + 1);
    std::vector<GemvWeight> rot{w};
    for (int i = 1; i < copies; ++i) rot.push_back(cuda::gemv_clone(w, nullptr));
    int next = 0;
    gemv1[si] = time_ms(o.reps, [&] {
      cuda::gemv(rot[next++ % rot.size()], x.as<__half>(), y.as<__half>(), nullptr, nullptr);
    });
    for (int M : ms) {
      // The plans that fit, resolved, and the largest workspace among them.
      std::vector<cuda::GemmSmallLaunch> plans;
      std::set<std::tuple<int, int, int, bool, int, bool, int>> seen;  // a forced split may be the planner's
      size_t ws_bytes = 16;
      for (const cuda::GemmSmallLaunch& c : fused_candidates(M, o.sweep_kernels)) {
        try {
          const size_t b = cuda::gemm_small_workspace_bytes(w, M, c);
          const cuda::GemmSmallLaunch r = cuda::gemm_small_plan(w, M, c);
          if (!seen.insert({r.warps, r.stream ? 0 : r.stages, r.token_tiles, r.x_once, r.splits, r.stream,
                            r.k_slices}).second)
            continue;
          plans.push_back(r);
          ws_bytes = std::max(ws_bytes, b);
        } catch (const Error&) {
          // A plan the device or the shape refuses (shared memory, splits past the stages).
        }
      }
      DeviceBuffer ws(ws_bytes);
      auto time_plan = [&](const cuda::GemmSmallLaunch& l) {
        // Plans lay out their split-K counters differently: zeroed before each, as a caller
        // zeroes a workspace once.
        KESTREL_CUDA_CHECK(cudaMemset(ws.get(), 0, ws_bytes));
        return time_ms(o.reps, [&] {
          cuda::gemm_small(rot[next++ % rot.size()], x.as<__half>(), M, y.as<__half>(), nullptr,
                           ws.get(), ws_bytes, nullptr, {}, l);
        });
      };
      const cuda::GemmSmallLaunch def = cuda::gemm_small_plan(w, M);
      const double def_ms = time_plan({});
      std::vector<Timed> timed;
      for (const cuda::GemmSmallLaunch& l : plans) timed.push_back({l, time_plan(l)});
      std::sort(timed.begin(), timed.end(), [](const Timed& a, const Timed& b) { return a.ms < b.ms; });
      defaults[si].push_back({def, def_ms});
      bests[si].push_back(timed.empty() ? Timed{def, def_ms} : timed[0]);
      fmt::print("{:>8} M={:<3} default {:<28} {:.4f} ms ({:.2f}x gemv1) | best {:<28} {:.4f} ms "
                 "({:.2f}x gemv1, {:.2f}x faster) | {} plans\n",
                 s.name, M, plan_label(def), def_ms, def_ms / gemv1[si], plan_label(bests[si].back().plan),
                 bests[si].back().ms, bests[si].back().ms / gemv1[si], def_ms / bests[si].back().ms,
                 timed.size());
      for (size_t i = 0; i < timed.size() && i < size_t(o.fused_top); ++i)
        fmt::print("{:>14} #{} {:<28} {:.4f} ms\n", "", i + 1, plan_label(timed[i].plan), timed[i].ms);
    }
    for (GemvWeight& r : rot) cuda::gemv_free(r);
  }
  // One layer (the four linears) per M: the default plans against the best of each.
  fmt::print("\n{:>6} | {:>12} {:>12} {:>12} | {:>10}\n", "M", "layer gemv1", "default ms",
             "best ms", "def/best");
  double g1 = 0;
  for (double v : gemv1) g1 += v;
  for (size_t mi = 0; mi < ms.size(); ++mi) {
    double d = 0, b = 0;
    for (size_t si = 0; si < shapes.size(); ++si) d += defaults[si][mi].ms, b += bests[si][mi].ms;
    fmt::print("{:>6} | {:>12.4f} {:>12.4f} {:>12.4f} | {:>9.2f}x\n", ms[mi], g1, d, b,
               d / b);
  }
  fmt::print("(plan: w warps per block, st ring stages, tt token tiles per block, x once or per "
             "stage, sp split-K ranges; stream: the streaming kernel, ks k-slices per m-tile; "
             "gemv1 = one batch-1 GEMV)\n");
  return 0;
}

int run(const Options& o) {
  const cuda::DeviceInfo& dev = cuda::current_device_info();
  fmt::print("device: {} ({} SMs, L2 {} MB)\n", dev.name, dev.sm_count, dev.l2_bytes >> 20);
  {
    const size_t bytes = size_t(1) << 30;
    DeviceBuffer src(bytes), dst(bytes);
    KESTREL_CUDA_CHECK(cudaMemset(src.get(), 1, bytes));
    const double ms = time_ms(o.reps, [&] {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice));
    });
    fmt::print("device-to-device copy: {:.2f} TB/s (read + write)\n", 2.0 * bytes / ms * 1e-9);
  }
  fmt::print("weights: {}-bit, group {}{}\n", o.bits, o.group, o.act_order ? ", act-order" : "");

  const std::vector<Shape> shapes =
      o.shape == "1b" ? std::vector<Shape>(std::begin(bench::kLlama1bShapes),
                                           std::end(bench::kLlama1bShapes))
                      : std::vector<Shape>(std::begin(bench::kLlama7bShapes),
                                           std::end(bench::kLlama7bShapes));
  std::string listed;
  for (const Shape& s : shapes)
    listed += fmt::format("{}{} {}x{}", listed.empty() ? "" : ", ", s.name, s.N, s.K);
  fmt::print("shapes: {} ({})\n", o.shape == "1b" ? "Llama 1.1B" : "Llama-2-7B", listed);
  std::mt19937 rng(1);
  int64_t maxK = 0, maxN = 0;
  for (const Shape& s : shapes) {
    maxK = std::max(maxK, s.K);
    maxN = std::max(maxN, s.N);
  }
  std::vector<uint16_t> xh((size_t)o.max_rows * maxK);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : xh) v = float_to_half(nd(rng));
  DeviceBuffer x(xh.size() * 2), y((size_t)o.max_rows * maxN * 2);
  KESTREL_CUDA_CHECK(cudaMemcpy(x.get(), xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
  if (o.fused_sweep) return run_fused_sweep(o, shapes, x, y, rng);
  cuda::GemmRunner runner;

  // Powers of two, and the token counts that break the fused kernel's n-tiles of 8.
  std::vector<int> rows;
  for (int m = 1; m <= o.max_rows; m *= 2) rows.push_back(m);
  for (int m : {3, 9, 17, 33})
    if (m <= o.max_rows) rows.push_back(m);
  std::sort(rows.begin(), rows.end());

  struct Cell {
    double gemv = -1, fused = -1, quant = 0, f16 = 0;
  };
  std::vector<std::vector<Cell>> table(std::size(shapes), std::vector<Cell>(rows.size()));
  std::vector<double> deq_ms(std::size(shapes));

  for (size_t si = 0; si < std::size(shapes); ++si) {
    const Shape& s = shapes[si];
    GemvWeight w = random_weight(s, o, rng);
    // Copies for the GEMV rotation: > 4 x L2 of codes in total.
    const int copies = (int)std::max<size_t>(2, 4 * dev.l2_bytes / w.device_bytes + 1);
    std::vector<GemvWeight> rot{w};
    for (int i = 1; i < copies; ++i) rot.push_back(cuda::gemv_clone(w, nullptr));
    // quant_gemm's scratch holds one dequantized slice of the weight (and the gathered input);
    // the whole weight, dequantized once for the f16 column and timed alone, goes to wd.
    DeviceBuffer scratch(cuda::quant_gemm_scratch_elems(w, o.max_rows) * 2);
    const size_t wd_elems = (size_t)s.N * s.K;
    DeviceBuffer wd(wd_elems * 2);
    // The fused GEMM's workspace (split-K partial sums): the largest any M <= 64 needs, zeroed
    // once as gemm_small asks.
    size_t fused_ws = 0;
    for (int M : rows)
      if (M <= cuda::kGemmSmallMaxRows)
        fused_ws = std::max(fused_ws, cuda::gemm_small_workspace_bytes(w, M));
    DeviceBuffer fws(std::max<size_t>(fused_ws, 16));
    KESTREL_CUDA_CHECK(cudaMemset(fws.get(), 0, std::max<size_t>(fused_ws, 16)));
    deq_ms[si] = time_ms(o.reps, [&] { cuda::dequantize_f16(w, wd.as<__half>(), wd_elems, nullptr); });

    int next = 0;
    for (size_t ri = 0; ri < rows.size(); ++ri) {
      const int M = rows[ri];
      Cell& c = table[si][ri];
      if (M <= o.gemv_max)
        c.gemv = time_ms(o.reps, [&] {
          for (int m = 0; m < M; ++m) {
            const GemvWeight& wr = rot[next++ % rot.size()];
            cuda::gemv(wr, x.as<__half>() + (size_t)m * s.K, y.as<__half>() + (size_t)m * s.N, nullptr, nullptr);
          }
        });
      if (M <= cuda::kGemmSmallMaxRows)
        c.fused = time_ms(o.reps, [&] {
          const GemvWeight& wr = rot[next++ % rot.size()];
          cuda::gemm_small(wr, x.as<__half>(), M, y.as<__half>(), nullptr,
                           fused_ws ? fws.get() : nullptr, fused_ws, nullptr);
        });
      c.quant = time_ms(o.reps, [&] {
        cuda::quant_gemm(runner, w, x.as<__half>(), M, y.as<__half>(), nullptr, scratch.as<__half>(), nullptr);
      });
      c.f16 = time_ms(o.reps, [&] {
        runner.gemm(x.as<__half>(), wd.as<__half>(), M, s.N, s.K, y.as<__half>(), nullptr, nullptr);
      });
    }
    for (GemvWeight& r : rot) cuda::gemv_free(r);
  }

  fmt::print("\n{:>8} {:>6} | {:>9} {:>9} {:>9} {:>9} | {:>8} {:>8} | {:>7} | {:>12} {:>11}\n",
             "shape", "M", "gemv ms", "fused ms", "quant ms", "f16 ms", "quant TF", "f16 TF", "q/f16",
             "fused/gemv1", "fused/quant");
  for (size_t si = 0; si < std::size(shapes); ++si) {
    const Shape& s = shapes[si];
    fmt::print("{:>8} dequantize alone: {:.3f} ms ({:.2f} TB/s of codes + fp16 out)\n", s.name,
               deq_ms[si], (s.N * s.K * (o.bits / 8.0 + 2.0)) / deq_ms[si] * 1e-9);
    int crossover = -1;
    const double gemv1 = table[si][0].gemv;  // rows[0] is M = 1
    double worst16 = 0, worst64 = 0;
    bool fused_beats_quant = true;
    for (size_t ri = 0; ri < rows.size(); ++ri) {
      const Cell& c = table[si][ri];
      const double flop = 2.0 * rows[ri] * s.N * s.K;
      if (crossover < 0 && c.gemv >= 0 && c.quant < c.gemv) crossover = rows[ri];
      auto ms = [](double v) { return v >= 0 ? fmt::format("{:.3f}", v) : std::string("-"); };
      const bool ratio = c.fused >= 0 && gemv1 > 0;
      if (c.fused >= 0) {
        if (rows[ri] <= 16) worst16 = std::max(worst16, c.fused / gemv1);
        worst64 = std::max(worst64, c.fused / gemv1);
        fused_beats_quant = fused_beats_quant && c.fused < c.quant;
      }
      fmt::print("{:>8} {:>6} | {:>9} {:>9} {:>9.3f} {:>9.3f} | {:>8.1f} {:>8.1f} | {:>6.1f}% | {:>12} {:>11}\n",
                 s.name, rows[ri], ms(c.gemv), ms(c.fused), c.quant, c.f16, flop / c.quant * 1e-9,
                 flop / c.f16 * 1e-9, 100.0 * c.f16 / c.quant,
                 ratio ? fmt::format("{:.2f}x", c.fused / gemv1) : std::string("-"),
                 c.fused >= 0 ? fmt::format("{:.2f}x", c.fused / c.quant) : std::string("-"));
    }
    fmt::print("{:>8} crossover: quant beats M GEMVs from M = {}\n", s.name,
               crossover < 0 ? std::string("(not within the GEMV range)") : std::to_string(crossover));
    if (gemv1 > 0 && worst64 > 0)
      fmt::print("{:>8} fused: worst M <= 16 {:.2f}x gemv(M=1) (target 1.3x), worst M <= 64 {:.2f}x "
                 "(target 2x), {} dequant + cuBLAS at every M <= 64\n",
                 s.name, worst16, worst64, fused_beats_quant ? "beats" : "does NOT beat");
  }
  // One decoder layer (the four linears) per token count.
  fmt::print("\n{:>6} | {:>10} {:>11} {:>10} {:>10} | {:>7}\n", "M", "layer gemv", "layer fused",
             "layer quant", "layer f16", "q/f16");
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    double g = 0, fu = 0, q = 0, f = 0;
    bool have_g = true, have_fu = true;
    for (size_t si = 0; si < std::size(shapes); ++si) {
      have_g = have_g && table[si][ri].gemv >= 0;
      have_fu = have_fu && table[si][ri].fused >= 0;
      g += table[si][ri].gemv;
      fu += table[si][ri].fused;
      q += table[si][ri].quant;
      f += table[si][ri].f16;
    }
    fmt::print("{:>6} | {:>10} {:>11} {:>10.3f} {:>10.3f} | {:>6.1f}%\n", rows[ri],
               have_g ? fmt::format("{:.3f}", g) : std::string("-"),
               have_fu ? fmt::format("{:.3f}", fu) : std::string("-"), q, f, 100.0 * f / q);
  }

  // The memory sweep (prefill scratch against prompt speed): one layer's four quantized
  // linears per (slice, workspace, M), each runner with its own scratch.
  const bool sweep = o.slice_mib != std::vector<int>{32} || o.workspace_mib != std::vector<int>{32};
  if (sweep) {
    std::vector<GemvWeight> ws;
    for (const Shape& s : shapes) ws.push_back(random_weight(s, o, rng));
    fmt::print("\n{:>9} {:>9} {:>6} | {:>14} {:>12} | {:>12}\n", "slice MiB", "wksp MiB", "M",
               "layer quant ms", "tokens/s x1", "scratch MiB");
    for (int sm : o.slice_mib)
      for (int wm : o.workspace_mib) {
        cuda::GemmMemory mem;
        mem.slice_halves = (size_t)sm << 19;  // MiB in halves
        mem.workspace_bytes = (size_t)wm << 20;
        cuda::GemmRunner r(mem);
        size_t scratch_elems = 0;
        for (const GemvWeight& w : ws)
          scratch_elems = std::max(
              scratch_elems, cuda::quant_gemm_scratch_elems(w, o.max_rows, mem.slice_halves));
        DeviceBuffer scratch(scratch_elems * 2);
        for (int M : o.sweep_rows) {
              const double ms = time_ms(o.reps, [&] {
            for (const GemvWeight& w : ws)
              cuda::quant_gemm(r, w, x.as<__half>(), M, y.as<__half>(), nullptr,
                               scratch.as<__half>(), nullptr);
          });
          fmt::print("{:>9} {:>9} {:>6} | {:>14.3f} {:>12.0f} | {:>12.1f}\n", sm, wm, M, ms,
                     M / ms * 1e3, scratch_elems * 2.0 / 1048576.0);
        }
      }
    fmt::print("(tokens/s x1: M over one layer's time; a model of L layers runs at about 1/L of it)\n");
    for (GemvWeight& w : ws) cuda::gemv_free(w);
  }

  // Causal attention of one Llama-2-7B layer over a chunk at position 0.
  fmt::print("\n{:>6} {:>6} | {:>9} {:>8} | {:>13}\n", "M", "kernel", "attn ms", "TFLOP/s", "x 32 layers ms");
  const int H = 32, D = 128, q_dim = H * D;
  for (int T : {512, 2048}) {
    if (T > o.max_rows) continue;
    std::vector<uint16_t> h((size_t)T * 3 * q_dim);
    for (auto& v : h) v = float_to_half(nd(rng));
    DeviceBuffer qkv(h.size() * 2), kc((size_t)T * q_dim * 2), vc((size_t)T * q_dim * 2),
        out((size_t)T * q_dim * 2);
    KESTREL_CUDA_CHECK(cudaMemcpy(qkv.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy(kc.get(), h.data(), (size_t)T * q_dim * 2, cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy(vc.get(), h.data() + (size_t)T * q_dim, (size_t)T * q_dim * 2,
                                  cudaMemcpyHostToDevice));
    const double flop = 4.0 * D * H * (double)T * (T + 1) / 2;
    for (auto kernel : {cuda::PrefillAttnKernel::Mma, cuda::PrefillAttnKernel::Wmma}) {
      const double ms = time_ms(o.reps, [&] {
        cuda::attention_prefill_f16(qkv.as<__half>(), 3 * q_dim, kc.as<__half>(), vc.as<__half>(), 0,
                                    T, 0, H, H, D, out.as<__half>(), nullptr, kernel);
      });
      fmt::print("{:>6} {:>6} | {:>9.3f} {:>8.1f} | {:>13.2f}\n", T,
                 kernel == cuda::PrefillAttnKernel::Mma ? "mma" : "wmma", ms, flop / ms * 1e-9, 32 * ms);
    }
  }
  return 0;
}

}  // namespace
}  // namespace kestrel

int main(int argc, char** argv) {
  kestrel::Options o;
  CLI::App app{"kestrel-bench-gemm: quantized GEMM (fused small-M; dequantize + cuBLASLt) vs FP16 cuBLASLt vs GEMVs, 7B shapes"};
  app.add_option("--bits", o.bits, "2, 3, 4 or 8")->check(CLI::IsMember({2, 3, 4, 8}));
  app.add_option("--group-size", o.group, "32, 64, 128 or -1")->check(CLI::IsMember({32, 64, 128, -1}));
  app.add_flag("--act-order", o.act_order, "random act-order permutation");
  app.add_option("--reps", o.reps, "timed repetitions per cell (median)")->check(CLI::PositiveNumber);
  app.add_option("--gemv-max", o.gemv_max, "largest M timed as M GEMVs")->check(CLI::NonNegativeNumber);
  app.add_option("--max-rows", o.max_rows, "largest M (powers of two from 1)")->check(CLI::Range(1, 8192));
  app.add_option("--shape", o.shape, "7b (Llama-2-7B linears) or 1b (Llama 1.1B)")
      ->check(CLI::IsMember({"7b", "1b"}));
  app.add_option("--slice-mib", o.slice_mib, "memory sweep: dequantized slice sizes, MiB")
      ->check(CLI::Range(1, 1024));
  app.add_option("--workspace-mib", o.workspace_mib, "memory sweep: cuBLASLt workspaces, MiB")
      ->check(CLI::Range(0, 1024));
  app.add_option("--sweep-rows", o.sweep_rows, "memory sweep: token counts")->check(CLI::Range(1, 8192));
  app.add_flag("--fused-sweep", o.fused_sweep,
               "time every launch plan of the fused small-M GEMM per shape and M (only that)");
  app.add_option("--sweep-kernels", o.sweep_kernels,
                 "fused sweep: the ring kernel's plans, the streaming kernel's (M <= 16), or both")
      ->check(CLI::IsMember({"ring", "stream", "both"}));
  app.add_option("--sweep-m", o.fused_sweep_m, "fused sweep: token counts")->check(CLI::Range(1, 64));
  app.add_option("--sweep-top", o.fused_top, "fused sweep: plans listed per shape and M")
      ->check(CLI::NonNegativeNumber);
  app.set_version_flag("--version", "kestrel-bench-gemm " KESTREL_VERSION);
  CLI11_PARSE(app, argc, argv);
  // Without a GPU, say so as kestrel does (base/device.h), not as the first CUDA call fails.
  const kestrel::CudaStatus gpu = kestrel::cuda_status();
  if (!gpu.usable) {
    fmt::print(stderr, "kestrel-bench-gemm: {}; this benchmark measures GPU kernels\n", gpu.problem);
    return 1;
  }
  try {
    return kestrel::run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "kestrel-bench-gemm: {}\n", e.what());
    return 1;
  }
}
