// The paged KV cache's bookkeeping (models/kv_pool.h) against a simulated engine: a "cache" of
// one id per pool row, written through the tables as an engine writes K/V, so that every
// sharing, copy-on-write, eviction and refusal is checked by what a sequence would read back.
#include "models/kv_pool.h"

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "base/error.h"

namespace kestrel {
namespace {

constexpr int B = KvBlockPool::kBlock;

// A position's "K/V": like a real one, a function of every id up to it (attention reads the
// earlier positions), so a block reused after a different prefix reads back wrong.
uint64_t kv_of(uint64_t before, int id) {
  uint64_t z = (before ^ (uint64_t)(uint32_t)id) * 0x9e3779b97f4a7c15ull + 1;
  return z ^ (z >> 29);
}
std::vector<uint64_t> kv_of(const std::vector<int>& ids) {
  std::vector<uint64_t> out;
  uint64_t h = 0;
  for (int id : ids) out.push_back(h = kv_of(h, id));
  return out;
}

// What an engine does around a write: prepare, copy shared blocks, write the rows (each from
// the position before it, read back through the table), commit.
struct Engine {
  explicit Engine(int blocks) : pool(blocks), rows((size_t)blocks * B, 0) {}
  KvBlockPool pool;
  std::vector<uint64_t> rows;  // the "K/V" of each pool row

  bool write(KvBlockTable& t, int pos, const std::vector<int>& ids) {
    std::vector<KvBlockTable::Copy> copies;
    if (!t.prepare_write(pos, (int)ids.size(), copies)) return false;
    for (auto [from, to] : copies)
      std::copy_n(rows.begin() + (size_t)from * B, B, rows.begin() + (size_t)to * B);
    for (size_t i = 0; i < ids.size(); ++i) {
      const int p = pos + (int)i;
      const uint64_t before = p ? rows[(size_t)t.blocks()[(p - 1) / B] * B + (p - 1) % B] : 0;
      rows[(size_t)t.blocks()[p / B] * B + p % B] = kv_of(before, ids[i]);
    }
    t.commit_write(pos, ids);
    return true;
  }
  // What the sequence reads back at positions [0, n).
  std::vector<uint64_t> read(const KvBlockTable& t, int n) const {
    std::vector<uint64_t> out(n);
    for (int p = 0; p < n; ++p) out[p] = rows[(size_t)t.blocks()[p / B] * B + p % B];
    return out;
  }
};

std::vector<int> iota_ids(int n, int from) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

TEST(KvPool, FullBlocksArePublishedAndAdoptedByAnotherSequence) {
  Engine e(8);
  KvBlockTable a(e.pool), b(e.pool);
  const std::vector<int> prompt = iota_ids(40, 100);  // two full blocks and 8 positions
  ASSERT_TRUE(e.write(a, 0, prompt));
  EXPECT_EQ(a.blocks().size(), 3u);
  EXPECT_TRUE(e.pool.published(a.blocks()[0]));
  EXPECT_TRUE(e.pool.published(a.blocks()[1]));
  EXPECT_FALSE(e.pool.published(a.blocks()[2]));  // partial: never shared

  EXPECT_EQ(b.adopt_prefix(prompt, 1000), 32);
  EXPECT_EQ(b.blocks()[0], a.blocks()[0]);
  EXPECT_EQ(b.blocks()[1], a.blocks()[1]);
  EXPECT_EQ(e.pool.refs(a.blocks()[0]), 2);
  EXPECT_EQ(e.read(b, 32), kv_of(std::vector<int>(prompt.begin(), prompt.begin() + 32)));
  // The rest of b's prompt goes into a block of its own; a's are untouched.
  ASSERT_TRUE(e.write(b, 32, std::vector<int>(prompt.begin() + 32, prompt.end())));
  EXPECT_NE(b.blocks()[2], a.blocks()[2]);
  EXPECT_EQ(e.read(a, 40), kv_of(prompt));
  EXPECT_EQ(e.read(b, 40), kv_of(prompt));
}

TEST(KvPool, AdoptionStopsAtTheFirstDifferentBlockAndAtTheLimit) {
  Engine e(8);
  KvBlockTable a(e.pool), b(e.pool);
  const std::vector<int> prompt = iota_ids(48, 0);
  ASSERT_TRUE(e.write(a, 0, prompt));
  std::vector<int> other = prompt;
  other[20] = 999;  // differs in the second block
  EXPECT_EQ(b.adopt_prefix(other, 1000), 16);
  EXPECT_EQ(b.adopt_prefix(prompt, 47), 32);  // the limit cuts the third block
  EXPECT_EQ(b.adopt_prefix(std::vector<int>(prompt.begin(), prompt.begin() + 15), 1000), 0);
  // A block at the same depth with the same ids after a different prefix is not the same K/V.
  std::vector<int> shifted = iota_ids(32, 16);
  shifted[0] = 7;
  EXPECT_EQ(b.adopt_prefix(shifted, 1000), 0);
}

TEST(KvPool, WritingIntoASharedBlockCopiesItFirst) {
  Engine e(8);
  KvBlockTable a(e.pool), b(e.pool);
  const std::vector<int> prompt = iota_ids(32, 10);
  ASSERT_TRUE(e.write(a, 0, prompt));
  ASSERT_EQ(b.adopt_prefix(prompt, 1000), 32);
  // b rewrites its last position (generate_cached reruns a prompt's last token).
  ASSERT_TRUE(e.write(b, 31, {555}));
  EXPECT_NE(b.blocks()[1], a.blocks()[1]);
  EXPECT_EQ(b.blocks()[0], a.blocks()[0]);
  std::vector<int> want = prompt;
  EXPECT_EQ(e.read(a, 32), kv_of(want));
  want[31] = 555;
  EXPECT_EQ(e.read(b, 32), kv_of(want));  // the copy kept positions 16..30
  EXPECT_EQ(e.pool.refs(a.blocks()[1]), 1);
}

TEST(KvPool, RewritingAPublishedBlockOfOnesOwnTakesItOutOfTheIndex) {
  Engine e(8);
  KvBlockTable a(e.pool), b(e.pool);
  const std::vector<int> prompt = iota_ids(32, 10);
  ASSERT_TRUE(e.write(a, 0, prompt));
  const int blk = a.blocks()[1];
  ASSERT_TRUE(e.write(a, 20, {1, 2, 3}));  // a speculative draft rejected, say
  EXPECT_EQ(a.blocks()[1], blk);            // written in place: no one else holds it
  EXPECT_FALSE(e.pool.published(blk));
  EXPECT_EQ(b.adopt_prefix(prompt, 1000), 16);  // the old second block is gone
}

TEST(KvPool, ABlockWrittenAfterARewrittenOneIsNeverFoundUnderTheOldPrefix) {
  Engine e(16);
  KvBlockTable a(e.pool), c(e.pool), b(e.pool);
  const std::vector<int> prompt = iota_ids(48, 0);
  ASSERT_TRUE(e.write(a, 0, std::vector<int>(prompt.begin(), prompt.begin() + 32)));
  ASSERT_TRUE(e.write(a, 20, iota_ids(12, 900)));  // a's second block now differs
  ASSERT_TRUE(e.write(a, 32, std::vector<int>(prompt.begin() + 32, prompt.end())));
  ASSERT_TRUE(e.write(c, 0, prompt));  // the prompt as it was, whole, in c's blocks
  ASSERT_EQ(b.adopt_prefix(prompt, 1000), 48);
  EXPECT_EQ(e.read(b, 48), kv_of(prompt));  // c's third block, not a's
}

TEST(KvPool, FinishedSequencesStayCachedUntilTheMemoryIsNeeded) {
  Engine e(4);
  {
    KvBlockTable a(e.pool);
    ASSERT_TRUE(e.write(a, 0, iota_ids(32, 0)));
  }  // released: both blocks cached
  EXPECT_EQ(e.pool.cached_blocks(), 2);
  EXPECT_EQ(e.pool.available(), 4);
  KvBlockTable b(e.pool);
  EXPECT_EQ(b.adopt_prefix(iota_ids(40, 0), 1000), 32);
  EXPECT_EQ(e.pool.cached_blocks(), 0);
  b.clear();
  // A sequence that needs every block takes the cached ones, least recently used first.
  KvBlockTable c(e.pool);
  ASSERT_TRUE(e.write(c, 0, iota_ids(64, 500)));
  EXPECT_EQ(e.pool.available(), 0);
  KvBlockTable d(e.pool);
  EXPECT_EQ(d.adopt_prefix(iota_ids(32, 0), 1000), 0);
}

TEST(KvPool, UseCountsHeldAndCachedBlocks) {
  Engine e(4);
  EXPECT_EQ(e.pool.use().blocks, 4);
  EXPECT_EQ(e.pool.use().held, 0);
  {
    KvBlockTable a(e.pool);
    ASSERT_TRUE(e.write(a, 0, iota_ids(40, 0)));  // two full blocks and a partial one
    EXPECT_EQ(e.pool.use().held, 3);
    EXPECT_EQ(e.pool.use().cached, 0);
  }
  EXPECT_EQ(e.pool.use().held, 0);
  EXPECT_EQ(e.pool.use().cached, 2);  // the full ones stay for their prefix
}

TEST(KvPool, PoolSizesRoundUpToBlocksAndRefuseNoneOrTooMany) {
  EXPECT_EQ(KvBlockPool::blocks_for(1), 1);
  EXPECT_EQ(KvBlockPool::blocks_for(kKvBlock), 1);
  EXPECT_EQ(KvBlockPool::blocks_for(kKvBlock + 1), 2);
  EXPECT_THROW(KvBlockPool::blocks_for(0), Error);
  EXPECT_THROW(KvBlockPool::blocks_for(-5), Error);
  EXPECT_NO_THROW(KvBlockPool::blocks_for((int64_t)INT32_MAX / kKvBlock * kKvBlock));
  EXPECT_EQ(KvBlockPool::kMaxPositions, (int64_t)INT32_MAX / kKvBlock * kKvBlock);
  EXPECT_THROW(KvBlockPool::blocks_for(KvBlockPool::kMaxPositions + 1), Error);
  EXPECT_THROW(KvBlockPool::blocks_for((int64_t)INT32_MAX), Error);
}

TEST(KvPool, ARefusedWriteChangesNothing) {
  Engine e(3);
  KvBlockTable a(e.pool), b(e.pool);
  ASSERT_TRUE(e.write(a, 0, iota_ids(32, 0)));
  ASSERT_EQ(b.adopt_prefix(iota_ids(32, 0), 1000), 32);
  // b needs a copy of block 1 and a new block: two, and only one is free.
  std::vector<KvBlockTable::Copy> copies;
  const std::vector<int32_t> before = b.blocks();
  EXPECT_FALSE(b.prepare_write(31, 2, copies));
  EXPECT_EQ(b.blocks(), before);
  EXPECT_EQ(e.pool.free_blocks(), 1);
  EXPECT_EQ(e.pool.refs(before[1]), 2);
  EXPECT_TRUE(e.write(b, 32, {1}));  // one block: fits
}

// Random sequences over a small pool: new prompts from a few shared headers, continuations,
// rewrites of earlier positions and releases, each checked by what every live sequence reads.
TEST(KvPool, RandomTrafficReadsBackWhatEachSequenceWrote) {
  std::mt19937 rng(7);
  Engine e(24);
  std::vector<std::vector<int>> headers;
  for (int h = 0; h < 3; ++h) headers.push_back(iota_ids(16 * (h + 1) + 5, 1000 * (h + 1)));
  std::vector<std::unique_ptr<KvBlockTable>> seqs;
  std::vector<std::vector<int>> truth;  // what each sequence should read back
  for (int s = 0; s < 5; ++s) {
    seqs.push_back(std::make_unique<KvBlockTable>(e.pool));
    truth.emplace_back();
  }
  int adopted = 0, refused = 0;
  for (int step = 0; step < 4000; ++step) {
    const int s = rng() % seqs.size();
    KvBlockTable& t = *seqs[s];
    std::vector<int>& want = truth[s];
    const int op = rng() % 10;
    if (op == 0) {  // a new request: a header and a tail of its own
      std::vector<int> prompt = headers[rng() % headers.size()];
      for (int i = rng() % 20; i > 0; --i) prompt.push_back(rng() % 50);
      const int got = t.adopt_prefix(prompt, (int)prompt.size() - 1);
      adopted += got;
      ASSERT_EQ(got % B, 0);
      want.assign(prompt.begin(), prompt.begin() + got);
      ASSERT_EQ(e.read(t, got), kv_of(want));
      std::vector<int> rest(prompt.begin() + got, prompt.end());
      if (e.write(t, got, rest)) {
        want = prompt;
      } else {
        ++refused;
        t.clear();
        want.clear();
      }
    } else if (op == 1) {
      t.clear();
      want.clear();
    } else {  // continue, or rewrite from a position a little back (rejected drafts)
      const int back = op == 2 ? std::min<int>(want.size(), rng() % 20) : 0;
      const int pos = (int)want.size() - back;
      std::vector<int> ids(1 + rng() % 8);
      for (int& id : ids) id = rng() % 50;
      if (pos + (int)ids.size() > 200) continue;
      if (e.write(t, pos, ids)) {
        want.resize(pos);
        want.insert(want.end(), ids.begin(), ids.end());
      } else {
        ++refused;
      }
    }
    for (size_t k = 0; k < seqs.size(); ++k)
      ASSERT_EQ(e.read(*seqs[k], (int)truth[k].size()), kv_of(truth[k])) << "step " << step << " seq " << k;
    // Every block is free, cached or held, once.
    int held = 0;
    for (int b = 0; b < e.pool.n_blocks(); ++b) held += e.pool.refs(b) > 0;
    ASSERT_EQ(held + e.pool.available(), e.pool.n_blocks());
  }
  EXPECT_GT(adopted, 0);  // the headers were shared
  EXPECT_GT(refused, 0);  // and the pool ran short
}

}  // namespace
}  // namespace kestrel
