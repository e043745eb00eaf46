// Top-k sampling as the device runs it (sample_top_k_f16 in sample_cuda.h), in plain C++: the
// parameters the device reads, its random numbers, and the CPU oracle of its kernel.
//
// The rule is the host Sampler's top-k path (engine/sampler.h) without penalties: the k largest
// logits (ties to the lower id), then top-p over them (the fewest most likely whose weights at
// temperature 1 reach top_p of their sum, the one that crosses included), then min-p (logits
// below max + ln(min_p) out), then a draw at the temperature. Candidates are walked from the
// largest logit down, so a draw u in [0, 1) picks the first candidate whose cumulative weight
// passes u times the total.
//
// Random numbers: Philox4x32-10 (Salmon et al., SC11, the Random123 generator), counter-based,
// so draw i of a run is a pure function of (seed, i) and the device needs no state but i.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define KESTREL_HD __host__ __device__ __forceinline__
#else
#define KESTREL_HD inline
#endif

namespace kestrel {

// The most candidates the device keeps (top_k above this runs on the host).
constexpr int kDeviceTopKMax = 256;
// The largest vocabulary the device samples (64 blocks of at most 4,096 logits; the largest
// vocabularies in use, 256,000, fit).
constexpr int kDeviceSampleMax = 262144;

// Read by the device from device memory at every draw; `draws` advances by one per draw.
struct TopKSampling {
  int top_k = 40;            // 1 .. kDeviceTopKMax
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  float temperature = 1.0f;  // > 0
  uint64_t seed = 0;
  uint64_t draws = 0;        // draws made so far: the counter of the next one
};

// Philox4x32-10 of a 128-bit counter under a 64-bit key.
KESTREL_HD void philox4x32_10(const uint32_t (&ctr_in)[4], const uint32_t (&key_in)[2],
                              uint32_t (&out)[4]) {
  uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
  uint32_t k0 = key_in[0], k1 = key_in[1];
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

// Draw `i` of the run seeded with `seed`: uniform in [0, 1), 53 random bits.
KESTREL_HD double philox_uniform(uint64_t seed, uint64_t i) {
  const uint32_t ctr[4] = {uint32_t(i), uint32_t(i >> 32), 0x6B657374u, 0x72656C00u};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint32_t r[4];
  philox4x32_10(ctr, key, r);
  const uint64_t bits = ((uint64_t(r[0]) << 32) | r[1]) >> 11;
  return double(bits) * (1.0 / 9007199254740992.0);  // 2^-53
}

// The oracle of sample_top_k_f16: the token drawn by `u` from fp16 logits (bits) [n].
int sample_top_k_ref(const uint16_t* logits, int n, const TopKSampling& s, double u);

// Every kept candidate, most likely first, with its probability and the interval of u that
// draws it: [cdf_lo, cdf_hi).
struct TopKCandidate {
  int id;
  double p, cdf_lo, cdf_hi;
};
std::vector<TopKCandidate> top_k_candidates_ref(const uint16_t* logits, int n,
                                                const TopKSampling& s);

}  // namespace kestrel
