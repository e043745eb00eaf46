// Block tables for the tests of paged KV caches (kernels/attention/kv_cache_cuda.h): a
// sequence's blocks scattered over a larger pool, so that a kernel that reads or writes a
// position at its contiguous row, or at the wrong block's, finds other data there.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/attention/kv_quant.h"

namespace kestrel::test {

// Blocks of the pool no position of the table maps to.
constexpr int kSpareBlocks = 3;

// The blocks of `positions` positions taken from a pool of kSpareBlocks more, in a random order
// (seeded): neighbouring positions across a block boundary lie far apart, block 0 is never
// position 0's, and the spare blocks' rows are no position's. The pool's rows:
// kKvBlock * (table size + kSpareBlocks).
inline std::vector<int32_t> scrambled_table(int positions, uint32_t seed) {
  const int n = (positions + kKvBlock - 1) / kKvBlock, pool_blocks = n + kSpareBlocks;
  std::vector<int32_t> pool(pool_blocks);
  for (int b = 0; b < pool_blocks; ++b) pool[b] = b;
  std::shuffle(pool.begin(), pool.end(), std::mt19937(seed));
  if (pool[0] == 0) std::swap(pool[0], pool[pool_blocks - 1]);
  pool.resize(n);
  return pool;
}

inline int64_t pool_rows(const std::vector<int32_t>& table) {
  return (int64_t)(table.size() + kSpareBlocks) * kKvBlock;
}

}  // namespace kestrel::test
