// The fused small-M GEMM (kernels/gemm/gemm_small.h) against the plain C++ reference
// (gptq::dequantize_ref, the weights rounded to fp16, fp32 sums: below), over the shapes and
// formats that break its tiling:
//   M      1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64 (n-tiles of 8 tokens: 1, 2, 4, 8)
//   N      not a multiple of a block's rows (128; 64 at 8 bits; SiLU: 64 or 32 pairs)
//   K      one stage of 512 codes, 1.56 stages, 4.06 stages (a last stage of one unit), and at
//          8 bits K % 8 == 4 (x gathered into padded rows first)
//   bits 2/3/4/8 x group 32/64/128/per row x sym/asym (v1 and v2 zeros) x act-order
//   split-K forced to 1, 2, 3 and every stage apart; the plan's own choice on a 7B shape
//   epilogues: residual (own buffer and aliasing y), bias, bias + ReLU, bias + residual, SiLU
//   over a [gate | up] weight prepared from two parts.
//   launch plans: every GemmSmallLaunch variant (warps per block, ring depth, x staged once,
//          token groups) on a subset of formats, plain, SiLU and residual, with split-K.
// Outputs past M are poisoned with NaN before the call and must stay so (no stray writes).
//
// The reference is what gemm_small specifies: each weight dequantized by the plain formula
// (gptq::dequantize_ref) and rounded once to fp16, as dequantize_f16 writes it for cuBLAS and
// as the kernel's hmul2 rounds it; products and sums in fp32. Against fp32 weights the
// rounding (2^-12 relative per weight) shows at 8 bits, whose rows sum terms of up to 2.5 to
// outputs of ~17 rms: a gate that cancels to ~0 carries ~1e-2 of it, which SiLU(gate) x up
// multiplies by |up| (~40) past any per-element tolerance that holds for the other formats.
// Tolerance: ||y - ref|| / ||ref|| < 2e-3: what is left is the fp32 summation order of the
// tensor cores and split-K, and the fp16 output. A wrong code, group, scale, zero point, k
// position or token gives errors of order 1e-2 to 1.
//
// The argument checks (GemmSmallChecks) come before any CUDA call and need no GPU; every other
// test is named Gpu* (ctest label gpu) and skips itself without one.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm_small.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gptq/gptq_format.h"
#include "tests/support/device_data.h"
#include "tests/support/engine_stream.h"
#include "tests/support/fake_weight.h"
#include "tests/support/gptq_formats.h"
#include "tests/support/compare.h"
#include "tests/support/gpu.h"

namespace kestrel {
namespace {

using cuda::DeviceBuffer;
using cuda::GemmSmallLaunch;
using cuda::GemvEpilogue;
using cuda::GemvWeight;
using ::testing::HasSubstr;

constexpr double kTol = 2e-3;
const int kAllM[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64};

using Format = kestrel::test::GptqFormat;
using kestrel::test::to_floats;
using kestrel::test::upload;
using kestrel::test::describe;
using kestrel::test::fake_gemv_weight;

// One random GPTQ linear in checkpoint tensors (N a multiple of 32: whole qzeros words at any
// width, which gptq's reference requires).
struct Linear {
  Format f;
  int64_t N = 0, K = 0, G = 0;
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  std::vector<int32_t> g_idx;
  gptq::GptqView view;
};

Linear random_linear(const Format& f, int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  Linear L;
  L.f = f;
  L.N = N;
  L.K = K;
  L.G = f.group_size > 0 ? (K + f.group_size - 1) / f.group_size : 1;
  const int maxq = (1 << f.bits) - 1;
  std::uniform_int_distribution<int> code(0, maxq);
  std::vector<uint8_t> codes(N * K);
  for (auto& c : codes) c = static_cast<uint8_t>(code(rng));
  std::vector<uint8_t> zeros(L.G * N);
  for (auto& z : zeros)
    z = static_cast<uint8_t>(f.sym ? (1 << (f.bits - 1)) - f.zero_offset : code(rng));
  std::uniform_real_distribution<float> log_scale(std::log(2e-3f), std::log(2e-2f));
  L.scales.resize(L.G * N);
  for (auto& s : L.scales) s = float_to_half(std::exp(log_scale(rng)));
  if (f.act_order) {
    std::vector<int32_t> perm(K);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    L.g_idx = gptq::act_order_g_idx(perm, f.group_size);
  }
  L.qweight = gptq::pack_qweight(codes, N, K, f.bits);
  L.qzeros = gptq::pack_qzeros(zeros, L.G, N, f.bits);
  L.view.bits = f.bits;
  L.view.group_size = f.group_size;
  L.view.K = K;
  L.view.N = N;
  L.view.zero_offset = f.zero_offset;
  L.view.qweight = L.qweight.data();
  L.view.qzeros = L.qzeros.data();
  L.view.scales = L.scales.data();
  L.view.g_idx = L.g_idx.empty() ? nullptr : L.g_idx.data();
  return L;
}

std::vector<uint16_t> random_halves(size_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<uint16_t> v(n);
  for (auto& h : v) h = float_to_half(d(rng));
  return v;
}
std::vector<uint16_t> download(const DeviceBuffer& b, size_t n) {
  std::vector<uint16_t> v(n);
  KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), b.get(), n * 2, cudaMemcpyDeviceToHost));
  return v;
}

// y [M, N] = x [M, K] W^T, W dequantized by the reference formula and each weight rounded to
// fp16 (the header says why), fp32 sums.
std::vector<float> matmul_f16_weights(const gptq::GptqView& v, const std::vector<float>& x,
                                      int64_t M) {
  std::vector<float> W(size_t(v.N) * v.K);
  gptq::dequantize_ref(v, W.data());
  for (float& w : W) w = half_to_float(float_to_half(w));
  std::vector<float> y(size_t(M) * v.N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < v.N; ++n) {
      const float* xm = x.data() + m * v.K;
      const float* wn = W.data() + n * v.K;
      float acc = 0.f;
      for (int64_t k = 0; k < v.K; ++k) acc += xm[k] * wn[k];
      y[size_t(m) * v.N + n] = acc;
    }
  return y;
}

// The inputs of one comparison: x for the most tokens, the reference W x for all of them.
struct Case {
  std::vector<uint16_t> xh;  // [64][K]
  std::vector<float> ref;    // [64][N] = x W^T, fp16 weights, fp32 sums
};
Case make_case(const Linear& L, uint32_t seed) {
  std::mt19937 rng(seed);
  Case c;
  c.xh = random_halves(size_t(cuda::kGemmSmallMaxRows) * L.K, 1.0f, rng);
  c.ref = matmul_f16_weights(L.view, to_floats(c.xh), cuda::kGemmSmallMaxRows);
  return c;
}

using Stream = kestrel::test::EngineStream;

// Runs gemm_small for the first M tokens of xh; y holds M + 1 rows of `cols`, NaN-poisoned,
// or starts as the residual when `alias` (y += residual in place). Returns all M + 1 rows.
struct RunOpts {
  GemvEpilogue out;
  GemmSmallLaunch launch;
  const std::vector<uint16_t>* residual = nullptr;  // [M][cols]
  bool alias = false;
  int repeat = 1;  // calls in a row on the same workspace (counters must come back to zero)
};
std::vector<uint16_t> run_small(const GemvWeight& w, const std::vector<uint16_t>& xh, int M,
                                int64_t cols, const RunOpts& o, const std::vector<uint16_t>* bias = nullptr) {
  const size_t n = size_t(M + 1) * cols;
  std::vector<uint16_t> init(n, 0xFFFF);  // fp16 NaN
  if (o.alias && o.residual) std::copy(o.residual->begin(), o.residual->begin() + size_t(M) * cols, init.begin());
  DeviceBuffer dx = upload(std::vector<uint16_t>(xh.begin(), xh.begin() + size_t(M) * w.K));
  DeviceBuffer dy = upload(init);
  DeviceBuffer dr, db;
  if (o.residual && !o.alias) dr = upload(std::vector<uint16_t>(o.residual->begin(), o.residual->begin() + size_t(M) * cols));
  GemvEpilogue out = o.out;
  if (bias) {
    db = upload(*bias);
    out.bias = db.as<__half>();
  }
  const size_t ws_bytes = cuda::gemm_small_workspace_bytes(w, M, o.launch, out);
  DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
  KESTREL_CUDA_CHECK(cudaMemset(ws.get(), 0, std::max<size_t>(ws_bytes, 16)));
  const __half* res = o.residual ? (o.alias ? dy.as<__half>() : dr.as<__half>()) : nullptr;
  Stream st;
  for (int r = 0; r < o.repeat; ++r) {
    if (o.alias && r > 0) {  // restore y = residual for the next in-place call
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dy.get(), init.data(), size_t(M) * cols * 2,
                                         cudaMemcpyHostToDevice, st.s));
    }
    cuda::gemm_small(w, dx.as<__half>(), M, dy.as<__half>(), res, ws_bytes ? ws.get() : nullptr,
                     ws_bytes, st.s, out, o.launch);
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.s));
  KESTREL_CUDA_CHECK(cudaGetLastError());
  return download(dy, n);
}

// rel_err over the first M rows; the row past them must still be NaN.
void expect_matches(const std::vector<uint16_t>& got, const std::vector<float>& ref, int M,
                    int64_t cols, const std::string& what) {
  std::vector<float> y = to_floats(std::vector<uint16_t>(got.begin(), got.begin() + size_t(M) * cols));
  std::vector<float> r(ref.begin(), ref.begin() + size_t(M) * cols);
  EXPECT_LT(test::rel_err(y, r), kTol) << what;
  int64_t touched = 0;
  for (int64_t i = 0; i < cols; ++i) touched += got[size_t(M) * cols + i] != 0xFFFF;
  EXPECT_EQ(touched, 0) << what << ": outputs past M were written";
  // The first bad element, to say where a layout error lies.
  for (int m = 0; m < M; ++m)
    for (int64_t i = 0; i < cols; ++i) {
      const float a = y[size_t(m) * cols + i], b = r[size_t(m) * cols + i];
      if (!(std::abs(a - b) <= 0.05f + 0.02f * std::abs(b))) {
        ADD_FAILURE() << what << ": first mismatch at token " << m << ", output " << i << ": got "
                      << a << ", reference " << b;
        return;
      }
    }
}

std::vector<float> ref_rows(const Case& c, int64_t N, int M) {
  return std::vector<float>(c.ref.begin(), c.ref.begin() + size_t(M) * N);
}

// The reference of the residual + bias + ReLU epilogue: relu(x W^T + residual + bias).
std::vector<float> plus_residual_bias_relu(std::vector<float> ref, const std::vector<uint16_t>& res,
                                           const std::vector<uint16_t>& bias, int M, int64_t N) {
  for (int m = 0; m < M; ++m)
    for (int64_t i = 0; i < N; ++i) {
      const size_t k = size_t(m) * N + i;
      ref[k] = std::max(ref[k] + half_to_float(res[k]) + half_to_float(bias[i]), 0.f);
    }
  return ref;
}

// ---- Formats x M x K ------------------------------------------------------------------------------

std::vector<Format> all_formats() {
  std::vector<Format> out;
  for (int bits : {2, 3, 4, 8})
    for (int gs : {32, 128, -1})
      for (bool sym : {true, false}) {
        Format f{bits, gs, sym, false, sym ? 1 : 0};
        out.push_back(f);
        if (gs != -1) {
          Format a = f;
          a.act_order = true;
          if (!sym) a.zero_offset = 1;  // v1 zeros under act-order
          out.push_back(a);
        }
      }
  out.push_back(Format{4, 64, false, true, 0});
  out.push_back(Format{3, 64, true, false, 1});
  return out;
}

class GpuGemmSmallFormats : public ::testing::TestWithParam<Format> {};

// Every M at N = 160 (not a multiple of 128 or 64 rows), K = 800 (1.56 stages).
TEST_P(GpuGemmSmallFormats, EveryMMatchesReference) {
  KESTREL_REQUIRE_GPU();
  const Format f = GetParam();
  const int64_t N = 160, K = 800;
  Linear L = random_linear(f, N, K, 17);
  GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
  const Case c = make_case(L, 3);
  for (int M : kAllM) {
    const auto got = run_small(w, c.xh, M, N, RunOpts{});
    expect_matches(got, ref_rows(c, N, M), M, N, describe(f, N, K) + " M=" + std::to_string(M));
  }
  cuda::gemv_free(w);
}

// K of exactly one stage, and of four stages and one unit (the last stage mostly padding);
// 8 bits also K % 8 == 4 (x gathered into padded rows). Split-K by the plan, then forced.
TEST_P(GpuGemmSmallFormats, OddKAndSplitsMatchReference) {
  KESTREL_REQUIRE_GPU();
  const Format f = GetParam();
  std::vector<int64_t> Ks = {512, 2080};
  if (f.bits == 8) Ks.push_back(772);
  for (int64_t K : Ks) {
    const int64_t N = 96;
    Linear L = random_linear(f, N, K, 23);
    GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
    const Case c = make_case(L, 5);
    for (int M : {1, 9, 33, 64})
      for (int splits : {0, 2, 3}) {
        RunOpts o;
        o.launch.splits = splits;
        const int64_t stages = (K + 511) / 512;
        if (splits > stages) continue;
        const auto got = run_small(w, c.xh, M, N, o);
        expect_matches(got, ref_rows(c, N, M), M, N,
                       describe(f, N, K) + " M=" + std::to_string(M) +
                           " splits=" + std::to_string(splits));
      }
    cuda::gemv_free(w);
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuGemmSmallFormats, ::testing::ValuesIn(all_formats()),
                         [](const ::testing::TestParamInfo<Format>& i) {
                           const Format& f = i.param;
                           return "b" + std::to_string(f.bits) + "_g" +
                                  (f.group_size > 0 ? std::to_string(f.group_size) : "row") +
                                  (f.sym ? "_sym" : "_asym") + (f.act_order ? "_act" : "") +
                                  "_v" + std::to_string(f.zero_offset == 0 ? 2 : 1);
                         });

// ---- Split-K ----------------------------------------------------------------------------------------

// Every split count up to one stage per range, twice in a row on one workspace: the second call
// must find its counters back at zero and give the same bits (the reduction runs in split order).
TEST(GemmSmallSplits, GpuEverySplitIsDeterministicAndCorrect) {
  KESTREL_REQUIRE_GPU();
  const Format f{4, 128, false, true, 0};
  const int64_t N = 288, K = 2560;  // 5 stages
  Linear L = random_linear(f, N, K, 31);
  GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
  const Case c = make_case(L, 7);
  std::mt19937 rng(2);
  for (int M : {3, 17, 64}) {
    const std::vector<uint16_t> res = random_halves(size_t(M) * N, 1.0f, rng);
    std::vector<float> ref = ref_rows(c, N, M);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += half_to_float(res[i]);
    for (int splits = 1; splits <= 5; ++splits) {
      RunOpts o;
      o.launch.splits = splits;
      o.residual = &res;
      o.alias = true;
      const auto once = run_small(w, c.xh, M, N, o);
      o.repeat = 3;
      const auto thrice = run_small(w, c.xh, M, N, o);
      const std::string what = describe(f, N, K) + " M=" + std::to_string(M) +
                               " splits=" + std::to_string(splits) + ", residual aliasing y";
      expect_matches(once, ref, M, N, what);
      EXPECT_EQ(once, thrice) << what << ": a repeated call differs";
    }
  }
  cuda::gemv_free(w);
}

// One workspace, as the model shares it, for calls of two weights (one act-order, whose x is
// gathered into the workspace), several M and split counts in turn: no call's gathered x or
// partial sums may land on the counters another call left at zero.
TEST(GemmSmallSplits, GpuOneWorkspaceServesCallsOfEveryPlan) {
  KESTREL_REQUIRE_GPU();
  const int64_t N = 288, K = 2560;
  Linear act = random_linear(Format{4, 128, true, true, 1}, N, K, 41);
  Linear plain = random_linear(Format{4, 128, false, false, 0}, N, K, 43);
  GemvWeight wa = cuda::gemv_prepare({act.view}, nullptr);
  GemvWeight wp = cuda::gemv_prepare({plain.view}, nullptr);
  const Case ca = make_case(act, 9), cp = make_case(plain, 11);
  struct Call {
    bool act;
    int M, splits;
  };
  const std::vector<Call> calls = {{false, 17, 3}, {true, 9, 1}, {false, 17, 3}, {true, 64, 2},
                                   {false, 3, 5},  {true, 33, 1}, {false, 64, 4}, {false, 3, 5}};
  size_t ws_bytes = 0;
  for (const Call& k : calls) {
    GemmSmallLaunch l;
    l.splits = k.splits;
    ws_bytes = std::max(ws_bytes, cuda::gemm_small_workspace_bytes(k.act ? wa : wp, k.M, l));
  }
  DeviceBuffer ws(ws_bytes);
  KESTREL_CUDA_CHECK(cudaMemset(ws.get(), 0, ws_bytes));
  DeviceBuffer dxa = upload(ca.xh), dxp = upload(cp.xh);
  DeviceBuffer dy(size_t(cuda::kGemmSmallMaxRows + 1) * N * 2);
  Stream st;
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& k = calls[i];
    GemmSmallLaunch l;
    l.splits = k.splits;
    cuda::gemm_small(k.act ? wa : wp, (k.act ? dxa : dxp).as<__half>(), k.M, dy.as<__half>(),
                     nullptr, ws.get(), ws_bytes, st.s, {}, l);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.s));
    std::vector<uint16_t> got = download(dy, size_t(k.M + 1) * N);
    std::fill(got.begin() + size_t(k.M) * N, got.end(), 0xFFFF);  // the row past M is not ours
    expect_matches(got, ref_rows(k.act ? ca : cp, N, k.M), k.M, N,
                   "call " + std::to_string(i) + (k.act ? " act-order" : " plain") +
                       " M=" + std::to_string(k.M) + " splits=" + std::to_string(k.splits));
  }
  cuda::gemv_free(wa);
  cuda::gemv_free(wp);
}

// A 7B shape (down: 4096 x 11008) with the plan's own split choice, against the reference.
TEST(GemmSmallSplits, GpuDownShapeWithPlannedSplits) {
  KESTREL_REQUIRE_GPU();
  const Format f{4, 128, true, false, 1};
  const int64_t N = 4096, K = 11008;
  Linear L = random_linear(f, N, K, 41);
  GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
  std::mt19937 rng(9);
  const int M = 5;
  std::vector<uint16_t> xh = random_halves(size_t(cuda::kGemmSmallMaxRows) * K, 1.0f, rng);
  const std::vector<float> ref = matmul_f16_weights(
      L.view, to_floats(std::vector<uint16_t>(xh.begin(), xh.begin() + size_t(M) * K)), M);
  const auto got = run_small(w, xh, M, N, RunOpts{});
  expect_matches(got, ref, M, N, describe(f, N, K) + " M=5, planned splits");
  cuda::gemv_free(w);
}

// ---- Epilogues ----------------------------------------------------------------------------------------

const Format kEpilogueFormats[] = {{4, 128, true, false, 1}, {3, 64, false, true, 0},
                                   {2, 32, false, false, 0}, {8, -1, true, false, 1}};

TEST(GemmSmallEpilogues, GpuResidualBiasReluMatchReference) {
  KESTREL_REQUIRE_GPU();
  for (const Format& f : kEpilogueFormats) {
    const int64_t N = 224, K = 1056;
    Linear L = random_linear(f, N, K, 51);
    GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
    const Case c = make_case(L, 11);
    std::mt19937 rng(4);
    const std::vector<uint16_t> bias = random_halves(N, 0.5f, rng);
    for (int M : {1, 8, 16, 33, 64})
      for (int splits : {1, 2}) {
        const std::vector<uint16_t> res = random_halves(size_t(M) * N, 1.0f, rng);
        const std::string what =
            describe(f, N, K) + " M=" + std::to_string(M) + " splits=" + std::to_string(splits);
        std::vector<float> base = ref_rows(c, N, M);
        RunOpts o;
        o.launch.splits = splits;
        {  // residual in its own buffer
          std::vector<float> ref = base;
          for (size_t i = 0; i < ref.size(); ++i) ref[i] += half_to_float(res[i]);
          o.residual = &res;
          expect_matches(run_small(w, c.xh, M, N, o), ref, M, N, what + " residual");
          o.alias = true;
          expect_matches(run_small(w, c.xh, M, N, o), ref, M, N, what + " residual aliasing y");
          o.alias = false;
          o.residual = nullptr;
        }
        {  // bias alone, bias + ReLU, bias + residual + ReLU
          std::vector<float> rb = base, rbr = base, rres = base;
          for (int m = 0; m < M; ++m)
            for (int64_t i = 0; i < N; ++i) {
              const size_t k = size_t(m) * N + i;
              rb[k] += half_to_float(bias[i]);
              rbr[k] = std::max(rb[k], 0.f);
              rres[k] = std::max(base[k] + half_to_float(res[k]) + half_to_float(bias[i]), 0.f);
            }
          expect_matches(run_small(w, c.xh, M, N, o, &bias), rb, M, N, what + " bias");
          o.out.relu = true;
          expect_matches(run_small(w, c.xh, M, N, o, &bias), rbr, M, N, what + " bias + relu");
          o.residual = &res;
          expect_matches(run_small(w, c.xh, M, N, o, &bias), rres, M, N,
                         what + " residual + bias + relu");
        }
      }
    cuda::gemv_free(w);
  }
}

// The SiLU epilogue's reference for the first M tokens: gate and up ([64][H] each) rounded to
// fp16, silu(gate) * up in fp32.
std::vector<float> silu_of(const std::vector<float>& gate, const std::vector<float>& up, int M,
                           int64_t H) {
  std::vector<float> ref(size_t(M) * H);
  for (size_t i = 0; i < ref.size(); ++i) {
    const float g = half_to_float(float_to_half(gate[i]));
    const float u = half_to_float(float_to_half(up[i]));
    ref[i] = g / (1.0f + std::exp(-g)) * u;
  }
  return ref;
}

// SiLU(gate) * up over [gate | up] prepared from two parts, as the model fuses them: output i
// pairs rows i and N/2 + i, each rounded to fp16 before the fp32 SiLU (GemvEpilogue::silu_mul).
TEST(GemmSmallEpilogues, GpuSiluOfGateUpMatchesReference) {
  KESTREL_REQUIRE_GPU();
  for (const Format& f : kEpilogueFormats) {
    const int64_t H = 96, K = 800;  // 96 pairs: not a multiple of a block's 64 (at 8 bits
                                    // 32: three whole blocks)
    Linear gate = random_linear(f, H, K, 61);
    Linear up = random_linear(f, H, K, 62);
    if (f.act_order) up.view.g_idx = gate.view.g_idx;  // fused parts share g_idx
    GemvWeight w = cuda::gemv_prepare({gate.view, up.view}, nullptr);
    const Case cg = make_case(gate, 13);
    const std::vector<float> ru = matmul_f16_weights(up.view, to_floats(cg.xh), cuda::kGemmSmallMaxRows);
    for (int M : kAllM)
      for (int splits : {1, 2}) {
        const std::vector<float> ref = silu_of(cg.ref, ru, M, H);
        RunOpts o;
        o.out.silu_mul = true;
        o.launch.splits = splits;
        expect_matches(run_small(w, cg.xh, M, H, o), ref, M, H,
                       describe(f, 2 * H, K) + " SiLU M=" + std::to_string(M) +
                           " splits=" + std::to_string(splits));
      }
    cuda::gemv_free(w);
  }
}

// The output as a column slice of a wider matrix (ldy), as the parts of a linear that could not
// be fused write their columns of the layer's output: y[m][c0 + i] = (x W^T)[m][i] + the
// residual read from the same place (aliasing y, as the q|k|v biases are laid down first), and
// nothing written outside the slice; at split-K 1 and 2 and through the streaming kernel
// (whose epilogue is the same store).
TEST(GemmSmallEpilogues, GpuColumnSliceOfAWiderOutput) {
  KESTREL_REQUIRE_GPU();
  const int64_t N = 160, K = 800, c0 = 48, ldy = N + 112;  // columns [48, 208) of 272
  for (const Format& f : kEpilogueFormats) {
    Linear L = random_linear(f, N, K, 71);
    GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
    const Case c = make_case(L, 17);
    std::mt19937 rng(5);
    for (int M : {3, 16, 64})
      for (int variant = 0; variant < 3; ++variant) {
        GemmSmallLaunch launch;
        if (variant < 2)
          launch.splits = variant + 1;
        else
          launch.stream = true;  // 2 and 4 bits, M <= 16: others are refused, and skipped here
        size_t ws_bytes = 0;
        try {
          ws_bytes = cuda::gemm_small_workspace_bytes(w, M, launch);
        } catch (const Error&) {
          if (launch.stream) continue;
          throw;
        }
        const std::string what = describe(f, N, K) + " M=" + std::to_string(M) +
                                 (launch.stream ? " stream" : " splits=" + std::to_string(launch.splits));
        const std::vector<uint16_t> res = random_halves(size_t(M) * N, 1.0f, rng);
        std::vector<uint16_t> init(size_t(M + 1) * ldy, 0xFFFF);  // fp16 NaN outside the slice
        for (int m = 0; m < M; ++m)
          for (int64_t i = 0; i < N; ++i) init[size_t(m) * ldy + c0 + i] = res[size_t(m) * N + i];
        DeviceBuffer dx = upload(std::vector<uint16_t>(c.xh.begin(), c.xh.begin() + size_t(M) * K));
        DeviceBuffer dy = upload(init);
        DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
        KESTREL_CUDA_CHECK(cudaMemset(ws.get(), 0, std::max<size_t>(ws_bytes, 16)));
        __half* y = dy.as<__half>() + c0;
        Stream st;
        cuda::gemm_small(w, dx.as<__half>(), M, y, y, ws_bytes ? ws.get() : nullptr, ws_bytes,
                         st.s, {}, launch, ldy);
        KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.s));
        KESTREL_CUDA_CHECK(cudaGetLastError());
        const std::vector<uint16_t> got = download(dy, init.size());
        std::vector<float> slice(size_t(M) * N), ref(size_t(M) * N);
        for (int m = 0; m < M; ++m)
          for (int64_t i = 0; i < N; ++i) {
            const size_t k = size_t(m) * N + i;
            slice[k] = half_to_float(got[size_t(m) * ldy + c0 + i]);
            ref[k] = c.ref[k] + half_to_float(res[k]);
          }
        EXPECT_LT(test::rel_err(slice, ref), kTol) << what;
        int64_t outside = 0;
        for (size_t j = 0; j < got.size(); ++j) {
          const int64_t row = int64_t(j) / ldy, col = int64_t(j) % ldy;
          if (row >= M || col < c0 || col >= c0 + N) outside += got[j] != 0xFFFF;
        }
        EXPECT_EQ(outside, 0) << what << ": written outside the slice";
      }
    cuda::gemv_free(w);
  }
}

// ---- Launch plans ------------------------------------------------------------------------------------

// Every combination of the plan's knobs (GemmSmallLaunch) but split-K, which each test varies
// on top: warps per block 2/4/8 (32..128 rows, 16..64 SiLU pairs), ring depth 2, 3, 5, x
// staged with each stage or once per K range, all tokens in one block or one n-tile per block
// (token groups of blocks side by side, 2..8 of them).
std::vector<GemmSmallLaunch> plan_variants() {
  std::vector<GemmSmallLaunch> out;
  for (int warps : {2, 4, 8})
    for (int stages : {2, 3, 5})
      for (int tiles : {0, 1})
        for (bool once : {false, true}) {
          GemmSmallLaunch l;
          l.warps = warps;
          l.stages = stages;
          l.token_tiles = tiles;
          l.x_once = once;
          out.push_back(l);
        }
  return out;
}

std::string plan_label(const GemmSmallLaunch& l) {
  return "w" + std::to_string(l.warps) + "_s" + std::to_string(l.stages) + "_t" +
         std::to_string(l.token_tiles) + (l.x_once ? "_xonce" : "_xstage");
}

// Whether the call of o fits the device: a plan whose shared memory does not fit is refused
// (and must say so), and the test skips that combination.
bool plan_fits(const GemvWeight& w, int M, const RunOpts& o, const std::string& what) {
  try {
    cuda::gemm_small_workspace_bytes(w, M, o.launch, o.out);
    return true;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("bytes of shared memory")) << what;
    return false;
  }
}

// The formats each plan runs: asymmetric act-order (gathered x, v2 zeros), 8-bit per row, 3-bit
// (three planes), 2-bit.
const Format kPlanFormats[] = {{4, 128, false, true, 0}, {8, -1, true, false, 1},
                               {3, 64, true, false, 1}, {2, 32, false, false, 0}};

class GpuGemmSmallPlans : public ::testing::TestWithParam<GemmSmallLaunch> {};

// N = 160 (not a multiple of 64 or 128 rows), K = 2080 (5 stages, the last one unit: x staged
// once holds 5, or 2 at 3 splits), M across n-tiles and token groups (M = 40: 5 groups of one
// n-tile, the last partial), split-K by the plan and forced; the residual aliasing y with
// bias and ReLU (the epilogue's token offset); SiLU over [gate | up].
TEST_P(GpuGemmSmallPlans, MatchReference) {
  KESTREL_REQUIRE_GPU();
  const GemmSmallLaunch plan = GetParam();
  int ran = 0;
  std::mt19937 rng(6);
  for (const Format& f : kPlanFormats) {
    const int64_t N = 160, K = 2080;
    Linear L = random_linear(f, N, K, 81);
    GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
    const Case c = make_case(L, 19);
    for (int M : {1, 9, 17, 40, 64})
      for (int splits : {0, 3}) {
        RunOpts o;
        o.launch = plan;
        o.launch.splits = splits;
        const std::string what = describe(f, N, K) + " M=" + std::to_string(M) +
                                 " splits=" + std::to_string(splits) + " " + plan_label(plan);
        if (!plan_fits(w, M, o, what)) continue;
        ++ran;
        expect_matches(run_small(w, c.xh, M, N, o), ref_rows(c, N, M), M, N, what);
      }
    {
      const int M = 40;
      const std::vector<uint16_t> res = random_halves(size_t(M) * N, 1.0f, rng);
      const std::vector<uint16_t> bias = random_halves(N, 0.5f, rng);
      const std::vector<float> ref = plus_residual_bias_relu(ref_rows(c, N, M), res, bias, M, N);
      RunOpts o;
      o.launch = plan;
      o.launch.splits = 2;
      o.residual = &res;
      o.alias = true;
      o.out.relu = true;
      const std::string what = describe(f, N, K) + " M=40 splits=2 residual aliasing y + bias + relu " +
                               plan_label(plan);
      if (plan_fits(w, M, o, what)) {
        ++ran;
        expect_matches(run_small(w, c.xh, M, N, o, &bias), ref, M, N, what);
      }
    }
    cuda::gemv_free(w);

    const int64_t H = 96, Ks = 800;
    Linear gate = random_linear(f, H, Ks, 61);
    Linear up = random_linear(f, H, Ks, 62);
    if (f.act_order) up.view.g_idx = gate.view.g_idx;
    GemvWeight wg = cuda::gemv_prepare({gate.view, up.view}, nullptr);
    const Case cg = make_case(gate, 13);
    const std::vector<float> ru =
        matmul_f16_weights(up.view, to_floats(cg.xh), cuda::kGemmSmallMaxRows);
    for (int M : {7, 33})
      for (int splits : {0, 2}) {
        RunOpts o;
        o.launch = plan;
        o.launch.splits = splits;
        o.out.silu_mul = true;
        const std::string what = describe(f, 2 * H, Ks) + " SiLU M=" + std::to_string(M) +
                                 " splits=" + std::to_string(splits) + " " + plan_label(plan);
        if (!plan_fits(wg, M, o, what)) continue;
        ++ran;
        expect_matches(run_small(wg, cg.xh, M, H, o), silu_of(cg.ref, ru, M, H), M, H, what);
      }
    cuda::gemv_free(wg);
  }
  EXPECT_GT(ran, 0) << plan_label(plan) << ": no call fits";
}

INSTANTIATE_TEST_SUITE_P(All, GpuGemmSmallPlans, ::testing::ValuesIn(plan_variants()),
                         [](const ::testing::TestParamInfo<GemmSmallLaunch>& i) {
                           return plan_label(i.param);
                         });

// ---- The streaming kernel (GemmSmallLaunch::stream) ------------------------------------------------

// Its plans: warps 4 and 8 x k-slices 1, 2, 4, 8 (those that divide the warps).
std::vector<GemmSmallLaunch> stream_variants() {
  std::vector<GemmSmallLaunch> out;
  for (int warps : {4, 8})
    for (int ks : {1, 2, 4, 8}) {
      if (ks > warps) continue;
      GemmSmallLaunch l;
      l.stream = true;
      l.warps = warps;
      l.k_slices = ks;
      out.push_back(l);
    }
  return out;
}

class GpuGemmStream : public ::testing::TestWithParam<GemmSmallLaunch> {};

// The 2- and 4-bit formats (every group size, symmetric and not, act-order) at every M up to
// 16, N = 160 (a partial block of rows at every plan), K = 800 (1.56 stages: a k-slice with no
// stage at 4 and 8 slices) and 2080 (5 stages, the last one unit), split-K by the plan and
// forced; the residual aliasing y with bias and ReLU; SiLU over [gate | up].
TEST_P(GpuGemmStream, MatchReference) {
  KESTREL_REQUIRE_GPU();
  const GemmSmallLaunch plan = GetParam();
  const std::string label = "stream w" + std::to_string(plan.warps) + " ks" + std::to_string(plan.k_slices);
  std::vector<Format> formats;
  for (int bits : {2, 4})
    for (int gs : {32, 64, 128, -1})
      for (bool sym : {true, false}) {
        formats.push_back(Format{bits, gs, sym, false, sym ? 1 : 0});
        if (gs != -1 && !sym) formats.push_back(Format{bits, gs, sym, true, 1});
      }
  std::mt19937 rng(8);
  for (const Format& f : formats)
    for (int64_t K : {800, 2080}) {
      const int64_t N = 160;
      Linear L = random_linear(f, N, K, 83);
      GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
      const Case c = make_case(L, 21);
      for (int M : {1, 2, 5, 8, 9, 16})
        for (int splits : {0, 2}) {
          RunOpts o;
          o.launch = plan;
          o.launch.splits = splits;
          expect_matches(run_small(w, c.xh, M, N, o), ref_rows(c, N, M), M, N,
                         describe(f, N, K) + " M=" + std::to_string(M) + " splits=" +
                             std::to_string(splits) + " " + label);
        }
      const int M = 9;
      const std::vector<uint16_t> res = random_halves(size_t(M) * N, 1.0f, rng);
      const std::vector<uint16_t> bias = random_halves(N, 0.5f, rng);
      const std::vector<float> ref = plus_residual_bias_relu(ref_rows(c, N, M), res, bias, M, N);
      RunOpts o;
      o.launch = plan;
      o.launch.splits = 2;
      o.residual = &res;
      o.alias = true;
      o.out.relu = true;
      expect_matches(run_small(w, c.xh, M, N, o, &bias), ref, M, N,
                     describe(f, N, K) + " M=9 residual aliasing y + bias + relu " + label);
      cuda::gemv_free(w);
    }
  const Format f{4, 128, false, true, 0};
  const int64_t H = 96, Ks = 800;
  Linear gate = random_linear(f, H, Ks, 61);
  Linear up = random_linear(f, H, Ks, 62);
  up.view.g_idx = gate.view.g_idx;
  GemvWeight wg = cuda::gemv_prepare({gate.view, up.view}, nullptr);
  const Case cg = make_case(gate, 13);
  const std::vector<float> ru = matmul_f16_weights(up.view, to_floats(cg.xh), cuda::kGemmSmallMaxRows);
  for (int M : {1, 7, 16})
    for (int splits : {0, 2}) {
      RunOpts o;
      o.launch = plan;
      o.launch.splits = splits;
      o.out.silu_mul = true;
      expect_matches(run_small(wg, cg.xh, M, H, o), silu_of(cg.ref, ru, M, H), M, H,
                     describe(f, 2 * H, Ks) + " SiLU M=" + std::to_string(M) + " " + label);
    }
  cuda::gemv_free(wg);
}

INSTANTIATE_TEST_SUITE_P(All, GpuGemmStream, ::testing::ValuesIn(stream_variants()),
                         [](const ::testing::TestParamInfo<GemmSmallLaunch>& i) {
                           return "w" + std::to_string(i.param.warps) + "_ks" +
                                  std::to_string(i.param.k_slices);
                         });

// What the streaming kernel does not run is refused in one line: 3- and 8-bit weights, more
// than 16 tokens, k-slices that do not divide the warps, k-slices without it.
TEST(GemmSmallPlans, GpuStreamRefusesWhatItDoesNotRun) {
  KESTREL_REQUIRE_GPU();
  auto message = [](const Format& f, int M, GemmSmallLaunch l) -> std::string {
    Linear L = random_linear(f, 64, 512, 5);
    GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
    std::string msg = "(no error)";
    try {
      cuda::gemm_small_plan(w, M, l);
    } catch (const Error& e) {
      msg = e.what();
    }
    cuda::gemv_free(w);
    return msg;
  };
  GemmSmallLaunch l;
  l.stream = true;
  EXPECT_THAT(message(Format{3, 128, true, false, 1}, 4, l), HasSubstr("no streaming kernel compiled for bits=3"));
  EXPECT_THAT(message(Format{8, 128, true, false, 1}, 4, l), HasSubstr("no streaming kernel compiled for bits=8"));
  EXPECT_THAT(message(Format{4, 128, true, false, 1}, 17, l), HasSubstr("token tiles (M=17)"));
  l.k_slices = 3;
  EXPECT_THAT(message(Format{4, 128, true, false, 1}, 4, l), HasSubstr("k_slices=3 does not divide warps=8"));
  GemmSmallLaunch r;
  r.k_slices = 2;
  EXPECT_THAT(message(Format{4, 128, true, false, 1}, 4, r), HasSubstr("k_slices needs the streaming kernel"));
}

// The planner's own choice is the design's plan (docs/gemm-small.md): 8 warps (4 at 8 bits),
// a ring of 2 stages, all tokens in one block, x with each stage; a field that is set comes
// back as it was.
TEST(GemmSmallPlans, GpuDefaultIsTheDesignPlan) {
  KESTREL_REQUIRE_GPU();
  for (int bits : {4, 8}) {
    const Format f{bits, 128, true, false, 1};
    Linear L = random_linear(f, 256, 4096, 91);
    GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
    const int want_stages[] = {2, 2, 2, 2}, want_tiles[] = {1, 2, 4, 8};
    int i = 0;
    for (int M : {8, 16, 32, 64}) {
      const GemmSmallLaunch p = cuda::gemm_small_plan(w, M);
      EXPECT_EQ(p.warps, bits == 8 ? 4 : 8) << "bits=" << bits << " M=" << M;
      EXPECT_EQ(p.stages, want_stages[i]) << "bits=" << bits << " M=" << M;
      EXPECT_EQ(p.token_tiles, want_tiles[i]) << "bits=" << bits << " M=" << M;
      EXPECT_FALSE(p.x_once);
      EXPECT_GE(p.splits, 1);
      ++i;
    }
    GemmSmallLaunch l;
    l.warps = 2;
    l.stages = 3;
    l.token_tiles = 1;
    l.x_once = true;
    l.splits = 2;
    const GemmSmallLaunch p = cuda::gemm_small_plan(w, 64, l);
    EXPECT_EQ(p.warps, 2);
    EXPECT_EQ(p.stages, 3);
    EXPECT_EQ(p.token_tiles, 1);
    EXPECT_TRUE(p.x_once);
    EXPECT_EQ(p.splits, 2);
    cuda::gemv_free(w);
  }
}

// ---- Argument checks: before any CUDA call, no GPU needed -------------------------------------------

std::string message_of(const GemvWeight& w, const __half* x, int64_t M, __half* y,
                       const __half* residual, GemvEpilogue out = {}) {
  try {
    cuda::gemm_small(w, x, M, y, residual, nullptr, 0, nullptr, out);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Device-looking pointers, never dereferenced: every check below fails first.
const __half* kX = reinterpret_cast<const __half*>(uintptr_t(0x10000));
__half* const kY = reinterpret_cast<__half*>(uintptr_t(0x20000));

TEST(GemmSmallChecks, RefusesMOutside1To64) {
  EXPECT_EQ(message_of(fake_gemv_weight(), kX, 0, kY, nullptr),
            "gemm_small: M=0 is outside 1..64 (larger batches: quant_gemm)");
  EXPECT_EQ(message_of(fake_gemv_weight(), kX, 65, kY, nullptr),
            "gemm_small: M=65 is outside 1..64 (larger batches: quant_gemm)");
  EXPECT_THAT(message_of(fake_gemv_weight(), kX, -3, kY, nullptr), HasSubstr("M=-3"));
}

TEST(GemmSmallChecks, RefusesAnEmptyWeightFirst) {
  GemvWeight w = fake_gemv_weight();
  w.device = nullptr;
  EXPECT_EQ(message_of(w, nullptr, 0, nullptr, nullptr),
            "gemm_small: the weight is empty (not prepared, or freed)");
}

TEST(GemmSmallChecks, RefusesUnsupportedFormats) {
  GemvWeight w = fake_gemv_weight();
  w.bits = 5;
  EXPECT_THAT(message_of(w, kX, 4, kY, nullptr), HasSubstr("bits=5 is not supported"));
  w = fake_gemv_weight();
  w.group_size = 96;
  EXPECT_THAT(message_of(w, kX, 4, kY, nullptr), HasSubstr("group size 96 is not supported"));
}

TEST(GemmSmallChecks, RefusesNullMisalignedAndAliasedPointers) {
  EXPECT_THAT(message_of(fake_gemv_weight(), nullptr, 4, kY, nullptr), HasSubstr("null"));
  EXPECT_THAT(message_of(fake_gemv_weight(), kX, 4, nullptr, nullptr), HasSubstr("null"));
  EXPECT_EQ(message_of(fake_gemv_weight(), kX, 4, const_cast<__half*>(kX), nullptr),
            "gemm_small: y must not alias x");
  EXPECT_EQ(message_of(fake_gemv_weight(), kX + 1, 4, kY, nullptr),
            "gemm_small: x must be 16-byte aligned");
}

TEST(GemmSmallChecks, RefusesEpiloguesItDoesNotHave) {
  GemvEpilogue silu;
  silu.silu_mul = true;
  GemvWeight odd = fake_gemv_weight();
  odd.N = 255;
  EXPECT_EQ(message_of(odd, kX, 4, kY, nullptr, silu),
            "gemm_small: the SiLU epilogue needs an even N ([gate | up]), got N=255");
  EXPECT_EQ(message_of(fake_gemv_weight(), kX, 4, kY, kX, silu),
            "gemm_small: the SiLU epilogue goes without residual, bias and relu");
  GemvEpilogue silu_relu = silu;
  silu_relu.relu = true;
  EXPECT_THAT(message_of(fake_gemv_weight(), kX, 4, kY, nullptr, silu_relu),
              HasSubstr("without residual, bias and relu"));
  GemvEpilogue idx;
  idx.out_index = reinterpret_cast<const int32_t*>(uintptr_t(0x30000));
  EXPECT_THAT(message_of(fake_gemv_weight(), kX, 4, kY, nullptr, idx),
              HasSubstr("out_index and residual_index are not supported"));
}

TEST(GemmSmallChecks, RefusesAnLdyNarrowerThanTheOutput) {
  auto message = [](int64_t ldy, GemvEpilogue out) -> std::string {
    try {
      cuda::gemm_small(fake_gemv_weight(), kX, 4, kY, nullptr, nullptr, 0, nullptr, out, {}, ldy);
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(message(255, {}), "gemm_small: ldy=255 is less than the output's 256 columns");
  EXPECT_EQ(message(-1, {}), "gemm_small: ldy=-1 is less than the output's 256 columns");
  GemvEpilogue silu;
  silu.silu_mul = true;  // [gate | up] writes N/2 columns
  EXPECT_EQ(message(127, silu), "gemm_small: ldy=127 is less than the output's 128 columns");
}

std::string plan_message(const GemmSmallLaunch& l) {
  try {
    cuda::gemm_small(fake_gemv_weight(), kX, 4, kY, nullptr, nullptr, 0, nullptr, {}, l);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A plan's fields are checked before the device is asked anything.
TEST(GemmSmallChecks, RefusesPlansItDoesNotHave) {
  GemmSmallLaunch l;
  l.warps = 3;
  EXPECT_EQ(plan_message(l), "gemm_small: warps=3 is not 2, 4 or 8");
  l = {};
  l.stages = 1;
  EXPECT_EQ(plan_message(l), "gemm_small: stages=1 is outside 2..8");
  l.stages = 9;
  EXPECT_EQ(plan_message(l), "gemm_small: stages=9 is outside 2..8");
  l = {};
  l.token_tiles = 3;
  EXPECT_EQ(plan_message(l), "gemm_small: token_tiles=3 is not 1, 2, 4 or 8");
  l = {};
  l.splits = 2;  // K = 512: one stage
  EXPECT_EQ(plan_message(l), "gemm_small: splits=2 is outside 1..1 for K=512 (1 stages)");
}

// The workspace size is checked once the launch is planned (it depends on the device).
TEST(GemmSmallChecks, GpuRefusesASmallWorkspace) {
  KESTREL_REQUIRE_GPU();
  const Format f{4, 128, true, true, 1};
  Linear L = random_linear(f, 96, 1024, 71);
  GemvWeight w = cuda::gemv_prepare({L.view}, nullptr);
  GemmSmallLaunch l;
  l.splits = 2;
  const size_t need = cuda::gemm_small_workspace_bytes(w, 8, l);
  ASSERT_GT(need, 0u);
  DeviceBuffer x(8 * 1024 * 2), y(8 * 96 * 2), ws(need);
  try {
    cuda::gemm_small(w, x.as<__half>(), 8, y.as<__half>(), nullptr, ws.get(), need - 1, nullptr,
                     {}, l);
    ADD_FAILURE() << "a workspace one byte short was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("needs " + std::to_string(need)));
  }
  l.splits = 3;  // K = 1024: two stages
  EXPECT_THROW(cuda::gemm_small_workspace_bytes(w, 8, l), Error);
  cuda::gemv_free(w);
}

}  // namespace
}  // namespace kestrel
