// The GPU quantizer against its CPU oracle (tools/quantize/gptq.h), kernel by kernel and as a
// whole, and the GPU layer forward the calibration runs on against DecoderCpu::layer_forward.
//
// - Hessian: GpuHessian (cuBLAS, fp16 inputs, fp32 accumulation) equals quant::Hessian on the
//   same fp16-representable inputs to fp32 rounding.
// - Factor: U from cuSOLVER factors the damped, permuted Hessian's inverse; a Hessian that is
//   not positive definite is the CPU's one-line error.
// - RTN: codes, scales, zeros, g_idx and dequantized weights bit-equal to rtn_quantize for
//   every option (no accumulation anywhere, so nothing may differ); with --mse's range search,
//   equal bar near-ties of its scores (expect_near_ties_only says why those may differ).
// - GPTQ: against gptq_quantize over bits, group sizes, act-order, static groups, sym/asym,
//   --mse and shapes that are not multiples of the 128-column block. Exact where exactness follows from
//   the arithmetic, bounded where it cannot (see GptqVsCpu).
// - relative_error_cuda equals relative_error; an allocation that does not fit is one line
//   naming what it was for.
// - layer_forward_rows with taps against the CPU engine's layer_forward.
// - Mixed precision on the GPU, on the CPU mixed-precision suite's model and calibration text
//   (tests/support/sampled_model.h): the measuring pass gives the CPU's losses within the
//   bounds of the uniform GPU quantizer and the CPU's plan bar near-ties, --loss kl is refused
//   on cuda, the quantizing pass gives every linear its planned format, a plan of one format
//   is the uniform GPU checkpoint, and the mixed checkpoint's perplexity is the CPU's within a
//   few percent.
// Every test skips where no GPU is usable.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "base/device.h"
#include "base/dtype.h"
#include "base/error.h"
#include "models/io/model_spec.h"
#include "kernels/common/cuda_utils.h"
#include "models/cpu/decoder.h"
#include "models/gpu/layer.h"
#include "tests/support/compare.h"
#include "tests/support/plan_check.h"
#include "tests/support/quant_inputs.h"
#include "tests/support/sampled_model.h"
#include "tests/support/synth_model.h"
#include "tools/quantize/gptq.h"
#include "tools/quantize/gptq_cuda.h"
#include "tools/quantize/quantize.h"

namespace kestrel {
namespace {

using cuda::DeviceBuffer;
using namespace kestrel::quant;
using test::check_inverse_factor;
using test::correlated_inputs;
using test::FactorCheck;
using test::hessian_of;
using test::max_rel_diff;
using test::random_weights;


template <class T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(std::max<size_t>(v.size() * sizeof(T), 16));
  KESTREL_CUDA_CHECK(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

template <class T>
std::vector<T> to_host(const void* d, size_t n) {
  std::vector<T> v(n);
  KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Rounds every value to fp16 (the GPU Hessian's inputs are the forward's fp16 activations).
std::vector<float> fp16_values(std::vector<float> v) {
  for (float& x : v) x = round_to_half(x);
  return v;
}

struct Gpu {
  cudaStream_t stream = nullptr;
  std::unique_ptr<GpuContext> ctx;
  Gpu() {
    KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
    ctx = std::make_unique<GpuContext>(stream);
  }
  ~Gpu() {
    ctx.reset();
    cudaStreamDestroy(stream);
  }
};

// A GPU Hessian holding exactly H (host), for feeding both sides the same matrix.
DeviceBuffer hessian_on_device(const std::vector<float>& H) { return to_device(H); }

// ---------------------------------------------------------------------------------------

TEST(GpuAlloc, OutOfMemoryIsOneLineNamingWhat) {
  KESTREL_REQUIRE_GPU();
  try {
    gpu_alloc(size_t(1) << 52, "the calibration activations");  // 4 PiB
    FAIL() << "no error";
  } catch (const DeviceError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of GPU memory for the calibration activations"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  // The failure leaves no error behind: the next allocation and launch work.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_NO_THROW(gpu_alloc(1 << 20, "a small buffer"));
}

TEST(GpuHessian, EqualsTheCpuHessian) {
  KESTREL_REQUIRE_GPU();
  Gpu g;
  const int64_t n = 1000, K = 200;  // K: not a multiple of the tensor-core tiles
  const std::vector<float> x = fp16_values(correlated_inputs(n, K, 1));
  std::vector<uint16_t> xh(x.size());
  for (size_t i = 0; i < x.size(); ++i) xh[i] = float_to_half(x[i]);
  const DeviceBuffer dx = to_device(xh);
  GpuHessian h(*g.ctx, K);
  for (int64_t i = 0; i < n; i += 300)  // uneven chunks: the running average's rescaling
    h.add(dx.as<__half>() + i * K, std::min<int64_t>(300, n - i));
  EXPECT_EQ(h.samples(), n);
  const std::vector<float> gpu = h.matrix();
  const std::vector<float> cpu = hessian_of(x, n, K);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_TRUE(std::isfinite(gpu[i]));
    worst = std::max(worst, (double)std::abs(gpu[i] - cpu[i]));
    scale = std::max(scale, (double)std::abs(cpu[i]));
  }
  // fp16 x fp16 products are exact in fp32; only the order of the fp32 sums differs.
  EXPECT_LT(worst, 1e-5 * scale);
  // Both triangles are written: the matrix is symmetric.
  for (int64_t a = 0; a < K; ++a)
    for (int64_t b = 0; b < a; ++b) ASSERT_NEAR(gpu[a * K + b], gpu[b * K + a], 1e-6 * scale);
}

TEST(GpuGptqFactor, UFactorsTheDampedPermutedInverse) {
  KESTREL_REQUIRE_GPU();
  Gpu g;
  const int64_t n = 400, K = 150;
  std::vector<float> H = hessian_of(correlated_inputs(n, K, 4), n, K);
  for (int64_t i = 0; i < K; ++i) H[13 * K + i] = H[i * K + 13] = 0.0f;  // a dead input
  const DeviceBuffer dH = hessian_on_device(H);
  const GptqOptions o{.act_order = true, .damp = 0.01f};
  const GpuGptqFactor f(*g.ctx, dH.as<float>(), K, o, "test");
  const std::vector<float> U = f.U_host();
  const std::vector<int32_t>& perm = f.perm();
  // The permutation sorts the diagonal (the dead input's 1 included) in decreasing order.
  for (int64_t j = 1; j < K; ++j) {
    const float a = H[perm[j - 1] * K + perm[j - 1]], b = H[perm[j] * K + perm[j]];
    EXPECT_GE(a == 0.0f ? 1.0f : a, b == 0.0f ? 1.0f : b);
  }
  // The damped, permuted Hessian as gptq_quantize builds it.
  double mean = 0;
  for (int64_t i = 0; i < K; ++i) mean += (H[i * K + i] == 0.0f ? 1.0 : H[i * K + i]);
  const float damp = 0.01f * (float)(mean / K);
  std::vector<double> Hp(K * K);
  for (int64_t a = 0; a < K; ++a)
    for (int64_t b = 0; b < K; ++b) {
      double v = H[perm[a] * K + perm[b]];
      if (a == b) v = (v == 0.0 ? 1.0 : v) + damp;
      Hp[a * K + b] = v;
    }
  // Hp (U^T U) = I, U upper triangular.
  const FactorCheck c = check_inverse_factor(Hp, U, K);
  ASSERT_EQ(c.below_diagonal, 0);
  EXPECT_LT(c.worst, 2e-3);  // the CPU factor's bound in test_quantize
}

TEST(GpuGptqFactor, NotPositiveDefiniteIsAClearError) {
  KESTREL_REQUIRE_GPU();
  Gpu g;
  const DeviceBuffer dH = hessian_on_device({1, 2, 2, 1});  // eigenvalues 3 and -1
  try {
    GpuGptqFactor f(*g.ctx, dH.as<float>(), 2, GptqOptions{}, "model.layers.0.mlp.up_proj");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.layers.0.mlp.up_proj"), std::string::npos) << m;
    EXPECT_NE(m.find("--damp"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

// ---------------------------------------------------------------------------------------

struct Opt {
  int bits, group_size;
  bool act_order, sym, static_groups;
  int64_t N, K;
  float mse = 0.0f;
};
std::string opt_name(const ::testing::TestParamInfo<Opt>& i) {
  const Opt& o = i.param;
  return "b" + std::to_string(o.bits) + "_g" + (o.group_size < 0 ? "m1" : std::to_string(o.group_size)) +
         (o.act_order ? "_act" : "") + (o.sym ? "_sym" : "_asym") + (o.static_groups ? "_static" : "") +
         (o.mse > 0 ? "_mse" : "") + "_" + std::to_string(o.N) + "x" + std::to_string(o.K);
}
GptqOptions options_of(const Opt& p) {
  return GptqOptions{.bits = p.bits, .group_size = p.group_size, .act_order = p.act_order,
                     .sym = p.sym, .static_groups = p.static_groups, .mse = p.mse};
}

// sum |w - q(w)|^norm over one range of weights at scale s and zero z: how the CPU's range
// search (find_params, gptq.cpp) scores a fit, with the same float operations.
double range_error(const float* w, int64_t cols, float s, float z, int bits, float norm) {
  const float maxq = (float)((1 << bits) - 1);
  double e = 0.0;
  for (int64_t c = 0; c < cols; ++c)
    e += std::pow(std::fabs(s * (quantize_code(w[c], s, z, maxq) - z) - w[c]), norm);
  return e;
}

// The range search on the GPU scores each shrink with the CPU's terms in the CPU's order, but
// takes each term's power correctly rounded where glibc's powf is at times one ulp off. So
// where two shrinks' sums tie to about that precision the two may keep different ones, and
// nowhere else. For every (group, row) whose scale or zero differ between the GPU's result gq
// and the CPU's cq, both fitted by group on Wfit [N, K] (original column order, `width`
// columns a group), this checks that it is such a near-tie on the CPU's own scores: the CPU's
// choice scores least (it keeps the first least), the GPU's within 1e-6 of it. Returns how many
// differ.
int expect_near_ties_only(const std::vector<float>& Wfit, int64_t N, int64_t K, int64_t width,
                          const GptqOptions& o, const QuantizedLinear& gq,
                          const QuantizedLinear& cq) {
  const int64_t G = cq.groups();
  int differ = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n) {
      const size_t i = g * N + n;
      if (gq.scales[i] == cq.scales[i] && gq.zeros[i] == cq.zeros[i]) continue;
      ++differ;
      const float* w = &Wfit[n * K + g * width];
      const int64_t cols = std::min(width, K - g * width);
      const double ec = range_error(w, cols, cq.scales[i], cq.zeros[i], o.bits, o.mse);
      const double eg = range_error(w, cols, gq.scales[i], gq.zeros[i], o.bits, o.mse);
      EXPECT_LE(ec, eg) << "group " << g << " row " << n;
      EXPECT_LE(eg - ec, 1e-6 * ec) << "group " << g << " row " << n << ": not a near-tie";
    }
  return differ;
}

class RtnVsCpu : public ::testing::TestWithParam<Opt> {};

// RTN has no accumulation: every output must equal the CPU's bit for bit, but for the range
// search's near-ties.
TEST_P(RtnVsCpu, BitEqual) {
  KESTREL_REQUIRE_GPU();
  Gpu g;
  const Opt& p = GetParam();
  const GptqOptions o = options_of(p);
  const std::vector<float> W = random_weights(p.N, p.K, 21);
  const std::vector<float> H = hessian_of(correlated_inputs(600, p.K, 22), 600, p.K);
  const DeviceBuffer dW = to_device(W), dH = to_device(H);
  std::vector<uint16_t> zeros16(p.N * p.K);
  DeviceBuffer d16 = to_device(zeros16);
  GpuQuantOutputs out;
  out.dequant_host = true;
  out.dequant_f16 = d16.as<__half>();
  out.error_hessian = dH.as<float>();
  const QuantizedLinear gq = rtn_quantize_cuda(*g.ctx, dW.as<float>(), p.N, p.K, o, "test", out);
  const QuantizedLinear cq = rtn_quantize(W.data(), p.N, p.K, o);
  EXPECT_EQ(gq.g_idx, cq.g_idx);
  ASSERT_EQ(gq.scales.size(), cq.scales.size());
  if (p.mse > 0) {
    // The range search: equal parameters bar near-ties of its scores, and where the
    // parameters are equal, equal codes and values.
    const int64_t width = p.group_size == -1 ? p.K : p.group_size;
    const int differ = expect_near_ties_only(W, p.N, p.K, width, o, gq, cq);
    EXPECT_LE(differ, 1 + (int)(0.01 * (double)cq.scales.size())) << "near-ties";
    for (int64_t k = 0; k < p.K; ++k)
      for (int64_t n = 0; n < p.N; ++n) {
        const size_t gi = (size_t)cq.g_idx[k] * p.N + n, i = n * p.K + k;
        if (gq.scales[gi] != cq.scales[gi] || gq.zeros[gi] != cq.zeros[gi]) continue;
        ASSERT_EQ(gq.codes[i], cq.codes[i]) << i;
        ASSERT_EQ(gq.dequant[i], cq.dequant[i]) << i;
      }
    // The search ran: some range was shrunk below the full range's scale.
    GptqOptions full_range = o;
    full_range.mse = 0.0f;
    const QuantizedLinear full = rtn_quantize(W.data(), p.N, p.K, full_range);
    int clipped = 0;
    for (size_t i = 0; i < full.scales.size(); ++i) clipped += gq.scales[i] < full.scales[i];
    EXPECT_GT(clipped, 0);
  } else {
    // No accumulation anywhere: bit-equal.
    EXPECT_EQ(gq.codes, cq.codes);
    EXPECT_EQ(gq.scales, cq.scales);
    EXPECT_EQ(gq.zeros, cq.zeros);
    ASSERT_EQ(gq.dequant, cq.dequant);
  }
  // The fp16 copy is the dequantized weight rounded once.
  const std::vector<uint16_t> h16 = to_host<uint16_t>(d16.get(), p.N * p.K);
  for (size_t i = 0; i < h16.size(); ++i) ASSERT_EQ(h16[i], float_to_half(gq.dequant[i])) << i;
  const double e = relative_error(W.data(), gq.dequant.data(), p.N, p.K, H.data());
  EXPECT_GT(e, 0.0);
  EXPECT_NEAR(out.rel_error, e, 1e-4 * e);
}

INSTANTIATE_TEST_SUITE_P(
    Options, RtnVsCpu,
    ::testing::Values(Opt{4, 128, false, true, false, 64, 256}, Opt{4, 32, false, false, false, 72, 200},
                      Opt{3, -1, false, true, false, 40, 200}, Opt{2, 32, false, false, false, 64, 96},
                      Opt{8, 128, false, true, false, 96, 320}, Opt{8, -1, false, false, false, 33, 130},
                      Opt{2, 64, false, false, false, 64, 256, 2.4f},
                      Opt{3, 128, false, true, false, 40, 320, 2.4f},
                      Opt{3, -1, false, false, false, 40, 200, 2.4f},
                      Opt{4, 32, false, true, false, 72, 200, 2.0f}),
    opt_name);

class GptqVsCpu : public ::testing::TestWithParam<Opt> {};

// GPTQ on the GPU against gptq_quantize on the same W and H.
//
// The column loop repeats the CPU's float operations exactly, so the two differ only through
// U (cuSOLVER's and LAPACK's fp32 Cholesky factorizations round differently, ~1e-6 relative
// here) and the lazy updates' sum order (cuBLAS vs OpenBLAS). A code can then differ only
// where w / scale lies within ~1e-5 of a rounding boundary (a near-tie), and after such a flip
// the row feeds a different error forward, so the rest of that row may differ too: GPTQ's rows
// are independent, so a flip never reaches another row. Hence the bounds: few rows differ at
// all (the CPU's own blocked-vs-plain test, the same kind of perturbation, sees at most 1 of 32)
// and most codes even of those rows agree; rows that agree in every code agree in every scale
// and zero bar near-ties of the fp16 rounding of a scale; parameters that do not depend on the
// updates (per-row groups, static groups) and g_idx are equal everywhere (with --mse, bar
// near-ties of the range search's scores); and the
// reconstruction errors are close.
TEST_P(GptqVsCpu, SameCodesBarNearTies) {
  KESTREL_REQUIRE_GPU();
  Gpu g;
  const Opt& p = GetParam();
  const GptqOptions o = options_of(p);
  const int64_t N = p.N, K = p.K, n = 1500;
  std::vector<float> H = hessian_of(correlated_inputs(n, K, 5), n, K);
  for (int64_t dead : {int64_t{7}, K - 20})  // two dead inputs: never active
    for (int64_t i = 0; i < K; ++i) H[dead * K + i] = H[i * K + dead] = 0.0f;
  const std::vector<float> W = random_weights(N, K, 6);
  const DeviceBuffer dW = to_device(W), dH = to_device(H);

  const GpuGptqFactor f(*g.ctx, dH.as<float>(), K, o, "test");
  GpuQuantOutputs out;
  out.dequant_host = true;
  out.error_hessian = dH.as<float>();
  const QuantizedLinear gq = gptq_quantize_cuda(*g.ctx, f, dW.as<float>(), N, K, o, "test", out);
  const QuantizedLinear cq = gptq_quantize(W.data(), N, K, H.data(), o, "test");

  ASSERT_EQ(gq.codes.size(), cq.codes.size());
  ASSERT_EQ(gq.scales.size(), cq.scales.size());
  EXPECT_EQ(gq.g_idx, cq.g_idx);
  const int64_t G = gq.groups();
  int rows_differing = 0, codes_differing = 0, params_differing_in_equal_rows = 0;
  for (int64_t r = 0; r < N; ++r) {
    int d = 0;
    for (int64_t k = 0; k < K; ++k) d += gq.codes[r * K + k] != cq.codes[r * K + k];
    codes_differing += d;
    rows_differing += d > 0;
    if (d > 0) continue;
    int params_differing = 0;
    for (int64_t gi = 0; gi < G; ++gi)
      params_differing += gq.scales[gi * N + r] != cq.scales[gi * N + r] ||
                          gq.zeros[gi * N + r] != cq.zeros[gi * N + r];
    params_differing_in_equal_rows += params_differing;
    if (params_differing == 0) {
      for (int64_t k = 0; k < K; ++k) ASSERT_EQ(gq.dequant[r * K + k], cq.dequant[r * K + k]);
    }
  }
  std::printf("[ stats    ] %s: %d of %lld rows differ, %d of %lld codes, %d of the equal rows' "
              "%lld parameters\n",
              ::testing::UnitTest::GetInstance()->current_test_info()->name(), rows_differing,
              (long long)N, codes_differing, (long long)(N * K), params_differing_in_equal_rows,
              (long long)((N - rows_differing) * G));
  EXPECT_LE(rows_differing, std::max<int64_t>(2, N / 10));
  EXPECT_LE(codes_differing, 0.02 * N * K);
  EXPECT_LE(params_differing_in_equal_rows, 1 + 0.01 * (N - rows_differing) * G);
  if (p.group_size == -1 || p.static_groups) {
    if (p.mse > 0) {
      // Fitted before any update, per row on W as given, static groups on W with the dead
      // inputs zeroed: the same bar near-ties of the range search's scores.
      std::vector<float> Wfit = W;
      if (p.static_groups)
        for (int64_t r = 0; r < N; ++r) Wfit[r * K + 7] = Wfit[r * K + K - 20] = 0.0f;
      const int differ = expect_near_ties_only(Wfit, N, K, p.static_groups ? p.group_size : K,
                                               o, gq, cq);
      EXPECT_LE(differ, 1 + (int)(0.01 * (double)cq.scales.size())) << "near-ties";
    } else {
      EXPECT_EQ(gq.scales, cq.scales);  // fitted on W before any update
      EXPECT_EQ(gq.zeros, cq.zeros);
    }
  }
  // Dead inputs are quantized from zero weights.
  for (int64_t r = 0; r < N; ++r) ASSERT_EQ(gq.dequant[r * K + 7], 0.0f);
  // dequant is the format's formula over the returned codes, scales and zeros.
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t gi = gq.g_idx[k];
      ASSERT_EQ(gq.dequant[r * K + k],
                gq.scales[gi * N + r] * ((float)gq.codes[r * K + k] - (float)gq.zeros[gi * N + r]));
    }
  // The error the GPU reports is relative_error of its result, and close to the CPU's.
  const double eg = relative_error(W.data(), gq.dequant.data(), N, K, H.data());
  const double ec = relative_error(W.data(), cq.dequant.data(), N, K, H.data());
  EXPECT_NEAR(out.rel_error, eg, 1e-4 * eg);
  EXPECT_NEAR(eg, ec, 0.05 * ec);
  // And clearly below round-to-nearest's, as GPTQ must be on correlated inputs.
  const QuantizedLinear rq = rtn_quantize(W.data(), N, K, o);
  EXPECT_LT(eg, 0.7 * relative_error(W.data(), rq.dequant.data(), N, K, H.data()));
}

INSTANTIATE_TEST_SUITE_P(
    Options, GptqVsCpu,
    ::testing::Values(Opt{4, 128, false, true, false, 96, 320}, Opt{4, 128, true, true, false, 96, 320},
                      Opt{4, -1, false, true, false, 64, 320}, Opt{4, -1, true, true, false, 64, 320},
                      Opt{4, 32, false, true, false, 64, 200}, Opt{4, 32, true, false, false, 64, 200},
                      Opt{3, 64, true, true, false, 40, 320}, Opt{3, 128, false, false, false, 40, 260},
                      Opt{2, 32, true, false, false, 64, 200}, Opt{8, 128, true, true, false, 64, 320},
                      Opt{4, 64, true, true, true, 96, 320}, Opt{4, 128, false, false, true, 72, 300},
                      Opt{4, 96, true, true, false, 48, 320}, Opt{4, 128, true, true, false, 200, 130},
                      // --mse: the range search on dynamic groups (fitted on updated weights),
                      // per row and on static groups (fitted up front).
                      Opt{2, 64, true, false, false, 64, 200, 2.4f},
                      Opt{3, 128, true, true, false, 40, 320, 2.4f},
                      Opt{3, -1, false, false, false, 40, 260, 2.4f},
                      Opt{4, 64, true, true, true, 96, 320, 2.0f}),
    opt_name);

TEST(RelativeErrorCuda, EqualsTheCpuValue) {
  KESTREL_REQUIRE_GPU();
  Gpu g;
  const int64_t n = 500, N = 48, K = 96;
  const std::vector<float> H = hessian_of(correlated_inputs(n, K, 2), n, K);
  const std::vector<float> W = random_weights(N, K, 3);
  const QuantizedLinear q = rtn_quantize(W.data(), N, K, GptqOptions{.bits = 3, .group_size = 32});
  const DeviceBuffer dW = to_device(W), dQ = to_device(q.dequant), dH = to_device(H);
  const double e = relative_error(W.data(), q.dequant.data(), N, K, H.data());
  EXPECT_GT(e, 0.0);
  EXPECT_NEAR(relative_error_cuda(*g.ctx, dW.as<float>(), dQ.as<float>(), N, K, dH.as<float>()), e,
              1e-4 * e);
}

// ---------------------------------------------------------------------------------------
// The calibration forward: one decoder layer on the GPU (fp16) against the CPU engine (fp32).

std::vector<float> halves_to_floats(const __half* d, size_t n) {
  const std::vector<uint16_t> h = to_host<uint16_t>(d, n);
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = half_to_float(h[i]);
  return f;
}

TEST(LayerForwardRows, TapsAndOutputMatchTheCpuLayer) {
  KESTREL_REQUIRE_GPU();
  const std::filesystem::path dir =
      test::write_tiny_model({"layer_fp16", "fp16", 4, 128, false, false, "gptq"}, 3, 1);
  const ModelSpec spec = load_model_spec(dir.string());
  const ModelConfig& c = spec.config;
  const int T = 100;  // not a multiple of the attention or GEMM tiles
  DecoderCpu cpu_model(spec);
  auto cpu = cpu_model.new_cpu_session(T);
  std::vector<int> tokens(T);
  for (int i = 0; i < T; ++i) tokens[i] = (i * 37 + 5) % c.vocab;
  std::vector<float> x((size_t)T * c.hidden);
  cpu_model.embed(tokens.data(), T, 0, x.data());
  // The GPU's input is the same embedding rounded to fp16 (the model's own fp16 values).
  const std::vector<float> x0 = x;
  std::vector<std::vector<float>> cpu_in(4);
  LayerTaps ct;
  ct.input = [&](LinearGroup g, const float* in, int t, int K) { cpu_in[(int)g].assign(in, in + (size_t)t * K); };
  cpu->layer_forward(0, x.data(), T, 0, &ct);

  // The layer's fp16 weights on the GPU, fused as the engine holds them.
  const LayerSpec& ls = spec.layers[0];
  auto upload = [](std::vector<const TensorInfo*> parts) {
    std::vector<uint16_t> h;
    for (const TensorInfo* t : parts) {
      const std::vector<float> f = to_float(*t);
      for (float v : f) h.push_back(float_to_half(v));
    }
    return to_device(h);
  };
  const DeviceBuffer n1 = upload({ls.input_norm}), n2 = upload({ls.post_norm});
  const DeviceBuffer wqkv = upload({ls.q.weight, ls.k.weight, ls.v.weight}), wo = upload({ls.o.weight});
  const DeviceBuffer wgu = upload({ls.gate.weight, ls.up.weight}), wd = upload({ls.down.weight});
  GpuLayer L;
  L.input_norm = n1.as<__half>();
  L.post_norm = n2.as<__half>();
  auto dense = [](GpuLinear& l, const DeviceBuffer& b, int64_t N, int64_t K) {
    l.N = N;
    l.K = K;
    l.dense = b.as<__half>();
  };
  const int qkv_n = c.q_dim() + 2 * c.kv_dim();
  dense(L.qkv, wqkv, qkv_n, c.hidden);
  dense(L.o, wo, c.hidden, c.q_dim());
  dense(L.gate_up, wgu, 2 * c.intermediate, c.hidden);
  dense(L.down, wd, c.hidden, c.intermediate);

  auto halves = [](size_t n) { return DeviceBuffer(n * 2); };
  const DeviceBuffer xb = halves((size_t)T * c.hidden), qkv = halves((size_t)T * qkv_n),
                     att = halves((size_t)T * c.q_dim()), gu = halves((size_t)T * 2 * c.intermediate),
                     act = halves((size_t)T * c.intermediate), kc = halves((size_t)T * c.kv_dim()),
                     vc = halves((size_t)T * c.kv_dim());
  const LayerRowsScratch b{xb.as<__half>(), qkv.as<__half>(), att.as<__half>(), gu.as<__half>(),
                           act.as<__half>(), nullptr};
  std::vector<uint16_t> xh(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) xh[i] = float_to_half(x0[i]);
  DeviceBuffer dx = to_device(xh);
  cudaStream_t s = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamCreate(&s));
  cuda::GemmRunner gemm;
  std::vector<std::vector<float>> gpu_in(4);
  std::vector<int> seen_k(4, 0);
  GpuLayerTaps gt;
  gt.input = [&](LinearGroup g, const __half* in, int t, int K) {
    EXPECT_EQ(t, T);
    seen_k[(int)g] = K;
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    gpu_in[(int)g] = halves_to_floats(in, (size_t)t * K);
  };
  layer_forward_rows(c, L, gemm, dx.as<__half>(), T, 0, kc.as<__half>(), vc.as<__half>(), b, s, &gt);
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(seen_k, (std::vector<int>{c.hidden, c.q_dim(), c.hidden, c.intermediate}));
  // fp16 activations against fp32: a few fp16 roundings along the way.
  for (int g = 0; g < 4; ++g) EXPECT_LT(max_rel_diff(gpu_in[g], cpu_in[g]), 1e-2) << "group " << g;
  EXPECT_LT(max_rel_diff(halves_to_floats(dx.as<__half>(), x.size()), x), 1e-2);

  // stop_after returns right after the tap: the residual stream is untouched before the MLP.
  DeviceBuffer dy = to_device(xh);
  int calls = 0;
  GpuLayerTaps stop;
  stop.input = [&](LinearGroup, const __half*, int, int) { ++calls; };
  stop.stop_after = LinearGroup::O;
  layer_forward_rows(c, L, gemm, dy.as<__half>(), T, 0, kc.as<__half>(), vc.as<__half>(), b, s, &stop);
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(to_host<uint16_t>(dy.get(), xh.size()), xh);
  cudaStreamDestroy(s);
}

// ---------------------------------------------------------------------------------------
// Mixed precision on the GPU.

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("kestrel_qcuda_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  return d;
}

// test_quantize_mixed.cpp's model and calibration text (the same recipe, its own folder), made
// on first use: a binary without a GPU skips before paying for it.
const test::SampledModel& mixed_model() {
  static const test::SampledModel m = test::sampled_model(KESTREL_TEST_FIXTURES, "mixed_cuda");
  return m;
}

// The options of test_quantize_mixed.cpp's Mixed suite, on `device`.
QuantizeOptions mixed_options(const fs::path& out, const std::string& device) {
  QuantizeOptions o;
  o.model_dir = mixed_model().fp16.string();
  o.calib_file = mixed_model().calib.string();
  o.out_dir = out.string();
  o.gptq.act_order = true;
  o.nsamples = 32;
  o.seqlen = 128;
  o.progress = false;
  o.device = device;
  return o;
}

using kestrel::test::expect_checkpoint_holds;

// A plan's summed loss on a measure: each linear's measured loss at the plan's setting for it.
double plan_loss(const MixedPlanReport& plan, const std::vector<PlannedLinear>& measure) {
  double total = 0;
  for (size_t i = 0; i < plan.linears.size(); ++i) {
    bool found = false;
    for (const auto& [c, pc] : measure.at(i).measured)
      if (c == plan.linears[i].setting) {
        total += pc.error;
        found = true;
      }
    EXPECT_TRUE(found) << plan.linears[i].name;
  }
  return total;
}

// The CPU's and the GPU's plans at one budget: the same setting for every linear, or else a
// near-tie. The GPU measures on fp16 activations and its GPTQ rounds otherwise at near-ties, so
// its losses are the CPU's within a few percent, and a plan such a difference can change is
// one whose alternative costs about as much: each measure must then score the other's plan
// within 3% of its own (the budget being the same, both fit it). Returns the linears whose
// settings differ.
int expect_same_plan_bar_near_ties(const MixedPlanReport& cpu, const MixedPlanReport& gpu) {
  EXPECT_EQ(gpu.budget, cpu.budget);
  EXPECT_LE(gpu.bytes, gpu.budget);
  EXPECT_EQ(gpu.linears.size(), cpu.linears.size());
  if (gpu.linears.size() != cpu.linears.size()) return -1;
  int differ = 0;
  for (size_t i = 0; i < cpu.linears.size(); ++i) {
    EXPECT_EQ(gpu.linears[i].name, cpu.linears[i].name);
    differ += !(gpu.linears[i].setting == cpu.linears[i].setting);
  }
  if (differ > 0) {
    const double cpu_on_gpu_plan = plan_loss(gpu, cpu.linears);
    const double gpu_on_cpu_plan = plan_loss(cpu, gpu.linears);
    std::printf("[ stats    ] %d linears planned otherwise; the CPU's measure scores the GPU's plan "
                "%.4f of its own, the GPU's the CPU's plan %.4f of its own\n",
                differ, cpu_on_gpu_plan / cpu.loss, gpu_on_cpu_plan / gpu.loss);
    EXPECT_LE(cpu_on_gpu_plan, 1.03 * cpu.loss) << "not a near-tie";
    EXPECT_LE(gpu_on_cpu_plan, 1.03 * gpu.loss) << "not a near-tie";
  }
  return differ;
}

// The GPU's measuring pass against the CPU's, a dry run of each at 3.5 bits for each of the
// losses it runs: the same linears with the same candidates and bytes, every loss near the
// CPU's (as each uniform GPU linear's error is near the CPU's: CudaGptqHasTheCpuQuality), and
// the same plan bar near-ties. --device auto measures on the GPU too.
class CudaMixedMeasure : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaMixedMeasure, PlanIsTheCpuPlan) {
  KESTREL_REQUIRE_GPU();
  QuantizeOptions oc = mixed_options({}, "cpu");
  oc.bits_avg = 3.5;
  oc.dry_run = true;
  oc.loss = GetParam();
  QuantizeOptions og = oc;
  og.device = GetParam() == "residual" ? "auto" : "cuda";
  const QuantizeReport rc = quantize_model(oc);
  const QuantizeReport rg = quantize_model(og);
  EXPECT_EQ(rg.device, "cuda");
  ASSERT_TRUE(rc.plan.has_value());
  ASSERT_TRUE(rg.plan.has_value());
  const std::vector<PlannedLinear>& c = rc.plan->linears;
  const std::vector<PlannedLinear>& g = rg.plan->linears;
  ASSERT_EQ(g.size(), 14u);
  ASSERT_EQ(g.size(), c.size());
  double worst = 1.0;
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(g[i].name, c[i].name);
    EXPECT_EQ(g[i].N, c[i].N);
    EXPECT_EQ(g[i].K, c[i].K);
    ASSERT_EQ(g[i].measured.size(), c[i].measured.size()) << c[i].name;
    for (size_t k = 0; k < c[i].measured.size(); ++k) {
      const auto& [cs, cc] = c[i].measured[k];
      const auto& [gs, gc] = g[i].measured[k];
      EXPECT_EQ(gs, cs) << c[i].name;
      EXPECT_EQ(gc.bytes, cc.bytes) << c[i].name;
      ASSERT_GT(cc.error, 0.0) << c[i].name;
      const double ratio = gc.error / cc.error;
      worst = std::max(worst, std::max(ratio, 1.0 / ratio));
      EXPECT_GT(ratio, 0.8) << c[i].name << " " << cs.bits << "g" << cs.group_size;
      EXPECT_LT(ratio, 1.25) << c[i].name << " " << cs.bits << "g" << cs.group_size;
    }
  }
  std::printf("[ stats    ] --loss %s: the GPU's losses within a factor %.4f of the CPU's\n",
              GetParam().c_str(), worst);
  expect_same_plan_bar_near_ties(*rc.plan, *rg.plan);
}

INSTANTIATE_TEST_SUITE_P(Losses, CudaMixedMeasure,
                         ::testing::Values("output", "relative", "residual"),
                         [](const auto& info) { return info.param; });

// --loss kl measures on the CPU only: refused on cuda in one line (auto runs it on the CPU).
TEST(CudaMixed, KlIsRefusedOnCuda) {
  KESTREL_REQUIRE_GPU();
  QuantizeOptions o = mixed_options({}, "cuda");
  o.bits_avg = 3.5;
  o.dry_run = true;
  o.loss = "kl";
  try {
    quantize_model(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--loss kl runs on the CPU only"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  o.device = "auto";
  o.kl_windows = 1;
  o.candidates = {{3, 128}, {4, 128}};  // a cheap measure: only where it runs matters here
  EXPECT_EQ(quantize_model(o).device, "cpu");
}

// The GPU's mixed checkpoint at 3.5 bits against the CPU's, both passes on each device: the
// same plan bar near-ties, every linear quantized at its planned format, and a perplexity on
// the sampled text within a few percent of the CPU's. The two quantizing passes differ as the
// uniform ones do (fp16 Hessians on the GPU), no more.
TEST(CudaMixed, CheckpointHoldsThePlanNearTheCpusPerplexity) {
  KESTREL_REQUIRE_GPU();
  const fs::path gpu_dir = temp_dir("mixed_gpu"), cpu_dir = temp_dir("mixed_cpu");
  QuantizeOptions og = mixed_options(gpu_dir, "cuda"), oc = mixed_options(cpu_dir, "cpu");
  og.bits_avg = oc.bits_avg = 3.5;
  const QuantizeReport rg = quantize_model(og);
  const QuantizeReport rc = quantize_model(oc);
  ASSERT_TRUE(rg.plan.has_value());
  ASSERT_TRUE(rc.plan.has_value());
  EXPECT_EQ(rg.device, "cuda");
  ASSERT_EQ(rg.plan->linears.size(), 14u);
  std::set<QuantSetting> settings;
  for (const PlannedLinear& l : rg.plan->linears) settings.insert(l.setting);
  EXPECT_GE(settings.size(), 2u) << "the plan should mix formats at 3.5 bits";
  expect_same_plan_bar_near_ties(*rc.plan, *rg.plan);
  expect_checkpoint_holds(gpu_dir, *rg.plan);
  // Every linear was quantized, in the CPU's order.
  ASSERT_EQ(rg.linears.size(), rc.linears.size());
  for (size_t i = 0; i < rg.linears.size(); ++i) {
    EXPECT_EQ(rg.linears[i].name, rc.linears[i].name);
    EXPECT_GT(rg.linears[i].rel_error, 0.0) << rg.linears[i].name;
    EXPECT_TRUE(std::isfinite(rg.linears[i].rel_error)) << rg.linears[i].name;
  }
  const std::vector<int>& text = mixed_model().sampled;
  const double p16 = test::perplexity_of(mixed_model().fp16, text);
  const double pg = test::perplexity_of(gpu_dir, text), pc = test::perplexity_of(cpu_dir, text);
  std::printf("[ stats    ] perplexity: FP16 %.4f, CPU mixed %.4f, GPU mixed %.4f\n", p16, pc, pg);
  EXPECT_GT(pg, p16);
  // Other calibration windows (another --seed) move the CPU's own perplexity here by a few
  // percent: the GPU's fp16 Hessians may move it as far, not further.
  EXPECT_LT(std::abs(pg - pc), 0.05 * pc) << p16 << " " << pc << " " << pg;
  fs::remove_all(gpu_dir);
  fs::remove_all(cpu_dir);
}

// A plan of one candidate on the GPU writes exactly the GPU's uniform checkpoint: the planned
// options reach every linear, and nothing else changes.
TEST(CudaMixed, OneCandidatePlanIsTheUniformCheckpoint) {
  KESTREL_REQUIRE_GPU();
  const fs::path mixed = temp_dir("one_mixed"), uniform = temp_dir("one_uniform");
  QuantizeOptions om = mixed_options(mixed, "cuda");
  om.bits_avg = 8;
  om.candidates = {{3, 64}};
  const QuantizeReport r = quantize_model(om);
  EXPECT_TRUE(r.plan->rules.empty());
  QuantizeOptions ou = mixed_options(uniform, "cuda");
  ou.gptq.bits = 3;
  ou.gptq.group_size = 64;
  quantize_model(ou);
  kestrel::test::expect_same_tensors(mixed, uniform);
  fs::remove_all(mixed);
  fs::remove_all(uniform);
}

}  // namespace
}  // namespace kestrel
