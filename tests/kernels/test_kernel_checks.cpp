// The argument checks of the CUDA kernels' host entry points. They run before any CUDA call,
// so these tests need no GPU: a weight whose device pointer is never dereferenced stands in
// for a prepared one.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "base/error.h"
#include "kernels/gemm/gemm.h"
#include "tests/support/fake_weight.h"

namespace kestrel::cuda {
namespace {

using ::testing::HasSubstr;

using kestrel::test::fake_gemv_weight;

std::string message_of(const GemvWeight& w, __half* out, size_t elems) {
  try {
    dequantize_f16(w, out, elems, nullptr);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// kestrel-bench-gemm once dequantized a whole weight into a scratch sized for one slice of it
// and died with an illegal address; the size is now part of the call.
TEST(DequantizeChecks, RefusesAnOutputSmallerThanTheWeight) {
  alignas(16) static __half small[64];
  EXPECT_EQ(message_of(fake_gemv_weight(), small, 64),
            "dequantize_f16: the output holds 64 halves, the weight [256, 512] needs 131072");
  EXPECT_THAT(message_of(fake_gemv_weight(), small, 256 * 512 - 1), HasSubstr("needs 131072"));
}

TEST(DequantizeChecks, RefusesANullOutput) {
  EXPECT_EQ(message_of(fake_gemv_weight(), nullptr, 256 * 512),
            "dequantize_f16: the output holds 0 halves, the weight [256, 512] needs 131072");
}

TEST(DequantizeChecks, RefusesAnEmptyWeightFirst) {
  GemvWeight w = fake_gemv_weight();
  w.device = nullptr;
  EXPECT_THAT(message_of(w, nullptr, 0), HasSubstr("the weight is empty"));
}

TEST(DequantizeChecks, RefusesAMisalignedOutput) {
  // Never written: the alignment check fails first. Sized so that only alignment is wrong.
  const auto bogus = reinterpret_cast<__half*>(uintptr_t(0x1000) + 2);
  EXPECT_THAT(message_of(fake_gemv_weight(), bogus, 256 * 512), HasSubstr("16-byte aligned"));
}

}  // namespace
}  // namespace kestrel::cuda
