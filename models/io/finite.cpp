#include "models/io/finite.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/error.h"

namespace kestrel {

namespace {

// A float is NaN or Inf exactly when its exponent field is all ones. Adding the exponent's
// lowest bit to the masked field carries into the sign position only then, so OR-ing
// (w & exp) + low over a block and testing the sign bit once asks "any non-finite?" without a
// branch per element (the compiler vectorises it).
template <typename Word, Word kExp, Word kLow, Word kSign>
int64_t first_bad(const uint8_t* data, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 2048;
  auto word = [&](int64_t i) {
    Word w;
    std::memcpy(&w, data + i * sizeof(Word), sizeof(Word));  // data may be unaligned
    return w;
  };
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = std::min(end, b + kBlock);
    Word acc = 0;
    for (int64_t i = b; i < e; ++i) acc |= (Word)((word(i) & kExp) + kLow);
    if (!(acc & kSign)) continue;
    for (int64_t i = b; i < e; ++i)
      if ((word(i) & kExp) == kExp) return i;
  }
  return -1;
}

// The first non-finite element of t in [begin, end), or -1.
int64_t first_bad_in(const TensorInfo& t, int64_t begin, int64_t end) {
  switch (t.dtype) {
    case DType::F16:
      return first_bad<uint16_t, 0x7C00, 0x0400, 0x8000>(t.data, begin, end);
    case DType::BF16:
      return first_bad<uint16_t, 0x7F80, 0x0080, 0x8000>(t.data, begin, end);
    case DType::F32:
      return first_bad<uint32_t, 0x7F800000u, 0x00800000u, 0x80000000u>(t.data, begin, end);
    case DType::I32:
      break;
  }
  return -1;
}

// "NaN", "Inf" or "-Inf".
std::string value_name(const TensorInfo& t, int64_t i) {
  float v = 0;
  if (t.dtype == DType::F32) {
    std::memcpy(&v, t.data + 4 * i, 4);
  } else {
    uint16_t h;
    std::memcpy(&h, t.data + 2 * i, 2);
    v = t.dtype == DType::F16 ? half_to_float(h) : bf16_to_float(h);
  }
  if (v != v) return "NaN";
  return v < 0 ? "-Inf" : "Inf";
}

[[noreturn]] void refuse(const TensorInfo& t, int64_t i) {
  std::string where;
  if (t.shape.size() > 1) {  // the element's place in the shape too: "[3, 17]"
    std::vector<int64_t> at(t.shape.size());
    int64_t rest = i;
    for (size_t d = t.shape.size(); d-- > 0;) {
      at[d] = rest % t.shape[d];
      rest /= t.shape[d];
    }
    where = fmt::format(" ([{}])", fmt::join(at, ", "));
  }
  throw Error(fmt::format("{} in {}: element {}{} is {}; a checkpoint's weights must be finite",
                          t.name, t.file, i, where, value_name(t, i)));
}

}  // namespace

int64_t first_non_finite(const TensorInfo& t) {
  if (!dtype_is_float(t.dtype)) return -1;
  return first_bad_in(t, 0, (int64_t)(t.nbytes / dtype_size(t.dtype)));
}

void check_finite(const std::vector<const TensorInfo*>& tensors) {
  // Work items of up to 8 MiB, in list order; a thread takes the next one from a counter.
  struct Chunk {
    const TensorInfo* t;
    int64_t begin, end;
  };
  constexpr size_t kChunkBytes = size_t(8) << 20;
  std::vector<Chunk> chunks;
  size_t total = 0;
  for (const TensorInfo* t : tensors) {
    if (!dtype_is_float(t->dtype) || t->nbytes == 0) continue;
    const int64_t n = (int64_t)(t->nbytes / dtype_size(t->dtype));
    const int64_t step = (int64_t)(kChunkBytes / dtype_size(t->dtype));
    for (int64_t b = 0; b < n; b += step) chunks.push_back({t, b, std::min(n, b + step)});
    total += t->nbytes;
  }

  // The lowest chunk that holds a non-finite value, and its element: chunks are taken in
  // order, so every chunk before a bad one is scanned and the answer does not depend on timing.
  std::atomic<size_t> next{0};
  std::atomic<size_t> bad_chunk{std::numeric_limits<size_t>::max()};
  std::vector<int64_t> bad_at(chunks.size(), -1);
  auto work = [&] {
    for (;;) {
      const size_t c = next.fetch_add(1);
      if (c >= chunks.size() || c > bad_chunk.load()) return;
      const int64_t i = first_bad_in(*chunks[c].t, chunks[c].begin, chunks[c].end);
      if (i < 0) continue;
      bad_at[c] = i;
      size_t seen = bad_chunk.load();
      while (c < seen && !bad_chunk.compare_exchange_weak(seen, c)) {
      }
    }
  };
  // One thread per 64 MiB, up to 8: the scan is bound by memory bandwidth and page faults.
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const unsigned n_threads = (unsigned)std::min<size_t>({hw, 8, total / (size_t(64) << 20) + 1});
  std::vector<std::thread> threads;
  for (unsigned i = 1; i < n_threads; ++i) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();

  const size_t c = bad_chunk.load();
  if (c < chunks.size()) refuse(*chunks[c].t, bad_at[c]);
}

}  // namespace kestrel
