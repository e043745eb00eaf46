#include "engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

namespace kestrel {

namespace {

// The scans below work on whole vectors of floats through GCC/Clang vector extensions,
// portable C++ that becomes SSE, AVX or NEON instructions (the build targets no particular
// ISA, and the compiler does not vectorise the scalar forms of these reductions on its own).
// The passes over the whole vocabulary (maximum, exp weights, masses) also have AVX2+FMA and
// AVX-512 versions, chosen at run time on x86-64. (The vector types cross no function boundary, so
// GCC's -Wpsabi notes about their calling convention, silenced in CMake, do not apply.)
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
template <class V> struct Lanes;
template <class F, class I, class U, int N>
struct LaneTypes {
  using Int = I;
  using UInt = U;
  static constexpr int n = N;
};
template <> struct Lanes<f32x4> : LaneTypes<f32x4, i32x4, u32x4, 4> {};
template <> struct Lanes<f32x8> : LaneTypes<f32x8, i32x8, u32x8, 8> {};
template <> struct Lanes<f32x16> : LaneTypes<f32x16, i32x16, u32x16, 16> {};
constexpr int kBlock = 16;  // floats per step of a scan

template <class V>
[[gnu::always_inline]] inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x4 load4(const float* p) { return load<f32x4>(p); }
template <class V = f32x4>
[[gnu::always_inline]] inline V splat(float x) {
  return V{} + x;
}
template <class V>
[[gnu::always_inline]] inline V vmax(V a, V b) {
  return a > b ? a : b;
}
inline float hmax(f32x4 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2));
  return v[0];
}

// 2^z for z <= 0 (every caller passes a logit minus the maximum, scaled, times log2(e)) to
// about 1.2e-7 relative, without branches or library calls: 2^z = 2^n 2^f with n = round(z),
// |f| <= 1/2, a degree-5 polynomial for 2^f (minimax for the relative error with the constant
// term held at 1, so that exp(0) = 1 exactly and equal logits sum exactly; 1.1e-7 with its
// coefficients in float) and 2^n built in the exponent bits. Adding 1.5 * 2^23 + 127 rounds z
// and leaves n + 127 in the low mantissa bits, so one shift makes 2^n. z is first clamped to
// -127, where that exponent field is 0: from about 2^-127 down, and for -inf, the result is
// exactly 0, so a token masked with -inf gets no weight at all. The clamp is an unsigned
// minimum of the bits (one instruction; GCC turns a float maximum against a constant into a
// compare and a blend): negative floats order by magnitude as unsigned integers above every
// non-negative one.
template <class V>
[[gnu::always_inline]] inline V exp2_neg(V z) {
  constexpr float kRound = 12582912.0f + 127.0f;
  using I = typename Lanes<V>::Int;
  using U = typename Lanes<V>::UInt;
  const U zb = std::bit_cast<U>(z), lo = std::bit_cast<U>(splat<V>(-127.0f));
  const V zc = std::bit_cast<V>(zb < lo ? zb : lo);
  const V t = zc + kRound;
  const V f = zc - (t - kRound);
  V p = splat<V>(1.3264735462e-3f);
  p = p * f + 9.6715176478e-3f;
  p = p * f + 5.5507339537e-2f;
  p = p * f + 2.4022242427e-1f;
  p = p * f + 6.9314700365e-1f;
  p = p * f + 1.0f;
  return p * std::bit_cast<V>(std::bit_cast<I>(t) << 23);
}
constexpr float kLog2e = 1.44269504088896341f;
template <class V>
[[gnu::always_inline]] inline V fast_exp(V x) {
  return exp2_neg(x * kLog2e);
}
inline float fast_exp(float x) { return fast_exp(splat(x))[0]; }

[[gnu::always_inline]] inline float hsum(f32x4 v) {
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
  return v[0];
}
[[gnu::always_inline]] inline float hsum(f32x8 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3) +
              __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
[[gnu::always_inline]] inline float hsum(f32x16 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The passes over the whole vocabulary sum in float within a span of kSpan logits (16 terms a
// lane at most, so the sum keeps float precision) and in double across spans. The span is
// also the first level of a draw: its weights' sum is kept, a draw walks those sums and then
// only the one span where the uniform falls.
constexpr int kSpan = 256;

struct Sums {
  double all = 0;   // every weight
  double kept = 0;  // the weights of the logits >= the floor
};

// w_i = exp((x_i - shift) * scale) over x[0, n): the sum per span of the weights of the logits
// >= floor into span_sum[n / kSpan rounded up], of all of them into span_all[] when that is
// not null, and every weight into out[n] when Store.
// Without a floor (Floor false) the masked sum is skipped: kept is all. The argument of the
// exp is one fused multiply-add, x_i k - shift k with k = scale log2(e): the rounding of
// shift k scales every weight by the same factor, which the normalisation removes.
template <class V, bool Store, bool Floor>
[[gnu::always_inline]] inline Sums weigh_v(const float* x, int n, float shift, float scale,
                                           float floor, float* out, double* span_sum,
                                           double* span_all) {
  constexpr int N = Lanes<V>::n;
  const float k = scale * kLog2e;
  const V kv = splat<V>(k), sk = splat<V>(shift * k), fl = splat<V>(floor);
  Sums t;
  for (int b0 = 0; b0 < n; b0 += kSpan) {
    const int b1 = std::min(n, b0 + kSpan);
    V a{}, m{};
    int i = b0;
    for (; i + N <= b1; i += N) {
      const V l = load<V>(x + i);
      const V w = exp2_neg(l * kv - sk);
      if constexpr (Store) std::memcpy(out + i, &w, sizeof w);
      a += w;
      if constexpr (Floor) m += l >= fl ? w : V{};
    }
    double all = hsum(a), kept = Floor ? hsum(m) : 0.0;
    for (; i < b1; ++i) {
      const float w = exp2_neg(splat(x[i] * k - shift * k))[0];
      if constexpr (Store) out[i] = w;
      all += w;
      if (Floor && x[i] >= floor) kept += w;
    }
    if constexpr (!Floor) kept = all;
    span_sum[b0 / kSpan] = kept;
    if (span_all) span_all[b0 / kSpan] = all;
    t.all += all;
    t.kept += kept;
  }
  return t;
}
template <class V>
[[gnu::always_inline]] inline Sums weigh_any(const float* x, int n, float shift, float scale,
                                             float floor, float* out, double* span_sum,
                                             double* span_all) {
  const bool has_floor = floor > -std::numeric_limits<float>::infinity();
  if (out) {
    return has_floor ? weigh_v<V, true, true>(x, n, shift, scale, floor, out, span_sum, span_all)
                     : weigh_v<V, true, false>(x, n, shift, scale, floor, out, span_sum, span_all);
  }
  return has_floor ? weigh_v<V, false, true>(x, n, shift, scale, floor, out, span_sum, span_all)
                   : weigh_v<V, false, false>(x, n, shift, scale, floor, out, span_sum, span_all);
}

struct Mass {
  double sum = 0;  // of the weights
  int count = 0;   // of the logits
};

// The weights w_i and (when Count) the number of the logits x_i >= t over [begin, end).
template <class V, bool Count>
[[gnu::always_inline]] inline Mass mass_v(const float* x, const float* w, int begin, int end,
                                          float t) {
  constexpr int N = Lanes<V>::n;
  using I = typename Lanes<V>::Int;
  const V tv = splat<V>(t);
  Mass out;
  I c{};
  for (int b0 = begin; b0 < end; b0 += kSpan) {
    const int b1 = std::min(end, b0 + kSpan);
    V a{};
    int i = b0;
    for (; i + N <= b1; i += N) {
      const auto in = load<V>(x + i) >= tv;
      a += in ? load<V>(w + i) : V{};
      if constexpr (Count) c -= in;  // a true lane is -1
    }
    double sum = hsum(a);
    for (; i < b1; ++i)
      if (x[i] >= t) {
        sum += w[i];
        ++out.count;
      }
    out.sum += sum;
  }
  for (int j = 0; j < N; ++j) out.count += c[j];
  return out;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KESTREL_SAMPLER_AVX2 1
[[gnu::target("avx2,fma")]] Sums weigh_avx2(const float* x, int n, float shift, float scale,
                                            float floor, float* out, double* span_sum,
                                            double* span_all) {
  return weigh_any<f32x8>(x, n, shift, scale, floor, out, span_sum, span_all);
}
[[gnu::target("avx512f")]] Sums weigh_avx512(const float* x, int n, float shift, float scale,
                                             float floor, float* out, double* span_sum,
                                             double* span_all) {
  return weigh_any<f32x16>(x, n, shift, scale, floor, out, span_sum, span_all);
}
[[gnu::target("avx2,fma")]] Mass mass_avx2(const float* x, const float* w, int begin, int end,
                                           float t, bool count) {
  return count ? mass_v<f32x8, true>(x, w, begin, end, t)
               : mass_v<f32x8, false>(x, w, begin, end, t);
}
[[gnu::target("avx512f")]] Mass mass_avx512(const float* x, const float* w, int begin, int end,
                                            float t, bool count) {
  return count ? mass_v<f32x16, true>(x, w, begin, end, t)
               : mass_v<f32x16, false>(x, w, begin, end, t);
}
const bool kHaveAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
#endif

Sums weigh(const float* x, int n, float shift, float scale, float floor, float* out,
           double* span_sum, double* span_all = nullptr) {
#ifdef KESTREL_SAMPLER_AVX2
  if (kHaveAvx512) return weigh_avx512(x, n, shift, scale, floor, out, span_sum, span_all);
  if (kHaveAvx2) return weigh_avx2(x, n, shift, scale, floor, out, span_sum, span_all);
#endif
  return weigh_any<f32x4>(x, n, shift, scale, floor, out, span_sum, span_all);
}

Mass mass_from(const float* x, const float* w, int begin, int end, float t, bool count) {
#ifdef KESTREL_SAMPLER_AVX2
  if (kHaveAvx512) return mass_avx512(x, w, begin, end, t, count);
  if (kHaveAvx2) return mass_avx2(x, w, begin, end, t, count);
#endif
  return count ? mass_v<f32x4, true>(x, w, begin, end, t)
               : mass_v<f32x4, false>(x, w, begin, end, t);
}

constexpr float kInf = std::numeric_limits<float>::infinity();

// The largest of 16 floats, lane-wise (4 lanes).
inline f32x4 block_max(const float* x) {
  return vmax(vmax(load4(x), load4(x + 4)), vmax(load4(x + 8), load4(x + 12)));
}

// The largest of x[0, n), with vectors V and four accumulators.
template <class V>
[[gnu::always_inline]] inline float max_v(const float* x, int n) {
  constexpr int N = Lanes<V>::n;
  float best = -kInf;
  int i = 0;
  if (n >= 4 * N) {
    V m0 = load<V>(x), m1 = load<V>(x + N), m2 = load<V>(x + 2 * N), m3 = load<V>(x + 3 * N);
    for (i = 4 * N; i + 4 * N <= n; i += 4 * N) {
      m0 = vmax(m0, load<V>(x + i));
      m1 = vmax(m1, load<V>(x + i + N));
      m2 = vmax(m2, load<V>(x + i + 2 * N));
      m3 = vmax(m3, load<V>(x + i + 3 * N));
    }
    const V m = vmax(vmax(m0, m1), vmax(m2, m3));
    for (int j = 0; j < N; ++j) best = m[j] > best ? m[j] : best;
  }
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

#ifdef KESTREL_SAMPLER_AVX2
[[gnu::target("avx2")]] float max_avx2(const float* x, int n) { return max_v<f32x8>(x, n); }
[[gnu::target("avx512f")]] float max_avx512(const float* x, int n) {
  return max_v<f32x16>(x, n);
}
#endif

float max_of(const float* x, int n) {
#ifdef KESTREL_SAMPLER_AVX2
  if (kHaveAvx512) return max_avx512(x, n);
  if (kHaveAvx2) return max_avx2(x, n);
#endif
  return max_v<f32x4>(x, n);
}

// c.w = exp((c.logit - shift) * scale) for every candidate, four at a time; returns the sum.
template <class Cand>
double weigh_cands(std::vector<Cand>& cand, float shift, float scale) {
  double sum = 0;
  size_t i = 0;
  for (; i + 4 <= cand.size(); i += 4) {
    const f32x4 l = {cand[i].logit, cand[i + 1].logit, cand[i + 2].logit, cand[i + 3].logit};
    const f32x4 w = fast_exp((l - shift) * scale);
    for (int j = 0; j < 4; ++j) sum += cand[i + j].w = w[j];
  }
  for (; i < cand.size(); ++i) sum += cand[i].w = fast_exp((cand[i].logit - shift) * scale);
  return sum;
}

}  // namespace

int argmax(const float* x, int n) {
  // The maximum (vectorised), then the first block holding it, then its first index there.
  const float m = max_of(x, n);
  int i = 0;
  for (; i + kBlock <= n; i += kBlock)
    if (hmax(block_max(x + i)) >= m) break;
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // every value NaN
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}

void Sampler::apply_penalties(float* logits, int vocab, const std::vector<int>& history) {
  if (p_.repeat_penalty == 1.0f && p_.frequency_penalty == 0.0f && p_.presence_penalty == 0.0f)
    return;
  const size_t window = p_.repeat_last_n < 0 ? history.size()
                                             : std::min(history.size(), (size_t)p_.repeat_last_n);
  if ((int)counts_.size() < vocab) counts_.assign(vocab, 0);
  const size_t first = history.size() - window;
  for (size_t i = first; i < history.size(); ++i)
    if (history[i] >= 0 && history[i] < vocab) ++counts_[history[i]];
  // Each distinct token once; its count is reset on the way so counts_ is zero again.
  for (size_t i = first; i < history.size(); ++i) {
    const int tok = history[i];
    if (tok < 0 || tok >= vocab || counts_[tok] == 0) continue;
    float& l = logits[tok];
    // Repetition (CTRL / llama.cpp): divide positive logits, multiply negative ones.
    if (p_.repeat_penalty != 1.0f) l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
    l -= counts_[tok] * p_.frequency_penalty + p_.presence_penalty;
    counts_[tok] = 0;
  }
}

// The k largest logits (ties to the lower id), without sorting or heap churn. One vectorised
// pass records the maximum of every block of kBlock logits. The k-th largest maximum over
// groups of four blocks is a threshold that at least k logits reach (k groups each hold one),
// and on typical logits hardly more than k do; a second pass visits only the blocks whose
// maximum reaches it, and a selection over the few collected logits finishes. Nothing here
// branches on individual logits of the whole vocabulary, so random logits cost no more than
// repetitive ones.
void Sampler::select_top_k(const float* logits, int vocab, int k) {
  auto better = [](const Cand& a, const Cand& b) {
    return a.logit != b.logit ? a.logit > b.logit : a.id < b.id;
  };
  const int n_blocks = vocab / kBlock, n_groups = n_blocks / 4;
  if ((int)buf_.size() < n_blocks + n_groups) buf_.resize(n_blocks + n_groups);
  float* block = buf_.data();
  float* group = buf_.data() + n_blocks;
  for (int b = 0; b < n_blocks; ++b) block[b] = hmax(block_max(logits + b * kBlock));
  for (int g = 0; g < n_groups; ++g)
    group[g] = std::max(std::max(block[4 * g], block[4 * g + 1]),
                        std::max(block[4 * g + 2], block[4 * g + 3]));
  float t = -std::numeric_limits<float>::infinity();
  if (n_groups >= k) {
    std::nth_element(group, group + (k - 1), group + n_groups, std::greater<float>());
    t = group[k - 1];
  }
  cand_.clear();
  for (int b = 0; b < n_blocks; ++b)
    if (block[b] >= t)
      for (int i = b * kBlock; i < (b + 1) * kBlock; ++i)
        if (logits[i] >= t) cand_.push_back({logits[i], i, 0.0f});
  for (int i = n_blocks * kBlock; i < vocab; ++i)
    if (logits[i] >= t) cand_.push_back({logits[i], i, 0.0f});
  if (cand_.size() > (size_t)k) {
    std::nth_element(cand_.begin(), cand_.begin() + (k - 1), cand_.end(), better);
    cand_.resize(k);
  }
}

// Top-p over the candidates: keeps the fewest most likely ones whose weights reach `need`
// (the one that crosses included, as llama.cpp). A quickselect weighted by mass, so the
// nucleus is found in expected linear time and never sorted; only a short run at the cut is.
void Sampler::keep_nucleus(double need) {
  auto by_weight = [](const Cand& a, const Cand& b) {
    return a.w != b.w ? a.w > b.w : a.id < b.id;
  };
  auto mass = [&](size_t a, size_t b) {
    double s = 0;
    for (size_t i = a; i < b; ++i) s += cand_[i].w;
    return s;
  };
  size_t lo = 0, hi = cand_.size();  // [0, lo) is in; the cut lies in [lo, hi)
  if (mass(lo, hi) < need) return;     // all of them (min-p cut deeper than top-p)
  while (hi - lo > 32) {
    float a = cand_[lo].w, b = cand_[(lo + hi) / 2].w, c = cand_[hi - 1].w;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median
    auto first = cand_.begin() + lo, last = cand_.begin() + hi;
    auto gt = std::partition(first, last, [&](const Cand& x) { return x.w > pivot; });
    auto eq = std::partition(gt, last, [&](const Cand& x) { return x.w == pivot; });
    const size_t g = gt - cand_.begin(), e = eq - cand_.begin();
    const double m_gt = mass(lo, g);
    if (m_gt >= need) {
      hi = g;
      continue;
    }
    const double m_eq = mass(g, e);
    if (m_gt + m_eq >= need) {  // the cut falls among equal weights: take them by id
      std::sort(cand_.begin() + g, cand_.begin() + e, by_weight);
      lo = g;
      hi = e;
      need -= m_gt;
      break;
    }
    need -= m_gt + m_eq;
    lo = e;
  }
  std::sort(cand_.begin() + lo, cand_.begin() + hi, by_weight);
  size_t keep = hi;
  double acc = 0;
  for (size_t i = lo; i < hi; ++i) {
    acc += cand_[i].w;
    if (acc >= need) {
      keep = i + 1;
      break;
    }
  }
  cand_.resize(std::max<size_t>(keep, 1));
}

int Sampler::sample(float* logits, int vocab, const std::vector<int>& history) {
  apply_penalties(logits, vocab, history);
  if (p_.temperature <= 0.0f) return argmax(logits, vocab);
  if (p_.top_k > 0 && p_.top_k < vocab) return sample_top_k(logits, vocab);
  return sample_by_mass(logits, vocab);
}

// Top-k first: the other cut-offs then work on k candidates, which are left in cand_ with their
// weights at the temperature; returns the weights' sum.
double Sampler::truncate_top_k(const float* logits, int vocab) {
  if (cand_.capacity() < (size_t)vocab) cand_.reserve(vocab);
  select_top_k(logits, vocab, p_.top_k);
  float max_logit = cand_[0].logit;
  for (const Cand& c : cand_) max_logit = std::max(max_logit, c.logit);
  const double norm = weigh_cands(cand_, max_logit, 1.0f);
  if (p_.top_p < 1.0f) keep_nucleus(p_.top_p * norm);
  if (p_.min_p > 0.0f) {
    // The most likely token survives top-k and top-p, so min-p measures against max_logit.
    const float threshold = max_logit + std::log(p_.min_p);
    std::erase_if(cand_, [&](const Cand& c) { return c.logit < threshold; });
  }
  if (p_.temperature == 1.0f) {
    double total = 0;
    for (const Cand& c : cand_) total += c.w;
    return total;
  }
  return weigh_cands(cand_, max_logit, 1.0f / p_.temperature);
}

int Sampler::sample_top_k(const float* logits, int vocab) {
  const double total = truncate_top_k(logits, vocab);
  if (cand_.size() == 1) return cand_[0].id;
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (const Cand& c : cand_) {
    r -= c.w;
    if (r < 0) return c.id;
  }
  return cand_.back().id;
}

// Without top-k, nothing is sorted or collected. Min-p is a floor on the logit (p_i >= min_p *
// p_max exactly when l_i >= l_max + ln(min_p)), and without top-p the draw walks the span sums
// of one weighing pass and then one span. Top-p keeps token x exactly when the mass of the
// tokens ahead of it (larger logit, or equal logit and lower id) is below top_p of the total:
// that is llama.cpp's rule (keep the sorted prefix up to the token whose cumulative mass
// reaches top_p) read token by token. So a token drawn from the min-p set at the temperature
// is tested with one pass over the stored weights, and drawn again if it falls outside; the
// accepted draw then follows the distribution over the nucleus exactly. With top-p 0.95 at a
// temperature <= 1 the nucleus holds at least 95% of the drawn mass, so a second draw is rare.
int Sampler::sample_by_mass(const float* logits, int vocab) {
  const float m = max_of(logits, vocab);
  const float inv_t = 1.0f / p_.temperature;
  const float floor = p_.min_p > 0.0f ? m + std::log(p_.min_p) : -kInf;
  const int n_spans = (vocab + kSpan - 1) / kSpan;
  if (spans_.size() < 3 * (size_t)n_spans) spans_.resize(3 * n_spans);
  double* at_one = spans_.data();          // span sums at temperature 1, above the floor
  double* at_t = spans_.data() + n_spans;  // span sums at the temperature, above the floor
  if (p_.top_p >= 1.0f) {
    const Sums s = weigh(logits, vocab, m, inv_t, floor, nullptr, at_t);
    return draw(logits, vocab, nullptr, at_t, m, inv_t, floor, s.kept);
  }
  if (p_.top_p <= 0.0f) return argmax(logits, vocab);  // llama.cpp keeps one token

  if ((int)buf_.size() < vocab) buf_.resize(vocab);
  float* w = buf_.data();
  const Sums one = weigh(logits, vocab, m, 1.0f, floor, w, at_one, spans_.data() + 2 * n_spans);
  const double need = p_.top_p * one.all;
  // Below temperature 1 a draw at temperature 1 accepted with probability
  // exp((l - max) (1/T - 1)) <= 1 is a draw at the temperature, and saves the second exp
  // pass; after a few refusals (a low temperature) that pass is made after all. Giving up on
// draws after a fixed number of them keeps the result exact: an accepted draw follows the
// target distribution whichever attempt it came from, and so does the explicit nucleus.
  double total_t = -1;
  int refused = 0, tested = 0;
  float outside = -kInf;  // the largest logit found outside the nucleus: the cut is not below
  while (tested < kNucleusTests) {
    int x;
    if (inv_t >= 1.0f && refused < kTemperatureRefusals) {
      x = draw(logits, vocab, w, at_one, m, 1.0f, floor, one.kept);
      if (inv_t > 1.0f) {
        const double keep = std::exp(((double)logits[x] - m) * (inv_t - 1.0));
        if (std::uniform_real_distribution<double>(0.0, 1.0)(rng_) >= keep) {
          ++refused;
          continue;
        }
      }
    } else {
      if (total_t < 0) total_t = weigh(logits, vocab, m, inv_t, floor, nullptr, at_t).kept;
      x = draw(logits, vocab, nullptr, at_t, m, inv_t, floor, total_t);
    }
    ++tested;
    if (in_nucleus(logits, vocab, x, need, one.all)) return x;
    outside = std::max(outside, logits[x]);
  }
  return draw_from_nucleus(logits, vocab, m, floor, need, outside);
}

// Whether the mass at temperature 1 of the tokens ahead of x in llama.cpp's order (larger
// logit, or equal logit and lower id) is below `need`, from the weights in buf_ and the sums
// of all weights per span (the last third of spans_, `total` theirs). The spans are visited
// in order, and the walk stops as soon as the answer is known: the mass ahead has reached
// `need` (sums of weights >= 0 only grow, so that is final), or the mass ahead so far plus
// everything not yet visited stays below it (with a margin far above the rounding of the
// sums, so that the answer is the one the whole walk gives). For top-p 0.95 and a likely
// token that happens within the first spans.
bool Sampler::in_nucleus(const float* logits, int vocab, int x, double need, double total) const {
  const int n_spans = (vocab + kSpan - 1) / kSpan;
  const double* span_all = spans_.data() + 2 * n_spans;
  const float* w = buf_.data();
  const float l = logits[x], above = std::nextafter(l, kInf);
  const double sure = need * (1.0 - 1e-6);
  double ahead = 0, rest = total;
  for (int b = 0; b < n_spans; ++b) {
    const int b0 = b * kSpan, b1 = std::min(vocab, b0 + kSpan);
    if (b1 <= x) {
      ahead += mass_from(logits, w, b0, b1, l, false).sum;
    } else if (b0 > x) {
      ahead += mass_from(logits, w, b0, b1, above, false).sum;
    } else {
      ahead += mass_from(logits, w, b0, x, l, false).sum +
               mass_from(logits, w, x + 1, b1, above, false).sum;
    }
    rest -= span_all[b];
    if (ahead >= need) return false;
    if (ahead + rest < sure) return true;
  }
  return ahead < need;
}

std::vector<double> Sampler::distribution(const float* logits, int vocab) {
  std::vector<double> prob(vocab, 0.0);
  if (p_.temperature <= 0.0f || (p_.top_p <= 0.0f && !(p_.top_k > 0 && p_.top_k < vocab))) {
    prob[argmax(logits, vocab)] = 1.0;
    return prob;
  }
  if (p_.top_k > 0 && p_.top_k < vocab) {
    const double total = truncate_top_k(logits, vocab);
    for (const Cand& c : cand_) prob[c.id] = c.w / total;
    return prob;
  }
  // The floor of sample_by_mass, then its nucleus rule (a token is in when the mass at
  // temperature 1 ahead of it in llama.cpp's order, larger logit first and lower id on ties,
  // is below top_p of the total) walked once over the tokens above the floor in that order:
  // every token ahead of a kept one is above the floor too. The weights are sample()'s own.
  const float m = max_of(logits, vocab);
  const float floor = p_.min_p > 0.0f ? m + std::log(p_.min_p) : -kInf;
  const int n_spans = (vocab + kSpan - 1) / kSpan;
  if (spans_.size() < 3 * (size_t)n_spans) spans_.resize(3 * n_spans);
  std::vector<float> at_t(vocab);
  weigh(logits, vocab, m, 1.0f / p_.temperature, floor, at_t.data(), spans_.data());
  std::vector<int> kept;
  for (int i = 0; i < vocab; ++i)
    if (logits[i] >= floor) kept.push_back(i);
  if (p_.top_p < 1.0f) {
    if ((int)buf_.size() < vocab) buf_.resize(vocab);
    const double z = weigh(logits, vocab, m, 1.0f, floor, buf_.data(), spans_.data(),
                           spans_.data() + 2 * n_spans).all;
    const double need = p_.top_p * z;
    auto before = [&](int a, int b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    };
    // The nucleus is usually a few dozen tokens of a vocabulary of 32K-150K: sort only as far
    // as the walk needs, a growing head at a time (the order is total, so each head is what a
    // full sort would put there). Speculative decoding calls this for every verified row.
    double ahead = 0;
    size_t n_in = 0, sorted = 0, head = 64;
    for (;;) {
      head = std::min(head, kept.size());
      std::partial_sort(kept.begin() + sorted, kept.begin() + head, kept.end(), before);
      sorted = head;
      while (n_in < sorted && ahead < need) ahead += buf_[kept[n_in++]];
      if (ahead >= need || sorted == kept.size()) break;
      head *= 4;
    }
    kept.resize(n_in);
  }
  double total = 0;
  for (int i : kept) total += prob[i] = at_t[i];
  for (int i : kept) prob[i] /= total;
  return prob;
}

// Picks a token by the span sums span_sum (of the weights exp((l - shift) * scale) of the
// logits >= floor; `total` is their sum, in order), then inside the span by its weights: the
// stored ones in w, or recomputed when w is null.
int Sampler::draw(const float* x, int n, const float* w, const double* span_sum, float shift,
                  float scale, float floor, double total) {
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  const int n_spans = (n + kSpan - 1) / kSpan;
  int b = -1;
  for (int i = 0; i < n_spans; ++i) {
    if (!(span_sum[i] > 0)) continue;
    b = i;
    if (r < span_sum[i]) break;
    r -= span_sum[i];  // rounding may leave r past the last span: the last token with weight
  }
  if (b < 0) return argmax(x, n);  // no weight anywhere (NaN logits)
  const int b0 = b * kSpan, len = std::min(kSpan, n - b0);
  float local[kSpan];
  double sum;
  if (w) {
    std::memcpy(local, w + b0, len * sizeof(float));
  } else {
    weigh(x + b0, len, shift, scale, floor, local, &sum);
  }
  int last = b0;
  for (int i = 0; i < len; ++i) {
    if (!(x[b0 + i] >= floor) || !(local[i] > 0)) continue;
    last = b0 + i;
    r -= local[i];
    if (r < 0) break;
  }
  return last;
}

// The nucleus made explicit, for the calls where draws kept falling outside it (a small top-p
// or a high temperature): a search on the logit value narrows the cut to a few logits
// (bounded by the mass >= lo reaching `need` and the mass >= hi not), those are ordered by
// logit and id, and the draw at the temperature covers the logits >= hi and the kept ones of
// the few. Expects buf_ to hold the weights at temperature 1.
int Sampler::draw_from_nucleus(const float* logits, int vocab, float m, float floor, double need,
                               float outside) {
  const float* w = buf_.data();
  // A token outside the nucleus has at least `need` ahead of it, so the mass >= its logit
  // reaches `need`. Failing one, below m - 64 a weight is under 2^-92: the whole vocabulary
  // there cannot reach 1 - top_p of a total >= 1 at float precision, so the cut lies above.
  float lo = std::max(outside, m - 64.0f), hi = std::nextafter(m, kInf);
  Mass at_lo = mass_from(logits, w, 0, vocab, lo, true), at_hi;
  if (at_lo.sum < need && lo > m - 64.0f) {
    lo = m - 64.0f;
    at_lo = mass_from(logits, w, 0, vocab, lo, true);
  }
  cand_.clear();
  if (at_lo.sum < need) {
    hi = -kInf;  // rounding put the whole vocabulary short of `need`: every token is kept
  } else {
    while (at_lo.count - at_hi.count > kFewAtTheCut) {
      // The mass >= t is near linear in t over a short bracket: interpolate, but move at
      // least a tenth of the bracket from either end, so it shrinks geometrically anyway.
      const double frac = std::clamp((at_lo.sum - need) / (at_lo.sum - at_hi.sum), 0.1, 0.9);
      float mid = lo + (float)frac * (hi - lo);
      if (!(mid > lo && mid < hi)) mid = lo + 0.5f * (hi - lo);
      if (!(mid > lo && mid < hi)) break;  // lo and hi adjacent floats: one value between
      const Mass at = mass_from(logits, w, 0, vocab, mid, true);
      if (at.sum >= need) {
        lo = mid;
        at_lo = at;
      } else {
        hi = mid;
        at_hi = at;
      }
    }
    for (int i = 0; i < vocab; ++i)
      if (logits[i] >= lo && logits[i] < hi) cand_.push_back({logits[i], i, w[i]});
    std::sort(cand_.begin(), cand_.end(), [](const Cand& a, const Cand& b) {
      return a.logit != b.logit ? a.logit > b.logit : a.id < b.id;
    });
    double ahead = at_hi.sum;
    size_t keep = 0;
    while (keep < cand_.size() && ahead < need) ahead += cand_[keep++].w;
    cand_.resize(keep);
    std::erase_if(cand_, [&](const Cand& c) { return !(c.logit >= floor); });
  }
  const float inv_t = 1.0f / p_.temperature;
  const int n_spans = (vocab + kSpan - 1) / kSpan;
  double* at_t = spans_.data() + n_spans;
  const float cut = std::max(floor, hi);
  const double in_spans = weigh(logits, vocab, m, inv_t, cut, nullptr, at_t).kept;
  const double in_few = weigh_cands(cand_, m, inv_t);
  if (in_few > 0 &&
      std::uniform_real_distribution<double>(0.0, in_spans + in_few)(rng_) >= in_spans) {
    double r = std::uniform_real_distribution<double>(0.0, in_few)(rng_);
    for (const Cand& c : cand_) {
      r -= c.w;
      if (r < 0) return c.id;
    }
    return cand_.back().id;
  }
  return draw(logits, vocab, nullptr, at_t, m, inv_t, cut, in_spans);
}

Logprobs logprobs_of(const float* logits, int vocab, int chosen, int n) {
  const float m = max_of(logits, vocab);
  double s = 0;
  for (int i = 0; i < vocab; ++i) s += std::exp((double)logits[i] - m);
  const double lse = m + std::log(s);
  Logprobs out;
  out.chosen = {chosen, (float)(logits[chosen] - lse)};
  n = std::clamp(n, 0, vocab);
  std::vector<int> ids(vocab);
  for (int i = 0; i < vocab; ++i) ids[i] = i;
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int a, int b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  for (int i = 0; i < n; ++i) out.top.push_back({ids[i], (float)(logits[ids[i]] - lse)});
  return out;
}

}  // namespace kestrel
