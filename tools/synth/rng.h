// Seeded random numbers for synthetic weights: splitmix64 to derive seeds, xoshiro256** to
// draw. Every tensor and every block of a tensor gets its own stream derived from the user's
// seed and stable names/indices, so the output does not depend on thread count or order.
#pragma once

#include <cstdint>
#include <string_view>

namespace kestrel::synth {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Seed of a sub-stream `index` of stream `seed`.
inline uint64_t derive_seed(uint64_t seed, uint64_t index) {
  return splitmix64(seed ^ splitmix64(index + 0x632BE59BD9B4E019ull));
}

// FNV-1a: a stable number for a tensor name.
inline uint64_t name_hash(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& w : s_) w = seed = splitmix64(seed);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, n) (multiply-shift; the bias is below n / 2^32).
  uint32_t below(uint32_t n) { return (uint32_t)(((next() >> 32) * n) >> 32); }
  // Uniform in [0, 1).
  double uniform() { return (double)(next() >> 11) * 0x1.0p-53; }
  // Approximately standard normal: the sum of four 16-bit uniforms (Irwin-Hall), one draw per
  // value. Bounded by +-3.46, so a weight can never be an outlier that overflows fp16.
  float normal() {
    const uint64_t r = next();
    const uint32_t sum = (uint32_t)(r & 0xFFFF) + (uint32_t)((r >> 16) & 0xFFFF) +
                         (uint32_t)((r >> 32) & 0xFFFF) + (uint32_t)(r >> 48);
    // Mean 2 * 65535, variance 4 * 65536^2 / 12 (to within 2^-16).
    return ((float)sum - 131070.0f) * (1.7320508f / 65536.0f);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace kestrel::synth
