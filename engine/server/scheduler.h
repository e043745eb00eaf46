// How `kestrel serve` shares one loaded model among many clients: --parallel slots (one Session
// each; their KV caches in the model's paged pool, or each its own), a bounded queue of requests
// waiting for a slot (and for KV blocks), and a turn lock.
//
// The sessions of one model must never run at once (models/model.h). The slots of the served
// model run their passes on the step batcher's one thread (engine/server/batcher.h: continuous
// batching); TurnTakingSession serves the draft model's sessions of --spec draft, whose steps
// take the draft model's TurnLock, handed on in the order it was asked for, so that N streams
// advance in turn rather than one starving the rest.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "models/model.h"

namespace kestrel::server {

// A fair lock: whoever asked first goes first (a ticket lock). A plain mutex lets the thread
// that just unlocked take it again before a woken waiter runs, so one stream would run many
// steps in a row.
class TurnLock {
 public:
  void lock();
  void unlock();
  // Tickets handed out so far (the holder's and the waiters'): lets a test order its threads.
  uint64_t tickets() {
    std::lock_guard<std::mutex> g(m_);
    return next_;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  uint64_t next_ = 0, serving_ = 0;
};

// A session that runs through a session of the model (the server's wrappers, which order the
// passes): its cache is the inner one's, and so is what a paged cache adopts and gives back.
// `cached` is the wrapper's own (generate_cached keeps it), set from the inner session's where
// that one says what its cache holds.
class SessionWrapper : public Session {
 public:
  explicit SessionWrapper(std::unique_ptr<Session> inner)
      : Session(inner->model()), inner_(std::move(inner)) {}
  int context_length() const override { return inner_->context_length(); }
  size_t cache_bytes() const override { return inner_->cache_bytes(); }
  bool adopt_prefix(std::span<const int> prompt) override {
    if (!inner_->adopt_prefix(prompt)) return false;
    cached = inner_->cached;
    return true;
  }
  bool release_kv() override {
    if (!inner_->release_kv()) return false;
    cached.clear();
    return true;
  }

 protected:
  std::unique_ptr<Session> inner_;
};

// A session whose every run through the model takes the model's turn. Greedy decoding runs
// step by step (each step one turn); device-chained runs are not offered, because a chained
// run keeps its next token in the model's shared state between steps, where another
// session's step would overwrite it (the host then samples, as on the CPU engine).
class TurnTakingSession final : public SessionWrapper {
 public:
  TurnTakingSession(std::unique_ptr<Session> inner, TurnLock& turn);
  void forward(const int* tokens, int n, int pos, float* logits, float* all_logits) override;
  int forward_argmax(int token, int pos) override;
  // A speculative verify pass is one turn: it leaves nothing in the model's state.
  void forward_argmax_rows(const int* tokens, int n, int pos, int* out) override;

 private:
  TurnLock& turn_;
};

// The slots and the queue in front of them. acquire() gives a free slot at once, or waits in
// line (first come, first served) while fewer than max_queue others wait, or refuses.
//
// With paged KV memory (Model::use_kv_pool) a request is also given its KV blocks' worth of
// the pool: the blocks its prompt and the most tokens it may generate can take. A request waits
// in line until the requests running leave it that many, so that a running request never finds
// the pool full (as TGI admits by --max-batch-total-tokens; vLLM instead admits on the prompt and
// preempts a request when the pool runs out). Blocks shared with other sequences are counted
// in full, so the reservation is an upper bound of what the pool gives.
class Slots {
 public:
  // `cached(i)` is what slot i's KV cache holds (Session::cached), read to pick the slot that
  // shares the longest prefix with a request's prompt. `kv_blocks`: the pool's blocks, 0
  // where each slot has a cache of its own.
  Slots(int n_slots, int max_queue, std::function<const std::vector<int>&(int)> cached,
        int64_t kv_blocks = 0);

  enum class Outcome { Granted, QueueFull, Cancelled, ShuttingDown };

  // A slot held, and the KV blocks reserved with it; both released when destroyed.
  class Lease {
   public:
    Lease(Slots& s, int slot, int64_t blocks) : s_(s), slot_(slot), blocks_(blocks) {}
    ~Lease() { s_.release(slot_, blocks_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    int slot() const { return slot_; }
    int64_t kv_blocks() const { return blocks_; }

   private:
    Slots& s_;
    int slot_;
    int64_t blocks_;
  };

  // Waits for a slot (and `kv_blocks` of the pool) for a request whose prompt is `ids`;
  // `cancelled` is polled while waiting (the client went away). Among free slots, the one whose
  // cache shares the longest prefix with `ids`, then the one idle longest. (With paged memory an
  // idle slot holds nothing, and any slot maps any cached prefix: the one idle longest.) kv_blocks must be
  // at most the pool's (a request that needs more would wait for ever).
  std::unique_ptr<Lease> acquire(const std::vector<int>& ids, const std::function<bool()>& cancelled,
                                 Outcome& outcome, int64_t kv_blocks = 0);

  // Refuses every waiting and later request (ShuttingDown).
  void shut_down();
  bool shutting_down() const;

  struct Status {
    int idle = 0, busy = 0, queued = 0;
    int64_t kv_blocks = 0, kv_reserved = 0;  // the pool's blocks and those reserved (0 0: none)
  };
  Status status() const;

 private:
  void release(int slot, int64_t kv_blocks);
  // -1 when none is free, or the pool cannot reserve kv_blocks more.
  int best_free_slot(const std::vector<int>& ids, int64_t kv_blocks) const;

  mutable std::mutex m_;
  std::condition_variable cv_;
  std::vector<bool> busy_;
  std::vector<uint64_t> released_at_;  // release counter value when each slot was last freed
  uint64_t releases_ = 0;
  std::deque<uint64_t> line_;  // tickets of the waiting requests, first come first
  uint64_t next_ticket_ = 0;
  int max_queue_;
  bool shutting_down_ = false;
  std::function<const std::vector<int>&(int)> cached_;
  int64_t kv_blocks_ = 0, kv_reserved_ = 0;
};

}  // namespace kestrel::server
