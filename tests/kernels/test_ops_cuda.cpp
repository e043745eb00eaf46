// The FP16 CUDA decode ops against the plain C++ references (kernels/*/ *_ref.cpp).
//
// Inputs are random fp16 values (fixed seeds) and the references are fed exactly those values
// widened to float, so the only differences allowed are the kernels' own arithmetic: fp32 math
// and one rounding of each output to fp16. That rounding moves each element by at most 2^-11 of
// its size (round to nearest, 11-bit significand), so the normalised error ||y - ref|| / ||ref||
// is at most 4.9e-4 from it (about 2.8e-4 in practice); fp32 accumulation over at most a few
// thousand terms adds ~1e-6. kTol = 1e-3 leaves a 2x margin over the worst case and still fails
// on any real indexing or scaling bug, which shows as errors of order 1.
//
// Outputs, workspaces and unused cache rows are filled with NaN before every launch: a kernel
// that skips an element, or reads a row it must not read, leaves a NaN behind.
#include <gtest/gtest.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/gpu.h"
#include "base/dtype.h"
#include "kernels/activation/activation.h"
#include "kernels/activation/activation_cuda.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/embedding/embedding.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/norm/norm.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/sampling/sample.h"
#include "kernels/sampling/sample_cuda.h"
#include "tests/support/kv_table.h"
#include "tests/support/sample_check.h"
#include "kernels/rope/rope.h"
#include "kernels/rope/rope_cuda.h"
#include "kernels/sampling/argmax_cuda.h"

namespace kestrel {
namespace {

constexpr double kTol = 1e-3;
constexpr uint16_t kHalfNaN = 0x7E00;


// A device array of T, freed on scope exit. Halves travel as their uint16_t bits.
template <class T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) { KESTREL_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) { upload(v); }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  T* get() const { return p_; }
  __half* half() const {
    static_assert(sizeof(T) == 2);
    return reinterpret_cast<__half*>(p_);
  }
  void upload(const std::vector<T>& v) {
    KESTREL_CUDA_CHECK(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  // All bytes 0xFF: NaN as fp16 (0xFFFF) and as fp32, -1 as int.
  void poison() { KESTREL_CUDA_CHECK(cudaMemset(p_, 0xFF, n_ * sizeof(T))); }

 private:
  T* p_ = nullptr;
  size_t n_;
};

std::vector<uint16_t> random_half(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_half(dist(rng));
  return v;
}

std::vector<float> widen(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = half_to_float(h[i]);
  return f;
}

std::vector<float> widen(const std::vector<uint16_t>& h, size_t first, size_t count) {
  return widen(std::vector<uint16_t>(h.begin() + first, h.begin() + first + count));
}

// Fails on any non-finite value, then on ||got - ref|| / ||ref|| > tol.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t bad = 0;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (bad++ == 0) ADD_FAILURE() << what << ": non-finite output at index " << i;
      continue;
    }
    diff += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
    norm += (double)ref[i] * ref[i];
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " non-finite outputs";
  const double err = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  EXPECT_LE(err, tol) << what << ": normalised error";
}

// ---- norms ----

struct NormShape {
  int rows, n;
};

class NormCuda : public ::testing::TestWithParam<NormShape> {};

TEST_P(NormCuda, RmsNormMatchesReference) {
  KESTREL_REQUIRE_GPU();
  const auto [rows, n] = GetParam();
  const auto x = random_half((size_t)rows * n, -4.0f, 4.0f, 11);
  const auto w = random_half(n, -2.0f, 2.0f, 12);
  std::vector<float> ref(x.size());
  rms_norm_ref(widen(x).data(), widen(w).data(), 1e-5f, rows, n, ref.data());

  Dev<uint16_t> dx(x), dw(w), dy(x.size());
  dy.poison();
  cuda::rms_norm_f16(dx.half(), dw.half(), 1e-5f, rows, n, dy.half(), nullptr);
  expect_close(widen(dy.download()), ref, kTol, "rms_norm_f16");

  // In place: y aliases x.
  cuda::rms_norm_f16(dx.half(), dw.half(), 1e-5f, rows, n, dx.half(), nullptr);
  expect_close(widen(dx.download()), ref, kTol, "rms_norm_f16 in place");
}

TEST_P(NormCuda, LayerNormMatchesReference) {
  KESTREL_REQUIRE_GPU();
  const auto [rows, n] = GetParam();
  // An offset mean: a one-pass variance would cancel.
  const auto x = random_half((size_t)rows * n, 2.0f, 6.0f, 21);
  const auto w = random_half(n, -2.0f, 2.0f, 22);
  const auto b = random_half(n, -1.0f, 1.0f, 23);
  Dev<uint16_t> dx(x), dw(w), db(b), dy(x.size());
  for (const bool bias : {true, false}) {
    std::vector<float> ref(x.size());
    layer_norm_ref(widen(x).data(), widen(w).data(), bias ? widen(b).data() : nullptr, 1e-5f,
                   rows, n, ref.data());
    dy.poison();
    cuda::layer_norm_f16(dx.half(), dw.half(), bias ? db.half() : nullptr, 1e-5f, rows, n,
                         dy.half(), nullptr);
    expect_close(widen(dy.download()), ref, kTol,
                 std::string("layer_norm_f16 ") + (bias ? "with" : "without") + " bias");
  }
}

// 1 and 7: smaller than a warp and than a 16-byte load; 4096, 5120: the vector path;
// 11009: odd, scalar path over many threads.
INSTANTIATE_TEST_SUITE_P(Shapes, NormCuda,
                         ::testing::Values(NormShape{1, 1}, NormShape{3, 1}, NormShape{1, 7},
                                           NormShape{3, 7}, NormShape{1, 4096},
                                           NormShape{5, 4096}, NormShape{1, 5120},
                                           NormShape{1, 11009}, NormShape{2, 11009}),
                         [](const auto& info) {
                           return "rows" + std::to_string(info.param.rows) + "_n" +
                                  std::to_string(info.param.n);
                         });

// Qwen3's per-head norms in place on q|k|v rows with padding between rows (ld): q and k heads
// normalised by rms_norm_ref per head, v and the padding untouched.
struct HeadNormShape {
  int rows, n_heads, n_kv, head_dim;
};

class HeadNormCuda : public ::testing::TestWithParam<HeadNormShape> {};

TEST_P(HeadNormCuda, MatchesReferencePerHead) {
  KESTREL_REQUIRE_GPU();
  const auto [rows, n_heads, n_kv, hd] = GetParam();
  const int64_t width = (int64_t)(n_heads + 2 * n_kv) * hd, ld = width + 8;
  const auto x = random_half((size_t)rows * ld, -3.0f, 3.0f, 61);
  const auto qw = random_half(hd, 0.5f, 1.5f, 62), kw = random_half(hd, 0.5f, 1.5f, 63);
  std::vector<float> ref = widen(x);
  for (int r = 0; r < rows; ++r) {
    float* row = ref.data() + (size_t)r * ld;
    rms_norm_ref(row, widen(qw).data(), 1e-6f, n_heads, hd, row);
    rms_norm_ref(row + (size_t)n_heads * hd, widen(kw).data(), 1e-6f, n_kv, hd, row + (size_t)n_heads * hd);
  }
  Dev<uint16_t> dx(x), dqw(qw), dkw(kw);
  cuda::head_rms_norm_f16(dx.half(), ld, rows, n_heads, n_kv, hd, dqw.half(), dkw.half(), 1e-6f,
                          nullptr);
  const auto got = dx.download();
  expect_close(widen(got), ref, kTol, "head_rms_norm_f16");
  for (int r = 0; r < rows; ++r)  // v and the padding: bit for bit
    for (int64_t i = (int64_t)(n_heads + n_kv) * hd; i < ld; ++i)
      ASSERT_EQ(got[(size_t)r * ld + i], x[(size_t)r * ld + i]) << r << " " << i;
}

INSTANTIATE_TEST_SUITE_P(Shapes, HeadNormCuda,
                         ::testing::Values(HeadNormShape{1, 32, 8, 128}, HeadNormShape{3, 4, 2, 64},
                                           HeadNormShape{70, 6, 1, 128}, HeadNormShape{2, 3, 3, 96},
                                           HeadNormShape{1, 2, 1, 256}, HeadNormShape{5, 5, 1, 16}),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "rows" + std::to_string(p.rows) + "_h" + std::to_string(p.n_heads) +
                                  "_kv" + std::to_string(p.n_kv) + "_hd" + std::to_string(p.head_dim);
                         });

// OPT's pending bias added to the residual stream by the LayerNorm that reads it: x += add
// (written back, rounded to fp16), y = layer_norm_ref of the new x.
TEST_P(NormCuda, AddLayerNormAddsThenNormalises) {
  KESTREL_REQUIRE_GPU();
  const auto [rows, n] = GetParam();
  const auto x = random_half((size_t)rows * n, 2.0f, 6.0f, 24);
  const auto add = random_half(n, -1.0f, 1.0f, 25);
  const auto w = random_half(n, -2.0f, 2.0f, 26), b = random_half(n, -1.0f, 1.0f, 27);
  std::vector<float> x_ref = widen(x);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) {
      float& v = x_ref[(size_t)r * n + i];
      v = half_to_float(float_to_half(v + half_to_float(add[i])));
    }
  std::vector<float> ref(x.size());
  layer_norm_ref(x_ref.data(), widen(w).data(), widen(b).data(), 1e-5f, rows, n, ref.data());
  Dev<uint16_t> dx(x), dadd(add), dw(w), db(b), dy(x.size());
  dy.poison();
  cuda::add_layer_norm_f16(dx.half(), dadd.half(), dw.half(), db.half(), 1e-5f, rows, n, dy.half(),
                           nullptr);
  EXPECT_EQ(widen(dx.download()), x_ref);  // the stream, bit for bit
  expect_close(widen(dy.download()), ref, kTol, "add_layer_norm_f16");
}

TEST(ElementwiseCuda, AddRowsAndRelu) {
  KESTREL_REQUIRE_GPU();
  for (const auto& [rows, n, ld] : {std::tuple{1, 1, 1}, {3, 7, 9}, {70, 4096, 4096}, {5, 1000, 1003}}) {
    const auto y = random_half((size_t)rows * ld, -2.0f, 2.0f, 81), v = random_half(n, -1.0f, 1.0f, 82);
    Dev<uint16_t> dy(y), dv(v);
    cuda::add_rows_f16(dy.half(), ld, dv.half(), rows, n, nullptr);
    const auto got = dy.download();
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < ld; ++i) {
        const size_t at = (size_t)r * ld + i;
        const uint16_t want = i < n ? float_to_half(half_to_float(y[at]) + half_to_float(v[i])) : y[at];
        ASSERT_EQ(got[at], want) << r << " " << i;
      }
    cuda::relu_f16(dy.half(), (int64_t)rows * ld, nullptr);
    std::vector<float> ref = widen(got);
    relu_ref(ref.data(), (int64_t)ref.size());
    EXPECT_EQ(widen(dy.download()), ref);
  }
}

// A bias laid into rows of a wider buffer: every row equal to it, the rest untouched.
TEST(BroadcastRowsCuda, FillsEveryRowAndNothingElse) {
  KESTREL_REQUIRE_GPU();
  for (const auto& [rows, n, ld] : {std::tuple{1, 1, 1}, {3, 7, 9}, {70, 4608, 4608}, {5, 1000, 1003}}) {
    const auto v = random_half(n, -1.0f, 1.0f, 71);
    Dev<uint16_t> dv(v), dy((size_t)rows * ld);
    dy.poison();
    const auto before = dy.download();
    cuda::broadcast_rows_f16(dv.half(), rows, n, dy.half(), ld, nullptr);
    const auto got = dy.download();
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < ld; ++i)
        ASSERT_EQ(got[(size_t)r * ld + i], i < n ? v[i] : before[(size_t)r * ld + i]) << r << " " << i;
  }
}

// ---- rope + KV write ----

struct RopeCase {
  int head_dim, n_heads, n_kv_heads, pos;
  float theta, factor;
  float llama3 = 0;  // Llama 3's scaling factor (original 8192 positions); 0 = none
  RopeScaling scaling() const { return {theta, factor, llama3, 1.0f, 4.0f, 8192}; }
};

class RopeCuda : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeCuda, RotatesQKAndWritesCacheRow) {
  KESTREL_REQUIRE_GPU();
  const auto c = GetParam();
  const int q_dim = c.n_heads * c.head_dim, kv_dim = c.n_kv_heads * c.head_dim;
  const int max_ctx = c.pos + 2;  // one row after pos, and pos - 1 when pos > 0: must stay poisoned
  const auto qkv = random_half((size_t)q_dim + 2 * kv_dim, -2.0f, 2.0f, 31 + c.pos);

  std::vector<float> q_ref = widen(qkv, 0, q_dim), k_ref = widen(qkv, q_dim, kv_dim);
  const std::vector<float> freqs = rope_inv_freq(c.head_dim, c.scaling());
  rope_ref(q_ref.data(), c.n_heads, c.head_dim, c.pos, freqs.data());
  rope_ref(k_ref.data(), c.n_kv_heads, c.head_dim, c.pos, freqs.data());

  Dev<uint16_t> dqkv(qkv), dk((size_t)max_ctx * kv_dim), dv((size_t)max_ctx * kv_dim);
  Dev<int> dpos(std::vector<int>{c.pos});
  dk.poison();
  dv.poison();
  cuda::rope_kv_write_f16(dqkv.half(), dk.half(), dv.half(), dpos.get(), c.n_heads, c.n_kv_heads,
                          c.head_dim, c.scaling(), nullptr);

  const auto got = dqkv.download();
  expect_close(widen(got, 0, q_dim), q_ref, kTol, "rotated q");
  expect_close(widen(got, q_dim, kv_dim), k_ref, kTol, "rotated k");
  // v is not touched in qkv and is copied bit for bit.
  for (int i = 0; i < kv_dim; ++i) ASSERT_EQ(got[q_dim + kv_dim + i], qkv[q_dim + kv_dim + i]) << i;

  const auto kc = dk.download(), vc = dv.download();
  for (int row = 0; row < max_ctx; ++row) {
    for (int i = 0; i < kv_dim; ++i) {
      const size_t at = (size_t)row * kv_dim + i;
      if (row == c.pos) {
        ASSERT_EQ(kc[at], got[q_dim + i]) << "k cache row " << row << " elem " << i;
        ASSERT_EQ(vc[at], qkv[q_dim + kv_dim + i]) << "v cache row " << row << " elem " << i;
      } else {
        ASSERT_EQ(kc[at], 0xFFFF) << "k cache row " << row << " written";
        ASSERT_EQ(vc[at], 0xFFFF) << "v cache row " << row << " written";
      }
    }
  }
}

std::vector<RopeCase> rope_cases() {
  std::vector<RopeCase> cases;
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{32, 32}, {32, 8}, {6, 2}, {4, 1}})
      for (const int pos : {0, 1, 4095})
        for (const float factor : {1.0f, 2.0f}) cases.push_back({hd, h, kv, pos, 10000.0f, factor});
  cases.push_back({128, 32, 8, 4095, 500000.0f, 8.0f});  // Llama-3 theta
  cases.push_back({128, 32, 8, 4095, 500000.0f, 1.0f, 8.0f});   // Llama 3.1's scaling
  cases.push_back({64, 32, 8, 100000, 500000.0f, 1.0f, 32.0f});  // Llama 3.2's, far out
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeCuda, ::testing::ValuesIn(rope_cases()),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "hd" + std::to_string(p.head_dim) + "_h" +
                                  std::to_string(p.n_heads) + "_kv" +
                                  std::to_string(p.n_kv_heads) + "_pos" + std::to_string(p.pos) +
                                  "_theta" + std::to_string((int)p.theta) + "_f" +
                                  std::to_string((int)p.factor) +
                                  (p.llama3 > 0 ? "_llama3x" + std::to_string((int)p.llama3) : "");
                         });

// ---- decode attention ----

struct AttnCase {
  int head_dim, n_heads, n_kv_heads, n_ctx, window;
};

// Reference over the window: attention_ref on the cache rows [first, n_ctx).
std::vector<float> attention_window_ref(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, const AttnCase& c) {
  const int first = c.window > 0 ? std::max(0, c.n_ctx - c.window) : 0;
  const size_t kv_dim = (size_t)c.n_kv_heads * c.head_dim;
  std::vector<float> out((size_t)c.n_heads * c.head_dim);
  attention_ref(q.data(), k.data() + first * kv_dim, v.data() + first * kv_dim, c.n_heads,
                c.n_kv_heads, c.head_dim, c.n_ctx - first, out.data());
  return out;
}

class AttentionCuda : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionCuda, MatchesReferenceAndReadsOnlyLiveRows) {
  KESTREL_REQUIRE_GPU();
  const auto c = GetParam();
  const int kv_dim = c.n_kv_heads * c.head_dim;
  const int max_ctx = c.n_ctx + 300;  // grids sized past the context; not a multiple of 256
  const int first = c.window > 0 ? std::max(0, c.n_ctx - c.window) : 0;

  // q in [-3, 3], k in [-1, 1]: scores of standard deviation ~1 after 1/sqrt(head_dim), so
  // the softmax is neither flat nor one-hot.
  const auto q = random_half((size_t)c.n_heads * c.head_dim, -3.0f, 3.0f, 41);
  auto k = random_half((size_t)max_ctx * kv_dim, -1.0f, 1.0f, 42);
  auto v = random_half((size_t)max_ctx * kv_dim, -1.0f, 1.0f, 43);
  const auto ref = attention_window_ref(widen(q), widen(k), widen(v), c);
  // Every row outside [first, n_ctx) becomes NaN: reading one would poison the output.
  for (int row = 0; row < max_ctx; ++row) {
    if (row >= first && row < c.n_ctx) continue;
    std::fill_n(k.begin() + (size_t)row * kv_dim, kv_dim, kHalfNaN);
    std::fill_n(v.begin() + (size_t)row * kv_dim, kv_dim, kHalfNaN);
  }

  Dev<uint16_t> dq(q), dk(k), dv(v), dout(q.size());
  Dev<int> dpos(std::vector<int>{c.n_ctx - 1});
  Dev<float> ws(cuda::attention_workspace_bytes(max_ctx, c.n_heads, c.head_dim) / sizeof(float));
  ws.poison();
  cuda::attention_workspace_reset(ws.get(), max_ctx, c.n_heads, c.head_dim, nullptr);
  // Every compiled number of query heads per block (0: the default, which depends on the
  // grid's bound), one workspace for all: each call leaves its counters zero for the next.
  // Grids bounded at the context itself, one past it and at the cache's length (0): with the
  // heads per block forced, a bound changes only how many blocks exit at once and (past 1,024
  // positions) the chunks' length, so outputs of one chunk length keep their bits.
  for (const int heads : {0, 1, 2, 4}) {
    std::map<int, std::vector<uint16_t>> first_out;  // by chunk length
    for (const int bound : {0, c.n_ctx, c.n_ctx + 1}) {
      dout.poison();
      cuda::attention_decode_f16(dq.half(), dk.half(), dv.half(), dpos.get(), max_ctx, c.window,
                                 c.n_heads, c.n_kv_heads, c.head_dim, ws.get(), dout.half(),
                                 nullptr, bound, heads);
      const int chunk = cuda::attention_chunk_positions(bound ? bound : max_ctx, c.head_dim);
      const std::string what = "attention_decode_f16, heads per block " + std::to_string(heads) +
                               ", grid bound " + std::to_string(bound) + ", chunks of " +
                               std::to_string(chunk);
      const std::vector<uint16_t> out = dout.download();
      expect_close(widen(out), ref, kTol, what);
      auto [first, inserted] = first_out.emplace(chunk, out);
      if (!inserted && heads != 0) {
        EXPECT_EQ(out, first->second) << what;
      }
    }
  }
}

std::vector<AttnCase> attention_cases() {
  std::vector<AttnCase> cases;
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{32, 32}, {32, 8}, {6, 2}, {4, 1}})
      for (const int n_ctx : {1, 2, 255, 256, 257, 1000, 4096}) cases.push_back({hd, h, kv, n_ctx, 0});
  // Sliding windows: inside one chunk, across a chunk boundary, starting one past a boundary,
  // longer than the context.
  for (const int hd : {64, 128}) {
    cases.push_back({hd, 32, 8, 1000, 100});
    cases.push_back({hd, 32, 8, 4096, 300});
    cases.push_back({hd, 6, 2, 257, 256});
    cases.push_back({hd, 4, 1, 1000, 4096});
  }
  // Groups past one block's 16 heads, and an odd group of 5.
  cases.push_back({64, 32, 1, 1000, 0});
  cases.push_back({128, 40, 2, 300, 0});
  cases.push_back({128, 10, 2, 513, 0});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionCuda, ::testing::ValuesIn(attention_cases()),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "hd" + std::to_string(p.head_dim) + "_h" +
                                  std::to_string(p.n_heads) + "_kv" +
                                  std::to_string(p.n_kv_heads) + "_ctx" +
                                  std::to_string(p.n_ctx) + "_win" + std::to_string(p.window);
                         });

TEST(AttentionCuda, RejectsUncompiledHeadDim) {
  KESTREL_REQUIRE_GPU();
  Dev<uint16_t> buf(4096);
  Dev<int> dpos(std::vector<int>{0});
  Dev<float> ws(cuda::attention_workspace_bytes(8, 2, 96) / sizeof(float));
  EXPECT_THROW(cuda::attention_decode_f16(buf.half(), buf.half(), buf.half(), dpos.get(), 8, 0, 2,
                                          2, 96, ws.get(), buf.half(), nullptr),
               Error);
}

// A grid bounded past the cache's length (or at a negative count) would index the workspace out
// of its size: refused with the bound named.
TEST(AttentionCuda, RejectsAGridBoundPastTheCache) {
  KESTREL_REQUIRE_GPU();
  Dev<uint16_t> buf(4096);
  Dev<int> dpos(std::vector<int>{0});
  Dev<float> ws(cuda::attention_workspace_bytes(8, 2, 64) / sizeof(float));
  for (const int bound : {9, -1}) {
    try {
      cuda::attention_decode_f16(buf.half(), buf.half(), buf.half(), dpos.get(), 8, 0, 2, 2, 64,
                                 ws.get(), buf.half(), nullptr, bound);
      ADD_FAILURE() << "grid bound " << bound << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ctx_bound " + std::to_string(bound)),
                std::string::npos)
          << e.what();
    }
  }
}

// The decode step as the engine runs it: rope + KV write + attention captured once into a CUDA
// graph, then replayed at each position with only *d_pos and the qkv input changing. The CPU
// side keeps its own caches; q and k are rounded to fp16 after rotation as the GPU stores them,
// so both sides attend with the same values up to rare one-ulp rotation differences (2e-3 allows
// for those on top of the output rounding).
TEST(DecodeGraphCuda, RopeAndAttentionReplayOverPositions) {
  KESTREL_REQUIRE_GPU();
  const int hd = 64, n_heads = 8, n_kv = 2, max_ctx = 600, steps = 520, window = 0;
  const int q_dim = n_heads * hd, kv_dim = n_kv * hd, qkv_dim = q_dim + 2 * kv_dim;
  const float theta = 10000.0f, factor = 1.0f;

  Dev<uint16_t> dqkv(qkv_dim), dk((size_t)max_ctx * kv_dim), dv((size_t)max_ctx * kv_dim),
      dout(q_dim);
  Dev<int> dpos(1);
  Dev<float> ws(cuda::attention_workspace_bytes(max_ctx, n_heads, hd) / sizeof(float));
  ws.poison();
  cuda::attention_workspace_reset(ws.get(), max_ctx, n_heads, hd, nullptr);
  dk.poison();
  dv.poison();

  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::rope_kv_write_f16(dqkv.half(), dk.half(), dv.half(), dpos.get(), n_heads, n_kv, hd,
                          RopeScaling{theta, factor}, stream);
  cuda::attention_decode_f16(dqkv.half(), dk.half(), dv.half(), dpos.get(), max_ctx, window,
                             n_heads, n_kv, hd, ws.get(), dout.half(), stream);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<float> k_cpu((size_t)max_ctx * kv_dim), v_cpu((size_t)max_ctx * kv_dim);
  for (int pos = 0; pos < steps; ++pos) {
    const auto qkv = random_half(qkv_dim, -2.0f, 2.0f, 1000 + pos);
    dqkv.upload(qkv);
    dpos.upload({pos});
    dout.poison();
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));

    std::vector<float> q = widen(qkv, 0, q_dim), k = widen(qkv, q_dim, kv_dim);
    rope_ref(q.data(), n_heads, hd, pos, theta, factor);
    rope_ref(k.data(), n_kv, hd, pos, theta, factor);
    for (auto& x : q) x = round_to_half(x);
    for (int i = 0; i < kv_dim; ++i) {
      k_cpu[(size_t)pos * kv_dim + i] = round_to_half(k[i]);
      v_cpu[(size_t)pos * kv_dim + i] = half_to_float(qkv[q_dim + kv_dim + i]);
    }
    std::vector<float> ref(q_dim);
    attention_ref(q.data(), k_cpu.data(), v_cpu.data(), n_heads, n_kv, hd, pos + 1, ref.data());
    expect_close(widen(dout.download()), ref, 2e-3, "graph replay at pos " + std::to_string(pos));
    if (HasFailure()) break;
  }
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
}

// attention_decode_rope_f16 (RoPE, KV write and attention in one kernel) against the two
// kernels it replaces, bit for bit: the output, the q|k|v row (left untouched by the fused
// kernel) and both caches, replayed in a graph over positions that cross chunk boundaries, with
// and without a sliding window, MHA and GQA, both head dims, and grids of short chunks (300
// positions) and of long ones (1,300). A third run stores its output through an index (the o
// GEMV's act-order permutation): the same values, moved. A fourth runs over a paged cache (a
// scrambled block table over a larger pool, tests/support/kv_table.h): the same output bit for
// bit, and each position's row at its block's row of the pool.
TEST(DecodeGraphCuda, FusedRopeAttentionEqualsRopeThenAttention) {
  KESTREL_REQUIRE_GPU();
  struct Case {
    int hd, n_heads, n_kv, window, max_ctx;
  };
  for (const Case c : {Case{128, 4, 4, 0, 300}, Case{64, 8, 2, 0, 300}, Case{64, 32, 2, 100, 300},
                       Case{128, 6, 2, 70, 300}, Case{128, 4, 4, 0, 1300},
                       Case{64, 8, 2, 100, 1300}}) {
    SCOPED_TRACE("hd " + std::to_string(c.hd) + " heads " + std::to_string(c.n_heads) + "/" +
                 std::to_string(c.n_kv) + " window " + std::to_string(c.window) + " max_ctx " +
                 std::to_string(c.max_ctx));
    const int max_ctx = c.max_ctx, steps = 200;
    const int q_dim = c.n_heads * c.hd, kv_dim = c.n_kv * c.hd, qkv_dim = q_dim + 2 * kv_dim;
    // Llama 3's scaling, its medium band inside head_dim's frequencies.
    const RopeScaling rope{500000.0f, 1.0f, 8.0f, 1.0f, 4.0f, 256};
    const std::vector<int32_t> table = test::scrambled_table(max_ctx, 3 + c.max_ctx);
    const int64_t pool = test::pool_rows(table);
    Dev<uint16_t> dqkv(qkv_dim), dqkv2(qkv_dim), dk((size_t)max_ctx * kv_dim),
        dv((size_t)max_ctx * kv_dim), dk2((size_t)max_ctx * kv_dim),
        dv2((size_t)max_ctx * kv_dim), dk4((size_t)pool * kv_dim), dv4((size_t)pool * kv_dim),
        dout(q_dim), dout2(q_dim), dout3(q_dim), dout4(q_dim);
    Dev<int> dpos(1);
    Dev<int32_t> dtable(table);
    auto f16 = [](const Dev<uint16_t>& d, const int32_t* blocks = nullptr) {
      return cuda::KvCacheDev{KvType::F16, d.half(), nullptr, blocks};
    };
    const size_t ws_n = cuda::attention_workspace_bytes(max_ctx, c.n_heads, c.hd) / sizeof(float);
    Dev<float> ws(ws_n), ws2(ws_n), ws3(ws_n), ws4(ws_n);
    for (auto* d : {&dk, &dv, &dk2, &dv2, &dk4, &dv4}) d->poison();
    for (auto* w : {&ws, &ws2, &ws3, &ws4}) {
      w->poison();
      cuda::attention_workspace_reset(w->get(), max_ctx, c.n_heads, c.hd, nullptr);
    }
    std::vector<int32_t> idx(q_dim);
    std::iota(idx.begin(), idx.end(), 0);
    std::shuffle(idx.begin(), idx.end(), std::mt19937(q_dim));
    Dev<int32_t> didx(idx);

    cudaStream_t stream;
    KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    cuda::rope_kv_write_f16(dqkv.half(), dk.half(), dv.half(), dpos.get(), c.n_heads, c.n_kv, c.hd,
                            rope, stream);
    cuda::attention_decode_f16(dqkv.half(), dk.half(), dv.half(), dpos.get(), max_ctx, c.window,
                               c.n_heads, c.n_kv, c.hd, ws.get(), dout.half(), stream);
    cuda::attention_decode_rope_f16(dqkv2.half(), f16(dk2), f16(dv2), dpos.get(), max_ctx,
                                    c.window, c.n_heads, c.n_kv, c.hd, rope, ws2.get(),
                                    dout2.half(), stream);
    // The same again (it rewrites the same cache row): its output through the index.
    cuda::attention_decode_rope_f16(dqkv2.half(), f16(dk2), f16(dv2), dpos.get(), max_ctx,
                                    c.window, c.n_heads, c.n_kv, c.hd, rope, ws3.get(),
                                    dout3.half(), stream, didx.get());
    // Paged: the sequence's max_ctx positions through the table.
    cuda::attention_decode_rope_f16(dqkv2.half(), f16(dk4, dtable.get()), f16(dv4, dtable.get()),
                                    dpos.get(), max_ctx, c.window, c.n_heads, c.n_kv, c.hd, rope,
                                    ws4.get(), dout4.half(), stream);
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int pos = 0; pos < steps; ++pos) {
      const auto qkv = random_half(qkv_dim, -2.0f, 2.0f, 7000 + pos);
      dqkv.upload(qkv);
      dqkv2.upload(qkv);
      dpos.upload({pos});
      dout.poison();
      dout2.poison();
      dout3.poison();
      dout4.poison();
      KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::string at = " at pos " + std::to_string(pos);
      const std::vector<uint16_t> out = dout.download(), out3 = dout3.download();
      ASSERT_EQ(dout2.download(), out) << "attention output" << at;
      ASSERT_EQ(dout4.download(), out) << "paged attention output" << at;
      for (int e = 0; e < q_dim; ++e)
        ASSERT_EQ(out3[idx[e]], out[e]) << "indexed output " << e << at;
      ASSERT_EQ(dqkv2.download(), qkv) << "the fused kernel must not modify qkv" << at;
      if (pos % 50 == 49 || pos == steps - 1) {
        const std::vector<uint16_t> k = dk.download(), v = dv.download();
        ASSERT_EQ(dk2.download(), k) << "k cache" << at;
        ASSERT_EQ(dv2.download(), v) << "v cache" << at;
        // The paged cache's rows gathered by position: the contiguous cache, every row (those
        // not yet written poisoned in both).
        const std::vector<uint16_t> k4 = dk4.download(), v4 = dv4.download();
        std::vector<uint16_t> kg(k.size()), vg(v.size());
        for (int p = 0; p < max_ctx; ++p) {
          const size_t row = (size_t)table[p / kKvBlock] * kKvBlock + p % kKvBlock;
          std::copy_n(k4.begin() + row * kv_dim, kv_dim, kg.begin() + (size_t)p * kv_dim);
          std::copy_n(v4.begin() + row * kv_dim, kv_dim, vg.begin() + (size_t)p * kv_dim);
        }
        ASSERT_EQ(kg, k) << "paged k cache" << at;
        ASSERT_EQ(vg, v) << "paged v cache" << at;
      }
    }
    KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
    KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// ---- silu * up ----

struct SiluShape {
  int rows, inter;
};

class SiluMulCuda : public ::testing::TestWithParam<SiluShape> {};

TEST_P(SiluMulCuda, MatchesReference) {
  KESTREL_REQUIRE_GPU();
  const auto [rows, inter] = GetParam();
  auto gu = random_half((size_t)rows * 2 * inter, -8.0f, 8.0f, 51);
  // Some gates far below -88, where exp(-g) overflows fp32: the result must be -0, not NaN.
  for (int r = 0; r < rows; ++r)
    for (int i = 3; i < inter; i += 97)
      gu[(size_t)r * 2 * inter + i] = float_to_half(i % 2 ? -100.0f : -60000.0f);
  std::vector<float> ref((size_t)rows * inter);
  const auto guf = widen(gu);
  for (int r = 0; r < rows; ++r)
    silu_mul_ref(guf.data() + (size_t)r * 2 * inter, guf.data() + (size_t)r * 2 * inter + inter,
                 inter, ref.data() + (size_t)r * inter);

  Dev<uint16_t> dgu(gu), dout(ref.size());
  dout.poison();
  cuda::silu_mul_rows_f16(dgu.half(), rows, inter, dout.half(), nullptr);
  expect_close(widen(dout.download()), ref, kTol, "silu_mul");

  if (rows == 1) {  // in place over the gate half
    cuda::silu_mul_rows_f16(dgu.half(), 1, inter, dgu.half(), nullptr);
    expect_close(widen(dgu.download(), 0, inter), ref, kTol, "silu_mul in place");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SiluMulCuda,
                         ::testing::Values(SiluShape{1, 1}, SiluShape{1, 7}, SiluShape{1, 11008},
                                           SiluShape{1, 11009}, SiluShape{3, 7},
                                           SiluShape{4, 11008}, SiluShape{2, 11009}),
                         [](const auto& info) {
                           return "rows" + std::to_string(info.param.rows) + "_inter" +
                                  std::to_string(info.param.inter);
                         });

// ---- embedding ----

// OPT's learned positions: token row + position row (*d_pos0 + i, or i), one fp16 rounding.
TEST(EmbeddingCuda, AddsLearnedPositions) {
  KESTREL_REQUIRE_GPU();
  const int vocab = 50, hidden = 72, rows = 40;
  const auto table = random_half((size_t)vocab * hidden, -1.0f, 1.0f, 91);
  const auto positions = random_half((size_t)rows * hidden, -1.0f, 1.0f, 92);
  const std::vector<int> tokens = {3, 49, 0, 7};
  Dev<uint16_t> dt(table), dp(positions), dout(tokens.size() * hidden);
  Dev<int> dtok(tokens), dpos(std::vector<int>{5});
  auto expect_rows = [&](int first_pos) {
    const auto got = dout.download();
    for (size_t t = 0; t < tokens.size(); ++t)
      for (int j = 0; j < hidden; ++j) {
        const float e = half_to_float(table[(size_t)tokens[t] * hidden + j]);
        const float p = half_to_float(positions[(size_t)(first_pos + t) * hidden + j]);
        ASSERT_EQ(got[t * hidden + j], float_to_half(e + p)) << t << " " << j;
      }
  };
  cuda::embedding_positions_f16(dt.half(), dp.half(), dtok.get(), dpos.get(), (int)tokens.size(),
                                hidden, dout.half(), nullptr);
  expect_rows(5);
  const auto from_device = dout.download();
  cuda::embedding_positions_f16(dt.half(), dp.half() + 2 * hidden, dtok.get(), nullptr,
                                (int)tokens.size(), hidden, dout.half(), nullptr);
  expect_rows(2);
  // The same first position by value (the table from its row) and from device memory (a
  // captured verify pass): the same bits.
  cuda::embedding_positions_f16(dt.half(), dp.half() + 5 * hidden, dtok.get(), nullptr,
                                (int)tokens.size(), hidden, dout.half(), nullptr);
  EXPECT_EQ(dout.download(), from_device);
}

TEST(EmbeddingCuda, CopiesRowsExactly) {
  KESTREL_REQUIRE_GPU();
  const int vocab = 1000;
  for (const int hidden : {7, 4096, 4100}) {  // scalar, vector, scalar (4100 % 8 != 0)
    const auto table = random_half((size_t)vocab * hidden, -1.0f, 1.0f, 61 + hidden);
    Dev<uint16_t> dtable(table), dout((size_t)4 * hidden);
    for (const int token : {0, 123, vocab - 1}) {
      Dev<int> dtok(std::vector<int>{token});
      dout.poison();
      cuda::embedding_f16(dtable.half(), dtok.get(), hidden, dout.half(), nullptr);
      std::vector<float> ref(hidden);
      embedding_f16_ref(table.data(), hidden, token, ref.data());
      const auto got = dout.download();
      for (int i = 0; i < hidden; ++i)
        ASSERT_EQ(half_to_float(got[i]), ref[i]) << "hidden " << hidden << " token " << token;
    }
    // In a permutation: out[j] = row[perm[j]].
    std::vector<int32_t> perm(hidden);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(hidden));
    Dev<int32_t> dperm(perm);
    Dev<int> dtok(std::vector<int>{vocab - 2});
    dout.poison();
    cuda::embedding_permuted_f16(dtable.half(), dtok.get(), hidden, dperm.get(), dout.half(),
                                 nullptr);
    {
      std::vector<float> ref(hidden);
      embedding_f16_ref(table.data(), hidden, vocab - 2, ref.data());
      const auto got = dout.download();
      for (int j = 0; j < hidden; ++j)
        ASSERT_EQ(half_to_float(got[j]), ref[perm[j]]) << "hidden " << hidden << " permuted " << j;
    }
    const std::vector<int> tokens = {5, vocab - 1, 0, 5};
    Dev<int> dtoks(tokens);
    dout.poison();
    cuda::embedding_tokens_f16(dtable.half(), dtoks.get(), 4, hidden, dout.half(), nullptr);
    const auto got = dout.download();
    std::vector<float> ref(hidden);
    for (int t = 0; t < 4; ++t) {
      embedding_f16_ref(table.data(), hidden, tokens[t], ref.data());
      for (int i = 0; i < hidden; ++i)
        ASSERT_EQ(half_to_float(got[(size_t)t * hidden + i]), ref[i])
            << "hidden " << hidden << " row " << t;
    }
  }
}

// ---- argmax and conversion ----

int first_argmax(const std::vector<uint16_t>& x) {
  int best = 0;
  for (int i = 1; i < (int)x.size(); ++i)
    if (half_to_float(x[i]) > half_to_float(x[best])) best = i;
  return best;
}

int run_argmax(const std::vector<uint16_t>& logits) {
  Dev<uint16_t> d(logits);
  Dev<int> tok(1);
  tok.poison();
  cuda::argmax_f16(d.half(), (int)logits.size(), tok.get(), nullptr);
  return tok.download()[0];
}

TEST(ArgmaxCuda, RandomLogits) {
  KESTREL_REQUIRE_GPU();
  for (const int n : {1, 7, 32000, 32001, 128256}) {
    // Negative logits: a reduction that starts from 0 instead of -inf would fail.
    const auto logits = random_half(n, -20.0f, -1.0f, 71 + n);
    EXPECT_EQ(run_argmax(logits), first_argmax(logits)) << "n " << n;
  }
}

TEST(ArgmaxCuda, TiesGoToTheFirstIndex) {
  KESTREL_REQUIRE_GPU();
  for (const int n : {32000, 32001}) {  // vector and scalar paths
    auto logits = random_half(n, -5.0f, 5.0f, 81);
    const uint16_t top = float_to_half(9.0f);
    // Ties inside one 16-byte load (16, 17), across threads and warps (5000, 31999).
    for (const int i : {31999, 5000, 17, 16}) logits[i] = top;
    EXPECT_EQ(run_argmax(logits), 16) << "n " << n;
    logits[16] = float_to_half(1.0f);
    EXPECT_EQ(run_argmax(logits), 17) << "n " << n;
    logits[17] = logits[5000] = float_to_half(1.0f);
    EXPECT_EQ(run_argmax(logits), 31999) << "n " << n;
  }
  const std::vector<uint16_t> flat(4096, float_to_half(0.5f));
  EXPECT_EQ(run_argmax(flat), 0);
}

TEST(ArgmaxCuda, MaxAtTheEnds) {
  KESTREL_REQUIRE_GPU();
  for (const int n : {32000, 32001, 128256}) {
    auto logits = random_half(n, -5.0f, 5.0f, 91);
    logits[n - 1] = float_to_half(100.0f);
    EXPECT_EQ(run_argmax(logits), n - 1) << "n " << n;
    logits[0] = float_to_half(200.0f);
    EXPECT_EQ(run_argmax(logits), 0) << "n " << n;
  }
}

// A verify pass's rows: each row's first maximum, NaN never winning and a row of -inf and NaN
// giving 0, over row lengths that are not a multiple of the block (8193) and row counts of one
// to a draft's worth.
TEST(ArgmaxCuda, RowsOfFp32LogitsEachTheirFirstMaximum) {
  KESTREL_REQUIRE_GPU();
  auto reference = [](const float* x, int n) {
    float best = -INFINITY;
    int idx = -1;
    for (int i = 0; i < n; ++i)
      if (x[i] > best) {  // false for NaN
        best = x[i];
        idx = i;
      }
    return idx < 0 ? 0 : idx;
  };
  for (const int n : {1, 7, 8192, 8193, 32000}) {
    for (const int rows : {1, 3, 9, 65}) {
      std::mt19937 rng(101 + n + rows);
      std::uniform_real_distribution<float> u(-30.0f, -1.0f);
      std::vector<float> x((size_t)rows * n);
      for (float& v : x) v = u(rng);
      for (int r = 0; r < rows; ++r) {
        float* row = x.data() + (size_t)r * n;
        switch (r % 5) {
          case 1: row[0] = NAN; break;                      // NaN first: not the answer
          case 2: row[n - 1] = 5.0f; row[n / 2] = 5.0f; break;  // a tie: the earlier one
          case 3: for (int i = 0; i < n; ++i) row[i] = (i % 2) ? NAN : -INFINITY; break;
          case 4: row[n - 1] = 100.0f; break;               // the last element
          default: break;
        }
      }
      Dev<float> d(x);
      Dev<int> out(rows);
      out.poison();
      cuda::argmax_rows_f32(d.get(), rows, n, out.get(), nullptr);
      const std::vector<int> got = out.download();
      for (int r = 0; r < rows; ++r)
        ASSERT_EQ(got[r], reference(x.data() + (size_t)r * n, n)) << "n " << n << " row " << r;
    }
  }
}

// Chained decoding: the argmax also becomes the next step's {token, pos + 1} and reaches a
// pinned host slot.
TEST(ArgmaxCuda, FeedsTheNextStepAndTheHost) {
  KESTREL_REQUIRE_GPU();
  for (const int n : {32000, 32001}) {
    const auto logits = random_half(n, -5.0f, 5.0f, 101 + n);
    Dev<uint16_t> d(logits);
    Dev<int> tok(1);
    Dev<int> feed(std::vector<int>{-1, 41});
    int* host = nullptr;
    ASSERT_EQ(cudaMallocHost(&host, sizeof(int)), cudaSuccess);
    *host = -1;
    cuda::argmax_f16(d.half(), n, tok.get(), nullptr, feed.get(), host);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const int want = first_argmax(logits);
    EXPECT_EQ(tok.download()[0], want) << "n " << n;
    EXPECT_EQ(feed.download(), (std::vector<int>{want, 42})) << "n " << n;
    EXPECT_EQ(*host, want) << "n " << n;
    cudaFreeHost(host);
  }
}

// The device's top-k draw against its CPU oracle (kernels/sampling/sample.h): for each draw
// i, the token whose interval of the oracle's cumulative distribution holds philox_uniform(seed,
// i) (a neighbour when u lies within 1e-6 of the boundary: the kernel's sums run in another
// order). Over vocabularies that break the blocks' chunks and loops, logits with many ties
// (the lowest ids win, across chunks too), NaN and -inf, fewer valid logits than k, and every
// cut-off. One workspace serves every call, as in the engine: each call must leave it reset.
TEST(SampleTopKCuda, DrawsWhatTheReferenceDraws) {
  KESTREL_REQUIRE_GPU();
  struct Case {
    int n;
    int shape;  // 0 random, 1 coarse steps (ties), 2 all equal, 3 NaN and -inf, 4 seven valid
    TopKSampling s;
  };
  auto sp = [](int k, float p, float m, float t) {
    TopKSampling s;
    s.top_k = k, s.top_p = p, s.min_p = m, s.temperature = t, s.seed = 1234 + k;
    return s;
  };
  const std::vector<Case> cases = {
      {32000, 0, sp(40, 0.95f, 0.05f, 0.8f)}, {32001, 0, sp(40, 0.95f, 0.05f, 0.8f)},
      {128256, 0, sp(256, 1.0f, 0.0f, 1.5f)}, {1000, 0, sp(1, 1.0f, 0.0f, 1.0f)},
      {32000, 1, sp(50, 0.9f, 0.0f, 1.0f)},   {32000, 1, sp(5, 0.5f, 0.0f, 1.0f)},
      {5000, 2, sp(10, 1.0f, 0.0f, 1.0f)},    {4097, 3, sp(40, 0.95f, 0.05f, 0.8f)},
      {7, 0, sp(40, 1.0f, 0.0f, 2.0f)},       {3000, 4, sp(40, 0.8f, 0.0f, 1.0f)},
      // Chunks of 2,048: one block exactly, a second of one logit, 64 blocks of longer chunks
      // (131,073: 2,056 each, the last short), the largest vocabulary, ties across chunks.
      {2048, 0, sp(40, 0.95f, 0.05f, 0.8f)},  {2049, 1, sp(256, 1.0f, 0.0f, 1.0f)},
      {131073, 3, sp(40, 0.95f, 0.0f, 0.7f)}, {kDeviceSampleMax, 0, sp(40, 0.95f, 0.05f, 0.8f)},
      {kDeviceSampleMax, 1, sp(256, 1.0f, 0.0f, 1.0f)}, {100000, 2, sp(256, 1.0f, 0.0f, 1.0f)},
  };
  const int kDraws = 48;
  Dev<uint8_t> ws(cuda::sample_top_k_workspace_bytes());  // one for every call, as the engine's
  cuda::sample_top_k_workspace_reset(ws.get(), nullptr);
  for (const Case& c : cases) {
    std::vector<uint16_t> x = random_half(c.n, -8.0f, 8.0f, 300 + c.n + c.shape);
    for (size_t i = 0; i < x.size(); ++i) {
      const float v = half_to_float(x[i]);
      if (c.shape == 1) x[i] = float_to_half(std::round(v * 2.0f) / 2.0f);
      if (c.shape == 2) x[i] = float_to_half(1.5f);
      if (c.shape == 3 && i % 7 == 3) x[i] = 0x7E00;            // NaN
      if (c.shape == 3 && i % 7 == 5) x[i] = 0xFC00;            // -inf
      if (c.shape == 4 && i % 400 != 9) x[i] = 0xFE00;          // NaN but every 400th
    }
    const std::string what = "n " + std::to_string(c.n) + " shape " + std::to_string(c.shape) +
                             " top_k " + std::to_string(c.s.top_k);
    SCOPED_TRACE(what);
    const std::vector<TopKCandidate> cand = top_k_candidates_ref(x.data(), c.n, c.s);
    ASSERT_FALSE(cand.empty());
    if (c.shape == 2) {
      for (size_t i = 0; i < cand.size(); ++i) ASSERT_EQ(cand[i].id, (int)i) << "ties: lowest ids";
    }
    Dev<uint16_t> d(x);
    Dev<int> tok(1);
    Dev<TopKSampling> params(std::vector<TopKSampling>{c.s});
    for (int i = 0; i < kDraws; ++i) {
      cuda::sample_top_k_f16(d.half(), c.n, params.get(), ws.get(), tok.get(), nullptr);
      const int got = tok.download()[0];
      ASSERT_TRUE(test::drawn_by(cand, got, philox_uniform(c.s.seed, i))) << "draw " << i;
    }
    EXPECT_EQ(params.download()[0].draws, (uint64_t)kDraws) << "one draw counted per call";
  }
}

TEST(SampleTopKCuda, FeedsTheNextStepAndTheHost) {
  KESTREL_REQUIRE_GPU();
  const auto logits = random_half(32000, -5.0f, 5.0f, 7);
  TopKSampling s;
  s.top_k = 40, s.top_p = 0.95f, s.min_p = 0.05f, s.temperature = 0.8f, s.seed = 99, s.draws = 5;
  Dev<uint16_t> d(logits);
  Dev<int> tok(1);
  Dev<int> feed(std::vector<int>{-1, 41});
  Dev<TopKSampling> params(std::vector<TopKSampling>{s});
  Dev<uint8_t> ws(cuda::sample_top_k_workspace_bytes());
  cuda::sample_top_k_workspace_reset(ws.get(), nullptr);
  int* host = nullptr;
  ASSERT_EQ(cudaMallocHost(&host, sizeof(int)), cudaSuccess);
  *host = -1;
  cuda::sample_top_k_f16(d.half(), 32000, params.get(), ws.get(), tok.get(), nullptr, feed.get(),
                         host);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const int want = sample_top_k_ref(logits.data(), 32000, s, philox_uniform(99, 5));
  EXPECT_EQ(tok.download()[0], want);
  EXPECT_EQ(feed.download(), (std::vector<int>{want, 42}));
  EXPECT_EQ(*host, want);
  EXPECT_EQ(params.download()[0].draws, 6u);
  cudaFreeHost(host);
}

TEST(SampleTopKCuda, RefusesVocabulariesPastItsLargest) {
  KESTREL_REQUIRE_GPU();
  Dev<uint16_t> d(kDeviceSampleMax + 1);
  Dev<int> tok(1);
  Dev<TopKSampling> params(std::vector<TopKSampling>{TopKSampling{}});
  Dev<uint8_t> ws(cuda::sample_top_k_workspace_bytes());
  EXPECT_THROW(cuda::sample_top_k_f16(d.half(), kDeviceSampleMax + 1, params.get(), ws.get(),
                                      tok.get(), nullptr),
               Error);
}

TEST(HalfToFloatCuda, ConvertsExactly) {
  KESTREL_REQUIRE_GPU();
  for (const int n : {1, 1000, 32001}) {
    const auto x = random_half(n, -60000.0f, 60000.0f, 101);
    Dev<uint16_t> dx(x);
    Dev<float> dy(n);
    dy.poison();
    cuda::half_to_float(dx.half(), dy.get(), n, nullptr);
    const auto got = dy.download();
    for (int i = 0; i < n; ++i) ASSERT_EQ(got[i], half_to_float(x[i])) << "n " << n << " i " << i;
  }
}

}  // namespace
}  // namespace kestrel
