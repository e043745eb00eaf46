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
//   - rope_kv_write_batch and attention_decode_batch (a batched decode step's rows over their
//     own sequences' caches, f16 and 8-bit): each row bitwise as the one-row kernels above on a
//     copy of its caches, and the 8-bit pairs' attention against attention_ref_kv too.
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
  size_t size() const { return n_; }
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

// ---- the batched decode step: rope_kv_write_batch and attention_decode_batch -------------------
//
// B sequences of their own contexts (some paged through scrambled tables, some contiguous),
// each cache two layers deep with layer 0 all NaN and the step run at layer 1, so that a row
// read at the wrong layer, sequence, block or position shows. The rows run in a shuffled order
// (d_rows) over two launches. Each row against the one-row kernels on a copy of the same caches
// with the same grid (bitwise: the batch changes which block computes what, never the
// arithmetic), and the attention of the 8-bit pairs also against the reference on the same
// codes. Row 0's context is shorter than the grid (as a short session's beside a long one):
// against the one-row kernel over its own context, within the decode test's tolerance. Every
// workspace's counters are back at zero after the step, as the sessions' own decode steps,
// which use the same workspaces, need them.

struct BatchKvCase {
  int head_dim, n_heads, n_kv_heads, window;
  std::vector<int> pos;  // each row's position
  int bound;             // the grid's positions (every row's context is at least this)
};

// One sequence's caches on the device, two layers of `c`'s layout: layer 0 all 0xFF bytes (NaN
// in every type), layer 1 c's data; its workspace for c.ctx positions.
struct BatchSeqDev {
  DevBytes k_data, v_data, k_scales, v_scales, ws;
  std::unique_ptr<DevBytes> table;
  int ctx;
  BatchSeqDev(const TestCache& k, const TestCache& v, int n_heads)
      : k_data(2 * cuda::kv_data_bytes(k.type, k.rows, k.n_kv_heads, k.head_dim)),
        v_data(2 * cuda::kv_data_bytes(v.type, v.rows, v.n_kv_heads, v.head_dim)),
        k_scales(2 * cuda::kv_scales_bytes(k.type, k.rows, k.n_kv_heads, k.head_dim)),
        v_scales(2 * cuda::kv_scales_bytes(v.type, v.rows, v.n_kv_heads, v.head_dim)),
        ws(cuda::attention_workspace_bytes(k.ctx, n_heads, k.head_dim)),
        table(device_table(k.blocks)),
        ctx(k.ctx) {
    put(k_data, k.device_data());
    put(v_data, v.device_data());
    if (k.type != KvType::F16) put(k_scales, k.scales);
    if (v.type != KvType::F16) put(v_scales, v.scales);
    cuda::attention_workspace_reset(ws.as<float>(), ctx, n_heads, k.head_dim, nullptr);
  }
  static void put(DevBytes& d, const std::vector<uint8_t>& layer1) {
    KESTREL_CUDA_CHECK(cudaMemset(d.get(), 0xFF, layer1.size()));
    KESTREL_CUDA_CHECK(cudaMemcpy(d.as<uint8_t>() + layer1.size(), layer1.data(), layer1.size(),
                                  cudaMemcpyHostToDevice));
  }
  cuda::KvBatchSeq seq(KvType kt, KvType vt, const TestCache& k, const TestCache& v) const {
    cuda::KvBatchSeq s;
    s.k_data = k_data.as<char>();
    s.v_data = v_data.as<char>();
    s.k_stride = cuda::kv_data_bytes(kt, k.rows, k.n_kv_heads, k.head_dim);
    s.v_stride = cuda::kv_data_bytes(vt, v.rows, v.n_kv_heads, v.head_dim);
    if (kt != KvType::F16) {
      s.k_scales = k_scales.as<char>();
      s.k_scales_stride = cuda::kv_scales_bytes(kt, k.rows, k.n_kv_heads, k.head_dim);
    }
    if (vt != KvType::F16) {
      s.v_scales = v_scales.as<char>();
      s.v_scales_stride = cuda::kv_scales_bytes(vt, v.rows, v.n_kv_heads, v.head_dim);
    }
    s.blocks = table ? table->as<int32_t>() : nullptr;
    s.workspace = ws.as<float>();
    s.ctx = ctx;
    return s;
  }
  // Layer 1 as the one-row kernels take it.
  cuda::KvCacheDev layer1(const DevBytes& data, const DevBytes& scales, KvType t,
                          const TestCache& c) const {
    return {t, data.as<char>() + cuda::kv_data_bytes(t, c.rows, c.n_kv_heads, c.head_dim),
            t == KvType::F16
                ? nullptr
                : scales.as<char>() + cuda::kv_scales_bytes(t, c.rows, c.n_kv_heads, c.head_dim),
            table ? table->as<int32_t>() : nullptr};
  }
};

// c's storage from layer 1 of a BatchSeqDev's arrays of layer_bytes each (its scales, of the
// same rows, after them in theirs).
void load_layer1(TestCache& c, const DevBytes& data, const DevBytes& scales, size_t layer_bytes) {
  const auto all = data.download<uint8_t>(2 * layer_bytes);
  if (c.type == KvType::F16) {
    for (size_t i = 0; i < c.values.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, &all[layer_bytes + 2 * i], 2);
      c.values[i] = half_to_float(h);
    }
    return;
  }
  c.codes.assign(all.begin() + layer_bytes, all.end());
  const size_t sb = c.scales.size();
  const auto sc = scales.download<uint8_t>(2 * sb);
  c.scales.assign(sc.begin() + sb, sc.end());
}

class BatchDecodeKvCuda : public ::testing::TestWithParam<BatchKvCase> {};

TEST_P(BatchDecodeKvCuda, EachRowAsTheOneRowKernelsAndTheReference) {
  KESTREL_REQUIRE_GPU();
  const BatchKvCase c = GetParam();
  const int hd = c.head_dim, B = (int)c.pos.size();
  const int64_t stride = (int64_t)(c.n_heads + 2 * c.n_kv_heads) * hd + 8;  // a padded row
  const size_t q_dim = (size_t)c.n_heads * hd;
  const int64_t out_stride = (int64_t)q_dim + 8;
  RopeScaling rope;
  rope.theta = 10000.0f;
  std::vector<int> ctxs(B);
  std::vector<std::vector<int32_t>> tables(B);
  for (int i = 0; i < B; ++i) {
    ctxs[i] = i == 0 ? c.pos[0] + 20 : c.bound + 37 * i;  // each its own; row 0's below the grid
    if (i % 2 == 1) tables[i] = test::scrambled_table(ctxs[i], 70 + i);
  }
  std::vector<int> order(B);  // the launch order: 1, 3, ..., then 0, 2, ...
  for (int j = 0, i = 1; i < B; i += 2) order[j++] = i;
  for (int j = B / 2, i = 0; i < B; i += 2) order[j++] = i;
  DevBytes dorder(order);
  const auto qkv = random_q((size_t)B * stride, 51);
  DevBytes dpos(c.pos);

  for (const KvType kt : kTypes)
    for (const KvType vt : kTypes) {
      const std::string what = types_name(kt, vt);
      const bool fused = kt == KvType::F16 && vt == KvType::F16;
      std::vector<TestCache> ks, vs;
      for (int i = 0; i < B; ++i) {
        ks.emplace_back(kt, ctxs[i], c.n_kv_heads, hd, tables[i]);
        vs.emplace_back(vt, ctxs[i], c.n_kv_heads, hd, tables[i]);
        fill_rows(ks[i], c.pos[i] + 1, 80 + i);
        fill_rows(vs[i], c.pos[i] + 1, 90 + i);
        const int first = c.window > 0 ? std::max(0, c.pos[i] + 1 - c.window) : 0;
        ks[i].poison_outside(first, c.pos[i] + 1);
        vs[i].poison_outside(first, c.pos[i] + 1);
      }
      // The batch's caches and, for the one-row kernels, a copy of each.
      std::vector<std::unique_ptr<BatchSeqDev>> batch, solo;
      std::vector<cuda::KvBatchSeq> seqs;
      for (int i = 0; i < B; ++i) {
        batch.push_back(std::make_unique<BatchSeqDev>(ks[i], vs[i], c.n_heads));
        solo.push_back(std::make_unique<BatchSeqDev>(ks[i], vs[i], c.n_heads));
        seqs.push_back(batch[i]->seq(kt, vt, ks[i], vs[i]));
      }
      DevBytes dseqs(B * sizeof(cuda::KvBatchSeq));
      KESTREL_CUDA_CHECK(cudaMemcpy(dseqs.get(), seqs.data(), B * sizeof(cuda::KvBatchSeq),
                                    cudaMemcpyHostToDevice));

      // The write (8-bit pairs: the step's kernel before the attention; f16: fused in it).
      DevBytes bq(qkv), sq(qkv);
      if (!fused) {
        cuda::rope_kv_write_batch(bq.as<__half>(), stride, B, dpos.as<int>(),
                                  dseqs.as<cuda::KvBatchSeq>(), 1, {kt, vt}, c.n_heads,
                                  c.n_kv_heads, hd, rope, nullptr);
        for (int i = 0; i < B; ++i)
          cuda::rope_kv_write_rows_kv(sq.as<__half>() + i * stride, stride, 1, 0,
                                      solo[i]->layer1(solo[i]->k_data, solo[i]->k_scales, kt, ks[i]),
                                      solo[i]->layer1(solo[i]->v_data, solo[i]->v_scales, vt, vs[i]),
                                      c.n_heads, c.n_kv_heads, hd, rope, nullptr,
                                      dpos.as<int>() + i);
        EXPECT_EQ(bq.download<uint16_t>(qkv.size()), sq.download<uint16_t>(qkv.size()))
            << what << ": q|k rotation";
      }
      // The attention.
      DevBytes bout((size_t)B * out_stride * 2), sout((size_t)B * out_stride * 2);
      KESTREL_CUDA_CHECK(cudaMemset(bout.get(), 0xFF, (size_t)B * out_stride * 2));
      KESTREL_CUDA_CHECK(cudaMemset(sout.get(), 0xFF, (size_t)B * out_stride * 2));
      for (const auto& [j0, n] : {std::pair{0, B / 2}, {B / 2, B - B / 2}})
        cuda::attention_decode_batch(bq.as<__half>(), stride, n, dorder.as<int>() + j0,
                                     dpos.as<int>(), dseqs.as<cuda::KvBatchSeq>(), 1, {kt, vt},
                                     fused, c.bound, c.window, c.n_heads, c.n_kv_heads, hd, rope,
                                     bout.as<__half>(), out_stride, nullptr);
      for (int i = 0; i < B; ++i) {
        const int bound = std::min(c.bound, ctxs[i]);
        const cuda::KvCacheDev k1 = solo[i]->layer1(solo[i]->k_data, solo[i]->k_scales, kt, ks[i]);
        const cuda::KvCacheDev v1 = solo[i]->layer1(solo[i]->v_data, solo[i]->v_scales, vt, vs[i]);
        __half* out = sout.as<__half>() + i * out_stride;
        if (fused)
          cuda::attention_decode_rope_f16(sq.as<__half>() + i * stride, k1, v1, dpos.as<int>() + i,
                                          ctxs[i], c.window, c.n_heads, c.n_kv_heads, hd, rope,
                                          solo[i]->ws.as<float>(), out, nullptr, nullptr, bound);
        else
          cuda::attention_decode_kv(sq.as<__half>() + i * stride, k1, v1, dpos.as<int>() + i,
                                    ctxs[i], c.window, c.n_heads, c.n_kv_heads, hd,
                                    solo[i]->ws.as<float>(), out, nullptr, nullptr, bound);
      }
      const auto got = bout.download<uint16_t>((size_t)B * out_stride);
      const auto want = sout.download<uint16_t>((size_t)B * out_stride);
      const auto rotated = bq.download<uint16_t>(qkv.size());
      for (int i = 0; i < B; ++i) {
        const std::string row = what + ", row " + std::to_string(i) + " at " +
                                std::to_string(c.pos[i]);
        const std::vector<uint16_t> g(got.begin() + i * out_stride,
                                      got.begin() + i * out_stride + q_dim);
        const std::vector<uint16_t> w(want.begin() + i * out_stride,
                                      want.begin() + i * out_stride + q_dim);
        if (ctxs[i] >= c.bound)
          EXPECT_EQ(g, w) << row << ": the one-row kernel's output";
        else  // another grid: the same values in another summation order
          expect_close(widen(g.data(), q_dim), widen(w.data(), q_dim), 1e-3,
                       row + ": the one-row kernel's output over its own context");
        // The merge's counters, after the other partials in the workspace: all zero again.
        const size_t ws_bytes = cuda::attention_workspace_bytes(ctxs[i], c.n_heads, hd);
        const auto ws = batch[i]->ws.download<uint8_t>(ws_bytes);
        EXPECT_EQ(std::vector<uint8_t>(ws.end() - c.n_heads * sizeof(int), ws.end()),
                  std::vector<uint8_t>(c.n_heads * sizeof(int), 0))
            << row << ": the workspace's counters";
        // Both layers of both caches as the one-row kernels left them: the new row written at
        // its block's row of layer 1, nothing else touched.
        for (const auto& [bd, sd] : {std::pair{&batch[i]->k_data, &solo[i]->k_data},
                                     {&batch[i]->v_data, &solo[i]->v_data},
                                     {&batch[i]->k_scales, &solo[i]->k_scales},
                                     {&batch[i]->v_scales, &solo[i]->v_scales}}) {
          EXPECT_EQ(bd->download<uint8_t>(bd->size()), sd->download<uint8_t>(sd->size()))
              << row << ": the caches";
        }
        if (!fused) {  // the reference over the written codes, from the rotated q
          TestCache k = ks[i], v = vs[i];
          const size_t kb = cuda::kv_data_bytes(kt, k.rows, c.n_kv_heads, hd);
          const size_t vb = cuda::kv_data_bytes(vt, v.rows, c.n_kv_heads, hd);
          load_layer1(k, batch[i]->k_data, batch[i]->k_scales, kb);
          load_layer1(v, batch[i]->v_data, batch[i]->v_scales, vb);
          const std::vector<float> qf = widen(rotated.data() + i * stride, q_dim);
          std::vector<float> ref(q_dim);
          const int first = c.window > 0 ? std::max(0, c.pos[i] + 1 - c.window) : 0;
          attention_ref_kv(qf.data(), k.ref(), v.ref(), c.n_heads, first, c.pos[i], ref.data());
          expect_close(widen(g.data(), q_dim), ref, 1e-3, row + ": the reference");
        }
      }
    }
}

std::vector<BatchKvCase> batch_cases() {
  std::vector<BatchKvCase> v;
  for (const int hd : {64, 128})
    for (const auto& [h, kv] : {std::pair{8, 8}, {8, 2}, {6, 2}, {4, 1}}) {
      // short chunks (a grid of up to 1,024 positions): a first token, a block's last position,
      // across chunks; long chunks past 1,024
      v.push_back({hd, h, kv, 0, {0, 15, 257, 33, 700}, 1024});
      v.push_back({hd, h, kv, 0, {1500, 2, 1024, 16}, 1600});
    }
  for (const int hd : {64, 128}) {  // Mistral's window
    v.push_back({hd, 8, 2, 100, {0, 150, 257, 99}, 300});
    v.push_back({hd, 8, 2, 300, {1500, 1, 400}, 1536});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, BatchDecodeKvCuda, ::testing::ValuesIn(batch_cases()),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return "hd" + std::to_string(p.head_dim) + "_h" +
                                  std::to_string(p.n_heads) + "_kv" +
                                  std::to_string(p.n_kv_heads) + "_win" +
                                  std::to_string(p.window) + "_bound" + std::to_string(p.bound) +
                                  "_rows" + std::to_string(p.pos.size());
                         });

TEST(BatchDecodeKvCuda, RefusesTheUnfusedF16PairTheFusedEightBitOnesAndBadHeadsPerBlock) {
  KESTREL_REQUIRE_GPU();
  DevBytes buf(1 << 16), dpos(std::vector<int>{0});
  const auto* seqs = static_cast<const cuda::KvBatchSeq*>(buf.get());
  EXPECT_THROW(cuda::attention_decode_batch(buf.as<__half>(), 4 * 64, 1, nullptr, dpos.as<int>(),
                                            seqs, 0, {KvType::F16, KvType::F16}, false, 16, 0, 2,
                                            1, 64, RopeScaling{}, buf.as<__half>(), 128, nullptr),
               Error);
  EXPECT_THROW(cuda::attention_decode_batch(buf.as<__half>(), 4 * 64, 1, nullptr, dpos.as<int>(),
                                            seqs, 0, {KvType::Q8_0, KvType::F16}, true, 16, 0, 2,
                                            1, 64, RopeScaling{}, buf.as<__half>(), 128, nullptr),
               Error);
  EXPECT_THROW(cuda::attention_decode_batch(buf.as<__half>(), 4 * 64, 1, nullptr, dpos.as<int>(),
                                            seqs, 0, {KvType::Q8_0, KvType::Q8_0}, false, 16, 0, 2,
                                            1, 64, RopeScaling{}, buf.as<__half>(), 128, nullptr,
                                            /*heads_per_block=*/3),
               Error);
}

}  // namespace
}  // namespace kestrel
