// The plain C++ reference ops against hand-computed values and their defining properties.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/activation/activation.h"
#include "kernels/attention/attention.h"
#include "kernels/embedding/embedding.h"
#include "kernels/matmul/matmul.h"
#include "kernels/norm/norm.h"
#include "kernels/rope/rope.h"

namespace kestrel {
namespace {

void expect_all_near(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "index " << i;
}

// ---- dense matmul ----

TEST(Matmul, SmallHandComputed) {
  // x [2, 3], W [2, 3], y = x W^T + b
  const std::vector<float> x = {1, 2, 3, -1, 0.5f, 2};
  const std::vector<float> W = {1, 0, -1, 2, 1, 0.5f};
  const std::vector<float> b = {10, -10};
  std::vector<float> y(4);
  matmul_ref(x.data(), W.data(), b.data(), 2, 2, 3, y.data());
  // row 0: (1 - 3) + 10, (2 + 2 + 1.5) - 10 ; row 1: (-1 - 2) + 10, (-2 + 0.5 + 1) - 10
  EXPECT_EQ(y, (std::vector<float>{8, -4.5f, 7, -10.5f}));
  matmul_ref(x.data(), W.data(), nullptr, 2, 2, 3, y.data());
  EXPECT_EQ(y, (std::vector<float>{-2, 5.5f, -3, -0.5f}));
}

TEST(Matmul, F16WeightsHandComputed) {
  // fp16 bits: 0x3C00 = 1, 0xC000 = -2, 0x3800 = 0.5, 0x0000 = 0, 0x4200 = 3, 0xBC00 = -1
  const std::vector<uint16_t> W = {0x3C00, 0xC000, 0x3800, 0x0000, 0x4200, 0xBC00};
  const std::vector<float> x = {2, 1, 4};
  std::vector<float> y(2);
  matmul_f16w_ref(x.data(), W.data(), nullptr, 1, 2, 3, y.data());
  EXPECT_EQ(y, (std::vector<float>{2, -1}));  // 2 - 2 + 2 ; 0 + 3 - 4
  const std::vector<float> b = {0.25f, 1};
  matmul_f16w_ref(x.data(), W.data(), b.data(), 1, 2, 3, y.data());
  EXPECT_EQ(y, (std::vector<float>{2.25f, 0}));
}

// ---- norms ----

TEST(Norm, RmsNormHandComputed) {
  // mean(x^2) = 30/4 = 7.5, + eps 0.5 = 8: y = x / sqrt(8) * w
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> w = {1, 1, 2, 0.5f};
  std::vector<float> y(4);
  rms_norm_ref(x.data(), w.data(), 0.5f, 1, 4, y.data());
  expect_all_near(y, {0.35355339f, 0.70710678f, 2.12132034f, 0.70710678f}, 1e-6f);
}

TEST(Norm, RmsNormRowsInPlace) {
  // Row 1 is row 0 times 10 with eps 0: the same normalised row.
  std::vector<float> x = {1, -2, 3, 10, -20, 30};
  const std::vector<float> w = {1, 1, 1};
  rms_norm_ref(x.data(), w.data(), 0.0f, 2, 3, x.data());
  const float r = 1.0f / std::sqrt(14.0f / 3.0f);
  expect_all_near(x, {r, -2 * r, 3 * r, r, -2 * r, 3 * r}, 1e-6f);
}

TEST(Norm, LayerNormHandComputed) {
  // mean 2.5, var 1.25, + eps 0.75 = 2: (x - 2.5) / sqrt(2) * w + b
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> w = {1, 2, 1, 1};
  const std::vector<float> b = {0, 0, 1, -1};
  std::vector<float> y(4);
  layer_norm_ref(x.data(), w.data(), b.data(), 0.75f, 1, 4, y.data());
  expect_all_near(y, {-1.06066017f, -0.70710678f, 1.35355339f, 0.06066017f}, 1e-6f);
  layer_norm_ref(x.data(), w.data(), nullptr, 0.75f, 1, 4, y.data());
  expect_all_near(y, {-1.06066017f, -0.70710678f, 0.35355339f, 1.06066017f}, 1e-6f);
}

// ---- rope ----

std::vector<float> random_vec(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& e : v) e = d(rng);
  return v;
}

TEST(Rope, PositionZeroIsIdentity) {
  std::mt19937 rng(1);
  const auto x0 = random_vec(rng, 4 * 64);
  auto x = x0;
  rope_ref(x.data(), 4, 64, 0, 10000.0f, 1.0f);
  EXPECT_EQ(x, x0);
}

TEST(Rope, PreservesNormOfEachPair) {
  std::mt19937 rng(2);
  const int heads = 3, d = 32;
  const auto x0 = random_vec(rng, heads * d);
  auto x = x0;
  rope_ref(x.data(), heads, d, 1234, 10000.0f, 1.0f);
  bool moved = false;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < d / 2; ++i) {
      const int a = h * d + i, b = a + d / 2;  // rotate-half pairs i with i + d/2
      EXPECT_NEAR(std::hypot(x[a], x[b]), std::hypot(x0[a], x0[b]), 1e-5f) << h << "," << i;
      moved |= x[a] != x0[a];
    }
  EXPECT_TRUE(moved);
}

TEST(Rope, HeadDimFourHandComputed) {
  // theta 10000, d 4: inv_freq = {1, 0.01}. pos 1: pair (x0, x2) turns by 1 rad, (x1, x3) by 0.01.
  std::vector<float> x = {1, 2, 3, 4, 1, 2, 3, 4};  // two heads, rotated alike
  rope_ref(x.data(), 2, 4, 1, 10000.0f, 1.0f);
  const std::vector<float> head = {-1.98411065f, 1.95990067f, 2.46237790f, 4.01979967f};
  expect_all_near(x, {head[0], head[1], head[2], head[3], head[0], head[1], head[2], head[3]},
                  1e-5f);
}

TEST(Rope, LinearFactorDividesPosition) {
  std::mt19937 rng(3);
  const auto x0 = random_vec(rng, 2 * 64);
  auto a = x0, b = x0;
  rope_ref(a.data(), 2, 64, 2, 500000.0f, 2.0f);
  rope_ref(b.data(), 2, 64, 1, 500000.0f, 1.0f);
  EXPECT_EQ(a, b);
  auto c = x0;
  rope_ref(c.data(), 2, 64, 2, 500000.0f, 1.0f);
  EXPECT_NE(a, c);
}

// ---- attention ----

TEST(Attention, OnePositionReturnsV) {
  std::mt19937 rng(4);
  const int H = 2, D = 8;
  const auto q = random_vec(rng, H * D), k = random_vec(rng, H * D), v = random_vec(rng, H * D);
  std::vector<float> out(H * D);
  attention_ref(q.data(), k.data(), v.data(), H, H, D, 1, out.data());
  EXPECT_EQ(out, v);
}

TEST(Attention, EqualScoresAverageV) {
  const int D = 4;
  const std::vector<float> q = {0.3f, -1, 2, 0.5f};
  const std::vector<float> k = {1, 2, 3, 4, 1, 2, 3, 4};  // both positions score alike
  const std::vector<float> v = {2, 4, -6, 8, 0, 2, 6, 1};
  std::vector<float> out(D);
  attention_ref(q.data(), k.data(), v.data(), 1, 1, D, 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{1, 3, 0, 4.5f}));
}

TEST(Attention, ScaledSoftmaxWeights) {
  // head_dim 4: scale 1/2. Scores 0 and ln 3 -> weights 1/4 and 3/4.
  const int D = 4;
  const float l3 = std::log(3.0f);
  const std::vector<float> q = {2 * l3, 0, 0, 0};
  const std::vector<float> k = {0, 0, 0, 0, 1, 0, 0, 0};
  const std::vector<float> v = {4, 0, 8, 0, 0, 4, 0, 8};
  std::vector<float> out(D);
  attention_ref(q.data(), k.data(), v.data(), 1, 1, D, 2, out.data());
  expect_all_near(out, {1, 3, 2, 6}, 1e-5f);
}

TEST(Attention, IgnoresCachePositionsPastContext) {
  // Positions n_ctx and beyond hold NaN: a causal read never touches them.
  std::mt19937 rng(5);
  const int H = 2, D = 4, max_ctx = 6, n_ctx = 3;
  const auto q = random_vec(rng, H * D);
  auto k = random_vec(rng, max_ctx * H * D), v = random_vec(rng, max_ctx * H * D);
  for (int i = n_ctx * H * D; i < max_ctx * H * D; ++i) k[i] = v[i] = NAN;
  std::vector<float> out(H * D);
  attention_ref(q.data(), k.data(), v.data(), H, H, D, n_ctx, out.data());
  for (float o : out) EXPECT_TRUE(std::isfinite(o));
}

TEST(Attention, GroupedQueryHeadsShareKv) {
  // 4 query heads over 2 KV heads: heads 0 and 1 read KV head 0, heads 2 and 3 KV head 1.
  const int H = 4, KVH = 2, D = 2;
  const std::vector<float> q = {1, 0, 0, 1, 1, 1, -1, 0};
  const std::vector<float> k = {0.5f, 0.5f, 1, -1};   // one position
  const std::vector<float> v = {10, 20, 30, 40};      // kv0 = {10, 20}, kv1 = {30, 40}
  std::vector<float> out(H * D);
  attention_ref(q.data(), k.data(), v.data(), H, KVH, D, 1, out.data());
  EXPECT_EQ(out, (std::vector<float>{10, 20, 10, 20, 30, 40, 30, 40}));

  // Two positions, where the KV heads disagree on which one to attend to.
  const std::vector<float> q2 = {8, 0, 8, 0, 8, 0, 8, 0};
  // pos 0: kv0 = (1, 0) kv1 = (0, 0) ; pos 1: kv0 = (0, 0) kv1 = (1, 0)
  const std::vector<float> k2 = {1, 0, 0, 0, 0, 0, 1, 0};
  const std::vector<float> v2 = {1, 1, 2, 2, 3, 3, 4, 4};
  attention_ref(q2.data(), k2.data(), v2.data(), H, KVH, D, 2, out.data());
  // score 8 / sqrt 2 vs 0: the preferred position weighs 1 / (1 + e^-5.657) = 0.99652
  const float p = 1.0f / (1.0f + std::exp(-8.0f / std::sqrt(2.0f)));
  const float a = p * 1 + (1 - p) * 3, b = p * 4 + (1 - p) * 2;
  expect_all_near(out, {a, a, a, a, b, b, b, b}, 1e-5f);
}

TEST(Attention, RejectsHeadsNotMultipleOfKvHeads) {
  std::vector<float> buf(64, 0.0f), out(64);
  EXPECT_THROW(attention_ref(buf.data(), buf.data(), buf.data(), 3, 2, 4, 1, out.data()), Error);
}

// ---- activations ----

TEST(Activation, SiluMulKnownValues) {
  const std::vector<float> gate = {0, 1, -1, 2, -100, 100};
  const std::vector<float> up = {5, 2, 3, 0.5f, 1, 1};
  std::vector<float> out(6);
  silu_mul_ref(gate.data(), up.data(), 6, out.data());
  expect_all_near(out, {0, 1.46211716f, -0.80682426f, 0.88079708f, 0, 100}, 1e-6f);
  for (float o : out) EXPECT_TRUE(std::isfinite(o));

  auto g = gate;  // out may alias gate
  silu_mul_ref(g.data(), up.data(), 6, g.data());
  EXPECT_EQ(g, out);
}

TEST(Activation, SoftmaxKnownValuesAndSum) {
  std::vector<float> x = {0, 1, 2};
  softmax_ref(x.data(), 3);
  expect_all_near(x, {0.09003057f, 0.24472847f, 0.66524096f}, 1e-6f);

  std::mt19937 rng(6);
  auto r = random_vec(rng, 1000);
  for (auto& e : r) e *= 10;
  softmax_ref(r.data(), (int64_t)r.size());
  double sum = 0;
  for (float e : r) {
    EXPECT_GE(e, 0.0f);
    sum += e;
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
}

TEST(Activation, SoftmaxShiftInvariantWithHugeInputs) {
  std::vector<float> a = {1000, 1001, 1002}, b = {0, 1, 2};
  softmax_ref(a.data(), 3);
  softmax_ref(b.data(), 3);
  expect_all_near(a, b, 1e-7f);

  const float big = 3e38f;
  std::vector<float> h = {big, big, -big};
  softmax_ref(h.data(), 3);
  EXPECT_EQ(h, (std::vector<float>{0.5f, 0.5f, 0.0f}));

  std::vector<float> one = {std::numeric_limits<float>::max()};
  softmax_ref(one.data(), 1);
  EXPECT_EQ(one[0], 1.0f);
}

// ---- embedding ----

TEST(Embedding, CopiesTheTokenRow) {
  // [3, 4] fp16 table: 0x3C00 = 1, 0xC000 = -2, 0x3800 = 0.5, 0x7BFF = 65504, 0x0001 = 2^-24
  const std::vector<uint16_t> table = {0x0000, 0x0000, 0x0000, 0x0000,
                                       0x3C00, 0xC000, 0x3800, 0x7BFF,
                                       0x0001, 0x3C00, 0x3C00, 0x3C00};
  std::vector<float> out(4, NAN);
  embedding_f16_ref(table.data(), 4, 1, out.data());
  EXPECT_EQ(out, (std::vector<float>{1, -2, 0.5f, 65504}));
  embedding_f16_ref(table.data(), 4, 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{std::ldexp(1.0f, -24), 1, 1, 1}));
  EXPECT_THROW(embedding_f16_ref(table.data(), 4, -1, out.data()), Error);
}

}  // namespace
}  // namespace kestrel
