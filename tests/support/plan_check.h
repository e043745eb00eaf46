// What the mixed-precision tests check of a checkpoint written from a plan, on the CPU's and
// the GPU's quantizer alike.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "models/io/model_spec.h"
#include "tools/quantize/quantize.h"

namespace kestrel::test {

// The decoder linears of a layer, in checkpoint order.
inline constexpr LinearSpec LayerSpec::*kPlanLinears[] = {
    &LayerSpec::q, &LayerSpec::k, &LayerSpec::v, &LayerSpec::o,
    &LayerSpec::gate, &LayerSpec::up, &LayerSpec::down};

// Every linear of the checkpoint at `dir` has, through Kestrel's loader, the format `plan`
// gives it (its tensors of that format's shapes), and the plan's bytes are the bytes written.
inline void expect_checkpoint_holds(const std::filesystem::path& dir,
                                    const quant::MixedPlanReport& plan) {
  const ModelSpec spec = load_model_spec(dir.string());
  std::map<std::string, const LinearSpec*> loaded;
  for (const LayerSpec& ls : spec.layers)
    for (auto lin : kPlanLinears) loaded[(ls.*lin).name] = &(ls.*lin);
  uint64_t bytes = 0;
  for (const quant::PlannedLinear& l : plan.linears) {
    ASSERT_TRUE(loaded.count(l.name)) << l.name;
    const LinearSpec& s = *loaded[l.name];
    EXPECT_TRUE(s.quantized) << l.name;
    EXPECT_EQ(s.bits, l.setting.bits) << l.name;
    EXPECT_EQ(s.group_size, l.setting.group_size) << l.name;
    const int64_t groups = l.setting.group_size > 0
                               ? (l.K + l.setting.group_size - 1) / l.setting.group_size
                               : 1;
    EXPECT_EQ(s.scales->shape[0], groups) << l.name;
    EXPECT_EQ(s.qweight->shape[0], l.K * l.setting.bits / 32) << l.name;
    bytes += s.qweight->nbytes + s.qzeros->nbytes + s.scales->nbytes + s.g_idx->nbytes;
  }
  EXPECT_EQ(bytes, plan.bytes);  // the plan counted exactly what was written
}

// The checkpoints at a and b hold the same tensors, byte for byte (a one-candidate plan against
// the uniform quantization of that candidate).
inline void expect_same_tensors(const std::filesystem::path& a, const std::filesystem::path& b) {
  const ModelSpec sa = load_model_spec(a.string()), sb = load_model_spec(b.string());
  const std::vector<std::string> names = sa.files.names();
  ASSERT_EQ(names, sb.files.names());
  for (const std::string& n : names) {
    const TensorInfo &ta = sa.files.get(n), &tb = sb.files.get(n);
    EXPECT_EQ(std::vector<uint8_t>(ta.data, ta.data + ta.nbytes),
              std::vector<uint8_t>(tb.data, tb.data + tb.nbytes)) << n;
  }
}

}  // namespace kestrel::test
