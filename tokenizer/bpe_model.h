// The BPE model: a word's symbols merged pair by pair in the order of the merge list, as
// Hugging Face's tokenizers does (lowest rank first, the leftmost pair on ties).
//
// Symbols are strings of the model's alphabet: raw bytes for a byte-level tokenizer (its
// vocabulary is converted from GPT-2's byte characters to bytes at load, so words need no
// mapping), UTF-8 characters otherwise, with byte_fallback's <0xNN> tokens or the unknown token
// for characters the vocabulary lacks.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tokenizer/token_map.h"

namespace kestrel {

struct BpeOptions {
  bool byte_level = false;     // symbols are bytes rather than UTF-8 characters
  bool ignore_merges = false;  // a word that is itself in the vocabulary is one token
  bool byte_fallback = false;  // unknown characters as <0xNN> tokens
  int unk_id = -1;             // the unknown token (-1: unknown characters are dropped)
  bool fuse_unk = false;       // consecutive unknown characters as one unknown token
};

class BpeModel {
 public:
  // `vocab`: token (in the model's alphabet) -> id; `merges`: pairs in rank order. `where`
  // names the file for errors (a merge whose parts or result are not in the vocabulary).
  BpeModel(std::vector<std::pair<std::string, int>> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& o,
           const std::string& where);

  // Appends the ids of `word` to `out`.
  void encode_word(std::string_view word, std::vector<int>& out) const;
  int token_id(std::string_view token) const;  // -1 when absent

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  // Pair (left id, right id) -> (rank, merged id), open addressing: the merge loop's only
  // lookup, so it is kept flat.
  class PairMap {
   public:
    void reserve(size_t n);
    void insert(uint32_t a, uint32_t b, uint32_t rank, uint32_t merged);
    // False when the pair does not merge.
    bool find(uint32_t a, uint32_t b, uint32_t* rank, uint32_t* merged) const;

   private:
    struct Slot {
      uint64_t key = ~0ull;
      uint32_t rank = 0, merged = 0;
    };
    std::vector<Slot> slots_;
    size_t mask_ = 0, size_ = 0;
  };

  void initial_symbols(std::string_view word, std::vector<int>& syms) const;
  void merge(std::vector<int>& syms) const;

  BpeOptions o_;
  TokenMap vocab_;
  PairMap merges_;
  int byte_ids_[256];      // byte-level: the token of each byte, -1 when absent
  int fallback_ids_[256];  // byte_fallback: <0xNN>, -1 when absent

  // Words already merged. Text repeats its words, so most lookups end here. Bounded: once it
  // is full, new words are merged every time (as tokenizers does).
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int>, StringHash, std::equal_to<>> cache_;
};

}  // namespace kestrel
