// Paged KV memory's bookkeeping (docs/server.md, "Paged KV memory with shared prefixes"): one
// pool of fixed-size blocks of positions per model, a block table per sequence, reference counts,
// and an index of full blocks by the token ids they hold, so that sequences with a common prefix
// share its blocks.
//
// This class owns no K/V bytes: an engine keeps its cache as [blocks * kBlock positions] rows
// per layer and maps a sequence's position p to row table[p / kBlock] * kBlock + p % kBlock.
// Everything here is host-side and engine-independent.
//
// A block is in one of three states:
//   free       on the free list;
//   held       referenced by one or more tables (refs > 0); it may also be published;
//   cached     published, refs == 0: its K/V are kept for a later sequence with the same
//              prefix, and it is taken back (least recently used first) when no block is free.
// A published block's key hashes its parent's key and its kBlock ids, so that one key names
// the whole prefix from position 0. A lookup also compares the block's stored ids and its
// parent's key, so two blocks whose keys collide read as a miss; what is not checked is a
// collision of two whole prefixes' 64-bit parent keys (odds about n^2 / 2^65 over n cached
// blocks).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "kernels/attention/kv_quant.h"

namespace kestrel {

// How a model's paged KV memory is used (Model::kv_pool_use, KvBlockPool::use), in blocks of
// kKvBlock positions.
struct KvPoolUse {
  int64_t blocks = 0;  // 0: no pool (each session has a cache of its own)
  int64_t held = 0;    // held by live sequences
  int64_t cached = 0;  // kept for a later prompt with the same prefix, reusable at once
};

class KvBlockPool {
 public:
  static constexpr int kBlock = kKvBlock;  // positions per block
  static constexpr uint64_t kRoot = 0;   // the parent key of a sequence's first block

  // The most positions a pool holds: whole blocks whose rows an int32 row index reaches.
  static constexpr int64_t kMaxPositions = (int64_t)INT32_MAX / kBlock * kBlock;
  // The blocks of a pool of `positions` positions, rounded up; a kestrel::Error for none, or for
  // more than kMaxPositions.
  static int blocks_for(int64_t positions);

  explicit KvBlockPool(int n_blocks);
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  int n_blocks() const { return (int)blocks_.size(); }
  // Blocks an allocate() can still hand out: the free ones and the cached ones.
  int available() const { return (int)free_.size() + (int)lru_.size(); }
  int free_blocks() const { return (int)free_.size(); }
  int cached_blocks() const { return (int)lru_.size(); }
  KvPoolUse use() const {
    return {n_blocks(), n_blocks() - available(), cached_blocks()};
  }
  int refs(int b) const { return blocks_[b].refs; }
  bool published(int b) const { return blocks_[b].published; }

  // A block for a table to write into (refs 1, unpublished): a free one, else the least
  // recently used cached one (taken out of the index). -1 when every block is held.
  int allocate();
  // One more table holds b (a cached block becomes held again).
  void retain(int b);
  // A table lets go of b: at refs 0 a published block stays cached, any other is freed.
  void release(int b);

  // The key of a block holding ids[0..kBlock) after the prefix whose last block's key is
  // `parent` (kRoot for the first block).
  static uint64_t chain_key(uint64_t parent, std::span<const int> ids);
  // The published block holding exactly `ids` after `parent`, or -1. A hit counts as a use
  // (for eviction order); the caller retains the block to hold it.
  int lookup(uint64_t parent, std::span<const int> ids);
  // b (held) now holds ids after `parent`: publish it under chain_key(parent, ids). A no-op
  // where another block is already published under that key (the first one stays).
  void publish(int b, uint64_t parent, std::span<const int> ids);
  // b's contents are about to change: take it out of the index.
  void unpublish(int b);

 private:
  struct Block {
    int refs = 0;
    bool published = false;
    uint64_t key = 0, parent = 0;
    std::vector<int> ids;               // [kBlock] while published
    std::list<int>::iterator lru;       // into lru_ while cached
  };
  std::vector<Block> blocks_;
  std::vector<int> free_;               // a stack: the last block freed is reused first
  std::list<int> lru_;                  // cached blocks, least recently used first
  std::unordered_map<uint64_t, int> index_;
};

// A sequence's block table over a KvBlockPool, with the ids it wrote (so that its full blocks
// can be published and a new prompt can take a cached prefix). It keeps the invariant that a
// block it is about to write is held by it alone and unpublished (copy on write).
class KvBlockTable {
 public:
  explicit KvBlockTable(KvBlockPool& pool) : pool_(&pool) {}
  ~KvBlockTable() { clear(); }
  KvBlockTable(const KvBlockTable&) = delete;
  KvBlockTable& operator=(const KvBlockTable&) = delete;

  // The block of each kBlock positions from position 0.
  const std::vector<int32_t>& blocks() const { return blocks_; }
  // The ids at positions 0 .. written() - 1, as the last writes left them.
  const std::vector<int>& ids() const { return ids_; }
  int written() const { return (int)ids_.size(); }

  // Lets go of every block (they stay cached where published).
  void clear();
  // Starts a new sequence: clear(), then map the longest run of published full blocks that
  // `prompt` begins with (at most max_positions positions) and return how many positions they
  // cover (a multiple of kBlock). Those positions need not run again.
  int adopt_prefix(std::span<const int> prompt, int max_positions);

  // What a write of ids[0..n) at positions pos .. pos + n - 1 needs, before the engine writes:
  // every block it touches held by this table alone and unpublished. A block shared with
  // another table is replaced by a copy: copies receives (from, to) pairs the engine must copy
  // (every position of the block) before writing. Returns false, changing nothing, when the
  // pool cannot give the blocks (the caller may free memory and retry, or refuse).
  struct Copy {
    int from, to;
  };
  bool prepare_write(int pos, int n, std::vector<Copy>& copies);
  // After the engine wrote ids[0..n) at pos: records them (positions past pos + n are
  // forgotten) and publishes the blocks that became full.
  void commit_write(int pos, std::span<const int> ids);

 private:
  // chain key of block j (its ids known and full): keys_[j].
  KvBlockPool* pool_;
  std::vector<int32_t> blocks_;
  std::vector<uint64_t> keys_;  // keys_[j]: the chain key of block j once full and recorded
  std::vector<int> ids_;
};

}  // namespace kestrel
