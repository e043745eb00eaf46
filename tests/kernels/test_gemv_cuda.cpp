// GEMV kernels against the CPU references: gptq::matmul_ref (kernels/gptq) for the quantized
// family, matmul_f16w_ref (kernels/matmul) for fp16 weights.
//
// Tolerance: ||y - ref|| / max(||ref||, ||terms||) < 2e-3 (terms: W[n,k] x[k], see
// expect_close). The reference accumulates exact fp32 products of
// the fp16 inputs. The kernel rounds (a) the output to fp16: at most 2^-11 relative per
// element, ~2.8e-4 rms; (b) the dequantized weight (q - z) * s to fp16 (4/8-bit): 2^-11
// relative, ~2.8e-4 rms, averaging down over K; (c) partial sums of 16-64 products in half2
// before they join the fp32 sum: each ~2^-12 relative to that partial sum. Together well under
// 1e-3 in the norm; 2e-3 leaves margin for the rounding to line up, while a wrong code, group,
// scale, zero or x element gives errors of order 1e-2 to 1.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/device_data.h"
#include "tests/support/engine_stream.h"
#include "tests/support/gptq_formats.h"
#include "tests/support/gpu.h"
#include "base/dtype.h"
#include "base/error.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/gemv_layout.h"
#include "kernels/gptq/gptq_format.h"
#include "kernels/activation/activation.h"
#include "kernels/matmul/matmul.h"
#include "kernels/norm/norm.h"

namespace kestrel {
namespace {

using cuda::DeviceBuffer;
using cuda::GemvWeight;


constexpr double kTol = 2e-3;

using Format = kestrel::test::GptqFormat;
using kestrel::test::to_floats;
using kestrel::test::upload;
using kestrel::test::describe;

// One random quantized linear, in plain arrays, that can be packed at any N <= N_gen.
struct Linear {
  Format f;
  int64_t N = 0, K = 0, G = 0;
  std::vector<uint8_t> codes;    // [N][K]
  std::vector<uint8_t> zeros;    // [G][N] stored zero points
  std::vector<uint16_t> scales;  // [G][N] fp16 bits
  std::vector<int32_t> g_idx;    // [K], empty = none
};

Linear random_linear(const Format& f, int64_t N, int64_t K, std::mt19937& rng) {
  Linear L;
  L.f = f;
  L.N = N;
  L.K = K;
  L.G = f.group_size > 0 ? (K + f.group_size - 1) / f.group_size : 1;
  const int maxq = (1 << f.bits) - 1;
  std::uniform_int_distribution<int> code(0, maxq);
  L.codes.resize(N * K);
  for (auto& c : L.codes) c = static_cast<uint8_t>(code(rng));
  L.zeros.resize(L.G * N);
  for (auto& z : L.zeros)
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
  return L;
}

// Checkpoint tensors of the first n rows of L. When n * bits fills whole words the project's
// packers write them; otherwise (odd n, only to break the kernels' row tiling) qzeros rows get
// ceil(n * bits / 32) words, written with the format's own write_code.
struct Packed {
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  gptq::GptqView view;
};

Packed pack(const Linear& L, int64_t n) {
  Packed P;
  std::vector<uint8_t> codes(L.codes.begin(), L.codes.begin() + n * L.K);
  P.qweight = gptq::pack_qweight(codes, n, L.K, L.f.bits);
  std::vector<uint8_t> zeros(L.G * n);
  P.scales.resize(L.G * n);
  for (int64_t g = 0; g < L.G; ++g)
    for (int64_t i = 0; i < n; ++i) {
      zeros[g * n + i] = L.zeros[g * L.N + i];
      P.scales[g * n + i] = L.scales[g * L.N + i];
    }
  if ((n * L.f.bits) % 32 == 0) {
    P.qzeros = gptq::pack_qzeros(zeros, L.G, n, L.f.bits);
  } else {
    const int64_t words = (n * L.f.bits + 31) / 32;
    P.qzeros.assign(L.G * words, 0u);
    for (int64_t g = 0; g < L.G; ++g)
      for (int64_t i = 0; i < n; ++i)
        gptq::write_code(P.qzeros.data() + g * words, 1, i, L.f.bits, zeros[g * n + i]);
  }
  P.view.bits = L.f.bits;
  P.view.group_size = L.f.group_size;
  P.view.K = L.K;
  P.view.N = n;
  P.view.zero_offset = L.f.zero_offset;
  P.view.qweight = P.qweight.data();
  P.view.qzeros = P.qzeros.data();
  P.view.scales = P.scales.data();
  P.view.g_idx = L.g_idx.empty() ? nullptr : L.g_idx.data();
  return P;
}

// The oracle: gptq::matmul_ref on a checkpoint-valid tensor (rows padded to a multiple of 32,
// so that qzeros rows are whole words), first n outputs. `terms2` gets sum over those outputs
// and k of (W[n,k] x[k])^2: the size of what the kernel's fp16 rounding acts on.
std::vector<float> reference(const Linear& L, int64_t n, const std::vector<float>& x,
                             double* terms2 = nullptr) {
  Packed P = pack(L, L.N);
  std::vector<float> y(L.N);
  gptq::matmul_ref(P.view, x.data(), 1, y.data());
  y.resize(n);
  if (terms2) {
    std::vector<float> W(L.N * L.K);
    gptq::dequantize_ref(P.view, W.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < L.K; ++k) {
        const double t = double(W[i * L.K + k]) * x[k];
        *terms2 += t * t;
      }
  }
  return y;
}

std::vector<uint16_t> random_x(int64_t K, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<uint16_t> x(K);
  for (auto& v : x) v = float_to_half(d(rng));
  return x;
}



using kestrel::test::EngineStream;

// Runs y = W x (+ residual) on the GPU; y is poisoned with NaN first.
template <class Launch>
std::vector<float> run(int64_t N, const std::vector<uint16_t>& x,
                       const std::vector<uint16_t>& residual, bool alias, Launch launch) {
  DeviceBuffer dx = upload(x);
  DeviceBuffer dy(N * 2);
  KESTREL_CUDA_CHECK(cudaMemset(dy.get(), 0xFF, N * 2));  // 0xFFFF is an fp16 NaN
  DeviceBuffer dr;
  const __half* res = nullptr;
  if (!residual.empty()) {
    if (alias) {
      KESTREL_CUDA_CHECK(cudaMemcpy(dy.get(), residual.data(), N * 2, cudaMemcpyHostToDevice));
      res = dy.as<__half>();
    } else {
      dr = upload(residual);
      res = dr.as<__half>();
    }
  }
  {
    const EngineStream st;
    launch(dx.as<__half>(), dy.as<__half>(), res, st.s);
    KESTREL_CUDA_CHECK(cudaGetLastError());
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.s));
  }
  std::vector<uint16_t> yh(N);
  KESTREL_CUDA_CHECK(cudaMemcpy(yh.data(), dy.get(), N * 2, cudaMemcpyDeviceToHost));
  return to_floats(yh);
}

// ||y - ref|| / max(||ref||, ||terms||), failing on any non-finite output. The second norm,
// sqrt(sum (W[n,k] x[k])^2), is what fp16 rounding errors scale with; it keeps outputs that
// cancel to near zero (likely with N = 1) from turning rounding into a large relative error,
// and equals ||ref|| on average for random data, so the bound is not loosened otherwise.
void expect_close(const std::vector<float>& y, const std::vector<float>& ref, double terms2,
                  const std::string& what) {
  ASSERT_EQ(y.size(), ref.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << what << ": y[" << i << "] = " << y[i];
    num += (double(y[i]) - ref[i]) * (double(y[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  den = std::max(den, terms2);
  ASSERT_GT(den, 0.0) << what;
  EXPECT_LT(std::sqrt(num / den), kTol) << what;
}

// The SiLU epilogue's outputs y[i] against SiLU(gate) * up of the same GEMV's rows without it
// (both: [gate | up], n each), within one fp16 rounding: the epilogue rounds gate and up to
// fp16 as a separate GEMV would, then computes in fp32 and rounds once.
void expect_silu_mul_of(const std::vector<float>& y, const std::vector<float>& both, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = both[i], b = both[n + i];
    const float want = half_to_float(float_to_half(a / (1.0f + std::exp(-a)) * b));
    ASSERT_TRUE(std::isfinite(y[i])) << "y[" << i << "]";
    EXPECT_LE(std::fabs(y[i] - want), std::ldexp(std::fabs(want), -10) + 1e-7f)
        << "row " << i << ": " << y[i] << " vs silu(" << a << ") * " << b;
  }
}

// Quantized GEMV of the first n rows of L against the reference.
void check_quant(const Linear& L, int64_t n, std::mt19937& rng, bool residual = false,
                 bool alias = false, cuda::GemvLaunch launch = {}) {
  const std::string what = describe(L.f, n, L.K);
  SCOPED_TRACE(what);
  Packed P = pack(L, n);
  GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
  if (launch.k_split) w.launch.k_split = launch.k_split;
  if (launch.grid) w.launch.grid = launch.grid;
  EXPECT_EQ(w.N, n);
  EXPECT_EQ(w.K, L.K);
  const bool grouped = L.f.group_size > 0 && L.f.group_size < L.K;
  EXPECT_EQ(w.has_perm, L.f.act_order && grouped) << "act-order must permute K exactly when "
                                                     "there is more than one group";
  const std::vector<uint16_t> x = random_x(L.K, rng);
  std::vector<uint16_t> r;
  if (residual) r = random_x(n, rng);
  double terms2 = 0;
  std::vector<float> ref = reference(L, n, to_floats(x), &terms2);
  if (residual)
    for (int64_t i = 0; i < n; ++i) ref[i] += half_to_float(r[i]);
  const std::vector<float> y =
      run(n, x, r, alias, [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
        cuda::gemv(w, dx, dy, dr, st);
      });
  cuda::gemv_free(w);
  EXPECT_EQ(w.device, nullptr);
  expect_close(y, ref, terms2, what);
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ---- Every format --------------------------------------------------------------------------

struct FormatCase {
  int bits, group_size;
  bool sym, act_order;
  Format format(int zero_offset) const {
    return Format{bits, group_size, sym, act_order, zero_offset};
  }
};

class GemvFormats : public ::testing::TestWithParam<FormatCase> {};

TEST_P(GemvFormats, MatchesReferenceOnTileBreakingShapes) {
  KESTREL_REQUIRE_GPU();
  const FormatCase c = GetParam();
  // Both zero-point conventions across the sweep (v1 stores z - 1, v2 stores z).
  const Format f = c.format((c.group_size == 64 || c.group_size == -1) ? 1 : (c.sym ? 1 : 0));
  std::mt19937 rng(1000 * c.bits + 10 * c.group_size + 2 * c.sym + c.act_order + 7);
  // (N, K): N = 1, 7, 33 leave tiles partly empty; K = 96, 160, 352 give 3, 5, 11 groups of 32
  // (odd counts, and K not a multiple of any chunk for 3-bit); 11008 is Llama-2-7B's down_proj.
  const std::pair<int64_t, int64_t> shapes[] = {
      {1, 96}, {7, 352}, {33, 160}, {33, 11008}, {4097, 4096}};
  for (auto [n, K] : shapes) {
    const Linear L = random_linear(f, round_up(n, 32), K, rng);
    check_quant(L, n, rng);
  }
}

std::vector<FormatCase> all_formats() {
  std::vector<FormatCase> v;
  for (int bits : {2, 3, 4, 8})
    for (int gs : {32, 64, 128, -1})
      for (bool sym : {true, false})
        for (bool act : {false, true}) v.push_back({bits, gs, sym, act});
  return v;
}

INSTANTIATE_TEST_SUITE_P(All, GemvFormats, ::testing::ValuesIn(all_formats()),
                         [](const ::testing::TestParamInfo<FormatCase>& i) {
                           const FormatCase& c = i.param;
                           return "b" + std::to_string(c.bits) + "_g" +
                                  (c.group_size < 0 ? std::string("row")
                                                    : std::to_string(c.group_size)) +
                                  (c.sym ? "_sym" : "_asym") + (c.act_order ? "_act" : "");
                         });

// ---- Shapes ----------------------------------------------------------------------------------

TEST(GemvShapes, FourBitGroup128AllShapes) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(42);
  for (bool act : {false, true}) {
    Format f;
    f.bits = 4;
    f.group_size = 128;
    f.sym = !act;
    f.act_order = act;
    f.zero_offset = act ? 0 : 1;
    for (int64_t K : {96, 160, 4096, 11008}) {
      const Linear L = random_linear(f, 4128, K, rng);
      for (int64_t n : {1, 7, 33, 4097}) check_quant(L, n, rng);
    }
  }
}

// Rows long enough that a block's x needs more than the default 48 KB of shared memory (the
// kernel raises its limit), on both sides of the longest row x is staged in one pass by a bulk
// copy (K = 16384), with and without act-order (K = 13824 is Llama-2-13B's down_proj).
TEST(GemvShapes, LongRowsNeedMoreSharedMemory) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(44);
  for (bool act : {false, true}) {
    const Format f{/*bits=*/4, /*group_size=*/128, /*sym=*/true, act, /*zero_offset=*/1};
    for (int64_t K : {13824, 16384, 16512}) {
      const Linear L = random_linear(f, 64, K, rng);
      for (int64_t n : {33, 64}) check_quant(L, n, rng);
    }
  }
}

// Rows long enough that two blocks of 8 warps do not fit on an SM: with act-order at K = 30720
// a block holds x twice (120 KB), so a shape that would take blocks of 8 warps (K, N >= 4096)
// falls back to one block of 16 (gemv.cu); without act-order the same K stages in one layout.
TEST(GemvShapes, LongRowsAtLargeNKeepWholeBlocks) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(45);
  for (int bits : {4, 8, 3})
    for (bool act : {true, false}) {
      const Format f{bits, /*group_size=*/128, /*sym=*/true, act, /*zero_offset=*/1};
      const Linear L = random_linear(f, 4096, 30720, rng);
      check_quant(L, 4096, rng);
    }
}

// Group sizes that are multiples of 32 but not 32/64/128 are served by repeating scales.
TEST(GemvShapes, OtherGroupSizes) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(43);
  for (int gs : {96, 160, 256})
    for (int bits : {3, 4}) {
      Format f;
      f.bits = bits;
      f.group_size = gs;
      f.sym = false;
      f.act_order = true;
      f.zero_offset = 0;
      const Linear L = random_linear(f, 64, 1056, rng);
      check_quant(L, 64, rng);
    }
}

// Grids of every size agree: one warp for all rows, a few rows per warp with a partial last
// step, and more warps than rows (idle warps).
TEST(GemvShapes, LaunchShapesAgree) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(44);
  for (int bits : {3, 4}) {
    Format f;
    f.bits = bits;
    f.group_size = 128;
    f.sym = false;
    f.act_order = true;
    f.zero_offset = 0;
    const Linear L = random_linear(f, 1056, 4096, rng);
    for (int grid : {0, 1, 5, 33, 200}) {
      SCOPED_TRACE("grid=" + std::to_string(grid));
      check_quant(L, 1043, rng, false, false, cuda::GemvLaunch{0, grid, true});
    }
  }
  // Symmetric 4-bit at K and N >= 4096: the specialized kernel in blocks of 8 warps (two per
  // SM), under a chosen grid, a grid of fewer blocks than SMs and one of more than resident.
  Format f;
  const Linear L = random_linear(f, 4128, 4096, rng);
  for (int grid : {0, 3, 300}) {
    SCOPED_TRACE("sym 4-bit, grid=" + std::to_string(grid));
    check_quant(L, 4100, rng, true, false, cuda::GemvLaunch{0, grid, true});
  }
}

// ---- Residual epilogue ------------------------------------------------------------------------

TEST(GemvResidual, AddsResidualSeparateAndAliased) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(45);
  Format f;
  f.bits = 4;
  f.group_size = 128;
  f.sym = false;
  f.act_order = true;
  f.zero_offset = 0;
  const Linear L = random_linear(f, 4128, 4096, rng);
  check_quant(L, 4097, rng, /*residual=*/true, /*alias=*/false);
  check_quant(L, 4097, rng, /*residual=*/true, /*alias=*/true);
  f.bits = 3;
  const Linear L3 = random_linear(f, 64, 11008, rng);
  check_quant(L3, 33, rng, true, true);
}

// ---- Fused input ops --------------------------------------------------------------------------

// x as the GEMV stages it after the fused op: the CPU reference op, rounded to fp16.
enum class InputOp { RmsNorm, SiluMul, LayerNorm };

std::vector<float> fused_input(const std::vector<uint16_t>& x, int64_t K, const std::vector<uint16_t>& norm_w,
                               float eps, InputOp op, const std::vector<uint16_t>& norm_b = {}) {
  const std::vector<float> xf = to_floats(x);
  std::vector<float> out(K);
  if (op == InputOp::SiluMul) {
    silu_mul_ref(xf.data(), xf.data() + K, K, out.data());
  } else if (op == InputOp::LayerNorm) {
    const std::vector<float> wf = to_floats(norm_w), bf = to_floats(norm_b);
    layer_norm_ref(xf.data(), wf.data(), norm_b.empty() ? nullptr : bf.data(), eps, 1, K, out.data());
  } else {
    const std::vector<float> wf = to_floats(norm_w);
    rms_norm_ref(xf.data(), wf.data(), eps, 1, K, out.data());
  }
  for (float& v : out) v = half_to_float(float_to_half(v));
  return out;
}

// x whose mean is far from 0, so that a LayerNorm that skipped the centring would be wrong.
std::vector<uint16_t> offset_x(std::vector<uint16_t> x, float offset) {
  for (auto& v : x) v = float_to_half(half_to_float(v) + offset);
  return x;
}

TEST(GemvInputOps, RmsNormSiluMulAndLayerNormFusedIntoStaging) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(51);
  for (bool act : {false, true})
    for (InputOp op : {InputOp::RmsNorm, InputOp::SiluMul, InputOp::LayerNorm})
      // 11008: over 48 KB of shared memory; 20480: past the bulk-copy staging (K > 16384)
      for (int64_t K : {96, 4096, 11008, 20480}) {
        const bool silu = op == InputOp::SiluMul, ln = op == InputOp::LayerNorm;
        if (K == 20480 && !ln) continue;
        Format f;
        f.bits = 4;
        f.group_size = 32;
        f.act_order = act;
        const int64_t n = 33;
        const Linear L = random_linear(f, round_up(n, 32), K, rng);
        const std::string what = describe(f, n, K) + (silu ? " silu*up" : ln ? " layernorm" : " rmsnorm");
        SCOPED_TRACE(what);
        Packed P = pack(L, n);
        GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
        const std::vector<uint16_t> x = offset_x(random_x(silu ? 2 * K : K, rng), ln ? 3.f : 0.f);
        std::vector<uint16_t> norm_w = random_x(K, rng), norm_b = random_x(K, rng);
        const float eps = 1e-5f;
        double terms2 = 0;
        const std::vector<float> ref =
            reference(L, n, fused_input(x, K, norm_w, eps, op, norm_b), &terms2);
        DeviceBuffer dnw = upload(norm_w), dnb = upload(norm_b);
        cuda::GemvInput in;
        if (silu)
          in.silu_mul = true;
        else if (ln)
          in = {dnw.as<__half>(), eps, false, true, dnb.as<__half>()};
        else
          in = {dnw.as<__half>(), eps, false};
        const std::vector<float> y =
            run(n, x, {}, false, [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
              cuda::gemv(w, dx, dy, dr, st, in);
            });
        cuda::gemv_free(w);
        expect_close(y, ref, terms2, what);

        // The fp16 GEMV stages x the same way.
        std::vector<uint16_t> W(n * K);
        std::normal_distribution<float> d(0.f, 0.02f);
        for (auto& v : W) v = float_to_half(d(rng));
        const std::vector<float> xe = fused_input(x, K, norm_w, eps, op, norm_b);
        std::vector<float> ref16(n);
        matmul_f16w_ref(xe.data(), W.data(), nullptr, 1, n, K, ref16.data());
        double t2 = 0;
        for (int64_t r = 0; r < n; ++r)
          for (int64_t k = 0; k < K; ++k) t2 += std::pow(double(half_to_float(W[r * K + k])) * xe[k], 2);
        DeviceBuffer dW = upload(W);
        const std::vector<float> y16 =
            run(n, x, {}, false, [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
              cuda::gemv_f16(dW.as<__half>(), dx, dy, n, K, dr, st, {}, in);
            });
        expect_close(y16, ref16, t2, what + " f16");
      }
}

// ---- SiLU epilogue ------------------------------------------------------------------------------

// gemv with GemvEpilogue::silu_mul on a fused [gate | up] weight against the plain gemv of the
// same weight: its row sums are the same (each row is summed alone), so silu(g) * u of the
// plain output must match to within one fp16 step (the host's expf against the device's).
// Also against the CPU reference, and the epilogue's argument checks.
TEST(GemvEpilogue, SiluMulOfFusedGateUp) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(52);
  for (int bits : {3, 4, 8})
    for (bool act : {false, true})
      for (auto [I, K] : {std::pair<int64_t, int64_t>{33, 96}, {1056, 4096}, {7, 11008}}) {
        Format f;
        f.bits = bits;
        f.group_size = 128;
        f.sym = !act;
        f.act_order = act;
        f.zero_offset = act ? 0 : 1;
        Linear gate = random_linear(f, round_up(I, 32), K, rng);
        Linear up = random_linear(f, round_up(I, 32), K, rng);
        up.g_idx = gate.g_idx;  // fused parts share the input permutation
        const std::string what = describe(f, I, K) + " silu epilogue";
        SCOPED_TRACE(what);
        Packed pg = pack(gate, I), pu = pack(up, I);
        GemvWeight w = cuda::gemv_prepare({pg.view, pu.view}, nullptr);
        const std::vector<uint16_t> x = random_x(K, rng);
        const std::vector<float> both = run(
            2 * I, x, {}, false, [&](const __half* dx, __half* dy, const __half*, cudaStream_t st) {
              cuda::gemv(w, dx, dy, nullptr, st);
            });
        const std::vector<float> y = run(
            I, x, {}, false, [&](const __half* dx, __half* dy, const __half*, cudaStream_t st) {
              cuda::gemv(w, dx, dy, nullptr, st, {}, cuda::GemvEpilogue{true});
            });
        double terms2 = 0;
        const std::vector<float> g = reference(gate, I, to_floats(x), &terms2);
        const std::vector<float> u = reference(up, I, to_floats(x), &terms2);
        expect_silu_mul_of(y, both, I);
        std::vector<float> ref(I);
        for (int64_t i = 0; i < I; ++i) ref[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        expect_close(y, ref, terms2, what + " vs reference");
        cuda::gemv_free(w);
      }
  // Odd N (not a [gate | up] pair) and a residual are refused.
  Format f;
  f.bits = 4;
  f.group_size = 128;
  const Linear L = random_linear(f, 64, 256, rng);
  Packed P = pack(L, 33);
  GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
  DeviceBuffer buf(4096);
  EXPECT_THROW(cuda::gemv(w, buf.as<__half>(), buf.as<__half>() + 512, nullptr, nullptr, {},
                          cuda::GemvEpilogue{true}),
               Error);
  cuda::gemv_free(w);
  Packed P2 = pack(L, 34);
  w = cuda::gemv_prepare({P2.view}, nullptr);
  EXPECT_THROW(cuda::gemv(w, buf.as<__half>(), buf.as<__half>() + 512, buf.as<__half>() + 1024,
                          nullptr, {}, cuda::GemvEpilogue{true}),
               Error);
  cuda::gemv_free(w);
}

// ---- Specialized kernels ----------------------------------------------------------------------

// The symmetric 4-bit kernels compiled per act-order and fused ops (gemv.cu, spec_of) against
// the kernel that tests its inputs at run time, on the same weight and inputs: the same
// arithmetic, so the same bits, for each combination a decode step uses (none, RMSNorm,
// residual separate and aliased, RMSNorm with the SiLU epilogue), every group size, with and
// without act-order, in blocks of 16 warps and (g128, the large shape) of 8; and both against
// the CPU reference. Asymmetric weights take the run-time
// kernel either way (checked to agree too).
// The gate|up GEMV storing SiLU * up in the down weight's act-order permutation
// (GemvEpilogue::out_index = gemv_input_index(down)), and down's gemv_input_permuted view
// staging it as is: the same bits as the down GEMV gathering the natural x.
TEST(GemvEpilogue, IndexedStoreFeedsThePermutedInput) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(57);
  for (int bits : {4, 3, 8})
    for (bool act : {true, false})
      // (intermediate, hidden, down rows): 11008 x 4100 takes blocks of 8 warps without the
      // permutation, 16 with it (its x twice in shared memory); 5632 x 70 the warp-pair kernel
      // at 3 and 4 bits.
      for (auto [I, H, Nd] : {std::tuple<int64_t, int64_t, int64_t>{1056, 256, 70},
                              {11008, 256, 4100}, {5632, 256, 70}}) {
        Format f;
        f.bits = bits;
        f.group_size = 128;
        f.act_order = act;
        Format fg = f;
        fg.act_order = false;
        const Linear gate = random_linear(fg, round_up(I, 32), H, rng);
        const Linear up = random_linear(fg, round_up(I, 32), H, rng);
        const Linear down = random_linear(f, round_up(Nd, 32), I, rng);
        const std::string what = describe(f, Nd, I) + " down after an indexed gate|up";
        SCOPED_TRACE(what);
        Packed pg = pack(gate, I), pu = pack(up, I), pd = pack(down, Nd);
        GemvWeight gu = cuda::gemv_prepare({pg.view, pu.view}, nullptr);
        GemvWeight d = cuda::gemv_prepare({pd.view}, nullptr);
        ASSERT_EQ(d.has_perm, act);
        const GemvWeight dv = cuda::gemv_input_permuted(d);
        ASSERT_EQ(dv.perm, nullptr);
        const std::vector<int32_t> idx = cuda::gemv_input_index(d, nullptr);
        ASSERT_EQ((int64_t)idx.size(), I);
        std::vector<int32_t> seen(idx);
        std::sort(seen.begin(), seen.end());
        for (int64_t i = 0; i < I; ++i) ASSERT_EQ(seen[i], i) << "not a permutation";

        const std::vector<uint16_t> x = random_x(H, rng);
        DeviceBuffer dx = upload(x), didx = upload(idx);
        DeviceBuffer h(I * 2), hp(I * 2), y(Nd * 2), yp(Nd * 2);
        {
          const EngineStream es;
          const cudaStream_t st = es.s;
          cuda::gemv(gu, dx.as<__half>(), h.as<__half>(), nullptr, st, {}, {true});
          cuda::gemv(d, h.as<__half>(), y.as<__half>(), nullptr, st);
          cuda::gemv(gu, dx.as<__half>(), hp.as<__half>(), nullptr, st, {},
                     {true, didx.as<int32_t>()});
          cuda::gemv(dv, hp.as<__half>(), yp.as<__half>(), nullptr, st);
          KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
        }
        std::vector<uint16_t> hh(I), hph(I), yh(Nd), yph(Nd);
        KESTREL_CUDA_CHECK(cudaMemcpy(hh.data(), h.get(), I * 2, cudaMemcpyDeviceToHost));
        KESTREL_CUDA_CHECK(cudaMemcpy(hph.data(), hp.get(), I * 2, cudaMemcpyDeviceToHost));
        KESTREL_CUDA_CHECK(cudaMemcpy(yh.data(), y.get(), Nd * 2, cudaMemcpyDeviceToHost));
        KESTREL_CUDA_CHECK(cudaMemcpy(yph.data(), yp.get(), Nd * 2, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < I; ++i)
          ASSERT_EQ(hph[idx[i]], hh[i]) << "h[" << i << "] stored at " << idx[i];
        for (int64_t n = 0; n < Nd; ++n)
          ASSERT_EQ(yph[n], yh[n]) << "row " << n << ": " << half_to_float(yph[n]) << " vs "
                                   << half_to_float(yh[n]);
        // And right: down's reference on the natural h.
        double terms2 = 0;
        expect_close(to_floats(yph), reference(down, Nd, to_floats(hh), &terms2), terms2, what);
        cuda::gemv_free(gu);
        cuda::gemv_free(d);
      }
}

// The residual stream read in one permutation and written in another (GemvEpilogue's
// out_index and residual_index): y[oi[i]] = (W x)_i + r[ri[i]], bit for bit what the GEMV
// with the natural residual r[ri[i]] stores at i, for the specialized kernels (blocks of 8 and
// 16 warps, with and without act-order), the run-time kernel (asymmetric weights) and more
// than 32 rows per warp (the store path that reads its indexes late; 100000 rows: 47 per warp
// on the H200's 132 SMs of 16 warps).
TEST(GemvEpilogue, ResidualReadAndStoredThroughIndexes) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(61);
  struct Case {
    int bits;
    bool sym, act;
    int64_t N, K;
  };
  const Case cases[] = {{4, true, true, 4100, 4096},  {4, true, false, 4100, 4096},
                        {4, true, true, 70, 11008},   {3, true, true, 4096, 1056},
                        // the warp-pair kernel, act-order and not
                        {4, true, true, 2048, 5632},  {3, true, false, 70, 4224},
                        {8, true, false, 4100, 4096}, {4, false, true, 300, 256},
                        // > 32 rows per warp up to ~190 SMs (16 warps each): the late path
                        {4, true, false, 100000, 256},  {4, true, true, 100000, 256}};
  for (const Case& c : cases) {
    Format f;
    f.bits = c.bits;
    f.sym = c.sym;
    f.act_order = c.act;
    const Linear L = random_linear(f, round_up(c.N, 32), c.K, rng);
    const std::string what = describe(f, c.N, c.K) + " indexed residual";
    SCOPED_TRACE(what);
    Packed P = pack(L, c.N);
    GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
    std::vector<int32_t> oi(c.N), ri(c.N);
    std::iota(oi.begin(), oi.end(), 0);
    std::iota(ri.begin(), ri.end(), 0);
    std::shuffle(oi.begin(), oi.end(), rng);
    std::shuffle(ri.begin(), ri.end(), rng);
    const std::vector<uint16_t> x = random_x(c.K, rng), r = random_x(c.N, rng);
    std::vector<uint16_t> r_nat(c.N);  // the residual in natural order
    for (int64_t i = 0; i < c.N; ++i) r_nat[i] = r[ri[i]];
    DeviceBuffer dx = upload(x), dr = upload(r), drn = upload(r_nat), doi = upload(oi),
                 dri = upload(ri), y(c.N * 2), yi(c.N * 2);
    {
      const EngineStream es;
      cuda::gemv(w, dx.as<__half>(), y.as<__half>(), drn.as<__half>(), es.s);
      cuda::gemv(w, dx.as<__half>(), yi.as<__half>(), dr.as<__half>(), es.s, {},
                 {false, doi.as<int32_t>(), dri.as<int32_t>()});
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(es.s));
    }
    std::vector<uint16_t> yh(c.N), yih(c.N);
    KESTREL_CUDA_CHECK(cudaMemcpy(yh.data(), y.get(), c.N * 2, cudaMemcpyDeviceToHost));
    KESTREL_CUDA_CHECK(cudaMemcpy(yih.data(), yi.get(), c.N * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < c.N; ++i)
      ASSERT_EQ(yih[oi[i]], yh[i]) << "row " << i << " stored at " << oi[i];
    // And right: the reference plus the residual.
    double terms2 = 0;
    std::vector<float> ref = reference(L, c.N, to_floats(x), &terms2);
    for (int64_t i = 0; i < c.N; ++i) ref[i] += half_to_float(r_nat[i]);
    std::vector<float> got(c.N);
    for (int64_t i = 0; i < c.N; ++i) got[i] = half_to_float(yih[oi[i]]);
    expect_close(got, ref, terms2, what);
    cuda::gemv_free(w);
  }
}

// Refused: an output index without the SiLU epilogue or a residual index, a residual index
// without an output index, indexes without a residual, y aliasing the residual.
// A small weight and one device buffer carved into x, y, a residual (or bias) and an index:
// the calls of the refusal tests below, which gemv refuses before launching anything.
struct RefusedCall {
  GemvWeight w;
  DeviceBuffer buf{4096};
  __half* x = buf.as<__half>();
  __half* y = buf.as<__half>() + 256;
  __half* r = buf.as<__half>() + 384;
  const int32_t* idx = buf.as<int32_t>() + 512;
  explicit RefusedCall(uint32_t seed) {
    std::mt19937 rng(seed);
    const Linear L = random_linear(Format{}, 64, 256, rng);
    Packed P = pack(L, 64);
    w = cuda::gemv_prepare({P.view}, nullptr);
  }
  ~RefusedCall() { cuda::gemv_free(w); }
  RefusedCall(const RefusedCall&) = delete;
  RefusedCall& operator=(const RefusedCall&) = delete;
};

TEST(GemvEpilogue, RefusesIndexesWithoutTheirEpilogue) {
  KESTREL_REQUIRE_GPU();
  RefusedCall c(63);
  const GemvWeight& w = c.w;
  __half *x = c.x, *y = c.y, *r = c.r;
  const int32_t* idx = c.idx;
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {}, cuda::GemvEpilogue{false, idx}), Error);
  EXPECT_THROW(cuda::gemv(w, x, y, r, nullptr, {}, cuda::GemvEpilogue{false, nullptr, idx}), Error);
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {}, cuda::GemvEpilogue{false, idx, idx}),
               Error);
  EXPECT_THROW(cuda::gemv(w, x, y, y, nullptr, {}, cuda::GemvEpilogue{false, idx, idx}), Error);
}

TEST(GemvEpilogue, RefusesCombinationsItDoesNotCompute) {
  KESTREL_REQUIRE_GPU();
  RefusedCall c(64);
  const GemvWeight& w = c.w;
  __half *x = c.x, *y = c.y, *b = c.r;
  const int32_t* idx = c.idx;
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {}, {.silu_mul = true, .relu = true}), Error);
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {}, {.silu_mul = true, .bias = b}), Error);
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {}, {.out_index = idx, .relu = true}), Error);
  // A bias standing in for the residual is not read through a residual_index.
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {},
                          {.out_index = idx, .residual_index = idx, .bias = b}),
               Error);
  // LayerNorm without its weights, or a norm beside SiLU * up.
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {nullptr, 1e-5f, false, true, b}), Error);
  EXPECT_THROW(cuda::gemv(w, x, y, nullptr, nullptr, {b, 1e-5f, true}), Error);
  EXPECT_THROW(cuda::gemv_f16(b, x, y, 8, 256, nullptr, nullptr, {}, {}, {.silu_mul = true}), Error);
}

TEST(GemvSpecialized, SameOutputAsTheRunTimeKernel) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(61);
  enum Ops { kNone, kNorm, kResidual, kAliased, kNormSilu };
  // Every bit width with specialized kernels (2, 3, 4, 8); asymmetric weights run the run-time
  // kernel either way, checked here once each.
  for (int bits : {4, 3, 8, 2})
    for (int gs : {32, 64, 128, -1})
      for (bool act : {false, true})
        for (bool sym : {true, false})
          // 4098 x 4096: blocks of 8 warps (gemv.cu, spec_block_warps) at 3, 4 and 8 bits; the
          // others 16. K <= 2048 (rows of at most 16 units) takes the half-warp kernels at 3 and
          // 4 bits, K <= 4096 at 2 bits (units of 256 codes; 4096 fills every lane): 352 and
          // 1920 leave some of a half's lanes without a unit, 2048 none; 34, 2562 and 1030 rows
          // end on a part of a (double) step, and 17, 1,281 and 515 SiLU pairs on one half of it.
          // K = 5632 and 4224 (44 and 33 units: a second group of 12 and 1) take the warp-pair
          // kernels at 3 and 4 bits without the RMSNorm; 70 and 1030 rows end on a part of a step.
          // 4098 x 8192 at 2 bits (32 units): the 2-bit whole-warp kernels in blocks of 8, as a
          // 7B's 2-bit down takes them.
          for (auto [n, K] : {std::pair<int64_t, int64_t>{34, 352}, {1056, 4096}, {4098, 4096},
                              {2562, 2048}, {1030, 1920}, {70, 5632}, {1030, 4224}, {4098, 8192}})
            for (Ops ops : {kNone, kNorm, kResidual, kAliased, kNormSilu}) {
              if (!sym && (gs != 128 || ops != kNone)) continue;
              if (n == 4098 && gs != 128) continue;
              if (K == 8192 && bits != 2) continue;
              Format f;
              f.bits = bits;
              f.group_size = gs;
              f.act_order = act;
              f.sym = sym;
              f.zero_offset = sym ? 1 : 0;
              const Linear L = random_linear(f, round_up(n, 32), K, rng);
              const std::string what = describe(f, n, K) + " ops " + std::to_string(ops);
              SCOPED_TRACE(what);
              Packed P = pack(L, n);
              GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
              const std::vector<uint16_t> x = random_x(K, rng);
              const std::vector<uint16_t> norm_w = random_x(K, rng);
              DeviceBuffer dnw = upload(norm_w);
              const bool norm = ops == kNorm || ops == kNormSilu, silu = ops == kNormSilu;
              const bool res = ops == kResidual || ops == kAliased;
              const std::vector<uint16_t> r = res ? random_x(n, rng) : std::vector<uint16_t>{};
              cuda::GemvInput in;
              if (norm) in = {dnw.as<__half>(), 1e-5f, false};
              const int64_t out_n = silu ? n / 2 : n;
              auto y_with = [&](bool specialized) {
                GemvWeight wk = w;
                wk.launch.specialized = specialized;
                return run(out_n, x, r, ops == kAliased,
                           [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
                             cuda::gemv(wk, dx, dy, dr, st, in, cuda::GemvEpilogue{silu});
                           });
              };
              const std::vector<float> ys = y_with(true), yg = y_with(false);
              // The same bits, except where the specialized kernel runs blocks of 8 warps
              // (4098 rows) with the RMSNorm: its block of 256 threads sums x's squares in
              // another order than the run-time kernel's 512, so 1 / rms may differ in its last
              // bit and a staged x by an fp16 ulp, and the gate and up sums (rounded to fp16
              // before the SiLU epilogue multiplies them) by an ulp at their own magnitude.
              // There, within 2^-9 of the largest output.
              // Rows of 33-64 units at 3 and 4 bits without the RMSNorm take the warp-pair
              // kernel, whose two unit groups are summed apart, then added: there too.
              const bool pair = (bits == 3 || bits == 4) && sym && K > 4096 && K <= 8192 && !norm;
              const bool same_order = !(norm && n == 4098) && !pair;
              float scale = 0.f;
              for (float v : yg) scale = std::max(scale, std::fabs(v));
              for (int64_t i = 0; i < out_n; ++i) {
                if (same_order) {
                  ASSERT_EQ(std::memcmp(&ys[i], &yg[i], sizeof(float)), 0)
                      << "row " << i << ": specialized " << ys[i] << ", run-time " << yg[i];
                } else {
                  ASSERT_LE(std::fabs(ys[i] - yg[i]), std::ldexp(scale, -9))
                      << "row " << i << ": specialized " << ys[i] << ", run-time " << yg[i];
                }
              }
              // And both right: the reference of the staged input, residual added. With the
              // SiLU epilogue, the gate and up rows (the same kernel without it) against the
              // reference, where kTol holds for a linear's outputs, and the epilogue's output
              // against SiLU(gate) * up of those (expect_silu_mul_of, as in
              // GemvEpilogue.SiluMulOfFusedGateUp): a product of two outputs scales their
              // rounding errors by the other's value, which kTol does not bound.
              double terms2 = 0;
              std::vector<float> ref =
                  reference(L, n, norm ? fused_input(x, K, norm_w, 1e-5f, InputOp::RmsNorm) : to_floats(x),
                            &terms2);
              if (res)
                for (int64_t i = 0; i < n; ++i) ref[i] += half_to_float(r[i]);
              if (silu) {
                const std::vector<float> both =
                    run(n, x, r, false,
                        [&](const __half* dx, __half* dy, const __half*, cudaStream_t st) {
                          cuda::gemv(w, dx, dy, nullptr, st, in);
                        });
                expect_silu_mul_of(ys, both, out_n);
                expect_close(both, ref, terms2, what);
              } else {
                expect_close(ys, ref, terms2, what);
              }
              cuda::gemv_free(w);
            }
}

// The LayerNorm staging, and the norm with a residual (the q/k/v biases of Qwen2 and OPT; OPT's
// fc1 with its bias and ReLU), in the kernels specialized for a norm and a residual against the
// run-time kernel and the reference, over the shapes that take each block size and row split.
TEST(GemvSpecialized, NormWithResidualLayerNormAndReluAsTheRunTimeKernel) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(67);
  enum Ops { kRmsRes, kLnRes, kLnResRelu };
  for (int bits : {4, 3, 8})
    for (int gs : {128, 32})
      for (bool act : {false, true})
        // 34 x 352: half-warp rows; 4098 x 4096: blocks of 8 warps; 70 x 5632: rows of 33-64
        // units (no warp-pair kernel with a norm); 64 x 16384: the largest bulk-copied x.
        for (auto [n, K] : {std::pair<int64_t, int64_t>{34, 352}, {1056, 4096}, {4098, 4096},
                            {70, 5632}, {64, 16384}})
          for (Ops ops : {kRmsRes, kLnRes, kLnResRelu}) {
            if (n == 4098 && gs != 128) continue;
            Format f;
            f.bits = bits;
            f.group_size = gs;
            f.act_order = act;
            const Linear L = random_linear(f, round_up(n, 32), K, rng);
            const bool ln = ops != kRmsRes, relu = ops == kLnResRelu;
            const std::string what = describe(f, n, K) + (ln ? " layernorm" : " rmsnorm") +
                                     " + residual" + (relu ? " + relu" : "");
            SCOPED_TRACE(what);
            Packed P = pack(L, n);
            GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
            const std::vector<uint16_t> x = offset_x(random_x(K, rng), ln ? -2.f : 0.f);
            const std::vector<uint16_t> norm_w = random_x(K, rng), norm_b = random_x(K, rng);
            const std::vector<uint16_t> r = random_x(n, rng);
            DeviceBuffer dnw = upload(norm_w), dnb = upload(norm_b);
            const cuda::GemvInput in{dnw.as<__half>(), 1e-5f, false, ln, dnb.as<__half>()};
            auto y_with = [&](bool specialized) {
              GemvWeight wk = w;
              wk.launch.specialized = specialized;
              return run(n, x, r, false,
                         [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
                           cuda::gemv(wk, dx, dy, dr, st, in, {.relu = relu});
                         });
            };
            const std::vector<float> ys = y_with(true), yg = y_with(false);
            // As in SameOutputAsTheRunTimeKernel: the blocks of 8 warps sum x's statistics in
            // another order.
            float scale = 0.f;
            for (float v : yg) scale = std::max(scale, std::fabs(v));
            for (int64_t i = 0; i < n; ++i) {
              if (n != 4098)
                ASSERT_EQ(std::memcmp(&ys[i], &yg[i], sizeof(float)), 0)
                    << "row " << i << ": specialized " << ys[i] << ", run-time " << yg[i];
              else
                ASSERT_LE(std::fabs(ys[i] - yg[i]), std::ldexp(scale, -9)) << "row " << i;
            }
            double terms2 = 0;
            std::vector<float> ref = reference(
                L, n, fused_input(x, K, norm_w, 1e-5f, ln ? InputOp::LayerNorm : InputOp::RmsNorm,
                                  norm_b),
                &terms2);
            for (int64_t i = 0; i < n; ++i) {
              ref[i] += half_to_float(r[i]);
              if (relu) ref[i] = std::max(ref[i], 0.f);
            }
            expect_close(ys, ref, terms2, what);
            cuda::gemv_free(w);
          }
}

// GemvEpilogue::bias after the residual (or as it, without one) and ReLU after both, in the
// specialized, run-time and fp16 kernels.
TEST(GemvEpilogue, BiasAndReluAfterTheResidual) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(71);
  struct Case {
    bool residual, alias, relu;
  };
  for (int bits : {4, 2})
    for (bool act : {false, true})
      for (auto [n, K] : {std::pair<int64_t, int64_t>{33, 96}, {1056, 4096}})
        for (Case c : {Case{true, false, false}, Case{true, true, false}, Case{false, false, false},
                       Case{false, false, true}, Case{true, false, true}}) {
          Format f;
          f.bits = bits;
          f.group_size = 32;
          f.act_order = act;
          const Linear L = random_linear(f, round_up(n, 32), K, rng);
          const std::string what = describe(f, n, K) + (c.residual ? " residual" : "") +
                                   (c.alias ? " aliased" : "") + " bias" + (c.relu ? " relu" : "");
          SCOPED_TRACE(what);
          Packed P = pack(L, n);
          GemvWeight w = cuda::gemv_prepare({P.view}, nullptr);
          const std::vector<uint16_t> x = random_x(K, rng), b = random_x(n, rng);
          const std::vector<uint16_t> r = c.residual ? random_x(n, rng) : std::vector<uint16_t>{};
          DeviceBuffer db = upload(b);
          const cuda::GemvEpilogue out{.bias = db.as<__half>(), .relu = c.relu};
          auto finish = [&](std::vector<float> ref) {
            for (int64_t i = 0; i < n; ++i) {
              ref[i] += half_to_float(b[i]) + (c.residual ? half_to_float(r[i]) : 0.f);
              if (c.relu) ref[i] = std::max(ref[i], 0.f);
            }
            return ref;
          };
          double terms2 = 0;
          const std::vector<float> ref = finish(reference(L, n, to_floats(x), &terms2));
          for (bool specialized : {true, false}) {
            GemvWeight wk = w;
            wk.launch.specialized = specialized;
            const std::vector<float> y =
                run(n, x, r, c.alias, [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
                  cuda::gemv(wk, dx, dy, dr, st, {}, out);
                });
            expect_close(y, ref, terms2, what + (specialized ? "" : " run-time"));
          }
          cuda::gemv_free(w);

          std::vector<uint16_t> W(n * K);
          std::normal_distribution<float> d(0.f, 0.02f);
          for (auto& v : W) v = float_to_half(d(rng));
          std::vector<float> ref16(n);
          const std::vector<float> xf = to_floats(x);
          matmul_f16w_ref(xf.data(), W.data(), nullptr, 1, n, K, ref16.data());
          double t2 = 0;
          for (int64_t i = 0; i < n; ++i)
            for (int64_t k = 0; k < K; ++k) t2 += std::pow(double(half_to_float(W[i * K + k])) * xf[k], 2);
          DeviceBuffer dW = upload(W);
          const std::vector<float> y16 =
              run(n, x, r, c.alias, [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
                cuda::gemv_f16(dW.as<__half>(), dx, dy, n, K, dr, st, {}, {}, out);
              });
          expect_close(y16, finish(ref16), t2, what + " f16");
        }
}

// ---- Fused parts -------------------------------------------------------------------------------

TEST(GemvFused, ThreePartsMatchConcatenatedReferences) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(46);
  for (int bits : {3, 4, 8}) {
    Format f;
    f.bits = bits;
    f.group_size = bits == 3 ? 64 : 128;
    f.sym = false;
    f.act_order = true;
    f.zero_offset = bits == 8 ? 1 : 0;
    const int64_t K = 1056;
    // One shared act-order permutation (q, k and v see the same input).
    Linear base = random_linear(f, 32, K, rng);
    const int64_t Ns[3] = {96, 32, 160};
    std::vector<Linear> Ls;
    std::vector<Packed> Ps;
    for (int64_t n : Ns) {
      Linear L = random_linear(f, n, K, rng);
      L.g_idx = base.g_idx;
      Ls.push_back(L);
    }
    for (const Linear& L : Ls) Ps.push_back(pack(L, L.N));
    std::vector<gptq::GptqView> views;
    for (const Packed& P : Ps) views.push_back(P.view);
    GemvWeight w = cuda::gemv_prepare(views, nullptr);
    ASSERT_EQ(w.N, 96 + 32 + 160);
    const std::vector<uint16_t> x = random_x(K, rng);
    std::vector<float> ref;
    double terms2 = 0;
    for (const Linear& L : Ls) {
      const std::vector<float> part = reference(L, L.N, to_floats(x), &terms2);
      ref.insert(ref.end(), part.begin(), part.end());
    }
    const std::vector<float> y = run(
        w.N, x, {}, false, [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
          cuda::gemv(w, dx, dy, dr, st);
        });
    cuda::gemv_free(w);
    expect_close(y, ref, terms2, "fused bits=" + std::to_string(bits));
  }
}

// ---- The packed layout (no GPU needed) ---------------------------------------------------------

// Decodes W[n, k] from the host repack by the layout drawn in kernels/gemv/weight_decode.cuh, un-permuting K.
std::vector<float> decode_repack(const cuda::gemv_detail::HostRepack& h) {
  using namespace cuda::gemv_detail;
  const GemvWeight& m = h.meta;
  const int C = chunk_codes(m.bits), P = m.planes;
  const int64_t nch = m.chunks;
  std::vector<float> W(m.N * m.K, std::nanf(""));
  for (int64_t n = 0; n < m.N; ++n)
    for (int64_t kp = 0; kp < m.K; ++kp) {
      const int64_t c = kp / C;
      const int i = static_cast<int>(kp % C);
      auto word = [&](int plane, int j) {
        return h.codes[(n * P * nch + chunk_index(m.bits, nch, c, plane)) * 4 + j];
      };
      uint32_t q = 0;
      switch (m.bits) {
        case 4:
          q = (word(0, i / 8) >> nibble_pos(i % 8)) & 15u;
          break;
        case 2:
          q = (word(0, i / 16) >> crumb_pos(i % 16)) & 3u;
          break;
        case 8:
          q = (word(0, i / 4) >> (8 * (i % 4))) & 255u;
          break;
        case 3: {
          const int u = i / 32, ii = i % 32;
          if (ii < 24) {
            q = (word(ii / 8, u) >> nibble_pos(ii % 8)) & 7u;
          } else {
            for (int b = 0; b < 3; ++b) q |= ((word(b, u) >> (nibble_pos(ii - 24) + 3)) & 1u) << b;
          }
          break;
        }
      }
      const int64_t e = m.group_size > 0 ? kp / m.group_size : 0;
      const float s = half_to_float(h.scales[n * m.groups + e]);
      const int z = h.zeros.empty() ? m.zero_const : h.zeros[n * m.groups + e] + m.zero_offset;
      const int64_t k = h.perm.empty() ? kp : h.perm[kp];
      W[n * m.K + k] = s * (float(q) - float(z));
    }
  return W;
}

TEST(GemvLayout, RepackDecodesToTheCheckpointWeights) {
  std::mt19937 rng(50);
  for (const FormatCase& c : all_formats()) {
    const Format f = c.format(c.sym ? 1 : (c.bits == 8 ? 1 : 0));
    const int64_t K = 352;
    const Linear L = random_linear(f, 64, K, rng);
    const std::string what = describe(f, 64, K);
    SCOPED_TRACE(what);
    Packed P = pack(L, L.N);
    std::vector<float> ref(L.N * K);
    gptq::dequantize_ref(P.view, ref.data());
    const cuda::gemv_detail::HostRepack h = cuda::gemv_detail::repack({P.view});
    EXPECT_EQ(h.zeros.empty(), c.sym) << "symmetric weights need no zero-point array";
    const std::vector<float> W = decode_repack(h);
    for (size_t i = 0; i < W.size(); ++i)
      ASSERT_EQ(W[i], ref[i]) << what << ": W[" << i / K << ", " << i % K << "]";
  }
}

// The quantized kernel deals its rows to warps with warp_rows (no GPU needed): consecutive runs
// tile [0, n_rows) in order; in whole steps, every warp takes P / W or P / W + 1 steps, the
// longer runs first, each starting at a step boundary; with fewer steps than warps (or without
// whole steps), equal runs.
TEST(GemvLayout, WarpRowsTileTheRowsInWholeSteps) {
  using cuda::gemv_detail::warp_rows;
  for (const int per_step : {1, 2})
    for (const int64_t W : {1, 3, 8, 256, 2112})
      for (const int64_t n_rows : {1, 2, 5, 63, 64, 255, 1000, 4096, 4097, 11008, 12288, 22016})
        for (const bool whole : {false, true}) {
          SCOPED_TRACE(std::to_string(n_rows) + " rows, " + std::to_string(per_step) +
                       " per step, " + std::to_string(W) + " warps, whole " +
                       std::to_string(whole));
          const int64_t P = (n_rows + per_step - 1) / per_step;
          const bool dealt = whole && P >= W;
          int prev_end = 0, prev_steps = INT32_MAX;
          for (int64_t w = 0; w < W; ++w) {
            const cuda::gemv_detail::RowRun r = warp_rows(n_rows, per_step, w, W, whole);
            ASSERT_EQ(r.begin, prev_end) << "warp " << w << " does not start where the last ended";
            ASSERT_LE(r.begin, r.end) << "warp " << w;
            if (dealt) {
              ASSERT_EQ(r.begin % per_step, 0) << "warp " << w << " starts inside a step";
              const int steps = (r.end - r.begin + per_step - 1) / per_step;
              ASSERT_TRUE(steps == P / W || steps == P / W + 1) << "warp " << w << ": " << steps;
              ASSERT_LE(steps, prev_steps) << "warp " << w << ": a longer run after a shorter";
              prev_steps = steps;
            } else {
              ASSERT_EQ(r.begin, n_rows * w / W) << "warp " << w << ": not the equal run";
            }
            prev_end = r.end;
          }
          EXPECT_EQ(prev_end, n_rows) << "the runs do not reach the last row";
        }
  // The 7B's gate|up (11,008 SiLU pairs) and qkv (12,288 rows, two per step) over 264 blocks of
  // 8 warps: the left-over steps go to the first 448 and 1,920 warps.
  const cuda::gemv_detail::RowRun g447 = warp_rows(11008, 1, 447, 2112, true);
  const cuda::gemv_detail::RowRun g448 = warp_rows(11008, 1, 448, 2112, true);
  EXPECT_EQ(g447.end - g447.begin, 6);
  EXPECT_EQ(g448.end - g448.begin, 5);
  const cuda::gemv_detail::RowRun q1919 = warp_rows(12288, 2, 1919, 2112, true);
  const cuda::gemv_detail::RowRun q1920 = warp_rows(12288, 2, 1920, 2112, true);
  EXPECT_EQ(q1919.end - q1919.begin, 6);
  EXPECT_EQ(q1920.end - q1920.begin, 4);
}

// The half-warp kernels' rows (step_runs): whole steps of two half-warp steps, in equal runs of
// steps, tiling the rows in order.
TEST(GemvLayout, StepRunsTileTheRowsInEqualRunsOfWholeSteps) {
  using cuda::gemv_detail::step_runs;
  for (const int per_step : {2, 4})
    for (const int64_t W : {1, 3, 2112})
      for (const int64_t n_rows : {1, 2, 3, 5, 17, 1030, 1280, 2048, 2560, 2562, 5632}) {
        SCOPED_TRACE(std::to_string(n_rows) + " rows, " + std::to_string(per_step) + " per step, " +
                     std::to_string(W) + " warps");
        const int64_t P = (n_rows + per_step - 1) / per_step;
        int prev_end = 0;
        for (int64_t w = 0; w < W; ++w) {
          const cuda::gemv_detail::RowRun r = step_runs(n_rows, per_step, w, W);
          ASSERT_EQ(r.begin, prev_end) << "warp " << w << " does not start where the last ended";
          ASSERT_LE(r.begin, r.end) << "warp " << w;
          if (r.begin < r.end) {
            ASSERT_EQ(r.begin % per_step, 0) << "warp " << w;
          }
          const int64_t steps = (r.end - r.begin + per_step - 1) / per_step;
          ASSERT_TRUE(steps == P / W || steps == (P + W - 1) / W) << "warp " << w << ": " << steps;
          prev_end = r.end;
        }
        EXPECT_EQ(prev_end, n_rows) << "the runs do not reach the last row";
      }
  // The 1.1B's gate|up (5,632 SiLU pairs, two per step) over 132 blocks of 16 warps: 2,816
  // steps, one or two per warp.
  EXPECT_EQ(step_runs(5632, 2, 0, 2112).end, 2);
  EXPECT_EQ(step_runs(5632, 2, 2, 2112).end - step_runs(5632, 2, 2, 2112).begin, 4);
}

// ---- Validation (no GPU needed: gemv_prepare checks before touching the device) ----------------

struct PartsFixture {
  std::vector<Linear> Ls;
  std::vector<Packed> Ps;
  std::vector<gptq::GptqView> views() const {
    std::vector<gptq::GptqView> v;
    for (const Packed& P : Ps) v.push_back(P.view);
    return v;
  }
};

PartsFixture two_parts(const Format& f, int64_t K, std::mt19937& rng) {
  PartsFixture fx;
  fx.Ls.push_back(random_linear(f, 64, K, rng));
  fx.Ls.push_back(random_linear(f, 32, K, rng));
  fx.Ls[1].g_idx = fx.Ls[0].g_idx;
  for (const Linear& L : fx.Ls) fx.Ps.push_back(pack(L, L.N));
  return fx;
}

void expect_error_mentions(const std::vector<gptq::GptqView>& views, const std::string& needle) {
  try {
    GemvWeight w = cuda::gemv_prepare(views, nullptr);
    cuda::gemv_free(w);
    FAIL() << "expected kestrel::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("part 1"), std::string::npos) << e.what();
  }
}

// The loader sizes the weights' allocation before repacking, asking whether zero points will
// be kept: the answer must be repack's, for every format and for fused parts, and one differing
// zero point anywhere must keep them all.
TEST(GemvPrepare, ZeroPointsUniformIsRepacksDecision) {
  std::mt19937 rng(53);
  for (const FormatCase& c : all_formats()) {
    const Format f = c.format(c.sym ? 1 : 0);
    SCOPED_TRACE(describe(f, 96, 352));
    PartsFixture fx = two_parts(f, 352, rng);
    const bool uniform = cuda::gemv_zero_points_uniform(fx.views());
    EXPECT_EQ(uniform, c.sym) << "random asymmetric zero points are not all equal";
    EXPECT_EQ(cuda::gemv_detail::repack(fx.views()).zeros.empty(), uniform);
    if (!c.sym) continue;
    // One zero point of the second part's last group changed: no longer uniform.
    Packed& P = fx.Ps[1];
    const int64_t zwords = (P.view.N * c.bits + 31) / 32;
    uint32_t& word = P.qzeros[(P.view.groups() - 1) * zwords + zwords - 1];
    word ^= 1u << (32 - c.bits);  // the low bit of its last zero point (32 codes: whole words)
    P.view.qzeros = P.qzeros.data();
    EXPECT_FALSE(cuda::gemv_zero_points_uniform(fx.views()));
    EXPECT_FALSE(cuda::gemv_detail::repack(fx.views()).zeros.empty());
  }
}

TEST(GemvPrepare, RejectsMismatchedParts) {
  std::mt19937 rng(47);
  Format f;
  f.bits = 4;
  f.group_size = 64;
  f.sym = false;
  f.act_order = true;
  f.zero_offset = 0;
  {
    PartsFixture fx = two_parts(f, 256, rng);
    auto v = fx.views();
    v[1].K = 128;
    expect_error_mentions(v, "K=128");
  }
  {
    PartsFixture fx = two_parts(f, 256, rng);
    auto v = fx.views();
    v[1].bits = 8;
    expect_error_mentions(v, "bits=8");
  }
  {
    PartsFixture fx = two_parts(f, 256, rng);
    auto v = fx.views();
    v[1].group_size = 128;
    expect_error_mentions(v, "group_size=128");
  }
  {
    PartsFixture fx = two_parts(f, 256, rng);
    auto v = fx.views();
    v[1].zero_offset = 1;
    expect_error_mentions(v, "zero_offset=1");
  }
  {
    PartsFixture fx = two_parts(f, 256, rng);
    std::vector<int32_t> other(256);
    std::iota(other.begin(), other.end(), 0);
    std::shuffle(other.begin(), other.end(), rng);
    fx.Ls[1].g_idx = gptq::act_order_g_idx(other, 64);
    auto v = fx.views();
    v[1].g_idx = fx.Ls[1].g_idx.data();
    expect_error_mentions(v, "g_idx");
  }
}

TEST(GemvPrepare, RejectsUnsupportedFormats) {
  std::mt19937 rng(48);
  Format f;
  f.bits = 4;
  f.group_size = 64;
  const Linear L = random_linear(f, 32, 256, rng);
  Packed P = pack(L, 32);
  {
    gptq::GptqView v = P.view;
    v.bits = 5;
    EXPECT_THROW(cuda::gemv_prepare({v}, nullptr), Error);
  }
  {
    gptq::GptqView v = P.view;
    v.group_size = 48;  // groups would not be whole 32-code units
    try {
      cuda::gemv_prepare({v}, nullptr);
      FAIL() << "group_size 48 accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("group_size=48"), std::string::npos) << e.what();
    }
  }
  {
    // g_idx whose groups are not runs of group_size columns (all in group 0 of 4).
    std::vector<int32_t> g(256, 0);
    gptq::GptqView v = P.view;
    v.g_idx = g.data();
    EXPECT_THROW(cuda::gemv_prepare({v}, nullptr), Error);
  }
  EXPECT_THROW(cuda::gemv_prepare({}, nullptr), Error);
}

// A weight placed in the caller's memory (one allocation for a whole model) computes exactly
// what an owned one does, fits in gemv_device_bytes_bound, and gemv_free leaves the memory
// alone; memory smaller than the weight is refused.
TEST(GemvPrepare, PlacesIntoCallerMemoryWithinTheBound) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(47);
  for (const FormatCase& c : all_formats()) {
    const Format f = c.format(c.sym ? 1 : 0);
    const Linear L = random_linear(f, 96, 352, rng);
    const std::string what = describe(f, 96, 352);
    SCOPED_TRACE(what);
    Packed P = pack(L, 96);
    GemvWeight owned = cuda::gemv_prepare({P.view}, nullptr);
    const size_t bound = cuda::gemv_device_bytes_bound(c.bits, c.group_size, 96, 352, c.act_order);
    EXPECT_GE(bound, owned.device_bytes);
    // Told whether zero points are kept, the bound is exact unless it counts a permutation
    // that is not there (act-order with one group per row).
    const size_t exact = cuda::gemv_device_bytes_bound(
        c.bits, c.group_size, 96, 352, c.act_order, !cuda::gemv_zero_points_uniform({P.view}));
    if (c.act_order && c.group_size < 0)
      EXPECT_GE(exact, owned.device_bytes);
    else
      EXPECT_EQ(exact, owned.device_bytes);
    DeviceBuffer arena(bound + 256);
    GemvWeight placed = cuda::gemv_prepare({P.view}, nullptr, arena.as<char>() + 256, bound);
    EXPECT_FALSE(placed.owns_device);
    EXPECT_EQ(placed.device, arena.as<char>() + 256);
    EXPECT_EQ(placed.device_bytes, owned.device_bytes);
    const std::vector<uint16_t> x = random_x(352, rng);
    auto gemv_of = [&](const GemvWeight& w) {
      return run(96, x, {}, false,
                 [&](const __half* dx, __half* dy, const __half*, cudaStream_t st) {
                   cuda::gemv(w, dx, dy, nullptr, st);
                 });
    };
    EXPECT_EQ(gemv_of(placed), gemv_of(owned));
    const size_t short_by_16 = owned.device_bytes - 16;
    cuda::gemv_free(placed);
    EXPECT_EQ(placed.device, nullptr);
    cuda::gemv_free(owned);
    EXPECT_THROW(cuda::gemv_prepare({P.view}, nullptr, arena.as<char>(), short_by_16),
                 kestrel::Error);
    EXPECT_THROW(cuda::gemv_prepare({P.view}, nullptr, arena.as<char>() + 8, bound),
                 kestrel::Error);  // unaligned
  }
}

TEST(GemvPrepare, EmptyWeightIsRejectedByGemv) {
  GemvWeight w;
  EXPECT_THROW(cuda::gemv(w, nullptr, nullptr, nullptr, nullptr), Error);
}

// ---- fp16 weights ----------------------------------------------------------------------------

TEST(GemvF16, MatchesReference) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(49);
  std::normal_distribution<float> d(0.f, 0.02f);
  for (int64_t K : {96, 160, 4096, 11008})
    for (int64_t N : {1, 7, 33, 4097})
      for (bool residual : {false, true}) {
        const std::string what = "f16 N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                 (residual ? " +residual" : "");
        SCOPED_TRACE(what);
        std::vector<uint16_t> W(N * K);
        for (auto& v : W) v = float_to_half(d(rng));
        const std::vector<uint16_t> x = random_x(K, rng);
        std::vector<uint16_t> r;
        if (residual) r = random_x(N, rng);
        std::vector<float> ref(N);
        matmul_f16w_ref(to_floats(x).data(), W.data(), nullptr, 1, N, K, ref.data());
        double terms2 = 0;
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) {
            const double t = double(half_to_float(W[n * K + k])) * half_to_float(x[k]);
            terms2 += t * t;
          }
        if (residual)
          for (int64_t i = 0; i < N; ++i) ref[i] += half_to_float(r[i]);
        DeviceBuffer dW = upload(W);
        const std::vector<float> y =
            run(N, x, r, residual && (N % 2),
                [&](const __half* dx, __half* dy, const __half* dr, cudaStream_t st) {
                  cuda::gemv_f16(dW.as<__half>(), dx, dy, N, K, dr, st);
                });
        expect_close(y, ref, terms2, what);
      }
}

TEST(GemvF16, RejectsBadShapes) {
  EXPECT_THROW(cuda::gemv_f16(nullptr, nullptr, nullptr, 4, 100, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::gemv_f16(nullptr, nullptr, nullptr, 0, 64, nullptr, nullptr), Error);
}

}  // namespace
}  // namespace kestrel
