// kestrel-bench-gemv: achieved bandwidth of the batch-1 GEMV kernels on the Llama-2-7B shapes,
// against a device-to-device copy and cuBLAS measured in the same run.
//
// Method: every weight is repeated in enough device copies (> 4 x L2 in total) that each launch
// reads its weights from HBM, not L2; launches are captured into a CUDA graph (as the engine
// runs them) rotating over the copies, at least 128 launches per graph; after warm-up replays,
// each replay is timed with CUDA events and the median per-launch time is reported. Bytes =
// what the kernel must move: codes + scales + zeros (+ perm) + x + y for GPTQ, W + x + y for
// fp16.
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/device.h"
#include "base/dtype.h"
#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemv/gemv.h"
#include "tools/bench_gemv/loads.h"
#include "tools/llama7b_shapes.h"
#include "tools/median.h"

namespace kestrel {
namespace {

using bench::median;
using cuda::DeviceBuffer;
using cuda::GemvLaunch;
using cuda::GemvWeight;

using bench::Shape;
constexpr const auto& kShapes = bench::kLlama7bShapes;
const Shape kLmHead = {"lm_head", 32000, 4096};

// A grid no GEMV has as many tiles as: gemv clamps it to one block per tile.
constexpr int kAllTiles = 1 << 30;

struct Row {
  std::string kind;  // gptq | f16 | cublas
  std::string shape;
  int64_t N = 0, K = 0;
  int bits = 16, group = 0;
  bool act = false;
  // Act-order as the decode step runs it: x written in the weight's permutation by the kernel
  // before (gemv_input_permuted: no gather, no permutation read).
  bool x_permuted = false;
  std::string fused;  // the op fused into the GEMV as the engine runs it ("" = none)
  GemvLaunch launch;  // launch.specialized false: the run-time kernel (--generic's rows)
  double bytes = 0, us = 0;
  double gbps() const { return bytes / us * 1e-3; }
};

struct Options {
  int min_launches = 400;
  int min_replays = 30;
  bool sweep = false;
  std::string out = "md";
  // Restrict the run (e.g. for a profiler): one shape name, one bit width (16 = fp16 only),
  // one group size.
  std::string shape;
  int bits = 0, group = 0;
  bool generic = false;  // --generic: each GPTQ row again through the run-time kernel
  bool loads = false;  // --loads: the loads-only kernels instead (loads.cu)
};

// Median microseconds per launch: the rotation fn(0) .. fn(copies - 1) captured in one graph as
// many times as it takes to reach 128 launches (the graph's own start, a few microseconds, is
// then a small share of each launch, as in the engine's decode graph of hundreds of kernels),
// replayed after a warm-up, each replay timed with events.
template <class Fn>
double time_graph(cudaStream_t s, int copies, const Options& o, Fn fn) {
  // One plain call first: library handles, heuristics and occupancy caches initialise
  // outside the capture.
  fn(0);
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  const int batch = (128 + copies - 1) / copies * copies;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < batch; ++i) fn(i % copies);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int w = 0; w < 5; ++w) KESTREL_CUDA_CHECK(cudaGraphLaunch(ge, s));
  const int replays = std::max(o.min_replays, (o.min_launches + batch - 1) / batch);
  std::vector<cudaEvent_t> ev(2 * replays);
  for (auto& e : ev) KESTREL_CUDA_CHECK(cudaEventCreate(&e));
  for (int r = 0; r < replays; ++r) {
    KESTREL_CUDA_CHECK(cudaEventRecord(ev[2 * r], s));
    KESTREL_CUDA_CHECK(cudaGraphLaunch(ge, s));
    KESTREL_CUDA_CHECK(cudaEventRecord(ev[2 * r + 1], s));
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> us(replays);
  for (int r = 0; r < replays; ++r) {
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
    us[r] = 1e3 * ms / batch;
  }
  for (auto& e : ev) KESTREL_CUDA_CHECK(cudaEventDestroy(e));
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(ge));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(g));
  return median(us);
}

// Copies needed so that a rotation over them touches more than 4 x L2.
int copies_for(size_t bytes) {
  const size_t l2 = cuda::current_device_info().l2_bytes;
  return static_cast<int>(std::max<size_t>(2, (4 * l2) / std::max<size_t>(bytes, 1) + 1));
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A random symmetric GPTQ linear in checkpoint layout (random words are random codes).
struct Gptq {
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  std::vector<int32_t> g_idx;
  gptq::GptqView view;
};

Gptq random_gptq(int64_t N, int64_t K, int bits, int group, bool act, uint64_t seed) {
  Gptq t;
  const int64_t G = group > 0 ? (K + group - 1) / group : 1;
  t.qweight.resize(K * bits / 32 * N);
  for (auto& w : t.qweight) w = static_cast<uint32_t>(splitmix(seed));
  // Symmetric, gptq (v1): stored zero 2^(b-1) - 1 for every column.
  std::vector<uint32_t> col_stream((N * bits + 31) / 32, 0u);
  for (int64_t n = 0; n < N; ++n)
    gptq::write_code(col_stream.data(), 1, n, bits, (1u << (bits - 1)) - 1u);
  for (int64_t g = 0; g < G; ++g)
    t.qzeros.insert(t.qzeros.end(), col_stream.begin(), col_stream.end());
  t.scales.resize(G * N);
  for (auto& s : t.scales)
    s = float_to_half(1e-3f + 1e-2f * float(splitmix(seed) >> 40) / float(1 << 24));
  if (act) {
    std::vector<int32_t> perm(K);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    t.g_idx = gptq::act_order_g_idx(perm, group);
  }
  t.view.bits = bits;
  t.view.group_size = group;
  t.view.K = K;
  t.view.N = N;
  t.view.zero_offset = 1;
  t.view.qweight = t.qweight.data();
  t.view.qzeros = t.qzeros.data();
  t.view.scales = t.scales.data();
  t.view.g_idx = act ? t.g_idx.data() : nullptr;
  return t;
}

DeviceBuffer random_halves(size_t n, float scale, uint64_t seed) {
  std::vector<uint16_t> h(n);
  for (auto& v : h)
    v = float_to_half(scale * (float(splitmix(seed) >> 40) / float(1 << 24) * 2.f - 1.f));
  DeviceBuffer d(n * 2);
  KESTREL_CUDA_CHECK(cudaMemcpy(d.get(), h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

struct Bench {
  Options o;
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  DeviceBuffer blas_ws;
  DeviceBuffer x, y;
  double copy_gbps = 0;
  std::vector<Row> rows, sweep_rows;

  explicit Bench(const Options& opt) : o(opt) {
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    KESTREL_CUBLAS_CHECK(cublasCreate(&blas));
    KESTREL_CUBLAS_CHECK(cublasSetStream(blas, s));
    blas_ws = DeviceBuffer(32 << 20);  // a fixed workspace: no allocation during graph capture
    KESTREL_CUBLAS_CHECK(cublasSetWorkspace(blas, blas_ws.get(), blas_ws.size()));
    x = random_halves(64 * 1024, 1.f, 1);
    y = DeviceBuffer(64 * 1024 * 2);
  }
  ~Bench() {
    cublasDestroy(blas);
    cudaStreamDestroy(s);
  }

  // Device-to-device cudaMemcpyAsync of 1 GiB, plain stream launches (a memcpy node in a graph
  // may go to a copy engine, slower than the SM copy a stream D2D memcpy gets): bytes read +
  // written over the median time.
  void measure_copy() {
    const size_t n = size_t(1) << 30;
    DeviceBuffer a(n), b(n);
    KESTREL_CUDA_CHECK(cudaMemset(a.get(), 1, n));
    cudaEvent_t e0, e1;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e0));
    KESTREL_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> us;
    for (int i = 0; i < 23; ++i) {
      KESTREL_CUDA_CHECK(cudaEventRecord(e0, s));
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice, s));
      KESTREL_CUDA_CHECK(cudaEventRecord(e1, s));
      KESTREL_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 3) us.push_back(1e3 * ms);  // the first copies warm up
    }
    KESTREL_CUDA_CHECK(cudaEventDestroy(e0));
    KESTREL_CUDA_CHECK(cudaEventDestroy(e1));
    copy_gbps = 2.0 * n / median(us) * 1e-3;
  }

  // The copies in rotation at launch l, with an optional fused input op and residual.
  double time_gptq(const std::vector<GemvWeight>& ws, const GemvLaunch& l,
                   cuda::GemvInput in = {}, const __half* residual = nullptr) {
    return time_graph(s, static_cast<int>(ws.size()), o, [&](int i) {
      GemvWeight w = ws[i];
      w.launch = l;
      cuda::gemv(w, x.as<__half>(), y.as<__half>(), residual, s, in);
    });
  }

  void run_gptq(const Shape& sh, int bits, int group, bool act) {
    Gptq t = random_gptq(sh.N, sh.K, bits, group, act, 7 + bits * 131 + group);
    std::vector<GemvWeight> ws;
    ws.push_back(cuda::gemv_prepare({t.view}, s));
    const int copies = copies_for(ws[0].device_bytes);
    for (int i = 1; i < copies; ++i) ws.push_back(cuda::gemv_clone(ws[0], s));
    Row r;
    r.kind = "gptq";
    r.shape = sh.name;
    r.N = sh.N;
    r.K = sh.K;
    r.bits = bits;
    r.group = group;
    r.act = act;
    r.launch = ws[0].launch;
    r.bytes = static_cast<double>(ws[0].bytes_moved());
    r.us = time_gptq(ws, r.launch);
    rows.push_back(r);
    if (o.generic) {  // the same weights through the run-time kernel, in the same run
      Row g = r;
      g.launch.specialized = false;
      g.us = time_gptq(ws, g.launch);
      rows.push_back(g);
    }
    if (act) {
      Row v = r;
      v.x_permuted = true;
      std::vector<GemvWeight> views;  // share ws's memory
      for (const GemvWeight& w : ws) views.push_back(cuda::gemv_input_permuted(w));
      v.bytes = static_cast<double>(views[0].bytes_moved());
      v.us = time_gptq(views, r.launch);
      rows.push_back(v);
    }
    // 4-bit g128 also as the decode step runs it: RMSNorm fused into the staging of x (qkv,
    // gate_up), SiLU(gate) * up (down, whose x is then [gate | up]), the residual (o).
    if (bits == 4 && group == 128 && !act) {
      Row f = r;
      const std::string name = sh.name;
      cuda::GemvInput in;
      const __half* res = nullptr;
      if (name == "qkv" || name == "gate_up") {
        f.fused = "rmsnorm";
        in.norm_w = x.as<__half>() + 32 * 1024;
        in.eps = 1e-5f;
        f.bytes += sh.K * 2;
      } else if (name == "down") {
        f.fused = "silu*up";
        in.silu_mul = true;
        f.bytes += sh.K * 2;
      } else {
        f.fused = "residual";
        res = y.as<__half>();
        f.bytes += sh.N * 2;
      }
      f.us = time_gptq(ws, r.launch, in, res);
      rows.push_back(f);
    }
    if (o.sweep && sh.K * sh.N >= 4096 * 11008 && group == 128 && bits >= 3) {
      // The quantized kernel has no k_split (a lane owns whole units of K): grid and PDL.
      const int sms = cuda::current_device_info().sm_count;
      for (int grid : {sms / 2, sms, 2 * sms})
        for (bool pdl : {true, false}) {
          Row v = r;
          v.launch = GemvLaunch{1, grid, pdl};
          v.us = time_gptq(ws, v.launch);
          sweep_rows.push_back(v);
        }
    }
    for (auto& w : ws) cuda::gemv_free(w);
  }

  // fp16 weights: gemv_f16 and cuBLAS (GemmEx, m = 1) on the same copies.
  void run_f16(const Shape& sh) {
    const size_t elems = static_cast<size_t>(sh.N) * sh.K;
    std::vector<DeviceBuffer> ws;
    ws.push_back(random_halves(elems, 0.05f, 11 + sh.N));
    const int copies = copies_for(elems * 2);
    for (int i = 1; i < copies; ++i) {
      ws.emplace_back(elems * 2);
      KESTREL_CUDA_CHECK(
          cudaMemcpy(ws.back().get(), ws[0].get(), elems * 2, cudaMemcpyDeviceToDevice));
    }
    Row r;
    r.kind = "f16";
    r.shape = sh.name;
    r.N = sh.N;
    r.K = sh.K;
    r.bytes = double(elems) * 2 + double(sh.K) * 2 + double(sh.N) * 2;
    r.us = time_graph(s, copies, o, [&](int i) {
      cuda::gemv_f16(ws[i].as<__half>(), x.as<__half>(), y.as<__half>(), sh.N, sh.K, nullptr, s);
    });
    rows.push_back(r);
    Row b = r;
    b.kind = "cublas";
    const float alpha = 1.f, beta = 0.f;
    b.us = time_graph(s, copies, o, [&](int i) {
      // Column-major view: W row-major [N, K] is A = [K, N], lda = K; y = A^T x.
      KESTREL_CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(sh.N), 1, int(sh.K),
                                        &alpha, ws[i].get(), CUDA_R_16F, int(sh.K), x.get(),
                                        CUDA_R_16F, int(sh.K), &beta, y.get(), CUDA_R_16F,
                                        int(sh.N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    rows.push_back(b);
    if (o.sweep && sh.N * sh.K >= 4096 * 11008) {
      const int sms = cuda::current_device_info().sm_count;
      for (int ks : {1, 2, 4})
        for (int grid : {sms, 2 * sms}) {
          Row v = r;
          v.launch = GemvLaunch{ks, grid, true};
          v.us = time_graph(s, copies, o, [&](int i) {
            cuda::gemv_f16(ws[i].as<__half>(), x.as<__half>(), y.as<__half>(), sh.N, sh.K, nullptr,
                           s, v.launch);
          });
          sweep_rows.push_back(v);
        }
    }
  }

  const Row* find(const std::string& kind, const std::string& shape) const {
    for (const Row& r : rows)
      if (r.kind == kind && r.shape == shape) return &r;
    return nullptr;
  }
};

std::string config_name(const Row& r) {
  if (r.kind != "gptq") return r.kind == "f16" ? "fp16 (gemv_f16)" : "fp16 (cuBLAS)";
  return fmt::format("{}-bit g{}{}{}{}", r.bits, r.group > 0 ? std::to_string(r.group) : "row",
                     r.act ? (r.x_permuted ? " act, x permuted" : " act") : "",
                     r.fused.empty() ? "" : " + " + r.fused,
                     r.launch.specialized ? "" : ", run-time kernel");
}

void print_md(const Bench& b) {
  const auto& d = cuda::current_device_info();
  fmt::print("# kestrel-bench-gemv on {} ({} SMs, L2 {} MB)\n\n", d.name, d.sm_count,
             d.l2_bytes >> 20);
  fmt::print("Device-to-device copy (1 GiB, read + written): **{:.0f} GB/s**\n\n", b.copy_gbps);
  fmt::print(
      "| shape | N x K | weights | launch (ks/grid) | MB moved | us | GB/s | % copy | "
      "cuBLAS fp16 GB/s |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : b.rows) {
    const Row* cb = b.find("cublas", r.shape);
    fmt::print("| {} | {}x{} | {} | {} | {:.2f} | {:.2f} | {:.0f} | {:.1f}% | {} |\n", r.shape, r.N,
               r.K, config_name(r),
               r.kind == "cublas" ? std::string("-")
                                  : r.launch.grid == 0
                                        ? fmt::format("{}/auto", r.launch.k_split)
                                        : fmt::format("{}/{}", r.launch.k_split, r.launch.grid),
               r.bytes / 1e6, r.us, r.gbps(), 100.0 * r.gbps() / b.copy_gbps,
               cb ? fmt::format("{:.0f}", cb->gbps()) : std::string("-"));
  }
  if (!b.sweep_rows.empty()) {
    fmt::print(
        "\n## Launch sweep (grid tiles = one block per row tile)\n\n| shape | weights | k_split | "
        "grid | pdl | us | GB/s | % copy |\n|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : b.sweep_rows)
      fmt::print("| {} | {} | {} | {} | {} | {:.2f} | {:.0f} | {:.1f}% |\n", r.shape,
                 config_name(r), r.launch.k_split,
                 r.launch.grid == kAllTiles ? std::string("tiles") : std::to_string(r.launch.grid),
                 r.launch.pdl ? 1 : 0, r.us, r.gbps(), 100.0 * r.gbps() / b.copy_gbps);
    fmt::print(
        "\n## Best launch per shape and weights (sweep)\n\n| shape | weights | k_split | "
        "grid | pdl | GB/s | % copy | default GB/s |\n|---|---|---|---|---|---|---|---|\n");
    std::vector<const Row*> best;
    for (const Row& r : b.sweep_rows) {
      auto it = std::find_if(best.begin(), best.end(), [&](const Row* x) {
        return x->shape == r.shape && config_name(*x) == config_name(r);
      });
      if (it == best.end())
        best.push_back(&r);
      else if (r.gbps() > (*it)->gbps())
        *it = &r;
    }
    for (const Row* r : best) {
      double def = 0;
      for (const Row& d : b.rows)
        if (d.shape == r->shape && config_name(d) == config_name(*r)) def = d.gbps();
      fmt::print(
          "| {} | {} | {} | {} | {} | {:.0f} | {:.1f}% | {:.0f} |\n", r->shape, config_name(*r),
          r->launch.k_split,
          r->launch.grid == kAllTiles ? std::string("tiles") : std::to_string(r->launch.grid),
          r->launch.pdl ? 1 : 0, r->gbps(), 100.0 * r->gbps() / b.copy_gbps, def);
    }
  }
}

void print_json(const Bench& b) {
  const auto& d = cuda::current_device_info();
  nlohmann::json j;
  j["device"] = d.name;
  j["sm_count"] = d.sm_count;
  j["l2_bytes"] = d.l2_bytes;
  j["copy_gbps"] = b.copy_gbps;
  auto dump = [&](const std::vector<Row>& rows) {
    nlohmann::json a = nlohmann::json::array();
    for (const Row& r : rows)
      a.push_back({{"kind", r.kind},
                   {"shape", r.shape},
                   {"N", r.N},
                   {"K", r.K},
                   {"bits", r.bits},
                   {"group_size", r.group},
                   {"act_order", r.act},
                   {"x_permuted", r.x_permuted},
                   {"k_split", r.launch.k_split},
                   {"specialized", r.launch.specialized},
                   {"grid", r.launch.grid},
                   {"pdl", r.launch.pdl},
                   {"bytes", r.bytes},
                   {"us_median", r.us},
                   {"gbps", r.gbps()},
                   {"fraction_of_copy", r.gbps() / b.copy_gbps}});
    return a;
  };
  j["results"] = dump(b.rows);
  if (!b.sweep_rows.empty()) j["sweep"] = dump(b.sweep_rows);
  fmt::print("{}\n", j.dump(2));
}

// --loads: the weight stream alone (no dequantization, no x, no output) at 4-bit row sizes of the
// 1.1B and 7B shapes, for 1-3 row steps in flight per warp and two ways of dealing rows.
void run_loads(Bench& b) {
  struct LoadShape {
    const char* name;
    int64_t rows;
    int row_bytes;
  };
  const LoadShape shapes[] = {{"1.1B qkv", 2560, 1024},    {"1.1B o", 2048, 1024},
                              {"1.1B gate_up", 11264, 1024}, {"1.1B down", 2048, 2816},
                              {"7B qkv", 12288, 2048},      {"7B o", 4096, 2048},
                              {"7B gate_up", 22016, 2048},  {"7B down", 4096, 5504}};
  DeviceBuffer sink(bench::loads_sink_words() * sizeof(uint32_t));
  fmt::print("Device-to-device copy (1 GiB, read + written): **{:.0f} GB/s**\n\n", b.copy_gbps);
  fmt::print(
      "| shape | rows x row bytes | MB | rows per warp | steps in flight | us | GB/s | % copy |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const LoadShape& sh : shapes) {
    const size_t bytes = size_t(sh.rows) * sh.row_bytes;
    const int copies = copies_for(bytes);
    DeviceBuffer w(bytes * copies);
    KESTREL_CUDA_CHECK(cudaMemset(w.get(), 0x5A, w.size()));
    for (bool rr : {false, true})
      for (int depth = 1; depth <= 3; ++depth) {
        const double us = time_graph(b.s, copies, b.o, [&](int i) {
          bench::launch_loads(static_cast<const char*>(w.get()) + bytes * i, sh.rows,
                              sh.row_bytes, depth, rr, static_cast<uint32_t*>(sink.get()), b.s);
        });
        const double gbps = bytes / us * 1e-3;
        fmt::print("| {} | {} x {} | {:.2f} | {} | {} | {:.2f} | {:.0f} | {:.1f}% |\n", sh.name,
                   sh.rows, sh.row_bytes, bytes / 1e6, rr ? "pairs round-robin" : "equal runs",
                   depth, us, gbps, 100.0 * gbps / b.copy_gbps);
      }
  }
}

int run(int argc, char** argv) {
  CLI::App app{"kestrel-bench-gemv: GEMV bandwidth on the Llama-2-7B shapes"};
  Options o;
  app.add_option("-o,--output", o.out, "md or json")->check(CLI::IsMember({"md", "json"}));
  app.add_option("--min-launches", o.min_launches, "timed launches per measurement (at least)");
  app.add_flag("--sweep", o.sweep, "also sweep k_split, grid and PDL on the large shapes");
  app.add_option("--shape", o.shape, "only this shape (qkv, o, gate_up, down, lm_head)");
  app.add_option("--bits", o.bits, "only this bit width (2, 3, 4, 8; 16 = fp16)");
  app.add_option("--group", o.group, "only this group size (32, 64, 128, -1)");
  app.add_flag("--generic", o.generic,
               "also time each GPTQ weight through the run-time kernel (GemvLaunch::specialized "
               "false), against the specialized kernels in the same run");
  app.add_flag("--loads", o.loads,
               "only the weight stream: loads-only kernels over steps in flight and row order");
  app.set_version_flag("--version", "kestrel-bench-gemv " KESTREL_VERSION);
  CLI11_PARSE(app, argc, argv);
  // Without a GPU, say so as kestrel does (base/device.h), not as the first CUDA call fails.
  const CudaStatus gpu = cuda_status();
  if (!gpu.usable) {
    std::fprintf(stderr, "kestrel-bench-gemv: %s; this benchmark measures GPU kernels\n",
                 gpu.problem.c_str());
    return 1;
  }

  Bench b(o);
  b.measure_copy();
  if (o.loads) {
    run_loads(b);
    return 0;
  }
  auto shape_on = [&](const Shape& sh) { return o.shape.empty() || o.shape == sh.name; };
  for (const Shape& sh : kShapes) {
    if (!shape_on(sh)) continue;
    if (o.bits == 0 || o.bits == 16) b.run_f16(sh);
    for (int bits : {2, 3, 4, 8}) {
      if (o.bits != 0 && o.bits != bits) continue;
      for (int group : {32, 64, 128, -1})
        if (o.group == 0 || o.group == group) b.run_gptq(sh, bits, group, false);
      if (o.group == 0 || o.group == 128) b.run_gptq(sh, bits, 128, true);
    }
  }
  if (shape_on(kLmHead) && (o.bits == 0 || o.bits == 16)) b.run_f16(kLmHead);
  if (o.out == "json")
    print_json(b);
  else
    print_md(b);
  return 0;
}

}  // namespace
}  // namespace kestrel

int main(int argc, char** argv) {
  try {
    return kestrel::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kestrel-bench-gemv: %s\n", e.what());
    return 1;
  }
}
