// The Llama-2-7B decode linears the kernel benchmarks run: fused q/k/v, o, fused gate/up, down.
#pragma once

#include <cstdint>

namespace kestrel::bench {

struct Shape {
  const char* name;
  int64_t N, K;
};

inline constexpr Shape kLlama7bShapes[] = {
    {"qkv", 12288, 4096}, {"o", 4096, 4096}, {"gate_up", 22016, 4096}, {"down", 4096, 11008}};

// The same linears of a Llama 1.1B (kestrel-synth --shape 1b: hidden 2048, 32 query heads and
// 4 KV heads of 64, intermediate 5632).
inline constexpr Shape kLlama1bShapes[] = {
    {"qkv", 2560, 2048}, {"o", 2048, 2048}, {"gate_up", 11264, 2048}, {"down", 2048, 5632}};

}  // namespace kestrel::bench
