#include "tokenizer/token_map.h"

namespace kestrel {

uint32_t TokenMap::hash(std::string_view key) {
  // FNV-1a, then a final mix so that the low bits (the slot) depend on every byte.
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : key) h = (h ^ c) * 0x100000001b3ull;
  h ^= h >> 32;
  h *= 0xd6e8feb86659fd93ull;
  h ^= h >> 32;
  return static_cast<uint32_t>(h);
}

void TokenMap::reserve(size_t n) {
  if (n * 2 <= slots_.size()) return;
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (const Slot& s : old) {
    if (s.id < 0) continue;
    size_t i = s.hash & mask_;
    while (slots_[i].id >= 0) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void TokenMap::grow() { reserve(slots_.empty() ? 8 : slots_.size()); }

void TokenMap::insert(std::string_view key, int id, bool replace) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const uint32_t h = hash(key);
  for (size_t i = h & mask_;; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.id < 0) {
      s = {static_cast<uint32_t>(arena_.size()), static_cast<uint32_t>(key.size()), h, id};
      arena_.append(key);
      ++size_;
      return;
    }
    if (s.hash == h && std::string_view(arena_).substr(s.offset, s.len) == key) {
      if (replace) s.id = id;
      return;
    }
  }
}

int TokenMap::find(std::string_view key) const {
  if (slots_.empty()) return -1;
  const uint32_t h = hash(key);
  for (size_t i = h & mask_;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.id < 0) return -1;
    if (s.hash == h && s.len == key.size() &&
        std::string_view(arena_).substr(s.offset, s.len) == key)
      return s.id;
  }
}

}  // namespace kestrel
