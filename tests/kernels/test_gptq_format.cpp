// The GPTQ packed format and its reference dequantization/matmul, checked against bit
// streams and formula loops written here, independently of kernels/gptq/gptq_ref.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/gptq/gptq_format.h"
#include "kernels/matmul/matmul.h"

namespace kestrel::gptq {
namespace {

std::vector<uint8_t> random_codes(std::mt19937& rng, int64_t count, int bits) {
  std::uniform_int_distribution<int> dist(0, (1 << bits) - 1);
  std::vector<uint8_t> out(count);
  for (auto& c : out) c = (uint8_t)dist(rng);
  return out;
}

// Packs codes bit by bit into a little-endian stream whose words are `stride` apart: bit j
// of code i goes to stream bit bits*i + j. Deliberately unlike write_code.
void pack_bits(std::vector<uint32_t>& words, int64_t base, int64_t stride, const uint8_t* codes,
               int64_t count, int bits) {
  for (int64_t i = 0; i < count; ++i)
    for (int j = 0; j < bits; ++j)
      if ((codes[i] >> j) & 1) {
        const int64_t bit = (int64_t)bits * i + j;
        words[base + (bit / 32) * stride] |= 1u << (bit % 32);
      }
}

// ---- packing ----

class PackingTest : public ::testing::TestWithParam<int> {};

TEST_P(PackingTest, QweightMatchesBitStreamAndRoundTrips) {
  const int bits = GetParam();
  std::mt19937 rng(1000 + bits);
  for (auto [N, K] : {std::pair<int64_t, int64_t>{32, 32}, {64, 96}, {32, 256}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " K=" << K);
    const auto q = random_codes(rng, N * K, bits);
    const auto packed = pack_qweight(q, N, K, bits);
    ASSERT_EQ((int64_t)packed.size(), K * bits / 32 * N);

    // Column n of qweight is the bit stream of row n of the codes, words N apart.
    std::vector<uint32_t> expected(packed.size(), 0u);
    for (int64_t n = 0; n < N; ++n) pack_bits(expected, n, N, &q[n * K], K, bits);
    EXPECT_EQ(packed, expected);

    EXPECT_EQ(unpack_qweight(packed.data(), N, K, bits), q);
  }
}

TEST_P(PackingTest, QzerosMatchBitStreamAndRoundTrip) {
  const int bits = GetParam();
  std::mt19937 rng(2000 + bits);
  const int64_t G = 3, N = 96;
  const auto z = random_codes(rng, G * N, bits);
  const auto packed = pack_qzeros(z, G, N, bits);
  const int64_t row_words = N * bits / 32;
  ASSERT_EQ((int64_t)packed.size(), G * row_words);

  std::vector<uint32_t> expected(packed.size(), 0u);
  for (int64_t g = 0; g < G; ++g) pack_bits(expected, g * row_words, 1, &z[g * N], N, bits);
  EXPECT_EQ(packed, expected);

  EXPECT_EQ(unpack_qzeros(packed.data(), G, N, bits), z);
}

INSTANTIATE_TEST_SUITE_P(Bits, PackingTest, ::testing::Values(2, 3, 4, 8));

// The symmetric v1 zero words listed in docs/gptq-format.md: stored zero 2^(b-1) - 1.
TEST(Packing, SymmetricV1ZeroWords) {
  const int64_t N = 64;
  auto words_for = [&](int bits) {
    return pack_qzeros(std::vector<uint8_t>(N, (uint8_t)((1 << (bits - 1)) - 1)), 1, N, bits);
  };
  for (auto [bits, word] : {std::pair<int, uint32_t>{4, 0x77777777u}, {2, 0x55555555u},
                            {8, 0x7F7F7F7Fu}}) {
    const auto w = words_for(bits);
    ASSERT_EQ((int64_t)w.size(), N * bits / 32);
    for (uint32_t x : w) EXPECT_EQ(x, word) << "bits " << bits;
  }
  const auto w3 = words_for(3);
  ASSERT_EQ(w3.size(), 6u);
  const uint32_t three[3] = {0xDB6DB6DBu, 0xB6DB6DB6u, 0x6DB6DB6Du};
  for (size_t i = 0; i < w3.size(); ++i) EXPECT_EQ(w3[i], three[i % 3]) << "word " << i;
}

// 3-bit codes 10 and 21 straddle words; the exact bit positions, drawn in gptq_format.h.
TEST(Packing, ThreeBitStraddlingCodes) {
  const int64_t N = 2, K = 32;  // column 1 is checked too: words of a column are N apart
  for (int64_t n = 0; n < N; ++n) {
    std::vector<uint8_t> q(N * K, 0);
    q[n * K + 10] = 7;
    auto w = pack_qweight(q, N, K, 3);
    ASSERT_EQ(w.size(), 6u);
    EXPECT_EQ(w[0 * N + n], 0xC0000000u);  // low 2 bits at bits 30..31 of word 0
    EXPECT_EQ(w[1 * N + n], 0x00000001u);  // high bit at bit 0 of word 1
    EXPECT_EQ(w[2 * N + n], 0u);
    EXPECT_EQ(w[0 * N + (1 - n)] | w[1 * N + (1 - n)] | w[2 * N + (1 - n)], 0u);

    q.assign(N * K, 0);
    q[n * K + 21] = 7;
    w = pack_qweight(q, N, K, 3);
    EXPECT_EQ(w[0 * N + n], 0u);
    EXPECT_EQ(w[1 * N + n], 0x80000000u);  // low bit at bit 31 of word 1
    EXPECT_EQ(w[2 * N + n], 0x00000003u);  // high 2 bits at bits 0..1 of word 2
  }
  // Asymmetric patterns tell the low and high parts apart: 5 = 0b101, 6 = 0b110.
  std::vector<uint8_t> q(K, 0);
  q[10] = 5;
  q[21] = 6;
  const auto w = pack_qweight(q, 1, K, 3);
  EXPECT_EQ(w[0], 0x40000000u);  // code 10 low bits 01
  EXPECT_EQ(w[1], 0x00000001u);  // code 10 high bit 1, code 21 low bit 0
  EXPECT_EQ(w[2], 0x00000003u);  // code 21 high bits 11
  const auto back = unpack_qweight(w.data(), 1, K, 3);
  EXPECT_EQ(back[10], 5);
  EXPECT_EQ(back[21], 6);
  EXPECT_EQ(read_code(w.data(), 1, 10, 3), 5u);
  EXPECT_EQ(read_code(w.data(), 1, 21, 3), 6u);
}

TEST(Packing, RejectsBadShapesAndCodes) {
  EXPECT_THROW(pack_qweight(std::vector<uint8_t>(16, 0), 1, 16, 3), Error);  // 48 bits
  EXPECT_THROW(pack_qweight(std::vector<uint8_t>(32, 16), 1, 32, 4), Error);  // code > 15
  EXPECT_THROW(pack_qweight(std::vector<uint8_t>(31, 0), 1, 32, 4), Error);   // size
  EXPECT_THROW(pack_qweight(std::vector<uint8_t>(32, 0), 1, 32, 5), Error);   // bits
  EXPECT_THROW(pack_qzeros(std::vector<uint8_t>(8, 0), 1, 8, 2), Error);      // 16 bits
}

// ---- dequantization formula ----

// One-column layer with hand-picked codes: W = scale * (q - z), z = stored + offset.
TEST(Dequantize, ZeroOffsetV1VersusV2) {
  const int64_t N = 8, K = 32;  // N*4 = 32 bits of zeros
  std::vector<uint8_t> q(N * K, 0);
  for (int64_t k = 0; k < K; ++k) q[k] = (uint8_t)(k % 16);  // row 0
  const auto qweight = pack_qweight(q, N, K, 4);
  const auto qzeros = pack_qzeros(std::vector<uint8_t>(N, 7), 1, N, 4);
  const std::vector<uint16_t> scales(N, float_to_half(0.5f));

  GptqView v;
  v.bits = 4;
  v.group_size = -1;
  v.K = K;
  v.N = N;
  v.qweight = qweight.data();
  v.qzeros = qzeros.data();
  v.scales = scales.data();

  std::vector<float> W(N * K);
  v.zero_offset = 1;
  dequantize_ref(v, W.data());
  for (int64_t k = 0; k < K; ++k) EXPECT_EQ(W[k], 0.5f * ((float)(k % 16) - 8.0f)) << k;
  EXPECT_EQ(W[K], -4.0f);  // row 1: code 0, z = 8

  v.zero_offset = 0;
  dequantize_ref(v, W.data());
  for (int64_t k = 0; k < K; ++k) EXPECT_EQ(W[k], 0.5f * ((float)(k % 16) - 7.0f)) << k;
  EXPECT_EQ(W[K], -3.5f);
}

TEST(Dequantize, RejectsOutOfRangeGIdx) {
  const int64_t N = 32, K = 64;
  const auto qweight = pack_qweight(std::vector<uint8_t>(N * K, 1), N, K, 4);
  const auto qzeros = pack_qzeros(std::vector<uint8_t>(2 * N, 7), 2, N, 4);
  const std::vector<uint16_t> scales(2 * N, float_to_half(1.0f));
  std::vector<int32_t> g_idx(K, 0);
  g_idx[5] = 2;  // only groups 0 and 1 exist
  GptqView v;
  v.bits = 4;
  v.group_size = 32;
  v.K = K;
  v.N = N;
  v.qweight = qweight.data();
  v.qzeros = qzeros.data();
  v.scales = scales.data();
  v.g_idx = g_idx.data();
  std::vector<float> W(N * K);
  EXPECT_THROW(dequantize_ref(v, W.data()), Error);
}

// A random quantized layer; the view points into it.
struct Layer {
  std::vector<uint8_t> codes;      // [N, K]
  std::vector<uint8_t> zeros;      // [G, N] stored
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;    // [G, N]
  std::vector<int32_t> g_idx;      // [K] or empty
  GptqView view;
};

Layer make_layer(std::mt19937& rng, int bits, int group_size, int64_t N, int64_t K,
                 int zero_offset, bool explicit_g_idx) {
  Layer L;
  L.view.bits = bits;
  L.view.group_size = group_size;
  L.view.K = K;
  L.view.N = N;
  L.view.zero_offset = zero_offset;
  const int64_t G = L.view.groups();
  L.codes = random_codes(rng, N * K, bits);
  L.zeros = random_codes(rng, G * N, bits);
  L.qweight = pack_qweight(L.codes, N, K, bits);
  L.qzeros = pack_qzeros(L.zeros, G, N, bits);
  std::uniform_real_distribution<float> sd(0.001f, 0.05f);
  L.scales.resize(G * N);
  for (auto& s : L.scales) s = float_to_half(sd(rng));
  if (explicit_g_idx) {
    L.g_idx.resize(K);
    for (int64_t k = 0; k < K; ++k) L.g_idx[k] = group_size <= 0 ? 0 : (int32_t)(k / group_size);
  }
  L.view.qweight = L.qweight.data();
  L.view.qzeros = L.qzeros.data();
  L.view.scales = L.scales.data();
  L.view.g_idx = L.g_idx.empty() ? nullptr : L.g_idx.data();
  return L;
}

// The formula of docs/gptq-format.md element by element, from the packed words.
std::vector<float> naive_dequantize(const GptqView& v) {
  std::vector<float> W(v.N * v.K);
  const int64_t zero_row_words = v.N * v.bits / 32;
  for (int64_t n = 0; n < v.N; ++n)
    for (int64_t k = 0; k < v.K; ++k) {
      const uint32_t q = read_code(v.qweight + n, v.N, k, v.bits);
      const int64_t g = v.g_idx ? v.g_idx[k] : (v.group_size <= 0 ? 0 : k / v.group_size);
      const uint32_t f = read_code(v.qzeros + g * zero_row_words, 1, n, v.bits);
      const int z = (int)f + v.zero_offset;
      W[n * v.K + k] = half_to_float(v.scales[g * v.N + n]) * (float)((int)q - z);
    }
  return W;
}

// y = x W^T in double, and sum |x_k W_nk| per output for the error bound.
void naive_matmul(const std::vector<float>& x, const std::vector<float>& W, int64_t M, int64_t N,
                  int64_t K, std::vector<double>& y, std::vector<double>& mag) {
  y.assign(M * N, 0.0);
  mag.assign(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const double p = (double)x[m * K + k] * W[n * K + k];
        y[m * N + n] += p;
        mag[m * N + n] += std::fabs(p);
      }
}

// fp32 accumulation of K products: |error| <= K * 2^-24 * sum |x w| (plus slack).
void expect_close(const std::vector<float>& got, const std::vector<double>& want,
                  const std::vector<double>& mag, int64_t K) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << "index " << i;
    const double tol = 2.0 * (double)K * std::ldexp(1.0, -24) * mag[i] + 1e-30;
    ASSERT_NEAR(got[i], want[i], tol) << "index " << i;
  }
}

// bits, group size, K, zero offset
using Shape = std::tuple<int, int, int64_t, int>;
class GptqShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(GptqShapes, DequantizeMatchesFormula) {
  const auto [bits, gs, K, off] = GetParam();
  std::mt19937 rng(bits * 7919 + gs * 31 + (int)K + off);
  for (bool explicit_g_idx : {false, true}) {
    SCOPED_TRACE(explicit_g_idx ? "explicit g_idx" : "g_idx absent");
    const Layer L = make_layer(rng, bits, gs, 64, K, off, explicit_g_idx);
    std::vector<float> W(64 * K);
    dequantize_ref(L.view, W.data());
    EXPECT_EQ(W, naive_dequantize(L.view));
  }
}

TEST_P(GptqShapes, MatmulMatchesDequantizedMatmul) {
  const auto [bits, gs, K, off] = GetParam();
  std::mt19937 rng(bits * 104729 + gs * 17 + (int)K + off);
  const int64_t N = 96;
  const Layer L = make_layer(rng, bits, gs, N, K, off, false);
  std::vector<float> W(N * K);
  dequantize_ref(L.view, W.data());
  std::normal_distribution<float> xd(0.0f, 1.0f);
  for (int64_t M : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "M=" << M);
    std::vector<float> x(M * K);
    for (auto& e : x) e = xd(rng);
    std::vector<float> y(M * N, NAN);
    matmul_ref(L.view, x.data(), M, y.data());
    std::vector<double> want, mag;
    naive_matmul(x, W, M, N, K, want, mag);
    expect_close(y, want, mag, K);
  }
}

// What a speculative verify pass relies on: a row of a many-row call equals the same row
// alone, bit for bit, and neither depends on the threads the call runs on (K = 200: not a
// multiple of dot_ref's 16 sums, so the tail counts too). Dense fp32, fp16 and GPTQ.
TEST(CpuLinears, RowsAndThreadsDoNotChangeABit) {
  std::mt19937 rng(7);
  const int64_t N = 640, K = 200, M = 5;  // N * K * M past kLinearParallelWork
  const Layer L = make_layer(rng, 4, 64, N, K, 1, false);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(M * K), W(N * K), b(N);
  std::vector<uint16_t> W16(N * K);
  for (auto& e : x) e = d(rng);
  for (auto& e : W) e = d(rng);
  for (auto& e : b) e = d(rng);
  for (int64_t i = 0; i < N * K; ++i) W16[i] = float_to_half(W[i]);
  using Linear = std::function<void(const float*, int64_t, float*)>;
  const std::vector<std::pair<const char*, Linear>> linears = {
      {"fp32", [&](const float* xs, int64_t m, float* y) { kestrel::matmul_ref(xs, W.data(), b.data(), m, N, K, y); }},
      {"fp16", [&](const float* xs, int64_t m, float* y) { matmul_f16w_ref(xs, W16.data(), b.data(), m, N, K, y); }},
      {"gptq", [&](const float* xs, int64_t m, float* y) { matmul_ref(L.view, xs, m, y); }}};
  for (const auto& [name, linear] : linears) {
    SCOPED_TRACE(name);
    set_linear_threads(1);
    std::vector<float> one(M * N);
    for (int64_t m = 0; m < M; ++m) linear(x.data() + m * K, 1, one.data() + m * N);
    for (int threads : {1, 2, 3}) {
      set_linear_threads(threads);
      std::vector<float> all(M * N, NAN);
      linear(x.data(), M, all.data());
      EXPECT_EQ(std::memcmp(all.data(), one.data(), all.size() * sizeof(float)), 0) << threads;
    }
  }
  set_linear_threads(1);
}

// K = 96 with group 64 gives G = 2 (a partial last group); 96 with 128 gives G = 1.
INSTANTIATE_TEST_SUITE_P(Formats, GptqShapes,
                         ::testing::Combine(::testing::Values(2, 3, 4, 8),
                                            ::testing::Values(32, 64, 128, -1),
                                            ::testing::Values<int64_t>(96, 256),
                                            ::testing::Values(1, 0)));

// ---- act-order ----

TEST(ActOrder, GIdxFromPermutation) {
  // Columns quantized in reverse order: column k is the (K-1-k)-th quantized.
  const int64_t K = 8;
  std::vector<int32_t> perm(K);
  for (int64_t j = 0; j < K; ++j) perm[j] = (int32_t)(K - 1 - j);
  EXPECT_EQ(act_order_g_idx(perm, 4), (std::vector<int32_t>{1, 1, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(act_order_g_idx(perm, 3), (std::vector<int32_t>{2, 2, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(act_order_g_idx(perm, -1), std::vector<int32_t>(K, 0));
  EXPECT_THROW(act_order_g_idx({0, 1, 1, 3}, 2), Error);
  EXPECT_THROW(act_order_g_idx({0, 1, 4, 3}, 2), Error);
}

// A layer quantized in permuted order: the j-th quantized column has code cp[n][j] and
// belongs to group j / group_size. The checkpoint stores codes at their real column
// perm[j] with g_idx scattering the groups; dequantizing it must equal the permuted layout
// read back through perm.
TEST(ActOrder, DequantizeAndMatmulMatchPermutedLayout) {
  for (int bits : {3, 4}) {
    SCOPED_TRACE(::testing::Message() << "bits=" << bits);
    const int64_t N = 32, K = 160;
    const int gs = 64;  // G = 3, the last group partial
    const int64_t G = 3;
    std::mt19937 rng(77 + bits);
    std::vector<int32_t> perm(K);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);

    const auto cp = random_codes(rng, N * K, bits);  // [N, j] in quantization order
    const auto zs = random_codes(rng, G * N, bits);
    std::vector<uint16_t> scales(G * N);
    std::uniform_real_distribution<float> sd(0.01f, 0.1f);
    for (auto& s : scales) s = float_to_half(sd(rng));

    std::vector<uint8_t> codes(N * K);  // [N, k] in checkpoint order
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < K; ++j) codes[n * K + perm[j]] = cp[n * K + j];
    const auto qweight = pack_qweight(codes, N, K, bits);
    const auto qzeros = pack_qzeros(zs, G, N, bits);
    const auto g_idx = act_order_g_idx(perm, gs);

    GptqView v;
    v.bits = bits;
    v.group_size = gs;
    v.K = K;
    v.N = N;
    v.zero_offset = 1;
    v.qweight = qweight.data();
    v.qzeros = qzeros.data();
    v.scales = scales.data();
    v.g_idx = g_idx.data();

    std::vector<float> expected(N * K);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t g = j / gs;
        const float s = half_to_float(scales[g * N + n]);
        const int z = zs[g * N + n] + 1;
        expected[n * K + perm[j]] = s * (float)((int)cp[n * K + j] - z);
      }
    std::vector<float> W(N * K);
    dequantize_ref(v, W.data());
    EXPECT_EQ(W, expected);

    const int64_t M = 3;
    std::vector<float> x(M * K);
    std::normal_distribution<float> xd(0.0f, 1.0f);
    for (auto& e : x) e = xd(rng);
    std::vector<float> y(M * N);
    matmul_ref(v, x.data(), M, y.data());
    std::vector<double> want, mag;
    naive_matmul(x, expected, M, N, K, want, mag);
    expect_close(y, want, mag, K);
  }
}

}  // namespace
}  // namespace kestrel::gptq
