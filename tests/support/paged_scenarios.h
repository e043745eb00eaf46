// Scenarios of paged KV memory (Model::use_kv_pool) that run the same on either engine: the
// CPU's tests (tests/models/test_batch.cpp) and the GPU's (tests/models/test_kv_pool_cuda.cpp)
// call them and hold what they return to their own engine's tolerance.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "models/model.h"

namespace kestrel::test {

// The logits of a prompt's last row and of `steps` greedy decode steps after it (one-token
// forwards: on the GPU, the session's decode graphs), from position pos0 of the prompt
// (earlier positions already in the cache).
inline std::vector<std::vector<float>> greedy_logits(Session& s, const std::vector<int>& prompt,
                                                     int steps, int pos0 = 0) {
  const int vocab = s.config().vocab;
  std::vector<std::vector<float>> out;
  std::vector<float> logits(vocab);
  s.forward(prompt.data() + pos0, (int)prompt.size() - pos0, pos0, logits.data(), nullptr);
  out.push_back(logits);
  int pos = (int)prompt.size();
  for (int k = 0; k < steps; ++k) {
    const int next = (int)(std::max_element(logits.begin(), logits.end()) - logits.begin());
    s.forward(&next, 1, pos++, logits.data(), nullptr);
    out.push_back(logits);
  }
  return out;
}

// A prompt that begins with another sequence's header (a system prompt, say) reuses its whole
// blocks: `first` runs the header (40 ids: two whole blocks and a partial one) and 3 greedy
// steps, `second` adopts what it can of `prompt` (header + 9 ids) and decodes `steps` greedy
// steps from there; `alone`, a session with a cache of its own, runs the same prompt whole.
// `paged` runs with a pool of at least 64 blocks.
struct PrefixReuse {
  std::vector<int> cached;  // the ids second adopted (want: the header's first 32)
  int64_t held = 0;         // the pool's held blocks then (want 3: second shares two of first's)
  std::vector<std::vector<float>> got, want;  // second's logits, alone's
};
inline PrefixReuse prefix_reuse(Model& paged, Session& alone, const std::vector<int>& header,
                                const std::vector<int>& prompt, int steps) {
  PrefixReuse r;
  auto first = paged.new_session(128);
  greedy_logits(*first, header, 3);
  auto second = paged.new_session(128);
  second->adopt_prefix(prompt);
  r.cached = second->cached;
  r.held = paged.kv_pool_use().held;
  r.got = greedy_logits(*second, prompt, steps, (int)r.cached.size());
  r.want = greedy_logits(alone, prompt, steps);
  return r;
}

// A sequence that writes into a block it shares (a rerun from inside the shared prefix) writes
// into a copy of all of it: `a` runs `prompt` (48 ids, three whole blocks) and one step; `b`
// adopts prompt + one id (the three blocks), then writes another id at position 20, inside a
// block it shares with `a`, and steps at 21; `lone`, a session with a cache of its own, runs
// b's ids. `paged` runs with a pool of at least 16 blocks.
struct CopyOnWrite {
  size_t cached = 0;            // what b adopted (want 48)
  int64_t held_shared = 0;      // held blocks after the adoption (want 4: a's 49 positions)
  int64_t held_written = 0;     // after b's write (want 5: b's copy of block 1)
  bool a_unchanged = false;     // a's step again, bit for bit what it was before b's write
  std::vector<float> b_step, lone_step;  // b's step at 21 (reading 16 .. 20 of its copy), lone's
};
inline CopyOnWrite copy_on_write(Model& paged, Session& lone, std::vector<int> prompt) {
  CopyOnWrite r;
  const int vocab = paged.config().vocab;
  auto a = paged.new_session(128);
  std::vector<float> before(vocab), after(vocab), scratch(vocab);
  a->forward(prompt.data(), 48, 0, scratch.data(), nullptr);
  a->forward(&prompt[5], 1, 48, before.data(), nullptr);  // a's next step

  auto b = paged.new_session(128);
  prompt.push_back(3);
  b->adopt_prefix(prompt);
  r.cached = b->cached.size();
  r.held_shared = paged.kv_pool_use().held;
  const int other = (prompt[20] + 1) % vocab;
  b->forward(&other, 1, 20, scratch.data(), nullptr);  // position 20: a block shared with a
  r.held_written = paged.kv_pool_use().held;
  a->forward(&prompt[5], 1, 48, after.data(), nullptr);
  r.a_unchanged = std::memcmp(before.data(), after.data(), vocab * sizeof(float)) == 0;

  r.b_step.resize(vocab);
  b->forward(&prompt[7], 1, 21, r.b_step.data(), nullptr);
  r.lone_step.resize(vocab);
  lone.forward(prompt.data(), 20, 0, scratch.data(), nullptr);
  lone.forward(&other, 1, 20, scratch.data(), nullptr);
  lone.forward(&prompt[7], 1, 21, r.lone_step.data(), nullptr);
  return r;
}

}  // namespace kestrel::test
