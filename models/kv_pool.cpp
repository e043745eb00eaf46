#include "models/kv_pool.h"

#include <algorithm>

#include "base/error.h"

namespace kestrel {

int KvBlockPool::blocks_for(int64_t positions) {
  KESTREL_CHECK(positions > 0, "a KV pool of " + std::to_string(positions) + " positions");
  KESTREL_CHECK(positions <= kMaxPositions,
                "a KV pool of " + std::to_string(positions) + " positions is past what one holds (" +
                    std::to_string(kMaxPositions) + ")");
  return (int)((positions + kBlock - 1) / kBlock);
}

KvBlockPool::KvBlockPool(int n_blocks) : blocks_(std::max(0, n_blocks)) {
  KESTREL_CHECK(n_blocks > 0, "a KV pool needs at least one block");
  free_.reserve(n_blocks);
  for (int b = n_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 handed out first
}

int KvBlockPool::allocate() {
  int b = -1;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    Block& k = blocks_[b];
    index_.erase(k.key);
    k.published = false;
    k.ids.clear();
  } else {
    return -1;
  }
  blocks_[b].refs = 1;
  return b;
}

void KvBlockPool::retain(int b) {
  Block& k = blocks_[b];
  KESTREL_CHECK(k.refs > 0 || k.published, "KV pool: a free block retained");
  if (k.refs == 0) lru_.erase(k.lru);
  ++k.refs;
}

void KvBlockPool::release(int b) {
  Block& k = blocks_[b];
  KESTREL_CHECK(k.refs > 0, "KV pool: a block released more often than held");
  if (--k.refs > 0) return;
  if (k.published) {
    k.lru = lru_.insert(lru_.end(), b);
  } else {
    free_.push_back(b);
  }
}

uint64_t KvBlockPool::chain_key(uint64_t parent, std::span<const int> ids) {
  // splitmix64's finalizer over the parent key and each id: every bit of each input reaches
  // every bit of the key.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent + 0x9e3779b97f4a7c15ull);
  for (int id : ids) h = mix(h ^ (uint64_t)(uint32_t)id) + 0x9e3779b97f4a7c15ull;
  return h == kRoot ? 1 : h;
}

int KvBlockPool::lookup(uint64_t parent, std::span<const int> ids) {
  auto it = index_.find(chain_key(parent, ids));
  if (it == index_.end()) return -1;
  Block& k = blocks_[it->second];
  if (k.parent != parent || !std::equal(ids.begin(), ids.end(), k.ids.begin(), k.ids.end()))
    return -1;  // a collision of keys: a miss
  if (k.refs == 0) lru_.splice(lru_.end(), lru_, k.lru);  // most recently used now
  return it->second;
}

void KvBlockPool::publish(int b, uint64_t parent, std::span<const int> ids) {
  KESTREL_CHECK((int)ids.size() == kBlock, "KV pool: a published block holds a whole block");
  Block& k = blocks_[b];
  KESTREL_CHECK(k.refs > 0, "KV pool: only a held block is published");
  const uint64_t key = chain_key(parent, ids);
  if (k.published) {
    if (k.key == key) return;
    unpublish(b);
  }
  if (index_.count(key)) return;  // another block holds this prefix already
  k.published = true;
  k.key = key;
  k.parent = parent;
  k.ids.assign(ids.begin(), ids.end());
  index_.emplace(key, b);
}

void KvBlockPool::unpublish(int b) {
  Block& k = blocks_[b];
  if (!k.published) return;
  auto it = index_.find(k.key);
  if (it != index_.end() && it->second == b) index_.erase(it);
  k.published = false;
  k.ids.clear();
  if (k.refs == 0) {  // cached: nothing keeps it now
    lru_.erase(k.lru);
    free_.push_back(b);
  }
}

void KvBlockTable::clear() {
  for (int32_t b : blocks_) pool_->release(b);
  blocks_.clear();
  keys_.clear();
  ids_.clear();
}

int KvBlockTable::adopt_prefix(std::span<const int> prompt, int max_positions) {
  clear();
  const size_t limit = std::min(prompt.size(), (size_t)std::max(0, max_positions));
  uint64_t parent = KvBlockPool::kRoot;
  for (size_t p = 0; p + KvBlockPool::kBlock <= limit; p += KvBlockPool::kBlock) {
    const std::span<const int> ids = prompt.subspan(p, KvBlockPool::kBlock);
    const int b = pool_->lookup(parent, ids);
    if (b < 0) break;
    pool_->retain(b);
    blocks_.push_back(b);
    parent = KvBlockPool::chain_key(parent, ids);
    keys_.push_back(parent);
    ids_.insert(ids_.end(), ids.begin(), ids.end());
  }
  return written();
}

bool KvBlockTable::prepare_write(int pos, int n, std::vector<Copy>& copies) {
  copies.clear();
  if (n <= 0) return true;
  KESTREL_CHECK(pos >= 0, "KV table: a negative position");
  const int first = pos / KvBlockPool::kBlock, last = (pos + n - 1) / KvBlockPool::kBlock;
  // Count the blocks needed before taking any, so that a refusal changes nothing.
  int need = std::max(0, last + 1 - (int)blocks_.size());
  for (int j = first; j <= last && j < (int)blocks_.size(); ++j)
    if (pool_->refs(blocks_[j]) > 1) ++need;
  if (need > pool_->available()) return false;
  for (int j = first; j <= last && j < (int)blocks_.size(); ++j) {
    const int b = blocks_[j];
    if (pool_->refs(b) > 1) {  // shared: write into a copy of our own
      const int c = pool_->allocate();
      copies.push_back({b, c});
      pool_->release(b);
      blocks_[j] = c;
    } else {
      pool_->unpublish(b);  // ours alone: its key no longer names what it will hold
    }
  }
  while ((int)blocks_.size() <= last) blocks_.push_back(pool_->allocate());
  return true;
}

void KvBlockTable::commit_write(int pos, std::span<const int> ids) {
  ids_.resize(pos, -1);  // a gap's ids are unknown: no block over it is published
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  keys_.resize(std::min(keys_.size(), (size_t)(pos / KvBlockPool::kBlock)));
  for (size_t j = keys_.size(); (j + 1) * KvBlockPool::kBlock <= ids_.size(); ++j) {
    const std::span<const int> block(ids_.data() + j * KvBlockPool::kBlock, KvBlockPool::kBlock);
    if (std::any_of(block.begin(), block.end(), [](int id) { return id < 0; })) break;
    const uint64_t parent = j ? keys_[j - 1] : KvBlockPool::kRoot;
    keys_.push_back(KvBlockPool::chain_key(parent, block));
    pool_->publish(blocks_[j], parent, block);
  }
}

}  // namespace kestrel
