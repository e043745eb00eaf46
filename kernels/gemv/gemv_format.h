// Which GPTQ formats the GEMV kernels (kernels/gemv/gemv.h) take, asked from host code that
// does not need the kernels' header: a loader refusing a checkpoint before any device work.
#pragma once

#include <cstdint>
#include <string>

namespace kestrel::cuda {

// Why gemv_prepare refuses a linear of this format, "" when it takes it: bits other than 2, 3,
// 4, 8, a K that does not fill whole 32-bit words, or groups of a size that is not a multiple
// of 32 columns (one group per row always runs). The same checks as gemv_prepare's, which
// name the parts of its call instead of the checkpoint's linear.
std::string gemv_format_problem(int bits, int group_size, int64_t K);

}  // namespace kestrel::cuda
