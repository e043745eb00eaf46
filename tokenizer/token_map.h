// Token string -> id, for vocabularies of hundreds of thousands of tokens: open addressing
// over one arena of bytes, so that building it is a few allocations rather than one per
// token, and a lookup touches one slot and the bytes it compares.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

class TokenMap {
 public:
  void reserve(size_t n);
  // Adds `key` -> `id`; a key already present keeps its id unless `replace`.
  void insert(std::string_view key, int id, bool replace = false);
  int find(std::string_view key) const;  // -1 when absent
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint32_t offset = 0, len = 0, hash = 0;
    int32_t id = -1;  // -1: empty
  };
  static uint32_t hash(std::string_view key);
  void grow();

  std::string arena_;
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
};

}  // namespace kestrel
