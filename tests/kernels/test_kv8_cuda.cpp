// The 8-bit KV cache's CUDA kernels (kernels/attention/kv_cache_cuda.h) against the plain C++
// references of kernels/attention/kv_quant.h:
//   - rope_kv_write_rows_kv: q and k rotated bitwise as rope_kv_write_rows_f16 rotates them (the
//     f16 kernel, itself tested against rope_ref), and the cache's codes and scales byte for
//     byte those KvLayerRef::write makes of the same fp16 k and v; every pair of types, head
//     dims 64 and 128, GQA, one token at a device position and chunks of rows; the default
//     RoPE, Llama 3's scaled frequencies and none (OPT's rotate = false);
//   - attention_decode_kv (flash-decoding) and attention_prefill_kv (tensor cores) over caches
//     written by KvLayerRef::write, against attention_ref_kv on the same codes and scales:
//     head dims 64 and 128, GQA, sliding windows, contexts and chunks that break the tiles;
//     the decode kernel also storing through an out_index (an act-order o's input order).
//     Rows the query must not see hold NaN scales (and fp8 NaN codes), so reading one fails.
//
// Tolerances. The dequantized values are the reference's exactly (code * scale in fp32); the
// decode kernel differs from the reference only by its summation order and its fp16 output
// (2^-11 relative), so 1e-3 normalised error as the f16 decode test. The prefill kernel also
// rounds each dequantized K/V value and P to fp16 for the tensor cores: 3e-3, as the f16
// prefill attention test.
#include <gtest/gtest.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/attention/attention_prefill_cuda.h"
#include "kernels/attention/kv_cache_cuda.h"
#include "kernels/attention/kv_quant.h"
#include "kernels/common/cuda_utils.h"
#include "kernels/rope/rope_rows_cuda.h"
#include "tests/support/gpu.h"
#include "tests/support/kv_table.h"

namespace kestrel {
namespace {

// A device buffer of bytes, freed on scope exit.
class DevBytes {
 public:
  explicit DevBytes(size_t n) : n_(std::max<size_t>(n, 16)) {
    KESTREL_CUDA_CHECK(cudaMalloc(&p_, n_));
    KESTREL_CUDA_CHECK(cudaMemset(p_, 0, n_));  // rows never written compare as zeros
  }
  template <class T>
  explicit DevBytes(const std::vector<T>& v) : DevBytes(v.size() * sizeof(T)) {
    upload(v);
  }
  ~DevBytes() { cudaFree(p_); }
  DevBytes(const DevBytes&) = delete;
  DevBytes& operator=(const DevBytes&) = delete;

  void* get() const { return p_; }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  template <class T>
  void upload(const std::vector<T>& v) {
    KESTREL_CUDA_CHECK(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> download(size_t n) const {
    std::vector<T> v(n);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), p_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

const KvType kTypes[] = {KvType::F16, KvType::Q8_0, KvType::Fp8};

std::string types_name(KvType k, KvType v) {
  return std::string("k_") + kv_type_name(k) + "_v_" + kv_type_name(v);
}

// Fails on any non-finite value, then on ||got - ref|| / ||ref|| > tol.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t bad = 0;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++bad;
      continue;
    }
    diff += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
    norm += (double)ref[i] * ref[i];
  }
  EXPECT_EQ(bad, 0u) << what << ": non-finite outputs";
  const double err = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  EXPECT_LE(err, tol) << what << ": normalised error";
}

std::vector<float> widen(const uint16_t* h, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = half_to_float(h[i]);
  return f;
}

// One layer's cache of ctx positions in type t, on the host in the reference's storage and on
// the device in the CUDA layout (kv_cache_cuda.h), contiguous or (with a block table,
// tests/support/kv_table.h) paged over a pool of rows. f16: fp32 values on the host, fp16 on the device (the values written are
// fp16-representable, so both hold the same numbers).
struct TestCache {
  KvType type;
  int ctx, n_kv_heads, head_dim;
  std::vector<int32_t> blocks;    // paged: the table (scrambled_table); contiguous: empty
  int64_t rows;                   // storage rows: ctx, or the pool's
  std::vector<float> values;      // f16
  std::vector<uint8_t> codes;     // q8_0, fp8
  std::vector<uint8_t> scales;    // their bytes: fp16 (q8_0) or fp32 (fp8)

  TestCache(KvType t, int ctx_, int n_kv, int hd, std::vector<int32_t> table = {})
      : type(t), ctx(ctx_), n_kv_heads(n_kv), head_dim(hd), blocks(std::move(table)) {
    rows = blocks.empty() ? ctx : test::pool_rows(blocks);
    const size_t kvd = (size_t)n_kv * hd;
    if (t == KvType::F16) {
      values.assign(rows * kvd, 0.0f);
    } else {
      codes.assign(rows * kvd, 0);
      scales.assign(cuda::kv_scales_bytes(t, rows, n_kv, hd), 0);
    }
  }
  KvLayerRef ref() {
    KvLayerRef r;
    r.type = type;
    r.n_kv_heads = n_kv_heads;
    r.head_dim = head_dim;
    r.values = values.data();
    r.codes = codes.data();
    r.scales = scales.data();
    r.blocks = blocks.empty() ? nullptr : blocks.data();
    return r;
  }
  // The storage as the device holds it: f16 values as fp16 bits, else the codes.
  std::vector<uint8_t> device_data() const {
    if (type != KvType::F16) return codes;
    std::vector<uint8_t> b(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t h = float_to_half(values[i]);
      std::memcpy(&b[2 * i], &h, 2);
    }
    return b;
  }
  // Makes every row but those of positions [first, end) unreadable (a paged cache's other
  // blocks and spare rows included): NaN values (f16), NaN scales (8-bit; fp8 codes NaN too),
  // so a kernel that reads one puts NaN in its output.
  void poison_outside(int first, int end) {
    const size_t kvd = (size_t)n_kv_heads * head_dim;
    const int64_t spr = kv_scales_per_row(type, n_kv_heads, head_dim);
    std::vector<bool> live(rows, false);
    for (int p = first; p < end; ++p) live[ref().row(p)] = true;
    for (int64_t p = 0; p < rows; ++p) {  // p: a storage row
      if (live[p]) continue;
      if (type == KvType::F16) {
        std::fill_n(values.begin() + p * kvd, kvd, std::nanf(""));
      } else if (type == KvType::Q8_0) {
        uint16_t* s = reinterpret_cast<uint16_t*>(scales.data()) + p * spr;
        std::fill_n(s, spr, (uint16_t)0x7E00);
      } else {
        float* s = reinterpret_cast<float*>(scales.data()) + p * spr;
        std::fill_n(s, spr, std::nanf(""));
        std::fill_n(codes.begin() + p * kvd, kvd, (uint8_t)0x7F);
      }
    }
  }
};

// The device copy of a TestCache. A paged one's K and V share one device table (`blocks`,
// which the kernels require of them): the caller's.
struct DevCache {
  DevBytes data, scales;
  explicit DevCache(const TestCache& c)
      : data(cuda::kv_data_bytes(c.type, c.rows, c.n_kv_heads, c.head_dim)),
        scales(cuda::kv_scales_bytes(c.type, c.rows, c.n_kv_heads, c.head_dim)) {
    data.upload(c.device_data());
    if (c.type != KvType::F16) scales.upload(c.scales);
  }
  cuda::KvCacheDev view(KvType t, const DevBytes* blocks = nullptr) const {
    return {t, data.get(), t == KvType::F16 ? nullptr : scales.get(),
            blocks ? blocks->as<int32_t>() : nullptr};
  }
};

// A table on the device, or none for a contiguous cache.
std::unique_ptr<DevBytes> device_table(const std::vector<int32_t>& table) {
  return table.empty() ? nullptr : std::make_unique<DevBytes>(table);
}

// Rows of random fp16-representable values, each head with its own magnitude (scales from
// 1e-3 to 4), and head 0 of position 3 all zeros (the zero scale).
void fill_rows(TestCache& c, int rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), mag(-3.0f, 0.6f);
  KvLayerRef r = c.ref();
  const int kvd = c.n_kv_heads * c.head_dim;
  std::vector<float> row(kvd);
  for (int p = 0; p < rows; ++p) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const float m = std::pow(10.0f, mag(rng));
      for (int d = 0; d < c.head_dim; ++d)
        row[h * c.head_dim + d] =
            p == 3 && h == 0 ? 0.0f : round_to_half(u(rng) * m);
    }
    r.write(p, row.data());
  }
}

// ---- rope_kv_write_rows_kv ---------------------------------------------------------------------

// The RoPE a model gives the write: the default (theta 10,000), Llama 3's (theta 500,000, low
// frequencies scaled by 1/8) or none (rotate = false: the identity, OPT's learned positions).
enum class RopeKind { Default, Llama3, None };

struct WriteCase {
  int head_dim, n_heads, n_kv_heads, T, pos0;
  bool device_pos;
  RopeKind rope = RopeKind::Default;
  bool paged = false;  // through a scrambled block table (scrambled_table)
};

class KvWriteCuda : public ::testing::TestWithParam<WriteCase> {};

TEST_P(KvWriteCuda, RotatesAsTheF16KernelAndRoundsAsTheReference) {
  KESTREL_REQUIRE_GPU();
  const WriteCase c = GetParam();
  const int hd = c.head_dim, kvd = c.n_kv_heads * hd;
  const int64_t stride = (int64_t)(c.n_heads + 2 * c.n_kv_heads) * hd + 8;  // a padded row
  const int ctx = c.pos0 + c.T + 5;
  RopeScaling rope;
  rope.theta = 10000.0f;
  if (c.rope == RopeKind::Llama3) rope.theta = 500000.0f, rope.llama3_factor = 8.0f;
  if (c.rope == RopeKind::None) rope.rotate = false;
  // q|k|v rows: each head its own magnitude; the k and v heads of row 1 (when there is one)
  // all zeros, so that a zero scale is written.
  std::mt19937 rng(7 + c.T);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), mag(-2.5f, 0.7f);
  std::vector<uint16_t> qkv((size_t)c.T * stride, 0);
  for (int t = 0; t < c.T; ++t)
    for (int h = 0; h < c.n_heads + 2 * c.n_kv_heads; ++h) {
      const float m = std::pow(10.0f, mag(rng));
      const bool zero = t == 1 && h >= c.n_heads;
      for (int d = 0; d < hd; ++d)
        qkv[t * stride + h * hd + d] = float_to_half(zero ? 0.0f : u(rng) * m);
    }

  // The f16 kernel: the rotation and the fp16 K/V rows every type is rounded from.
  DevBytes a(qkv), kf(cuda::kv_data_bytes(KvType::F16, ctx, c.n_kv_heads, hd)),
      vf(cuda::kv_data_bytes(KvType::F16, ctx, c.n_kv_heads, hd));
  DevBytes dpos(std::vector<int>{c.pos0});
  const int* d_pos0 = c.device_pos ? dpos.as<int>() : nullptr;
  const int host_pos0 = c.device_pos ? 0 : c.pos0;
  cuda::rope_kv_write_rows_f16(a.as<__half>(), stride, c.T, host_pos0, kf.as<__half>(),
                               vf.as<__half>(), c.n_heads, c.n_kv_heads, hd, rope, nullptr,
                               d_pos0);
  const auto rotated = a.download<uint16_t>(qkv.size());
  const auto k16 = kf.download<uint16_t>((size_t)ctx * kvd);
  const auto v16 = vf.download<uint16_t>((size_t)ctx * kvd);
  // What makes the comparisons below able to fail: without rotation q|k stay as they came, bit
  // for bit; Llama 3's scaling rotates otherwise than the same theta unscaled does.
  if (c.rope == RopeKind::None) {
    EXPECT_EQ(rotated, qkv) << "rotate = false";
  } else if (c.rope == RopeKind::Llama3) {
    RopeScaling unscaled = rope;
    unscaled.llama3_factor = 0.0f;
    DevBytes u(qkv), uk(cuda::kv_data_bytes(KvType::F16, ctx, c.n_kv_heads, hd)),
        uv(cuda::kv_data_bytes(KvType::F16, ctx, c.n_kv_heads, hd));
    cuda::rope_kv_write_rows_f16(u.as<__half>(), stride, c.T, host_pos0, uk.as<__half>(),
                                 uv.as<__half>(), c.n_heads, c.n_kv_heads, hd, unscaled, nullptr,
                                 d_pos0);
    EXPECT_NE(u.download<uint16_t>(qkv.size()), rotated) << "Llama 3's scaling changes nothing";
  }

  // Paged: K and V rows at their blocks' rows of a pool, through a table of their own each (the
  // write takes K and V as two caches), every row elsewhere left zero.
  const std::vector<int32_t> none;
  const std::vector<int32_t> k_table = c.paged ? test::scrambled_table(ctx, 11) : none;
  const std::vector<int32_t> v_table = c.paged ? test::scrambled_table(ctx, 12) : none;
  const auto dk_table = device_table(k_table), dv_table = device_table(v_table);
  for (const KvType kt : kTypes)
    for (const KvType vt : kTypes) {
      const std::string what = types_name(kt, vt);
      TestCache kref(kt, ctx, c.n_kv_heads, hd, k_table), vref(vt, ctx, c.n_kv_heads, hd, v_table);
      for (int t = 0; t < c.T; ++t) {
        const size_t row = (size_t)(c.pos0 + t) * kvd;
        kref.ref().write(c.pos0 + t, widen(k16.data() + row, kvd).data());
        vref.ref().write(c.pos0 + t, widen(v16.data() + row, kvd).data());
      }
      DevBytes b(qkv);
      DevCache kd(TestCache(kt, ctx, c.n_kv_heads, hd, k_table)),
          vd(TestCache(vt, ctx, c.n_kv_heads, hd, v_table));
      cuda::rope_kv_write_rows_kv(b.as<__half>(), stride, c.T, host_pos0,
                                  kd.view(kt, dk_table.get()), vd.view(vt, dv_table.get()),
                                  c.n_heads, c.n_kv_heads, hd, rope, nullptr, d_pos0);
      EXPECT_EQ(b.download<uint16_t>(qkv.size()), rotated) << what << ": q|k rotation";
      const std::pair<const TestCache*, const DevCache*> sides[] = {{&kref, &kd}, {&vref, &vd}};
      for (int s = 0; s < 2; ++s) {
        const TestCache& r = *sides[s].first;
        const DevCache& d = *sides[s].second;
        const char* side = s == 0 ? "K" : "V";
        // f16: the bits of the f16 kernel's rows (the reference holds them), each at its row.
        const std::vector<uint8_t> want = r.device_data();
        EXPECT_EQ(d.data.download<uint8_t>(want.size()), want) << what << " " << side << " data";
        if (r.type != KvType::F16)
          EXPECT_EQ(d.scales.download<uint8_t>(r.scales.size()), r.scales)
              << what << " " << side << " scales";
      }
    }
}

std::vector<WriteCase> write_cases() {
  std::vector<WriteCase> v;
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{8, 8}, {8, 2}, {4, 1}}) {
      v.push_back({hd, h, kv, 1, 0, true});      // a decode step at a device position
      v.push_back({hd, h, kv, 1, 1000, true});
      v.push_back({hd, h, kv, 67, 0, false});    // a prompt chunk
      v.push_back({hd, h, kv, 13, 300, true});   // a verify pass over a written cache
    }
  for (const int hd : {64, 128})
    for (const RopeKind r : {RopeKind::Llama3, RopeKind::None}) {
      v.push_back({hd, 8, 2, 1, 1000, true, r});
      v.push_back({hd, 8, 2, 13, 300, true, r});
      v.push_back({hd, 4, 1, 67, 0, false, r});
    }
  // Paged: a block's last position; rows across one block boundary, and across four.
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{8, 8}, {8, 2}, {4, 1}}) {
      v.push_back({hd, h, kv, 1, 1007, true, RopeKind::Default, true});
      v.push_back({hd, h, kv, 13, 300, true, RopeKind::Default, true});
      v.push_back({hd, h, kv, 67, 5, false, RopeKind::Default, true});
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, KvWriteCuda, ::testing::ValuesIn(write_cases()),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "hd" + std::to_string(p.head_dim) + "_h" +
                                  std::to_string(p.n_heads) + "_kv" +
                                  std::to_string(p.n_kv_heads) + "_T" + std::to_string(p.T) +
                                  "_pos" + std::to_string(p.pos0) +
                                  (p.device_pos ? "_dev" : "_host") +
                                  (p.rope == RopeKind::Llama3 ? "_llama3"
                                   : p.rope == RopeKind::None ? "_norot"
                                                              : "") +
                                  (p.paged ? "_paged" : "");
                         });

TEST(KvWriteCuda, RefusesAMissingScaleBufferAndAnUncompiledHeadDim) {
  KESTREL_REQUIRE_GPU();
  DevBytes buf(1 << 16);
  const cuda::KvCacheDev f16{KvType::F16, buf.get(), nullptr};
  const cuda::KvCacheDev no_scales{KvType::Q8_0, buf.get(), nullptr};
  EXPECT_THROW(cuda::rope_kv_write_rows_kv(buf.as<__half>(), 4 * 64, 1, 0, no_scales, f16, 2, 1,
                                           64, RopeScaling{}, nullptr),
               Error);
  EXPECT_THROW(cuda::rope_kv_write_rows_kv(buf.as<__half>(), 4 * 96, 1, 0, f16, f16, 2, 1, 96,
                                           RopeScaling{}, nullptr),
               Error);
}

// ---- attention over the caches ------------------------------------------------------------------

struct AttnKvCase {
  int head_dim, n_heads, n_kv_heads, n_ctx, window;
  // Output e stored at out[out_index[e]], a shuffle of [0, n_heads * head_dim) (the decode
  // step passes an act-order o's input order), read back through it.
  bool out_index = false;
  bool paged = false;  // K and V through one scrambled block table over max_ctx positions
};

// q [n_heads, head_dim] at position n_ctx - 1 (or a chunk's rows) in [-3, 3]: scores of
// standard deviation about 1 over keys of magnitude up to 4.
std::vector<uint16_t> random_q(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<uint16_t> q(n);
  for (auto& x : q) x = float_to_half(u(rng) * 0.5f);
  return q;
}

class AttentionDecodeKvCuda : public ::testing::TestWithParam<AttnKvCase> {};

TEST_P(AttentionDecodeKvCuda, MatchesTheReferenceOnTheSameCodes) {
  KESTREL_REQUIRE_GPU();
  const AttnKvCase c = GetParam();
  const int hd = c.head_dim;
  const int max_ctx = c.n_ctx + 300;  // grids past the context
  const int first = c.window > 0 ? std::max(0, c.n_ctx - c.window) : 0;
  const auto q = random_q((size_t)c.n_heads * hd, 41);
  const std::vector<float> qf = widen(q.data(), q.size());
  const size_t n_out = (size_t)c.n_heads * hd;
  DevBytes dq(q), dout(n_out * 2), dpos(std::vector<int>{c.n_ctx - 1});
  DevBytes ws(cuda::attention_workspace_bytes(max_ctx, c.n_heads, hd));
  cuda::attention_workspace_reset(ws.as<float>(), max_ctx, c.n_heads, hd, nullptr);
  std::vector<int32_t> perm(n_out);
  for (size_t e = 0; e < n_out; ++e) perm[e] = (int32_t)e;
  if (c.out_index) std::shuffle(perm.begin(), perm.end(), std::mt19937(61));
  DevBytes dperm(perm);
  const int32_t* out_index = c.out_index ? dperm.as<int32_t>() : nullptr;
  const std::vector<int32_t> table =
      c.paged ? test::scrambled_table(max_ctx, 21) : std::vector<int32_t>();
  const auto dtable = device_table(table);

  for (const KvType kt : kTypes)
    for (const KvType vt : kTypes) {
      TestCache k(kt, max_ctx, c.n_kv_heads, hd, table), v(vt, max_ctx, c.n_kv_heads, hd, table);
      fill_rows(k, max_ctx, 42);
      fill_rows(v, max_ctx, 43);
      std::vector<float> ref((size_t)c.n_heads * hd);
      attention_ref_kv(qf.data(), k.ref(), v.ref(), c.n_heads, first, c.n_ctx - 1, ref.data());
      k.poison_outside(first, c.n_ctx);
      v.poison_outside(first, c.n_ctx);
      DevCache dk(k), dv(v);
      // Every compiled number of query heads per block, grids bounded at the cache's length
      // and at the context (short and long chunks past 1,024 positions).
      for (const int heads : {0, 1, 2, 4})
        for (const int bound : {0, c.n_ctx}) {
          const std::string what = types_name(kt, vt) + ", heads per block " +
                                   std::to_string(heads) + ", bound " + std::to_string(bound);
          // NaN (0xFFFF) in every output first: one the kernel leaves unwritten fails.
          KESTREL_CUDA_CHECK(cudaMemset(dout.get(), 0xFF, n_out * 2));
          cuda::attention_decode_kv(dq.as<__half>(), dk.view(kt, dtable.get()),
                                    dv.view(vt, dtable.get()), dpos.as<int>(),
                                    max_ctx, c.window, c.n_heads, c.n_kv_heads, hd,
                                    ws.as<float>(), dout.as<__half>(), nullptr, out_index, bound,
                                    heads);
          const auto out = dout.download<uint16_t>(n_out);
          std::vector<float> got(n_out);
          for (size_t e = 0; e < n_out; ++e) got[e] = half_to_float(out[perm[e]]);
          expect_close(got, ref, 1e-3, what);
        }
    }
}

std::vector<AttnKvCase> decode_cases() {
  std::vector<AttnKvCase> v;
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{8, 8}, {8, 2}, {6, 2}, {4, 1}})
      for (const int n : {1, 2, 33, 257, 1000, 1500}) v.push_back({hd, h, kv, n, 0});
  for (const int hd : {64, 128}) {  // Mistral's window: inside a chunk, across chunks, past it
    v.push_back({hd, 8, 2, 1000, 100});
    v.push_back({hd, 8, 2, 1500, 300});
    v.push_back({hd, 6, 2, 257, 256});
    v.push_back({hd, 4, 1, 100, 4096});
  }
  for (const int hd : {64, 128}) {  // an act-order o's input order, short and long grids
    v.push_back({hd, 8, 2, 257, 0, true});
    v.push_back({hd, 8, 2, 1500, 0, true});
    v.push_back({hd, 4, 1, 1000, 100, true});
  }
  // Paged: contexts inside one block, across blocks at short and long chunks, windows starting
  // inside a block.
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{8, 8}, {8, 2}, {6, 2}, {4, 1}})
      for (const int n : {1, 17, 257, 1500}) v.push_back({hd, h, kv, n, 0, false, true});
  for (const int hd : {64, 128}) {
    v.push_back({hd, 8, 2, 1000, 100, false, true});
    v.push_back({hd, 8, 2, 1500, 300, true, true});
    v.push_back({hd, 6, 2, 257, 251, false, true});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionDecodeKvCuda, ::testing::ValuesIn(decode_cases()),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "hd" + std::to_string(p.head_dim) + "_h" +
                                  std::to_string(p.n_heads) + "_kv" +
                                  std::to_string(p.n_kv_heads) + "_ctx" +
                                  std::to_string(p.n_ctx) + "_win" + std::to_string(p.window) +
                                  (p.out_index ? "_outidx" : "") + (p.paged ? "_paged" : "");
                         });

TEST(AttentionDecodeKvCuda, RefusesAnEightBitCacheWithoutScales) {
  KESTREL_REQUIRE_GPU();
  DevBytes buf(1 << 16), dpos(std::vector<int>{0});
  DevBytes ws(cuda::attention_workspace_bytes(8, 2, 64));
  const cuda::KvCacheDev f16{KvType::F16, buf.get(), nullptr};
  const cuda::KvCacheDev fp8{KvType::Fp8, buf.get(), nullptr};
  EXPECT_THROW(cuda::attention_decode_kv(buf.as<__half>(), f16, fp8, dpos.as<int>(), 8, 0, 2, 1,
                                         64, ws.as<float>(), buf.as<__half>(), nullptr),
               Error);
}

TEST(AttentionKvCuda, RefusesKAndVUnderDifferentBlockTables) {
  KESTREL_REQUIRE_GPU();
  DevBytes buf(1 << 16), dpos(std::vector<int>{0}), table(std::vector<int32_t>{0});
  DevBytes ws(cuda::attention_workspace_bytes(8, 2, 64));
  const cuda::KvCacheDev paged{KvType::F16, buf.get(), nullptr, table.as<int32_t>()};
  const cuda::KvCacheDev contiguous{KvType::F16, buf.get(), nullptr};
  EXPECT_THROW(cuda::attention_decode_kv(buf.as<__half>(), paged, contiguous, dpos.as<int>(), 8,
                                         0, 2, 1, 64, ws.as<float>(), buf.as<__half>(), nullptr),
               Error);
  EXPECT_THROW(cuda::attention_decode_rope_f16(buf.as<__half>(), contiguous, paged,
                                               dpos.as<int>(), 8, 0, 2, 1, 64, RopeScaling{},
                                               ws.as<float>(), buf.as<__half>(), nullptr),
               Error);
  EXPECT_THROW(cuda::attention_prefill_kv(buf.as<__half>(), 4 * 64, paged, contiguous, 0, 1, 0,
                                          2, 1, 64, buf.as<__half>(), nullptr),
               Error);
}

struct PrefillKvCase {
  int head_dim, n_heads, n_kv_heads, pos0, T, window;
  bool device_pos;
  bool paged = false;  // K and V through one scrambled block table (f16 with f16 too)
};

class AttentionPrefillKvCuda : public ::testing::TestWithParam<PrefillKvCase> {};

TEST_P(AttentionPrefillKvCuda, EveryQueryMatchesTheReferenceOnTheSameCodes) {
  KESTREL_REQUIRE_GPU();
  const PrefillKvCase c = GetParam();
  const int hd = c.head_dim, q_dim = c.n_heads * hd;
  const int ctx = c.pos0 + c.T + 70;  // rows past the chunk: never read
  const int64_t q_stride = q_dim + 2 * c.n_kv_heads * hd;  // the fused qkv row
  const auto qrows = random_q((size_t)c.T * q_stride, 51);
  DevBytes dq(qrows), dout((size_t)c.T * q_dim * 2), dpos(std::vector<int>{c.pos0});
  // Rows before every query's window and past the chunk are unreadable.
  const int first_any = c.window > 0 ? std::max(0, c.pos0 + 1 - c.window) : 0;
  const std::vector<int32_t> table =
      c.paged ? test::scrambled_table(ctx, 31) : std::vector<int32_t>();
  const auto dtable = device_table(table);

  for (const KvType kt : kTypes)
    for (const KvType vt : kTypes) {
      // Contiguous f16 with f16: attention_prefill_f16's tests (the same kernel). A paged f16
      // cache runs through here only.
      if (kt == KvType::F16 && vt == KvType::F16 && !c.paged) continue;
      TestCache k(kt, ctx, c.n_kv_heads, hd, table), v(vt, ctx, c.n_kv_heads, hd, table);
      fill_rows(k, ctx, 52);
      fill_rows(v, ctx, 53);
      std::vector<float> ref((size_t)c.T * q_dim);
      for (int t = 0; t < c.T; ++t) {
        const int last = c.pos0 + t;
        const int first = c.window > 0 ? std::max(0, last + 1 - c.window) : 0;
        const std::vector<float> qt = widen(qrows.data() + t * q_stride, q_dim);
        attention_ref_kv(qt.data(), k.ref(), v.ref(), c.n_heads, first, last,
                         ref.data() + (size_t)t * q_dim);
      }
      k.poison_outside(first_any, c.pos0 + c.T);
      v.poison_outside(first_any, c.pos0 + c.T);
      DevCache dk(k), dv(v);
      cuda::attention_prefill_kv(dq.as<__half>(), q_stride, dk.view(kt, dtable.get()),
                                 dv.view(vt, dtable.get()),
                                 c.device_pos ? 0 : c.pos0, c.T, c.window, c.n_heads,
                                 c.n_kv_heads, hd, dout.as<__half>(), nullptr,
                                 c.device_pos ? dpos.as<int>() : nullptr);
      const auto out = dout.download<uint16_t>((size_t)c.T * q_dim);
      expect_close(widen(out.data(), out.size()), ref, 3e-3, types_name(kt, vt));
    }
}

std::vector<PrefillKvCase> prefill_cases() {
  std::vector<PrefillKvCase> v;
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{4, 4}, {8, 2}, {4, 1}}) {
      v.push_back({hd, h, kv, 0, 1, 0, false});
      v.push_back({hd, h, kv, 0, 65, 0, false});    // two query tiles, two key tiles
      v.push_back({hd, h, kv, 37, 130, 0, false});  // a chunk over a cache already written
      v.push_back({hd, h, kv, 200, 9, 0, true});    // a verify pass at a device position
    }
  for (const int hd : {64, 128}) {  // Mistral's window
    v.push_back({hd, 8, 2, 0, 130, 32, false});
    v.push_back({hd, 8, 2, 100, 70, 50, true});
  }
  // Paged: a prompt from 0, a chunk over a cache already written, a verify pass at a device
  // position, windows starting inside a block.
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{4, 4}, {8, 2}, {4, 1}}) {
      v.push_back({hd, h, kv, 0, 65, 0, false, true});
      v.push_back({hd, h, kv, 37, 130, 0, false, true});
      v.push_back({hd, h, kv, 200, 9, 0, true, true});
    }
  for (const int hd : {64, 128}) {
    v.push_back({hd, 8, 2, 0, 130, 35, false, true});
    v.push_back({hd, 8, 2, 100, 70, 50, true, true});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionPrefillKvCuda, ::testing::ValuesIn(prefill_cases()),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "hd" + std::to_string(p.head_dim) + "_h" +
                                  std::to_string(p.n_heads) + "_kv" +
                                  std::to_string(p.n_kv_heads) + "_pos" +
                                  std::to_string(p.pos0) + "_T" + std::to_string(p.T) + "_win" +
                                  std::to_string(p.window) + (p.device_pos ? "_dev" : "") +
                                  (p.paged ? "_paged" : "");
                         });

}  // namespace
}  // namespace kestrel
