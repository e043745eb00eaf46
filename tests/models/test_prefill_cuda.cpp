// The prefill path on the GPU against the CPU references:
//   Dequant      dequantize_f16 equals dequantize_ref rounded to fp16, bit for bit, every format
//   QuantGemm    the many-row linear (dequantize + cuBLASLt, and the GEMV crossover) against
//                gptq::matmul_ref for 1 .. 2048 rows, every bit width, act-order, asym, residual
//   RopeRows     RoPE + KV write of a chunk against rope_ref, and bitwise equal to the decode
//                kernel run token by token (the decode that follows a prefill reads those rows);
//                the first position by value and from device memory give the same bits
//   AttnPrefill  causal tensor-core attention of a chunk over a partly filled cache against
//                attention_ref query by query (GQA, head_dim 64 / 128, sliding window); the
//                first position by value and from device memory give the same bits
//   Nll          per-row log-softmax at the target against a host computation in double
//   Prefill      whole models: chunked prefill then decode equals token-by-token decode (and
//                the CPU engine), greedy tokens identical
//
// Tolerances. Linear: the reference accumulates exact fp32 products of the fp16 inputs; the GPU
// rounds the dequantized weight to fp16 (2^-11 relative at most, ~3e-4 rms, averaging down over
// K) and the output to fp16 (~3e-4 rms); 2e-3 on ||y - ref|| / ||ref|| leaves margin while a
// wrong code, group, zero or permutation gives 1e-2 .. 1. Attention: the probabilities enter the
// P V product rounded to fp16 (2^-11 relative each) and the output is rounded to fp16: a few 1e-4
// rms; 3e-3 catches any mask or indexing error (which moves whole rows). Models: see Prefill.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "base/device.h"
#include "base/dtype.h"
#include "models/io/model_spec.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/nll_cuda.h"
#include "kernels/gptq/gptq_format.h"
#include "kernels/rope/rope.h"
#include "kernels/rope/rope_cuda.h"
#include "kernels/rope/rope_rows_cuda.h"
#include "models/cpu/decoder.h"
#include "models/gpu/decoder.h"
#include "tests/support/compare.h"
#include "tests/support/device_data.h"
#include "tests/support/synth_model.h"

namespace fs = std::filesystem;

namespace kestrel {
namespace {

using cuda::DeviceBuffer;


using kestrel::test::rel_err;
using kestrel::test::to_floats;

// Random fp16 values (as bits) and their float values.
std::vector<uint16_t> random_halves(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> h(n);
  for (auto& v : h) v = float_to_half(d(rng));
  return h;
}

DeviceBuffer upload(const void* p, size_t bytes) {
  DeviceBuffer b(bytes);
  KESTREL_CUDA_CHECK(cudaMemcpy(b.get(), p, bytes, cudaMemcpyHostToDevice));
  return b;
}
template <class T>
std::vector<T> download(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// ---- Random GPTQ linears -------------------------------------------------------------------

struct Format {
  int bits, group_size;  // group -1 = per row
  bool act_order, asym;
  int zero_offset;
  int64_t N, K;
};

std::string describe(const Format& f) {
  return "bits=" + std::to_string(f.bits) + " group=" + std::to_string(f.group_size) +
         (f.act_order ? " act-order" : "") + (f.asym ? " asym" : " sym") +
         " zero_offset=" + std::to_string(f.zero_offset) + " N=" + std::to_string(f.N) +
         " K=" + std::to_string(f.K);
}

struct RandomGptq {
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
  std::vector<int32_t> g_idx, perm;  // perm: the K order of the repacked weight
  gptq::GptqView view;

  RandomGptq(const Format& f, uint32_t seed) {
    std::mt19937 rng(seed);
    const int64_t N = f.N, K = f.K;
    const int64_t G = f.group_size > 0 ? (K + f.group_size - 1) / f.group_size : 1;
    std::uniform_int_distribution<int> code(0, (1 << f.bits) - 1);
    std::vector<uint8_t> q(N * K), z(G * N);
    for (auto& c : q) c = (uint8_t)code(rng);
    std::uniform_int_distribution<int> zd(0, (1 << f.bits) - 2);
    for (auto& v : z) v = (uint8_t)(f.asym ? zd(rng) : (1 << (f.bits - 1)) - f.zero_offset);
    std::uniform_real_distribution<float> sd(0.004f, 0.02f);
    scales.resize(G * N);
    for (auto& s : scales) s = float_to_half(sd(rng));
    qweight = gptq::pack_qweight(q, N, K, f.bits);
    qzeros = gptq::pack_qzeros(z, G, N, f.bits);
    perm.resize(K);
    std::iota(perm.begin(), perm.end(), 0);
    if (f.act_order) {
      std::vector<int32_t> order(K);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      g_idx = gptq::act_order_g_idx(order, f.group_size);
      // The repack sorts K by group, stably: the same order here.
      std::stable_sort(perm.begin(), perm.end(), [&](int a, int b) { return g_idx[a] < g_idx[b]; });
    }
    view.bits = f.bits;
    view.group_size = f.group_size;
    view.K = K;
    view.N = N;
    view.zero_offset = f.zero_offset;
    view.qweight = qweight.data();
    view.qzeros = qzeros.data();
    view.scales = scales.data();
    view.g_idx = g_idx.empty() ? nullptr : g_idx.data();
  }
};

const std::vector<Format> kFormats = {
    {4, 128, false, false, 1, 264, 512}, {4, 128, true, false, 1, 264, 512},
    {4, 32, false, true, 0, 136, 320},   {3, 128, true, false, 1, 224, 384},
    {3, 64, false, true, 1, 224, 320},   {2, 64, false, false, 1, 128, 256},
    {2, 32, true, true, 0, 96, 384},     {8, -1, false, false, 1, 192, 200},
    {8, 128, true, false, 1, 256, 512},
};

class GemmFormats : public ::testing::TestWithParam<Format> {};

TEST_P(GemmFormats, DequantizeMatchesReferenceBitForBit) {
  KESTREL_REQUIRE_GPU();
  const Format f = GetParam();
  RandomGptq g(f, 7);
  cuda::GemvWeight w = cuda::gemv_prepare({g.view}, nullptr);
  std::vector<float> ref(f.N * f.K);
  gptq::dequantize_ref(g.view, ref.data());
  DeviceBuffer out(f.N * f.K * 2);
  KESTREL_CUDA_CHECK(cudaMemset(out.get(), 0xFF, f.N * f.K * 2));  // NaN poison
  cuda::dequantize_f16(w, out.as<__half>(), f.N * f.K, nullptr);
  const std::vector<uint16_t> got = download<uint16_t>(out, f.N * f.K);
  int64_t bad = 0;
  for (int64_t n = 0; n < f.N; ++n)
    for (int64_t j = 0; j < f.K; ++j)
      bad += got[n * f.K + j] != float_to_half(ref[n * f.K + g.perm[j]]);
  EXPECT_EQ(bad, 0) << describe(f);
  cuda::gemv_free(w);
}

TEST_P(GemmFormats, ManyRowLinearMatchesReference) {
  KESTREL_REQUIRE_GPU();
  const Format f = GetParam();
  RandomGptq g(f, 11);
  cuda::GemvWeight w = cuda::gemv_prepare({g.view}, nullptr);
  cuda::GemmRunner runner;
  std::mt19937 rng(5);
  for (int M : {1, 3, 7, 8, 9, 17, 64, 129, 511, 2048}) {
    const std::vector<uint16_t> xh = random_halves((size_t)M * f.K, 1.0f, rng);
    const std::vector<uint16_t> rh = random_halves((size_t)M * f.N, 1.0f, rng);
    const std::vector<float> x = to_floats(xh), res = to_floats(rh);
    std::vector<float> ref((size_t)M * f.N);
    gptq::matmul_ref(g.view, x.data(), M, ref.data());
    std::vector<float> ref_res(ref);
    for (size_t i = 0; i < ref.size(); ++i) ref_res[i] += res[i];

    DeviceBuffer dx = upload(xh.data(), xh.size() * 2);
    DeviceBuffer scratch(cuda::quant_gemm_scratch_elems(w, M) * 2);
    for (int path = 0; path < 3; ++path) {  // crossover launcher, forced GEMM, with residual
      DeviceBuffer dy = upload(rh.data(), rh.size() * 2);
      if (path == 0)
        cuda::quant_linear_rows(runner, w, dx.as<__half>(), M, dy.as<__half>(), nullptr,
                                scratch.as<__half>(), nullptr);
      else if (path == 1)
        cuda::quant_gemm(runner, w, dx.as<__half>(), M, dy.as<__half>(), nullptr,
                         scratch.as<__half>(), nullptr);
      else
        cuda::quant_linear_rows(runner, w, dx.as<__half>(), M, dy.as<__half>(), dy.as<__half>(),
                                scratch.as<__half>(), nullptr);
      const std::vector<float> y = to_floats(download<uint16_t>(dy, (size_t)M * f.N));
      EXPECT_LT(rel_err(y, path == 2 ? ref_res : ref), 2e-3)
          << describe(f) << " M=" << M << " path=" << path;
    }
  }
  cuda::gemv_free(w);
}

INSTANTIATE_TEST_SUITE_P(Formats, GemmFormats, ::testing::ValuesIn(kFormats));

// A weight larger than one dequantized slice (cuda::kDequantSliceHalves) runs as several
// dequantize + GEMM slices writing column slices of y: the last one partial, with act-order's
// gathered input, asymmetric zero points, 3-bit planes and a residual aliasing y.
TEST(GemmSlices, WeightLargerThanOneSliceMatchesReference) {
  KESTREL_REQUIRE_GPU();
  // N = 8416 = 2 x 4096 + 224 (a multiple of 32, as 3-bit qzeros rows need).
  for (const Format f :
       {Format{4, 128, true, true, 0, 8416, 4096}, Format{3, 64, false, true, 1, 8416, 4096}}) {
    RandomGptq g(f, 13);
    cuda::GemvWeight w = cuda::gemv_prepare({g.view}, nullptr);
    ASSERT_EQ(cuda::dequant_slice_rows(w), 4096) << "the case must span three slices";
    cuda::GemmRunner runner;
    std::mt19937 rng(6);
    const int M = 17;
    const std::vector<uint16_t> xh = random_halves((size_t)M * f.K, 1.0f, rng);
    const std::vector<uint16_t> rh = random_halves((size_t)M * f.N, 1.0f, rng);
    const std::vector<float> x = to_floats(xh), res = to_floats(rh);
    std::vector<float> ref((size_t)M * f.N);
    gptq::matmul_ref(g.view, x.data(), M, ref.data());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += res[i];
    DeviceBuffer dx = upload(xh.data(), xh.size() * 2);
    DeviceBuffer dy = upload(rh.data(), rh.size() * 2);
    DeviceBuffer scratch(cuda::quant_gemm_scratch_elems(w, M) * 2);
    EXPECT_LT(cuda::quant_gemm_scratch_elems(w, M), (size_t)f.N * f.K / 2);
    cuda::quant_gemm(runner, w, dx.as<__half>(), M, dy.as<__half>(), dy.as<__half>(),
                     scratch.as<__half>(), nullptr);
    const std::vector<float> y = to_floats(download<uint16_t>(dy, (size_t)M * f.N));
    EXPECT_LT(rel_err(y, ref), 2e-3) << describe(f);

    // A runner with smaller slices (1 MiB: 128 rows, 66 slices) and no cuBLASLt workspace
    // computes the same thing: each output column's dot product is the same GEMM's.
    cuda::GemmMemory small;
    small.slice_halves = size_t(1) << 19;
    small.workspace_bytes = 0;
    cuda::GemmRunner small_runner(small);
    ASSERT_EQ(cuda::dequant_slice_rows(w, small.slice_halves), 128);
    DeviceBuffer small_scratch(cuda::quant_gemm_scratch_elems(w, M, small.slice_halves) * 2);
    DeviceBuffer dy2 = upload(rh.data(), rh.size() * 2);
    cuda::quant_gemm(small_runner, w, dx.as<__half>(), M, dy2.as<__half>(), dy2.as<__half>(),
                     small_scratch.as<__half>(), nullptr);
    const std::vector<float> y2 = to_floats(download<uint16_t>(dy2, (size_t)M * f.N));
    EXPECT_LT(rel_err(y2, ref), 2e-3) << describe(f) << ", 1 MiB slices, no workspace";
    cuda::gemv_free(w);
  }
}

TEST(DenseLinear, ManyRowsMatchReference) {
  KESTREL_REQUIRE_GPU();
  std::mt19937 rng(3);
  const int64_t N = 328, K = 264;
  const std::vector<uint16_t> wh = random_halves(N * K, 0.05f, rng);
  const std::vector<float> wf = to_floats(wh);
  DeviceBuffer dw = upload(wh.data(), wh.size() * 2);
  cuda::GemmRunner runner;
  for (int M : {1, 5, 8, 33, 300}) {
    const std::vector<uint16_t> xh = random_halves(M * K, 1.0f, rng);
    const std::vector<float> x = to_floats(xh);
    std::vector<float> ref(M * N, 0.0f);
    for (int m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * wf[n * K + k];
        ref[m * N + n] = acc;
      }
    DeviceBuffer dx = upload(xh.data(), xh.size() * 2), dy(M * N * 2);
    cuda::dense_linear_rows(runner, dw.as<__half>(), N, K, dx.as<__half>(), M, dy.as<__half>(),
                            nullptr, nullptr);
    EXPECT_LT(rel_err(to_floats(download<uint16_t>(dy, M * N)), ref), 2e-3) << "M=" << M;
    DeviceBuffer df(M * N * 4);
    runner.gemm_f32(dx.as<__half>(), dw.as<__half>(), M, N, K, df.as<float>(), nullptr);
    EXPECT_LT(rel_err(download<float>(df, M * N), ref), 1e-5) << "fp32 out, M=" << M;
  }
}

// ---- RoPE + KV write for a chunk -------------------------------------------------------------

TEST(RopeRows, MatchesReferenceAndDecodeKernel) {
  KESTREL_REQUIRE_GPU();
  const int H = 4, KVH = 2, D = 64, T = 37, pos0 = 21, ctx = 96;
  const int kv_dim = KVH * D, qkv_n = (H + 2 * KVH) * D, stride = qkv_n + 8;
  const float theta = 10000.0f, factor = 2.0f;
  std::mt19937 rng(9);
  const std::vector<uint16_t> qkv = random_halves((size_t)T * stride, 1.0f, rng);

  DeviceBuffer d_rows = upload(qkv.data(), qkv.size() * 2);
  DeviceBuffer kc(ctx * kv_dim * 2), vc(ctx * kv_dim * 2);
  KESTREL_CUDA_CHECK(cudaMemset(kc.get(), 0, ctx * kv_dim * 2));
  KESTREL_CUDA_CHECK(cudaMemset(vc.get(), 0, ctx * kv_dim * 2));
  cuda::rope_kv_write_rows_f16(d_rows.as<__half>(), stride, T, pos0, kc.as<__half>(),
                               vc.as<__half>(), H, KVH, D, RopeScaling{theta, factor}, nullptr);
  const std::vector<uint16_t> rows = download<uint16_t>(d_rows, qkv.size());
  const std::vector<uint16_t> kcache = download<uint16_t>(kc, ctx * kv_dim);
  const std::vector<uint16_t> vcache = download<uint16_t>(vc, ctx * kv_dim);

  // The first position read on the device (a captured verify pass; the host's pos0 then
  // unused): bitwise the same rows and cache.
  {
    DeviceBuffer rows2 = upload(qkv.data(), qkv.size() * 2);
    DeviceBuffer kc3(ctx * kv_dim * 2), vc3(ctx * kv_dim * 2), dpos0 = upload(&pos0, sizeof(int));
    KESTREL_CUDA_CHECK(cudaMemset(kc3.get(), 0, ctx * kv_dim * 2));
    KESTREL_CUDA_CHECK(cudaMemset(vc3.get(), 0, ctx * kv_dim * 2));
    cuda::rope_kv_write_rows_f16(rows2.as<__half>(), stride, T, /*pos0=*/0, kc3.as<__half>(),
                                 vc3.as<__half>(), H, KVH, D, RopeScaling{theta, factor}, nullptr,
                                 dpos0.as<int>());
    EXPECT_EQ(download<uint16_t>(rows2, qkv.size()), rows) << "device pos0: rotated rows";
    EXPECT_EQ(download<uint16_t>(kc3, ctx * kv_dim), kcache) << "device pos0: K cache";
    EXPECT_EQ(download<uint16_t>(vc3, ctx * kv_dim), vcache) << "device pos0: V cache";
  }

  // The decode kernel, one token at a time, into its own cache.
  DeviceBuffer kc2(ctx * kv_dim * 2), vc2(ctx * kv_dim * 2), dpos(sizeof(int));
  KESTREL_CUDA_CHECK(cudaMemset(kc2.get(), 0, ctx * kv_dim * 2));
  KESTREL_CUDA_CHECK(cudaMemset(vc2.get(), 0, ctx * kv_dim * 2));
  std::vector<uint16_t> dec_rows(qkv);
  for (int t = 0; t < T; ++t) {
    const int pos = pos0 + t;
    DeviceBuffer one = upload(qkv.data() + (size_t)t * stride, qkv_n * 2);
    KESTREL_CUDA_CHECK(cudaMemcpy(dpos.get(), &pos, sizeof(int), cudaMemcpyHostToDevice));
    cuda::rope_kv_write_f16(one.as<__half>(), kc2.as<__half>(), vc2.as<__half>(), dpos.as<int>(),
                            H, KVH, D, RopeScaling{theta, factor}, nullptr);
    const std::vector<uint16_t> r = download<uint16_t>(one, qkv_n);
    std::copy(r.begin(), r.end(), dec_rows.begin() + (size_t)t * stride);
  }
  EXPECT_EQ(rows, dec_rows) << "rotated q|k|v rows differ from the decode kernel's";
  EXPECT_EQ(kcache, download<uint16_t>(kc2, ctx * kv_dim));
  EXPECT_EQ(vcache, download<uint16_t>(vc2, ctx * kv_dim));

  double worst = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<float> q(qkv_n);
    for (int i = 0; i < qkv_n; ++i) q[i] = half_to_float(qkv[(size_t)t * stride + i]);
    rope_ref(q.data(), H, D, pos0 + t, theta, factor);
    rope_ref(q.data() + H * D, KVH, D, pos0 + t, theta, factor);
    for (int i = 0; i < qkv_n; ++i) {
      const float got = half_to_float(rows[(size_t)t * stride + i]);
      worst = std::max(worst, (double)std::fabs(got - q[i]) / (1.0 + std::fabs(q[i])));
    }
    for (int i = 0; i < kv_dim; ++i) {
      EXPECT_EQ(kcache[(size_t)(pos0 + t) * kv_dim + i], rows[(size_t)t * stride + H * D + i]);
      EXPECT_EQ(vcache[(size_t)(pos0 + t) * kv_dim + i], qkv[(size_t)t * stride + (H + KVH) * D + i]);
    }
  }
  EXPECT_LT(worst, 2e-3);  // one fp16 rounding of values of order 1
  // Rows outside the chunk untouched.
  for (int p = 0; p < ctx; ++p) {
    if (p >= pos0 && p < pos0 + T) continue;
    for (int i = 0; i < kv_dim; ++i) ASSERT_EQ(kcache[(size_t)p * kv_dim + i], 0) << "row " << p;
  }
  // The pad columns past q|k|v stay as they were.
  for (int t = 0; t < T; ++t)
    for (int i = qkv_n; i < stride; ++i) EXPECT_EQ(rows[(size_t)t * stride + i], qkv[(size_t)t * stride + i]);
}

// ---- Prefill attention -----------------------------------------------------------------------

struct AttnCase {
  int H, KVH, D, pos0, T, window;
};

class AttnPrefill : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttnPrefill, MatchesReferenceQueryByQuery) {
  KESTREL_REQUIRE_GPU();
  const AttnCase a = GetParam();
  const int kv_dim = a.KVH * a.D, q_dim = a.H * a.D;
  const int stride = q_dim + 2 * kv_dim;  // the fused qkv rows
  const int ctx = a.pos0 + a.T + 70;
  std::mt19937 rng(a.pos0 * 131 + a.T);
  const std::vector<uint16_t> q = random_halves((size_t)a.T * stride, 1.0f, rng);
  std::vector<uint16_t> k = random_halves((size_t)ctx * kv_dim, 1.0f, rng);
  std::vector<uint16_t> v = random_halves((size_t)ctx * kv_dim, 1.0f, rng);
  // Rows past the chunk are NaN: reading one would poison the output.
  for (size_t i = (size_t)(a.pos0 + a.T) * kv_dim; i < k.size(); ++i) k[i] = v[i] = 0x7E00;
  DeviceBuffer dq = upload(q.data(), q.size() * 2), dk = upload(k.data(), k.size() * 2),
               dv = upload(v.data(), v.size() * 2), dout((size_t)a.T * q_dim * 2);

  const std::vector<float> kf = to_floats(k), vf = to_floats(v);
  std::vector<float> ref((size_t)a.T * q_dim);
  for (int t = 0; t < a.T; ++t) {
    const int pos = a.pos0 + t;
    const int first = a.window > 0 ? std::max(0, pos + 1 - a.window) : 0;
    std::vector<float> qt(q_dim);
    for (int i = 0; i < q_dim; ++i) qt[i] = half_to_float(q[(size_t)t * stride + i]);
    attention_ref(qt.data(), kf.data() + (size_t)first * kv_dim, vf.data() + (size_t)first * kv_dim,
                  a.H, a.KVH, a.D, pos - first + 1, ref.data() + (size_t)t * q_dim);
  }
  for (auto kernel : {cuda::PrefillAttnKernel::Mma, cuda::PrefillAttnKernel::Wmma}) {
    const char* name = kernel == cuda::PrefillAttnKernel::Mma ? "mma" : "wmma";
    KESTREL_CUDA_CHECK(cudaMemset(dout.get(), 0xFF, (size_t)a.T * q_dim * 2));  // NaN poison
    cuda::attention_prefill_f16(dq.as<__half>(), stride, dk.as<__half>(), dv.as<__half>(), a.pos0,
                                a.T, a.window, a.H, a.KVH, a.D, dout.as<__half>(), nullptr, kernel);
    const std::vector<uint16_t> got_bits = download<uint16_t>(dout, (size_t)a.T * q_dim);
    const std::vector<float> got = to_floats(got_bits);
    EXPECT_LT(rel_err(got, ref), 3e-3) << name;
    // The first position read on the device (a captured verify pass; the host's pos0 then
    // unused): bitwise the same output.
    DeviceBuffer dpos0 = upload(&a.pos0, sizeof(int));
    KESTREL_CUDA_CHECK(cudaMemset(dout.get(), 0xFF, (size_t)a.T * q_dim * 2));
    cuda::attention_prefill_f16(dq.as<__half>(), stride, dk.as<__half>(), dv.as<__half>(),
                                /*pos0=*/0, a.T, a.window, a.H, a.KVH, a.D, dout.as<__half>(),
                                nullptr, kernel, dpos0.as<int>());
    EXPECT_EQ(download<uint16_t>(dout, (size_t)a.T * q_dim), got_bits) << name << ", device pos0";
    // Row by row too: a wrong mask on a single query must not hide in the norm of the chunk.
    for (int t = 0; t < a.T; ++t) {
      std::vector<float> g(got.begin() + (size_t)t * q_dim, got.begin() + (size_t)(t + 1) * q_dim);
      std::vector<float> r(ref.begin() + (size_t)t * q_dim, ref.begin() + (size_t)(t + 1) * q_dim);
      ASSERT_LT(rel_err(g, r), 1e-2) << name << " query " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttnPrefill,
    ::testing::Values(AttnCase{4, 2, 64, 0, 1, 0}, AttnCase{4, 2, 64, 0, 64, 0},
                      AttnCase{4, 2, 64, 37, 100, 0}, AttnCase{6, 2, 64, 0, 333, 0},
                      AttnCase{8, 1, 128, 130, 200, 0}, AttnCase{2, 2, 128, 0, 129, 0},
                      AttnCase{4, 4, 128, 500, 7, 0}, AttnCase{4, 2, 64, 20, 150, 50},
                      AttnCase{4, 1, 128, 300, 90, 64}));

// ---- NLL -------------------------------------------------------------------------------------

TEST(Nll, MatchesHostLogSoftmax) {
  KESTREL_REQUIRE_GPU();
  const int rows = 37, vocab = 5003;
  std::mt19937 rng(4);
  std::normal_distribution<float> d(0.0f, 4.0f);
  std::vector<float> logits((size_t)rows * vocab);
  for (auto& l : logits) l = d(rng) + 30.0f;  // an offset that would overflow a naive exp sum
  std::vector<int> targets(rows);
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  for (auto& t : targets) t = tok(rng);
  targets[5] = -1;
  DeviceBuffer dl = upload(logits.data(), logits.size() * 4), dt = upload(targets.data(), rows * 4),
               dn(rows * 4);
  cuda::nll_rows_f32(dl.as<float>(), dt.as<int>(), rows, vocab, dn.as<float>(), nullptr);
  const std::vector<float> nll = download<float>(dn, rows);
  for (int r = 0; r < rows; ++r) {
    if (targets[r] < 0) {
      EXPECT_EQ(nll[r], 0.0f);
      continue;
    }
    const float* l = &logits[(size_t)r * vocab];
    double mx = *std::max_element(l, l + vocab), s = 0;
    for (int i = 0; i < vocab; ++i) s += std::exp((double)l[i] - mx);
    EXPECT_NEAR(nll[r], std::log(s) + mx - l[targets[r]], 1e-4) << "row " << r;
  }
}

// ---- Whole models ----------------------------------------------------------------------------
//
// Chunked prefill then decode against the decode graph run token by token over the same tokens.
// Both keep activations and the KV cache in FP16 with FP32 accumulation but round at different
// places (GEMM vs GEMV partial sums, FP32 vs FP16 logits), so logits agree to the few 1e-3
// relative that test_decoder_cuda allows against the CPU engine; 2e-2 leaves the same margin and a
// wrong cache row, mask or chunk offset gives errors of order 1. Greedy tokens must match exactly.

using ModelCase = kestrel::test::ModelFormat;

class Prefill : public ::testing::TestWithParam<ModelCase> {};

int argmax_of(const float* v, int n) { return (int)(std::max_element(v, v + n) - v); }

// The chunks here run dequantize + cuBLASLt (the fused small-M GEMM off: chunks of 64 would
// take it by default; SmallGemmPassesMatchTheCpu below runs the same chunks through it).
DecodeTuning without_small_gemm() {
  DecodeTuning t;
  t.small_gemm_max_rows = 0;
  return t;
}

TEST_P(Prefill, ChunkedPrefillThenDecodeEqualsTokenByToken) {
  KESTREL_REQUIRE_GPU();
  const ModelCase& c = GetParam();
  const fs::path dir = kestrel::test::write_tiny_model(c, /*seed=*/21);

  const ModelSpec spec = load_model_spec(dir.string());
  const int vocab = spec.config.vocab, ctx = 256, n_prompt = 150, steps = 24;
  DecoderCuda chunked_model(spec, true, without_small_gemm()), stepwise_model(spec, true);
  auto chunked = chunked_model.new_cuda_session(ctx);
  auto stepwise = stepwise_model.new_cuda_session(ctx);
  chunked_model.set_prefill_chunk(64);  // chunks of 64, 64, 22: crosses two boundaries
  DecoderCpu cpu_model(spec);
  auto cpu = cpu_model.new_cpu_session(ctx);

  std::mt19937 rng(17);
  std::uniform_int_distribution<int> tok(3, vocab - 1);
  std::vector<int> prompt(n_prompt);
  for (int& t : prompt) t = tok(rng);

  std::vector<float> all((size_t)n_prompt * vocab), last(vocab), step(vocab);
  chunked->forward(prompt.data(), n_prompt, 0, last.data(), all.data());
  std::vector<float> cpu_all((size_t)n_prompt * vocab), cpu_last(vocab);
  cpu->forward(prompt.data(), n_prompt, 0, cpu_last.data(), cpu_all.data());
  double worst = 0, worst_cpu = 0;
  for (int i = 0; i < n_prompt; ++i) {
    stepwise->forward(&prompt[i], 1, i, step.data(), nullptr);
    const std::vector<float> row(all.begin() + (size_t)i * vocab, all.begin() + (size_t)(i + 1) * vocab);
    const std::vector<float> crow(cpu_all.begin() + (size_t)i * vocab, cpu_all.begin() + (size_t)(i + 1) * vocab);
    worst = std::max(worst, rel_err(row, step));
    worst_cpu = std::max(worst_cpu, rel_err(row, crow));
    // At random prompt positions the top two logits can be a near tie that the decode path's
    // FP16 logits (spacing 2^-7 at |logit| ~ 10) cannot order. A different pick must be such a
    // tie: within the error the row comparison above allows (2e-2 of the logits' rms).
    const int ap = argmax_of(row.data(), vocab), as = argmax_of(step.data(), vocab);
    if (ap != as) {
      double ms = 0;
      for (float v : step) ms += (double)v * v;
      const double tol = 2e-2 * std::sqrt(ms / vocab);
      EXPECT_LT(step[as] - step[ap], tol) << "prompt position " << i << ": prefill picks " << ap << ", decode " << as;
      EXPECT_LT(row[ap] - row[as], tol) << "prompt position " << i << ": prefill picks " << ap << ", decode " << as;
    }
  }
  EXPECT_LT(worst, 2e-2) << "prefill vs token-by-token logits, worst row";
  EXPECT_LT(worst_cpu, 2e-2) << "prefill vs CPU engine logits, worst row";
  EXPECT_EQ(last, std::vector<float>(all.end() - vocab, all.end()));

  // Greedy decode from both caches: close logits at every step, and the same greedy token
  // unless the top two are a near tie (as above); both then continue with the prefilled
  // engine's token, so that a tie does not end the comparison.
  int a = argmax_of(last.data(), vocab), b = argmax_of(step.data(), vocab);
  ASSERT_EQ(a, b);
  std::vector<float> la(vocab), lb(vocab);
  int ties = 0;
  for (int i = 0; i < steps; ++i) {
    const int pos = n_prompt + i;
    chunked->forward(&a, 1, pos, la.data(), nullptr);
    stepwise->forward(&a, 1, pos, lb.data(), nullptr);
    EXPECT_LT(rel_err(la, lb), 2e-2) << "decode step " << i;
    const int na = argmax_of(la.data(), vocab), nb = argmax_of(lb.data(), vocab);
    if (na != nb) {
      ++ties;
      double ms = 0;
      for (float v : lb) ms += (double)v * v;
      const double tol = 2e-2 * std::sqrt(ms / vocab);
      EXPECT_LT(lb[nb] - lb[na], tol) << "decode step " << i << ": " << na << " vs " << nb;
      EXPECT_LT(la[na] - la[nb], tol) << "decode step " << i << ": " << na << " vs " << nb;
    }
    a = na;
  }
  EXPECT_LE(ties, 2) << "near ties are rare; many mean the caches differ";

  // The NLL head agrees with a log-softmax of the same engine's logits.
  std::vector<int> targets(n_prompt);
  for (int i = 0; i < n_prompt; ++i) targets[i] = i + 1 < n_prompt ? prompt[i + 1] : -1;
  std::vector<double> nll(n_prompt);
  chunked->forward_nll(prompt.data(), n_prompt, 0, targets.data(), nll.data());
  for (int i = 0; i + 1 < n_prompt; ++i) {
    const float* l = &all[(size_t)i * vocab];
    double mx = *std::max_element(l, l + vocab), s = 0;
    for (int j = 0; j < vocab; ++j) s += std::exp((double)l[j] - mx);
    ASSERT_NEAR(nll[i], std::log(s) + mx - l[targets[i]], 1e-3) << "position " << i;
  }
  EXPECT_EQ(nll[n_prompt - 1], 0.0f);

  // A short prompt (below the GEMM crossover, and with the fused GEMM off: batch-1 GEMVs per
  // row) at a later position.
  std::vector<float> short_last(vocab);
  chunked->forward(prompt.data(), 5, 100, short_last.data(), nullptr);
  for (int i = 0; i < 5; ++i) stepwise->forward(&prompt[i], 1, 100 + i, step.data(), nullptr);
  EXPECT_LT(rel_err(short_last, step), 2e-2);
  fs::remove_all(dir);
}

// The fused small-M GEMM in the model (DecodeTuning::small_gemm_max_rows): a prompt in chunks
// of 64, 64 and 22 tokens and passes of 3 to 9 tokens at later positions (speculative
// verification's size) run every quantized linear through it. Its logits agree with the CPU
// engine as closely as the unfused path's do (2e-2 of the rms; a wrong tile or token column
// gives errors of order 1), and the cache it writes serves the decode step after it.
TEST_P(Prefill, SmallGemmPassesMatchTheCpu) {
  KESTREL_REQUIRE_GPU();
  const ModelCase& c = GetParam();
  const fs::path dir = kestrel::test::write_tiny_model(c, /*seed=*/23);
  const ModelSpec spec = load_model_spec(dir.string());
  const int vocab = spec.config.vocab, ctx = 256, n_prompt = 150;
  DecodeTuning tuning;
  tuning.small_gemm_max_rows = 64;
  DecoderCuda gpu_model(spec, true, tuning);
  gpu_model.set_prefill_chunk(64);
  auto gpu = gpu_model.new_cuda_session(ctx);
  DecoderCpu cpu_model(spec);
  auto cpu = cpu_model.new_cpu_session(ctx);

  std::mt19937 rng(29);
  std::uniform_int_distribution<int> tok(3, vocab - 1);
  std::vector<int> prompt(n_prompt + 40);
  for (int& t : prompt) t = tok(rng);
  std::vector<float> all((size_t)n_prompt * vocab), cpu_all((size_t)n_prompt * vocab), last(vocab),
      cpu_last(vocab);
  gpu->forward(prompt.data(), n_prompt, 0, last.data(), all.data());
  cpu->forward(prompt.data(), n_prompt, 0, cpu_last.data(), cpu_all.data());
  double worst = 0;
  for (int i = 0; i < n_prompt; ++i) {
    const std::vector<float> row(all.begin() + (size_t)i * vocab, all.begin() + (size_t)(i + 1) * vocab);
    const std::vector<float> crow(cpu_all.begin() + (size_t)i * vocab,
                                  cpu_all.begin() + (size_t)(i + 1) * vocab);
    worst = std::max(worst, rel_err(row, crow));
  }
  EXPECT_LT(worst, 2e-2) << "chunks of 64 through the fused GEMM vs the CPU engine, worst row";

  // The fused path was taken: the path without it (GEMVs, dequantize + cuBLASLt) sums in
  // another order, so a quantized model's logits differ from it in some bits; with only fp16
  // linears nothing changes.
  {
    DecoderCuda unfused_model(spec, true, without_small_gemm());
    unfused_model.set_prefill_chunk(64);
    auto d = unfused_model.new_cuda_session(ctx);
    std::vector<float> d_all((size_t)n_prompt * vocab), d_last(vocab);
    d->forward(prompt.data(), n_prompt, 0, d_last.data(), d_all.data());
    if (c.dtype == "fp16")
      EXPECT_EQ(all, d_all) << "no quantized linear: the same kernels as without the fused GEMM";
    else
      EXPECT_NE(all, d_all) << "the logits are those without the fused GEMM bit for bit: not taken";
  }

  // Passes of 3, 4, 8 and 9 tokens one after the other, all their rows against the CPU's.
  int pos = n_prompt;
  for (int n : {3, 4, 8, 9}) {
    std::vector<float> rows((size_t)n * vocab), crows((size_t)n * vocab), l(vocab), cl(vocab);
    gpu->forward(&prompt[pos], n, pos, l.data(), rows.data());
    cpu->forward(&prompt[pos], n, pos, cl.data(), crows.data());
    EXPECT_LT(rel_err(rows, crows), 2e-2) << "a pass of " << n << " tokens at position " << pos;
    pos += n;
  }
  // A decode step over the cache those passes wrote.
  std::vector<float> l(vocab), cl(vocab);
  gpu->forward(&prompt[pos], 1, pos, l.data(), nullptr);
  cpu->forward(&prompt[pos], 1, pos, cl.data(), nullptr);
  EXPECT_LT(rel_err(l, cl), 2e-2) << "the decode step after the fused passes";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, Prefill,
    ::testing::Values(ModelCase{"fp16", "fp16", 16, 0, false, false, "gptq"},
                      ModelCase{"q4_g128_act", "gptq", 4, 128, true, false, "gptq"},
                      // q, k, v and gate, up not fusable: each part's GEMM into its columns
                      ModelCase{"q4_g128_act_unfused", "gptq", 4, 128, true, false, "gptq", 4, 2,
                                true},
                      ModelCase{"q4_g32_asym_v2", "gptq", 4, 32, false, true, "gptq_v2"},
                      ModelCase{"q3_g128", "gptq", 3, 128, false, false, "gptq"},
                      ModelCase{"q2_g64_act", "gptq", 2, 64, true, false, "gptq"},
                      ModelCase{"q8_perchannel", "gptq", 8, -1, false, false, "gptq"},
                      ModelCase{"q4_g128_hd128", "gptq", 4, 128, false, false, "gptq", 2, 1},
                      // GPTQModel `dynamic` models: each linear's GEMMs in its own format, the
                      // parts of unfused siblings into their columns (tests/support/synth_model.h)
                      kestrel::test::dynamic_mixed(), kestrel::test::dynamic_fused(),
                      kestrel::test::dynamic_act_stream(), kestrel::test::dynamic_v2_asym()),
    [](const auto& info) { return info.param.name; });

// The chunk length the prefill takes within the memory target (no GPU needed).
TEST(PrefillChunk, LongestMultipleOf64WithinFivePercent) {
  constexpr size_t MB = 1000000;
  // Llama-2-7B at 640 positions: 4.2 GB of weights and cache, 140 MB taken, 115 KB a token:
  // 70 MB of room holds 608 tokens, so 576.
  EXPECT_EQ(prefill_chunk_rows(4200 * MB, 140 * MB, 115000, 640), 576);
  // Room for more than asked: what was asked.
  EXPECT_EQ(prefill_chunk_rows(4200 * MB, 10 * MB, 115000, 640), 640);
  // No room at all (a small model's fixed scratch alone passes 5%): 512, or fewer if asked.
  EXPECT_EQ(prefill_chunk_rows(770 * MB, 100 * MB, 51000, 2048), 512);
  EXPECT_EQ(prefill_chunk_rows(770 * MB, 100 * MB, 51000, 7), 7);

  std::mt19937 rng(5);
  for (int i = 0; i < 2000; ++i) {
    const size_t base = std::uniform_int_distribution<size_t>(100 * MB, 200000 * MB)(rng);
    const size_t taken = std::uniform_int_distribution<size_t>(0, base / 10)(rng);
    const size_t row = std::uniform_int_distribution<size_t>(1000, 1000000)(rng);
    const int max_rows = std::uniform_int_distribution<int>(1, 8192)(rng);
    const int r = prefill_chunk_rows(base, taken, row, max_rows);
    SCOPED_TRACE(::testing::Message() << "base " << base << " taken " << taken << " row " << row
                                      << " max " << max_rows << " -> " << r);
    ASSERT_LE(r, max_rows);
    ASSERT_GE(r, std::min(512, max_rows));
    if (r > 512 && r < max_rows) {  // set by the room: a multiple of 64 that fits, and the longest
      EXPECT_EQ(r % 64, 0);
      EXPECT_LE(taken + (size_t)r * row, base / 20);
      EXPECT_GT(taken + (size_t)(r + 64) * row, base / 20);
    }
  }
}

// The workspace gets what is left of the 5%, in whole MiB, at most what was asked.
TEST(PrefillChunk, WorkspaceFromWhatIsLeft) {
  constexpr size_t MB = 1000000, MiB = size_t(1) << 20;
  // 7B at 640 positions: 210 MB of room, 120 MB taken: 90 MB left, 32 MiB asked.
  EXPECT_EQ(prefill_workspace_bytes(4200 * MB, 120 * MB, 32 * MiB), 32 * MiB);
  // 10.5 MB left: 10 MiB.
  EXPECT_EQ(prefill_workspace_bytes(4200 * MB, 199500000, 32 * MiB), 10 * MiB);
  // Nothing left, or already over: none.
  EXPECT_EQ(prefill_workspace_bytes(770 * MB, 90 * MB, 32 * MiB), 0u);
  EXPECT_EQ(prefill_workspace_bytes(770 * MB, 770 * MB / 20, 32 * MiB), 0u);
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const size_t base = std::uniform_int_distribution<size_t>(100 * MB, 200000 * MB)(rng);
    const size_t taken = std::uniform_int_distribution<size_t>(0, base / 10)(rng);
    const size_t most = std::uniform_int_distribution<size_t>(0, 64 * MiB)(rng);
    const size_t w = prefill_workspace_bytes(base, taken, most);
    SCOPED_TRACE(::testing::Message() << "base " << base << " taken " << taken << " most " << most);
    ASSERT_EQ(w % MiB, 0u);
    ASSERT_LE(w, most);
    ASSERT_LE(taken + w, std::max(taken, base / 20));
    // The largest such: one more MiB would pass the target or the cap.
    EXPECT_TRUE(w + MiB > most || taken + w + MiB > base / 20);
  }
}

}  // namespace
}  // namespace kestrel
