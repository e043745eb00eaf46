// Plain C++ reference of the KV cache's types (kv_quant.h): the rounding of q8_0 and FP8 E4M3,
// one layer's cache written and read in the CPU engine's storage, and attention over it.
#include "kernels/attention/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "kernels/activation/activation.h"
#include "kernels/attention/attention.h"

namespace kestrel {

const char* kv_type_name(KvType t) {
  switch (t) {
    case KvType::F16: return "f16";
    case KvType::Q8_0: return "q8_0";
    case KvType::Fp8: return "fp8";
  }
  return "?";
}

KvType parse_kv_type(const std::string& name, const std::string& option) {
  for (KvType t : {KvType::F16, KvType::Q8_0, KvType::Fp8})
    if (name == kv_type_name(t)) return t;
  throw Error(option + ": unknown cache type '" + name + "' (f16, q8_0 or fp8)");
}

std::string kv_type_unsupported(KvType t, int head_dim) {
  if (t == KvType::Q8_0 && head_dim % kQ8Block != 0)
    return "q8_0 stores blocks of 32 values of a head, and this model's heads have " +
           std::to_string(head_dim);
  return "";
}

int64_t kv_scales_per_row(KvType t, int n_kv_heads, int head_dim) {
  switch (t) {
    case KvType::F16: return 0;
    case KvType::Q8_0: return (int64_t)n_kv_heads * head_dim / kQ8Block;
    case KvType::Fp8: return n_kv_heads;
  }
  return 0;
}

size_t kv_scale_bytes(KvType t) {
  return t == KvType::Q8_0 ? sizeof(uint16_t) : t == KvType::Fp8 ? sizeof(float) : 0;
}

size_t kv_row_bytes(KvType t, int n_kv_heads, int head_dim, size_t f16_value_bytes) {
  const size_t values = (size_t)n_kv_heads * head_dim;
  if (t == KvType::F16) return values * f16_value_bytes;
  return values + (size_t)kv_scales_per_row(t, n_kv_heads, head_dim) * kv_scale_bytes(t);
}

// ---- FP8 E4M3 ------------------------------------------------------------------------------
//   bit  7    6 5 4 3    2 1 0
//        S    E E E E    M M M      E > 0: (-1)^S 2^(E-7) (1 + M/8); E = 0: (-1)^S 2^-6 (M/8)
//                                   S.1111.111 is NaN; there are no infinities
// The codes of one sign are in the order of their values, so a magnitude rounded to a multiple
// of its binade's step and written as (E + 7) * 8 + M carries a mantissa of 8 into the next
// exponent by itself, and subnormals (step 2^-9) continue into the normals at 0x08 = 2^-6.

uint8_t fp8_e4m3_from_float(float x) {
  // Every NaN is the positive one, 0x7F, as the device's conversion (cvt.rn.satfinite.e4m3x2)
  // writes it: a K or V value of inf makes inf / inf, a NaN whose sign the host sets.
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= kFp8Max) return sign | 0x7E;  // saturate (SATFINITE): 448 = 0.1111.110
  if (a == 0.0f) return sign;             // frexp's exponent of 0 names no binade
  int e;
  std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): the binade's exponent is e - 1
  const int binade = std::max(e - 1, -6);        // below 2^-6 the step stays 2^-9
  // nearbyint rounds ties to even under the default rounding mode; a * 2^(3 - binade) is exact.
  const int steps = (int)std::nearbyint(std::ldexp(a, 3 - binade));  // a / step
  // Subnormal binade: the code is the step count (0 .. 8, 8 being 2^-6 = 0x08). Normal:
  // steps in [8, 16]; 16 carries into the next binade, which stays below 448 since a < 448.
  const int code = binade == -6 ? steps : (binade + 7) * 8 + (steps - 8);
  return sign | (uint8_t)code;
}

float fp8_e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7) v = std::nanf("");
  else if (e == 0) v = std::ldexp((float)m, -9);
  else v = std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

// ---- q8_0 and fp8 vectors -----------------------------------------------------------------

void quantize_q8_0_ref(const float* x, int64_t n, int8_t* q, uint16_t* d) {
  for (int64_t b = 0; b < n / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.0f;
    for (int j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
    // llama.cpp's quantize_row_q8_0_ref: the code from the fp32 scale's inverse, the scale
    // stored in fp16. roundf takes halves away from zero.
    const float scale = amax / 127.0f;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    d[b] = float_to_half(scale);
    // A NaN value's code is 0, as the device's conversion to int makes it (a cast of NaN is
    // undefined in C++).
    for (int j = 0; j < kQ8Block; ++j) {
      const float v = xb[j] * inv;
      q[b * kQ8Block + j] = std::isnan(v) ? 0 : (int8_t)std::roundf(v);
    }
  }
}

void dequantize_q8_0_ref(const int8_t* q, const uint16_t* d, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = (float)q[i] * half_to_float(d[i / kQ8Block]);
}

void quantize_fp8_ref(const float* x, int64_t n, uint8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / kFp8Max;
  *scale = s;
  // x / s, not x * (1 / s): the quotient of the largest value is 448 exactly (amax / (amax /
  // 448) rounds to 448 in fp32), and a CUDA kernel divides the same way (__fdiv_rn).
  for (int64_t i = 0; i < n; ++i) q[i] = s != 0.0f ? fp8_e4m3_from_float(x[i] / s) : 0;
}

void dequantize_fp8_ref(const uint8_t* q, float scale, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp8_e4m3_to_float(q[i]) * scale;
}

// ---- One layer's cache ----------------------------------------------------------------------

void KvLayerRef::write(int64_t p, const float* row) const {
  const int64_t kvd = kv_dim(), pos = this->row(p);
  switch (type) {
    case KvType::F16:
      std::memcpy(values + pos * kvd, row, kvd * sizeof(float));
      return;
    case KvType::Q8_0: {
      const int64_t spr = kv_scales_per_row(type, n_kv_heads, head_dim);
      quantize_q8_0_ref(row, kvd, reinterpret_cast<int8_t*>(codes + pos * kvd),
                        static_cast<uint16_t*>(scales) + pos * spr);
      return;
    }
    case KvType::Fp8:
      for (int h = 0; h < n_kv_heads; ++h)
        quantize_fp8_ref(row + (int64_t)h * head_dim, head_dim, codes + pos * kvd + (int64_t)h * head_dim,
                         static_cast<float*>(scales) + pos * n_kv_heads + h);
      return;
  }
}

void KvLayerRef::read(int64_t p0, int64_t p1, int head, float* out) const {
  const int64_t kvd = kv_dim(), off = (int64_t)head * head_dim;
  for (int64_t i = p0; i < p1; ++i) {
    float* o = out + (i - p0) * head_dim;
    const int64_t p = row(i);
    switch (type) {
      case KvType::F16:
        std::memcpy(o, values + p * kvd + off, head_dim * sizeof(float));
        break;
      case KvType::Q8_0: {
        const int64_t spr = kv_scales_per_row(type, n_kv_heads, head_dim);
        dequantize_q8_0_ref(reinterpret_cast<const int8_t*>(codes + p * kvd + off),
                            static_cast<const uint16_t*>(scales) + p * spr + off / kQ8Block,
                            head_dim, o);
        break;
      }
      case KvType::Fp8:
        dequantize_fp8_ref(codes + p * kvd + off,
                           static_cast<const float*>(scales)[p * n_kv_heads + head], head_dim, o);
        break;
    }
  }
}

void attention_ref_kv(const float* q, const KvLayerRef& k, const KvLayerRef& v, int n_heads,
                      int64_t first, int64_t last, float* out) {
  const int n_kv = k.n_kv_heads, hd = k.head_dim;
  const int64_t n = last - first + 1;
  if (k.type == KvType::F16 && v.type == KvType::F16 && !k.blocks && !v.blocks) {
    // The fp32 cache as it always was. (A paged one takes the path below: the same arithmetic,
    // its rows gathered first.)
    attention_ref(q, k.values + first * k.kv_dim(), v.values + first * v.kv_dim(), n_heads, n_kv,
                  hd, n, out);
    return;
  }
  KESTREL_CHECK(n_kv > 0 && n_heads % n_kv == 0 && n > 0,
                "attention_ref_kv: " + std::to_string(n_heads) + " heads over " +
                    std::to_string(n_kv) + " KV heads and " + std::to_string(n) + " positions");
  // attention_ref's arithmetic, each KV head's rows dequantized once for the query heads of
  // its group.
  const int group = n_heads / n_kv;
  const float scale = 1.0f / std::sqrt((float)hd);
  std::vector<float> kh((size_t)n * hd), vh((size_t)n * hd), p(n);  // [n, hd], [n, hd], [n]
  for (int g = 0; g < n_kv; ++g) {
    k.read(first, last + 1, g, kh.data());
    v.read(first, last + 1, g, vh.data());
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const float* qh = q + (int64_t)h * hd;
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kh.data() + t * hd;
        float dot = 0.0f;
        for (int d = 0; d < hd; ++d) dot += qh[d] * kt[d];
        p[t] = dot * scale;
      }
      softmax_ref(p.data(), n);
      float* oh = out + (int64_t)h * hd;
      for (int d = 0; d < hd; ++d) oh[d] = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = vh.data() + t * hd;
        for (int d = 0; d < hd; ++d) oh[d] += p[t] * vt[d];
      }
    }
  }
}

}  // namespace kestrel
