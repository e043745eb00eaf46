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
// The one pass that needs exp over the whole vocabulary also has AVX2+FMA and AVX-512
// versions, chosen at run time on x86-64. (The vector types cross no function boundary, so
// GCC's -Wpsabi notes about their calling convention, silenced in CMake, do not apply.)
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
template <class V> struct Lanes;
template <> struct Lanes<f32x4> { using Int = i32x4; static constexpr int n = 4; };
template <> struct Lanes<f32x8> { using Int = i32x8; static constexpr int n = 8; };
template <> struct Lanes<f32x16> { using Int = i32x16; static constexpr int n = 16; };
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

// exp(x) for x <= 0 (every caller passes a logit minus the maximum, possibly scaled) to a few
// ulp, without branches or library calls: e^x = 2^n 2^f with z = x log2(e), n = round(z),
// |f| <= 1/2, a degree-6 polynomial for 2^f (Taylor; error below 2e-7 on the interval) and 2^n
// built in the exponent bits. Below 2^-126 it returns 2^-126 rather than leave the normal range.
template <class V>
[[gnu::always_inline]] inline V fast_exp(V x) {
  V z = x * 1.44269504088896341f;
  z = vmax(z, splat<V>(-126.0f));
  const V n = (z + 12582912.0f) - 12582912.0f;  // round to nearest: the 1.5 * 2^23 trick
  const V f = z - n;
  V p = splat<V>(1.5403530393e-4f);
  p = p * f + 1.3333558146e-3f;
  p = p * f + 9.6181291076e-3f;
  p = p * f + 5.5504108665e-2f;
  p = p * f + 2.4022650696e-1f;
  p = p * f + 6.9314718056e-1f;
  p = p * f + 1.0f;
  using I = typename Lanes<V>::Int;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return p * std::bit_cast<V>(bits);
}
inline float fast_exp(float x) { return fast_exp(splat(x))[0]; }

// sum of exp(x[i] - shift) with vectors V and four accumulators.
template <class V>
[[gnu::always_inline]] inline double sum_exp_v(const float* x, int n, float shift) {
  constexpr int N = Lanes<V>::n;
  V a0{}, a1{}, a2{}, a3{};
  const V s = splat<V>(shift);
  int i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 += fast_exp(load<V>(x + i) - s);
    a1 += fast_exp(load<V>(x + i + N) - s);
    a2 += fast_exp(load<V>(x + i + 2 * N) - s);
    a3 += fast_exp(load<V>(x + i + 3 * N) - s);
  }
  const V a = (a0 + a1) + (a2 + a3);
  double sum = 0;
  for (int j = 0; j < N; ++j) sum += a[j];
  for (; i < n; ++i) sum += fast_exp(x[i] - shift);
  return sum;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KESTREL_SAMPLER_AVX2 1
[[gnu::target("avx2,fma")]] double sum_exp_avx2(const float* x, int n, float shift) {
  return sum_exp_v<f32x8>(x, n, shift);
}
[[gnu::target("avx512f")]] double sum_exp_avx512(const float* x, int n, float shift) {
  return sum_exp_v<f32x16>(x, n, shift);
}
const bool kHaveAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
#endif

// sum of exp(x[i] - shift): the softmax normaliser, without storing the terms.
double sum_exp(const float* x, int n, float shift) {
#ifdef KESTREL_SAMPLER_AVX2
  if (kHaveAvx512) return sum_exp_avx512(x, n, shift);
  if (kHaveAvx2) return sum_exp_avx2(x, n, shift);
#endif
  return sum_exp_v<f32x4>(x, n, shift);
}

// The largest of 16 floats, lane-wise (4 lanes).
inline f32x4 block_max(const float* x) {
  return vmax(vmax(load4(x), load4(x + 4)), vmax(load4(x + 8), load4(x + 12)));
}

float max_of(const float* x, int n) {
  float best = -std::numeric_limits<float>::infinity();
  int i = 0;
  if (n >= kBlock) {
    f32x4 m0 = block_max(x), m1 = m0;
    for (i = kBlock; i + 2 * kBlock <= n; i += 2 * kBlock) {
      m0 = vmax(m0, block_max(x + i));
      m1 = vmax(m1, block_max(x + i + kBlock));
    }
    best = hmax(vmax(m0, m1));
  }
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

// c.w = exp((c.logit - shift) * scale) for every candidate, four at a time; returns the sum.
template <class Cand>
double weigh(std::vector<Cand>& cand, float shift, float scale) {
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

// Whether any of x[0..kBlock) exceeds t: lets the scans skip a block with one compare.
inline bool any_above(const float* x, float t) { return hmax(block_max(x)) > t; }

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

// Every logit >= threshold.
void Sampler::select_above(const float* logits, int vocab, float threshold) {
  cand_.clear();
  const float below = std::nextafter(threshold, -std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + kBlock <= vocab; i += kBlock)
    if (any_above(logits + i, below))
      for (int j = i; j < i + kBlock; ++j)
        if (logits[j] >= threshold) cand_.push_back({logits[j], j, 0.0f});
  for (; i < vocab; ++i)
    if (logits[i] >= threshold) cand_.push_back({logits[i], i, 0.0f});
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
  if (cand_.capacity() < (size_t)vocab) cand_.reserve(vocab);

  const bool top_k = p_.top_k > 0 && p_.top_k < vocab;
  const bool top_p = p_.top_p < 1.0f;
  const bool min_p = p_.min_p > 0.0f;
  if (!top_k && !top_p && !min_p) return sample_all(logits, vocab);
  float max_logit;
  double norm = 0;  // the softmax normaliser at temperature 1 that top-p measures against
  if (top_k) {
    select_top_k(logits, vocab, p_.top_k);
    max_logit = cand_[0].logit;
    for (const Cand& c : cand_) max_logit = std::max(max_logit, c.logit);
    norm = weigh(cand_, max_logit, 1.0f);
  } else {
    // Top-p and min-p both keep a prefix of the tokens by probability, so only tokens above
    // a logit threshold can survive: min-p's own, or for top-p alone the one below which
    // the whole vocabulary cannot hold more than 1 - top_p of the mass.
    max_logit = max_of(logits, vocab);
    if (top_p) norm = sum_exp(logits, vocab, max_logit);
    float threshold = -std::numeric_limits<float>::infinity();
    if (min_p) {
      threshold = max_logit + std::log(p_.min_p);
    } else if (top_p) {
      threshold = max_logit + (float)std::log((1.0 - p_.top_p) * norm / vocab);
    }
    select_above(logits, vocab, threshold);
    weigh(cand_, max_logit, 1.0f);
  }
  if (top_p) keep_nucleus(p_.top_p * norm);
  if (min_p && top_k) {
    // The most likely token survives top-k and top-p, so min-p measures against max_logit.
    const float threshold = max_logit + std::log(p_.min_p);
    std::erase_if(cand_, [&](const Cand& c) { return c.logit < threshold; });
  }
  if (cand_.size() == 1) return cand_[0].id;

  double total = 0;
  if (p_.temperature == 1.0f) {
    for (const Cand& c : cand_) total += c.w;
  } else {
    total = weigh(cand_, max_logit, 1.0f / p_.temperature);
  }
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (const Cand& c : cand_) {
    r -= c.w;
    if (r < 0) return c.id;
  }
  return cand_.back().id;
}

// No truncation: every token, weighted at the temperature, in one vectorised pass.
int Sampler::sample_all(const float* logits, int vocab) {
  if ((int)buf_.size() < vocab) buf_.resize(vocab);
  const float m = max_of(logits, vocab);
  const f32x4 inv_t = splat(1.0f / p_.temperature);
  double total = 0;
  int i = 0;
  for (; i + 4 <= vocab; i += 4) {
    const f32x4 w = fast_exp((load4(logits + i) - m) * inv_t);
    std::memcpy(&buf_[i], &w, sizeof w);
  }
  for (; i < vocab; ++i) buf_[i] = fast_exp((logits[i] - m) / p_.temperature);
  for (int j = 0; j < vocab; ++j) total += buf_[j];
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (int j = 0; j < vocab; ++j) {
    r -= buf_[j];
    if (r < 0) return j;
  }
  return argmax(logits, vocab);
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
