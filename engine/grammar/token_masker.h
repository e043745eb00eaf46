// Which tokens a grammar allows next: a byte trie over the vocabulary walked with the matcher,
// so that a prefix shared by many tokens is matched once and a refused byte cuts off every
// token below it (docs/grammar.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/grammar/grammar.h"

namespace kestrel::grammar {

class TokenMasker;

// Masks already computed for the states of one generation, the least recently used evicted
// past `capacity`. Inside a JSON string the state after every ordinary character is the same,
// so after the string's first mask each one is a lookup (a hash of the stacks) and a copy.
// Belongs to one generation (not thread-safe) and to one masker.
class MaskCache {
 public:
  explicit MaskCache(size_t capacity = 16) : capacity_(capacity) {}
  size_t hits() const { return hits_; }
  size_t misses() const { return misses_; }

 private:
  friend class TokenMasker;
  struct Entry {
    std::shared_ptr<const Grammar> g;
    StackSet set;
    size_t hash = 0;
    uint64_t used = 0;
    std::vector<uint32_t> mask;
  };
  const TokenMasker* owner_ = nullptr;
  std::vector<Entry> entries_;
  size_t capacity_;
  uint64_t tick_ = 0;
  size_t hits_ = 0, misses_ = 0;
};

class TokenMasker {
 public:
  // `token_bytes[id]` is the text token `id` adds in the middle of a generation
  // (Tokenizer::all_token_bytes); "" marks a token never allowed (control tokens, unused ids). The `eos_ids` are
  // allowed exactly when the state is a complete match. Built once per vocabulary and shared:
  // the masker holds no grammar and its methods are const (safe from several threads).
  TokenMasker(std::vector<std::string> token_bytes, std::vector<int> eos_ids);

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  // The words of a bitmask: bit (id % 32) of word id / 32 is token id.
  size_t mask_words() const { return (tokens_.size() + 31) / 32; }

  // Writes the bitmask of tokens allowed after `st` into mask[0 .. mask_words()).
  void allowed_tokens(const GrammarState& st, uint32_t* mask) const;
  std::vector<uint32_t> allowed_tokens(const GrammarState& st) const;
  // The same, through a generation's cache of masks per state.
  void allowed_tokens(const GrammarState& st, uint32_t* mask, MaskCache& cache) const;
  // Takes token `id`: false (and no change) when the grammar refuses it. An end-of-sequence
  // id is taken, changing nothing, exactly when the state is a complete match.
  bool accept_token(GrammarState& st, int id) const;
  bool is_eos(int id) const;
  const std::vector<int>& eos_ids() const { return eos_; }
  const std::string& token_bytes(int id) const { return tokens_[static_cast<size_t>(id)]; }
  size_t trie_nodes() const { return nodes_.size(); }

 private:
  // A trie node in preorder: the tokens below it are a contiguous run of the sorted tokens.
  struct Node {
    uint32_t end;        // the preorder index just past this node's subtree
    uint32_t tok_lo;     // sorted tokens of the subtree: [tok_lo, tok_hi); those that end
    uint32_t tok_exact;  // here are [tok_lo, tok_exact)
    uint32_t tok_hi;
    uint64_t below[2];   // the ASCII bytes on edges below this node
    uint16_t depth;
    uint16_t height;     // the longest path below this node, in bytes
    uint8_t byte;        // the edge into this node
    uint8_t flags;       // kNonAsciiBelow, kValidBelow
  };
  static constexpr uint8_t kNonAsciiBelow = 1;
  static constexpr uint8_t kValidBelow = 2;  // every path below continues valid UTF-8
  static constexpr uint8_t kValidPrefix = 4; // the bytes down to this node are valid UTF-8 so far

  void set_range(uint32_t* mask, uint32_t lo, uint32_t hi) const {
    for (uint32_t i = lo; i < hi; ++i) {
      const uint32_t id = sorted_[i];
      mask[id >> 5] |= 1u << (id & 31);
    }
  }

  std::vector<std::string> tokens_;
  std::vector<uint32_t> sorted_;  // token ids in byte order
  std::vector<Node> nodes_;
  std::vector<int> eos_;
  std::vector<uint8_t> is_eos_;
  size_t max_depth_ = 0;
};

}  // namespace kestrel::grammar
