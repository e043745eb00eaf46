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

}  // namespace kestrel::bench
