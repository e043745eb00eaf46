// The token masks. Two things make a mask cheap on a 150k-token vocabulary:
// - the trie: a byte the state refuses skips the whole subtree below it, and a prefix is
//   matched once for all the tokens that share it;
// - loops: inside a JSON string nearly every byte leads back to the same state. For a state
//   whose set of such looping bytes covers every byte below a trie node (precomputed per
//   node), every token below is allowed without walking it. Which bytes loop is found by
//   trying each ASCII byte once per distinct state, and remembered per thread.
#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>

#include "base/error.h"
#include "engine/grammar/token_masker.h"

namespace kestrel::grammar {

namespace {

// Below this many tokens a subtree is walked rather than tested for loops.
constexpr uint32_t kLoopTestMin = 2;
constexpr size_t kLoopCacheSize = 64;

// Strict UTF-8 validity of a byte string read from a code point boundary, one byte at a
// time, with the same table as advance() (grammar.h).
struct Utf8Check {
  uint8_t remaining = 0, lead = 0, seen = 0;
  bool step(uint8_t b) {
    if (remaining == 0) {
      if (b < 0x80) return true;
      lead = b;
      seen = 0;
      if (b >= 0xC2 && b <= 0xDF) remaining = 1;
      else if (b >= 0xE0 && b <= 0xEF) remaining = 2;
      else if (b >= 0xF0 && b <= 0xF4) remaining = 3;
      else return false;
      return true;
    }
    uint8_t lo = 0x80, hi = 0xBF;
    if (seen == 0) {
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    }
    if (b < lo || b > hi) return false;
    --remaining;
    ++seen;
    return true;
  }
};

struct LoopInfo {
  std::shared_ptr<const Grammar> g;
  StackSet set;
  size_t hash = 0;
  uint64_t ascii[2] = {0, 0};  // bytes that lead back to this state
  bool non_ascii = false;      // every non-ASCII code point does too
};

// The looping bytes of the state at one depth of the walk, when they are known (a copy, as a
// LoopInfo may be evicted while the walk goes on).
struct LoopBits {
  uint64_t ascii[2] = {0, 0};
  bool non_ascii = false;
  bool known = false;
};

struct Scratch {
  std::vector<StackSet> states;
  std::vector<LoopBits> loop_at;  // per depth, for states[depth]
  std::vector<LoopInfo> loops;    // most recent last
  StackSet tmp, tmp2;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

const LoopInfo& loop_info(const GrammarState& st, const StackSet& set) {
  Scratch& s = scratch();
  const size_t h = set.hash();
  for (size_t i = s.loops.size(); i-- > 0;) {
    if (s.loops[i].hash == h && s.loops[i].g == st.grammar_ptr() && s.loops[i].set.same_as(set)) {
      return s.loops[i];
    }
  }
  if (s.loops.size() >= kLoopCacheSize) s.loops.erase(s.loops.begin());
  LoopInfo info;
  info.g = st.grammar_ptr();
  info.set = set;
  info.hash = h;
  const Grammar& g = st.grammar();
  for (uint32_t b = 0; b < 128; ++b) {
    if (advance(g, set, static_cast<uint8_t>(b), s.tmp) && s.tmp.same_as(set)) {
      info.ascii[b >> 6] |= uint64_t{1} << (b & 63);
    }
  }
  // Every non-ASCII code point leads back here when each stack's top takes all of them or
  // none: then U+0080 stands for them all.
  bool uniform = true;
  size_t off = 0;
  for (uint32_t i = 0; i < set.count && uniform; ++i) {
    const uint32_t len = set.words[off];
    if (len > 0) {
      const CharClass& c = g.classes()[g.elements()[set.words[off + len]].arg];
      uniform = c.all_non_ascii() || c.no_non_ascii();
    }
    off += len + 1;
  }
  info.non_ascii = uniform && advance(g, set, 0xC2, s.tmp) && advance(g, s.tmp, 0x80, s.tmp2) &&
                   s.tmp2.same_as(set);
  s.loops.push_back(std::move(info));
  return s.loops.back();
}

}  // namespace

TokenMasker::TokenMasker(std::vector<std::string> token_bytes, std::vector<int> eos_ids)
    : tokens_(std::move(token_bytes)), eos_(std::move(eos_ids)) {
  is_eos_.assign(tokens_.size(), 0);
  for (int id : eos_) {
    KESTREL_CHECK(id >= 0 && static_cast<size_t>(id) < tokens_.size(),
                  "token masker: end-of-sequence id " + std::to_string(id) + " is outside the vocabulary of " +
                      std::to_string(tokens_.size()));
    is_eos_[static_cast<size_t>(id)] = 1;
  }
  for (uint32_t id = 0; id < tokens_.size(); ++id) {
    if (!tokens_[id].empty() && !is_eos_[id]) sorted_.push_back(id);
  }
  std::sort(sorted_.begin(), sorted_.end(),
            [&](uint32_t a, uint32_t b) { return tokens_[a] < tokens_[b]; });
  for (uint32_t id : sorted_) {
    KESTREL_CHECK(tokens_[id].size() < 65535, "token masker: token " + std::to_string(id) + " is longer than 65535 bytes");
  }

  // Preorder construction over the sorted tokens: a node's tokens share its prefix.
  struct Frame {
    uint32_t node, next;  // the node, and the first of its tokens not yet under a child
  };
  std::vector<uint32_t> parent;
  std::vector<Frame> stack;
  auto open = [&](uint32_t lo, uint32_t hi, uint16_t depth, uint8_t byte, uint32_t par) {
    Node n{};
    n.tok_lo = lo;
    n.tok_hi = hi;
    n.depth = depth;
    n.byte = byte;
    uint32_t i = lo;
    while (i < hi && tokens_[sorted_[i]].size() == depth) ++i;
    n.tok_exact = i;
    nodes_.push_back(n);
    parent.push_back(par);
    max_depth_ = std::max<size_t>(max_depth_, depth);
    stack.push_back({static_cast<uint32_t>(nodes_.size() - 1), i});
  };
  open(0, static_cast<uint32_t>(sorted_.size()), 0, 0, 0);
  while (!stack.empty()) {
    Frame& f = stack.back();
    Node& n = nodes_[f.node];
    if (f.next >= n.tok_hi) {
      nodes_[f.node].end = static_cast<uint32_t>(nodes_.size());
      stack.pop_back();
      continue;
    }
    const uint16_t d = n.depth;
    const uint32_t lo = f.next, hi_all = n.tok_hi, me = f.node;
    const char c = tokens_[sorted_[lo]][d];
    uint32_t j = lo;
    while (j < hi_all && tokens_[sorted_[j]][d] == c) ++j;
    f.next = j;
    open(lo, j, static_cast<uint16_t>(d + 1), static_cast<uint8_t>(c), me);
  }

  // Top-down: whether each node's prefix is valid UTF-8 so far; bottom-up: what lies below.
  std::vector<uint8_t> valid(nodes_.size(), 1);
  std::vector<Utf8Check> dec(nodes_.size());
  for (size_t i = 1; i < nodes_.size(); ++i) {
    dec[i] = dec[parent[i]];
    valid[i] = valid[parent[i]] && dec[i].step(nodes_[i].byte);
  }
  for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i].flags = kValidBelow | (valid[i] ? kValidPrefix : 0);
  for (size_t i = nodes_.size(); i-- > 1;) {
    Node& n = nodes_[i];
    Node& p = nodes_[parent[i]];
    p.below[0] |= n.below[0];
    p.below[1] |= n.below[1];
    if (n.byte < 128) p.below[n.byte >> 6] |= uint64_t{1} << (n.byte & 63);
    if (n.byte >= 128 || (n.flags & kNonAsciiBelow)) p.flags |= kNonAsciiBelow;
    if (!valid[i] || !(n.flags & kValidBelow)) p.flags &= static_cast<uint8_t>(~kValidBelow);
  }
}

bool TokenMasker::is_eos(int id) const {
  return id >= 0 && static_cast<size_t>(id) < is_eos_.size() && is_eos_[static_cast<size_t>(id)];
}

void TokenMasker::allowed_tokens(const GrammarState& st, uint32_t* mask) const {
  std::memset(mask, 0, mask_words() * sizeof(uint32_t));
  if (st.is_accepting()) {
    for (int id : eos_) mask[id >> 5] |= 1u << (id & 31);
  }
  Scratch& s = scratch();
  if (s.states.size() < max_depth_ + 1) {
    s.states.resize(max_depth_ + 1);
    s.loop_at.resize(max_depth_ + 1);
  }
  s.states[0] = st.stacks();
  auto bits_of = [&](const StackSet& set) {
    const LoopInfo& l = loop_info(st, set);
    LoopBits b;
    b.ascii[0] = l.ascii[0];
    b.ascii[1] = l.ascii[1];
    b.non_ascii = l.non_ascii;
    b.known = true;
    return b;
  };
  s.loop_at[0] = st.stacks().partial.remaining == 0 ? bits_of(st.stacks()) : LoopBits{};
  const Grammar& g = st.grammar();
  const uint32_t n = static_cast<uint32_t>(nodes_.size());
  for (uint32_t i = 1; i < n;) {
    const Node& node = nodes_[i];
    const StackSet& prev = s.states[node.depth - 1];
    const LoopBits& prev_loop = s.loop_at[node.depth - 1];
    StackSet& cur = s.states[node.depth];
    LoopBits& cur_loop = s.loop_at[node.depth];
    if (prev_loop.known && node.byte < 128 && ((prev_loop.ascii[node.byte >> 6] >> (node.byte & 63)) & 1)) {
      // A looping byte leads back to the state before it: no need to run the matcher. Inside
      // a string this is most of the walk, down to the tokens that hold a quote or a backslash.
      cur = prev;
      cur_loop = prev_loop;
    } else if (prev_loop.known && prev_loop.non_ascii && node.byte >= 0x80 && (node.flags & kValidPrefix) &&
               (node.flags & kValidBelow) && (node.below[0] & ~prev_loop.ascii[0]) == 0 &&
               (node.below[1] & ~prev_loop.ascii[1]) == 0) {
      // A code point starts here in a state every code point leads back to, and everything
      // below is valid UTF-8 made of looping bytes: the whole subtree is allowed, the tokens
      // that end inside the code point too (a partial code point that can complete is taken).
      // Without this, each two-byte prefix of a CJK character would run the matcher.
      set_range(mask, node.tok_lo, node.tok_hi);
      i = node.end;
      continue;
    } else {
      if (!advance(g, prev, node.byte, cur)) {
        i = node.end;
        continue;
      }
      cur_loop.known = false;
    }
    set_range(mask, node.tok_lo, node.tok_exact);
    if (node.tok_hi - node.tok_exact >= kLoopTestMin && cur.partial.remaining == 0) {
      if (!cur_loop.known) cur_loop = bits_of(cur);
      const bool ascii_ok =
          (node.below[0] & ~cur_loop.ascii[0]) == 0 && (node.below[1] & ~cur_loop.ascii[1]) == 0;
      const bool rest_ok = !(node.flags & kNonAsciiBelow) || (cur_loop.non_ascii && (node.flags & kValidBelow));
      if (ascii_ok && rest_ok) {
        set_range(mask, node.tok_exact, node.tok_hi);
        i = node.end;
        continue;
      }
    }
    ++i;
  }
}

std::vector<uint32_t> TokenMasker::allowed_tokens(const GrammarState& st) const {
  std::vector<uint32_t> mask(mask_words());
  allowed_tokens(st, mask.data());
  return mask;
}

void TokenMasker::allowed_tokens(const GrammarState& st, uint32_t* mask, MaskCache& cache) const {
  KESTREL_CHECK(cache.owner_ == nullptr || cache.owner_ == this, "a mask cache serves one token masker");
  cache.owner_ = this;
  const StackSet& set = st.stacks();
  const size_t h = set.hash();
  const size_t words = mask_words();
  ++cache.tick_;
  for (MaskCache::Entry& e : cache.entries_) {
    if (e.hash == h && e.g == st.grammar_ptr() && e.set.same_as(set)) {
      e.used = cache.tick_;
      ++cache.hits_;
      std::memcpy(mask, e.mask.data(), words * sizeof(uint32_t));
      return;
    }
  }
  ++cache.misses_;
  allowed_tokens(st, mask);
  if (cache.capacity_ == 0) return;
  MaskCache::Entry* slot;
  if (cache.entries_.size() < cache.capacity_) {
    slot = &cache.entries_.emplace_back();
  } else {
    slot = &*std::min_element(cache.entries_.begin(), cache.entries_.end(),
                              [](const MaskCache::Entry& a, const MaskCache::Entry& b) { return a.used < b.used; });
  }
  slot->g = st.grammar_ptr();
  slot->set = set;
  slot->hash = h;
  slot->used = cache.tick_;
  slot->mask.assign(mask, mask + words);
}

bool TokenMasker::accept_token(GrammarState& st, int id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size()) return false;
  if (is_eos(id)) return st.is_accepting();
  const std::string& b = tokens_[static_cast<size_t>(id)];
  return !b.empty() && st.accept_bytes(b);
}

}  // namespace kestrel::grammar
