// The token masks. Three things make a mask cheap on a 150k-token vocabulary:
// - the trie: a byte the state refuses skips the whole subtree below it, and a prefix is
//   matched once for all the tokens that share it;
// - steps: from a state, most bytes lead to one same next state (inside a JSON string, every
//   ordinary character: back to the same state when the string is unbounded, to the next count
//   under maxLength). Per distinct state, which ASCII bytes do so (and whether every non-ASCII
//   code point does too) is found once by trying each byte, and remembered per thread. A byte
//   of that set copies the next state down the trie instead of running the matcher;
// - chains: following those next states gives, for each length d, the bytes that any string of
//   up to d code points may hold and still be taken. A subtree whose bytes all lie in the set
//   for its height is allowed whole, without being walked.
#include <algorithm>
#include <array>
#include <deque>
#include <cstring>
#include <memory>
#include <numeric>
#include <unordered_map>

#include "base/error.h"
#include "engine/grammar/token_masker.h"

namespace kestrel::grammar {

namespace {

// A subtree of fewer tokens than this is walked rather than tested along a chain (a chain step
// costs a try of every ASCII byte the first time a state is met). A loop needs no chain.
constexpr uint32_t kChainTestMin = 8;
// The longest chain followed: deeper subtrees are walked down to this height.
constexpr int kChainMax = 32;
// States remembered per thread; past this the memory is cleared before the next mask.
constexpr size_t kStepCacheMax = 65536;
// Below this many tokens under a node, its state is not looked up or remembered (each new
// state costs a few matcher runs; a full walk of a structural position meets thousands).
constexpr uint32_t kInternMin = 4;

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

// What any string of up to d code points from a state may hold: the ASCII bytes, and whether
// any non-ASCII code point.
struct Reach {
  uint64_t ascii[2] = {~uint64_t{0}, ~uint64_t{0}};
  bool non_ascii = true;
};

// One state met by the walk: the ASCII bytes that lead to its most common next state `succ`
// (the successor most bytes lead to), and whether every non-ASCII code point leads there too.
struct StepInfo {
  std::shared_ptr<const Grammar> g;
  StackSet set;
  size_t hash = 0;
  uint64_t ascii[2] = {0, 0};
  bool non_ascii = false;
  bool loops = false;  // succ is this state
  StackSet succ;
  int next = -2;       // succ's index: -2 not looked up yet, -1 no byte is taken
  std::vector<Reach> reach;  // reach[d - 1], for d up to its size
};

struct Scratch {
  std::vector<StackSet> states;
  std::vector<int> info_at;  // per depth: the StepInfo of states[depth], -1 unknown
  std::deque<StepInfo> infos;  // a deque: growing it moves nothing
  std::unordered_multimap<size_t, int> index;  // hash -> infos
  struct Group {
    StackSet set;
    uint64_t bytes[2];
    int n;
  };
  std::vector<Group> groups;
  std::vector<std::pair<uint64_t, std::array<uint64_t, 2>>> sigs;  // signature -> its bytes
  std::vector<int> chain;
  StackSet tmp, tmp2;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The index of the StepInfo of `set` (at a code point boundary), computed on first sight.
int intern(const std::shared_ptr<const Grammar>& gp, const StackSet& set) {
  Scratch& s = scratch();
  const size_t h = set.hash();
  for (auto [it, end] = s.index.equal_range(h); it != end; ++it) {
    const StepInfo& in = s.infos[static_cast<size_t>(it->second)];
    if (in.g == gp && in.set.same_as(set)) return it->second;
  }
  const Grammar& g = *gp;
  StepInfo info;
  info.g = gp;
  info.set = set;
  info.hash = h;
  s.groups.clear();
  // An ASCII byte at a code point boundary is a whole code point: where it leads depends only
  // on which stacks' tops take it. So the bytes are grouped by that signature first and the
  // matcher runs once per signature, not once per byte (up to 64 stacks; past that, per byte).
  s.sigs.clear();
  if (set.count <= 64) {
    uint64_t sig[128] = {};
    size_t off = 0;
    for (uint32_t i = 0; i < set.count; ++i) {
      const uint32_t len = set.words[off];
      if (len > 0) {
        const CharClass& c = g.classes()[g.elements()[set.words[off + len]].arg];
        for (uint32_t b = 0; b < 128; ++b)
          if ((c.ascii[b >> 6] >> (b & 63)) & 1) sig[b] |= uint64_t{1} << i;
      }
      off += len + 1;
    }
    for (uint32_t b = 0; b < 128; ++b) {
      if (!sig[b]) continue;
      auto it = std::find_if(s.sigs.begin(), s.sigs.end(), [&](const auto& x) { return x.first == sig[b]; });
      if (it == s.sigs.end()) {
        s.sigs.push_back({sig[b], {0, 0}});
        it = s.sigs.end() - 1;
      }
      it->second[b >> 6] |= uint64_t{1} << (b & 63);
    }
  } else {
    for (uint32_t b = 0; b < 128; ++b) s.sigs.push_back({b, {b < 64 ? uint64_t{1} << b : 0, b >= 64 ? uint64_t{1} << (b - 64) : 0}});
  }
  for (const auto& [sig, bytes] : s.sigs) {
    const uint32_t b = bytes[0] ? static_cast<uint32_t>(__builtin_ctzll(bytes[0])) : 64 + static_cast<uint32_t>(__builtin_ctzll(bytes[1]));
    if (!advance(g, set, static_cast<uint8_t>(b), s.tmp)) continue;
    Scratch::Group* grp = nullptr;
    for (auto& x : s.groups)
      if (x.set.same_as(s.tmp)) grp = &x;
    if (!grp) {
      s.groups.push_back({s.tmp, {0, 0}, 0});
      grp = &s.groups.back();
    }
    grp->bytes[0] |= bytes[0];
    grp->bytes[1] |= bytes[1];
    grp->n += __builtin_popcountll(bytes[0]) + __builtin_popcountll(bytes[1]);
  }
  if (s.groups.empty()) {
    info.next = -1;
  } else {
    const auto best = std::max_element(s.groups.begin(), s.groups.end(),
                                       [](const Scratch::Group& a, const Scratch::Group& b) { return a.n < b.n; });
    info.ascii[0] = best->bytes[0];
    info.ascii[1] = best->bytes[1];
    info.succ = best->set;
    info.loops = info.succ.same_as(set);
    // Every non-ASCII code point leads to succ when each stack's top takes all of them or
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
                     s.tmp2.same_as(info.succ);
  }
  if (info.loops) info.next = static_cast<int>(s.infos.size());
  s.infos.push_back(std::move(info));
  const int id = static_cast<int>(s.infos.size() - 1);
  s.index.emplace(h, id);
  return id;
}

// What any string of up to d (<= kChainMax) code points from infos[id]'s state may hold:
// the bytes common to the chain of next states, as long as the chain goes.
Reach reach(int id, int d) {
  Scratch& s = scratch();
  if (s.infos[static_cast<size_t>(id)].reach.size() >= static_cast<size_t>(d))
    return s.infos[static_cast<size_t>(id)].reach[static_cast<size_t>(d - 1)];
  // A power of two at least as long: the walk asks for many heights of one state, and a long
  // chain costs a new state per step the first time.
  const int want = d;
  d = 4;
  while (d < want) d *= 2;
  d = std::min(d, kChainMax);
  s.chain.assign(1, id);
  while (static_cast<int>(s.chain.size()) < d) {
    const int c = s.chain.back();
    if (s.infos[static_cast<size_t>(c)].loops || s.infos[static_cast<size_t>(c)].next == -1) break;
    if (s.infos[static_cast<size_t>(c)].next == -2) {
      const StackSet succ = s.infos[static_cast<size_t>(c)].succ;  // intern may move infos
      const int t = intern(s.infos[static_cast<size_t>(c)].g, succ);
      s.infos[static_cast<size_t>(c)].next = t;
    }
    s.chain.push_back(s.infos[static_cast<size_t>(c)].next);
  }
  std::vector<Reach> out(static_cast<size_t>(d));
  Reach acc;
  const StepInfo& last = s.infos[static_cast<size_t>(s.chain.back())];
  for (int j = 0; j < d; ++j) {
    if (j < static_cast<int>(s.chain.size()) || last.loops) {
      const StepInfo& in = j < static_cast<int>(s.chain.size()) ? s.infos[static_cast<size_t>(s.chain[static_cast<size_t>(j)])] : last;
      acc.ascii[0] &= in.ascii[0];
      acc.ascii[1] &= in.ascii[1];
      acc.non_ascii = acc.non_ascii && in.non_ascii;
    } else {  // the chain ended: past it nothing is known to be taken
      acc = Reach{{0, 0}, false};
    }
    out[static_cast<size_t>(j)] = acc;
  }
  s.infos[static_cast<size_t>(id)].reach = std::move(out);
  return s.infos[static_cast<size_t>(id)].reach[static_cast<size_t>(want - 1)];
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
    p.height = std::max<uint16_t>(p.height, static_cast<uint16_t>(n.height + 1));
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
  if (s.infos.size() > kStepCacheMax) {
    s.infos.clear();
    s.index.clear();
  }
  if (s.states.size() < max_depth_ + 1) {
    s.states.resize(max_depth_ + 1);
    s.info_at.resize(max_depth_ + 1);
  }
  const std::shared_ptr<const Grammar>& gp = st.grammar_ptr();
  const Grammar& g = *gp;
  s.states[0] = st.stacks();
  s.info_at[0] = st.stacks().partial.remaining == 0 ? intern(gp, st.stacks()) : -1;
  const uint32_t n = static_cast<uint32_t>(nodes_.size());
  for (uint32_t i = 1; i < n;) {
    const Node& node = nodes_[i];
    const StackSet& prev = s.states[node.depth - 1];
    StackSet& cur = s.states[node.depth];
    const int pi = s.info_at[node.depth - 1];
    int ci = -1;
    if (pi >= 0) {
      // The whole subtree from the state before this node: its edge and everything below.
      uint64_t need[2] = {node.below[0], node.below[1]};
      if (node.byte < 128) need[node.byte >> 6] |= uint64_t{1} << (node.byte & 63);
      const bool non_ascii = node.byte >= 128 || (node.flags & kNonAsciiBelow);
      const StepInfo& p = s.infos[static_cast<size_t>(pi)];
      // The first step's bytes bound every longer chain's: a cheap test before the chain.
      if ((need[0] & ~p.ascii[0]) == 0 && (need[1] & ~p.ascii[1]) == 0 &&
          (!non_ascii || (p.non_ascii && (node.flags & kValidPrefix) && (node.flags & kValidBelow)))) {
        const int d = node.height + 1;
        bool whole = p.loops || d == 1;
        if (!whole && d <= kChainMax && node.tok_hi - node.tok_lo >= kChainTestMin) {
          const Reach r = reach(pi, d);
          whole = (need[0] & ~r.ascii[0]) == 0 && (need[1] & ~r.ascii[1]) == 0 && (!non_ascii || r.non_ascii);
        }
        if (whole) {
          set_range(mask, node.tok_lo, node.tok_hi);
          i = node.end;
          continue;
        }
      }
      const StepInfo& q = s.infos[static_cast<size_t>(pi)];  // reach() may have moved infos
      if (node.byte < 128 && ((q.ascii[node.byte >> 6] >> (node.byte & 63)) & 1)) {
        // The byte leads to the state's usual next state: no need to run the matcher.
        cur = q.succ;
        ci = q.next >= 0 ? q.next : -1;
      } else if (!advance(g, prev, node.byte, cur)) {
        i = node.end;
        continue;
      }
    } else if (!advance(g, prev, node.byte, cur)) {
      i = node.end;
      continue;
    }
    set_range(mask, node.tok_lo, node.tok_exact);
    // Small subtrees are walked: a state is worth remembering only above a few tokens.
    if (ci < 0 && node.tok_hi - node.tok_exact >= kInternMin && cur.partial.remaining == 0) ci = intern(gp, cur);
    s.info_at[node.depth] = ci;
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
