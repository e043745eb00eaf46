#include "tokenizer/bpe_model.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "base/error.h"
#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

// Words longer than this are merged every time rather than cached (as tokenizers does).
constexpr size_t kMaxCachedWord = 256;
constexpr size_t kCacheCapacity = 1 << 16;

uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }

uint64_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

// One candidate merge: the pair starting at symbol `pos`.
struct Candidate {
  uint32_t rank;
  int pos;
  uint32_t merged;
  // std::*_heap keep the largest on top: the lowest rank, then the leftmost position, wins.
  bool operator<(const Candidate& o) const {
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};

struct Symbol {
  int id, prev, next;
  bool alive;
};

}  // namespace

void BpeModel::PairMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  size_ = 0;
}

void BpeModel::PairMap::insert(uint32_t a, uint32_t b, uint32_t rank, uint32_t merged) {
  const uint64_t key = pair_key(a, b);
  for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key == key || s.key == ~0ull) {
      size_ += s.key != key;
      s = {key, rank, merged};
      return;
    }
  }
}

bool BpeModel::PairMap::find(uint32_t a, uint32_t b, uint32_t* rank, uint32_t* merged) const {
  if (slots_.empty()) return false;
  const uint64_t key = pair_key(a, b);
  for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.key == key) {
      *rank = s.rank;
      *merged = s.merged;
      return true;
    }
    if (s.key == ~0ull) return false;
  }
}

BpeModel::BpeModel(std::vector<std::pair<std::string, int>> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   const BpeOptions& o, const std::string& where)
    : o_(o) {
  vocab_.reserve(vocab.size());
  for (const auto& [token, id] : vocab) vocab_.insert(token, id, /*replace=*/true);
  for (int b = 0; b < 256; ++b) {
    byte_ids_[b] = token_id(std::string(1, static_cast<char>(b)));
    fallback_ids_[b] = o_.byte_fallback ? token_id(fmt::format("<0x{:02X}>", b)) : -1;
  }

  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    joined.assign(a).append(b);
    const int ia = token_id(a), ib = token_id(b), im = token_id(joined);
    const std::string& missing = ia < 0 ? a : ib < 0 ? b : joined;
    if (ia < 0 || ib < 0 || im < 0)
      throw Error(fmt::format("{}: merge {} (\"{} {}\"): \"{}\" is not in the vocabulary", where,
                              rank, a, b, missing));
    // A pair listed twice keeps its last rank, as tokenizers' map of merges does.
    merges_.insert(static_cast<uint32_t>(ia), static_cast<uint32_t>(ib),
                   static_cast<uint32_t>(rank), static_cast<uint32_t>(im));
  }
}

int BpeModel::token_id(std::string_view token) const { return vocab_.find(token); }

// The word's symbols before any merge, as tokenizers' merge_word builds them.
void BpeModel::initial_symbols(std::string_view word, std::vector<int>& syms) const {
  int unk = -1;  // a pending unknown token (fuse_unk extends it)
  auto unknown = [&] {
    if (o_.unk_id < 0) return;  // no unknown token: the character is dropped
    if (unk >= 0 && !o_.fuse_unk) syms.push_back(unk);
    unk = o_.unk_id;
  };
  size_t i = 0;
  while (i < word.size()) {
    size_t len = 1;
    int id;
    if (o_.byte_level) {
      id = byte_ids_[static_cast<uint8_t>(word[i])];
    } else {
      utf8::decode_char(word.substr(i), &len);
      len = std::min(len, word.size() - i);
      id = token_id(word.substr(i, len));
    }
    const std::string_view c = word.substr(i, len);
    i += len;
    if (id >= 0) {
      if (unk >= 0) syms.push_back(std::exchange(unk, -1));
      syms.push_back(id);
      continue;
    }
    if (o_.byte_fallback &&
        std::all_of(c.begin(), c.end(), [&](char b) { return fallback_ids_[uint8_t(b)] >= 0; })) {
      // As tokenizers does, the bytes go in before a pending unknown token.
      for (char b : c) syms.push_back(fallback_ids_[static_cast<uint8_t>(b)]);
      continue;
    }
    unknown();
  }
  if (unk >= 0) syms.push_back(unk);
}

// Applies the merges in rank order, leftmost first among equal ranks: a heap of candidate
// pairs over a linked list of symbols, entries made stale by earlier merges skipped when they
// surface (tokenizers' Word::merge_all).
void BpeModel::merge(std::vector<int>& ids) const {
  const int n = static_cast<int>(ids.size());
  if (n < 2) return;
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Candidate> heap;
  sym.resize(n);
  heap.clear();
  uint32_t rank, merged;
  for (int i = 0; i < n; ++i) sym[i] = {ids[i], i - 1, i + 1 < n ? i + 1 : -1, true};
  for (int i = 0; i + 1 < n; ++i)
    if (merges_.find(ids[i], ids[i + 1], &rank, &merged)) heap.push_back({rank, i, merged});
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& s = sym[top.pos];
    if (!s.alive || s.next < 0) continue;
    const int right = s.next;
    // A stale entry: the pair at pos changed since it was queued.
    if (!merges_.find(s.id, sym[right].id, &rank, &merged) || merged != top.merged) continue;
    s.id = static_cast<int>(top.merged);
    sym[right].alive = false;
    s.next = sym[right].next;
    if (s.next >= 0) sym[s.next].prev = top.pos;
    if (s.prev >= 0 && merges_.find(sym[s.prev].id, s.id, &rank, &merged)) {
      heap.push_back({rank, s.prev, merged});
      std::push_heap(heap.begin(), heap.end());
    }
    if (s.next >= 0 && merges_.find(s.id, sym[s.next].id, &rank, &merged)) {
      heap.push_back({rank, top.pos, merged});
      std::push_heap(heap.begin(), heap.end());
    }
  }
  ids.clear();
  for (int i = 0; i < n; ++i)
    if (sym[i].alive) ids.push_back(sym[i].id);
}

void BpeModel::encode_word(std::string_view word, std::vector<int>& out) const {
  if (word.empty()) return;
  if (o_.ignore_merges) {
    const int id = token_id(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const bool cacheable = word.size() < kMaxCachedWord;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  thread_local std::vector<int> syms;
  syms.clear();
  initial_symbols(word, syms);
  merge(syms);
  out.insert(out.end(), syms.begin(), syms.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), syms);
  }
}

}  // namespace kestrel
