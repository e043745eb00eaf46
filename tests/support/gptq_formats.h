// A GPTQ weight format as the kernel tests sweep them, and its one-line description for
// failure messages (the GEMV and fused small-M GEMM tests share both).
#pragma once

#include <cstdint>
#include <string>

namespace kestrel::test {

struct GptqFormat {
  int bits = 4;
  int group_size = 128;  // -1 = per row
  bool sym = true;
  bool act_order = false;
  int zero_offset = 1;
};

inline std::string describe(const GptqFormat& f, int64_t N, int64_t K) {
  return "bits=" + std::to_string(f.bits) + " group=" + std::to_string(f.group_size) +
         (f.sym ? " sym" : " asym") + (f.act_order ? " act-order" : "") +
         " zero_offset=" + std::to_string(f.zero_offset) + " N=" + std::to_string(N) +
         " K=" + std::to_string(K);
}

}  // namespace kestrel::test
